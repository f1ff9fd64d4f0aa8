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

Writes val_accuracy_block_XX per evaluation, and at the end
probe_accuracy.json / probe_accuracy.png (accuracy vs normalised depth) and
val_best_accuracy. Expect (paper figure): accuracy rising with depth and
peaking around the middle of the stack (deeper for ViT-B).
"""

from darl_jax import config_lib
from darl_jax.train import linear_probe


def get_config(arg=None):
  args = config_lib.parse_arg(arg, variant="L/16", init="")
  c = linear_probe.linear_probe_config()
  c.init_from = args.init
  c.batch_size = 16384
  c.total_epochs = 90.0
  c.log_every_steps = 50
  c.checkpoint_every_steps = 1000
  c.eval_every_steps = 1000
  c.data.update(name="imagenet2012", tfds_name="imagenet2012", image_size=224, channels=3,
                augment="spatial", train_split="train", eval_split="validation")
  c.model.update(variant=args.variant, image_size=224, reference_image_size=224, channels=3,
                 posenc="rope2d", causal=True, dtype="bfloat16", drop_path=0.0)
  if args.variant.startswith("H/"):
    c.sharding = "fsdp"
    c.mesh.update(data=1, fsdp=-1)
  return c
