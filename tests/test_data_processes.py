"""Files owned by processes (data.process_files, data/sources/encoded.py): with P > 1
processes each reads only its own training files, the processes' streams
never share an example, epochs count every process's examples, and resume
and a mixture hold. Simulated processes in this process, then two real ones
joined by jax.distributed."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import tarfile
import textwrap

import numpy as np
import pytest

from darl_jax.data import build_source, convert, holdout
from darl_jax.data.sources import encoded
import image_files

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLASSES = image_files.CLASSES
PER_CLASS = 12          # 24 training images: 4 shards of 6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  """{format: (train pattern, eval pattern)} for tar, arrayrecord and parquet,
  the same 24 training and 6 validation images in each."""
  root = tmp_path_factory.mktemp("procs")
  image_files.class_folder(root / "folder", (("train", PER_CLASS), ("val", 3)), shape=(9, 10),
                           exts=("png",))
  out = {}
  for fmt, ext in (("tar", "tar"), ("arrayrecord", "array_record")):
    convert.convert(str(root / "folder"), str(root / fmt), fmt, shard_size=6)
    out[fmt] = (f"{root}/{fmt}/train-{{000000..000003}}.{ext}", f"{root}/{fmt}/validation-*.{ext}")
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  os.makedirs(root / "parquet")
  for split, parts in (("train", 4), ("val", 1)):
    files = sorted((root / "folder" / split).rglob("*.png"))
    labels = [CLASSES.index(f.parent.name) for f in files]
    for k in range(parts):
      sel = slice(k * len(files) // parts, (k + 1) * len(files) // parts)
      pq.write_table(pa.table({"image": [f.read_bytes() for f in files[sel]],
                               "label": labels[sel]}),
                     root / "parquet" / f"{split}-{k}.parquet", row_group_size=3)
  out["parquet"] = (f"{root}/parquet/train-*.parquet", f"{root}/parquet/val-*.parquet")
  return out


NAMES = {"tar": "webdataset", "arrayrecord": "arrayrecord", "parquet": "parquet"}


def cfg(data, fmt, **kw):
  path, eval_path = data[fmt]
  return {"name": NAMES[fmt], "path": path, "eval_path": eval_path, "image_size": 8,
          "channels": 3, "augment": "spatial", **kw}


def as_process(monkeypatch, p, count):
  """Builds sources as process p of ``count``: every process's gathered
  values are taken to be this one's (the test data is symmetric)."""
  monkeypatch.setattr(encoded, "this_process", lambda: (p, count))
  monkeypatch.setattr(encoded, "gather_ints",
                      lambda values, n: np.tile(np.asarray([values], np.int64), (n, 1)))


def file_of(source, index):
  ids = getattr(source, "shard_ids", None)
  return source.files[int((ids if ids is not None else source.file_ids)[index])]


@pytest.mark.parametrize("fmt", ["tar", "arrayrecord", "parquet"])
def test_each_process_reads_only_its_own_files(data, fmt, monkeypatch):
  sources = []
  for p in range(2):
    as_process(monkeypatch, p, 2)
    sources.append(build_source(cfg(data, fmt), split="train", seed=3))
  seen = []
  for p, source in enumerate(sources):
    assert source.owner == (p, 2) and source.size == 12 and source.num_examples == 24
    own = set(sorted({f for f in source.files})[p::2])
    # One epoch of the process's own stream: 3 steps of 4 local rows.
    idx = np.concatenate([source.train_indices(s, 8, p, 2)[0] for s in range(3)])
    assert sorted(idx) == list(range(12))
    assert {file_of(source, i) for i in idx} == own
    seen += [source.names[i] for i in idx]
    batch = source.train_batch(0, 8, p, 2)
    assert batch["image"].shape == (4, 8, 8, 3)
    # Its indices name its own examples; another process's rows come from
    # that process's stream, which it builds from those files when asked.
    with pytest.raises(ValueError, match="process 1 of 2|process 0 of 2"):
      source.train_indices(0, 8, 1 - p, 2)
  for p, source in enumerate(sources):
    np.testing.assert_array_equal(source.train_batch(1, 8, 1 - p, 2)["image"],
                                  sources[1 - p].train_batch(1, 8, 1 - p, 2)["image"])
  # The two streams share no example, and together cover the split.
  assert len(seen) == len(set(seen)) == 24
  # Validation is every process's slice of the whole split.
  val = build_source(cfg(data, fmt), split="validation", seed=3)
  assert val.owner is None and val.num_examples == 6


def test_one_process_and_all_read_the_global_stream(data, monkeypatch):
  single = build_source(cfg(data, "tar"), split="train", seed=3)
  assert single.owner is None
  as_process(monkeypatch, 1, 2)
  shared = build_source(cfg(data, "tar", process_files="all"), split="train", seed=3)
  assert shared.owner is None and shared.size == 24
  np.testing.assert_array_equal(shared.train_batch(2, 8, 1, 2)["image"],
                                single.train_batch(2, 8, 0, 1)["image"][4:])


def test_resume_eval_and_bad_settings(data, monkeypatch, tmp_path):
  as_process(monkeypatch, 1, 2)
  source = build_source(cfg(data, "parquet"), split="train", seed=0)
  it = source.train_iterator(8, process_index=1, process_count=2)
  straight = [next(it)["image"] for _ in range(5)]
  assert it.get_state() == {"next_step": 5, "streams": 2}   # one stream per process
  resumed = source.train_iterator(8, start_step=3, process_index=1, process_count=2,
                                  state={"next_step": 3, "streams": 2})
  np.testing.assert_array_equal(next(resumed)["image"], straight[3])
  # An evaluation pass over the owned training split: its own 12 rows.
  batches = list(source.eval_batches(8, 1, 2))
  assert len(batches) == 3 and sum(int(b["mask"].sum()) for b in batches) == 12
  with pytest.raises(ValueError, match="process_files=all"):
    holdout.split(source, 2)
  with pytest.raises(ValueError, match="process_files must be one of own, all"):
    build_source(cfg(data, "parquet", process_files="mine"), split="train", seed=0)
  as_process(monkeypatch, 0, 8)
  with pytest.raises(ValueError, match="4 file.* for 8 processes.*process_files='all'"):
    build_source(cfg(data, "tar"), split="train", seed=0)
  # A process whose own files hold nothing: every process says so (the gathered
  # counts), none waits for the others.
  empty = str(tmp_path / "empty.tar")
  tarfile.open(empty, "w").close()
  first = data["tar"][0].replace("{000000..000003}", "000000")
  files = sorted([first, empty])
  as_process(monkeypatch, files.index(empty), 2)   # the process that owns the empty file
  with pytest.raises(ValueError, match="has no samples among its files.*process_files='all'"):
    build_source(cfg(data, "tar", path=f"{first},{empty}"), split="train", seed=0)
  as_process(monkeypatch, 0, 2)
  with pytest.raises(ValueError, match="fewer than its 16 rows"):
    source = build_source(cfg(data, "tar"), split="train", seed=0)
    source.train_batch(0, 32, 0, 2)


def test_a_hash_split_holds_out_the_same_examples_on_every_process(data, monkeypatch):
  """Without data.eval_path every process lists every file (the hash split
  needs all keys) but trains only on its own files' remaining examples."""
  config = {**cfg(data, "tar"), "eval_path": None, "val_split_size": 4}
  val = build_source(config, split="validation", seed=0)
  held = set(val.names)
  assert len(held) == 4
  trained = []
  for p in range(2):
    monkeypatch.setattr(encoded, "this_process", lambda p=p: (p, 2))
    monkeypatch.setattr(encoded, "gather_ints",
                        lambda values, n: np.asarray([values, values], np.int64))
    source = build_source(config, split="train", seed=0)
    own = set(source.files[p::2])
    assert {file_of(source, i) for i in range(source.size)} <= own
    trained += list(source.names)
  assert not held & set(trained) and len(trained) == len(set(trained)) == 20


def test_a_mixture_of_owned_and_shared_components(data, monkeypatch):
  """Owned tar shards beside digits (an in-memory source that every process
  holds): each process mixes its own stream and no example of either is read
  by both processes."""
  seen = {"tar": [], "digits": []}
  for p in range(2):
    as_process(monkeypatch, p, 2)
    mix = build_source(cfg(data, "tar", name="mixture",
                           mixture=f"{data['tar'][0]}=0.5,digits=0.5", channels=1),
                       split="train", seed=1)
    assert mix.owner == (p, 2)
    tar, digits = mix.components
    comp, pos = mix.assign(np.arange(0, 20, dtype=np.int64))
    for j, (name, source) in enumerate((("tar", tar), ("digits", digits))):
      idx, counters = source.process_stream(pos[comp == j], p, 2)
      assert (counters % 2 == p).all()
      seen[name] += [(name, int(i)) if name == "digits" else source.names[i] for i in idx]
    assert mix.train_batch(0, 40, p, 2)["image"].shape == (20, 8, 8, 1)
  for name, items in seen.items():
    assert len(items) == len(set(items)), name


CHILD = textwrap.dedent("""\
    import json, sys

    def main(config):
      opened = []
      def hook(event, args):
        if event == "open" and isinstance(args[0], str) and args[0].endswith(".tar"):
          opened.append(args[0])
      sys.addaudithook(hook)
      from darl_jax import distributed
      distributed.initialize()
      import jax
      from darl_jax.data import build_source
      p, count = jax.process_index(), jax.process_count()
      cfg = json.loads(config)
      train = build_source(cfg, split="train", seed=5)
      train_opened = sorted(set(opened))
      it = train.train_iterator(8, process_index=p, process_count=count, num_workers=1)
      images = [next(it)["image"] for _ in range(3)]
      it.close()
      names = [train.names[i] for s in range(3) for i in train.train_indices(s, 8, p, count)[0]]
      val = build_source(cfg, split="validation", seed=5)
      print(json.dumps({"opened": train_opened, "names": names, "size": train.size,
                        "num_examples": train.num_examples, "num_classes": train.num_classes,
                        "files": train.files, "val": val.num_examples,
                        "checksum": int(sum(int(x.sum()) for x in images))}))

    if __name__ == "__main__":   # the Grain worker is spawned: it imports this file
      main(sys.argv[1])
""")


def test_two_real_processes_read_disjoint_files(data, tmp_path):
  """Two processes joined through jax.distributed (the CLI's start-up path),
  with the gathered counts and a Grain worker each, as the loop runs them.
  The audit hook sees every file the training process opens while it builds
  its index (into a cache dir of its own, so nothing is read from a cached
  index); the worker reads the examples train_indices names."""
  (tmp_path / "child.py").write_text(CHILD)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  index_dir = tmp_path / "index"      # no index beside the shards: every process builds its own
  config = json.dumps(cfg(data, "tar", index_cache_dir=str(index_dir)))
  procs = [subprocess.Popen(
      [sys.executable, str(tmp_path / "child.py"), config], cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS="cpu", DARL_COORDINATOR=f"127.0.0.1:{port}",
               DARL_NUM_PROCESSES="2", DARL_PROCESS_ID=str(p)),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in range(2)]
  outs = []
  for proc in procs:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    outs.append(json.loads(out.strip().splitlines()[-1]))
  files = outs[0]["files"]
  for p, out in enumerate(outs):
    assert out["opened"] and set(out["opened"]) <= set(files[p::2]), out["opened"]
    assert out["size"] == 12 and out["num_examples"] == 24 and out["num_classes"] == 2
    assert out["val"] == 6
  assert not set(outs[0]["names"]) & set(outs[1]["names"])
  assert len(set(outs[0]["names"]) | set(outs[1]["names"])) == 24
  assert outs[0]["checksum"] != outs[1]["checksum"]
