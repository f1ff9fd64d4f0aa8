"""Sources whose examples are encoded image bytes read on demand (tar shards,
Parquet files): decoding, bad-record handling and splits shared by them.

A subclass lists its examples up front (``labels``, and whatever it needs to
find example i's bytes) and implements ``_read(i) -> bytes``. Batching,
shuffling, per-process slices and the counter-based crops are
`indexed.IndexedSource`'s; the worker processes are the Grain pipeline's
(data/pipeline.py). Decoding is image_folder's ``decode_crop`` (reduced JPEG
decoding, random-resized crop and flip for training, central crop for eval),
so the same images give the same pixels whatever file holds them.

A record that cannot be read or decoded (a truncated member, bytes that are
no image) is named in the log (once per process) and replaced by the next
readable example, image and label, as image folders do
(`indexed.DecodedSource`); the count of bad records met so far is in the
log line.

Files and processes (``data.process_files``): with "own" (the default) and
P > 1 training processes, process p reads the training files ``p, p + P,
p + 2P, ...`` of the sorted file list and nothing else: it indexes only them
(when ``data.eval_path`` is set; a hash split needs every file's keys) and
its training stream is its own (indexed.py). Epochs and schedules count the
examples of all processes (gathered once at build time). The number of
streams is fixed when the run starts: resumed on P' processes, a process
builds the sources of the streams its rows of the global batch are in
(``build(..., stream=(g, S))``, no collective), about S / P' streams' files
each. "all": every process indexes every file and takes its slice of one
global stream, so a P-process batch equals a 1-process one (at the cost of
each host touching every shard). Validation and test splits are read by all
processes, each its slice, either way.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import io
from typing import Any, Optional, Sequence

import numpy as np
from absl import logging

from darl_jax.data.transforms import augment as aug
from darl_jax.data.sources import image_folder, shards
from darl_jax.data.base import cfg_get, gather_ints, this_process, warn_once
from darl_jax.data.sources.indexed import DecodedSource


class EncodedSource(DecodedSource):
  """Example i's image is ``_read(i)`` (encoded bytes), its label ``labels[i]``."""

  def __init__(self, *, labels: np.ndarray, num_classes: int, names: Sequence[str],
               image_size: int, channels: int, augment: str, seed: int,
               crop_scale=aug.CROP_SCALE, what: str = "record"):
    super().__init__(labels=labels, num_classes=num_classes, image_size=image_size,
                     channels=channels, augment=augment, seed=seed, crop_scale=crop_scale)
    self.names = list(names)      # for messages: "shard.tar/key", "file.parquet:row"
    self.what = what

  @abc.abstractmethod
  def _read(self, index: int) -> bytes:
    """Example ``index``'s encoded image."""

  def _decode(self, index: int, u: Optional[np.ndarray]) -> np.ndarray:
    return image_folder.decode_crop(io.BytesIO(self._read(index)), u, self.image_shape,
                                    crop_scale=self.crop_scale)

  def example_name(self, index: int) -> str:
    return self.names[index]


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
  order = sorted(range(n), key=lambda i: image_folder.name_hash(keys[i]))
  chosen = order[:v] if split == "validation" else order[v:]
  return np.asarray(sorted(chosen), np.int64)


def split_files(config: Any, split: str, what: str) -> tuple[str, list[str], bool]:
  """(the file pattern of ``split``, its files, whether it must be
  hash-split): the training split reads ``data.path``; validation and test
  read ``data.eval_path`` when it is set, else ``data.path`` with a hash split."""
  path = cfg_get(config, "path", None)
  if not path:
    raise ValueError(f"the {what} source needs data.path (the shard files, e.g. "
                     f"'shards/train-{{000000..000099}}.tar' or a glob)")
  eval_path = cfg_get(config, "eval_path", None)
  if split != "train" and eval_path:
    return eval_path, shards.expand(eval_path, "data.eval_path"), False
  return path, shards.expand(path, "data.path"), split != "train" or not eval_path


# Labels are int32 (base.Batch); a value beyond is no class.
MAX_LABEL = 2 ** 31 - 1


def integer_labels(values, where: str) -> np.ndarray:
  """int64 labels of a label column, -1 where one is missing (null, NaN);
  one error naming ``where`` and the row of the first value that is no
  integer class (infinite, a fraction, beyond int32), never a value cast
  into another class."""
  x = np.asarray(values, np.float64)
  with np.errstate(invalid="ignore"):
    bad = ~np.isnan(x) & (~np.isfinite(x) | (x != np.round(x)) | (np.abs(x) > MAX_LABEL))
  if bad.any():
    i = int(np.argmax(bad))
    raise ValueError(f"{where}: row {i} has the label {x[i]:g}, not an integer class: "
                     f"fix it, or set data.label_column to the column of class labels")
  return np.nan_to_num(x, nan=-1).astype(np.int64)


def num_classes_of(config: Any, found: int, has_labels: bool) -> int:
  """``data.num_classes`` when set (> 0), else ``found`` (max label + 1); 0
  unlabeled."""
  given = int(cfg_get(config, "num_classes", 0) or 0)
  if not has_labels:
    return 0
  if given and found > given:
    raise ValueError(f"a label is {found - 1} but data.num_classes={given}: "
                     f"raise data.num_classes or set it to 0 (from the labels)")
  return given or found


PROCESS_FILES = ("own", "all")


def file_owner(config: Any, split: str, num_files: int, pattern: str,
               stream: Optional[tuple[int, int]] = None) -> Optional[tuple[int, int]]:
  """(p, P) when this process reads only its own files of ``split`` (the
  module docstring), else None. ``stream`` (g, S): the files of stream g of
  S instead (a run resumed on another number of processes, indexed.py);
  None when S is 1 (every file)."""
  mode = cfg_get(config, "process_files", "own")
  if mode not in PROCESS_FILES:
    raise ValueError(f"data.process_files must be one of {', '.join(PROCESS_FILES)}, "
                     f"got {mode!r}")
  if split != "train" or mode == "all":
    return None
  p, count = this_process() if stream is None else stream
  if count == 1:
    return None
  if num_files < count:
    raise ValueError(f"{pattern!r} has {num_files} file(s) for {count} processes, and each "
                     f"process reads its own files (data.process_files='own'): write at "
                     f"least {count} shards (python -m darl_jax.data.convert --shard_size=...) "
                     f"or set data.process_files='all'")
  return p, count


def splits_files(config: Any, split: str) -> bool:
  """Whether the training files of ``split`` can be split between streams."""
  return split == "train" and cfg_get(config, "process_files", "own") == "own"


def files_to_index(num_files: int, owner: Optional[tuple[int, int]], hashed: bool) -> list[int]:
  """The files a builder lists: its own, unless a hash split needs every key."""
  if owner is None or hashed:
    return list(range(num_files))
  return list(range(owner[0], num_files, owner[1]))


@dataclasses.dataclass
class Selection:
  """The examples of one split, chosen from a listing of files."""
  rows: np.ndarray                      # into the listing
  labels: np.ndarray                    # int32, 0 when unlabeled
  num_classes: int
  owner: Optional[tuple[int, int]]
  process_examples: Optional[list[int]]


def select(config: Any, split: str, *, kind: str, pattern: str, hashed: bool,
           owner: Optional[tuple[int, int]], num_files: int, file_ids: np.ndarray,
           keys: Sequence[str], labels: np.ndarray, what: str,
           gather: bool = True) -> Selection:
  """The examples of ``split`` from a listing: the hash split (when ``hashed``),
  this process's own files (when ``owner``), labels (``labels`` int, -1 where
  an example has none: a split with any such is unlabeled, with one warning
  when only some are), and the log line. ``gather=False``: the files of one
  stream built by one process alone (indexed.py), no collective: the split's
  size and labeledness are the source's that asks for it."""
  # With owned files an empty listing is found by every process at once,
  # after the gather below (one process raising alone would leave the others
  # waiting in it).
  if not len(keys) and (owner is None or not gather):
    raise ValueError(f"the {kind} file(s) of {pattern!r} hold no {what}s")
  rows = np.arange(len(keys))
  if hashed:
    rows = hash_split(keys, split, cfg_get(config, "val_split_size", None), pattern)
  if owner is not None:
    rows = rows[np.asarray(file_ids)[rows] % owner[1] == owner[0]]
  listed = np.asarray(labels, np.int64)
  raw = listed[rows]
  missing = int((raw < 0).sum())
  # A hash split counts the classes of the whole listing, so that its two
  # splits agree (a class whose every example fell in validation is one of
  # the training split's classes too).
  counted = listed if hashed else raw
  found = int(counted.max()) + 1 if len(counted) else 0
  counts = None
  if owner is not None and gather:   # what the processes' own files hold together
    everyone = gather_ints([len(rows), missing, found], owner[1])
    counts = [int(n) for n in everyone[:, 0]]
    if min(counts) == 0:
      raise ValueError(f"process {counts.index(0)} of {owner[1]} has no {what}s among its "
                       f"files of {pattern!r}: write more shards, or set "
                       f"data.process_files='all'")
    missing, found = int(everyone[:, 1].sum()), int(everyone[:, 2].max())
  total = len(rows) if counts is None else sum(counts)
  has_labels = missing == 0
  if missing and missing < total:
    warn_once(("partial labels", pattern), "%d of the %d %ss of %s have no label: the "
              "split is read as unlabeled", missing, total, what, pattern)
  labels = raw.astype(np.int32) if has_labels else np.zeros(len(raw), np.int32)
  if owner is not None and not gather:   # one stream's files, built by this process alone
    logging.info("%s %s (%s), stream %d of %d: %d %ss in its %d of the %d file(s)%s", kind,
                 pattern, split, owner[0], owner[1], total, what,
                 len(range(owner[0], num_files, owner[1])), num_files,
                 "" if has_labels else ", unlabeled")
    return Selection(rows, labels, num_classes_of(config, found, has_labels), owner, None)
  mine = "" if owner is None else (
      f"; this process reads its own {len(range(owner[0], num_files, owner[1]))} file(s) "
      f"(process {owner[0]} of {owner[1]}), {len(rows)} {what}s")
  logging.info("%s %s (%s): %d %ss in %d file(s)%s%s", kind, pattern, split, total, what,
               num_files, "" if has_labels else ", unlabeled", mine)
  return Selection(rows, labels, num_classes_of(config, found, has_labels), owner, counts)


def make(cls, config: Any, seed: int, selection: Selection, names: Sequence[str], *args,
         build=None, split: str = "", **kwargs) -> EncodedSource:
  """``cls(*args, **kwargs)`` with the selection's labels and ``data``'s image
  settings; marked as this process's own files when it is. ``build`` (the
  builder, ``build(config, split=, seed=, stream=)``) lets a training split
  of owned files (``splits_files``) build the source of any stream (g, S)."""
  source = cls(*args, labels=selection.labels, num_classes=selection.num_classes,
               names=[names[i] for i in selection.rows],
               image_size=int(cfg_get(config, "image_size", 64)),
               channels=int(cfg_get(config, "channels", 3)),
               augment=cfg_get(config, "augment", "none"), seed=seed,
               crop_scale=cfg_get(config, "crop_scale", aug.CROP_SCALE), **kwargs)
  if selection.owner is not None and selection.process_examples is not None:
    source.own_files(selection.owner[0], selection.process_examples)
  elif selection.owner is not None:      # one stream's files (select(gather=False))
    source.owner = selection.owner
  if build is not None and splits_files(config, split):
    source.regroup = functools.partial(_build_stream, build, config, split, seed)
  return source


def _build_stream(build, config: Any, split: str, seed: int,
                  stream: tuple[int, int]) -> EncodedSource:
  return build(config, split=split, seed=seed, stream=stream)
