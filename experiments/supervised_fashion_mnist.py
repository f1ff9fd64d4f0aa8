"""The supervised baseline on Fashion-MNIST: the same small ViT from scratch.

Run:
  python -m darl_jax.main --config=experiments/supervised_fashion_mnist.py \
      --workdir=workdirs/supervised_fashion_mnist
Args: posenc (default rope2d), causal (default False), steps (default 600).

The paper's supervised table (drop path 0.2, RandAug(9, 0.5), mixup 0.8,
cutmix 1.0, label smoothing 0.1, AdamW (0.9, 0.95), base lr 1e-4 x
batch/256, weight decay 0.3, 20 warm-up epochs) at CPU scale: the ViT of
experiments/fashion_mnist_diff.py, batch 128, base lr 1e-3 x batch / 256 (a
200-epoch lr of 1e-4 is far too low for a few hundred steps), drop path
0.1, 10% warm-up.
"""

from darl_jax import config_lib
from darl_jax.train.trainers import supervised


def get_config(arg=None):
  args = config_lib.parse_arg(arg, posenc="rope2d", causal=False, steps=600)
  c = supervised.supervised_config()
  c.total_steps = args.steps
  c.batch_size = 128
  c.log_every_steps = 25
  c.eval_every_steps = max(args.steps // 3, 1)
  c.checkpoint_every_steps = 500
  config_lib.fashion_mnist_setup(c, augment="spatial")
  c.model.update(posenc=args.posenc, causal=args.causal, drop_path=0.1)
  c.optim.update(base_lr=1e-3, warmup_steps=max(args.steps // 10, 1))
  return c
