"""Label smoothing, mixup and cutmix, on device inside the jitted loss.

The fine-tuning and supervised recipes of the paper (appendix tables "ImageNet
Fine-tuning Hyperparameters" and "ImageNet Supervised Training
Hyperparameters") use mixup 0.8, cutmix 1.0 and label smoothing 0.1, the
MAE/DeiT recipe. Mixing needs a second image per example, so it is a batch-level
operation; we run it on device from the step's rng rather than on the host:

* it is free next to the forward pass (one ``where`` per pixel),
* it is a pure function of ``(seed, step)`` like everything else in a step, so a
  resumed run mixes exactly as an uninterrupted one,
* the host pipeline stays per-example (RandAugment, crops).

Conventions follow timm's ``Mixup`` in its default "batch" mode: one mixing
coefficient per batch, the partner of example ``i`` is example ``B - 1 - i``
(the batch reversed), cutmix is chosen with probability ``switch_prob`` when
both are enabled, and the cutmix coefficient is recomputed from the clipped
box area. Targets are smoothed before mixing, so a mixed target is
``lam * smooth(y_i) + (1 - lam) * smooth(y_partner)`` and still sums to 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def smooth_labels(labels: jax.Array, num_classes: int, smoothing: float) -> jax.Array:
  """int labels ``[B]`` -> float32 targets ``[B, K]``.

  The true class gets ``1 - smoothing + smoothing / K``, every other class
  ``smoothing / K`` (the "uniform" label smoothing of Szegedy et al.; rows sum
  to 1).
  """
  one_hot = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)
  return one_hot * (1.0 - smoothing) + smoothing / num_classes


def cutmix_box(rng: jax.Array, height: int, width: int, lam: jax.Array):
  """A box covering about ``1 - lam`` of the image, centre uniform, clipped.

  Returns ``(mask [H, W] bool, lam_adjusted)``: mask True inside the box (the
  pixels taken from the partner), ``lam_adjusted = 1 - box_area / (H * W)``
  after clipping at the image border.
  """
  ratio = jnp.sqrt(1.0 - lam)
  cut_h = jnp.round(height * ratio)
  cut_w = jnp.round(width * ratio)
  ry, rx = jax.random.split(rng)
  cy = jax.random.randint(ry, (), 0, height).astype(jnp.float32)
  cx = jax.random.randint(rx, (), 0, width).astype(jnp.float32)
  y0 = jnp.clip(cy - cut_h // 2, 0, height)
  y1 = jnp.clip(cy + cut_h // 2, 0, height)
  x0 = jnp.clip(cx - cut_w // 2, 0, width)
  x1 = jnp.clip(cx + cut_w // 2, 0, width)
  ys = jnp.arange(height, dtype=jnp.float32)[:, None]
  xs = jnp.arange(width, dtype=jnp.float32)[None, :]
  mask = (ys >= y0) & (ys < y1) & (xs >= x0) & (xs < x1)
  lam_adjusted = 1.0 - (y1 - y0) * (x1 - x0) / (height * width)
  return mask, lam_adjusted


def mix_batch(rng: jax.Array, images: jax.Array, targets: jax.Array, *,
              mixup_alpha: float = 0.8, cutmix_alpha: float = 1.0,
              switch_prob: float = 0.5, prob: float = 1.0):
  """Mixup or cutmix of a batch with its reverse.

  Args:
    rng: the step's key for mixing.
    images: ``[B, H, W, C]``.
    targets: soft targets ``[B, K]`` (rows sum to 1, e.g. ``smooth_labels``).
    mixup_alpha: Beta(a, a) parameter of mixup; 0 disables mixup.
    cutmix_alpha: Beta(a, a) parameter of cutmix; 0 disables cutmix.
    switch_prob: probability of cutmix when both are enabled.
    prob: probability that a batch is mixed at all.

  Returns:
    ``(images, targets, lam)``: mixed images ``[B, H, W, C]`` (same dtype),
    mixed targets ``[B, K]`` (rows still sum to 1), and the coefficient of the
    original example (1.0 for an unmixed batch).
  """
  if mixup_alpha <= 0 and cutmix_alpha <= 0:
    return images, targets, jnp.ones((), jnp.float32)
  r_apply, r_switch, r_mix, r_cut, r_box = jax.random.split(rng, 5)
  _, h, w, _ = images.shape
  partner_images = images[::-1]
  partner_targets = targets[::-1]

  lam_mixup = (jax.random.beta(r_mix, mixup_alpha, mixup_alpha) if mixup_alpha > 0
               else jnp.ones(()))
  lam_cutmix = (jax.random.beta(r_cut, cutmix_alpha, cutmix_alpha) if cutmix_alpha > 0
                else jnp.ones(()))
  if mixup_alpha > 0 and cutmix_alpha > 0:
    use_cutmix = jax.random.uniform(r_switch) < switch_prob
  else:
    use_cutmix = jnp.asarray(cutmix_alpha > 0)
  box, lam_box = cutmix_box(r_box, h, w, lam_cutmix)
  apply = jax.random.uniform(r_apply) < prob

  mixed_up = lam_mixup * images + (1.0 - lam_mixup) * partner_images
  cut = jnp.where(box[None, :, :, None], partner_images, images)
  lam = jnp.where(use_cutmix, lam_box, lam_mixup).astype(jnp.float32)
  out = jnp.where(use_cutmix, cut, mixed_up.astype(images.dtype))
  out = jnp.where(apply, out, images)
  lam = jnp.where(apply, lam, 1.0)
  mixed_targets = lam * targets + (1.0 - lam) * partner_targets
  return out, mixed_targets, lam


def soft_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Per-example cross entropy ``[B]`` of float32 logits against soft targets ``[B, K]``."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(targets * logp, axis=-1)
