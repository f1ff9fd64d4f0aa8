"""Parquet files of encoded images (data/sources/parquet.py)."""


import numpy as np
import pytest

import image_files

from darl_jax.data import build_source
from darl_jax.data.sources import parquet

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def encode(rng, fmt="PNG"):
  return image_files.encode(rng, fmt, shape=(9, 13))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """Two files in Hugging Face's layout (image struct with bytes, label),
  row groups of 5; one with a plain binary column and no labels."""
  root = tmp_path_factory.mktemp("parquet")
  rng = np.random.default_rng(0)
  images = [encode(rng, "PNG" if i % 2 else "JPEG") for i in range(20)]
  for f in range(2):
    part = images[10 * f:10 * (f + 1)]
    table = pa.table({"image": [{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(part)],
                      "label": [i % 3 for i in range(10 * f, 10 * (f + 1))]})
    pq.write_table(table, root / f"train-{f:05d}-of-00002.parquet", row_group_size=5)
  pq.write_table(pa.table({"jpg": images[:6]}), root / "plain.parquet", row_group_size=3)
  return str(root), images


def cfg(**kw):
  return {"name": "parquet", "image_size": 8, "channels": 3, "augment": "spatial",
          "val_split_size": 0, **kw}


def test_rows_decode_like_the_same_bytes_in_a_folder(files, tmp_path):
  """Every row's pixels are the image_folder decode of the same bytes; labels
  come from the label column; each epoch sees every row once."""
  root, images = files
  source = build_source(cfg(path=f"{root}/train-{{00000..00001}}-of-00002.parquet",
                            augment="none"), split="train", seed=1)
  assert (source.num_examples, source.num_classes) == (20, 3)
  for i, data in enumerate(images):
    (tmp_path / f"{i:02d}.{'png' if i % 2 else 'jpg'}").write_bytes(data)
  folder = build_source({**cfg(augment="none"), "name": "image_folder", "path": str(tmp_path)},
                        split="train", seed=1)
  got = next(iter(source.eval_batches(20)))
  want = next(iter(folder.eval_batches(20)))
  np.testing.assert_array_equal(got["image"], want["image"])
  np.testing.assert_array_equal(got["label"], np.arange(20) % 3)
  epoch = np.concatenate([source.train_indices(s, 5)[0] for s in range(4)])
  assert sorted(epoch) == list(range(20))


def test_block_shuffle_keeps_batches_within_few_row_groups(files):
  root, _ = files
  source = build_source(cfg(path=f"{root}/train-*.parquet"), split="train", seed=2)
  perm = source.epoch_permutation(0)
  assert sorted(perm) == list(range(20)) and list(perm) != list(range(20))
  window = parquet.SHUFFLE_WINDOW * 5
  assert len(set(source.blocks[perm[:window]])) <= parquet.SHUFFLE_WINDOW
  np.testing.assert_array_equal(perm, build_source(cfg(path=f"{root}/train-*.parquet"),
                                                   split="train", seed=2).epoch_permutation(0))
  it = source.train_iterator(4, num_workers=1)      # Grain's workers read the files too
  try:
    np.testing.assert_array_equal(next(it)["image"], source.train_batch(0, 4)["image"])
  finally:
    it.close()


def test_plain_binary_column_without_labels(files):
  root, _ = files
  source = build_source(cfg(path=f"{root}/plain.parquet", image_column="jpg"),
                        split="train", seed=0)
  assert source.num_classes == 0
  assert source.train_batch(0, 4)["image"].shape == (4, 8, 8, 3)


def test_bad_input_names_the_fix(files):
  root, _ = files
  with pytest.raises(ValueError, match="set data.image_column"):
    build_source(cfg(path=f"{root}/plain.parquet"), split="train", seed=0)
  with pytest.raises(ValueError, match="no label column 'y'"):
    build_source(cfg(path=f"{root}/train-*.parquet", label_column="y"), split="train", seed=0)
  with pytest.raises(FileNotFoundError, match="no file matches"):
    build_source(cfg(path=f"{root}/val-*.parquet"), split="train", seed=0)


def test_a_truncated_file_is_named(files, tmp_path):
  """pyarrow's own message names no file."""
  root, _ = files
  data = open(f"{root}/train-00001-of-00002.parquet", "rb").read()
  for size in (len(data) // 2, 3):
    cut = tmp_path / f"cut-{size}.parquet"
    cut.write_bytes(data[:size])
    with pytest.raises(ValueError, match=f"the Parquet file {cut} cannot be read .*copy it "
                                         "again, or leave it out of data.path"):
      build_source(cfg(path=f"{root}/train-00000-of-00002.parquet,{cut}"), split="train",
                   seed=0)


def test_a_converted_folder_reads_as_the_folder(tmp_path):
  """``convert --format=parquet``: HF's image struct and label column, row
  groups of 256, every split's rows in the folder's order: an unshuffled pass
  gives the folder's pixels and labels."""
  from darl_jax.data import convert  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(3)
  for split, n in (("train", 5), ("val", 2)):
    for c in ("cat", "dog"):
      (tmp_path / "folder" / split / c).mkdir(parents=True)
      for i in range(n):
        (tmp_path / "folder" / split / c / f"{i}.png").write_bytes(encode(rng))
  out = convert.convert(str(tmp_path / "folder"), str(tmp_path / "pq"), "parquet", shard_size=4)
  assert [len(out[s]) for s in ("train", "validation")] == [3, 1]
  table = pq.read_table(out["train"][0])
  assert table.schema.field("image").type.names == ["bytes", "path"]
  assert table.column("label").to_pylist() == [0, 0, 0, 0]
  config = cfg(path=f"{tmp_path}/pq/train-*.parquet", eval_path=f"{tmp_path}/pq/validation-*.parquet")
  ref = {**config, "name": "image_folder", "path": str(tmp_path / "folder")}
  for split in ("train", "validation"):
    got = build_source(config, split=split, seed=0)
    want = build_source(ref, split=split, seed=0)
    assert got.num_classes == want.num_classes == 2
    for a, b in zip(got.eval_batches(4), want.eval_batches(4)):
      for k in ("image", "label", "mask"):
        np.testing.assert_array_equal(a[k], b[k])
