"""The model's compute ops: the one place that knows how each is implemented.

Models declare their parameters with plain Flax and call these functions:
``layer_norm``, ``mlp``, ``self_attention``, ``attention``, ``gelu`` and
``block_stack``. Each runs XLA's version or one of the kernels in
darl_jax/kernels, as the current ``Kernels`` choice says:

- ``attention``: ``xla`` | ``cudnn`` (cuDNN's fused attention, 16-bit inputs,
  even lengths) | ``hopper`` (kernels/hopper_attention.py: causal attention
  without a mask, projection, bias and RoPE included; other calls as
  ``auto``) | ``auto`` (cuDNN where it takes the inputs, else XLA).
- ``mlp``: ``xla`` | ``hopper`` (kernels/hopper_mlp.py, GELU inside the
  matrix products).
- ``norm``: ``xla`` | ``triton`` (kernels/layer_norm.py; with it,
  ``block_stack`` runs a model's whole stack of pre-LN blocks as
  kernels/fused_stack.py, each residual add and branch bias inside the next
  norm's kernel).

Beside the kernels, the precision of the dense layers (``config.precision``):
``bf16`` computes ``dense`` and ``mlp`` in the model's dtype; ``fp8`` runs
their products on float8 inputs (darl_jax/fp8.py). The Hopper MLP kernels
multiply in bfloat16, so under ``fp8`` the MLP is XLA's and ``hopper``
attention takes its q/k/v from the fp8 projection.

Invariants: every implementation computes the same function from the same
parameters (tests compare them); a kernel that does not take a shape (its
``fits`` check, made on one device's rows: kernels/per_shard.py, the batch
split over ``BATCH_AXES``) falls back to XLA's op silently, while a kernel
asked for on a device it cannot run on is an error naming the fix. Off the
GPU the kernels run in Pallas's interpreter (tests).

The choice is process-wide: the loop sets it once from ``config.kernels``
(``configure``) before anything is traced; tests use ``using``. The default,
before any ``configure``, is XLA everywhere. It is read while tracing and is
not part of jit's cache key: a jitted function keeps the choice it was first
traced under, so code that switches choices builds new functions.

Imports run one way: models call these ops, these call the kernels, and
neither this module nor the kernels import the model (``block_stack`` is
handed the model's block code instead). The Pallas kernel modules are
imported where first used: a run on XLA's ops never loads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from darl_jax.kernels import per_shard
from darl_jax.kernels import rope as rope_lib
from darl_jax.mesh_axes import BATCH_AXES

LN_EPS = 1e-6
CHOICES = {"attention": ("auto", "xla", "cudnn", "hopper"),
           "mlp": ("auto", "xla", "hopper"),
           "norm": ("auto", "xla", "triton")}
PRECISIONS = ("bf16", "fp8")
# Key lengths up to this take ``_short_attention`` on XLA's path.
SHORT_KEYS = 4


@dataclasses.dataclass(frozen=True)
class Kernels:
  """Which implementation each op runs (``auto`` resolved, see ``resolve``)."""
  attention: str = "xla"
  mlp: str = "xla"
  norm: str = "xla"

  def __post_init__(self):
    for op, value in dataclasses.asdict(self).items():
      if value not in CHOICES[op]:
        raise ValueError(f"unknown kernels.{op} {value!r}; valid: {', '.join(CHOICES[op])}")


_current = Kernels()
_precision = "bf16"


def current() -> Kernels:
  return _current


def precision() -> str:
  """The dense layers' precision: ``bf16`` (the model's dtype) or ``fp8``."""
  return _precision


def check_precision(precision_: str) -> str:
  if precision_ not in PRECISIONS:
    raise ValueError(f"unknown precision {precision_!r}; valid: {', '.join(PRECISIONS)}")
  return precision_


def on_hopper() -> bool:
  """Whether the default device is an sm_90 NVIDIA GPU (H100, H200)."""
  device = jax.devices()[0]
  return (device.platform == "gpu"
          and str(getattr(device, "compute_capability", "")).startswith("9."))


def _asked(kernels_cfg, op: str) -> str:
  """What ``config.kernels`` asks of ``op`` (``auto`` where it says nothing)."""
  return (kernels_cfg.get(op, "auto") if kernels_cfg is not None else "auto") or "auto"


def resolve(kernels_cfg, dtype: str = "float32", precision_: str = "bf16") -> Kernels:
  """``config.kernels`` (attention / mlp / norm, each possibly ``auto``) ->
  what runs on this backend. ``auto``: the Hopper kernels and the Triton
  norms on sm_90 GPUs in bfloat16; elsewhere attention stays ``auto``
  (cuDNN where it takes the inputs) and the rest is XLA's. Under
  ``precision_='fp8'`` the MLP's ``auto`` is XLA's (the Hopper MLP
  kernels multiply in bfloat16) and an explicit ``hopper`` MLP is an
  error. An explicit value is otherwise kept as given."""
  fast = dtype == "bfloat16" and on_hopper()
  fp8 = check_precision(precision_) == "fp8"
  auto = {"attention": "hopper" if fast else "auto",
          "mlp": "hopper" if fast and not fp8 else "xla",
          "norm": "triton" if fast else "xla"}
  chosen = Kernels(**{op: auto[op] if _asked(kernels_cfg, op) == "auto"
                      else _asked(kernels_cfg, op) for op in CHOICES})
  if fp8 and chosen.mlp == "hopper":
    raise ValueError("kernels.mlp='hopper' multiplies in bfloat16; with precision='fp8' set "
                     "kernels.mlp='auto' or 'xla' (or precision='bf16')")
  return chosen


def configure(kernels_cfg, dtype: str = "float32", precision_: str = "bf16") -> Kernels:
  """Resolves ``config.kernels`` and makes it, and ``precision_``, the
  choice of every op traced from now on; returns the kernels (``describe``
  makes the log line)."""
  global _current, _precision
  _current = resolve(kernels_cfg, dtype, precision_)
  _precision = precision_
  return _current


@contextlib.contextmanager
def using(precision: str | None = None, **choice):
  """``with ops.using(norm="triton"):`` or ``ops.using(precision="fp8")``:
  the ops choose that inside (tests)."""
  global _current, _precision
  saved = _current, _precision
  _current = dataclasses.replace(_current, **choice)
  _precision = check_precision(precision or _precision)
  try:
    yield _current
  finally:
    _current, _precision = saved


def describe(kernels_cfg, chosen: Kernels, precision_: str = "bf16") -> str:
  """One log line: what runs, and which of it ``auto`` chose (and fp8
  dense layers, where asked)."""
  parts = []
  for op in CHOICES:
    auto = " (auto)" if _asked(kernels_cfg, op) == "auto" else ""
    parts.append(f"{op}={getattr(chosen, op)}{auto}")
  if precision_ == "fp8":
    parts.append("dense layers in fp8")
  return f"kernels on {jax.devices()[0].device_kind}: " + ", ".join(parts)


def _interpret() -> bool:
  """Off the GPU the Pallas kernels run in their interpreter (tests)."""
  return jax.default_backend() != "gpu"


def _require_hopper(op: str, gpu_fix: str) -> None:
  from darl_jax.kernels import mosaic
  mosaic.require_hopper(f"kernels.{op}='hopper'", tpu_fix=f"kernels.{op}='xla'",
                        gpu_fix=f"kernels.{op}='{gpu_fix}'")


# ------------------------------------------------------------------ dense layers


def dense(x, kernel, bias=None, *, dtype, axes: int = 1, history=None):
  """``x @ kernel (+ bias)`` over ``x``'s last ``axes`` axes, as Flax's
  ``nn.DenseGeneral`` computes it: inputs and parameters promoted to
  ``dtype`` first. Under ``precision='fp8'`` the product runs on float8
  copies of ``x`` and ``kernel`` (darl_jax/fp8.py) and comes back in
  ``dtype``, scaled from the layer's ``history`` where it has one
  (``dense_delayed``), else row by row (``dense``); bf16 ignores
  ``history``."""
  x = x.astype(dtype)
  if _precision == "fp8":
    from darl_jax import fp8
    y = (fp8.dense(x, kernel, axes, dtype) if history is None
         else fp8.dense_delayed(x, kernel, history, axes, dtype))
  else:
    kernel = kernel.astype(dtype)
    contract = (tuple(range(x.ndim - axes, x.ndim)), tuple(range(axes)))
    y = jax.lax.dot_general(x, kernel, (contract, ((), ())))
  if bias is not None:
    y = y + bias.astype(dtype)
  return y


# ------------------------------------------------------------------ LayerNorm


def layer_norm(x, scale, bias, *, dtype):
  """LayerNorm over the last axis (epsilon ``LN_EPS``, statistics in
  float32, output in ``dtype``): Flax's ``nn.LayerNorm`` function."""
  if _current.norm == "triton":
    from darl_jax.kernels import layer_norm as ln
    _require_norm_device()
    y = per_shard.over_batch(
        lambda x, s, b: ln.layer_norm(x, s, b, LN_EPS, ln.blocks_for(x.shape[-1]), _interpret()),
        x, scale, bias, batched=(True, False, False), axes=BATCH_AXES)
    return y.astype(dtype)
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = jnp.maximum((x32 * x32).mean(-1, keepdims=True) - mean * mean, 0.0)
  y = (x32 - mean) * (jax.lax.rsqrt(var + LN_EPS) * scale) + bias
  return y.astype(dtype)


def _require_norm_device() -> None:
  device = jax.devices()[0]
  if device.platform not in ("gpu", "cpu"):
    raise ValueError(f"kernels.norm='triton' runs on NVIDIA GPUs, not {device.platform}; "
                     "use kernels.norm='xla'")


# ------------------------------------------------------------------ MLP


def _erf_term(x32):
  return 1.0 + jax.lax.erf(x32 * (2.0 ** -0.5))


@jax.custom_vjp
def gelu(x):
  """Exact GELU, x Phi(x) = x/2 (1 + erf(x / sqrt 2)), evaluated in float32
  and returned in ``x``'s dtype (the standard ViT's, so exported weights
  behave the same).

  Written with ``erf`` (PyTorch's form) rather than ``jax.nn.gelu``'s
  ``erfc``, which XLA expands into a slower piecewise approximation; the
  values differ by float32 rounding. The gradient keeps only ``x`` and
  recomputes Phi(x) + x phi(x) from it, where autodiff would save a float32
  copy of the MLP's widest activation.
  """
  x32 = x.astype(jnp.float32)
  return (0.5 * x32 * _erf_term(x32)).astype(x.dtype)


def _gelu_fwd(x):
  return gelu(x), x


def _gelu_bwd(x, g):
  x32 = x.astype(jnp.float32)
  cdf = 0.5 * _erf_term(x32)
  pdf = jnp.exp(-0.5 * x32 * x32) * ((2.0 * jnp.pi) ** -0.5)
  return ((g.astype(jnp.float32) * (cdf + x32 * pdf)).astype(x.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


def _hopper_mlp_fits(x, hidden: int, dtype) -> bool:
  """Whether the Hopper MLP kernels run on ``x``: errors naming the fix for
  a wrong dtype or device; False for shapes their tiles do not take
  (initialisation on one example, a last partial batch)."""
  from darl_jax.kernels import hopper_mlp
  if jnp.dtype(dtype) != jnp.bfloat16:
    raise ValueError("kernels.mlp='hopper' runs in bfloat16; set model.dtype='bfloat16' "
                     "or kernels.mlp='xla'")
  _require_hopper("mlp", "xla")
  x = per_shard.local(x, BATCH_AXES)
  if x is None:
    return False
  try:
    for tiling in (hopper_mlp.DEFAULT_KERNELS.fwd, hopper_mlp.DEFAULT_KERNELS.bwd):
      tiling.check(math.prod(x.shape[:-1]), hidden, x.shape[-1])
  except ValueError:
    return False
  return True


def mlp(x, fc1_kernel, fc1_bias, fc2_kernel, fc2_bias, *, dtype, histories=(None, None)):
  """The Transformer MLP, ``fc2(gelu(fc1(x)))``; fc2's bias is added only if
  ``fc2_bias`` is given (the fused stack adds it in the next norm's kernel).
  ``histories``: fc1's and fc2's fp8 histories (``dense``)."""
  if (_current.mlp == "hopper" and _precision != "fp8"
      and _hopper_mlp_fits(x, fc1_kernel.shape[-1], dtype)):
    from darl_jax.kernels import hopper_mlp
    return per_shard.over_batch(
        lambda x, w1, b1, w2, b2: hopper_mlp.mlp(x, w1, b1, w2, b2, hopper_mlp.DEFAULT_KERNELS,
                                                 _interpret()),
        x.astype(dtype), fc1_kernel, fc1_bias, fc2_kernel, fc2_bias,
        batched=(True, False, False, False, False), axes=BATCH_AXES)
  h = gelu(dense(x, fc1_kernel, fc1_bias, dtype=dtype, history=histories[0]))
  return dense(h, fc2_kernel, fc2_bias, dtype=dtype, history=histories[1])


# ------------------------------------------------------------------ attention


def apply_rope(x, rope):
  """Rotary positions on ``x [B, T, H, D]``; ``rope`` = (cos, sin) ``[B or
  1, T, D/2]`` or None."""
  return x if rope is None else rope_lib.apply_rope(x, *rope)


def attention(q, k, v, *, causal: bool, mask=None, kernels: bool = True):
  """Softmax attention of ``q [B, Tq, H, D]`` over ``k, v [B, Tk, H, D]``
  (``mask [B or 1, 1 or H, Tq, Tk]``, True = attend, combined with the
  causal mask when both are given). ``kernels=False``: XLA's, whatever the
  choice. A handful of keys (the denoising decoder's two tokens) always
  take XLA's elementwise form: a fused kernel has nothing to win there."""
  impl = _current.attention if kernels else "xla"
  if k.shape[1] <= SHORT_KEYS:
    if k.shape[1] == 2 and q.shape[1] == 1 and mask is None:
      return _two_key_attention(q, k, v)
    return _short_attention(q, k, v, causal=causal, mask=mask)
  if impl == "hopper":
    if causal and mask is None and _hopper_attention_fits(q, k, v):
      from darl_jax.kernels import hopper_attention
      return per_shard.over_batch(
          lambda q, k, v: hopper_attention.causal_attention(
              q, k, v, hopper_attention.DEFAULT_ATTENTION_TILING, _interpret()),
          q, k, v, batched=(True, True, True), axes=BATCH_AXES)
    impl = "auto"
  if impl == "auto":
    impl = "cudnn" if _cudnn_takes(q, k) else "xla"
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                      implementation=impl)


def _cudnn_takes(q, k) -> bool:
  """cuDNN's fused attention takes: an NVIDIA GPU, 16-bit inputs, even
  sequence lengths (odd ones raise in cuDNN)."""
  return (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
          and q.shape[1] % 2 == 0 and k.shape[1] % 2 == 0)


def _hopper_attention_fits(q, k, v) -> bool:
  from darl_jax.kernels import hopper_attention
  _require_hopper("attention", "cudnn")
  q, k, v = (per_shard.local(x, BATCH_AXES) for x in (q, k, v))
  return q is not None and hopper_attention.fits(q, k, v)


def _short_attention(q, k, v, *, causal: bool, mask=None):
  """Attention over a handful of keys as broadcast products and sums: the
  numbers of ``jax.nn.dot_product_attention``'s XLA path (float32 logits and
  softmax, probabilities rounded to v's dtype) without the tiny batched
  matrix products, which cost as much as the denoising decoder's real ones."""
  t, s, d = q.shape[1], k.shape[1], q.shape[-1]
  logits = jnp.sum(q[:, :, None].astype(jnp.float32) * k[:, None].astype(jnp.float32),
                   axis=-1) * (d ** -0.5)                                  # [B, T, S, H]
  keep = None
  if causal:
    keep = jnp.tril(jnp.ones((t, s), bool))[None, :, :, None]   # as jax.nn: top-left
  if mask is not None:
    m = jnp.transpose(jnp.asarray(mask, bool), (0, 2, 3, 1))               # [B, T, S, H]
    keep = m if keep is None else keep & m
  if keep is not None:
    logits = jnp.where(keep, logits, -0.7 * jnp.finfo(jnp.float32).max)   # as jax.nn
  probs = jax.nn.softmax(logits, axis=2).astype(v.dtype)
  out = jnp.sum(probs[..., None].astype(jnp.float32) * v[:, None].astype(jnp.float32),
                axis=2)                                                    # [B, T, H, D]
  return out.astype(v.dtype)


def _two_key_attention(q, k, v):
  """One query over two keys: the softmax of two logits is the sigmoid of
  their difference, so ``out = v1 + sigmoid(q.(k0 - k1)/sqrt D) (v0 - v1)``
  in float32, which XLA fuses with its gradient into a few elementwise
  passes (the denoising decoder's read-out token)."""
  f32 = lambda x: x.astype(jnp.float32)   # noqa: E731
  k0, k1, v0, v1 = k[:, :1], k[:, 1:], v[:, :1], v[:, 1:]
  logit = jnp.sum(f32(q) * (f32(k0) - f32(k1)), axis=-1, keepdims=True) * q.shape[-1] ** -0.5
  p0 = jax.nn.sigmoid(logit)
  return (f32(v1) + p0 * (f32(v0) - f32(v1))).astype(v.dtype)


def self_attention(x, qkv_kernel, qkv_bias, rope, *, causal: bool, dtype, mask=None,
                   history=None):
  """Multi-head self-attention of ``x [B, T, D]`` up to the output
  projection: the packed q/k/v projection (``qkv_kernel [D, 3, H, Dh]``,
  ``qkv_bias [3, H, Dh]``, fp8 ``history`` as for ``dense``), RoPE on q
  and k, attention. Returns the heads' outputs ``[B, T, H, Dh]``.

  With ``hopper`` and causal attention without a mask the projection's
  bias and RoPE run inside the Hopper kernels (the projection too where its
  tiles fit), so the packed ``[B, T, 3, H, Dh]`` array is read once."""
  if _current.attention == "hopper":
    if causal and mask is None:
      out = _hopper_self_attention(x, qkv_kernel, qkv_bias, rope, dtype, history)
      if out is not None:
        return out
    elif mask is not None:
      _warn_once("kernels.attention='hopper' runs causal attention without a mask; masked "
                 "attention (model.prefix) runs as cuDNN's where it takes the inputs, else XLA's",
                 info=True)
  qkv = dense(x, qkv_kernel, qkv_bias, dtype=dtype, history=history)
  q, k, v = (apply_rope(qkv[:, :, i], rope) if i < 2 else qkv[:, :, i] for i in range(3))
  return attention(q, k, v, causal=causal, mask=mask)


def _hopper_self_attention(x, kernel, bias, rope, dtype, history=None):
  """The Hopper path of ``self_attention``, or None where its kernels do
  not take the inputs (per-image RoPE tables, shapes their tiles do not
  divide), for the general path."""
  from darl_jax.kernels import hopper_attention
  _require_hopper("attention", "cudnn")
  tables = None if rope is None or rope[0].shape[0] != 1 else tuple(t[0] for t in rope)
  if rope is not None and tables is None:
    return None
  x, bias = x.astype(dtype), bias.astype(dtype)
  tiling = hopper_attention.DEFAULT_ATTENTION_TILING
  local = per_shard.local(x, BATCH_AXES)
  # The projected kernel multiplies in bfloat16: under fp8 the projection
  # is ops.dense's (below) and the kernel takes its q/k/v.
  if (tables is not None and local is not None and _precision != "fp8"
      and hopper_attention.fits_projected(local, kernel.astype(dtype), bias, tables)):
    return per_shard.over_batch(
        lambda x, kernel, bias, tables: hopper_attention.causal_attention_projected(
            x, kernel, bias, tables, tiling, _interpret()),
        x, kernel.astype(dtype), bias, tables, batched=(True, False, False, False), axes=BATCH_AXES)
  product = dense(x, kernel, dtype=dtype, history=history)
  local = per_shard.local(product, BATCH_AXES)
  if local is None or not hopper_attention.fits_qkv(local, bias, tables):
    return None
  return per_shard.over_batch(
      lambda product, bias, tables: hopper_attention.causal_attention_qkv(
          product, bias, tables, tiling, _interpret()),
      product, bias, tables, batched=(True, False, False), axes=BATCH_AXES)


# ------------------------------------------------------------------ block stacks


def block_stack(params, x, rope, mask=None, *, depth: int, num_heads: int, causal: bool,
                dtype, scanned: bool, block_code: tuple, histories=None):
  """A backbone's stack of pre-LN blocks and its final norm run as one unit
  on its parameter tree (``block_XX`` or scanned ``blocks/block``, and
  ``norm``; ``histories``: the same tree's fp8 histories, or None), or None
  when the plain blocks should run: with ``norm=triton``,
  kernels/fused_stack.py, each residual add (and the bias of the projection
  that ends the branch) done inside the next norm's kernel. Returns
  ``{"features", "block_XX"}`` as the backbone does.

  The fused stack re-implements the block, so it runs only while the
  model's block code (``block_code``: the classes and functions the
  model's stack runs, models/vit.py's ``FUSED_BLOCK_CODE``) is the code it
  was written for (``block_digest``); after an edit to them, the plain
  blocks run, with one warning. The model hands its code in so that this
  module never imports the model."""
  if _current.norm != "triton":
    return None
  _require_norm_device()
  from darl_jax.kernels import fused_stack
  digest = block_digest(block_code)
  if digest != fused_stack.WRITTEN_FOR:
    names = ", ".join(f"{code.__module__}.{code.__qualname__}" for code in block_code)
    _warn_once(f"the model's block code ({names}) differs from the block that "
               "kernels/fused_stack.py implements: running the plain blocks. Port the change "
               f"to fused_stack.py and set its WRITTEN_FOR to {digest!r} to fuse again.")
    return None
  stack_ops = fused_stack.StackOps(self_attention=self_attention, dense=dense, mlp=mlp,
                                   eps=LN_EPS, interpret=_interpret(), batch_axes=BATCH_AXES)
  return fused_stack.run(params, x, rope, mask, depth=depth, num_heads=num_heads,
                         causal=causal, dtype=dtype, scanned=scanned, ops=stack_ops,
                         histories=histories)


@functools.lru_cache(maxsize=None)
def block_digest(block_code: tuple) -> str:
  """A digest of ``block_code`` (classes and functions: the model's block,
  the layers it calls and the backbone's stack): their source text without
  docstrings, comments and layout (the same on every Python version)."""
  import hashlib
  import inspect
  digest = hashlib.sha256()
  for code in block_code:
    digest.update(_code_text(inspect.getsource(code)).encode())
  return digest.hexdigest()[:16]


def _code_text(source: str) -> str:
  """``source`` without docstrings and comments, whitespace collapsed."""
  import ast
  import io
  import textwrap
  import tokenize
  source = textwrap.dedent(source)
  lines = source.splitlines(keepends=True)
  offsets = [0]
  for line in lines:
    offsets.append(offsets[-1] + len(line))
  at = lambda row, col: offsets[row - 1] + col   # noqa: E731 (1-based rows)
  cuts = []
  for node in ast.walk(ast.parse(source)):
    body = getattr(node, "body", None)
    if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
      doc = body[0]
      cuts.append((at(doc.lineno, doc.col_offset), at(doc.end_lineno, doc.end_col_offset)))
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      cuts.append((at(*tok.start), at(*tok.end)))
  text, last = [], 0
  for start, end in sorted(cuts):
    text.append(source[last:start])
    last = max(last, end)
  text.append(source[last:])
  return " ".join("".join(text).split())


_warned = set()


def _warn_once(message: str, info: bool = False) -> None:
  if message not in _warned:
    _warned.add(message)
    from absl import logging
    (logging.info if info else logging.warning)("%s", message)
