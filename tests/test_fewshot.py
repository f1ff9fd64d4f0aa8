"""Few-shot ridge regression on frozen features: the fit, the support draws,
the pretraining evaluator and the ``fewshot`` job."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from darl_jax import config_lib
from darl_jax import metrics as metrics_lib
from darl_jax.train import evaluators as fewshot  # the few-shot fit and evaluator
from darl_jax.train import backbone as backbone_lib
from xla_env import cpu_devices_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "tiny_config.py")
JOB = str(ROOT / "experiments" / "fashion_mnist_fewshot.py")


def _blobs(num_classes=5, per_class=60, dim=32, spread=1.0, seed=0):
  rng = np.random.default_rng(seed)
  centers = rng.normal(size=(num_classes, dim)) * 3
  labels = np.repeat(np.arange(num_classes), per_class)
  feats = centers[labels] + spread * rng.normal(size=(len(labels), dim))
  return feats, labels


def test_separable_features_reach_high_accuracy_and_random_labels_chance():
  pool_x, pool_y = _blobs(seed=0)
  query_x, query_y = _blobs(seed=0, per_class=40)   # same centres, new draws
  query_x = query_x + np.random.default_rng(1).normal(size=query_x.shape)
  grid = config_lib.fewshot_eval_config().l2_grid
  scores = fewshot.fewshot_scores(pool_x, pool_y, query_x, query_y, 5, (1, 5, 10), 3, grid)
  assert scores[1]["mean"] > 0.9 and scores[5]["mean"] > 0.95 and scores[10]["mean"] > 0.95
  assert len(scores[5]["accuracy"]) == len(scores[5]["l2"]) == 3
  # Labels unrelated to the features: chance (1 / 5), whatever the shots.
  shuffled = np.random.default_rng(2).permutation(pool_y)
  chance = fewshot.fewshot_scores(pool_x, shuffled, query_x, query_y, 5, (5, 10), 5, grid)
  for k in (5, 10):
    assert abs(chance[k]["mean"] - 0.2) < 0.1, chance[k]


def test_support_sets_are_balanced_nested_and_differ_across_seeds():
  labels = np.random.default_rng(0).integers(0, 4, 200)
  sets = {}
  for seed in range(3):
    for shots in (1, 5, 10):
      idx = fewshot.support_indices(labels, 4, shots, seed)
      assert len(set(idx)) == len(idx) == 4 * shots
      assert np.bincount(labels[idx], minlength=4).tolist() == [shots] * 4
      sets[seed, shots] = idx
    # The 5-shot set of a seed starts its 10-shot set, class by class.
    assert set(sets[seed, 5]) <= set(sets[seed, 10])
  assert len({tuple(sorted(sets[s, 5])) for s in range(3)}) == 3
  # The same seed draws the same set (every evaluation scores the same sets).
  np.testing.assert_array_equal(sets[1, 5], fewshot.support_indices(labels, 4, 5, 1))
  with pytest.raises(ValueError, match="num_support_examples"):
    fewshot.support_indices(labels[:10], 4, 5, 0)


def test_leave_one_out_is_the_refit_without_the_example():
  x, y = _blobs(num_classes=3, per_class=6, dim=8, spread=3.0)
  l2 = 4.0
  (fit,) = fewshot.ridge_path(x, y, 3, [l2])
  # By hand: refit without example i (whitened with the full set's
  # statistics, as the closed form assumes), predict example i.
  z = (x - fit["mean"]) / fit["std"]
  t = 2.0 * np.eye(3)[y] - 1.0
  hits = []
  for i in range(len(y)):
    keep = np.arange(len(y)) != i
    zk, tk = z[keep], t[keep]
    mu, tb = zk.mean(0), tk.mean(0)
    w = np.linalg.solve((zk - mu).T @ (zk - mu) + l2 * np.eye(z.shape[1]),
                        (zk - mu).T @ (tk - tb))
    hits.append(np.argmax((z[i] - mu) @ w + tb) == y[i])
  assert fit["loo_accuracy"] == pytest.approx(np.mean(hits))
  # And the full fit is the ridge solution with an unpenalised intercept.
  w = np.linalg.solve(z.T @ z + l2 * np.eye(z.shape[1]), z.T @ (t - t.mean(0)))
  np.testing.assert_allclose(fit["w"], w, atol=1e-8)
  np.testing.assert_allclose(fit["b"], t.mean(0))


def test_the_l2_choice_ignores_the_query_set_and_one_shot_takes_the_strongest():
  fits = [{"l2": 1.0, "loo_accuracy": 0.8}, {"l2": 16.0, "loo_accuracy": 0.8},
          {"l2": 4.0, "loo_accuracy": 0.9}]
  assert fewshot.choose_fit(fits, 5)["l2"] == 4.0
  fits[2]["loo_accuracy"] = 0.5
  assert fewshot.choose_fit(fits, 5)["l2"] == 16.0        # ties: the strongest
  assert fewshot.choose_fit(fits, 1)["l2"] == 16.0


def test_bad_fewshot_config_values_fail_with_the_fix():
  c = config_lib.pretrain_config()
  c.fewshot_eval.shots = (1, 0)
  with pytest.raises(config_lib.ConfigError, match="fewshot_eval.shots"):
    config_lib.validate(c)
  c = config_lib.pretrain_config()
  c.fewshot_eval.l2_grid = ()
  with pytest.raises(config_lib.ConfigError, match="fewshot_eval.l2_grid"):
    config_lib.validate(c)
  with pytest.raises(ValueError, match="block_01"):
    fewshot.check_features_name("block_07", 2)


def _cli(config, workdir, *overrides):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             XLA_FLAGS=cpu_devices_flags(1))
  proc = subprocess.run([sys.executable, "-m", "darl_jax.main", f"--config={config}",
                         f"--workdir={workdir}", *overrides],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc


# The job's tiny settings (experiments/fashion_mnist_fewshot.py:tiny) at the
# pretraining run's batch size, so both compute the same features.
FEWSHOT_FLAGS = ["--config.fewshot_eval.shots=(1,5)", "--config.fewshot_eval.num_seeds=2",
                 "--config.fewshot_eval.num_support_examples=400",
                 "--config.fewshot_eval.num_query_examples=100"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """8 steps of tiny pretraining (CLI) with the few-shot evaluator at steps 4 and 8."""
  wd = tmp_path_factory.mktemp("pretrain")
  _cli(TINY, wd, "--config.fewshot_eval.enabled=True", "--config.predictions.num_images=0",
       *FEWSHOT_FLAGS)
  return wd


def test_pretraining_logs_fewshot_accuracy_per_shot_count(pretrained):
  records = [r for r in metrics_lib.read_metrics(str(pretrained)) if "val_fewshot_1shot" in r]
  assert [r["step"] for r in records] == [4, 8]
  for r in records:
    for k in (1, 5):
      assert 0.0 <= r[f"val_fewshot_{k}shot"] <= 1.0
      assert r[f"val_fewshot_{k}shot_std"] >= 0.0
    assert "val_fewshot_10shot" not in r
  config = json.loads((pretrained / "config.json").read_text())
  assert config["fewshot_eval"]["shots"] == [1, 5]


def test_fewshot_job_scores_a_checkpoint_as_pretraining_did(pretrained, tmp_path):
  _cli(f"{JOB}:tiny", tmp_path, f"--config.init_from={pretrained}", "--config.batch_size=16")
  report = json.loads((tmp_path / "fewshot.json").read_text())
  assert report["step"] == 8 and report["num_classes"] == 10
  assert sorted(report["shots"]) == ["1", "5"]
  for v in report["shots"].values():
    assert len(v["accuracy"]) == len(v["l2"]) == 2
    assert v["mean"] == pytest.approx(np.mean(v["accuracy"]))
  (record,) = metrics_lib.read_metrics(str(tmp_path))
  logged = [r for r in metrics_lib.read_metrics(str(pretrained))
            if r["step"] == 8 and "val_fewshot_1shot" in r][0]
  # The same checkpoint, support draws and query set: the same numbers.
  for k in ("val_fewshot_1shot", "val_fewshot_5shot", "val_fewshot_5shot_std"):
    assert record[k] == pytest.approx(logged[k], abs=1e-6), k
  assert (tmp_path / "config.json").exists()


def test_features_option_reads_a_block_of_the_tiny_model():
  """``fewshot_eval.features``: the final features or one block's, mean-pooled."""
  import jax
  sys.path.insert(0, str(ROOT / "tests"))
  import tiny_config  # pylint: disable=import-outside-toplevel
  from darl_jax.models import darl as darl_lib
  c = tiny_config.get_config()
  model = darl_lib.darl_from_config(c)
  images = jax.random.uniform(jax.random.PRNGKey(0), (3, 8, 8, 1), minval=-1, maxval=1)
  params = model.init({"params": jax.random.PRNGKey(1), "noise": jax.random.PRNGKey(2)},
                      images, train=False)["params"]
  final = backbone_lib.darl_pooled_features(model, params, images)
  block = backbone_lib.darl_pooled_features(model, params, images, "block_01")
  assert final.shape == block.shape == (3, model.backbone.width)
  assert not np.allclose(final, block)
  c.fewshot_eval.features = "block_05"
  with pytest.raises(ValueError, match="valid: features, block_00, block_01"):
    fewshot.from_pretrain_config(c, None, model)
