"""Few-shot linear classification of a pretrained DARL checkpoint's features, as big_vision evaluates.

Run (after a pretraining run, e.g. experiments/fashion_mnist_diff.py):
  python -m darl_jax.main --config=experiments/fashion_mnist_fewshot.py \
      --config.init_from=workdirs/fashion_mnist_diff --workdir=workdirs/fashion_mnist_fewshot

The model and the dataset come from the checkpoint's stored config. 1, 5,
10 and 25 labelled training images per class (3 draws), ridge regression on
the frozen, mean-pooled final features, scored on 2000 validation images
(darl_jax/train/jobs/fewshot.py). Writes fewshot.json (accuracy per shot count
and draw, mean, std, chosen L2 strengths) and one metrics.jsonl record at the
checkpoint's step with the keys pretraining logs when ``fewshot_eval`` is on
(``val_fewshot_<k>shot``). A minute or two on 2 CPU cores.

Expect: not yet measured.

Args: features (``features`` or ``block_XX``), tiny (fewer examples and
shots: the tests' smoke run on tests/tiny_config.py's checkpoint).
"""

from darl_jax import config_lib
from darl_jax.train.jobs import fewshot


def get_config(arg=None):
  args = config_lib.parse_arg(arg, features="features", tiny=False)
  c = fewshot.fewshot_config()
  c.batch_size = 256
  c.fewshot_eval.update(shots=(1, 5, 10, 25), num_seeds=3, num_support_examples=10_000,
                        num_query_examples=2000, features=args.features)
  if args.tiny:
    c.batch_size = 32
    c.tensorboard = False
    c.fewshot_eval.update(shots=(1, 5), num_seeds=2, num_support_examples=400,
                          num_query_examples=100)
  return c
