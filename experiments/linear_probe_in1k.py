"""Linear probes on every block of a DARL-pretrained ViT, ImageNet (appendix "Linear Evaluation").

Run:
  python -m darl_jax.main --config=experiments/linear_probe_in1k.py:init=gs://<bucket>/darl_vit_l16_diff \
      --workdir=gs://<bucket>/darl_vit_l16_diff_linear
Args: variant (B/16 | L/16 | H/14, must match the pretraining run), init.

Recipe (table "ImageNet Linear Evaluation Hyperparameters"): frozen backbone
with the causal mask, mean pooling over patch tokens, BatchNorm without
affine on the features, LARS (base lr 0.1 x batch / 256 = 6.4, momentum 0.9,
weight decay 0), label
smoothing 0.1, spatial augmentation, batch 16384, cosine with 10 warm-up
epochs, 90 epochs. One forward pass trains one probe per block.

By default a grid, as DINOv2 and AIM evaluate (train/probe_grid.py,
docs/PROBES.md): 8 base learning rates (0.025 to 3.2, spaced by 2, the
paper's 0.1 among them) x 2 poolings (mean, last token) on every block,
each block's setting chosen on held-out training rows (min(2%, 10000)),
all in the one frozen pass: at ViT-H/14, 512 heads, about 25-30 GB per
device at 2048 images per device. The held-out rows need an
index-addressable source: imagenet2012 prepared as ArrayRecord (``tfds build
imagenet2012 --file_format=array_record``) or an image folder. The paper's
single setting: --config.probe.learning_rates='(0.1,)' --config.probe.poolings='("mean",)'.

Writes val_accuracy_block_XX per evaluation, and at the end
probe_accuracy.json / probe_accuracy.png (accuracy vs normalised depth) and
val_best_accuracy. Expect (paper figure): accuracy rising with depth and
peaking around the middle of the stack (deeper for ViT-B).
"""

from darl_jax import config_lib
from darl_jax.train.trainers import linear_probe

# The grid's base rates (x batch / 256: 1.6 to 204.8 at batch 16384).
LEARNING_RATES = (0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)


def get_config(arg=None):
  args = config_lib.parse_arg(arg, variant="L/16", init="")
  c = linear_probe.linear_probe_config()
  c.init_from = args.init
  c.batch_size = 16384
  c.total_epochs = 90.0
  # The grid steps its heads inside the loss, once per microbatch, so it takes
  # the whole batch (probe_grid.check_loop_options); the frozen pass keeps no
  # activations for a backward pass, so the batch fits without accumulation.
  c.microbatch_size = 0
  c.log_every_steps = 50
  c.checkpoint_every_steps = 1000
  c.eval_every_steps = 1000
  c.probe.learning_rates = LEARNING_RATES
  c.probe.poolings = ("mean", "last")
  config_lib.imagenet_frozen_backbone(c, args.variant, augment="spatial")
  if args.variant.startswith("H/"):     # 632M parameters: sharded over every device
    c.sharding = "fsdp"
    c.mesh.update(data=1, fsdp=-1)
  return c
