"""The pretraining objectives (paper section "Training Objective"), as plain functions.

The DARL module gives ordered targets ``[B, N, P]`` and backbone outputs
``z [B, N, D]`` (``z_t`` has seen ``x_{<t}`` only); the objectives score the
patch decoder's predictions against the targets:

* ``mse``: a deterministic decoder, ``||f(z_t) - x_t||^2``.
* ``diffusion``: ``gamma ~ Beta(a, b)`` per patch, ``x_t^gamma = sqrt(gamma)
  x_t + sqrt(1 - gamma) eps``; the decoder predicts x0 (default) or eps from
  ``(z_t, x_t^gamma, gamma)`` and the loss is the simplified DDPM objective.
  ``noise_samples = k`` draws k independent (gamma, eps) pairs per backbone
  output: one backbone pass, k decoder passes, since the decoder is cheap and
  the backbone is not (beyond the paper; 1 is the paper's setting).

Targets are raw pixels, or per-patch normalised pixels (``norm_pix``, appendix
"Normalized Pixels"). Every loss is a plain mean of per-patch squared errors
(mean over pixels, then over patches and draws): the paper weights all
patches and noise levels equally.

Noise is injectable: :func:`diffusion_loss` and :func:`loss_given_noise` take
explicit ``gamma``/``eps``; :func:`draw_noise` and :func:`loss` draw them from
a key first. Nothing here draws from a Flax rng stream, so the trainer decides
where the randomness comes from. :func:`loss` and :func:`loss_given_noise` are
``DARL.apply(..., method=...)`` functions: one apply runs backbone and decoder,
so gradients reach both.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from darl_jax import diffusion

LOSSES = ("mse", "diffusion")
PREDICTION_TARGETS = ("x0", "eps")


def check_objective(kind: str, predict: str = "x0") -> None:
  if kind not in LOSSES:
    raise ValueError(f"unknown loss {kind!r}; valid: {', '.join(LOSSES)}")
  if predict not in PREDICTION_TARGETS:
    raise ValueError(f"unknown prediction target {predict!r}; valid: "
                     f"{', '.join(PREDICTION_TARGETS)}")


# ----------------------------------------------------------------- targets


def normalize_patches(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """Per-patch standardisation over the last axis (MAE's norm-pix target):
  ``(x - mean) / sqrt(var + eps)``."""
  mean = x.mean(-1, keepdims=True)
  var = x.var(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + eps)


def patch_targets(tokens: jax.Array, norm_pix: bool) -> jax.Array:
  """What the decoder is scored against: the ordered patches ``[B, N, P]``,
  standardised per patch with ``norm_pix``."""
  return normalize_patches(tokens) if norm_pix else tokens


# ----------------------------------------------------------------- MSE


def _weighted_mean(err, weights, axis=None):
  """The mean of ``err`` over ``axis`` with per-patch ``weights`` (None: all 1)."""
  if weights is None:
    return jnp.mean(err, axis)
  w = jnp.broadcast_to(weights.reshape(weights.shape + (1,) * (err.ndim - weights.ndim)),
                       err.shape)
  return jnp.sum(err * w, axis) / jnp.maximum(jnp.sum(w, axis), 1.0)


def mse_loss(pred: jax.Array, target: jax.Array, weights=None) -> tuple[jax.Array, dict]:
  """``pred``, ``target [B, N, P]`` -> ``(loss, {"loss", "per_example_loss" [B]})``;
  ``weights [B, N]`` (prefix_weights) leave patches out of both."""
  err = jnp.mean(jnp.square(pred - target), -1)              # [B, N]
  loss = _weighted_mean(err, weights)
  return loss, {"loss": loss, "per_example_loss": _weighted_mean(err, weights, 1),
                "counts": {"loss": _count(err, weights)}}


def _count(err: jax.Array, weights=None) -> jax.Array:
  """The number of terms behind ``_weighted_mean(err, weights)``: what a mean
  over several microbatches weighs each microbatch's mean by."""
  if weights is None:
    return jnp.asarray(err.size, jnp.float32)
  w = weights.reshape(weights.shape + (1,) * (err.ndim - weights.ndim))
  return jnp.sum(jnp.broadcast_to(w, err.shape).astype(jnp.float32))


def draw_prefix(key: jax.Array, batch: int, n: int) -> jax.Array:
  """Prefix lengths ``[B]`` for prefix-causal pretraining: uniform over 1 ..
  N - 1 patches, so every example keeps at least one patch with a loss."""
  return jax.random.randint(key, (batch,), 1, n)


def prefix_weights(prefix: jax.Array, n: int) -> jax.Array:
  """``[B, N]`` 1.0 for the patches scored under ``prefix [B]``: the output
  at position t predicts patch t and has seen the whole prefix, so only
  ``t >= prefix`` (patches after the prefix) carry a loss."""
  return (jnp.arange(n)[None] >= prefix[:, None]).astype(jnp.float32)


# ----------------------------------------------------------------- diffusion


def draw_noise(key: jax.Array, target_shape, noise_samples: int, a: float, b: float):
  """Training draws for targets of ``target_shape [B, N, P]``: ``gamma [B, N, k]``
  ~ Beta(a, b) (diffusion.sample_gamma) and ``eps [B, N, k, P]`` ~ N(0, I),
  float32, ``k = noise_samples``; every patch and draw independent."""
  bsz, n, p = target_shape
  key_gamma, key_eps = jax.random.split(key)
  gamma = diffusion.sample_gamma(key_gamma, (bsz, n, noise_samples), a, b)
  eps = jax.random.normal(key_eps, (bsz, n, noise_samples, p), jnp.float32)
  return gamma, eps


def eval_noise(key: jax.Array, target_shape, gammas):
  """Validation draws: every patch at every level of the fixed grid ``gammas [k]``
  (diffusion.eval_gamma_grid) with ``eps`` from ``key``; shapes as draw_noise.
  A fixed key and grid make validation losses comparable across steps and runs."""
  bsz, n, p = target_shape
  gammas = jnp.asarray(gammas, jnp.float32)
  gamma = jnp.broadcast_to(gammas, (bsz, n, gammas.shape[0]))
  eps = jax.random.normal(key, (bsz, n, gammas.shape[0], p), jnp.float32)
  return gamma, eps


def diffusion_loss(decode: Callable, z: jax.Array, target: jax.Array, gamma: jax.Array,
                   eps: jax.Array, *, predict: str = "x0", gamma_bins: int = 10,
                   weights=None) -> tuple[jax.Array, dict]:
  """The simplified DDPM loss for given draws.

  Args:
    decode: ``(z [M, D], x_noisy [M, P], gamma [M]) -> [M, P]``, the patch decoder.
    z: backbone outputs ``[B, N, D]``.
    target: clean patches ``[B, N, P]``.
    gamma: ``[B, N, k]``; eps: ``[B, N, k, P]`` (draw_noise / eval_noise).
    predict: ``x0`` (the paper's choice) or ``eps``, what the decoder outputs
      and is scored against.
    gamma_bins: number of equal-width gamma bins of the per-level metrics.
    weights: ``[B, N]`` or None; patches of weight 0 carry no loss (prefix).

  Returns:
    ``(loss, metrics)``: ``loss``, ``per_example_loss [B]`` (mean over the
    example's patches and draws), ``loss_gamma_bin_XX`` and ``counts``, the
    number of (patch, draw) terms behind ``loss`` and each bin's mean (how
    gradient accumulation weighs a microbatch's means).
  """
  bsz, n, k = gamma.shape
  p = target.shape[-1]
  x0 = jnp.broadcast_to(target[:, :, None], (bsz, n, k, p))
  x_noisy = diffusion.corrupt(x0, gamma, eps)
  # One decoder call over all B * N * k (patch, draw) rows; each backbone
  # output is repeated k times (the backbone ran once).
  z_k = jnp.repeat(z.reshape(bsz * n, 1, -1), k, axis=1).reshape(bsz * n * k, -1)
  pred = decode(z_k, x_noisy.reshape(-1, p).astype(z.dtype), gamma.reshape(-1))
  goal = x0 if predict == "x0" else eps
  err = jnp.mean(jnp.square(pred.reshape(bsz, n, k, p) - goal), -1)      # [B, N, k]
  loss = _weighted_mean(err, weights)
  metrics = {"loss": loss, "per_example_loss": _weighted_mean(err, weights, (1, 2))}
  bins, bin_counts = gamma_bin_metrics(err, gamma, gamma_bins, weights)
  metrics.update(bins)
  metrics["counts"] = {"loss": _count(err, weights), **bin_counts}
  return loss, metrics


def gamma_bin_metrics(err: jax.Array, gamma: jax.Array, num_bins: int,
                      weights=None) -> tuple[dict, dict]:
  """``loss_gamma_bin_XX``: the mean loss of the draws whose gamma falls in
  equal-width bin XX of [0, 1] (diffusion.bin_edges); NaN for an empty bin,
  which the logger averages over steps with nanmean. Returns ``(means,
  counts)``, both keyed ``loss_gamma_bin_XX``."""
  mask = None if weights is None else jnp.broadcast_to(weights[..., None], err.shape
                                                       ).reshape(-1) > 0
  sums, counts = diffusion.gamma_bin_stats(err.reshape(-1), gamma.reshape(-1), num_bins, mask)
  names = [f"loss_gamma_bin_{i:02d}" for i in range(num_bins)]
  means = {name: jnp.where(counts[i] > 0, sums[i] / jnp.maximum(counts[i], 1), jnp.nan)
           for i, name in enumerate(names)}
  return means, {name: counts[i] for i, name in enumerate(names)}


# ----------------------------------------------------- with the DARL module


def noise_shape(model, images) -> tuple[int, int, int]:
  """``(B, N, P)``: the targets' shape for ``images [B, H, W, C]`` under ``model``."""
  bsz, h, w, c = images.shape
  p = model.patch_size
  return bsz, (h // p) * (w // p), p * p * c


def draws(model, images, key, *, eval_gammas=None) -> dict:
  """Every random input of the loss for ``images [B, H, W, C]``, drawn from
  ``key``: the diffusion noise (Beta(noise_a, noise_b) levels,
  ``noise_samples`` per patch, or every level of the fixed grid
  ``eval_gammas`` for validation; MSE draws none) and, for prefix-causal
  pretraining, the prefix lengths. ``{gamma, eps, prefix}`` (those that
  apply), each with the batch's leading axis, so a batch's draws can be made
  once and sliced with it (gradient accumulation). ``model``: a DARL module
  (bound or not; only its settings are read)."""
  out = {}
  shape = noise_shape(model, images)
  if model.loss == "diffusion":
    if eval_gammas is None:
      out["gamma"], out["eps"] = draw_noise(key, shape, model.noise_samples, model.noise_a,
                                            model.noise_b)
    else:
      out["gamma"], out["eps"] = eval_noise(key, shape, eval_gammas)
  if model.prefix != "off":   # its own stream: the noise draws stay as without a prefix
    out["prefix"] = draw_prefix(jax.random.fold_in(key, 2), shape[0], shape[1])
  return out


def loss(model, images, key, *, train: bool, eval_gammas=None, perm=None):
  """The pretraining loss of a DARL module (``model.apply(..., method=loss)``):
  :func:`draws` from ``key``, then :func:`loss_given_noise`. Returns
  ``(loss, metrics)``.
  """
  return loss_given_noise(model, images, train=train, perm=perm,
                          **draws(model, images, key, eval_gammas=eval_gammas))


def loss_given_noise(model, images, *, train: bool, gamma=None, eps=None, perm=None,
                     prefix=None):
  """The loss for given diffusion draws (``gamma [B, N, k]``, ``eps [B, N, k, P]``;
  unused for MSE), optional ordering ``perm`` (``[N]`` or ``[B, N]``) and
  prefix lengths ``prefix [B]`` (prefix-causal pretraining: the prefix
  attends both ways and carries no loss). A ``model.apply(...,
  method=loss_given_noise)`` function."""
  check_objective(model.loss, model.predict)
  out = model(images, train=train, perm=perm, prefix=prefix)
  z, target = out["z"], out["target"]
  weights = None if prefix is None else prefix_weights(prefix, target.shape[1])
  if model.loss == "mse":
    # The decoders take rows [M, D]: one row per (example, patch).
    pred = model.decode(z.reshape(-1, z.shape[-1])).reshape(target.shape)
    return mse_loss(pred, target, weights)
  if gamma is None or eps is None:
    raise ValueError("the diffusion loss needs gamma and eps (objectives.draw_noise)")
  return diffusion_loss(model.decode, z, target, gamma, eps, predict=model.predict,
                        gamma_bins=model.gamma_bins, weights=weights)
