"""Hugging Face ``datasets`` saved with ``save_to_disk`` (``data.name=hf_disk``).

``data.path`` is the folder ``Dataset.save_to_disk`` or
``DatasetDict.save_to_disk`` wrote; it is opened with ``datasets.load_from_disk``
(memory-mapped Arrow files: nothing is loaded into host memory; a ``gs://``
style URL goes through fsspec as ``load_from_disk`` allows). The images are
the column ``data.image_column`` (default "image"): a ``datasets.Image``
feature (read as stored, undecoded: the encoded bytes, or the file its
``path`` names when the bytes are not stored) or a binary column of encoded
images. Labels are ``data.label_column`` (default "label"; an integer or
``ClassLabel`` column, whose class count is used); a dataset without that
column is unlabeled, and a row whose label is missing or negative (HF marks
unlabeled test rows -1) makes its split unlabeled (one warning). A label
column named explicitly must exist.

Splits: a ``DatasetDict`` gives its ``train`` split for training and its
``validation`` (or ``val``, ``valid``) / ``test`` split for those.
``data.eval_path``, when set, is read for validation and test instead (a
``Dataset``, or a ``DatasetDict`` holding the split). Otherwise a split
that is not there is a hash split of the training rows (image_folder's rule,
``data.val_split_size``), as for the tar, Parquet and ArrayRecord sources.

Random access: a worker process opens the dataset itself (memory maps are
per process) and reads row i's image column only; labels are read up front
(one column). Decoding, bad-record substitution, permutations, per-process
slices, counter-based crops and resume from the step are those of
`encoded.EncodedSource` / `indexed.IndexedSource`.

``datasets`` is an optional extra: ``pip install -c constraints.txt -e ".[hf]"``.
"""

from __future__ import annotations

import posixpath
from typing import Any, Optional

import numpy as np

from darl_jax.data.sources import encoded
from darl_jax.data.base import cfg_get

INSTALL = 'pip install -c constraints.txt -e ".[hf]"'
SPLIT_NAMES = {"train": ("train",), "validation": ("validation", "val", "valid"),
               "test": ("test",)}


def _datasets():
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f"data.name='hf_disk' needs Hugging Face datasets: {INSTALL}") from e
  return datasets


def _load(path: str):
  datasets = _datasets()
  try:
    return datasets.load_from_disk(path)
  except FileNotFoundError as e:
    raise FileNotFoundError(f"{path} is not a dataset folder written by save_to_disk "
                            f"(data.name='hf_disk'): {e}") from e


def _pick(obj, split: str) -> Optional[str]:
  """The split name of ``obj`` (a DatasetDict) holding ``split``; "" for a
  plain Dataset; None when a DatasetDict has no such split."""
  if not hasattr(obj, "keys"):
    return ""
  for name in SPLIT_NAMES[split]:
    if name in obj:
      return name
  return None


def _open_split(path: str, name: str):
  obj = _load(path)
  return obj[name] if name else obj


def _image_view(ds, image_column: str, where: str):
  """``ds`` reduced to its image column, rows as Arrow (the encoded bytes)."""
  datasets = _datasets()
  if image_column not in ds.column_names:
    raise ValueError(f"{where} has no column {image_column!r} (columns: "
                     f"{', '.join(ds.column_names)}); set data.image_column to the column of "
                     f"encoded images")
  feature = ds.features[image_column]
  # Arrow rows: the stored struct {bytes, path} or bytes, never decoded.
  view = ds.select_columns([image_column]).with_format("arrow")
  if isinstance(feature, datasets.Image):
    return view
  dtype = getattr(feature, "dtype", None)
  if dtype in ("binary", "large_binary"):
    return view
  if isinstance(feature, dict) and "bytes" in feature:
    return view
  raise ValueError(f"{where}: column {image_column!r} is {feature}, not images (a "
                   f"datasets.Image feature or encoded bytes); set data.image_column")


def _image_bytes(value) -> bytes:
  if isinstance(value, dict):
    data = value.get("bytes")
    if data is None and value.get("path"):
      from etils import epath  # pylint: disable=g-import-not-at-top
      return epath.Path(value["path"]).read_bytes()
    value = data
  if value is None:
    raise ValueError("the image is null")
  return bytes(value)


class HfDiskSource(encoded.EncodedSource):
  """Rows of a dataset saved with ``save_to_disk`` (see the module docstring)."""

  PER_PROCESS = {"_ds": lambda: None}   # the memory-mapped dataset, opened on first use

  def __init__(self, path: str, split_name: str, image_column: str, rows: np.ndarray,
               **kwargs):
    super().__init__(what="dataset row", **kwargs)
    self.path, self.split_name, self.image_column = path, split_name, image_column
    self.rows = np.asarray(rows, np.int64)

  def _dataset(self):
    if self._ds is None:
      self._ds = _image_view(_open_split(self.path, self.split_name), self.image_column,
                             self.path)
    return self._ds

  def _read(self, index: int) -> bytes:
    row = self._dataset()[int(self.rows[index])]      # a one-row pyarrow Table
    return _image_bytes(row.column(0)[0].as_py())


def _labels(ds, label_column: str, explicit: bool, where: str):
  """(labels int64 [n] or None when unlabeled, the ClassLabel count or 0)."""
  datasets = _datasets()
  if label_column not in ds.column_names:
    if explicit:
      raise ValueError(f"{where} has no label column {label_column!r} (columns: "
                       f"{', '.join(ds.column_names)}); set data.label_column, or leave it "
                       f"at 'label' for unlabeled data")
    return None, 0
  feature = ds.features[label_column]
  classes = int(feature.num_classes) if isinstance(feature, datasets.ClassLabel) else 0
  values = ds.select_columns([label_column]).with_format("numpy")[label_column]
  values = np.asarray(values)
  if not np.issubdtype(values.dtype, np.number):
    raise ValueError(f"{where}: label column {label_column!r} holds {feature}, not integer "
                     f"labels; set data.label_column")
  values = encoded.integer_labels(values, f"{where}: label column {label_column!r}")
  return values, classes


def build(config: Any, *, split: str, seed: int) -> HfDiskSource:
  path = cfg_get(config, "path", None)
  if not path:
    raise ValueError("the hf_disk source needs data.path (the folder a Hugging Face "
                     "Dataset or DatasetDict was saved to with save_to_disk)")
  eval_path = cfg_get(config, "eval_path", None)
  main = _load(path)
  train_name = _pick(main, "train")
  if train_name is None:
    raise ValueError(f"the DatasetDict at {path} has no 'train' split (splits: "
                     f"{', '.join(main.keys())})")
  # Where this split's rows are, and whether they are a hash split of train's.
  source_path, name, hashed = path, train_name, False
  if split != "train":
    if eval_path:
      held = _pick(_load(eval_path), split)
      if held is None:
        raise ValueError(f"the DatasetDict at data.eval_path={eval_path} has no {split!r} "
                         f"split (one of {', '.join(SPLIT_NAMES[split])})")
      source_path, name = eval_path, held
    elif train_name and _pick(main, split):
      name = _pick(main, split)
    else:
      hashed = True
  else:
    hashed = not eval_path and not (train_name and _pick(main, "validation"))
  ds = _open_split(source_path, name)
  where = f"{source_path}" + (f"[{name}]" if name else "")
  image_column = cfg_get(config, "image_column", "image")
  label_column = cfg_get(config, "label_column", "label")
  _image_view(ds, image_column, where)           # the image column is usable
  values, classes = _labels(ds, label_column, label_column != "label", where)
  n = len(ds)
  if not n:
    raise ValueError(f"the dataset at {where} has no rows")
  keys = [f"{posixpath.basename(str(path).rstrip('/'))}:{i}" for i in range(n)]
  labels = np.full(n, -1, np.int64) if values is None else values
  chosen = encoded.select(config, split, kind="hf_disk", pattern=where, hashed=hashed,
                          owner=None, num_files=1, file_ids=np.zeros(n, np.int32), keys=keys,
                          labels=labels, what="row")
  if chosen.num_classes and classes and not int(cfg_get(config, "num_classes", 0) or 0):
    chosen.num_classes = max(chosen.num_classes, classes)    # the ClassLabel's count
  return encoded.make(HfDiskSource, config, seed, chosen, keys, source_path, name,
                      image_column, chosen.rows)
