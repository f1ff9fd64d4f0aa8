"""The fused LayerNorm kernels (darl_jax/kernels/layer_norm.py) on CPU: their
numbers in Pallas's Triton interpreter against a float32 LayerNorm (and, for
``add_layer_norm`` / ``add_bias_layer_norm``, against XLA's adds), the
models under ``kernels.norm='triton'`` against XLA's LayerNorm (the
backbone's stack with the branch biases deferred into the norms,
kernels/fused_stack.py; tests/test_ops.py has more of it), and their
lowering for CUDA at the model widths."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import config_lib
from darl_jax import objectives
from darl_jax import ops
from darl_jax.kernels import layer_norm as ln
from darl_jax.models import darl as darl_lib
from darl_jax.models import decoders
from darl_jax.models import vit
from test_kernels import perturbed, vit_inputs

# 37 rows in blocks of 4 = 10 blocks over 3 backward programs: a partial last
# block, and programs that walk different numbers of blocks.
SMALL = ln.Blocks(rows=4, warps=2, bwd_rows=4, bwd_warps=2, programs=3)
EPS = ops.LN_EPS


def _reference(x, scale, bias):
  """(x, LN(x)) in float32, as the kernels define it."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
  return x, (x32 - mean) * jax.lax.rsqrt(var + EPS) * scale + bias


def _inputs(width, dtype, rows=37):
  k = jax.random.split(jax.random.key(width), 5)
  x = (jax.random.normal(k[0], (rows, width)) * 3 + 1.5).astype(dtype)
  scale = 1 + 0.2 * jax.random.normal(k[1], (width,))
  bias = 0.2 * jax.random.normal(k[2], (width,))
  dres = jax.random.normal(k[3], (rows, width)).astype(dtype)
  dy = jax.random.normal(k[4], (rows, width)).astype(dtype)
  return x, scale, bias, dres, dy


def _rel(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("width", list(range(1, 70)) + [80, 768, 1000, 1024, 1280, 2049])
def test_chunks_cover_a_row_in_descending_powers_of_two(width):
  parts = ln.chunks(width)
  starts = [s for s, _ in parts]
  sizes = [n for _, n in parts]
  assert sum(sizes) == width and starts == [sum(sizes[:i]) for i in range(len(sizes))]
  assert all(n & (n - 1) == 0 for n in sizes) and sizes == sorted(set(sizes), reverse=True)


# The backward's forms: the default (binary chunks held in registers, column
# sums per row of the block), the column sums reduced across the block at
# every step, two sweeps over uniform 16-lane chunks (5 at width 80), and
# XLA's formula.
BACKWARDS = {
    "default": SMALL,
    "step_sums": dataclasses.replace(SMALL, bwd_block_sums=False),
    "two_sweeps": dataclasses.replace(SMALL, bwd_chunk=16, bwd_sweeps=2),
    "xla": dataclasses.replace(SMALL, bwd="xla"),
}


# 64: one chunk. 80 = 64 + 16: two chunks.
@pytest.mark.parametrize("width", [64, 80])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("backward", list(BACKWARDS))
def test_residual_layer_norm_matches_float32_layer_norm(width, dtype, backward):
  x, scale, bias, dres, dy = _inputs(width, dtype)
  blocks = BACKWARDS[backward]
  f = lambda x, s, b: ln.residual_layer_norm(x, s, b, EPS, blocks, True)
  (x_out, y), vjp = jax.vjp(f, x, scale, bias)
  (_, y_ref), vjp_ref = jax.vjp(_reference, x, scale, bias)
  assert x_out is x or np.array_equal(x_out, x)
  assert y.dtype == dtype and y.shape == x.shape
  tol = 1e-6 if dtype == jnp.float32 else 5e-3
  assert _rel(y, y_ref) < tol
  # the residual's cotangent is added in the backward
  dx, dscale, dbias = vjp((dres, dy))
  dx_ref, dscale_ref, dbias_ref = vjp_ref((dres, dy.astype(jnp.float32)))
  assert dx.dtype == dtype and dscale.dtype == jnp.float32
  assert _rel(dx, dx_ref) < tol
  assert _rel(dscale, dscale_ref) < 1e-5 and _rel(dbias, dbias_ref) < 1e-5
  # statistics kept for the backward: float32 mean and 1/std per row
  _, (mean, rstd) = ln.forward(x, scale, bias, eps=EPS, blocks=SMALL, interpret=True)
  x32 = x.astype(jnp.float32)
  np.testing.assert_allclose(mean, x32.mean(-1), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(rstd, 1 / jnp.sqrt(x32.var(-1) + EPS), rtol=1e-4)


@pytest.mark.parametrize("width", [64, 80])
def test_plain_layer_norm_gradient(width):
  """``layer_norm`` (no residual) has the same function and gradient."""
  x, scale, bias, _, dy = _inputs(width, jnp.float32)
  x = x.reshape(37, 1, width)        # leading axes are flattened into rows
  loss = lambda f: lambda *a: jnp.sum(f(*a) * dy.reshape(x.shape))
  got = jax.grad(loss(lambda *a: ln.layer_norm(*a, EPS, SMALL, True)), (0, 1, 2))(x, scale, bias)
  want = jax.grad(loss(lambda *a: _reference(*a)[1]), (0, 1, 2))(x, scale, bias)
  for a, b in zip(got, want):
    assert a.shape == b.shape and _rel(a, b) < 1e-5


def _assert_statistics_are_the_sums(x, y, s, scale, bias, y_bias=None):
  """The statistics the forward keeps for the backward are those of the sum ``s``."""
  _, _, (mean, rstd) = ln.add_forward(x, y, scale, bias, y_bias=y_bias, eps=EPS, blocks=SMALL,
                                      interpret=True)
  _, (mean_s, rstd_s) = ln.forward(s, scale, bias, eps=EPS, blocks=SMALL, interpret=True)
  np.testing.assert_array_equal(mean, mean_s)
  np.testing.assert_array_equal(rstd, rstd_s)


def _readout(r_sum, r_out, use_sum):
  """``loss(f)``: a random readout of ``f``'s (sum, norm) outputs, or of the
  norm's alone (a final norm: the sum's cotangent a symbolic zero)."""
  def loss(f):
    def g(*args):
      s, out = f(*args)
      total = jnp.sum(out.astype(jnp.float32) * r_out)
      return total + jnp.sum(s.astype(jnp.float32) * r_sum) if use_sum else total
    return g
  return loss


def _add_reference(x, y, scale, bias):
  """(x + y, LN(x + y)): XLA's add, then the float32 LayerNorm."""
  s = x + y
  return s, _reference(s, scale, bias)[1]


# 64: one chunk; 80: two chunks (64 + 16). 37 rows:
# a partial last block.
@pytest.mark.parametrize("width", [64, 80])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_add_layer_norm_is_xlas_add_then_the_norm(width, dtype):
  x, scale, bias, y, _ = _inputs(width, dtype)
  s, out = ln.add_layer_norm(x, y, scale, bias, EPS, SMALL, True)
  # the sum rounded as XLA rounds x + y (bf16: a float32 add rounded to bf16)
  assert s.dtype == dtype and np.array_equal(np.asarray(s), np.asarray(x + y))
  assert out.dtype == dtype and out.shape == x.shape
  tol = 1e-6 if dtype == jnp.float32 else 5e-3
  assert _rel(out, _add_reference(x, y, scale, bias)[1]) < tol
  _assert_statistics_are_the_sums(x, y, s, scale, bias)


@pytest.mark.parametrize("width", [64, 80])
@pytest.mark.parametrize("x_dtype,y_dtype", [(jnp.float32, jnp.float32),
                                             (jnp.bfloat16, jnp.bfloat16),
                                             (jnp.float32, jnp.bfloat16)])
@pytest.mark.parametrize("use_sum", [True, False])
def test_add_layer_norm_gradient(width, x_dtype, y_dtype, use_sum):
  """dx, dy, dscale, dbias as jax.grad of XLA's add and a float32 LayerNorm,
  under a random readout of both outputs (``use_sum``) or of the norm's
  alone (a final norm: the sum's cotangent is a symbolic zero, not read)."""
  x, scale, bias, _, _ = _inputs(width, x_dtype)
  k = jax.random.split(jax.random.key(7), 3)
  y = jax.random.normal(k[0], x.shape).astype(y_dtype)
  r_sum, r_out = jax.random.normal(k[1], x.shape), jax.random.normal(k[2], x.shape)

  loss = _readout(r_sum, r_out, use_sum)

  args = (x, y, scale, bias)
  grad = jax.grad(loss(lambda *a: ln.add_layer_norm(*a, EPS, SMALL, True)), (0, 1, 2, 3))
  got = grad(*args)
  want = jax.grad(loss(_add_reference), (0, 1, 2, 3))(*args)
  if width == 64:
    # the backward kernel reads the sum's cotangent only where it has one
    # (x, scale, mean, rstd, dy [, dres])
    bwd = [e for e in jax.make_jaxpr(grad)(*args).eqns if e.params.get("name") == "layer_norm_bwd"]
    assert [len(e.invars) for e in bwd] == [6 if use_sum else 5]
  # dx and dy are the one gradient of the sum, in their inputs' dtypes
  assert [a.dtype for a in got] == [x_dtype, y_dtype, jnp.float32, jnp.float32]
  assert np.array_equal(np.asarray(got[0].astype(y_dtype)), np.asarray(got[1]))
  tol = 1e-5 if x_dtype == y_dtype == jnp.float32 else 5e-3
  for name, a, b in zip(("dx", "dy", "dscale", "dbias"), got, want):
    assert a.shape == b.shape and _rel(a, b) < tol, name


def _add_bias_reference(x, y, y_bias, scale, bias):
  """XLA's x + (y + y_bias) (the bias cast to y's dtype first, as a Dense
  layer casts it), then the float32 LayerNorm."""
  return _add_reference(x, y + y_bias.astype(y.dtype), scale, bias)


def _bias_inputs(x, y_dtype, bias_dtype=None):
  k = jax.random.split(jax.random.key(7), 4)
  y = jax.random.normal(k[0], x.shape).astype(y_dtype)
  y_bias = (0.5 * jax.random.normal(k[1], x.shape[-1:])).astype(bias_dtype or y_dtype)
  return y, y_bias, jax.random.normal(k[2], x.shape), jax.random.normal(k[3], x.shape)


# bias_dtype float32: the model's case (the parameter handed on as it is)
@pytest.mark.parametrize("width", [64, 80])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bias_dtype", [None, jnp.float32])
def test_add_bias_layer_norm_is_xlas_adds_then_the_norm(width, dtype, bias_dtype):
  x, scale, bias, _, _ = _inputs(width, dtype)
  y, y_bias, _, _ = _bias_inputs(x, dtype, bias_dtype)
  s, out = ln.add_bias_layer_norm(x, y, y_bias, scale, bias, EPS, SMALL, True)
  # rounded as XLA rounds x + (y + y_bias): the bias to y's dtype, the inner
  # sum, then the outer
  want = x + (y + y_bias.astype(dtype))
  assert s.dtype == dtype and np.array_equal(np.asarray(s), np.asarray(want))
  if dtype == jnp.bfloat16:   # one rounding of x + y + y_bias would differ
    assert not np.array_equal(np.asarray(s), np.asarray(
        (x.astype(jnp.float32) + y + y_bias.astype(jnp.float32)).astype(dtype)))
  tol = 1e-6 if dtype == jnp.float32 else 5e-3
  assert _rel(out, _add_bias_reference(x, y, y_bias, scale, bias)[1]) < tol
  _assert_statistics_are_the_sums(x, y, s, scale, bias, y_bias)


@pytest.mark.parametrize("width", [64, 80])
@pytest.mark.parametrize("x_dtype,y_dtype", [(jnp.float32, jnp.float32),
                                             (jnp.bfloat16, jnp.bfloat16),
                                             (jnp.float32, jnp.bfloat16)])
@pytest.mark.parametrize("use_sum", [True, False])
@pytest.mark.parametrize("bias_dtype", [None, jnp.float32])
def test_add_bias_layer_norm_gradient(width, x_dtype, y_dtype, use_sum, bias_dtype):
  """dx, dy, dy_bias, dscale, dbias as jax.grad of XLA's adds and a float32
  LayerNorm; dx and dy are add_layer_norm's, dy_bias their row sum (float32,
  then the bias's dtype: a float32 bias gets the float32 sum)."""
  x, scale, bias, _, _ = _inputs(width, x_dtype)
  y, y_bias, r_sum, r_out = _bias_inputs(x, y_dtype, bias_dtype)
  bias_dtype = y_bias.dtype

  loss = _readout(r_sum, r_out, use_sum)

  args = (x, y, y_bias, scale, bias)
  grad = jax.grad(loss(lambda *a: ln.add_bias_layer_norm(*a, EPS, SMALL, True)), range(5))
  got = grad(*args)
  want = jax.grad(loss(_add_bias_reference), range(5))(*args)
  add_got = jax.grad(loss(lambda x, y, *a: ln.add_layer_norm(
      x, y + y_bias.astype(y.dtype), *a, EPS, SMALL, True)), (0, 1))(x, y, scale, bias)
  if width == 64:   # the sum's cotangent is read only where it has one
    bwd = [e for e in jax.make_jaxpr(grad)(*args).eqns if e.params.get("name") == "layer_norm_bwd"]
    assert [len(e.invars) for e in bwd] == [6 if use_sum else 5]
    # dy_bias comes out of the kernel (a third column sum beside the scale's
    # and bias's in its [programs, 3 width] partials), not from a reduction
    # of XLA's over the [rows, width] gradient
    assert [e.outvars[1].aval.shape for e in bwd] == [(SMALL.programs, 3 * width)]
    rows_reduced = [e for e in jax.make_jaxpr(grad)(*args).eqns
                    if e.primitive.name == "reduce_sum" and e.invars[0].aval.shape == x.shape
                    and tuple(e.params["axes"]) == (0,)]
    assert not rows_reduced
  assert [a.dtype for a in got] == [x_dtype, y_dtype, bias_dtype, jnp.float32, jnp.float32]
  for a, b in zip(got[:2], add_got):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # dy_bias is the kernel's third column sum of d as stored: the float32 sum
  # of got[0] up to the order of the additions
  d_sum = jnp.sum(got[0].astype(jnp.float32), 0)
  assert _rel(got[2], d_sum.astype(bias_dtype)) < (1e-6 if bias_dtype == jnp.float32 else 4e-3)
  # XLA's own y_bias gradient is a row sum in y's dtype (bf16 on the CPU,
  # less accurate than the kernel's float32 sum): take the float32 row sum
  # of its dy instead
  want = list(want)
  want[2] = jnp.sum(want[1].astype(jnp.float32), 0)
  tol = 1e-5 if x_dtype == y_dtype == jnp.float32 else 5e-3
  for name, a, b in zip(("dx", "dy", "dy_bias", "dscale", "dbias"), got, want):
    assert a.shape == b.shape and _rel(a, b) < tol, name


def test_add_bias_layer_norm_needs_a_width_bias():
  x, scale, bias = jnp.zeros((4, 8)), jnp.ones((8,)), jnp.zeros((8,))
  with pytest.raises(ValueError, match=r"y_bias \(4, 8\) must be \[width\]"):
    ln.add_bias_layer_norm(x, x, x, scale, bias, EPS, SMALL, True)


def test_add_layer_norm_needs_operands_of_one_shape():
  x, scale, bias = jnp.zeros((4, 8)), jnp.ones((8,)), jnp.zeros((8,))
  with pytest.raises(ValueError, match=r"x \(4, 8\) and y \(1, 8\) must have the same shape"):
    ln.add_layer_norm(x, jnp.zeros((1, 8)), scale, bias, EPS, SMALL, True)
  with pytest.raises(ValueError, match="must have the same shape"):
    jax.grad(lambda y: jnp.sum(ln.add_layer_norm(x, y, scale, bias, EPS, SMALL, True)[1]))(
        jnp.zeros((4, 1)))


def test_layer_norm_checks_its_parameters():
  x = jnp.zeros((4, 8))
  with pytest.raises(ValueError, match=r"must be \[width\]"):
    ln.forward(x, jnp.ones((4,)), jnp.zeros((8,)), eps=EPS, interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    ln.Blocks(rows=3)
  with pytest.raises(ValueError, match="bwd_chunk must be 0 or a power of two"):
    ln.Blocks(bwd_chunk=96)
  with pytest.raises(ValueError, match="bwd_sweeps must be 1 or 2"):
    ln.Blocks(bwd_sweeps=3)
  with pytest.raises(ValueError, match="'auto', 'kernel' or 'xla'"):
    ln.Blocks(bwd="triton")


def test_backward_chunks():
  """Uniform chunks where they divide the width, the binary ones elsewhere."""
  assert ln.Blocks(bwd_chunk=256).bwd_parts(1280) == tuple((i, 256) for i in range(0, 1280, 256))
  assert ln.Blocks(bwd_chunk=256).bwd_parts(1000) == ln.chunks(1000)
  assert ln.Blocks().bwd_parts(1280) == ((0, 1024), (1024, 256))


def _tiny_vit(dtype=jnp.float32, **kw):
  return vit.ViT(64, 2, 2, 128, reference_grid=(4, 4), dtype=dtype, **kw)


def _all_eqns(jaxpr):
  """Every equation of ``jaxpr`` and of its sub-jaxprs, depth first."""
  for eqn in jaxpr.eqns:
    yield eqn
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        if hasattr(sub, "eqns"):
          yield from _all_eqns(sub)
        elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
          yield from _all_eqns(sub.jaxpr)


def _norm_kernels(jaxpr) -> dict:
  """How many of each forward norm kernel a jaxpr calls, in its sub-jaxprs
  (scan bodies, remat, custom gradients) too; a scan body counts once."""
  counts = {}

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name == "pallas_call":
        counts[eqn.params["name"]] = counts.get(eqn.params["name"], 0) + 1
        continue
      for v in eqn.params.values():
        for sub in v if isinstance(v, (tuple, list)) else (v,):
          if hasattr(sub, "eqns"):
            walk(sub)
          elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
            walk(sub.jaxpr)

  walk(jaxpr.jaxpr)
  return counts


# Two blocks. The fused stack (kernels/fused_stack.py, without drop path and
# remat): the triton norms add the attention branch in norm2 and the first
# block's MLP branch in the second block's norm1, the last in the final norm,
# each with the bias of the projection that ends the branch
# (add_bias_layer_norm_fwd); unrolled and scanned (the carry is (x, (product,
# bias))). With drop path in training, or under remat, the plain blocks run,
# each of their five norms the plain kernel. ``kernels``: the forward norm
# kernels the triton model's forward calls, so that a lost deferral (or a
# norm left to XLA) fails here.
@pytest.mark.parametrize("kw,train,kernels", [
    ({}, False, {"add_bias_layer_norm_fwd": 4, "layer_norm_fwd": 1}),
    ({"scan_layers": True}, False, {"add_bias_layer_norm_fwd": 3}),
    ({"drop_path": 0.5}, True, {"layer_norm_fwd": 5}),
    ({"remat": "full"}, False, {"layer_norm_fwd": 5})],
    ids=["unrolled", "scan", "drop_path", "remat"])
def test_vit_with_triton_norms_is_the_same_model(kw, train, kernels):
  """Same features and block outputs, and parameter gradients equal to
  float32 rounding under a random readout."""
  batch = 8 if train else 3   # 8 images: drop path keeps some branches, drops others
  args = vit_inputs(batch, 4)
  model = _tiny_vit(**kw)
  params = perturbed(model.init(jax.random.key(1), *args)["params"])   # scales, biases off 1, 0
  readout = jax.random.normal(jax.random.key(3), (3, batch, 16, 64))
  # the same per-example drop-path masks for both (drop rate 0.5 in block 1)
  rngs = {"dropout": jax.random.key(4)}

  def loss(norm):
    def f(p):
      out = model.apply({"params": p}, *args, train=train, rngs=rngs)
      # LN output alone is scale-free upstream; the block outputs make every
      # parameter's gradient count
      return jnp.sum(out["features"] * readout[0]) + sum(
          jnp.sum(out[f"block_{i:02d}"] * readout[1 + i]) for i in range(2)), out
    with ops.using(norm=norm):
      return jax.value_and_grad(f, has_aux=True)(params)

  (_, out_x), g_x = loss("xla")
  (_, out_t), g_t = loss("triton")
  # a function for each trace: jax caches a function's trace, which does not
  # know of the ops' choice
  forward = lambda: lambda p: model.apply({"params": p}, *args, train=train, rngs=rngs)
  with ops.using(norm="triton"):
    assert _norm_kernels(jax.make_jaxpr(forward())(params)) == kernels
  assert not _norm_kernels(jax.make_jaxpr(forward())(params))
  assert out_t.keys() == out_x.keys() == {"features", "block_00", "block_01"}
  for key in out_x:
    assert _rel(out_t[key], out_x[key]) < 1e-5, key
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_t), jax.tree.leaves(g_x)):
    assert _rel(a, b) < 1e-4, jax.tree_util.keystr(path)


def test_mlp_decoder_with_triton_norms_is_the_same_function():
  """The residual MLP decoder's norms (one per block, the final one) run the
  kernels under kernels.norm='triton': same outputs and gradients as XLA's."""
  z = jax.random.normal(jax.random.key(0), (37, 64))
  x_noisy = jax.random.normal(jax.random.key(1), (37, 12))
  decoder = decoders.PatchDecoder("mlp", 12, depth=2, width=64, mlp_ratio=2)
  params = perturbed(decoder.init(jax.random.key(2), z, x_noisy)["params"])
  readout = jax.random.normal(jax.random.key(3), (37, 12))

  def loss(norm):
    with ops.using(norm=norm):
      return jax.value_and_grad(
          lambda p, z: jnp.sum(decoder.apply({"params": p}, z, x_noisy) * readout), (0, 1))(
              params, z)

  got, want = loss("triton"), loss("xla")
  forward = lambda p: decoder.apply({"params": p}, z, x_noisy)
  with ops.using(norm="triton"):
    assert _norm_kernels(jax.make_jaxpr(forward)(params)) == {"layer_norm_fwd": 3}
  assert abs(float(got[0]) - float(want[0])) < 1e-5 * abs(float(want[0]))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1])):
    assert _rel(a, b) < 1e-4, jax.tree_util.keystr(path)


def test_the_denoising_decoder_takes_the_backbones_kernels():
  """kernels.norm='triton' reaches the Transformer patch decoder too (its
  norms run the kernels), and the diffusion model's loss is unchanged by the
  norms' implementation."""
  config = config_lib.imagenet_pretrain_config("mu/16", "diffusion")
  config.model.image_size = 32
  model = darl_lib.darl_from_config(config)
  assert model.decoder.kind == "transformer"
  images = jax.random.uniform(jax.random.key(0), (2, 32, 32, 3), minval=-1, maxval=1)
  rngs = {"params": jax.random.key(1), "noise": jax.random.key(2), "dropout": jax.random.key(3)}
  variables = model.init(rngs, images, train=True)
  z = jnp.zeros((4, model.backbone.width))
  with ops.using(norm="triton"):
    decode = jax.make_jaxpr(lambda v: model.apply(
        v, z, jnp.zeros((4, 16 * 16 * 3)), jnp.full((4,), 0.5), method=darl_lib.DARL.decode))
    assert _norm_kernels(decode(variables)).get("layer_norm_fwd", 0) >= 1

  def loss(norm):
    with ops.using(norm=norm):
      return model.apply(variables, images, jax.random.key(4), train=True,
                         rngs={"noise": jax.random.key(5)}, method=objectives.loss)[0]

  got, want = loss("triton"), loss("xla")
  assert abs(float(got) - float(want)) < 1e-5 * abs(float(want))


def test_unknown_norm_choice_names_the_valid_ones():
  with pytest.raises(ValueError, match="unknown kernels.norm 'fast'; valid: auto, xla, triton"):
    ops.Kernels(norm="fast")
  config = config_lib.imagenet_pretrain_config("mu/16", "mse")
  config.kernels.norm = "fast"
  with pytest.raises(config_lib.ConfigError, match="kernels.norm must be one of auto, xla, "
                                                   "triton, got 'fast'"):
    config_lib.validate(config)


@pytest.mark.parametrize("width,backward_kernels", [(1024, 1), (1280, 1), (768, 0)])
def test_kernels_lower_for_cuda_at_model_widths(width, backward_kernels):
  """Triton lowering (block shapes, layouts) at ViT-L/H/B widths: one forward
  kernel per norm (the residual norm's, the add-and-norm's and the one with
  a deferred bf16 bias); the backward kernel except at XLA_BACKWARD_WIDTHS
  (ViT-B's 768)."""
  s = jax.ShapeDtypeStruct
  x, v = s((64, 197, width), jnp.bfloat16), s((width,), jnp.float32)

  def loss(x, scale, bias):
    r, y = ln.residual_layer_norm(x, scale, bias)
    r, y = ln.add_layer_norm(r, y, scale, bias)
    r, y = ln.add_bias_layer_norm(r, y, bias.astype(jnp.bfloat16), scale, bias)
    return jnp.sum(r.astype(jnp.float32) * y.astype(jnp.float32))

  text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(x, v, v).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("add_layer_norm_fwd") >= 1 and text.count("add_bias_layer_norm_fwd") >= 1
  assert text.count("layer_norm_fwd") > (text.count("add_layer_norm_fwd")
                                         + text.count("add_bias_layer_norm_fwd"))
  assert (text.count("layer_norm_bwd") >= 1) == bool(backward_kernels)


@pytest.mark.parametrize("width,bwd_rows", [(1024, 2), (1280, ln.DEFAULT_BLOCKS.bwd_rows)])
def test_the_model_norm_takes_its_widths_blocks(width, bwd_rows):
  """ops.layer_norm under kernels.norm='triton' runs the kernels at
  ``blocks_for(width)``: the backward over 2 rows a block at ViT-L's 1024
  (measured faster there), the default elsewhere. The backward's grid shows
  it: one program per block of rows here (8 rows)."""
  x = jnp.ones((8, width), jnp.bfloat16)
  scale, bias = jnp.ones((width,)), jnp.zeros((width,))

  def backward_grid():
    grad = jax.grad(lambda x, s, b: jnp.sum(
        ops.layer_norm(x, s, b, dtype=jnp.bfloat16).astype(jnp.float32)), (0, 1, 2))
    with ops.using(norm="triton"):
      jaxpr = jax.make_jaxpr(grad)(x, scale, bias)
    # The kernels run inside the jitted call per_shard shares between call
    # sites: look into sub-jaxprs too.
    eqns = [e for e in _all_eqns(jaxpr.jaxpr) if e.params.get("name") == "layer_norm_bwd"]
    assert len(eqns) == 1
    return tuple(eqns[0].params["grid_mapping"].grid)

  assert backward_grid() == (8 // bwd_rows,)


def test_identical_blocks_lower_their_kernels_once(monkeypatch):
  """per_shard shares one jitted program per kernel call site's code and
  settings, so a deeper model lowers no more kernels: the LayerNorm kernels
  of a 3-block backbone (lowered for the GPU, forward and backward) are as
  many as a 1-block one's, where each block used to lower its own."""
  from darl_jax.kernels import per_shard
  from darl_jax.models import vit as vit_lib
  monkeypatch.setattr(ops, "_interpret", lambda: False)   # lower the kernels for the GPU

  def triton_calls(depth):
    model = vit_lib.ViT(width=64, depth=depth, num_heads=2, mlp_dim=128,
                        reference_grid=(4, 4), dtype=jnp.bfloat16)
    t = jnp.arange(16)[None]
    args = (jnp.ones((2, 16, 12)), t // 4, t % 4, t + 1, (4, 4))
    params = model.init(jax.random.key(0), *args)["params"]
    loss = lambda p: jnp.sum(model.apply({"params": p}, *args)["features"].astype(jnp.float32))
    with ops.using(norm="triton"):
      text = jax.jit(jax.grad(loss)).trace(params).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("custom_call @__gpu$xla.gpu.triton")

  assert triton_calls(3) == triton_calls(1) > 0
  monkeypatch.setattr(per_shard, "_shared", lambda fn: fn)   # each call site its own
  assert triton_calls(3) > triton_calls(1)
