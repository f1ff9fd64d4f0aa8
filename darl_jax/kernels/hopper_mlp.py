"""The ViT MLP's GELU inside its matrix products, as Hopper (sm_90) kernels.

XLA computes ``h = x W1 + b1`` with cuBLAS, then reads ``h`` back to write
``gelu(h)``, and in the backward writes ``dy W2^T`` only to read it back and
multiply by ``gelu'(h)``; cuBLAS's own GELU epilogue is the tanh
approximation, not the model's exact GELU, so XLA cannot fold either pass
into the GEMM. These two kernels do:

- ``dense_gelu(x, w1, b1) -> (gelu(h), gelu'(h))``: the fc1 product with the
  bias, GELU and GELU's derivative applied to each output tile while it is
  still in registers (the derivative is what the backward keeps of ``h``).
- ``matmul_scaled(dy, w2t, gelu'(h)) -> (dy w2t) * gelu'(h)``: the product
  that back-propagates through fc2, with the multiply in its epilogue; the
  matching derivative tile is fetched while the product runs.

Both are hopper_gemm.gemm (a persistent, ping-pong kernel; see there). The
epilogue is not hidden behind the other warpgroup's products (they slow
down while it runs), so it is written for the fewest operations on the
multiprocessor's quarter-rate pipe (special functions, conversions).

``mlp`` composes them into the MLP with a custom gradient. The backward
kernel also sums its output's columns (fc1's bias gradient) on the tensor
cores, so no pass of its own reads dh again; everything else (fc2, the
weight gradients, fc2's bias sum) stays XLA's. Elsewhere than on a Hopper
GPU the kernels run in Pallas's GPU interpret mode (slow, for tests). They
lengthen the training step's compilation several times over.

Use: ``kernels.mlp='hopper'`` (darl_jax/ops.py; the default on sm_90 in bf16).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from darl_jax.kernels.hopper_gemm import DEFAULT_TILING, Tiling, gemm

_SQRT_HALF = 2.0 ** -0.5
_INV_SQRT_2PI = (2.0 * math.pi) ** -0.5




@dataclasses.dataclass(frozen=True)
class MlpKernels:
  """The tilings of ``mlp``'s forward and backward kernels."""
  fwd: Tiling = Tiling()
  bwd: Tiling = Tiling()


DEFAULT_KERNELS = MlpKernels()


# erfc(z) ~= t (a1 + t (a2 + ... + t a5)) exp(-z^2), t = 1 / (1 + p z), z >= 0:
# Abramowitz & Stegun 7.1.26, absolute error below 1.5e-7. Mosaic GPU (jax
# 0.10 and 0.11) has no layout rule for erf; this form is built from the
# cheapest operations: 1 / (1 + p z) as rsqrt(.)^2 (its argument is >= 1)
# and exp as exp2, each one hardware approximation under approx_math.
# Taking Phi(x) = erfc(-x / sqrt 2) / 2 from it also avoids 1 + erf(x)'s
# cancellation in the far negative tail.
#
# The epilogue is throughput-bound (an on-device trace shows it outlasting
# the other warpgroup's products), and its scarce resource is the quarter-rate pipe that the two special functions
# and the float -> bf16 conversions share. So every constant is folded into
# another operation: with u = |x| sqrt(log2(e) / 2), exp(-x^2 / 2) / sqrt(2 pi)
# is exp2(log2(1 / sqrt(2 pi)) - u^2), one fused multiply-add into exp2,
# which gives phi(x) itself; p z is p' u; and the 1 / 2 of Phi(-|x|) = erfc /
# 2 and the sqrt(2 pi) that phi carries go into the coefficients a_i.
_AS_P = 0.3275911
_AS_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
_LOG2E = math.log2(math.e)
_U = math.sqrt(0.5 * _LOG2E)                    # u = |x| * _U, u^2 = x^2 log2(e) / 2
_P_U = _AS_P * _SQRT_HALF / _U                  # p z = _P_U u
_LOG2_INV_SQRT_2PI = math.log2(_INV_SQRT_2PI)
_A_PHI = tuple(a * 0.5 / _INV_SQRT_2PI for a in _AS_A)   # Phi(-|x|) = t poly(t) phi(x)


def _rsqrt_ftz(x):
  """rsqrt of a float32 array in the WGMMA layout, inside a Mosaic GPU
  kernel, as the flush-to-zero form of the hardware approximation. Mosaic
  emits ``rsqrt.approx.f32``, which ptxas brackets with a test and two
  rescales for denormal inputs; _cdf_pdf's argument is >= 1, so those are
  wasted on the epilogue's busiest pipes. (Goes through FragmentedArray's
  private pointwise helpers: jax 0.10-0.11 have no public way to pick the
  instruction; without them it falls back to the public form.
  tests/test_kernels.py lowers it.)"""
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                     return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32,
                                                        plgpu.Layout.WGMMA))
  def ftz(_, a):
    if not (hasattr(a, "_pointwise") and hasattr(a, "_lift_fast_instr")):
      return a.rsqrt(approx=True)   # a jax without the helpers: the public, non-ftz form
    return a._pointwise(a._lift_fast_instr("rsqrt.approx.ftz.f32"))
  return ftz(x)


def _cdf_pdf(x, rsqrt=lax.rsqrt):
  """(Phi(x), phi(x)) of the standard normal, float32: 2 special functions
  and 13 other operations (16 in the form before the constants were folded)."""
  u = jnp.abs(x) * _U
  r = rsqrt(1.0 + _P_U * u)
  t = r * r
  poly = _A_PHI[4]
  for a in _A_PHI[3::-1]:
    poly = a + t * poly
  pdf = jnp.exp2(_LOG2_INV_SQRT_2PI - u * u)
  tail = t * poly * pdf                          # Phi(-|x|)
  return jnp.where(x >= 0, 1.0 - tail, tail), pdf


def kernel_gelu(x):
  """GELU as the kernels evaluate it (within 1e-6 of ops.gelu)."""
  return x * _cdf_pdf(x)[0]


def kernel_gelu_grad(x):
  """GELU's derivative as the kernels evaluate it."""
  cdf, pdf = _cdf_pdf(x)
  return cdf + x * pdf


def _fwd_epilogue_for(interpret: bool) -> Callable:
  """dense_gelu's epilogue: with the flush-to-zero rsqrt on the GPU, the
  plain one in the interpreter (which runs no inline Mosaic GPU code)."""
  return functools.partial(_fwd_epilogue, rsqrt=lax.rsqrt if interpret else _rsqrt_ftz)


def _fwd_epilogue(acc, bias, _, rsqrt=lax.rsqrt):
  # The GELU of the float32 pre-activation. (The XLA MLP rounds h to bf16
  # first, as its fc1 output; doing that here would cost two conversions
  # per element on the epilogue's scarcest pipe, for a result one rounding
  # further from the float32 MLP.)
  h = acc + lax.broadcast_in_dim(bias, acc.shape, [1])
  cdf, pdf = _cdf_pdf(h, rsqrt)
  return h * cdf, cdf + h * pdf


def _scale_epilogue(acc, _, scale):
  return (acc * scale,)


def dense_gelu(x, w, b, *, tiling: Tiling = DEFAULT_TILING, interpret: bool = False):
  """``gelu(h)`` and ``gelu'(h)`` for ``h = x @ w + b``, both ``[M, N]`` bf16.

  The derivative is what the backward needs of ``h``: keeping it instead of
  ``h`` moves the derivative's arithmetic (two special-function calls and a
  dozen multiply-adds per element) out of the backward kernel's epilogue, at
  the price of one multiply-add here, where ``Phi(h)`` and ``phi(h)`` are
  computed anyway. Same memory. Rounding: both are of the float32 ``h``
  (the XLA MLP rounds ``h`` to bf16 first, as its fc1 output) and stored in
  bf16 (relative error 2^-9, the same as ``dh``'s own final rounding), where
  the XLA MLP evaluates the derivative in float32 in its backward; the
  backward's result moves by less than one bf16 ulp. x, w bf16, b any float.
  """
  return gemm(x, w, bias=b.astype(jnp.float32), epilogue=_fwd_epilogue_for(interpret), num_out=2,
               tiling=tiling, interpret=interpret)


def matmul_scaled(dy, wt, scale, *, col_sums: bool = False, tiling: Tiling = DEFAULT_TILING,
                  interpret: bool = False):
  """``dh = (dy @ wt) * scale``, ``[M, N]`` bf16: with ``scale = gelu'(h)``,
  the gradient at fc1's output. ``col_sums``: return ``(dh, sum(dh, 0))``
  instead, the sum (fc1's bias gradient) in float32 over dh's bf16 values,
  taken inside the kernel rather than by a pass of its own over dh."""
  out = gemm(dy, wt, aux=scale, epilogue=_scale_epilogue, num_out=1, col_sums=col_sums,
              tiling=tiling, interpret=interpret)
  if col_sums:
    return out[0], jnp.sum(out[1], axis=0)
  return out[0]


def _flat(x):
  return x.reshape(-1, x.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def mlp(x, w1, b1, w2, b2, kernels: MlpKernels = DEFAULT_KERNELS, interpret: bool = False):
  """``gelu(x @ w1 + b1) @ w2 + b2`` over the last axis of ``x``, in x's dtype (bf16).

  The same function as ops.mlp on XLA in bf16 (float32 accumulation, exact
  GELU evaluated in float32), with the GELU and its derivative inside the
  kernels above; the kernels take the GELU of the float32 pre-activation,
  where XLA's MLP (ops.mlp) rounds it to bf16 first.

  ``b2=None``: no fc2 bias here (no add, no gradient), for a caller that
  adds it elsewhere (ops.mlp without fc2's bias: kernels/fused_stack.py
  adds it in the next norm's kernel).
  """
  return _mlp_fwd(x, w1, b1, w2, b2, kernels, interpret)[0]


def _mlp_fwd(x, w1, b1, w2, b2, kernels, interpret):
  dt = x.dtype
  x2 = _flat(x)
  g, dg = dense_gelu(x2, w1.astype(dt), b1.astype(dt), tiling=kernels.fwd,
                     interpret=interpret)
  y = jnp.dot(g, w2.astype(dt))
  if b2 is not None:
    y = y + b2.astype(dt)
  return y.reshape(x.shape[:-1] + y.shape[-1:]), (x2, w1, b1, w2, b2, g, dg)


def _wgrad(x, g):
  """x^T g over the rows, as autodiff writes it (no transposed copy)."""
  return lax.dot_general(x, g, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _mlp_bwd(kernels, interpret, res, dy):
  x2, w1, b1, w2, b2, g, dg = res
  dt = x2.dtype
  dy2 = _flat(dy).astype(dt)
  dh, db1 = matmul_scaled(dy2, w2.astype(dt).T, dg, col_sums=True, tiling=kernels.bwd,
                          interpret=interpret)
  db2 = None if b2 is None else jnp.sum(dy2.astype(jnp.float32), axis=0).astype(b2.dtype)
  dx = lax.dot_general(dh, w1.astype(dt), (((1,), (1,)), ((), ())))
  return (dx.reshape(dy.shape[:-1] + x2.shape[-1:]), _wgrad(x2, dh).astype(w1.dtype),
          db1.astype(b1.dtype), _wgrad(g, dy2).astype(w2.dtype), db2)


mlp.defvjp(_mlp_fwd, _mlp_bwd)


__all__: Sequence[str] = ("Tiling", "DEFAULT_TILING", "MlpKernels", "DEFAULT_KERNELS",
                          "dense_gelu", "matmul_scaled", "mlp", "kernel_gelu",
                          "kernel_gelu_grad")
