"""DARL ViT-H/14 pretraining on ImageNet with the mse objective (paper setup).

Run (TPU pod or GPU cluster; ImageNet prepared for TFDS, see README):
  python -m darl_jax.main --config=experiments/vit_h14_mse.py --workdir=gs://<bucket>/darl_vit_h14_mse
On GPUs the defaults (kernels.*=auto) pick the fused kernels (README, GPUs).
A quick smoke run of the same config: --config.total_steps=10 --config.batch_size=64

Recipe (appendix "ImageNet Pre-training Hyperparams"): 224x224, 2D RoPE,
spatial augmentation, AdamW b1=0.9 b2=0.95, base lr 1.5e-4 x batch/256,
weight decay 0.05, batch 4096, cosine with 40 warm-up epochs, 800 epochs,
Xavier-uniform init, bf16 compute with fp32 parameters.
Patch decoder: linear, MSE on raw pixels.

Expect: ImageNet top-1 85.5 after fine-tuning for 90 epochs (paper Table
"ImageNet top-1 Accuracy Comparison", 800 pretraining epochs).
"""

from darl_jax import config_lib


def get_config(arg=None):
  del arg
  c = config_lib.imagenet_pretrain_config("H/14", "mse")
  c.sharding = "fsdp"  # 632M parameters + Adam moments: shard them over `fsdp`
  # Batch 4096 on one GPU or a pod alike: the largest microbatch that fits,
  # from memory.py's estimate before anything compiles (train/fit.py).
  c.microbatch_size = -1
  return c
