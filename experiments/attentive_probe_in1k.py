"""Attentive probe (AIM's evaluation) on a DARL-pretrained ViT, ImageNet, over a grid.

Run:
  python -m darl_jax.main --config=experiments/attentive_probe_in1k.py:init=gs://<bucket>/darl_vit_h14_diff,variant=H/14 \
      --workdir=gs://<bucket>/darl_vit_h14_diff_attentive
Args: variant (B/16 | L/16 | H/14, must match the pretraining run), init,
blocks (block indices joined by "+", negative from the end; default "-1",
the last block; "-8+-1" reads two blocks, their tokens concatenated).

Recipe (train/trainers/attentive_probe.py): the frozen causal backbone of the linear
probe (experiments/linear_probe_in1k.py), one learned query attending over
the chosen blocks' patch tokens with the backbone's heads, BatchNorm without
affine and a linear classifier; AdamW (0.9, 0.999), cosine with 5 warm-up
epochs, 90 epochs at batch 1024, label smoothing 0.1, spatial augmentation.

By default a grid, as AIM (ml-l3m's probe_hparam_search) evaluates: base
learning rates 3e-4, 1e-3, 3e-3 (x batch / 256) x weight decays 0.05, 0.3,
six probes trained in one frozen pass and chosen on held-out training rows
(min(2%, 10000); train/probe_grid.py). The held-out rows need an
index-addressable source: imagenet2012 prepared as ArrayRecord (``tfds build
imagenet2012 --file_format=array_record``) or an image folder. One setting:
--config.probe.learning_rates='(1e-3,)' --config.probe.weight_decays='(0.05,)'.
docs/PROBES.md gives the grid's memory and step time at ViT-H/14.

Writes attentive_probe.json (the chosen setting, its held-out and
validation accuracy, every setting's). Expect: not measured at ImageNet
scale here.
"""

from darl_jax import config_lib
from darl_jax.train.trainers import attentive_probe

LEARNING_RATES = (3e-4, 1e-3, 3e-3)
WEIGHT_DECAYS = (0.05, 0.3)


def get_config(arg=None):
  args = config_lib.parse_arg(arg, variant="L/16", init="", blocks="-1")
  c = attentive_probe.attentive_probe_config()
  c.init_from = args.init
  c.probe.blocks = tuple(int(b) for b in args.blocks.split("+"))
  c.probe.learning_rates = LEARNING_RATES
  c.probe.weight_decays = WEIGHT_DECAYS
  c.batch_size = 1024
  c.total_epochs = 90.0
  c.log_every_steps = 50
  c.checkpoint_every_steps = 1000
  c.eval_every_steps = 5000
  config_lib.imagenet_frozen_backbone(c, args.variant, augment="spatial")
  if args.variant.startswith("H/"):     # 632M parameters: sharded over every device
    c.sharding = "fsdp"
    c.mesh.update(data=1, fsdp=-1)
  return c
