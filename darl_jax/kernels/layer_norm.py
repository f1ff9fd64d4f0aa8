"""Pre-LayerNorm in one pass each way, as Pallas Triton kernels (NVIDIA GPUs).

XLA's LayerNorm makes two passes over the token rows forward (statistics,
then the normalised output) and, in a pre-LN block, several backward (the
row reductions, the column sums of the scale and bias gradients, the add of
the residual stream's gradient). Here each direction is one kernel:

- forward: a block of rows is read once, its mean and variance (two-pass,
  in float32) taken in registers, and ``y`` written; the float32 mean and
  reciprocal deviation per row are kept for the backward (8 bytes a row).
- backward: a program walks its share of row blocks, writes
  ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = dy *
  scale`` plus the gradient that reaches ``x`` around the norm in the same
  pass, and keeps the scale and bias gradients' column sums in registers
  (per row of the block, reduced once at the end: ``Blocks.bwd_block_sums``);
  one ``[programs, 2 width]`` partial sum per program (``3 width`` with a
  deferred bias) is left for XLA to add up. ViT-B's 768 takes the same
  formula in XLA (``XLA_BACKWARD_WIDTHS``), which is faster there.

Three entry points, each ``-> (residual, LN(residual))``:
``residual_layer_norm(x, scale, bias)`` hands ``x`` on unchanged, so the
residual stream's cotangent is added in this op's backward kernel;
``add_layer_norm(x, y, ...)`` also does the residual add ``s = x + y`` in
the forward kernel (saving a pass that writes ``s`` for the norm to read
back); ``add_bias_layer_norm(x, y, y_bias, ...)`` also adds the deferred
bias of the projection that made ``y``, its gradient a third column sum in
the backward kernel. Invariant: ``s`` is rounded as XLA rounds ``x + (y +
y_bias)``, so the model's numbers do not change with ``kernels.norm``.

Rows are held as power-of-two chunks (Triton blocks; ViT-H's 1280 as 1024 +
256). On CPU the kernels run in Pallas's interpreter (tests). Use:
``kernels.norm='triton'`` (darl_jax/ops.py, kernels/fused_stack.py; the
default on sm_90 in bf16).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Kernel shape: ``rows`` token rows per block (a power of two), Triton
  ``warps`` per program; the backward runs at most ``programs`` programs,
  each over every ``programs``-th row block, so its column-sum partials
  stay small (``programs x width`` float32)."""
  rows: int = 4
  warps: int = 2
  bwd_rows: int = 4
  bwd_warps: int = 4
  programs: int = 1056
  # The backward kernel's row walk: ``bwd_chunk`` lanes per chunk (0: the
  # binary chunks of ``chunks``; else uniform chunks of that many lanes where
  # they divide the width), and ``bwd_sweeps`` passes over a block's chunks:
  # 1 holds every chunk of x and dy in registers between the row sums and dx;
  # 2 takes the row sums first and reads the chunks again for dx (from
  # cache), holding one chunk at a time.
  bwd_chunk: int = 0
  bwd_sweeps: int = 1
  # ``bwd_block_sums``: carry the scale and bias gradients' column sums as
  # ``[bwd_rows, width]`` (one row per row of the block) and reduce over the
  # rows once, after the walk, instead of a reduction across the block's
  # rows (threads) at every step; more registers, fewer synchronisations.
  bwd_block_sums: bool = True
  # "kernel", "xla" (``_backward_xla``), or "auto": see ``backward``.
  bwd: str = "auto"

  def __post_init__(self):
    for name in ("rows", "bwd_rows"):
      v = getattr(self, name)
      if v < 1 or v & (v - 1):
        raise ValueError(f"Blocks.{name} must be a power of two, got {v}")
    if self.bwd_chunk < 0 or self.bwd_chunk & (self.bwd_chunk - 1):
      raise ValueError(f"Blocks.bwd_chunk must be 0 or a power of two, got {self.bwd_chunk}")
    if self.bwd_sweeps not in (1, 2):
      raise ValueError(f"Blocks.bwd_sweeps must be 1 or 2, got {self.bwd_sweeps}")
    if self.bwd not in ("auto", "kernel", "xla"):
      raise ValueError(f"Blocks.bwd must be 'auto', 'kernel' or 'xla', got {self.bwd!r}")

  def bwd_parts(self, width: int) -> tuple[tuple[int, int], ...]:
    """The backward kernel's ``(start, size)`` column chunks of a row."""
    c = self.bwd_chunk
    if c and width % c == 0:
      return tuple((i, c) for i in range(0, width, c))
    return chunks(width)


# The backward kernel with block sums: faster than XLA's backward at ViT-H's
# 1280, alone and in the training step; at 1024 the block sums tie with the
# per-step reduction (benchmarks/layer_norm_bench.py).
DEFAULT_BLOCKS = Blocks()

# Widths where other blocks are faster (the model's norms take
# ``blocks_for(width)``): at ViT-L's 1024 the backward over 2 rows per block
# (at ViT-H's 1280 the default four rows stay faster).
WIDTH_BLOCKS = {1024: dataclasses.replace(DEFAULT_BLOCKS, bwd_rows=2)}


def blocks_for(width: int) -> Blocks:
  """The kernels' blocks for rows of ``width``: ``WIDTH_BLOCKS`` or the default."""
  return WIDTH_BLOCKS.get(width, DEFAULT_BLOCKS)

# Widths whose backward stays XLA's under ``bwd='auto'``: ViT-B's 768, where
# the kernel (512 + 256 chunks) is slower than XLA's.
XLA_BACKWARD_WIDTHS = (768,)


def chunks(width: int) -> tuple[tuple[int, int], ...]:
  """``(start, size)`` column chunks of power-of-two sizes covering a row of
  ``width`` (its binary digits, largest first: 1280 -> 1024 + 256). Triton
  blocks are powers of two; chunks rather than one block padded to
  ``next_pow2(width)`` keep ViT-H's 1280 from holding 2048 lanes in
  registers."""
  out, start = [], 0
  for bit in reversed(range(width.bit_length())):
    if width >> bit & 1:
      out.append((start, 1 << bit))
      start += 1 << bit
  return tuple(out)


def _load(ref, rows, rmask, start, size):
  cols = start + jnp.arange(size)
  return pltriton.load(ref.at[rows[:, None], cols[None, :]], mask=rmask[:, None],
                       other=0.0).astype(jnp.float32)


def _store(ref, rows, rmask, start, value):
  cols = start + jnp.arange(value.shape[1])
  pltriton.store(ref.at[rows[:, None], cols[None, :]], value.astype(ref.dtype),
                 mask=rmask[:, None])


def _vector(ref, start, size):
  return ref[pl.dslice(start, size)].astype(jnp.float32)


def _forward_kernel(*refs, eps, block_rows, has_add, has_add_bias):
  # inputs x [, add [, add_bias]], scale, bias; outputs [s,] y, mean, rstd
  refs = list(refs)
  x_ref = refs.pop(0)
  add_ref = refs.pop(0) if has_add else None
  add_bias_ref = refs.pop(0) if has_add_bias else None
  scale_ref, bias_ref = refs.pop(0), refs.pop(0)
  s_ref = refs.pop(0) if has_add else None
  y_ref, mean_ref, rstd_ref = refs
  n, width = x_ref.shape
  rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  rmask = rows < n
  parts = chunks(width)
  xs = [_load(x_ref, rows, rmask, start, size) for start, size in parts]
  if has_add:
    # the residual add, rounded to x's dtype as XLA's x + y is (a bf16 add is
    # a float32 add rounded to bf16); the norm is of the rounded sum, which is
    # also what the backward reads back
    for i, (start, size) in enumerate(parts):
      add = _load(add_ref, rows, rmask, start, size)
      if has_add_bias:
        # the added operand's deferred bias, rounded as XLA's add + bias is
        # (to add's dtype) before the residual add: x + (add + add_bias)
        # (a float32 bias is rounded to add's dtype first, as XLA's bf16
        # Dense casts its bias before adding it)
        add_bias = _vector(add_bias_ref, start, size).astype(add_ref.dtype).astype(jnp.float32)
        add = (add + add_bias[None, :]).astype(add_ref.dtype)
      s = (xs[i] + add.astype(jnp.float32)).astype(s_ref.dtype)
      _store(s_ref, rows, rmask, start, s)
      xs[i] = s.astype(jnp.float32)
  mean = sum(jnp.sum(x, axis=1) for x in xs) / width
  centred = [x - mean[:, None] for x in xs]
  # two-pass variance (centred values, already in registers): no cancellation
  rstd = jax.lax.rsqrt(sum(jnp.sum(c * c, axis=1) for c in centred) / width + eps)
  for (start, size), c in zip(parts, centred):
    y = c * rstd[:, None] * _vector(scale_ref, start, size)[None, :]
    _store(y_ref, rows, rmask, start, y + _vector(bias_ref, start, size)[None, :])
  pltriton.store(mean_ref.at[rows], mean, mask=rmask)
  pltriton.store(rstd_ref.at[rows], rstd, mask=rmask)


def _backward_kernel(*refs, block_rows, programs, has_residual, parts, sweeps, block_sums,
                     sum_dx):
  if has_residual:
    x_ref, scale_ref, mean_ref, rstd_ref, dy_ref, dres_ref, dx_ref, sums_ref = refs
  else:
    x_ref, scale_ref, mean_ref, rstd_ref, dy_ref, dx_ref, sums_ref = refs
    dres_ref = None
  n, width = x_ref.shape
  program = pl.program_id(0)
  blocks = pl.cdiv(n, block_rows)

  def body(block, sums):
    rows = block * block_rows + jnp.arange(block_rows)
    rmask = rows < n
    mean = pltriton.load(mean_ref.at[rows], mask=rmask, other=0.0)
    rstd = pltriton.load(rstd_ref.at[rows], mask=rmask, other=0.0)

    def chunk(start, size):
      # rows past the end load as zeros, so they add nothing to the sums
      xhat = (_load(x_ref, rows, rmask, start, size) - mean[:, None]) * rstd[:, None]
      dy = _load(dy_ref, rows, rmask, start, size)
      return xhat, dy, dy * _vector(scale_ref, start, size)[None, :]

    held = [chunk(start, size) for start, size in parts]
    c1 = sum(jnp.sum(g * xhat, axis=1) for xhat, _, g in held) / width
    c2 = sum(jnp.sum(g, axis=1) for _, _, g in held) / width
    new = []
    for i, (start, size) in enumerate(parts):
      # two sweeps: the chunk again (from cache) rather than held since the sums
      xhat, dy, g = chunk(start, size) if sweeps == 2 else held[i]
      dx = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
      if dres_ref is not None:
        dx += _load(dres_ref, rows, rmask, start, size)
      _store(dx_ref, rows, rmask, start, dx)
      # column sums over this block's rows (carried as one row per row of
      # the block, or reduced over them now): the scale's and bias's
      # gradients, and with sum_dx dx's own, of dx as stored (rounded to its
      # dtype), for the bias of an added branch (add_bias_layer_norm)
      terms = (dy * xhat, dy)
      if sum_dx:
        terms += (dx.astype(dx_ref.dtype).astype(jnp.float32),)
      new.append(tuple(acc + (t if block_sums else jnp.sum(t, axis=0))
                       for acc, t in zip(sums[i], terms)))
    return tuple(new)

  lead = (block_rows,) if block_sums else ()
  zeros = tuple(tuple(jnp.zeros(lead + (size,), jnp.float32) for _ in range(2 + sum_dx))
                for _, size in parts)
  # blocks program, program + programs, ...: neighbouring programs read
  # neighbouring rows at the same time
  count = (blocks - program + programs - 1) // programs
  sums = jax.lax.fori_loop(0, count, lambda i, s: body(program + i * programs, s), zeros)
  # one [programs, k * width] partial for all k column sums (scale's, bias's
  # [, dx's]): XLA then adds them up in one reduction, not k
  for (start, size), part_sums in zip(parts, sums):
    for k, total in enumerate(part_sums):
      sums_ref[program, pl.dslice(k * width + start, size)] = (
          jnp.sum(total, axis=0) if block_sums else total)


def _check(x, scale, bias):
  if x.ndim < 1 or scale.shape != x.shape[-1:] or bias.shape != x.shape[-1:]:
    raise ValueError(f"layer_norm: scale {scale.shape} and bias {bias.shape} must be "
                     f"[width] for x {x.shape}")


def forward(x, scale, bias, *, eps: float, blocks: Blocks = DEFAULT_BLOCKS,
            interpret: bool = False):
  """``(LN(x), (mean, rstd))`` over the last axis, the statistics float32 ``[rows]``."""
  _, y, stats = _forward(x, None, scale, bias, eps, blocks, interpret)
  return y, stats


def add_forward(x, y, scale, bias, *, y_bias=None, eps: float,
                blocks: Blocks = DEFAULT_BLOCKS, interpret: bool = False):
  """``(s, LN(s), (mean, rstd))`` for ``s = x + y`` (in ``x``'s dtype), in one
  kernel; ``s = x + (y + y_bias)`` given ``y_bias`` ``[width]``, the inner
  sum rounded to ``y``'s dtype."""
  if y.shape != x.shape:
    raise ValueError(f"add_layer_norm: x {x.shape} and y {y.shape} must have the same shape "
                     "(the kernel adds them row by row; broadcast y first)")
  if y_bias is not None and y_bias.shape != x.shape[-1:]:
    raise ValueError(f"add_bias_layer_norm: y_bias {y_bias.shape} must be [width] for "
                     f"x {x.shape}")
  return _forward(x, y, scale, bias, eps, blocks, interpret, y_bias)


def _forward(x, add, scale, bias, eps, blocks, interpret, add_bias=None):
  """The forward kernel: ``(s, LN(s), (mean, rstd))`` for ``s = x + add``
  (``x + (add + add_bias)`` given ``add_bias``), or ``(None, LN(x), (mean,
  rstd))`` where ``add`` is None."""
  _check(x, scale, bias)
  width = x.shape[-1]
  x2 = x.reshape(-1, width)
  n = x2.shape[0]
  row_out = jax.ShapeDtypeStruct(x2.shape, x.dtype)
  stat = jax.ShapeDtypeStruct((n,), jnp.float32)
  inputs = (x2,) if add is None else (x2, add.reshape(-1, width))
  if add_bias is not None:
    inputs += (add_bias,)
  name = ("layer_norm_fwd" if add is None else
          "add_layer_norm_fwd" if add_bias is None else "add_bias_layer_norm_fwd")
  outs = pl.pallas_call(
      functools.partial(_forward_kernel, eps=eps, block_rows=blocks.rows,
                        has_add=add is not None, has_add_bias=add_bias is not None),
      grid=(pl.cdiv(n, blocks.rows),),
      # [s,] y, mean, rstd
      out_shape=(row_out,) * (1 if add is None else 2) + (stat, stat),
      compiler_params=pltriton.CompilerParams(num_warps=blocks.warps),
      interpret=interpret, name=name)(*inputs, scale, bias)
  *out, mean, rstd = outs
  s = None if add is None else out[0].reshape(x.shape)
  return s, out[-1].reshape(x.shape), (mean, rstd)


def backward(x, scale, mean, rstd, dy, dres=None, *, blocks: Blocks = DEFAULT_BLOCKS,
             sum_dx: bool = False, interpret: bool = False):
  """``(dx [+ dres], dscale, dbias)`` for ``y = LN(x)`` given ``dy``; ``dres``
  (optional) is the gradient reaching ``x`` by other paths. ``sum_dx``: also
  the float32 sum over the rows of ``dx [+ dres]`` as returned (``[width]``,
  the gradient of a bias added into ``x``), taken in the kernel's pass.

  ``blocks.bwd``: "kernel", "xla" (the same formula as XLA fuses it), or
  "auto": the kernel except at ``XLA_BACKWARD_WIDTHS``."""
  width = x.shape[-1]
  use_xla = blocks.bwd == "xla" or (blocks.bwd == "auto" and width in XLA_BACKWARD_WIDTHS)
  if use_xla:
    out = _backward_xla(x, scale, mean, rstd, dy, dres)
    if sum_dx:
      out += (jnp.sum(out[0].astype(jnp.float32), axis=tuple(range(x.ndim - 1))),)
    return out
  x2, dy2 = x.reshape(-1, width), dy.reshape(-1, width)
  n = x2.shape[0]
  programs = max(1, min(blocks.programs, pl.cdiv(n, blocks.bwd_rows)))
  args = [x2, scale, mean, rstd, dy2]
  if dres is not None:
    args.append(dres.reshape(-1, width))
  num_sums = 3 if sum_dx else 2
  dx, partials = pl.pallas_call(
      functools.partial(_backward_kernel, block_rows=blocks.bwd_rows, programs=programs,
                        has_residual=dres is not None, parts=blocks.bwd_parts(width),
                        sweeps=blocks.bwd_sweeps, block_sums=blocks.bwd_block_sums,
                        sum_dx=sum_dx),
      grid=(programs,),
      out_shape=(jax.ShapeDtypeStruct(x2.shape, x.dtype),
                 jax.ShapeDtypeStruct((programs, num_sums * width), jnp.float32)),
      compiler_params=pltriton.CompilerParams(num_warps=blocks.bwd_warps),
      interpret=interpret, name="layer_norm_bwd")(*args)
  dscale, dbias, *dsum = jnp.sum(partials, axis=0).reshape(num_sums, width)
  return (dx.reshape(x.shape), dscale.astype(scale.dtype), dbias.astype(scale.dtype),
          *dsum)


def _backward_xla(x, scale, mean, rstd, dy, dres):
  """``backward``'s formula as XLA fuses it (one pass for dx, column sums)."""
  width = x.shape[-1]
  stats = lambda v: v.reshape(x.shape[:-1] + (1,))
  xhat = (x.astype(jnp.float32) - stats(mean)) * stats(rstd)
  dy32 = dy.astype(jnp.float32)
  g = dy32 * scale
  c1 = jnp.sum(g * xhat, axis=-1, keepdims=True) / width
  c2 = jnp.sum(g, axis=-1, keepdims=True) / width
  dx = (g - xhat * c1 - c2) * stats(rstd)
  if dres is not None:
    dx = dx + dres.astype(jnp.float32)
  axes = tuple(range(x.ndim - 1))
  return (dx.astype(x.dtype), jnp.sum(dy32 * xhat, axis=axes).astype(scale.dtype),
          jnp.sum(dy32, axis=axes).astype(scale.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def layer_norm(x, scale, bias, eps: float = 1e-6, blocks: Blocks = DEFAULT_BLOCKS,
               interpret: bool = False):
  """``LN(x) * scale + bias`` alone, for a norm whose input goes nowhere else
  (its own gradient, so the backward reads no zeros for a residual)."""
  return forward(x, scale, bias, eps=eps, blocks=blocks, interpret=interpret)[0]


def _norm_fwd(x, scale, bias, eps, blocks, interpret):
  y, (mean, rstd) = forward(x, scale, bias, eps=eps, blocks=blocks, interpret=interpret)
  return y, (x, scale, mean, rstd)


def _norm_bwd(eps, blocks, interpret, saved, dy, dres=None, sum_dx=False):
  del eps
  x, scale, mean, rstd = saved
  return backward(x, scale, mean, rstd, dy, dres, blocks=blocks, sum_dx=sum_dx,
                  interpret=interpret)


layer_norm.defvjp(_norm_fwd, _norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def residual_layer_norm(x, scale, bias, eps: float = 1e-6,
                        blocks: Blocks = DEFAULT_BLOCKS, interpret: bool = False):
  """``(x, LN(x) * scale + bias)``: ``x`` unchanged, for the residual stream
  (its cotangent is added in the backward kernel), and the normalised rows
  in ``x``'s dtype (statistics and arithmetic in float32)."""
  return x, forward(x, scale, bias, eps=eps, blocks=blocks, interpret=interpret)[0]


def _residual_fwd(x, scale, bias, eps, blocks, interpret):
  y, saved = _norm_fwd(x, scale, bias, eps, blocks, interpret)
  return (x, y), saved


def _residual_bwd(eps, blocks, interpret, saved, cotangents):
  dres, dy = cotangents
  return _norm_bwd(eps, blocks, interpret, saved, dy, dres)


residual_layer_norm.defvjp(_residual_fwd, _residual_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def add_layer_norm(x, y, scale, bias, eps: float = 1e-6,
                   blocks: Blocks = DEFAULT_BLOCKS, interpret: bool = False):
  """``(s, LN(s) * scale + bias)`` for ``s = x + y``: a residual add and the
  next pre-LN norm in one kernel, which reads ``x`` and ``y`` and writes
  ``s`` and the normalised rows. ``s`` is in ``x``'s dtype and rounded as
  XLA's ``x + y`` is (the same bits when ``y``'s dtype is ``x``'s); ``x`` and
  ``y`` have the same shape.

  The gradient is ``residual_layer_norm``'s at ``s`` (the residual stream's
  cotangent added in the backward kernel), given to ``x`` and ``y`` both (in
  their dtypes): an add passes its cotangent on unchanged. A cotangent of
  ``s`` that is symbolically zero (``s`` unused, as in a final norm) is not
  read."""
  s, out, _ = add_forward(x, y, scale, bias, eps=eps, blocks=blocks, interpret=interpret)
  return s, out


def _add_fwd(x, y, scale, bias, eps, blocks, interpret):
  # symbolic_zeros: the primals come wrapped (value, perturbed)
  x, y, scale, bias = (a.value for a in (x, y, scale, bias))
  s, out, (mean, rstd) = add_forward(x, y, scale, bias, eps=eps, blocks=blocks,
                                     interpret=interpret)
  # y itself is not needed; an empty array keeps its dtype for the cotangent
  return (s, out), (s, scale, mean, rstd, jnp.zeros((0,), y.dtype))


def _add_bwd(eps, blocks, interpret, saved, cotangents, sum_dx=False):
  s, scale, mean, rstd, y_like = saved
  ds, dout = cotangents
  if isinstance(dout, SymbolicZero):
    dout = jnp.zeros(s.shape, s.dtype)
  dres = None if isinstance(ds, SymbolicZero) else ds
  d, dscale, dbias, *dsum = _norm_bwd(eps, blocks, interpret, (s, scale, mean, rstd), dout,
                                      dres, sum_dx)
  return (d, d.astype(y_like.dtype), dscale, dbias) + tuple(dsum)


add_layer_norm.defvjp(_add_fwd, _add_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def add_bias_layer_norm(x, y, y_bias, scale, bias, eps: float = 1e-6,
                        blocks: Blocks = DEFAULT_BLOCKS, interpret: bool = False):
  """``add_layer_norm`` with the added operand's bias deferred into the
  kernel: ``(s, LN(s) * scale + bias)`` for ``s = x + (y + y_bias)``, where
  ``y`` is a projection's product and ``y_bias`` ``[width]`` its bias (any
  float dtype; the model hands on the float32 parameter), handed on apart so
  that no pass of XLA's own adds them. ``y_bias`` is rounded to ``y``'s
  dtype, ``y + y_bias`` to ``y``'s dtype, then ``s`` to ``x``'s, as XLA's
  ``x + (y + y_bias.astype(y.dtype))`` is (the same bits).

  The gradient is ``add_layer_norm``'s: one cotangent ``d`` of ``s`` given to
  ``x`` and ``y`` both, and ``y_bias``'s the sum of ``d`` over the rows (in
  float32, then ``y_bias``'s dtype: a float32 bias gets a float32 gradient,
  where a bias cast to bf16 before its add would get a bf16 one); a
  symbolically zero cotangent of ``s`` is not read."""
  s, out, _ = add_forward(x, y, scale, bias, y_bias=y_bias, eps=eps, blocks=blocks,
                          interpret=interpret)
  return s, out


def _add_bias_fwd(x, y, y_bias, scale, bias, eps, blocks, interpret):
  x, y, y_bias, scale, bias = (a.value for a in (x, y, y_bias, scale, bias))
  s, out, (mean, rstd) = add_forward(x, y, scale, bias, y_bias=y_bias, eps=eps,
                                     blocks=blocks, interpret=interpret)
  return (s, out), (s, scale, mean, rstd, jnp.zeros((0,), y.dtype),
                    jnp.zeros((0,), y_bias.dtype))


def _add_bias_bwd(eps, blocks, interpret, saved, cotangents):
  *saved, bias_like = saved
  # y_bias's gradient, the row sum of d, is a third column sum in the
  # backward kernel's pass, not a pass of XLA's own over d (one [rows,
  # width] read per norm)
  d, dy, dscale, dbias, dsum = _add_bwd(eps, blocks, interpret, tuple(saved), cotangents,
                                        sum_dx=True)
  return d, dy, dsum.astype(bias_like.dtype), dscale, dbias


add_bias_layer_norm.defvjp(_add_bias_fwd, _add_bias_bwd, symbolic_zeros=True)
