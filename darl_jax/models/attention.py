"""Multi-head self-attention with rotary positions and a causal/full switch."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from darl_jax.models import posenc as posenc_lib

ATTENTION_IMPLS = ("xla", "cudnn")

# MAE initialises every nn.Linear with Xavier-uniform over the 2D weight.
# DenseGeneral initialises its kernel in the flattened 2D shape ([D, 3*D] for
# the fused q/k/v, [D, D] for the output), so the fans are exactly MAE's.
QKV_INIT = nn.initializers.xavier_uniform()
OUT_INIT = nn.initializers.xavier_uniform()


def check_attention_impl(name: str) -> str:
  if name not in ATTENTION_IMPLS:
    raise ValueError(f"unknown attention implementation {name!r}; valid: "
                     f"{', '.join(ATTENTION_IMPLS)}")
  return name


def dot_product_attention(q, k, v, *, causal: bool, impl: str = "xla",
                          mask: jax.Array | None = None) -> jax.Array:
  """``[B, T, H, D]`` attention through ``jax.nn.dot_product_attention``.

  ``xla`` works everywhere (softmax in float32). ``cudnn`` is the fused flash
  kernel on NVIDIA GPUs; it needs bf16/fp16 inputs and, on the cards we tried,
  an even sequence length (see docs). ``mask`` ([B or 1, 1 or H, Tq, Tk],
  True = attend) is combined with the causal mask when both are given.
  """
  check_attention_impl(impl)
  return jax.nn.dot_product_attention(
      q, k, v, mask=mask, is_causal=causal, implementation=impl)


def project_qkv(x, num_heads: int, dtype, rope=None):
  """The fused q/k/v projection (submodule ``qkv`` of the calling module) and
  RoPE on q and k. ``x [B, T, D]`` -> three ``[B, T, heads, head_dim]``.

  Call from inside a compact method: the Dense is created in the caller's
  scope, so every attention variant shares the parameter names.
  """
  width = x.shape[-1]
  if width % num_heads:
    raise ValueError(f"width {width} is not divisible by {num_heads} heads")
  qkv = nn.DenseGeneral((3, num_heads, width // num_heads), dtype=dtype,
                        kernel_init=QKV_INIT, name="qkv")(x)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  if rope is not None:
    q = posenc_lib.apply_rope(q, *rope)
    k = posenc_lib.apply_rope(k, *rope)
  return q, k, v


class MultiHeadAttention(nn.Module):
  """Pre-projected multi-head attention; RoPE tables are passed in, not rebuilt."""
  num_heads: int
  causal: bool = True
  impl: str = "xla"
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array] | None = None,
               mask: jax.Array | None = None) -> jax.Array:
    width = x.shape[-1]
    q, k, v = project_qkv(x, self.num_heads, self.dtype, rope)
    out = dot_product_attention(q, k, v, causal=self.causal, impl=self.impl, mask=mask)
    return nn.DenseGeneral(width, axis=(-2, -1), dtype=self.dtype,
                           kernel_init=OUT_INIT, name="out")(out)


class CachedMultiHeadAttention(nn.Module):
  """Key/value-cached twin of :class:`MultiHeadAttention` for decoding.

  It creates the same submodules with the same names (``qkv``, ``out``), so it
  runs on the parameters the training path learned. Each call takes the next
  ``T`` tokens of the sequence, ``x [B, T, D]`` with their RoPE tables
  ``[B or 1, T, head_dim / 2]``, writes their keys and values into the
  ``cache`` collection at ``cache_index`` and lets every new token attend to
  all cached tokens at or before its own position (causal). Prefilling a
  prefix is one call with ``T = len(prefix)``; decoding is one call per token.

  Cache variables (created, zero-filled, by the first call under
  ``apply(..., mutable=["cache"])``): ``cached_key`` and ``cached_value``
  ``[B, cache_len, H, head_dim]`` in the compute dtype (keys after RoPE), and
  ``cache_index`` (int32 scalar, the number of tokens written so far). Writing
  past ``cache_len`` is not checked inside jit (``dynamic_update_slice`` would
  clamp); callers size the cache for the whole sequence.

  Attention always uses the ``xla`` implementation: with one query against a
  masked cache there is nothing for the fused training kernel to win, and the
  cuDNN kernel's even-length rule would not hold.
  """
  num_heads: int
  cache_len: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array,
               rope: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    b, t, width = x.shape
    if t > self.cache_len:
      raise ValueError(f"{t} new tokens do not fit a cache of {self.cache_len}")
    head_dim = width // self.num_heads
    q, k, v = project_qkv(x, self.num_heads, self.dtype, rope)
    shape = (b, self.cache_len, self.num_heads, head_dim)
    cached_key = self.variable("cache", "cached_key", jnp.zeros, shape, k.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, shape, v.dtype)
    cache_index = self.variable("cache", "cache_index",
                                lambda: jnp.zeros((), jnp.int32))
    start = cache_index.value
    keys = jax.lax.dynamic_update_slice(cached_key.value, k, (0, start, 0, 0))
    values = jax.lax.dynamic_update_slice(cached_value.value, v, (0, start, 0, 0))
    cached_key.value, cached_value.value = keys, values
    cache_index.value = start + t
    # Query i of this chunk sits at sequence position start + i and sees cache
    # slots 0 .. start + i; slots not yet written are masked out.
    query_pos = start + jnp.arange(t)
    mask = jnp.arange(self.cache_len)[None, :] <= query_pos[:, None]     # [T, L]
    out = dot_product_attention(q, keys, values, causal=False, impl="xla",
                                mask=mask[None, None])
    return nn.DenseGeneral(width, axis=(-2, -1), dtype=self.dtype,
                           kernel_init=OUT_INIT, name="out")(out)
