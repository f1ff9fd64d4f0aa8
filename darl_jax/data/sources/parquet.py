"""Parquet files of encoded images (``data.name=parquet``), read by row group.

The format Hugging Face datasets publishes: a column of images, either a
struct with a ``bytes`` field (``{"bytes": ..., "path": ...}``, HF's Image
feature) or a plain binary column (``data.image_column``, default "image"),
and optionally an integer label column (``data.label_column``, default
"label"; a file without it is unlabeled; a null or NaN is a missing label,
and a value that is no integer class an error naming its file and row).
``data.path`` / ``data.eval_path`` are shard patterns as for tar shards
(`shards.expand`: braces, globs, ``gs://``); without ``eval_path``
validation is a hash split of ``path``.

Random access by row group: the files' footers give every row's (file, row
group, row); labels are read up front (one small column); a worker reads a
row group's image column when it first needs one of its rows and keeps the
last few (``CACHED_ROW_GROUPS``). A Parquet file cannot read one row
alone, so a uniform shuffle over all rows would read a whole row group per
image; training epochs are therefore block-shuffled: the row groups are
permuted, and the rows of each window of ``SHUFFLE_WINDOW`` consecutive row
groups (in that permuted order) are shuffled together. Every row is seen
once per epoch, the order is a pure function of (seed, epoch) as for the
other sources (resume, per-process slices and determinism hold), and a
batch touches about ``SHUFFLE_WINDOW`` row groups. Write files with row groups
of a few hundred to a few thousand images (HF's default) for a good shuffle.

A file that cannot be opened (cut short, it has no footer; damaged) is an
error that names it; a row group that cannot be read later is logged with
its file and replaced by the next readable row, as undecodable images are
(encoded.py).

pyarrow comes with TensorFlow Datasets (the ``tfds`` extra) and is pinned in
constraints.txt; without it the source says to ``pip install pyarrow``. It is
imported only when a Parquet source is built.
"""

from __future__ import annotations

import collections
import os
from typing import Any

import numpy as np

from darl_jax.data.sources import encoded
from darl_jax.data.base import cfg_get

SHUFFLE_WINDOW = 4
CACHED_ROW_GROUPS = SHUFFLE_WINDOW + 2


def _pq():
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("the parquet source needs pyarrow: pip install -c constraints.txt "
                      "pyarrow") from e
  return pq


def _open(path: str):
  from etils import epath  # pylint: disable=g-import-not-at-top
  if "://" not in path:
    return _pq().ParquetFile(path)
  return _pq().ParquetFile(epath.Path(path).open("rb"))


def _image_bytes(column, image_column: str, path: str):
  """The encoded images of a pyarrow column (struct with ``bytes``, or binary),
  as one pyarrow binary array: a worker takes out only the rows it needs
  (``array[i].as_py()``), not a Python bytes object for every row of every
  row group it reads."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  if pa.types.is_struct(column.type):
    names = [column.type.field(i).name for i in range(column.type.num_fields)]
    if "bytes" not in names:
      raise ValueError(f"{path}: column {image_column!r} is a struct without a 'bytes' "
                       f"field (fields {names}); set data.image_column to the column of "
                       f"encoded images")
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return column.field("bytes")
  if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
    raise ValueError(f"{path}: column {image_column!r} holds {column.type}, not encoded "
                     f"image bytes; set data.image_column")
  return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


class ParquetSource(encoded.EncodedSource):
  """Rows of Parquet files (see the module docstring)."""

  PER_PROCESS = {"_handles": dict, "_cache": collections.OrderedDict}

  def __init__(self, files: list[str], file_ids: np.ndarray, groups: np.ndarray,
               rows: np.ndarray, image_column: str, **kwargs):
    super().__init__(what="Parquet row", **kwargs)
    self.files, self.image_column = list(files), image_column
    self.file_ids = np.asarray(file_ids, np.int32)
    self.groups = np.asarray(groups, np.int32)
    self.rows = np.asarray(rows, np.int64)
    # One id per (file, row group): the unit of reading and of shuffling.
    self.blocks = self.file_ids.astype(np.int64) * (int(self.groups.max(initial=0)) + 1) + self.groups

  def epoch_order(self, epoch: int) -> np.ndarray:
    """Row groups permuted, rows shuffled within windows of SHUFFLE_WINDOW of them."""
    rng = self.epoch_rng(epoch)
    ids, members = np.unique(self.blocks, return_inverse=True)
    order = np.argsort(members, kind="stable")
    starts = np.searchsorted(members[order], np.arange(len(ids) + 1))
    block_order = rng.permutation(len(ids))
    parts = []
    for w in range(0, len(ids), SHUFFLE_WINDOW):
      window = np.concatenate([order[starts[b]:starts[b + 1]]
                               for b in block_order[w:w + SHUFFLE_WINDOW]])
      parts.append(rng.permutation(window))
    return np.concatenate(parts)

  def _group(self, file_id: int, group: int):
    key = (file_id, group)
    images = self._cache.pop(key, None)
    if images is None:
      handle = self._handles.get(file_id)
      if handle is None:
        handle = self._handles[file_id] = _open(self.files[file_id])
      # One thread: the pipeline already runs a worker process per core, and
      # pyarrow's own pool (a thread per core in every worker) only contends.
      table = handle.read_row_group(group, columns=[self.image_column], use_threads=False)
      images = _image_bytes(table.column(0), self.image_column, self.files[file_id])
      if len(self._cache) >= CACHED_ROW_GROUPS:
        self._cache.popitem(last=False)
    self._cache[key] = images
    return images

  def _read(self, index: int) -> bytes:
    data = self._group(int(self.file_ids[index]), int(self.groups[index]))[
        int(self.rows[index])].as_py()
    if data is None:
      raise ValueError("the image is null")
    return data


def _unreadable(path: str, e: Exception) -> ValueError:
  """pyarrow's errors name no file ("Parquet magic bytes not found in
  footer"): this one does. An error, not a warning and a skip: a file
  without its footer has no readable row at all, so reading on would lose
  the whole file; a copy that stopped is fixed by copying again."""
  return ValueError(f"the Parquet file {path} cannot be read ({' '.join(str(e).split())}): "
                    f"cut short or damaged? copy it again, or leave it out of data.path")


def _file_rows(path: str, image_column: str, label_column: str, explicit_label: bool):
  """(row groups' sizes, labels or None) of one file, from its footer and label column."""
  _pq()
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  try:
    handle = _open(path)
    names = handle.schema_arrow.names
    sizes = [handle.metadata.row_group(g).num_rows for g in range(handle.num_row_groups)]
  except pa.ArrowException as e:
    raise _unreadable(path, e) from None
  if image_column not in names:
    raise ValueError(f"{path} has no column {image_column!r} (columns: {', '.join(names)}); "
                     f"set data.image_column to the column of encoded images")
  labels = None
  if label_column in names:
    try:
      labels = handle.read(columns=[label_column]).column(0).to_numpy(zero_copy_only=False)
    except pa.ArrowException as e:
      raise _unreadable(path, e) from None
  elif explicit_label:
    raise ValueError(f"{path} has no label column {label_column!r} (columns: "
                     f"{', '.join(names)}); set data.label_column, or leave it at 'label' "
                     f"for unlabeled data")
  return sizes, labels


def build(config: Any, *, split: str, seed: int, stream=None) -> ParquetSource:
  # stream (g, S): the source of stream g's files (encoded.make, indexed.py).
  pattern, files, hashed = encoded.split_files(config, split, "parquet")
  owner = encoded.file_owner(config, split, len(files), pattern, stream)
  image_column = cfg_get(config, "image_column", "image")
  label_column = cfg_get(config, "label_column", "label")
  file_ids, groups, rows, labels, keys = [], [], [], [], []
  for f in encoded.files_to_index(len(files), owner, hashed):
    path = files[f]
    sizes, file_labels = _file_rows(path, image_column, label_column,
                                    explicit_label=label_column != "label")
    n = sum(sizes)
    file_ids.append(np.full(n, f, np.int32))
    groups.append(np.repeat(np.arange(len(sizes), dtype=np.int32), sizes))
    rows.append(np.concatenate([np.arange(s, dtype=np.int64) for s in sizes] or
                               [np.zeros(0, np.int64)]))
    labels.append(np.full(n, -1, np.int64) if file_labels is None else
                  encoded.integer_labels(file_labels, f"{path}: column {label_column!r}"))
    base = os.path.basename(path)
    keys += [f"{base}:{i}" for i in range(n)]
  file_ids, groups, rows, labels = map(np.concatenate, (file_ids, groups, rows, labels))
  chosen = encoded.select(config, split, kind="parquet", pattern=pattern, hashed=hashed,
                          owner=owner, num_files=len(files), file_ids=file_ids, keys=keys,
                          labels=labels, what="row", gather=stream is None)
  picked = chosen.rows
  return encoded.make(ParquetSource, config, seed, chosen, keys, files, file_ids[picked],
                      groups[picked], rows[picked], image_column, build=build, split=split)
