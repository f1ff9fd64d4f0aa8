"""Resume on another topology (issue 56): a run checkpointed on N devices or P
processes continues on M devices or P' processes from the CLI with the state
as saved, the same global batches (the data streams of base.stream_rows),
and no example of the epoch repeated or skipped.

First the streams themselves, in this process (simulated processes): the
global batch of a run that started on S processes is the same read by any
number of processes. Then the CLI: a child runs ``darl_jax.main`` with two
recorders around it (``RECORDER``): the ids of the examples of every
training batch (each generated image's pixels are its id) and the state at
the save of the stop step and right after a restore.
"""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
import time

import numpy as np
import pytest
from PIL import Image

from darl_jax import config_lib
from darl_jax.data import base, build_source, convert
from darl_jax.data.sources import encoded
from xla_env import cpu_devices_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "tiny_config.py")
NUM_TRAIN = 48         # one epoch: 6 steps of 8
BATCH = 8
SHARD = 12             # 4 shards: files 0, 2 and 1, 3 are the two streams of 2 processes


def image_folder(root: pathlib.Path, first: int) -> pathlib.Path:
  """``root/train`` of 48 images with ids ``first, first + 1, ...`` and
  ``root/val`` of 4 more (ids 250-253): image i a constant colour whose red
  channel is i."""
  for split, ids in (("train", range(first, first + NUM_TRAIN)), ("val", range(250, 254))):
    os.makedirs(root / split)
    for i in ids:
      pixels = np.zeros((8, 8, 3), np.uint8) + np.asarray([i, 255 - i, 7], np.uint8)
      Image.fromarray(pixels).save(root / split / f"{i:03d}.png")
  return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  """{source: data overrides}: an image folder, tar shards and Parquet files of
  the same 48 training images (ids 0-47, and 4 validation ones); and a
  mixture of all three kinds, each of other images (tar 0-47, Parquet
  64-111, the folder 128-175)."""
  root = tmp_path_factory.mktemp("elastic")
  image_folder(root / "folder", 0)
  out = {"folder": {"name": "image_folder", "path": str(root / "folder")}}
  for fmt, name, ext in (("tar", "webdataset", "tar"), ("parquet", "parquet", "parquet"),
                        ("arrayrecord", "arrayrecord", "array_record")):
    convert.convert(str(root / "folder"), str(root / fmt), fmt, shard_size=SHARD)
    out[fmt] = {"name": name, "path": f"{root}/{fmt}/train-*.{ext}",
                "eval_path": f"{root}/{fmt}/validation-*.{ext}",
                "index_cache_dir": str(root / "index")}
  convert.convert(str(image_folder(root / "mix_parquet", 64)), str(root / "mix_parquet_files"),
                  "parquet", shard_size=SHARD)
  folder = image_folder(root / "mix_folder", 128)
  out["mixture"] = {"name": "mixture", "index_cache_dir": str(root / "index"),
                    "mixture": f"{out['tar']['path']}=1,{root}/mix_parquet_files/train-*.parquet"
                               f"=1,image_folder:{folder}=1"}
  return out


def ids_of(batch) -> list[int]:
  return [int(i) for i in batch["image"][:, 0, 0, 0]]


# ------------------------------------------------------ streams in-process


def as_process(monkeypatch, p, count):
  """Sources built as process p of ``count`` (the gathered counts are this
  process's, repeated: the test's streams are of equal size)."""
  monkeypatch.setattr(encoded, "this_process", lambda: (p, count))
  monkeypatch.setattr(encoded, "gather_ints",
                      lambda values, n: np.tile(np.asarray([values], np.int64), (n, 1)))


def test_stream_rows_tile_the_global_batch():
  for streams in (1, 2, 4, 8):
    for processes in (1, 2, 4, 8):
      rows = []
      for p in range(processes):
        parts = base.stream_rows(3, 8, p, processes, streams)
        assert sum(r.stop - r.start for _, r, _ in parts) == 8 // processes
        rows += [(g, int(pos)) for g, _, positions in parts for pos in positions]
      # Every stream's 8 / S positions of step 3, in stream order, once.
      per = 8 // streams
      assert rows == [(g, 3 * per + k) for g in range(streams) for k in range(per)]
  with pytest.raises(ValueError, match="not divisible by the 3 data streams"):
    base.stream_rows(0, 8, 0, 1, 3)


@pytest.mark.parametrize("fmt", ["tar", "parquet", "arrayrecord", "mixture"])
def test_the_global_batch_of_two_streams_on_any_process_count(data, fmt, monkeypatch):
  """A run started on 2 processes (2 streams) read by 1, 2 and 4 processes:
  the same global batches; each stream's epoch has every example once."""
  config = dict(data["tar" if fmt == "mixture" else fmt], image_size=8, channels=3,
                augment="spatial")
  if fmt == "mixture":
    config.update(name="mixture", mixture=f"{data['tar']['path']}=0.5,digits=0.5", channels=1)

  def global_batches(processes, steps=range(6)):
    out = []
    for step in steps:
      parts = []
      for p in range(processes):
        as_process(monkeypatch, p, processes)
        source = build_source(config, split="train", seed=4)
        state = {"next_step": step, "streams": 2}
        it = source.train_iterator(BATCH, start_step=step, process_index=p,
                                   process_count=processes, state=state)
        assert it.get_state() == state
        parts.append(next(it))
        it.close()
      out.append({k: np.concatenate([b[k] for b in parts]) for k in parts[0]})
    return out

  two = global_batches(2)
  for processes in (1, 4):
    for a, b in zip(two[2:5], global_batches(processes, range(2, 5))):
      np.testing.assert_array_equal(a["image"], b["image"])
  if fmt != "mixture":   # each stream's 24 examples once in its epoch (6 steps of 4 rows)
    for g in range(2):
      seen = [i for batch in two for i in ids_of(batch)[4 * g:4 * g + 4]]
      assert len(set(seen)) == 24
  # A run that starts on 4 processes makes 4 streams of its own files.
  as_process(monkeypatch, 0, 4)
  source = build_source(config, split="train", seed=4)
  assert source.train_iterator(BATCH, process_count=4).get_state()["streams"] == 4


def test_randaugment_keeps_the_streams_of_the_source_it_wraps(data, monkeypatch):
  """Fine-tuning's RandAugment wrapper reads its source's streams: a run
  started on 2 processes (2 streams of owned tar files) and read by 1
  process gives the same augmented global batches."""
  from darl_jax.data.transforms.randaugment import RandAugmentSource
  config = dict(data["tar"], image_size=8, channels=3, augment="spatial")

  def global_batch(processes, step=3):
    parts = []
    for p in range(processes):
      as_process(monkeypatch, p, processes)
      source = RandAugmentSource(build_source(config, split="train", seed=4), seed=4)
      assert source.default_streams(processes) == processes
      it = source.train_iterator(BATCH, start_step=step, process_index=p,
                                 process_count=processes, state={"next_step": step, "streams": 2})
      parts.append(next(it)["image"])
      it.close()
    return np.concatenate(parts)

  np.testing.assert_array_equal(global_batch(2), global_batch(1))


def test_one_stream_stays_one_and_a_stream_count_needs_owned_files(data, monkeypatch):
  config = dict(data["tar"], image_size=8, channels=3)
  single = build_source(config, split="train", seed=0)
  it = single.train_iterator(BATCH)
  assert it.get_state() == {"next_step": 0}    # one stream: nothing beside the step
  whole = next(it)
  # Resumed on 2 processes: both read their rows of the one global stream.
  as_process(monkeypatch, 1, 2)
  source = build_source(config, split="train", seed=0)
  resumed = source.train_iterator(BATCH, process_index=1, process_count=2,
                                  state={"next_step": 0})
  np.testing.assert_array_equal(next(resumed)["image"], whole["image"][4:])
  shared = build_source(dict(config, process_files="all"), split="train", seed=0)
  with pytest.raises(ValueError, match="made of 2 streams.*process_files=own"):
    shared.train_iterator(BATCH, process_index=1, process_count=2,
                          state={"next_step": 0, "streams": 2})
  folder = build_source(dict(data["folder"], image_size=8, channels=3), split="train", seed=0)
  with pytest.raises(ValueError, match="made of 4 streams"):
    folder.train_iterator(BATCH, state={"next_step": 0, "streams": 4})
  with pytest.raises(ValueError, match="streams must be a positive integer"):
    folder.train_iterator(BATCH, state={"next_step": 0, "streams": 0})


def test_a_stream_built_alone_is_what_the_split_is(tmp_path, monkeypatch):
  """Shards 1 and 3 all labeled, shard 4 without labels: the split is
  unlabeled, and so is stream 1 of 2 built by a process alone (files 1, 3)."""
  import image_files  # pylint: disable=g-import-not-at-top
  image_files.class_folder(tmp_path / "folder", (("train", 8),), shape=(8, 8), exts=("png",))
  convert.convert(str(tmp_path / "folder"), str(tmp_path / "tar"), "tar", shard_size=4)
  unlabeled = tmp_path / "tar" / "train-000004.tar"
  with tarfile.open(unlabeled, "w") as tar:
    tar.add(str(next((tmp_path / "folder" / "train" / "cat").glob("*.png"))), "x/0.png")
  config = {"name": "webdataset", "path": str(tmp_path / "tar" / "train-*.tar"),
            "eval_path": str(unlabeled), "image_size": 8, "channels": 3}
  as_process(monkeypatch, 0, 2)
  # (examples, unlabeled, classes) of each process: 0's files hold the unlabeled one.
  counts = np.asarray([[9, 1, 2], [8, 0, 2]], np.int64)
  monkeypatch.setattr(encoded, "gather_ints", lambda values, n: counts)
  source = build_source(config, split="train", seed=0)
  assert source.owner == (0, 2) and source.num_classes == 0
  other = source.stream_source(1, 2)
  assert other.owner == (1, 2) and other.size == 8
  assert other.num_classes == 0 and not other.labels.any()
  assert other.num_examples == source.num_examples


class _Sequential(base.DataSource):
  """A source read in order only, its stream cut by process (as tf.data's)."""
  image_shape, num_classes, num_examples = (2, 2, 1), 0, 8

  def train_batches(self, batch_size, start_step=0, process_index=0, process_count=1):
    local = batch_size // process_count
    while True:
      yield {"image": np.full((local, 2, 2, 1), process_index, np.uint8),
             "label": np.zeros(local, np.int32)}

  def eval_batches(self, batch_size, process_index=0, process_count=1, num_workers=0):
    return iter(())


def test_a_sequential_stream_resumes_on_its_process_count_only():
  source = _Sequential()
  it = source.train_iterator(4, start_step=3, process_index=1, process_count=2,
                             state={"next_step": 3, "processes": 2})
  next(it)
  assert it.get_state() == {"next_step": 4, "processes": 2}
  with pytest.raises(ValueError, match="read by 2 processes.*resume on 2 processes.*records"):
    source.train_iterator(4, start_step=4, process_count=1, state=it.get_state())
  # A checkpoint from before the record: the step alone, resumed as before.
  assert next(source.train_iterator(4, start_step=4, state={"next_step": 4}))["image"].shape[0] == 4


def test_the_topology_line():
  before = config_lib.topology({"data": 4, "fsdp": 2, "tensor": 1}, 2, 0)
  now = config_lib.topology({"data": 1, "fsdp": 2, "tensor": 1}, 1, 2)
  assert before["devices"] == 8 and now["devices"] == 2
  line = config_lib.topology_change({"topology": before}, now, 8, 2)
  assert line.startswith("resuming on another topology: 8 devices (data 4 x fsdp 2 x "
                         "tensor 1) in 2 process(es), 0 data worker(s) each -> 2 devices")
  assert "global batch (8)" in line and "2 stream(s)" in line and "\n" not in line
  assert config_lib.topology_change({"topology": now}, now, 8, 1) is None
  assert config_lib.topology_change({}, now, 8, 1) is None     # an older checkpoint


# ------------------------------------------------------------------ the CLI

RECORDER = textwrap.dedent("""\
    import json, os, sys

    import numpy as np

    OUT = os.environ["ELASTIC_OUT"]


    def record():
      import jax
      from jax.experimental import multihost_utils
      from darl_jax import checkpoint
      from darl_jax.data import pipeline

      def host(tree):
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        gathered = {jax.tree_util.keystr(k): np.asarray(
            multihost_utils.process_allgather(v, tiled=True)) for k, v in leaves}
        if jax.process_index() == 0:
          return gathered

      def dump(name, state):
        values = host(state)
        if values is not None:
          np.savez(os.path.join(OUT, name), **values)

      take = pipeline.StepIterator.__next__

      def next_recorded(self):      # the training iterator's batches and their ids
        step = self._next_step
        batch = take(self)
        if self._stop == pipeline.END:
          with open(os.path.join(OUT, f"ids_{jax.process_index()}.jsonl"), "a") as f:
            f.write(json.dumps({"step": step,
                                "ids": batch["image"][:, 0, 0, 0].tolist()}) + "\\n")
        return batch

      pipeline.StepIterator.__next__ = next_recorded
      save, restore = checkpoint.Checkpointer.save, checkpoint.Checkpointer.restore_newest

      def save_recorded(self, step, state, meta, **kw):
        if step == int(os.environ["ELASTIC_STOP"]):
          dump("saved.npz", state)
        return save(self, step, state, meta, **kw)

      def restore_recorded(self, *args, **kw):
        out = restore(self, *args, **kw)
        if out is not None:
          dump("restored.npz", out[1])
        return out

      checkpoint.Checkpointer.save = save_recorded
      checkpoint.Checkpointer.restore_newest = restore_recorded


    if __name__ == "__main__":      # Grain's spawned workers import this file
      import faulthandler, signal
      # wait() asks a run it is about to kill where its threads are.
      faulthandler.register(signal.SIGUSR2, all_threads=True)
      record()
      from darl_jax import main
      sys.argv = ["darl_jax.main", *sys.argv[1:]]
      main.cli()
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _overrides(data: dict, *, devices: int, steps: int, stop: int = 0, workers: int = 0):
  flags = [f"--config.total_steps={steps}", f"--config.batch_size={BATCH}",
           "--config.checkpoint_every_steps=2", "--config.eval_every_steps=0",
           "--config.predictions.num_images=0", "--config.data.augment=none",
           "--config.data.image_size=8", "--config.data.channels=3",
           "--config.model.channels=3", f"--config.data.num_workers={workers}",
           f"--config.stop_after_steps={stop}", "--config.sharding=fsdp",
           "--config.mesh.data=-1", f"--config.mesh.fsdp={min(devices, 2)}"]
  return flags + [f"--config.data.{k}={v}" for k, v in data.items()]


def start_cli(workdir: pathlib.Path, data: dict, *, processes: int = 1, devices: int,
              steps: int = 6, stop: int = 0, workers: int = 0):
  """Starts the training command in ``processes`` processes of ``devices``
  devices each; returns (the folder the recorder writes to, the processes)."""
  out = workdir.parent / f"{workdir.name}-{processes}x{devices}-{stop}"
  out.mkdir()
  # One script for the test's runs, written once: the second run of a pair
  # starts while the first run's interpreters may still be reading it (a
  # rewrite in place would truncate it under them).
  script = workdir.parent / "recorded_main.py"
  if not script.exists():
    tmp = script.with_suffix(".tmp")
    tmp.write_text(RECORDER)
    os.replace(tmp, script)
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if not k.startswith(("DARL_", "SLURM_"))}
  # PYTHONFAULTHANDLER: a process that dies of a signal says where, in its log.
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
             ELASTIC_OUT=str(out),
             ELASTIC_STOP=str(stop), XLA_FLAGS=cpu_devices_flags(devices),
             PYTHONPATH=str(ROOT))
  procs = []
  for p in range(processes):
    if processes > 1:
      env.update(DARL_COORDINATOR=f"127.0.0.1:{port}", DARL_NUM_PROCESSES=str(processes),
                 DARL_PROCESS_ID=str(p))
    log = open(out / f"log_{p}.txt", "w")
    procs.append(subprocess.Popen(
        [sys.executable, str(script), f"--config={TINY}", f"--workdir={workdir}",
         *_overrides(data, devices=devices * processes, steps=steps, stop=stop,
                     workers=workers)],
        cwd=ROOT, env=dict(env), stdout=log, stderr=subprocess.STDOUT))
    log.close()
  return out, procs


def wait(*runs, timeout: float = 400) -> list[pathlib.Path]:
  """Waits for runs of ``start_cli`` (started together: independent runs share
  the 2 cores, most of a run is one core's imports and compiles); on a
  failure or the timeout asks the rest for their threads' stacks (into
  their logs), kills them and fails naming each process's exit status (-9,
  or -12 before its stack handler was set: killed here) and the time, with
  the logs, the failed process's first."""
  procs = [(out, p, proc) for out, ps in runs for p, proc in enumerate(ps)]
  started = time.time()
  while (any(proc.poll() is None for _, _, proc in procs)
         and time.time() < started + timeout):
    if any(proc.poll() not in (None, 0) for _, _, proc in procs):
      break
    time.sleep(0.2)
  ended = time.time() - started
  first = [(out, p) for out, p, proc in procs if proc.poll() not in (None, 0)]
  alive = [proc for _, _, proc in procs if proc.poll() is None]
  for proc in alive:          # their threads' stacks into their logs first
    proc.send_signal(signal.SIGUSR2)
  time.sleep(2 if alive else 0)
  for proc in alive:
    proc.kill()
    proc.wait()
  if any(proc.returncode for _, _, proc in procs):
    status = ", ".join(f"{out.name}/{p}: {proc.returncode}" for out, p, proc in procs)
    order = first + [(out, p) for out, p, _ in procs if (out, p) not in first]
    logs = "\n".join(f"--- {out.name}/log_{p}.txt\n{(out / f'log_{p}.txt').read_text()[-6000:]}"
                     for out, p in order)
    failed = ", ".join(f"{o.name}/{p}" for o, p in first) or "none, the timeout"
    pytest.fail(f"a run failed or timed out after {ended:.0f} s (exit status: {status}; "
                f"first failed: {failed})\n{logs}")
  return [out for out, _ in runs]


def seen_ids(out: pathlib.Path, first: int, last: int) -> dict[int, list[int]]:
  """step -> the ids of its global batch (processes' rows in order), for
  iterator steps ``[first, last)`` (the feed reads ahead of the stop)."""
  by_step: dict[int, dict[int, list[int]]] = {}
  for f in sorted(out.glob("ids_*.jsonl")):
    p = int(f.stem.split("_")[1])
    for line in f.read_text().splitlines():
      record = json.loads(line)
      if first <= record["step"] < last:
        by_step.setdefault(record["step"], {})[p] = record["ids"]
  return {s: [i for p in sorted(rows) for i in rows[p]] for s, rows in sorted(by_step.items())}


def losses(workdir: pathlib.Path) -> dict[int, float]:
  out = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    if "loss" in record and "grad_norm" in record:
      out[record["step"]] = record["loss"]
  return out


def check_resumed(straight, stopped, resumed, *, stop: int, whole_epoch: bool, rtol: float):
  """The restored state is the saved one; the global batches are the
  straight run's, so the losses are too (to ``rtol``), and no example is
  seen twice: with ``whole_epoch`` the 6 steps are the epoch, every example
  once."""
  saved, restored = np.load(stopped / "saved.npz"), np.load(resumed / "restored.npz")
  assert sorted(saved.files) == sorted(restored.files)
  for key in saved.files:
    np.testing.assert_array_equal(saved[key], restored[key], err_msg=key)
  epoch = {**seen_ids(stopped, 0, stop), **seen_ids(resumed, stop, 6)}
  assert sorted(epoch) == list(range(6)) and epoch == seen_ids(straight, 0, 6)
  ids = [i for s in range(6) for i in epoch[s]]
  assert len(ids) == len(set(ids)) == 6 * BATCH, ids
  if whole_epoch:
    assert sorted(ids) == list(range(NUM_TRAIN))
  assert "resuming on another topology" in (resumed / "log_0.txt").read_text()
  want, got = losses(straight.parent / "straight"), losses(resumed.parent / resumed.name.split("-")[0])
  assert sorted(got) == list(range(1, 7))
  np.testing.assert_allclose([got[s] for s in range(1, 7)], [want[s] for s in range(1, 7)],
                             rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("source", ["folder", "tar", "parquet"])
def test_eight_devices_stopped_and_resumed_on_four_and_two(data, source, tmp_path):
  """8 devices (data 4 x fsdp 2), stopped after step 2, resumed on 4 (data 2
  x fsdp 2, with a data worker) and on 2 (fsdp 2). One process: one global
  stream. The losses agree to float32 rounding (rtol 1e-5): the devices sum
  the gradient's parts in another order."""
  straight, stopped = wait(start_cli(tmp_path / "straight", data[source], devices=8),
                           start_cli(tmp_path / "run", data[source], devices=8, stop=2))
  for devices in (4, 2):
    shutil.copytree(tmp_path / "run", tmp_path / f"on{devices}")
  resumed = wait(start_cli(tmp_path / "on4", data[source], devices=4, workers=1),
                 start_cli(tmp_path / "on2", data[source], devices=2))
  for out in resumed:
    check_resumed(straight, stopped, out, stop=2, whole_epoch=True, rtol=1e-5)


def test_two_processes_resumed_with_one_and_with_four(data, tmp_path):
  """2 processes of one device (FSDP across them), each reading its own tar
  and Parquet files (2 streams) beside a shared image folder, in one mixture
  of the three (one set of runs for the three kinds of source: each run
  here is several processes); stopped after step 2, resumed by 1 process of
  2 devices (with a data worker) and by 4 processes of one device: the
  same global batches."""
  mixture = data["mixture"]
  straight, stopped = wait(
      start_cli(tmp_path / "straight", mixture, processes=2, devices=1),
      start_cli(tmp_path / "run", mixture, processes=2, devices=1, stop=2))
  for processes in (1, 4):
    shutil.copytree(tmp_path / "run", tmp_path / f"with{processes}")
  # With a data worker: the streams' sources built here travel to it.
  resumed = wait(start_cli(tmp_path / "with1", mixture, processes=1, devices=2, workers=1),
                 start_cli(tmp_path / "with4", mixture, processes=4, devices=1))
  for out in resumed:
    check_resumed(straight, stopped, out, stop=2, whole_epoch=False, rtol=1e-5)
    assert "in its 2 stream(s)" in (out / "log_0.txt").read_text()
