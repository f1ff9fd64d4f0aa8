"""Linear probes on every block of the Fashion-MNIST DARL model (experiments/fashion_mnist_diff.py).

Run (after the pretraining job wrote workdirs/fashion_mnist_diff):
  python -m darl_jax.main --config=experiments/fashion_mnist_linear_probe.py:init=workdirs/fashion_mnist_diff \
      --workdir=workdirs/fashion_mnist_linear_probe
Without ``init`` the probes read a random backbone (the baseline).
Args: init, steps (default 300).

Recipe: the paper's linear evaluation scaled to CPU minutes: frozen causal
backbone, mean pooling, BatchNorm without affine, LARS (momentum 0.9, no
weight decay), label smoothing 0.1, 10% warm-up then cosine, no
augmentation (28x28 crops would dominate a 300-step run). One probe per
block; probe_accuracy.json / .png in the workdir.

A grid of settings in the same frozen pass, chosen on held-out training
rows: ``--config.probe.learning_rates=...`` (and ``weight_decays``, ``poolings``),
docs/PROBES.md.

Learning rate: the paper's peak rate, 0.1 x 16384 / 256 = 6.4, kept at
batch 256 rather than rescaled to 0.1: LARS moves a weight matrix by at most
lr x 1e-3 of its norm per step, and a 300-step run needs the full rate (see
darl_jax/train/trainers/linear_probe.py).

Expect (docs/RESULTS.md, "Downstream at the minute scale", one seed): best
block 78.0% after 600 steps of diffusion pretraining at batch 256 (MSE 74.7%,
random backbone 66.8%, a logistic regression on the raw pixels 85.9%); 87.9%
after 40 epochs of a larger model (docs/STUDIES.md, fmnist_long).
"""

from darl_jax import config_lib
from darl_jax.train.trainers import linear_probe


def get_config(arg=None):
  args = config_lib.parse_arg(arg, init="", steps=300)
  c = linear_probe.linear_probe_config()
  c.init_from = args.init
  c.total_steps = args.steps
  c.batch_size = 256
  c.log_every_steps = 25
  c.eval_every_steps = max(args.steps // 3, 1)
  c.checkpoint_every_steps = 500
  # The checkpoint's architecture (experiments/fashion_mnist_diff.py).
  config_lib.fashion_mnist_setup(c, augment="none")
  c.model.update(causal=True, drop_path=0.0)
  c.optim.update(base_lr=6.4, lr_scaling=False, warmup_steps=max(args.steps // 10, 1))
  return c
