"""k-nearest-neighbour classification on every block of the Fashion-MNIST DARL model (experiments/fashion_mnist_diff.py).

Run (after the pretraining job wrote workdirs/fashion_mnist_diff):
  python -m darl_jax.main --config=experiments/fashion_mnist_knn.py:init=workdirs/fashion_mnist_diff \
      --workdir=workdirs/fashion_mnist_knn
Without ``init`` it reads a random backbone (the baseline).
Args: init, tiny (scikit-learn's 8x8 digits and the tiny model of
tests/tiny_config.py: the tests' smoke run).

Protocol (darl_jax/train/jobs/knn.py, DINO's): the linear probe's frozen causal
pass (experiments/fashion_mnist_linear_probe.py), mean-pooled and
L2-normalised features of every block, cosine similarity to the 55,000
training images, votes weighted exp(sim / 0.07), k in {10, 20, 100, 200};
the headline is k = 20. Nothing is trained: the job is one pass over each
split. knn_accuracy.json / .png in the workdir.

Expect: not measured yet (issue 55's reruns).
"""

from darl_jax import config_lib
from darl_jax.train.jobs import knn


def get_config(arg=None):
  args = config_lib.parse_arg(arg, init="", tiny=False)
  c = knn.knn_config()
  c.init_from = args.init
  c.batch_size = 256
  # The checkpoint's architecture (experiments/fashion_mnist_diff.py).
  config_lib.fashion_mnist_setup(c, augment="none")
  c.model.update(causal=True, drop_path=0.0)
  if args.tiny:
    # The architecture of tests/tiny_config.py's pretraining run.
    c.update(batch_size=16, tensorboard=False)
    c.data.update(name="digits", image_size=8, channels=1, num_workers=0)
    c.model.update(variant="mu/2", width=0, depth=0, num_heads=0, mlp_dim=0, image_size=8,
                   channels=1, rope_max_wavelength=100.0)
    c.knn.test_chunk_size = 64
  return c
