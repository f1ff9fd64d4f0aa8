"""Attentive probe (AIM's evaluation) on the Fashion-MNIST DARL model (experiments/fashion_mnist_diff.py).

Run (after the pretraining job wrote workdirs/fashion_mnist_diff):
  python -m darl_jax.main --config=experiments/fashion_mnist_attentive_probe.py:init=workdirs/fashion_mnist_diff \
      --workdir=workdirs/fashion_mnist_attentive_probe
Without ``init`` the probe reads a random backbone (the baseline).
Args: init, steps (default 300), blocks (block indices joined by "+",
default "-1": the last block; "1+3" reads blocks 1 and 3, their tokens
concatenated), tiny (scikit-learn's 8x8 digits and the tiny model of
tests/tiny_config.py, a few steps: the tests' smoke run).

Recipe: the frozen causal backbone of the linear probe
(experiments/fashion_mnist_linear_probe.py); one learned query attends over
the chosen block's 49 patch tokens with the backbone's 4 heads, BatchNorm
without affine and a linear classifier; AdamW at 1e-3 (batch 256, no lr
scaling), weight decay 0.05, 10% warm-up then cosine, label smoothing 0.1,
no augmentation. attentive_probe.json in the workdir.

A grid of settings in the same frozen pass, chosen on held-out training
rows: ``--config.probe.learning_rates=...`` (and ``weight_decays``),
docs/PROBES.md.

Expect: on the fmnist_long study scale's model (width 256, 6 blocks, 40
epochs of diffusion pretraining; docs/STUDIES.md), 10 epochs of this recipe
give 90.7 +- 0.2 % (block 5, 3 seeds) against 87.9 +- 0.3 % for the best
block's linear probe on the same checkpoints, and 82.0 on a random backbone.
With this file's 4-block model and 300 steps: not measured; mean pooling
is one of the poolings the query can learn (equal attention weights), so it
should reach at least the linear probe's accuracy.
"""

from darl_jax import config_lib
from darl_jax.train.trainers import attentive_probe


def get_config(arg=None):
  args = config_lib.parse_arg(arg, init="", steps=300, blocks="-1", tiny=False)
  c = attentive_probe.attentive_probe_config()
  c.init_from = args.init
  c.probe.blocks = tuple(int(b) for b in args.blocks.split("+"))
  c.total_steps = args.steps
  c.batch_size = 256
  c.log_every_steps = 25
  c.eval_every_steps = max(args.steps // 3, 1)
  c.checkpoint_every_steps = 500
  # The checkpoint's architecture (experiments/fashion_mnist_diff.py).
  config_lib.fashion_mnist_setup(c, augment="none")
  c.model.update(causal=True, drop_path=0.0)
  c.optim.update(base_lr=1e-3, lr_scaling=False, warmup_steps=max(args.steps // 10, 1))
  if args.tiny:
    # The architecture of tests/tiny_config.py's pretraining run.
    c.update(batch_size=16, log_every_steps=1, eval_max_batches=2, tensorboard=False,
             eval_every_steps=max(args.steps // 2, 1), checkpoint_every_steps=args.steps)
    c.data.update(name="digits", image_size=8, channels=1, num_workers=0)
    c.model.update(variant="mu/2", width=0, depth=0, num_heads=0, mlp_dim=0, image_size=8,
                   channels=1, rope_max_wavelength=100.0)
  return c
