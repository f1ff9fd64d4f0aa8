"""Two-stream DARL on Fashion-MNIST: random vs raster order at small scale.

Run:
  python -m darl_jax.main --config=experiments/fashion_mnist_two_stream.py:order=random --workdir=/tmp/ts_random
  python -m darl_jax.main --config=experiments/fashion_mnist_two_stream.py:order=raster --workdir=/tmp/ts_raster

The model of experiments/fashion_mnist_mse.py (width 128, 4 blocks, 7x7
patches of 4x4 pixels, 2D RoPE, linear decoder, MSE) with the XLNet-style
query stream. ``order=random`` trains on a fresh patch order per example and
step; ``order=raster`` on the fixed raster order.

Expect (2 CPU cores, about 6 minutes each): both losses fall; random order
ends higher at equal steps (predicting a patch anywhere in the image from an
arbitrary subset is harder than the next raster patch), the paper's "random
order needs longer training". Fine-tune either with
experiments/fashion_mnist_finetune.py (raster order) to compare downstream.

Args: order (random | raster), steps (total_steps).
"""

from darl_jax import config_lib


def get_config(arg=None):
  args = config_lib.parse_arg(arg, order="random", steps=800)
  if args.order not in ("random", "raster"):
    raise ValueError(f"order must be random or raster, got {args.order!r}")
  c = config_lib.fashion_mnist_pretrain_config(args.steps)
  c.eval_every_steps = 400
  c.model.update(two_stream=True, ordering=args.order)
  c.decoder.update(kind="linear")
  c.loss.update(kind="mse")
  return c
