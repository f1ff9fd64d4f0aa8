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
decoded on demand, in the pipeline's worker processes (data/pipeline.py);
batching follows `indexed.IndexedSource`. A file that cannot be decoded
(truncated, not an image) is named in the log and replaced by the next
readable example, image and label (`indexed.DecodedSource`), so it never
stops a run. Pixels of 16-bit, 32-bit, float, palette, transparent, CMYK
and 1-bit images are brought to 8 bits by ``eight_bit``, which every
source that decodes images with PIL shares.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any, Optional

import numpy as np

from darl_jax.data.transforms import augment as aug
from darl_jax.data.base import DataSource, cfg_get, warn_once
from darl_jax.data.sources.indexed import DecodedSource

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


def name_bytes(name: str) -> bytes:
  """The bytes of a file or member name: a UTF-8 name's UTF-8 bytes, and a
  name that is not valid UTF-8 (read with surrogate escapes from the file
  system or a tar header) its original bytes, as ``os.fsencode`` gives them
  on a UTF-8 system but whatever the locale, so that hashes of UTF-8 names
  stay what ``str.encode()`` gave."""
  try:
    return name.encode("utf-8", "surrogateescape")
  except UnicodeEncodeError:     # a lone surrogate that escapes no byte
    return name.encode("utf-8", "surrogatepass")


def name_hash(name: str) -> str:
  """SHA-1 (hex) of ``name``'s bytes (``name_bytes``): the order of hash splits."""
  return hashlib.sha1(name_bytes(name)).hexdigest()


def _hash_key(relpath: str) -> str:
  return name_hash(relpath.replace(os.sep, "/"))


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


class ImageFolderSource(DecodedSource):
  """Images decoded from files on demand (see the module docstring)."""

  what = "image"

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

  def _decode(self, index: int, u: Optional[np.ndarray]) -> np.ndarray:
    return decode_crop(self.paths[index], u, self.image_shape, crop_scale=self.crop_scale)

  def example_name(self, index: int) -> str:
    return self.paths[index]


def decode_crop(file, u: Optional[np.ndarray], image_shape, crop_fraction: float = 1.0,
                crop_scale=aug.CROP_SCALE):
  """Decodes an image file (a path or a file object) and crops it: the
  random-resized crop (area ``crop_scale``) and flip of the uniforms ``u``, or (``u`` None) the
  central square of side ``crop_fraction * min(h, w)``; resized to
  ``image_shape`` (bilinear, antialiased), uint8 ``[S, S, C]``. Pixels of
  every mode are brought to 8 bits by ``eight_bit``."""
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
    img = eight_bit(img, channels)
    img = img.resize((size, size), Image.BILINEAR, box=box)
    if flip:
      img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(img, np.uint8).reshape(size, size, channels)


# Where transparent pixels are composited: the white a viewer or a web page
# shows them on, and never the colour a writer happened to leave under them.
BACKGROUND = 255
# The largest value of 16-bit samples, mapped to 255.
MAX_16 = 65535


def eight_bit(img, channels: int):
  """A decoded PIL image of any mode as 8-bit "L" (``channels`` 1) or "RGB"
  (3), every mode's full range mapped onto 0-255 rather than clipped into it:

  - 16-bit greys ("I;16", "I;16B", "I;16L", ...): ``v * 255 / 65535``;
  - 32-bit integers ("I"): the same when every value lies in 0-65535 (PNG,
    TIFF and PGM readers give 16-bit greys this mode), otherwise the image's
    own range, min to 0 and max to 255 (no fixed range fits integer data
    beyond 16 bits, and clipping it would leave a flat image);
  - floats ("F"): taken to be in [0, 1], the convention of image libraries
    (scikit-image, torchvision) and of images written from normalised
    arrays, so that one image's brightness keeps its meaning across a
    dataset; values outside are clipped (logged once per process), NaN is 0;
  - transparency (RGBA, LA, PA, a palette or a grey/RGB image with a
    transparent colour): composited over white (``BACKGROUND``);
  - palette, 1-bit, CMYK, YCbCr, LAB, HSV: PIL's conversion.

  Colour to grey is ITU-R 601 luma, as ``augment.convert_channels``."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  mode = img.mode
  if mode.startswith("I;16") or mode in ("I", "F"):
    x = np.asarray(img, np.float64)
    if mode == "F":
      lo, hi = np.nanmin(x, initial=0.0), np.nanmax(x, initial=0.0)
      if lo < 0 or hi > 1:
        warn_once(("float range",), "a float image (mode F) holds values in [%g, %g]: "
                  "float images are read as [0, 1] and clipped there; write them scaled "
                  "to [0, 1] (or as 8/16-bit integers) to keep their range", lo, hi)
      x = np.nan_to_num(np.clip(x, 0.0, 1.0), nan=0.0) * 255.0
    elif mode == "I" and (x.min(initial=0) < 0 or x.max(initial=0) > MAX_16):
      lo, hi = x.min(), x.max()
      x = (x - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(x)
    else:
      x = x * (255.0 / MAX_16)
    img = Image.fromarray(np.round(x).astype(np.uint8))
  elif mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
      mode in ("P", "L", "RGB") and "transparency" in img.info):
    rgba = img.convert("RGBA")
    back = Image.new("RGBA", rgba.size, (BACKGROUND,) * 3 + (255,))
    img = Image.alpha_composite(back, rgba).convert("RGB")
  if img.mode not in ("L", "RGB"):
    img = img.convert("RGB")
  if channels == 1:
    return img.convert("L") if img.mode == "RGB" else img
  return img.convert("RGB") if img.mode == "L" else img


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
