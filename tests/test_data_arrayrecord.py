"""ArrayRecord files of your own images (data/sources/arrayrecord.py) and the
image-folder -> ArrayRecord converter (data/convert.py --format=arrayrecord)."""

import os

import numpy as np
import pytest

from darl_jax.data import build_source, convert
from darl_jax.data.sources import arrayrecord as arrayrecord_source, shards
import image_files

array_record_module = pytest.importorskip("array_record.python.array_record_module")

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  """train/ and val/ with two class folders of PNG and JPEG images."""
  return image_files.class_folder(tmp_path_factory.mktemp("folder"))


@pytest.fixture(scope="module")
def converted(folder, tmp_path_factory):
  dst = str(tmp_path_factory.mktemp("records"))
  return dst, convert.convert(folder, dst, "arrayrecord", shard_size=4)


def cfg(**kw):
  base = {"name": "arrayrecord", "image_size": 8, "channels": 3, "augment": "spatial"}
  return {**base, **kw}


def write(path, records):
  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  for r in records:
    writer.write(r)
  writer.close()


def test_records_give_the_image_folders_batches(folder, converted):
  """The converted files (2 classes, files of 4 records) are the same examples
  in the same order as the folder: the same batches bit for bit, labels too."""
  dst, out = converted
  assert len(out["train"]) == 4 and len(out["validation"]) == 2
  assert all(p.endswith(".array_record") for p in out["train"])
  config = cfg(path=f"{dst}/train-{{000000..000003}}.array_record",
               eval_path=f"{dst}/validation-*.array_record")
  records = build_source(config, split="train", seed=4)
  ref = build_source({**config, "name": "image_folder", "path": folder}, split="train", seed=4)
  assert (records.num_examples, records.num_classes) == (ref.num_examples, ref.num_classes) == (14, 2)
  for step in (0, 3):
    a, b = records.train_batch(step, 6), ref.train_batch(step, 6)
    np.testing.assert_array_equal(a["image"], b["image"])
    np.testing.assert_array_equal(a["label"], b["label"])
  val = build_source(config, split="validation", seed=4)
  ref_val = build_source({**config, "name": "image_folder", "path": folder},
                         split="validation", seed=4)
  assert val.num_examples == ref_val.num_examples == 6
  for a, b in zip(val.eval_batches(4), ref_val.eval_batches(4)):
    for k in ("image", "label", "mask"):
      np.testing.assert_array_equal(a[k], b[k])


def test_a_resumed_iterator_equals_the_uninterrupted_one(converted):
  """Grain's worker processes read the files (each opens its own readers); a
  pipeline started at step 3 gives the batches an uninterrupted one gives."""
  dst, _ = converted
  source = build_source(cfg(path=f"{dst}/train-*.array_record"), split="train", seed=1)
  it = source.train_iterator(6, num_workers=1)
  try:
    whole = [next(it) for _ in range(6)]      # past one epoch (14 records)
  finally:
    it.close()
  again = build_source(cfg(path=f"{dst}/train-*.array_record"), split="train", seed=1)
  resumed = again.train_iterator(6, start_step=3, num_workers=1)
  try:
    for want in whole[3:]:
      got = next(resumed)
      np.testing.assert_array_equal(got["image"], want["image"])
      np.testing.assert_array_equal(got["label"], want["label"])
    assert resumed.get_state() == {"next_step": 6}
  finally:
    resumed.close()
  for step, want in enumerate(whole):          # and equal the in-process batches
    np.testing.assert_array_equal(source.train_batch(step, 6)["image"], want["image"])


def test_unlabeled_records_keys_and_hash_split(tmp_path):
  rng = np.random.default_rng(2)
  write(tmp_path / "u.array_record",
        [arrayrecord_source.encode_record(image_files.encode(rng), key=f"img{i}") for i in range(10)])
  config = cfg(path=str(tmp_path / "u.array_record"), val_split_size=2)
  train = build_source(config, split="train", seed=0)
  val = build_source(config, split="validation", seed=0)
  assert (train.num_examples, val.num_examples, train.num_classes) == (8, 2, 0)
  assert not set(train.names) & set(val.names)
  assert set(train.names) | set(val.names) == {f"img{i}" for i in range(10)}
  assert train.train_batch(0, 4)["image"].shape == (4, 8, 8, 3)
  with pytest.raises(ValueError, match="no 'test' split"):
    build_source(config, split="test", seed=0)


def test_the_index_is_cached(converted, monkeypatch):
  dst, out = converted
  path = out["train"][0]
  build_source(cfg(path=path), split="train", seed=0)      # builds the index if no test did
  assert os.path.exists(path + shards.INDEX_SUFFIX)
  calls = []
  real = arrayrecord_source.index_file
  monkeypatch.setattr(arrayrecord_source, "index_file", lambda p: calls.append(p) or real(p))
  build_source(cfg(path=path), split="train", seed=0)
  assert not calls
  os.utime(path, (1, 1))
  build_source(cfg(path=path), split="train", seed=0)
  assert calls == [path]


def test_bad_records_and_bad_input(tmp_path):
  """A record that is not of the layout is skipped at indexing; one whose
  image cannot be decoded is replaced by the next readable record."""
  rng = np.random.default_rng(3)
  write(tmp_path / "b.array_record",
        [arrayrecord_source.encode_record(image_files.encode(rng), label=i % 2) for i in range(4)]
        + [b"\xc1 not msgpack", arrayrecord_source.encode_record(b"not an image", label=1)])
  source = build_source(cfg(path=str(tmp_path / "b.array_record"), augment="none",
                            val_split_size=0), split="train", seed=0)
  assert (source.num_examples, source.num_classes) == (5, 2)
  batches = list(source.eval_batches(2))
  assert sum(int(b["mask"].sum()) for b in batches) == 5
  assert len(source._bad) == 1   # pylint: disable=protected-access
  (tmp_path / "junk.array_record").write_bytes(b"not an array record file")
  with pytest.raises(ValueError, match="cannot read .* as an ArrayRecord file"):
    build_source(cfg(path=str(tmp_path / "junk.array_record")), split="train", seed=0)
  with pytest.raises(FileNotFoundError, match="no file matches"):
    build_source(cfg(path=str(tmp_path / "none-*.array_record")), split="train", seed=0)
  with pytest.raises(ValueError, match="needs data.path"):
    build_source(cfg(), split="train", seed=0)


def test_convert_command_line(folder, tmp_path, capsys):
  from absl import flags
  flags.FLAGS(["convert", f"--src={folder}", f"--dst={tmp_path}", "--shard_size=100",
               "--format=arrayrecord"])
  try:
    convert.main([])
  finally:
    flags.FLAGS["format"].value = "tar"
  out = capsys.readouterr().out
  assert "--config.data.name=arrayrecord" in out and "--config.data.eval_path=" in out
  assert sorted(os.listdir(tmp_path)) == ["train-000000.array_record",
                                          "validation-000000.array_record"]
  reader = array_record_module.ArrayRecordReader(str(tmp_path / "train-000000.array_record"))
  first = arrayrecord_source.decode_record(reader.read([0])[0])
  reader.close()
  assert first["key"] == "cat/000.png" and first["label"] == 0
  with open(os.path.join(folder, "train", "cat", "000.png"), "rb") as f:
    assert first["image"] == f.read()


def test_a_mixture_takes_array_record_patterns(folder, converted):
  dst, _ = converted
  source = build_source(cfg(name="mixture", mixture=f"{dst}/train-*.array_record=3,"
                            f"image_folder:{folder}=1"), split="train", seed=0)
  assert source.train_batch(0, 8)["image"].shape == (8, 8, 8, 3)


def test_the_pipeline_benchmark_times_the_sharded_formats(tmp_path):
  """benchmarks/pipeline_benchmark.py --formats: a row per format and worker count."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run(
      [sys.executable, os.path.join(root, "benchmarks", "pipeline_benchmark.py"), "--images=16",
       "--size=16", "--batch=4", "--workers=0", "--seconds=0.2", "--repeats=2",
       f"--folder={tmp_path / 'jpegs'}", "--formats=folder,tar,arrayrecord,parquet"],
      capture_output=True, text=True, cwd=root, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  rows = [line.split("|")[1].strip() for line in done.stdout.splitlines()
          if line.startswith("| ")]
  assert rows[1:] == ["plain PIL loop", "pipeline, 0 workers", "pipeline, tar, 0 workers",
                      "pipeline, arrayrecord, 0 workers", "pipeline, parquet, 0 workers"]
  table = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| pipeline")]
  assert table[0][4].strip() == "1.00"            # the folder against itself
  for row in table[1:]:                           # each format against the folder
    np.testing.assert_allclose(float(row[4]), float(row[2]) / float(table[0][2]), atol=0.02)
