"""WebDataset-style tar shards, read with random access (``data.name=webdataset``).

A shard is a plain tar file whose members are grouped into samples by key:
``{key}.jpg|jpeg|png|webp|...`` is the image and an optional ``{key}.cls``
(an integer), ``{key}.json`` (an integer, or an object with the integer
under ``data.label_key``, default "label") or ``{key}.txt`` (an integer;
any other text, a caption, is ignored) its label. As in WebDataset, the key
is the member's path up to the first dot of its file name. Other members
are ignored, with one warning per shard.

``data.path`` names the training shards: a pattern of `shards.expand`
(brace ranges ``train-{000000..001023}.tar``, globs, ``gs://`` paths through
etils.epath, comma-separated lists). Validation reads ``data.eval_path``
when set, else a hash split of ``data.path``'s samples (image_folder's rule,
``data.val_split_size``).

Random access: each shard's member offsets are indexed once with Python's
tarfile (headers only: member data is skipped over) and cached
(`shards.cached_index`: beside the shard, else under
``data.index_cache_dir``), rebuilt when the shard's size or time changes.
An example is then one seek and one read of its bytes, in the pipeline's
worker processes; everything else (epoch permutations of all samples of all
shards, per-process slices, counter-based crops, resume from the step,
labels) is `indexed.IndexedSource`'s, as for image folders. A truncated
shard keeps the samples it holds whole (one warning); a member that cannot
be decoded is logged and replaced by the next readable one (encoded.py).
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from typing import Any, Optional

import numpy as np

from darl_jax.data import encoded, shards
from darl_jax.data.base import cfg_get, warn_once

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
LABEL_EXTENSIONS = ("cls", "json", "txt")
INDEX_KIND = "webdataset-tar"
# Open shard files kept per process (an LRU): random access touches many.
MAX_OPEN_SHARDS = 16


def _parse_label(ext: str, raw: bytes, label_key: str) -> Optional[int]:
  text = raw.decode("utf-8", errors="replace").strip()
  if ext == "json":
    try:
      value = json.loads(text)
    except ValueError:
      return None
    if isinstance(value, dict):
      value = value.get(label_key)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
  try:
    return int(text)
  except ValueError:
    return None      # a caption in .txt, not a class


def index_shard(shard: str, label_key: str = "label") -> dict:
  """The samples of one tar shard: keys, image offsets and sizes (bytes),
  image extensions, labels (None where a sample has none)."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  images: dict[str, tuple[int, int, str]] = {}
  labels: dict[str, tuple[int, str]] = {}   # key -> (label, ext)
  ignored, truncated = 0, None
  label_rank = {e: r for r, e in enumerate(LABEL_EXTENSIONS)}   # .cls wins over .json over .txt
  with epath.Path(shard).open("rb") as f:
    size = f.seek(0, 2)
    f.seek(0)
    try:
      with tarfile.open(fileobj=f, mode="r:") as tar:
        for member in tar:
          if not member.isfile():
            continue
          folder, name = posixpath.split(member.name)
          stem, _, ext = name.partition(".")
          key, ext = posixpath.join(folder, stem), ext.lower()
          if member.offset_data + member.size > size:
            truncated = f"member {member.name} ends at byte {member.offset_data + member.size} of {size}"
            break
          if ext in IMAGE_EXTENSIONS and not name.startswith("."):
            images.setdefault(key, (member.offset_data, member.size, ext))
          elif ext in LABEL_EXTENSIONS:
            value = _parse_label(ext, tar.extractfile(member).read(), label_key)
            if value is not None and (key not in labels
                                      or label_rank[ext] < label_rank[labels[key][1]]):
              labels[key] = (value, ext)
          else:
            ignored += 1
    except (tarfile.ReadError, EOFError) as e:
      truncated = f"{type(e).__name__}: {e}"
  keys = sorted(images)
  return {"keys": keys,
          "offsets": [images[k][0] for k in keys],
          "sizes": [images[k][1] for k in keys],
          "labels": [labels[k][0] if k in labels else None for k in keys],
          "ignored": ignored, "truncated": truncated}


class TarShardSource(encoded.EncodedSource):
  """Samples of tar shards read by offset (see the module docstring)."""

  PER_PROCESS = {"_open": dict}     # shard -> open file, most recently used last

  def __init__(self, files: list[str], shard_ids: np.ndarray, offsets: np.ndarray,
               sizes: np.ndarray, **kwargs):
    super().__init__(what="tar member", **kwargs)
    self.files = list(files)
    self.shard_ids = np.asarray(shard_ids, np.int32)
    self.offsets = np.asarray(offsets, np.int64)
    self.sizes = np.asarray(sizes, np.int64)

  def _file(self, shard: int):
    f = self._open.pop(shard, None)
    if f is None:
      from etils import epath  # pylint: disable=g-import-not-at-top
      f = epath.Path(self.files[shard]).open("rb")
      if len(self._open) >= MAX_OPEN_SHARDS:
        self._open.pop(next(iter(self._open))).close()
    self._open[shard] = f      # most recently used last
    return f

  def _read(self, index: int) -> bytes:
    f = self._file(int(self.shard_ids[index]))
    f.seek(int(self.offsets[index]))
    size = int(self.sizes[index])
    data = f.read(size)
    if len(data) != size:
      raise EOFError(f"read {len(data)} of {size} bytes (a truncated shard)")
    return data


def _collect(files: list[str], wanted: list[int], config: Any) -> dict:
  """The concatenated index of ``files[wanted]`` (built or read from the cache)."""
  label_key = cfg_get(config, "label_key", "label")
  cache_dir = cfg_get(config, "index_cache_dir", None)
  out = {"shard": [], "offsets": [], "sizes": [], "labels": [], "keys": []}
  for s in wanted:
    shard = files[s]
    index = shards.cached_index(shard, lambda p: index_shard(p, label_key),
                                f"{INDEX_KIND}:{label_key}", cache_dir)
    if index["truncated"]:
      warn_once(("truncated", shard), "tar shard %s is truncated (%s): using its %d "
                "complete sample(s)", shard, index["truncated"], len(index["keys"]))
    if index["ignored"]:
      warn_once(("ignored", shard), "tar shard %s: ignoring %d member(s) that are neither "
                "images (%s) nor labels (%s)", shard, index["ignored"],
                "/".join(IMAGE_EXTENSIONS), "/".join(LABEL_EXTENSIONS))
    if not index["keys"]:
      warn_once(("empty", shard), "tar shard %s holds no images (%s)", shard,
                "/".join(IMAGE_EXTENSIONS))
    base = posixpath.basename(shard)
    out["shard"] += [s] * len(index["keys"])
    out["offsets"] += index["offsets"]
    out["sizes"] += index["sizes"]
    out["labels"] += [-1 if v is None else v for v in index["labels"]]
    out["keys"] += [f"{base}/{k}" for k in index["keys"]]
  return out


def build(config: Any, *, split: str, seed: int) -> TarShardSource:
  pattern, files, hashed = encoded.split_files(config, split, "webdataset")
  owner = encoded.file_owner(config, split, len(files), pattern)
  index = _collect(files, encoded.files_to_index(len(files), owner, hashed), config)
  if not index["keys"] and owner is None:   # owned: select() says it on every process
    raise ValueError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) in the {len(files)} tar "
                     f"shard(s) of {pattern!r}: a WebDataset sample is {{key}}.jpg (or "
                     f".png, .webp) beside an optional {{key}}.cls label")
  shard_ids = np.asarray(index["shard"], np.int32)
  chosen = encoded.select(config, split, kind="webdataset", pattern=pattern, hashed=hashed,
                          owner=owner, num_files=len(files), file_ids=shard_ids,
                          keys=index["keys"], labels=index["labels"], what="sample")
  rows = chosen.rows
  return encoded.make(TarShardSource, config, seed, chosen, index["keys"], files,
                      shard_ids[rows], np.asarray(index["offsets"], np.int64)[rows],
                      np.asarray(index["sizes"], np.int64)[rows])
