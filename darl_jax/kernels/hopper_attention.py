"""Causal attention over short image sequences, as Hopper (sm_90) kernels.

The step's attention is ``batch x heads`` causal problems of only 196
(ViT-L/16) or 256 (ViT-H/14) tokens, too short for flash kernels' tiles.
These kernels see the batch as one flat sequence of ``B * T`` tokens with a
block-diagonal causal mask (r attends to c when both are in one image and
c <= r), in 64-row tiles: no padding, no copy, every tile a full ``wgmma``;
a tile that straddles two images is masked per row.

Three kernels, each a grid of (64-row tile, head) with one warpgroup that
streams its tiles through ``AttentionTiling.slots`` shared-memory slots:
``_forward`` (O and the base-2 log-sum-exp, online softmax), ``_dq`` (dQ
and delta = rowsum(dO * O)) and ``_dkv`` (dK, dV, written into _dq's
gradient array in place). Keeping dQ apart from dK/dV recomputes two
products per tile pair but needs no atomics. Probabilities and score
gradients stay in registers as the next product's operand.

Entry points, each with a custom gradient: ``causal_attention_qkv(qkv,
bias, rope)`` from the packed projection ``[B, T, 3, H, D]`` (v read in
place, v's bias added to the output, RoPE's transpose and the bias
gradient's column sums in the backward's epilogues, the gradient in the
projection's own layout); ``causal_attention_projected(x, kernel, bias,
rope)`` from the block's input, the q/k/v product hopper_gemm's kernel with
the bias and RoPE in its epilogue (head dim 64); ``causal_attention(q, k,
v)`` on three ``[B, T, H, D]`` arrays.

Invariants: bf16 inputs, ``T >= 64``, ``B * T`` a multiple of 64, head dim
a multiple of 16 up to 256 (check_shapes names the fix otherwise); RoPE
tables are one ``[T, D/2]`` pair shared by the batch, in kernels/rope.py's
layout. darl_jax/ops.py calls these where they fit
(``kernels.attention='hopper'``, the default on sm_90 in bf16), cuDNN or XLA
elsewhere.
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

from darl_jax.kernels import hopper_gemm
from darl_jax.kernels import rope as rope_lib
from darl_jax.kernels.mosaic import interpret_params, swizzled

BLOCK = 64            # rows of every tile: one wgmma M, and a 128-byte bf16 row at D = 64
_LOG2E = math.log2(math.e)
_M_INIT = -1e30       # running max before any key: finite, so exp2(m_old - m_new) is 0, not NaN


@dataclasses.dataclass(frozen=True)
class AttentionTiling:
  """``slots``: shared-memory slots for the streamed tiles; 0 gives each of a
  CTA's streamed tiles its own slot (all copies issued up front). Fewer
  slots use less shared memory (more CTAs per multiprocessor) and refill a
  slot once its tile is done.

  ``rope_tables``: the dtype of the RoPE tables the backward kernels apply
  the rotation's transpose with: ``float32`` (two ``[64, D/2]`` tiles in
  shared memory) or ``bfloat16`` (one ``[64, D]`` tile, cos | sin: less
  shared memory, so more CTAs per multiprocessor, for a rounding of the
  tables about that of the bf16 gradients themselves)."""
  slots: int = 2
  rope_tables: str = "bfloat16"


# Two slots and bfloat16 tables: the fastest settings at ViT-L/16 and H/14
# sizes (benchmarks/attention_kernel_bench.py --tilings), bf16 tables for a
# gradient error about that of float32 ones.
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
                     + ". Use kernels.attention='cudnn' or 'xla' for it.")


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


def _mask(q0, k0, seg: int, transposed: bool, ops: "_Ops"):
  """Which (query, key) pairs attend: same image and key <= query.

  ``q0``/``k0`` are the tiles' first flat rows; ``transposed`` puts keys on
  the rows (the dK/dV kernel works on S^T). A 64-row tile spans at most two
  images (T >= 64), so each query's image starts at one of two places.

  Query q sees key k when ``start(q) <= k <= q``, that is when ``0 <= q - k
  <= q - start(q)``: one unsigned compare of ``q - k`` against ``q -
  start(q)`` (never negative). Everything that depends on the query alone
  or the key alone is a vector along its tile dimension (2 or 16 values a
  thread in the WGMMA layout), so each score element costs a subtract, a
  compare and the caller's select: the mask is a large share of the
  backward's instructions, and this form also needs fewer registers than
  one that builds two-dimensional row and column indices.
  """
  q_dim, k_dim = (1, 0) if transposed else (0, 1)
  q = q0 + ops.index(q_dim)
  k = k0 + ops.index(k_dim)
  first = q0 // seg * seg
  start = jnp.where(q >= first + seg, first + seg, first)
  shape = (BLOCK, BLOCK)
  d = lax.broadcast_in_dim(q, shape, [q_dim]) - lax.broadcast_in_dim(k, shape, [k_dim])
  bound = lax.broadcast_in_dim((q - start).astype(jnp.uint32), shape, [q_dim])
  return d.astype(jnp.uint32) <= bound


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

  def index(self, dim):
    """[64] int32, 0..63 along tile dimension ``dim`` (rows 0, columns 1)."""
    if self.interpret:
      return lax.iota(jnp.int32, BLOCK)
    return plgpu.broadcasted_iota(jnp.int32, (BLOCK,), 0,
                                  layout=plgpu.Layout.WGMMA.reduce(1 - dim))

  def zeros(self, shape):
    return self.cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)

  def rows(self, ref):     # a [64] float32 per-row vector from shared memory
    return self.cast(ref[...], plgpu.Layout.WGMMA.reduce(1))

  def cols(self, ref):     # the same, one value per column
    return self.cast(ref[...], plgpu.Layout.WGMMA.reduce(0))


@dataclasses.dataclass(frozen=True)
class _Mm:
  """One product ``acc + a @ b`` (``a @ b^T`` when ``b_t``): ``a`` a
  shared-memory tile or a bf16 register array
  (probabilities, score gradients), ``b`` a shared-memory tile, ``acc`` a
  float32 running sum or None (zeros)."""
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


def _packed(heads: int):
  """``at`` for q, k, v as heads 0.., H.., 2H.. of one array."""
  return (heads, 0, heads, 2 * heads)


def _separate(heads: int):
  """``at`` for q, k, v as three ``[N, H, D]`` arrays."""
  return (heads, 0, 0, 0)


@dataclasses.dataclass(frozen=True)
class _Geometry:
  """What a kernel derives from its inputs: tile counts, the number of
  streaming slots, where q, k and v are, and the shapes of its buffers.

  The kernels read head h of q, k and v as heads ``at[0] + h``,
  ``at[1] + h`` and ``at[2] + h`` of their ``[N, *, D]`` arrays: (0, H, 2H)
  for the packed projection ``[N, 3H, D]`` (or q and k rotated together,
  ``[N, 2H, D]``), (0, 0, 0) for three ``[N, H, D]`` arrays. Gradients go
  into one ``[N, 3H, D]`` array, dQ, dK, dV at heads h, H + h, 2H + h."""
  rows: int
  heads: int
  d: int
  slots: int
  dtype: object
  at: tuple   # head offsets of q, k, v

  @classmethod
  def of(cls, v, at, seg: int, tiling: AttentionTiling, span):
    """``v``: the array v is read from; ``at``: (heads, q, k, v offsets),
    from _packed or _separate; ``span``: _q_span or _kv_span, the tiles a
    CTA streams."""
    rows, _, d = v.shape
    heads, *at = at
    longest = _max_span(span, rows // BLOCK, seg)
    return cls(rows, heads, d, min(tiling.slots, longest) if tiling.slots else longest,
               v.dtype, tuple(at))

  @property
  def scale(self) -> float:
    return self.d ** -0.5

  def tile(self, slotted: bool = False):
    """Shared memory for one ``[64, D]`` tile (one per slot if ``slotted``)."""
    return plgpu.SMEM(((self.slots,) if slotted else ()) + (BLOCK, self.d), self.dtype,
                      transforms=swizzled(self.d, self.dtype))

  def half(self, dtype):
    """Shared memory for one ``[64, D/2]`` tile (a RoPE table's rows, or
    half of a gradient tile)."""
    cols = self.d // 2
    # Rows that are not a multiple of the smallest swizzle (32 bytes: bf16
    # halves of head dim 80 are 80 bytes) stay untiled; such tiles are only
    # stored and copied (not a wgmma operand: see _sums_in_kernel).
    return plgpu.SMEM((BLOCK, cols), dtype,
                      transforms=swizzled(cols, dtype) if _swizzles(cols, dtype) else ())

  def rope_scratch(self, tables):
    """The RoPE tables' rows (see extended_tables), and a gradient's two
    rotated halves."""
    return ([self.tile() if t.shape[-1] == self.d else self.half(t.dtype) for t in tables]
            + [self.half(self.dtype), self.half(self.dtype)])

  def bias(self):
    """Shared memory for one head's float32 ``[D]`` value bias."""
    return plgpu.SMEM((self.d,), jnp.float32)

  def vector(self, slotted: bool = False):
    """Shared memory for one tile's per-row float32 values."""
    return plgpu.SMEM(((self.slots,) if slotted else ()) + (BLOCK,), jnp.float32)

  def sums(self, grads: int):
    """Shared memory for the column sums of ``grads`` gradient tiles: per
    tile, ``ceil(D / 64)`` float32 ``[64]`` vectors (see _column_sums)."""
    return plgpu.SMEM((grads * self.sum_vectors, BLOCK), jnp.float32)

  @property
  def sum_vectors(self) -> int:
    return -(-self.d // BLOCK)

  def tiles_out(self):
    return jax.ShapeDtypeStruct((self.rows, self.heads, self.d), self.dtype)

  def grads_out(self):
    return jax.ShapeDtypeStruct((self.rows, 3 * self.heads, self.d), self.dtype)

  def vector_out(self):
    return jax.ShapeDtypeStruct((self.heads, self.rows), jnp.float32)

  def sums_out(self, grads: int):
    """Each CTA's column sums of the gradient tiles it stores: ``[tiles,
    grads * H, D]`` float32."""
    return jax.ShapeDtypeStruct((self.rows // BLOCK, grads * self.heads, self.d), jnp.float32)

  def call(self, name, body, *, inputs, out_type, scratch, interpret: bool):
    """``body(*input refs, *output refs, *scratch)`` on a (tile, head) grid.
    ``pl.kernel`` rather than ``plgpu.kernel``: it takes a ``jax.Ref`` input
    (written in place, aliased in and out of the call), which _dkv needs."""
    def entry(*refs):
      pl.run_scoped(lambda *s: body(*refs, *s), *scratch)
    return pl.kernel(
        entry, out_type=out_type,
        mesh=plgpu.Mesh(grid=(self.rows // BLOCK, self.heads), grid_names=("tile", "head")),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True),
        interpret=interpret_params(interpret), name=f"attention_{name}")(*inputs)


def _fetcher(first, bar, tiles=(), vectors=()):
  """``fetch(j, slot)``: copy streamed tile ``first + j`` into ``slot``, for
  each (gmem, head, smem) of ``tiles`` (``[N, *, D]`` arrays) and
  ``vectors`` (``[H, N]`` per-row values), all landing on ``bar[slot]``."""
  def fetch(j, slot):
    rows = pl.ds((first + j) * BLOCK, BLOCK)
    for gmem, head, smem in tiles:
      plgpu.copy_gmem_to_smem(gmem.at[rows, head], smem.at[slot], bar.at[slot])
    for gmem, head, smem in vectors:
      plgpu.copy_gmem_to_smem(gmem.at[head, rows], smem.at[slot], bar.at[slot])
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


def _fetch_tables(tables, tile, smem, bar):
  """Copy the RoPE tables' rows for flat tile ``tile`` (see extended_tables)."""
  period = tables[0].shape[0]
  for table, table_smem in zip(tables, smem):
    plgpu.copy_gmem_to_smem(table.at[tile - tile // period * period], table_smem, bar)


def _stage_grad(x, gmem, rows, head, tile_smem, rope, ops: "_Ops"):
  """Write float32 ``[64, D]`` gradient ``x`` to shared memory as bf16 and
  return its staged pieces ``(smem, gmem, first column)``: the copies that
  take it to ``gmem[rows, head]`` (issued by _copy_out, after
  ``plgpu.commit_smem``) and, for _column_sums, which columns each holds.

  ``rope``: None, or shared-memory tiles (the tables' rows: cos and sin
  ``[64, D/2]`` float32, or one ``[64, D]`` bf16 cos | sin; then two
  ``[64, D/2]`` bf16 tiles for the halves) when ``x`` is the gradient of
  RoPE-rotated rows: then it gets the rotation's transpose first, ``(x1 c +
  x2 s, x2 c - x1 s)`` for halves x1, x2, which the WGMMA accumulator
  layout holds in the same threads, and the halves go out as two copies.
  """
  if rope is None:
    tile_smem[...] = x.astype(tile_smem.dtype)
    return [(tile_smem, gmem.at[rows, head], 0)]
  *tables, lo_smem, hi_smem = rope
  half = x.shape[1] // 2
  if len(tables) == 1:
    cs = ops.cast(tables[0][...], plgpu.Layout.WGMMA).astype(jnp.float32)
    c, s = cs[:, :half], cs[:, half:]
  else:
    c, s = (ops.cast(t[...], plgpu.Layout.WGMMA) for t in tables)
  x1, x2 = x[:, :half], x[:, half:]
  lo_smem[...] = (x1 * c + x2 * s).astype(lo_smem.dtype)
  hi_smem[...] = (x2 * c - x1 * s).astype(hi_smem.dtype)
  return [(lo_smem, gmem.at[rows, head, pl.ds(0, half)], 0),
          (hi_smem, gmem.at[rows, head, pl.ds(half, half)], half)]


def _swizzles(cols: int, dtype) -> bool:
  """Whether a shared-memory tile of ``cols``-element rows gets a swizzle:
  rows a multiple of the smallest one, 32 bytes."""
  return (cols * jnp.dtype(dtype).itemsize) % 32 == 0


def _sums_in_kernel(d: int, rope: bool) -> bool:
  """Whether the backward kernels take the qkv bias gradient's column sums
  (_column_sums) at head dim ``d``: each staged gradient piece, a ``[64,
  D]`` tile or with RoPE two ``[64, D/2]`` halves, must be a swizzled tile,
  wgmma's B operand. True at head dim 64 with or without RoPE and at 80
  without; not at 80 with RoPE (ViT-H/14: 80-byte bf16 halves stay
  untiled, see _Geometry.half), where _qkv_bwd sums the gradient in XLA."""
  return _swizzles(d // 2 if rope else d, jnp.bfloat16)


def _column_sums(grads, sums_smem, ops: "_Ops"):
  """Stage the float32 column sums of gradient tiles already staged in
  shared memory as bf16 (and committed), and return the copies that take
  them out. ``grads``: per gradient tile, its pieces as _stage_grad returns
  them and the ``[D]`` float32 gmem row its sums go to; ``sums_smem``:
  _Geometry.sums(len(grads)).

  The sums are of the bf16 values as stored, what XLA's column sum of the
  gradient array adds, in another order. They are taken on the tensor
  cores: ``ones[64, 64] @ P`` for each staged piece ``P [64, n]`` (the
  ones a register operand) has P's column sums in every row. Reading them
  out as a column sum of registers would be a cross-warp reduction, whose
  Mosaic scratch (shared memory that the kernel's own buffers may alias)
  gave wrong sums on the GPU in an earlier kernel of this repo; instead
  row r keeps only its entry in column r (within a 64-column window) and
  a row sum (within a warp, as the softmax's) makes that one ``[64]``
  vector in row layout, whose entry r is the sum of column r. Columns at
  64 and over go to a second vector the same way (head dim 80: columns
  64..79 in entries 0..15).

  The GPU interpreter runs no wgmma with a register operand; there
  _products takes the same products as plain dots, so the diagonal, the
  offsets and the sums' layout are checked on CPU too."""
  dtype = grads[0][0][0][0].dtype
  ones = ops.cast(jnp.ones((BLOCK, BLOCK), dtype), plgpu.Layout.WGMMA)
  accs = iter(_products([_Mm(ones, smem) for pieces, _ in grads for smem, *_ in pieces], ops))
  copies = []
  for t, (pieces, gmem) in enumerate(grads):
    d = sum(smem.shape[1] for smem, *_ in pieces)
    sums = [(col, next(accs)) for _, _, col in pieces]
    vectors = -(-d // BLOCK)
    for v in range(vectors):
      total = None
      for col, acc in sums:
        n = acc.shape[1]
        if col + n <= v * BLOCK or col >= (v + 1) * BLOCK:
          continue
        # entry r: column r + 64 v of the tile, column r + 64 v - col of the piece
        diag = ops.iota((BLOCK, n), 1) + (col - v * BLOCK) == ops.iota((BLOCK, n), 0)
        part = jnp.where(diag, acc, 0.0).sum(axis=1)
        total = part if total is None else total + part
      vec = sums_smem.at[t * vectors + v]
      vec[...] = total
      width = min(BLOCK, d - v * BLOCK)
      copies.append((vec if width == BLOCK else vec.at[pl.ds(0, width)],
                     gmem.at[pl.ds(v * BLOCK, width)]))
  return copies


def _copy_out(copies, then=None):
  """Issue the bulk copies ``(smem, gmem, ...)`` of what the epilogue
  staged, and wait for them. ``then``: None, or a function that stages
  more (reading what is staged: _column_sums) and returns its copies; it
  runs after the first copies are issued (they and its products only read
  the staged tiles), and its copies join theirs."""
  plgpu.commit_smem()
  for smem, gmem, *_ in copies:
    plgpu.copy_smem_to_gmem(smem, gmem)
  if then is not None:
    more = then()
    plgpu.commit_smem()
    for smem, gmem in more:
      plgpu.copy_smem_to_gmem(smem, gmem)
  plgpu.wait_smem_to_gmem(0)


def _forward(q, k, v, v_bias, at, seg: int, tiling: AttentionTiling, interpret: bool,
             keep_v: bool = False):
  """-> (O ``[N, H, D]``, log2-sum-exp ``[H, N]`` float32), and with
  ``keep_v`` also v's heads as their own ``[N, H, D]`` array. ``v_bias``:
  None, or float32 ``[H, D]`` added to the output, which is v's bias added
  to every value row (see causal_attention_qkv).

  ``keep_v``: the CTA of query tile i streams key/value tile i last (the
  diagonal), so that tile is in shared memory when the loop ends and one
  more bulk copy stores it: every row of v is written once, by one CTA,
  with no extra read. The backward then keeps this array instead of the
  packed projection (two thirds smaller)."""
  g = _Geometry.of(v, at, seg, tiling, _q_span)
  ops = _Ops(interpret)
  biased = v_bias is not None

  def body(*refs):
    q_ref, k_ref, v_ref, *refs = refs
    bias_ref, refs = (refs[0], refs[1:]) if biased else (None, refs)
    o_ref, lse_ref, *refs = refs
    v_out, refs = (refs[0], refs[1:]) if keep_v else (None, refs)
    q_smem, k_smem, v_smem, lse_smem, *refs = refs
    bias_smem, (q_bar, kv_bar) = (refs[0], refs[1:]) if biased else (None, refs)
    i, h = lax.axis_index("tile"), lax.axis_index("head")
    q0 = i * BLOCK
    lo, n = _q_span(i, seg)
    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q0, BLOCK), g.at[0] + h], q_smem, q_bar.at[0])
    if biased:
      plgpu.copy_gmem_to_smem(bias_ref.at[h], bias_smem, q_bar.at[0])
    fetch = _fetcher(lo, kv_bar, tiles=((k_ref, g.at[1] + h, k_smem),
                                        (v_ref, g.at[2] + h, v_smem)))

    def step(j, slot, carry):
      acc, m, l = carry
      plgpu.barrier_wait(kv_bar.at[slot])
      s, = _products([_Mm(q_smem, k_smem.at[slot], b_t=True)], ops)
      s = s * (g.scale * _LOG2E)
      keep = _mask(q0, (lo + j) * BLOCK, seg, False, ops)
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
    if biased:
      out = out + lax.broadcast_in_dim(ops.cols(bias_smem), out.shape, [1])
    q_smem[...] = out.astype(q_smem.dtype)        # Q is no longer read
    lse_smem[...] = m + jnp.log2(l)
    copies = [(q_smem, o_ref.at[pl.ds(q0, BLOCK), h]),
              (lse_smem, lse_ref.at[h, pl.ds(q0, BLOCK)])]
    if keep_v:   # the last streamed tile, lo + n - 1 = i: this CTA's own rows
      copies.append((v_smem.at[(n - 1) % g.slots], v_out.at[pl.ds(q0, BLOCK), h]))
    _copy_out(copies)

  scratch = [g.tile(), g.tile(slotted=True), g.tile(slotted=True), g.vector()]
  scratch += [g.bias()] if biased else []
  scratch += [plgpu.Barrier(num_arrivals=2 if biased else 1, num_barriers=1),
              plgpu.Barrier(num_arrivals=2, num_barriers=g.slots)]
  return g.call("fwd", body, inputs=(q, k, v) + ((v_bias,) if biased else ()),
                out_type=(g.tiles_out(), g.vector_out()) + ((g.tiles_out(),) if keep_v else ()),
                scratch=scratch, interpret=interpret)


def _dq(q, k, v, v_bias, o, do, lse, tables, at, seg: int, tiling: AttentionTiling,
        interpret: bool, sums: bool = False):
  """-> (the gradient array ``[N, 3H, D]`` with dQ in heads 0..H-1 (the rest
  is _dkv's), delta = rowsum(dO * O) ``[H, N]`` float32 for ``_dkv``), and
  with ``sums`` each tile's column sums of dQ, ``[N / 64, H, D]`` float32
  (_column_sums). ``tables``: None, or RoPE's extended (cos, sin), whose
  rotation's transpose dQ gets before it is stored. ``v_bias``: as in
  _forward; O includes it and the products here use v without it, so delta
  is taken of O minus the bias."""
  biased = v_bias is not None
  g = _Geometry.of(v, at, seg, tiling, _q_span)
  ops = _Ops(interpret)
  rope = tables is not None
  nt = len(tables) if rope else 0
  aliased = rope and not interpret    # O's tile shares memory with dQ's halves

  def body(*refs):
    q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, *refs = refs
    table_refs, refs = (refs[:nt], refs[nt:]) if rope else ((), refs)
    bias_ref, refs = (refs[0], refs[1:]) if biased else (None, refs)
    dqkv_ref, delta_ref, *refs = refs
    sums_ref, refs = (refs[0], refs[1:]) if sums else (None, refs)
    (q_smem, o_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, *refs) = refs
    held = nt if aliased else nt + 2     # the tables' rows (and dQ's halves)
    rope_smem, refs = (refs[:held], refs[held:]) if rope else (None, refs)
    if aliased:
      o_smem, halves = o_smem
      rope_smem = (*rope_smem, *halves)
    bias_smem, refs = (refs[0], refs[1:]) if biased else (None, refs)
    sums_smem, (held_bar, kv_bar) = (refs[0], refs[1:]) if sums else (None, refs)
    i, h = lax.axis_index("tile"), lax.axis_index("head")
    q0 = i * BLOCK
    lo, n = _q_span(i, seg)
    rows = pl.ds(q0, BLOCK)
    plgpu.copy_gmem_to_smem(q_ref.at[rows, g.at[0] + h], q_smem, held_bar.at[0])
    plgpu.copy_gmem_to_smem(do_ref.at[rows, h], do_smem, held_bar.at[0])
    plgpu.copy_gmem_to_smem(o_ref.at[rows, h], o_smem, held_bar.at[0])
    plgpu.copy_gmem_to_smem(lse_ref.at[h, rows], lse_smem, held_bar.at[0])
    if rope:
      _fetch_tables(table_refs, i, rope_smem[:nt], held_bar.at[0])
    if biased:
      plgpu.copy_gmem_to_smem(bias_ref.at[h], bias_smem, held_bar.at[0])
    fetch = _fetcher(lo, kv_bar, tiles=((k_ref, g.at[1] + h, k_smem),
                                        (v_ref, g.at[2] + h, v_smem)))

    plgpu.barrier_wait(held_bar.at[0])
    lse_rows = ops.rows(lse_smem)
    # The softmax backward's row term, here rather than in a separate pass
    # over O and dO; _dkv reads it back.
    o_tile = ops.cast(o_smem[...], plgpu.Layout.WGMMA).astype(jnp.float32)
    if biased:
      o_tile = o_tile - lax.broadcast_in_dim(ops.cols(bias_smem), o_tile.shape, [1])
    do_tile = ops.cast(do_smem[...], plgpu.Layout.WGMMA).astype(jnp.float32)
    delta_rows = (o_tile * do_tile).sum(axis=1)
    delta_smem[...] = delta_rows

    def step(j, slot, acc):
      plgpu.barrier_wait(kv_bar.at[slot])
      s, dp = _products([_Mm(q_smem, k_smem.at[slot], b_t=True),
                         _Mm(do_smem, v_smem.at[slot], b_t=True)], ops)
      p = jnp.exp2(s * (g.scale * _LOG2E) - lax.broadcast_in_dim(lse_rows, s.shape, [0]))
      keep = _mask(q0, (lo + j) * BLOCK, seg, False, ops)
      p = jnp.where(keep, p, 0.0)
      ds = p * (dp - lax.broadcast_in_dim(delta_rows, dp.shape, [0]))
      acc, = _products([_Mm(ds.astype(q_smem.dtype), k_smem.at[slot], acc=acc)], ops)
      return acc

    acc = _stream(n, g.slots, fetch, step, ops.zeros((BLOCK, g.d)))
    copies = _stage_grad(acc * g.scale, dqkv_ref, rows, h, q_smem,
                         rope_smem, ops)
    _copy_out(copies + [(delta_smem, delta_ref.at[h, rows])],
              functools.partial(_column_sums, [(copies, sums_ref.at[i, h])], sums_smem, ops)
              if sums else None)

  # With RoPE, O's tile (read once, for delta, before the loop) and the two
  # halves the rotated dQ is staged in (written after it) are one union in
  # shared memory, so that shared memory lets as many CTAs share a
  # multiprocessor as dQ's registers do. The GPU interpreter has no unions:
  # separate tiles.
  o_tile, rope_scratch = g.tile(), g.rope_scratch(tables) if rope else []
  if aliased:
    *rope_scratch, lo, hi = rope_scratch
    o_tile = plgpu.RefUnion(o_tile, (lo, hi))
  scratch = [g.tile(), o_tile, g.tile(), g.tile(slotted=True), g.tile(slotted=True),
             g.vector(), g.vector()]
  scratch += rope_scratch
  scratch += [g.bias()] if biased else []
  scratch += [g.sums(1)] if sums else []
  scratch += [plgpu.Barrier(num_arrivals=4 + nt + biased, num_barriers=1),
              plgpu.Barrier(num_arrivals=2, num_barriers=g.slots)]
  return g.call("dq", body, inputs=(q, k, v, o, do, lse) + (tuple(tables) if rope else ())
                + ((v_bias,) if biased else ()),
                out_type=(g.grads_out(), g.vector_out()) + ((g.sums_out(1),) if sums else ()),
                scratch=scratch, interpret=interpret)


def _dkv(q, k, v, do, lse, delta, grads, tables, at, seg: int, tiling: AttentionTiling,
         interpret: bool, sums: bool = False):
  """Writes dK (heads H..2H-1, after RoPE's transpose when ``tables`` are
  given) and dV (2H..3H-1) into ``grads``, a ``jax.Ref`` of _dq's output.
  -> with ``sums``, each tile's column sums of dK and dV, ``[N / 64, 2H,
  D]`` float32 (dK's at heads 0..H-1, dV's at H..; _column_sums), else ()."""
  g = _Geometry.of(v, at, seg, tiling, _kv_span)
  ops = _Ops(interpret)
  rope = tables is not None
  nt = len(tables) if rope else 0

  def body(*refs):
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs = refs
    table_refs, refs = (refs[:nt], refs[nt:]) if rope else ((), refs)
    dqkv_ref, *refs = refs      # the input Ref
    sums_ref, refs = (refs[0], refs[1:]) if sums else (None, refs)
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, *refs) = refs
    rope_smem, refs = (refs[:nt + 2], refs[nt + 2:]) if rope else (None, refs)
    sums_smem, (held_bar, q_bar) = (refs[0], refs[1:]) if sums else (None, refs)
    c, h = lax.axis_index("tile"), lax.axis_index("head")
    k0 = c * BLOCK
    first, n = _kv_span(c, seg)
    rows = pl.ds(k0, BLOCK)
    plgpu.copy_gmem_to_smem(k_ref.at[rows, g.at[1] + h], k_smem, held_bar.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[rows, g.at[2] + h], v_smem, held_bar.at[0])
    if rope:
      _fetch_tables(table_refs, c, rope_smem[:nt], held_bar.at[0])
    fetch = _fetcher(first, q_bar, tiles=((q_ref, g.at[0] + h, q_smem), (do_ref, h, do_smem)),
                     vectors=((lse_ref, h, lse_smem), (delta_ref, h, delta_smem)))
    plgpu.barrier_wait(held_bar.at[0])

    def step(j, slot, carry):
      dk, dv = carry
      plgpu.barrier_wait(q_bar.at[slot])
      st, dpt = _products([_Mm(k_smem, q_smem.at[slot], b_t=True),
                           _Mm(v_smem, do_smem.at[slot], b_t=True)], ops)
      pt = jnp.exp2(st * (g.scale * _LOG2E)
                    - lax.broadcast_in_dim(ops.cols(lse_smem.at[slot]), st.shape, [1]))
      keep = _mask((first + j) * BLOCK, k0, seg, True, ops)
      pt = jnp.where(keep, pt, 0.0)
      delta_cols = ops.cols(delta_smem.at[slot])
      dst = (pt * (dpt - lax.broadcast_in_dim(delta_cols, dpt.shape, [1]))).astype(k_smem.dtype)
      dk, dv = _products([_Mm(dst, q_smem.at[slot], acc=dk),
                          _Mm(pt.astype(k_smem.dtype), do_smem.at[slot], acc=dv)], ops)
      return dk, dv

    zeros = ops.zeros((BLOCK, g.d))
    dk, dv = _stream(n, g.slots, fetch, step, (zeros, zeros))
    # dK's pieces (k_smem, or the halves with RoPE) and dV's (v_smem) are
    # different buffers: both stay staged until the copies and sums are done.
    dk_pieces = _stage_grad(dk * g.scale, dqkv_ref, rows, g.heads + h, k_smem,
                            rope_smem, ops)
    dv_pieces = _stage_grad(dv, dqkv_ref, rows, 2 * g.heads + h, v_smem, None, ops)
    _copy_out(dk_pieces + dv_pieces,
              functools.partial(_column_sums, [(dk_pieces, sums_ref.at[c, h]),
                                               (dv_pieces, sums_ref.at[c, g.heads + h])],
                                sums_smem, ops) if sums else None)

  scratch = [g.tile(), g.tile(), g.tile(slotted=True), g.tile(slotted=True),
             g.vector(slotted=True), g.vector(slotted=True)]
  if rope:
    scratch += g.rope_scratch(tables)
  scratch += [g.sums(2)] if sums else []
  scratch += [plgpu.Barrier(num_arrivals=2 + nt, num_barriers=1),
              plgpu.Barrier(num_arrivals=4, num_barriers=g.slots)]
  return g.call("dkv", body, inputs=(q, k, v, do, lse, delta) + (tuple(tables) if rope else ())
                + (grads,), out_type=(g.sums_out(2),) if sums else (), scratch=scratch,
                interpret=interpret)


@functools.partial(jax.jit, static_argnums=(8, 9, 10, 11, 12))
def _dkv_into(grads, q, k, v, do, lse, delta, tables, at, seg, tiling, interpret, sums):
  """_dkv writing into _dq's gradient array in place (-> it, and _dkv's
  sums or ()). Under jit because a ``jax.Ref`` in a memory space exists
  only there; inside the training step's jit this is inlined and the array
  is updated in place."""
  ref = jax.new_ref(grads, memory_space=plgpu.GMEM)
  out = _dkv(q, k, v, do, lse, delta, ref, tables, at, seg, tiling, interpret, sums)
  return ref[...], out


def _backward(q, k, v, v_bias, o, lse, do, tables, at, tiling, interpret, sums=False):
  """-> (the ``[B, T, 3, H, D]`` gradients of q, k, v from ``do [B, T, H,
  D]``, and with ``sums`` their float32 column sums ``[3, H, D]``, else
  None: the kernels' per-tile sums (_column_sums), summed over tiles here.)"""
  b, t, h, d = do.shape
  dof = _flat(do).astype(v.dtype)
  grads, delta, *dq_sums = _dq(q, k, v, v_bias, o, dof, lse, tables, at, t, tiling,
                               interpret, sums)
  grads, dkv_sums = _dkv_into(grads, q, k, v, dof, lse, delta, tables, at, t, tiling,
                              interpret, sums)
  col_sums = None
  if sums:
    col_sums = jnp.concatenate([dq_sums[0], dkv_sums[0]], axis=1).sum(0).reshape(3, h, d)
  return grads.reshape(b, t, 3, h, d), col_sums


def _tile_rows(table, seg: int, tile: int):
  """A ``[T, w]`` per-position table as ``[P, tile, w]`` float32: entry e
  holds the positions of flat rows ``tile e .. tile e + tile - 1`` (row r is
  position r % T); P = T / gcd(tile, T) entries make one period."""
  period = seg // math.gcd(tile, seg)
  pos = jnp.arange(period * tile) % seg
  return jnp.asarray(table, jnp.float32)[pos].reshape(period, tile, -1)


def extended_tables(cos, sin, seg: int, dtype="float32"):
  """RoPE's ``[T, D/2]`` tables laid out for the backward kernels: entry j of
  ``[P, 64, ...]`` holds the positions of flat rows ``64 j .. 64 j + 63``
  (row r is position r % T), and tile i of the flat sequence uses entry
  i % P. P = T / gcd(64, T) tiles make one period (49 at T = 196, 4 at
  T = 256), so the tables stay small whatever the batch. (Copies into tiled
  shared memory need their dynamic row offsets to be multiples of the
  tiling, which r % T is not: hence whole tiles on an untiled leading axis.)

  ``dtype`` float32: (cos, sin), each ``[P, 64, D/2]``; bfloat16: one
  ``[P, 64, D]`` array, cos in the first half of each row, sin in the second.
  """
  cos, sin = (_tile_rows(t, seg, BLOCK) for t in (cos, sin))
  if jnp.dtype(dtype) == jnp.float32:
    return cos, sin
  if jnp.dtype(dtype) != jnp.bfloat16:
    raise ValueError(f"rope_tables must be float32 or bfloat16, got {dtype}")
  return (jnp.concatenate([cos, sin], axis=-1).astype(jnp.bfloat16),)


def check_qkv(qkv, bias=None, rope=None) -> None:
  """Errors that name the fix for a packed ``[B, T, 3, H, D]`` input (and
  bias, RoPE tables) the kernels do not take."""
  if qkv.ndim != 5 or qkv.shape[2] != 3:
    raise ValueError(f"qkv must be [batch, tokens, 3, heads, head_dim], got {qkv.shape}")
  q = jax.ShapeDtypeStruct(qkv.shape[:2] + qkv.shape[3:], qkv.dtype)
  check_shapes(q, q, q)
  if bias is not None and bias.shape != qkv.shape[2:]:
    raise ValueError(f"the qkv bias must be [3, heads, head_dim] = {list(qkv.shape[2:])}, "
                     f"got {bias.shape}")
  if rope is not None:
    want = (qkv.shape[1], qkv.shape[4] // 2)
    for t in rope:
      if t.shape[-2:] != want or math.prod(t.shape) != math.prod(want):
        raise ValueError(f"RoPE tables for the Hopper attention kernels must be one "
                         f"[tokens, head_dim / 2] = {list(want)} table shared by every "
                         f"image, got {t.shape}; per-image tables take "
                         f"causal_attention on rotated q, k")


def fits_qkv(qkv, bias=None, rope=None) -> bool:
  try:
    check_qkv(qkv, bias, rope)
  except ValueError:
    return False
  return True


def _flat(x):
  return x.reshape((-1,) + x.shape[2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def causal_attention_qkv(qkv, bias=None, rope=None,
                         tiling: AttentionTiling = DEFAULT_ATTENTION_TILING,
                         interpret: bool = False):
  """Causal softmax attention straight from the packed projection: ``qkv
  [B, T, 3, H, D]`` bf16 (the product, before its bias), ``bias [3, H, D]``
  (None for none) and RoPE's ``rope = (cos, sin)`` (``[T, D/2]``, the same
  for every image; None for none) applied to q and k: the same function as
  ``causal_attention(apply_rope(q + bq), apply_rope(k + bk), v + bv)``.

  Taking the packed array lets the kernels read v in place (no copy of it)
  and write all three gradients into one ``[B, T, 3, H, D]`` array, the
  projection's own gradient layout, with RoPE's backward done in the
  kernels' epilogues: the separate pass that rotated dQ and dK back and
  concatenated them with dV is gone. q and k get their bias and rotation in
  one XLA pass (whose output is also the backward's). v's bias is added to
  the output instead (each softmax row sums to one, so P (V + bv) = P V +
  bv), so the product never needs a pass of its own to add it. The tables
  get a zero gradient: they are functions of the positions, not parameters.
  """
  return _qkv_fwd(qkv, bias, rope, tiling, interpret)[0]


def _query_keys(qkv, bias, rope):
  """q and k of ``[B, T, 3, H, D]`` with their bias and RoPE, as one
  ``[B T, 2H, D]`` (one XLA pass); with neither, the packed array itself."""
  b, t, _, h, d = qkv.shape
  if bias is None and rope is None:
    return qkv.reshape(b * t, 3 * h, d)
  qk = qkv[:, :, :2]
  if bias is not None:
    qk = qk + bias[:2].astype(qk.dtype)
  qk = qk.reshape(b, t, 2 * h, d)
  if rope is not None:
    cos, sin = (x.reshape(1, t, d // 2) for x in rope)
    qk = rope_lib.apply_rope(qk, cos, sin)
  return qk.reshape(b * t, 2 * h, d)


def _qkv_fwd(qkv, bias, rope, tiling, interpret):
  check_qkv(qkv, bias, rope)
  b, t, _, h, d = qkv.shape
  packed = qkv.reshape(b * t, 3 * h, d)
  qk = _query_keys(qkv, bias, rope)
  v_bias = None if bias is None else bias[2].astype(jnp.float32)
  # The backward keeps v as the forward kernel copied it out, not the packed
  # product: with bias or RoPE, q and k are kept rotated (qk), and holding
  # the packed array for its v would keep its q and k halves alive too (8 GB
  # at ViT-H/14, batch 192). Without either, qk is the packed array itself.
  keep_v = _keeps_v(bias, rope)
  o, lse, *v = _forward(qk, qk, packed, v_bias, _packed(h), t, tiling, interpret,
                        keep_v=keep_v)
  return o.reshape(b, t, h, d), (qk, v[0] if keep_v else packed, v_bias, o, lse, bias, rope)


def _keeps_v(bias, rope) -> bool:
  """Whether the backward reads v from its own array (q and k are a rotated
  or biased copy) rather than from the packed product (which is then qk)."""
  return bias is not None or rope is not None


def _qkv_bwd(tiling, interpret, res, do):
  qk, v, v_bias, o, lse, bias, rope = res
  heads = do.shape[2]
  # q and k at heads 0.. and H.. of qk, v at 0.. of its own array, or all
  # three in the packed product
  at = (heads, 0, heads, 0) if _keeps_v(bias, rope) else _packed(heads)
  tables = None if rope is None else extended_tables(*rope, do.shape[1], tiling.rope_tables)
  # Every bias row is added to every token: its gradient is the column sum
  # of dqkv. The backward kernels take it in their epilogues, each CTA the
  # float32 column sums of the bf16 tiles it stores (_column_sums), so that
  # what is left here is a sum over tiles of [N / 64, 3H, D], a 64th of the
  # gradient, instead of a pass over the whole gradient; the sums cost one
  # more 64 x 64 x D product per gradient tile, less than that pass. Where
  # the staged pieces are no wgmma operand (head dim 80 with RoPE), XLA sums
  # the gradient.
  in_kernel = bias is not None and _sums_in_kernel(do.shape[3], rope is not None)
  dqkv, sums = _backward(qk, qk, v, v_bias, o, lse, do, tables, at, tiling, interpret,
                         sums=in_kernel)
  if bias is None:
    dbias = None
  elif in_kernel:
    dbias = sums.astype(bias.dtype)
  else:
    dbias = jnp.sum(dqkv.astype(jnp.float32), (0, 1)).astype(bias.dtype)
  return dqkv, dbias, None if rope is None else tuple(jnp.zeros_like(x) for x in rope)


causal_attention_qkv.defvjp(_qkv_fwd, _qkv_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def causal_attention(q, k, v, tiling: AttentionTiling = DEFAULT_ATTENTION_TILING,
                     interpret: bool = False):
  """Causal softmax attention of ``[B, T, H, D]`` bf16 q, k, v (scale
  ``D ** -0.5``, float32 softmax): the same function as
  ``jax.nn.dot_product_attention(q, k, v, is_causal=True)``. The model
  calls ``causal_attention_qkv`` on its projection where it can."""
  return _attention_fwd(q, k, v, tiling, interpret)[0]


def _attention_fwd(q, k, v, tiling, interpret):
  check_shapes(q, k, v)
  b, t, h, d = q.shape
  qf, kf, vf = _flat(q), _flat(k), _flat(v)
  o, lse = _forward(qf, kf, vf, None, _separate(h), t, tiling, interpret)
  return o.reshape(q.shape), (qf, kf, vf, o, lse)


def _attention_bwd(tiling, interpret, res, do):
  qf, kf, vf, o, lse = res
  dqkv, _ = _backward(qf, kf, vf, None, o, lse, do, None, _separate(do.shape[2]), tiling,
                      interpret)   # no bias: no column sums
  return dqkv[:, :, 0], dqkv[:, :, 1], dqkv[:, :, 2]


causal_attention.defvjp(_attention_fwd, _attention_bwd)


# ------------------------------------------- the projection's epilogue: bias + RoPE

# The q/k/v projection's own tiling: 128 x 128 output tiles (two heads of 64)
# and 64 x 64 epilogue sub-tiles, one head each, so that the pairs RoPE
# rotates together (columns c and c + 32 of a head) are in one sub-tile.
PROJECTION_TILING = hopper_gemm.Tiling()


def check_projected(x, kernel, bias, rope, tiling: hopper_gemm.Tiling = PROJECTION_TILING
                    ) -> None:
  """Errors that name the fix for inputs ``causal_attention_projected`` does
  not take."""
  problems = []
  if x.ndim != 3 or kernel.ndim != 4 or kernel.shape[0] != x.shape[-1] or kernel.shape[1] != 3:
    raise ValueError(f"x must be [batch, tokens, width] and the kernel [width, 3, heads, "
                     f"head_dim], got {x.shape} and {kernel.shape}")
  b, t, width = x.shape
  _, _, heads, d = kernel.shape
  if bias is None or bias.shape != kernel.shape[1:]:
    problems.append(f"a bias [3, heads, head_dim] = {list(kernel.shape[1:])} "
                    f"(got {None if bias is None else bias.shape})")
  if d != tiling.epi or tiling.tile_n % d:
    problems.append(f"head_dim {tiling.epi} (one head per epilogue sub-tile), got {d}")
  if x.dtype != jnp.bfloat16 or kernel.dtype != jnp.bfloat16:
    problems.append(f"bf16 x and kernel, got {x.dtype} and {kernel.dtype}")
  if rope is None or any(r.shape != (t, d // 2) for r in rope):
    problems.append(f"one RoPE table pair [tokens, head_dim / 2] = {[t, d // 2]} shared by "
                    f"every image")
  try:
    tiling.check(b * t, 3 * heads * d, width)
    check_shapes(*(jax.ShapeDtypeStruct((b, t, heads, d), x.dtype),) * 3)
  except ValueError as e:
    problems.append(str(e))
  if problems:
    raise ValueError("causal_attention_projected needs " + "; ".join(problems)
                     + ". Project with the model's Dense and call causal_attention_qkv "
                     "(models/attention.py does when this does not fit).")


def fits_projected(x, kernel, bias, rope) -> bool:
  try:
    check_projected(x, kernel, bias, rope)
  except ValueError:
    return False
  return True


def projection_tables(cos, sin, seg: int, tile_m: int):
  """RoPE's ``[T, D/2]`` tables laid out for the projection's tiles: entry e
  of ``[P + 1, tile_m, D/2]`` holds the positions of flat rows ``tile_m e ..``
  (row r is position r % T; P = T / gcd(tile_m, T) entries make one period),
  and the last entry is the identity rotation (cos 1, sin 0), which v's
  columns take."""
  out = []
  for table, fill in ((cos, 1.0), (sin, 0.0)):
    rows = _tile_rows(table, seg, tile_m)
    out.append(jnp.concatenate([rows, jnp.full((1,) + rows.shape[1:], fill, jnp.float32)]))
  return tuple(out)


def _rope_epilogue(acc, bias, _, cos, sin):
  """One head's ``[64, D]`` sub-tile: the bias, then RoPE's rotation of the
  halves (x1 c - x2 s, x2 c + x1 s), as two pieces (see hopper_gemm.gemm's
  ``out_pieces``)."""
  h = acc + lax.broadcast_in_dim(bias, acc.shape, [1])
  half = h.shape[1] // 2
  x1, x2 = h[:, :half], h[:, half:]
  return ((x1 * cos - x2 * sin, x2 * cos + x1 * sin),)


def project_qkv(x, kernel, bias, rope, tiling: hopper_gemm.Tiling = PROJECTION_TILING,
                interpret: bool = False):
  """``x [B, T, W] @ kernel [W, 3, H, D] + bias`` with RoPE applied to q and
  k, in one kernel (the bias and the rotation in the product's epilogue, in
  float32): ``[B T, 3H, D]`` bf16, the packed layout the attention kernels
  read."""
  b, t, width = x.shape
  _, _, heads, d = kernel.shape
  tables = projection_tables(*rope, t, tiling.tile_m)
  period = tables[0].shape[0] - 1
  qk_cols = 2 * heads * d

  def entry(row, col):
    return jnp.where(col < qk_cols, row // tiling.tile_m % period, period)

  (out,) = hopper_gemm.gemm(
      x.reshape(b * t, width), kernel.reshape(width, 3 * heads * d),
      bias=bias.reshape(-1).astype(jnp.float32), epilogue=_rope_epilogue, num_out=1,
      row_tables=tables, table_entry=entry, out_pieces=2, tiling=tiling,
      interpret=interpret)
  return out.reshape(b * t, 3 * heads, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def causal_attention_projected(x, kernel, bias, rope,
                               tiling: AttentionTiling = DEFAULT_ATTENTION_TILING,
                               interpret: bool = False):
  """Causal attention straight from the block's input: ``x [B, T, W]`` bf16,
  the q/k/v projection's ``kernel [W, 3, H, D]`` (bf16) and ``bias [3, H,
  D]``, RoPE's ``rope = (cos, sin)`` (``[T, D/2]``, shared by every image):
  the same function as ``causal_attention_qkv(x @ kernel, bias, rope)``.

  The projection is our own product kernel (hopper_gemm.gemm) with the bias
  and RoPE's rotation in its epilogue, so q and k come out rotated: no pass
  of XLA's reads the product back to add the bias and rotate q and k, and
  the forward attention kernel reads q, k and v from that one array (no
  copy of v for the backward). The rounding differs from the model's XLA path: the bias
  and the rotation are applied to the float32 product and rounded to bf16
  once, where the XLA path rounds the product, then the biased product,
  then the rotation.

  The backward is causal_attention_qkv's (RoPE's transpose and the bias's
  column sums in the attention kernels' epilogues), then the projection's
  two products, XLA's."""
  return _projected_fwd(x, kernel, bias, rope, tiling, interpret)[0]


def _projected_fwd(x, kernel, bias, rope, tiling, interpret):
  check_projected(x, kernel, bias, rope)
  b, t, _ = x.shape
  heads = kernel.shape[2]
  packed = project_qkv(x, kernel, bias, rope, interpret=interpret)
  o, lse = _forward(packed, packed, packed, None, _packed(heads), t, tiling, interpret)
  # an empty array keeps the bias's dtype for its gradient
  return o.reshape(b, t, heads, -1), (x, kernel, packed, o, lse, rope,
                                      jnp.zeros((0,), bias.dtype))


def _projected_bwd(tiling, interpret, res, do):
  x, kernel, packed, o, lse, rope, bias_like = res
  b, t, width = x.shape
  heads, d = do.shape[2:]
  tables = extended_tables(*rope, t, tiling.rope_tables)
  # head dim 64 (check_projected): the bias gradient's column sums are taken
  # in the backward kernels' epilogues (see _qkv_bwd)
  dqkv, sums = _backward(packed, packed, packed, None, o, lse, do, tables, _packed(heads),
                         tiling, interpret, sums=True)
  flat = dqkv.reshape(b * t, 3 * heads * d)
  x2 = x.reshape(b * t, width)
  dkernel = lax.dot_general(x2, flat, (((0,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
  dx = lax.dot_general(flat, kernel.reshape(width, -1), (((1,), (1,)), ((), ())))
  return (dx.reshape(x.shape).astype(x.dtype), dkernel.reshape(kernel.shape).astype(kernel.dtype),
          sums.astype(bias_like.dtype), tuple(jnp.zeros_like(r) for r in rope))


causal_attention_projected.defvjp(_projected_fwd, _projected_bwd)


__all__: Sequence[str] = ("AttentionTiling", "DEFAULT_ATTENTION_TILING", "BLOCK",
                          "PROJECTION_TILING", "causal_attention", "causal_attention_projected",
                          "causal_attention_qkv", "check_projected", "check_qkv",
                          "check_shapes", "extended_tables", "fits", "fits_projected",
                          "fits_qkv", "project_qkv", "projection_tables")
