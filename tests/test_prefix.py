"""Prefix-causal pretraining (model.prefix): a random prefix of each sequence
attends both ways and carries no loss, the rest is causal (tiny models, CPU)."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import objectives, ops
from darl_jax import patches as patches_lib
from darl_jax.models import darl as darl_lib
from darl_jax.models import vit
from test_kernels import perturbed, vit_inputs
from test_models import images, init, tiny_config
from test_sampling import random_params


def test_prefix_causal_mask():
  """Tokens 0..k (SOS and the k prefix patches) see each other; every later
  token sees itself and what came before."""
  m = np.asarray(vit.prefix_causal_mask(jnp.array([0, 2]), 5))[:, 0]
  assert m.shape == (2, 5, 5)
  np.testing.assert_array_equal(m[0], np.tril(np.ones((5, 5), bool)))   # k = 0: causal
  want = np.tril(np.ones((5, 5), bool))
  want[:3, :3] = True
  np.testing.assert_array_equal(m[1], want)


def test_outputs_after_the_prefix_never_see_later_patches():
  """Under prefix k, the output at t >= k (which predicts patch t) does not
  change when patches t, t+1, .. change; outputs inside the prefix do
  change with the last prefix patch (they attend both ways)."""
  model = vit.ViT(64, 2, 2, 128, reference_grid=(4, 4))
  args = vit_inputs(1, 4)                      # 15 patch tokens + SOS = 16
  params = perturbed(model.init(jax.random.key(0), *args)["params"])
  k = 5
  mask = vit.prefix_causal_mask(jnp.array([k]), 16)
  run = jax.jit(lambda x: model.apply({"params": params}, x, *args[1:], mask=mask)["features"])
  base = run(args[0])
  for t in (k, k + 3, 14):        # output t sees tokens <= t = SOS, x_0 .. x_{t-1}
    changed = run(args[0].at[:, t:].add(1.0))
    np.testing.assert_allclose(changed[:, :t + 1], base[:, :t + 1], rtol=1e-5, atol=1e-5)
  changed = run(args[0].at[:, k - 1].add(1.0))   # the prefix's last patch, token k
  assert np.abs(np.asarray(changed[:, :k] - base[:, :k])).max() > 1e-3


@pytest.mark.parametrize("objective", ["mse", "diffusion"])
def test_the_loss_counts_only_patches_after_the_prefix(objective):
  """The loss is the mean over the patches after each example's prefix: the
  model's loss equals the per-patch errors weighted by hand."""
  over = {"model.prefix": "uniform"}
  if objective == "diffusion":
    over.update({"loss.kind": "diffusion", "decoder.kind": "linear"})
  model = darl_lib.darl_from_config(tiny_config(**over))
  x = images()
  params = init(model, x)
  b, n, p = objectives.noise_shape(model, x)
  prefix = jnp.array([3, 9])
  gamma = eps = None
  if objective == "diffusion":
    gamma, eps = objectives.draw_noise(jax.random.key(1), (b, n, p), 1, 1.0, 1.0)
  loss, metrics = model.apply({"params": params}, x, train=False, gamma=gamma, eps=eps,
                              prefix=prefix, method=objectives.loss_given_noise)
  # by hand: every patch's error, then the mean over the patches t >= prefix
  out = model.apply({"params": params}, x, train=False, prefix=prefix)
  z, target = out["z"], out["target"]
  if objective == "mse":
    pred = model.apply({"params": params}, z.reshape(b * n, -1),
                       method=darl_lib.DARL.decode).reshape(target.shape)
    err = jnp.mean(jnp.square(pred - target), -1)
  else:
    x_noisy = (jnp.sqrt(gamma[..., None]) * target[:, :, None]
               + jnp.sqrt(1 - gamma[..., None]) * eps)
    pred = model.apply({"params": params}, z.reshape(b * n, -1), x_noisy.reshape(b * n, p),
                       gamma.reshape(-1), method=darl_lib.DARL.decode).reshape(target.shape)
    err = jnp.mean(jnp.square(pred - target), -1)
  keep = np.arange(n)[None] >= np.asarray(prefix)[:, None]
  np.testing.assert_allclose(loss, np.asarray(err)[keep].mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["per_example_loss"],
                             [np.asarray(err)[i][keep[i]].mean() for i in range(b)], rtol=1e-5)


def test_prefix_lengths_leave_a_patch_to_predict():
  k = objectives.draw_prefix(jax.random.key(0), 4096, 16)
  assert int(k.min()) == 1 and int(k.max()) == 15


def test_the_fused_stack_takes_the_prefix_mask():
  """kernels.norm='triton' (the fused stack, interpreted on CPU) gives the
  plain blocks' outputs under a prefix mask."""
  model = vit.ViT(64, 2, 2, 128, reference_grid=(4, 4))
  args = vit_inputs(2, 4)
  params = perturbed(model.init(jax.random.key(0), *args)["params"])
  mask = vit.prefix_causal_mask(jnp.array([3, 8]), 16)
  outs = {}
  for norm in ("xla", "triton"):
    with ops.using(norm=norm):
      outs[norm] = jax.jit(lambda p: model.apply({"params": p}, *args, mask=mask))(params)
  for key in outs["xla"]:
    np.testing.assert_allclose(outs["triton"][key], outs["xla"][key], rtol=2e-4, atol=2e-4)


def test_cached_prefill_of_a_prefix_model_is_its_prefix_forward_pass():
  """The sampler prefills a prefix-causal model's known patches as its
  prefix: the cached outputs equal the full forward pass under the prefix
  mask, for the prefill and for tokens decoded after it."""
  config = tiny_config(**{"model.prefix": "uniform"})
  model = darl_lib.darl_from_config(config)
  backbone = model.backbone
  order = patches_lib.make_ordering("raster", 4, 4)
  rows, cols = jnp.asarray(order.rows)[None], jnp.asarray(order.cols)[None]
  index = jnp.arange(1, 17)[None]
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 16))
  args = lambda x, a, b: (x[:, a:b], rows[:, a:b], cols[:, a:b], index[:, a:b], (4, 4))
  params = random_params(backbone, *args(x, 0, 15))
  m = 6
  full = backbone.apply({"params": params}, *args(x, 0, 15),
                        mask=vit.prefix_causal_mask(jnp.array([m, m]), 16))["features"]
  cached = vit.with_cache(backbone, cache_len=16)
  prefill_mask = (jnp.arange(16) <= m)[None, None, None]
  out, variables = cached.apply({"params": params}, *args(x, 0, m), prepend_sos=True,
                                mask=prefill_mask, mutable=["cache"])
  np.testing.assert_allclose(out["features"], full[:, :m + 1], rtol=1e-5, atol=1e-5)
  for k in range(m, 9):
    out, variables = cached.apply({"params": params, **variables}, *args(x, k, k + 1),
                                  prepend_sos=False, mutable=["cache"])
    np.testing.assert_allclose(out["features"][:, 0], full[:, k + 1], rtol=1e-5, atol=1e-5)


def test_prefix_needs_the_plain_causal_backbone():
  with pytest.raises(ValueError, match="model.prefix needs the plain causal backbone"):
    darl_lib.darl_from_config(tiny_config(**{"model.prefix": "uniform",
                                             "model.two_stream": True}))
  with pytest.raises(ValueError, match="unknown model.prefix 'half'; valid: off, uniform"):
    darl_lib.darl_from_config(tiny_config(**{"model.prefix": "half"}))


def test_prefix_pretraining_trains_from_the_cli(tmp_path):
  """A tiny prefix-causal run from the CLI: finite losses every step."""
  cmd = [sys.executable, "-m", "darl_jax.main", "--config=tests/tiny_config.py:steps=4",
         f"--workdir={tmp_path}", "--config.model.prefix=uniform"]
  subprocess.run(cmd, check=True, capture_output=True,
                 cwd=str(pathlib.Path(__file__).resolve().parents[1]))
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in records if "loss" in r and "step" in r]
  assert len(losses) >= 4 and all(np.isfinite(losses))
