"""Tests for darl_jax/optim.py on tiny fake Flax param trees (no model needed)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax.core import freeze

from darl_jax import optim

DEPTH = 4


def _cfg(**kw):
  """Plain lr 1, no warm-up, no decay unless asked: updates are easy to predict."""
  base = dict(name="sgd", base_lr=1.0, lr_scaling=False, schedule="constant",
              warmup_steps=0, weight_decay=0.0, momentum=0.0)
  base.update(kw)
  return ml_collections.ConfigDict(base)


def _leaf(rng, *shape):
  return jnp.asarray(rng.normal(size=shape), jnp.float32)


def _params(scanned=False):
  rng = np.random.default_rng(0)
  bb = {"patch_embed": {"kernel": _leaf(rng, 6, 4), "bias": _leaf(rng, 4)},
        "sos": _leaf(rng, 4),
        "pos_embed": {"table": _leaf(rng, 2, 2, 4)},
        "norm": {"scale": _leaf(rng, 4), "bias": _leaf(rng, 4)}}
  if scanned:
    bb["blocks"] = {"block": {"mlp": {"fc1": {"kernel": _leaf(rng, DEPTH, 4, 5),
                                              "bias": _leaf(rng, DEPTH, 5)}},
                              "norm1": {"scale": _leaf(rng, DEPTH, 4)}}}
  else:
    for i in range(DEPTH):
      bb[f"block_{i:02d}"] = {"attn": {"qkv": {"kernel": _leaf(rng, 4, 12),
                                               "bias": _leaf(rng, 12)}},
                              "norm1": {"scale": _leaf(rng, 4)}}
  return {"backbone": bb, "head": {"kernel": _leaf(rng, 4, 3), "bias": _leaf(rng, 3)}}


def _flat(tree):
  return dict(zip(jax.tree.leaves(optim.param_paths(tree)), jax.tree.leaves(tree)))


def _one_update(cfg, params, grads, **kw):
  tx, sched = optim.make_optimizer(cfg, params, total_steps=kw.pop("total_steps", 100),
                                   batch_size=kw.pop("batch_size", 256), **kw)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  return _flat(updates)


def test_param_paths_plain_and_frozen_dict():
  p = _params()
  paths = _flat(optim.param_paths(p))
  assert paths["backbone/block_03/attn/qkv/kernel"] == "backbone/block_03/attn/qkv/kernel"
  assert set(_flat(optim.param_paths(freeze(p)))) == set(paths)
  assert "backbone/blocks/block/mlp/fc1/kernel" in _flat(_params(scanned=True))


def test_schedule_values():
  s = optim.make_schedule(_cfg(schedule="cosine", warmup_steps=10), 110, None)
  for step, want in [(0, 0.0), (5, 0.5), (10, 1.0), (60, 0.5), (110, 0.0), (500, 0.0)]:
    np.testing.assert_allclose(s(step), want, atol=1e-6, err_msg=f"step {step}")
  assert s(30) > s(40) > s(50)   # monotone decay after the warm-up
  s = optim.make_schedule(_cfg(schedule="cosine", warmup_steps=10, end_lr_fraction=0.1),
                          110, None)
  np.testing.assert_allclose([s(60), s(110)], [0.55, 0.1], atol=1e-6)
  s = optim.make_schedule(_cfg(warmup_steps=4), 50, None)   # constant
  np.testing.assert_allclose([s(0), s(2), s(4), s(49)], [0, 0.5, 1, 1], atol=1e-6)


def test_warmup_epochs_steps_and_clipping():
  cfg = _cfg(warmup_steps=None, warmup_epochs=2)
  assert optim.num_warmup_steps(cfg, 100, 5) == 10
  assert optim.num_warmup_steps(_cfg(warmup_steps=3, warmup_epochs=2), 100, 5) == 3
  assert optim.num_warmup_steps(_cfg(warmup_steps=-1, warmup_epochs=2), 100, 5) == 10
  with pytest.raises(ValueError, match="steps_per_epoch"):
    optim.make_schedule(cfg, 100, None)
  # 40 warm-up epochs on a 20-step smoke run: the ramp spans the whole run.
  s = optim.make_schedule(_cfg(schedule="cosine", warmup_epochs=40, warmup_steps=None),
                          20, 100)
  np.testing.assert_allclose([s(0), s(10), s(20)], [0.0, 0.5, 1.0], atol=1e-6)


def test_lr_scaling_with_batch():
  cfg = _cfg(base_lr=1.5e-4, lr_scaling=True)
  assert optim.peak_lr(cfg, 4096) == pytest.approx(1.5e-4 * 16)
  _, s = optim.make_optimizer(cfg, _params(), total_steps=10, batch_size=1024)
  np.testing.assert_allclose(s(5), 6e-4, rtol=1e-6)
  _, s = optim.make_optimizer(_cfg(base_lr=1.5e-4), _params(), total_steps=10,
                              batch_size=1024)
  np.testing.assert_allclose(s(5), 1.5e-4, rtol=1e-6)


@pytest.mark.parametrize("scanned", [False, True])
def test_weight_decay_only_on_kernels(scanned):
  p = _params(scanned)
  cfg = _cfg(name="adamw", weight_decay=0.1)
  # Zero gradient: Adam's step is 0, so the update is the decoupled decay alone.
  up = _one_update(cfg, p, jax.tree.map(jnp.zeros_like, p))
  flat = _flat(p)
  decayed = {k for k, u in up.items() if np.any(np.asarray(u) != 0)}
  assert decayed == {k for k in flat if k.endswith("kernel")}
  for k in decayed:
    np.testing.assert_allclose(up[k], -0.1 * flat[k], rtol=1e-6)


def test_layer_decay_multipliers_per_block():
  p = _params()
  up = _one_update(_cfg(layer_decay=0.5, num_layers=DEPTH), p, jax.tree.map(jnp.ones_like, p))
  want = {"backbone/patch_embed/kernel": 0.5 ** 5, "backbone/sos": 0.5 ** 5,
          "backbone/pos_embed/table": 0.5 ** 5, "backbone/norm/scale": 1.0,
          "head/kernel": 1.0, "head/bias": 1.0}
  for i in range(DEPTH):
    want[f"backbone/block_{i:02d}/attn/qkv/kernel"] = 0.5 ** (DEPTH - i)
    want[f"backbone/block_{i:02d}/norm1/scale"] = 0.5 ** (DEPTH - i)
  for k, m in want.items():
    np.testing.assert_allclose(up[k], -m, rtol=1e-6, err_msg=k)


def test_layer_decay_reaches_the_train_step_as_inputs_not_constants():
  """Bound to the step's ``hyper`` (as the train step binds it), the
  multipliers are inputs of the program: the same program for any layer
  decay (so each block's update is one shared kernel, not one per block),
  and the bound values are the ones applied."""
  p = _params()
  grads = jax.tree.map(jnp.ones_like, p)
  texts, updates = [], []
  for decay in (0.5, 0.25):
    tx, hp = optim.make_train_optimizer(_cfg(layer_decay=decay, num_layers=DEPTH), p,
                                        total_steps=100, batch_size=256)
    assert set(hp.values(0)) == {"learning_rate", "weight_decay", "layer_multipliers"}

    def update(grads, state, params, hyper, tx=tx, hp=hp):
      with hp.bind(hyper):
        return tx.update(grads, state, params)[0]

    lowered = jax.jit(update).lower(grads, tx.init(p), p, hp.values(0))
    texts.append(lowered.as_text())
    updates.append(_flat(jax.jit(update)(grads, tx.init(p), p, hp.values(0))))
  assert texts[0] == texts[1]
  for i in range(DEPTH):
    k = f"backbone/block_{i:02d}/attn/qkv/kernel"
    np.testing.assert_allclose(updates[1][k], updates[0][k] * 0.5 ** (DEPTH - i), rtol=1e-6)


def test_layer_decay_scanned_per_layer_axis():
  p = _params(scanned=True)
  cfg = _cfg(name="adamw", layer_decay=0.5, num_layers=DEPTH, eps=0.0)
  # Adam's first step with eps 0 is sign(g): unit magnitude, then scaled per layer.
  up = _one_update(cfg, p, jax.tree.map(jnp.ones_like, p))
  for k in ("backbone/blocks/block/mlp/fc1/kernel", "backbone/blocks/block/mlp/fc1/bias"):
    for i in range(DEPTH):
      np.testing.assert_allclose(up[k][i], -(0.5 ** (DEPTH - i)), rtol=1e-6, err_msg=k)
  np.testing.assert_allclose(up["backbone/patch_embed/kernel"], -(0.5 ** 5), rtol=1e-6)
  np.testing.assert_allclose(up["head/kernel"], -1.0, rtol=1e-6)
  with pytest.raises(ValueError, match="num_layers"):
    optim.make_optimizer(_cfg(layer_decay=0.5, num_layers=3), p, total_steps=5,
                         batch_size=1)


def test_frozen_params_do_not_move():
  p = _params()
  tx, _ = optim.make_optimizer(_cfg(name="adamw", weight_decay=0.05, frozen=["^backbone/"]),
                               p, total_steps=10, batch_size=1)
  state = tx.init(p)
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  new = p
  for i in range(5):
    g = jax.tree.map(lambda x: jnp.full_like(x, 0.1 * (i + 1)), p)
    u, state = step(new, state, g)
    new = optax.apply_updates(new, u)
  old_f, new_f = _flat(p), _flat(new)
  for k in old_f:
    moved = not np.array_equal(old_f[k], new_f[k])
    assert moved == k.startswith("head/"), k
  # The trainable branch keeps no Adam moments for the frozen backbone.
  n_state = sum(x.size for x in jax.tree.leaves(state))
  assert n_state < sum(x.size for x in jax.tree.leaves(p))


def test_errors():
  p = _params()
  with pytest.raises(ValueError, match="'adamx'.*adamw, lars, sgd"):
    optim.make_optimizer(_cfg(name="adamx"), p, total_steps=5, batch_size=1)
  with pytest.raises(ValueError, match="backbon/"):
    optim.make_optimizer(_cfg(frozen=["^backbone/", "^backbon/"]), p, total_steps=5,
                         batch_size=1)
  with pytest.raises(ValueError, match="warmup_epoch"):
    optim.make_optimizer(_cfg(warmup_epoch=3), p, total_steps=5, batch_size=1)
  with pytest.raises(ValueError, match="schedule"):
    optim.make_optimizer(_cfg(schedule="linear"), p, total_steps=5, batch_size=1)


def test_grad_clip_bounds_update_over_trainable_grads_only():
  p = _params()
  big = jax.tree.map(lambda x: jnp.full_like(x, 100.0), p)
  up = _one_update(_cfg(grad_clip_norm=1.0), p, big)
  np.testing.assert_allclose(optax.tree.norm(list(up.values())), 1.0, rtol=1e-5)
  up = _one_update(_cfg(), p, big)
  assert optax.tree.norm(list(up.values())) > 100.0
  # Huge frozen-backbone grads must not shrink the head's small (norm < 1) update.
  g = {"backbone": big["backbone"], "head": jax.tree.map(lambda x: 0.1 * jnp.ones_like(x),
                                                          p["head"])}
  up = _one_update(_cfg(grad_clip_norm=1.0, frozen=["^backbone/"]), p, g)
  np.testing.assert_allclose(up["head/kernel"], -0.1, rtol=1e-6)


def test_lars_linear_probe_runs_and_learns():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(64, 4)), jnp.float32)
  y = x @ jnp.asarray([[1.0], [-2.0], [0.5], [3.0]])
  p = {"backbone": {"patch_embed": {"kernel": _leaf(rng, 4, 4)}},
       "head": {"kernel": _leaf(rng, 4, 1), "bias": jnp.zeros((1,))}}
  cfg = _cfg(name="lars", base_lr=0.1, lr_scaling=True, momentum=0.9, trust_coefficient=0.02,
             schedule="cosine", warmup_epochs=1, warmup_steps=None, frozen=["^backbone/"])
  tx, sched = optim.make_optimizer(cfg, p, total_steps=60, steps_per_epoch=5,
                                   batch_size=1024)
  loss = lambda p: jnp.mean((x @ p["backbone"]["patch_embed"]["kernel"]
                             @ p["head"]["kernel"] + p["head"]["bias"] - y) ** 2)

  @jax.jit
  def step(p, s):
    l, g = jax.value_and_grad(loss)(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, l

  s, losses, p0 = tx.init(p), [], p
  for _ in range(60):
    p, s, l = step(p, s)
    losses.append(float(l))
  assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0]
  np.testing.assert_array_equal(p["backbone"]["patch_embed"]["kernel"],
                                p0["backbone"]["patch_embed"]["kernel"])
  np.testing.assert_allclose(sched(5), 0.1 * 4, rtol=1e-6)


def test_lars_trust_ratio_skips_biases():
  p = {"head": {"kernel": jnp.full((4, 2), 2.0), "bias": jnp.ones((2,))}}
  g = jax.tree.map(jnp.ones_like, p)
  up = _one_update(_cfg(name="lars", trust_coefficient=0.5), p, g)
  # kernel: lr * tc * ||p|| / ||g|| * g = 0.5 * sqrt(32) / sqrt(8) = 1.0; bias: plain lr * g.
  np.testing.assert_allclose(up["head/kernel"], -1.0, rtol=1e-6)
  np.testing.assert_allclose(up["head/bias"], -1.0, rtol=1e-6)
  up = _one_update(_cfg(name="lars", trust_coefficient=0.25), p, g)
  np.testing.assert_allclose([up["head/kernel"][0, 0], up["head/bias"][0]], [-0.5, -1.0],
                             rtol=1e-6)


def test_project_config_defaults_work():
  """The config_lib-style dict (None / 0 meaning off or default) builds and decays right."""
  cfg = optim.default_config()
  cfg.update(no_decay=None, warmup_steps=-1, warmup_epochs=1.0, layer_decay=0.0,
             num_layers=0, grad_clip_norm=0.0)
  p = _params()
  tx, s = optim.make_optimizer(cfg, p, total_steps=20, steps_per_epoch=4, batch_size=512)
  assert float(s(4)) == pytest.approx(3e-4)
  mask = _flat(optim.decay_mask(cfg, p))
  assert not mask["backbone/pos_embed/table"] and mask["backbone/block_00/attn/qkv/kernel"]
