"""The small layers every Transformer here is built from: dense parameters,
LayerNorm, the MLP and stochastic depth. Each declares its parameters with
plain Flax (the names, shapes and initialisers of Flax's own layers, so
checkpoints and exports keep one layout) and computes through darl_jax.ops.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from darl_jax import ops

# MAE initialises every nn.Linear with Xavier-uniform over the 2D weight; for
# multi-axis kernels (q/k/v [D, 3, H, Dh], output [H, Dh, D]) the fans are
# those of the flattened 2D kernel, as in Flax's DenseGeneral.
DENSE_INIT = nn.initializers.xavier_uniform()


class DenseParams(nn.Module):
  """The ``kernel [*fan_in, *features]`` and ``bias [*features]`` of a dense
  layer (float32, Xavier-uniform over the flattened 2D kernel, zero bias),
  returned for the caller's op rather than applied."""
  features: int | tuple[int, ...]
  kernel_init: Any = DENSE_INIT

  @nn.compact
  def __call__(self, fan_in: int | tuple[int, ...]):
    fan_in = (fan_in,) if isinstance(fan_in, int) else tuple(fan_in)
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)

    def init(key, shape, dtype=jnp.float32):
      return self.kernel_init(key, (math.prod(fan_in), math.prod(features)), dtype).reshape(shape)

    kernel = self.param("kernel", init, fan_in + features, jnp.float32)
    bias = self.param("bias", nn.initializers.zeros, features, jnp.float32)
    return kernel, bias


class LayerNorm(nn.Module):
  """LayerNorm over the last axis (epsilon 1e-6, float32 statistics), the
  parameters of Flax's ``nn.LayerNorm``."""
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, x.shape[-1:], jnp.float32)
    bias = self.param("bias", nn.initializers.zeros, x.shape[-1:], jnp.float32)
    return ops.layer_norm(x, scale, bias, dtype=self.dtype)


class Mlp(nn.Module):
  """fc1, exact GELU, fc2 (the standard ViT MLP)."""
  hidden: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    w1, b1 = DenseParams(self.hidden, name="fc1")(x.shape[-1])
    w2, b2 = DenseParams(x.shape[-1], name="fc2")(self.hidden)
    return ops.mlp(x, w1, b1, w2, b2, dtype=self.dtype)


class DropPath(nn.Module):
  """Stochastic depth: drops the whole residual branch per example.

  ``rate`` is a Python float, or a traced scalar where a scanned stack hands
  each layer its own rate as the scan's input (models/vit.py); a traced 0
  keeps every example (a Bernoulli draw of probability 1)."""
  rate: float | jax.Array

  @nn.compact
  def __call__(self, x, deterministic: bool):
    if deterministic or (isinstance(self.rate, (int, float)) and self.rate == 0.0):
      return x
    keep = 1.0 - self.rate
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    mask = jax.random.bernoulli(self.make_rng("dropout"), keep, shape)
    return jnp.where(mask, x / keep, 0).astype(x.dtype)
