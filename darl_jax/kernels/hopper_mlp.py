"""The ViT MLP's GELU inside its matrix products, as Hopper (sm_90) kernels.

Profiles of the pretraining step (benchmarks/RESULTS.md) put the exact GELU
and its derivative among the largest memory-bound kernels: XLA computes
``h = x W1 + b1`` with cuBLAS, then reads ``h`` back to write ``gelu(h)``,
and in the backward writes ``dy W2^T`` only to read it back and multiply by
``gelu'(h)``. cuBLAS's own GELU epilogue is the tanh approximation, not the
model's exact GELU, so XLA cannot fold either pass into the GEMM. These two
kernels do:

- ``dense_gelu(x, w1, b1) -> (gelu(h), gelu'(h))``: the fc1 product with the
  bias, GELU and GELU's derivative applied to each output tile while it is
  still in registers (the derivative is what the backward keeps of ``h``).
- ``matmul_scaled(dy, w2t, gelu'(h)) -> (dy w2t) * gelu'(h)``: the product
  that back-propagates through fc2, with the multiply in its epilogue; the
  matching derivative tile is fetched while the product runs.

Both are one Pallas Mosaic GPU kernel (``_gemm``): a persistent grid over
output tiles; per CTA one memory warpgroup streams A and B tiles into shared
memory through the bulk tensor copy engine, and two compute warpgroups take
alternate output tiles ("ping-pong": one's epilogue runs while the other's
``wgmma`` products do), each with a ``tile_m x tile_n`` float32
accumulator; the epilogue runs on ``epi x epi`` sub-tiles and stores
through shared memory with bulk copies.

``mlp`` composes them into the MLP with a custom gradient. The backward
kernel also sums its output's columns (fc1's bias gradient) on the tensor
cores, so no pass of its own reads dh again; everything else (fc2, the
weight gradients, fc2's bias sum) stays XLA's. The kernels need a Hopper
GPU; elsewhere they run in Pallas's GPU interpret mode (slow, for tests;
tests/test_kernels.py).

Use: ``model.mlp_impl='hopper'`` (models/vit.py). Measured on an H200 with
jax 0.11.2 (benchmarks/RESULTS.md, "fifth", "tenth" and "eleventh
session"): at the ViT-L/16 shape (batch 256), the forward 0.705 ms against
XLA's 0.98 and cuBLAS's plain product's 0.55, the backward with the bias
sum 0.70 ms against 1.03 + the sum; at ViT-H/14's (batch 192) 1.02 / 1.05 ms
against 1.40 / 1.47. The forward's epilogue (the GELU) is not hidden behind
the other warpgroup's products: an on-device trace of the kernel
(``trace_dir``) shows the tensor cores always fed, but the products run
slower while the other warpgroup's arithmetic runs, and at L/16 the
epilogue (8.6k cycles per tile) outlasts the other's products (about 8k).
So the epilogue is written for the fewest operations on the
multiprocessor's quarter-rate pipe (special functions, conversions).
Compiling the training step takes 100-135 s instead of about 20.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from darl_jax.kernels.mosaic import interpret_params, swizzled

_SQRT_HALF = 2.0 ** -0.5
_INV_SQRT_2PI = (2.0 * math.pi) ** -0.5


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Tile shapes of ``_gemm``: each compute warpgroup owns one ``tile_m x
  tile_n`` output tile at a time; ``stages`` shared-memory slots of A/B
  tiles of depth ``tile_k`` are in flight. ``ctas`` caps the grid (0: one CTA per
  multiprocessor, the persistent layout).

  ``ordered``: the two compute warpgroups take turns at their main loops
  (each starts its products only once the other has issued all of a
  tile's), so that one's epilogue always overlaps the other's products.
  Without it the turns come only from the order in which the ring's slots
  are filled, which lets the next tile's products start while this one's
  finish. Measured: no difference (0.753 / 0.754 ms at L/16,
  benchmarks/RESULTS.md, eleventh session; the ring already keeps the
  turns), so off by default.

  ``inflight``: how many k-steps' products a compute warpgroup leaves
  running when it moves on to the next step (``wgmma_wait(inflight)``);
  a slot is released only once its products are done, so the ring's
  look-ahead shrinks by the same number of slots. Measured: 2 is slower
  than 1 with 4 or 5 slots (eleventh session).
  """
  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 4
  epi: int = 64
  ctas: int = 0
  ordered: bool = False
  inflight: int = 1

  def check(self, m: int, n: int, k: int) -> None:
    problems = []
    if m % self.tile_m:
      problems.append(f"rows {m} (batch x tokens) by tile_m={self.tile_m}")
    if n % self.tile_n:
      problems.append(f"columns {n} by tile_n={self.tile_n}")
    if k % self.tile_k:
      problems.append(f"the inner dimension {k} by tile_k={self.tile_k}")
    if not 1 <= self.inflight < min(self.stages, k // self.tile_k + 1):
      problems.append(f"inflight={self.inflight} products in flight with {self.stages} "
                      f"slots and {k // self.tile_k} k-steps (want 1 <= inflight < both)")
    if self.tile_m % self.epi or self.tile_n % self.epi:
      problems.append(f"tile {self.tile_m}x{self.tile_n} by epi={self.epi}")
    if problems:
      raise ValueError(
          "the Hopper MLP kernels need divisible shapes; cannot divide "
          + "; ".join(problems)
          + ". Use the plain MLP (models.vit.Mlp) for this shape, or a batch "
          "size that makes batch x tokens a multiple of tile_m.")


DEFAULT_TILING = Tiling()


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
# The epilogue is throughput-bound (its trace, benchmarks/RESULTS.md,
# eleventh session: 10k cycles per tile against the products' 8k), and its
# scarce resource is the quarter-rate pipe that the two special functions
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
  """GELU as the kernels evaluate it (within 1e-6 of models.vit.gelu_exact)."""
  return x * _cdf_pdf(x)[0]


def kernel_gelu_grad(x):
  """GELU's derivative as the kernels evaluate it."""
  cdf, pdf = _cdf_pdf(x)
  return cdf + x * pdf


def _num_ctas(tiles: int, tiling: Tiling, interpret: bool) -> int:
  if tiling.ctas:
    return min(tiling.ctas, tiles)
  if interpret:
    return min(2, tiles)
  # One CTA per multiprocessor (132 on an H100 / H200 SXM).
  return min(getattr(jax.devices()[0], "core_count", 132), tiles)


def _gemm(a, b, *, epilogue: Callable, num_out: int, bias=None, aux=None,
          col_sums: bool = False, tiling: Tiling = DEFAULT_TILING, interpret: bool = False,
          trace_dir: str = ""):
  """``epilogue(a @ b, bias, aux)`` per output tile, in one kernel.

  ``a [M, K]`` and ``b [K, N]`` bf16; ``bias [N]`` float32 and ``aux [M, N]``
  bf16 are optional extra inputs whose matching slices reach the epilogue
  (bias as ``[epi]``, aux as float32 ``[epi, epi]``; None when not given).
  ``epilogue(acc, bias, aux)`` gets the float32 accumulator sub-tile and
  returns ``num_out`` arrays of the same shape; each becomes an ``[M, N]``
  bf16 output.

  ``col_sums`` (one output computed from aux only): also return the output's
  column sums per row of tiles, ``[M / tile_m, N]`` float32 (summing the
  bf16 values as stored, as ``jnp.sum(out.astype(float32), 0)`` does).
  They are taken on the tensor cores: once a sub-tile of the output sits in
  shared memory for its store, ``ones[epi, epi] @ sub_tile`` adds its
  column sums to every row of a small accumulator, and row 0 of that is
  stored. (A cross-warp ``jnp.sum`` in the epilogue needs Mosaic's
  reduction scratch, which another version of this kernel saw give wrong
  sums on the GPU.) The GPU interpreter runs no ``wgmma`` with a register
  operand, so there the sums are a plain ``jnp.sum`` of the same sub-tile.

  Schedule ("ping-pong"): a CTA walks its share of the output tiles in
  order; the memory warpgroup streams their A/B steps through one ring of
  ``stages`` shared-memory slots, and compute warpgroup ``j % 2`` consumes
  tile j's. The two compute warpgroups therefore work on different tiles,
  offset in time: one's epilogue (the GELU arithmetic and the stores, which
  a version with both warpgroups on halves of one tile ran with the tensor
  cores idle) overlaps the other's products. Each slot's "landed" barrier
  exists once per compute warpgroup, so every barrier has a single waiter
  that sees all of its phases (barrier_wait tracks phases per thread).

  ``trace_dir`` (GPU only; benchmarks/mlp_kernel_bench.py ``--trace``):
  record when each warpgroup enters and leaves its "mainloop" and
  "epilogue" regions (Mosaic GPU's on-device profiler, SM clock cycles) and
  write them there as a Chrome trace, one file per call.
  """
  t = tiling
  (m, k), n = a.shape, b.shape[1]
  if b.shape[0] != k:
    raise ValueError(f"inner dimensions differ: {a.shape} @ {b.shape}")
  t.check(m, n, k)
  dtype = a.dtype
  tm, tn, tk, depth = t.tile_m, t.tile_n, t.tile_k, t.stages
  m_iters, n_iters, k_iters = m // tm, n // tn, k // tk
  tiles = m_iters * n_iters
  ctas = _num_ctas(tiles, t, interpret)
  # Column-major order: a column of sub-tiles is finished before the next
  # (the column sums are taken per column of sub-tiles).
  subtiles = [(i, j) for j in range(tn // t.epi) for i in range(tm // t.epi)]
  n_sub = len(subtiles)
  in_transforms = swizzled(tk, dtype)
  epi_transforms = swizzled(t.epi, dtype)
  has_bias, has_aux = bias is not None, aux is not None
  # A single output computed from aux is written over its aux sub-tile in
  # shared memory and stored from there; other outputs go through two
  # sub-tile slots per warpgroup.
  in_place = has_aux and num_out == 1
  if col_sums and not in_place:
    raise ValueError("col_sums needs one output computed from aux (in place)")
  rows_per_col = tm // t.epi

  def as_layout(x, layout):   # the GPU interpreter has no layouts
    return x if interpret else plgpu.layout_cast(x, layout)

  def body(*refs):
    a_gmem, b_gmem = refs[:2]
    rest = list(refs[2:])
    bias_gmem = rest.pop(0) if has_bias else None
    aux_gmem = rest.pop(0) if has_aux else None
    outs = rest[:num_out]
    sums_gmem = rest[num_out] if col_sums else None
    sm = lax.axis_index("sm")
    local_tiles = (tiles - sm + ctas - 1) // ctas     # tiles sm, sm + ctas, ...

    def tile_origin(j):   # (row, column) of this CTA's j-th tile
      lin = sm + j * ctas
      # N fastest: CTAs running together share A's rows; B (a weight
      # matrix, a few MB) stays in L2.
      return (lin // n_iters) * tm, (lin % n_iters) * tn

    scratch = dict(
        a_smem=plgpu.SMEM((depth, tm, tk), dtype, transforms=in_transforms),
        b_smem=plgpu.SMEM((depth, tk, tn), dtype, transforms=in_transforms),
        aux_smem=(plgpu.SMEM((2, n_sub, t.epi, t.epi), dtype, transforms=epi_transforms)
                  if has_aux else None),
        out_smem=(None if in_place else
                  plgpu.SMEM((2, 2, num_out, t.epi, t.epi), dtype, transforms=epi_transforms)),
        bias_smem=plgpu.SMEM((2, tn), jnp.float32) if has_bias else None,
        full=plgpu.Barrier(num_arrivals=2, num_barriers=2 * depth),  # [consumer, slot]: A, B landed
        empty=plgpu.Barrier(num_arrivals=1, num_barriers=depth),     # slot consumed
        aux_barriers=plgpu.Barrier(num_barriers=2 * n_sub) if has_aux else None,
        # [wg]: warpgroup wg may start its next main loop (t.ordered)
        turn=plgpu.Barrier(num_arrivals=1, num_barriers=2) if t.ordered else None,
        bias_barriers=plgpu.Barrier(num_barriers=2) if has_bias else None,
        # [epi, epi] float32 per compute warpgroup: a column-sum accumulator
        # (every row the same) on its way to the output's row of sums.
        sums_smem=(plgpu.SMEM((2, t.epi, t.epi), jnp.float32) if col_sums else None),
    )

    @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
    def _scope(a_smem, b_smem, aux_smem, out_smem, bias_smem, full, empty, aux_barriers,
               turn, bias_barriers, sums_smem):

      def producer():
        plgpu.set_max_registers(40, action="decrease")

        @pl.loop(0, local_tiles)
        def _tile(j):
          row, col = tile_origin(j)

          @pl.loop(0, k_iters)
          def _step(kk):
            step = j * k_iters + kk
            slot = step % depth

            @pl.when(step >= depth)
            def _():
              plgpu.barrier_wait(empty.at[slot])

            landed = full.at[(j % 2) * depth + slot]
            plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(row, tm), pl.ds(kk * tk, tk)],
                                    a_smem.at[slot], landed)
            plgpu.copy_gmem_to_smem(b_gmem.at[pl.ds(kk * tk, tk), pl.ds(col, tn)],
                                    b_smem.at[slot], landed)

        # Observe the last releases too, so every barrier ends in a known
        # phase (the interpreter checks that each waiter saw every phase).
        steps = local_tiles * k_iters

        @pl.loop(jnp.maximum(steps - depth, 0), steps)
        def _drain(step):
          plgpu.barrier_wait(empty.at[step % depth])

      def consumer(wg):
        plgpu.set_max_registers(232, action="increase")

        @pl.loop(0, (local_tiles - wg + 1) // 2)
        def _tile(q):
          row, col = tile_origin(wg + 2 * q)
          first = (wg + 2 * q) * k_iters   # the ring's step count before this tile

          def sub(ref, i, j):   # the (i, j) epilogue sub-tile of an [M, N] array
            return ref.at[pl.ds(row + i * t.epi, t.epi), pl.ds(col + j * t.epi, t.epi)]

          def column_sums(tile_row, first_col, tiles_smem):
            """Row ``tile_row`` of the sums at columns ``first_col + [0, epi)``:
            the column sums of the bf16 sub-tiles ``tiles_smem`` (each
            ``[epi, epi]``, already written and fenced)."""
            stage = sums_smem.at[wg]
            if interpret:
              total = sum(jnp.sum(r[...].astype(jnp.float32), axis=0, keepdims=True)
                          for r in tiles_smem)
              stage[pl.ds(0, 1), :] = total
            else:
              ones = plgpu.layout_cast(jnp.ones((t.epi, t.epi), dtype), plgpu.Layout.WGMMA)

              @functools.partial(pl.run_scoped, sums_acc=plgpu.ACC((t.epi, t.epi), jnp.float32))
              def _sums(sums_acc):
                for r in tiles_smem:
                  plgpu.wgmma(sums_acc, ones, r)
                plgpu.wgmma_wait(0)
                # The stage's last store: issued before this column's stores.
                plgpu.wait_smem_to_gmem(rows_per_col, wait_read_only=True)
                stage[...] = sums_acc[...]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stage.at[pl.ds(0, 1)],
                                    sums_gmem.at[pl.ds(tile_row, 1), pl.ds(first_col, t.epi)])

          # Fetch the bias / aux slices while the product runs.
          if has_aux:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # last tile's stores read them
          plgpu.commit_smem()   # and our reads of these buffers come first
          if has_bias:
            plgpu.copy_gmem_to_smem(bias_gmem.at[pl.ds(col, tn)], bias_smem.at[wg],
                                    bias_barriers.at[wg])
          if has_aux:
            for s, (i, j) in enumerate(subtiles):
              plgpu.copy_gmem_to_smem(sub(aux_gmem, i, j), aux_smem.at[wg, s],
                                      aux_barriers.at[wg * n_sub + s])

          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
          def _acc(acc_ref):
            j = wg + 2 * q   # this tile's index among the CTA's
            if t.ordered:   # the other warpgroup has issued its previous tile's products
              @pl.when(j > 0)
              def _():
                plgpu.barrier_wait(turn.at[wg])

            with jax.named_scope("mainloop"):
              @pl.loop(0, k_iters)
              def _step(kk):
                step = first + kk
                plgpu.barrier_wait(full.at[wg * depth + step % depth])
                plgpu.wgmma(acc_ref, a_smem.at[step % depth], b_smem.at[step % depth])
                # The product t.inflight steps back is done: free its slot.
                plgpu.wgmma_wait(t.inflight)

                @pl.when(kk >= t.inflight)
                def _():
                  plgpu.barrier_arrive(empty.at[(step - t.inflight) % depth])

            if t.ordered:   # the other's turn, if it has a next tile
              @pl.when(j + 1 < local_tiles)
              def _():
                plgpu.barrier_arrive(turn.at[1 - wg])

            with jax.named_scope("epilogue"):
              plgpu.wgmma_wait(0)
              for r in range(t.inflight, 0, -1):
                plgpu.barrier_arrive(empty.at[(first + k_iters - r) % depth])
              acc = acc_ref[...]

              if has_bias:
                plgpu.barrier_wait(bias_barriers.at[wg])
              for s, (i, j) in enumerate(subtiles):
                tile = acc[i * t.epi:(i + 1) * t.epi, j * t.epi:(j + 1) * t.epi]
                bias_tile = aux_tile = None
                if has_bias:
                  bias_tile = as_layout(bias_smem[wg, pl.ds(j * t.epi, t.epi)],
                                        plgpu.Layout.WGMMA.reduce(0))
                if has_aux:
                  plgpu.barrier_wait(aux_barriers.at[wg * n_sub + s])
                  aux_tile = as_layout(aux_smem[wg, s], plgpu.Layout.WGMMA).astype(jnp.float32)
                results = epilogue(tile, bias_tile, aux_tile)
                if in_place:
                  aux_smem[wg, s] = results[0].astype(dtype)
                  plgpu.commit_smem()
                  plgpu.copy_smem_to_gmem(aux_smem.at[wg, s], sub(outs[0], i, j))
                  if col_sums and i == rows_per_col - 1:   # this column of sub-tiles is stored
                    column_sums(row // tm, col + j * t.epi,
                                [aux_smem.at[wg, s - r] for r in range(rows_per_col)])
                else:
                  slot = s % 2
                  plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # this slot's last stores
                  for o, r in enumerate(results):
                    out_smem[wg, slot, o] = r.astype(dtype)
                  plgpu.commit_smem()
                  for o in range(num_out):
                    plgpu.copy_smem_to_gmem(out_smem.at[wg, slot, o], sub(outs[o], i, j),
                                            commit_group=o == num_out - 1)

        plgpu.wait_smem_to_gmem(0)

      wg = lax.axis_index("wg")
      lax.cond(wg == 2, producer, lambda: consumer(wg))

  inputs = [a, b] + ([bias] if has_bias else []) + ([aux] if has_aux else [])
  out_type = [jax.ShapeDtypeStruct((m, n), dtype) for _ in range(num_out)]
  if col_sums:
    out_type.append(jax.ShapeDtypeStruct((m_iters, n), jnp.float32))
  kernel = plgpu.kernel(
      body,
      out_type=tuple(out_type),
      grid=(ctas,), grid_names=("sm",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True,
          # two regions per tile, a CTA's tiles split between two warpgroups
          **(dict(profile_space=2 * (tiles // ctas + 2), profile_dir=trace_dir)
             if trace_dir else {})),
      interpret=interpret_params(interpret))
  return kernel(*inputs)


def _fwd_epilogue_for(interpret: bool) -> Callable:
  """dense_gelu's epilogue: with the flush-to-zero rsqrt on the GPU, the
  plain one in the interpreter (which runs no inline Mosaic GPU code)."""
  return functools.partial(_fwd_epilogue, rsqrt=lax.rsqrt if interpret else _rsqrt_ftz)


def _fwd_epilogue(acc, bias, _, rsqrt=lax.rsqrt):
  # The GELU of the float32 pre-activation. (The XLA MLP rounds h to bf16
  # first, as its fc1 output; doing that here cost two conversions per
  # element on the epilogue's scarcest pipe, benchmarks/RESULTS.md, eleventh
  # session, for a result one rounding further from the float32 MLP.)
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
  return _gemm(x, w, bias=b.astype(jnp.float32), epilogue=_fwd_epilogue_for(interpret), num_out=2,
               tiling=tiling, interpret=interpret)


def matmul_scaled(dy, wt, scale, *, col_sums: bool = False, tiling: Tiling = DEFAULT_TILING,
                  interpret: bool = False):
  """``dh = (dy @ wt) * scale``, ``[M, N]`` bf16: with ``scale = gelu'(h)``,
  the gradient at fc1's output. ``col_sums``: return ``(dh, sum(dh, 0))``
  instead, the sum (fc1's bias gradient) in float32 over dh's bf16 values,
  taken inside the kernel rather than by a pass of its own over dh."""
  out = _gemm(dy, wt, aux=scale, epilogue=_scale_epilogue, num_out=1, col_sums=col_sums,
              tiling=tiling, interpret=interpret)
  if col_sums:
    return out[0], jnp.sum(out[1], axis=0)
  return out[0]


def _flat(x):
  return x.reshape(-1, x.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def mlp(x, w1, b1, w2, b2, kernels: MlpKernels = DEFAULT_KERNELS, interpret: bool = False):
  """``gelu(x @ w1 + b1) @ w2 + b2`` over the last axis of ``x``, in x's dtype (bf16).

  The same function as models.vit.Mlp in bf16 (float32 accumulation, exact
  GELU evaluated in float32), with the GELU and its derivative inside the
  kernels above; the kernels take the GELU of the float32 pre-activation,
  where models.vit.Mlp rounds it to bf16 first.

  ``b2=None``: no fc2 bias here (no add, no gradient), for a caller that
  adds it elsewhere (models.vit.Mlp's ``defer_bias``: in the next norm's
  kernel).
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
