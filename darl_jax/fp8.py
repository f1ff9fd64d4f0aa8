"""Dense layers with fp8 inputs: ``config.precision='fp8'`` (darl_jax/ops.py).

``x @ kernel`` runs as a product of float8 copies of both inputs on the
tensor cores, accumulated in float32 and returned in the layer's dtype,
then multiplied by the scales that mapped each input into the format's
range. The backward pass multiplies the incoming gradient in e5m2 (more
range, less precision: gradients span more decades than activations) with
the saved e4m3 inputs.

How ``dense`` chooses the scales (no history), and why:

- Each row of ``x`` (one token of one image) gets its own scale, from that
  row's largest magnitude. One scale for the whole tensor would tie every
  token's rounding to the largest value anywhere in the batch, the future
  patches of its own image included: a causal model would no longer be
  causal (tests/test_fp8.py checks that it is), and an evaluation would
  depend on its batch. Row scales apply to the product's rows, so they
  cost one multiply in the pass that adds the bias.
- The kernel has one scale (it is the same for every row).
- The backward pass's products contract over the rows, where row scales
  cannot be taken out of the sum: the gradient gets one scale, and the
  saved ``x`` is re-rounded to one scale (the largest row scale) for the
  kernel's gradient. Gradients sum over the batch anyway, so nothing is
  lost by tying them together.
- These scales come from the tensors as they are ("current scaling"):
  nothing to keep between steps. Their extra passes cost what fp8 gains
  (benchmarks/RESULTS.md, "fp8"), so they run only where a layer has no
  history: a model applied without the ``fp8`` collection (the probes'
  frozen backbone, sampling, kNN and few-shot features).

A layer trained under ``precision='fp8'`` scales from a history instead
("delayed scaling", as Transformer Engine and Flax's ``Fp8DotGeneralOp``
run it; ``dense_delayed`` below): its ``DenseParams`` keeps the largest
magnitudes of its input and of its output's gradient over the last
``HISTORY`` steps in the ``fp8`` collection (``COLLECTION``), which the
train state holds in ``model_state`` and checkpoints. The train step
(train/step.py) differentiates the loss with respect to the histories as
well; their cotangents are the step's records, which ``updated_histories``
shifts in. A checkpoint of either precision loads under the other
(train/state.py, ``precision_target``): a bf16 one starts with empty
histories, and a step whose layers had none only fills them
(``warming``): its update is skipped, as a non-finite step's is, since
scales of 1 would have clipped or flushed what it computed.

What stays in the model's dtype: everything but the dense layers that call
``ops.dense`` and ``ops.mlp`` (attention's q/k/v and output projections
and the MLPs, of the backbone and of the denoising decoder): attention
itself, norms, the patch embedding, heads, the loss and the optimizer. The
parameters stay float32; their fp8 copies live only inside the step.

On CPU the products run emulated by XLA (the tests' use); on NVIDIA GPUs
from compute capability 8.9 (Ada, Hopper) on fp8 tensor cores; elsewhere
``check_backend`` refuses the option.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn   # activations and weights
E5M2 = jnp.float8_e5m2     # gradients


def _largest(fmt) -> float:
  return float(jnp.finfo(fmt).max)


def _to(x, scale, fmt):
  """``x / scale`` rounded to ``fmt``, clipped (a value that rounds past
  the largest finite one would become NaN in e4m3fn)."""
  return jnp.clip(x.astype(jnp.float32) / scale, -_largest(fmt), _largest(fmt)).astype(fmt)


def _scale(amax, fmt):
  """The scale that maps ``amax`` to ``fmt``'s largest value (1 for 0)."""
  return jnp.where(amax > 0, amax / _largest(fmt), jnp.float32(1.0))


def quantize(x, fmt):
  """``(q, scale)``: ``x`` in ``fmt`` with one float32 scale for the tensor."""
  scale = _scale(jnp.max(jnp.abs(x)).astype(jnp.float32), fmt)
  return _to(x, scale, fmt), scale


def quantize_rows(x, fmt, axes: int):
  """``(q, scales)``: ``x`` in ``fmt`` with one float32 scale per row, a
  row being the last ``axes`` axes (``scales`` has ``x``'s other axes)."""
  lead = x.ndim - axes
  amax = jnp.max(jnp.abs(x), axis=tuple(range(lead, x.ndim))).astype(jnp.float32)
  scales = _scale(amax, fmt)
  return _to(x, scales.reshape(scales.shape + (1,) * axes), fmt), scales


def _product(a, b, dims, dtype):
  """The float8 product of ``a`` and ``b`` over ``dims`` (dot_general's
  contracting dims), accumulated in float32, in ``dtype``."""
  return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=dtype)


def _scaled(y, scale, dtype):
  return (y.astype(jnp.float32) * scale).astype(dtype)


def dense(x, kernel, axes: int, dtype):
  """``x [..., *K] @ kernel [*K, *N] -> [..., *N]`` in ``dtype``, the last
  ``axes`` axes of ``x`` contracted with the first ``axes`` of ``kernel``,
  both inputs in e4m3 (module docstring). The gradients come back in the
  inputs' own dtypes (a float32 kernel gets a float32 gradient)."""
  return _dense(x, kernel, axes, jnp.dtype(dtype), jnp.dtype(x.dtype), jnp.dtype(kernel.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _dense(x, kernel, axes, dtype, x_dtype, kernel_dtype):
  return _dense_fwd(x, kernel, axes, dtype, x_dtype, kernel_dtype)[0]


def _dense_fwd(x, kernel, axes, dtype, x_dtype, kernel_dtype):
  del x_dtype, kernel_dtype
  xq, sx = quantize_rows(x, E4M3, axes)
  wq, sw = quantize(kernel, E4M3)
  y = _product(xq, wq, (tuple(range(x.ndim - axes, x.ndim)), tuple(range(axes))), dtype)
  out = kernel.ndim - axes
  y = _scaled(y, sx.reshape(sx.shape + (1,) * out) * sw, dtype)
  # The residuals are the fp8 copies: half the bytes of a bf16 input.
  return y, (xq, sx, wq, sw)


def _dense_bwd(axes, dtype, x_dtype, kernel_dtype, residuals, g):
  del dtype
  xq, sx, wq, sw = residuals
  gq, sg = quantize(g, E5M2)
  lead = xq.ndim - axes                       # x's row axes
  # dx = g @ kernel^T: g's output axes against the kernel's -> [..., *K].
  dx = _product(gq, wq, (tuple(range(lead, gq.ndim)), tuple(range(axes, wq.ndim))), x_dtype)
  dx = _scaled(dx, sg * sw, x_dtype)
  # dkernel = x^T @ g over the rows -> [*K, *N]: x re-rounded to one scale.
  top = jnp.max(sx)
  xt = _to(xq.astype(jnp.float32) * (sx / top).reshape(sx.shape + (1,) * axes), 1.0, E4M3)
  dkernel = _product(xt, gq, (tuple(range(lead)), tuple(range(lead))), kernel_dtype)
  return dx, _scaled(dkernel, top * sg, kernel_dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


# ----------------------------------------------------------- delayed scaling
#
# What benchmarks/RESULTS.md ("fp8") found faster than bf16 where the row
# scales above are not: the input's scale is known before the input is (it
# comes from the largest magnitudes of earlier steps), so quantizing fuses
# into the op that produces the input, and the product is XLA's pattern for
# one scaled fp8 GEMM (dequantize both inputs, then the dot). Scales are
# powers of two: dividing by one and dequantizing are exact in any float
# format, so only the fp8 rounding differs from the exact product, on the
# CPU as on the GPU. The kernel keeps a current scale (its own largest
# magnitude: one reduction over the weights, the same for every row and
# every batch). The input's scale comes from the history alone, so row i's
# output depends on row i only: a causal model stays causal and an
# evaluation does not depend on its batch.
#
# How a step updates the history: the history is an input of the product
# whose "gradient" is this step's record, the input's and the output
# gradient's largest magnitudes in column 0 and zeros elsewhere (the
# gradient's is known only in the backward pass, hence the record travels as
# a cotangent, as in Flax's fp8 ops); the train step then shifts the record
# in with :func:`updated_history`. A layer applied twice in one step sums
# its two records, which overstates the largest magnitude (a coarser scale,
# never a clipped value); microbatches must combine their records with a
# maximum, not a sum.

HISTORY = 16     # steps of largest magnitudes each scale is taken from
COLLECTION = "fp8"   # the Flax collection of the histories (models/layers.py, DenseParams)


def new_history():
  """``[2, HISTORY]`` float32 zeros: the largest magnitudes of a layer's
  input (row 0) and of its output's gradient (row 1) over the last
  ``HISTORY`` steps, newest first. An empty history gives the scale 1."""
  return jnp.zeros((2, HISTORY), jnp.float32)


def updated_history(history, record):
  """``history`` after a step whose record (the cotangent
  :func:`dense_delayed` gives its history) holds this step's largest
  magnitudes in column 0: the record shifted in, the oldest step out."""
  return jnp.concatenate([record[:, :1], history[:, :-1]], axis=1)


def updated_histories(histories, records):
  """:func:`updated_history` over a tree of histories (the ``fp8``
  collection) and their records (its cotangent)."""
  return jax.tree.map(updated_history, histories, records)


def combined_records(records):
  """One record from records stacked on a leading axis (a step's
  microbatches, train/accumulate.py): the largest magnitude of each, since
  a sum would overstate it and a mean understate it."""
  return jax.tree.map(lambda r: jnp.max(r, axis=0), records)


def warming(histories, records) -> jax.Array:
  """Whether a layer ran this step (its record is nonzero) on an empty
  history (a fresh state, or a checkpoint saved under bf16): its scales
  were 1, not its tensors', so the step only fills the histories (module
  docstring). A bool scalar; False for no histories."""
  empty = [(jnp.max(h[0]) == 0) & (jnp.max(r[0]) > 0)
           for h, r in zip(jax.tree.leaves(histories), jax.tree.leaves(records))]
  return jnp.any(jnp.stack(empty)) if empty else jnp.zeros((), bool)


def power_of_two_scale(amax, fmt):
  """The smallest power of two that maps ``amax`` into ``fmt``'s range (1
  for 0)."""
  exponent = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30) / _largest(fmt)))
  return jnp.where(amax > 0, jnp.exp2(exponent), jnp.float32(1.0))


def _dequantized(q, scale, dtype):
  return q.astype(dtype) * scale.astype(dtype)


def dense_delayed(x, kernel, history, axes: int, dtype):
  """``x [..., *K] @ kernel [*K, *N] -> [..., *N]`` in ``dtype`` on e4m3
  inputs (e5m2 gradient), the input's scale from ``history``
  (:func:`new_history`), the kernel's from itself; the cotangent of
  ``history`` is the step's record (see above). The gradients of ``x``
  and ``kernel`` come back in their own dtypes."""
  return _delayed(x, kernel, history, axes, jnp.dtype(dtype), jnp.dtype(x.dtype),
                  jnp.dtype(kernel.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _delayed(x, kernel, history, axes, dtype, x_dtype, kernel_dtype):
  return _delayed_fwd(x, kernel, history, axes, dtype, x_dtype, kernel_dtype)[0]


def _delayed_fwd(x, kernel, history, axes, dtype, x_dtype, kernel_dtype):
  del x_dtype, kernel_dtype
  sx = power_of_two_scale(jnp.max(history[0]), E4M3)
  sw = power_of_two_scale(jnp.max(jnp.abs(kernel)).astype(jnp.float32), E4M3)
  xq, wq = _to(x, sx, E4M3), _to(kernel, sw, E4M3)
  dims = (tuple(range(x.ndim - axes, x.ndim)), tuple(range(axes)))
  y = jax.lax.dot_general(_dequantized(xq, sx, dtype), _dequantized(wq, sw, dtype),
                          (dims, ((), ())))
  amax_x = jnp.max(jnp.abs(x)).astype(jnp.float32)
  return y, (xq, sx, wq, sw, amax_x, history)


def _delayed_bwd(axes, dtype, x_dtype, kernel_dtype, residuals, g):
  # Both products in the layer's dtype, as the bf16 layer computes them
  # (ops.dense casts the kernel first), each operand dequantized straight
  # from float8: XLA's pattern for a scaled fp8 GEMM.
  xq, sx, wq, sw, amax_x, history = residuals
  sg = power_of_two_scale(jnp.max(history[1]), E5M2)
  gq = _to(g, sg, E5M2)
  lead = xq.ndim - axes
  dx = jax.lax.dot_general(_dequantized(gq, sg, dtype), _dequantized(wq, sw, dtype),
                           ((tuple(range(lead, g.ndim)), tuple(range(axes, wq.ndim))),
                            ((), ())))
  dkernel = jax.lax.dot_general(_dequantized(xq, sx, dtype), _dequantized(gq, sg, dtype),
                                ((tuple(range(lead)), tuple(range(lead))), ((), ())))
  amax_g = jnp.max(jnp.abs(g)).astype(jnp.float32)
  record = jnp.zeros_like(history).at[:, 0].set(jnp.stack([amax_x, amax_g]))
  return dx.astype(x_dtype), dkernel.astype(kernel_dtype), record


_delayed.defvjp(_delayed_fwd, _delayed_bwd)


# Accelerators whose matrix units take fp8 inputs (the others would run the
# products emulated, slower than bf16): NVIDIA from compute capability 8.9.
def supports_fp8(device) -> bool:
  """Whether ``device`` runs fp8 products natively, or is the CPU (emulated:
  the tests)."""
  if device.platform == "cpu":
    return True
  if device.platform in ("gpu", "cuda"):
    major, _, minor = str(getattr(device, "compute_capability", "0.0")).partition(".")
    try:
      return (int(major), int(minor or 0)) >= (8, 9)
    except ValueError:
      return False
  return False


def check_backend(precision: str, device=None) -> None:
  """Refuses ``precision='fp8'`` on a device without fp8 matrix units, in
  one line that names the fix."""
  if precision != "fp8":
    return
  device = device or jax.devices()[0]
  if not supports_fp8(device):
    kind = getattr(device, "device_kind", device.platform)
    raise ValueError(
        f"precision='fp8' needs fp8 matrix units (NVIDIA GPUs of compute capability 8.9 or "
        f"later: Ada, Hopper); {kind} has none: run with --config.precision=bf16")
