"""scikit-learn's 8x8 handwritten digits (1797 images, 10 classes).

A tiny labelled dataset that ships inside scikit-learn (no download), for
smoke tests and CPU runs. Pixel values 0..16 are rescaled to uint8 0..255.

Fixed split: the 1797 examples are permuted once with
``default_rng(SPLIT_SEED)`` (independent of the run seed) and cut into
train = 1257, validation = 180, test = 360 examples.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from darl_jax.data.transforms import augment as aug
from darl_jax.data.base import DataSource, cfg_get
from darl_jax.data.sources.indexed import ArraySource

NUM_CLASSES = 10
SPLIT_SEED = 0
SPLIT_SIZES = {"train": 1257, "validation": 180, "test": 360}

_CACHE: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def load_all() -> tuple[np.ndarray, np.ndarray]:
  """All digits: uint8 [1797, 8, 8, 1] in 0..255 and int32 [1797] labels."""
  if "all" not in _CACHE:
    try:
      from sklearn import datasets  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError("the digits source needs scikit-learn: pip install "
                        "scikit-learn") from e
    digits = datasets.load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    _CACHE["all"] = (images[..., None], digits.target.astype(np.int32))
  return _CACHE["all"]


def split_indices(split: str, num: int) -> np.ndarray:
  """Example indices (int64) of a split of the fixed permutation."""
  if split not in SPLIT_SIZES:
    raise ValueError(f"unknown split {split!r}; valid: "
                     f"{', '.join(SPLIT_SIZES)}")
  if sum(SPLIT_SIZES.values()) != num:
    raise ValueError(f"expected {sum(SPLIT_SIZES.values())} digits, got {num}")
  perm = np.random.default_rng(SPLIT_SEED).permutation(num)
  start = 0
  for name, size in SPLIT_SIZES.items():
    if name == split:
      return np.sort(perm[start:start + size])
    start += size
  raise AssertionError("unreachable")


def build(config: Any, *, split: str, seed: int) -> DataSource:
  images, labels = load_all()
  idx = split_indices(split, len(images))
  return ArraySource(images[idx], labels[idx], num_classes=NUM_CLASSES,
                     image_size=int(cfg_get(config, "image_size", 8)),
                     channels=int(cfg_get(config, "channels", 1)),
                     augment=cfg_get(config, "augment", "none"), seed=seed,
                     crop_scale=cfg_get(config, "crop_scale", aug.CROP_SCALE))
