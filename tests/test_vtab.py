"""VTAB-1k: task definitions, label functions, sources on mocked TFDS data, the sweep driver."""

import json
import pathlib
import runpy

import numpy as np
import pytest

from darl_jax.data.sources import vtab_tasks
from darl_jax.train.jobs import vtab

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_19_tasks_with_groups_label_keys_and_split_sizes():
  tasks = vtab_tasks.TASKS
  assert len(tasks) == 19
  groups = [t.group for t in tasks.values()]
  assert (groups.count("natural"), groups.count("specialized"),
          groups.count("structured")) == (7, 4, 8)
  for t in tasks.values():
    assert t.num_classes > 1 and t.label_key and t.label_fn in vtab_tasks.LABEL_FNS
    assert ":" in t.tfds_name or t.tfds_name.count("/") == 1
    assert vtab_tasks.split_parts(t, "train800") == [(t.train, 800)]
    assert vtab_tasks.split_parts(t, "val200") == [(t.val, 200)]
    assert sum(n for _, n in vtab_tasks.split_parts(t, "train800val200")) == 1000
    assert vtab_tasks.split_parts(t, "test") == [(t.test, 0)]       # 0: the whole split
    assert t.train != t.val != t.test
  assert (tasks["clevr_count"].test, tasks["clevr_count"].num_classes) == ("validation", 8)
  assert tasks["smallnorb_elevation"].val == "test[:50%]"
  assert tasks["smallnorb_azimuth"].label_key == "label_azimuth"
  assert tasks["dsprites_orientation"].divisor == 2.5
  assert tasks["kitti_distance"].num_classes == 4
  with pytest.raises(ValueError, match="unknown VTAB task 'cifar10'"):
    vtab_tasks.get_task("cifar10")
  with pytest.raises(ValueError, match="unknown VTAB split"):
    vtab_tasks.split_parts(tasks["dtd"], "train1000")


def test_derived_labels():
  from darl_jax.data.sources import tfds_source
  tf = tfds_source.import_tf()
  t = vtab_tasks.TASKS

  def label(task, ex):
    return int(vtab_tasks.LABEL_FNS[task.label_fn](tf, ex, task))

  clevr = {"objects": {"size": tf.constant([0, 1, 1, 0, 1]),
                       "pixel_coords": tf.constant([[1., 2., 9.7], [3., 4., 8.7]] * 2
                                                   + [[0., 0., 12.]])}}
  assert label(t["clevr_count"], clevr) == 2                      # 5 objects
  assert label(t["clevr_distance"], clevr) == 2                   # 8.5 < 8.7 <= 9.0
  kitti = {"objects": {"type": tf.constant([3, 0, 1]),
                       "location": tf.constant([[0., 0., 5.], [0., 0., 15.], [0., 0., 30.]])}}
  assert label(t["kitti_distance"], kitti) == 1                   # closest vehicle 15 m
  no_vehicle = {"objects": {"type": tf.constant([3]), "location": tf.constant([[0., 0., 5.]])}}
  assert label(t["kitti_distance"], no_vehicle) == 3
  assert label(t["dsprites_orientation"], {"label_orientation": tf.constant(39)}) == 15
  assert label(t["dsprites_location"], {"label_x_position": tf.constant(31)}) == 15
  assert label(t["smallnorb_azimuth"], {"label_azimuth": tf.constant(17)}) == 17


def _data_config(task, **kw):
  c = vtab.vtab_config().data
  c.update(vtab_task=task, image_size=8, vtab_train_examples=6, vtab_val_examples=3, **kw)
  return c


def test_sources_on_mocked_tfds():
  import tensorflow_datasets as tfds
  with tfds.testing.mock_data(num_examples=10):
    train = vtab_tasks.build_source(_data_config("dtd"), split="train800", seed=0)
    assert (train.num_examples, train.image_shape, train.num_classes) == (6, (8, 8, 3), 47)
    batch = next(train.train_batches(4))
    assert batch["image"].shape == (4, 8, 8, 3) and batch["image"].dtype == np.uint8
    assert ((0 <= batch["label"]) & (batch["label"] < 47)).all()
    both = vtab_tasks.build_source(_data_config("dtd"), split="train800val200", seed=0)
    assert both.num_examples == 9
    test = vtab_tasks.build_source(_data_config("dtd"), split="test", seed=0)
    assert test.num_examples == 10
    batches = list(test.eval_batches(4))
    assert len(batches) == 3 and sum(int(b["mask"].sum()) for b in batches) == 10
    with pytest.raises(ValueError, match="evaluation-only"):
      test.train_batches(4)
    norb = vtab_tasks.build_source(_data_config("smallnorb_azimuth"), split="val200", seed=0)
    assert norb.image_shape == (8, 8, 3) and norb.num_examples == 3   # gray tiled to RGB


# ------------------------------------------------------------------- driver


def _fake_sweep_config():
  c = runpy.run_path(str(ROOT / "experiments" / "vtab.py"))["get_config"]("task=dtd,init=/ckpt")
  c.vtab.sweep.update(drop_path=[0.0, 0.1], augment=["spatial", "randaug_mixup"],
                      weight_decay=[0.1], lr=[1e-3, 1e-2], layer_decay=[0.8])
  return c


def test_sweep_picks_the_best_validation_point_and_retrains_it(tmp_path):
  calls = []

  def fake_runner(cfg, workdir):
    calls.append((cfg, workdir))
    if cfg.data.eval_split == "test":
      return 0.625
    # Best: lr 1e-2, randaug_mixup, drop path 0.1.
    return (0.5 + 10 * cfg.optim.base_lr + 0.01 * (cfg.randaugment.num_ops > 0)
            + 0.001 * cfg.model.drop_path * 10)

  c = _fake_sweep_config()
  result = vtab.run_task(c, tmp_path, "dtd", runner=fake_runner)
  assert len(calls) == 8 + 1
  assert result["best"] == "dp0.1_randaug_mixup_wd0.1_lr0.01_ld0.8"
  assert result["test_accuracy"] == 0.625 and len(result["val_accuracy"]) == 8
  final, final_dir = calls[-1]
  assert final_dir == tmp_path / "dtd" / "final"
  assert (final.data.train_split, final.data.eval_split) == ("train800val200", "test")
  assert (final.model.drop_path, final.optim.base_lr, final.optim.layer_decay) == (0.1, 1e-2, 0.8)
  assert final.randaugment.num_ops == 2 and final.mixup.cutmix_alpha == 1.0
  assert final.model.causal and final.init_from == "/ckpt" and final.data.vtab_task == "dtd"
  spatial = [cfg for cfg, wd in calls[:-1] if "_spatial_" in wd.name]
  assert spatial and all(cfg.randaugment.num_ops == 0 and cfg.mixup.mixup_alpha == 0
                         for cfg in spatial)
  assert all(cfg.data.train_split == "train800" and cfg.data.eval_split == "val200"
             for cfg, _ in calls[:-1])
  saved = json.loads((tmp_path / "dtd" / "result.json").read_text())
  assert saved["best"] == result["best"]


def test_suite_table_and_finished_runs_are_skipped(tmp_path):
  c = _fake_sweep_config()
  c.vtab.sweep.update(drop_path=[0.0], augment=["spatial"], lr=[1e-3])
  c.vtab.tasks = "dtd,eurosat,clevr_count"
  scores = {"dtd": 0.5, "eurosat": 0.9, "clevr_count": 0.3}
  results = vtab.run_suite(c, tmp_path, runner=lambda cfg, wd: scores[cfg.data.vtab_task])
  assert [r["task"] for r in results] == ["dtd", "eurosat", "clevr_count"]
  table = (tmp_path / "vtab_results.md").read_text()
  assert "| natural | dtd |" in table and "| specialized | 1 | 90.0 |" in table
  assert "| structured | 1 | 30.0 |" in table and "| all | 3 | 56.7 |" in table
  done = tmp_path / "done"
  done.mkdir()
  (done / "result.json").write_text(json.dumps({"accuracy": 0.42}))
  assert vtab.run_one(None, done) == 0.42           # no training: the run is finished


def test_one_vtab_finetune_run_on_mocked_tfds(tmp_path):
  import tensorflow_datasets as tfds
  c = runpy.run_path(str(ROOT / "experiments" / "vtab.py"))["get_config"]("task=dtd,sweep=single")
  point = vtab.sweep_points(c.vtab.sweep)[0]
  cfg = vtab.apply_point(c, point, task="dtd", train_split="train800", eval_split="test")
  cfg.update(total_steps=2, batch_size=4, log_every_steps=1, eval_every_steps=2,
             checkpoint_every_steps=2)
  cfg.data.update(image_size=8, vtab_train_examples=8)
  cfg.model.update(variant="mu/2", image_size=8, reference_image_size=8, dtype="float32")
  cfg.optim.update(warmup_steps=1, num_layers=2)
  with tfds.testing.mock_data(num_examples=6):
    acc = vtab.run_one(cfg, tmp_path / "run")
  assert 0.0 <= acc <= 1.0
  marker = tmp_path / "run" / "result.json"
  assert json.loads(marker.read_text())["eval_split"] == "test"
  # A torn marker (as a non-atomic writer killed half way would leave) is not
  # taken as finished: the run resumes at its last checkpoint, which has no
  # step left, takes the final accuracy from its metrics, and the marker is
  # whole again.
  marker.write_text('{"accur')
  with tfds.testing.mock_data(num_examples=6):
    assert vtab.run_one(cfg, tmp_path / "run") == pytest.approx(acc)
  assert json.loads(marker.read_text())["accuracy"] == pytest.approx(acc)
