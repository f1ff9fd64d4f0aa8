"""Tar shards (data/sources/webdataset.py), shard patterns and index caches
(data/sources/shards.py), and the image-folder -> shards converter (data/convert.py)."""

import io
import json
import os
import tarfile

import numpy as np
import pytest

from darl_jax.data import build_source, convert
from darl_jax.data.sources import image_folder, shards, webdataset
import image_files


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  """train/ and val/ with two class folders of PNG and JPEG images."""
  return image_files.class_folder(tmp_path_factory.mktemp("folder"))


@pytest.fixture(scope="module")
def converted(folder, tmp_path_factory):
  dst = str(tmp_path_factory.mktemp("shards"))
  return dst, convert.convert(folder, dst, "tar", shard_size=4)


def cfg(**kw):
  base = {"name": "webdataset", "image_size": 8, "channels": 3, "augment": "spatial"}
  return {**base, **kw}


def test_brace_ranges_lists_and_globs_expand(tmp_path):
  for name in ("a-000.tar", "a-001.tar", "a-002.tar", "b-000.tar"):
    (tmp_path / name).write_bytes(b"")
  t = str(tmp_path)
  assert shards.expand_braces("x-{008..010}.tar") == ["x-008.tar", "x-009.tar", "x-010.tar"]
  assert shards.expand_braces("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]
  assert shards.expand(f"{t}/a-{{000..002}}.tar") == [f"{t}/a-00{i}.tar" for i in range(3)]
  assert shards.expand(f"{t}/*-000.tar,{t}/a-002.tar") == [
      f"{t}/a-000.tar", f"{t}/a-002.tar", f"{t}/b-000.tar"]
  with pytest.raises(FileNotFoundError, match="no file matches"):
    shards.expand(f"{t}/c-*.tar")
  with pytest.raises(FileNotFoundError, match="does not exist"):
    shards.expand(f"{t}/a-{{000..003}}.tar")


def test_shards_give_the_image_folders_batches(folder, converted):
  """The converted shards (2 classes, shards of 4) are the same examples in
  the same order as the folder: the same batches bit for bit, labels too."""
  dst, out = converted
  assert len(out["train"]) == 4 and len(out["validation"]) == 2
  train = f"{dst}/train-{{000000..000003}}.tar"
  config = cfg(path=train, eval_path=f"{dst}/validation-*.tar")
  tar = build_source(config, split="train", seed=4)
  ref = build_source({**config, "name": "image_folder", "path": folder}, split="train", seed=4)
  assert (tar.num_examples, tar.num_classes) == (ref.num_examples, ref.num_classes) == (14, 2)
  for step in (0, 3):
    a, b = tar.train_batch(step, 6), ref.train_batch(step, 6)
    np.testing.assert_array_equal(a["image"], b["image"])
    np.testing.assert_array_equal(a["label"], b["label"])
  val = build_source(config, split="validation", seed=4)
  ref_val = build_source({**config, "name": "image_folder", "path": folder},
                         split="validation", seed=4)
  for a, b in zip(val.eval_batches(4), ref_val.eval_batches(4)):
    for k in ("image", "label", "mask"):
      np.testing.assert_array_equal(a[k], b[k])


def test_worker_processes_read_the_shards(converted):
  """The source pickles into Grain's workers (each opens its own files)."""
  dst, _ = converted
  source = build_source(cfg(path=f"{dst}/train-*.tar"), split="train", seed=0)
  plain = [source.train_batch(s, 4) for s in range(3)]
  it = source.train_iterator(4, num_workers=1)
  try:
    for want in plain:
      np.testing.assert_array_equal(next(it)["image"], want["image"])
  finally:
    it.close()


def test_the_index_is_cached_and_rebuilt_when_the_shard_changes(converted, tmp_path,
                                                                 monkeypatch):
  dst, out = converted
  shard = out["train"][0]
  index_file = shard + shards.INDEX_SUFFIX
  assert os.path.exists(index_file)           # written beside the shard by the tests above
  calls = []
  real = webdataset.index_shard
  monkeypatch.setattr(webdataset, "index_shard", lambda *a: calls.append(a) or real(*a))
  build_source(cfg(path=shard), split="train", seed=0)
  assert not calls                            # read from the cache
  os.utime(shard, (1, 1))                     # a new modification time
  build_source(cfg(path=shard), split="train", seed=0)
  assert len(calls) == 1
  cache = tmp_path / "cache"                  # an explicit cache folder instead
  build_source(cfg(path=shard, index_cache_dir=str(cache)), split="train", seed=0)
  assert len(calls) == 2 and len(os.listdir(cache)) == 1


def _tar(path, members):
  with tarfile.open(path, "w") as tar:
    for name, data in members:
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))




def test_labels_json_txt_unlabeled_and_hash_split(tmp_path):
  rng = np.random.default_rng(2)
  members = []
  for i in range(10):
    members.append((f"s{i}.webp" if i == 0 else f"s{i}.png", image_files.encode(rng)))
    members.append((f"s{i}.json", json.dumps({"y": i % 3}).encode()))
    members.append((f"s{i}.txt", b"a caption"))
  _tar(tmp_path / "j.tar", members)
  s = build_source(cfg(path=str(tmp_path / "j.tar"), label_key="y", val_split_size=2),
                   split="train", seed=0)
  v = build_source(cfg(path=str(tmp_path / "j.tar"), label_key="y", val_split_size=2),
                   split="validation", seed=0)
  assert (s.num_examples, v.num_examples, s.num_classes) == (8, 2, 3)
  assert not set(s.names) & set(v.names)
  _tar(tmp_path / "u.tar", [(f"{i}.png", image_files.encode(rng)) for i in range(4)])
  u = build_source(cfg(path=str(tmp_path / "u.tar")), split="train", seed=0)
  assert u.num_classes == 0 and u.train_batch(0, 2)["image"].shape == (2, 8, 8, 3)


def test_bad_input_names_the_fix(tmp_path):
  _tar(tmp_path / "t.tar", [("a.cls", b"1"), ("notes.md", b"x")])
  with pytest.raises(ValueError, match="no images"):
    build_source(cfg(path=str(tmp_path / "t.tar")), split="train", seed=0)
  with pytest.raises(FileNotFoundError, match="no file matches"):
    build_source(cfg(path=str(tmp_path / "none-*.tar")), split="train", seed=0)
  with pytest.raises(ValueError, match="needs data.path"):
    build_source(cfg(), split="train", seed=0)


def test_truncated_shards_and_bad_members_are_skipped(tmp_path):
  """A shard cut short keeps its whole samples; an undecodable member is
  replaced by the next readable example."""
  rng = np.random.default_rng(3)
  members = [(f"{i}.png", image_files.encode(rng)) for i in range(6)]
  members[2] = ("2.png", b"not an image")
  _tar(tmp_path / "full.tar", members)
  data = (tmp_path / "full.tar").read_bytes()
  (tmp_path / "cut.tar").write_bytes(data[:len(data) // 2 + 700])
  source = build_source(cfg(path=str(tmp_path / "cut.tar"), augment="none", val_split_size=0),
                        split="train", seed=0)
  assert 2 <= source.num_examples < 6
  batches = list(source.eval_batches(2))
  assert sum(int(b["mask"].sum()) for b in batches) == source.num_examples
  assert len(source._bad) == 1   # pylint: disable=protected-access


def _labeled_shard(path, rng, n=4):
  """n samples ``s<i>.png`` + ``s<i>.json`` (a long label member, so that a
  cut can fall inside it); returns the members' (name, offset, data offset)."""
  members = []
  for i in range(n):
    members += [(f"s{i}.png", image_files.encode(rng)),
                (f"s{i}.json", json.dumps({"label": i % 2, "pad": "x" * 600}).encode())]
  _tar(path, members)
  with tarfile.open(path) as tar:
    return {m.name: (m.offset, m.offset_data) for m in tar.getmembers()}


@pytest.mark.parametrize("where,kept,skipped", [
    ("after the last image", 3, 1),         # s3.json's header gone: s3 lost its label
    ("inside the last label", 3, 1),        # s3.json cut: s3 is incomplete
    ("before the end marker", 4, 0),        # every sample whole, the marker gone
])
def test_a_shard_cut_short_is_named_and_its_incomplete_sample_skipped(tmp_path, caplog,
                                                                        where, kept, skipped):
  """A shard cut short is named in a warning whatever the cut, the sample
  that lost its label is skipped and counted, and the split stays labeled
  (one image without a label used to make it unlabeled)."""
  rng = np.random.default_rng(5)
  offsets = _labeled_shard(tmp_path / "a-0.tar", rng)
  _labeled_shard(tmp_path / "a-1.tar", rng)
  data = (tmp_path / "a-0.tar").read_bytes()
  cut = {"after the last image": offsets["s3.json"][0],
         "inside the last label": offsets["s3.json"][1] + 100,
         "before the end marker": offsets["s3.json"][1] + 1024}[where]
  (tmp_path / "a-0.tar").write_bytes(data[:cut])
  caplog.set_level("WARNING")
  source = build_source(cfg(path=f"{tmp_path}/a-{{0..1}}.tar", val_split_size=0),
                        split="train", seed=0)
  assert source.num_examples == 4 + kept and source.num_classes == 2
  assert sorted(set(source.labels.tolist())) == [0, 1]
  shard = str(tmp_path / "a-0.tar")
  assert f"tar shard {shard} is cut short" in caplog.text
  assert f"1 of the 2 tar shard(s) read here are cut short ({shard}); {skipped} incomplete" \
      in caplog.text
  if skipped:
    assert "a-0.tar/s3" in caplog.text
  assert "a-1.tar is cut short" not in caplog.text


def test_an_unlabeled_shard_cut_between_members_keeps_its_last_image(tmp_path):
  """Without labels anywhere, the last image of a cut shard lost nothing we read."""
  rng = np.random.default_rng(6)
  _tar(tmp_path / "u.tar", [(f"{i}.png", image_files.encode(rng)) for i in range(3)])
  with tarfile.open(tmp_path / "u.tar") as tar:
    end = max(m.offset_data + m.size for m in tar.getmembers())
  data = (tmp_path / "u.tar").read_bytes()
  (tmp_path / "u.tar").write_bytes(data[:-(-end // 512) * 512])   # the marker cut off
  index = webdataset.index_shard(str(tmp_path / "u.tar"))
  assert index["truncated"] and "no end-of-archive marker" in index["truncated"]
  assert index["keys"] == ["0", "1", "2"] and index["suspect"] == "2"
  source = build_source(cfg(path=str(tmp_path / "u.tar"), val_split_size=0), split="train",
                        seed=0)
  assert source.num_examples == 3 and source.num_classes == 0


def test_convert_command_line(folder, tmp_path, capsys):
  from absl import flags
  flags.FLAGS(["convert", f"--src={folder}", f"--dst={tmp_path}", "--shard_size=100"])
  convert.main([])
  out = capsys.readouterr().out
  assert "--config.data.path=" in out and "--config.data.eval_path=" in out
  assert sorted(os.listdir(tmp_path)) == ["train-000000.tar", "validation-000000.tar"]
  with tarfile.open(tmp_path / "train-000000.tar") as tar:
    names = tar.getnames()
  assert "cat/000.png" in names and "cat/000.cls" in names and "dog/001.jpg" in names
  assert image_folder.IMAGE_EXTENSIONS
