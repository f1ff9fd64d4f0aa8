"""The small layers every Transformer here is built from: dense parameters,
LayerNorm, the MLP and stochastic depth. Each declares its parameters with
plain Flax (the names, shapes and initialisers of Flax's own layers, so
checkpoints and exports keep one layout) and computes through darl_jax.ops.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from darl_jax import fp8
from darl_jax import ops

# MAE initialises every nn.Linear with Xavier-uniform over the 2D weight; for
# multi-axis kernels (q/k/v [D, 3, H, Dh], output [H, Dh, D]) the fans are
# those of the flattened 2D kernel, as in Flax's DenseGeneral.
DENSE_INIT = nn.initializers.xavier_uniform()


class Dense(NamedTuple):
  """A dense layer's parameters, for ``ops.dense(x, d.kernel, d.bias,
  history=d.history)``."""
  kernel: jax.Array
  bias: jax.Array
  history: jax.Array | None   # fp8 scaling's history (darl_jax/fp8.py), else None


class DenseParams(nn.Module):
  """The ``kernel [*fan_in, *features]`` and ``bias [*features]`` of a dense
  layer (float32, Xavier-uniform over the flattened 2D kernel, zero bias),
  returned for the caller's op rather than applied, as a ``Dense``.

  Under ``precision='fp8'`` a layer initialised then also keeps a history
  of its largest magnitudes (the ``fp8`` collection: fp8.new_history), from
  which ops.dense scales its float8 inputs; a model applied without that
  collection (a frozen backbone) gets ``history=None``, and ops.dense then
  scales each row afresh."""
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
    history = None
    if ops.precision() == "fp8" and (self.is_initializing()
                                     or self.has_variable(fp8.COLLECTION, "history")):
      history = self.variable(fp8.COLLECTION, "history", fp8.new_history).value
    return Dense(kernel, bias, history)


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
    fc1 = DenseParams(self.hidden, name="fc1")(x.shape[-1])
    fc2 = DenseParams(x.shape[-1], name="fc2")(self.hidden)
    return ops.mlp(x, fc1.kernel, fc1.bias, fc2.kernel, fc2.bias, dtype=self.dtype,
                   histories=(fc1.history, fc2.history))


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
