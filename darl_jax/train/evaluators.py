"""Evaluators of frozen features that pretraining runs and the jobs share.

Two evaluators, each enabled by its own config section of a pretraining run
(train/trainers/pretrain.py's ``extra_eval``): ``RidgeProbe``
(``config.probe_eval``; ``val_probe_accuracy``), closed-form ridge regression
on frozen, mean-pooled final features, and ``FewShotEval``
(``config.fewshot_eval``; ``val_fewshot_<k>shot``), which the ``fewshot`` job
(train/jobs/fewshot.py) also runs on a checkpoint's features.

Few-shot linear classification of frozen features, as big_vision evaluates:

    support features (k shots per class, one draw per seed) -> whitening ->
    ridge regression onto one-hot targets in {-1, +1} -> argmax on a fixed query set

The protocol of big_vision's few-shot evaluator: features standardised per
dimension with the support set's mean and standard deviation, targets
``2 * one_hot - 1``, closed-form L2-regularised least squares, accuracy of
the argmax on the query set; shots 1 / 5 / 10 / 25 per class, 3 seeds
(support draws). Each seed ``s`` draws the support set with
``default_rng(s)``: a random order of every class's examples in the pool,
whose first ``k`` are the ``k``-shot support set (so the sets of one seed
are nested, as big_vision's are). The draws depend on nothing else, so
every evaluation of a run (and the downstream job on any of its
checkpoints) scores the same support and query sets.

Intercept. big_vision appends a large constant feature (so its weight is
almost unregularised); here the intercept is left out of the penalty
exactly: the features are centred and the intercept is the targets' mean.

L2 strength. big_vision fixes it (``l2_reg = 2 ** 10`` in its configs) and
keeps the solver fast for many strengths. A fixed strength suits one
feature scale and one support size; here it is chosen per fit from
``l2_grid`` by leave-one-out accuracy on the support set itself, which
ridge regression gives in closed form (the prediction for example ``i``
with ``i`` left out is ``(f_i - h_ii y_i) / (1 - h_ii)``, ``H`` the hat
matrix), so the query set never takes part in the choice and no support
example is spent on a held-out part (a 1-shot set has none to spare).
Ties go to the strongest strength. With one shot, leaving an example out
leaves its class without examples, so leave-one-out says nothing: the
strongest strength of the grid is used (towards which ridge regression on
whitened features becomes a nearest-class-mean classifier).
"""

from __future__ import annotations

import jax
import numpy as np

from darl_jax import data as data_lib
from darl_jax import sharding as sharding_lib
from darl_jax.models import vit as vit_lib
from darl_jax.train import backbone as backbone_lib
from darl_jax.train import fit


# ------------------------------------------------------------------ the fit


def support_indices(labels: np.ndarray, num_classes: int, shots: int, seed: int) -> np.ndarray:
  """Indices of ``shots`` examples of every class in ``labels`` (the pool),
  drawn by ``seed``; the ``k``-shot set of a seed is the start of its
  ``k' > k``-shot set. A class with fewer than ``shots`` examples is an error."""
  rng = np.random.default_rng(seed)
  labels = np.asarray(labels)
  out = []
  for c in range(num_classes):
    members = np.flatnonzero(labels == c)
    if len(members) < shots:
      raise ValueError(f"the few-shot pool holds {len(members)} example(s) of class {c}, "
                       f"fewer than {shots} shots; raise fewshot_eval.num_support_examples "
                       "or lower fewshot_eval.shots")
    out.append(rng.permutation(members)[:shots])
  return np.concatenate(out)


def ridge_path(feats, labels, num_classes: int, l2_grid) -> list[dict]:
  """Ridge fits of ``{-1, +1}`` one-hot targets on whitened ``feats [n, D]``,
  one per strength of ``l2_grid``: ``[{l2, mean, std, w [D, K], b [K],
  loo_accuracy}]`` (float64). One SVD serves every strength."""
  x = np.asarray(feats, np.float64)
  labels = np.asarray(labels)
  n = x.shape[0]
  mean, std = x.mean(0), x.std(0) + 1e-5
  z = (x - mean) / std                         # centred: the intercept is unpenalised
  y = 2.0 * np.eye(num_classes)[labels] - 1.0
  bias = y.mean(0)
  u, s, vt = np.linalg.svd(z, full_matrices=False)
  uty = u.T @ (y - bias)
  fits = []
  for l2 in l2_grid:
    shrink = s ** 2 / (s ** 2 + l2)
    w = vt.T @ ((s / (s ** 2 + l2))[:, None] * uty)
    fitted = bias + u @ (shrink[:, None] * uty)
    hat = 1.0 / n + (u ** 2) @ shrink          # diag of the hat matrix, intercept included
    loo = (fitted - hat[:, None] * y) / np.maximum(1.0 - hat, 1e-12)[:, None]
    fits.append({"l2": float(l2), "mean": mean, "std": std, "w": w, "b": bias,
                 "loo_accuracy": float(np.mean(np.argmax(loo, -1) == labels))})
  return fits


def choose_fit(fits: list[dict], shots: int) -> dict:
  """The fit of the best leave-one-out accuracy, ties to the strongest
  strength; with one shot the strongest (see the module docstring)."""
  by_strength = sorted(fits, key=lambda f: f["l2"], reverse=True)
  if shots <= 1:
    return by_strength[0]
  return max(by_strength, key=lambda f: f["loo_accuracy"])   # max keeps the first of ties


def predict(fit: dict, feats) -> np.ndarray:
  z = (np.asarray(feats, np.float64) - fit["mean"]) / fit["std"]
  return np.argmax(z @ fit["w"] + fit["b"], -1)


def fewshot_scores(pool_feats, pool_labels, query_feats, query_labels, num_classes: int,
                   shots, num_seeds: int, l2_grid) -> dict:
  """Accuracy per shot count and seed: ``{k: {"accuracy": [per seed], "l2":
  [chosen per seed], "mean", "std"}}``."""
  out = {}
  for k in shots:
    accs, l2s = [], []
    for seed in range(num_seeds):
      idx = support_indices(pool_labels, num_classes, int(k), seed)
      fit = choose_fit(ridge_path(pool_feats[idx], pool_labels[idx], num_classes, l2_grid),
                       int(k))
      accs.append(float(np.mean(predict(fit, query_feats) == np.asarray(query_labels))))
      l2s.append(fit["l2"])
    out[int(k)] = {"accuracy": accs, "l2": l2s, "mean": float(np.mean(accs)),
                   "std": float(np.std(accs))}
  return out


def metric_dict(scores: dict) -> dict:
  """``{fewshot_<k>shot: mean, fewshot_<k>shot_std: std}`` (the loop adds ``val_``)."""
  out = {}
  for k, v in scores.items():
    out[f"fewshot_{k}shot"] = v["mean"]
    out[f"fewshot_{k}shot_std"] = v["std"]
  return out


# ------------------------------------------------------------- the evaluator


class FewShotEval:
  """Few-shot accuracy of frozen features on ``data_cfg``'s splits per
  ``fewshot_cfg`` (``config.fewshot_eval``'s keys).

  ``features_fn(params, images) -> [B, D]`` (jitted once). The support pool
  (the first ``num_support_examples`` of ``support_split``) and the query set
  (the first ``num_query_examples`` of ``query_split``) are read, unaugmented,
  at every call, through backbone_lib.collect_features as the ridge probe
  reads its splits.
  """

  def __init__(self, fewshot_cfg, data_cfg, mesh, features_fn, *, seed: int = 0,
               batch_size: int = 128):
    self.cfg = fewshot_cfg
    self.sharding = sharding_lib.batch_sharding(mesh)
    self.features_fn = jax.jit(features_fn)
    self.support_source = data_lib.build_source(data_cfg, split=fewshot_cfg.support_split,
                                                seed=seed)
    self.query_source = data_lib.build_source(data_cfg, split=fewshot_cfg.query_split,
                                              seed=seed)
    self.num_classes = self.support_source.num_classes
    if self.num_classes <= 1:
      raise ValueError(f"few-shot evaluation needs labels; {data_cfg.name} has none")
    data_lib.check_labels(self.query_source, self.num_classes, fewshot_cfg.query_split)
    self.batch_size = fewshot_cfg.batch_size or batch_size

  def scores(self, params) -> dict:
    """``fewshot_scores`` of ``params``' features (see there)."""
    pool_x, pool_y = backbone_lib.collect_features(
        self.features_fn, params, self.support_source, self.batch_size,
        self.cfg.num_support_examples, self.sharding)
    query_x, query_y = backbone_lib.collect_features(
        self.features_fn, params, self.query_source, self.batch_size,
        self.cfg.num_query_examples, self.sharding)
    return fewshot_scores(pool_x, pool_y, query_x, query_y, self.num_classes,
                          self.cfg.shots, self.cfg.num_seeds, self.cfg.l2_grid)

  def __call__(self, params) -> dict:
    return metric_dict(self.scores(params))


def from_pretrain_config(config, mesh, model, eval_batch: int | None = None) -> FewShotEval:
  """The pretraining run's evaluator: ``config.fewshot_eval`` on ``config.data``,
  pooled features of ``model`` (a DARL model)."""
  cfg = config.fewshot_eval
  name = cfg.features
  check_features_name(name, vit_lib.depth(config.model))
  return FewShotEval(cfg, config.data, mesh,
                     lambda p, x: backbone_lib.darl_pooled_features(model, p, x, name),
                     seed=config.seed,
                     batch_size=eval_batch or fit.resolve(config).eval_batch)


def check_features_name(name: str, depth: int) -> None:
  valid = ["features"] + [f"block_{i:02d}" for i in range(depth)]
  if name not in valid:
    raise ValueError(f"fewshot_eval.features {name!r} is not an output of the model; "
                     f"valid: {', '.join(valid)}")


# ------------------------------------------------------- the ridge probe


def ridge_fit(feats: np.ndarray, labels: np.ndarray, num_classes: int, l2: float):
  """Closed-form ridge regression onto one-hot targets.

  ``W = (Xc^T Xc + lam I)^-1 Xc^T Y`` on centred features ``Xc = X - mu``
  (``[n, D]``), with ``lam = l2 * trace(Xc^T Xc) / D`` so that ``l2`` does not
  depend on the feature scale. Returns ``(mu [D], W [D, K])`` in float64.
  """
  x = np.asarray(feats, np.float64)
  mu = x.mean(0)
  xc = x - mu
  gram = xc.T @ xc
  lam = l2 * np.trace(gram) / max(x.shape[1], 1) + 1e-12
  y = np.eye(num_classes)[np.asarray(labels)]
  w = np.linalg.solve(gram + lam * np.eye(x.shape[1]), xc.T @ (y - y.mean(0)))
  return mu, w


def ridge_accuracy(train_feats, train_labels, test_feats, test_labels, num_classes: int,
                   l2: float = 1e-3) -> float:
  mu, w = ridge_fit(train_feats, train_labels, num_classes, l2)
  pred = np.argmax((np.asarray(test_feats, np.float64) - mu) @ w, -1)
  return float(np.mean(pred == np.asarray(test_labels)))


class RidgeProbe:
  """The pretraining evaluator: ridge-regression accuracy of frozen DARL features.

  ``features_fn(params, images) -> [B, D]`` (jitted once); the two labelled
  splits of ``config.data`` named in ``config.probe_eval`` are built once.
  """

  def __init__(self, config, mesh, features_fn, eval_batch: int | None = None):
    self.cfg = config.probe_eval
    self.sharding = sharding_lib.batch_sharding(mesh)
    self.features_fn = jax.jit(features_fn)
    self.train_source = data_lib.build_source(config.data, split=self.cfg.train_split,
                                              seed=config.seed)
    self.eval_source = data_lib.build_source(config.data, split=self.cfg.eval_split,
                                             seed=config.seed)
    if self.train_source.num_classes <= 1:
      raise ValueError(f"probe_eval needs labels; {config.data.name} has none")
    data_lib.check_labels(self.eval_source, self.train_source.num_classes, self.cfg.eval_split)
    # ``eval_batch``: the run's resolved evaluation batch (train/fit.py).
    self.batch_size = self.cfg.batch_size or eval_batch or fit.resolve(config).eval_batch

  def __call__(self, params) -> dict:
    xtr, ytr = backbone_lib.collect_features(self.features_fn, params, self.train_source,
                                self.batch_size, self.cfg.num_train_examples, self.sharding)
    xte, yte = backbone_lib.collect_features(self.features_fn, params, self.eval_source,
                                self.batch_size, self.cfg.num_eval_examples, self.sharding)
    acc = ridge_accuracy(xtr, ytr, xte, yte, self.train_source.num_classes, self.cfg.l2)
    return {"probe_accuracy": acc}
