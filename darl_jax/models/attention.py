"""Multi-head self-attention with rotary positions and a causal/full switch."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from darl_jax.models import posenc as posenc_lib

ATTENTION_IMPLS = ("auto", "xla", "cudnn", "hopper")

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


# Key lengths up to this use ``short_attention`` on the xla path.
SHORT_KEYS = 4


def dot_product_attention(q, k, v, *, causal: bool, impl: str = "xla",
                          mask: jax.Array | None = None) -> jax.Array:
  """``[B, T, H, D]`` attention through ``jax.nn.dot_product_attention``.

  ``xla`` works everywhere (softmax in float32). ``cudnn`` is the fused flash
  kernel on NVIDIA GPUs; it needs bf16/fp16 inputs and, on the cards we tried,
  an even sequence length (see docs). ``hopper`` runs causal attention
  without a mask through our sm_90 kernels (kernels/hopper_attention.py,
  faster than cuDNN at the pretraining shapes) and everything else as
  ``auto``. ``auto`` is ``cudnn`` where cuDNN takes
  the inputs (``_cudnn_takes``) and ``xla`` elsewhere (off the GPU the
  Hopper kernels run in Pallas's interpreter, for tests). ``mask`` ([B or 1, 1 or H, Tq, Tk], True
  = attend) is combined with the causal mask when both are given.
  Sequences of at most ``SHORT_KEYS`` keys (the two-token denoising decoder)
  take ``short_attention`` on the xla path.
  """
  check_attention_impl(impl)
  if impl == "hopper":
    if causal and mask is None and _hopper_attention_fits(q, k, v):
      from darl_jax.kernels import hopper_attention, per_shard   # Pallas Mosaic GPU when used
      interpret = jax.default_backend() != "gpu"
      return per_shard.over_batch(
          lambda q, k, v: hopper_attention.causal_attention(
              q, k, v, hopper_attention.DEFAULT_ATTENTION_TILING, interpret),
          q, k, v, batched=(True, True, True))
    impl = "auto"
  if impl == "auto":
    impl = "cudnn" if _cudnn_takes(q, k) else "xla"
  if impl == "xla" and k.shape[1] <= SHORT_KEYS:
    return short_attention(q, k, v, causal=causal, mask=mask)
  return jax.nn.dot_product_attention(
      q, k, v, mask=mask, is_causal=causal, implementation=impl)


def _cudnn_takes(q, k) -> bool:
  """Whether cuDNN's fused attention takes these inputs: an NVIDIA GPU,
  16-bit inputs and an even sequence length (odd ones raise in cuDNN)."""
  return (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
          and q.shape[1] % 2 == 0 and k.shape[1] % 2 == 0)


def _require_hopper() -> None:
  """Errors that name the fix when ``attention_impl='hopper'`` meets a device
  its kernels cannot run on."""
  from darl_jax.kernels import mosaic
  mosaic.require_hopper("model.attention_impl='hopper'", tpu_fix="model.attention_impl='xla'",
                        gpu_fix="model.attention_impl='cudnn'")


def _hopper_attention_fits(q, k, v) -> bool:
  """Whether ``attention_impl='hopper'`` runs its kernels on q, k, v: errors
  that name the fix for a wrong device; False for inputs the kernels do not
  take (float32, a head_dim that is not a multiple of 16, a batch x tokens
  that is not a multiple of 64), which go to cuDNN. The shapes checked are
  one device's (kernels/per_shard.py)."""
  from darl_jax.kernels import hopper_attention, per_shard
  _require_hopper()
  q, k, v = (per_shard.local(x) for x in (q, k, v))
  return q is not None and hopper_attention.fits(q, k, v)


def short_attention(q, k, v, *, causal: bool, mask: jax.Array | None = None) -> jax.Array:
  """Attention over a handful of keys as broadcast products and sums.

  The same numbers as the xla path of ``jax.nn.dot_product_attention``
  (float32 logits and softmax, probabilities cast to the value dtype), but
  no batched matrix products: for the denoising decoder (2 tokens per patch,
  batch x heads of 2x2 products) those run as tiny GEMMs that took as long
  as all its real matrix multiplies (sampling profile, docs/SAMPLING.md);
  as elementwise work XLA fuses them into a couple of memory-bound kernels.
  """
  t, s, d = q.shape[1], k.shape[1], q.shape[-1]
  logits = jnp.sum(q[:, :, None].astype(jnp.float32) * k[:, None].astype(jnp.float32),
                   axis=-1) * (d ** -0.5)                                  # [B, T, S, H]
  keep = None
  if causal:
    keep = jnp.tril(jnp.ones((t, s), bool))[None, :, :, None]   # as jax.nn: top-left
  if mask is not None:
    m = jnp.transpose(jnp.asarray(mask, bool), (0, 2, 3, 1))               # [B, T, S, H]
    keep = m if keep is None else keep & m
  if keep is not None:
    logits = jnp.where(keep, logits, -0.7 * jnp.finfo(jnp.float32).max)   # as jax.nn
  probs = jax.nn.softmax(logits, axis=2).astype(v.dtype)
  out = jnp.sum(probs[..., None].astype(jnp.float32) * v[:, None].astype(jnp.float32),
                axis=2)                                                    # [B, T, H, D]
  return out.astype(v.dtype)


def two_key_attention(q, k0, k1, v0, v1) -> jax.Array:
  """Attention of ``q [B, 1, H, D]`` over two keys and values (``[B, 1, H,
  D]`` each), no mask. A softmax over two logits is the sigmoid of their
  difference, so ``p0 = sigmoid(q . (k0 - k1) / sqrt(D))`` and ``out = v1 +
  p0 (v0 - v1)``, in float32. The same function as ``short_attention`` over
  ``[k0, k1]`` (which rounds the probabilities to v's dtype first; tests
  compare the two), in one sum per head and elementwise work: XLA fuses it
  and its gradient into a few passes over the operands, where the stacked
  form's gradient also writes and adds padded [B, 2, H, D] arrays."""
  f32 = lambda x: x.astype(jnp.float32)   # noqa: E731
  logit = jnp.sum(f32(q) * (f32(k0) - f32(k1)), axis=-1, keepdims=True) * q.shape[-1] ** -0.5
  p0 = jax.nn.sigmoid(logit)
  return (f32(v1) + p0 * (f32(v0) - f32(v1))).astype(v0.dtype)


class QkvProjection(nn.Module):
  """The fused q/k/v projection, ``x [B, T, D]`` -> the product ``x W``
  ``[B, T, 3, heads, head_dim]`` and the bias ``[3, heads, head_dim]``, both
  in ``dtype``, returned apart: the Hopper attention path adds the bias
  inside its own passes instead of in a pass over the whole product.

  Parameters, their names, shapes and initialisation, and ``product + bias``
  are those of ``nn.DenseGeneral((3, heads, head_dim))`` (tests check both).
  """
  num_heads: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, weights_only: bool = False):
    """``weights_only``: return ``(x, kernel [width, 3, heads, head_dim],
    bias)`` in ``dtype`` and compute nothing, for a caller that takes the
    product in its own kernel (or its own products: ReadoutAttention)."""
    width = x.shape[-1]
    if width % self.num_heads:
      raise ValueError(f"width {width} is not divisible by {self.num_heads} heads")
    features = (3, self.num_heads, width // self.num_heads)

    def kernel_init(key, shape, dtype=jnp.float32):   # fans of the 2D [width, 3 H D] kernel
      return QKV_INIT(key, (width, math.prod(features)), dtype).reshape(shape)

    kernel = self.param("kernel", kernel_init, (width,) + features, jnp.float32)
    bias = self.param("bias", nn.initializers.zeros, features, jnp.float32)
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    if weights_only:
      return x, kernel, bias
    return _project(x, kernel), bias


def _project(x, kernel):
  """``x [..., width] @ kernel [width, ...]``."""
  return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


class DenseBiasApart(nn.Module):
  """``nn.DenseGeneral(features, axis)`` (``axis`` the trailing input axes it
  contracts; ``(-1,)`` is ``nn.Dense``) returning its product and bias apart,
  ``(x W, bias)``, the product in ``dtype`` and the bias the float32
  parameter: the bias is added in the next norm's kernel (vit.Block,
  ``norm_impl='triton'``), rounded to the product's dtype there, instead of
  in a pass of XLA's own over the product; its gradient is then a float32
  sum.

  Parameters, their names, shapes and initialisation (``kernel_init`` of the
  flattened 2D kernel, reshaped), the dtype promotion and ``product +
  bias.astype(product.dtype)`` are those of ``nn.DenseGeneral`` (tests check
  them).
  """
  features: int
  axis: tuple[int, ...] = (-1,)
  dtype: Any = jnp.float32
  kernel_init: Any = OUT_INIT

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    axes = tuple(sorted(a % x.ndim for a in self.axis))
    if axes != tuple(range(x.ndim - len(axes), x.ndim)):
      raise ValueError(f"DenseBiasApart contracts trailing axes, not {self.axis} of {x.shape}")
    fan_in = tuple(x.shape[a] for a in axes)

    def kernel_init(key, shape, dtype=jnp.float32):   # fans of the 2D kernel, as DenseGeneral
      return self.kernel_init(key, (math.prod(fan_in), self.features), dtype).reshape(shape)

    kernel = self.param("kernel", kernel_init, fan_in + (self.features,), jnp.float32)
    bias = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
    x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
    contract = (axes, tuple(range(len(axes))))
    return jax.lax.dot_general(x, kernel, (contract, ((), ()))), bias


def qkv_projection(x, num_heads: int, dtype) -> jax.Array:
  """The fused q/k/v projection with its bias (submodule ``qkv`` of the
  calling module): ``x [B, T, D]`` -> ``[B, T, 3, heads, head_dim]``.

  Call from inside a compact method: the projection is created in the
  caller's scope, so every attention variant shares the parameter names.
  """
  product, bias = QkvProjection(num_heads, dtype, name="qkv")(x)
  return product + bias


def split_qkv(qkv, rope=None):
  """``[B, T, 3, H, D]`` -> q, k, v ``[B, T, H, D]``, with RoPE on q and k."""
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  if rope is not None:
    q = posenc_lib.apply_rope(q, *rope)
    k = posenc_lib.apply_rope(k, *rope)
  return q, k, v


def project_qkv(x, num_heads: int, dtype, rope=None):
  """``qkv_projection`` then ``split_qkv``: three ``[B, T, heads, head_dim]``."""
  return split_qkv(qkv_projection(x, num_heads, dtype), rope)


def _shared_tables(rope):
  """RoPE tables as one ``[T, D/2]`` pair when every image has the same
  positions (``[1, T, D/2]``), else None."""
  if rope is None or rope[0].shape[0] != 1:
    return None
  return tuple(t[0] for t in rope)


def _hopper_qkv_attention(product, bias, rope):
  """Causal attention of the packed projection through the Hopper kernels,
  bias and RoPE's backward inside them (kernels/hopper_attention.py); None
  where they do not take it (per-image RoPE tables, shapes and dtypes they
  do not cover), for the caller's general path."""
  tables = _shared_tables(rope)
  if rope is not None and tables is None:
    return None
  from darl_jax.kernels import hopper_attention, per_shard
  _require_hopper()
  local = per_shard.local(product)
  if local is None or not hopper_attention.fits_qkv(local, bias, tables):
    return None
  interpret = jax.default_backend() != "gpu"
  return per_shard.over_batch(
      lambda product, bias, tables: hopper_attention.causal_attention_qkv(
          product, bias, tables, hopper_attention.DEFAULT_ATTENTION_TILING, interpret),
      product, bias, tables, batched=(True, False, False))


def _projected_attention(projection: "QkvProjection", x, rope):
  """Causal attention from the block's input through the Hopper kernels,
  the q/k/v product included: the bias and RoPE in the product's epilogue,
  q, k, v read from it by the attention kernels
  (hopper_attention.causal_attention_projected). None where that does not
  fit (no RoPE or per-image tables, head dims other than 64, row counts
  that its tiles do not divide), for causal_attention_qkv on XLA's product."""
  tables = _shared_tables(rope)
  if tables is None:
    return None
  from darl_jax.kernels import hopper_attention, per_shard
  _require_hopper()
  x, kernel, bias = projection(x, weights_only=True)
  local = per_shard.local(x)
  if local is None or not hopper_attention.fits_projected(local, kernel, bias, tables):
    return None
  interpret = jax.default_backend() != "gpu"
  return per_shard.over_batch(
      lambda x, kernel, bias, tables: hopper_attention.causal_attention_projected(
          x, kernel, bias, tables, hopper_attention.DEFAULT_ATTENTION_TILING, interpret),
      x, kernel, bias, tables, batched=(True, False, False, False))


class MultiHeadAttention(nn.Module):
  """Pre-projected multi-head attention; RoPE tables are passed in, not rebuilt.

  ``defer_bias``: return the output projection's product and bias apart,
  ``(product, bias)`` (``DenseBiasApart``), for the caller to add the bias
  in its next norm's kernel (vit.Block); the same parameters either way."""
  num_heads: int
  causal: bool = True
  impl: str = "xla"
  dtype: Any = jnp.float32
  defer_bias: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array] | None = None,
               mask: jax.Array | None = None) -> jax.Array:
    out = None
    projection = QkvProjection(self.num_heads, self.dtype, name="qkv")
    hopper = check_attention_impl(self.impl) == "hopper" and self.causal and mask is None
    if hopper:
      out = _projected_attention(projection, x, rope)
    if out is None:
      product, bias = projection(x)
    if hopper and out is None:
      out = _hopper_qkv_attention(product, bias, rope)
    if out is None:
      q, k, v = split_qkv(product + bias, rope)
      out = dot_product_attention(q, k, v, causal=self.causal, impl=self.impl, mask=mask)
    return _out_projection(out, x.shape[-1], self.dtype, self.defer_bias)


def _out_projection(out, width: int, dtype, defer_bias: bool):
  """The heads' outputs ``[..., heads, head_dim]`` -> ``[..., width]``
  (submodule ``out`` of the calling module), the bias apart with
  ``defer_bias`` (DenseBiasApart)."""
  if defer_bias:
    return DenseBiasApart(width, (-2, -1), dtype, OUT_INIT, name="out")(out)
  return nn.DenseGeneral(width, axis=(-2, -1), dtype=dtype, kernel_init=OUT_INIT,
                         name="out")(out)


class ReadoutAttention(nn.Module):
  """Full attention (no mask, no RoPE) over ``[context, token]``, computed
  for the query of ``token`` alone: ``context [B, S, D]`` are keys and
  values only, ``token [B, 1, D]`` the last key, value and the one query.
  Returns ``token``'s output ``[B, 1, D]`` (``(product, bias)`` with
  ``defer_bias``), which is ``MultiHeadAttention(causal=False)`` over the
  concatenated sequence at its last token: same parameters (``qkv``,
  ``out``), same function (tests).

  For the denoising decoder's last block (vit.ReadoutBlock), whose other
  outputs go unused. Taking the two tokens as two arrays rather than as
  slices of one ``[B, 2, D]`` sequence saves the stack before the block and,
  in the backward, the pads and adds that slicing the query's row and the
  residual's out of the sequence cost; for two tokens the attention itself
  is ``two_key_attention``: both shorten the decoder's passes outside its
  matrix products.
  """
  num_heads: int
  dtype: Any = jnp.float32
  defer_bias: bool = False
  impl: str = "xla"

  @nn.compact
  def __call__(self, context: jax.Array, token: jax.Array):
    projection = QkvProjection(self.num_heads, self.dtype, name="qkv")
    context, kernel, bias = projection(context, weights_only=True)
    token, = nn.dtypes.promote_dtype(token, dtype=self.dtype)
    kv = _project(context, kernel[:, 1:]) + bias[1:]   # [B, S, 2, H, D]: no query
    qkv = _project(token, kernel) + bias               # [B, 1, 3, H, D]
    q = qkv[:, :, 0]
    if kv.shape[1] == 1 and self.impl == "xla":   # the decoder's two tokens
      out = two_key_attention(q, kv[:, :, 0], qkv[:, :, 1], kv[:, :, 1], qkv[:, :, 2])
    else:
      k = jnp.concatenate([kv[:, :, 0], qkv[:, :, 1]], axis=1)
      v = jnp.concatenate([kv[:, :, 1], qkv[:, :, 2]], axis=1)
      out = dot_product_attention(q, k, v, causal=False, impl=self.impl)
    return _out_projection(out, token.shape[-1], self.dtype, self.defer_bias)


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
