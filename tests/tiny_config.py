"""A seconds-long DARL pretraining config on scikit-learn's 8x8 digits, for tests.

  python -m darl_jax.main --config=tests/tiny_config.py:objective=diffusion --workdir=/tmp/tiny
"""

from darl_jax import config_lib


def get_config(arg=None):
  args = config_lib.parse_arg(arg, objective="mse", steps=8)
  c = config_lib.pretrain_config()
  c.total_steps = args.steps
  c.batch_size = 16
  c.log_every_steps = 1
  c.tensorboard = False   # TensorFlow's import would be most of a run's start-up
  c.checkpoint_every_steps = 4
  c.eval_every_steps = 4
  c.eval_max_batches = 2
  # Batches built in the test process: worker processes would add their
  # start-up to every short run (tests/test_pipeline.py runs the workers).
  c.data.update(name="digits", image_size=8, channels=1, augment="none", num_workers=0)
  c.model.update(variant="mu/2", image_size=8, channels=1, rope_max_wavelength=100.0)
  c.optim.update(base_lr=2e-3, warmup_steps=2)
  c.predictions.update(num_images=2, num_steps=4)
  if args.objective == "diffusion":
    c.decoder.update(kind="transformer", depth=1, width=32, num_heads=2,
                     gamma_conditioning=True)
    c.loss.update(kind="diffusion", noise_a=1.0, noise_b=1.0, eval_gammas=4)
  return c
