"""Patch diffusion in the gamma parameterisation (paper section "Patch Diffusion").

Notation. ``gamma`` is the cumulative signal level (the paper's ``gamma(s)``):

    x_s = sqrt(gamma) * x0 + sqrt(1 - gamma) * eps,   eps ~ N(0, I)

``gamma = 1`` is the clean patch, ``gamma = 0`` pure noise. One reverse step goes
from ``gamma_s`` to a cleaner ``gamma_prev >= gamma_s`` (the paper's
``gamma_{s-1}``), with per-step ``alpha = gamma_s / gamma_prev``.

Training draws ``gamma ~ Beta(a, b)`` independently per patch
(:func:`sample_gamma`; the losses are in darl_jax/objectives.py); sampling
walks the deterministic grid :func:`sampling_gamma_grid` that has the same
distribution, with the one denoising chain :func:`reverse_diffusion` that both
the sampler and pretraining's prediction picture run.

Shapes and broadcasting. Data tensors are ``[..., P]`` (patch pixels last).
Gamma aligns with the *leading* axes of the data (not numpy's trailing
alignment): its shape is a prefix of the data shape, typically
``x.shape[:-1]`` (e.g. gamma ``[B, N]`` for x ``[B, N, P]``, or ``[B, N, k]`` for
``k`` noise draws per patch, x ``[B, N, k, P]``); trailing singleton axes are
added until the ranks match and ordinary broadcasting takes over.

Jit and dtypes. The jax functions are jitted (shapes and bin counts static),
so eager calls compile once per shape; inside an outer jit they are inlined.
They compute in float32 and return float32 whatever the input dtype.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special

# Gamma is kept inside [GAMMA_MIN, GAMMA_MAX] wherever it is divided by or
# square-rooted near a boundary. With a = 0.03 (the paper's preferred
# high-noise schedule) a float32 Beta sample underflows to exactly 0 about 7% of
# the time, and 1 - gamma can round to exactly 0 for b < 1; x0_from_eps divides
# by sqrt(gamma) and the posterior divides by 1 - gamma. The clip keeps those
# factors below ~316x (1 / sqrt(1e-5)) and is far below any scale that matters
# for the loss. In float32 (ulp at 1 is 6e-8) 1 - GAMMA_MAX is still ~1e-5.
GAMMA_MIN = 1e-5
GAMMA_MAX = 1.0 - 1e-5

_F32 = jnp.float32


def _f32(x) -> jax.Array:
  return jnp.asarray(x).astype(_F32)


def _expand(gamma: jax.Array, ndim: int) -> jax.Array:
  """Adds trailing axes so ``gamma`` (a prefix of the data shape) broadcasts."""
  if gamma.ndim > ndim:
    raise ValueError(
        f"gamma of shape {gamma.shape} has more axes than the data ({ndim}); gamma's shape "
        "must be a prefix of the data shape, usually data.shape[:-1]")
  return gamma.reshape(gamma.shape + (1,) * (ndim - gamma.ndim))


# ----------------------------------------------------------------- training noise


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def sample_gamma(key: jax.Array, shape, a: float, b: float) -> jax.Array:
  """Draws ``gamma ~ Beta(a, b)``, float32 of ``shape``, clipped to [GAMMA_MIN, GAMMA_MAX].

  ``a``, ``b``: Python floats (the config's ``loss.noise_a``/``noise_b``).
  With ``b = 1`` (the paper's schedules, e.g. Beta(0.03, 1)) or ``a = 1`` the
  Beta CDF inverts in closed form, ``gamma = U^(1/a)`` or ``1 - U^(1/b)`` for
  ``U ~ U(0, 1]``, and that is how they are drawn. ``jax.random.beta`` (used
  for every other pair) draws two Gamma variates by rejection, a ``while`` loop
  whose exit test the GPU reports to the host at every iteration, leaving
  the GPU idle in the training step. The closed form is one elementwise
  pass. Both are exact samplers of the same distribution (not the
  same numbers for a key).
  """
  if b == 1.0 or a == 1.0:
    # U in (0, 1]: log U is finite, so U^(1/a) = exp(log U / a) is in [0, 1]
    # (it underflows to 0 where the Beta sample would too).
    u = 1.0 - jax.random.uniform(key, shape, _F32)
    g = jnp.exp(jnp.log(u) / a) if b == 1.0 else 1.0 - jnp.exp(jnp.log(u) / b)
  else:
    g = jax.random.beta(key, a, b, shape, dtype=_F32)
  return jnp.clip(g, GAMMA_MIN, GAMMA_MAX)


@jax.jit
def corrupt(x0, gamma, noise) -> jax.Array:
  """Forward process ``x_s = sqrt(gamma) x0 + sqrt(1 - gamma) noise``.

  Args:
    x0: clean data ``[..., P]``.
    gamma: signal level, shape a prefix of ``x0.shape`` (usually ``x0.shape[:-1]``).
      Values outside [0, 1] are clipped.
    noise: standard normal noise of ``x0``'s shape.

  Returns:
    float32 ``x_s`` of ``x0``'s shape.
  """
  x0, noise = _f32(x0), _f32(noise)
  g = jnp.clip(_expand(_f32(gamma), x0.ndim), 0.0, 1.0)
  return jnp.sqrt(g) * x0 + jnp.sqrt(1.0 - g) * noise


@jax.jit
def x0_from_eps(x_s, eps, gamma) -> jax.Array:
  """``x0 = (x_s - sqrt(1 - gamma) eps) / sqrt(gamma)``, gamma clipped to >= GAMMA_MIN."""
  x_s, eps = _f32(x_s), _f32(eps)
  g = jnp.clip(_expand(_f32(gamma), x_s.ndim), GAMMA_MIN, 1.0)
  return (x_s - jnp.sqrt(1.0 - g) * eps) / jnp.sqrt(g)


@jax.jit
def eps_from_x0(x_s, x0, gamma) -> jax.Array:
  """``eps = (x_s - sqrt(gamma) x0) / sqrt(1 - gamma)``, gamma clipped to <= GAMMA_MAX."""
  x_s, x0 = _f32(x_s), _f32(x0)
  g = jnp.clip(_expand(_f32(gamma), x_s.ndim), 0.0, GAMMA_MAX)
  return (x_s - jnp.sqrt(g) * x0) / jnp.sqrt(1.0 - g)


# ----------------------------------------------------------------- posterior


def _posterior_terms(gamma_s, gamma_prev):
  """Clipped ``(gamma_s, gamma_prev, alpha, 1 - alpha)``, all float32.

  gamma_s is kept below GAMMA_MAX (it is in ``1 / (1 - gamma_s)``), gamma_prev
  may reach 1 (the final, clean step), and ``gamma_s <= gamma_prev`` is enforced
  so alpha is in (0, 1] and the variance is never negative.
  """
  gs = jnp.clip(_f32(gamma_s), GAMMA_MIN, GAMMA_MAX)
  gp = jnp.clip(_f32(gamma_prev), GAMMA_MIN, 1.0)
  gs = jnp.minimum(gs, gp)
  alpha = gs / gp
  # (gp - gs) / gp rather than 1 - alpha: no cancellation when the steps are fine.
  one_minus_alpha = (gp - gs) / gp
  return gs, gp, alpha, one_minus_alpha


@jax.jit
def posterior_mean_from_x0(x_s, x0, gamma_s, gamma_prev) -> jax.Array:
  """Mean of ``q(x_prev | x_s, x0)``.

  ``mu = sqrt(alpha)(1 - gamma_prev)/(1 - gamma_s) x_s
       + sqrt(gamma_prev)(1 - alpha)/(1 - gamma_s) x0``, ``alpha = gamma_s / gamma_prev``.

  Args:
    x_s, x0: ``[..., P]``.
    gamma_s: current (noisier) signal level, shape a prefix of ``x_s.shape``.
    gamma_prev: target (cleaner) signal level, ``>= gamma_s``, same shape rule.
      ``gamma_prev = 1`` gives ``mu = x0`` exactly. A ``gamma_s`` above
      ``gamma_prev`` is clamped to it: a no-op step (``mu = x_s``, var 0).

  Returns:
    float32 ``[..., P]``.
  """
  x_s, x0 = _f32(x_s), _f32(x0)
  gs, gp, alpha, oma = (_expand(t, x_s.ndim) for t in _posterior_terms(gamma_s, gamma_prev))
  c_xs = jnp.sqrt(alpha) * (1.0 - gp) / (1.0 - gs)
  c_x0 = jnp.sqrt(gp) * oma / (1.0 - gs)
  return c_xs * x_s + c_x0 * x0


@jax.jit
def posterior_mean_from_eps(x_s, eps, gamma_s, gamma_prev) -> jax.Array:
  """Same mean written with the noise: ``mu = x_s/sqrt(alpha) - (1-alpha)/sqrt(alpha(1-gamma_s)) eps``.

  Shapes and clipping as :func:`posterior_mean_from_x0`; float32 ``[..., P]``.
  """
  x_s, eps = _f32(x_s), _f32(eps)
  gs, _, alpha, oma = (_expand(t, x_s.ndim) for t in _posterior_terms(gamma_s, gamma_prev))
  return x_s / jnp.sqrt(alpha) - oma / jnp.sqrt(alpha * (1.0 - gs)) * eps


@jax.jit
def posterior_variance(gamma_s, gamma_prev) -> jax.Array:
  """Variance of ``q(x_prev | x_s, x0)``: ``(1 - alpha)(1 - gamma_prev)/(1 - gamma_s)``.

  Returns float32 of the broadcast shape of the gammas, in ``[0, 1 - gamma_prev]``.
  """
  gs, gp, _, oma = _posterior_terms(gamma_s, gamma_prev)
  return jnp.maximum(oma * (1.0 - gp) / (1.0 - gs), 0.0)


@jax.jit
def ddpm_step(key: jax.Array, x_s, x0_pred, gamma_s, gamma_prev, temperature: float = 1.0,
              is_final=None) -> jax.Array:
  """One ancestral step ``x_prev = mu + temperature * sqrt(var) * z``, ``z ~ N(0, I)``.

  ``mu`` is the posterior mean given the predicted clean patch ``x0_pred``
  (the paper predicts x0; clip ``x0_pred`` to the data range beforehand if
  wanted). On the last step the mean is returned with no noise: where
  ``gamma_prev >= 1`` (then ``var = 0`` and ``mu = x0_pred`` exactly, so the
  switch only makes this explicit), or where ``is_final`` is true (for callers
  whose last level is below 1, e.g. a truncated grid: the result is the
  posterior mean, not x0_pred).

  Args:
    key: PRNG key for ``z``.
    x_s: ``[..., P]`` current sample at ``gamma_s``.
    x0_pred: ``[..., P]`` prediction of the clean data.
    gamma_s, gamma_prev: shape a prefix of ``x_s.shape`` (scalars are fine).
    temperature: noise scale (1 = ancestral sampling, 0 = mean only).
    is_final: optional bool (or bool array, prefix shape) forcing the
      noise-free mean; jit-friendly.

  Returns:
    float32 ``[..., P]`` sample at ``gamma_prev``.
  """
  x_s = _f32(x_s)
  mu = posterior_mean_from_x0(x_s, x0_pred, gamma_s, gamma_prev)
  std = _expand(jnp.sqrt(posterior_variance(gamma_s, gamma_prev)), x_s.ndim)
  z = jax.random.normal(key, x_s.shape, dtype=_F32)
  final = _expand(_f32(gamma_prev) >= 1.0, x_s.ndim)
  if is_final is not None:
    final = final | _expand(jnp.asarray(is_final, dtype=bool), x_s.ndim)
  return jnp.where(final, mu, mu + temperature * std * z)


def reverse_diffusion(denoise: Callable[[jax.Array, jax.Array], jax.Array],
                      key: jax.Array, shape: tuple[int, ...], gammas,
                      temperature: float = 1.0) -> jax.Array:
  """Ancestral DDPM sampling: the denoising chain, written once.

  Starts from ``x ~ N(0, I)`` of ``shape`` at ``gammas[0]`` (the noisiest
  level) and takes ``len(gammas) - 1`` steps with :func:`ddpm_step`, step
  ``i`` going from ``gammas[i]`` to ``gammas[i + 1]`` with the posterior mean
  around ``denoise(x, gammas[i])``, an estimate of x0 of ``shape``. With
  ``gammas[-1] == 1`` (as :func:`sampling_gamma_grid` gives) the last step
  returns that estimate exactly. ``temperature`` scales the noise injected at
  each step (not the initial noise); 0 gives the mean path.

  Randomness: the initial noise from ``fold_in(key, T)``, step ``i``'s from
  ``fold_in(key, i)``. A ``lax.fori_loop``: one compiled step whatever ``T`` is.
  """
  gammas = jnp.asarray(gammas, _F32)
  num_steps = gammas.shape[0] - 1
  x = jax.random.normal(jax.random.fold_in(key, num_steps), shape, _F32)

  def step(i, x):
    g_s, g_prev = gammas[i], gammas[i + 1]
    return ddpm_step(jax.random.fold_in(key, i), x, denoise(x, g_s), g_s, g_prev,
                     temperature)

  return jax.lax.fori_loop(0, num_steps, step, x)


# ----------------------------------------------------------------- sampling grid


def gamma_from_s(s, a: float, b: float) -> np.ndarray:
  """The schedule ``gamma(s)`` equivalent to ``gamma ~ Beta(a, b)`` for ``s ~ U[0, 1]``.

  The paper defines the schedule through ``Pr(gamma <= x) = T^{-1}(x)`` with
  ``T(s) = 1 - gamma(s)``; inverting gives ``Pr(gamma <= x) = 1 - s``, i.e.
  ``gamma(s) = BetaQuantile(1 - s)``: decreasing in s, ``gamma(0) = 1`` (clean),
  ``gamma(1) = 0`` (noise). float64 numpy.
  """
  return scipy.special.betaincinv(a, b, 1.0 - np.asarray(s, dtype=np.float64))


def sampling_gamma_grid(num_steps: int, a: float, b: float) -> np.ndarray:
  """Gammas for ``s = 1, 1 - 1/T, ..., 0`` (``T = num_steps``), float32 ``[T + 1]``.

  Index 0 is the noisiest level (``gamma(1) = 0``, clipped up to GAMMA_MIN so
  that the first step's divisions stay finite), the last is exactly 1.0 (the
  final step returns the predicted x0). Step ``i`` goes from ``grid[i]`` to
  ``grid[i + 1]``.

  Choice: uniform steps in ``s`` put the sampling steps where the training
  distribution put its mass (equal Beta probability between consecutive
  levels), rather than uniform in gamma. For bimodal schedules such as
  ``a = 0.03`` many low levels clip to GAMMA_MIN; those steps are identities
  (alpha = 1, zero variance), so the grid is non-decreasing, not strictly
  increasing.
  """
  if num_steps < 1:
    raise ValueError(f"num_steps must be >= 1, got {num_steps}")
  s = 1.0 - np.arange(num_steps + 1, dtype=np.float64) / num_steps
  g = np.clip(gamma_from_s(s, a, b), GAMMA_MIN, 1.0)
  g[-1] = 1.0  # betaincinv(a, b, 1) is 1, made exact regardless of scipy rounding
  return np.maximum.accumulate(g).astype(np.float32)


# ----------------------------------------------------------------- loss by gamma


def bin_edges(num_bins: int) -> np.ndarray:
  """Edges of ``num_bins`` equal-width gamma bins on [0, 1], float32 ``[num_bins + 1]``.

  Bin ``i`` is ``[i/n, (i+1)/n)``; the last bin also holds gamma = 1.
  """
  return np.linspace(0.0, 1.0, num_bins + 1, dtype=np.float32)


@functools.partial(jax.jit, static_argnums=2)
def gamma_bin_stats(per_item_loss, gamma, num_bins: int, mask=None) -> tuple[jax.Array, jax.Array]:
  """Sums and counts of a loss over equal-width gamma bins (jit-friendly).

  Args:
    per_item_loss: any shape, e.g. ``[B, N]`` per-patch losses.
    gamma: same shape as ``per_item_loss``.
    num_bins: static number of bins over [0, 1] (see :func:`bin_edges`).
    mask: optional bool/float, broadcastable to the loss; items with mask 0 are
      left out (e.g. padding rows of an evaluation batch).

  Returns:
    ``(sum, count)``, float32 ``[num_bins]`` each. Counts are float so they
    can be summed across devices and divided directly; ``sum / max(count, 1)``
    is the mean loss per bin.
  """
  loss = _f32(per_item_loss)
  g = _f32(gamma)
  if g.shape != loss.shape:
    raise ValueError(f"gamma shape {g.shape} must equal loss shape {loss.shape}")
  w = jnp.ones_like(loss) if mask is None else jnp.broadcast_to(_f32(mask), loss.shape)
  idx = jnp.clip(jnp.floor(g * num_bins).astype(jnp.int32), 0, num_bins - 1).reshape(-1)
  # A one-hot column sum rather than segment_sum's scatter-add: the gammas
  # crowd into one or two bins (Beta(0.03, 1) puts most of them near 0), and
  # a GPU scatter-add then serialises on those bins' atomics, where the
  # one-hot sum is one fused reduction over [items, bins].
  onehot = (idx[:, None] == jnp.arange(num_bins)[None, :]).astype(jnp.float32)
  sums = jnp.sum(onehot * (loss * w).reshape(-1, 1), axis=0)
  counts = jnp.sum(onehot * w.reshape(-1, 1), axis=0)
  return sums, counts


def eval_gamma_grid(num: int) -> np.ndarray:
  """Fixed bin midpoints ``(i + 0.5) / num``, float32 ``[num]``.

  Validation losses at these gammas (instead of random Beta draws) are
  deterministic and comparable across runs with different training schedules.
  """
  return ((np.arange(num, dtype=np.float64) + 0.5) / num).astype(np.float32)
