"""Evaluation does not depend on its batch: the same examples with the same
weights give the same metrics at any evaluation batch (train/loop.py,
``evaluate`` and ``make_eval_step``). Tiny models on the 8x8 digits, CPU."""

import sys
import pathlib

import jax
import numpy as np
import pytest

from darl_jax.train.trainers import finetune
from darl_jax.train import loop
from darl_jax.train import step as step_lib
from darl_jax.train import feed as feed_lib
from darl_jax.train.trainers import pretrain

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import test_accumulate as acc  # noqa: E402  pylint: disable=wrong-import-position

RTOL = 1e-5


def scores_at(trainer_cls, config, eval_batch_sizes, eval_max_batches):
  """``evaluate``'s metrics of one initial state at each evaluation batch."""
  config.eval_max_batches = eval_max_batches
  built = loop.setup(trainer_cls(config), config)
  state = built.init_state()
  out = []
  for size in eval_batch_sizes:
    config.eval_batch_size = size
    out.append(step_lib.evaluate(None, built.model, state, built.ctx.eval_source, built.eval_step,
                             built.batch_sharding, config))
  return out


def assert_same_scores(scores):
  first = scores[0]
  assert first and all(sorted(s) == sorted(first) for s in scores)
  for other in scores[1:]:
    for k in first:
      np.testing.assert_allclose(other[k], first[k], rtol=RTOL, err_msg=k)


# The digits' validation split has 180 examples: at 32 rows the last batch has
# 20 real rows and 12 of padding. A cap of 2 batches of batch_size 16 is the
# first 32 examples: 4 batches of 8, 1 of 32, 2 of 24 (the second partly past it).
@pytest.mark.parametrize("objective,extra,max_batches", [
    ("mse", {}, 0),
    ("mse", {}, 2),
    ("diffusion", {}, 0),
    ("diffusion", {}, 2),
    # The other random inputs of the loss: the prefix lengths, and a
    # two-stream model's random orders.
    ("diffusion", {"model.prefix": "uniform"}, 2),
    ("mse", {"model.two_stream": True, "model.ordering": "random"}, 2),
])
def test_pretraining_val_loss_is_the_same_at_any_eval_batch(objective, extra, max_batches):
  config = acc.pretrain_config(objective, **extra)
  assert_same_scores(scores_at(pretrain.PretrainTrainer, config, (8, 32, 24), max_batches))


@pytest.mark.parametrize("max_batches", [0, 2])
def test_classifier_accuracy_and_loss_are_the_same_at_any_eval_batch(max_batches):
  config = acc.finetune_config()
  scores = scores_at(finetune.FinetuneTrainer, config, (8, 32, 24), max_batches)
  assert {"accuracy", "loss"} <= set(scores[0])
  assert_same_scores(scores)


def test_an_evaluation_cap_counts_examples_of_batch_size():
  """``eval_max_batches`` batches of ``batch_size`` examples: the mean over
  exactly the first ``eval_max_batches * batch_size`` examples of the split."""
  config = acc.finetune_config()
  one, capped = scores_at(finetune.FinetuneTrainer, config, (1, 24), 2)
  assert capped["accuracy"] == pytest.approx(one["accuracy"], rel=RTOL)
  accuracy = one["accuracy"] * 32
  assert accuracy == pytest.approx(round(accuracy), abs=1e-4)   # k correct of 32


def test_each_examples_noise_comes_from_its_index_in_the_split():
  """Each example's noise is drawn from the eval key folded with its index:
  the same example at another row or in another batch gets the same loss,
  and two examples with the same pixels get different noise."""
  config = acc.pretrain_config("diffusion")
  built = loop.setup(pretrain.PretrainTrainer(config), config)
  state = built.init_state()
  images = np.random.default_rng(0).integers(0, 256, (4, 8, 8, 1), dtype=np.uint8)
  images[3] = images[0]

  def losses(rows, index):
    batch = {"image": images[rows], "label": np.zeros(len(rows), np.int32),
             "mask": np.ones(len(rows), bool), "index": np.asarray(index, np.int32)}
    out = built.eval_step(state["params"], state["model_state"],
                          feed_lib.to_global(batch, built.batch_sharding))
    return out

  per_row = [float(losses([r], [i])["loss"]) for r, i in ((0, 10), (1, 11), (2, 12))]
  together = losses([2, 0, 1], [12, 10, 11])
  assert float(together["loss"]) == pytest.approx(sum(per_row), rel=RTOL)
  assert float(losses([3], [10])["loss"]) == pytest.approx(per_row[0], rel=RTOL)
  assert float(losses([3], [13])["loss"]) != pytest.approx(per_row[0], rel=1e-3)


def test_an_accumulated_run_reports_the_one_shot_val_loss(tmp_path):
  """Microbatches of 8 (evaluated at the microbatch) and one shot of 32:
  the same updates, the same validation loss."""
  runs = {}
  for microbatch in (0, 8):
    config = acc.pretrain_config("diffusion", total_steps=2, batch_size=32,
                                 microbatch_size=microbatch, eval_every_steps=2,
                                 checkpoint_every_steps=2, eval_max_batches=2)
    runs[microbatch] = loop.run(pretrain.PretrainTrainer(config), config,
                                str(tmp_path / str(microbatch)))
    assert config.eval_batch_size == 0      # resolved once (fit.resolve), never written back
  np.testing.assert_allclose(runs[0]["loss"], runs[8]["loss"], rtol=RTOL)
  np.testing.assert_allclose(runs[8]["val_loss"], runs[0]["val_loss"], rtol=RTOL)


def test_two_processes_cap_the_same_examples_at_any_eval_batch(tmp_path):
  """Two processes (gloo collectives, one CPU device each) leave a capped
  evaluation after the same batch, and the cap covers the same examples at
  4 and at 16 rows per evaluation batch."""
  import test_multihost as mh  # pylint: disable=g-import-not-at-top
  logs = tmp_path / "logs"
  logs.mkdir()
  diffusion = ["--config.loss.kind=diffusion", "--config.loss.eval_gammas=4",
               "--config.decoder.kind=transformer", "--config.decoder.depth=1",
               "--config.decoder.width=32", "--config.decoder.num_heads=2",
               "--config.decoder.gamma_conditioning=True"]
  common = [*diffusion, "--config.total_steps=1",
            "--config.eval_every_steps=1", "--config.checkpoint_every_steps=1",
            "--config.eval_max_batches=3", "--config.predictions.num_images=0"]
  runs = {size: tmp_path / f"eval{size}" for size in (4, 16)}
  mh._wait([p for size, wd in runs.items() for p in mh._start(
      wd, logs, [*common, f"--config.eval_batch_size={size}"], processes=2, devices=1)],
           logs, timeout=400)
  (_, small), (_, large) = (mh._logged(wd) for wd in runs.values())
  assert list(small) == [1] == list(large)
  np.testing.assert_allclose(small[1][0], large[1][0], rtol=RTOL)
