"""Tests of darl_jax.data: sources, batching determinism, eval coverage,
augmentation, errors. No network; TensorFlow tests skip if TF is absent."""

import gzip
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from PIL import Image

from darl_jax.data.transforms import augment as aug
from darl_jax.data import build_source
from darl_jax.data.sources import fashion_mnist_idx
from idx_files import write_idx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBIAN_DIR = fashion_mnist_idx.DEFAULT_PATH
HAVE_DEBIAN = os.path.isfile(
    os.path.join(DEBIAN_DIR, "train-images-idx3-ubyte.gz"))
FAKE_TRAIN, FAKE_TEST, FAKE_VAL = 300, 100, 50


pytestmark = pytest.mark.usefixtures("no_network")   # conftest.py


@pytest.fixture(scope="session")
def fake_fashion(tmp_path_factory):
  """A Fashion-MNIST-shaped IDX directory: 300 train / 100 test examples."""
  d = tmp_path_factory.mktemp("fashion")
  rng = np.random.default_rng(0)
  arrays = {}
  for part, n in (("train", FAKE_TRAIN), ("t10k", FAKE_TEST)):
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = (np.arange(n) * 7 % 10).astype(np.uint8)
    write_idx(d / f"{part}-images-idx3-ubyte.gz", images)
    write_idx(d / f"{part}-labels-idx1-ubyte.gz", labels)
    arrays[part] = (images, labels)
  return str(d), arrays


def fashion_cfg(path, **kw):
  return dict(name="fashion_mnist", path=path, val_split_size=FAKE_VAL, **kw)


@pytest.fixture
def tf(monkeypatch, tmp_path):
  tf = pytest.importorskip(
      "tensorflow", reason="TensorFlow not importable: TFDS paths untested")
  pytest.importorskip("tensorflow_datasets",
                      reason="tensorflow_datasets not importable")
  # TFDS leaves an empty mkdtemp() folder per builder of an unprepared
  # dataset; keep those inside pytest's tmp_path.
  scratch = tmp_path / "scratch"
  scratch.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(scratch))
  return tf


def collect_eval(source, batch_size, process_count):
  """Per-process lists of eval batches."""
  return [list(source.eval_batches(batch_size, p, process_count))
          for p in range(process_count)]


def check_eval_coverage(source, expected_images, expected_labels, batch_size,
                        process_count):
  per_proc = collect_eval(source, batch_size, process_count)
  local = batch_size // process_count
  assert len({len(b) for b in per_proc}) == 1  # equal batch counts
  images, labels = [], []
  for batches in per_proc:
    for b in batches:
      assert b["image"].shape == (local, *source.image_shape)
      assert b["mask"].dtype == bool and b["label"].dtype == np.int32
      assert not b["image"][~b["mask"]].any()  # padding rows are zeros
      assert b["mask"].sum() == 0 or b["mask"][:b["mask"].sum()].all()
      images.append(b["image"][b["mask"]])
      labels.append(b["label"][b["mask"]])
  images, labels = np.concatenate(images), np.concatenate(labels)
  assert len(labels) == source.num_examples == len(expected_labels)
  np.testing.assert_array_equal(labels, expected_labels)
  np.testing.assert_allclose(images, expected_images, atol=1e-6)


# -- registry and errors ----------------------------------------------------


def test_unknown_name_lists_valid_names():
  with pytest.raises(ValueError) as e:
    build_source({"name": "cifar"}, split="train", seed=0)
  for name in ("fashion_mnist", "digits", "imagenet2012", "image_folder",
               "tfds"):
    assert name in str(e.value)


def test_unknown_split(fake_fashion):
  with pytest.raises(ValueError, match="validation"):
    build_source(fashion_cfg(fake_fashion[0]), split="dev", seed=0)


def test_missing_fashion_files_message(tmp_path):
  for path in (tmp_path, tmp_path / "absent"):
    with pytest.raises(FileNotFoundError,
                       match="apt-get install -y dataset-fashion-mnist"):
      build_source({"name": "fashion_mnist", "path": str(path)},
                   split="train", seed=0)


def test_batch_not_divisible_by_process_count(fake_fashion):
  src = build_source(fashion_cfg(fake_fashion[0]), split="train", seed=0)
  with pytest.raises(ValueError, match="not divisible"):
    src.train_batches(10, process_index=0, process_count=3)
  with pytest.raises(ValueError, match="not divisible"):
    src.eval_batches(10, process_index=0, process_count=4)


# -- Fashion-MNIST (numpy) --------------------------------------------------


def test_idx_reader_and_splits(fake_fashion):
  path, arrays = fake_fashion
  train_images, train_labels = arrays["train"]
  val = build_source(fashion_cfg(path), split="validation", seed=0)
  assert val.num_examples == FAKE_VAL and val.num_classes == 10
  batch = next(val.eval_batches(FAKE_VAL))
  # validation = the LAST val_split_size examples of the training files
  np.testing.assert_array_equal(batch["label"], train_labels[-FAKE_VAL:])
  np.testing.assert_allclose(
      batch["image"][..., 0], train_images[-FAKE_VAL:])
  train = build_source(fashion_cfg(path), split="train", seed=0)
  test = build_source(fashion_cfg(path), split="test", seed=0)
  assert (train.num_examples, test.num_examples) == (
      FAKE_TRAIN - FAKE_VAL, FAKE_TEST)


def test_read_idx_rejects_garbage(tmp_path):
  bad = tmp_path / "bad.gz"
  with gzip.open(bad, "wb") as f:
    f.write(b"\x01\x02\x03\x04garbage")
  with pytest.raises(ValueError, match="magic"):
    fashion_mnist_idx.read_idx(str(bad))


@pytest.mark.skipif(not HAVE_DEBIAN, reason="dataset-fashion-mnist missing")
def test_fashion_mnist_debian_files():
  cfg = {"name": "fashion_mnist", "augment": "spatial"}
  sizes = {s: build_source(cfg, split=s, seed=0).num_examples
           for s in ("train", "validation", "test")}
  assert sizes == {"train": 55000, "validation": 5000, "test": 10000}
  src = build_source(cfg, split="train", seed=0)
  batch = next(src.train_batches(256))
  assert batch["image"].shape == (256, 28, 28, 1)
  assert batch["image"].dtype == np.uint8 and batch["label"].dtype == np.int32
  assert batch["image"].min() < 128 < batch["image"].max()
  assert set(np.unique(batch["label"])) <= set(range(10))
  rgb = build_source(dict(cfg, image_size=32, channels=3), split="test",
                     seed=0)
  assert rgb.image_shape == (32, 32, 3)
  b = next(rgb.eval_batches(8))
  assert b["image"].shape == (8, 32, 32, 3)
  np.testing.assert_array_equal(b["image"][..., 0], b["image"][..., 2])


# -- determinism, process slices, eval coverage ------------------------------


def small_sources(fake_path, augment):
  return {
      "fashion_mnist": build_source(fashion_cfg(fake_path, augment=augment),
                                    split="train", seed=3),
      "digits": build_source({"name": "digits", "augment": augment},
                             split="train", seed=3),
  }


@pytest.mark.parametrize("augment", ["none", "spatial"])
@pytest.mark.parametrize("name", ["fashion_mnist", "digits"])
def test_resume_gives_identical_batches(fake_fashion, name, augment):
  src = small_sources(fake_fashion[0], augment)[name]
  it = src.train_batches(64)
  from_zero = [next(it) for _ in range(8)]  # 512 > N: crosses epochs
  resumed = next(src.train_batches(64, start_step=5))
  np.testing.assert_array_equal(resumed["image"], from_zero[5]["image"])
  np.testing.assert_array_equal(resumed["label"], from_zero[5]["label"])
  assert not np.array_equal(from_zero[4]["image"], from_zero[5]["image"])


def test_seed_changes_the_stream():
  a = build_source({"name": "digits"}, split="train", seed=3)
  b = build_source({"name": "digits"}, split="train", seed=4)
  assert not np.array_equal(next(a.train_batches(64))["label"],
                            next(b.train_batches(64))["label"])


def test_config_dict_with_missing_keys():
  ml_collections = pytest.importorskip("ml_collections")
  cfg = ml_collections.ConfigDict({"name": "digits", "augment": "spatial",
                                   "path": None})  # None -> default
  src = build_source(cfg, split="validation", seed=0)
  assert src.image_shape == (8, 8, 1) and src.num_examples == 180


@pytest.mark.parametrize("name", ["fashion_mnist", "digits"])
def test_process_slices_concatenate_to_global_batch(fake_fashion, name):
  src = small_sources(fake_fashion[0], "spatial")[name]
  for step in (0, 3, 7):  # step 3 straddles an epoch boundary for fashion
    whole = next(src.train_batches(96, start_step=step))
    parts = [next(src.train_batches(96, start_step=step, process_index=p,
                                    process_count=2)) for p in range(2)]
    assert parts[0]["image"].shape[0] == 48
    for key in ("image", "label"):
      np.testing.assert_array_equal(
          np.concatenate([p[key] for p in parts]), whole[key])


def test_each_epoch_is_a_permutation(fake_fashion):
  src = small_sources(fake_fashion[0], "none")["fashion_mnist"]
  n = src.num_examples  # 250
  seen = np.concatenate([src.train_indices(s, 50)[0] for s in range(5)])
  np.testing.assert_array_equal(np.sort(seen), np.arange(n))
  nxt = np.concatenate([src.train_indices(s, 50)[0] for s in range(5, 10)])
  np.testing.assert_array_equal(np.sort(nxt), np.arange(n))
  assert not np.array_equal(seen, nxt)  # reshuffled every epoch


@pytest.mark.parametrize("process_count", [1, 2, 3])
def test_eval_covers_every_example_once(fake_fashion, process_count):
  path, arrays = fake_fashion
  src = build_source(fashion_cfg(path, augment="spatial"), split="test",
                     seed=0)
  images, labels = arrays["t10k"]
  check_eval_coverage(src, images[..., None], labels,
                      batch_size=24, process_count=process_count)


def test_digits_splits():
  sizes, labels = {}, {}
  for split in ("train", "validation", "test"):
    src = build_source({"name": "digits"}, split=split, seed=0)
    assert src.image_shape == (8, 8, 1) and src.num_classes == 10
    sizes[split] = src.num_examples
    labels[split] = np.concatenate(
        [b["label"][b["mask"]] for b in src.eval_batches(100)])
  assert sizes == {"train": 1257, "validation": 180, "test": 360}
  assert set(labels["test"]) == set(range(10))
  big = build_source({"name": "digits", "image_size": 16, "channels": 3,
                      "augment": "spatial"}, split="train", seed=0)
  batch = next(big.train_batches(32))
  assert batch["image"].shape == (32, 16, 16, 3)
  assert batch["image"].dtype == np.uint8


# -- augmentation -------------------------------------------------------------


def test_augmentation_range_shape_and_change():
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (64, 28, 28, 1), dtype=np.uint8)
  pos = np.arange(64)
  out = aug.to_unit_range(aug.random_resized_crop(images, 0, pos, 28))
  plain = aug.to_unit_range(aug.resize_full(images, 28))
  assert out.shape == (64, 28, 28, 1) and out.dtype == np.float32
  assert out.min() >= -1 and out.max() <= 1
  changed = np.abs(out - plain).reshape(64, -1).max(axis=1) > 0.1
  assert changed.all()
  again = aug.to_unit_range(aug.random_resized_crop(images, 0, pos, 28))
  np.testing.assert_array_equal(out, again)  # a function of (seed, position)
  other = aug.to_unit_range(aug.random_resized_crop(images, 1, pos, 28))
  assert not np.array_equal(out, other)


def test_crop_boxes_respect_scale_ratio_and_bounds():
  u = aug.hash_uniform(7, np.arange(4000), 4 * aug.CROP_ATTEMPTS + 1)
  assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
  top, left, bh, bw = aug.sample_crop_boxes(u, 40, 30)
  assert (top >= 0).all() and (left >= 0).all()
  assert (top + bh <= 40 + 1e-9).all() and (left + bw <= 30 + 1e-9).all()
  area = bh * bw / (40 * 30)
  assert area.min() >= 0.2 - 1e-9 and area.max() <= 1 + 1e-9
  assert area.max() - area.min() > 0.5  # the whole scale range is used
  ratio = bw / bh
  assert ratio.min() >= 0.75 - 1e-9 and ratio.max() <= 4 / 3 + 1e-9
  flips = u[:, -1] < aug.FLIP_PROB
  assert 0.45 < flips.mean() < 0.55


def test_resample_identity_flip_and_pil_agreement():
  rng = np.random.default_rng(1)
  images = rng.integers(0, 256, (3, 20, 24, 3), dtype=np.uint8)
  full = aug.resample(images, 0.0, 0.0, 20.0, 20.0, 20)
  np.testing.assert_allclose(full, images[:, :, :20], atol=1e-3)
  flipped = aug.resample(images, 0.0, 0.0, 20.0, 20.0, 20,
                         flip=np.array([True, False, True]))
  np.testing.assert_allclose(flipped[0], images[0, :, 19::-1], atol=1e-3)
  np.testing.assert_allclose(flipped[1], images[1, :, :20], atol=1e-3)
  for out in (9, 50):  # antialiased down- and bilinear up-sampling
    ref = np.stack([np.asarray(Image.fromarray(im).resize((out, out),
                                                          Image.BILINEAR))
                    for im in images]).astype(np.float32)
    got = aug.resample(images, 0, 0, 20, 24, out)
    assert np.abs(got - ref).max() <= 1.5  # PIL rounds to uint8


def test_augmentation_speed():
  images = np.random.default_rng(0).integers(0, 256, (256, 28, 28, 1),
                                             dtype=np.uint8)
  pos = np.arange(256)
  times = []
  for _ in range(10):
    start = time.perf_counter()
    aug.to_unit_range(aug.random_resized_crop(images, 0, pos, 28))
    times.append(time.perf_counter() - start)
  # ~3 ms on one idle core; the bound leaves room for loaded CI machines.
  assert np.median(times) < 0.05


def test_channel_conversion():
  gray = np.full((2, 4, 4, 1), 100.0, np.float32)
  rgb = aug.convert_channels(gray, 3)
  assert rgb.shape == (2, 4, 4, 3) and (rgb == 100).all()
  back = aug.convert_channels(rgb, 1)
  np.testing.assert_allclose(back, gray, rtol=1e-5)


# -- image folder -------------------------------------------------------------


def save_image(path, size, color, mode="RGB"):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  w, h = size
  arr = np.zeros((h, w, 3), np.uint8)
  arr[:] = color
  arr[:, : w // 4] = 255 - np.asarray(color, np.uint8)  # asymmetric stripe
  img = Image.fromarray(arr)
  if mode == "L":
    img = img.convert("L")
  img.save(path)


def test_image_folder_with_classes(tmp_path):
  sizes = [(40, 30), (17, 50), (64, 64), (33, 21)]
  for k, cls in enumerate(["zebra", "ant", "moth"]):  # labels: sorted names
    for j, size in enumerate(sizes):
      ext = "png" if j % 2 else "jpg"
      save_image(tmp_path / "train" / cls / f"{j}.{ext}", size,
                 (50 * k, 10, 200), mode="L" if j == 3 else "RGB")
    save_image(tmp_path / "val" / cls / "v.png", (25, 25), (50 * k, 10, 200))
  cfg = {"name": "image_folder", "path": str(tmp_path), "image_size": 16,
         "channels": 3, "augment": "spatial"}
  train = build_source(cfg, split="train", seed=0)
  assert (train.num_examples, train.num_classes) == (12, 3)
  assert train.class_names == ["ant", "moth", "zebra"]
  batch = next(train.train_batches(8))
  assert batch["image"].shape == (8, 16, 16, 3)
  assert batch["image"].dtype == np.uint8
  from_zero = list(_take(train.train_batches(8), 3))
  np.testing.assert_array_equal(
      next(train.train_batches(8, start_step=2))["image"],
      from_zero[2]["image"])
  val = build_source(dict(cfg, augment="none"), split="validation", seed=0)
  assert val.num_examples == 3
  b = next(val.eval_batches(4))
  np.testing.assert_array_equal(b["label"][b["mask"]], [0, 1, 2])
  assert not b["mask"][3]
  gray = build_source(dict(cfg, channels=1), split="validation", seed=0)
  assert next(gray.eval_batches(4))["image"].shape == (4, 16, 16, 1)
  with pytest.raises(ValueError, match="test"):
    build_source(cfg, split="test", seed=0)


def _take(iterator, n):
  for _ in range(n):
    yield next(iterator)


def test_image_folder_flat_hash_split(tmp_path):
  for i in range(20):
    save_image(tmp_path / f"img{i:02d}.png", (10 + i, 30 - i), (i * 10, 0, 0))
  cfg = {"name": "image_folder", "path": str(tmp_path), "image_size": 8,
         "channels": 1, "val_split_size": 5}
  train = build_source(cfg, split="train", seed=0)
  val = build_source(cfg, split="validation", seed=0)
  assert (train.num_examples, val.num_examples) == (15, 5)
  assert train.num_classes == 0
  assert not set(train.paths) & set(val.paths)
  b = next(train.eval_batches(16))
  assert b["image"].shape == (16, 8, 8, 1) and not b["label"].any()
  assert b["mask"].sum() == 15


def test_image_folder_errors(tmp_path):
  cfg = {"name": "image_folder", "path": str(tmp_path / "nope")}
  with pytest.raises(FileNotFoundError, match="does not exist"):
    build_source(cfg, split="train", seed=0)
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "notes.txt").write_text("no images")
  with pytest.raises(ValueError, match="no images"):
    build_source(dict(cfg, path=str(tmp_path / "empty")), split="train",
                 seed=0)


# -- TensorFlow paths ---------------------------------------------------------


def test_tfds_fashion_backend_matches_numpy(tf, fake_fashion, tmp_path):
  path, _ = fake_fashion
  cfg = fashion_cfg(path, backend="tfds", tfds_data_dir=str(tmp_path))
  val_tf = build_source(cfg, split="validation", seed=0)
  val_np = build_source(dict(cfg, backend="numpy"), split="validation",
                        seed=0)
  assert val_tf.num_examples == FAKE_VAL and val_tf.num_classes == 10
  assert os.path.isdir(tmp_path / "debian_fashion_mnist")
  for process_count, batch_size in ((1, 16), (2, 16), (3, 15)):
    got = collect_eval(val_tf, batch_size, process_count)
    want = collect_eval(val_np, batch_size, process_count)
    for g_list, w_list in zip(got, want):
      assert len(g_list) == len(w_list)
      for g, w in zip(g_list, w_list):
        np.testing.assert_array_equal(g["label"], w["label"])
        np.testing.assert_array_equal(g["mask"], w["mask"])
        np.testing.assert_allclose(g["image"], w["image"], atol=1e-6)
  train = build_source(dict(cfg, augment="spatial", channels=3),
                       split="train", seed=0)
  it = train.train_batches(64)
  batches = [next(it) for _ in range(5)]  # 320 > 250: crosses an epoch
  assert batches[0]["image"].shape == (64, 28, 28, 3)
  assert batches[0]["image"].dtype == np.uint8
  resumed = next(train.train_batches(64, start_step=4))
  np.testing.assert_array_equal(resumed["image"], batches[4]["image"])
  np.testing.assert_array_equal(resumed["label"], batches[4]["label"])


def test_imagenet2012_mock_and_not_prepared(tf, tmp_path):
  import tensorflow_datasets as tfds
  cfg = {"name": "imagenet2012", "image_size": 24, "augment": "spatial",
         "tfds_data_dir": str(tmp_path)}
  with pytest.raises(FileNotFoundError) as e:
    build_source(cfg, split="train", seed=0)
  msg = str(e.value)
  assert "ILSVRC2012_img_train.tar" in msg and "ILSVRC2012_img_val.tar" in msg
  assert f"{tmp_path}/downloads/manual/" in msg
  assert f"tfds build imagenet2012 --data_dir={tmp_path}" in msg
  assert "\n" not in msg
  with tfds.testing.mock_data(num_examples=6):
    train = build_source(cfg, split="train", seed=0)
    assert train.image_shape == (24, 24, 3) and train.num_classes == 1000
    it = train.train_batches(4)
    batch = next(it)
    assert batch["image"].shape == (4, 24, 24, 3)
    assert next(it)["image"].shape == (4, 24, 24, 3)  # crosses the epoch
    assert batch["label"].dtype == np.int32
    assert batch["image"].dtype == np.uint8
    assert batch["image"].std() > 0.05
    val = build_source(dict(cfg, augment="none"), split="validation", seed=0)
    batches = list(val.eval_batches(4))
    assert [b["mask"].sum() for b in batches] == [4, 2]
    assert batches[1]["image"].shape == (4, 24, 24, 3)


# -- TensorFlow-free import ---------------------------------------------------


def test_numpy_sources_work_without_tensorflow(fake_fashion):
  code = f"""
import sys
sys.modules["tensorflow"] = None  # any `import tensorflow` now fails
sys.modules["tensorflow_datasets"] = None
import darl_jax.data as data
src = data.build_source({{"name": "fashion_mnist", "path": {fake_fashion[0]!r},
                         "val_split_size": 50, "augment": "spatial"}},
                        split="train", seed=0)
batch = next(src.train_batches(32))
assert batch["image"].shape == (32, 28, 28, 1), batch["image"].shape
try:
  data.build_source({{"name": "imagenet2012"}}, split="train", seed=0)
except ImportError:
  pass
else:
  raise AssertionError("imagenet2012 should need tensorflow")
print("OK")
"""
  result = subprocess.run([sys.executable, "-c", code], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == "OK"
