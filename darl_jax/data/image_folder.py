"""A folder of PNG/JPEG images of any sizes, read with PIL (no TensorFlow).

Layout (``config.path``):
- split folders ``train/``, ``validation/`` (or ``val/``), optionally
  ``test/``: each is used for its split;
- otherwise the whole folder is one pool, split deterministically by file
  name: the V files whose SHA-1 of the relative path is smallest form
  "validation", the rest "train" (V = config.val_split_size, default 10% of
  the files, at least 1). Hash order means adding files moves few others.
  There is no "test" split then.

Labels: if every image lies inside a class sub-folder (``<split>/<class>/...``
or ``<class>/...``), labels are the indices of the sorted class names (union
over all split folders, so labels agree between splits); if any image lies
directly in the (split) folder, the data is unlabeled: label 0, num_classes 0.

Preprocessing: eval (and augment="none") takes the central square of side
min(h, w) and resizes it to image_size; augment="spatial" takes the
random-resized crop of `augment.sample_crop_boxes` (area 0.2-1, ratio
3/4-4/3, from the counter-based rng) and flips with probability 1/2. Crops are
sub-pixel boxes resized by PIL (bilinear, antialiased); images are converted
to "L" or "RGB" to match ``channels``. Files are decoded on demand in a
thread pool; batching follows `indexed.IndexedSource`.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from typing import Any, Optional

import numpy as np

from darl_jax.data import augment as aug
from darl_jax.data.base import DataSource, cfg_get
from darl_jax.data.indexed import IndexedSource

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
SPLIT_DIRS = {"train": ("train",), "validation": ("validation", "val"),
              "test": ("test",)}
DEFAULT_VAL_FRACTION = 0.1


def list_images(root: str) -> list[str]:
  """Sorted relative paths of the images under ``root`` (recursive)."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    for name in filenames:
      if name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith("."):
        found.append(os.path.relpath(os.path.join(dirpath, name), root))
  return sorted(found)


def _split_folders(root: str) -> dict[str, str]:
  """{split: folder} of the split sub-folders present under ``root``."""
  out = {}
  for split, names in SPLIT_DIRS.items():
    for name in names:
      if os.path.isdir(os.path.join(root, name)):
        out[split] = os.path.join(root, name)
        break
  return out


def _hash_key(relpath: str) -> str:
  return hashlib.sha1(relpath.replace(os.sep, "/").encode()).hexdigest()


def resolve_files(root: str, split: str,
                  val_split_size: Optional[int]) -> tuple[str, list[str],
                                                          list[list[str]]]:
  """(base folder, relative files of ``split``, files of every split).

  The last item (all splits' file lists) is what class names come from.
  """
  if split not in SPLIT_DIRS:
    raise ValueError(f"unknown split {split!r}; valid: "
                     f"{', '.join(SPLIT_DIRS)}")
  folders = _split_folders(root)
  if "train" in folders:
    if split not in folders:
      names = "/".join(SPLIT_DIRS[split])
      raise ValueError(f"image folder {root} has no {names} sub-folder for "
                       f"split {split!r}")
    listed = {s: list_images(f) for s, f in folders.items()}
    return folders[split], listed[split], list(listed.values())
  files = list_images(root)
  if not files:
    raise ValueError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found "
                     f"under {root}")
  if split == "test":
    raise ValueError(f"image folder {root} has no split folders, so no "
                     f"'test' split (only train/validation by file hash)")
  if val_split_size is None:
    val_split_size = max(1, round(DEFAULT_VAL_FRACTION * len(files)))
  if not 0 <= val_split_size < len(files):
    raise ValueError(f"val_split_size must be in [0, {len(files)}), got "
                     f"{val_split_size}")
  by_hash = sorted(files, key=_hash_key)
  chosen = by_hash[:val_split_size] if split == "validation" else (
      by_hash[val_split_size:])
  return root, sorted(chosen), [files]


def class_names(file_lists: list[list[str]]) -> list[str]:
  """Sorted class folder names, or [] if any image is not in a class folder."""
  names = set()
  for files in file_lists:
    for rel in files:
      parts = rel.split(os.sep)
      if len(parts) < 2:
        return []
      names.add(parts[0])
  return sorted(names)


class ImageFolderSource(IndexedSource):
  """Images decoded from files on demand (see the module docstring)."""

  def __init__(self, base: str, files: list[str], classes: list[str], *,
               image_size: int, channels: int, augment: str, seed: int,
               num_workers: int = 8):
    index = {name: i for i, name in enumerate(classes)}
    labels = [index[f.split(os.sep)[0]] if classes else 0 for f in files]
    super().__init__(labels=np.asarray(labels, np.int32),
                     num_classes=len(classes), image_size=image_size,
                     channels=channels, augment=augment, seed=seed)
    self.paths = [os.path.join(base, f) for f in files]
    self.class_names = list(classes)
    self._num_workers = num_workers
    self._pool = None  # created on first use

  def _load_one(self, path: str, u: Optional[np.ndarray]) -> np.ndarray:
    from PIL import Image  # pylint: disable=g-import-not-at-top
    size, _, channels = self.image_shape
    with Image.open(path) as img:
      img = img.convert("RGB")  # normalises palette/alpha/16-bit modes
      if channels == 1:
        img = img.convert("L")  # ITU-R 601 luma, as augment.convert_channels
      w, h = img.size
      if u is None:
        side = min(w, h)
        box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
        flip = False
      else:
        top, left, bh, bw = aug.sample_crop_boxes(u[None], h, w)
        box = (left[0], top[0], left[0] + bw[0], top[0] + bh[0])
        flip = u[-1] < aug.FLIP_PROB
      img = img.resize((size, size), Image.BILINEAR, box=box)
      if flip:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
      return np.asarray(img, np.uint8).reshape(size, size, channels)

  def _load(self, indices, positions):
    us = [None] * len(indices)
    if positions is not None:
      us = list(aug.hash_uniform(self.seed, positions,
                                 4 * aug.CROP_ATTEMPTS + 1))
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(self._num_workers)
    images = list(self._pool.map(self._load_one,
                                 [self.paths[i] for i in indices], us))
    return aug.to_unit_range(np.stack(images).astype(np.float32))


def build(config: Any, *, split: str, seed: int) -> DataSource:
  root = cfg_get(config, "path", None)
  if not root:
    raise ValueError("the image_folder source needs data.path (a folder of "
                     "PNG/JPEG images)")
  if not os.path.isdir(root):
    raise FileNotFoundError(f"image folder {root} does not exist")
  val = cfg_get(config, "val_split_size", None)
  base, files, all_lists = resolve_files(root, split,
                                         None if val is None else int(val))
  if not files:
    raise ValueError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) for split "
                     f"{split!r} under {base}")
  return ImageFolderSource(base, files, class_names(all_lists),
                           image_size=int(cfg_get(config, "image_size", 64)),
                           channels=int(cfg_get(config, "channels", 3)),
                           augment=cfg_get(config, "augment", "none"),
                           seed=seed)
