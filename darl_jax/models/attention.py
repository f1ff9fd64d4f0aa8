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
    if width % self.num_heads:
      raise ValueError(f"width {width} is not divisible by {self.num_heads} heads")
    head_dim = width // self.num_heads
    qkv = nn.DenseGeneral((3, self.num_heads, head_dim), dtype=self.dtype,
                          kernel_init=QKV_INIT, name="qkv")(x)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if rope is not None:
      q = posenc_lib.apply_rope(q, *rope)
      k = posenc_lib.apply_rope(k, *rope)
    out = dot_product_attention(q, k, v, causal=self.causal, impl=self.impl, mask=mask)
    return nn.DenseGeneral(width, axis=(-2, -1), dtype=self.dtype,
                           kernel_init=OUT_INIT, name="out")(out)
