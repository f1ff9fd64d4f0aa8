"""A backbone's block stack with the residual adds inside the LayerNorm kernels.

The same function as the model's plain blocks (models/vit.py: ``x + attn(LN(x));
x + mlp(LN(x))``, then the final norm), computed from the same parameter tree
(``block_XX/{norm1, attn/{qkv, out}, norm2, mlp/{fc1, fc2}}`` or the scanned
``blocks/block/...``, and ``norm``), but arranged for the Triton LayerNorm
kernels (layer_norm.py):

- every residual add is done in the forward kernel of the norm that follows
  it (``add_layer_norm``): the attention branch's in norm2, the MLP branch's
  in the next block's norm1 (or the final norm), instead of an XLA pass that
  writes the sum for the norm to read back;
- the bias of the projection that ends each branch (the attention's output
  projection, fc2) is added in that same kernel (``add_bias_layer_norm``):
  the projections return ``(product, bias)``;
- each norm's backward adds the residual stream's gradient in its own pass
  (``residual_layer_norm``).

So a block hands on ``(x, branch)`` un-added, and the stack keeps that pair
as its carry (a scan starts from a zero branch: ``x + (0 + 0)`` is ``x``).
The per-block outputs ``x + branch`` are computed for the probes; XLA drops
them where unused. Chosen by ``ops.block_stack`` as a unit (``kernels.norm
= 'triton'``) for stacks without remat and without drop path in training
(evaluation of a model trained with drop path fuses, unrolled or scanned).

The attention and MLP inside run whatever darl_jax/ops.py chose for them:
ops.block_stack hands its own ops in (``StackOps``), so this module, like
every kernel, imports nothing of the package above kernels/.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from darl_jax.kernels import layer_norm as ln
from darl_jax.kernels import per_shard

# ops.block_digest(vit.FUSED_BLOCK_CODE), the digest of the model code this
# file implements (models/vit.py): when that code changes, ops.block_stack
# runs the plain blocks instead (and says so) until the change is ported
# here and this is updated.
WRITTEN_FOR = "e3feef017f5a7b98"


@dataclasses.dataclass(frozen=True)
class StackOps:
  """What the stack takes from its caller, ops.block_stack: the branches'
  ops (darl_jax/ops.py's ``self_attention``, ``dense`` and ``mlp``, which
  run the kernels chosen for them) and the norms' settings."""
  self_attention: Callable
  dense: Callable
  mlp: Callable
  eps: float                     # the LayerNorm epsilon (ops.LN_EPS)
  interpret: bool                # Pallas's interpreter (off the GPU)
  batch_axes: tuple[str, ...]    # the mesh axes the batch is split over (per_shard)


def _norm(p, x, add, ops: StackOps, keep_input: bool = True):
  """``(s, LN(s))`` for ``s = x + add`` (``add``: None, an array, or a
  ``(product, bias)`` pair) in one kernel; only ``LN(s)`` when the sum is
  not used again (``keep_input=False``)."""
  scale, bias = p["scale"], p["bias"]
  blocks = ln.blocks_for(x.shape[-1])
  eps, interpret, axes = ops.eps, ops.interpret, ops.batch_axes
  if isinstance(add, tuple):
    product, add_bias = add
    s, y = per_shard.over_batch(
        lambda x, a, ab, sc, b: ln.add_bias_layer_norm(x, a, ab, sc, b, eps, blocks, interpret),
        x, product, add_bias, scale, bias, batched=(True, True, False, False, False), axes=axes)
  elif add is not None:
    s, y = per_shard.over_batch(
        lambda x, a, sc, b: ln.add_layer_norm(x, a, sc, b, eps, blocks, interpret),
        x, add, scale, bias, batched=(True, True, False, False), axes=axes)
  elif keep_input:
    s, y = per_shard.over_batch(
        lambda x, sc, b: ln.residual_layer_norm(x, sc, b, eps, blocks, interpret),
        x, scale, bias, batched=(True, False, False), axes=axes)
  else:   # the final norm: the plain kernel, as ops.layer_norm runs it under norm='triton'
    s, y = x, per_shard.over_batch(
        lambda x, sc, b: ln.layer_norm(x, sc, b, eps, blocks, interpret),
        x, scale, bias, batched=(True, False, False), axes=axes).astype(x.dtype)
  return s, y


def _value(branch):
  """A branch's value: ``product + bias`` (the bias rounded to the
  product's dtype first, as a Dense layer adds it)."""
  product, bias = branch
  return product + bias.astype(product.dtype)


def _block(p, h, x, branch, rope, mask, *, causal: bool, dtype, ops: StackOps):
  """One block on ``x + branch`` (``h``: its fp8 histories, or None):
  returns ``(x + branch + attention branch, the MLP branch as (product,
  bias))``."""
  history = lambda layer, dense: None if h is None else h[layer][dense]["history"]   # noqa: E731
  x, y = _norm(p["norm1"], x, branch, ops)
  attn = p["attn"]
  heads = ops.self_attention(y.astype(dtype), attn["qkv"]["kernel"], attn["qkv"]["bias"],
                             rope, causal=causal and mask is None, dtype=dtype, mask=mask,
                             history=history("attn", "qkv"))
  y = (ops.dense(heads, attn["out"]["kernel"], dtype=dtype, axes=2,
                 history=history("attn", "out")), attn["out"]["bias"])
  x, y = _norm(p["norm2"], x, y, ops)
  m = p["mlp"]
  y = ops.mlp(y.astype(dtype), m["fc1"]["kernel"], m["fc1"]["bias"],
              m["fc2"]["kernel"], None, dtype=dtype,
              histories=(history("mlp", "fc1"), history("mlp", "fc2")))
  return x, (y, m["fc2"]["bias"])


def run(params, x, rope, mask=None, *, depth: int, num_heads: int, causal: bool, dtype,
        scanned: bool, ops: StackOps, histories=None):
  """``{"features": final LN output, "block_XX": block outputs}`` of the
  stack in ``params`` (a backbone's parameter tree) on tokens ``x``
  (``mask``: the attention pattern, replacing causal or full), its
  branches computed by ``ops``; ``histories``: the dense layers' fp8
  histories in the same tree (the model's ``fp8`` collection), or None."""
  del num_heads   # read from the parameter shapes
  out = {}
  if scanned:
    zero = (jnp.zeros_like(x), jnp.zeros(x.shape[-1:], jnp.float32))

    def step(carry, layer):
      p, h = layer
      x, branch = _block(p, h, *carry, rope, mask, causal=causal, dtype=dtype, ops=ops)
      return (x, branch), x + _value(branch)

    layers = (params["blocks"]["block"],
              None if histories is None else histories["blocks"]["block"])
    (x, branch), ys = jax.lax.scan(step, (x, zero), layers, length=depth)
    for i in range(depth):
      out[f"block_{i:02d}"] = ys[i]
  else:
    branch = None
    for i in range(depth):
      x, branch = _block(params[f"block_{i:02d}"],
                         None if histories is None else histories[f"block_{i:02d}"],
                         x, branch, rope, mask, causal=causal, dtype=dtype, ops=ops)
      out[f"block_{i:02d}"] = x + _value(branch)
  _, y = _norm(params["norm"], x, branch, ops, keep_input=False)
  out["features"] = y.astype(dtype)
  return out
