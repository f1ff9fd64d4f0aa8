"""Tests for darl_jax/diffusion.py and the objectives built on it (darl_jax/objectives.py).

Monte Carlo checks use fixed seeds and tolerances of 5 standard errors (stated
at each check), so they are deterministic and still catch wrong formulas,
which are off by far more than that.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from darl_jax import diffusion as D
from darl_jax import objectives

# One sample shape shared by every test: Beta sampling is slow to compile
# (D.sample_gamma is jitted with the shape static).
N_GAMMA = 200_000
GMIN, GMAX = np.float32(D.GAMMA_MIN), np.float32(D.GAMMA_MAX)

GAMMA_PAIRS = [(0.1, 0.2), (0.5, 0.51), (0.01, 0.9), (0.3, 0.99), (0.7, 1.0), (1e-4, 1e-3)]


def _bayes_posterior(x_s, x0, gs, gp):
  """Posterior of x_prev by Gaussian conditioning (float64, independent of the module).

  Prior x_prev ~ N(sqrt(gp) x0, 1 - gp); likelihood x_s | x_prev ~ N(sqrt(alpha) x_prev, 1 - alpha).
  """
  alpha = gs / gp
  prec = 1.0 / (1.0 - gp) + alpha / (1.0 - alpha)
  mean = (np.sqrt(gp) * x0 / (1.0 - gp) + np.sqrt(alpha) * x_s / (1.0 - alpha)) / prec
  return mean, 1.0 / prec


@pytest.mark.parametrize("gs,gp", [p for p in GAMMA_PAIRS if p[1] < 1.0])
def test_posterior_matches_gaussian_conditioning(gs, gp):
  rng = np.random.default_rng(0)
  x_s, x0 = rng.normal(size=(2, 4, 5, 3))
  mean, var = _bayes_posterior(x_s, x0, gs, gp)
  g = lambda v: np.full((4, 5), v, np.float32)
  np.testing.assert_allclose(D.posterior_mean_from_x0(x_s, x0, g(gs), g(gp)), mean, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(D.posterior_variance(gs, gp), var, rtol=1e-4, atol=1e-7)


def test_posterior_mean_from_eps_agrees_with_from_x0():
  # All GAMMA_PAIRS at once: gammas [pairs, 6], data [pairs, 6, 8].
  rng = np.random.default_rng(0)
  shape = (len(GAMMA_PAIRS), 6, 8)
  x_s = rng.normal(size=shape).astype(np.float32)
  x0 = rng.uniform(-1, 1, size=shape).astype(np.float32)
  gs = np.broadcast_to(np.array([p[0] for p in GAMMA_PAIRS], np.float32)[:, None], shape[:2])
  gp = np.broadcast_to(np.array([p[1] for p in GAMMA_PAIRS], np.float32)[:, None], shape[:2])
  eps = D.eps_from_x0(x_s, x0, gs)
  np.testing.assert_allclose(D.x0_from_eps(x_s, eps, gs), x0, atol=5e-3)
  a = D.posterior_mean_from_x0(x_s, x0, gs, gp)
  b = D.posterior_mean_from_eps(x_s, eps, gs, gp)
  np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  # A wrong eps (sign flipped) must not agree: the check can fail.
  assert not np.allclose(D.posterior_mean_from_eps(x_s, -eps, gs, gp), a, atol=1e-2)


def test_posterior_variance_range_and_final_step():
  gs, gp = np.meshgrid(np.linspace(0, 1, 41), np.linspace(0, 1, 41), indexing="ij")
  gs, gp = np.minimum(gs, gp), np.maximum(gs, gp)
  var = np.asarray(D.posterior_variance(gs, gp))
  assert var.dtype == np.float32 and var.shape == gs.shape
  assert np.all(var >= 0)
  assert np.all(var <= 1 - np.clip(gp, D.GAMMA_MIN, 1) + 1e-6)
  # gamma_prev = 1: no variance and the mean is x0 exactly.
  assert float(D.posterior_variance(0.3, 1.0)) == 0.0
  x0 = np.linspace(-1, 1, 7, dtype=np.float32)
  np.testing.assert_array_equal(D.posterior_mean_from_x0(np.ones(7), x0, 0.3, 1.0), x0)
  # Misuse gamma_s > gamma_prev is treated as a no-op step (documented clamp).
  x_s = np.linspace(-2, 2, 7, dtype=np.float32)
  np.testing.assert_allclose(D.posterior_mean_from_x0(x_s, x0, 0.8, 0.3), x_s, rtol=1e-6)
  assert float(D.posterior_variance(0.8, 0.3)) == 0.0


def test_corrupt_moments_monte_carlo():
  n, gammas = 50_000, np.array([0.0, 0.2, 0.75, 1.0], np.float32)
  x0 = np.broadcast_to(np.array([0.9, -0.5, 0.1], np.float32), (n, 4, 3))
  noise = np.random.default_rng(1).standard_normal((n, 4, 3), np.float32)
  xs = np.asarray(D.corrupt(x0, np.broadcast_to(gammas, (n, 4)), noise), np.float64)
  exp_mean = np.sqrt(gammas)[:, None] * x0[0]
  exp_var = np.broadcast_to((1 - gammas)[:, None], (4, 3))
  # Tolerance: 5 standard errors, se(mean) = sqrt(var / n), se(var) = var sqrt(2 / n).
  np.testing.assert_allclose(xs.mean(0), exp_mean, atol=5 * np.sqrt(1 / n))
  assert np.all(np.abs(xs.var(0) - exp_var) <= 1e-7 + 5 * np.sqrt(2 / n) * exp_var)
  # gamma with an extra axis ([B, N, k] against x0 [B, N, k, P]).
  out = D.corrupt(np.ones((2, 3, 4, 5)), np.full((2, 3, 4), 0.25), np.zeros((2, 3, 4, 5)))
  np.testing.assert_allclose(out, 0.5)
  with pytest.raises(ValueError, match="prefix of the data shape"):
    D.corrupt(np.ones((2, 3)), np.ones((2, 3, 4)), np.ones((2, 3)))


@pytest.mark.parametrize("a,b", [(1.0, 1.0), (3.0, 10.0), (0.03, 1.0)])
def test_sample_gamma_moments(a, b):
  n = N_GAMMA
  g = np.asarray(D.sample_gamma(jax.random.key(2), (n,), a, b))
  assert g.dtype == np.float32 and not np.isnan(g).any()
  assert g.min() >= GMIN and g.max() <= GMAX
  g = g.astype(np.float64)
  mean, var = a / (a + b), a * b / ((a + b) ** 2 * (a + b + 1))
  # 5 standard errors; se(var) from the sample's fourth central moment. The clip
  # moves the mean by at most 1e-5.
  m4 = np.mean((g - g.mean()) ** 4)
  assert abs(g.mean() - mean) < 5 * np.sqrt(var / n) + 1e-5
  assert abs(g.var() - var) < 5 * np.sqrt((m4 - g.var() ** 2) / n) + 1e-5


def test_ddpm_chain_with_true_x0_reproduces_forward_marginals():
  """Ancestral sampling with the true x0 must follow q(x_s | x0) at every step."""
  steps, chains = 200, 4000
  grid = D.sampling_gamma_grid(steps, 1.0, 1.0)
  x0 = np.array([0.8, -0.6, 0.0], np.float32)
  x0_b = np.broadcast_to(x0, (chains, 3))
  x_init = np.random.default_rng(3).standard_normal((chains, 3), np.float32)  # gamma ~ 0

  @jax.jit
  def run(key, x):
    def body(x, inp):
      k, gs, gp = inp
      x = D.ddpm_step(k, x, x0_b, jnp.full((chains,), gs), jnp.full((chains,), gp))
      return x, x

    keys = jax.random.split(key, steps)
    _, xs = jax.lax.scan(body, x, (keys, jnp.asarray(grid[:-1]), jnp.asarray(grid[1:])))
    return xs

  xs = np.asarray(run(jax.random.key(3), x_init))
  for i in (49, 99, steps - 2):  # xs[i] is at gamma = grid[i + 1]
    g = float(grid[i + 1])
    # 5 standard errors of mean and variance over the chains.
    np.testing.assert_allclose(xs[i].mean(0), np.sqrt(g) * x0, atol=5 * np.sqrt((1 - g) / chains))
    np.testing.assert_allclose(xs[i].var(0), 1 - g, atol=5 * (1 - g) * np.sqrt(2 / chains))
  # Last step (gamma_prev = 1): exactly the posterior mean, which is x0.
  np.testing.assert_array_equal(xs[-1], x0_b)


def test_ddpm_step_final_flag_and_temperature():
  # Same argument shapes/dtypes in every call: one compilation.
  key = jax.random.key(4)
  x_s, x0 = np.ones((2, 5), np.float32), np.zeros((2, 5), np.float32)
  gs, gp = np.full((2,), 0.5, np.float32), np.full((2,), 0.9, np.float32)
  step = lambda temperature, final: D.ddpm_step(key, x_s, x0, gs, gp, temperature, np.array(final))
  mean = D.posterior_mean_from_x0(x_s, x0, gs, gp)
  np.testing.assert_array_equal(step(1.0, [True, True]), mean)
  np.testing.assert_array_equal(step(0.0, [False, False]), mean)
  noisy = step(1.0, [False, False])
  assert not np.allclose(noisy, mean)
  # The noise has the posterior scale: z = (noisy - mean) / std is O(1).
  z = (noisy - mean) / np.sqrt(D.posterior_variance(gs, gp))[:, None]
  assert 0.1 < np.abs(z).max() < 6
  out = step(1.0, [True, False])  # per-row final flag
  np.testing.assert_array_equal(out[0], mean[0])
  np.testing.assert_array_equal(out[1], noisy[1])


@pytest.mark.parametrize("a,b,closed_form", [(0.03, 1.0, True), (1.0, 2.5, True),
                                               (0.5, 2.0, False)])
def test_sample_gamma_distribution_and_form(a, b, closed_form):
  """Draws follow the Beta CDF (Kolmogorov-Smirnov below the 1% critical
  value 1.63 / sqrt(n), the CDF clipped as the draws are), and b = 1 or
  a = 1 take the inverse CDF, not the Gamma variates' rejection loop (its
  while loop costs host round trips on GPUs)."""
  n = N_GAMMA
  g = np.sort(np.asarray(D.sample_gamma(jax.random.key(11), (n,), a, b)).astype(np.float64))
  cdf = np.where(g >= GMAX, 1.0, scipy.special.betainc(a, b, g))
  cdf = np.where(g <= GMIN, scipy.special.betainc(a, b, np.float64(GMIN)), cdf)
  # at the clips many draws share one value: compare the CDF just below and at it
  ks = max(np.max(np.arange(1, n + 1) / n - cdf),
           np.max(np.where(g <= GMIN, 0.0, cdf) - np.arange(n) / n))
  assert ks < 1.63 / np.sqrt(n)
  jaxpr = jax.make_jaxpr(lambda k: D.sample_gamma(k, (8,), a, b))(jax.random.key(0))
  assert ("random_gamma" not in _primitives(jaxpr.jaxpr)) == closed_form


def _primitives(jaxpr, out=None) -> set:
  """The primitive names of ``jaxpr`` and every jaxpr nested in it."""
  out = set() if out is None else out
  for eqn in jaxpr.eqns:
    out.add(eqn.primitive.name)
    for value in eqn.params.values():
      for x in value if isinstance(value, (tuple, list)) else [value]:
        inner = getattr(x, "jaxpr", x)
        if hasattr(inner, "eqns"):
          _primitives(inner, out)
  return out


@pytest.mark.parametrize("a,b", [(1.0, 1.0), (3.0, 10.0), (0.5, 2.0), (0.03, 1.0)])
def test_sampling_gamma_grid(a, b):
  grid = D.sampling_gamma_grid(100, a, b)
  assert grid.shape == (101,) and grid.dtype == np.float32
  assert grid[-1] == 1.0 and grid[0] == GMIN
  assert np.all(np.diff(grid) >= 0)
  if a >= 0.5:
    assert np.all(np.diff(grid) > 0)
  # gamma(s) for s ~ U[0, 1] is Beta(a, b): Kolmogorov-Smirnov distance to the
  # Beta CDF below 1.63 / sqrt(n) (the 1% critical value).
  n = 20_000
  gam = np.sort(D.gamma_from_s(np.random.default_rng(5).uniform(size=n), a, b))
  cdf = scipy.special.betainc(a, b, gam)
  ks = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
  assert ks < 1.63 / np.sqrt(n)
  # Orientation: s = 1 is noise, s = 0 clean.
  assert D.gamma_from_s(1.0, a, b) < D.gamma_from_s(0.5, a, b) < D.gamma_from_s(0.0, a, b)


@pytest.mark.parametrize("a,b", [(1.0, 1.0), (3.0, 10.0)])
def test_sampling_grid_splits_training_distribution_evenly(a, b):
  """Each of T grid intervals holds 1/T of the training gammas (5 binomial s.e.)."""
  t, n = 10, N_GAMMA
  grid = D.sampling_gamma_grid(t, a, b)
  g = np.asarray(D.sample_gamma(jax.random.key(6), (n,), a, b))
  frac = np.histogram(g, bins=grid)[0] / n
  np.testing.assert_allclose(frac, 1 / t, atol=5 * np.sqrt(0.1 * 0.9 / n))
  if a == b == 1.0:
    np.testing.assert_allclose(grid[1:], np.arange(1, t + 1) / t, atol=1e-6)


def test_gamma_bin_stats_hand_example():
  loss = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
  gamma = np.array([[0.0, 0.1, 0.55], [0.99, 1.0, 0.3]], np.float32)
  s, c = D.gamma_bin_stats(loss, gamma, 4)
  np.testing.assert_allclose(s, [3.0, 6.0, 3.0, 9.0])
  np.testing.assert_allclose(c, [2.0, 1.0, 1.0, 2.0])
  assert s.dtype == jnp.float32 and c.dtype == jnp.float32
  # Mask out the second row (e.g. a padding example).
  s, c = D.gamma_bin_stats(loss, gamma, 4, mask=np.array([[True], [False]]))
  np.testing.assert_allclose(s, [3.0, 0.0, 3.0, 0.0])
  np.testing.assert_allclose(c, [2.0, 0.0, 1.0, 0.0])
  np.testing.assert_allclose(D.bin_edges(4), [0.0, 0.25, 0.5, 0.75, 1.0])
  with pytest.raises(ValueError, match="must equal loss shape"):
    D.gamma_bin_stats(loss, gamma[0], 4)


def test_eval_gamma_grid():
  g = D.eval_gamma_grid(4)
  assert g.dtype == np.float32
  np.testing.assert_allclose(g, [0.125, 0.375, 0.625, 0.875])
  # Midpoints land one per bin.
  _, c = D.gamma_bin_stats(np.ones(4, np.float32), g, 4)
  np.testing.assert_array_equal(c, np.ones(4))


EDGE_GAMMAS = [0.0, 1e-8, 1.0 - 1e-8, 1.0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_finite_at_edges_and_float32_outputs(dtype):
  rng = np.random.default_rng(7)
  cast = lambda a: np.asarray(a, np.float32).astype(dtype)  # numpy knows bfloat16
  x = cast(rng.normal(size=(4, 3, 5)))
  eps = cast(rng.normal(size=(4, 3, 5)))
  g = cast(np.broadcast_to(np.array(EDGE_GAMMAS)[:, None], (4, 3)))
  outs = [D.corrupt(x, g, eps), D.x0_from_eps(x, eps, g), D.eps_from_x0(x, x, g)]
  # All 16 (gamma_s, gamma_prev) pairs, including the misuse gamma_s > gamma_prev.
  pairs = np.array(list(itertools.product(EDGE_GAMMAS, repeat=2)))
  gs = cast(np.broadcast_to(pairs[:, :1], (16, 3)))
  gp = cast(np.broadcast_to(pairs[:, 1:], (16, 3)))
  xp, ep = cast(rng.normal(size=(16, 3, 5))), cast(rng.normal(size=(16, 3, 5)))
  outs += [
      D.posterior_mean_from_x0(xp, ep, gs, gp), D.posterior_mean_from_eps(xp, ep, gs, gp),
      D.posterior_variance(gs, gp),
  ]
  if dtype == jnp.bfloat16:
    # ddpm_step is checked once (its compile is slow): in float32 the edge values
    # are the same as in bfloat16 (1 - 1e-8 rounds to 1 in both).
    outs.append(D.ddpm_step(jax.random.key(8), xp, ep, gs, gp))
  for o in outs:
    assert o.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(o)))


def test_sample_gamma_bimodal_within_bounds():
  g = np.asarray(D.sample_gamma(jax.random.key(9), (N_GAMMA,), 0.03, 0.03))  # mass at both ends
  assert g.dtype == np.float32 and np.all(np.isfinite(g))
  assert g.min() == GMIN and g.max() == GMAX  # both clips are hit


# ------------------------------------------------------------- the objectives


def _oracle(target, k, predict):
  """A decoder that knows the answer: x0 (or eps, from x_noisy and gamma) of
  each of its rows, which are (example, patch, draw) in row-major order."""
  def decode(z, x_noisy, gamma):
    x0 = jnp.repeat(target.reshape(-1, target.shape[-1]), k, axis=0)
    return x0 if predict == "x0" else D.eps_from_x0(x_noisy, x0, gamma)
  return decode


@pytest.mark.parametrize("predict", ["x0", "eps"])
def test_diffusion_loss_is_zero_for_the_exact_prediction_and_bins_by_gamma(predict):
  bsz, n, k, p = 2, 3, 4, 5
  target = jax.random.normal(jax.random.PRNGKey(0), (bsz, n, p))
  z = jnp.zeros((bsz, n, 7))
  gamma, eps = objectives.draw_noise(jax.random.PRNGKey(1), target.shape, k, 1.0, 1.0)
  assert gamma.shape == (bsz, n, k) and eps.shape == (bsz, n, k, p)
  loss, metrics = objectives.diffusion_loss(_oracle(target, k, predict), z, target, gamma, eps,
                                            predict=predict, gamma_bins=4)
  assert float(loss) < 1e-6 and metrics["per_example_loss"].shape == (bsz,)
  # A decoder that predicts 0: the loss is the mean square of the goal, and
  # each gamma bin averages the draws whose gamma falls in it.
  zero = lambda z, x, g: jnp.zeros_like(x)
  loss, metrics = objectives.diffusion_loss(zero, z, target, gamma, eps, predict=predict,
                                            gamma_bins=4)
  goal = jnp.broadcast_to(target[:, :, None], eps.shape) if predict == "x0" else eps
  err = np.asarray(jnp.mean(goal ** 2, -1))
  np.testing.assert_allclose(float(loss), err.mean(), rtol=1e-6)
  np.testing.assert_allclose(metrics["per_example_loss"], err.reshape(bsz, -1).mean(1),
                             rtol=1e-6)
  bins = np.minimum((np.asarray(gamma) * 4).astype(int), 3)
  for i in range(4):
    got = float(metrics[f"loss_gamma_bin_{i:02d}"])
    if (bins == i).any():
      np.testing.assert_allclose(got, err[bins == i].mean(), rtol=1e-5)
    else:
      assert np.isnan(got)


def test_eval_noise_scores_every_patch_at_every_grid_level():
  grid = D.eval_gamma_grid(3)
  gamma, eps = objectives.eval_noise(jax.random.PRNGKey(0), (2, 4, 5), grid)
  assert gamma.shape == (2, 4, 3) and eps.shape == (2, 4, 3, 5)
  np.testing.assert_array_equal(gamma[1, 2], grid)


def test_mse_loss_and_norm_pix_targets():
  pred, target = jnp.zeros((2, 3, 4)), jnp.arange(24.0).reshape(2, 3, 4)
  loss, metrics = objectives.mse_loss(pred, target)
  np.testing.assert_allclose(float(loss), float(jnp.mean(target ** 2)))
  np.testing.assert_allclose(metrics["per_example_loss"],
                             jnp.mean(target.reshape(2, -1) ** 2, 1))
  t = objectives.patch_targets(target, norm_pix=True)
  np.testing.assert_allclose(t.mean(-1), 0.0, atol=1e-6)
  np.testing.assert_allclose(t.std(-1), 1.0, atol=1e-5)
  assert objectives.patch_targets(target, norm_pix=False) is target
