"""Property tests of the model library on tiny models (CPU)."""


import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from darl_jax import ops
from darl_jax import objectives
from darl_jax import patches as patches_lib
from darl_jax import sampling
from darl_jax.models import darl as darl_lib
from darl_jax.models import heads, posenc, vit


def tiny_config(**over):
  c = ml_collections.ConfigDict({
      "seed": 0,
      "model": dict(variant="mu/4", image_size=16, channels=1, posenc="rope2d",
                    rope_max_wavelength=100.0, causal=True,
                    dtype="float32", drop_path=0.0, scan_layers=False, remat="none",
                    ordering="raster", ordering_block=2, reference_image_size=0),
      "decoder": dict(kind="linear", depth=1, width=32, num_heads=2,
                      gamma_conditioning=False),
      "loss": dict(kind="mse", norm_pix=False, noise_a=1.0, noise_b=1.0,
                   predict="x0", noise_samples=1, gamma_bins=4),
  })
  for k, v in over.items():
    section, key = k.split(".")
    c[section][key] = v
  return c


def init(model, images, seed=0):
  rngs = {"params": jax.random.PRNGKey(seed), "noise": jax.random.PRNGKey(1),
          "dropout": jax.random.PRNGKey(2)}
  # jitted: one compile instead of one per operation (about half the time)
  return jax.jit(lambda r, x: model.init(r, x, train=False)["params"])(rngs, images)


def images(n=2, size=16, c=1, seed=0):
  return jax.random.uniform(jax.random.PRNGKey(seed), (n, size, size, c), minval=-1, maxval=1)


# ------------------------------------------------------------------ causality

CAUSAL_CASES = [(o, "mse") for o in ("raster", "nested_raster", "round_robin", "random")]
CAUSAL_CASES += [(o, "diffusion") for o in ("raster", "round_robin")]


@pytest.mark.parametrize("ordering,objective", CAUSAL_CASES)
def test_prediction_for_patch_t_never_sees_patch_t_or_later(ordering, objective):
  over = {"model.ordering": ordering}
  if objective == "diffusion":
    over.update({"loss.kind": "diffusion", "decoder.kind": "transformer",
                 "decoder.gamma_conditioning": True})
  model = darl_lib.darl_from_config(tiny_config(**over))
  x = images()
  params = init(model, x)
  order = patches_lib.make_ordering(ordering, 4, 4, block=2, seed=0)

  @jax.jit
  def per_patch_pred(imgs):
    # Same noise for both calls: the decoder sees identical (x_noisy, gamma).
    return sampling.predict_patches(model, params, imgs, jax.random.PRNGKey(7), num_steps=3)

  base = patches_lib.patchify(per_patch_pred(x), 4)
  for j in (0, 5, 15):
    raster_j = int(order.perm[j])
    bumped = patches_lib.patchify(x, 4).at[:, raster_j].add(0.5)
    x2 = patches_lib.unpatchify(bumped, 4, (4, 4), 1)
    new = patches_lib.patchify(per_patch_pred(x2), 4)
    # Predictions of ordered patches 0..j (raster indices perm[:j+1]) are unchanged.
    seen = order.perm[: j + 1]
    np.testing.assert_allclose(new[:, seen], base[:, seen], atol=1e-5)
    if j < 15:
      later = order.perm[j + 1:]
      assert float(jnp.abs(new[:, later] - base[:, later]).max()) > 1e-4


def test_full_attention_lets_later_patches_change_earlier_outputs():
  model = darl_lib.darl_from_config(tiny_config(**{"model.causal": False}))
  x = images()
  params = init(model, x)
  f = jax.jit(lambda imgs: model.apply({"params": params}, imgs, train=False,
                                       method=darl_lib.DARL.encode)[1]["features"])
  bumped = x.at[:, 12:, 8:12].add(0.5)  # raster patch 14 = input token 15 (after SOS)
  assert float(jnp.abs(f(bumped)[:, :3] - f(x)[:, :3]).max()) > 1e-4


# ----------------------------------------------------------------------- RoPE


def _rope_logit(name, q, k, pos_q, pos_k, head_dim=8):
  def rot(x, pos):
    angles = posenc.rope_angles(name, head_dim, 100.0, index=pos[0], rows=pos[0], cols=pos[1])
    cos, sin = posenc.rope_cos_sin(jnp.asarray(angles)[None, None])
    return posenc.apply_rope(x[None, None, None], cos, sin)[0, 0, 0]
  return jnp.dot(rot(q, pos_q), rot(k, pos_k))


@pytest.mark.parametrize("name", ["rope1d", "rope2d"])
def test_rope_logits_depend_only_on_relative_offset(name):
  rng = np.random.default_rng(0)
  q, k = rng.normal(size=(2, 8)).astype(np.float32)
  for _ in range(5):
    pq, pk, shift = rng.integers(-20, 20, size=(3, 2)).astype(np.float32)
    a = _rope_logit(name, q, k, pq, pk)
    b = _rope_logit(name, q, k, pq + shift, pk + shift)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_rope2d_sees_rows_and_columns_separately_unlike_1d():
  rng = np.random.default_rng(1)
  q, k = rng.normal(size=(2, 8)).astype(np.float32)
  # Same relative column offset, different row offsets -> 2D logits differ.
  a = _rope_logit("rope2d", q, k, np.array([0., 0.]), np.array([0., 3.]))
  b = _rope_logit("rope2d", q, k, np.array([2., 0.]), np.array([0., 3.]))
  assert abs(float(a - b)) > 1e-3
  # 1D RoPE only uses the first coordinate (the index): moving the column does nothing.
  c = _rope_logit("rope1d", q, k, np.array([0., 0.]), np.array([0., 3.]))
  d = _rope_logit("rope1d", q, k, np.array([0., 5.]), np.array([0., 3.]))
  np.testing.assert_allclose(c, d, rtol=1e-5)
  assert abs(float(a - c)) > 1e-3 or abs(float(b - c)) > 1e-3


def test_rope2d_channel_split_rows_then_columns():
  angles = posenc.rope_angles("rope2d", 16, 100.0, rows=jnp.array([3.0]), cols=jnp.array([0.0]))
  assert angles.shape == (1, 8)
  assert float(jnp.abs(angles[0, 4:]).max()) == 0.0        # column half does not turn
  np.testing.assert_allclose(angles[0, 0], 3.0)            # timescale 1 first
  inv = posenc.rope_inv_timescales(4, 100.0)
  assert inv[0] == 1.0 and np.all(np.diff(inv) < 0) and inv[-1] > 1 / 100.0


def test_position_interpolation_maps_larger_grid_onto_training_range():
  sy, sx = posenc.interpolation_scale((24, 24), (14, 14))
  rows = np.arange(24) * sy
  # Cell extents map onto cell extents: 24 cells cover [0, 14) like the 14
  # training cells did.
  assert 13 < rows.max() < 14 and rows.min() == 0
  # A model built at 2x the reference resolution scales its positions by 1/2.
  cfg = tiny_config(**{"model.reference_image_size": 16, "model.image_size": 32})
  model = darl_lib.darl_from_config(cfg)
  assert model.backbone.reference_grid == (4, 4)


def test_1d_index_and_sos_are_interpolated_like_the_grid():
  """At 2x the reference resolution (an 8x8 grid on a 4x4 reference) the 1D
  index 1..64 maps onto 0.25..16, the reference's range (interpolated, not
  extrapolated to 64), and the SOS slot stays one scaled step left of the
  first patch in both encodings; at the reference grid nothing moves."""
  backbone = vit.vit_from_config(tiny_config(**{"model.posenc": "rope1d"}).model)[0]
  assert backbone.reference_grid == (4, 4)
  grid_rows, grid_cols = np.divmod(np.arange(64), 8)
  rows, cols, index = backbone.scaled_positions(grid_rows[None], grid_cols[None],
                                                np.arange(1, 65)[None], (8, 8))
  np.testing.assert_allclose(np.asarray(index)[0], np.arange(1, 65) / 4)
  assert float(np.asarray(index).max()) == 16.0
  np.testing.assert_allclose(np.asarray(cols)[0, :8], np.arange(8) / 2)
  sos_row, sos_col, sos_index = posenc.sos_position((8, 8), (4, 4))
  assert (sos_row, sos_col, sos_index) == (0.0, -0.5, 0.0)
  assert float(np.asarray(cols)[0, 0]) - sos_col == 0.5      # one scaled column step
  assert float(np.asarray(index)[0, 0]) - sos_index == 0.25  # one scaled index step
  assert posenc.sos_position((4, 4), (4, 4)) == (posenc.SOS_ROW, posenc.SOS_COL, 0.0)
  assert posenc.index_scale((4, 4), (4, 4)) == 1.0


@pytest.mark.parametrize("name", ["rope2d", "sincos2d", "learned", "rope1d", "none"])
def test_higher_resolution_runs_from_the_same_parameters(name):
  small = heads.Classifier(vit.vit_from_config(tiny_config(**{"model.posenc": name}).model)[0],
                           4, 3)
  x16, x32 = images(size=16), images(size=32)
  params = small.init(jax.random.PRNGKey(0), x16)["params"]
  cfg = tiny_config(**{"model.posenc": name, "model.image_size": 32,
                       "model.reference_image_size": 16})
  big = heads.Classifier(vit.vit_from_config(cfg.model)[0], 4, 3)
  logits, out = jax.jit(big.apply)({"params": params}, x32)
  assert out["features"].shape == (2, 65, 64)
  assert np.isfinite(np.asarray(logits)).all()


# -------------------------------------------------------------- sizes and options


@pytest.mark.parametrize("variant,expected", [("B/16", 86e6), ("L/16", 304e6), ("H/14", 632e6)])
def test_backbone_parameter_counts_match_standard_vits(variant, expected):
  cfg = tiny_config(**{"model.variant": variant, "model.image_size": 224,
                       "model.channels": 3})
  backbone, p = vit.vit_from_config(cfg.model)
  n = (224 // p) ** 2
  shapes = jax.eval_shape(
      lambda: backbone.init(jax.random.PRNGKey(0), jnp.zeros((1, n, p * p * 3)),
                            np.zeros((1, n)), np.zeros((1, n)), np.zeros((1, n)),
                            (224 // p, 224 // p)))
  count = sum(np.prod(s.shape) for s in jax.tree_util.tree_leaves(shapes))
  assert abs(count - expected) / expected < 0.01, count


# Every option appears at least once; options are combined so that each case
# (one compile) covers several.
OPTION_CASES = [
    {"model.posenc": "none", "model.drop_path": 0.1, "loss.norm_pix": True},
    {"model.posenc": "sincos2d", "model.causal": False, "model.ordering": "nested_raster"},
    {"model.posenc": "learned", "model.dtype": "bfloat16", "model.ordering": "round_robin"},
    {"model.posenc": "rope1d", "model.scan_layers": True, "model.remat": "full",
     "model.drop_path": 0.2},
    {"model.remat": "save_dots", "model.scan_layers": True,
     "decoder.kind": "mlp", "decoder.depth": 2},
    {"model.remat": "full", "decoder.kind": "mlp", "decoder.depth": 0},
    {"loss.kind": "diffusion", "decoder.kind": "linear"},
    {"loss.kind": "diffusion", "decoder.kind": "mlp", "decoder.depth": 2,
     "decoder.gamma_conditioning": True},
    {"loss.kind": "diffusion", "decoder.kind": "transformer", "decoder.depth": 0},
    {"loss.kind": "diffusion", "decoder.kind": "transformer", "decoder.depth": 2,
     "decoder.gamma_conditioning": True, "loss.predict": "eps", "loss.noise_samples": 3,
     "loss.noise_a": 0.03, "model.dtype": "bfloat16", "model.scan_layers": True},
]


@pytest.mark.parametrize("over", OPTION_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_every_option_runs_forward_and_backward(over):
  model = darl_lib.darl_from_config(tiny_config(**over))
  x = images()
  params = init(model, x)

  def loss_fn(p):
    loss, metrics = model.apply({"params": p}, x, jax.random.PRNGKey(5), train=True,
                                rngs={"noise": jax.random.PRNGKey(3),
                                      "dropout": jax.random.PRNGKey(4)},
                                method=objectives.loss)
    return loss, metrics

  (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
  assert np.isfinite(float(loss))
  gnorm = optax.global_norm(grads)
  assert np.isfinite(float(gnorm)) and float(gnorm) > 0
  assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
  if over.get("loss.kind") == "diffusion":
    assert "loss_gamma_bin_00" in metrics


def test_backbone_returns_every_block_by_name():
  model = darl_lib.darl_from_config(tiny_config())
  x = images()
  params = init(model, x)
  _, out = model.apply({"params": params}, x, train=False, method=darl_lib.DARL.encode)
  assert [k for k in out if k.startswith("block_")] == ["block_00", "block_01"]
  assert out["features"].shape == (2, 16, 64)


@pytest.mark.parametrize("readout,sos", [("last", True), ("mean", True), ("last", False)])
def test_classifier_readouts(readout, sos):
  backbone, p = vit.vit_from_config(tiny_config().model, causal=False)
  clf = heads.Classifier(backbone, p, 10, readout=readout, sos=sos)
  x = images()
  params = clf.init(jax.random.PRNGKey(0), x)["params"]
  logits, out = clf.apply({"params": params}, x)
  assert logits.shape == (2, 10)
  assert out["features"].shape[1] == 16 + int(sos)


def test_bad_config_errors_name_the_fix():
  with pytest.raises(ValueError, match="unknown model variant 'X/16'.*L/16"):
    darl_lib.darl_from_config(tiny_config(**{"model.variant": "X/16"}))
  with pytest.raises(ValueError, match="not divisible by patch size 4"):
    darl_lib.darl_from_config(tiny_config(**{"model.image_size": 18}))
  with pytest.raises(ValueError, match="unknown positional encoding.*rope2d"):
    darl_lib.darl_from_config(tiny_config(**{"model.posenc": "rope3d"}))
  with pytest.raises(ValueError, match="unknown patch decoder.*transformer"):
    darl_lib.darl_from_config(tiny_config(**{"decoder.kind": "unet"}))
  with pytest.raises(ValueError, match="loss.kind='diffusion'"):
    darl_lib.darl_from_config(tiny_config(**{"decoder.kind": "transformer"}))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tq,tk", [(1, 1), (2, 2), (3, 3), (4, 4), (1, 4), (3, 2)])
def test_short_attention_matches_jax_attention(tq, tk, dtype):
  keys = jax.random.split(jax.random.PRNGKey(tq * 10 + tk), 4)
  q = jax.random.normal(keys[0], (5, tq, 3, 8), dtype)
  k, v = (jax.random.normal(r, (5, tk, 3, 8), dtype) for r in keys[1:3])
  mask = jax.random.bernoulli(keys[3], 0.7, (5, 1, tq, tk)).at[..., 0].set(True)
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  for causal in (False, True):
    for m in (None, mask, jnp.broadcast_to(mask, (5, 3, tq, tk))):
      want = jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=causal)
      for got in (ops._short_attention(q, k, v, causal=causal, mask=m),
                  ops.attention(q, k, v, causal=causal, mask=m)):   # the dispatcher's pick
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.float32(got), np.float32(want), atol=tol, rtol=tol)
  assert tk <= ops.SHORT_KEYS


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_two_key_attention_is_attention_over_two_keys(dtype):
  """The two-key form (sigmoid of the logits' difference) gives
  short_attention's output over the stacked keys, and its gradient."""
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  q, k0, k1, v0, v1 = (2.0 * jax.random.normal(r, (6, 1, 3, 8), dtype) for r in keys)
  cat = lambda a, b: jnp.concatenate([a, b], 1)  # noqa: E731
  want_f = lambda q, k0, k1, v0, v1: ops._short_attention(  # noqa: E731
      q, cat(k0, k1), cat(v0, v1), causal=False)
  got_f = lambda q, k0, k1, v0, v1: ops.attention(  # noqa: E731
      q, cat(k0, k1), cat(v0, v1), causal=False)   # dispatched to the two-key form
  w = jax.random.normal(jax.random.PRNGKey(1), q.shape)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  outs = []
  for f in (want_f, got_f):
    loss = lambda *a, f=f: jnp.sum(f(*a).astype(jnp.float32) * w)  # noqa: E731
    outs.append((f(q, k0, k1, v0, v1), jax.grad(loss, range(5))(q, k0, k1, v0, v1)))
  (want, g_want), (got, g_got) = outs
  assert got.dtype == want.dtype == dtype
  np.testing.assert_allclose(np.float32(got), np.float32(want), atol=tol, rtol=tol)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(np.float32(a), np.float32(b), atol=4 * tol, rtol=4 * tol)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
def test_cudnn_and_xla_attention_agree():
  q, k, v = jax.random.normal(jax.random.PRNGKey(0), (3, 2, 196, 4, 64), jnp.bfloat16)
  for causal in (True, False):
    with ops.using(attention="xla"):
      a = ops.attention(q, k, v, causal=causal)
    with ops.using(attention="cudnn"):
      b = ops.attention(q, k, v, causal=causal)
    np.testing.assert_allclose(np.float32(a), np.float32(b), atol=2e-2)


# ---------------------------------------------------------------- overfitting


@pytest.mark.parametrize("over", [
    {},
    {"loss.kind": "diffusion", "decoder.kind": "transformer",
     "decoder.gamma_conditioning": True},
    {"loss.kind": "diffusion", "decoder.kind": "mlp", "decoder.depth": 2},
], ids=["mse-linear", "diffusion-transformer", "diffusion-mlp"])
def test_tiny_darl_overfits_a_handful_of_images(over):
  model = darl_lib.darl_from_config(tiny_config(**over))
  # Smooth generated images (gradients + a disk), so the next patch is predictable.
  yy, xx = np.mgrid[0:16, 0:16] / 15.0
  imgs = np.stack([np.sin(3 * xx + i) * np.cos(2 * yy - i) for i in range(4)])[..., None]
  x = jnp.asarray(imgs, jnp.float32)
  params = init(model, x)
  opt = optax.adam(3e-3)
  state = opt.init(params)

  @jax.jit
  def step(params, state, key):
    def loss_fn(p):
      return model.apply({"params": p}, x, key, train=True, method=objectives.loss)[0]
    loss, g = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(g, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for i in range(150):
    params, state, loss = step(params, state, jax.random.PRNGKey(i))
    losses.append(float(loss))
  start, end = np.mean(losses[:5]), np.mean(losses[-10:])
  assert end < 0.3 * start, (start, end)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gelu_exact_value_and_custom_gradient(dtype):
  """The erf GELU against a float64 reference, and its hand-written backward
  (which keeps only the input) against autodiff of jax's GELU, on random
  inputs including the tails."""
  import math
  x = (jax.random.normal(jax.random.PRNGKey(0), (4096,)) * 4).astype(dtype)
  g = jax.random.normal(jax.random.PRNGKey(1), (4096,)).astype(dtype)
  x64 = np.asarray(x, np.float64)
  exact = x64 * 0.5 * np.asarray([math.erfc(-v / math.sqrt(2)) for v in x64])
  ours = np.asarray(ops.gelu(x), np.float64)
  if dtype == jnp.float32:
    # 1 + erf cancels in the far negative tail (as in PyTorch): < 1e-6 absolute.
    np.testing.assert_allclose(ours, exact, rtol=1e-5, atol=1e-6)
  else:   # within one bf16 rounding of the exact value
    np.testing.assert_allclose(ours, exact, rtol=2 ** -8, atol=1e-6)
  reference = lambda x: jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(x.dtype)
  grad = jax.vjp(ops.gelu, x)[1](g)[0]
  want = jax.vjp(reference, x)[1](g)[0]
  assert grad.dtype == dtype
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(want, np.float32),
                             rtol=tol, atol=tol)
  # And inside a larger jitted function.
  loss = lambda x: jnp.sum(ops.gelu(x).astype(jnp.float32) ** 2)
  ref_loss = lambda x: jnp.sum(reference(x).astype(jnp.float32) ** 2)
  np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(loss))(x), np.float32),
                             np.asarray(jax.grad(ref_loss)(x), np.float32), rtol=tol, atol=tol)


def _dot_rows(jaxpr, cols: int) -> list:
  """Row counts (all but the last axis) of every dot_general result with
  ``cols`` columns in ``jaxpr`` and the jaxprs nested in it."""
  rows = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.shape[-1] == cols:
      rows.append(int(np.prod(eqn.outvars[0].aval.shape[:-1])))
    for value in eqn.params.values():
      for x in value if isinstance(value, (tuple, list)) else [value]:
        inner = getattr(x, "jaxpr", x)
        if hasattr(inner, "eqns"):
          rows += _dot_rows(inner, cols)
  return rows


@pytest.mark.parametrize("context_len,norm", [(1, "xla"), (2, "xla"), (1, "triton")])
def test_readout_block_is_the_full_block_at_the_last_token(context_len, norm):
  """Block(token, context=context) (the read-out mode) is the full
  (non-causal) Block over ``[context, token]`` read at the last token: same
  parameter tree, values and gradients (inputs and parameters, under a
  random readout), with either norm; its MLP runs on the token alone."""
  b, width = 5, 32
  context = jax.random.normal(jax.random.PRNGKey(0), (b, context_len, width))
  token = jax.random.normal(jax.random.PRNGKey(1), (b, 1, width))
  block = vit.Block(num_heads=4, mlp_dim=64, causal=False)
  seq = jnp.concatenate([context, token], axis=1)
  params = block.init(jax.random.PRNGKey(2), seq)["params"]
  got_init = block.init(jax.random.PRNGKey(2), token, context=context)["params"]
  assert jax.tree.structure(got_init) == jax.tree.structure(params)
  assert jax.tree.map(jnp.shape, got_init) == jax.tree.map(jnp.shape, params)
  params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.PRNGKey(3), p.shape),
                        params)   # biases and scales away from 0 and 1
  w = jax.random.normal(jax.random.PRNGKey(4), (b, 1, width))
  want_f = lambda p, c, t: jnp.sum(
      block.apply({"params": p}, jnp.concatenate([c, t], axis=1))[:, -1:] * w)
  got_f = lambda p, c, t: jnp.sum(block.apply({"params": p}, t, context=c) * w)
  with ops.using(norm=norm):
    assert block.apply({"params": params}, token, context=context).shape == (b, 1, width)
    (want, g_want), (got, g_got) = (
        jax.jit(jax.value_and_grad(f, (0, 1, 2)))(params, context, token)
        for f in (want_f, got_f))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b_ in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
      np.testing.assert_allclose(a, b_, rtol=1e-4, atol=1e-5)
    # the MLP's first layer (64 wide) sees one token of each example
    jaxpr = jax.make_jaxpr(lambda p: block.apply({"params": p}, token, context=context))(
        params).jaxpr
    assert _dot_rows(jaxpr, 64) == [b]


def test_transformer_decoder_last_block_reads_one_token():
  """The denoising decoder's last block computes its read-out token only:
  its MLP's first layer runs on M rows, the earlier blocks' on 2M."""
  from darl_jax.models import decoders
  z = jax.random.normal(jax.random.PRNGKey(0), (7, 32))
  noisy = jax.random.normal(jax.random.PRNGKey(1), (7, 12))
  dec = decoders.PatchDecoder("transformer", 12, depth=2, width=16, num_heads=2, mlp_ratio=3)
  params = dec.init(jax.random.PRNGKey(2), z, noisy)["params"]
  jaxpr = jax.make_jaxpr(lambda p: dec.apply({"params": p}, z, noisy))(params).jaxpr
  assert sorted(_dot_rows(jaxpr, 48)) == [7, 14]
  one = decoders.PatchDecoder("transformer", 12, depth=1, width=16, num_heads=2, mlp_ratio=3)
  params = one.init(jax.random.PRNGKey(2), z, noisy)["params"]
  jaxpr = jax.make_jaxpr(lambda p: one.apply({"params": p}, z, noisy))(params).jaxpr
  assert _dot_rows(jaxpr, 48) == [7]
