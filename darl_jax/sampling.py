"""Autoregressive image completion with a pretrained DARL model (KV-cached).

    images [B, H, W, C], known patches (a raster mask [N] or [B, N])
      -> patchify + the model's ordering        tokens x_0 .. x_{N-1}, positions
      -> prefill: cached backbone over [SOS, x_0 .. x_{m-1}]
         (m = the leading run of known patches in the ordering)
      -> lax.scan over k = m .. N-1, S samples per image batched together:
           z_k   backbone output at sequence position k (it predicts x_k)
           x_k   the given patch if it is known, else drawn from the decoder
                 (decode_patches): diffusion: T ancestral DDPM steps of
                 diffusion.reverse_diffusion from pure noise over the training
                 schedule's gamma grid; mse: the decoder's prediction
           feed x_k at position k + 1: one cached decoding step
      -> unorder + unpatchify                   completions [B, S, H, W, C]

The backbone runs as ``vit.with_cache`` builds it: the same parameters as
training, decoding one token at a time against a key/value cache; positions
(RoPE index, grid row/col, additive encodings) follow the model's ordering
exactly as in training: SOS at index 0 / (0, -1), ordered patch ``k`` at index
``k + 1`` and grid ``(rows[k], cols[k])``.

Known patches after the first unknown one (a mask that is not a prefix in the
ordering, e.g. the left half under raster order) are fed to the backbone as
they are when their turn comes, so later samples condition on them; earlier
samples cannot see them: the model is autoregressive, not an inpainter.

Randomness: patch ``k`` draws its noise from ``fold_in(key, k)`` (its initial
noise and every step's noise), jointly over the ``B * S`` rows, so a run with
the same key, batch shape and a longer known prefix reproduces the later
patches of a shorter one given the same earlier patches.

:func:`predict_patches` (teacher-forced predictions, pretraining's picture)
runs the same :func:`decode_patches` on the training forward pass's features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from darl_jax import diffusion
from darl_jax import objectives
from darl_jax import patches as patches_lib
from darl_jax.models import darl as darl_lib
from darl_jax.models import vit as vit_lib

CONDITIONS = ("top_half", "left_half", "prefix", "none")


# ----------------------------------------------------------------- known masks


def known_mask(condition: str, grid_hw: tuple[int, int], ordering: patches_lib.Ordering,
               prefix_len: int = 0) -> np.ndarray:
  """Which raster patches are given, bool ``[N]``.

  * ``top_half``: patch rows ``< grid_h // 2`` (the paper's samples; with an
    odd number of rows the middle row is generated, e.g. 3 of 7 rows given
    for Fashion-MNIST at patch 4).
  * ``left_half``: patch columns ``< grid_w // 2`` (a mask that is not a
    prefix under raster order).
  * ``prefix``: the first ``prefix_len`` patches of the ordering.
  * ``none``: nothing given (unconditional samples).
  """
  gh, gw = grid_hw
  rows, cols = np.divmod(np.arange(gh * gw), gw)
  if condition == "top_half":
    return rows < gh // 2
  if condition == "left_half":
    return cols < gw // 2
  if condition == "prefix":
    if not 0 <= prefix_len <= gh * gw:
      raise ValueError(f"prefix_len {prefix_len} is outside [0, {gh * gw}] patches")
    mask = np.zeros(gh * gw, bool)
    mask[ordering.perm[:prefix_len]] = True
    return mask
  if condition == "none":
    return np.zeros(gh * gw, bool)
  raise ValueError(f"unknown condition {condition!r}; valid: {', '.join(CONDITIONS)}")


def leading_known(known_ordered: np.ndarray) -> int:
  """Length of the run of known patches that starts every sequence of the batch
  (``known_ordered`` bool ``[B, N]`` in the ordering): the prefill length."""
  known_ordered = np.asarray(known_ordered, bool)
  unknown = ~known_ordered
  first = np.where(unknown.any(1), unknown.argmax(1), known_ordered.shape[1])
  return int(first.min())


# ------------------------------------------------- patches from the decoder


def decode_patches(model: darl_lib.DARL, decoder_params, z: jax.Array, key: jax.Array, *,
                   gammas=None, temperature: float = 1.0, clip: bool = False) -> jax.Array:
  """One patch per row of ``z [M, D]``: float32 ``[M, P]``.

  MSE: the decoder's prediction. Diffusion: :func:`diffusion.reverse_diffusion`
  over ``gammas`` (a sampling grid) from ``key``, the decoder's output read as
  x0 or eps (``model.predict``). ``clip`` clips every x0 estimate (and MSE
  predictions) to the data range [-1, 1], the usual DDPM choice.
  """
  apply = lambda *a: model.decoder.apply({"params": decoder_params}, *a)
  clip_fn = (lambda x: jnp.clip(x, -1.0, 1.0)) if clip else (lambda x: x)
  if model.loss == "mse":
    return clip_fn(apply(z))

  def denoise(x, gamma):
    g = jnp.full((x.shape[0],), gamma, jnp.float32)
    out = apply(z, x.astype(z.dtype), g)
    return clip_fn(out if model.predict == "x0" else diffusion.x0_from_eps(x, out, g))

  return diffusion.reverse_diffusion(denoise, key, (z.shape[0], model.decoder.patch_dim),
                                     gammas, temperature)


def predict_patches(model: darl_lib.DARL, params, images, key: jax.Array, *,
                    num_steps: int = 50, temperature: float = 1.0) -> jax.Array:
  """Teacher-forced next-patch predictions in raster layout ``[B, H, W, C]``.

  Every patch is predicted from the true patches before it in the model's
  configured ordering (pretraining's prediction picture). Diffusion models run
  the chain of :func:`decode_patches` with ``num_steps`` steps over the
  training schedule's grid, for all patches at once: they are independent
  given the teacher-forced context. Nothing is clipped.
  """
  grid_hw = (images.shape[1] // model.patch_size, images.shape[2] // model.patch_size)
  order = model.make_ordering(grid_hw)
  out = model.apply({"params": params}, images, train=False, perm=jnp.asarray(order.perm))
  b, n, p = out["target"].shape
  gammas = None
  if model.loss == "diffusion":
    gammas = diffusion.sampling_gamma_grid(num_steps, model.noise_a, model.noise_b)
  pred = decode_patches(model, params["decoder"], out["z"].reshape(b * n, -1), key,
                        gammas=gammas, temperature=temperature)
  raster = patches_lib.unorder_tokens(pred.reshape(b, n, p), jnp.asarray(order.perm))
  return patches_lib.unpatchify(raster, model.patch_size, grid_hw, images.shape[-1])


# ----------------------------------------------------------------- the sampler


class Sampler:
  """Completes images with a DARL model; see the module docstring.

  Args:
    model: the pretraining module (``darl_from_config``); causal backbone,
      fixed ordering, raw-pixel targets (``norm_pix`` predictions cannot be
      fed back as pixels).
    image_shape: ``(H, W, C)`` of the images to complete.
    num_steps: ``T``, reverse diffusion steps per patch (diffusion models).
    temperature: scale of the noise injected at each reverse step.
    num_samples: ``S`` completions per image, generated in one batch.
    clip: clip x0 estimates (and MSE predictions) to the data range [-1, 1],
      the usual DDPM choice; the models are trained on data in that range.

  ``sampler(params, images, known, key)`` -> ``[B, S, H, W, C]`` float32. The
  whole generation is one jitted program per prefill length; ``params`` is
  the DARL parameter tree (``{"backbone": ..., "decoder": ...}``).
  """

  def __init__(self, model: darl_lib.DARL, image_shape, *, num_steps: int = 1000,
               temperature: float = 1.0, num_samples: int = 1, clip: bool = True):
    h, w, c = image_shape
    p = model.patch_size
    if h % p or w % p:
      raise ValueError(f"image size {h}x{w} is not divisible by patch size {p}")
    if model.norm_pix:
      raise ValueError("sampling needs a model trained on raw pixels: its norm_pix "
                       "predictions lack each patch's mean and scale (loss.norm_pix=True)")
    if not model.backbone.causal:
      raise ValueError("sampling needs a causal backbone (model.causal=True)")
    if getattr(model, "two_stream", False):
      raise ValueError("the KV-cached sampler runs plain causal backbones; two-stream "
                       "(model.two_stream) models are not supported")
    objectives.check_objective(model.loss, model.predict)
    if num_samples < 1:
      raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    self.model = model
    self.image_shape = (h, w, c)
    self.grid_hw = (h // p, w // p)
    self.num_patches = self.grid_hw[0] * self.grid_hw[1]
    self.ordering = model.make_ordering(self.grid_hw)
    self.num_samples = num_samples
    self.temperature = float(temperature)
    self.clip = clip
    self.gammas = None
    if model.loss == "diffusion":
      self.gammas = diffusion.sampling_gamma_grid(num_steps, model.noise_a, model.noise_b)
    # N + 1 positions: SOS and all N patches. The last patch is fed too (its
    # features are never used), which keeps the scan body uniform; it costs
    # one backbone token of N + 1.
    self.backbone = vit_lib.with_cache(model.backbone, cache_len=self.num_patches + 1)
    self._compiled = {}

  # ------------------------------------------------------------- pieces

  def _positions(self, start: int | jax.Array, length: int):
    """rows, cols, index ``[1, length]`` of ordered patches start .. start+length-1."""
    rows = jnp.asarray(self.ordering.rows)
    cols = jnp.asarray(self.ordering.cols)
    k = start + jnp.arange(length)
    return rows[k][None], cols[k][None], (k + 1)[None]

  def prefill(self, backbone_params, tokens: jax.Array):
    """Runs ``[SOS, tokens]`` (``tokens [B, m, P]`` = ordered patches 0..m-1)
    into a fresh cache. Returns ``(z [B, D], cache)``: ``z`` predicts patch m.
    A prefix-causal model (``model.prefix``) reads the known patches as its
    prefix: they attend to each other both ways, as in its pretraining."""
    m = tokens.shape[1]
    rows, cols, index = self._positions(0, m)
    mask = None
    if self.model.prefix != "off":
      # the m + 1 prefilled tokens see each other, and no slot after them
      mask = (jnp.arange(self.backbone.cache_len) <= m)[None, None, None]
    out, variables = self.backbone.apply(
        {"params": backbone_params}, tokens.astype(self.backbone.dtype), rows, cols,
        index, self.grid_hw, prepend_sos=True, mask=mask, mutable=["cache"])
    return out["features"][:, -1], variables["cache"]

  def decode_step(self, backbone_params, cache, patch: jax.Array, k):
    """Feeds ordered patch ``k`` (``patch [B, P]``, ``k`` traced or int) at
    sequence position ``k + 1``. Returns ``(z [B, D], cache)``: ``z`` predicts
    patch ``k + 1``."""
    rows, cols, index = self._positions(k, 1)
    out, variables = self.backbone.apply(
        {"params": backbone_params, "cache": cache},
        patch[:, None].astype(self.backbone.dtype), rows, cols, index, self.grid_hw,
        prepend_sos=False, mutable=["cache"])
    return out["features"][:, 0], variables["cache"]

  def sample_patch(self, decoder_params, z: jax.Array, key: jax.Array) -> jax.Array:
    """One patch per row of ``z [M, D]``: ``[M, P]`` float32."""
    return decode_patches(self.model, decoder_params, z, key, gammas=self.gammas,
                          temperature=self.temperature, clip=self.clip)

  def generate_tokens(self, params, tokens: jax.Array, known: jax.Array, key: jax.Array,
                      prefill_len: int) -> jax.Array:
    """Ordered tokens ``[B, N, P]`` + known ``[B, N]`` (ordered; the first
    ``prefill_len`` all known) -> ``[B * S, N, P]`` (row ``b * S + s``).
    Traceable; ``prefill_len`` is static."""
    b, n, _ = tokens.shape
    s = self.num_samples
    bparams = vit_lib.unscan_params(params["backbone"], self.backbone.depth)
    z, cache = self.prefill(bparams, tokens[:, :prefill_len])
    # The prefix is shared by the S samples of an image: prefill once, copy.
    rep = lambda a: jnp.repeat(a, s, axis=0) if a.ndim else a
    z, cache, tokens, known = (jax.tree_util.tree_map(rep, t)
                               for t in (z, cache, tokens, known))

    def body(carry, k):
      cache, z = carry
      given = tokens[:, k]
      # Skip the decoder when the whole batch knows patch k (e.g. the right
      # half of a mask); otherwise sample and keep the given patches.
      x = jax.lax.cond(
          jnp.all(known[:, k]), lambda: given,
          lambda: jnp.where(known[:, k, None], given,
                            self.sample_patch(params["decoder"], z,
                                              jax.random.fold_in(key, k))))
      z, cache = self.decode_step(bparams, cache, x, k)
      return (cache, z), x

    _, generated = jax.lax.scan(body, (cache, z), jnp.arange(prefill_len, n))
    return jnp.concatenate([tokens[:, :prefill_len],
                            jnp.swapaxes(generated, 0, 1).astype(tokens.dtype)], 1)

  # ------------------------------------------------------------- entry point

  def _complete(self, params, images, known, key, prefill_len):
    b = images.shape[0]
    tokens = patches_lib.order_tokens(
        patches_lib.patchify(images.astype(jnp.float32), self.model.patch_size),
        self.ordering.perm)
    out = self.generate_tokens(params, tokens, known, key, prefill_len)
    raster = patches_lib.order_tokens(out, self.ordering.inverse)
    h, w, c = self.image_shape
    imgs = patches_lib.unpatchify(raster, self.model.patch_size, self.grid_hw, c)
    return imgs.reshape(b, self.num_samples, h, w, c)

  def __call__(self, params, images, known, key, prefill_len: int | None = None
               ) -> jax.Array:
    """Completes ``images [B, H, W, C]`` in [-1, 1].

    ``known``: bool raster mask ``[N]`` (shared) or ``[B, N]`` (see
    :func:`known_mask`); given patches are copied bit-exactly into every
    completion. ``prefill_len`` (default: the whole leading run of known
    patches) may be set lower: the remaining known patches are then fed one at
    a time like any given patch, with the same result, and every mask with the
    same ``prefill_len`` shares one compiled program. Returns
    ``[B, S, H, W, C]`` float32.
    """
    images = jnp.asarray(images)
    if tuple(images.shape[1:]) != self.image_shape:
      raise ValueError(f"images of shape {images.shape[1:]} do not match the "
                       f"sampler's {self.image_shape}")
    known = np.broadcast_to(np.asarray(known, bool), (images.shape[0], self.num_patches))
    known_ordered = known[:, self.ordering.perm]
    m = leading_known(known_ordered)
    if prefill_len is not None:
      if not 0 <= prefill_len <= m:
        raise ValueError(f"prefill_len {prefill_len} must be in [0, {m}], the leading "
                         "run of known patches in the ordering")
      m = prefill_len
    if m not in self._compiled:
      self._compiled[m] = jax.jit(
          lambda p, x, kn, k, m=m: self._complete(p, x, kn, k, m))
    return self._compiled[m](params, images, jnp.asarray(known_ordered), key)
