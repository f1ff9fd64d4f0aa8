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


def _knn_by_loops(x_train, y_train, x_test, k, temperature):
  """One test row at a time, as the rule reads: cosine similarity, the k
  most similar (earlier row first on equal similarity) vote exp(sim / T)."""
  out = []
  for row in x_test:
    sims = [float(np.dot(row, t) / (np.linalg.norm(row) * np.linalg.norm(t)))
            for t in x_train]
    nearest = sorted(range(len(sims)), key=lambda i: (-sims[i], i))[:k]
    votes = np.zeros(int(y_train.max()) + 1)
    for i in nearest:
      votes[y_train[i]] += np.exp(sims[i] / temperature)
    out.append(int(np.argmax(votes)))
  return np.asarray(out)


def test_pixel_knn_equals_the_rule_read_row_by_row():
  rng = np.random.default_rng(0)
  # Small integer pixels: many exactly equal similarities (duplicated and
  # scaled rows), so the tie rules decide; k = 50 is more than the rows.
  x_train = rng.integers(0, 3, size=(40, 6)).astype(np.float32)
  x_train[10:20] = x_train[:10]
  x_train[20:25] = 2 * x_train[:5]
  y_train = rng.integers(0, 4, 40)
  x_test = rng.integers(0, 3, size=(23, 6)).astype(np.float32)
  x_test[x_test.sum(1) == 0, 0] = 1.0                  # no all-zero rows
  x_train[x_train.sum(1) == 0, 1] = 1.0
  y_test = rng.integers(0, 4, 23)
  ks = (1, 3, 10, 50)
  got = pixels.knn_predict(x_train, y_train, x_test, ks=ks, temperature=0.5, chunk=7)
  for k in ks:
    np.testing.assert_array_equal(got[k], _knn_by_loops(x_train, y_train, x_test, k, 0.5))
  # The tie rule decides here: the later of equal rows first predicts otherwise.
  flipped = _knn_by_loops(x_train[::-1], y_train[::-1], x_test, 1, 0.5)
  assert (flipped != got[1]).any()
  acc = pixels.knn_accuracy(x_train, y_train, x_test, y_test, ks=ks, temperature=0.5)
  assert acc == {k: float(np.mean(got[k] == y_test)) for k in ks}


def test_pixel_knn_reads_digits_far_above_chance():
  x, y = pixels.load(DIGITS, "train")
  xv, yv = pixels.load(DIGITS, "validation")
  acc = pixels.knn_accuracy(x, y, xv, yv, ks=(20,))
  assert acc[20] > 0.9
