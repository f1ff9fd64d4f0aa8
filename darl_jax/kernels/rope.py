"""RoPE's rotation in the "rotate half" channel layout.

Channel ``j`` of a head pairs with channel ``j + D/2``, and pair ``j`` turns
by angle ``j`` of the tables: ``(x1 c - x2 s, x2 c + x1 s)`` for halves x1,
x2. The model (models/posenc.py builds the angles, models/attention.py
rotates q and k) and the Hopper kernels (hopper_attention.py, which
rotates in its projection's epilogue and applies the transpose in its
backward's) share this layout, so it lives on the kernels' side: models
import kernels, never the other way round.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates ``x [B, T, H, D]`` by tables ``cos/sin [B or 1, T, D/2]``.

  The rotation runs in float32 and is cast back to ``x.dtype``: one fused
  elementwise pass under jit.
  """
  dtype = x.dtype
  x = x.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  c = cos[:, :, None, :]
  s = sin[:, :, None, :]
  out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
  return out.astype(dtype)
