"""A local TFDS builder for Fashion-MNIST that reads Debian's IDX files.

`DebianFashionMnist` never downloads: `_split_generators` reads the IDX files
of its ``source_dir`` (default /usr/share/datasets/fashion-mnist) and
`download_and_prepare` writes TFRecords into ``data_dir`` (config
``tfds_data_dir``, default $TFDS_DATA_DIR or ~/tensorflow_datasets). Shuffling
at preparation is disabled, so the prepared splits keep the IDX file order and
``train[-V:]`` is the same validation split as the numpy backend's.

The builder config name is derived from the absolute source directory, so
two source directories never share (or silently reuse) prepared files.

It reads the files and splits of `fashion_mnist_idx.py`, as the numpy
backend does. Importing this module imports TensorFlow (Datasets);
`fashion_mnist.py` imports it only for backend="tfds". Prepare once per
data_dir (e.g. on the first process, or ahead of time) when several processes
share a filesystem.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from darl_jax.data.sources import fashion_mnist_idx as idx
from darl_jax.data.base import cfg_get
from darl_jax.data.sources.tfds_source import TfdsSource, default_data_dir, import_tf

import_tf()  # hides GPUs from TF before TFDS touches it
import tensorflow_datasets as tfds  # pylint: disable=wrong-import-position


def source_config(source_dir: str) -> tfds.core.BuilderConfig:
  """Builder config named after the (absolute) IDX source directory."""
  source_dir = os.path.abspath(source_dir)
  digest = hashlib.sha1(source_dir.encode()).hexdigest()[:12]
  return tfds.core.BuilderConfig(name=f"src_{digest}",
                                 description=f"IDX files of {source_dir}")


class DebianFashionMnist(tfds.core.GeneratorBasedBuilder):
  """Fashion-MNIST (28x28x1, 10 classes) from local IDX files."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Reads Debian's dataset-fashion-mnist files."}

  def __init__(self, *, source_dir: str = idx.DEFAULT_PATH,
               **kwargs):
    self._source_dir = os.path.abspath(source_dir)
    kwargs.setdefault("config", source_config(self._source_dir))
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        description="Fashion-MNIST read from local IDX files (no download).",
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(28, 28, 1)),
            "label": tfds.features.ClassLabel(
                names=list(idx.CLASS_NAMES)),
        }),
        supervised_keys=("image", "label"),
        # Keep file order (examples are written sorted by their int key).
        disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Everything is local.
    return {part: self._generate_examples(part) for part in ("train", "test")}

  def _generate_examples(self, part: str):
    images, labels = idx.load_part(self._source_dir, part)
    for i in range(len(images)):
      yield i, {"image": images[i], "label": int(labels[i])}


def prepared_builder(source_dir: str, data_dir: str) -> DebianFashionMnist:
  """The builder, prepared into ``data_dir`` if it was not yet."""
  builder = DebianFashionMnist(source_dir=source_dir, data_dir=data_dir)
  if not builder.is_prepared():
    builder.download_and_prepare()
  return builder


def build(config: Any, *, split: str, seed: int, source_dir: str,
          val_split_size: int) -> TfdsSource:
  """Fashion-MNIST via TFDS; the same splits as the numpy backend."""
  data_dir = cfg_get(config, "tfds_data_dir", None) or default_data_dir()
  builder = prepared_builder(source_dir, data_dir)
  num_train = builder.info.splits["train"].num_examples
  idx.split_range(split, num_train, val_split_size)  # validates
  config_view = _Overrides(config, val_split_size=val_split_size,
                           image_size=cfg_get(config, "image_size", 28),
                           channels=cfg_get(config, "channels", 1),
                           # Whole-split shuffle buffer (the encoded split is
                           # ~30 MB); file shuffling is off for this ordered
                           # dataset, so a partial buffer would mix poorly.
                           shuffle_buffer=cfg_get(config, "shuffle_buffer",
                                                  num_train))
  # crop_fraction 1: eval sees the whole 28x28 image, as in the numpy path.
  return TfdsSource(builder, split, config_view, seed=seed,
                    crop_fraction=1.0, data_dir=data_dir,
                    name="debian_fashion_mnist")


class _Overrides:
  """Attribute view of ``config`` with a few keys replaced."""

  def __init__(self, config: Any, **overrides):
    self._config, self._overrides = config, overrides

  def __getattr__(self, key):
    if key in self._overrides:
      return self._overrides[key]
    return cfg_get(self._config, key, None)
