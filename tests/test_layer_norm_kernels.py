"""The fused LayerNorm kernels (darl_jax/kernels/layer_norm.py) on CPU: their
numbers in Pallas's Triton interpreter against a float32 LayerNorm, the
models' ``norm_impl='triton'`` against flax's LayerNorm, and their lowering
for CUDA at the model widths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import config_lib
from darl_jax.kernels import layer_norm as ln
from darl_jax.models import darl as darl_lib
from darl_jax.models import vit
from test_kernels import perturbed, vit_inputs

# 37 rows in blocks of 4 = 10 blocks over 3 backward programs: a partial last
# block, and programs that walk different numbers of blocks.
SMALL = ln.Blocks(rows=4, warps=2, bwd_rows=4, bwd_warps=2, programs=3)
EPS = vit.LN_EPS


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


# 64: one chunk, the backward kernel. 80 = 64 + 16: two chunks in the
# forward, XLA's backward (not a power of two).
@pytest.mark.parametrize("width", [64, 80])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_residual_layer_norm_matches_float32_layer_norm(width, dtype):
  x, scale, bias, dres, dy = _inputs(width, dtype)
  f = lambda x, s, b: ln.residual_layer_norm(x, s, b, EPS, SMALL, True)
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


def test_layer_norm_checks_its_parameters():
  x = jnp.zeros((4, 8))
  with pytest.raises(ValueError, match=r"must be \[width\]"):
    ln.forward(x, jnp.ones((4,)), jnp.zeros((8,)), eps=EPS, interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    ln.Blocks(rows=3)


def _tiny_vit(norm_impl, dtype=jnp.float32):
  return vit.ViT(64, 2, 2, 128, reference_grid=(4, 4), dtype=dtype, norm_impl=norm_impl)


def test_vit_with_triton_norms_is_the_same_model():
  """Same parameter tree, same features and block outputs, and parameter
  gradients equal to float32 rounding under a random readout."""
  args = vit_inputs(3, 4)
  params = _tiny_vit("xla").init(jax.random.key(1), *args)["params"]
  assert (jax.tree.structure(_tiny_vit("triton").init(jax.random.key(1), *args)["params"])
          == jax.tree.structure(params))
  params = perturbed(params)   # scales and biases away from 1 and 0
  readout = jax.random.normal(jax.random.key(3), (3, 16, 64))

  def loss(impl):
    def f(p):
      out = _tiny_vit(impl).apply({"params": p}, *args)
      # LN output alone is scale-free upstream; the block outputs make every
      # parameter's gradient count
      return jnp.sum(out["features"] * readout) + jnp.sum(out["block_00"] * readout), out
    return jax.value_and_grad(f, has_aux=True)(params)

  (_, out_x), g_x = loss("xla")
  (_, out_t), g_t = loss("triton")
  for key in ("features", "block_00", "block_01"):
    assert _rel(out_t[key], out_x[key]) < 1e-5, key
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_t), jax.tree.leaves(g_x)):
    assert _rel(a, b) < 1e-4, jax.tree_util.keystr(path)


def test_the_denoising_decoder_takes_the_backbones_kernels():
  """config.model.norm_impl / mlp_impl reach the patch decoder too, and the
  diffusion model's loss is unchanged by the norms' implementation."""
  config = config_lib.imagenet_pretrain_config("mu/16", "diffusion")
  config.model.image_size = 32
  config.model.norm_impl = "triton"
  model = darl_lib.darl_from_config(config)
  assert model.decoder.kind == "transformer" and model.decoder.norm_impl == "triton"
  assert model.decoder.mlp_impl == config.model.mlp_impl
  images = jax.random.uniform(jax.random.key(0), (2, 32, 32, 3), minval=-1, maxval=1)
  rngs = {"params": jax.random.key(1), "noise": jax.random.key(2), "dropout": jax.random.key(3)}
  variables = model.init(rngs, images, train=True)
  config.model.norm_impl = "xla"
  plain = darl_lib.darl_from_config(config)
  assert (jax.tree.structure(plain.init(rngs, images, train=True)) == jax.tree.structure(variables))
  noise = {"noise": jax.random.key(4)}
  got, _ = model.apply(variables, images, train=True, rngs=noise)
  want, _ = plain.apply(variables, images, train=True, rngs=noise)
  assert abs(float(got) - float(want)) < 1e-5 * abs(float(want))


def test_unknown_norm_impl_names_the_valid_ones():
  with pytest.raises(ValueError, match="unknown LayerNorm implementation 'fast'; valid: xla, triton"):
    vit.check_norm_impl("fast")
  config = config_lib.imagenet_pretrain_config("mu/16", "mse")
  config.model.norm_impl = "fast"
  with pytest.raises(ValueError, match="valid: xla, triton"):
    vit.vit_from_config(config.model)


@pytest.mark.parametrize("width,backward_kernels", [(1024, 1), (1280, 0), (768, 0)])
def test_kernels_lower_for_cuda_at_model_widths(width, backward_kernels):
  """Triton lowering (block shapes, layouts) at ViT-L/H/B widths: one forward
  kernel per norm; the backward kernel where the width is a power of two."""
  s = jax.ShapeDtypeStruct
  x, v = s((64, 197, width), jnp.bfloat16), s((width,), jnp.float32)

  def loss(x, scale, bias):
    r, y = ln.residual_layer_norm(x, scale, bias)
    return jnp.sum(r.astype(jnp.float32) * y.astype(jnp.float32))

  text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(x, v, v).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("layer_norm_fwd") >= 1
  assert (text.count("layer_norm_bwd") >= 1) == bool(backward_kernels)
