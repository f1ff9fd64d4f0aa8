"""DARL with the MSE objective on Fashion-MNIST, small enough for 2 CPU cores.

Run:
  python -m darl_jax.main --config=experiments/fashion_mnist_mse.py --workdir=/tmp/darl_fmnist_mse

Model: a causal ViT (width 128, 4 blocks, 4 heads) over 7x7 patches of 4x4
pixels, 2D RoPE, a linear patch decoder. Data: Fashion-MNIST from Debian's
dataset-fashion-mnist (no download), 55k train / 5k validation.

Expect (2 CPU cores, about 5 minutes): the training loss (per-pixel MSE on
[-1, 1] pixels) falls from about 3 over the first steps to about 0.13 by
step 200 and lower after; the workdir holds
config.json, metrics.jsonl, tensorboard/, checkpoints/ and predictions.png
(left: originals, right: teacher-forced next-patch predictions).

Args (``--config=...py:steps=200,probe``): steps (total_steps); probe: a
ridge probe on frozen features at every evaluation, logged as
``val_probe_accuracy`` (config.probe_eval).
"""

from darl_jax import config_lib


def get_config(arg=None):
  args = config_lib.parse_arg(arg, steps=500, probe=False)
  c = config_lib.fashion_mnist_pretrain_config(args.steps)
  c.decoder.update(kind="linear")
  c.loss.update(kind="mse")
  c.probe_eval.enabled = args.probe
  return c
