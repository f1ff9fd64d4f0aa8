"""Sources whose examples are encoded image bytes read on demand (tar shards,
Parquet files): decoding, bad-record handling and splits shared by them.

A subclass lists its examples up front (``labels``, and whatever it needs to
find example i's bytes) and implements ``_read(i) -> bytes``. Batching,
shuffling, per-process slices and the counter-based crops are
`indexed.IndexedSource`'s; the worker processes are the Grain pipeline's
(pipeline.py). Decoding is image_folder's ``decode_crop`` (reduced JPEG
decoding, random-resized crop and flip for training, central crop for eval),
so the same images give the same pixels whatever file holds them.

A record that cannot be read or decoded (a truncated member, bytes that are
no image) is logged once per process and replaced by the next readable
example, as image folders do; the count of bad records met so far is in the
log line.
"""

from __future__ import annotations

import abc
import hashlib
import io
from typing import Any, Optional, Sequence

import numpy as np
from absl import logging

from darl_jax.data import augment as aug
from darl_jax.data import image_folder
from darl_jax.data.base import cfg_get, warn_once
from darl_jax.data.indexed import IndexedSource


class EncodedSource(IndexedSource):
  """Example i's image is ``_read(i)`` (encoded bytes), its label ``labels[i]``."""

  decodes_files = True

  def __init__(self, *, labels: np.ndarray, num_classes: int, names: Sequence[str],
               image_size: int, channels: int, augment: str, seed: int,
               crop_scale=aug.CROP_SCALE, what: str = "record"):
    super().__init__(labels=labels, num_classes=num_classes, image_size=image_size,
                     channels=channels, augment=augment, seed=seed, crop_scale=crop_scale)
    self.names = list(names)      # for messages: "shard.tar:key", "file.parquet:row"
    self.what = what
    self._bad: dict[int, str] = {}   # this process's: example -> error

  @abc.abstractmethod
  def _read(self, index: int) -> bytes:
    """Example ``index``'s encoded image."""

  def _decode(self, index: int, u: Optional[np.ndarray]) -> np.ndarray:
    return image_folder.decode_crop(io.BytesIO(self._read(index)), u, self.image_shape,
                                    crop_scale=self.crop_scale)

  def _load_or_substitute(self, index: int, u: Optional[np.ndarray]) -> np.ndarray:
    for offset in range(self.num_examples):
      i = (index + offset) % self.num_examples
      if i in self._bad:
        continue
      try:
        return self._decode(i, u)
      except Exception as e:  # pylint: disable=broad-except  # PIL, tarfile, pyarrow raise many kinds
        self._bad[i] = f"{type(e).__name__}: {e}"
        logging.warning("unreadable %s %s (%s): using the next readable example instead; "
                        "%d unreadable %s(s) met so far in this process", self.what,
                        self.names[i], self._bad[i], len(self._bad), self.what)
    raise ValueError(f"no {self.what} of this split can be read; e.g. "
                     f"{self.names[next(iter(self._bad))]}: {next(iter(self._bad.values()))}")

  def _load(self, indices, positions):
    us = aug.crop_uniforms(self.seed, positions, len(indices))
    return np.stack([self._load_or_substitute(int(i), u) for i, u in zip(indices, us)])


def hash_split(keys: Sequence[str], split: str, val_split_size: Optional[int],
               where: str) -> np.ndarray:
  """Indices of ``split`` ("train" / "validation") when one set of files
  holds both: the V keys of smallest SHA-1 are validation (image_folder's
  rule: V = val_split_size, 10% by default, at least 1; more than half falls
  back to 10% with one warning)."""
  if split == "test":
    raise ValueError(f"{where} has no 'test' split: set data.eval_path to the "
                     f"shards to evaluate on")
  n = len(keys)
  default = max(1, round(image_folder.DEFAULT_VAL_FRACTION * n))
  v = default if val_split_size is None else int(val_split_size)
  if v > n // 2:
    warn_once(("val_split_size", where, v, n),
              "data.val_split_size=%d is more than half of the %d examples of %s; holding "
              "out %d (%.0f%%) for validation instead (or set data.eval_path)", v, n, where,
              default, 100 * image_folder.DEFAULT_VAL_FRACTION)
    v = default
  order = sorted(range(n), key=lambda i: hashlib.sha1(keys[i].encode()).hexdigest())
  chosen = order[:v] if split == "validation" else order[v:]
  return np.asarray(sorted(chosen), np.int64)


def split_files(config: Any, split: str, what: str) -> tuple[str, bool]:
  """(the file pattern of ``split``, whether it must be hash-split): the
  training split reads ``data.path``; validation and test read
  ``data.eval_path`` when it is set, else ``data.path`` with a hash split."""
  path = cfg_get(config, "path", None)
  if not path:
    raise ValueError(f"the {what} source needs data.path (the shard files, e.g. "
                     f"'shards/train-{{000000..000099}}.tar' or a glob)")
  eval_path = cfg_get(config, "eval_path", None)
  if split == "train":
    return path, not eval_path
  if eval_path:
    return eval_path, False
  return path, True


def num_classes_of(config: Any, labels: np.ndarray, has_labels: bool) -> int:
  """``data.num_classes`` when set (> 0), else max label + 1; 0 unlabeled."""
  given = int(cfg_get(config, "num_classes", 0) or 0)
  if not has_labels:
    return 0
  found = int(labels.max()) + 1 if len(labels) else 0
  if given and found > given:
    raise ValueError(f"a label is {found - 1} but data.num_classes={given}: "
                     f"raise data.num_classes or set it to 0 (from the labels)")
  return given or found
