"""KV-cached autoregressive sampling (darl_jax/sampling.py, the sampling job
train/jobs/sample.py) and the denoising chain (diffusion.reverse_diffusion) on tiny models."""

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from PIL import Image

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import diffusion
from darl_jax import metrics as metrics_lib
from darl_jax import patches as patches_lib
from darl_jax import sampling
from darl_jax.models import darl as darl_lib
from darl_jax.models import vit
from darl_jax.train.jobs import sample as sample_lib
from darl_jax.train import backbone as backbone_lib

from test_models import images, tiny_config

DIFFUSION = {"loss.kind": "diffusion", "decoder.kind": "transformer",
             "decoder.gamma_conditioning": True}


def random_params(module, *args, seed=0, **kwargs):
  """Random parameters of the shapes ``module.init(*args)`` would create,
  without compiling an init (seconds per test on 2 CPU cores): kernels
  ~ N(0, 1 / fan_in), LayerNorm scales ~ 1 + N(0, 0.1), the rest ~ N(0, 0.1).
  The tests compare paths on the same parameters; trained values are not needed."""
  rngs = {"params": jax.random.PRNGKey(0), "noise": jax.random.PRNGKey(1)}
  shapes = jax.eval_shape(lambda: module.init(rngs, *args, **kwargs))["params"]
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    value = rng.normal(0.0, 0.1, leaf.shape)
    if name.endswith("['kernel']"):   # [in, out], [D, 3, H, hd] (qkv), [H, hd, D] (out)
      fan_in = leaf.shape[0] if leaf.ndim == 4 else np.prod(leaf.shape[:-1])
      value = rng.normal(0.0, 1.0 / np.sqrt(fan_in), leaf.shape)
    elif name.endswith("['scale']"):
      value = 1.0 + value
    return jnp.asarray(value, jnp.float32)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def init(model, x):
  """DARL parameters (backbone and decoder)."""
  return random_params(model, x, train=False)


def tiny(**over):
  """A mu/4 DARL model on 16x16x1 images (4x4 patches) and its parameters."""
  model = darl_lib.darl_from_config(tiny_config(**over))
  return model, init(model, images())


# ---------------------------------------------------- cached = full forward


@pytest.mark.parametrize("posenc", ["none", "sincos2d", "learned", "rope1d", "rope2d"])
def test_cached_decoding_equals_the_full_forward_pass(posenc):
  """Prefill SOS + 5 patches, then one patch at a time: the outputs equal the
  training forward pass over the same tokens at every position. Tokens are in
  round-robin order, so the positions are those of a non-raster ordering.
  Tolerance 1e-5 (float32; only the summation order of the masked attention
  differs)."""
  model = vit.ViT(64, 2, 2, 128, posenc=posenc, reference_grid=(4, 4),
                  rope_max_wavelength=100.0)
  order = patches_lib.make_ordering("round_robin", 4, 4, block=2)
  rows, cols = jnp.asarray(order.rows)[None], jnp.asarray(order.cols)[None]
  index = jnp.arange(1, 17)[None]
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 16))
  cached = vit.with_cache(model, cache_len=16)

  args = lambda x: (x[:, :15], rows[:, :15], cols[:, :15], index[:, :15], (4, 4))
  params = random_params(model, *args(x))

  @jax.jit
  def both(params, x):
    full = model.apply({"params": params}, *args(x))["features"]    # [2, 16, 64]
    out, variables = cached.apply(
        {"params": params}, x[:, :5], rows[:, :5], cols[:, :5], index[:, :5], (4, 4),
        prepend_sos=True, mutable=["cache"])

    def step(variables, k):
      out, variables = cached.apply(
          {"params": params, **variables}, jax.lax.dynamic_slice_in_dim(x, k, 1, 1),
          rows[:, k, None], cols[:, k, None], index[:, k, None], (4, 4), prepend_sos=False,
          mutable=["cache"])
      return variables, out["features"][:, 0]

    variables, feats = jax.lax.scan(step, variables, jnp.arange(5, 15))
    steps = jnp.concatenate([out["features"], jnp.swapaxes(feats, 0, 1)], 1)
    return full, steps, variables["cache"]["block_01"]["attn"]["cache_index"]

  full, steps, cache_index = both(params, x)
  np.testing.assert_allclose(steps, full, atol=1e-5, rtol=1e-5)
  assert int(cache_index) == 16


def test_cached_backbone_has_the_training_parameter_tree():
  model = darl_lib.darl_from_config(tiny_config(**{"model.scan_layers": True}))
  params = init(model, jnp.zeros((1, 16, 16, 1)))
  cached = vit.with_cache(model.backbone, cache_len=17)
  cached_shapes = jax.eval_shape(lambda: cached.init(
      jax.random.PRNGKey(0), jnp.zeros((1, 16, 16)), np.zeros((1, 16)), np.zeros((1, 16)),
      np.zeros((1, 16)), (4, 4), prepend_sos=True))["params"]
  unscanned = vit.unscan_params(params["backbone"], model.backbone.depth)
  assert jax.tree_util.tree_structure(cached_shapes) == \
      jax.tree_util.tree_structure(unscanned)
  np.testing.assert_array_equal(unscanned["block_01"]["mlp"]["fc1"]["kernel"],
                                params["backbone"]["blocks"]["block"]["mlp"]["fc1"]["kernel"][1])


def test_first_sampled_patch_is_the_teacher_forced_prediction():
  """MSE model, round-robin order: with the first 6 patches given, patch 6 of
  the completion equals sampling.predict_patches (the training forward pass), so the
  sampler's tokens, positions and prefill follow the ordering; MSE
  completions are deterministic (all samples equal, any key)."""
  model, params = tiny(**{"model.ordering": "round_robin"})
  x = images()
  sampler = sampling.Sampler(model, (16, 16, 1), num_samples=2)
  known = sampling.known_mask("prefix", sampler.grid_hw, sampler.ordering, prefix_len=6)
  a = np.asarray(sampler(params, x, known, jax.random.PRNGKey(0)))
  b = np.asarray(sampler(params, x, known, jax.random.PRNGKey(1)))
  np.testing.assert_array_equal(a[:, 0], a[:, 1])
  np.testing.assert_array_equal(a, b)
  teacher = jax.jit(lambda p, x: sampling.predict_patches(model, p, x, jax.random.PRNGKey(0))
                    )(params, x)
  j = sampler.ordering.perm[6]
  got = patches_lib.patchify(a[:, 0], 4)[:, j]
  want = np.clip(patches_lib.patchify(teacher, 4)[:, j], -1, 1)
  np.testing.assert_allclose(got, want, atol=1e-5)
  np.testing.assert_array_equal(patches_lib.patchify(a[:, 0], 4)[:, known],
                                patches_lib.patchify(x, 4)[:, known])


# ------------------------------------------------ prefix, masks, causality


@pytest.fixture(scope="module")
def diffusion_sampler():
  """One diffusion sampler (T = 3, 2 samples) shared by the tests below, so
  that calls with the same prefill length share one compiled program."""
  model, params = tiny(**DIFFUSION)
  return params, sampling.Sampler(model, (16, 16, 1), num_steps=3, num_samples=2)


def test_given_patches_are_kept_and_each_patch_depends_only_on_earlier_ones(
    diffusion_sampler):
  params, sampler = diffusion_sampler
  x = np.asarray(images())
  key = jax.random.PRNGKey(5)
  top = sampling.known_mask("top_half", sampler.grid_hw, sampler.ordering)
  out = np.asarray(sampler(params, x, top, key))                     # [2, 2, 16, 16, 1]
  assert out.shape == (2, 2, 16, 16, 1)
  np.testing.assert_array_equal(out[:, :, :8], np.broadcast_to(x[:, None, :8],
                                                               out[:, :, :8].shape))
  assert np.abs(out[:, 0, 8:] - out[:, 1, 8:]).max() > 1e-3          # two different samples
  # Given the first sample's patches 0..9, its patches 10.. come out the same
  # (same key): patch k is a function of patches < k and its own noise. Here
  # prefill_len=0 (SOS alone) feeds patches 0..9 one by one through the scan.
  longer = sampling.known_mask("prefix", sampler.grid_hw, sampler.ordering, prefix_len=10)
  first = out[:, 0]
  again = np.asarray(sampler(params, first, longer, key, prefill_len=0))[:, 0]
  np.testing.assert_allclose(again, first, atol=1e-4)
  # Changing a given patch (raster 9) changes the patches after it only.
  bumped = first.copy()
  bumped[:, 8:12, 4:8] += 0.5
  moved = np.asarray(sampler(params, bumped, longer, key, prefill_len=0))[:, 0]
  np.testing.assert_array_equal(moved[:, :12, :8], bumped[:, :12, :8])
  assert np.abs(moved[:, 8:12, 8:] - again[:, 8:12, 8:]).max() > 1e-3


def test_a_mask_that_is_not_a_prefix_keeps_its_given_patches(diffusion_sampler):
  """Left half under raster order: given patches come after generated ones;
  they are kept and fed, so only later generated patches depend on them."""
  params, sampler = diffusion_sampler
  x = np.asarray(images())
  left = sampling.known_mask("left_half", sampler.grid_hw, sampler.ordering)
  key = jax.random.PRNGKey(0)
  out = np.asarray(sampler(params, x, left, key, prefill_len=0))[:, 0]
  np.testing.assert_array_equal(out[:, :, :8], x[:, :, :8])
  y = x.copy()
  y[:, 8:12, :4] += 0.5                                              # raster patch 8, given
  out2 = np.asarray(sampler(params, y, left, key, prefill_len=0))[:, 0]
  np.testing.assert_allclose(out2[:, :8, 8:], out[:, :8, 8:], atol=1e-5)   # rows 0-1: before
  assert np.abs(out2[:, 8:, 8:] - out[:, 8:, 8:]).max() > 1e-3             # rows 2-3: after


def test_known_masks():
  order = patches_lib.make_ordering("round_robin", 4, 4, block=2)
  top = sampling.known_mask("top_half", (4, 4), order)
  assert top.sum() == 8 and top[:8].all()
  assert sampling.known_mask("left_half", (4, 4), order).reshape(4, 4)[:, :2].all()
  pre = sampling.known_mask("prefix", (4, 4), order, prefix_len=3)
  assert set(np.flatnonzero(pre)) == set(order.perm[:3])
  assert not sampling.known_mask("none", (4, 4), order).any()
  assert sampling.leading_known(top[order.perm][None]) == 2         # block 0's top row
  assert sampling.leading_known(np.ones((2, 16), bool)) == 16
  with pytest.raises(ValueError, match="valid: top_half"):
    sampling.known_mask("bottom", (4, 4), order)


# -------------------------------------------------- the reverse diffusion


def _mixture_denoiser(points, weights):
  """Exact E[x0 | x_s] for x0 drawn from ``points [K, P]`` with ``weights [K]``."""
  points, logw = jnp.asarray(points), jnp.log(jnp.asarray(weights))

  def denoise(x, g):
    # log N(x; sqrt(g) mu_k, (1 - g) I) up to a constant shared by all k.
    d2 = jnp.sum((x[:, None] - jnp.sqrt(g) * points) ** 2, -1)
    post = jax.nn.softmax(logw - d2 / (2 * (1 - g)), axis=-1)
    return post @ points

  return denoise


@pytest.mark.parametrize("a,b,steps", [(1.0, 1.0, 200), (0.03, 1.0, 2000)])
def test_sampler_reproduces_a_two_point_mixture_with_the_exact_denoiser(a, b, steps):
  """Every sample lands on one of the two points, in the right proportions.

  Beta(0.03, 1) needs more steps: its grid puts most levels at gamma ~ 0
  (at T = 200 only 49 are above 1e-4), and coarse steps near the end bias the
  proportions (0.21 instead of 0.3 at T = 200; 0.30 at T = 2000)."""
  points = np.array([[0.8, -0.4, 0.2], [-0.6, 0.5, -0.3]], np.float32)
  weights = np.array([0.3, 0.7])
  grid = diffusion.sampling_gamma_grid(steps, a, b)
  x = np.asarray(jax.jit(lambda k: diffusion.reverse_diffusion(
      _mixture_denoiser(points, weights), k, (4000, 3), grid))(jax.random.PRNGKey(0)))
  dist = np.linalg.norm(x[:, None] - points, axis=-1)               # [n, 2]
  assert dist.min(1).max() < 1e-2                                   # every sample on a mode
  frac = np.mean(dist.argmin(1) == 0)
  assert abs(frac - 0.3) < 0.02, frac                               # modes in proportion


def test_sampler_reproduces_gaussian_moments_and_temperature_narrows_them():
  mean, std = 0.3, 0.5

  def denoise(x, g):   # E[x0 | x_s] for x0 ~ N(mean, std^2), per dimension
    return mean + jnp.sqrt(g) * std**2 * (x - jnp.sqrt(g) * mean) / (g * std**2 + 1 - g)

  grid = diffusion.sampling_gamma_grid(200, 1.0, 1.0)
  sample = jax.jit(lambda k, t: diffusion.reverse_diffusion(denoise, k, (4000, 8), grid,
                                                           temperature=t))
  run = lambda t: np.asarray(sample(jax.random.PRNGKey(1), t))
  x = run(1.0)
  assert abs(x.mean() - mean) < 0.01 and abs(x.std() - std) < 0.02, (x.mean(), x.std())
  assert run(0.0).std() < 0.8 * std


# ------------------------------------------------------------- the options


def test_sampler_rejects_models_it_cannot_sample():
  build = lambda **over: darl_lib.darl_from_config(tiny_config(**over))
  with pytest.raises(ValueError, match="norm_pix"):
    sampling.Sampler(build(**{"loss.norm_pix": True}), (16, 16, 1))
  with pytest.raises(ValueError, match="causal"):
    sampling.Sampler(build(**{"model.causal": False}), (16, 16, 1))
  with pytest.raises(ValueError, match="two-stream"):
    sampling.Sampler(build(**{"model.two_stream": True}), (16, 16, 1))
  with pytest.raises(ValueError, match="prefill_len 9 must be in"):
    sampler = sampling.Sampler(build(), (16, 16, 1))
    sampler(None, images(), sampling.known_mask("top_half", (4, 4), sampler.ordering),
            jax.random.PRNGKey(0), prefill_len=9)


# ------------------------------------------------------------ the sampling job


def _fake_pretraining_run(workdir, over):
  """config.json + a checkpoint of freshly initialised parameters, as a
  pretraining run on 8x8 digits would leave them."""
  c = tiny_config(**over)
  c.model.update(image_size=8, variant="mu/2")
  c.data = ml_collections.ConfigDict({"name": "digits", "image_size": 8, "channels": 1,
                                      "augment": "none", "val_split_size": 0})
  model = darl_lib.darl_from_config(c)
  params = init(model, jnp.zeros((1, 8, 8, 1)))
  (workdir / "config.json").write_text(json.dumps(c.to_dict()))
  with checkpoint_lib.Checkpointer(str(workdir / "checkpoints")) as ckpt:
    ckpt.save(1, {"params": params}, {"step": 1})
  return c


def test_sample_job_writes_grid_samples_and_metrics(tmp_path, monkeypatch):
  # TensorBoard is not what this checks, and its backend imports TensorFlow.
  monkeypatch.setattr(metrics_lib, "_make_tensorboard_backend", lambda logdir: None)
  pre = tmp_path / "pre"
  pre.mkdir()
  _fake_pretraining_run(pre, {**DIFFUSION, "loss.predict": "eps"})
  from darl_jax import main
  c = sample_lib.sample_config()
  c.init_from = str(pre)
  c.batch_size = 4
  c.sample.update(num_images=5, num_samples=3, num_steps=2, temperature=0.5, clip=False,
                  grid_images=3, classifier_steps=20, classifier_batch_size=64)
  returned = main.get_job("sample")(c, str(tmp_path / "out"))
  out = tmp_path / "out"
  metrics = json.loads((out / "sample_metrics.json").read_text())
  assert metrics == returned
  assert json.loads((out / "config.json").read_text())["trainer"] == "sample"
  assert [r["step"] for r in metrics_lib.read_metrics(str(out))] == [0]
  assert not (out / "run.lock").exists()
  assert metrics["given_max_abs_error"] == 0.0 and metrics["diversity_rms"] > 0
  assert 0 <= metrics["classifier_acc_completion"] <= 1
  grid = np.asarray(Image.open(out / "samples.png"))
  assert grid.shape == (3 * 34 + 2, 4 * 34 + 2, 3)
  # The red edge of the given top half (rows 0..3 of 8, at scale 4: pixels 0..15).
  cell = grid[2:34, 36:68]
  assert (cell[14:16, :, 0] == 255).all() and (cell[14:16, :, 1] == 0).all()
  saved = np.load(out / "samples.npz")
  assert saved["samples"].shape == (5, 3, 8, 8, 1) and np.isfinite(saved["samples"]).all()
  assert not (out / "checkpoints").exists()


def test_sample_job_errors_name_the_fix(tmp_path):
  c = sample_lib.sample_config()
  with pytest.raises(ValueError, match="init_from"):
    sample_lib.run(c, str(tmp_path / "out"))
  c.init_from = str(tmp_path)
  with pytest.raises(FileNotFoundError, match="no DARL checkpoint found.*--config.init_from"):
    sample_lib.run(c, str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()             # nothing written before the checks
  c.sample.condition = "bottom_half"
  with pytest.raises(ValueError, match="valid: top_half"):
    sample_lib.resolve(c)
  pre = _fake_pretraining_run(tmp_path, {})
  pre.decoder.kind = "mlp"                       # config.json now disagrees with the weights
  (tmp_path / "config.json").write_text(json.dumps(pre.to_dict()))
  model = darl_lib.darl_from_config(pre)
  params, _ = checkpoint_lib.restore_params(str(tmp_path))
  with pytest.raises(ValueError, match="decoder"):
    backbone_lib.check_params(model, (8, 8, 1), params)
