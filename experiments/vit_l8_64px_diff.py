"""DARL ViT-L/8 at 64x64 on ImageNet with a denoising decoder: the paper's sampling model.

Run (GPU cluster or TPU pod; ImageNet prepared for TFDS, see README):
  python -m darl_jax.main --config=experiments/vit_l8_64px_diff.py --workdir=gs://<bucket>/darl_vit_l8_64px
then sample from it with experiments/vit_l8_64px_sample.py. A quick smoke
run of the same config: --config.total_steps=10 --config.batch_size=64

Recipe (appendix "Samples from DARL"): 800 ImageNet epochs at resolution 64
with patch size 8 (an 8x8 grid of 64 patches, ViT-L/8), an 8-layer
Transformer denoising patch decoder conditioned on gamma, gamma ~ Beta(1, 1)
(uniform on [0, 1]), predicting the clean patch x0. Everything else is the
ImageNet pretraining table (config_lib.imagenet_pretrain_config): AdamW
(0.9, 0.95), base lr 1.5e-4 x batch/256, weight decay 0.05, batch 4096, cosine
with 40 warm-up epochs, spatial augmentation, 2D RoPE, bf16 compute.

Choices the paper leaves open: the decoder's width and heads are the
backbone's (1024, 16), this codebase's default for the transformer decoder;
the crop is random-resized to 64x64 directly (no 224 intermediate).

Expect: next-patch samples that continue the given top half plausibly
(paper Figures "Samples from DARL"); no number is reported for this model.
"""

from darl_jax import config_lib


def get_config(arg=None):
  del arg
  c = config_lib.imagenet_pretrain_config("L/8", "diffusion")
  c.data.image_size = 64
  c.model.image_size = 64
  c.decoder.update(kind="transformer", depth=8, gamma_conditioning=True)
  c.loss.update(kind="diffusion", noise_a=1.0, noise_b=1.0, predict="x0")
  c.predictions.num_steps = 100
  # Batch 4096 on one GPU or a pod alike: the largest microbatch that fits,
  # from memory.py's estimate before anything compiles (train/fit.py).
  c.microbatch_size = -1
  return c
