"""Writing small result files whole or not at all."""

from __future__ import annotations

import json
import os

from etils import epath


def write_text_atomic(path, text: str) -> epath.Path:
  """Writes ``text`` to a temporary file beside ``path``, then renames it over
  ``path``: a writer killed (or a disk that fills) half way leaves the old
  file or none, never a torn one. Files whose presence means "this run is
  finished" (resume markers) must be written this way. Works for local and
  ``gs://`` paths (``epath``)."""
  path = epath.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
  try:
    tmp.write_text(text)
    tmp.replace(path)
  finally:
    if tmp.exists():
      tmp.unlink()
  return path


def write_json_atomic(path, obj, **dumps_kwargs) -> epath.Path:
  return write_text_atomic(path, json.dumps(obj, **dumps_kwargs))


def read_json_or_none(path):
  """The JSON in ``path``; None if it is missing or not valid JSON (e.g. torn
  by a writer from before writes were atomic)."""
  path = epath.Path(path)
  if not path.exists():
    return None
  try:
    return json.loads(path.read_text())
  except ValueError:
    return None
