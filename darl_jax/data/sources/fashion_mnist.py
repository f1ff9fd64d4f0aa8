"""Fashion-MNIST from the IDX files of Debian's `dataset-fashion-mnist`.

The files and the splits (train, validation = the training files' last
``config.val_split_size`` examples, test) are fashion_mnist_idx.py's; both
backends use them, in file order.

Backends: "auto" / "numpy" keep uint8 arrays in memory (decoded once per
process) and batch with `indexed.ArraySource`; "tfds" prepares the local
`DebianFashionMnist` TFDS builder (tfds_fashion_mnist.py, no download) and
runs the tf.data pipeline of `tfds_source.py`.
"""

from __future__ import annotations

import os
from typing import Any

from darl_jax.data.transforms import augment as aug
from darl_jax.data.sources import fashion_mnist_idx as idx
from darl_jax.data.base import DataSource, cfg_get
from darl_jax.data.sources.indexed import ArraySource

BACKENDS = ("auto", "numpy", "tfds")


def build(config: Any, *, split: str, seed: int) -> DataSource:
  """Fashion-MNIST source for ``split`` (see the module docstring)."""
  data_dir = cfg_get(config, "path", idx.DEFAULT_PATH)
  backend = cfg_get(config, "backend", "auto")
  val_split_size = int(cfg_get(config, "val_split_size",
                               idx.DEFAULT_VAL_SPLIT_SIZE))
  image_size = int(cfg_get(config, "image_size", 28))
  channels = int(cfg_get(config, "channels", 1))
  augment = cfg_get(config, "augment", "none")
  if backend not in BACKENDS:
    raise ValueError(f"unknown fashion_mnist backend {backend!r}; valid: "
                     f"{', '.join(BACKENDS)}")
  if not os.path.isdir(data_dir):
    raise FileNotFoundError(idx.missing_message(data_dir, data_dir))
  if backend == "tfds":
    # Imported here: the module imports TensorFlow Datasets at top level.
    from darl_jax.data.sources import tfds_fashion_mnist
    return tfds_fashion_mnist.build(config, split=split, seed=seed,
                                    source_dir=data_dir,
                                    val_split_size=val_split_size)
  num_train = idx.num_examples(data_dir, "train")
  part, sl = idx.split_range(split, num_train, val_split_size)
  images, labels = idx.load_part(data_dir, part)
  return ArraySource(images[sl], labels[sl], num_classes=idx.NUM_CLASSES,
                     image_size=image_size, channels=channels,
                     augment=augment, seed=seed,
                     crop_scale=cfg_get(config, "crop_scale", aug.CROP_SCALE))
