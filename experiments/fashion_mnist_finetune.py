"""Fine-tune the Fashion-MNIST DARL model (experiments/fashion_mnist_diff.py) for classification.

Run (after the pretraining job wrote workdirs/fashion_mnist_diff):
  python -m darl_jax.main --config=experiments/fashion_mnist_finetune.py:init=workdirs/fashion_mnist_diff \
      --workdir=workdirs/fashion_mnist_finetune
Without ``init`` the same model trains from random initialisation (the
baseline at equal budget). Args: init, steps (default 300), light (drop
RandAugment / mixup / cutmix / random crops: better for runs of a few hundred
steps, where the heavy recipe has no time to pay off).

Model: the pretraining backbone (width 128, 4 blocks, 4 heads, 4x4 patches,
2D RoPE) with full attention and the last-token read-out. Recipe: the paper's
fine-tuning table scaled to CPU minutes: AdamW (0.9, 0.95) at peak lr 1e-3,
weight decay 0.05, layer-wise lr decay 0.75, 10% warm-up then cosine, label
smoothing 0.1, RandAug(9, 0.5) + mixup 0.8 + cutmix 1.0 unless ``light``.

Expect (docs/RESULTS.md, "Downstream at the minute scale", one seed): from
600 steps of diffusion pretraining at batch 256, 300 ``light`` steps give
84.0% (83.0% from random initialisation at the same budget); the heavy
recipe gives 61.5% in 300 steps. A larger model fine-tuned for 20 epochs
reaches 92.8% (docs/STUDIES.md, fmnist_long).
"""

from darl_jax import config_lib
from darl_jax.train.trainers import finetune


def get_config(arg=None):
  args = config_lib.parse_arg(arg, init="", steps=300, light=False)
  c = finetune.finetune_config()
  c.init_from = args.init
  c.total_steps = args.steps
  c.batch_size = 128
  c.log_every_steps = 25
  c.eval_every_steps = max(args.steps // 3, 1)
  c.checkpoint_every_steps = 500
  # The checkpoint's architecture (experiments/fashion_mnist_diff.py).
  config_lib.fashion_mnist_setup(c, augment="spatial")
  c.model.update(causal=False, drop_path=0.0)
  c.optim.update(base_lr=1e-3, lr_scaling=False, layer_decay=0.75, num_layers=4,
                 warmup_steps=max(args.steps // 10, 1), weight_decay=0.05)
  if args.light:
    c.data.augment = "none"
    c.randaugment.num_ops = 0
    c.mixup.update(mixup_alpha=0.0, cutmix_alpha=0.0)
  return c
