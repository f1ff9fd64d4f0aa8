"""The supervised ViT baseline on ImageNet (appendix "Supervised Baseline").

Run:
  python -m darl_jax.main --config=experiments/supervised_in1k.py:posenc=rope2d,causal=False \
      --workdir=gs://<bucket>/supervised_l16_rope2d
Args: variant (default L/16), posenc (none | sincos2d | learned | rope1d |
rope2d), causal (the paper's Table "positional encodings" ablates both).

Recipe (table "ImageNet Supervised Training Hyperparameters"): Xavier-uniform
init, drop path 0.2, RandAug(9, 0.5), mixup 0.8, cutmix 1.0, label smoothing
0.1, AdamW (0.9, 0.95), base lr 1e-4 x batch / 256, weight decay 0.3, batch
4096, cosine with 20 warm-up epochs, 200 epochs, mean-pool + linear head, no
EMA.

Expect (paper's positional-encoding table, ImageNet top-1): non-causal 2D
RoPE 82.7, causal 2D RoPE 81.8 (1D RoPE 82.8 / 81.7; the causal penalty is
about 1 point).
"""

from darl_jax import config_lib
from darl_jax.train.trainers import supervised


def get_config(arg=None):
  args = config_lib.parse_arg(arg, variant="L/16", posenc="rope2d", causal=False)
  c = supervised.supervised_config()
  c.log_every_steps = 100
  c.checkpoint_every_steps = 2000
  c.eval_every_steps = 2000
  c.data.update(name="imagenet2012", tfds_name="imagenet2012", image_size=224, channels=3,
                augment="spatial", train_split="train", eval_split="validation")
  c.model.update(variant=args.variant, image_size=224, channels=3, posenc=args.posenc,
                 causal=args.causal, dtype="bfloat16", drop_path=0.2)
  if args.variant.startswith("H/"):
    c.sharding = "fsdp"
    c.mesh.update(data=1, fsdp=-1)
  return c
