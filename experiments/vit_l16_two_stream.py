"""The paper's random-order study: two-stream ViT-L/16, MSE, raster vs random order.

Run (ImageNet prepared for TFDS, see README):
  python -m darl_jax.main --config=experiments/vit_l16_two_stream.py:order=random --workdir=gs://<bucket>/two_stream_random
  python -m darl_jax.main --config=experiments/vit_l16_two_stream.py:order=raster --workdir=gs://<bucket>/two_stream_raster

Model (paper section "Random Ordering", appendix "Two-Stream Architecture"):
the causal ViT-L/16 content stream plus an XLNet-style query stream with
learnable query tokens and 2D RoPE at the position of the next patch; a
linear decoder on the query stream, MSE. ``order=random`` draws a new patch
order for every example and step; ``order=raster`` is the fixed-order control.
Everything else is the pretraining recipe of experiments/vit_l16_mse.py.

Expect (paper Figure "random order", fine-tuned 50 epochs with fixed raster
order): random order lags raster at short schedules and catches up with
longer training, with no final advantage.

Args: order (random | raster), epochs (pretraining length; the figure varies it).
"""

from darl_jax import config_lib


def get_config(arg=None):
  args = config_lib.parse_arg(arg, order="random", epochs=800.0)
  if args.order not in ("random", "raster"):
    raise ValueError(f"order must be random or raster, got {args.order!r}")
  c = config_lib.imagenet_pretrain_config("L/16", "mse")
  c.total_epochs = args.epochs
  c.model.two_stream = True
  c.model.ordering = args.order
  # Batch 4096 on one GPU or a pod alike: the largest microbatch that fits,
  # from memory.py's estimate before anything compiles (train/fit.py).
  c.microbatch_size = -1
  return c
