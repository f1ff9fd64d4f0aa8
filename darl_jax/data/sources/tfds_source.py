"""tf.data pipelines over prepared TFDS datasets (imagenet2012, any TFDS name,
and the local Fashion-MNIST builder). The only module that needs TensorFlow;
it is imported lazily, and TF is kept off the GPUs (JAX owns them).

Training stream and resume semantics
------------------------------------
Process p of P reads ``tfds.even_splits(split, P, drop_remainder=True)[p]``,
n = N // P examples. Its local stream is the concatenation of epochs; epoch e
reads the shard's files in an order shuffled with a seed derived from
(seed, p, e), then shuffles examples in a buffer seeded the same way. With
deterministic tf.data (the default), the stream is a pure function of
(seed, p, P). Local step s covers local stream positions [s * b, (s + 1) * b)
(b = batch_size // P), so ``start_step = s`` starts epoch
``e = s * b // n`` and skips its first ``s * b % n`` examples -- before JPEG
decoding (the image feature is read with `tfds.decode.SkipDecoding`), so the
skip costs only reading bytes. Crop/flip randomness is a stateless function of
(seed, p, stream position). Resuming with another process count gives a
different (equally valid) stream.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np

from darl_jax.data.transforms import augment as aug
from darl_jax.data.sources import tfds_records
from darl_jax.data.base import (AUGMENTS, Batch, DataSource, cfg_get,
                                check_process, local_batch_size,
                                num_eval_batches, pad_batch, process_range)

# Standard ImageNet eval: resize to S / 0.875 and center-crop S, done as
# "center-crop 0.875 of the shorter side, then resize to S".
IMAGENET_CROP_FRACTION = 0.875
DEFAULT_SHUFFLE_BUFFER = 10_000
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)
_LUMA = (0.299, 0.587, 0.114)  # same weights as augment.convert_channels
# data.backend for TFDS datasets: "records" reads ArrayRecord files record by
# record through the Grain pipeline (tfds_records.py), "tf" uses tf.data
# (this module), "auto" takes records when the dataset is prepared so.
BACKENDS = ("auto", "records", "tf")


class DatasetNotPreparedError(FileNotFoundError):
  """The TFDS dataset has no prepared files in its data_dir."""


def import_tf():
  """Imports TensorFlow with the GPUs hidden from it (JAX owns them)."""
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        "TFDS sources (imagenet2012, tfds, fashion_mnist backend='tfds') need "
        "tensorflow and tensorflow-datasets; without them use fashion_mnist "
        "with backend='numpy', digits or image_folder") from e
  try:
    tf.config.set_visible_devices([], "GPU")
  except RuntimeError:
    pass  # Devices already initialised: TF was set up by an earlier call.
  return tf


def default_data_dir() -> str:
  return os.path.expanduser(
      os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets"))


def not_prepared_message(name: str, data_dir: str) -> str:
  """One-line instructions to prepare ``name`` in ``data_dir``."""
  if name.split("/")[0].split(":")[0] == "imagenet2012":
    return (f"imagenet2012 is not prepared in {data_dir}: download "
            f"ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar into "
            f"{data_dir}/downloads/manual/ and run `tfds build imagenet2012 "
            f"--data_dir={data_dir}` (or python -c \"import "
            f"tensorflow_datasets as tfds; tfds.builder('imagenet2012', "
            f"data_dir='{data_dir}').download_and_prepare()\")")
  return (f"TFDS dataset {name} is not prepared in {data_dir}: run `tfds "
          f"build {name} --data_dir={data_dir}` where the sources can be "
          f"reached (nothing is downloaded at run time)")


def resolve_split(builder, split: str, val_split_size: int) -> str:
  """TFDS split string for train/validation/test.

  A dataset without a "validation" split gets one carved from the END of
  "train": validation = train[-V:], train = train[:-V] (V = val_split_size).
  """
  known = set(builder.info.splits.keys())  # empty when metadata is unknown
  carve = (bool(known) and "validation" not in known and "train" in known
           and val_split_size > 0)
  if carve and split == "train":
    return f"train[:-{val_split_size}]"
  if carve and split == "validation":
    return f"train[-{val_split_size}:]"
  if known and split not in known:
    raise ValueError(f"{builder.name} has no split {split!r}; it has "
                     f"{sorted(known)} (set val_split_size > 0 to carve a "
                     f"validation split from train)")
  return split


def seed_pair(*words: int) -> tuple[int, int]:
  """Two int31 seeds derived from ``words`` (tf.data wants small ints)."""
  state = np.random.SeedSequence(list(words)).generate_state(2)
  return int(state[0] & 0x7FFFFFFF), int(state[1] & 0x7FFFFFFF)


def rebatch(chunks: Iterator[Batch], size: int) -> Iterator[Batch]:
  """Regroups a stream of row-chunks into batches of exactly ``size`` rows.

  Needed where one batch straddles two per-epoch datasets.
  """
  pending: list[Batch] = []
  have = 0
  for chunk in chunks:
    if not pending and len(chunk["label"]) == size:
      yield chunk  # the common case: no copy
      continue
    pending.append(chunk)
    have += len(chunk["label"])
    while have >= size:
      merged = {k: np.concatenate([c[k] for c in pending]) for k in chunk}
      yield {k: v[:size] for k, v in merged.items()}
      rest = {k: v[size:] for k, v in merged.items()}
      have -= size
      pending = [rest] if have else []


def build(config: Any, *, split: str, seed: int,
          tfds_name: str) -> "TfdsSource":
  """Source over the prepared TFDS dataset ``tfds_name``."""
  import_tf()
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  data_dir = cfg_get(config, "tfds_data_dir", None)
  builder = tfds.builder(tfds_name, data_dir=data_dir)
  is_imagenet = tfds_name.split("/")[0].split(":")[0] == "imagenet2012"
  crop = cfg_get(config, "crop_fraction",
                 IMAGENET_CROP_FRACTION if is_imagenet else 1.0)
  data_dir = data_dir or default_data_dir()
  backend = cfg_get(config, "backend", "auto")
  if backend not in BACKENDS:
    raise ValueError(f"unknown data.backend {backend!r} for a TFDS dataset; valid: "
                     f"{', '.join(BACKENDS)}")
  if backend == "records" or (backend == "auto" and builder.info.splits
                              and tfds_records.file_format(builder) == "array_record"):
    spec = resolve_split(builder, split, int(cfg_get(config, "val_split_size", 0)))
    return tfds_records.build(config, builder, name=tfds_name, split=spec,
                              data_dir=data_dir, seed=seed, crop_fraction=crop)
  return TfdsSource(builder, split, config, seed=seed, crop_fraction=crop,
                    data_dir=data_dir, name=tfds_name)


class JpegPreprocess:
  """Per-image host preprocessing of encoded images (JPEG fast path).

  ``center(encoded)``: the evaluation crop (``crop_fraction`` of the shorter
  side, centred) resized to ``image_shape``; ``random(encoded, seed)``: the
  training crop (random-resized crop, area ``crop_scale``, ratio 3/4-4/3, then a flip),
  a stateless function of ``seed``. JPEGs decode only the crop window. Shared
  by ``TfdsSource`` and benchmarks/input_pipeline_benchmark.py.
  """

  def __init__(self, image_shape, src_channels: int, crop_fraction: float,
               crop_scale=aug.CROP_SCALE):
    self._tf = import_tf()
    self.image_shape = tuple(image_shape)
    self._src_channels = int(src_channels)
    self._crop_fraction = float(crop_fraction)
    self._crop_scale = aug.check_crop_scale(crop_scale)

  def _decode_crop(self, encoded, window_fn):
    """Decodes only the crop window of a JPEG (other formats: full decode)."""
    tf, c = self._tf, self._src_channels

    def jpeg():
      shape = tf.image.extract_jpeg_shape(encoded)
      return tf.image.decode_and_crop_jpeg(
          encoded, window_fn(shape[0], shape[1]), channels=c)

    def other():
      img = tf.io.decode_image(encoded, channels=c, expand_animations=False)
      shape = tf.shape(img)
      w = window_fn(shape[0], shape[1])
      return img[w[0]:w[0] + w[2], w[1]:w[1] + w[3], :]

    return tf.cond(tf.io.is_jpeg(encoded), jpeg, other)

  def _finish(self, img):
    """uint8 crop [h, w, c] -> uint8 [S, S, C] (rounded; float happens on the device)."""
    tf = self._tf
    size, _, channels = self.image_shape
    img = tf.image.resize(img, [size, size], method="bilinear", antialias=True)
    if self._src_channels == 1 and channels == 3:
      img = tf.tile(img, [1, 1, 3])
    elif self._src_channels == 3 and channels == 1:
      img = tf.reduce_sum(img * tf.constant(_LUMA), axis=-1, keepdims=True)
    img = tf.ensure_shape(img, self.image_shape)
    return tf.cast(tf.clip_by_value(tf.round(img), 0.0, 255.0), tf.uint8)

  def center(self, encoded):
    tf, frac = self._tf, self._crop_fraction

    def window(h, w):
      side = tf.cast(tf.round(frac * tf.cast(tf.minimum(h, w), tf.float32)),
                     tf.int32)
      side = tf.maximum(side, 1)
      return tf.stack([(h - side) // 2, (w - side) // 2, side, side])

    return self._finish(self._decode_crop(encoded, window))

  def random(self, encoded, seed):
    """Random-resized crop (area ``crop_scale``, ratio 3/4-4/3) + flip, stateless."""
    tf = self._tf
    crop_seed, flip_seed = tf.unstack(
        tf.random.experimental.stateless_split(seed, 2))

    def window(h, w):
      begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
          tf.stack([h, w, self._src_channels]),
          bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
          seed=crop_seed, min_object_covered=0.0,
          aspect_ratio_range=CROP_RATIO, area_range=self._crop_scale,
          max_attempts=10, use_image_if_no_bounding_boxes=True)
      return tf.stack([begin[0], begin[1], size[0], size[1]])

    img = self._finish(self._decode_crop(encoded, window))
    flip = tf.random.stateless_uniform([], flip_seed) < 0.5
    return tf.cond(flip, lambda: tf.reverse(img, [1]), lambda: img)


class TfdsSource(DataSource):
  """A split of a TFDS builder's prepared data, batched with tf.data."""

  def __init__(self, builder, split: str, config: Any, *, seed: int,
               crop_fraction: float, data_dir: str, name: str):
    tf = import_tf()
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    self._tf, self._tfds, self._builder = tf, tfds, builder
    self.seed = int(seed)
    self.augment = cfg_get(config, "augment", "none")
    if self.augment not in AUGMENTS:
      raise ValueError(f"augment must be one of {AUGMENTS}, got "
                       f"{self.augment!r}")
    features = builder.info.features
    if "image" not in features:
      raise ValueError(f"{name} has no 'image' feature")
    src_channels = features["image"].shape[-1] or 3
    self._src_channels = int(src_channels)
    image_size = int(cfg_get(config, "image_size", 224))
    channels = int(cfg_get(config, "channels", self._src_channels))
    if channels not in (1, 3):
      raise ValueError(f"channels must be 1 or 3, got {channels}")
    self.image_shape = (image_size, image_size, channels)
    label = features["label"] if "label" in features else None
    self.num_classes = int(getattr(label, "num_classes", 0) or 0)
    self._has_label = label is not None
    self._preprocess = JpegPreprocess(self.image_shape, self._src_channels, crop_fraction,
                                      cfg_get(config, "crop_scale", aug.CROP_SCALE))
    self._shuffle_buffer = int(cfg_get(config, "shuffle_buffer",
                                       DEFAULT_SHUFFLE_BUFFER))
    self._split = resolve_split(builder, split,
                                int(cfg_get(config, "val_split_size", 0)))
    try:
      probe = self._read(self._split, shuffle_seed=None)
    except AssertionError as e:  # TFDS's "could not find data in ..."
      raise DatasetNotPreparedError(not_prepared_message(name, data_dir)) from e
    if builder.info.splits:
      self.num_examples = int(builder.info.splits[self._split].num_examples)
    else:  # Metadata unknown (e.g. under tfds.testing.mock_data).
      self.num_examples = int(probe.cardinality().numpy())

  # -- reading --------------------------------------------------------------

  def _read(self, split, shuffle_seed):
    """Undecoded {"image": bytes, "label": int32} examples of ``split``."""
    tfds, tf = self._tfds, self._tf
    read_config = tfds.ReadConfig(shuffle_seed=shuffle_seed)
    # Ordered datasets (disable_shuffling) refuse file shuffling; their
    # examples are still shuffled by the seeded buffer.
    shuffle_files = (shuffle_seed is not None
                     and not self._builder.info.disable_shuffling)
    ds = self._builder.as_dataset(
        split=split, shuffle_files=shuffle_files,
        read_config=read_config,
        decoders={"image": tfds.decode.SkipDecoding()})
    has_label = self._has_label

    def select(ex):  # drop other features early (smaller shuffle buffer)
      label = tf.cast(ex["label"], tf.int32) if has_label else tf.constant(0)
      return {"image": ex["image"], "label": label}

    return ds.map(select, num_parallel_calls=tf.data.AUTOTUNE)

  # -- batches --------------------------------------------------------------

  def _epoch_chunks(self, shard, epoch, skip, n_local, local, process_index):
    """Local batches (last one partial) of one epoch, after ``skip``."""
    tf = self._tf
    file_seed, buffer_seed = seed_pair(self.seed, process_index, epoch)
    aug_key, _ = seed_pair(self.seed, process_index)
    ds = self._read(shard, shuffle_seed=file_seed)
    ds = ds.shuffle(min(self._shuffle_buffer, n_local), seed=buffer_seed,
                    reshuffle_each_iteration=False)
    ds = ds.take(n_local).skip(skip)  # skip BEFORE decoding
    ds = ds.enumerate(start=epoch * n_local + skip)  # stream positions
    spatial = self.augment == "spatial"

    def prep(pos, ex):
      if spatial:
        seed = tf.stack([tf.constant(aug_key, tf.int64), pos])
        img = self._preprocess.random(ex["image"], seed)
      else:
        img = self._preprocess.center(ex["image"])
      return {"image": img, "label": ex["label"]}

    ds = ds.map(prep, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(local).prefetch(tf.data.AUTOTUNE).as_numpy_iterator()

  def train_batches(self, batch_size: int, start_step: int = 0,
                    process_index: int = 0,
                    process_count: int = 1) -> Iterator[Batch]:
    local = local_batch_size(batch_size, process_count)
    check_process(process_index, process_count)
    n_local = self.num_examples // process_count
    if n_local == 0:
      raise ValueError(f"split has {self.num_examples} examples, fewer than "
                       f"the {process_count} processes")
    shard = self._tfds.even_splits(self._split, process_count,
                                   drop_remainder=True)[process_index]
    start_epoch, skip = divmod(start_step * local, n_local)

    def chunks():
      epoch, first_skip = start_epoch, skip
      while True:
        yield from self._epoch_chunks(shard, epoch, first_skip, n_local,
                                      local, process_index)
        epoch, first_skip = epoch + 1, 0

    return rebatch(chunks(), local)

  def eval_batches(self, batch_size: int, process_index: int = 0,
                   process_count: int = 1, num_workers: int = 0) -> Iterator[Batch]:
    local = local_batch_size(batch_size, process_count)
    check_process(process_index, process_count)
    return self._eval_iter(local, process_index, process_count)

  def _eval_iter(self, local, process_index, process_count):
    tf = self._tf
    shard = self._tfds.even_splits(self._split, process_count)[process_index]
    lo, hi = process_range(self.num_examples, process_index, process_count)
    ds = self._read(shard, shuffle_seed=None).take(hi - lo)
    ds = ds.map(lambda ex: {"image": self._preprocess.center(ex["image"]),
                            "label": ex["label"]},
                num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.batch(local).prefetch(tf.data.AUTOTUNE)
    total = num_eval_batches(self.num_examples, local, process_count)
    done = 0
    for batch in ds.as_numpy_iterator():
      yield pad_batch(batch, local, self.image_shape)
      done += 1
    for _ in range(total - done):  # keep batch counts equal across processes
      yield pad_batch(None, local, self.image_shape)
