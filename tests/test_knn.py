"""kNN on frozen features (train/jobs/knn.py): the classifier against a brute-force
NumPy kNN (ties, k beyond a class and beyond the training set, chunking),
the job end to end on a tiny model, and its row in the studies."""

import json
import os
import pathlib
import runpy
import subprocess
import sys

import numpy as np
import pytest

from darl_jax import config_lib
from darl_jax import metrics as metrics_lib
from darl_jax.studies import catalog
from darl_jax.studies import spec as S
from darl_jax.train.jobs import knn
from xla_env import cpu_devices_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENT = ROOT / "experiments" / "fashion_mnist_knn.py"


def brute_force(test, train, labels, num_classes, ks, temperature):
  """The definition, one test row and head at a time in float64: neighbours by
  similarity, ties by training index; votes exp(sim / T); ties by class."""
  norm = lambda x: x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
  test, train = norm(np.asarray(test, np.float64)), norm(np.asarray(train, np.float64))
  m, h, _ = test.shape
  out = np.zeros((len(ks), m, h), np.int64)
  for i in range(m):
    for j in range(h):
      sims = train[:, j] @ test[i, j]
      order = np.lexsort((np.arange(len(sims)), -sims))    # by -sim, then index
      for a, k in enumerate(ks):
        votes = np.zeros(num_classes)
        for n in order[:k]:
          votes[labels[n]] += np.exp(sims[n] / temperature)
        out[a, i, j] = np.argmax(votes)                     # the first of equal votes
  return out


def _blobs(seed, n, num_classes=4, heads=2, dim=6, spread=1.5):
  rng = np.random.default_rng(seed)
  centres = rng.normal(size=(num_classes, heads, dim))
  labels = rng.integers(0, num_classes, n)
  return centres[labels] + spread * rng.normal(size=(n, heads, dim)), labels


def test_knn_equals_brute_force_for_every_k_and_head():
  train, labels = _blobs(0, 90)
  test, _ = _blobs(1, 23)
  ks = (1, 5, 20, 90)
  want = brute_force(test, train, labels, 4, ks, 0.07)
  got = np.asarray(knn.knn_predict(test, train, labels, 4, ks, 0.07))
  np.testing.assert_array_equal(got, want)
  assert len(np.unique(want)) > 1          # not a constant answer


@pytest.mark.parametrize("train_chunk,test_chunk", [(7, 5), (1, 1), (90, 4), (32, 23)])
def test_chunked_equals_unchunked(train_chunk, test_chunk):
  train, labels = _blobs(2, 90)
  test, _ = _blobs(3, 23)
  whole = np.asarray(knn.knn_predict(test, train, labels, 4, (3, 10, 40), 0.1))
  parts = np.asarray(knn.knn_predict(test, train, labels, 4, (3, 10, 40), 0.1,
                                     train_chunk=train_chunk, test_chunk=test_chunk))
  np.testing.assert_array_equal(parts, whole)


def test_equal_similarities_go_to_the_earlier_training_row_across_chunks():
  # Training rows 0..5 all lie on the test row's direction (similarity 1),
  # labelled 0..5: the neighbour order, read off with k = 1..6 and as many
  # classes as rows, is the training order, also when the rows come in
  # chunks (and the later duplicates arrive in a later chunk).
  e = np.eye(3)[:, None, :]                          # [3, 1, 3]
  train = np.concatenate([np.repeat(e[:1], 6, 0) * np.arange(1, 7)[:, None, None],
                          e[1:]])                     # 6 parallel rows, 2 orthogonal
  labels = np.array([3, 0, 5, 1, 4, 2, 0, 0])
  test = e[:1]
  ks = (1, 2, 3, 4, 5, 6)
  for chunk in (0, 1, 2, 4):
    nb_preds = np.asarray(knn.knn_predict(test, train, labels, 6, ks, 0.07,
                                          train_chunk=chunk))[:, 0, 0]
    # k=1: the first row's label; k=2: rows 0 and 1 tie in votes -> lower class.
    assert nb_preds[0] == 3 and nb_preds[1] == 0
    np.testing.assert_array_equal(nb_preds, brute_force(test, train, labels, 6, ks, 0.07)[:, 0, 0])
  # Exactly which neighbours were kept: labels = training indices.
  nb = knn.empty_neighbours(1, 1, 8)
  normed = np.asarray(knn.l2_normalize(train))
  for start in (0, 3, 6):
    rows = slice(start, start + 3)
    n = len(train[rows])
    nb = knn.merge(nb, knn.l2_normalize(test), normed[rows], np.arange(start, start + n),
                   np.ones(n, bool), 1)
  np.testing.assert_array_equal(np.asarray(nb.labels)[0, 0], [0, 1, 2, 3, 4, 5, 6, 7])


def test_k_beyond_a_class_and_beyond_the_training_set():
  # Class 1 has two rows and class 0 five, far away: at k = 2 the two nearby
  # class-1 rows win; at k = 7 (every row) and k = 50 (more than there are)
  # the five class-0 rows outvote them only if their weights do; empty
  # entries carry no vote.
  rng = np.random.default_rng(4)
  test = rng.normal(size=(5, 1, 4))
  train = np.concatenate([test[:2] + 0.01, -test[:1] + 0.3 * rng.normal(size=(5, 1, 4))])
  labels = np.array([1, 1, 0, 0, 0, 0, 0])
  ks = (2, 7, 50)
  for temperature in (0.07, 10.0):
    want = brute_force(test, train, labels, 3, ks, temperature)
    for chunk in (0, 3):
      got = np.asarray(knn.knn_predict(test, train, labels, 3, ks, temperature,
                                       train_chunk=chunk))
      np.testing.assert_array_equal(got, want)
  # At a high temperature the votes are counts: 5 of class 0 beat 2 of class 1.
  assert (np.asarray(knn.knn_predict(test, train, labels, 3, (50,), 1e4)) == 0).all()
  assert (brute_force(test[:2], train, labels, 3, (2,), 0.07) == 1).all()


def test_bad_knn_config_values_fail_with_the_fix():
  for key, value, match in (("ks", (), "knn.ks"), ("ks", (5, 5), "knn.ks"),
                            ("report_k", 7, "report_k"), ("temperature", 0.0, "temperature"),
                            ("poolings", ("max",), "poolings"),
                            ("test_chunk_size", 0, "test_chunk_size")):
    c = knn.knn_config()
    c.knn[key] = value
    with pytest.raises(config_lib.ConfigError, match=match):
      knn.check_config(c)
  assert knn.chosen_blocks((), 3) == (0, 1, 2)
  assert knn.chosen_blocks((-1, 0), 3) == (2, 0)
  with pytest.raises(config_lib.ConfigError, match="knn.blocks"):
    knn.chosen_blocks((3,), 3)


def test_report_reads_the_headline_k_and_the_first_pooling():
  acc = np.arange(2 * 6).reshape(2, 6) / 100                # 2 ks x (2 poolings x 3 blocks)
  report = knn.knn_report(acc, (10, 20), ("mean", "last"), (1, 2, 3), 4, 20)
  assert report["accuracy"] == [0.06, 0.07, 0.08] and report["best_block"] == "block_03"
  assert report["normalized_depth"] == [0.5, 0.75, 1.0]
  metrics = knn.knn_metrics(report)
  assert metrics["val_accuracy_block_01"] == 0.06 and metrics["val_accuracy"] == 0.08
  assert metrics["val_knn_accuracy_last_k10_block_02"] == 0.04
  assert len(report["grid"]) == 12


# ------------------------------------------------------------------- the job


def _crash_report(stderr: str) -> str:
  """The part of a failed job's stderr that says why: from a crash dump's
  start (its thread stacks come before the list of extension modules that
  ends it), else the end."""
  start = stderr.find("Fatal Python error")
  return stderr[start:start + 6000] if start >= 0 else stderr[-4000:]


def _job(workdir, devices, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             XLA_FLAGS=cpu_devices_flags(devices))
  proc = subprocess.run(
      [sys.executable, "-m", "darl_jax.main", f"--config={EXPERIMENT}:tiny",
       f"--workdir={workdir}", "--config.knn.poolings=('mean','last')",
       "--config.knn.ks=(1,20,200)", "--config.knn.report_k=20",
       "--config.knn.num_train_examples=300", "--config.eval_max_batches=3", *flags],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, _crash_report(proc.stderr)
  return json.loads((workdir / "knn_accuracy.json").read_text())


def test_job_runs_end_to_end_on_a_tiny_model(tmp_path):
  """The random backbone (no checkpoint needed) on digits, every block, two
  poolings, on two devices (the test rows split between them, each share
  padded to the chunk of 5), against a brute-force kNN of the same
  features. (The runner test below runs it on one device.)"""
  report = _job(tmp_path, 2, "--config.knn.test_chunk_size=5")
  assert report["num_train"] == 300 and report["num_test"] == 48
  assert report["blocks"] == ["block_00", "block_01"] and report["ks"] == [1, 20, 200]
  assert len(report["grid"]) == 2 * 3 * 2
  assert all(0.0 <= r["accuracy"] <= 1.0 for r in report["grid"])
  assert (tmp_path / "knn_accuracy.png").exists()
  (record,) = metrics_lib.read_metrics(str(tmp_path))
  assert record["val_accuracy_block_01"] == report["accuracy"][1]

  # The same numbers from the features themselves.
  import jax
  import jax.numpy as jnp
  from darl_jax import data as data_lib
  from darl_jax.models import vit as vit_lib
  from darl_jax.train import backbone as backbone_lib
  c = runpy.run_path(str(EXPERIMENT))["get_config"]("tiny")
  backbone, patch = vit_lib.vit_from_config(c.model)
  model = backbone_lib.PooledBlocks(backbone=backbone, patch_size=patch, poolings=("mean", "last"))
  params = model.init(jax.random.PRNGKey(c.seed), jnp.zeros((1, 8, 8, 1)))["params"]

  def feats(split, n):
    source = data_lib.build_source(c.data, split=split, seed=c.seed)
    images, labels = [], []
    for b in source.eval_batches(16):
      images.append(b["image"][b["mask"]])
      labels.append(b["label"][b["mask"]])
    x = np.concatenate(images)[:n].astype(np.float32) / 127.5 - 1
    return np.moveaxis(np.asarray(model.apply({"params": params}, x)), 0, 1), \
        np.concatenate(labels)[:n]

  train_x, train_y = feats(c.data.train_split, 300)
  test_x, test_y = feats(c.data.eval_split, 48)
  preds = brute_force(test_x, train_x, train_y, 10, (1, 20, 200), 0.07)
  acc = (preds == test_y[None, :, None]).mean(1)           # [3, 4]
  for row in report["grid"]:
    head = ("mean", "last").index(row["pooling"]) * 2 + int(row["block"][-2:])
    assert row["accuracy"] == pytest.approx(acc[(1, 20, 200).index(row["k"]), head]), row


# The training pass on two CPU devices whose second device falls behind the
# host: every 8th batch's features spin there for a while (a busy machine's
# lagging device, made certain). Each merge is traced: was the previous
# merge finished, and were its own features, when it was dispatched?
_LAGGING_DEVICE_PASS = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from darl_jax import mesh_axes, sharding
from darl_jax.train.jobs import knn

mesh = sharding.make_mesh({"data": -1})
batch, num_batches, spins = 4, 48, 3_000_000

def features(params, images):
  def share(x):
    v = x.reshape(x.shape[0], -1)
    slow = (jax.lax.axis_index(mesh_axes.BATCH_AXES) == 1) & (jnp.max(v) > 0)
    v = jax.lax.fori_loop(0, jnp.where(slow, spins, 1),
                          lambda i, v: jnp.tanh(v * 1.0001 + 1e-3), v)
    return knn.l2_normalize(v[:, None, :] + params)
  return jax.shard_map(share, mesh=mesh, in_specs=P(mesh_axes.BATCH_AXES),
                       out_specs=P(mesh_axes.BATCH_AXES))(images)

class Source:
  num_examples = batch * num_batches
  def eval_batches(self, batch_size, process_index, process_count, num_workers=-1):
    for i in range(num_batches):
      yield {"image": np.full((batch_size, 2, 2, 1), 255 if i % 8 == 1 else 0, np.uint8),
             "label": np.arange(i * batch_size, (i + 1) * batch_size, dtype=np.int32) % 3,
             "mask": np.ones(batch_size, bool)}

scorer = knn.Scorer(mesh, np.ones((4, 1, 4), np.float32), (1, 2), 2)
merge, trace = scorer._merge, []
def traced_merge(nb, test, x, *rest):
  trace.append([nb.sims.is_ready(), x.is_ready()])
  return merge(nb, test, x, *rest)
scorer._merge = traced_merge
used = knn.stream_train(scorer, jax.jit(features), 1.0, Source(), batch,
                        sharding.batch_sharding(mesh), batch * num_batches - 3, 0)
scorer.predictions(3, 0.07)
print(json.dumps({"used": used, "trace": trace}))
"""


def test_training_pass_waits_for_each_merge_on_a_lagging_device():
  """The training pass keeps at most one batch in flight (knn.py, Dispatch):
  run unbounded on 2 devices with XLA's CPU thread pool of 2 (as on a
  2-core machine, whatever this one has), it queued the lagging device's
  32nd unfinished program and the merge's all-gather deadlocked: SIGABRT
  after 40 s. Here every merge must find the previous one finished, also
  while its own features are still being computed."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             XLA_FLAGS=cpu_devices_flags(2), PJRT_NPROC="2")
  proc = subprocess.run([sys.executable, "-c", _LAGGING_DEVICE_PASS], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, _crash_report(proc.stderr)
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["used"] == 4 * 48 - 3 and len(out["trace"]) == 48
  previous_done, features_done = zip(*out["trace"])
  assert all(previous_done), [i for i, d in enumerate(previous_done) if not d]
  assert not all(features_done)          # the device did fall behind the host


def test_experiment_config_and_catalog_rows():
  c = runpy.run_path(str(EXPERIMENT))["get_config"](None)
  assert c.trainer == "knn" and tuple(c.knn.ks) == (10, 20, 100, 200)
  assert c.knn.temperature == 0.07 and c.model.causal and "optim" not in c
  config_lib.validate(c)
  knn.check_config(c)
  from darl_jax import main
  assert main.get_job("knn") is knn.run
  for scale in ("tiny", "fmnist_long"):
    study = catalog.get_study("downstream", S.get_scale(scale), seeds=1)
    rows = {r.labels["init"]: r for r in study.runs if r.labels["family"] == "knn"}
    assert sorted(rows) == ["DARL diffusion", "DARL mse", "random"]
    (random_knn,) = rows["random"].stages
    assert random_knn.kind == "knn" and random_knn.parent is None
    pre, stage = rows["DARL diffusion"].stages
    assert stage.parent is pre and S.load_config(stage).trainer == "knn"
    assert S.load_config(stage).model.width == S.load_config(pre).model.width


def test_study_runner_runs_the_knn_stage_on_its_pretraining(tmp_path):
  from darl_jax.studies import runner as runner_lib
  study = catalog.get_study("downstream", S.get_scale("tiny"), seeds=1)
  (run,) = [r for r in study.runs if r.labels["family"] == "knn"
            and r.labels["init"] == "DARL mse"]
  runner = runner_lib.Runner(tmp_path / "out", tmp_path / "work")
  assert runner.run(list(run.stages)) == []
  pre, stage = run.stages
  result = runner.result(stage)
  assert "--config=experiments/fashion_mnist_knn.py" in result["command"]
  init = json.loads((runner.workdir(stage) / "init_report.json").read_text())
  assert init["loaded"] and init["step"] == S.load_config(pre).total_steps
  records, _ = runner_lib.records(runner, study)
  (record,) = [r for r in records if r["labels"] == run.labels]
  blocks = [v for k, v in result["metrics"].items() if k.startswith("val_accuracy_block_")]
  assert len(blocks) == 2 and record["metrics"]["last/best_block_accuracy"] == max(blocks)
