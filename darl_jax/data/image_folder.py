"""A folder of images of any sizes (JPEG, PNG, GIF, TIFF, WebP, BMP), read with PIL.

Layout (``config.path``):
- split folders ``train/``, ``validation/`` (or ``val/``), optionally
  ``test/``: each is used for its split;
- otherwise the whole folder is one pool, split deterministically by file
  name: the V files whose SHA-1 of the relative path is smallest form
  "validation", the rest "train" (V = config.val_split_size, default 10% of
  the files, at least 1; a V over half the files, such as the ImageNet
  configs' 5000 on a small folder, falls back to 10% with a warning). Hash
  order means adding files moves few others. There is no "test" split then.
Other files are ignored, with one warning naming a few.

Labels: if every image lies inside a class sub-folder (``<split>/<class>/...``
or ``<class>/...``), labels are the indices of the sorted class names (union
over all split folders, so labels agree between splits); if any image lies
directly in the (split) folder, the data is unlabeled: label 0, num_classes 0.

Preprocessing: eval (and augment="none") takes the central square of side
min(h, w) and resizes it to image_size; augment="spatial" takes the
random-resized crop of `augment.sample_crop_boxes` (area ``data.crop_scale``,
0.2-1 by default, ratio 3/4-4/3, from the counter-based rng) and flips with
probability 1/2. Crops are sub-pixel boxes resized by PIL (bilinear,
antialiased); images are converted to "L" or "RGB" to match ``channels``; a JPEG is decoded only at the
smallest DCT scale that still gives the crop full resolution
(``reduced_decode``); multi-frame files give their first frame. Files are
decoded on demand, in the pipeline's worker processes (pipeline.py);
batching follows `indexed.IndexedSource`. A file that cannot be decoded
(truncated, not an image) is logged once and replaced by the next readable
example, so it never stops a run.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any, Optional

import numpy as np
from absl import logging

from darl_jax.data import augment as aug
from darl_jax.data.base import DataSource, cfg_get, warn_once
from darl_jax.data.indexed import IndexedSource

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".gif", ".tif", ".tiff", ".webp", ".bmp")
SPLIT_DIRS = {"train": ("train",), "validation": ("validation", "val"),
              "test": ("test",)}
DEFAULT_VAL_FRACTION = 0.1


def list_images(root: str) -> list[str]:
  """Sorted relative paths of the images under ``root`` (recursive). Other
  files are logged once per folder (count and a few names)."""
  found, ignored = [], []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    for name in filenames:
      if name.startswith("."):
        continue
      rel = os.path.relpath(os.path.join(dirpath, name), root)
      (found if name.lower().endswith(IMAGE_EXTENSIONS) else ignored).append(rel)
  if ignored:
    warn_once(("ignored", root), "%s: ignoring %d file(s) that are not images (%s), e.g. %s",
              root, len(ignored), "/".join(IMAGE_EXTENSIONS), ", ".join(sorted(ignored)[:3]))
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
  default = max(1, round(DEFAULT_VAL_FRACTION * len(files)))
  if val_split_size is None:
    val_split_size = default
  if val_split_size < 0:
    raise ValueError(f"data.val_split_size must be >= 0, got {val_split_size}")
  if val_split_size > len(files) // 2:
    # A count meant for another dataset (the ImageNet configs' 5000 for
    # TFDS) would leave little or nothing to train on here.
    # Both splits (train, validation) meet this: one warning for the folder.
    warn_once(("val_split_size", root, val_split_size, len(files)),
              "data.val_split_size=%d is more than half of the %d images under %s; "
              "holding out %d (%.0f%%) for validation instead", val_split_size,
              len(files), root, default, 100 * DEFAULT_VAL_FRACTION)
    val_split_size = default
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

  decodes_files = True

  def __init__(self, base: str, files: list[str], classes: list[str], *,
               image_size: int, channels: int, augment: str, seed: int,
               crop_scale=aug.CROP_SCALE):
    index = {name: i for i, name in enumerate(classes)}
    labels = [index[f.split(os.sep)[0]] if classes else 0 for f in files]
    super().__init__(labels=np.asarray(labels, np.int32),
                     num_classes=len(classes), image_size=image_size,
                     channels=channels, augment=augment, seed=seed,
                     crop_scale=crop_scale)
    self.paths = [os.path.join(base, f) for f in files]
    self.class_names = list(classes)
    self._unreadable: dict[str, str] = {}   # this process's: path -> error

  def _load_one(self, path: str, u: Optional[np.ndarray]) -> np.ndarray:
    return decode_crop(path, u, self.image_shape, crop_scale=self.crop_scale)

  def _load_or_substitute(self, index: int, u: Optional[np.ndarray]) -> np.ndarray:
    """Example ``index``'s image; an unreadable file is logged once (per
    process) and replaced by the next readable example of the split, so a
    damaged file costs one duplicate image, never the run."""
    for offset in range(self.num_examples):
      path = self.paths[(index + offset) % self.num_examples]
      if path in self._unreadable:
        continue
      try:
        return self._load_one(path, u)
      except Exception as e:  # pylint: disable=broad-except  # PIL raises many kinds
        self._unreadable[path] = f"{type(e).__name__}: {e}"
        logging.warning("unreadable image %s (%s): using the next readable example "
                        "instead; %d unreadable file(s) met so far in this process",
                        path, self._unreadable[path], len(self._unreadable))
    raise ValueError(f"no image under {os.path.dirname(self.paths[0])} can be read; "
                     f"e.g. {next(iter(self._unreadable.items()))}")

  def _load(self, indices, positions):
    us = aug.crop_uniforms(self.seed, positions, len(indices))
    return np.stack([self._load_or_substitute(int(i), u) for i, u in zip(indices, us)])


def decode_crop(file, u: Optional[np.ndarray], image_shape, crop_fraction: float = 1.0,
                crop_scale=aug.CROP_SCALE):
  """Decodes an image file (a path or a file object) and crops it: the
  random-resized crop (area ``crop_scale``) and flip of the uniforms ``u``, or (``u`` None) the
  central square of side ``crop_fraction * min(h, w)``; resized to
  ``image_shape`` (bilinear, antialiased), uint8 ``[S, S, C]``."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  size, _, channels = image_shape
  with Image.open(file) as img:
    w, h = img.size
    if u is None:
      side = crop_fraction * min(w, h)
      box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
      flip = False
    else:
      top, left, bh, bw = aug.sample_crop_boxes(u[None], h, w, scale=crop_scale)
      box = (left[0], top[0], left[0] + bw[0], top[0] + bh[0])
      flip = u[-1] < aug.FLIP_PROB
    img = reduced_decode(img, box, size)
    sx, sy = img.size[0] / w, img.size[1] / h
    box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    img = img.convert("RGB")  # normalises palette/alpha/16-bit modes
    if channels == 1:
      img = img.convert("L")  # ITU-R 601 luma, as augment.convert_channels
    img = img.resize((size, size), Image.BILINEAR, box=box)
    if flip:
      img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(img, np.uint8).reshape(size, size, channels)


def reduced_decode(img, box, size: int):
  """``img`` (opened, not yet decoded) set to decode at the smallest size
  that still gives the crop ``box`` at least ``size`` pixels a side: JPEG's
  DCT scaling decodes at 1/2, 1/4 or 1/8 of the size for a fraction of the
  work. Other formats are returned as they are."""
  if getattr(img, "format", None) != "JPEG":
    return img
  w, h = img.size
  bw, bh = max(box[2] - box[0], 1e-6), max(box[3] - box[1], 1e-6)
  want = (math.ceil(w * size / bw), math.ceil(h * size / bh))
  if want[0] < w and want[1] < h:
    img.draft(img.mode, want)
  return img


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
                           seed=seed, crop_scale=cfg_get(config, "crop_scale", aug.CROP_SCALE))
