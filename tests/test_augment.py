"""RandAugment (host, numpy), mixup / cutmix / label smoothing (device, jax)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import mixup
from darl_jax.data.sources import digits
from darl_jax.data.transforms import randaugment


def _images(n=16, size=12, channels=3, seed=0):
  """Smooth random images in [-1, 1] (a gradient plus noise, so every op acts)."""
  rng = np.random.default_rng(seed)
  ramp = np.linspace(-0.8, 0.8, size, dtype=np.float32)
  base = ramp[None, :, None, None] * rng.uniform(0.5, 1, (n, 1, 1, channels))
  noise = rng.uniform(-0.2, 0.2, (n, size, size, channels))
  return np.clip(base + noise, -1, 1).astype(np.float32)


# ------------------------------------------------------------------ RandAugment


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("op", randaugment.OPS)
def test_every_op_gives_valid_images(op, channels):
  x = (_images(channels=channels) + 1) * 127.5
  level = np.full(len(x), 0.9, np.float32)
  sign = np.where(np.arange(len(x)) % 2, 1.0, -1.0)
  out = np.clip(randaugment.OP_FNS[op](x, level, sign), 0, 255)
  assert out.shape == x.shape and np.isfinite(out).all()
  if op == "color" and channels == 1:
    np.testing.assert_array_equal(out, x)      # saturation of gray is a no-op
  elif op not in ("equalize", "auto_contrast"):
    assert np.abs(out - x).mean() > 0.5, f"{op} did nothing at magnitude 9"


def test_geometric_ops_are_identity_at_level_zero():
  x = (_images(channels=3) + 1) * 127.5
  zero, sign = np.zeros(len(x), np.float32), np.ones(len(x))
  for op in ("rotate", "shear_x", "shear_y", "translate_x", "translate_y"):
    np.testing.assert_allclose(randaugment.OP_FNS[op](x, zero, sign), x, atol=1e-3)


def test_equalize_flattens_the_histogram():
  x = np.repeat(np.linspace(100, 140, 64, dtype=np.float32).reshape(1, 8, 8, 1), 2, 0)
  out = randaugment.equalize(x, None, None)
  assert out.min() == 0 and out.max() == 255          # 40 grey levels spread over 0..255


def test_rand_augment_is_a_function_of_seed_and_position():
  x = np.rint((_images(n=32) + 1) * 127.5).astype(np.uint8)     # uint8, as batches are
  pos = np.arange(100, 132)
  a = randaugment.rand_augment(x, 3, pos)
  b = randaugment.rand_augment(x, 3, pos)
  np.testing.assert_array_equal(a, b)
  assert a.shape == x.shape and a.dtype == np.uint8
  changed = np.abs(a.astype(int) - x).reshape(32, -1).max(1) > 0
  assert 0.3 < changed.mean() <= 1.0       # 2 ops at p = 0.5: ~75% of images change
  c = randaugment.rand_augment(x, 3, pos + 1000)
  assert not np.array_equal(a, c)
  np.testing.assert_array_equal(randaugment.rand_augment(x, 3, pos, prob=0.0), x)


def test_rand_augment_source_resumes_and_leaves_eval_alone():
  class Cfg:
    image_size, channels, augment = 8, 1, "none"
  base = digits.build(Cfg, split="train", seed=0)
  src = randaugment.RandAugmentSource(base, seed=0)
  stream = src.train_batches(16)
  batches = [next(stream) for _ in range(4)]
  resumed = next(src.train_batches(16, start_step=3))
  np.testing.assert_array_equal(resumed["image"], batches[3]["image"])
  plain = next(base.train_batches(16, start_step=3))
  np.testing.assert_array_equal(resumed["label"], plain["label"])
  assert not np.array_equal(resumed["image"], plain["image"])
  e1, e2 = next(src.eval_batches(16)), next(base.eval_batches(16))
  np.testing.assert_array_equal(e1["image"], e2["image"])
  # Two processes of 8 rows see the rows of the one-process batch of 16.
  halves = [next(src.train_batches(16, start_step=3, process_index=p, process_count=2))
            for p in (0, 1)]
  np.testing.assert_allclose(np.concatenate([h["image"] for h in halves]),
                             resumed["image"], atol=1e-6)


def test_unknown_op_is_rejected():
  with pytest.raises(ValueError, match="unknown RandAugment ops"):
    randaugment.rand_augment(_images(n=2), 0, np.arange(2), ops=("rotate", "invertt"))


# --------------------------------------------------------- mixup and smoothing


def test_label_smoothing_rows_sum_to_one():
  t = mixup.smooth_labels(jnp.asarray([0, 3, 9]), 10, 0.1)
  np.testing.assert_allclose(t.sum(-1), 1.0, atol=1e-6)
  np.testing.assert_allclose(t[1, 3], 0.9 + 0.01, atol=1e-6)
  np.testing.assert_allclose(t[1, 0], 0.01, atol=1e-7)


@pytest.mark.parametrize("mode", ["mixup", "cutmix", "both"])
def test_mixed_batches_are_valid_and_targets_sum_to_one(mode):
  alphas = {"mixup": (0.8, 0.0), "cutmix": (0.0, 1.0), "both": (0.8, 1.0)}[mode]
  images = jnp.asarray(_images(n=8, size=16))
  targets = mixup.smooth_labels(jnp.arange(8) % 5, 5, 0.1)
  fn = jax.jit(lambda r: mixup.mix_batch(r, images, targets, mixup_alpha=alphas[0],
                                         cutmix_alpha=alphas[1]))
  seen_cut = seen_mix = False
  for s in range(8):
    out, mixed, lam = fn(jax.random.PRNGKey(s))
    lam = float(lam)
    assert out.shape == images.shape and 0.0 <= lam <= 1.0
    assert float(out.min()) >= -1 - 1e-6 and float(out.max()) <= 1 + 1e-6
    np.testing.assert_allclose(mixed.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(mixed, lam * targets + (1 - lam) * targets[::-1], atol=1e-6)
    from_self = np.isclose(out, images).all(-1)
    from_partner = np.isclose(out, images[::-1]).all(-1)
    if (from_self | from_partner).all():     # cutmix: every pixel from one side
      seen_cut = True
      np.testing.assert_allclose(from_self[0].mean(), lam, atol=1e-6)
    else:                                    # mixup: the convex combination
      seen_mix = True
      np.testing.assert_allclose(out, lam * images + (1 - lam) * images[::-1], atol=1e-5)
  assert seen_cut == (alphas[1] > 0) and seen_mix == (alphas[0] > 0)


def test_mixing_off_returns_the_batch():
  images = jnp.asarray(_images(n=4))
  targets = mixup.smooth_labels(jnp.arange(4), 4, 0.0)
  out, mixed, lam = mixup.mix_batch(jax.random.PRNGKey(0), images, targets,
                                    mixup_alpha=0.0, cutmix_alpha=0.0)
  assert out is images and mixed is targets and float(lam) == 1.0
