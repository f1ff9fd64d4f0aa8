"""The source registry: `build_source(config, split=..., seed=...)`."""

from __future__ import annotations

from typing import Any, Callable

from darl_jax.data.base import SPLITS, DataSource, cfg_get


def _fashion_mnist(config, split, seed):
  from darl_jax.data import fashion_mnist  # pylint: disable=g-import-not-at-top
  return fashion_mnist.build(config, split=split, seed=seed)


def _digits(config, split, seed):
  from darl_jax.data import digits  # pylint: disable=g-import-not-at-top
  return digits.build(config, split=split, seed=seed)


def _synthetic(config, split, seed):
  from darl_jax.data import synthetic  # pylint: disable=g-import-not-at-top
  return synthetic.build(config, split=split, seed=seed)


def _image_folder(config, split, seed):
  from darl_jax.data import image_folder  # pylint: disable=g-import-not-at-top
  return image_folder.build(config, split=split, seed=seed)


def _webdataset(config, split, seed):
  from darl_jax.data import webdataset  # pylint: disable=g-import-not-at-top
  return webdataset.build(config, split=split, seed=seed)


def _parquet(config, split, seed):
  from darl_jax.data import parquet  # pylint: disable=g-import-not-at-top
  return parquet.build(config, split=split, seed=seed)


def _arrayrecord(config, split, seed):
  from darl_jax.data import arrayrecord_source  # pylint: disable=g-import-not-at-top
  return arrayrecord_source.build(config, split=split, seed=seed)


def _hf_disk(config, split, seed):
  from darl_jax.data import hf_disk  # pylint: disable=g-import-not-at-top
  return hf_disk.build(config, split=split, seed=seed)


def _mixture(config, split, seed):
  from darl_jax.data import mixture  # pylint: disable=g-import-not-at-top
  return mixture.build(config, split=split, seed=seed, build_source=build_source,
                       names=SOURCES)


def _imagenet2012(config, split, seed):
  from darl_jax.data import tfds_source  # pylint: disable=g-import-not-at-top
  return tfds_source.build(config, split=split, seed=seed,
                           tfds_name=cfg_get(config, "tfds_name",
                                             "imagenet2012"))


def _tfds(config, split, seed):
  from darl_jax.data import tfds_source  # pylint: disable=g-import-not-at-top
  name = cfg_get(config, "tfds_name", None)
  if not name:
    raise ValueError("data.name='tfds' needs data.tfds_name (a TFDS builder "
                     "name such as 'cifar10')")
  return tfds_source.build(config, split=split, seed=seed, tfds_name=name)


# Builders import their modules lazily: only the TFDS ones import TensorFlow.
SOURCES: dict[str, Callable[[Any, str, int], DataSource]] = {
    "fashion_mnist": _fashion_mnist,
    "digits": _digits,
    "imagenet2012": _imagenet2012,
    "image_folder": _image_folder,
    "webdataset": _webdataset,
    "parquet": _parquet,
    "arrayrecord": _arrayrecord,
    "hf_disk": _hf_disk,
    "mixture": _mixture,
    "tfds": _tfds,
    "synthetic": _synthetic,
}


def build_source(config: Any, *, split: str, seed: int) -> DataSource:
  """Builds the `DataSource` for one split.

  Args:
    config: the data config (ml_collections ConfigDict or any attribute
      object): name, image_size, channels, augment, path, backend, tfds_name,
      tfds_data_dir, val_split_size (see the package docstring).
    split: "train", "validation" or "test".
    seed: shuffling / augmentation seed (batches are a function of it).

  Returns:
    The source; its batches are dicts of numpy arrays.
  """
  name = cfg_get(config, "name", None)
  if name not in SOURCES:
    raise ValueError(f"unknown data source {name!r}; valid names: "
                     f"{', '.join(sorted(SOURCES))}")
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
  if int(seed) < 0:
    raise ValueError(f"seed must be >= 0, got {seed}")
  return SOURCES[name](config, split, int(seed))
