"""DARL with the diffusion objective on Fashion-MNIST: the README's main job.

Run:
  python -m darl_jax.main --config=experiments/fashion_mnist_diff.py --workdir=/tmp/darl_fmnist_diff

Model: a causal ViT (width 128, 4 blocks, 4 heads) over 7x7 patches of 4x4
pixels with 2D RoPE, and a one-block Transformer denoising patch decoder.
gamma ~ Beta(1, 1) with gamma conditioning (at this scale a uniform schedule
gives a readable picture; the paper's ImageNet choice is Beta(0.03, 1), see
experiments/vit_l16_diff.py). Data: Fashion-MNIST from Debian's
dataset-fashion-mnist (no download).

Expect (2 CPU cores, under 10 minutes): the loss (x0 MSE averaged over gamma)
falls from about 2.5 over the first steps to about 0.12 by step 150 and
lower after; val_loss (at a fixed gamma grid) falls with
it; metrics.jsonl has loss_gamma_bin_XX (low gamma = heavy noise = high loss);
predictions.png shows originals, then two teacher-forced samples from the
reverse diffusion process (100 steps) for each next patch.

Args (``--config=...py:steps=200,probe``): steps (total_steps); probe: a
ridge probe on frozen features at every evaluation, logged as
``val_probe_accuracy`` (config.probe_eval).
"""

from darl_jax import config_lib


def get_config(arg=None):
  args = config_lib.parse_arg(arg, steps=500, probe=False)
  c = config_lib.fashion_mnist_pretrain_config(args.steps)
  c.decoder.update(kind="transformer", depth=1, gamma_conditioning=True)
  c.loss.update(kind="diffusion", noise_a=1.0, noise_b=1.0, predict="x0")
  c.probe_eval.enabled = args.probe
  return c
