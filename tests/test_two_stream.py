"""The XLNet-style two-stream model (random-order pretraining)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from darl_jax import objectives, ops
from darl_jax import patches as patches_lib
from darl_jax.models import darl as darl_lib
from darl_jax.models import two_stream
from test_models import images, init, tiny_config


def two_stream_config(**over):
  return tiny_config(**{"model.two_stream": True, "model.ordering": "random", **over})


@pytest.mark.parametrize("objective", ["mse", "diffusion"])
def test_query_stream_never_sees_the_patch_it_predicts_or_later(objective):
  over = {}
  if objective == "diffusion":
    over = {"loss.kind": "diffusion", "decoder.kind": "transformer"}
  model = darl_lib.darl_from_config(two_stream_config(**over))
  assert isinstance(model.backbone, two_stream.TwoStreamViT)
  x = images()
  params = init(model, x)
  perm = patches_lib.random_permutations(jax.random.PRNGKey(5), 2, 16)

  @jax.jit
  def queries(imgs):
    _, out = model.apply({"params": params}, imgs, train=False, perm=perm,
                         method=darl_lib.DARL.encode)
    return out["features"]

  base = queries(x)
  for t in (0, 6, 15):
    raster = np.asarray(perm[:, t])                       # per example
    patches = patches_lib.patchify(x, 4)
    bumped = patches.at[jnp.arange(2), raster].add(0.7)
    new = queries(patches_lib.unpatchify(bumped, 4, (4, 4), 1))
    # Queries 0..t predict patches 0..t of the order: none may see patch t.
    np.testing.assert_allclose(new[:, : t + 1], base[:, : t + 1], atol=1e-5)
    if t < 15:
      assert float(jnp.abs(new[:, t + 1:] - base[:, t + 1:]).max()) > 1e-4


def test_content_stream_is_the_plain_causal_backbone():
  model = darl_lib.darl_from_config(two_stream_config(**{"model.ordering": "raster"}))
  x = images()
  params = init(model, x)
  plain_params = jax.tree_util.tree_map(lambda a: a, params)
  backbone = dict(plain_params["backbone"])
  backbone.pop("query_token")
  for name in [k for k in backbone if k.startswith("block_")]:
    block = dict(backbone[name])
    attn = dict(block["attn"])
    attn.pop("query_proj")
    block["attn"] = attn
    backbone[name] = block
  plain_params["backbone"] = backbone
  plain = darl_lib.darl_from_config(tiny_config())
  _, a = model.apply({"params": params}, x, train=False, method=darl_lib.DARL.encode)
  _, b = plain.apply({"params": plain_params}, x, train=False, method=darl_lib.DARL.encode)
  np.testing.assert_allclose(a["content"], b["features"], atol=1e-5)
  for k in ("block_00", "block_01"):
    np.testing.assert_allclose(a[k], b[k], atol=1e-5)


def test_random_order_draws_a_new_permutation_per_example_and_step():
  model = darl_lib.darl_from_config(two_stream_config())
  x = jnp.repeat(images(1), 2, axis=0)                    # two identical images
  params = init(model, x)
  run = lambda key: model.apply({"params": params}, x, key, train=True, rngs={"noise": key},
                                method=objectives.loss)[1]["per_example_loss"]
  l1, l2 = run(jax.random.PRNGKey(0)), run(jax.random.PRNGKey(1))
  assert float(jnp.abs(l1[0] - l1[1])) > 1e-6             # orders differ per example
  assert float(jnp.abs(l1 - l2).max()) > 1e-6             # and per step


def test_permutation_bookkeeping_positions_follow_patches():
  perm = patches_lib.random_permutations(jax.random.PRNGKey(2), 3, 12)
  rows, cols = patches_lib.positions_of(perm, 4)
  np.testing.assert_array_equal(rows * 4 + cols, perm)
  tokens = jnp.arange(3 * 12 * 2, dtype=jnp.float32).reshape(3, 12, 2)
  back = patches_lib.unorder_tokens(patches_lib.order_tokens(tokens, perm), perm)
  np.testing.assert_array_equal(back, tokens)


def _train(model, x, steps=120):
  params = init(model, x)
  opt = optax.adam(3e-3)
  state = opt.init(params)

  @jax.jit
  def step(params, state, key):
    loss, g = jax.value_and_grad(lambda p: model.apply(
        {"params": p}, x, key, train=True, rngs={"noise": key},
        method=objectives.loss)[0])(params)
    updates, state = opt.update(g, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for i in range(steps):
    params, state, loss = step(params, state, jax.random.PRNGKey(i))
    losses.append(float(loss))
  return np.mean(losses[:5]), np.mean(losses[-10:])


def test_raster_two_stream_trains_like_the_plain_model():
  yy, xx = np.mgrid[0:16, 0:16] / 15.0
  x = jnp.asarray(np.stack([np.sin(3 * xx + i) * np.cos(2 * yy - i)
                            for i in range(4)])[..., None], jnp.float32)
  start_p, end_p = _train(darl_lib.darl_from_config(tiny_config()), x)
  start_t, end_t = _train(darl_lib.darl_from_config(
      two_stream_config(**{"model.ordering": "raster"})), x)
  assert end_t < 0.3 * start_t
  assert end_t < 2.0 * end_p, (end_t, end_p)


def test_two_stream_model_under_the_norm_kernels_is_the_same_function():
  """kernels.norm='triton' in the two-stream model (both streams' norms,
  the shared final norm; the stack runs as plain blocks, the two-stream
  backbone having no fused stack): the same query and content features, and
  parameter gradients, as XLA's norms. float32, Pallas's interpreter."""
  model = darl_lib.darl_from_config(two_stream_config(**{"model.ordering": "raster"}))
  x = images()
  params = init(model, x)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(3), len(leaves))
  params = jax.tree.unflatten(tree, [p + 0.1 * jax.random.normal(k, p.shape)
                                     for p, k in zip(leaves, keys)])

  def run(norm):
    def f(p):
      _, out = model.apply({"params": p}, x, train=False, method=darl_lib.DARL.encode)
      return jnp.sum(out["features"] * jnp.sin(out["features"])) + jnp.sum(
          out["content"] * jnp.cos(out["content"])), out
    with ops.using(norm=norm):
      return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

  (_, want), g_want = run("xla")
  (_, got), g_got = run("triton")
  with ops.using(norm="triton"):   # the norms ran as the kernels
    assert "layer_norm_fwd" in str(jax.make_jaxpr(lambda p: model.apply(
        {"params": p}, x, train=False, method=darl_lib.DARL.encode))(params))
  for key in ("features", "content", "block_00", "block_01"):
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=key)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_got), jax.tree.leaves(g_want)):
    err = float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-12))
    assert err < 1e-4, (jax.tree_util.keystr(path), err)
