"""The 19 VTAB-1k tasks (Zhai et al. 2019) through their TFDS names, and their sources.

Each task names a TFDS dataset, the feature its label comes from (and how: a
few structured tasks derive the label, e.g. CLEVR counts objects), and three
TFDS split expressions, VTAB's standard "train", "val" and "test" of the
task_adaptation benchmark code. VTAB-1k then uses

    train800        the first 800 examples of "train"
    val200          the first 200 examples of "val"
    train800val200  both (1000 examples): the retraining set
    test            all of "test"

so a task's numbers are comparable with every published VTAB-1k result. In
this project these are ``config.data.train_split`` / ``eval_split`` values
of a ``data.name="vtab"`` config (``data.vtab_task`` = the task name).

Preprocessing (VTAB's): every image is resized to ``image_size`` squared
(bilinear, antialiased, aspect ratio not kept), grey images are tiled to 3
channels, dSprites' {0, 1} pixels are scaled to {0, 255}. The 1000 training
examples are decoded once into memory (uint8) and batched by
``indexed.ArraySource`` (same resume semantics and spatial augmentation as
the other in-memory sources); the test split is streamed with tf.data.

Nothing is downloaded: an unprepared dataset fails with the ``tfds build``
command that prepares it (diabetic_retinopathy needs the Kaggle files, see
the TFDS catalogue).

``vtab_source="synthetic"`` replaces a task's data by random images with
the task's class count and VTAB-1k's split sizes (the test split as large as
val200), made in memory without TensorFlow: the suite's driver, its
programs and its speed can then be tried without preparing 19 datasets.
Not for learning anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import numpy as np

from darl_jax.data.transforms import augment as aug
from darl_jax.data.base import (DataSource, cfg_get, check_process, local_batch_size,
                                num_eval_batches, pad_batch, process_range)
from darl_jax.data.sources.indexed import ArraySource

GROUPS = ("natural", "specialized", "structured")
SPLITS = ("train800", "val200", "train800val200", "test")
TRAIN_EXAMPLES = 800
VAL_EXAMPLES = 200
SOURCES = ("tfds", "synthetic")


@dataclasses.dataclass(frozen=True)
class Task:
  """One VTAB task.

  ``train`` / ``val`` / ``test`` are TFDS split expressions of ``tfds_name``;
  ``label_key`` the feature read by ``label_fn`` ("class": the feature itself,
  "divide": ``floor(feature / divisor)``, or a derived label, see
  ``LABEL_FNS``).
  """
  name: str
  group: str
  tfds_name: str
  train: str
  val: str
  test: str
  num_classes: int
  label_key: str = "label"
  label_fn: str = "class"
  divisor: float = 1.0
  image_key: str = "image"
  scale: float = 1.0          # pixel multiplier (dSprites stores 0/1)


_TASK_LIST = (
    # natural
    Task("caltech101", "natural", "caltech101:3.*.*", "train[:90%]", "train[90%:]", "test", 102),
    Task("cifar100", "natural", "cifar100:3.*.*", "train[:90%]", "train[90%:]", "test", 100),
    Task("dtd", "natural", "dtd:3.*.*", "train", "validation", "test", 47),
    Task("oxford_flowers102", "natural", "oxford_flowers102:2.*.*", "train", "validation",
         "test", 102),
    Task("oxford_iiit_pet", "natural", "oxford_iiit_pet:3.*.*", "train[:80%]", "train[80%:]",
         "test", 37),
    Task("svhn", "natural", "svhn_cropped:3.*.*", "train[:90%]", "train[90%:]", "test", 10),
    Task("sun397", "natural", "sun397/tfds:4.*.*", "train", "validation", "test", 397),
    # specialized
    Task("patch_camelyon", "specialized", "patch_camelyon:2.*.*", "train", "validation",
         "test", 2),
    Task("eurosat", "specialized", "eurosat/rgb:2.*.*", "train[:60%]", "train[60%:80%]",
         "train[80%:]", 10),
    Task("resisc45", "specialized", "resisc45:3.*.*", "train[:60%]", "train[60%:80%]",
         "train[80%:]", 45),
    Task("diabetic_retinopathy", "specialized",
         "diabetic_retinopathy_detection/btgraham-300:3.*.*", "train", "validation", "test", 5),
    # structured
    Task("clevr_count", "structured", "clevr:3.*.*", "train[:90%]", "train[90%:]",
         "validation", 8, label_key="objects", label_fn="clevr_count"),
    Task("clevr_distance", "structured", "clevr:3.*.*", "train[:90%]", "train[90%:]",
         "validation", 6, label_key="objects", label_fn="clevr_distance"),
    Task("dmlab", "structured", "dmlab:2.0.1", "train", "validation", "test", 6),
    Task("kitti_distance", "structured", "kitti:3.*.*", "train", "validation", "test", 4,
         label_key="objects", label_fn="kitti_vehicle_distance"),
    Task("dsprites_location", "structured", "dsprites:2.*.*", "train[:80%]",
         "train[80%:90%]", "train[90%:]", 16, label_key="label_x_position",
         label_fn="divide", divisor=32 / 16, scale=255.0),
    Task("dsprites_orientation", "structured", "dsprites:2.*.*", "train[:80%]",
         "train[80%:90%]", "train[90%:]", 16, label_key="label_orientation",
         label_fn="divide", divisor=40 / 16, scale=255.0),
    Task("smallnorb_azimuth", "structured", "smallnorb:2.*.*", "train", "test[:50%]",
         "test[50%:]", 18, label_key="label_azimuth"),
    Task("smallnorb_elevation", "structured", "smallnorb:2.*.*", "train", "test[:50%]",
         "test[50%:]", 9, label_key="label_elevation"),
)
TASKS: dict[str, Task] = {t.name: t for t in _TASK_LIST}
# The largest class count of the tasks (sun397): the head size at which every
# task runs the same programs (train/vtab.py).
MAX_CLASSES = max(t.num_classes for t in _TASK_LIST)


def get_task(name: str) -> Task:
  if name not in TASKS:
    raise ValueError(f"unknown VTAB task {name!r}; valid: {', '.join(TASKS)}")
  return TASKS[name]


# ------------------------------------------------------------------ labels
# TF functions: example dict -> int32 label. Thresholds are VTAB's.


def _label_class(tf, ex, task):
  return tf.cast(ex[task.label_key], tf.int32)


def _label_divide(tf, ex, task):
  value = tf.cast(ex[task.label_key], tf.float32)
  return tf.cast(tf.math.floordiv(value, task.divisor), tf.int32)


def _bucket(tf, value, thresholds):
  """Index of the last threshold strictly below ``value``."""
  below = tf.cast(tf.constant(thresholds, tf.float32) < value, tf.int32)
  return tf.reduce_sum(below) - 1


def _label_clevr_count(tf, ex, task):
  del task
  return tf.size(ex["objects"]["size"]) - 3           # 3..10 objects -> 0..7


def _label_clevr_distance(tf, ex, task):
  del task
  depth = tf.reduce_min(tf.cast(ex["objects"]["pixel_coords"][:, 2], tf.float32))
  return _bucket(tf, depth, [0.0, 8.0, 8.5, 9.0, 9.5, 10.0, 100.0])


def _label_kitti_vehicle_distance(tf, ex, task):
  """Distance of the closest car, van or truck (types 0-2): <8 m, <20 m, more, none."""
  del task
  objects = ex["objects"]
  z = tf.cast(objects["location"][:, 2], tf.float32)
  vehicle_z = tf.boolean_mask(z, objects["type"] < 3)
  dist = tf.reduce_min(tf.concat([vehicle_z, [1000.0]], 0))
  return _bucket(tf, dist, [-100.0, 8.0, 20.0, 999.0])


LABEL_FNS = {"class": _label_class, "divide": _label_divide,
             "clevr_count": _label_clevr_count, "clevr_distance": _label_clevr_distance,
             "kitti_vehicle_distance": _label_kitti_vehicle_distance}


# ---------------------------------------------------------------- datasets


def split_parts(task: Task, split: str, num_train: int = TRAIN_EXAMPLES,
                num_val: int = VAL_EXAMPLES) -> list[tuple[str, int]]:
  """VTAB-1k split -> [(TFDS split expression, examples to take; 0 = all)]."""
  parts = {"train800": [(task.train, num_train)], "val200": [(task.val, num_val)],
           "train800val200": [(task.train, num_train), (task.val, num_val)],
           "test": [(task.test, 0)]}
  if split not in parts:
    raise ValueError(f"unknown VTAB split {split!r}; valid: {', '.join(SPLITS)}")
  return parts[split]


def dataset(task: Task, tfds_split: str, image_size: int, data_dir: str | None):
  """tf.data of ``(image uint8 [S, S, 3], label int32)`` in the split's file order."""
  from darl_jax.data.sources import tfds_source  # pylint: disable=g-import-not-at-top
  tf = tfds_source.import_tf()
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  builder = tfds.builder(task.tfds_name, data_dir=data_dir)
  try:
    ds = builder.as_dataset(split=tfds_split, shuffle_files=False)
  except AssertionError as e:  # TFDS: "Dataset ... could not be found / not prepared"
    raise tfds_source.DatasetNotPreparedError(tfds_source.not_prepared_message(
        task.tfds_name.split(":")[0], data_dir or tfds_source.default_data_dir())) from e
  label_fn = LABEL_FNS[task.label_fn]

  def prep(ex):
    img = tf.cast(ex[task.image_key], tf.float32) * task.scale
    if img.shape[-1] == 1:
      img = tf.tile(img, [1, 1, 3])
    img = tf.image.resize(img, [image_size, image_size], method="bilinear", antialias=True)
    img = tf.cast(tf.clip_by_value(tf.round(img), 0, 255), tf.uint8)
    return img, tf.cast(label_fn(tf, ex, task), tf.int32)

  return ds.map(prep, num_parallel_calls=tf.data.AUTOTUNE)


def load_arrays(task: Task, parts, image_size: int, data_dir=None):
  """Decodes the (small) parts into memory: uint8 ``[n, S, S, 3]``, int32 ``[n]``."""
  images, labels = [], []
  for tfds_split, take in parts:
    ds = dataset(task, tfds_split, image_size, data_dir)
    if take:
      ds = ds.take(take)
    for img, lab in ds.batch(256).as_numpy_iterator():
      images.append(img)
      labels.append(lab)
  if not images:
    raise ValueError(f"VTAB task {task.name}: {parts} holds no examples")
  return np.concatenate(images), np.concatenate(labels).astype(np.int32)


class StreamSource(DataSource):
  """An evaluation-only source streamed with tf.data (the large test splits)."""

  def __init__(self, task: Task, tfds_split: str, image_size: int, channels: int,
               data_dir=None):
    self.task, self.tfds_split, self.data_dir = task, tfds_split, data_dir
    self.image_shape = (image_size, image_size, channels)
    self.num_classes = task.num_classes
    ds = dataset(task, tfds_split, image_size, data_dir)
    count = int(ds.cardinality().numpy())
    if count < 0:  # unknown (e.g. mocked data): count once, labels only
      count = sum(1 for _ in ds.map(lambda img, lab: lab).as_numpy_iterator())
    self.num_examples = count

  def train_batches(self, batch_size, start_step=0, process_index=0, process_count=1):
    raise ValueError(f"VTAB split {self.tfds_split!r} is evaluation-only; train on "
                     "train800 or train800val200")

  def eval_batches(self, batch_size: int, process_index: int = 0,
                   process_count: int = 1, num_workers: int = 0) -> Iterator[dict]:
    local = local_batch_size(batch_size, process_count)
    check_process(process_index, process_count)
    lo, hi = process_range(self.num_examples, process_index, process_count)
    ds = dataset(self.task, self.tfds_split, self.image_shape[0], self.data_dir)
    ds = ds.skip(lo).take(hi - lo).batch(local)
    total = num_eval_batches(self.num_examples, local, process_count)
    done = 0
    for img, lab in ds.as_numpy_iterator():
      if self.image_shape[2] == 1:
        img = aug.to_uint8(aug.convert_channels(img, 1))
      yield pad_batch({"image": img, "label": lab}, local, self.image_shape)
      done += 1
    for _ in range(total - done):
      yield pad_batch(None, local, self.image_shape)


def synthetic_arrays(task: Task, parts, image_size: int, test_examples: int = VAL_EXAMPLES):
  """Random uint8 images ``[n, S, S, 3]`` and labels over the task's classes
  for ``parts`` (split_parts' list; a whole split, the test split, has
  ``test_examples``): each TFDS split expression gets its own fixed draw
  (from the task's name and the expression), so ``train800val200`` holds
  ``train800``'s and ``val200``'s examples, as the real splits do."""
  images, labels = [], []
  for tfds_split, take in parts:
    n = take or test_examples
    seed = np.frombuffer(f"{task.name}/{tfds_split}".encode(), np.uint8)
    rng = np.random.default_rng(seed)
    images.append(rng.integers(0, 256, (n, image_size, image_size, 3), dtype=np.uint8))
    labels.append(rng.integers(0, task.num_classes, (n,), dtype=np.int32))
  return np.concatenate(images), np.concatenate(labels)


def build_source(config: Any, *, split: str, seed: int) -> DataSource:
  """The source of ``split`` (``SPLITS``) of task ``config.vtab_task``.

  Config keys: vtab_task, image_size, channels, augment, tfds_data_dir,
  vtab_train_examples (800), vtab_val_examples (200), vtab_source ("tfds",
  or "synthetic": random images, see the module docstring).
  """
  task = get_task(cfg_get(config, "vtab_task", None))
  size = int(cfg_get(config, "image_size", 224))
  channels = int(cfg_get(config, "channels", 3))
  data_dir = cfg_get(config, "tfds_data_dir", None)
  num_val = int(cfg_get(config, "vtab_val_examples", VAL_EXAMPLES))
  parts = split_parts(task, split, int(cfg_get(config, "vtab_train_examples", TRAIN_EXAMPLES)),
                      num_val)
  origin = cfg_get(config, "vtab_source", "tfds")
  if origin not in SOURCES:
    raise ValueError(f"unknown data.vtab_source {origin!r}; valid: {', '.join(SOURCES)}")
  if origin == "synthetic":
    images, labels = synthetic_arrays(task, parts, size, test_examples=num_val)
  elif split == "test":
    return StreamSource(task, parts[0][0], size, channels, data_dir)
  else:
    images, labels = load_arrays(task, parts, size, data_dir)
  return ArraySource(images, labels, num_classes=task.num_classes, image_size=size,
                     channels=channels, augment=cfg_get(config, "augment", "none"), seed=seed,
                     crop_scale=cfg_get(config, "crop_scale", aug.CROP_SCALE))
