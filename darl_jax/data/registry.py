"""The source registry: `build_source(config, split=..., seed=...)`.

``SOURCES`` is the one table of source names (``config.data.name``); every
caller, the trainers' and jobs' included, builds a source through it.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from darl_jax.data.base import SPLITS, DataSource, cfg_get

Builder = Callable[[Any, str, int], DataSource]

# Sources whose splits are their own (VTAB-1k's train800, val200, ...), checked by the
# source itself; the others take SPLITS, and only those can be parts of a mixture.
OWN_SPLITS = frozenset({"vtab"})


def _module_builder(module: str, function: str = "build") -> Builder:
  """``darl_jax.data.<module>.<function>(config, split=..., seed=...)``; the module is
  imported on the first call, so that only the TFDS sources import TensorFlow."""
  def build(config, split, seed):
    builder = getattr(importlib.import_module(f"darl_jax.data.{module}"), function)
    return builder(config, split=split, seed=seed)
  return build


def _mixture(config, split, seed):
  from darl_jax.data.sources import mixture  # pylint: disable=g-import-not-at-top
  return mixture.build(config, split=split, seed=seed, build_source=build_source,
                       names=[name for name in SOURCES if name not in OWN_SPLITS])


def _imagenet2012(config, split, seed):
  from darl_jax.data.sources import tfds_source  # pylint: disable=g-import-not-at-top
  return tfds_source.build(config, split=split, seed=seed,
                           tfds_name=cfg_get(config, "tfds_name",
                                             "imagenet2012"))


def _tfds(config, split, seed):
  from darl_jax.data.sources import tfds_source  # pylint: disable=g-import-not-at-top
  name = cfg_get(config, "tfds_name", None)
  if not name:
    raise ValueError("data.name='tfds' needs data.tfds_name (a TFDS builder "
                     "name such as 'cifar10')")
  return tfds_source.build(config, split=split, seed=seed, tfds_name=name)


# name -> builder(config, split, seed).
SOURCES: dict[str, Builder] = {
    "fashion_mnist": _module_builder("sources.fashion_mnist"),
    "digits": _module_builder("sources.digits"),
    "imagenet2012": _imagenet2012,
    "image_folder": _module_builder("sources.image_folder"),
    "webdataset": _module_builder("sources.webdataset"),
    "parquet": _module_builder("sources.parquet"),
    "arrayrecord": _module_builder("sources.arrayrecord"),
    "hf_disk": _module_builder("sources.hf_disk"),
    "mixture": _mixture,
    "tfds": _tfds,
    "synthetic": _module_builder("sources.synthetic"),
    "vtab": _module_builder("sources.vtab_tasks", "build_source"),
}


def build_source(config: Any, *, split: str, seed: int) -> DataSource:
  """Builds the `DataSource` for one split.

  Args:
    config: the data config (ml_collections ConfigDict or any attribute
      object): name, image_size, channels, augment, path, backend, tfds_name,
      tfds_data_dir, val_split_size (see the package docstring).
    split: "train", "validation" or "test" (a VTAB-1k split for "vtab",
      data/sources/vtab_tasks.py).
    seed: shuffling / augmentation seed (batches are a function of it).

  Returns:
    The source; its batches are dicts of numpy arrays.
  """
  name = cfg_get(config, "name", None)
  if name not in SOURCES:
    raise ValueError(f"unknown data source {name!r}; valid names: "
                     f"{', '.join(sorted(SOURCES))}")
  if name not in OWN_SPLITS and split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
  if int(seed) < 0:
    raise ValueError(f"seed must be >= 0, got {seed}")
  return SOURCES[name](config, split, int(seed))
