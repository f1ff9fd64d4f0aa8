"""Few-shot linear classification of frozen features, as big_vision evaluates.

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

Two uses: the pretraining evaluator ``FewShotEval`` (``config.fewshot_eval``,
train/trainers/pretrain.py's ``extra_eval``; ``val_fewshot_<k>shot``) and the
``fewshot`` job (``run``): a pretraining checkpoint's features scored the same
way, written to ``fewshot.json`` and metrics.jsonl.
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np
from absl import logging
from ml_collections.config_dict import placeholder

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import config_lib
from darl_jax import data as data_lib
from darl_jax import files
from darl_jax import sharding as sharding_lib
from darl_jax.train import setup as setup_lib
from darl_jax.train import compile_count
from darl_jax.train import fit
from darl_jax.train import backbone as backbone_lib
from darl_jax.models import vit as vit_lib

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


# ------------------------------------------------------------------ the job


def fewshot_config() -> ml_collections.ConfigDict:
  """Keys of the ``fewshot`` job: the checkpoint to read and ``fewshot_eval``'s
  keys (without ``enabled``). Model and data come from the pretraining run's
  stored config."""
  c = config_lib.base_config()
  c.trainer = "fewshot"
  c.total_steps = 0              # nothing is trained
  for unused in ("model", "optim", "data"):   # they come from the pretraining run
    del c[unused]
  c.init_from = placeholder(str)  # the pretraining workdir (or a checkpoint dir)
  c.init_step = -1                # -1: the newest checkpoint
  c.fewshot_eval = config_lib.fewshot_eval_config()
  del c.fewshot_eval["enabled"]
  # Overrides of the pretraining run's data location (None: keep it).
  c.data_path = placeholder(str)
  c.tfds_data_dir = placeholder(str)
  return c


def check_features_name(name: str, depth: int) -> None:
  valid = ["features"] + [f"block_{i:02d}" for i in range(depth)]
  if name not in valid:
    raise ValueError(f"fewshot_eval.features {name!r} is not an output of the model; "
                     f"valid: {', '.join(valid)}")


def run(config, workdir: str) -> dict:
  """Scores the pretraining checkpoint ``config.init_from`` into ``workdir``:
  ``fewshot.json`` (per shot count: accuracy per seed, their mean and std,
  the chosen L2 strengths) and one metrics.jsonl record at the checkpoint's
  step with the keys pretraining logs (``val_fewshot_<k>shot``, ``_std``).
  The workdir contract of the sampling job: locked, config.json written
  once the checks passed, no checkpoints. The report and the last log line
  say how many programs the job compiled (train/compile_count.py); the features
  program is kept by the persistent compilation cache (setup_lib.job), so a rerun
  on a checkpoint of the same model loads it."""
  from darl_jax.models import darl as darl_lib

  count = compile_count.Count()
  config_lib.validate(config)
  if not config.get("init_from"):
    raise ValueError("the fewshot job needs --config.init_from=<pretraining workdir>")
  pre, step = backbone_lib.load_pretrain_config(config.init_from,
                                          None if config.init_step < 0 else config.init_step)
  if config.get("data_path"):
    pre.data.path = config.data_path
  if config.get("tfds_data_dir"):
    pre.data.tfds_data_dir = config.tfds_data_dir
  check_features_name(config.fewshot_eval.features, vit_lib.depth(pre.model))
  dtype = pre.model.get("dtype", "float32")
  with setup_lib.job(config, workdir, dtype) as (workdir, writer, is_main):
    mesh = sharding_lib.make_mesh(config.mesh)
    model = darl_lib.darl_from_config(pre)
    # the EMA of the parameters where the checkpoint has one, unless use_ema says
    params, meta = checkpoint_lib.restore_params(config.init_from, step=step,
                                                 use_ema=config.get("use_ema", None))
    image_shape = (pre.model.image_size, pre.model.image_size, pre.model.get("channels", 3))
    backbone_lib.check_params(model, image_shape, params)
    writer.start(None, config.to_dict())
    params = jax.device_put(params, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))
    name = config.fewshot_eval.features
    evaluator = FewShotEval(config.fewshot_eval, pre.data, mesh,
                            lambda p, x: backbone_lib.darl_pooled_features(model, p, x, name),
                            seed=config.seed,
                            batch_size=fit.resolve(config).eval_batch)
    scores = evaluator.scores(params)
    ckpt_step = int(meta.get("step", step))
    report = {"init_from": str(config.init_from), "step": ckpt_step, "features": name,
              "support_split": config.fewshot_eval.support_split,
              "query_split": config.fewshot_eval.query_split,
              "num_classes": evaluator.num_classes,
              "shots": {str(k): v for k, v in scores.items()},
              "programs": count.report()}
    metrics = {f"val_{k}": v for k, v in metric_dict(scores).items()}
    writer.write_scalars(ckpt_step, metrics)
    if is_main:
      files.write_json_atomic(workdir / "fewshot.json", report, indent=1)
    logging.info("few-shot accuracy of %s (step %d): %s", config.init_from, ckpt_step,
                 {k: round(v, 4) for k, v in metrics.items()})
    logging.info("%s", count.line("few-shot"))
    return metrics
