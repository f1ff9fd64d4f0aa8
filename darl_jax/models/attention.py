"""Multi-head attention with rotary positions: one module for every use.

``Attention`` holds the packed q/k/v projection (``qkv``: kernel ``[D, 3,
H, Dh]``, bias ``[3, H, Dh]``) and the output projection (``out``: kernel
``[H, Dh, D]``); the two-stream model adds ``query_proj``. Its modes:

- self-attention (the default): causal or full; a ``mask`` (``[B or 1, 1,
  T, T]``, True = attend) replaces that pattern (prefix-causal attention);
- read-out, ``context=``: tokens that give keys and values only, placed
  before ``x`` under full attention; only ``x``'s outputs are computed (the
  denoising decoder reads one token of two);
- decoding, ``cache_len > 0``: keys and values cached across calls (the
  ``cache`` collection), each new token attending to every cached one at
  or before it; the same parameters as training, so samplers run on them;
- query stream, ``queries=``: the two-stream model's queries, with their own
  projection, attend to ``x``'s keys and values under the causal mask;
  returns both streams' outputs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from darl_jax import ops
from darl_jax.models import layers


class Attention(nn.Module):
  num_heads: int
  causal: bool = True
  dtype: Any = jnp.float32
  cache_len: int = 0

  @nn.compact
  def __call__(self, x, rope=None, mask=None, *, context=None, queries=None,
               query_rope=None):
    width = x.shape[-1]
    if width % self.num_heads:
      raise ValueError(f"width {width} is not divisible by {self.num_heads} heads")
    heads = (self.num_heads, width // self.num_heads)
    qkv = layers.DenseParams((3,) + heads, name="qkv")(width)
    query_proj = (layers.DenseParams(heads, name="query_proj")(width)
                  if queries is not None else None)
    out = layers.DenseParams(width, name="out")(heads)
    project_out = lambda o: ops.dense(o, out.kernel, out.bias, dtype=self.dtype, axes=2,
                                      history=out.history)

    if self.cache_len:
      return project_out(self._decode(x, qkv, rope, mask))
    if context is not None:   # keys and values of [context, x]; queries of x
      q, k, v = self._qkv(x, qkv, rope)
      k_v = qkv._replace(kernel=qkv.kernel[:, 1:], bias=qkv.bias[1:])
      _, k_c, v_c = self._qkv(context, k_v, None, queries=False)
      return project_out(ops.attention(q, jnp.concatenate([k_c, k], 1),
                                       jnp.concatenate([v_c, v], 1), causal=False))
    if queries is None:
      return project_out(ops.self_attention(x, qkv.kernel, qkv.bias, rope,
                                            causal=self.causal and mask is None,
                                            dtype=self.dtype, mask=mask, history=qkv.history))
    # Query stream: both streams use the causal mask over content positions;
    # for the queries that is "content before the patch it predicts"
    # (models/two_stream.py).
    q, k, v = self._qkv(x, qkv, rope)
    q_g = ops.apply_rope(ops.dense(queries, query_proj.kernel, query_proj.bias, dtype=self.dtype,
                                   history=query_proj.history), query_rope)
    return (project_out(ops.attention(q, k, v, causal=True)),
            project_out(ops.attention(q_g, k, v, causal=True)))

  def _qkv(self, x, qkv: layers.Dense, rope, queries: bool = True):
    """q, k, v ``[B, T, H, Dh]`` (k, v only, ``(None, k, v)``, for a kernel
    without the query part), RoPE on q and k."""
    qkv = ops.dense(x, qkv.kernel, qkv.bias, dtype=self.dtype, history=qkv.history)
    if not queries:
      return None, ops.apply_rope(qkv[:, :, 0], rope), qkv[:, :, 1]
    return (ops.apply_rope(qkv[:, :, 0], rope), ops.apply_rope(qkv[:, :, 1], rope),
            qkv[:, :, 2])

  def _decode(self, x, qkv: layers.Dense, rope, mask=None):
    """Writes the new tokens' keys and values into the cache at
    ``cache_index`` and attends each new token to the cache up to itself
    (or as ``mask [B or 1, 1, T, cache_len]`` says: a prefix prefilled with
    attention among all its tokens). Writing past ``cache_len`` is not
    checked inside jit (callers size the cache for the whole sequence)."""
    b, t, _ = x.shape
    if t > self.cache_len:
      raise ValueError(f"{t} new tokens do not fit a cache of {self.cache_len}")
    q, k, v = self._qkv(x, qkv, rope)
    shape = (b, self.cache_len) + k.shape[2:]
    cached_key = self.variable("cache", "cached_key", jnp.zeros, shape, k.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, shape, v.dtype)
    cache_index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
    start = cache_index.value
    cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, k, (0, start, 0, 0))
    cached_value.value = jax.lax.dynamic_update_slice(cached_value.value, v, (0, start, 0, 0))
    cache_index.value = start + t
    # Query i of this chunk sits at position start + i and sees slots
    # 0 .. start + i; slots not yet written are masked out. XLA's attention:
    # one query against a masked cache leaves a fused kernel nothing to win.
    if mask is None:
      mask = (jnp.arange(self.cache_len)[None, :] <= (start + jnp.arange(t))[:, None])[None, None]
    return ops.attention(q, cached_key.value, cached_value.value, causal=False,
                         mask=mask, kernels=False)
