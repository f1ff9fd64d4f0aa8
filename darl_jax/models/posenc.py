"""Positional encodings: the five rows of the paper's Table "positional encodings".

Two families:

* additive encodings (``sincos2d``, ``learned``) are added to the patch
  embeddings before the first block;
* rotary encodings (``rope1d``, ``rope2d``) rotate queries and keys inside every
  attention layer, so attention logits depend only on relative offsets.

``none`` (NoPE) uses neither.

Positions are given per token as float32 ``rows`` / ``cols`` (grid units) and a
1D ``index``. Running at another resolution than the one the model was trained
at is handled by *interpolating positions*: a grid of ``g`` patches is mapped
onto the reference grid of ``g_ref`` patches by scaling rows and columns with
``g_ref / g`` and the 1D index with ``N_ref / N`` (token counts) (paper section "Relative Positional Embedding": "we interpolate the
positions when using RoPE"). Additive encodings are resampled the same way:
sin-cos is evaluated at the scaled positions, the learned table is resized
bilinearly.

Start-of-sequence (SOS) token position. The SOS token is a learned vector with
no content. For rotary encodings it still needs a position; we put it at
``(row 0, col -1)`` in 2D and at index 0 in 1D (patch tokens then sit at 1..).
(0, -1) is a cell outside the grid, so no patch shares it, and in raster order it
is exactly one step to the left of the first patch, the same offset every other
"previous token" has to its successor along a row. At another resolution the
1D index is scaled by the ratio of token counts and the SOS column by the
column ratio (``sos_position``), so the SOS keeps that one-step offset.
For additive encodings the SOS token gets no position vector: it is already a
free parameter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

# The rotation itself is the kernels' (its channel layout is theirs too);
# models call it as posenc.apply_rope.
from darl_jax.kernels.rope import apply_rope  # noqa: F401

POSENCS = ("none", "sincos2d", "learned", "rope1d", "rope2d")
ROTARY = ("rope1d", "rope2d")
ADDITIVE = ("sincos2d", "learned")

SOS_ROW, SOS_COL = 0.0, -1.0


def check_posenc(name: str) -> str:
  if name not in POSENCS:
    raise ValueError(
        f"unknown positional encoding {name!r}; valid names: {', '.join(POSENCS)}")
  return name


def interpolation_scale(grid_hw, reference_grid_hw) -> tuple[float, float]:
  """Factor mapping positions of ``grid_hw`` onto ``reference_grid_hw``."""
  return (reference_grid_hw[0] / grid_hw[0], reference_grid_hw[1] / grid_hw[1])


def index_scale(grid_hw, reference_grid_hw) -> float:
  """Factor mapping the 1D token index of ``grid_hw`` onto the reference
  grid's: the index runs over ``gh * gw`` patches, so it is scaled by the
  ratio of the token counts (the last patch lands on the reference grid's
  last index, as the paper interpolates RoPE positions)."""
  return (reference_grid_hw[0] * reference_grid_hw[1]) / (grid_hw[0] * grid_hw[1])


def sos_position(grid_hw, reference_grid_hw) -> tuple[float, float, float]:
  """The SOS slot's (row, col, index) on ``grid_hw``, interpolated as the
  patches' are: (0, -1) and index 0 at the reference grid; elsewhere the
  column offset is scaled with the columns, so the SOS stays exactly one
  (scaled) step left of the first patch."""
  sy, sx = interpolation_scale(grid_hw, reference_grid_hw)
  return SOS_ROW * sy, SOS_COL * sx, 0.0


# --------------------------------------------------------------------------- RoPE


def rope_inv_timescales(num_freqs: int, max_wavelength: float) -> np.ndarray:
  """Inverse timescales ``max_wavelength ** (-i / num_freqs)``, i in [0, num_freqs).

  The timescales spread geometrically over [1, max_wavelength) as in the
  paper's appendix ("theta_i = max_wavelength^(2i/d)"); the angle of a channel
  pair at position m is ``m / timescale``.
  """
  i = np.arange(num_freqs, dtype=np.float64)
  return (max_wavelength ** (-i / num_freqs)).astype(np.float32)


def rope_angles(posenc: str, head_dim: int, max_wavelength: float,
                index=None, rows=None, cols=None) -> jax.Array:
  """Rotation angles ``[..., T, head_dim // 2]`` in float32.

  Channel layout ("rotate half"): channel ``j`` pairs with channel
  ``j + head_dim/2``; pair ``j`` turns by ``angles[..., j]``. This is the
  paper's pairing of adjacent channels up to a fixed permutation of the q/k
  projection outputs, and it needs no strided gathers, so it fuses well.

  * ``rope1d``: all ``head_dim/2`` pairs turn with the token index.
  * ``rope2d`` (decomposed): the first ``head_dim/4`` pairs turn with the row,
    the next ``head_dim/4`` with the column, each half with its own geometric
    spread of frequencies over [1, max_wavelength).
  """
  if head_dim % 2:
    raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
  half = head_dim // 2
  if posenc == "rope1d":
    inv = jnp.asarray(rope_inv_timescales(half, max_wavelength))
    return jnp.asarray(index, jnp.float32)[..., None] * inv
  if posenc == "rope2d":
    if head_dim % 4:
      raise ValueError(f"2D RoPE needs a head dimension divisible by 4, got {head_dim}")
    inv = jnp.asarray(rope_inv_timescales(half // 2, max_wavelength))
    r = jnp.asarray(rows, jnp.float32)[..., None] * inv
    c = jnp.asarray(cols, jnp.float32)[..., None] * inv
    return jnp.concatenate([r, c], axis=-1)
  raise ValueError(f"{posenc!r} is not a rotary encoding ({', '.join(ROTARY)})")


def rope_cos_sin(angles: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Precomputed tables, computed once per forward pass and shared by all layers."""
  return jnp.cos(angles), jnp.sin(angles)


# ---------------------------------------------------------- additive encodings


def sincos_2d(rows: jax.Array, cols: jax.Array, dim: int,
              temperature: float = 10_000.0) -> jax.Array:
  """Fixed 2D sin-cos embedding ``[..., T, dim]`` (MAE style: half row, half col).

  Evaluated at (possibly fractional) positions, so interpolation to another
  resolution is just a scaled position.
  """
  if dim % 4:
    raise ValueError(f"sin-cos 2D needs a width divisible by 4, got {dim}")
  inv = jnp.asarray(rope_inv_timescales(dim // 4, temperature))
  r = jnp.asarray(rows, jnp.float32)[..., None] * inv
  c = jnp.asarray(cols, jnp.float32)[..., None] * inv
  return jnp.concatenate([jnp.sin(r), jnp.cos(r), jnp.sin(c), jnp.cos(c)], axis=-1)


class LearnedPosEmbedding(nn.Module):
  """Learned table over the reference grid ``[gh, gw, D]``.

  The table's shape is fixed by the reference grid, so a checkpoint loads at any
  resolution; at another grid the table is resized bilinearly and then
  gathered at each token's (row, col).
  """
  reference_grid: tuple[int, int]
  width: int

  @nn.compact
  def __call__(self, rows: jax.Array, cols: jax.Array, grid_hw) -> jax.Array:
    table = self.param("table", nn.initializers.normal(0.02),
                       (*self.reference_grid, self.width), jnp.float32)
    if tuple(grid_hw) != tuple(self.reference_grid):
      table = jax.image.resize(table, (*grid_hw, self.width), "bilinear")
    r = jnp.asarray(rows).astype(jnp.int32)
    c = jnp.asarray(cols).astype(jnp.int32)
    return table[r, c]
