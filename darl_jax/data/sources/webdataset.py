"""WebDataset-style tar shards, read with random access (``data.name=webdataset``).

A shard is a plain tar file whose members are grouped into samples by key:
``{key}.jpg|jpeg|png|webp|...`` is the image and an optional ``{key}.cls``
(an integer), ``{key}.json`` (an integer, or an object with the integer
under ``data.label_key``, default "label") or ``{key}.txt`` (an integer;
any other text, a caption, is ignored) its label. As in WebDataset, the key
is the member's path up to the first dot of its file name. Other members
are ignored, with one warning per shard. A label member holding a number
that is no class (NaN, Infinity, a fraction, beyond int32) is an error that
names its shard and member.

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
labels) is `indexed.IndexedSource`'s, as for image folders. A shard cut
short (a member ends past the file's end, or the end-of-archive marker every
tar writer puts there is missing) is named in a warning and its complete
samples are read; a sample the cut went through, or one that lost its label
to it, is skipped and counted (`_collect` says why); a member that cannot
be decoded is logged and replaced by the next readable one (encoded.py).
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from typing import Any, Optional

import numpy as np

from darl_jax.data.sources import encoded, shards
from darl_jax.data.base import cfg_get, warn_once

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
LABEL_EXTENSIONS = ("cls", "json", "txt")
# The version after the name: indexes cached by an older reader lack the
# cut-short fields and are rebuilt.
INDEX_KIND = "webdataset-tar-2"
END_MARKER_BYTES = 2 * tarfile.BLOCKSIZE
# Open shard files kept per process (an LRU): random access touches many.
MAX_OPEN_SHARDS = 16


class _Constant(str):
  """NaN, Infinity or -Infinity in a JSON member, kept as its name: an error
  where it stands for the label, and nothing elsewhere in the object."""


def _parse_label(ext: str, raw: bytes, label_key: str) -> Optional[int]:
  """The integer class of a label member, or None when it holds none (a
  caption in .txt, text that is no JSON or number, a JSON object without
  ``label_key``); ValueError for a number that is no class: NaN, Infinity
  (rejected, never read as floats), a fraction, beyond int32."""
  text = raw.decode("utf-8", errors="replace").strip()
  if ext == "json":
    try:
      value = json.loads(text, parse_constant=_Constant)
    except json.JSONDecodeError:
      return None
    if isinstance(value, dict):
      value = value.get(label_key)
    if isinstance(value, _Constant):
      raise ValueError(f"{value} is not a class")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return None
    if isinstance(value, float) and not value.is_integer():
      raise ValueError(f"{value!r} is not an integer class")
  else:
    try:
      value = int(text)
    except ValueError:
      return None      # a caption in .txt, not a class
  if abs(value) > encoded.MAX_LABEL:
    raise ValueError(f"{value!r} is beyond the int32 labels")
  return int(value)


def _end_marker(f, offset: int) -> bool:
  """Whether the end-of-archive marker (two zero blocks, POSIX) is at
  ``offset``: every tar writer (Python's tarfile, GNU tar, the converter)
  ends an archive with it, so a file without it was cut short. Python's
  tarfile stops quietly at a cut between members."""
  f.seek(offset)
  return f.read(END_MARKER_BYTES) == bytes(END_MARKER_BYTES)


def index_shard(shard: str, label_key: str = "label") -> dict:
  """The samples of one tar shard: keys, image offsets and sizes (bytes),
  image extensions, labels (None where a sample has none), and how the
  shard is cut short, if it is: ``truncated`` (why, or None), ``skipped``
  (the keys of the samples the cut went through, left out: a member of
  theirs is incomplete) and ``suspect`` (the key of the last sample when the
  cut fell between members: it may have lost members after the last one
  read, e.g. its label; `_collect` judges it)."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  images: dict[str, tuple[int, int, str]] = {}
  labels: dict[str, tuple[int, str]] = {}   # key -> (label, ext)
  ignored, truncated, cut_key, last_key, end = 0, None, None, None, None
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
            truncated = (f"its member {member.name} ends at byte "
                         f"{member.offset_data + member.size} of {size}")
            cut_key = key
            break
          last_key = key
          if ext in IMAGE_EXTENSIONS and not name.startswith("."):
            images.setdefault(key, (member.offset_data, member.size, ext))
          elif ext in LABEL_EXTENSIONS:
            try:
              value = _parse_label(ext, tar.extractfile(member).read(), label_key)
            except ValueError as e:
              raise ValueError(f"tar shard {shard}: the label member {member.name} is bad "
                               f"({e}): write an integer class there, or remove the "
                               f"member") from None
            if value is not None and (key not in labels
                                      or label_rank[ext] < label_rank[labels[key][1]]):
              labels[key] = (value, ext)
          else:
            ignored += 1
        end = tar.offset       # where the next header, or the end marker, is
    except (tarfile.ReadError, EOFError) as e:
      truncated = f"{type(e).__name__}: {e}"
    if truncated is None and end is not None and not _end_marker(f, end):
      truncated = (f"it has no end-of-archive marker after its last member (byte {end} "
                   f"of {size}): it was cut between members")
  skipped = []
  if cut_key is not None and cut_key in images:
    # The cut went through this sample: a member of it is incomplete (its
    # label, if the image came first). Read, it would be an image without
    # its label, or with a part missing.
    skipped.append(cut_key)
    del images[cut_key]
  suspect = last_key if truncated and cut_key is None and last_key in images else None
  keys = sorted(images)
  return {"keys": keys,
          "offsets": [images[k][0] for k in keys],
          "sizes": [images[k][1] for k in keys],
          "labels": [labels[k][0] if k in labels else None for k in keys],
          "ignored": ignored, "truncated": truncated, "skipped": skipped,
          "suspect": suspect}


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
  """The concatenated index of ``files[wanted]`` (built or read from the cache).

  A shard cut short (a copy or download that stopped; it lacks the end
  marker or a member's end) is a warning that names it, and its complete
  samples are read; not an error, because those samples are whole (each
  member's size is in its header) and a long run should not stop for the
  tail of one shard of thousands. Not silent either: each cut shard is
  named with what it lost, and one line counts them all. A sample the cut
  went through is skipped and counted, and so is the last sample of a shard
  cut between members when it has no label and other samples here have:
  it lost its label, and one image without a label would make the whole
  split unlabeled (encoded.select), which fine-tuning then refuses."""
  label_key = cfg_get(config, "label_key", "label")
  cache_dir = cfg_get(config, "index_cache_dir", None)
  out = {"shard": [], "offsets": [], "sizes": [], "labels": [], "keys": []}
  suspects, cut, skipped = [], [], []
  for s in wanted:
    shard = files[s]
    index = shards.cached_index(shard, lambda p: index_shard(p, label_key),
                                f"{INDEX_KIND}:{label_key}", cache_dir)
    base = posixpath.basename(shard)
    if index["truncated"]:
      cut.append(shard)
      skipped += [f"{base}/{k}" for k in index["skipped"]]
      warn_once(("truncated", shard), "tar shard %s is cut short (%s): reading its %d "
                "complete sample(s)%s; copy it again to read the rest", shard,
                index["truncated"], len(index["keys"]),
                f", skipping {index['skipped'][0]}, which the cut went through"
                if index["skipped"] else "")
    if index["ignored"]:
      warn_once(("ignored", shard), "tar shard %s: ignoring %d member(s) that are neither "
                "images (%s) nor labels (%s)", shard, index["ignored"],
                "/".join(IMAGE_EXTENSIONS), "/".join(LABEL_EXTENSIONS))
    if not index["keys"]:
      warn_once(("empty", shard), "tar shard %s holds no images (%s)", shard,
                "/".join(IMAGE_EXTENSIONS))
    if index["suspect"] is not None:
      suspects.append(len(out["keys"]) + index["keys"].index(index["suspect"]))
    out["shard"] += [s] * len(index["keys"])
    out["offsets"] += index["offsets"]
    out["sizes"] += index["sizes"]
    out["labels"] += [-1 if v is None else v for v in index["labels"]]
    out["keys"] += [f"{base}/{k}" for k in index["keys"]]
  labeled = sum(v >= 0 for v in out["labels"])
  lost = [i for i in suspects if out["labels"][i] < 0]
  if lost and labeled:
    skipped += [out["keys"][i] for i in lost]
    drop = set(lost)
    for name, values in out.items():
      out[name] = [v for i, v in enumerate(values) if i not in drop]
  if cut:
    warn_once(("cut shards", tuple(cut)), "%d of the %d tar shard(s) read here are cut short "
              "(%s%s); %d incomplete sample(s) skipped%s", len(cut), len(wanted),
              ", ".join(cut[:3]), ", ..." if len(cut) > 3 else "", len(skipped),
              f" ({', '.join(skipped[:3])}{', ...' if len(skipped) > 3 else ''})"
              if skipped else "")
  return out


def build(config: Any, *, split: str, seed: int, stream=None) -> TarShardSource:
  # stream (g, S): the source of stream g's files (encoded.make, indexed.py).
  pattern, files, hashed = encoded.split_files(config, split, "webdataset")
  owner = encoded.file_owner(config, split, len(files), pattern, stream)
  index = _collect(files, encoded.files_to_index(len(files), owner, hashed), config)
  if not index["keys"] and owner is None:   # owned: select() says it on every process
    raise ValueError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) in the {len(files)} tar "
                     f"shard(s) of {pattern!r}: a WebDataset sample is {{key}}.jpg (or "
                     f".png, .webp) beside an optional {{key}}.cls label")
  shard_ids = np.asarray(index["shard"], np.int32)
  chosen = encoded.select(config, split, kind="webdataset", pattern=pattern, hashed=hashed,
                          owner=owner, num_files=len(files), file_ids=shard_ids,
                          keys=index["keys"], labels=index["labels"], what="sample",
                          gather=stream is None)
  rows = chosen.rows
  return encoded.make(TarShardSource, config, seed, chosen, index["keys"], files,
                      shard_ids[rows], np.asarray(index["offsets"], np.int64)[rows],
                      np.asarray(index["sizes"], np.int64)[rows], build=build,
                      split=split)
