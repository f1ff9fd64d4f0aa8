"""Tests for darl_jax.metrics (metrics.jsonl, TensorBoard backends, Progress)."""

import importlib
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import types

import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import metrics
from darl_jax.metrics import MetricWriter, Progress, read_metrics

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[1])


def _strict_json(line):
  """json.loads that rejects NaN/Infinity, like strict parsers do."""
  def reject(token):
    raise ValueError(f"non-standard JSON constant {token}")
  return json.loads(line, parse_constant=reject)


def test_jsonl_one_object_per_write(tmp_path):
  writer = MetricWriter(str(tmp_path), tensorboard=False)
  writer.write_scalars(1, {"loss": 0.5, "lr": np.float32(0.25)})
  writer.write_scalars(2, {"loss": jnp.asarray(0.125), "n": np.int64(3)})
  writer.write_scalars(3, {"loss": jnp.bfloat16(2.0), "flag": True})
  # Flushed per write: readable before close(), as after a kill.
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 3
  records = [_strict_json(l) for l in lines]
  assert records == [
      {"step": 1, "loss": 0.5, "lr": 0.25},
      {"step": 2, "loss": 0.125, "n": 3},
      {"step": 3, "loss": 2.0, "flag": 1},
  ]
  assert isinstance(records[1]["n"], int)
  assert read_metrics(str(tmp_path)) == records
  writer.close()
  # A resumed run appends to the same file.
  with MetricWriter(str(tmp_path), tensorboard=False) as writer:
    writer.write_scalars(4, {"loss": 1.0})
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3, 4]


def test_non_finite_values_are_null(tmp_path):
  with MetricWriter(str(tmp_path), tensorboard=False) as writer:
    writer.write_scalars(5, {"loss": float("nan"), "g": np.float32(np.inf),
                             "h": jnp.asarray(-jnp.inf), "ok": 1.5})
  line = (tmp_path / "metrics.jsonl").read_text().strip()
  assert _strict_json(line) == {"step": 5, "loss": None, "g": None, "h": None,
                                "ok": 1.5}


def test_rejects_non_scalars(tmp_path):
  with MetricWriter(str(tmp_path), tensorboard=False) as writer:
    with pytest.raises(TypeError, match="'vec'"):
      writer.write_scalars(1, {"vec": np.ones(3)})
    with pytest.raises(TypeError, match="'name'"):
      writer.write_scalars(1, {"name": "abc"})


def test_read_metrics_tolerates_truncated_last_line(tmp_path):
  assert read_metrics(str(tmp_path)) == []
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
  assert read_metrics(str(tmp_path)) == [{"step": 1, "loss": 2.0}]


def test_write_config(tmp_path):
  config = {"model": {"width": 192, "depth": 12}, "lr": 1e-3,
            "image_shape": (28, 28, 1), "name": "darl"}
  with MetricWriter(str(tmp_path), tensorboard=False) as writer:
    writer.write_config(config)
  text = (tmp_path / "config.json").read_text()
  loaded = json.loads(text)
  assert loaded == {"model": {"depth": 12, "width": 192}, "lr": 1e-3,
                    "image_shape": [28, 28, 1], "name": "darl"}
  assert list(loaded) == sorted(loaded)  # sorted keys
  assert '\n  "image_shape": [\n    28,' in text  # indent 2


def test_non_main_process_writes_nothing(tmp_path):
  workdir = tmp_path / "run"
  writer = MetricWriter(str(workdir), is_main_process=False)
  writer.write_scalars(1, {"loss": 1.0})
  writer.write_images(1, {"x": np.zeros((1, 4, 4, 1), np.uint8)})
  writer.write_config({"a": 1})
  writer.flush()
  writer.close()
  assert not workdir.exists()


class _EventsFile:
  """A TensorBoard backend that writes one file per writer opened, as real
  ones start a new events file: how many opened shows in the folder."""

  name = "events-file"

  def __init__(self, logdir):
    self._path = pathlib.Path(logdir) / f"events.{len(list(pathlib.Path(logdir).iterdir()))}"
    self._path.write_text("")

  def _append(self, line):
    with self._path.open("a") as f:
      f.write(line + "\n")

  def scalars(self, step, scalars):
    self._append(f"scalars {step}")

  def images(self, step, images):
    self._append(f"images {step} {sorted(images)}")

  def text(self, step, tag, text):
    self._append(f"text {step} {tag}")

  def flush(self):
    pass

  def close(self):
    pass


def test_a_finished_run_rerun_only_rewrites_its_prediction_picture(tmp_path, monkeypatch):
  from darl_jax.train import loop
  from darl_jax.train.trainers import pretrain
  import tiny_config  # pylint: disable=g-import-not-at-top  # tests/, on pytest's path
  monkeypatch.setattr(metrics, "_make_tensorboard_backend", _EventsFile)
  config = tiny_config.get_config("steps=2")
  config.update(tensorboard=True, eval_every_steps=2, checkpoint_every_steps=2)
  workdir = tmp_path / "run"

  def files():
    return {str(p.relative_to(workdir)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in workdir.rglob("*") if p.is_file()}

  loop.run(pretrain.PretrainTrainer(config), config, str(workdir))
  first = files()
  assert {"config.json", "metrics.jsonl", "predictions.png", "tensorboard/events.0"} <= set(first)
  assert "images 2 ['predictions']" in (workdir / "tensorboard" / "events.0").read_text()
  # The rerun resumes at step 2 = total_steps: nothing to train.
  loop.run(pretrain.PretrainTrainer(config), config, str(workdir))
  again = files()
  assert sorted(set(first) | set(again)) == sorted(first)      # no file added or removed
  assert [k for k in first if again[k] != first[k]] == ["predictions.png"]
  assert again["predictions.png"][0] > first["predictions.png"][0]
  assert [r["step"] for r in read_metrics(str(workdir))] == [1, 2]   # logged once each


def test_a_finished_writer_writes_nothing(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
  writer = MetricWriter(str(tmp_path), tensorboard=True)
  writer.start(1, {"a": 1}, finished=True)
  writer.write_scalars(1, {"loss": 2.0})
  writer.write_images(1, {"x": np.zeros((1, 4, 4, 1), np.uint8)})
  writer.close()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
  assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


def _clu_importable():
  try:
    importlib.import_module("clu.metric_writers")
    return True
  except Exception:  # pylint: disable=broad-except
    return False


@pytest.mark.skipif(not _clu_importable(),
                    reason="clu.metric_writers does not import (needs "
                           "tensorflow and the tensorboard package)")
def test_tensorboard_event_files_with_clu(tmp_path):
  with MetricWriter(str(tmp_path)) as writer:
    assert writer.tensorboard_backend == "clu"
    writer.write_scalars(1, {"loss": 0.5})
    writer.write_scalars(2, {"loss": float("nan")})
    writer.write_images(2, {"samples": np.random.rand(2, 8, 8, 1)})
    writer.write_config({"a": 1})
  events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
  assert events
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tags = set()
  for event in tf.compat.v1.train.summary_iterator(str(events[0])):
    tags.update(v.tag for v in event.summary.value)
  assert {"loss", "samples", "config"} <= tags
  assert len(read_metrics(str(tmp_path))) == 2


class _RecordingSummaryWriter:
  """Stands in for torch.utils.tensorboard.SummaryWriter."""

  instances = []

  def __init__(self, log_dir):
    self.log_dir = log_dir
    self.calls = []
    self.closed = False
    _RecordingSummaryWriter.instances.append(self)

  def add_scalar(self, tag, value, global_step):
    self.calls.append(("scalar", tag, value, global_step))

  def add_images(self, tag, images, global_step, dataformats):
    self.calls.append(("images", tag, images, global_step, dataformats))

  def add_text(self, tag, text, global_step):
    self.calls.append(("text", tag, text, global_step))

  def flush(self):
    pass

  def close(self):
    self.closed = True


def test_torch_fallback_when_clu_missing(tmp_path, monkeypatch):
  fake = types.ModuleType("torch.utils.tensorboard")
  fake.SummaryWriter = _RecordingSummaryWriter
  monkeypatch.setitem(sys.modules, "clu.metric_writers", None)
  monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
  _RecordingSummaryWriter.instances.clear()
  writer = MetricWriter(str(tmp_path))
  assert writer.tensorboard_backend == "torch.utils.tensorboard"
  writer.write_scalars(3, {"loss": np.float32(0.5), "bad": float("nan")})
  writer.write_images(3, {"img": np.array([[[[0.0], [1.0]]]])})  # [1,1,2,1]
  writer.write_config({"a": 1})
  writer.close()
  (tb,) = _RecordingSummaryWriter.instances
  assert tb.log_dir == str(tmp_path / "tensorboard") and tb.closed
  assert tb.calls[0] == ("scalar", "loss", 0.5, 3)
  assert tb.calls[1][:2] == ("scalar", "bad") and np.isnan(tb.calls[1][2])
  kind, tag, images, step, fmt = tb.calls[2]
  assert (kind, tag, step, fmt) == ("images", "img", 3, "NHWC")
  assert images.dtype == np.uint8 and images.ravel().tolist() == [0, 255]
  assert tb.calls[3][:2] == ("text", "config") and '"a": 1' in tb.calls[3][2]
  assert read_metrics(str(tmp_path)) == [{"step": 3, "loss": 0.5, "bad": None}]


_BLOCKED_SCRIPT = textwrap.dedent("""
    import sys
    # Simulate the GPU machines: no TensorFlow, hence no clu.metric_writers,
    # and (here) no torch / tensorboardX either.
    for name in ("clu.metric_writers", "tensorflow", "torch",
                 "torch.utils.tensorboard", "tensorboardX"):
      sys.modules[name] = None
    import numpy as np
    from darl_jax.metrics import MetricWriter, read_metrics
    writer = MetricWriter(sys.argv[1])
    assert writer.tensorboard_backend is None
    writer.write_scalars(1, {"loss": 0.5})
    writer.write_images(1, {"x": np.zeros((1, 4, 4, 3), np.uint8)})
    writer.write_config({"a": 1})
    writer.write_scalars(2, {"loss": 0.25})
    writer.close()
    assert "tensorflow" not in sys.modules or sys.modules["tensorflow"] is None
    print("RECORDS", read_metrics(sys.argv[1]))
""")


def test_without_clu_writes_jsonl_and_warns_once(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _BLOCKED_SCRIPT, str(tmp_path)],
                        env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert ("RECORDS [{'step': 1, 'loss': 0.5}, {'step': 2, 'loss': 0.25}]"
          in proc.stdout)
  assert proc.stderr.count("TensorBoard logging disabled") == 1, proc.stderr
  assert "clu.metric_writers" in proc.stderr  # the warning says why
  assert json.loads((tmp_path / "config.json").read_text()) == {"a": 1}


def test_progress_rate_and_eta():
  clock = iter([100.0, 102.0, 104.0, 104.0])
  progress = Progress(total_steps=1000, batch_size=64, start_step=100,
                      time_fn=lambda: next(clock))
  out = progress.update(110, {"loss": 0.123449})
  assert out["steps_per_sec"] == pytest.approx(5.0)
  assert out["img_per_sec"] == pytest.approx(320.0)
  # 890 steps left at 5 steps/s = 178 s.
  assert progress.last_line == (
      "step 110/1000 | loss 0.1234 | 320.0 img/s | ETA 2m58s")

  # The rate is measured between calls, not averaged since the start.
  out = progress.update(130, {"loss": 0.1})
  assert out["steps_per_sec"] == pytest.approx(10.0)
  assert progress.last_line.endswith("640.0 img/s | ETA 1m27s")

  # No elapsed time: rate unknown rather than a division by zero.
  out = progress.update(130, {})
  assert np.isnan(out["img_per_sec"])
  assert progress.last_line == "step 130/1000 | ? img/s | ETA ?"


def test_format_duration():
  assert metrics.format_duration(45.2) == "45s"
  assert metrics.format_duration(192) == "3m12s"
  assert metrics.format_duration(7507) == "2h05m07s"
  assert metrics.format_duration(float("inf")) == "?"
