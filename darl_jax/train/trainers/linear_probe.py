"""Linear probes on every block of a frozen backbone, and a ridge-regression probe.

Linear evaluation (appendix "Linear Evaluation", table "ImageNet Linear
Evaluation Hyperparameters"): the backbone runs with the causal mask, the
image descriptor is the mean over the patch tokens, a BatchNorm without affine
parameters normalises it (MAE's recipe), and a linear layer classifies it;
LARS (lr 0.1, momentum 0.9, weight decay 0), label smoothing 0.1, cosine with
10 warm-up epochs, spatial augmentation, batch 16384, 90 epochs.

The paper plots accuracy against normalised depth. Instead of one run per
layer, one frozen forward pass feeds an independent probe per block
(``params["probes"]["block_XX"]``, BatchNorm statistics in
``model_state["batch_stats"]``): the loss is the *sum* of the per-block
losses, and since the features are ``stop_gradient``-ed each probe receives
exactly the gradient of its own loss, as if trained alone. The backbone is
also frozen in the optimizer (``optim.frozen=["^backbone/"]``: no optimizer
state, zero updates).

Metrics: ``val_accuracy_block_XX`` per block, ``val_accuracy`` = the last
block's; at the end (``finalize``) ``probe_accuracy.json`` and
``probe_accuracy.png`` (accuracy vs depth (i + 1) / L) in the workdir and
``val_best_accuracy`` / ``val_best_block`` in metrics.jsonl.

Learning rate: the table's "Learning rate 0.1" is MAE's *base* rate, scaled
by batch / 256 (``optim.lr_scaling=True``: 6.4 at batch 16384). Read as a
peak rate it could not train: LARS (trust coefficient 1e-3, as in MAE) moves
each weight matrix by at most ``lr * 1e-3`` of its norm per step, so at 0.1
the probes (initialised at std 0.01) could grow by at most a factor
``exp(7000 * 1e-4) ~ 2`` over a 90-epoch run. (Fine-tuning, with AdamW, reads
its table's rate literally; see finetune.py.)

A hyper-parameter grid (``config.probe``: learning rates x weight decays x
poolings, every block) trains in the same frozen pass and is chosen on
held-out training rows: train/trainers/probe_grid.py. With every ``probe`` key at its
default the trainer is the single-setting probe above, unchanged.

``RidgeProbe`` is the optional pretraining evaluator (``config.probe_eval``):
closed-form ridge regression on frozen, mean-pooled final features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import linen as nn

from darl_jax import config_lib
from darl_jax import data as data_lib
from darl_jax import files
from darl_jax import sharding as sharding_lib
from darl_jax.data import mixup as mixup_lib
from darl_jax.models import vit as vit_lib
from darl_jax.train.trainers import finetune
from darl_jax.train import trainer as trainer_lib
from darl_jax.train import step as step_lib
from darl_jax.train.trainers import probe_grid
from darl_jax.train import compile_count
from darl_jax.train import fit
from darl_jax.train import backbone as backbone_lib


def linear_probe_config() -> ml_collections.ConfigDict:
  """``base_config`` plus the probe keys, at the paper's linear-evaluation recipe."""
  c = config_lib.base_config()
  c.trainer = "linear_probe"
  c.init_from = ""            # pretraining workdir / checkpoint; "" = random backbone
  c.init_step = -1
  c.data.augment = "spatial"
  c.model.update(causal=True, drop_path=0.0)
  c.label_smoothing = 0.1
  c.batch_size = 16384
  c.total_epochs = 90.0
  c.optim.update(name="lars", base_lr=0.1, lr_scaling=True, momentum=0.9,
                 weight_decay=0.0, warmup_epochs=10.0, warmup_steps=-1,
                 schedule="cosine", layer_decay=0.0, num_layers=0,
                 frozen=["^backbone/"])
  # The hyper-parameter grid (train/trainers/probe_grid.py); at these defaults, the
  # single setting of optim.base_lr / optim.weight_decay with mean pooling.
  c.probe = probe_grid.grid_config()
  c.probe.poolings = ("mean",)
  return c


# ------------------------------------------------------------------- model


class BlockProbe(nn.Module):
  """BatchNorm (no affine) + linear layer on pooled features ``[B, D]`` -> ``[B, K]``."""
  num_classes: int

  @nn.compact
  def __call__(self, feats, train: bool):
    x = nn.BatchNorm(use_running_average=not train, use_bias=False, use_scale=False,
                     momentum=0.9, epsilon=1e-6, name="bn")(feats.astype(jnp.float32))
    return nn.Dense(self.num_classes, kernel_init=nn.initializers.normal(0.01),
                    name="head")(x)


class Probes(nn.Module):
  """One ``BlockProbe`` per named feature (submodule names = block names)."""
  blocks: tuple[str, ...]
  num_classes: int

  @nn.compact
  def __call__(self, pooled: dict, train: bool) -> dict:
    return {name: BlockProbe(self.num_classes, name=name)(pooled[name], train)
            for name in self.blocks}


class LayerProbes(nn.Module):
  """Frozen backbone over ``[SOS, x_0 .. x_{N-1}]`` (raster) -> a probe per block.

  Returns ``{block_XX: logits [B, K]}``; the probe of ``block_XX`` sees the
  mean over the patch tokens (SOS output excluded) of that block's
  residual-stream output ``[B, N + 1, D]``, gradient-stopped.
  """
  backbone: vit_lib.ViT
  patch_size: int
  num_classes: int

  @nn.compact
  def __call__(self, images, *, train: bool = False):
    out = backbone_lib.frozen_patch_tokens(self.backbone, self.patch_size, images)
    names = backbone_lib.block_names(self.backbone.depth)
    pooled = {k: out[k].mean(1) for k in names}
    return Probes(names, self.num_classes, name="probes")(pooled, train)


def head_names(poolings, depth: int) -> tuple[str, ...]:
  """``block_XX_<pooling>``, in ``PooledBlocks``' order."""
  return tuple(f"{k}_{p}" for p in poolings for k in backbone_lib.block_names(depth))


# ----------------------------------------------------------------- trainer


class LinearProbeTrainer(trainer_lib.Trainer):
  """Per-block linear probes on a frozen, restored backbone: one setting
  (``LayerProbes``, trained by the loop's optimizer) or a grid of them
  (``PooledBlocks`` + probe_grid.HeadGrid, chosen on held-out rows)."""

  def __init__(self, config):
    super().__init__(config)
    self.grid = None                 # probe_grid.HeadGrid, built with the model
    self.held_out = None             # the held-out training rows (a grid's)
    self.programs = compile_count.Count()  # the job's compiled programs, in its report
    if probe_grid.is_grid(config):
      probe_grid.check_loop_options(config)

  @property
  def is_grid(self) -> bool:
    return probe_grid.is_grid(self.config)

  def num_candidates(self) -> int:
    """Settings per block: the grid's optimizer settings x poolings."""
    return len(probe_grid.settings(self.config)) * len(self.config.probe.poolings)

  def make_source(self, config, split, *, train):
    source = backbone_lib.build_source(config, split, train=train)
    if train and self.is_grid:
      source, self.held_out = probe_grid.split_source(config, source, self.num_candidates())
    return source

  def check_labels(self, ctx):
    cfg = self.config
    trainer_lib.check_image_shape(cfg, ctx.train_source)
    if ctx.train_source.num_classes <= 1:
      raise ValueError(f"{cfg.data.name} has no class labels; a probe needs labels")
    data_lib.check_labels(ctx.eval_source, ctx.train_source.num_classes, cfg.data.eval_split)
    if "^backbone/" not in list(cfg.optim.get("frozen") or []):
      logging.warning("optim.frozen lacks '^backbone/': the backbone gets no gradient "
                      "(stop_gradient) but weight decay would still move it")

  def make_grid(self, ctx, head, num_heads: int, example, *, shared_input: bool):
    """The grid's heads and their per-setting optimizers, at the loop's lengths."""
    cfg = self.config
    return probe_grid.HeadGrid(
        head, probe_grid.settings(cfg), num_heads, cfg.optim, example,
        shared_input=shared_input, total_steps=ctx.total_steps,
        steps_per_epoch=max(ctx.train_source.num_examples // cfg.batch_size, 1),
        batch_size=cfg.batch_size)

  def build_model(self, ctx):
    self.check_labels(ctx)
    backbone, patch = vit_lib.vit_from_config(self.config.model)
    num_classes = ctx.train_source.num_classes
    if not self.is_grid:
      return LayerProbes(backbone=backbone, patch_size=patch, num_classes=num_classes)
    poolings = probe_grid.check_poolings(self.config.probe.poolings)
    self.head_names = head_names(poolings, backbone.depth)
    self.grid = self.make_grid(ctx, BlockProbe(num_classes), len(self.head_names),
                               jax.ShapeDtypeStruct((1, backbone.width), jnp.float32),
                               shared_input=False)
    return backbone_lib.PooledBlocks(backbone=backbone, patch_size=patch, poolings=poolings)

  def init_variables(self, model, rng, batch):
    variables = dict(model.init({"params": rng}, batch["image"], train=False))
    if self.grid is not None:
      variables["grid"] = self.grid.init(jax.random.fold_in(rng, 1))
    return variables

  def load_pretrained(self, ctx, params):
    return backbone_lib.restore_backbone(ctx, self.config, params)

  def loss_fn(self, model, params, model_state, batch, rng, train):
    del rng
    if self.grid is not None:
      return self.grid_loss(model, params, model_state, batch, train)
    variables = {"params": params, **model_state}
    targets = mixup_lib.smooth_labels(batch["label"], model.num_classes,
                                      self.config.get("label_smoothing", 0.0))
    if train:
      logits, updates = model.apply(variables, batch["image"], train=True,
                                    mutable=["batch_stats"])
      model_state = {**model_state, "batch_stats": updates["batch_stats"]}
    else:
      logits = model.apply(variables, batch["image"], train=False)
    metrics, total = {}, 0.0
    for name, lg in logits.items():
      loss = jnp.mean(mixup_lib.soft_cross_entropy(lg, targets))
      metrics[f"loss_{name}"] = loss
      total = total + loss
    return total, (metrics, model_state)

  def grid_loss(self, model, params, model_state, batch, train):
    """The frozen pass, then every head of the grid: its loss and, in
    training, its optimizer step (probe_grid.py's design note)."""
    inputs = model.apply({"params": params}, batch["image"])
    targets = mixup_lib.smooth_labels(batch["label"], self.grid.head.num_classes,
                                      self.config.get("label_smoothing", 0.0))
    total, losses, grid_state, grad_norm = probe_grid.loss_and_step(
        self.grid, model_state["grid"], inputs, targets, train)
    metrics = {f"loss_{n}": jnp.sum(v) for n, v in losses.items()}
    if grad_norm is not None:
      metrics["head_grad_norm"] = grad_norm
    return total, (metrics, {**model_state, "grid": grid_state})

  def eval_fn(self, model, params, model_state, batch, rng):
    del rng
    if self.grid is not None:
      inputs = model.apply({"params": params}, batch["image"])
      return probe_grid.correct(self.grid, model_state["grid"], inputs, batch["label"],
                                self.head_names)
    logits = model.apply({"params": params, **model_state}, batch["image"], train=False)
    labels = batch["label"]
    out = {f"accuracy_{k}": (jnp.argmax(v, -1) == labels).astype(jnp.float32)
           for k, v in logits.items()}
    last = sorted(logits)[-1]
    out["accuracy"] = out[f"accuracy_{last}"]
    out["loss"] = mixup_lib.soft_cross_entropy(
        logits[last], jax.nn.one_hot(labels, model.num_classes))
    return out

  def final_scores(self, ctx, model, state, source=None) -> dict:
    """``eval_fn``'s metrics over ``source`` (default: the eval split), for the
    reports ``finalize`` writes: the loop's own eval step (its uint8 -> float
    input conversion included), not a second copy of it."""
    eval_step = jax.jit(step_lib.make_eval_step(self, model, jax.random.PRNGKey(0), ctx.mesh))
    return step_lib.evaluate(self, model, state, source or ctx.eval_source, eval_step,
                             sharding_lib.batch_sharding(ctx.mesh), self.config, ctx.resolved)

  def grid_scores(self, ctx, model, state) -> tuple[dict, dict]:
    """``(eval split, held-out rows)`` accuracies of every head ({} without
    a held-out part)."""
    held = {} if self.held_out is None else self.final_scores(ctx, model, state,
                                                              self.held_out)
    return self.final_scores(ctx, model, state), held

  def finalize(self, ctx, model, state):
    """Evaluates every probe once more and writes the per-layer report and plot."""
    if self.grid is not None:
      return self.finalize_grid(ctx, model, state)
    scores = self.final_scores(ctx, model, state)
    names = backbone_lib.block_names(model.backbone.depth)
    report = probe_report({k: scores[f"accuracy_{k}"] for k in names})
    self.write_report(ctx, state, report, {})

  def finalize_grid(self, ctx, model, state):
    """The grid's report: per block the setting of the best held-out accuracy,
    its eval-split accuracy, and every candidate's two accuracies."""
    test, held = self.grid_scores(ctx, model, state)
    names = backbone_lib.block_names(model.backbone.depth)
    rows = []
    for s in self.grid.settings:
      for pooling in self.config.probe.poolings:
        for block in names:
          key = f"grid_accuracy_{block}_{pooling}_{s.name}"
          rows.append({"block": block, "pooling": pooling, "learning_rate": s.learning_rate,
                       "weight_decay": s.weight_decay, "setting": f"{pooling}_{s.name}",
                       "holdout_accuracy": held.get(key), "accuracy": test[key]})
    chosen = probe_grid.choose(rows, "block")
    report = probe_report({k: chosen[k]["accuracy"] for k in names},
                          {k: chosen[k]["holdout_accuracy"] for k in names} if held else None)
    report.update(selection="holdout" if held else "single setting",
                  holdout_size=0 if self.held_out is None else self.held_out.num_examples,
                  chosen=chosen, grid=rows)
    scalars = {}
    poolings = list(self.config.probe.poolings)
    for k in names:
      row = chosen[k]
      scalars.update({f"val_accuracy_{k}": row["accuracy"],
                      f"val_chosen_learning_rate_{k}": row["learning_rate"],
                      f"val_chosen_weight_decay_{k}": row["weight_decay"],
                      f"val_chosen_pooling_{k}": poolings.index(row["pooling"])})
      if held:
        scalars[f"val_holdout_accuracy_{k}"] = row["holdout_accuracy"]
    scalars["val_accuracy"] = chosen[names[-1]]["accuracy"]
    scalars.update({f"val_{k}": v for k, v in test.items()})
    scalars.update({f"val_holdout_{k}": v for k, v in held.items()})
    self.write_report(ctx, state, report, scalars)

  def write_report(self, ctx, state, report: dict, scalars: dict):
    """probe_accuracy.json / .png in the workdir and the final metrics."""
    step = int(jax.device_get(state["step"]))
    report["step"] = step
    ctx.writer.write_scalars(step, {**scalars, "val_best_accuracy": report["best_accuracy"],
                                    "val_best_block": report["best_block_index"]})
    logging.info("linear probe: best %s (depth %.2f) %.4f", report["best_block"],
                 report["best_depth"], report["best_accuracy"])
    report["programs"] = self.programs.report()
    logging.info("%s", self.programs.line("linear probe"))
    if jax.process_index() == 0:
      files.write_json_atomic(ctx.workdir / "probe_accuracy.json", report, indent=1)
      plot_probe_accuracy(report, str(ctx.workdir / "probe_accuracy.png"))


def probe_report(accuracy: dict[str, float], holdout: dict[str, float] | None = None) -> dict:
  """``{block_XX: acc}`` -> report with normalised depths and the best block:
  the block of the best ``holdout`` accuracy where given (a grid's
  selection), else of the best ``accuracy``."""
  names = sorted(accuracy)
  depth = len(names)
  accs = [float(accuracy[k]) for k in names]
  best = int(np.argmax([holdout[k] for k in names] if holdout else accs))
  report = {"blocks": names, "accuracy": accs,
            "normalized_depth": [(i + 1) / depth for i in range(depth)],
            "best_block": names[best], "best_block_index": best,
            "best_depth": (best + 1) / depth, "best_accuracy": accs[best]}
  if holdout:
    report["holdout_accuracy"] = [float(holdout[k]) for k in names]
  return report


def plot_probe_accuracy(report: dict, path: str) -> None:
  """Accuracy vs normalised depth (the paper's linear-evaluation figure)."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  fig, ax = plt.subplots(figsize=(4.5, 3.2), dpi=120)
  depth = dict(zip(report["blocks"], report["normalized_depth"]))
  for setting in sorted({row["setting"] for row in report.get("grid", ())}):
    rows = [r for r in report["grid"] if r["setting"] == setting]   # every candidate, faint
    ax.plot([depth[r["block"]] for r in rows], [100 * r["accuracy"] for r in rows],
            "-", color="0.75", lw=0.8)
  ax.plot(report["normalized_depth"], [100 * a for a in report["accuracy"]], "o-",
          label="chosen on held-out rows" if "holdout_accuracy" in report else None)
  if "holdout_accuracy" in report:
    ax.plot(report["normalized_depth"], [100 * a for a in report["holdout_accuracy"]],
            "x--", color="C1", label="its held-out accuracy")
    ax.legend(fontsize=7)
  ax.set_xlabel("normalised depth (block / depth)")
  ax.set_ylabel("linear probe top-1 (%)")
  ax.set_xlim(0, 1.02)
  ax.grid(alpha=0.3)
  ax.set_title(f"best: {report['best_block']} ({100 * report['best_accuracy']:.1f}%)")
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


# -------------------------------------------------- ridge probe (pretraining)


# The keys of ``config.probe_eval`` live with the pretraining config.
probe_eval_config = config_lib.probe_eval_config


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
