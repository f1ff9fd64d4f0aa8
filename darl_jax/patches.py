"""Patchification and patch orderings.

Conventions (see docs/ARCHITECTURE.md):

* Images are ``[B, H, W, C]``; patches are ``[B, N, P]`` with ``P = p * p * C``,
  the pixels inside a patch flattened in ``(row, col, channel)`` order and the
  ``N = (H / p) * (W / p)`` patches in raster order.
* An ordering is a permutation ``perm`` of raster indices: token ``k`` of the
  ordered sequence is raster patch ``perm[k]``, at grid position
  ``(rows[k], cols[k]) = divmod(perm[k], grid_w)``.

Fixed orderings (``make_ordering``) are numpy arrays built once on the host and
baked into the jitted step as constants. Per-example random orderings
(``random_permutations``) are jax arrays drawn inside the step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np


# ---------------------------------------------------------------------------
# Patchify / unpatchify
# ---------------------------------------------------------------------------


def _check_patch_size(patch_size) -> int:
  if isinstance(patch_size, bool) or not isinstance(patch_size, (int, np.integer)) or patch_size < 1:
    raise ValueError(f"patch_size must be a positive integer, got {patch_size!r}")
  return int(patch_size)


def patchify(images, patch_size: int) -> jax.Array:
  """Cuts images into non-overlapping square patches.

  Args:
    images: ``[B, H, W, C]`` jax or numpy array.
    patch_size: ``p``, the patch side in pixels; must divide ``H`` and ``W``.

  Returns:
    ``[B, N, p * p * C]`` with ``N = (H / p) * (W / p)`` in raster order and the
    pixels of each patch in ``(row, col, channel)`` order. Same dtype as input.
  """
  p = _check_patch_size(patch_size)
  images = jnp.asarray(images)
  if images.ndim != 4:
    raise ValueError(f"patchify expects images of shape [B, H, W, C], got shape {images.shape}")
  _, h, w, _ = images.shape
  if h % p or w % p:
    raise ValueError(
        f"image size {h}x{w} is not divisible by patch size {p}; "
        "choose an image_size that is a multiple of the patch size")
  # Validation stays in Python (clear errors); the jitted core turns the
  # reshape/transpose/reshape into one compiled program per shape when eager.
  return _patchify(images, p)


@functools.partial(jax.jit, static_argnums=1)
def _patchify(images: jax.Array, p: int) -> jax.Array:
  b, h, w, c = images.shape
  gh, gw = h // p, w // p
  # [B, gh, p, gw, p, C] -> [B, gh, gw, p, p, C]: grid axes first (raster order
  # of patches), then the in-patch (row, col, channel) axes.
  x = images.reshape(b, gh, p, gw, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, gh * gw, p * p * c)


def unpatchify(patches, patch_size: int, grid_hw: tuple[int, int], channels: int) -> jax.Array:
  """Exact inverse of :func:`patchify`.

  Args:
    patches: ``[B, N, p * p * C]`` in raster order (unorder first if needed).
    patch_size: ``p``.
    grid_hw: ``(grid_h, grid_w)`` with ``grid_h * grid_w == N``.
    channels: ``C``.

  Returns:
    ``[B, grid_h * p, grid_w * p, C]``.
  """
  p = _check_patch_size(patch_size)
  patches = jnp.asarray(patches)
  gh, gw = (int(v) for v in grid_hw)
  if patches.ndim != 3:
    raise ValueError(f"unpatchify expects patches of shape [B, N, P], got shape {patches.shape}")
  b, n, dim = patches.shape
  if n != gh * gw or dim != p * p * channels:
    raise ValueError(
        f"patches of shape {patches.shape} do not match grid {gh}x{gw} with patch size {p} "
        f"and {channels} channels (expected [B, {gh * gw}, {p * p * channels}])")
  return _unpatchify(patches, p, gh, gw, int(channels))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _unpatchify(patches: jax.Array, p: int, gh: int, gw: int, c: int) -> jax.Array:
  b = patches.shape[0]
  x = patches.reshape(b, gh, gw, p, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, gh * p, gw * p, c)


# ---------------------------------------------------------------------------
# Orderings
# ---------------------------------------------------------------------------


# eq=False: the fields are numpy arrays, so the generated __eq__/__hash__ would
# be ambiguous / fail; identity hashing keeps an Ordering usable as a static
# (hashable) value, e.g. in a jit closure or a dict key.
@dataclasses.dataclass(frozen=True, eq=False)
class Ordering:
  """A fixed token ordering of a ``grid_h x grid_w`` patch grid.

  Attributes:
    perm: int32 ``[N]``; token ``k`` of the ordered sequence is raster patch
      ``perm[k]``.
    inverse: int32 ``[N]``; ``inverse[perm[k]] == k`` (position of each raster
      patch in the ordered sequence).
    rows: int32 ``[N]``; grid row of token ``k``.
    cols: int32 ``[N]``; grid column of token ``k``.
    name: registry name (informational).
  """

  perm: np.ndarray
  inverse: np.ndarray
  rows: np.ndarray
  cols: np.ndarray
  name: str = "custom"

  def __post_init__(self):
    arrays = {}
    for field in ("perm", "inverse", "rows", "cols"):
      a = np.array(getattr(self, field), dtype=np.int32)  # copy, then freeze
      if a.ndim != 1:
        raise ValueError(f"Ordering.{field} must be 1-D, got shape {a.shape}")
      a.setflags(write=False)
      arrays[field] = a
    n = arrays["perm"].shape[0]
    if any(a.shape[0] != n for a in arrays.values()):
      raise ValueError("Ordering arrays must all have the same length")
    if not np.array_equal(np.sort(arrays["perm"]), np.arange(n)):
      raise ValueError(f"Ordering.perm is not a permutation of 0..{n - 1}")
    if not np.array_equal(arrays["inverse"][arrays["perm"]], np.arange(n)):
      raise ValueError("Ordering.inverse is not the inverse of Ordering.perm")
    for field, a in arrays.items():
      object.__setattr__(self, field, a)

  @classmethod
  def from_perm(cls, perm, grid_w: int, name: str = "custom") -> "Ordering":
    """Builds an Ordering from ``perm`` [N]; inverse/rows/cols are derived."""
    perm = np.asarray(perm, dtype=np.int32)
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(perm.shape[0], dtype=np.int32)
    rows, cols = np.divmod(perm, np.int32(grid_w))
    return cls(perm=perm, inverse=inverse, rows=rows, cols=cols, name=name)

  @property
  def num_tokens(self) -> int:
    return int(self.perm.shape[0])

  def order(self, x) -> jax.Array:
    """Raster ``[B, N, ...]`` -> ordered ``[B, N, ...]``."""
    return order_tokens(x, self.perm)

  def unorder(self, x) -> jax.Array:
    """Ordered ``[B, N, ...]`` -> raster ``[B, N, ...]``."""
    # The stored inverse is a gather index, cheaper than a scatter.
    return order_tokens(x, self.inverse)


def _raster(gh, gw, block, seed):
  del block, seed
  return np.arange(gh * gw)


def _blocked_grid(gh, gw, block, name) -> np.ndarray:
  """Raster indices as ``[gh/b, b, gw/b, b]`` = (block_row, in_row, block_col, in_col)."""
  if block is None:
    raise ValueError(f"ordering {name!r} needs `block` (patches per block side)")
  if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
    raise ValueError(f"block must be a positive integer, got {block!r}")
  if gh % block or gw % block:
    raise ValueError(
        f"patch grid {gh}x{gw} is not divisible by block {block} for ordering {name!r}; "
        "choose a block that divides both grid dimensions")
  b = int(block)
  return np.arange(gh * gw).reshape(gh // b, b, gw // b, b)


def _nested_raster(gh, gw, block, seed):
  del seed
  idx = _blocked_grid(gh, gw, block, "nested_raster")
  # Outer loop over blocks in raster order, inner loop over patches in a block.
  return idx.transpose(0, 2, 1, 3).reshape(-1)


def _round_robin(gh, gw, block, seed):
  del seed
  idx = _blocked_grid(gh, gw, block, "round_robin")
  # Outer loop over the in-block position, inner loop over blocks: one patch
  # from each block in turn, cycling through the blocks.
  return idx.transpose(1, 3, 0, 2).reshape(-1)


def _random(gh, gw, block, seed):
  del block
  # seed=None would make the ordering differ between processes/restarts, which
  # silently breaks training; default to a fixed seed instead.
  rng = np.random.default_rng(0 if seed is None else seed)
  return rng.permutation(gh * gw)


# Registry: name -> builder(grid_h, grid_w, block, seed) -> raster-index perm [N].
ORDERINGS: dict[str, Callable[..., np.ndarray]] = {
    "raster": _raster,
    "nested_raster": _nested_raster,
    "round_robin": _round_robin,
    "random": _random,
}


def make_ordering(name: str, grid_h: int, grid_w: int, block: Optional[int] = None,
                  seed: Optional[int] = None) -> Ordering:
  """Builds a fixed ordering from the registry.

  Args:
    name: one of ``ORDERINGS``: ``raster``; ``nested_raster`` (``block x block``
      blocks in raster order, patches within a block in raster order);
      ``round_robin`` (one patch from each block in turn, blocks and in-block
      patches both raster ordered); ``random`` (a fixed numpy permutation).
    grid_h, grid_w: patch grid size.
    block: patches per block side (nested_raster / round_robin only; must
      divide both grid dimensions). Ignored by the other orderings.
    seed: seed of the ``random`` ordering (``None`` means 0). Ignored otherwise.

  Returns:
    An :class:`Ordering` with ``N = grid_h * grid_w`` tokens.
  """
  if name not in ORDERINGS:
    raise ValueError(f"unknown ordering {name!r}; valid names: {sorted(ORDERINGS)}")
  if grid_h < 1 or grid_w < 1:
    raise ValueError(f"grid size must be positive, got {grid_h}x{grid_w}")
  perm = ORDERINGS[name](int(grid_h), int(grid_w), block, seed)
  return Ordering.from_perm(perm, grid_w, name=name)


# ---------------------------------------------------------------------------
# Applying orderings (jax)
# ---------------------------------------------------------------------------


def order_tokens(x, perm) -> jax.Array:
  """Gathers tokens along axis 1: ``out[b, k] = x[b, perm[k]]`` (or ``perm[b, k]``).

  Args:
    x: ``[B, N, ...]``.
    perm: int ``[N]`` (shared by the batch) or ``[B, N]`` (per example).

  Returns:
    ``[B, N, ...]`` in the order given by ``perm``.
  """
  x = jnp.asarray(x)
  perm = jnp.asarray(perm)
  if perm.ndim == 1:
    return jnp.take(x, perm, axis=1)
  if perm.ndim == 2:
    if perm.shape[0] != x.shape[0]:
      raise ValueError(f"per-example perm of shape {perm.shape} does not match batch {x.shape[0]}")
    return jax.vmap(lambda xi, pi: jnp.take(xi, pi, axis=0))(x, perm)
  raise ValueError(f"perm must be [N] or [B, N], got shape {perm.shape}")


def invert_permutation(perm) -> jax.Array:
  """Inverse of ``perm`` ([N] or [B, N]) along its last axis, via scatter."""
  perm = jnp.asarray(perm)
  n = perm.shape[-1]
  ar = jnp.arange(n, dtype=perm.dtype)

  def inv1(p):
    return jnp.zeros_like(p).at[p].set(ar, unique_indices=True)

  if perm.ndim == 1:
    return inv1(perm)
  return jax.vmap(inv1)(perm)


def unorder_tokens(x, perm) -> jax.Array:
  """Inverse of :func:`order_tokens`: ``unorder_tokens(order_tokens(x, p), p) == x``."""
  return order_tokens(x, invert_permutation(perm))


@functools.partial(jax.jit, static_argnums=(1, 2))
def random_permutations(key: jax.Array, batch: int, n: int) -> jax.Array:
  """One independent uniform permutation of ``0..n-1`` per example.

  Args:
    key: PRNG key.
    batch, n: static Python ints (the function is jitted with them static).

  Returns:
    int32 ``[batch, n]``; usable inside jit.
  """
  keys = jax.random.split(key, batch)
  return jax.vmap(lambda k: jax.random.permutation(k, n))(keys).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=1)
def positions_of(perm, grid_w: int) -> tuple[jax.Array, jax.Array]:
  """Grid positions ``(rows, cols)`` of the tokens of ``perm`` ([N] or [B, N]), int32."""
  perm = jnp.asarray(perm, dtype=jnp.int32)
  return perm // grid_w, perm % grid_w
