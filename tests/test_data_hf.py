"""Hugging Face datasets saved with save_to_disk (data/sources/hf_disk.py)."""

import sys

import numpy as np
import pytest

import image_files

from darl_jax.data import build_source
from darl_jax.data.sources import hf_disk

datasets = pytest.importorskip("datasets")


def encode(rng, fmt="PNG"):
  return image_files.encode(rng, fmt, shape=(9, 13))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A DatasetDict (train 20 / validation 6 rows, datasets.Image + ClassLabel),
  a plain Dataset of a binary column without labels, and the images."""
  root = tmp_path_factory.mktemp("hf")
  rng = np.random.default_rng(0)
  images = [encode(rng, "PNG" if i % 2 else "JPEG") for i in range(26)]
  features = datasets.Features({"image": datasets.Image(),
                                "label": datasets.ClassLabel(names=["a", "b", "c", "d"])})

  def part(lo, hi):
    return datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in images[lo:hi]],
         "label": [i % 3 for i in range(lo, hi)]}, features=features)

  datasets.DatasetDict({"train": part(0, 20), "validation": part(20, 26)}).save_to_disk(
      str(root / "dict"))
  datasets.Dataset.from_dict({"jpg": images[:10]}).save_to_disk(str(root / "plain"))
  return str(root), images


def cfg(**kw):
  return {"name": "hf_disk", "image_size": 8, "channels": 3, "augment": "spatial", **kw}


def folder_of(images, tmp_path, name):
  path = tmp_path / name
  path.mkdir()
  for i, data in enumerate(images):
    (path / f"{i:02d}.{'png' if i % 2 else 'jpg'}").write_bytes(data)
  return str(path)


def test_rows_give_the_batches_of_the_same_images_in_a_folder(saved, tmp_path):
  """Train and validation batches equal an image folder's of the same bytes
  (same order, so the same permutations and crops); labels from ClassLabel,
  whose class count (4) is kept."""
  root, images = saved
  source = build_source(cfg(path=f"{root}/dict"), split="train", seed=3)
  assert (source.num_examples, source.num_classes) == (20, 4)
  folder = build_source({**cfg(val_split_size=0), "name": "image_folder",
                         "path": folder_of(images[:20], tmp_path, "train")},
                        split="train", seed=3)
  for step in (0, 4):
    np.testing.assert_array_equal(source.train_batch(step, 6)["image"],
                                  folder.train_batch(step, 6)["image"])
  np.testing.assert_array_equal(source.labels, np.arange(20) % 3)
  val = build_source(cfg(path=f"{root}/dict"), split="validation", seed=3)
  ref = build_source({**cfg(val_split_size=0), "name": "image_folder",
                      "path": folder_of(images[20:], tmp_path, "val")}, split="train", seed=3)
  got = next(iter(val.eval_batches(6)))
  want = next(iter(ref.eval_batches(6)))
  np.testing.assert_array_equal(got["image"], want["image"])
  np.testing.assert_array_equal(got["label"], np.arange(20, 26) % 3)


def test_a_resumed_iterator_equals_the_uninterrupted_one(saved):
  root, _ = saved
  source = build_source(cfg(path=f"{root}/dict"), split="train", seed=1)
  it = source.train_iterator(6, num_workers=1)      # Grain's workers open the dataset
  try:
    whole = [next(it) for _ in range(5)]
  finally:
    it.close()
  resumed = build_source(cfg(path=f"{root}/dict"), split="train",
                         seed=1).train_iterator(6, start_step=2, num_workers=1)
  try:
    for want in whole[2:]:
      got = next(resumed)
      np.testing.assert_array_equal(got["image"], want["image"])
      np.testing.assert_array_equal(got["label"], want["label"])
  finally:
    resumed.close()
  for step, want in enumerate(whole):
    np.testing.assert_array_equal(source.train_batch(step, 6)["image"], want["image"])


def test_binary_column_unlabeled_hash_split_and_eval_path(saved):
  root, _ = saved
  config = cfg(path=f"{root}/plain", image_column="jpg", val_split_size=2)
  train = build_source(config, split="train", seed=0)
  val = build_source(config, split="validation", seed=0)
  assert (train.num_examples, val.num_examples, train.num_classes) == (8, 2, 0)
  assert not set(train.names) & set(val.names)
  assert train.train_batch(0, 4)["image"].shape == (4, 8, 8, 3)
  other = build_source(cfg(path=f"{root}/plain", image_column="jpg",
                           eval_path=f"{root}/plain"), split="validation", seed=0)
  assert other.num_examples == 10
  whole = build_source(cfg(path=f"{root}/plain", image_column="jpg",
                           eval_path=f"{root}/plain"), split="train", seed=0)
  assert whole.num_examples == 10                   # eval_path set: no hash split


def test_bad_input_names_the_fix(saved, tmp_path):
  root, _ = saved
  with pytest.raises(ValueError, match="set data.image_column"):
    build_source(cfg(path=f"{root}/plain"), split="train", seed=0)
  with pytest.raises(ValueError, match="no label column 'y'"):
    build_source(cfg(path=f"{root}/dict", label_column="y"), split="train", seed=0)
  with pytest.raises(ValueError, match="needs data.path"):
    build_source(cfg(), split="train", seed=0)
  with pytest.raises(FileNotFoundError, match="save_to_disk"):
    build_source(cfg(path=str(tmp_path / "missing")), split="train", seed=0)
  with pytest.raises(ValueError, match="no 'test' split"):
    build_source(cfg(path=f"{root}/plain", image_column="jpg"), split="test", seed=0)


def test_without_datasets_the_error_names_the_extra(saved, monkeypatch):
  root, _ = saved
  monkeypatch.setitem(sys.modules, "datasets", None)     # import datasets -> ImportError
  with pytest.raises(ImportError, match=r'pip install -c constraints.txt -e "\.\[hf\]"'):
    build_source(cfg(path=f"{root}/dict"), split="train", seed=0)
  assert hf_disk.INSTALL == 'pip install -c constraints.txt -e ".[hf]"'
