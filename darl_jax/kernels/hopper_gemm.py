"""A persistent Hopper (sm_90) matrix product with its epilogue in registers.

``gemm(a, b, epilogue=...)`` computes ``a @ b`` tile by tile and hands each
float32 output sub-tile to an elementwise ``epilogue`` before it is stored,
so work that XLA would do in a pass of its own over the product (a bias, an
activation, a rotation) is done while the product is still in registers.
Its users: the ViT MLP's GELU kernels (hopper_mlp.py) and the q/k/v
projection with its bias and RoPE (hopper_attention.project_qkv).

One Pallas Mosaic GPU kernel: a persistent grid over output tiles; per CTA
one memory warpgroup streams A and B tiles into shared memory through the
bulk tensor copy engine, and two compute warpgroups take alternate output
tiles ("ping-pong": one's epilogue runs while the other's ``wgmma`` products
do), each with a ``tile_m x tile_n`` float32 accumulator; the epilogue runs
on ``epi x epi`` sub-tiles and stores through shared memory with bulk
copies. Elsewhere than on a Hopper GPU it runs in Pallas's GPU interpret
mode (slow, for tests).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from darl_jax.kernels.mosaic import interpret_params, swizzled


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Tile shapes of ``gemm``: each compute warpgroup owns one ``tile_m x
  tile_n`` output tile at a time; ``stages`` shared-memory slots of A/B
  tiles of depth ``tile_k`` are in flight. ``ctas`` caps the grid (0: one CTA per
  multiprocessor, the persistent layout).

  ``ordered``: the two compute warpgroups take turns at their main loops
  (each starts its products only once the other has issued all of a
  tile's), so that one's epilogue always overlaps the other's products.
  Without it the turns come only from the order in which the ring's slots
  are filled, which lets the next tile's products start while this one's
  finish. Off by default: the ring already keeps the turns, and timing
  showed no difference.

  ``inflight``: how many k-steps' products a compute warpgroup leaves
  running when it moves on to the next step (``wgmma_wait(inflight)``);
  a slot is released only once its products are done, so the ring's
  look-ahead shrinks by the same number of slots; 1 is the faster one.
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
          "the Hopper GEMM kernels need divisible shapes; cannot divide "
          + "; ".join(problems)
          + ". Use a batch size that makes batch x tokens a multiple of tile_m, "
          "or XLA's path for this shape (the plain MLP, kernels.mlp='xla'; the "
          "attention's own projection, causal_attention_qkv).")


DEFAULT_TILING = Tiling()


def _num_ctas(tiles: int, tiling: Tiling, interpret: bool) -> int:
  if tiling.ctas:
    return min(tiling.ctas, tiles)
  if interpret:
    return min(2, tiles)
  # One CTA per multiprocessor (132 on an H100 / H200 SXM).
  return min(getattr(jax.devices()[0], "core_count", 132), tiles)


def gemm(a, b, *, epilogue: Callable, num_out: int, bias=None, aux=None,
         col_sums: bool = False, row_tables: Sequence = (), table_entry: Callable | None = None,
         out_pieces: int = 1, tiling: Tiling = DEFAULT_TILING, interpret: bool = False,
         trace_dir: str = ""):
  """``epilogue(a @ b, bias, aux[, *tables])`` per output tile, in one kernel.

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

  ``row_tables``: float32 ``[entries, tile_m, w]`` arrays, tables indexed
  by row (RoPE's cos and sin for the rows' positions): for each output tile
  at ``(row, col)`` the kernel fetches entry ``table_entry(row, col)`` of
  each (while the product runs), and the epilogue gets the sub-tile's rows
  of them as extra arguments, ``epilogue(acc, bias, aux, *tables)``, each
  ``[epi, w]``.

  ``out_pieces``: the epilogue returns each output as that many column
  pieces ``[epi, epi / out_pieces]`` (a tuple), stored side by side; a
  kernel that works on the halves of a sub-tile (RoPE's rotation: columns
  ``c`` and ``c + epi / 2`` sit in the same thread in the accumulator's
  layout) needs no way to join them in registers.

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
  has_tables = bool(row_tables)
  if has_tables and table_entry is None:
    raise ValueError("row_tables need table_entry(row, col), the entry a tile uses")
  if t.epi % out_pieces or (in_place and out_pieces != 1):
    raise ValueError(f"out_pieces={out_pieces} must divide epi={t.epi} (and be 1 for an "
                     "output computed in place over aux)")
  piece = t.epi // out_pieces
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
    tables_gmem = [rest.pop(0) for _ in row_tables]
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
                  plgpu.SMEM((2, 2, num_out, out_pieces, t.epi, piece), dtype,
                             transforms=swizzled(piece, dtype))),
        # [table][wg]: the tile's rows of each row table
        tables_smem=[plgpu.SMEM((2,) + tab.shape[1:], jnp.float32,
                                transforms=swizzled(tab.shape[2], jnp.float32))
                     for tab in row_tables],
        table_barriers=(plgpu.Barrier(num_arrivals=len(row_tables), num_barriers=2)
                        if has_tables else None),
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
               turn, bias_barriers, sums_smem, tables_smem, table_barriers):

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
          if has_tables:
            entry = table_entry(row, col)
            for tab, tab_smem in zip(tables_gmem, tables_smem):
              plgpu.copy_gmem_to_smem(tab.at[entry], tab_smem.at[wg], table_barriers.at[wg])

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
              if has_tables:
                plgpu.barrier_wait(table_barriers.at[wg])
              for s, (i, j) in enumerate(subtiles):
                tile = acc[i * t.epi:(i + 1) * t.epi, j * t.epi:(j + 1) * t.epi]
                bias_tile = aux_tile = None
                if has_bias:
                  bias_tile = as_layout(bias_smem[wg, pl.ds(j * t.epi, t.epi)],
                                        plgpu.Layout.WGMMA.reduce(0))
                if has_aux:
                  plgpu.barrier_wait(aux_barriers.at[wg * n_sub + s])
                  aux_tile = as_layout(aux_smem[wg, s], plgpu.Layout.WGMMA).astype(jnp.float32)
                tables = [as_layout(tab_smem[wg, pl.ds(i * t.epi, t.epi)], plgpu.Layout.WGMMA)
                          for tab_smem in tables_smem]
                results = epilogue(tile, bias_tile, aux_tile, *tables)
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
                    for p, r_piece in enumerate(r if out_pieces > 1 else (r,)):
                      out_smem[wg, slot, o, p] = r_piece.astype(dtype)
                  plgpu.commit_smem()
                  for o in range(num_out):
                    for p in range(out_pieces):
                      dst = outs[o].at[pl.ds(row + i * t.epi, t.epi),
                                       pl.ds(col + j * t.epi + p * piece, piece)]
                      plgpu.copy_smem_to_gmem(
                          out_smem.at[wg, slot, o, p], dst,
                          commit_group=o == num_out - 1 and p == out_pieces - 1)

        plgpu.wait_smem_to_gmem(0)

      wg = lax.axis_index("wg")
      lax.cond(wg == 2, producer, lambda: consumer(wg))

  inputs = ([a, b] + ([bias] if has_bias else []) + ([aux] if has_aux else [])
            + list(row_tables))
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


__all__: Sequence[str] = ("Tiling", "DEFAULT_TILING", "gemm")
