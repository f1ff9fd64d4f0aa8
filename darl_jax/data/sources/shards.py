"""Sharded files: path patterns, and per-shard indexes cached on disk.

``expand(pattern)`` turns a shard pattern into the sorted list of its files:

- brace ranges and lists as WebDataset writes them,
  ``shards/train-{000000..001023}.tar`` (zero padding kept) and
  ``{train,extra}-*.parquet``;
- glob patterns (``*``, ``?``, ``[...]``), matched through etils.epath, so that
  ``gs://bucket/shards/*.tar`` works like a local path;
- several patterns separated by commas, or a list of them.

A pattern that matches nothing is an error that names it; a brace-expanded
name that does not exist too (a typo in a range would otherwise train on
part of the data).

``cached_index(shard, build, cache_dir)``: a shard's index (a JSON-able
dict, e.g. the byte offsets of a tar's members) is built once and kept beside
the shard (``<shard>.darl_index.json``) or, where that is not writable (a
bucket, a read-only mount) or ``cache_dir`` is given, under ``cache_dir``
(default ``~/.cache/darl_jax/shard_index``), keyed by the shard's path. It is
rebuilt when the shard's size or modification time changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from typing import Any, Callable, Iterable

from absl import logging

INDEX_SUFFIX = ".darl_index.json"
INDEX_VERSION = 1
DEFAULT_CACHE_DIR = "~/.cache/darl_jax/shard_index"
_BRACES = re.compile(r"\{([^{}]*)\}")
_GLOB_CHARS = re.compile(r"[*?\[]")


def _path(p: str):
  from etils import epath  # pylint: disable=g-import-not-at-top
  return epath.Path(p)


def _is_local(p: str) -> bool:
  return "://" not in p


def expand_braces(pattern: str) -> list[str]:
  """``a-{00..02}.tar`` -> [a-00.tar, a-01.tar, a-02.tar]; ``{x,y}`` lists."""
  match = _BRACES.search(pattern)
  if not match:
    return [pattern]
  body = match.group(1)
  span = re.fullmatch(r"(\d+)\.\.(\d+)", body)
  if span:
    lo, hi = span.groups()
    if int(hi) < int(lo):
      raise ValueError(f"empty brace range {{{body}}} in {pattern!r}")
    width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
    options = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
  else:
    options = body.split(",")
  head, tail = pattern[:match.start()], pattern[match.end():]
  return [p for o in options for p in expand_braces(head + o + tail)]


def _glob(pattern: str) -> list[str]:
  if _is_local(pattern):
    import glob  # pylint: disable=g-import-not-at-top
    return sorted(glob.glob(os.path.expanduser(pattern)))
  # epath globs below the longest directory without wildcards.
  parts = pattern.split("/")
  first = next(i for i, part in enumerate(parts) if _GLOB_CHARS.search(part))
  root = "/".join(parts[:first])
  return sorted(str(p) for p in _path(root).glob("/".join(parts[first:])))


def expand(patterns: str | Iterable[str], what: str = "data.path") -> list[str]:
  """The sorted, de-duplicated files of ``patterns`` (see the module doc)."""
  if isinstance(patterns, str):
    patterns = [p.strip() for p in patterns.split(",") if p.strip()]
  files: list[str] = []
  for pattern in patterns:
    for name in expand_braces(pattern):
      if _GLOB_CHARS.search(name):
        found = _glob(name)
        if not found:
          raise FileNotFoundError(f"{what}: no file matches {name!r}; check the "
                                  f"pattern (globs *, ?, [..] and brace ranges "
                                  f"{{000..099}} are expanded)")
        files.extend(found)
      else:
        if not _path(os.path.expanduser(name)).exists():
          raise FileNotFoundError(f"{what}: {name!r} does not exist (from the "
                                  f"pattern {pattern!r})")
        files.append(os.path.expanduser(name))
  if not files:
    raise ValueError(f"{what} names no files")
  return sorted(dict.fromkeys(files))


def _stamp(shard: str) -> dict:
  stat = _path(shard).stat()
  return {"size": int(stat.length if hasattr(stat, "length") else stat.st_size),
          "mtime": float(getattr(stat, "mtime", getattr(stat, "st_mtime", 0.0)))}


def _cache_file(shard: str, cache_dir: str) -> str:
  key = hashlib.sha1(shard.encode("utf-8", "surrogateescape")).hexdigest()[:16]
  return os.path.join(os.path.expanduser(cache_dir),
                      f"{key}-{os.path.basename(shard)}{INDEX_SUFFIX}")


def _read(path: str) -> Any:
  try:
    return json.loads(_path(path).read_text())
  except (OSError, ValueError):
    return None


def _write_atomic(path: str, payload: dict) -> bool:
  """Writes ``payload`` to the local ``path`` atomically; False if the folder
  is not writable."""
  folder = os.path.dirname(path) or "."
  try:
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=INDEX_SUFFIX)
  except OSError:
    return False
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(payload, f)
    os.replace(tmp, path)
    return True
  except OSError:
    if os.path.exists(tmp):
      os.unlink(tmp)
    return False


def cached_index(shard: str, build: Callable[[str], dict], kind: str,
                 cache_dir: str | None = None) -> dict:
  """``build(shard)``, cached (see the module docstring); ``kind`` names the
  index format, so that two readers of one file keep separate indexes."""
  stamp = _stamp(shard)
  want = {"version": INDEX_VERSION, "kind": kind, **stamp}
  candidates = []
  if cache_dir is None and _is_local(shard):
    candidates.append(shard + INDEX_SUFFIX)
  candidates.append(_cache_file(shard, cache_dir or DEFAULT_CACHE_DIR))
  for path in candidates:
    cached = _read(path)
    if isinstance(cached, dict) and all(cached.get(k) == v for k, v in want.items()):
      return cached["index"]
  index = build(shard)
  payload = {**want, "index": index}
  for path in candidates:
    if _write_atomic(path, payload):
      break
  else:
    logging.warning("cannot write the index of %s (tried %s): it is rebuilt by every run",
                    shard, ", ".join(candidates))
  return index


