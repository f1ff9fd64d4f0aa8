"""Causal attention over short image sequences, as Hopper (sm_90) kernels.

The pretraining step's attention is ``batch x heads`` independent causal
problems of only 196 (ViT-L/16) or 256 (ViT-H/14) tokens. cuDNN's flash
kernels run them at about 50 TFLOP/s in the backward (benchmarks/RESULTS.md:
11.2 of 105.8 ms per ViT-L/16 step): their tiles are sized for long
sequences, and 196 tokens leave most of a 128-row tile empty.

These kernels see the batch as one long sequence of ``B * T`` tokens with a
block-diagonal causal mask (token r attends to token c when both are in the
same image and c <= r). Tiles are 64 rows of that flat sequence: no padding,
no copy (``[B, T, H, D] -> [B * T, H, D]`` is a reshape), every tile a full
``wgmma`` and every copy in bounds; a tile that straddles two images is
masked per row. A 64-row query tile needs at most ``ceil(T / 64) + 1`` key
tiles, so each CTA streams a handful of tiles and many CTAs share a
multiprocessor.

Three kernels, each a grid of (64-row tile, head) with one warpgroup that
issues its own tile copies and waits on them per slot:

- ``_forward``: O and the row log-sum-exp (base 2), the online softmax over
  the query tile's key tiles;
- ``_dq``: dQ for a query tile, streaming its key/value tiles; it also
  writes ``delta = rowsum(dO * O)``, the softmax backward's row term;
- ``_dkv``: dK and dV for a key tile, streaming the query tiles that see it
  (with dO, the log-sum-exp and delta).

Splitting dQ from dK/dV recomputes two products per tile pair but needs no
atomics. Probabilities and score gradients stay in registers as the next
product's A operand, and independent products are issued together (one
wait). With 2 slots (the default) a CTA needs under 60 KB of shared memory
at head dim 64, so several share a multiprocessor and hide each other's
latencies.

``causal_attention`` wraps them with a custom gradient. Use:
``model.attention_impl='hopper'`` (models/attention.py), which keeps cuDNN for
what these kernels do not cover (non-causal attention, masks, other shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from darl_jax.kernels.mosaic import interpret_params, swizzled

BLOCK = 64            # rows of every tile: one wgmma M, and a 128-byte bf16 row at D = 64
_LOG2E = math.log2(math.e)
_M_INIT = -1e30       # running max before any key: finite, so exp2(m_old - m_new) is 0, not NaN


@dataclasses.dataclass(frozen=True)
class AttentionTiling:
  """``slots``: shared-memory slots for the streamed tiles; 0 gives each of a
  CTA's streamed tiles its own slot (all copies issued up front). Fewer
  slots use less shared memory (more CTAs per multiprocessor) and refill a
  slot once its tile is done."""
  slots: int = 2


# slots=2 measured fastest at ViT-L/16 sizes (H200; benchmarks/RESULTS.md):
# fwd + bwd 0.377 ms per layer at batch 128, against 0.390 with 3 slots and
# 0.425 with every tile in its own slot.
DEFAULT_ATTENTION_TILING = AttentionTiling()


def check_shapes(q, k, v) -> None:
  """Errors that name the fix for inputs the kernels do not take."""
  problems = []
  if not (q.shape == k.shape == v.shape) or q.ndim != 4:
    problems.append(f"q, k, v must share one [batch, tokens, heads, head_dim] shape, got "
                    f"{q.shape}, {k.shape}, {v.shape}")
  else:
    b, t, _, d = q.shape
    # wgmma takes bf16 operands 16 deep and at most 256 wide; shared-memory
    # rows of other than 128 bytes get a narrower swizzle (head_dim 80, as
    # in ViT-H/14: 160-byte rows, 32-byte swizzle).
    if d % 16 or d > 256:
      problems.append(f"head_dim {d} is not a multiple of 16 up to 256")
    if t < BLOCK:
      problems.append(f"{t} tokens is under one {BLOCK}-row tile")
    if (b * t) % BLOCK:
      problems.append(f"batch x tokens = {b * t} is not a multiple of {BLOCK} "
                      f"(pick a batch size that makes it one)")
  if any(x.dtype != jnp.bfloat16 for x in (q, k, v)):
    problems.append("q, k, v must be bfloat16")
  if problems:
    raise ValueError("the Hopper attention kernels cannot run this input: "
                     + "; ".join(problems)
                     + ". Use model.attention_impl='cudnn' or 'xla' for it.")


def fits(q, k, v) -> bool:
  try:
    check_shapes(q, k, v)
  except ValueError:
    return False
  return True


def _q_span(i, seg: int):
  """Key tiles of query tile ``i``: (first, count). Works on ints and tracers."""
  lo = (i * BLOCK // seg * seg) // BLOCK
  return lo, i - lo + 1


def _kv_span(c, seg: int):
  """Query tiles that see key tile ``c``: (first, count)."""
  end = ((c * BLOCK + BLOCK - 1) // seg + 1) * seg     # end of the last key row's image
  return c, (end - 1) // BLOCK - c + 1


def _max_span(span, tiles: int, seg: int) -> int:
  return max(span(i, seg)[1] for i in range(tiles))


def _mask(q0, k0, seg: int, transposed: bool, iota):
  """Which (query, key) pairs attend: same image and key <= query.

  ``q0``/``k0`` are the tiles' first flat rows; ``transposed`` puts keys on
  the rows (the dK/dV kernel works on S^T). A 64-row tile spans at most two
  images (T >= 64), so each query's image starts at one of two places.
  """
  qr = q0 + iota((BLOCK, BLOCK), 1 if transposed else 0)
  kr = k0 + iota((BLOCK, BLOCK), 0 if transposed else 1)
  first = q0 // seg * seg
  start = jnp.where(qr >= first + seg, first + seg, first)
  return (kr <= qr) & (kr >= start)


class _Ops:
  """Layout-aware helpers; the GPU interpreter has no layouts and no
  Mosaic iota, so there they are plain jax."""

  def __init__(self, interpret: bool):
    self.interpret = interpret

  def cast(self, x, layout):
    return x if self.interpret else plgpu.layout_cast(x, layout)

  def iota(self, shape, dim):
    if self.interpret:
      return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

  def zeros(self, shape):
    return self.cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)

  def rows(self, ref):     # a [64] float32 per-row vector from shared memory
    return self.cast(ref[...], plgpu.Layout.WGMMA.reduce(1))

  def cols(self, ref):     # the same, one value per column
    return self.cast(ref[...], plgpu.Layout.WGMMA.reduce(0))


@dataclasses.dataclass(frozen=True)
class _Mm:
  """One product ``acc + a @ b`` (``a @ b^T`` when ``b_t``): ``a`` a
  shared-memory tile or a bf16 register array (probabilities, score
  gradients), ``b`` a shared-memory tile, ``acc`` a float32 running sum or
  None (zeros)."""
  a: object
  b: object
  b_t: bool = False
  acc: object = None


def _products(mms: Sequence[_Mm], ops: "_Ops"):
  """Issue every product, wait once, return their float32 results.

  On the GPU each is a ``wgmma`` into an accumulator initialised with its
  running sum; issuing independent products together costs one wait for
  all. The GPU interpreter runs neither ``wgmma`` on a transposed view or
  a register operand nor ``pl.run_state``, so there each is a plain dot of
  the same tiles. The tests (interpreter) check everything around the
  products; the products themselves are checked on the GPU
  (benchmarks/attention_kernel_bench.py, pretrain_benchmark.py --check).
  """
  def rows_cols(mm):
    b_shape = mm.b.shape
    return mm.a.shape[0], b_shape[0] if mm.b_t else b_shape[1]

  if ops.interpret:
    outs = []
    for mm in mms:
      a = mm.a if isinstance(mm.a, jax.Array) else mm.a[...]
      b = mm.b[...].T if mm.b_t else mm.b[...]
      out = jnp.dot(a, b, preferred_element_type=jnp.float32)
      outs.append(out if mm.acc is None else mm.acc + out)
    return outs

  def body(acc_refs):
    for mm, ref in zip(mms, acc_refs):
      plgpu.wgmma(ref, mm.a, plgpu.transpose_ref(mm.b, (1, 0)) if mm.b_t else mm.b)
  inits = tuple(plgpu.ACC.init(ops.zeros(rows_cols(mm)) if mm.acc is None else mm.acc)
                for mm in mms)
  return list(pl.run_state(body)(inits))


@dataclasses.dataclass(frozen=True)
class _Geometry:
  """What a kernel derives from its ``[N, H, D]`` inputs: tile counts, the
  number of streaming slots, and the shapes of its buffers."""
  rows: int
  heads: int
  d: int
  slots: int
  dtype: object

  @classmethod
  def of(cls, q, seg: int, tiling: AttentionTiling, span):
    """``span``: _q_span or _kv_span, the tiles a CTA streams."""
    rows, heads, d = q.shape
    longest = _max_span(span, rows // BLOCK, seg)
    return cls(rows, heads, d, min(tiling.slots, longest) if tiling.slots else longest, q.dtype)

  @property
  def scale(self) -> float:
    return self.d ** -0.5

  def tile(self, slotted: bool = False):
    """Shared memory for one ``[64, D]`` tile (one per slot if ``slotted``)."""
    return plgpu.SMEM(((self.slots,) if slotted else ()) + (BLOCK, self.d), self.dtype,
                      transforms=swizzled(self.d, self.dtype))

  def vector(self, slotted: bool = False):
    """Shared memory for one tile's per-row float32 values."""
    return plgpu.SMEM(((self.slots,) if slotted else ()) + (BLOCK,), jnp.float32)

  def tiles_out(self):
    return jax.ShapeDtypeStruct((self.rows, self.heads, self.d), self.dtype)

  def vector_out(self):
    return jax.ShapeDtypeStruct((self.heads, self.rows), jnp.float32)

  def call(self, body, *, inputs, out_type, scratch, interpret: bool):
    """``body(*input refs, *output refs, *scratch)`` on a (tile, head) grid."""
    def entry(*refs):
      pl.run_scoped(lambda *s: body(*refs, *s), *scratch)
    return plgpu.kernel(
        entry, out_type=out_type, grid=(self.rows // BLOCK, self.heads),
        grid_names=("tile", "head"),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True),
        interpret=interpret_params(interpret))(*inputs)


def _fetcher(first, h, bar, tiles=(), vectors=()):
  """``fetch(j, slot)``: copy streamed tile ``first + j`` of head ``h`` into
  ``slot``, for each (gmem, smem) pair of ``tiles`` (``[N, H, D]`` arrays)
  and ``vectors`` (``[H, N]`` per-row values), all landing on ``bar[slot]``."""
  def fetch(j, slot):
    rows = pl.ds((first + j) * BLOCK, BLOCK)
    for gmem, smem in tiles:
      plgpu.copy_gmem_to_smem(gmem.at[rows, h], smem.at[slot], bar.at[slot])
    for gmem, smem in vectors:
      plgpu.copy_gmem_to_smem(gmem.at[h, rows], smem.at[slot], bar.at[slot])
  return fetch


def _stream(n, slots: int, fetch, step, carry):
  """Run ``step(j, slot, carry)`` over streamed tiles ``j < n`` (dynamic),
  ``fetch(j, slot)`` issuing tile j's copies: the first ``slots`` up front,
  each later one into the slot its predecessor just freed. The caller's
  step waits on its slot's barrier; one warpgroup is both producer and sole
  waiter, so a reused barrier's phases are seen in order."""
  @pl.loop(0, jnp.minimum(n, slots))
  def _(j):
    fetch(j, j % slots)

  def body(j, carry):
    slot = j % slots
    carry = step(j, slot, carry)

    @pl.when(j + slots < n)
    def _():
      fetch(j + slots, slot)
    return carry
  return lax.fori_loop(0, n, body, carry)


def _forward(q, k, v, seg: int, tiling: AttentionTiling, interpret: bool):
  """q, k, v ``[N, H, D]`` -> (O ``[N, H, D]``, log2-sum-exp ``[H, N]`` float32)."""
  g = _Geometry.of(q, seg, tiling, _q_span)
  ops = _Ops(interpret)

  def body(q_ref, k_ref, v_ref, o_ref, lse_ref,
           q_smem, k_smem, v_smem, lse_smem, q_bar, kv_bar):
    i, h = lax.axis_index("tile"), lax.axis_index("head")
    q0 = i * BLOCK
    lo, n = _q_span(i, seg)
    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q0, BLOCK), h], q_smem, q_bar.at[0])
    fetch = _fetcher(lo, h, kv_bar, tiles=((k_ref, k_smem), (v_ref, v_smem)))

    def step(j, slot, carry):
      acc, m, l = carry
      plgpu.barrier_wait(kv_bar.at[slot])
      s, = _products([_Mm(q_smem, k_smem.at[slot], b_t=True)], ops)
      s = s * (g.scale * _LOG2E)
      keep = _mask(q0, (lo + j) * BLOCK, seg, False, ops.iota)
      s = jnp.where(keep, s, -jnp.inf)
      m_new = jnp.maximum(m, s.max(axis=1))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
      l = l * alpha + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      acc, = _products([_Mm(p.astype(q_smem.dtype), v_smem.at[slot], acc=acc)], ops)
      return acc, m_new, l

    plgpu.barrier_wait(q_bar.at[0])
    row = plgpu.Layout.WGMMA.reduce(1)
    carry = (ops.zeros((BLOCK, g.d)),
             ops.cast(jnp.full((BLOCK,), _M_INIT, jnp.float32), row),
             ops.cast(jnp.zeros((BLOCK,), jnp.float32), row))
    acc, m, l = _stream(n, g.slots, fetch, step, carry)
    out = acc / lax.broadcast_in_dim(l, acc.shape, [0])
    q_smem[...] = out.astype(q_smem.dtype)        # Q is no longer read
    lse_smem[...] = m + jnp.log2(l)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[pl.ds(q0, BLOCK), h])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[h, pl.ds(q0, BLOCK)])
    plgpu.wait_smem_to_gmem(0)

  scratch = [g.tile(), g.tile(slotted=True), g.tile(slotted=True), g.vector(),
             plgpu.Barrier(num_barriers=1),
             plgpu.Barrier(num_arrivals=2, num_barriers=g.slots)]
  return g.call(body, inputs=(q, k, v), out_type=(g.tiles_out(), g.vector_out()),
                scratch=scratch, interpret=interpret)


def _dq(q, k, v, o, do, lse, seg: int, tiling: AttentionTiling, interpret: bool):
  """-> (dQ ``[N, H, D]``, delta = rowsum(dO * O) ``[H, N]`` float32 for ``_dkv``)."""
  g = _Geometry.of(q, seg, tiling, _q_span)
  ops = _Ops(interpret)

  def body(q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, dq_ref, delta_ref,
           q_smem, o_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, held_bar, kv_bar):
    i, h = lax.axis_index("tile"), lax.axis_index("head")
    q0 = i * BLOCK
    lo, n = _q_span(i, seg)
    rows = pl.ds(q0, BLOCK)
    plgpu.copy_gmem_to_smem(q_ref.at[rows, h], q_smem, held_bar.at[0])
    plgpu.copy_gmem_to_smem(do_ref.at[rows, h], do_smem, held_bar.at[0])
    plgpu.copy_gmem_to_smem(o_ref.at[rows, h], o_smem, held_bar.at[0])
    plgpu.copy_gmem_to_smem(lse_ref.at[h, rows], lse_smem, held_bar.at[0])
    fetch = _fetcher(lo, h, kv_bar, tiles=((k_ref, k_smem), (v_ref, v_smem)))

    plgpu.barrier_wait(held_bar.at[0])
    lse_rows = ops.rows(lse_smem)
    # The softmax backward's row term, here rather than in a separate pass
    # over O and dO; _dkv reads it back.
    o_tile = ops.cast(o_smem[...], plgpu.Layout.WGMMA).astype(jnp.float32)
    do_tile = ops.cast(do_smem[...], plgpu.Layout.WGMMA).astype(jnp.float32)
    delta_rows = (o_tile * do_tile).sum(axis=1)
    delta_smem[...] = delta_rows

    def step(j, slot, acc):
      plgpu.barrier_wait(kv_bar.at[slot])
      s, dp = _products([_Mm(q_smem, k_smem.at[slot], b_t=True),
                         _Mm(do_smem, v_smem.at[slot], b_t=True)], ops)
      p = jnp.exp2(s * (g.scale * _LOG2E) - lax.broadcast_in_dim(lse_rows, s.shape, [0]))
      keep = _mask(q0, (lo + j) * BLOCK, seg, False, ops.iota)
      p = jnp.where(keep, p, 0.0)
      ds = p * (dp - lax.broadcast_in_dim(delta_rows, dp.shape, [0]))
      acc, = _products([_Mm(ds.astype(q_smem.dtype), k_smem.at[slot], acc=acc)], ops)
      return acc

    acc = _stream(n, g.slots, fetch, step, ops.zeros((BLOCK, g.d)))
    q_smem[...] = (acc * g.scale).astype(q_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows, h])
    plgpu.copy_smem_to_gmem(delta_smem, delta_ref.at[h, rows])
    plgpu.wait_smem_to_gmem(0)

  scratch = [g.tile(), g.tile(), g.tile(), g.tile(slotted=True), g.tile(slotted=True),
             g.vector(), g.vector(),
             plgpu.Barrier(num_arrivals=4, num_barriers=1),
             plgpu.Barrier(num_arrivals=2, num_barriers=g.slots)]
  return g.call(body, inputs=(q, k, v, o, do, lse), out_type=(g.tiles_out(), g.vector_out()),
                scratch=scratch, interpret=interpret)


def _dkv(q, k, v, do, lse, delta, seg: int, tiling: AttentionTiling, interpret: bool):
  """-> (dK, dV), both ``[N, H, D]``."""
  g = _Geometry.of(q, seg, tiling, _kv_span)
  ops = _Ops(interpret)

  def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
           k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
           held_bar, q_bar):
    c, h = lax.axis_index("tile"), lax.axis_index("head")
    k0 = c * BLOCK
    first, n = _kv_span(c, seg)
    rows = pl.ds(k0, BLOCK)
    plgpu.copy_gmem_to_smem(k_ref.at[rows, h], k_smem, held_bar.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[rows, h], v_smem, held_bar.at[0])
    fetch = _fetcher(first, h, q_bar, tiles=((q_ref, q_smem), (do_ref, do_smem)),
                     vectors=((lse_ref, lse_smem), (delta_ref, delta_smem)))
    plgpu.barrier_wait(held_bar.at[0])

    def step(j, slot, carry):
      dk, dv = carry
      plgpu.barrier_wait(q_bar.at[slot])
      st, dpt = _products([_Mm(k_smem, q_smem.at[slot], b_t=True),
                           _Mm(v_smem, do_smem.at[slot], b_t=True)], ops)
      pt = jnp.exp2(st * (g.scale * _LOG2E)
                    - lax.broadcast_in_dim(ops.cols(lse_smem.at[slot]), st.shape, [1]))
      keep = _mask((first + j) * BLOCK, k0, seg, True, ops.iota)
      pt = jnp.where(keep, pt, 0.0)
      delta_cols = ops.cols(delta_smem.at[slot])
      dst = pt * (dpt - lax.broadcast_in_dim(delta_cols, dpt.shape, [1]))
      dk, dv = _products([_Mm(dst.astype(k_smem.dtype), q_smem.at[slot], acc=dk),
                          _Mm(pt.astype(k_smem.dtype), do_smem.at[slot], acc=dv)], ops)
      return dk, dv

    zeros = ops.zeros((BLOCK, g.d))
    dk, dv = _stream(n, g.slots, fetch, step, (zeros, zeros))
    k_smem[...] = (dk * g.scale).astype(k_smem.dtype)
    v_smem[...] = dv.astype(v_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[rows, h])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[rows, h])
    plgpu.wait_smem_to_gmem(0)

  scratch = [g.tile(), g.tile(), g.tile(slotted=True), g.tile(slotted=True),
             g.vector(slotted=True), g.vector(slotted=True),
             plgpu.Barrier(num_arrivals=2, num_barriers=1),
             plgpu.Barrier(num_arrivals=4, num_barriers=g.slots)]
  return g.call(body, inputs=(q, k, v, do, lse, delta), out_type=(g.tiles_out(), g.tiles_out()),
                scratch=scratch, interpret=interpret)


def _flat(x):
  return x.reshape((-1,) + x.shape[2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def causal_attention(q, k, v, tiling: AttentionTiling = DEFAULT_ATTENTION_TILING,
                     interpret: bool = False):
  """Causal softmax attention of ``[B, T, H, D]`` bf16 q, k, v (scale
  ``D ** -0.5``, float32 softmax): the same function as
  ``jax.nn.dot_product_attention(q, k, v, is_causal=True)``."""
  return _attention_fwd(q, k, v, tiling, interpret)[0]


def _attention_fwd(q, k, v, tiling, interpret):
  check_shapes(q, k, v)
  seg = q.shape[1]
  qf, kf, vf = _flat(q), _flat(k), _flat(v)
  o, lse = _forward(qf, kf, vf, seg, tiling, interpret)
  return o.reshape(q.shape), (qf, kf, vf, o, lse)


def _attention_bwd(tiling, interpret, res, do):
  qf, kf, vf, o, lse = res
  shape = do.shape
  dof = _flat(do).astype(qf.dtype)
  seg = shape[1]
  dq, delta = _dq(qf, kf, vf, o, dof, lse, seg, tiling, interpret)
  dk, dv = _dkv(qf, kf, vf, dof, lse, delta, seg, tiling, interpret)
  return dq.reshape(shape), dk.reshape(shape), dv.reshape(shape)


causal_attention.defvjp(_attention_fwd, _attention_bwd)


__all__: Sequence[str] = ("AttentionTiling", "DEFAULT_ATTENTION_TILING", "BLOCK",
                          "causal_attention", "check_shapes", "fits")
