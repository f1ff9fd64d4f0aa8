"""ArrayRecord files of your own images (``data.name=arrayrecord``), read with
random access through ``array_record`` (the reader Grain uses).

Record layout (written by ``python -m darl_jax.data.convert --format=arrayrecord``;
any writer can produce it, no TensorFlow involved): each ArrayRecord record is
one msgpack map (msgpack is a dependency of Flax)::

    {"image": <bytes: the encoded image file, JPEG/PNG/WebP... unchanged>,
     "label": <int, optional>,
     "key":   <str, optional: a stable name, e.g. the image's relative path>}

A record without ``"label"`` is unlabeled (a split whose records all lack it
is an unlabeled split: pretraining needs none; fine-tuning and probes say so).
``"key"`` names the record in messages and drives the hash split; without it
the key is ``<file name>:<position>``.

``data.path`` names the training files, a shard pattern of `shards.expand`
(brace ranges ``train-{000000..000009}.array_record``, globs, ``gs://`` paths,
comma-separated lists). Validation reads ``data.eval_path`` when set, else a
hash split of ``data.path``'s records (image_folder's rule,
``data.val_split_size``), as for tar shards and Parquet files.

Labels and keys are needed up front (for the label count and the split), so
each file is scanned once and its labels and keys cached like a tar shard's
member index (`shards.cached_index`: beside the file, else under
``data.index_cache_dir``; rebuilt when the file's size or time changes).
After that a training example is one random-access read of its record in
the pipeline's worker processes (``readahead_buffer_size:0``, the random
access setting); permutations, per-process slices, counter-based crops and
resume from the step are `indexed.IndexedSource`'s. A record that is not such
a msgpack map, or whose image cannot be decoded, is logged and replaced by
the next readable one (encoded.py); a file that cannot be opened (truncated,
not ArrayRecord) is an error naming it.
"""

from __future__ import annotations

import os
import posixpath
from typing import Any, Optional

import numpy as np

from darl_jax.data.sources import encoded, shards
from darl_jax.data.base import cfg_get, warn_once

INDEX_KIND = "darl-arrayrecord-v1"
RECORD_FIELDS = ("image", "label", "key")
# Random access: no read-ahead (ArrayRecord's documented setting for it).
READER_OPTIONS = {"readahead_buffer_size": "0", "max_parallelism": "0"}
SCAN_CHUNK = 512


def encode_record(image: bytes, label: Optional[int] = None, key: Optional[str] = None) -> bytes:
  """One record of the layout above."""
  import msgpack  # pylint: disable=g-import-not-at-top
  record: dict[str, Any] = {"image": bytes(image)}
  if label is not None:
    record["label"] = int(label)
  if key is not None:
    record["key"] = str(key)
  return msgpack.packb(record, use_bin_type=True)


def decode_record(data: bytes) -> dict:
  """The map of one record; ValueError when it is not of the layout above."""
  import msgpack  # pylint: disable=g-import-not-at-top
  try:
    record = msgpack.unpackb(data, raw=False)
  except Exception as e:  # pylint: disable=broad-except  # msgpack raises several kinds
    raise ValueError(f"not a msgpack record ({type(e).__name__}: {e})") from e
  if not isinstance(record, dict) or not isinstance(record.get("image"), bytes):
    raise ValueError("not a darl_jax image record (a msgpack map with 'image' bytes)")
  label = record.get("label")
  if label is not None and (isinstance(label, bool) or not isinstance(label, int)):
    raise ValueError(f"the record's label is {label!r}, not an integer")
  return record


def _reader(path: str):
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  try:
    return array_record_module.ArrayRecordReader(
        os.fspath(path), ",".join(f"{k}:{v}" for k, v in READER_OPTIONS.items()))
  except Exception as e:  # pylint: disable=broad-except  # riegeli's status errors
    raise ValueError(f"cannot read {path} as an ArrayRecord file (truncated, or not "
                     f"ArrayRecord?): {type(e).__name__}: {e}") from e


def index_file(path: str) -> dict:
  """Labels (None where a record has none), keys (None: ``file:position``),
  and the positions of records that are not of the layout, of one file."""
  reader = _reader(path)
  labels, keys, bad = [], [], []
  try:
    n = reader.num_records()
    for start in range(0, n, SCAN_CHUNK):
      chunk = reader.read(start, min(n, start + SCAN_CHUNK))
      for offset, data in enumerate(chunk):
        try:
          record = decode_record(data)
        except ValueError:
          bad.append(start + offset)
          labels.append(None)
          keys.append(None)
          continue
        labels.append(record.get("label"))
        key = record.get("key")
        keys.append(key if isinstance(key, str) else None)
    reader.close()
  except Exception as e:  # pylint: disable=broad-except  # riegeli's status errors
    raise ValueError(f"cannot read {path} as an ArrayRecord file (truncated, or not "
                     f"ArrayRecord?): {type(e).__name__}: {e}") from e
  return {"labels": labels, "keys": keys, "bad": bad}


class ArrayRecordSource(encoded.EncodedSource):
  """Records of ArrayRecord files read by (file, position)."""

  PER_PROCESS = {"_readers": dict}   # file -> open reader

  def __init__(self, files: list[str], file_ids: np.ndarray, positions: np.ndarray, **kwargs):
    super().__init__(what="ArrayRecord record", **kwargs)
    self.files = list(files)
    self.file_ids = np.asarray(file_ids, np.int32)
    self.positions = np.asarray(positions, np.int64)

  def _read(self, index: int) -> bytes:
    f = int(self.file_ids[index])
    reader = self._readers.get(f)
    if reader is None:
      reader = self._readers[f] = _reader(self.files[f])
    data = reader.read([int(self.positions[index])])[0]
    return decode_record(data)["image"]


def build(config: Any, *, split: str, seed: int, stream=None) -> ArrayRecordSource:
  # stream (g, S): the source of stream g's files (encoded.make, indexed.py).
  pattern, files, hashed = encoded.split_files(config, split, "arrayrecord")
  owner = encoded.file_owner(config, split, len(files), pattern, stream)
  cache_dir = cfg_get(config, "index_cache_dir", None)
  file_ids, positions, labels, keys = [], [], [], []
  for f in encoded.files_to_index(len(files), owner, hashed):
    path = files[f]
    index = shards.cached_index(path, index_file, INDEX_KIND, cache_dir)
    bad = set(index["bad"])
    if bad:
      warn_once(("bad records", path), "%s: skipping %d record(s) that are not darl_jax "
                "image records (a msgpack map with 'image' bytes, optional 'label')",
                path, len(bad))
    base = posixpath.basename(path)
    for p, (label, key) in enumerate(zip(index["labels"], index["keys"])):
      if p in bad:
        continue
      file_ids.append(f)
      positions.append(p)
      labels.append(-1 if label is None else int(label))
      keys.append(key if key is not None else f"{base}:{p}")
  if not keys and owner is None:   # owned: select() says it on every process
    raise ValueError(f"the {len(files)} ArrayRecord file(s) of {pattern!r} hold no image "
                     f"records; write them with `python -m darl_jax.data.convert "
                     f"--format=arrayrecord --src=<image folder> --dst=<dir>`")
  file_ids = np.asarray(file_ids, np.int32)
  chosen = encoded.select(config, split, kind="arrayrecord", pattern=pattern, hashed=hashed,
                          owner=owner, num_files=len(files), file_ids=file_ids, keys=keys,
                          labels=labels, what="record", gather=stream is None)
  return encoded.make(ArrayRecordSource, config, seed, chosen, keys, files,
                      file_ids[chosen.rows], np.asarray(positions, np.int64)[chosen.rows],
                      build=build, split=split)
