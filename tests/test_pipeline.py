"""The Grain input pipeline (data/pipeline.py): workers, resume, sharding,
uint8 end to end, bad image files, reduced JPEG decoding."""

import io
import logging as py_logging
import os
import threading
import time
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from darl_jax.data import pipeline
from darl_jax.data.sources import digits, image_folder
from darl_jax.train import feed


class Cfg:
  image_size, channels, augment = 8, 1, "spatial"


@pytest.fixture(scope="module")
def source():
  return digits.build(Cfg, split="train", seed=3)


def take(it, n):
  return [next(it) for _ in range(n)]


def assert_same_batches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_workers_give_the_batches_of_the_training_process(source):
  """2 worker processes build the same batches, in the same order, as none."""
  plain = take(source.train_iterator(32, start_step=5, num_workers=0), 6)
  workers = source.train_iterator(32, start_step=5, num_workers=2)
  try:
    assert_same_batches(take(workers, 6), plain)
  finally:
    workers.close()
  assert plain[0]["image"].dtype == np.uint8 and plain[0]["label"].dtype == np.int32


def test_resume_from_the_iterator_state_is_bit_identical(source):
  """A killed run's saved state (get_state after step 3's batch) restarts the
  stream exactly where it was, with or without workers; so does start_step;
  a state that disagrees with the checkpoint's step is refused."""
  straight = take(source.train_iterator(16, num_workers=0), 7)
  first = source.train_iterator(16, num_workers=0)
  take(first, 3)
  state = first.get_state()
  assert state == {"next_step": 3}
  resumed = source.train_iterator(16, start_step=3, num_workers=2, state=state)
  try:
    assert_same_batches(take(resumed, 4), straight[3:])
  finally:
    resumed.close()
  assert_same_batches(take(source.train_iterator(16, start_step=3), 4), straight[3:])
  moved = source.train_iterator(16, num_workers=0)
  moved.set_state({"next_step": 5})
  assert_same_batches(take(moved, 2), straight[5:7])
  with pytest.raises(ValueError, match="inconsistent"):
    source.train_iterator(16, start_step=4, state=state)


def test_processes_share_every_example_once_per_epoch(source):
  """P processes' slices of the first epoch's stream positions hold every
  example exactly once, and together they are the 1-process batches."""
  n, batch = source.num_examples, 64
  steps = -(-n // batch)
  for processes in (1, 2, 4):
    seen = []
    for step in range(steps):
      for p in range(processes):
        idx, pos = source.train_indices(step, batch, p, processes)
        seen.append(idx[pos < n])
    seen = np.concatenate(seen)
    assert len(seen) == n and set(seen.tolist()) == set(range(n))
  whole = source.train_batch(2, batch)
  halves = [source.train_batch(2, batch, p, 2) for p in (0, 1)]
  np.testing.assert_array_equal(np.concatenate([h["image"] for h in halves]), whole["image"])


def test_uint8_on_the_wire_and_floats_on_the_device(source):
  """Batches cross to the device as uint8; the step's input conversion maps
  0..255 onto [-1, 1] exactly as the host used to."""
  it = source.train_iterator(16, num_workers=0)
  sharding = None
  import jax
  sharding = jax.sharding.NamedSharding(
      jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",)),
      jax.sharding.PartitionSpec("data"))
  device_feed = feed.DeviceFeed(it, sharding)
  try:
    batch, state = next(device_feed)
  finally:
    device_feed.close()
  assert batch["image"].dtype == jnp.uint8 and state == {"next_step": 1}
  x = feed.model_input(batch)["image"]
  assert x.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(x), np.asarray(batch["image"]) / 127.5 - 1, atol=1e-6)
  assert float(feed.model_input({"image": jnp.array([0, 255], jnp.uint8)})["image"][0]) == -1.0


class _SlowReader:
  """A host iterator whose ``next`` takes ``seconds`` and that records when
  each read and its ``close`` happened (a reader closed under a read in
  flight is what close() must avoid)."""

  def __init__(self, seconds):
    self.seconds, self.events, self.reading = seconds, [], threading.Event()

  def __iter__(self):
    return self

  def __next__(self):
    self.reading.set()
    time.sleep(self.seconds)
    self.events.append("read")
    return {"image": np.zeros((2, 2, 2, 1), np.uint8)}

  def close(self):
    self.events.append("closed")


def test_the_feed_closes_its_reader_after_the_read_in_flight(caplog):
  import jax
  sharding = jax.sharding.NamedSharding(
      jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",)),
      jax.sharding.PartitionSpec("data"))
  # Longer than the 5 s the feed once waited before closing the reader anyway.
  reader = _SlowReader(6.0)
  device_feed = feed.DeviceFeed(reader, sharding, size=1)
  assert reader.reading.wait(10)        # the producer is inside a read
  device_feed.close()
  assert reader.events == ["read", "closed"]
  # A read that outlasts STOP_TIMEOUT_S: closed under it, with a warning
  # (the read runs on after the test, in the daemon thread: its length is
  # the margin against a slow close, not time the test waits).
  reader = _SlowReader(20.0)
  device_feed = feed.DeviceFeed(reader, sharding, size=1)
  assert reader.reading.wait(10)
  with mock.patch.object(feed, "STOP_TIMEOUT_S", 0.2), caplog.at_level(py_logging.WARNING):
    device_feed.close()
  assert reader.events == ["closed"]
  assert "still reading a batch" in caplog.text


def _jpeg(path, size=(96, 80), seed=0):
  rng = np.random.default_rng(seed)
  low = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
  Image.fromarray(low).resize(size, Image.BICUBIC).save(path, "JPEG", quality=90)


def test_bad_files_are_skipped_and_other_formats_read(tmp_path, caplog):
  """A truncated JPEG and a text file named .png are replaced by the next
  readable example (logged, never raised, at every rerun); GIF, TIFF, BMP and
  WebP are read; other extensions are listed as ignored."""
  for i in range(6):
    _jpeg(tmp_path / f"ok_{i}.jpg", seed=i)
  good = (tmp_path / "ok_0.jpg").read_bytes()
  (tmp_path / "bad_truncated.jpg").write_bytes(good[:len(good) // 2])
  (tmp_path / "bad_text.png").write_text("not an image")
  img = Image.open(tmp_path / "ok_1.jpg")
  for ext in ("gif", "tif", "bmp", "webp"):
    img.save(tmp_path / f"other.{ext}")
  (tmp_path / "notes.txt").write_text("ignored")
  with caplog.at_level(py_logging.WARNING):
    src = image_folder.build({"path": str(tmp_path), "image_size": 16, "channels": 3,
                              "augment": "spatial", "val_split_size": 0},
                             split="train", seed=0)
    assert src.num_examples == 12
    assert "ignoring 1 file(s)" in caplog.text and "notes.txt" in caplog.text
    for _ in range(2):     # a rerun meets the same files and goes on again
      batch = src.train_batch(0, 12)
      assert batch["image"].shape == (12, 16, 16, 3) and batch["image"].dtype == np.uint8
  assert "bad_truncated.jpg" in caplog.text and "bad_text.png" in caplog.text
  evals = list(src.eval_batches(8))
  assert sum(int(b["mask"].sum()) for b in evals) == 12


def test_an_oversized_val_split_falls_back_to_a_tenth(tmp_path, caplog):
  """The ImageNet configs' val_split_size=5000 on a small flat folder."""
  for i in range(20):
    _jpeg(tmp_path / f"{i}.jpg", seed=i)
  with caplog.at_level(py_logging.WARNING):
    val = image_folder.build({"path": str(tmp_path), "image_size": 8, "channels": 3,
                              "val_split_size": 5000}, split="validation", seed=0)
  assert val.num_examples == 2 and "holding out 2" in caplog.text


def test_reduced_jpeg_decode_is_close_to_the_full_decode(tmp_path):
  """A 480x400 JPEG cropped whole to 64x64: decoded at 1/4 scale by DCT, the
  result stays within a few grey levels of resizing the full decode."""
  path = tmp_path / "big.jpg"
  _jpeg(path, size=(480, 400), seed=7)
  box = (0.0, 0.0, 480.0, 400.0)
  with Image.open(path) as img:
    reduced = image_folder.reduced_decode(img, box, 64)
    assert reduced.size == (120, 100)             # 1/4 scale still covers 64 px
    small = np.asarray(reduced.convert("RGB").resize(
        (64, 64), Image.BILINEAR, box=(0, 0, 120, 100)), np.float32)
  with Image.open(path) as img:
    full = np.asarray(img.convert("RGB").resize((64, 64), Image.BILINEAR, box=box),
                      np.float32)
  assert np.abs(small - full).mean() < 3.0
  # A crop that needs full resolution is decoded at full size.
  with Image.open(path) as img:
    assert image_folder.reduced_decode(img, (0, 0, 60, 60), 64).size == (480, 400)


def test_auto_workers_take_the_hosts_share_of_cores(monkeypatch):
  monkeypatch.setattr(pipeline, "host_cores", lambda: 16)
  monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
  monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
  monkeypatch.delenv("DARL_PROCESSES_PER_HOST", raising=False)
  assert pipeline.resolve_num_workers(-1) == 16
  monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
  assert pipeline.resolve_num_workers(-1) == 8
  assert pipeline.resolve_num_workers(3) == 3 and pipeline.resolve_num_workers(0) == 0
  monkeypatch.setattr(pipeline, "host_cores", lambda: 2)
  monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
  assert pipeline.resolve_num_workers(-1) == 1


def test_tfds_records_are_a_random_access_source():
  """data.backend=records reads a TFDS dataset record by record (no tf.data):
  uint8 crops, labels from the records, resumable like any indexed source."""
  tfds = pytest.importorskip("tensorflow_datasets")
  from darl_jax.data import build_source
  from darl_jax.data.sources import tfds_records
  with tfds.testing.mock_data(num_examples=12):
    src = build_source({"name": "imagenet2012", "image_size": 16, "channels": 3,
                        "augment": "spatial", "backend": "records", "val_split_size": 0},
                       split="train", seed=0)
    assert isinstance(src, tfds_records.TfdsRecordSource) and src.num_examples == 12
    straight = take(src.train_iterator(4, num_workers=0), 4)
    assert straight[0]["image"].shape == (4, 16, 16, 3) and straight[0]["image"].dtype == np.uint8
    assert (straight[0]["label"] < 1000).all()
    assert_same_batches(take(src.train_iterator(4, start_step=2, state={"next_step": 2}), 2),
                        straight[2:])
    evals = list(src.eval_batches(8))
    assert sum(int(b["mask"].sum()) for b in evals) == 12


def test_tfds_records_name_the_array_record_command():
  from types import SimpleNamespace
  from darl_jax.data.sources import tfds_records
  builder = SimpleNamespace(info=SimpleNamespace(file_format="tfrecord", features={},
                                                 splits={"train": None}))
  with pytest.raises(ValueError, match="--file_format=array_record"):
    tfds_records.build({}, builder, name="imagenet2012", split="train", data_dir="/d",
                       seed=0, crop_fraction=1.0)


def test_step_clock_splits_wall_time_into_steps_input_wait_and_the_rest(monkeypatch):
  """A window of 4 steps over 2 s with 0.5 s waiting for input: 500 ms a
  step, a quarter input-bound; time outside windows (an evaluation) and the
  waits count against goodput."""
  now = [100.0]
  monkeypatch.setattr(feed.time, "perf_counter", lambda: now[0])

  class FakeFeed:
    wait_s = 0.0

  source = FakeFeed()
  clock = feed.StepClock(source)           # the run starts at t = 100
  now[0] = 101.0
  clock.skip()                              # 1 s of start-up and compilation
  for _ in range(4):
    clock.tick()
  source.wait_s += 0.5
  now[0] = 103.0
  first = clock.window()
  assert first["step_time_ms"] == 500.0 and first["input_wait_fraction"] == 0.25
  assert first["goodput"] == 1.5 / 3.0     # 1.5 s of stepping in 3 s of run
  now[0] = 104.0
  clock.skip()                              # a 1 s evaluation
  clock.tick()
  now[0] = 105.0
  second = clock.window()
  assert second["input_wait_fraction"] == 0.0 and second["goodput"] == 2.5 / 5.0
  assert clock.window() == {}               # no steps, no window
