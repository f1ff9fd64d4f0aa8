"""Fashion-MNIST's IDX files and its splits, shared by both backends.

Files (gzip IDX, as shipped in /usr/share/datasets/fashion-mnist by Debian's
`dataset-fashion-mnist`): train-images-idx3-ubyte.gz,
train-labels-idx1-ubyte.gz (60000 examples) and t10k-images-idx3-ubyte.gz,
t10k-labels-idx1-ubyte.gz (10000 examples); the uncompressed files work too.

Splits (V = config.val_split_size, default 5000):
  train      = training files [0, 60000 - V)
  validation = training files [60000 - V, 60000)   (the last V examples)
  test       = the t10k files

A module of its own so that fashion_mnist.py (the numpy backend, and the
choice of backend) and tfds_fashion_mnist.py (the TFDS builder, which reads
the same files) share it without importing each other.
"""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np

DEFAULT_PATH = "/usr/share/datasets/fashion-mnist"
DEFAULT_VAL_SPLIT_SIZE = 5000
NUM_CLASSES = 10
CLASS_NAMES = ("t-shirt/top", "trouser", "pullover", "dress", "coat",
               "sandal", "shirt", "sneaker", "bag", "ankle boot")
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}

# IDX type codes -> big-endian numpy dtypes.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4",
               0x0D: ">f4", 0x0E: ">f8"}

# (realpath of file) -> decoded array; one decode per process.
_ARRAYS: dict[str, np.ndarray] = {}


def read_idx(path: str) -> np.ndarray:
  """Reads an IDX file (gzip-compressed if the name ends in .gz).

  Returns:
    The array with the header's shape, in native byte order.
  """
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    data = f.read()
  if len(data) < 4 or data[0] != 0 or data[1] != 0:
    raise ValueError(f"{path} is not an IDX file (bad magic number)")
  type_code, ndim = data[2], data[3]
  if type_code not in _IDX_DTYPES:
    raise ValueError(f"{path}: unknown IDX type code {type_code:#x}")
  shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
  dtype = np.dtype(_IDX_DTYPES[type_code])
  array = np.frombuffer(data, dtype, offset=4 + 4 * ndim)
  if array.size != int(np.prod(shape)):
    raise ValueError(f"{path}: header says {shape}, found {array.size} items")
  return array.reshape(shape).astype(dtype.newbyteorder("="))


def missing_message(path: str, data_dir: str) -> str:
  """The error for a missing file or directory, naming the fix."""
  return (f"Fashion-MNIST file {path} not found. Install the Debian package "
          f"with `apt-get install -y dataset-fashion-mnist` (it provides "
          f"{DEFAULT_PATH}) or set data.path to a directory holding the four "
          f"IDX files (now: {data_dir}).")


def _idx_file(data_dir: str, name: str) -> str:
  """Path of ``name`` in ``data_dir``; the uncompressed variant also works."""
  path = os.path.join(data_dir, name)
  for candidate in (path, path[:-len(".gz")]):
    if os.path.isfile(candidate):
      return candidate
  raise FileNotFoundError(missing_message(path, data_dir))


def _cached_idx(path: str) -> np.ndarray:
  key = os.path.realpath(path)
  if key not in _ARRAYS:
    _ARRAYS[key] = read_idx(path)
  return _ARRAYS[key]


def num_examples(data_dir: str, part: str) -> int:
  """How many examples the "train" or "test" files hold (their labels')."""
  return len(_cached_idx(_idx_file(data_dir, FILES[part][1])))


def load_part(data_dir: str, part: str) -> tuple[np.ndarray, np.ndarray]:
  """Images uint8 [N, 28, 28, 1] and labels int32 [N] of "train" or "test"."""
  image_file, label_file = (_idx_file(data_dir, n) for n in FILES[part])
  images = _cached_idx(image_file)
  labels = _cached_idx(label_file)
  if images.ndim != 3 or len(images) != len(labels):
    raise ValueError(f"inconsistent IDX files in {data_dir}: images "
                     f"{images.shape}, labels {labels.shape}")
  return (images[..., None].astype(np.uint8, copy=False),
          labels.astype(np.int32))


def split_range(split: str, num_train: int,
                val_split_size: int) -> tuple[str, slice]:
  """(file part, example slice) of a split; see the module docstring."""
  if not 0 <= val_split_size < num_train:
    raise ValueError(f"val_split_size must be in [0, {num_train}), got "
                     f"{val_split_size}")
  cut = num_train - val_split_size
  if split == "train":
    return "train", slice(0, cut)
  if split == "validation":
    if val_split_size == 0:
      raise ValueError("split 'validation' is empty: val_split_size is 0")
    return "train", slice(cut, num_train)
  if split == "test":
    return "test", slice(None)
  raise ValueError(f"unknown split {split!r}; valid: train, validation, test")
