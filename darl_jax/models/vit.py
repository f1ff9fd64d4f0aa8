"""The ViT backbone: pre-LN blocks, a learned SOS token, causal or full attention."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from darl_jax.kernels import select
from darl_jax.models import attention as attention_lib
from darl_jax.models import posenc as posenc_lib

DENSE_INIT = nn.initializers.xavier_uniform()
LN_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Variant:
  width: int
  depth: int
  num_heads: int
  mlp_dim: int


# Standard ViT sizes (Dosovitskiy et al.; Zhai et al. for M and g). Depth and
# width set the parameter count; the patch size is the "/p" suffix.
VARIANTS = {
    "mu": Variant(64, 2, 2, 256),      # a micro model for unit tests
    "Ti": Variant(192, 12, 3, 768),
    "S": Variant(384, 12, 6, 1536),
    "M": Variant(512, 12, 8, 2048),
    "B": Variant(768, 12, 12, 3072),
    "L": Variant(1024, 24, 16, 4096),
    "H": Variant(1280, 32, 16, 5120),
    "g": Variant(1408, 40, 16, 6144),
}


def parse_variant(name: str) -> tuple[Variant, int]:
  """``"L/16"`` -> (Variant, 16). Fails early with the valid names."""
  m = re.fullmatch(r"(\w+)/(\d+)", name or "")
  if not m or m.group(1) not in VARIANTS:
    raise ValueError(
        f"unknown model variant {name!r}; use '<size>/<patch>' with size one of "
        f"{', '.join(VARIANTS)} (e.g. 'L/16', 'Ti/4')")
  return VARIANTS[m.group(1)], int(m.group(2))


class DropPath(nn.Module):
  """Stochastic depth: drops the whole residual branch per example."""
  rate: float

  @nn.compact
  def __call__(self, x, deterministic: bool):
    if deterministic or self.rate == 0.0:
      return x
    keep = 1.0 - self.rate
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    mask = jax.random.bernoulli(self.make_rng("dropout"), keep, shape)
    return jnp.where(mask, x / keep, 0).astype(x.dtype)


def _erf_term(x32):
  return 1.0 + jax.lax.erf(x32 * (2.0 ** -0.5))


@jax.custom_vjp
def gelu_exact(x):
  """Exact GELU, x * Phi(x) = x/2 * (1 + erf(x / sqrt 2)), in float32, returned
  in ``x``'s dtype.

  Two choices, both for speed with the same function:
  - ``erf``, as PyTorch's exact GELU, not ``jax.nn.gelu``'s ``erfc`` form:
    XLA expands erfc into both branches of a piecewise approximation with an
    exp and a division, which made the MLP's GELU kernels compute-bound. The
    values differ by float32 rounding, below 1e-6 absolute (where 1 + erf
    cancels, in the far negative tail).
  - A custom gradient that keeps only ``x`` (already in memory, bf16 in
    training) and recomputes Phi(x) + x phi(x) from it. Left to autodiff,
    XLA saves a float32 intermediate of the MLP's widest activation
    ([tokens, 4 * width]).
  Evaluating in float32 also lets XLA fuse the GELU into one kernel.
  """
  x32 = x.astype(jnp.float32)
  return (0.5 * x32 * _erf_term(x32)).astype(x.dtype)


def _gelu_exact_fwd(x):
  return gelu_exact(x), x


def _gelu_exact_bwd(x, g):
  x32 = x.astype(jnp.float32)
  cdf = 0.5 * _erf_term(x32)
  pdf = jnp.exp(-0.5 * x32 * x32) * ((2.0 * jnp.pi) ** -0.5)
  return ((g.astype(jnp.float32) * (cdf + x32 * pdf)).astype(x.dtype),)


gelu_exact.defvjp(_gelu_exact_fwd, _gelu_exact_bwd)


# "xla": two Dense layers with the GELU between them, as XLA compiles them.
# "hopper": the same function on darl_jax/kernels/hopper_mlp.py's Hopper
# kernels (the GELU and its derivative inside the matrix products, of the
# float32 pre-activation where "xla" rounds it to bf16 first; bf16,
# sm_90 GPUs) wherever batch x tokens
# is a multiple of 128, the XLA MLP elsewhere. Same parameters.
MLP_IMPLS = ("xla", "hopper")


def check_mlp_impl(name: str) -> str:
  if name not in MLP_IMPLS:
    raise ValueError(f"unknown MLP implementation {name!r}; valid: {', '.join(MLP_IMPLS)}")
  return name


class DenseParams(nn.Module):
  """nn.Dense's parameters (same names, shapes and initialisers), unapplied."""
  features: int

  @nn.compact
  def __call__(self, fan_in):
    return (self.param("kernel", DENSE_INIT, (fan_in, self.features), jnp.float32),
            self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32))


def _hopper_kernels_fit(x, hidden: int, dtype) -> bool:
  """Whether ``mlp_impl='hopper'`` runs its kernels on ``x``: errors that name
  the fix for a wrong dtype or device; False for shapes the kernels do not
  tile (parameter init on one example, a last partial batch), which take the
  XLA MLP, the same function."""
  # imports Pallas Mosaic GPU only when used
  from darl_jax.kernels import hopper_mlp, mosaic, per_shard
  if jnp.dtype(dtype) != jnp.bfloat16:
    raise ValueError("model.mlp_impl='hopper' runs in bfloat16; set model.dtype='bfloat16' "
                     "or model.mlp_impl='xla'")
  mosaic.require_hopper("model.mlp_impl='hopper'", tpu_fix="model.mlp_impl='xla'",
                        gpu_fix="model.mlp_impl='xla'")
  x = per_shard.local(x)   # one device's rows
  if x is None:
    return False
  try:
    for tiling in (hopper_mlp.DEFAULT_KERNELS.fwd, hopper_mlp.DEFAULT_KERNELS.bwd):
      tiling.check(math.prod(x.shape[:-1]), hidden, x.shape[-1])
  except ValueError:
    return False
  return True


class Mlp(nn.Module):
  """fc1, exact GELU, fc2. ``defer_bias``: return fc2's product and bias
  apart, ``(product, bias)`` (the float32 bias parameter), for the caller to add
  the bias in its next norm's kernel (Block); the same parameters either
  way."""
  hidden: int
  dtype: Any = jnp.float32
  impl: str = "xla"
  defer_bias: bool = False

  @nn.compact
  def __call__(self, x):
    width = x.shape[-1]
    if (check_mlp_impl(self.impl) == "hopper"
        and _hopper_kernels_fit(x, self.hidden, self.dtype)):
      from darl_jax.kernels import hopper_mlp, per_shard
      w1, b1 = DenseParams(self.hidden, name="fc1")(width)
      w2, b2 = DenseParams(width, name="fc2")(self.hidden)
      # Off the GPU the kernels run in Pallas's interpreter: correct, slow (tests).
      interpret = jax.default_backend() != "gpu"
      y = per_shard.over_batch(
          lambda x, w1, b1, w2, b2: hopper_mlp.mlp(
              x, w1, b1, w2, b2, hopper_mlp.DEFAULT_KERNELS, interpret),
          x.astype(self.dtype), w1, b1, w2, None if self.defer_bias else b2,
          batched=(True, False, False, False, False))
      # deferred, the float32 parameter: the norm rounds it to y's dtype for
      # the add (as mlp would have) and its gradient stays a float32 sum
      return (y, b2) if self.defer_bias else y
    h = nn.Dense(self.hidden, dtype=self.dtype, kernel_init=DENSE_INIT, name="fc1")(x)
    # Exact (erf) GELU as in the standard ViT, so exported weights behave the
    # same; see gelu_exact for how it is computed.
    h = gelu_exact(h)
    if self.defer_bias:
      return attention_lib.DenseBiasApart(width, (-1,), self.dtype, DENSE_INIT, name="fc2")(h)
    return nn.Dense(width, dtype=self.dtype, kernel_init=DENSE_INIT, name="fc2")(h)


# "xla": flax's nn.LayerNorm. "triton": the same function and parameters on
# darl_jax/kernels/layer_norm.py's Pallas Triton kernels (NVIDIA GPUs), one
# pass over the tokens each way, with the residual stream's gradient added in
# the norm's backward, and each
# residual add done in the forward kernel of the norm that follows it (see
# Block), with the bias of the projection that ends the branch.
NORM_IMPLS = ("xla", "triton")


def check_norm_impl(name: str) -> str:
  if name not in NORM_IMPLS:
    raise ValueError(f"unknown LayerNorm implementation {name!r}; valid: {', '.join(NORM_IMPLS)}")
  return name


def branch_value(branch):
  """A residual branch's value: the array itself, or ``product + bias`` for a
  branch handed on as the pair ``(product, bias)`` (a deferred bias, Block;
  the bias rounded to the product's dtype first, as a Dense layer adds it)."""
  if isinstance(branch, tuple):
    product, bias = branch
    return product + bias.astype(product.dtype)
  return branch


class TritonLayerNorm(nn.Module):
  """nn.LayerNorm (same parameter names, shapes, initialisers, epsilon and
  float32 statistics) on the fused kernels. ``residual=True`` returns
  ``(x, LN(x))``: ``x`` handed on unchanged for the residual add, so that its
  gradient joins the norm's in one backward pass. ``add=y`` returns ``(s,
  LN(s))`` for ``s = x + y``, the add done in the norm's forward kernel (the
  gradient as with ``residual``); ``add=(y, b)`` (a branch with its bias
  deferred) for ``s = x + (y + b)``, the bias added in the same kernel."""
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, residual: bool = False, add=None):
    from darl_jax.kernels import layer_norm, per_shard   # imports Pallas Triton when used
    device = jax.devices()[0]
    if device.platform not in ("gpu", "cpu"):
      raise ValueError(f"model.norm_impl='triton' runs on NVIDIA GPUs, not {device.platform}; "
                       "use model.norm_impl='xla'")
    width = x.shape[-1]
    scale = self.param("scale", nn.initializers.ones, (width,), jnp.float32)
    bias = self.param("bias", nn.initializers.zeros, (width,), jnp.float32)
    # Off the GPU the kernels run in Pallas's interpreter: correct, slow (tests).
    interpret = jax.default_backend() != "gpu"
    blocks = layer_norm.blocks_for(width)
    # On a mesh each device normalises its own rows (kernels/per_shard.py).
    if isinstance(add, tuple):
      product, add_bias = add
      s, y = per_shard.over_batch(
          lambda x, p, ab, sc, b: layer_norm.add_bias_layer_norm(
              x, p, ab, sc, b, LN_EPS, blocks, interpret),
          x, product, add_bias, scale, bias, batched=(True, True, False, False, False))
      return s, y.astype(self.dtype)
    if add is not None:
      s, y = per_shard.over_batch(
          lambda x, a, sc, b: layer_norm.add_layer_norm(x, a, sc, b, LN_EPS, blocks, interpret),
          x, add, scale, bias, batched=(True, True, False, False))
      return s, y.astype(self.dtype)
    fn = layer_norm.residual_layer_norm if residual else layer_norm.layer_norm
    out = per_shard.over_batch(lambda x, sc, b: fn(x, sc, b, LN_EPS, blocks, interpret),
                               x, scale, bias, batched=(True, False, False))
    if residual:
      return out[0], out[1].astype(self.dtype)
    return out.astype(self.dtype)


def final_norm(impl: str, dtype, name: str, x, add=None):
  """LN(x) by ``impl`` (NORM_IMPLS), for a norm whose input is not used
  again; ``LN(x + add)`` if ``add`` is given, an array or a ``(product,
  bias)`` pair (``branch_value``; the triton norm adds either in its
  kernel). Call from a compact method: the norm's parameters go under ``name``."""
  if check_norm_impl(impl) == "triton":
    if add is not None:   # the sum goes unused: its gradient is a symbolic zero, not read
      return TritonLayerNorm(dtype=dtype, name=name)(x, add=add)[1]
    return TritonLayerNorm(dtype=dtype, name=name)(x)
  if add is not None:
    x = x + branch_value(add)
  return nn.LayerNorm(epsilon=LN_EPS, dtype=dtype, name=name)(x)


def pre_norm(impl: str, dtype, name: str, x, add=None):
  """``(x, LN(x))`` for a pre-LN residual branch, by ``impl``: the triton
  norm adds the residual's gradient in its own backward. With ``add`` (the
  residual add before the norm), ``(s, LN(s))`` for ``s = x + add``: the
  triton norm reads ``x`` and ``add`` and writes both in one kernel, where
  XLA would add in a pass of its own and the norm read the sum back.
  ``add`` may be a ``(product, bias)`` pair (``branch_value``), its bias
  then added in the same kernel."""
  if check_norm_impl(impl) == "triton":
    return TritonLayerNorm(dtype=dtype, name=name)(x, residual=True, add=add)
  if add is not None:
    x = x + branch_value(add)
  return x, final_norm(impl, dtype, name, x)


def defers_bias(norm_impl: str, drop_path: float) -> bool:
  """Whether a Block hands its branches on as ``(product, bias)`` pairs, the
  bias added in the next norm's kernel: with the triton norms, on branches
  without drop path (a dropped branch's bias is dropped with it, so it would
  be scaled per example before the add)."""
  return norm_impl == "triton" and drop_path == 0


class Block(nn.Module):
  """Pre-LayerNorm Transformer block: x + attn(LN(x)); x + mlp(LN(x)).

  Each residual add feeds a norm, and with ``norm_impl='triton'`` it is done
  in that norm's forward kernel (``pre_norm``'s ``add``) instead of in an XLA
  pass of its own: the attention branch's add in norm2, and, between blocks,
  the MLP branch's add in the next block's norm1 (or the final norm). An
  add of its own reads two arrays and writes one that the norm then reads
  back; fused, that read is saved.

  The biases of the projections that end the branches (the attention's
  output projection, the MLP's fc2) are added in the same kernels
  (``defers_bias``: triton norms, no drop path): the projections return
  ``(product, bias)`` and the norm adds ``x + (product + bias)``, rounded
  as XLA would; otherwise each bias add is a pass of its own, reading and
  writing a [rows, width] array.

  For the add between blocks the block hands its output on un-added:
  ``return_branch=True`` returns ``(x, branch)`` with the output ``x +
  branch`` (``branch`` drop-pathed already; a ``(product, bias)`` pair where
  the bias is deferred, see ``branch_value``), and ``branch=`` takes the
  previous block's, array or pair, so that this block's input is ``x +
  branch``, added in norm1. With ``norm_impl='xla'`` the same arguments add
  in XLA. The parameters are the same either way."""
  num_heads: int
  mlp_dim: int
  causal: bool = True
  attention_impl: str = "xla"
  drop_path: float = 0.0
  dtype: Any = jnp.float32
  mlp_impl: str = "xla"
  norm_impl: str = "xla"
  return_branch: bool = False

  @nn.compact
  def __call__(self, x, rope=None, mask=None, deterministic: bool = True, branch=None):
    defer = defers_bias(self.norm_impl, self.drop_path)
    x, y = pre_norm(self.norm_impl, self.dtype, "norm1", x, add=branch)
    y = attention_lib.MultiHeadAttention(
        self.num_heads, causal=self.causal, impl=self.attention_impl,
        dtype=self.dtype, defer_bias=defer, name="attn")(y, rope, mask)
    if not defer:
      y = DropPath(self.drop_path)(y, deterministic)
    x, y = pre_norm(self.norm_impl, self.dtype, "norm2", x, add=y)
    y = Mlp(self.mlp_dim, dtype=self.dtype, impl=self.mlp_impl, defer_bias=defer,
            name="mlp")(y)
    if not defer:
      y = DropPath(self.drop_path)(y, deterministic)
    return (x, y) if self.return_branch else x + branch_value(y)


class ReadoutBlock(nn.Module):
  """A full-attention (non-causal, no RoPE, no drop path) Block's output at
  one token, ``token [B, 1, D]``, whose sequence is ``[context, token]``
  (``context [B, S, D]``, keys and values only): the same parameters as
  ``Block`` and the same function as ``Block(causal=False)`` over the
  concatenated sequence, read at its last token (tests). The context's
  queries, output projection, norm2 and MLP, whose outputs nobody reads,
  are not computed: the denoising decoder's last block reads only its
  noisy-patch token, so 14 of its 24 width^2 multiply-adds per patch are
  left (flops.readout_layer_flops). Returns ``token``'s output, or ``(x,
  branch)`` with ``return_branch`` as Block."""
  num_heads: int
  mlp_dim: int
  dtype: Any = jnp.float32
  mlp_impl: str = "xla"
  norm_impl: str = "xla"
  return_branch: bool = False

  @nn.compact
  def __call__(self, context, token):
    defer = defers_bias(self.norm_impl, 0.0)
    # norm1 normalises both tokens (one module called twice: one set of
    # parameters); only the read-out token's residual stream goes on
    if check_norm_impl(self.norm_impl) == "triton":
      norm1 = TritonLayerNorm(dtype=self.dtype, name="norm1")
      context, (token, y) = norm1(context), norm1(token, residual=True)
    else:
      norm1 = nn.LayerNorm(epsilon=LN_EPS, dtype=self.dtype, name="norm1")
      context, y = norm1(context), norm1(token)
    y = attention_lib.ReadoutAttention(self.num_heads, dtype=self.dtype, defer_bias=defer,
                                       name="attn")(context, y)
    x, y = pre_norm(self.norm_impl, self.dtype, "norm2", token, add=y)
    y = Mlp(self.mlp_dim, dtype=self.dtype, impl=self.mlp_impl, defer_bias=defer,
            name="mlp")(y)
    return (x, y) if self.return_branch else x + branch_value(y)


class ScanBlock(nn.Module):
  """``Block`` in the (carry, x) -> (carry, y) form that ``nn.scan`` wants.
  ``fuse_add``: the carry is ``(x, branch)`` (``Block.return_branch``), the
  add between blocks done in the next block's norm1; ``branch`` is the pair
  ``(product, bias)`` (the blocks defer their biases: triton norms, and no
  drop path under scan)."""
  block_kwargs: dict
  deterministic: bool = True
  fuse_add: bool = False

  @nn.compact
  def __call__(self, carry, rope):
    if self.fuse_add:
      x, branch = carry
      x, branch = Block(**self.block_kwargs, return_branch=True, name="block")(
          x, rope, None, self.deterministic, branch)
      # the block output, for probes (unused: removed)
      return (x, branch), x + branch_value(branch)
    x = Block(**self.block_kwargs, name="block")(carry, rope, None, self.deterministic)
    return x, x


class ViT(nn.Module):
  """Causal (or full-attention) ViT over a sequence of patch tokens.

  Call with ordered patches ``[B, T, P]`` and their integer grid positions
  ``rows``/``cols`` and 1D ``index`` (``[B or 1, T]``; index = position in the
  ordering + 1, so index 0 is the SOS slot). ``prepend_sos`` puts the learned
  start-of-sequence token in front (T + 1 outputs).

  Returns a dict: ``features`` (final LayerNorm output, ``[B, T', D]``) and
  ``block_XX`` (each block's residual-stream output, for per-layer probes).
  """
  width: int
  depth: int
  num_heads: int
  mlp_dim: int
  posenc: str = "rope2d"
  reference_grid: tuple[int, int] = (14, 14)
  rope_max_wavelength: float = 10_000.0
  causal: bool = True
  attention_impl: str = "xla"
  drop_path: float = 0.0
  dtype: Any = jnp.float32
  scan_layers: bool = False
  remat: str = "none"   # none | full | save_dots
  mlp_impl: str = "xla"   # xla | hopper (MLP_IMPLS)
  norm_impl: str = "xla"   # xla | triton (NORM_IMPLS)

  def _block_kwargs(self, i: int) -> dict:
    rate = self.drop_path * i / max(self.depth - 1, 1)  # linearly increasing
    return dict(num_heads=self.num_heads, mlp_dim=self.mlp_dim, causal=self.causal,
                attention_impl=self.attention_impl, drop_path=rate, dtype=self.dtype,
                mlp_impl=self.mlp_impl, norm_impl=self.norm_impl)

  def embed_tokens(self, patches, rows, cols, index, grid_hw, prepend_sos: bool):
    """Patch embedding, additive positions, SOS and the RoPE tables.

    Called from a compact ``__call__`` (this one's or a subclass's), so the
    parameters it creates keep the backbone's names. Returns ``x [B, T', D]``
    and ``rope`` (``(cos, sin)`` tables ``[B, T', head_dim/2]``, or None).
    """
    posenc_lib.check_posenc(self.posenc)
    x = nn.Dense(self.width, dtype=self.dtype, kernel_init=DENSE_INIT,
                 name="patch_embed")(patches)
    x = x + self.additive_positions(rows, cols, grid_hw, x.dtype)
    rows_f, cols_f, index_f = self.scaled_positions(rows, cols, index, grid_hw)
    if prepend_sos:
      sos = self.param("sos", nn.initializers.normal(0.02), (self.width,), jnp.float32)
      x = jnp.concatenate([jnp.broadcast_to(sos.astype(x.dtype),
                                            (x.shape[0], 1, self.width)), x], 1)
      lead = rows_f.shape[:-1] + (1,)
      sos_row, sos_col, sos_index = posenc_lib.sos_position(grid_hw, self.reference_grid)
      rows_f = jnp.concatenate([jnp.full(lead, sos_row), rows_f], -1)
      cols_f = jnp.concatenate([jnp.full(lead, sos_col), cols_f], -1)
      index_f = jnp.concatenate([jnp.full(lead, sos_index), index_f], -1)
    return x, self.rope_tables(rows_f, cols_f, index_f)

  def scaled_positions(self, rows, cols, index, grid_hw):
    """float32 positions, interpolated onto the reference grid (rows and
    columns by the grid's ratio, the 1D index by the token count's)."""
    sy, sx = posenc_lib.interpolation_scale(grid_hw, self.reference_grid)
    si = posenc_lib.index_scale(grid_hw, self.reference_grid)
    # Per-example (e.g. permuted) and shared positions may be mixed: broadcast.
    return tuple(jnp.broadcast_arrays(jnp.asarray(rows, jnp.float32) * sy,
                                      jnp.asarray(cols, jnp.float32) * sx,
                                      jnp.asarray(index, jnp.float32) * si))

  def additive_positions(self, rows, cols, grid_hw, dtype):
    """The sin-cos / learned embedding to add (0 for NoPE and RoPE)."""
    if self.posenc == "sincos2d":
      r, c, _ = self.scaled_positions(rows, cols, rows, grid_hw)
      return posenc_lib.sincos_2d(r, c, self.width).astype(dtype)
    if self.posenc == "learned":
      return posenc_lib.LearnedPosEmbedding(
          tuple(self.reference_grid), self.width, name="pos_embed")(
              rows, cols, grid_hw).astype(dtype)
    return jnp.zeros((), dtype)

  def rope_tables(self, rows_f, cols_f, index_f):
    """``(cos, sin)`` for rotary encodings, else None: ``[1, T, head_dim/2]``
    when every image has the same positions (the Hopper attention kernels
    take those), ``[B, T, head_dim/2]`` when positions are per image."""
    if self.posenc not in posenc_lib.ROTARY:
      return None
    angles = posenc_lib.rope_angles(self.posenc, self.width // self.num_heads,
                                    self.rope_max_wavelength, index_f, rows_f, cols_f)
    if angles.ndim == 2:
      angles = angles[None]
    return posenc_lib.rope_cos_sin(angles)

  @nn.compact
  def __call__(self, patches, rows, cols, index, grid_hw, *, prepend_sos: bool = True,
               train: bool = False):
    x, rope = self.embed_tokens(patches, rows, cols, index, grid_hw, prepend_sos)
    out = {}
    block_cls = Block
    if self.remat != "none":
      policy = {"full": None,
                "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
      if self.remat not in policy:
        raise ValueError(f"unknown remat {self.remat!r}; valid: none, {', '.join(policy)}")
      block_cls = nn.remat(Block, policy=policy[self.remat], static_argnums=(4,))
    # With the triton norms each block's last residual add is done in the
    # next norm's kernel (Block): blocks hand on (x, branch) un-added (branch
    # a (product, bias) pair where the block defers its bias, defers_bias),
    # and the block outputs are x + branch in XLA, an add that XLA drops
    # where they go unused (pretraining). Not under remat: a checkpointed
    # block keeps its inputs for the backward, and (x, branch) would double
    # the activations that remat='full' keeps (memory.py); the adds inside
    # the block (and the attention bias, in norm2) are fused there still.
    fuse = self.norm_impl == "triton" and self.remat == "none"
    branch = None
    if self.scan_layers:
      if self.drop_path:
        raise ValueError("scan_layers needs drop_path == 0 (per-layer rates differ); "
                         "set model.scan_layers=False to use drop path")
      scan_cls = ScanBlock if self.remat == "none" else nn.remat(
          ScanBlock, policy=policy[self.remat])
      stack = nn.scan(scan_cls, variable_axes={"params": 0},
                      split_rngs={"params": True, "dropout": True},
                      in_axes=nn.broadcast, length=self.depth)
      # fused, the carry is (x, (product, bias)) (the blocks defer their
      # biases, defers_bias) and the first block's branch zeros (every step
      # is the same function; x + (0 + 0) is x): a memset and a read of
      # zeros instead of depth adds. The stacked block outputs x + branch
      # are dropped with the scan's other unused outputs where unused.
      zero_branch = (jnp.zeros_like(x), jnp.zeros(x.shape[-1:], jnp.float32))
      carry = (x, zero_branch) if fuse else x
      carry, ys = stack(self._block_kwargs(0), not train, fuse, name="blocks")(carry, rope)
      x, branch = carry if fuse else (carry, None)
      for i in range(self.depth):
        out[f"block_{i:02d}"] = ys[i]
    else:
      for i in range(self.depth):
        if fuse:
          x, branch = block_cls(**self._block_kwargs(i), return_branch=True,
                                name=f"block_{i:02d}")(x, rope, None, not train, branch)
          out[f"block_{i:02d}"] = x + branch_value(branch)
        else:
          x = block_cls(**self._block_kwargs(i), name=f"block_{i:02d}")(
              x, rope, None, not train)
          out[f"block_{i:02d}"] = x
    out["features"] = final_norm(self.norm_impl, self.dtype, "norm", x, add=branch)
    return out


def vit_from_config(model_cfg, *, image_size: int | None = None, causal=None,
                    dtype=None) -> tuple[ViT, int]:
  """Builds the backbone from ``config.model``; returns (module, patch_size).

  ``model_cfg`` keys: variant ("L/16"), optional width/depth/num_heads/mlp_dim
  overrides, image_size, reference_image_size (the resolution positions were
  trained at; defaults to image_size), posenc, rope_max_wavelength, causal,
  attention_impl, dtype, drop_path, scan_layers, remat, mlp_impl, norm_impl.
  """
  variant, patch = parse_variant(model_cfg.variant)
  get = lambda k, d=None: model_cfg.get(k, d) if hasattr(model_cfg, "get") else getattr(model_cfg, k, d)
  size = image_size or get("image_size")
  ref = get("reference_image_size") or get("image_size")
  for s in (size, ref):
    if s % patch:
      raise ValueError(f"image size {s} is not divisible by patch size {patch}; choose "
                       f"an image_size that is a multiple of {patch}")
  impls = select.resolve(model_cfg)     # "auto" -> what runs on this backend
  attention_lib.check_attention_impl(impls["attention_impl"])
  check_mlp_impl(impls["mlp_impl"])
  check_norm_impl(impls["norm_impl"])
  module = ViT(
      width=get("width") or variant.width,
      depth=get("depth") or variant.depth,
      num_heads=get("num_heads") or variant.num_heads,
      mlp_dim=get("mlp_dim") or variant.mlp_dim,
      posenc=posenc_lib.check_posenc(get("posenc", "rope2d")),
      reference_grid=(ref // patch, ref // patch),
      rope_max_wavelength=get("rope_max_wavelength", 10_000.0),
      causal=get("causal", True) if causal is None else causal,
      attention_impl=impls["attention_impl"],
      drop_path=get("drop_path", 0.0),
      dtype=dtype_from_name(dtype or get("dtype", "float32")),
      scan_layers=get("scan_layers", False),
      remat=get("remat", "none"),
      mlp_impl=impls["mlp_impl"],
      norm_impl=impls["norm_impl"])
  return module, patch


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def dtype_from_name(name):
  if not isinstance(name, str):
    return name
  if name not in DTYPES:
    raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
  return DTYPES[name]


# ------------------------------------------------------------ cached decoding
#
# Autoregressive sampling (darl_jax/sampling.py) runs the backbone one token at
# a time with a key/value cache. The classes below are a second, inference-only
# wiring of the same submodules under the same names, so they apply to the
# training parameters unchanged; the training path above is not touched.


class CachedBlock(nn.Module):
  """``Block`` for decoding: pre-LN, cached attention, no drop path."""
  num_heads: int
  mlp_dim: int
  cache_len: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, rope=None):
    y = nn.LayerNorm(epsilon=LN_EPS, dtype=self.dtype, name="norm1")(x)
    y = attention_lib.CachedMultiHeadAttention(
        self.num_heads, self.cache_len, dtype=self.dtype, name="attn")(y, rope)
    x = x + y
    y = nn.LayerNorm(epsilon=LN_EPS, dtype=self.dtype, name="norm2")(x)
    return x + Mlp(self.mlp_dim, dtype=self.dtype, name="mlp")(y)


class CachedViT(ViT):
  """The causal ViT run incrementally with a key/value cache.

  Same fields and parameter tree as :class:`ViT` (with ``scan_layers=False``;
  pass scanned parameters through :func:`unscan_params`), plus ``cache_len``,
  the number of sequence positions the cache holds (SOS included).

  Call under ``apply(variables, ..., mutable=["cache"])`` with the next ``T``
  tokens of the sequence: ordered patches ``[B, T, P]`` and their ``rows`` /
  ``cols`` / ``index`` (``[B or 1, T]``, the same meaning as for ``ViT``).
  ``prepend_sos`` puts the SOS token in front (the first call of a sequence;
  ``T = 0`` patches then prefills just SOS). Returns ``{"features":
  [B, T', D]}``, the final-LayerNorm outputs of the new tokens, equal to the
  full causal forward pass at those positions.
  """
  cache_len: int = 0

  @classmethod
  def from_vit(cls, vit: ViT, cache_len: int) -> "CachedViT":
    fields = {f.name: getattr(vit, f.name) for f in dataclasses.fields(ViT)
              if f.init and f.name not in ("parent", "name")}
    return cls(**fields, cache_len=cache_len)

  @nn.compact
  def __call__(self, patches, rows, cols, index, grid_hw, *, prepend_sos: bool = False):
    if not self.causal:
      raise ValueError("cached decoding needs a causal backbone (model.causal=True)")
    # The training path's own embedding, positions, SOS and RoPE tables.
    x, rope = self.embed_tokens(patches, rows, cols, index, grid_hw, prepend_sos)
    for i in range(self.depth):
      x = CachedBlock(self.num_heads, self.mlp_dim, self.cache_len, dtype=self.dtype,
                      name=f"block_{i:02d}")(x, rope)
    return {"features": nn.LayerNorm(epsilon=LN_EPS, dtype=self.dtype, name="norm")(x)}


def unscan_params(params: dict, depth: int) -> dict:
  """Backbone parameters of ``scan_layers=True`` (stacked under ``blocks/block``)
  -> the per-block ``block_XX`` layout; other trees are returned as they are."""
  if "blocks" not in params:
    return params
  out = {k: v for k, v in params.items() if k != "blocks"}
  stacked = params["blocks"]["block"]
  for i in range(depth):
    out[f"block_{i:02d}"] = jax.tree_util.tree_map(lambda a, i=i: a[i], stacked)
  return out
