"""Attention pooling for probes: one learned query reads a set of tokens.

AIM's attentive probe (El-Nouby et al., 2024): a learned query token
cross-attends, with several heads, over a frozen backbone's tokens; keys and
values are linear projections of the tokens, the query is the parameter
itself (no projection of it), and there is no output projection. Nothing
carries a position, so the pooled vector is a function of the *set* of
tokens: any permutation of them gives the same output.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import linen as nn

from darl_jax import ops
from darl_jax.models import layers


class AttentionPool(nn.Module):
  """``tokens [B, T, D]`` -> ``[B, D]``: the learned query's multi-head
  attention over the tokens (``num_heads`` must divide ``D``)."""
  num_heads: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens):
    b, _, width = tokens.shape
    if width % self.num_heads:
      raise ValueError(f"width {width} is not divisible by {self.num_heads} heads; set "
                       "the probe's num_heads to a divisor of the backbone's width")
    heads = (self.num_heads, width // self.num_heads)
    query = self.param("query", nn.initializers.normal(0.02), heads, jnp.float32)
    key = layers.DenseParams(heads, name="key")(width)
    value = layers.DenseParams(heads, name="value")(width)
    k = ops.dense(tokens, key.kernel, key.bias, dtype=self.dtype, history=key.history)
    v = ops.dense(tokens, value.kernel, value.bias, dtype=self.dtype, history=value.history)
    q = jnp.broadcast_to(query.astype(self.dtype), (b, 1) + heads)
    out = ops.attention(q, k, v, causal=False)            # [B, 1, H, Dh]
    return out.reshape(b, width)
