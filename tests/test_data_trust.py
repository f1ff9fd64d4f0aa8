"""Data that is right or absent: a bad example is replaced whole (image and
label), every image mode is scaled to 8 bits rather than clipped, names that
are not UTF-8 split by hash, bad labels are named, and evaluation labels are
checked against the classifier's classes."""

import hashlib
import io
import json
import logging as py_logging
import os
import tarfile

import numpy as np
import pytest
from PIL import Image

from darl_jax.data import build_source, check_labels, holdout
from darl_jax.data.sources import encoded, image_folder, webdataset
from darl_jax.data.sources.indexed import ArraySource

RED, BLUE = (200, 30, 30), (30, 30, 200)


def _png(colour, size=(6, 6)) -> bytes:
  buf = io.BytesIO()
  Image.new("RGB", size, colour).save(buf, "PNG")
  return buf.getvalue()


def _tar(path, members, fmt=tarfile.GNU_FORMAT):
  with tarfile.open(path, "w", format=fmt, encoding="utf-8",
                    errors="surrogateescape") as tar:
    for name, data in members:
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))


def _colour_matches_label(batch):
  """Each row's image is the colour of its label (0 red, 1 blue)."""
  for image, label, keep in zip(batch["image"], batch["label"], batch["mask"]):
    if keep:
      red = image[..., 0].mean() > image[..., 2].mean()
      assert red == (label == 0), (label, image[0, 0])


def _eval_rows(source, batch_size=4):
  batches = list(source.eval_batches(batch_size))
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def _warnings_naming(caplog, name):
  return [r for r in caplog.records
          if r.levelno == py_logging.WARNING and name in r.getMessage()]


# -- a bad example is replaced whole ---------------------------------------------------


@pytest.fixture
def cat_dog_folder(tmp_path):
  """cat/000.png red, cat/001.png not an image, dog/000-001.png blue."""
  for c in ("cat", "dog"):
    os.makedirs(tmp_path / c)
  (tmp_path / "cat" / "000.png").write_bytes(_png(RED))
  (tmp_path / "cat" / "001.png").write_bytes(b"not an image")
  (tmp_path / "dog" / "000.png").write_bytes(_png(BLUE))
  (tmp_path / "dog" / "001.png").write_bytes(_png(BLUE))
  return tmp_path


def test_a_bad_folder_image_is_replaced_with_its_label(cat_dog_folder, caplog):
  """The corrupt cat image becomes the next example, a dog image labelled
  dog, never a dog image labelled cat; one warning names it, with a count."""
  source = image_folder.build({"path": str(cat_dog_folder), "image_size": 6, "channels": 3,
                               "augment": "none", "val_split_size": 0},
                              split="train", seed=0)
  with caplog.at_level(py_logging.WARNING):
    for _ in range(2):        # a second pass meets the same file: no second warning
      rows = _eval_rows(source)
      _colour_matches_label(rows)
      np.testing.assert_array_equal(rows["label"], [0, 1, 1, 1])
  bad = _warnings_naming(caplog, os.path.join("cat", "001.png"))
  assert len(bad) == 1 and "1 unreadable image(s)" in bad[0].getMessage()
  # Training batches (the augmented path) pair images and labels alike.
  source = image_folder.build({"path": str(cat_dog_folder), "image_size": 6, "channels": 3,
                               "augment": "spatial", "val_split_size": 0},
                              split="train", seed=0)
  for step in range(3):
    batch = source.train_batch(step, 4)
    _colour_matches_label({**batch, "mask": np.ones(4, bool)})


def test_a_held_out_part_replaces_a_bad_example_whole(cat_dog_folder):
  """``holdout.Rows`` (an IndexedSource over another's rows) reads the
  parent's examples, labels with them."""
  source = image_folder.build({"path": str(cat_dog_folder), "image_size": 6, "channels": 3,
                               "augment": "none", "val_split_size": 0},
                              split="train", seed=0)
  rows = holdout.Rows(source, np.array([1, 3]))
  batch = _eval_rows(rows, 2)
  _colour_matches_label(batch)
  np.testing.assert_array_equal(batch["label"], [1, 1])


def test_a_bad_tar_member_is_replaced_with_its_label(tmp_path, caplog):
  _tar(tmp_path / "s.tar", [("a.png", _png(RED)), ("a.cls", b"0"),
                            ("b.png", b"not an image"), ("b.cls", b"0"),
                            ("c.png", _png(BLUE)), ("c.cls", b"1")])
  source = build_source({"name": "webdataset", "path": str(tmp_path / "s.tar"),
                         "image_size": 6, "channels": 3, "augment": "none",
                         "val_split_size": 0}, split="train", seed=0)
  with caplog.at_level(py_logging.WARNING):
    rows = _eval_rows(source)
  _colour_matches_label(rows)
  np.testing.assert_array_equal(rows["label"][:3], [0, 1, 1])
  bad = _warnings_naming(caplog, "s.tar/b")
  assert len(bad) == 1 and "1 unreadable tar member(s)" in bad[0].getMessage()


def test_a_bad_parquet_row_is_replaced_with_its_label(tmp_path):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  table = pa.table({"image": [_png(RED), b"not an image", _png(BLUE)], "label": [0, 0, 1]})
  pq.write_table(table, tmp_path / "p.parquet")
  source = build_source({"name": "parquet", "path": str(tmp_path / "p.parquet"),
                         "image_size": 6, "channels": 3, "augment": "none",
                         "val_split_size": 0}, split="train", seed=0)
  rows = _eval_rows(source)
  _colour_matches_label(rows)
  np.testing.assert_array_equal(rows["label"][:3], [0, 1, 1])


# -- every mode to 8 bits ----------------------------------------------------------------


def _decode(img, channels=3, fmt=None):
  """``img`` through decode_crop at its own size (a square): from a file
  written as ``fmt`` when given, else from the image itself."""
  if fmt is None:
    return np.asarray(image_folder.eight_bit(img, channels))
  buf = io.BytesIO()
  img.save(buf, fmt)
  buf.seek(0)
  side = img.size[0]
  return image_folder.decode_crop(buf, None, (side, side, channels))


def test_16_bit_greys_are_scaled_not_clipped():
  ramp = np.linspace(0, 65535, 16 * 16).round().astype(np.uint16).reshape(16, 16)
  want = np.round(ramp / 257.0)
  png = Image.fromarray(ramp)
  assert png.mode == "I;16"
  for channels in (1, 3):
    got = _decode(png, channels, "PNG").astype(float)
    assert got.shape == (16, 16, channels)
    np.testing.assert_allclose(got[..., 0], want, atol=1)
  for mode, dtype in (("I;16B", ">u2"), ("I;16L", "<u2")):
    img = Image.frombytes(mode, (16, 16), ramp.astype(dtype).tobytes())
    np.testing.assert_allclose(_decode(img, 1).astype(float), want, atol=1)
  # A 16-bit grey as mode I (how several readers give it): the same scale.
  img = Image.fromarray(ramp.astype(np.int32))
  assert img.mode == "I"
  np.testing.assert_allclose(_decode(img, 1).astype(float), want, atol=1)


def test_32_bit_integers_beyond_16_bits_take_their_own_range():
  values = np.linspace(-1e9, 3e9 - 1, 64).reshape(8, 8).astype(np.int64)
  values = np.clip(values, -2**31, 2**31 - 1).astype(np.int32)
  img = Image.fromarray(values)
  assert img.mode == "I"
  got = _decode(img, 1, "TIFF").astype(float)
  v = values.astype(np.float64)
  want = (v - v.min()) * 255.0 / (v.max() - v.min())
  np.testing.assert_allclose(got[..., 0], want, atol=1)
  assert got.min() == 0 and got.max() == 255


def test_float_images_are_read_as_0_to_1(caplog):
  ramp = np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8)
  img = Image.fromarray(ramp)
  assert img.mode == "F"
  got = _decode(img, 3, "TIFF").astype(float)
  np.testing.assert_allclose(got[..., 0], ramp * 255, atol=1)
  np.testing.assert_array_equal(got[..., 0], got[..., 2])
  wide = Image.fromarray(np.full((4, 4), 7.5, np.float32))
  with caplog.at_level(py_logging.WARNING):
    assert (_decode(wide, 1) == 255).all()
  nan = Image.fromarray(np.full((4, 4), np.nan, np.float32))
  assert (_decode(nan, 1) == 0).all()


def test_transparency_is_composited_over_white():
  rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 128))
  np.testing.assert_allclose(_decode(rgba, 3, "PNG")[0, 0], [255, 127, 127], atol=1)
  clear = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
  assert (_decode(clear, 3, "PNG") == 255).all()
  la = Image.new("LA", (4, 4), (100, 255))
  la.putpixel((0, 0), (0, 0))
  got = _decode(la, 1, "PNG")[..., 0]
  assert got[0, 0] == 255 and got[3, 3] == 100
  pal = Image.new("P", (4, 4), 0)
  pal.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
  pal.putpixel((3, 3), 1)
  pal.info["transparency"] = 0
  got = _decode(pal, 3, "PNG")
  np.testing.assert_array_equal(got[0, 0], [255, 255, 255])
  np.testing.assert_array_equal(got[3, 3], [255, 0, 0])
  opaque = Image.new("P", (4, 4), 1)
  opaque.putpalette([0, 0, 0, 0, 200, 0] + [0] * 762)
  np.testing.assert_array_equal(_decode(opaque, 3, "PNG")[1, 1], [0, 200, 0])


def test_cmyk_and_1_bit_images():
  cmyk = Image.new("CMYK", (4, 4), (0, 255, 255, 0))
  np.testing.assert_array_equal(_decode(cmyk, 3, "JPEG")[2, 2] // 16, [255 // 16, 0, 0])
  np.testing.assert_array_equal(_decode(cmyk, 3)[0, 0], [255, 0, 0])
  bits = Image.new("1", (4, 4), 0)
  bits.putpixel((1, 1), 1)
  got = _decode(bits, 1, "PNG")[..., 0]
  assert got[1, 1] == 255 and got[0, 0] == 0


def test_a_16_bit_image_reads_alike_from_a_folder_and_a_tar(tmp_path):
  ramp = np.linspace(0, 65535, 64).round().astype(np.uint16).reshape(8, 8)
  buf = io.BytesIO()
  Image.fromarray(ramp).save(buf, "PNG")
  (tmp_path / "f").mkdir()
  (tmp_path / "f" / "a.png").write_bytes(buf.getvalue())
  _tar(tmp_path / "a.tar", [("a.png", buf.getvalue())])
  base = {"image_size": 8, "channels": 1, "augment": "none", "val_split_size": 0}
  folder = build_source({**base, "name": "image_folder", "path": str(tmp_path / "f")},
                        split="train", seed=0)
  tar = build_source({**base, "name": "webdataset", "path": str(tmp_path / "a.tar")},
                     split="train", seed=0)
  a, b = _eval_rows(folder, 1)["image"], _eval_rows(tar, 1)["image"]
  np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(a[0, ..., 0].astype(float), np.round(ramp / 257.0), atol=1)


# -- hash splits by the name's bytes ---------------------------------------------------------


def test_utf8_names_keep_their_hash_split():
  for name in ("a.png", "été/ü.png", "猫/1.jpg"):
    assert image_folder.name_hash(name) == hashlib.sha1(name.encode()).hexdigest()
  keys = [f"s.tar/ké{i}" for i in range(20)]
  old = sorted(range(20), key=lambda i: hashlib.sha1(keys[i].encode()).hexdigest())
  np.testing.assert_array_equal(encoded.hash_split(keys, "validation", 4, "x"),
                                sorted(old[:4]))


def test_names_that_are_not_utf8_split_by_hash(tmp_path):
  root = os.fsencode(str(tmp_path))
  names = [b"caf\xe9.png", b"na\xefve.png"] + [f"ok{i}.png".encode() for i in range(4)]
  for name in names:
    with open(os.path.join(root, name), "wb") as f:
      f.write(_png(RED))
  config = {"name": "image_folder", "path": str(tmp_path), "image_size": 6, "channels": 3,
            "val_split_size": 2}
  train = build_source(config, split="train", seed=0)
  val = build_source(config, split="validation", seed=0)
  assert (train.num_examples, val.num_examples) == (4, 2)
  assert set(train.paths) | set(val.paths) == {
      os.path.join(str(tmp_path), os.fsdecode(n)) for n in names}
  want = sorted(names, key=lambda n: hashlib.sha1(n).hexdigest())[:2]
  assert sorted(os.path.basename(p) for p in val.paths) == sorted(map(os.fsdecode, want))
  _eval_rows(train)
  # The same names as tar members.
  _tar(tmp_path / "s.tar", [(os.fsdecode(n), _png(RED)) for n in names])
  config = {**config, "name": "webdataset", "path": str(tmp_path / "s.tar")}
  assert build_source(config, split="validation", seed=0).num_examples == 2
  assert build_source(config, split="train", seed=0).num_examples == 4


# -- bad labels are named ---------------------------------------------------------------


@pytest.mark.parametrize("text", ['{"label": NaN}', '{"label": Infinity}', "-Infinity",
                                  '{"label": 2.5}'])
def test_a_json_label_that_is_no_class_names_its_shard_and_member(tmp_path, text):
  _tar(tmp_path / "s.tar", [("a.png", _png(RED)), ("a.json", b"0"),
                            ("b.png", _png(BLUE)), ("b.json", text.encode())])
  with pytest.raises(ValueError) as e:
    build_source({"name": "webdataset", "path": str(tmp_path / "s.tar"), "image_size": 6,
                  "val_split_size": 0}, split="train", seed=0)
  message = str(e.value)
  assert "\n" not in message
  assert str(tmp_path / "s.tar") in message and "b.json" in message


def test_json_labels_that_are_classes_are_read(tmp_path):
  assert webdataset._parse_label("json", b'{"label": 3, "score": NaN}', "label") == 3
  assert webdataset._parse_label("json", b"2.0", "label") == 2
  assert webdataset._parse_label("json", b'"a caption"', "label") is None
  assert webdataset._parse_label("txt", b"NaN", "label") is None


def test_a_label_column_value_that_is_no_class_names_its_row(tmp_path):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  pq.write_table(pa.table({"image": [_png(RED)] * 3, "label": [0.0, float("inf"), 1.0]}),
                 tmp_path / "p.parquet")
  with pytest.raises(ValueError, match=r"p\.parquet.*row 1 has the label inf"):
    build_source({"name": "parquet", "path": str(tmp_path / "p.parquet"), "image_size": 6,
                  "val_split_size": 0}, split="train", seed=0)
  # NaN stays a missing label (the split is read unlabeled), as before.
  pq.write_table(pa.table({"image": [_png(RED)] * 3, "label": [0.0, float("nan"), 1.0]}),
                 tmp_path / "p.parquet")
  assert build_source({"name": "parquet", "path": str(tmp_path / "p.parquet"),
                       "image_size": 6, "val_split_size": 0},
                      split="train", seed=0).num_classes == 0


# -- evaluation labels against the classifier's classes -------------------------------------


def _labelled_tar(path, labels):
  members = []
  for i, label in enumerate(labels):
    members += [(f"k{i:02d}.png", _png(RED)), (f"k{i:02d}.cls", str(label).encode())]
  _tar(path, members)


def test_evaluation_labels_beyond_the_training_classes_are_named(tmp_path):
  _labelled_tar(tmp_path / "train.tar", [0, 1, 0, 1])
  _labelled_tar(tmp_path / "val.tar", [0, 1, 3])
  config = {"name": "webdataset", "path": str(tmp_path / "train.tar"),
            "eval_path": str(tmp_path / "val.tar"), "image_size": 6}
  train = build_source(config, split="train", seed=0)
  val = build_source(config, split="validation", seed=0)
  with pytest.raises(ValueError, match=r"val\.tar/k02 has the label 3.*data\.num_classes to "
                                       r"at least 4"):
    check_labels(val, train.num_classes, "validation")
  check_labels(build_source(config, split="train", seed=0), train.num_classes, "train")
  # The fix the message names: every split then has 4 classes.
  fixed = {**config, "num_classes": 4}
  train = build_source(fixed, split="train", seed=0)
  check_labels(build_source(fixed, split="validation", seed=0), train.num_classes,
               "validation")


def test_an_unlabeled_or_negative_evaluation_split_is_refused(tmp_path):
  _labelled_tar(tmp_path / "train.tar", [0, 1])
  _labelled_tar(tmp_path / "val.tar", [0, -1, 1])      # -1: no label, so unlabeled
  val = build_source({"name": "webdataset", "path": str(tmp_path / "train.tar"),
                      "eval_path": str(tmp_path / "val.tar"), "image_size": 6},
                     split="validation", seed=0)
  with pytest.raises(ValueError, match="'validation' split has no labels"):
    check_labels(val, 2, "validation")
  images = np.zeros((3, 4, 4, 3), np.uint8)
  arrays = ArraySource(images, np.array([0, 1, 1]), num_classes=2, image_size=4, channels=3,
                       augment="none", seed=0)
  with pytest.raises(ValueError, match="example 1 has the label 1"):
    check_labels(arrays, 1, "test")
  with pytest.raises(ValueError, match="example 2 has the label -1"):
    ArraySource(images, np.array([0, 1, -1]), num_classes=2, image_size=4, channels=3,
                augment="none", seed=0)
  with pytest.raises(ValueError, match="example 1 has the label 5"):
    ArraySource(images, np.array([0, 5, 1]), num_classes=2, image_size=4, channels=3,
                augment="none", seed=0)


def test_a_hash_split_counts_the_classes_of_both_splits(tmp_path):
  """A class whose only example falls in validation is a class of the
  training split too, so a classifier trained there can score it."""
  keys = [f"k{i:02d}" for i in range(10)]
  first = min(range(10), key=lambda i: image_folder.name_hash(f"s.tar/{keys[i]}"))
  labels = [i % 2 for i in range(10)]
  labels[first] = 2
  _labelled_tar(tmp_path / "s.tar", labels)
  config = {"name": "webdataset", "path": str(tmp_path / "s.tar"), "image_size": 6,
            "val_split_size": 1}
  train = build_source(config, split="train", seed=0)
  val = build_source(config, split="validation", seed=0)
  assert val.labels.tolist() == [2]
  assert train.num_classes == val.num_classes == 3
  check_labels(val, train.num_classes, "validation")
