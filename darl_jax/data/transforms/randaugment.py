"""RandAugment in numpy on the host, and a source wrapper that applies it.

The paper's fine-tuning and supervised recipes use "RandAug (9, 0.5)"
(appendix tables). We read that as timm's ``rand-m9-mstd0.5`` (the MAE/DeiT
fine-tuning recipe the paper follows): magnitude 9 on a 0..10 scale with
Gaussian noise of std 0.5 per application, ``num_ops = 2`` operations per
image, each applied with probability 0.5, and the "increasing" operation
variants (a larger magnitude is always a stronger distortion).

Operations (a subset of timm's ``rand_increasing`` list; ``level`` is the
magnitude / 10 and ``+-`` a random sign):

=============  ==========================================================
auto_contrast  stretch each channel to [0, 255]
equalize       per-channel histogram equalisation (CDF remap)
rotate         +-30 deg * level about the centre
solarize       invert pixels >= 256 * (1 - level)
posterize      keep 8 - floor(4 * level) bits
color          saturation factor 1 +- 0.9 level (identity on gray images)
contrast       contrast factor 1 +- 0.9 level (around the mean gray value)
brightness     brightness factor 1 +- 0.9 level
sharpness      blend with a 3x3 smoothed image, factor 1 +- 0.9 level
shear_x/y      shear +-0.3 level about the centre
translate_x/y  shift by +-0.45 level of the side
=============  ==========================================================

Left out: Invert and SolarizeAdd (rarely chosen and close to solarize), and
the PIL-specific rounding of the originals. Geometric operations resample
bilinearly and fill uncovered pixels with grey (128), like timm's default
fill. Shears are about the centre (PIL's are about the top-left corner; the
centre keeps the object in view on small images).

Randomness is counter based (``augment.hash_uniform``): every draw is a hash
of ``(seed, stream position, draw index)``, so a batch is a pure function of
the step and a resumed run augments exactly like an uninterrupted one.
Everything is vectorised per operation over the images that drew it.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from darl_jax.data.transforms import augment as aug
from darl_jax.data.base import DataSource, local_batch_size

OPS = ("auto_contrast", "equalize", "rotate", "solarize", "posterize", "color",
       "contrast", "brightness", "sharpness", "shear_x", "shear_y",
       "translate_x", "translate_y")
FILL = 128.0
MAX_MAGNITUDE = 10.0
_DRAWS_PER_OP = 5        # choice, apply, 2 for the Gaussian, sign
_SEED_SALT = 0x52414E44  # "RAND": decorrelates from the crop draws of the same seed
_LUMA = np.asarray([0.299, 0.587, 0.114], np.float32)


# ------------------------------------------------------------------ pixel ops
# Each op maps float32 images x [m, H, W, C] in [0, 255], level [m] in [0, 1]
# and sign [m] in {-1, +1} to images of the same shape (clipped afterwards).


def _gray(x):
  """[m, H, W, 1] luma of RGB (or the image itself when C == 1)."""
  return x if x.shape[-1] == 1 else (x @ _LUMA)[..., None]


def _factor(level, sign):
  return (1.0 + sign * 0.9 * level)[:, None, None, None].astype(np.float32)


def auto_contrast(x, level, sign):
  del level, sign
  lo = x.min(axis=(1, 2), keepdims=True)
  hi = x.max(axis=(1, 2), keepdims=True)
  span = hi - lo
  scale = np.where(span > 0, 255.0 / np.maximum(span, 1e-6), 1.0)
  return np.where(span > 0, (x - lo) * scale, x)


def equalize(x, level, sign):
  """Histogram equalisation per image and channel on the rounded uint8 values."""
  del level, sign
  m, h, w, c = x.shape
  q = np.clip(np.rint(x), 0, 255).astype(np.int64)
  vals = q.transpose(0, 3, 1, 2).reshape(m * c, h * w)
  offsets = (np.arange(m * c, dtype=np.int64) * 256)[:, None]
  hist = np.bincount((vals + offsets).ravel(), minlength=m * c * 256).reshape(m * c, 256)
  cdf = np.cumsum(hist, axis=1).astype(np.float64)
  cdf_min = np.where(hist > 0, cdf, np.inf).min(axis=1, keepdims=True)
  denom = (h * w) - cdf_min
  lut = np.where(denom > 0, np.rint((cdf - cdf_min) / np.maximum(denom, 1) * 255.0),
                 np.arange(256)[None, :])
  out = np.take_along_axis(lut, vals, axis=1).astype(np.float32)
  return out.reshape(m, c, h, w).transpose(0, 2, 3, 1)


def solarize(x, level, sign):
  del sign
  threshold = (256.0 - 256.0 * level)[:, None, None, None]
  return np.where(x >= threshold, 255.0 - x, x)


def posterize(x, level, sign):
  del sign
  shift = np.floor(4 * level).astype(np.int64)        # bits dropped: 0..4
  step = (2.0 ** shift)[:, None, None, None]
  return np.floor(np.clip(x, 0, 255) / step) * step


def color(x, level, sign):
  if x.shape[-1] == 1:
    return x
  gray = _gray(x)
  return gray + _factor(level, sign) * (x - gray)


def contrast(x, level, sign):
  mean = _gray(x).mean(axis=(1, 2, 3), keepdims=True)
  return mean + _factor(level, sign) * (x - mean)


def brightness(x, level, sign):
  return x * _factor(level, sign)


def sharpness(x, level, sign):
  """Blend with PIL's SMOOTH kernel ([[1,1,1],[1,5,1],[1,1,1]] / 13); border kept."""
  h, w = x.shape[1:3]
  if h < 3 or w < 3:
    return x
  blurred = x.copy()
  acc = 4.0 * x[:, 1:-1, 1:-1]
  for dy in (-1, 0, 1):
    for dx in (-1, 0, 1):
      acc = acc + x[:, 1 + dy:h - 1 + dy, 1 + dx:w - 1 + dx]
  blurred[:, 1:-1, 1:-1] = acc / 13.0
  return blurred + _factor(level, sign) * (x - blurred)


def _affine(x, linear, shift):
  """Resamples ``x`` at ``p_in = linear @ p_out + shift`` (centred (y, x) coordinates).

  linear: [m, 2, 2], shift: [m, 2] in pixels. Bilinear; outside taps read FILL.
  """
  m, h, w, c = x.shape
  cy, cx = (h - 1) / 2.0, (w - 1) / 2.0
  ys, xs = np.meshgrid(np.arange(h, dtype=np.float32) - cy,
                       np.arange(w, dtype=np.float32) - cx, indexing="ij")
  sy = (linear[:, 0, 0, None, None] * ys + linear[:, 0, 1, None, None] * xs
        + shift[:, 0, None, None] + cy)
  sx = (linear[:, 1, 0, None, None] * ys + linear[:, 1, 1, None, None] * xs
        + shift[:, 1, None, None] + cx)
  y0, x0 = np.floor(sy), np.floor(sx)
  wy, wx = (sy - y0)[..., None], (sx - x0)[..., None]
  idx = np.arange(m)[:, None, None]

  def tap(yy, xx):
    valid = (yy >= 0) & (yy < h) & (xx >= 0) & (xx < w)
    v = x[idx, np.clip(yy, 0, h - 1).astype(np.int64), np.clip(xx, 0, w - 1).astype(np.int64)]
    return np.where(valid[..., None], v, FILL)

  return ((1 - wy) * (1 - wx) * tap(y0, x0) + (1 - wy) * wx * tap(y0, x0 + 1)
          + wy * (1 - wx) * tap(y0 + 1, x0) + wy * wx * tap(y0 + 1, x0 + 1))


def rotate(x, level, sign):
  theta = np.deg2rad(30.0 * level * sign)
  cos, sin = np.cos(theta), np.sin(theta)
  linear = np.stack([np.stack([cos, -sin], -1), np.stack([sin, cos], -1)], 1)
  return _affine(x, linear.astype(np.float32), np.zeros((len(x), 2), np.float32))


def _shear(x, level, sign, axis):
  s = 0.3 * level * sign
  linear = np.tile(np.eye(2, dtype=np.float32), (len(x), 1, 1))
  if axis == 1:
    linear[:, 1, 0] = s        # x_in = x + s * y
  else:
    linear[:, 0, 1] = s        # y_in = y + s * x
  return _affine(x, linear, np.zeros((len(x), 2), np.float32))


def _translate(x, level, sign, axis):
  shift = np.zeros((len(x), 2), np.float32)
  shift[:, axis] = -0.45 * level * sign * x.shape[1 + axis]
  return _affine(x, np.tile(np.eye(2, dtype=np.float32), (len(x), 1, 1)), shift)


OP_FNS = {
    "auto_contrast": auto_contrast, "equalize": equalize, "rotate": rotate,
    "solarize": solarize, "posterize": posterize, "color": color,
    "contrast": contrast, "brightness": brightness, "sharpness": sharpness,
    "shear_x": lambda x, l, s: _shear(x, l, s, 1),
    "shear_y": lambda x, l, s: _shear(x, l, s, 0),
    "translate_x": lambda x, l, s: _translate(x, l, s, 1),
    "translate_y": lambda x, l, s: _translate(x, l, s, 0),
}


# -------------------------------------------------------------------- policy


def rand_augment(images: np.ndarray, seed: int, positions: np.ndarray, *,
                 num_ops: int = 2, magnitude: float = 9.0, magnitude_std: float = 0.5,
                 prob: float = 0.5, ops: tuple[str, ...] = OPS) -> np.ndarray:
  """RandAugment of a batch.

  Args:
    images: uint8 ``[n, H, W, C]`` (C = 1 or 3).
    seed: the source seed.
    positions: int ``[n]``, the examples' training-stream positions.
    num_ops: operations drawn per image (uniformly, with replacement).
    magnitude: mean magnitude on the 0..10 scale.
    magnitude_std: std of the Gaussian noise on the magnitude (0: fixed).
    prob: probability that a drawn operation is applied.
    ops: the operation names to draw from (subset of ``OPS``).

  Returns:
    uint8 ``[n, H, W, C]`` (rounded); a pure function of
    ``(images, seed, positions)``.
  """
  unknown = set(ops) - set(OP_FNS)
  if unknown:
    raise ValueError(f"unknown RandAugment ops {sorted(unknown)}; valid: {', '.join(OPS)}")
  x = np.asarray(images, np.float32)
  u = aug.hash_uniform((int(seed) * 1_000_003 + _SEED_SALT) & 0x7FFFFFFFFFFFFFFF,
                       positions, _DRAWS_PER_OP * num_ops)
  for slot in range(num_ops):
    d = u[:, slot * _DRAWS_PER_OP:(slot + 1) * _DRAWS_PER_OP]
    choice = np.minimum((d[:, 0] * len(ops)).astype(np.int64), len(ops) - 1)
    active = d[:, 1] < prob
    # Box-Muller: a standard normal from two uniforms (1 - u avoids log(0)).
    normal = np.sqrt(-2.0 * np.log(1.0 - d[:, 2])) * np.cos(2 * np.pi * d[:, 3])
    level = np.clip(magnitude + magnitude_std * normal, 0.0, MAX_MAGNITUDE) / MAX_MAGNITUDE
    sign = np.where(d[:, 4] < 0.5, -1.0, 1.0)
    for k, name in enumerate(ops):
      sel = active & (choice == k)
      if sel.any():
        x[sel] = np.clip(OP_FNS[name](x[sel], level[sel], sign[sel]), 0.0, 255.0)
  return aug.to_uint8(x)


class RandAugmentSource(DataSource):
  """Wraps a source: its training batches get RandAugment, evaluation is untouched.

  The stream position of row ``r`` of the local batch of global step ``s`` on
  process ``p`` is ``s * B + p * b + r`` (``B`` global, ``b`` local batch size),
  the same counter the in-memory sources use, so augmentation is a function of
  the step alone.
  """

  def __init__(self, source: DataSource, *, seed: int, num_ops: int = 2,
               magnitude: float = 9.0, magnitude_std: float = 0.5, prob: float = 0.5):
    self.source = source
    self.seed = int(seed)
    self.kwargs = dict(num_ops=num_ops, magnitude=magnitude,
                       magnitude_std=magnitude_std, prob=prob)
    self.image_shape = source.image_shape
    self.num_classes = source.num_classes
    self.num_examples = source.num_examples

  @property
  def random_access(self) -> bool:
    return self.source.random_access

  # The data streams are the wrapped source's (base.DataSource): a run resumed
  # on another number of processes reads the same global batches, and the
  # augmentation of a row is a function of its global position (``_augment``).
  def default_streams(self, process_count: int) -> int:
    return self.source.default_streams(process_count)

  def use_streams(self, streams: int, batch_size: int, process_index: int,
                  process_count: int) -> None:
    self.source.use_streams(streams, batch_size, process_index, process_count)

  def _augment(self, batch: dict, step: int, batch_size: int, process_index: int,
               process_count: int) -> dict:
    local = local_batch_size(batch_size, process_count)
    positions = step * batch_size + process_index * local + np.arange(local)
    return {**batch, "image": rand_augment(batch["image"], self.seed, positions,
                                           **self.kwargs)}

  def train_batch(self, step: int, batch_size: int, process_index: int = 0,
                  process_count: int = 1) -> dict:
    batch = self.source.train_batch(step, batch_size, process_index, process_count)
    return self._augment(batch, step, batch_size, process_index, process_count)

  def train_batches(self, batch_size: int, start_step: int = 0, process_index: int = 0,
                    process_count: int = 1) -> Iterator[dict]:
    if self.random_access:
      return super().train_batches(batch_size, start_step, process_index, process_count)
    return self._augmented(batch_size, start_step, process_index, process_count)

  def _augmented(self, batch_size, start_step, process_index, process_count):
    inner = self.source.train_batches(batch_size, start_step=start_step,
                                      process_index=process_index,
                                      process_count=process_count)
    for step, batch in enumerate(inner, start=start_step):
      yield self._augment(batch, step, batch_size, process_index, process_count)

  def eval_batches(self, batch_size: int, process_index: int = 0,
                   process_count: int = 1, num_workers: int = 0) -> Iterator[dict]:
    return self.source.eval_batches(batch_size, process_index, process_count, num_workers)
