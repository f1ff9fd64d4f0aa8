"""Tests of ``config.data.crop_scale``: the random-resized crop's (min, max)
area fraction, from the config through every source to the crop box.

The key fact used throughout: with ``crop_scale=(1.0, 1.0)`` the crop is the
whole image. A sampled attempt needs ``area * r <= w * h`` width-wise and
``area / r <= w * h`` height-wise, so on a square image a full-area attempt
fits only for an aspect ratio ``r`` of exactly 1, which the log-uniform
ratio draw (almost) never gives: all 10 attempts fail and the fallback box is
used, the largest central box with its ratio clamped to (3/4, 4/3), which
for any source ratio inside that range is the whole image. (Were an attempt
to fit, it would be the whole image too.) The training image is then the
eval image, or its mirror when the flip uniform is below 1/2, exactly: both
go through the same resampling of the same box. No network, no downloads.
"""

import io
import os
import runpy
import types

import ml_collections
import numpy as np
import pytest
from PIL import Image

from darl_jax import config_lib
from darl_jax.data.transforms import augment as aug
from darl_jax.data import build_source
from darl_jax.data.sources import digits
from darl_jax.data.sources import fashion_mnist
from darl_jax.data.sources import image_folder
from darl_jax.data.sources import indexed
from darl_jax.data.sources import tfds_records
from darl_jax.data.sources import vtab_tasks
from idx_files import write_idx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = (1.0, 1.0)
NUM_U = 4 * aug.CROP_ATTEMPTS + 1
BAD_SCALES = [(0.5, 0.2), (0.0, 1.0), (0.3, 1.5), (0.5,)]


pytestmark = pytest.mark.usefixtures("no_network")   # conftest.py


def flips_of(seed, positions):
  """The flip decisions of the counter-based rng (as augment.py draws them)."""
  return aug.hash_uniform(seed, positions, NUM_U)[:, -1] < aug.FLIP_PROB


def expected_full_crop(eval_images, flips):
  """Eval images, mirrored where ``flips``: what a full-area crop gives."""
  return np.where(flips[:, None, None, None], eval_images[:, :, ::-1], eval_images)


def differs_from_eval(train, eval_images):
  """Per example: the training image is neither the eval image nor its mirror."""
  t = train.astype(np.int32)
  e = eval_images.astype(np.int32)
  plain = np.abs(t - e).reshape(len(t), -1).max(axis=1)
  mirror = np.abs(t - e[:, :, ::-1]).reshape(len(t), -1).max(axis=1)
  return (plain > 2) & (mirror > 2)


# -- 1. sample_crop_boxes -----------------------------------------------------


def fallback_box(h, w, ratio=aug.CROP_RATIO):
  """The documented fallback: the largest central box, ratio clamped."""
  bw = min(w, h * ratio[1]) if w / h > ratio[1] else w
  bh = min(h, w / ratio[0]) if w / h < ratio[0] else h
  return (h - bh) / 2, (w - bw) / 2, bh, bw


@pytest.mark.parametrize("hw", [(32, 32), (40, 30), (20, 50)])
@pytest.mark.parametrize("scale", [(0.2, 1.0), (0.5, 0.7), (0.8, 1.0), (0.05, 0.1), FULL])
def test_crop_box_area_within_scale_or_fallback(hw, scale):
  h, w = hw
  u = aug.hash_uniform(11, np.arange(3000), NUM_U)
  top, left, bh, bw = aug.sample_crop_boxes(u, h, w, scale=scale)
  assert (top >= 0).all() and (left >= 0).all()
  assert (top + bh <= h + 1e-9).all() and (left + bw <= w + 1e-9).all()
  area = bh * bw / (h * w)
  inside = (area >= scale[0] - 1e-9) & (area <= scale[1] + 1e-9)
  ratio = bw / bh
  assert (ratio[inside] >= aug.CROP_RATIO[0] - 1e-9).all()
  assert (ratio[inside] <= aug.CROP_RATIO[1] + 1e-9).all()
  # Anything outside the scale is exactly the central fallback box.
  fb = fallback_box(h, w)
  for got, want in zip((top, left, bh, bw), fb):
    np.testing.assert_allclose(got[~inside], want, rtol=0, atol=1e-9)


@pytest.mark.parametrize("scale", [(0.8, 1.0), (0.5, 0.9), FULL])
def test_crop_box_area_strictly_in_scale_on_square_images(scale):
  # On a square image the fallback is the whole image (area 1), inside any
  # scale whose max is 1; for (0.5, 0.9) every 10-attempt draw here fits.
  # (Not every single attempt fits: area 0.9 at ratio 4/3 is 1.1 times wider
  # than the image; the fallback being the full image is what makes this hold.)
  u = aug.hash_uniform(3, np.arange(5000), NUM_U)
  top, left, bh, bw = aug.sample_crop_boxes(u, 24, 24, scale=scale)
  area = bh * bw / 24 ** 2
  assert area.min() >= scale[0] - 1e-9 and area.max() <= scale[1] + 1e-9
  assert (top >= 0).all() and (top + bh <= 24 + 1e-9).all()
  assert (left >= 0).all() and (left + bw <= 24 + 1e-9).all()


def test_crop_scale_parameter_matters():
  u = aug.hash_uniform(5, np.arange(4000), NUM_U)
  area = {}
  for scale in ((0.2, 1.0), (0.8, 1.0)):
    _, _, bh, bw = aug.sample_crop_boxes(u, 28, 28, scale=scale)
    area[scale] = bh * bw / 28 ** 2
  assert (area[(0.2, 1.0)] < 0.8).mean() > 0.5
  assert area[(0.2, 1.0)].min() < 0.25
  assert area[(0.8, 1.0)].min() >= 0.8 - 1e-9
  # The default argument is CROP_SCALE = (0.2, 1.0).
  assert aug.CROP_SCALE == (0.2, 1.0)
  _, _, bh, bw = aug.sample_crop_boxes(u, 28, 28)
  np.testing.assert_array_equal(bh * bw / 28 ** 2, area[(0.2, 1.0)])


@pytest.mark.parametrize("hw", [(16, 16), (24, 32), (32, 24)])
def test_full_scale_box_is_whole_image_when_ratio_allows(hw):
  h, w = hw  # source ratios 1, 4/3, 3/4: all inside the ratio range
  u = aug.hash_uniform(0, np.arange(500), NUM_U)
  top, left, bh, bw = aug.sample_crop_boxes(u, h, w, scale=FULL)
  np.testing.assert_array_equal(top, 0.0)
  np.testing.assert_array_equal(left, 0.0)
  np.testing.assert_array_equal(bh, float(h))
  np.testing.assert_array_equal(bw, float(w))


def test_full_scale_box_on_wide_image_is_central_ratio_clamped():
  u = aug.hash_uniform(0, np.arange(200), NUM_U)
  top, left, bh, bw = aug.sample_crop_boxes(u, 20, 40, scale=FULL)
  np.testing.assert_allclose(bh, 20.0)
  np.testing.assert_allclose(bw, 20.0 * 4 / 3)
  np.testing.assert_allclose(left, (40 - 20.0 * 4 / 3) / 2)
  np.testing.assert_allclose(top, 0.0)


def test_random_resized_crop_uses_scale():
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (64, 12, 12, 3), dtype=np.uint8)
  pos = np.arange(100, 164)
  full = aug.random_resized_crop(images, 7, pos, 12, scale=FULL)
  np.testing.assert_array_equal(full, expected_full_crop(images, flips_of(7, pos)))
  assert 0 < flips_of(7, pos).sum() < 64
  default = aug.random_resized_crop(images, 7, pos, 12)
  assert differs_from_eval(aug.to_uint8(default), images).mean() > 0.8
  np.testing.assert_array_equal(
      default, aug.random_resized_crop(images, 7, pos, 12, scale=(0.2, 1.0)))


# -- 2. in-memory sources (ArraySource) ----------------------------------------


def train_and_eval(source, step=0, batch_size=64):
  """(training images, eval images of the same examples, flips)."""
  batch = source.train_batch(step, batch_size)
  indices, positions = source.train_indices(step, batch_size)
  eval_images = source._load(indices, None)  # pylint: disable=protected-access
  return batch["image"], eval_images, flips_of(source.seed, positions)


def digits_cfg(**kw):
  return ml_collections.ConfigDict(dict(dict(augment="spatial", image_size=8, channels=1), **kw))


def test_digits_full_area_crop_is_eval_image_or_mirror():
  source = digits.build(digits_cfg(crop_scale=FULL), split="train", seed=3)
  assert source.crop_scale == FULL
  for step in (0, 5):
    train, eval_images, flips = train_and_eval(source, step)
    assert 0 < flips.sum() < len(flips)
    np.testing.assert_array_equal(train, expected_full_crop(eval_images, flips))


@pytest.mark.parametrize("size,channels", [(16, 1), (12, 3)])
def test_digits_full_area_crop_resized(size, channels):
  # Resizing (8 -> size) and gray -> RGB happen after the crop; the full crop
  # and the eval resize sample the same positions (mirrored when flipped).
  source = digits.build(digits_cfg(crop_scale=FULL, image_size=size, channels=channels),
                        split="train", seed=1)
  train, eval_images, flips = train_and_eval(source)
  assert train.shape == (64, size, size, channels)
  want = expected_full_crop(eval_images, flips).astype(np.int32)
  assert np.abs(train.astype(np.int32) - want).max() <= 1


def test_digits_default_crop_scale_changes_images():
  cfg = digits_cfg()
  assert "crop_scale" not in cfg
  source = digits.build(cfg, split="train", seed=3)
  assert source.crop_scale == aug.CROP_SCALE
  train, eval_images, _ = train_and_eval(source)
  assert differs_from_eval(train, eval_images).mean() > 0.5


def test_digits_crop_scale_sets_how_much_changes():
  """A larger minimum area keeps the crops closer to the whole image."""
  err = {}
  for scale in ((0.2, 1.0), (0.9, 1.0)):
    source = digits.build(digits_cfg(crop_scale=scale, image_size=16), split="train", seed=0)
    train, eval_images, flips = train_and_eval(source, batch_size=256)
    want = expected_full_crop(eval_images, flips)
    err[scale] = np.abs(train.astype(np.float32) - want).mean()
  assert err[(0.9, 1.0)] < 0.6 * err[(0.2, 1.0)]


@pytest.mark.parametrize("value,want", [((0.5, 0.9), (0.5, 0.9)), ([0.3, 1], (0.3, 1.0)),
                                        (None, aug.CROP_SCALE)])
def test_source_gets_config_crop_scale(value, want):
  cfg = ml_collections.ConfigDict({"name": "digits", "augment": "spatial", "image_size": 8,
                                   "crop_scale": value})
  for source in (digits.build(cfg, split="train", seed=0),
                 build_source(cfg, split="validation", seed=0),
                 build_source(dict(cfg.to_dict()), split="train", seed=0),
                 build_source(types.SimpleNamespace(**cfg.to_dict()), split="test", seed=0)):
    assert source.crop_scale == want
    assert all(isinstance(v, float) for v in source.crop_scale)


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_source_rejects_bad_crop_scale(bad):
  with pytest.raises(ValueError, match="data.crop_scale"):
    digits.build({"augment": "spatial", "crop_scale": bad}, split="train", seed=0)
  with pytest.raises(ValueError, match="data.crop_scale"):
    indexed.ArraySource(np.zeros((2, 4, 4, 1), np.uint8), np.zeros(2), num_classes=2,
                        image_size=4, channels=1, augment="spatial", seed=0, crop_scale=bad)


def test_finetune_experiment_data_config_reaches_source():
  config = runpy.run_path(os.path.join(REPO, "experiments", "fashion_mnist_finetune.py"))[
      "get_config"](None)
  assert tuple(config.data.crop_scale) == (0.2, 1.0)
  data = config.data
  data.name = "digits"   # in the package, unlike the Fashion-MNIST files
  data.crop_scale = FULL
  source = build_source(data, split="train", seed=2)
  assert source.augment == "spatial" and source.crop_scale == FULL
  train, eval_images, flips = train_and_eval(source, batch_size=32)
  want = expected_full_crop(eval_images, flips).astype(np.int32)
  assert np.abs(train.astype(np.int32) - want).max() <= 1


def test_fashion_mnist_build_passes_crop_scale(tmp_path):
  rng = np.random.default_rng(0)
  for part, n in (("train", 80), ("t10k", 20)):
    write_idx(tmp_path / f"{part}-images-idx3-ubyte.gz",
              rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
    write_idx(tmp_path / f"{part}-labels-idx1-ubyte.gz", np.arange(n) % 10)
  cfg = {"path": str(tmp_path), "val_split_size": 10, "augment": "spatial",
         "crop_scale": FULL, "backend": "numpy"}
  source = fashion_mnist.build(cfg, split="train", seed=4)
  assert source.crop_scale == FULL
  train, eval_images, flips = train_and_eval(source, batch_size=32)
  np.testing.assert_array_equal(train, expected_full_crop(eval_images, flips))
  default = fashion_mnist.build(dict(cfg, crop_scale=None), split="train", seed=4)
  assert default.crop_scale == aug.CROP_SCALE
  train, eval_images, _ = train_and_eval(default, batch_size=32)
  assert differs_from_eval(train, eval_images).mean() > 0.5


def test_vtab_build_source_passes_crop_scale(monkeypatch):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (40, 16, 16, 3), dtype=np.uint8)
  labels = np.arange(40, dtype=np.int32) % 5

  def fake_load_arrays(task, parts, image_size, data_dir=None):
    assert image_size == 16
    return images, labels

  monkeypatch.setattr(vtab_tasks, "load_arrays", fake_load_arrays)
  task = next(iter(vtab_tasks.TASKS))
  cfg = {"vtab_task": task, "image_size": 16, "augment": "spatial", "crop_scale": FULL}
  source = vtab_tasks.build_source(cfg, split="train800", seed=0)
  assert source.crop_scale == FULL
  train, eval_images, flips = train_and_eval(source, batch_size=16)
  np.testing.assert_array_equal(train, expected_full_crop(eval_images, flips))
  source = vtab_tasks.build_source(dict(cfg, crop_scale=(0.3, 0.6)), split="train800", seed=0)
  assert source.crop_scale == (0.3, 0.6)


# -- 3. image folders and TFDS records (PIL decode_crop) ------------------------


def save(path, array, **kw):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  Image.fromarray(array).save(path, **kw)
  return path


def noise(shape, seed=0):
  return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


@pytest.mark.parametrize("name,shape,out", [("a.png", (32, 32, 3), (16, 16, 3)),
                                            ("b.jpg", (40, 40, 3), (16, 16, 3)),
                                            ("c.png", (24, 24), (24, 24, 1)),
                                            ("d.png", (24, 32, 3), (20, 20, 3))])
def test_decode_crop_full_scale_is_eval_or_mirror(tmp_path, name, shape, out):
  path = save(str(tmp_path / name), noise(shape), **({"quality": 90} if name.endswith("jpg")
                                                       else {}))
  h, w = shape[:2]
  us = aug.crop_uniforms(9, np.arange(24), 24)
  if h == w:
    # Square: the full-area crop is the eval crop (central square of the whole image).
    ref = image_folder.decode_crop(path, None, out)
  else:
    # 4:3: the full-area crop is the whole (squashed) image, not the eval square.
    with Image.open(path) as img:
      ref = np.asarray(img.convert("RGB").resize(out[:2], Image.BILINEAR, box=(0, 0, w, h)))
  flips = np.array([u[-1] < aug.FLIP_PROB for u in us])
  assert 0 < flips.sum() < len(flips)
  changed = []
  for u, flip in zip(us, flips):
    got = image_folder.decode_crop(path, u, out, crop_scale=FULL)
    np.testing.assert_array_equal(got, ref[:, ::-1] if flip else ref)
    default = image_folder.decode_crop(path, u, out).astype(np.int32)
    changed.append(min(np.abs(default - ref).max(), np.abs(default - ref[:, ::-1]).max()) > 2)
  assert np.mean(changed) > 0.5


def test_decode_crop_scale_bounds_the_crop(tmp_path):
  """A small-area crop of a smooth gradient spans fewer grey levels."""
  ramp = np.tile(np.linspace(0, 255, 64).astype(np.uint8), (64, 1))
  path = save(str(tmp_path / "ramp.png"), ramp)
  us = aug.crop_uniforms(1, np.arange(32), 32)
  spans = {}
  for scale in ((0.05, 0.1), (0.9, 1.0)):
    spans[scale] = [np.ptp(image_folder.decode_crop(path, u, (16, 16, 1), crop_scale=scale)
                           .astype(np.int32)) for u in us]
  # Width fraction <= sqrt(0.1 * 4/3) ~ 0.37 against >= sqrt(0.9 * 3/4) ~ 0.82.
  assert max(spans[(0.05, 0.1)]) < 0.45 * 255
  assert min(spans[(0.9, 1.0)]) > 0.75 * 255


def make_folder(root, n=10, size=20):
  for i in range(n):
    save(os.path.join(root, f"cls{i % 2}", f"img{i}.png"), noise((size, size, 3), seed=i))


def test_image_folder_build_passes_crop_scale(tmp_path):
  make_folder(str(tmp_path))
  cfg = ml_collections.ConfigDict({"name": "image_folder", "path": str(tmp_path),
                                   "image_size": 20, "channels": 3, "augment": "spatial",
                                   "crop_scale": (0.6, 0.9)})
  source = image_folder.build(cfg, split="train", seed=0)
  assert isinstance(source, image_folder.ImageFolderSource)
  assert source.crop_scale == (0.6, 0.9)
  cfg.crop_scale = FULL
  source = build_source(cfg, split="train", seed=0)
  assert source.crop_scale == FULL
  train, eval_images, flips = train_and_eval(source, batch_size=8)
  assert 0 < flips.sum() < len(flips)
  np.testing.assert_array_equal(train, expected_full_crop(eval_images, flips))
  cfg.crop_scale = None  # placeholder left unset: the default
  source = image_folder.build(cfg, split="train", seed=0)
  assert source.crop_scale == aug.CROP_SCALE
  train, eval_images, _ = train_and_eval(source, batch_size=8)
  assert differs_from_eval(train, eval_images).mean() > 0.5


def png_bytes(array):
  buf = io.BytesIO()
  Image.fromarray(array).save(buf, format="PNG")
  return buf.getvalue()


def fake_builder(encoded, splits=True, num_classes=3):
  """Just enough of a TFDS builder for tfds_records.build / TfdsSource."""
  info = types.SimpleNamespace(
      splits={"train": types.SimpleNamespace(num_examples=len(encoded))} if splits else {},
      features={"image": types.SimpleNamespace(shape=(None, None, 3)),
                "label": types.SimpleNamespace(num_classes=num_classes)},
      file_format="array_record", disable_shuffling=False)
  return types.SimpleNamespace(info=info, name="fake", encoded=encoded)


def test_tfds_records_pass_crop_scale():
  encoded = [png_bytes(noise((24, 24, 3), seed=i)) for i in range(12)]
  cfg = {"image_size": 24, "channels": 3, "augment": "spatial", "crop_scale": FULL}
  source = tfds_records.build(cfg, fake_builder(encoded), name="fake", split="train",
                              data_dir="/nonexistent", seed=5, crop_fraction=1.0)
  assert source.crop_scale == FULL and source.num_examples == 12
  source._records = [{"image": e, "label": i % 3} for i, e in enumerate(encoded)]
  train, eval_images, flips = train_and_eval(source, batch_size=12)
  np.testing.assert_array_equal(train, expected_full_crop(eval_images, flips))
  default = tfds_records.build(dict(cfg, crop_scale=None), fake_builder(encoded), name="fake",
                               split="train", data_dir="/nonexistent", seed=5,
                               crop_fraction=1.0)
  assert default.crop_scale == aug.CROP_SCALE
  default._records = source._records
  train, eval_images, _ = train_and_eval(default, batch_size=12)
  assert differs_from_eval(train, eval_images).mean() > 0.5


# -- 4. TensorFlow preprocessing (tfds_source) -----------------------------------


@pytest.fixture
def tf():
  return pytest.importorskip("tensorflow", reason="TensorFlow not importable")


def test_jpeg_preprocess_full_scale_is_center_or_mirror(tf):
  from darl_jax.data.sources import tfds_source  # pylint: disable=g-import-not-at-top
  pre = tfds_source.JpegPreprocess((16, 16, 3), 3, 1.0, crop_scale=FULL)
  assert pre._crop_scale == FULL
  default = tfds_source.JpegPreprocess((16, 16, 3), 3, 1.0)
  assert default._crop_scale == aug.CROP_SCALE
  array = noise((16, 16, 3), seed=3)
  buf = io.BytesIO()
  Image.fromarray(array).save(buf, format="JPEG", quality=95)
  for data in (png_bytes(array), buf.getvalue()):
    encoded = tf.constant(data)
    center = pre.center(encoded).numpy()
    if data[:4] == b"\x89PNG":
      np.testing.assert_array_equal(center, array)
    flipped, changed = 0, 0
    for k in range(16):
      seed = tf.constant([7, k], tf.int64)
      got = pre.random(encoded, seed).numpy()
      is_flip = not np.array_equal(got, center)
      np.testing.assert_array_equal(got, center[:, ::-1] if is_flip else center)
      flipped += is_flip
      other = default.random(encoded, seed).numpy().astype(np.int32)
      changed += min(np.abs(other - center).max(), np.abs(other - center[:, ::-1]).max()) > 2
    assert 0 < flipped < 16
    assert changed > 8


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_jpeg_preprocess_rejects_bad_crop_scale(tf, bad):
  from darl_jax.data.sources import tfds_source  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="data.crop_scale"):
    tfds_source.JpegPreprocess((8, 8, 3), 3, 1.0, crop_scale=bad)


def test_tfds_source_passes_crop_scale(tf):
  pytest.importorskip("tensorflow_datasets")
  from darl_jax.data.sources import tfds_source  # pylint: disable=g-import-not-at-top
  arrays = [noise((16, 16, 3), seed=i) for i in range(8)]
  builder = fake_builder([png_bytes(a) for a in arrays])

  def as_dataset(**unused_kw):   # one split ("train", as a TFDS even split)
    return tf.data.Dataset.from_tensor_slices(
        {"image": tf.constant(builder.encoded), "label": tf.range(8, dtype=tf.int64) % 3})

  builder.as_dataset = as_dataset
  cfg = {"image_size": 16, "augment": "spatial", "crop_scale": FULL}
  source = tfds_source.TfdsSource(builder, "train", cfg, seed=0, crop_fraction=1.0,
                                  data_dir="/nonexistent", name="fake")
  assert source._preprocess._crop_scale == FULL
  batch = next(source.train_batches(8))
  for img in batch["image"]:   # shuffled: match each to some source image or its mirror
    assert any(np.array_equal(img, a) or np.array_equal(img, a[:, ::-1]) for a in arrays)
  source = tfds_source.TfdsSource(builder, "train", dict(cfg, crop_scale=(0.4, 0.5)), seed=0,
                                  crop_fraction=1.0, data_dir="/nonexistent", name="fake")
  assert source._preprocess._crop_scale == (0.4, 0.5)


# -- 5. config validation ----------------------------------------------------------


def finetune_config():
  return runpy.run_path(os.path.join(REPO, "experiments", "fashion_mnist_finetune.py"))[
      "get_config"](None)


def test_default_config_validates():
  config = finetune_config()
  assert tuple(config.data.crop_scale) == (0.2, 1.0)
  config_lib.validate(config)
  for good in ((0.8, 1.0), (1.0, 1.0), (0.08, 1.0), (0.5, 0.5)):
    config.data.crop_scale = good
    config_lib.validate(config)


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_validate_rejects_bad_crop_scale(bad):
  config = finetune_config()
  config.data.crop_scale = bad
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(config)
  assert "data.crop_scale" in str(e.value)


@pytest.mark.parametrize("bad", BAD_SCALES + [(0.2, 1.0, 0.5), "0.2,1.0", None])
def test_check_crop_scale_rejects(bad):
  with pytest.raises(ValueError, match="data.crop_scale"):
    aug.check_crop_scale(bad)


@pytest.mark.parametrize("good,want", [((0.2, 1.0), (0.2, 1.0)), ([1, 1], (1.0, 1.0)),
                                       ((0.5, 0.5), (0.5, 0.5)),
                                       (np.array([0.3, 0.9]), (0.3, 0.9))])
def test_check_crop_scale_accepts(good, want):
  got = aug.check_crop_scale(good)
  assert got == want and isinstance(got, tuple)
  assert all(type(v) is float for v in got)
