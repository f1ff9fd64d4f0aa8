"""Host-side (numpy) image preprocessing and spatial augmentation.

Everything here is pure numpy, so the in-memory sources run without
TensorFlow (and without PIL).

Randomness is *counter based*: every random number is a hash of
``(seed, position, draw)``, where ``position`` is the example's position in
the infinite training stream. A batch can therefore be regenerated exactly
from its step number alone, with no generator state to checkpoint, and the
draws are fully vectorised (no per-example ``np.random.Generator``).

Spatial augmentation (the paper's pretraining "spatial augmentation", i.e. the
MAE/Inception recipe):

- random-resized crop: area fraction ``s ~ U(data.crop_scale)`` (default
  U(0.2, 1.0)) of the source image,
  aspect ratio ``r`` log-uniform in ``(3/4, 4/3)``, crop position uniform;
  10 attempts per image, the first one that fits is used, otherwise the
  central crop with the ratio clamped to the allowed range (torchvision's
  fallback);
- the crop is resampled to ``out_size x out_size`` with bilinear
  interpolation, antialiased when shrinking (sub-pixel crop boxes, no
  rounding);
- horizontal flip with probability 1/2.
"""

from __future__ import annotations

import numpy as np

# The sources check data.crop_scale through this module; the rule itself lives
# below data/, where config_lib applies it too without importing data/.
from darl_jax.crop_scale import check_crop_scale  # pylint: disable=unused-import

# The training crop's area range, as a fraction of the source image
# (``data.crop_scale``). 0.2-1 is the paper's (and MAE's) pretraining crop;
# fine-tuning on small images may want less of the image thrown away.
CROP_SCALE = (0.2, 1.0)
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)
CROP_ATTEMPTS = 10
FLIP_PROB = 0.5

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(z: np.ndarray) -> np.ndarray:
  """The splitmix64 finaliser on a uint64 array (wrap-around arithmetic)."""
  z = (z ^ (z >> np.uint64(30))) * _M1
  z = (z ^ (z >> np.uint64(27))) * _M2
  return z ^ (z >> np.uint64(31))


def hash_uniform(seed: int, positions: np.ndarray, num: int) -> np.ndarray:
  """Counter-based uniforms in [0, 1).

  Args:
    seed: non-negative int, the source seed.
    positions: int array [n], stream positions (any non-negative ints).
    num: draws per position.

  Returns:
    float64 [n, num]; entry (i, k) depends only on (seed, positions[i], k).
  """
  pos = np.asarray(positions, dtype=np.int64).astype(np.uint64)
  # The seed key is mixed on a 1-element array: numpy warns on overflow of
  # uint64 *scalars* but wraps silently for arrays, which is what we want.
  key = _splitmix64(
      np.asarray([seed & 0xFFFFFFFFFFFFFFFF], np.uint64) + _GOLDEN)
  base = _splitmix64(key ^ (pos * _GOLDEN))
  draws = np.arange(1, num + 1, dtype=np.uint64)
  bits = _splitmix64(base[:, None] + draws[None, :] * _GOLDEN)
  # Top 53 bits -> exactly representable double in [0, 1).
  return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def crop_uniforms(seed: int, positions, num: int) -> list:
  """Per-example uniforms of one crop + flip (rows of ``hash_uniform``), or
  ``num`` Nones for eval preprocessing (``positions`` None): what the
  per-file decoders (image folders, TFDS records) take one example at a time."""
  if positions is None:
    return [None] * num
  return list(hash_uniform(seed, positions, 4 * CROP_ATTEMPTS + 1))


def sample_crop_boxes(u: np.ndarray, height, width,
                      scale=CROP_SCALE, ratio=CROP_RATIO):
  """Random-resized-crop boxes from uniforms.

  Args:
    u: float [n, >= 4 * CROP_ATTEMPTS] uniforms in [0, 1) (`hash_uniform`);
      attempt k uses columns 4k .. 4k+3 (area, ratio, row offset, col offset).
    height, width: source sizes, scalars or int arrays [n].
    scale: (min, max) fraction of the source area.
    ratio: (min, max) crop aspect ratio width / height.

  Returns:
    (top, left, box_h, box_w): float64 arrays [n], a sub-pixel box inside the
    source image (0 <= top, top + box_h <= height, same for width).
  """
  n = u.shape[0]
  h = np.broadcast_to(np.asarray(height, np.float64), (n,))
  w = np.broadcast_to(np.asarray(width, np.float64), (n,))
  u = u[:, :4 * CROP_ATTEMPTS].reshape(n, CROP_ATTEMPTS, 4)
  area = (h * w)[:, None] * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
  log_r = np.log(ratio[0]) + (np.log(ratio[1]) - np.log(ratio[0])) * u[..., 1]
  r = np.exp(log_r)
  bw = np.sqrt(area * r)
  bh = np.sqrt(area / r)
  ok = (bw <= w[:, None]) & (bh <= h[:, None])
  first = np.argmax(ok, axis=1)  # first valid attempt (0 if none is valid)
  any_ok = ok.any(axis=1)
  rows = np.arange(n)
  bh_sel, bw_sel = bh[rows, first], bw[rows, first]
  # Fallback: the largest central box whose ratio is inside the range.
  src_r = w / h
  fb_w = np.where(src_r > ratio[1], h * ratio[1], w)
  fb_h = np.where(src_r < ratio[0], w / ratio[0], h)
  fb_w = np.minimum(fb_w, w)
  fb_h = np.minimum(fb_h, h)
  bh_sel = np.where(any_ok, bh_sel, fb_h)
  bw_sel = np.where(any_ok, bw_sel, fb_w)
  # Position: uniform for sampled boxes, centred for the fallback.
  top = np.where(any_ok, u[rows, first, 2], 0.5) * (h - bh_sel)
  left = np.where(any_ok, u[rows, first, 3], 0.5) * (w - bw_sel)
  return top, left, bh_sel, bw_sel


def _triangle_weights(centers: np.ndarray, scale: np.ndarray, size: int,
                      transposed: bool = False) -> np.ndarray:
  """Dense 1-D resampling matrices of the (antialiased) bilinear filter.

  Args:
    centers: float [n, S], source coordinates of the output samples (pixel
      centres at integer coordinates).
    scale: float [n], source pixels per output pixel.
    size: number of source pixels along the axis.
    transposed: return [n, size, S] (contiguous) instead of [n, S, size].

  Returns:
    float32 [n, S, size] (or [n, size, S]); each output sample's weights sum
    to 1.
  """
  # Triangle (tent) filter, widened by the minification factor: plain
  # bilinear interpolation when upsampling, area-like averaging when
  # downsampling (PIL's BILINEAR / tf.image.resize(antialias=True)). Taps
  # outside the image are dropped and the rest renormalised, which for
  # upsampling equals edge replication.
  inv_support = (1.0 / np.maximum(scale, 1.0)).astype(np.float32)
  centers = centers.astype(np.float32)
  src = np.arange(size, dtype=np.float32)
  if transposed:
    weights = src[None, :, None] - centers[:, None, :]  # [n, size, S]
    sum_axis = 1
  else:
    weights = src[None, None, :] - centers[:, :, None]  # [n, S, size]
    sum_axis = 2
  # float32 and in-place ops: this runs on every batch.
  weights *= inv_support[:, None, None]
  np.abs(weights, out=weights)
  np.subtract(1.0, weights, out=weights)
  np.maximum(weights, 0.0, out=weights)
  weights *= 1.0 / weights.sum(axis=sum_axis, keepdims=True)
  return weights


def resample(images: np.ndarray, top, left, box_h, box_w, out_size: int,
             flip=None) -> np.ndarray:
  """Crops sub-pixel boxes and resizes them to S x S (antialiased bilinear).

  Output pixel (i, j) is centred at source coordinate
  ``(top + (i + .5) * box_h / S - .5, left + (j + .5) * box_w / S - .5)``.
  A full-image box with ``S`` equal to the source size is the identity. The
  resize is separable, so it is two batched matmuls with [n, S, h] and
  [n, S, w] weight matrices: for small images this is several times faster
  than gathering the four bilinear corners with fancy indexing (measured on
  28x28x1, batch 256).

  Args:
    images: uint8 or float [n, h, w, c].
    top, left, box_h, box_w: float arrays [n] (or scalars), the crop boxes.
    out_size: S, the output side.
    flip: optional bool [n]; True mirrors the output horizontally.

  Returns:
    float32 [n, S, S, c] in the input's value range.
  """
  n, h, w, c = images.shape

  def centers_and_scale(start, length):
    start = np.broadcast_to(np.asarray(start, np.float64).reshape(-1), (n,))
    length = np.broadcast_to(np.asarray(length, np.float64).reshape(-1), (n,))
    scale = length / out_size
    grid = np.arange(out_size, dtype=np.float64) + 0.5
    return start[:, None] + grid[None, :] * scale[:, None] - 0.5, scale

  cy, sy = centers_and_scale(top, box_h)
  cx, sx = centers_and_scale(left, box_w)
  if flip is not None:  # mirror the sample positions, not the output
    cx = np.where(np.asarray(flip)[:, None], cx[:, ::-1], cx)
  wy = _triangle_weights(cy, sy, h)  # [n, S, h]
  wx_t = _triangle_weights(cx, sx, w, transposed=True)  # [n, w, S]
  if c > 1:
    # Channel-last without transposes: the column weights become
    # kron(wx_t, I_c) [n, w*c, S*c], applied to rows of length w*c.
    kron = np.zeros((n, w, c, out_size, c), np.float32)
    for ch in range(c):  # strided copies; a broadcast multiply is ~5x slower
      kron[:, :, ch, :, ch] = wx_t
    wx_t = kron.reshape(n, w * c, out_size * c)
  rows = images.reshape(n, h, w * c).astype(np.float32)
  out = wy @ rows @ wx_t  # [n, S, S*c]
  return out.reshape(n, out_size, out_size, c)


def random_resized_crop(images: np.ndarray, seed: int, positions: np.ndarray,
                        out_size: int, scale=CROP_SCALE) -> np.ndarray:
  """Spatial augmentation of a batch (crop + resize + flip), deterministic.

  Args:
    images: uint8 [n, h, w, c].
    seed: source seed.
    positions: int [n], stream positions of the examples (the rng counter).
    out_size: output side S.
    scale: (min, max) fraction of the source area a crop takes
      (``data.crop_scale``).

  Returns:
    float32 [n, S, S, c] in [0, 255].
  """
  n, h, w, _ = images.shape
  u = hash_uniform(seed, positions, 4 * CROP_ATTEMPTS + 1)
  top, left, bh, bw = sample_crop_boxes(u, h, w, scale=scale)
  flip = u[:, -1] < FLIP_PROB
  return resample(images, top, left, bh, bw, out_size, flip=flip)


def resize_full(images: np.ndarray, out_size: int) -> np.ndarray:
  """Whole-image bilinear resize to S x S: float32 [n, S, S, c] in [0, 255],
  or ``images`` themselves when they are S x S already."""
  n, h, w, _ = images.shape
  if (h, w) == (out_size, out_size):
    return images
  return resample(images, 0.0, 0.0, float(h), float(w), out_size)


def convert_channels(images: np.ndarray, channels: int) -> np.ndarray:
  """Gray <-> RGB on float [..., c]: replicate gray, or ITU-R 601 luma."""
  c = images.shape[-1]
  if c == channels:
    return images
  images = images.astype(np.float32)
  if c == 1 and channels == 3:
    return np.repeat(images, 3, axis=-1)
  if c == 3 and channels == 1:
    luma = np.asarray([0.299, 0.587, 0.114], np.float32)
    return (images @ luma)[..., None].astype(np.float32)
  raise ValueError(f"cannot convert {c} channels to {channels}")


def to_uint8(images: np.ndarray) -> np.ndarray:
  """float [0, 255] -> uint8, rounded to nearest (uint8 passes through)."""
  if images.dtype == np.uint8:
    return images
  return np.clip(np.rint(images), 0, 255).astype(np.uint8)


def to_unit_range(images: np.ndarray) -> np.ndarray:
  """float [0, 255] -> float32 [-1, 1] (clipped against rounding drift)."""
  out = images.astype(np.float32) * np.float32(1.0 / 127.5) - np.float32(1.0)
  return np.clip(out, -1.0, 1.0, out=out)
