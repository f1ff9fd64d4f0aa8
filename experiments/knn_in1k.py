"""k-nearest-neighbour classification on every block of a DARL-pretrained ViT, ImageNet.

Run:
  python -m darl_jax.main --config=experiments/knn_in1k.py:init=gs://<bucket>/darl_vit_h14_diff,variant=H/14 \
      --workdir=gs://<bucket>/darl_vit_h14_diff_knn
Args: variant (B/16 | L/16 | H/14, must match the pretraining run), init.

Protocol (darl_jax/train/jobs/knn.py; DINO's and DINOv2's kNN evaluation):
the linear probe's frozen causal pass (experiments/linear_probe_in1k.py,
unaugmented: the centre crop of evaluation for both splits), mean-pooled
and L2-normalised features of every block, cosine similarity of each of the
50,000 validation images to the 1.28M training images, votes weighted
exp(sim / 0.07), k in {10, 20, 100, 200}; the headline is k = 20. Nothing
is trained: one pass over each split.

Memory: the training features are streamed batch by batch into the running
top-200 of every validation image and never held; at ViT-H/14 (32 blocks,
width 1280) the job keeps 8.2 GB of validation features and 2.6 GB of
neighbours, split over the devices (docs/PROBES.md).
"""

from darl_jax import config_lib
from darl_jax.train.jobs import knn


def get_config(arg=None):
  args = config_lib.parse_arg(arg, variant="L/16", init="")
  c = knn.knn_config()
  c.init_from = args.init
  c.batch_size = 1024
  config_lib.imagenet_frozen_backbone(c, args.variant, augment="none")
  return c
