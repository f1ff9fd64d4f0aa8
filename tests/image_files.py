"""Images the data tests draw and write: encoded bytes and class folders, for
the sources' fixtures (tar, Parquet, ArrayRecord, Hugging Face, mixtures)."""

import io
import os

import numpy as np
from PIL import Image

CLASSES = ("cat", "dog")


def draw(rng, shape=(11, 14)) -> np.ndarray:
  """A uint8 RGB image [h, w, 3] of noise."""
  return rng.integers(0, 255, (*shape, 3), np.uint8)


def encode(rng, fmt: str = "PNG", shape=(11, 14)) -> bytes:
  """A drawn image encoded as ``fmt`` (PNG, JPEG, WEBP...)."""
  buf = io.BytesIO()
  Image.fromarray(draw(rng, shape)).save(buf, fmt)
  return buf.getvalue()


def class_folder(root, splits=(("train", 7), ("val", 3)), *, shape=(11, 14),
                 exts=("png", "jpg"), classes=CLASSES, seed: int = 0) -> str:
  """``root/<split>/<class>/NNN.<ext>``: per split, ``n`` images of each class,
  the extension cycling through ``exts``; returns ``root`` as a string."""
  rng = np.random.default_rng(seed)
  for split, n in splits:
    for c in classes:
      os.makedirs(os.path.join(root, split, c))
      for i in range(n):
        Image.fromarray(draw(rng, shape)).save(
            os.path.join(root, split, c, f"{i:03d}.{exts[i % len(exts)]}"))
  return str(root)
