"""The DARL pretraining model: ordered patches -> causal ViT -> patch decoder -> loss.

    images [B, H, W, C]
      -> patchify + ordering            tokens x_0 .. x_{N-1} (ordered), positions
      -> backbone([SOS, x_0 .. x_{N-2}])  z [B, N, D]; z_t only sees x_{<t}
      -> patch decoder(z_t [, x_t^gamma, gamma])
      -> loss against x_0 .. x_{N-1}

Two objectives (paper section "Training Objective"):

* ``mse``: a deterministic decoder, ``||f(x_{<t}) - x_t||^2``.
* ``diffusion``: per patch gamma ~ Beta(a, b), ``x_t^gamma = sqrt(gamma) x_t +
  sqrt(1 - gamma) eps``; the decoder predicts x0 (default) or eps and the loss
  is the simplified DDPM objective. ``noise_samples = k`` draws k independent
  (gamma, eps) pairs per backbone output: one backbone pass, k decoder passes,
  since the decoder is cheap and the backbone is not (beyond the paper; 1 is
  the paper's setting).

Targets are raw pixels, or per-patch normalised pixels (``norm_pix``, appendix
"Normalized Pixels"): ``(x - mean) / sqrt(var + 1e-6)`` over each patch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from darl_jax import diffusion
from darl_jax import patches as patches_lib
from darl_jax.models import decoders as decoders_lib
from darl_jax.models import two_stream as two_stream_lib
from darl_jax.models import vit as vit_lib

LOSSES = ("mse", "diffusion")
PREDICTION_TARGETS = ("x0", "eps")


def normalize_patches(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """Per-patch standardisation over the last axis (MAE's norm-pix target)."""
  mean = x.mean(-1, keepdims=True)
  var = x.var(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + eps)


class DARL(nn.Module):
  """Pretraining module. ``__call__`` returns ``(loss, metrics)``.

  Attributes are plain values built from the config by ``darl_from_config``;
  the ordering is static (numpy) unless a per-example ``perm`` is passed.
  """
  backbone: vit_lib.ViT
  decoder: decoders_lib.PatchDecoder
  patch_size: int
  ordering: str = "raster"
  ordering_block: int = 2
  ordering_seed: int = 0
  loss: str = "mse"
  norm_pix: bool = False
  noise_a: float = 0.03
  noise_b: float = 1.0
  predict: str = "x0"
  noise_samples: int = 1
  gamma_bins: int = 10

  def _ordering(self, grid_hw):
    return patches_lib.make_ordering(self.ordering, *grid_hw, block=self.ordering_block,
                                     seed=self.ordering_seed)

  @property
  def two_stream(self) -> bool:
    return isinstance(self.backbone, two_stream_lib.TwoStreamViT)

  def encode(self, images, *, train: bool, perm=None):
    """Ordered targets ``[B, N, P]`` and backbone outputs ``z [B, N, D]``.

    ``perm`` (``[N]`` or per-example ``[B, N]``) overrides the configured
    ordering. A two-stream model with ``ordering="random"`` draws a fresh
    permutation per example from the ``noise`` rng; a plain model's "random"
    ordering is one fixed permutation (it has no way to know which patch
    comes next otherwise).
    """
    grid_hw = (images.shape[1] // self.patch_size, images.shape[2] // self.patch_size)
    x = patches_lib.patchify(images, self.patch_size)
    b, n = x.shape[0], x.shape[1]
    if perm is None and self.two_stream and self.ordering == "random":
      perm = patches_lib.random_permutations(
          jax.random.fold_in(self.make_rng("noise"), 7), b, n)
    if perm is None:
      order = self._ordering(grid_hw)
      perm = jnp.asarray(order.perm)
      rows, cols = jnp.asarray(order.rows)[None], jnp.asarray(order.cols)[None]
    else:
      rows, cols = patches_lib.positions_of(perm, grid_hw[1])
      rows, cols = (rows[None], cols[None]) if rows.ndim == 1 else (rows, cols)
    tokens = patches_lib.order_tokens(x, perm)
    index = jnp.arange(1, n + 1, dtype=jnp.int32)[None]
    inputs = (tokens[:, :-1].astype(self.backbone.dtype), rows[:, :-1], cols[:, :-1],
              index[:, :-1], grid_hw)
    if self.two_stream:
      # Query t carries the position of patch t, the one it predicts.
      out = self.backbone(*inputs, query_rows=rows, query_cols=cols, query_index=index,
                          prepend_sos=True, train=train)
    else:
      out = self.backbone(*inputs, prepend_sos=True, train=train)
    target = normalize_patches(tokens) if self.norm_pix else tokens
    return target, out

  def __call__(self, images, *, train: bool, perm=None, eval_gammas=None):
    """Loss and metrics for a batch (``per_example_loss [B]`` among the metrics).

    ``eval_gammas`` (a fixed 1D grid) replaces the random gamma draws for a
    comparable validation loss: every patch is scored at every grid value with
    noise from the fixed ``noise`` rng the caller passes.
    """
    if self.loss not in LOSSES:
      raise ValueError(f"unknown loss {self.loss!r}; valid: {', '.join(LOSSES)}")
    target, out = self.encode(images, train=train, perm=perm)
    b, n, p = target.shape
    z = out["features"].reshape(b * n, -1)
    if self.loss == "mse":
      pred = self.decoder(z)
      err = jnp.mean(jnp.square(pred - target.reshape(b * n, p)), -1)
      loss = jnp.mean(err)
      return loss, {"loss": loss, "per_example_loss": err.reshape(b, n).mean(1)}
    return self._diffusion_loss(z, target, eval_gammas)

  def _diffusion_loss(self, z, target, eval_gammas):
    if self.predict not in PREDICTION_TARGETS:
      raise ValueError(f"unknown prediction target {self.predict!r}; valid: "
                       f"{', '.join(PREDICTION_TARGETS)}")
    b, n, p = target.shape
    rng_gamma, rng_eps = jax.random.split(self.make_rng("noise"))
    if eval_gammas is None:
      k = self.noise_samples
      gamma = diffusion.sample_gamma(rng_gamma, (b * n, k), self.noise_a, self.noise_b)
    else:
      k = len(eval_gammas)
      gamma = jnp.broadcast_to(jnp.asarray(eval_gammas, jnp.float32), (b * n, k))
    x0 = jnp.repeat(target.reshape(b * n, 1, p), k, axis=1)
    eps = jax.random.normal(rng_eps, x0.shape, jnp.float32)
    x_noisy = diffusion.corrupt(x0, gamma, eps)
    z_k = jnp.repeat(z[:, None], k, axis=1).reshape(b * n * k, -1)
    pred = self.decoder(z_k, x_noisy.reshape(b * n * k, p).astype(z.dtype),
                        gamma.reshape(-1)).reshape(b * n, k, p)
    goal = x0 if self.predict == "x0" else eps
    err = jnp.mean(jnp.square(pred - goal), -1)          # [b*n, k]
    loss = jnp.mean(err)
    metrics = {"loss": loss, "per_example_loss": err.reshape(b, n * k).mean(1)}
    sums, counts = diffusion.gamma_bin_stats(err.reshape(-1), gamma.reshape(-1),
                                             self.gamma_bins)
    for i in range(self.gamma_bins):
      # NaN for an empty bin: the logger averages bins with nanmean.
      metrics[f"loss_gamma_bin_{i:02d}"] = jnp.where(
          counts[i] > 0, sums[i] / jnp.maximum(counts[i], 1), jnp.nan)
    return loss, metrics

  def predict_patches(self, images, *, num_steps: int = 50, temperature: float = 1.0):
    """Teacher-forced next-patch predictions in raster layout ``[B, H, W, C]``.

    Every patch is predicted from the true patches before it. MSE: the
    decoder's output. Diffusion: an ancestral DDPM chain of ``num_steps`` over
    the training schedule's gamma grid, run for all patches at once (they are
    independent given the teacher-forced context). Uses the ``noise`` rng.
    """
    grid_hw = (images.shape[1] // self.patch_size, images.shape[2] // self.patch_size)
    order = self._ordering(grid_hw)
    target, out = self.encode(images, train=False, perm=jnp.asarray(order.perm))
    b, n, p = target.shape
    z = out["features"].reshape(b * n, -1)
    if self.loss == "mse":
      pred = self.decoder(z)
    else:
      grid = jnp.asarray(diffusion.sampling_gamma_grid(num_steps, self.noise_a,
                                                       self.noise_b), jnp.float32)
      rng = self.make_rng("noise")
      x = jax.random.normal(jax.random.fold_in(rng, num_steps), (b * n, p), jnp.float32)

      def step(mdl, carry, i):
        x, z = carry
        g_s, g_prev = grid[i], grid[i + 1]
        g = jnp.full((b * n,), g_s)
        out_ = mdl.decoder(z, x.astype(z.dtype), g)
        x0_hat = out_ if mdl.predict == "x0" else diffusion.x0_from_eps(x, out_, g)
        x = diffusion.ddpm_step(jax.random.fold_in(rng, i), x, x0_hat,
                                g_s, g_prev, temperature)
        return (x, z), None

      # nn.scan (not jax.lax.scan) so the decoder's parameters are lifted into
      # the loop body correctly.
      (pred, _), _ = nn.scan(step, variable_broadcast="params",
                             split_rngs={"params": False})(self, (x, z),
                                                           jnp.arange(num_steps))
    pred = pred.reshape(b, n, p)
    raster = patches_lib.unorder_tokens(pred, jnp.asarray(order.perm))
    return patches_lib.unpatchify(raster, self.patch_size, grid_hw, images.shape[-1])


def darl_from_config(config) -> DARL:
  """Builds the DARL module from ``config.model``, ``config.decoder``, ``config.loss``."""
  backbone, patch = vit_lib.vit_from_config(config.model)
  mlp_impl, norm_impl = backbone.mlp_impl, backbone.norm_impl   # "auto" resolved
  if config.model.get("two_stream", False):
    backbone = two_stream_lib.two_stream_from_vit(backbone)
  loss_cfg = config.loss
  if loss_cfg.kind not in LOSSES:
    raise ValueError(f"unknown loss {loss_cfg.kind!r}; valid: {', '.join(LOSSES)}")
  decoder = decoders_lib.decoder_from_config(
      config.decoder, patch_dim=patch * patch * config.model.get("channels", 3),
      backbone_width=backbone.width, backbone_heads=backbone.num_heads,
      dtype=backbone.dtype, mlp_impl=mlp_impl, norm_impl=norm_impl)
  if decoder.kind == "transformer" and loss_cfg.kind == "mse":
    raise ValueError("decoder.kind='transformer' is a denoising decoder; use it with "
                     "loss.kind='diffusion', or decoder.kind='linear' for MSE")
  patches_lib.make_ordering(config.model.get("ordering", "raster"),
                            config.model.image_size // patch,
                            config.model.image_size // patch,
                            block=config.model.get("ordering_block", 2), seed=0)
  return DARL(
      backbone=backbone, decoder=decoder, patch_size=patch,
      ordering=config.model.get("ordering", "raster"),
      ordering_block=config.model.get("ordering_block", 2),
      ordering_seed=config.get("seed", 0),
      loss=loss_cfg.kind, norm_pix=loss_cfg.get("norm_pix", False),
      noise_a=loss_cfg.get("noise_a", 0.03), noise_b=loss_cfg.get("noise_b", 1.0),
      predict=loss_cfg.get("predict", "x0"),
      noise_samples=loss_cfg.get("noise_samples", 1),
      gamma_bins=loss_cfg.get("gamma_bins", 10))
