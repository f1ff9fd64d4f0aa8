"""The raw-pixel linear classifier (darl_jax/studies/pixels.py) on scikit-learn's digits."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from darl_jax.studies import pixels

DIGITS = ml_collections.ConfigDict({"name": "digits", "image_size": 8, "channels": 1,
                                    "augment": "none"})


def test_both_classifiers_read_digits_from_pixels_far_above_chance():
  result = pixels.evaluate(DIGITS, iters=100)
  assert result["train_examples"] > 1000 and result["val_examples"] > 100
  assert result["logistic"]["val_accuracy"] > 0.9
  assert result["ridge"]["val_accuracy"] > 0.85
  assert result["logistic"]["l2"] in pixels.LOGISTIC_L2
  assert result["ridge"]["l2"] in pixels.RIDGE_L2


def test_lbfgs_reaches_the_regularised_optimum():
  x, y = pixels.load(DIGITS, "train")
  (x,) = pixels.standardise(x)
  l2 = 1e-3
  params = pixels.fit_logistic(jnp.asarray(x), jnp.asarray(y), l2, num_classes=10, iters=200)
  grad = jax.grad(pixels._objective)(params, x, y, l2)
  assert float(optax.tree.norm(grad)) < 1e-4


def test_ridge_is_the_normal_equations_solution():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(50, 4)).astype(np.float32)
  y = rng.integers(0, 3, 50)
  w = pixels.fit_ridge(x, y, 2.0, 3)
  xb = np.concatenate([x, np.ones((50, 1))], 1)
  residual_grad = xb.T @ (xb @ w - np.eye(3)[y]) + 2.0 * np.concatenate([w[:-1], 0 * w[-1:]])
  np.testing.assert_allclose(residual_grad, 0.0, atol=1e-8)


def test_the_l2_choice_never_sees_the_validation_labels(monkeypatch):
  original = pixels.load

  def shuffled(data, split):
    x, y = original(data, split)
    return (x, np.roll(y, 1)) if split == "validation" else (x, y)

  honest = pixels.evaluate(DIGITS, iters=50)
  monkeypatch.setattr(pixels, "load", shuffled)
  broken = pixels.evaluate(DIGITS, iters=50)
  for name in ("logistic", "ridge"):
    assert broken[name]["l2"] == honest[name]["l2"]
    assert broken[name]["held_out_accuracy"] == honest[name]["held_out_accuracy"]
    assert broken[name]["val_accuracy"] < honest[name]["val_accuracy"] - 0.5
