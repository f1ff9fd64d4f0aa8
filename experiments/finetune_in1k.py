"""Fine-tune a DARL-pretrained ViT on ImageNet (paper table "ImageNet Fine-tuning Hyperparameters").

Run (ImageNet prepared for TFDS, see README):
  python -m darl_jax.main --config=experiments/finetune_in1k.py:init=gs://<bucket>/darl_vit_l16_diff \
      --workdir=gs://<bucket>/darl_vit_l16_diff_ft
Args (``:variant=L/16,epochs=90,init=<dir>,res=224,ema=0``):
  variant  B/16 | L/16 | H/14 (must match the pretraining run)
  epochs   50 | 90 (L: drop path 0.0 for 50, 0.1 for 90)
  init     the pretraining workdir (or a checkpoints/<step> directory)
  res      fine-tuning resolution; positions are interpolated from the
           pretraining 224 (e.g. res=384 for the paper's 224 -> 384 rows)
  ema      EMA decay of the weights, evaluated with (0 = off)
Smoke run of the same config: --config.total_steps=10 --config.batch_size=64

Recipe: full attention, last-token read-out, RandAug(9, 0.5) (host), mixup
0.8 / cutmix 1.0 / label smoothing 0.1 (device), AdamW (0.9, 0.95), weight
decay 0.05, layer-wise lr decay 0.75, batch 4096, cosine, 5 warm-up epochs;
lr 1e-3 (H: 3e-3) as the peak rate; drop path B 0.0, L 0.0 (50 ep) / 0.1
(90 ep), H 0.2. On GPUs the default kernels.attention=auto runs cuDNN's fused
kernel where it takes the shape.

Expect (paper's fine-tuning table, 800 pretraining epochs, 90 fine-tuning
epochs), ImageNet top-1: ViT-B/16 MSE 82.7, diffusion 81.9; ViT-L/16 MSE
84.7, diffusion 84.9; ViT-H/14 MSE 85.5, diffusion 85.9.
"""

from darl_jax import config_lib
from darl_jax.models import vit as vit_lib
from darl_jax.train.trainers import finetune

# variant -> (peak lr, {epochs: drop path}); paper table.
RECIPES = {"B/16": (1e-3, {50: 0.0, 90: 0.0}),
           "L/16": (1e-3, {50: 0.0, 90: 0.1}),
           "H/14": (3e-3, {50: 0.2, 90: 0.2})}


def get_config(arg=None):
  args = config_lib.parse_arg(arg, variant="L/16", epochs=90, init="", res=224, ema=0.0)
  if args.variant not in RECIPES:
    raise ValueError(f"variant must be one of {', '.join(RECIPES)}, got {args.variant!r}")
  lr, drop_paths = RECIPES[args.variant]
  if args.epochs not in drop_paths:
    raise ValueError(f"epochs must be 50 or 90 (the paper's schedules), got {args.epochs}")
  c = finetune.finetune_config()
  c.init_from = args.init
  c.batch_size = 4096
  c.total_epochs = float(args.epochs)
  c.microbatch_size = -1      # the largest microbatch that fits (train/aot.py)
  c.log_every_steps = 100
  c.checkpoint_every_steps = 2000
  c.eval_every_steps = 2000
  c.ema_decay = args.ema
  c.data.update(name="imagenet2012", tfds_name="imagenet2012", image_size=args.res,
                channels=3, augment="spatial", train_split="train", eval_split="validation")
  c.model.update(variant=args.variant, image_size=args.res, reference_image_size=224,
                 channels=3, posenc="rope2d", causal=False, dtype="bfloat16",
                 drop_path=drop_paths[args.epochs])
  c.head.update(readout="last", sos=True)
  depth = vit_lib.parse_variant(args.variant)[0].depth
  c.optim.update(base_lr=lr, lr_scaling=False, layer_decay=0.75, num_layers=depth,
                 warmup_epochs=5.0, weight_decay=0.05)
  if args.variant == "H/14":
    c.sharding = "fsdp"
    c.mesh.update(data=1, fsdp=-1)
  return c
