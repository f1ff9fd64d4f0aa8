"""The raw-pixel linear classifier: the floor under every probe table.

A representation that a linear read-out reads worse than the pixels
themselves shows nothing, so the downstream tables (docs/STUDIES.md) carry
this comparator, computed on the same train / validation split as the
studies' stages (the data sources of darl_jax/data, no augmentation):

- multinomial logistic regression (softmax cross-entropy + L2) on pixels
  standardised with the training split's per-pixel mean and deviation,
  fitted full-batch with L-BFGS (optax);
- closed-form ridge regression on one-hot targets (the ridge probe's method,
  applied to pixels);
- the kNN classifier of train/jobs/knn.py on the raw pixels in [0, 1] (cosine
  similarity, the k most similar training images vote exp(similarity / T),
  T = 0.07, k = 10, 20, 100, 200): the comparator of the kNN rows, which
  train nothing either, so a trained logistic regression is not their
  like-for-like floor.

Each L2 strength (not kNN's: nothing is chosen there) is chosen from a log grid on the last tenth of the training
split (fitted on the other nine tenths); the chosen one is refitted on the
whole training split and scored once on validation, which therefore plays no
part in the choice.

  python -m darl_jax.studies.pixels --data_path=/usr/share/datasets/fashion-mnist \
      --out=reports/studies/fmnist_long/pixels.json

A few minutes on two CPU cores for Fashion-MNIST; no accelerator needed.
"""

from __future__ import annotations

import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app, flags

from darl_jax import files
from darl_jax.data import registry

LOGISTIC_L2 = (1e-5, 1e-4, 1e-3, 1e-2)
RIDGE_L2 = (1.0, 10.0, 100.0, 1e3, 1e4, 1e5)
HOLDOUT = 0.1
KNN_KS = (10, 20, 100, 200)      # train/jobs/knn.py's defaults
KNN_TEMPERATURE = 0.07


def load(data: ml_collections.ConfigDict, split: str) -> tuple[np.ndarray, np.ndarray]:
  """All of ``split`` as (float32 pixels [n, h*w*c] in [0, 1], int labels [n])."""
  source = registry.build_source(data, split=split, seed=0)
  xs, ys = [], []
  for batch in source.eval_batches(1024):
    keep = np.asarray(batch["mask"], bool)
    xs.append(np.asarray(batch["image"])[keep].reshape(int(keep.sum()), -1))
    ys.append(np.asarray(batch["label"])[keep])
  return np.concatenate(xs).astype(np.float32) / 255.0, np.concatenate(ys).astype(np.int32)


def standardise(train: np.ndarray, *others: np.ndarray) -> list[np.ndarray]:
  """Per-pixel standardisation with the training rows' statistics (constant
  pixels, e.g. always-black borders, keep deviation 1)."""
  mean, std = train.mean(0), train.std(0)
  std = np.where(std < 1e-6, 1.0, std)
  return [(x - mean) / std for x in (train, *others)]


def _objective(params, x, y, l2):
  logits = x @ params["w"] + params["b"]
  ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
  return ce + 0.5 * l2 * jnp.sum(params["w"] ** 2)


@functools.partial(jax.jit, static_argnames=("iters", "num_classes"))
def fit_logistic(x, y, l2, *, num_classes: int, iters: int = 300):
  """The L2-regularised softmax regression's parameters, by ``iters`` L-BFGS
  steps (zoom line search) from zero."""
  params = {"w": jnp.zeros((x.shape[1], num_classes)), "b": jnp.zeros((num_classes,))}
  loss = functools.partial(_objective, x=x, y=y, l2=l2)
  opt = optax.lbfgs()
  value_and_grad = optax.value_and_grad_from_state(loss)

  def step(carry, _):
    params, state = carry
    value, grad = value_and_grad(params, state=state)
    updates, state = opt.update(grad, state, params, value=value, grad=grad, value_fn=loss)
    return (optax.apply_updates(params, updates), state), None

  (params, _), _ = jax.lax.scan(step, (params, opt.init(params)), None, length=iters)
  return params


def logistic_accuracy(params, x, y) -> float:
  return float(np.mean(np.argmax(x @ np.asarray(params["w"]) + np.asarray(params["b"]), -1)
                       == y))


def fit_ridge(x, y, l2, num_classes: int) -> np.ndarray:
  """Closed-form ridge on one-hot targets, with a bias column (not penalised)."""
  xb = np.concatenate([x, np.ones((len(x), 1), x.dtype)], 1).astype(np.float64)
  gram = xb.T @ xb
  reg = l2 * np.eye(len(gram))
  reg[-1, -1] = 0.0
  return np.linalg.solve(gram + reg, xb.T @ np.eye(num_classes)[y])


def ridge_accuracy(w, x, y) -> float:
  xb = np.concatenate([x, np.ones((len(x), 1), x.dtype)], 1)
  return float(np.mean(np.argmax(xb @ w, -1) == y))


def knn_predict(x_train, y_train, x_test, ks=KNN_KS, temperature: float = KNN_TEMPERATURE,
                chunk: int = 256) -> dict[int, np.ndarray]:
  """``{k: predicted class [n_test]}`` of the weighted kNN classifier,
  train/jobs/knn.py's rule in NumPy: rows L2-normalised, cosine similarity in
  float64, the k most similar training rows (equal similarities: the earlier
  row first) vote ``exp(similarity / temperature)``, the largest vote wins
  (ties: the lower class); k beyond the training rows takes them all.
  ``chunk`` test rows at a time bound the memory (chunk x training rows)."""
  unit = lambda x: x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
  a, b = unit(np.asarray(x_train, np.float64)), unit(np.asarray(x_test, np.float64))
  num_classes = int(np.max(y_train)) + 1
  top = min(max(ks), len(a))
  out = {k: [] for k in ks}
  for start in range(0, len(b), chunk):
    sim = b[start:start + chunk] @ a.T
    order = np.argsort(-sim, axis=1, kind="stable")[:, :top]    # stable: earlier row first
    weight = np.exp(np.take_along_axis(sim, order, 1) / temperature)
    onehot = np.eye(num_classes)[np.asarray(y_train)[order]]    # [rows, top, classes]
    for k in ks:
      votes = np.einsum("rk,rkc->rc", weight[:, :k], onehot[:, :k])
      out[k].append(np.argmax(votes, 1))                        # lower class on ties
  return {k: np.concatenate(v) for k, v in out.items()}


def knn_accuracy(x_train, y_train, x_test, y_test, ks=KNN_KS,
                 temperature: float = KNN_TEMPERATURE) -> dict[int, float]:
  """``{k: accuracy}`` of ``knn_predict``."""
  pred = knn_predict(x_train, y_train, x_test, ks, temperature)
  return {k: float(np.mean(p == np.asarray(y_test))) for k, p in pred.items()}


def choose(fit, score, grid, x, y):
  """(best l2, {l2: held-out accuracy}): fitted on the first 90% of the
  training rows, scored on the last 10%."""
  cut = int(round(len(x) * (1 - HOLDOUT)))
  scores = {l2: score(fit(x[:cut], y[:cut], l2), x[cut:], y[cut:]) for l2 in grid}
  return max(grid, key=lambda l2: scores[l2]), scores


def evaluate(data: ml_collections.ConfigDict, *, iters: int = 300) -> dict:
  """Both classifiers on ``data``'s training split, scored on its validation split."""
  start = time.time()
  x_train, y_train = load(data, "train")
  x_val, y_val = load(data, "validation")
  knn = knn_accuracy(x_train, y_train, x_val, y_val)       # raw [0, 1] pixels
  x_train, x_val = standardise(x_train, x_val)
  k = int(max(y_train.max(), y_val.max())) + 1
  logistic = lambda x, y, l2: fit_logistic(x, y, l2, num_classes=k, iters=iters)
  ridge = lambda x, y, l2: fit_ridge(x, y, l2, k)
  out = {"data": data.name, "train_examples": len(x_train), "val_examples": len(x_val)}
  for name, fit, score, grid in (("logistic", logistic, logistic_accuracy, LOGISTIC_L2),
                                 ("ridge", ridge, ridge_accuracy, RIDGE_L2)):
    l2, held_out = choose(fit, score, grid, x_train, y_train)
    out[name] = {"l2": l2, "held_out_accuracy": {str(g): a for g, a in held_out.items()},
                 "val_accuracy": score(fit(x_train, y_train, l2), x_val, y_val)}
  out["knn"] = {"temperature": KNN_TEMPERATURE,
                "val_accuracy": {str(k): a for k, a in knn.items()}}
  out["seconds"] = round(time.time() - start, 1)
  return out


_DATA = flags.DEFINE_string("data", "fashion_mnist", "Data source name (darl_jax/data).")
_PATH = flags.DEFINE_string("data_path", None, "Where the data lives (data.path).")
_SIZE = flags.DEFINE_integer("image_size", 28, "Image side the studies use.")
_OUT = flags.DEFINE_string("out", None, "JSON file to write (also printed).")
_ITERS = flags.DEFINE_integer("iters", 300, "L-BFGS steps per fit.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  data = ml_collections.ConfigDict({"name": _DATA.value, "image_size": _SIZE.value,
                                    "channels": 1, "augment": "none"})
  if _PATH.value:
    data.path = _PATH.value
  result = evaluate(data, iters=_ITERS.value)
  result["command"] = "python -m darl_jax.studies.pixels " + " ".join(sys.argv[1:])
  print(json.dumps(result, indent=1))
  if _OUT.value:
    files.write_json_atomic(_OUT.value, result, indent=1)


if __name__ == "__main__":
  app.run(main)
