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
held-out training rows: train/probe_grid.py. With every ``probe`` key at its
default the trainer is the single-setting probe above, unchanged.

The trainer's shared part (restore, grid, loss, evaluation) is
train/probe.py's ``ProbeTrainer``, which the attentive probe extends too.
``RidgeProbe`` is the optional pretraining evaluator (``config.probe_eval``):
closed-form ridge regression on frozen, mean-pooled final features
(train/evaluators.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import linen as nn

from darl_jax import config_lib
from darl_jax import files
from darl_jax.models import vit as vit_lib
from darl_jax.train import backbone as backbone_lib
from darl_jax.train import evaluators
from darl_jax.train import probe as probe_lib
from darl_jax.train import probe_grid


# The linear-evaluation recipe, which configs name through this module.
linear_probe_config = probe_lib.linear_probe_config


# ------------------------------------------------------------------- model


class Probes(nn.Module):
  """One ``BlockProbe`` per named feature (submodule names = block names)."""
  blocks: tuple[str, ...]
  num_classes: int

  @nn.compact
  def __call__(self, pooled: dict, train: bool) -> dict:
    return {name: probe_lib.BlockProbe(self.num_classes, name=name)(pooled[name], train)
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


class LinearProbeTrainer(probe_lib.ProbeTrainer):
  """Per-block linear probes on a frozen, restored backbone: one setting
  (``LayerProbes``, trained by the loop's optimizer) or a grid of them
  (``PooledBlocks`` + probe_grid.HeadGrid, chosen on held-out rows)."""

  def num_candidates(self) -> int:
    """Settings per block: the grid's optimizer settings x poolings."""
    return len(probe_grid.settings(self.config)) * len(self.config.probe.poolings)

  def build_model(self, ctx):
    self.check_labels(ctx)
    backbone, patch = vit_lib.vit_from_config(self.config.model)
    num_classes = ctx.train_source.num_classes
    if not self.is_grid:
      return LayerProbes(backbone=backbone, patch_size=patch, num_classes=num_classes)
    poolings = probe_grid.check_poolings(self.config.probe.poolings)
    self.head_names = head_names(poolings, backbone.depth)
    self.grid = self.make_grid(ctx, probe_lib.BlockProbe(num_classes), len(self.head_names),
                               jax.ShapeDtypeStruct((1, backbone.width), jnp.float32),
                               shared_input=False)
    return backbone_lib.PooledBlocks(backbone=backbone, patch_size=patch, poolings=poolings)

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


# The keys of ``config.probe_eval`` live with the pretraining config, the
# ridge probe with the other pretraining evaluators (train/evaluators.py).
probe_eval_config = config_lib.probe_eval_config
ridge_fit = evaluators.ridge_fit
ridge_accuracy = evaluators.ridge_accuracy
RidgeProbe = evaluators.RidgeProbe
