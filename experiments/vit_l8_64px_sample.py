"""Complete ImageNet validation images from their top half with DARL ViT-L/8 at 64x64.

Run (one GPU is enough; after experiments/vit_l8_64px_diff.py):
  python -m darl_jax.main --config=experiments/vit_l8_64px_sample.py \
      --config.init_from=gs://<bucket>/darl_vit_l8_64px --workdir=<dir>

The model is rebuilt from the pretraining run's config.json (ViT-L/8,
8-layer gamma-conditioned Transformer decoder, Beta(1, 1), x0 prediction). As
in the paper's appendix "Samples from DARL": the top half (4 of 8 patch rows)
is given, T = 1000 reverse diffusion steps per patch (step size 0.001) over
the Beta(1, 1) schedule, temperature 1. 16 validation images, 7 completions
each; samples.png shows each original in a red frame followed by its
completions (the red line marks the given half), as in the paper's figure.
sample.dtype=bfloat16 computes in bf16 (parameters stay float32).

Cost: 32 generated patches x 1000 decoder passes per image, about 13 TFLOP
per completion (benchmarks/sampling_benchmark.py measures images/s); raise
batch_size for throughput, lower sample.num_steps for a quick look.
"""

from darl_jax.train.jobs import sample


def get_config(arg=None):
  del arg
  c = sample.sample_config()
  c.batch_size = 16
  c.sample.update(num_images=16, num_samples=7, num_steps=1000, temperature=1.0,
                  condition="top_half", split="validation", dtype="bfloat16",
                  grid_images=16, grid_scale=2, classifier_steps=0)
  return c
