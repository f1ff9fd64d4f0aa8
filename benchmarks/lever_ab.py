"""A/B of step changes: ones measured and not kept, and earlier forms of kept ones.

    python benchmarks/lever_ab.py --case=L/16:mse:256 --variants=base,rope_vjp,base,rope_vjp

Each variant swaps one piece of the model for a version that computes the
same function (gradients equal to float32 rounding; tests/test_benchmarks.py
checks it) but is scheduled differently, then times the real pretraining step
with pretrain_benchmark.run_case, all in one process so the rows compare.
On jax 0.11.2 / H200 none was faster (benchmarks/RESULTS.md, "fourth
session"); a new XLA may change that, which is why they are kept runnable:

- ``mlp_recompute``: the MLP under one custom VJP that keeps only its input
  and the pre-activation and recomputes GELU in the backward, so the GELU
  output is never stored (XLA could then fuse GELU into the fc2 GEMMs).
- ``ln_mlp_recompute``: the second LayerNorm and the MLP under one custom
  VJP; the LayerNorm output is recomputed in the backward as well.
- ``rope_vjp``: RoPE with a hand-written backward (the rotation by minus the
  angle) instead of autodiff's slices and pads.
- ``bias_gemv``: every dense layer's bias gradient as a ones-vector matrix
  product (a cuBLAS GEMV) instead of a column sum fused into its producer.
- ``qkv_bias_split``: the q/k/v projection's bias gradient as a reduction of
  its own over the stored cotangent, instead of fused with RoPE's backward.
- ``rope_in_xla`` (with ``model.attention_impl=hopper``): the kernels'
  earlier form, RoPE's forward and backward in XLA and the kernels on
  separate q, k, v, instead of ``causal_attention_qkv`` on the packed
  projection (RoPE's backward in the kernels' epilogues). A no-op on other
  attention implementations.
- ``qkv_rope_in_xla`` (with ``model.attention_impl=hopper``): the q/k/v
  product as XLA's GEMM and its bias + RoPE as XLA's pass before
  ``causal_attention_qkv`` (the form until the fifteenth session), instead
  of ``causal_attention_projected`` (the bias and RoPE in our product
  kernel's epilogue). Rounding differs slightly (see
  causal_attention_projected): the loss agrees to bf16 rounding, not
  float32.
- ``dq_from_ds`` (with ``model.attention_impl=hopper``): the attention
  backward's other schedule, ``AttentionTiling(dq_from_ds=True)`` (dK/dV
  first, storing each tile pair's dS^T; dQ from those tiles, one product per
  pair), instead of the default's dQ kernel that recomputes S, dP and dS.
  Built in the fifteenth session and not measured yet (no device time was
  left); the same function (tests/test_attention_kernels.py).
- ``param_norm_in_step``: the step as it was until the thirteenth session,
  with the parameter norm a metric of every step (a reduction over every
  parameter, which XLA may fuse into the optimizer update) instead of read
  when metrics are logged. Not a model change: the loss and gradients are
  the base's.
- ``branch_bias_sum_in_xla`` (with ``model.norm_impl=triton``): the deferred
  branch bias's gradient in ``add_bias_layer_norm`` as it was until the
  fourteenth session, XLA's row sum over the norm's input gradient, instead
  of a third column sum in the backward kernel.
- ``iota_mask`` (with ``model.attention_impl=hopper``): the attention
  kernels' block-diagonal causal mask as it was until the eighteenth
  session, built from two-dimensional row and column indices (the image
  start and two compares per score element), instead of one unsigned
  compare of ``q - k`` against each query's bound ``q - start(q)``. The
  same mask (tests/test_benchmarks.py).

A variant written ``key=value`` is a config override for that row alone
(``--variants=base,model.norm_impl=triton,base,model.norm_impl=triton``): an
A/B of an option the model has. One written ``ln_blocks:<blocks>`` runs the
LayerNorm kernels (``model.norm_impl=triton``) at those ``layer_norm.Blocks``
at every width (``layer_norm.WIDTH_BLOCKS`` set aside), in
layer_norm_bench.py's notation (``ln_blocks:4x2:4x4x1056`` is the backward
kernel at every width, binary chunks). One written
``attention_tiling:<fields>`` runs the attention kernels
(``model.attention_impl=hopper``) at that ``AttentionTiling``
(``attention_tiling:slots=3/rope_tables=float32``).

Parameter names and shapes stay those of the model (``ln_mlp_recompute``
names its LayerNorm parameters ``norm2_scale`` / ``norm2_bias``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402

from darl_jax.kernels import hopper_attention, layer_norm  # noqa: E402
from darl_jax.models import attention as attention_lib  # noqa: E402
from darl_jax.models import posenc, vit  # noqa: E402
from darl_jax.train import loop  # noqa: E402

# ------------------------------------------------------------ MLP recompute


def _dense(x, w, b):
  return jnp.dot(x, w) + b


def _weight_grad(x, g):
  return jnp.dot(x.reshape(-1, x.shape[-1]).T, g.reshape(-1, g.shape[-1]))


def _bias_grad(g):
  return jnp.sum(g.astype(jnp.float32), axis=tuple(range(g.ndim - 1))).astype(g.dtype)


@jax.custom_vjp
def mlp_recompute(x, w1, b1, w2, b2):
  """fc2(gelu(fc1(x))); the backward recomputes GELU from the pre-activation."""
  return _dense(vit.gelu_exact(_dense(x, w1, b1)), w2, b2)


def _mlp_fwd(x, w1, b1, w2, b2):
  pre = _dense(x, w1, b1)
  return _dense(vit.gelu_exact(pre), w2, b2), (x, w1, w2, pre)


def _mlp_grads(x, w1, w2, pre, g):
  h = vit.gelu_exact(pre)
  dpre = vit._gelu_exact_bwd(pre, jnp.dot(g, w2.T))[0]
  return (jnp.dot(dpre, w1.T), _weight_grad(x, dpre), _bias_grad(dpre),
          _weight_grad(h, g), _bias_grad(g))


mlp_recompute.defvjp(_mlp_fwd, lambda res, g: _mlp_grads(*res, g))


def _layer_norm(x, scale, bias):
  """As flax's LayerNorm: float32 statistics, E[x^2] - E[x]^2 variance."""
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, -1, keepdims=True)
  var = jnp.maximum(jnp.mean(x32 * x32, -1, keepdims=True) - mean * mean, 0.0)
  rstd = jax.lax.rsqrt(var + vit.LN_EPS)
  return ((x32 - mean) * rstd * scale + bias).astype(x.dtype), mean, rstd


@jax.custom_vjp
def ln_mlp_recompute(x, scale, bias, w1, b1, w2, b2):
  """mlp(LN(x)); the backward recomputes the LayerNorm output and GELU."""
  return mlp_recompute(_layer_norm(x, scale, bias)[0], w1, b1, w2, b2)


def _ln_mlp_fwd(x, scale, bias, w1, b1, w2, b2):
  y, mean, rstd = _layer_norm(x, scale, bias)
  pre = _dense(y, w1, b1)
  return _dense(vit.gelu_exact(pre), w2, b2), (x, mean, rstd, scale, bias, w1, w2, pre)


def _ln_mlp_bwd(res, g):
  x, mean, rstd, scale, bias, w1, w2, pre = res
  xhat = (x.astype(jnp.float32) - mean) * rstd
  dy, dw1, db1, dw2, db2 = _mlp_grads((xhat * scale + bias).astype(x.dtype), w1, w2, pre, g)
  dy32 = dy.astype(jnp.float32)
  gs = dy32 * scale
  dx = rstd * (gs - jnp.mean(gs, -1, keepdims=True)
               - xhat * jnp.mean(gs * xhat, -1, keepdims=True))
  axes = tuple(range(x.ndim - 1))
  return (dx.astype(x.dtype), jnp.sum(dy32 * xhat, axes), jnp.sum(dy32, axes),
          dw1, db1, dw2, db2)


ln_mlp_recompute.defvjp(_ln_mlp_fwd, _ln_mlp_bwd)


class _MlpParams(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, width):
    w1, b1 = vit.DenseParams(self.hidden, name="fc1")(width)
    w2, b2 = vit.DenseParams(width, name="fc2")(self.hidden)
    return w1, b1, w2, b2


class MlpRecompute(nn.Module):
  """vit.Mlp's parameters, mlp_recompute's schedule (``impl``, which the
  blocks pass, is ignored: this variant is its own implementation)."""
  hidden: int
  dtype: object = jnp.float32
  impl: str = "xla"
  defer_bias: bool = False    # as vit.Mlp's: fc2's bias handed on apart

  @nn.compact
  def __call__(self, x):
    w1, b1 = vit.DenseParams(self.hidden, name="fc1")(x.shape[-1])
    w2, b2 = vit.DenseParams(x.shape[-1], name="fc2")(self.hidden)
    c = lambda a: a.astype(self.dtype)  # noqa: E731
    if self.defer_bias:
      return mlp_recompute(c(x), c(w1), c(b1), c(w2), jnp.zeros_like(c(b2))), b2
    return mlp_recompute(c(x), c(w1), c(b1), c(w2), c(b2))


class BlockLnMlpRecompute(vit.Block):
  """vit.Block with its second half as ln_mlp_recompute."""

  @nn.compact
  def __call__(self, x, rope=None, mask=None, deterministic: bool = True):
    if self.norm_impl != "xla":   # its norms are XLA's; the triton ViT passes branches
      raise ValueError("the ln_mlp_recompute variant is for model.norm_impl='xla'; "
                       f"drop --set model.norm_impl={self.norm_impl}")
    y = nn.LayerNorm(epsilon=vit.LN_EPS, dtype=self.dtype, name="norm1")(x)
    y = attention_lib.MultiHeadAttention(
        self.num_heads, causal=self.causal, impl=self.attention_impl,
        dtype=self.dtype, name="attn")(y, rope, mask)
    x = x + vit.DropPath(self.drop_path)(y, deterministic)
    d = x.shape[-1]
    scale = self.param("norm2_scale", nn.initializers.ones, (d,), jnp.float32)
    bias = self.param("norm2_bias", nn.initializers.zeros, (d,), jnp.float32)
    w1, b1, w2, b2 = _MlpParams(self.mlp_dim, name="mlp")(d)
    c = lambda a: a.astype(self.dtype)  # noqa: E731
    y = vit.DropPath(self.drop_path)(
        ln_mlp_recompute(c(x), scale, bias, c(w1), c(b1), c(w2), c(b2)), deterministic)
    return (x, y) if self.return_branch else x + y


# ------------------------------------------------------------ RoPE custom VJP


def _reduce_to(g, shape):
  axes = tuple(i for i, (a, b) in enumerate(zip(g.shape, shape)) if b == 1 and a != 1)
  return jnp.sum(g, axes, keepdims=True).reshape(shape)


_PLAIN_ROPE = posenc.apply_rope   # bound now: the variant patches posenc.apply_rope


@jax.custom_vjp
def rope_vjp(x, cos, sin):
  """posenc.apply_rope with a hand-written backward."""
  return _PLAIN_ROPE(x, cos, sin)


def _rope_bwd(res, g):
  x, cos, sin = res
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, -1)
  g1, g2 = jnp.split(g.astype(jnp.float32), 2, -1)
  dcos = jnp.sum(x1 * g1 + x2 * g2, axis=2)      # unused in training (fixed tables)
  dsin = jnp.sum(x1 * g2 - x2 * g1, axis=2)
  return (_PLAIN_ROPE(g, cos, -sin), _reduce_to(dcos, cos.shape).astype(cos.dtype),
          _reduce_to(dsin, sin.shape).astype(sin.dtype))


rope_vjp.defvjp(lambda x, cos, sin: (_PLAIN_ROPE(x, cos, sin), (x, cos, sin)), _rope_bwd)


# ------------------------------------------------------------ bias gradients, rescheduled


@jax.custom_vjp
def bias_add_gemv(y, b):
  """y + b; the bias gradient is ones @ g (a matrix product, not a reduction)."""
  return y + b


def _bias_add_gemv_bwd(shape, g):
  g2 = g.reshape(-1, math.prod(shape))
  db = jnp.dot(jnp.ones((g2.shape[0],), g.dtype), g2, preferred_element_type=jnp.float32)
  return g, db.reshape(shape).astype(g.dtype)


bias_add_gemv.defvjp(lambda y, b: (y + b, b.shape), _bias_add_gemv_bwd)


@jax.custom_vjp
def bias_add_split(y, b):
  """y + b; the bias gradient is a reduction of its own over the stored
  cotangent, not fused into the kernel that produces the cotangent."""
  return y + b


def _bias_add_split_bwd(shape, g):
  g = jax.lax.optimization_barrier(g)     # materialise g first, then sum it
  db = jnp.sum(g.astype(jnp.float32), axis=tuple(range(g.ndim - len(shape))))
  return g, db.astype(g.dtype)


bias_add_split.defvjp(lambda y, b: (y + b, b.shape), _bias_add_split_bwd)


class DenseBiasGemv(nn.Module):
  """Stands in for nn.Dense and nn.DenseGeneral (the arguments the model uses)."""
  features: object
  axis: object = -1
  dtype: object = jnp.float32
  kernel_init: object = nn.initializers.xavier_uniform()
  use_bias: bool = True

  bias_add = staticmethod(bias_add_gemv)

  @nn.compact
  def __call__(self, x):
    feats = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    axes = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
    axes = tuple(a % x.ndim for a in axes)
    ins = tuple(x.shape[a] for a in axes)

    def init(key, shape, dtype=jnp.float32):  # fans of the flattened 2D kernel, as DenseGeneral
      return self.kernel_init(key, (math.prod(ins), math.prod(feats)), dtype).reshape(shape)

    kernel = self.param("kernel", init, ins + feats, jnp.float32)
    y = jax.lax.dot_general(x.astype(self.dtype), kernel.astype(self.dtype),
                            ((axes, tuple(range(len(axes)))), ((), ())))
    if not self.use_bias:
      return y
    b = self.param("bias", nn.initializers.zeros, feats, jnp.float32)
    return self.bias_add(y, b.astype(self.dtype))


class QkvProjectionBiasSplit(attention_lib.QkvProjection):
  """attention.QkvProjection with the q/k/v bias added here, its gradient a
  reduction of its own (XLA fuses it with RoPE's backward, at 1.4 TB/s);
  the bias it hands on is zero, so the caller's add is a no-op."""

  def __call__(self, x, weights_only=False):
    if weights_only:   # callers that take their own products add the bias as before
      return super().__call__(x, weights_only=True)
    product, bias = super().__call__(x)
    return bias_add_split(product, bias), jnp.zeros_like(bias)


# ------------------------------------------------------------ RoPE outside the kernels


def no_shared_tables(rope):
  """attention._shared_tables that never finds batch-shared tables, so
  attention_impl='hopper' takes its general path: RoPE in XLA, the kernels
  on separate q, k, v (v copied out of the projection)."""
  return None


def no_projected_attention(projection, x, rope):
  """attention._projected_attention that never takes the fused projection."""
  return None


# ------------------------------------------------------------ the branch bias's gradient


def _xla_sum_add_bias_layer_norm():
  """``layer_norm.add_bias_layer_norm`` with ``y_bias``'s gradient summed by
  XLA over the whole ``[rows, width]`` gradient (its form until the
  fourteenth session)."""
  @functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
  def add_bias_layer_norm(x, y, y_bias, scale, bias, eps=1e-6,
                          blocks=layer_norm.DEFAULT_BLOCKS, interpret=False):
    s, out, _ = layer_norm.add_forward(x, y, scale, bias, y_bias=y_bias, eps=eps,
                                       blocks=blocks, interpret=interpret)
    return s, out

  def bwd(eps, blocks, interpret, saved, cotangents):
    *saved, bias_like = saved
    d, dy, dscale, dbias = layer_norm._add_bwd(eps, blocks, interpret, tuple(saved), cotangents)
    dy_bias = jnp.sum(d.astype(jnp.float32), axis=tuple(range(d.ndim - 1)))
    return d, dy, dy_bias.astype(bias_like.dtype), dscale, dbias

  add_bias_layer_norm.defvjp(layer_norm._add_bias_fwd, bwd, symbolic_zeros=True)
  return add_bias_layer_norm


# ------------------------------------------------------------ the attention mask


def iota_mask(q0, k0, seg, transposed, ops):
  """hopper_attention._mask as it was until the eighteenth session."""
  shape = (hopper_attention.BLOCK, hopper_attention.BLOCK)
  qr = q0 + ops.iota(shape, 1 if transposed else 0)
  kr = k0 + ops.iota(shape, 0 if transposed else 1)
  first = q0 // seg * seg
  start = jnp.where(qr >= first + seg, first + seg, first)
  return (kr <= qr) & (kr >= start)


# ------------------------------------------------------------ the step


def _with_param_norm(make_train_step):
  """``loop.make_train_step`` as it was until the thirteenth session: the
  parameter norm a metric of every step (now read at log time)."""
  def make(*args, **kwargs):
    step = make_train_step(*args, **kwargs)

    def train_step(state, batch):
      new_state, metrics = step(state, batch)
      return new_state, dict(metrics, param_norm=optax.tree.norm(state["params"]))
    return train_step
  return make


# ------------------------------------------------------------ registry

VARIANTS = {
    "base": [],
    "mlp_recompute": [(vit, "Mlp", MlpRecompute)],
    "ln_mlp_recompute": [(vit, "Block", BlockLnMlpRecompute)],
    "rope_vjp": [(posenc, "apply_rope", rope_vjp)],
    "bias_gemv": [(nn, "Dense", DenseBiasGemv), (nn, "DenseGeneral", DenseBiasGemv)],
    "qkv_bias_split": [(attention_lib, "QkvProjection", QkvProjectionBiasSplit)],
    "rope_in_xla": [(attention_lib, "_shared_tables", no_shared_tables)],
    "qkv_rope_in_xla": [(attention_lib, "_projected_attention", no_projected_attention)],
    "dq_from_ds": [(hopper_attention, "DEFAULT_ATTENTION_TILING",
                    hopper_attention.AttentionTiling(dq_from_ds=True))],
    "param_norm_in_step": [(loop, "make_train_step", _with_param_norm(loop.make_train_step))],
    "branch_bias_sum_in_xla": [(layer_norm, "add_bias_layer_norm",
                                _xla_sum_add_bias_layer_norm())],
    "iota_mask": [(hopper_attention, "_mask", iota_mask)],
}


LN_BLOCKS = "ln_blocks:"
ATTENTION_TILING = "attention_tiling:"


def _is_override(name: str) -> bool:
  """A ``key=value`` config override (an ``attention_tiling:`` variant has
  ``=`` in its fields, but is a variant)."""
  return "=" in name and not name.startswith(ATTENTION_TILING)


def parse_attention_tiling(text: str):
  """``slots=3/rope_tables=float32`` (fields of
  hopper_attention.AttentionTiling, ``/``-separated) -> the tiling."""
  fields = {}
  for item in text.split("/"):
    key, _, value = item.partition("=")
    if key not in ("slots", "rope_tables", "dq_from_ds"):
      raise ValueError(f"unknown AttentionTiling field {key!r} in {text!r}; valid: slots, "
                       f"rope_tables, dq_from_ds")
    if key == "rope_tables":
      fields[key] = value
    elif key == "dq_from_ds":
      if value.lower() not in ("1", "true", "0", "false"):
        raise ValueError(f"dq_from_ds takes true or false, got {value!r}")
      fields[key] = value.lower() in ("1", "true")
    else:
      fields[key] = int(value)
  return hopper_attention.AttentionTiling(**fields)


@contextlib.contextmanager
def variant(name: str):
  """Patches the model for one variant while the block runs.

  jax's caches are cleared on the way in and out: a function under its own
  ``jax.jit`` (the attention kernels' ``_dkv_into``) keeps the trace of its
  first call, which would otherwise hide a patch of what it calls."""
  jax.clear_caches()
  try:
    with _patched(name):
      yield
  finally:
    jax.clear_caches()


@contextlib.contextmanager
def _patched(name: str):
  if name.startswith(LN_BLOCKS):
    from layer_norm_bench import parse_blocks
    with mock.patch.object(layer_norm, "DEFAULT_BLOCKS", parse_blocks(name[len(LN_BLOCKS):])), \
        mock.patch.object(layer_norm, "WIDTH_BLOCKS", {}):
      yield
    return
  if name.startswith(ATTENTION_TILING):
    tiling = parse_attention_tiling(name[len(ATTENTION_TILING):])
    with mock.patch.object(hopper_attention, "DEFAULT_ATTENTION_TILING", tiling):
      yield
    return
  if name not in VARIANTS:
    raise ValueError(f"unknown variant {name!r}; valid: {', '.join(VARIANTS)}")
  with contextlib.ExitStack() as stack:
    for owner, attr, value in VARIANTS[name]:
      stack.enter_context(mock.patch.object(owner, attr, value))
    yield


def main():
  import pretrain_benchmark as bench
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--case", default="L/16:mse:256", help="variant:objective:batch")
  parser.add_argument("--variants", default="base,rope_vjp,base,rope_vjp",
                      help=f"comma list, repeats allowed; from {', '.join(VARIANTS)}")
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--set", action="append", default=[])
  args = parser.parse_args()
  model, objective, batch = args.case.split(":")
  names = args.variants.split(",")
  bad = [n for n in names if n not in VARIANTS and not _is_override(n)
         and not n.startswith((LN_BLOCKS, ATTENTION_TILING))]
  if bad:                                  # fail before compiling anything
    parser.error(f"unknown variants {bad}; valid: {', '.join(VARIANTS)}")
  for name in names:
    if name.startswith(ATTENTION_TILING):
      try:
        parse_attention_tiling(name[len(ATTENTION_TILING):])
      except (ValueError, TypeError) as e:
        parser.error(str(e))
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.case}")
  print("| variant | img/s (p10-p90) | MFU | memory GB | loss |")
  print("|---|---|---|---|---|")
  for name in names:
    if _is_override(name):                  # a config override for this row
      row = argparse.Namespace(**{**vars(args), "set": args.set + [name]})
      r = bench.run_case(model, objective, int(batch), row)
    else:
      with variant(name):
        r = bench.run_case(model, objective, int(batch), args)
    print(f"| {name} | {r['img_s']:.0f} ({r['spread']}) | {r['mfu']:.3f} | "
          f"{r['mem_gb']:.1f} | {r['loss']:.4f} |", flush=True)


if __name__ == "__main__":
  main()
