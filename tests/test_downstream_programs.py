"""Downstream programs reused: VTAB's tasks share their compiled programs, the
padded head with masked classes trains as an unpadded one, and downstream jobs
log how many programs they compiled (darl_jax/train/compile_count.py)."""

import json
import logging
import pathlib
import runpy
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax.data.sources import vtab_tasks
from darl_jax.models import heads
from darl_jax.models import vit as vit_lib
from darl_jax.train.trainers import finetune
from darl_jax.train import compile_count
from darl_jax.train.jobs import vtab

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# Three tasks of three class counts (10, 47, 8), at one resolution and batch.
TASKS = ("svhn", "dtd", "clevr_count")


# ------------------------------------------------------------ the counter


def test_the_counter_counts_compiles_and_cache_loads_per_name():
  count = compile_count.Count()

  def double_it(x):
    return x * 2.0

  def triple_it(x):
    return x * 3.0

  jax.jit(double_it)(jnp.ones(5))                       # a new program
  jax.jit(double_it)(jnp.ones(5))                       # in memory: nothing compiled
  jax.jit(triple_it)(jnp.ones(7))
  compiled, loaded = count.compiled(), count.loaded()
  # Under the tests' persistent cache (conftest.py) a program another test
  # compiled may come from it: each program is compiled or loaded, once.
  assert compiled.get("double_it", 0) + loaded.get("double_it", 0) == 1
  assert compiled.get("triple_it", 0) + loaded.get("triple_it", 0) == 1
  report = count.report()
  assert report["compiled"] == sum(compiled.values()) and report["compile_seconds"] >= 0
  line = count.line("a job")
  assert line.startswith(f"a job compiled {report['compiled']} programs")
  assert "from the persistent compilation cache" in line
  later = compile_count.Count()
  assert later.compiled() == {} and later.loaded() == {}
  assert compile_count.program_name("jit(train_step)") == "train_step"


# ------------------------------------------------------------ padded head


def _classifier(num_classes, task_classes=0):
  backbone, patch = vit_lib.vit_from_config(_tiny_model())
  return heads.Classifier(backbone=backbone, patch_size=patch, num_classes=num_classes,
                          task_classes=task_classes)


def _tiny_model():
  c = finetune.finetune_config().model
  c.update(variant="mu/2", image_size=8, channels=1, rope_max_wavelength=100.0)
  return c


def test_padded_masked_head_equals_the_unpadded_head():
  """Loss, accuracy and the real classes' gradients of a 5-class task on a
  head of 12 outputs equal those of a 5-output head with the same weights."""
  k, padded_k, batch = 5, 12, 6
  c = finetune.finetune_config()
  c.model = _tiny_model()
  c.label_smoothing = 0.1
  c.optim.num_layers = 2
  trainer = finetune.FinetuneTrainer(c)
  small, big = _classifier(k), _classifier(padded_k, task_classes=k)
  rng = jax.random.PRNGKey(0)
  images = jax.random.uniform(rng, (batch, 8, 8, 1), minval=-1.0, maxval=1.0)
  labels = jnp.array([0, 1, 4, 2, 3, 4], jnp.int32)
  variables = trainer.init_variables(big, rng, {"image": images[:1]})
  assert variables[heads.CLASSES]["valid"].tolist() == [True] * k + [False] * (padded_k - k)
  params = variables.pop("params")
  model_state = variables
  # A head with nonzero weights (a trained one), the absent outputs' zero.
  kernel = jax.random.normal(jax.random.PRNGKey(1), params["head"]["kernel"].shape)
  bias = jax.random.normal(jax.random.PRNGKey(2), params["head"]["bias"].shape)
  absent = jnp.arange(padded_k) >= k
  params["head"] = {"kernel": jnp.where(absent, 0.0, kernel), "bias": jnp.where(absent, 0.0, bias)}
  small_params = {**params, "head": {"kernel": kernel[:, :k], "bias": bias[:k]}}

  def loss(model, p, state, train_batch):
    return trainer.loss_fn(model, p, state, train_batch, jax.random.PRNGKey(3), False)

  def run(model, p, state):
    b = {"image": images, "label": labels}
    b = trainer.prepare_batch(model, b, jax.random.PRNGKey(4), False)
    (value, (metrics, _)), grads = jax.value_and_grad(
        lambda q: loss(model, q, state, b), has_aux=True)(p)
    evals = trainer.eval_fn(model, p, state, {"image": images, "label": labels}, None)
    return value, metrics["train_accuracy"], grads, evals

  small_out = jax.jit(lambda p: run(small, p, {}))(small_params)
  big_out = jax.jit(lambda p, state: run(big, p, state))(params, model_state)
  assert float(big_out[0]) == pytest.approx(float(small_out[0]), rel=1e-6)
  assert float(big_out[1]) == float(small_out[1])
  np.testing.assert_allclose(big_out[2]["head"]["kernel"][:, :k],
                             small_out[2]["head"]["kernel"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(big_out[2]["head"]["bias"][:k], small_out[2]["head"]["bias"],
                             rtol=1e-5, atol=1e-7)
  # The absent outputs get no gradient: from zero they stay zero.
  assert not np.asarray(big_out[2]["head"]["kernel"][:, k:]).any()
  assert not np.asarray(big_out[2]["head"]["bias"][k:]).any()
  for a, b in zip(jax.tree_util.tree_leaves(big_out[2]["backbone"]),
                  jax.tree_util.tree_leaves(small_out[2]["backbone"])):
    # float32 sums in another order: entries near zero differ by rounding
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))
  # The softmax over 16 padded logits and over 10 sums the same terms in
  # float32, but XLA:CPU vectorises reductions of different lengths into other
  # trees: a few ulps apart (1.6e-6 relative on some CPUs), never more.
  np.testing.assert_allclose(big_out[3]["loss"], small_out[3]["loss"], rtol=1e-5)
  np.testing.assert_array_equal(big_out[3]["accuracy"], small_out[3]["accuracy"])


def test_padded_head_checks():
  with pytest.raises(ValueError, match="head.num_classes=5 is smaller than the 10 classes"):
    finetune.head_size({"num_classes": 5}, 10, "svhn")
  assert finetune.head_size({"num_classes": 0}, 10) == (10, 0)
  assert finetune.head_size({"num_classes": 397}, 10) == (397, 10)
  with pytest.raises(ValueError, match="cannot hold 9 classes"):
    _classifier(4, task_classes=9).init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))
  assert vtab_tasks.MAX_CLASSES == 397 and vtab.vtab_config().head.num_classes == 397


# ------------------------------------------------------------------- VTAB


def tiny_vtab_config(tasks=TASKS):
  c = runpy.run_path(str(ROOT / "experiments" / "vtab.py"))["get_config"](
      "sweep=single,source=synthetic")
  c.vtab.tasks = ",".join(tasks)
  c.update(total_steps=2, batch_size=4, log_every_steps=1, checkpoint_every_steps=2,
           tensorboard=False)
  c.data.update(image_size=8, vtab_train_examples=8,
                vtab_val_examples=4, num_workers=0)
  c.model.update(variant="mu/2", image_size=8, reference_image_size=8, dtype="float32")
  c.optim.update(warmup_steps=1, num_layers=2)
  return c


def test_synthetic_vtab_sources_have_the_tasks_class_counts():
  c = tiny_vtab_config().data
  for task in TASKS:
    c.vtab_task = task
    train = vtab_tasks.build_source(c, split="train800", seed=0)
    both = vtab_tasks.build_source(c, split="train800val200", seed=0)
    test = vtab_tasks.build_source(c, split="test", seed=0)
    k = vtab_tasks.TASKS[task].num_classes
    assert (train.num_examples, both.num_examples, test.num_examples) == (8, 12, 4)
    assert train.num_classes == k and (both.labels < k).all()
    np.testing.assert_array_equal(both.images[:8], train.images)   # train800 inside
  c.vtab_source = "kaggle"
  with pytest.raises(ValueError, match="unknown data.vtab_source 'kaggle'"):
    vtab_tasks.build_source(c, split="train800", seed=0)


def test_vtab_tasks_of_other_class_counts_share_one_train_program(tmp_path):
  """Two tasks (10 and 47 classes) x (a sweep over two learning rates + the
  retrain) = 6 fine-tuning runs at one resolution and batch: one train step
  and one eval step are compiled, every later run loads them from the
  persistent compilation cache."""
  tasks = TASKS[:2]
  c = tiny_vtab_config(tasks)
  c.vtab.sweep.lr = [1e-3, 1e-2]
  results = vtab.run_suite(c, tmp_path)
  assert [r["task"] for r in results] == list(tasks)
  order = [f"sweep/{vtab.point_name(p)}" for p in vtab.sweep_points(c.vtab.sweep)] + ["final"]
  runs = [json.loads((tmp_path / t / run / "result.json").read_text())["programs"]
          for t in tasks for run in order]          # in the order they ran
  assert len(runs) == 6
  train = [r["compiled_by_name"].get("train_step", 0) for r in runs]
  train_loaded = [r["loaded_by_name"].get("train_step", 0) for r in runs]
  evals = [r["compiled_by_name"].get("eval_step", 0) for r in runs]
  # Each run builds its train step once, compiled or loaded; at most the
  # first compiles it (none where an earlier test compiled the same program).
  assert [a + b for a, b in zip(train, train_loaded)] == [1] * 6
  assert sum(train) <= 1 and train[1:] == [0] * 5
  assert sum(evals) <= 1 and evals[1:] == [0] * 5
  table = (tmp_path / "vtab_results.md").read_text()
  assert "Programs (this process): the suite compiled" in table
  assert results[0]["programs"]["compiled"] >= results[1]["programs"]["compiled"]


# ------------------------------------------------------------ a probe job


def test_a_probe_job_logs_and_reports_its_program_count(tmp_path, caplog):
  from darl_jax.train.trainers import linear_probe
  from darl_jax.train import loop
  c = linear_probe.linear_probe_config()
  c.update(total_steps=2, batch_size=16, log_every_steps=1, eval_every_steps=2,
           checkpoint_every_steps=2, eval_max_batches=1, tensorboard=False)
  c.data.update(name="digits", image_size=8, channels=1, augment="none", num_workers=0)
  c.model.update(variant="mu/2", image_size=8, channels=1, rope_max_wavelength=100.0)
  c.optim.update(warmup_steps=1)
  with caplog.at_level(logging.INFO):
    loop.run(linear_probe.LinearProbeTrainer(c), c, str(tmp_path))
  lines = [r.getMessage() for r in caplog.records
           if r.getMessage().startswith("linear probe compiled ")]
  assert len(lines) == 1 and "from the persistent compilation cache" in lines[0]
  counted = json.loads((tmp_path / "probe_accuracy.json").read_text())["programs"]
  built = {name: counted["compiled_by_name"].get(name, 0) + counted["loaded_by_name"].get(name, 0)
           for name in ("train_step", "eval_step")}
  assert built["train_step"] == 1 and built["eval_step"] >= 1
  assert counted["compiled"] + counted["loaded_from_cache"] >= 2
  assert f"compiled {counted['compiled']} programs" in lines[0]
