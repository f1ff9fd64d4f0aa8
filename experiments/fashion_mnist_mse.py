"""DARL with the MSE objective on Fashion-MNIST, small enough for 2 CPU cores.

Run:
  python -m darl_jax.main --config=experiments/fashion_mnist_mse.py --workdir=/tmp/darl_fmnist_mse

Model: a causal ViT (width 128, 4 blocks, 4 heads) over 7x7 patches of 4x4
pixels, 2D RoPE, a linear patch decoder. Data: Fashion-MNIST from Debian's
dataset-fashion-mnist (no download), 55k train / 5k validation.

Expect (2 CPU cores, about 5 minutes): the training loss (per-pixel MSE on
[-1, 1] pixels) falls from about 0.6 to below 0.15; the workdir holds
config.json, metrics.jsonl, tensorboard/, checkpoints/ and predictions.png
(left: originals, right: teacher-forced next-patch predictions).

Args (``--config=...py:steps=200``): steps (total_steps).
"""

from darl_jax import config_lib


def get_config(arg=None):
  args = config_lib.parse_arg(arg, steps=800)
  c = config_lib.pretrain_config()
  c.total_steps = args.steps
  c.batch_size = 128
  c.log_every_steps = 50
  c.checkpoint_every_steps = 500
  c.eval_every_steps = 500
  c.eval_max_batches = 10
  c.data.update(name="fashion_mnist", image_size=28, channels=1, augment="none")
  c.model.update(variant="Ti/4", width=128, depth=4, num_heads=4, mlp_dim=512,
                 image_size=28, channels=1, posenc="rope2d", rope_max_wavelength=100.0)
  # lr 1e-3 (base 1e-3 x 128/256 = 5e-4 peak): short runs want a larger lr than
  # the paper's 1.5e-4, which is tuned for 800 ImageNet epochs.
  c.optim.update(base_lr=1e-3, warmup_steps=100, weight_decay=0.05)
  c.decoder.update(kind="linear")
  c.loss.update(kind="mse")
  return c
