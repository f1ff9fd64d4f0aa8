"""Writes IDX files (the Fashion-MNIST format) for tests that fake the dataset."""

import gzip
import struct


def write_idx(path, array):
  """A gzipped IDX file of uint8 ``array`` (any rank), as the dataset ships."""
  with gzip.open(path, "wb") as f:
    f.write(bytes([0, 0, 0x08, array.ndim]))
    f.write(struct.pack(f">{array.ndim}I", *array.shape))
    f.write(array.astype("uint8").tobytes())
