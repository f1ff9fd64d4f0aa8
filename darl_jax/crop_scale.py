"""The rule of ``data.crop_scale``, the random-resized crop's area range.

Both the config's validation (config_lib) and the data sources that crop
(data/transforms/augment.py and its users) apply it; it lives in a module of its own so
that config_lib, which sits below data/, imports nothing of data/.
"""

from __future__ import annotations


def check_crop_scale(scale) -> tuple[float, float]:
  """``(min, max)`` area fractions with 0 < min <= max <= 1, as floats; a
  clear error naming ``data.crop_scale`` otherwise."""
  try:
    if any(isinstance(v, bool) for v in scale):
      raise TypeError("booleans are not area fractions")
    lo, hi = (float(v) for v in scale)
  except (TypeError, ValueError):
    lo = hi = float("nan")
  if not 0 < lo <= hi <= 1:
    raise ValueError(f"data.crop_scale must be two area fractions (min, max) with "
                     f"0 < min <= max <= 1, got {scale!r}: e.g. "
                     f"--config.data.crop_scale=(0.2,1.0)")
  return lo, hi
