"""Writes an image folder into tar, ArrayRecord or Parquet shards, once, for the sharded sources.

    python -m darl_jax.data.convert --src=<image folder> --dst=<dir> --format=tar \\
        --shard_size=10000
    python -m darl_jax.data.convert --src=<image folder> --dst=<dir> --format=arrayrecord
    python -m darl_jax.data.convert --src=<image folder> --dst=<dir> --format=parquet

The folder is read as the image_folder source reads it (split folders
``train/``, ``val/``..., or one pool; optional class sub-folders), and each
split becomes ``<dst>/<split>-000000.tar``, ``-000001.tar``, ... of
``shard_size`` images: WebDataset samples ``{key}.<ext>`` with the file's
bytes unchanged (no re-encoding: the same pixels) and, when the folder has
class sub-folders, ``{key}.cls`` (the class index of the sorted class names,
the labels image_folder gives). Keys are the relative paths without their
extension (dots in a name become ``_``, since a WebDataset key ends at the
first dot). A folder without split folders becomes ``train-*`` only: point
``data.path`` at it and the webdataset source holds out validation by hash.
The printed lines give the ``data.path`` / ``data.eval_path`` to train on.

``--format=arrayrecord`` writes ``<dst>/<split>-NNNNNN.array_record`` instead
(``data.name=arrayrecord``): one record per image, a msgpack map of the file's
bytes (unchanged), its class index (when the folder has class sub-folders)
and its key (the relative path), the layout sources/arrayrecord.py documents;
written with ``group_size:1``, ArrayRecord's setting for random access.

``--format=parquet`` writes ``<dst>/<split>-NNNNNN.parquet`` (``data.name=parquet``)
in Hugging Face's image layout: an ``image`` column of ``{bytes, path}``
structs (the file's bytes unchanged, its relative path), an integer ``label``
column when the folder has class sub-folders, row groups of 256 images.

Exit status (darl_jax/cli.py, as every command): 0 done; 1 the folder
cannot be converted (it does not exist, holds no images, a file cannot be
read or a shard written: the line names it); 2 bad input, one ``error:``
line (an unknown flag, a bad value such as ``--shard_size=0`` or an unknown
``--format``, ``--src`` or ``--dst`` left out).
"""

from __future__ import annotations

import io
import os
import posixpath
import tarfile
import time
from typing import Optional, Sequence

from absl import app, flags

from darl_jax import cli as cli_lib
from darl_jax.data.sources import image_folder

FORMATS = ("tar", "arrayrecord", "parquet")
SOURCE_NAMES = {"tar": "webdataset", "arrayrecord": "arrayrecord", "parquet": "parquet"}
ARRAYRECORD_WRITER_OPTIONS = "group_size:1"
# Parquet row groups: the unit the parquet source reads and shuffles by.
PARQUET_ROW_GROUP = 256


def _sample_key(rel: str) -> str:
  stem, _ = os.path.splitext(rel.replace(os.sep, "/"))
  folder, name = posixpath.split(stem)
  return posixpath.join(folder, name.replace(".", "_"))


class _TarShard:
  """WebDataset samples ``{key}.<ext>`` (+ ``{key}.cls``) in a tar file."""
  suffix = ".tar"

  def __init__(self, path: str):
    self._tar = tarfile.open(path, "w", format=tarfile.GNU_FORMAT)

  def _member(self, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(mtime), 0o644
    self._tar.addfile(info, io.BytesIO(data))

  def add(self, rel: str, data: bytes, label: Optional[int], mtime: float) -> None:
    key = _sample_key(rel)
    self._member(f"{key}.{os.path.splitext(rel)[1].lstrip('.').lower()}", data, mtime)
    if label is not None:
      self._member(f"{key}.cls", str(label).encode(), mtime)

  def close(self) -> None:
    self._tar.close()


class _ArrayRecordShard:
  """One msgpack record per image (sources/arrayrecord.py's layout)."""
  suffix = ".array_record"

  def __init__(self, path: str):
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    self._writer = array_record_module.ArrayRecordWriter(path, ARRAYRECORD_WRITER_OPTIONS)

  def add(self, rel: str, data: bytes, label: Optional[int], mtime: float) -> None:
    del mtime
    from darl_jax.data.sources import arrayrecord  # pylint: disable=g-import-not-at-top
    self._writer.write(arrayrecord.encode_record(data, label, rel.replace(os.sep, "/")))

  def close(self) -> None:
    self._writer.close()


class _ParquetShard:
  """Hugging Face's image layout: an ``image`` struct of ``bytes`` and
  ``path``, and an integer ``label`` column when there are classes; row groups
  of PARQUET_ROW_GROUP images, written as they fill."""
  suffix = ".parquet"

  def __init__(self, path: str):
    self._path, self._rows, self._writer = path, [], None

  def _flush(self) -> None:
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    if not self._rows:
      return
    columns = {"image": [{"bytes": d, "path": r} for r, d, _ in self._rows]}
    if self._rows[0][2] is not None:
      columns["label"] = pa.array([l for _, _, l in self._rows], pa.int64())
    table = pa.table(columns)
    if self._writer is None:
      self._writer = pq.ParquetWriter(self._path, table.schema)
    self._writer.write_table(table, row_group_size=PARQUET_ROW_GROUP)
    self._rows = []

  def add(self, rel: str, data: bytes, label: Optional[int], mtime: float) -> None:
    del mtime
    self._rows.append((rel.replace(os.sep, "/"), data, label))
    if len(self._rows) == PARQUET_ROW_GROUP:
      self._flush()

  def close(self) -> None:
    self._flush()
    if self._writer is not None:
      self._writer.close()


WRITERS = {"tar": _TarShard, "arrayrecord": _ArrayRecordShard, "parquet": _ParquetShard}


def write_shards(fmt: str, base: str, files: Sequence[str], classes: Sequence[str], dst: str,
                 prefix: str, shard_size: int) -> list[str]:
  """Writes ``files`` (relative to ``base``) into ``<dst>/<prefix>-NNNNNN<suffix>``
  shards of ``shard_size`` images; each shard appears whole (written under a
  temporary name, then renamed)."""
  if shard_size <= 0:
    raise ValueError(f"--shard_size must be positive, got {shard_size}")
  shard_cls = WRITERS[fmt]
  index = {name: i for i, name in enumerate(classes)}
  written = []
  os.makedirs(dst, exist_ok=True)
  for start in range(0, len(files), shard_size):
    path = os.path.join(dst, f"{prefix}-{start // shard_size:06d}{shard_cls.suffix}")
    tmp = path + ".tmp"
    shard = shard_cls(tmp)
    try:
      for rel in files[start:start + shard_size]:
        full = os.path.join(base, rel)
        with open(full, "rb") as f:
          data = f.read()
        label = index[rel.split(os.sep)[0]] if classes else None
        shard.add(rel, data, label, os.path.getmtime(full))
    finally:
      shard.close()
    os.replace(tmp, path)
    written.append(path)
  return written


def convert(src: str, dst: str, fmt: str = "tar", shard_size: int = 10_000,
            val_split_size=None) -> dict[str, list[str]]:
  """{split: shard paths} of ``src`` written under ``dst``."""
  if fmt not in FORMATS:
    raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
  if not os.path.isdir(src):
    raise FileNotFoundError(f"--src {src} is not a folder of images")
  folders = image_folder._split_folders(src)   # pylint: disable=protected-access
  splits = [s for s in ("train", "validation", "test") if s in folders] or ["train"]
  listed = {}
  for split in splits:
    if folders:
      base, files, all_lists = image_folder.resolve_files(src, split, val_split_size)
    else:   # one pool: every image, the source splits it by hash
      base, files = src, image_folder.list_images(src)
      all_lists = [files]
      if not files:
        raise ValueError(f"no images ({', '.join(image_folder.IMAGE_EXTENSIONS)}) under {src}")
    listed[split] = (base, files, all_lists)
  classes = image_folder.class_names([f for _, _, lists in listed.values() for f in lists])
  out = {}
  for split, (base, files, _) in listed.items():
    out[split] = write_shards(fmt, base, files, classes, dst, split, shard_size)
  return out


def _brace(paths: list[str]) -> str:
  """The brace pattern of consecutive shards ``x-000000.tar .. x-00000N.tar``
  (or ``.array_record``)."""
  if len(paths) == 1:
    return paths[0]
  stem, ext = os.path.splitext(paths[0])
  head = stem[:-len("000000")]
  return f"{head}{{000000..{len(paths) - 1:06d}}}{ext}"


_SRC = flags.DEFINE_string("src", None, "the image folder to convert")
_DST = flags.DEFINE_string("dst", None, "the folder to write the shards into")
_FORMAT = flags.DEFINE_enum("format", "tar", list(FORMATS), "shard format")
_SHARD_SIZE = flags.DEFINE_integer("shard_size", 10_000, "images per shard", lower_bound=1)


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if not _SRC.value or not _DST.value:
    raise app.UsageError("--src and --dst are required")
  start = time.perf_counter()
  out = convert(_SRC.value, _DST.value, _FORMAT.value, _SHARD_SIZE.value)
  for split, paths in out.items():
    print(f"{split}: {len(paths)} shard(s), {_brace(paths)}")
  train = _brace(out["train"])
  extra = f" --config.data.eval_path='{_brace(out['validation'])}'" if "validation" in out else ""
  print(f"done in {time.perf_counter() - start:.1f} s; train with "
        f"--config.data.name={SOURCE_NAMES[_FORMAT.value]} --config.data.path='{train}'{extra}")


def cli(argv=None):
  """The command, every error one line (darl_jax/cli.py)."""
  cli_lib.run(main, argv=argv)


if __name__ == "__main__":
  cli()
