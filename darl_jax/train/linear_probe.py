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
from jax.experimental import multihost_utils

from darl_jax import config_lib
from darl_jax import data as data_lib
from darl_jax import files
from darl_jax import patches as patches_lib
from darl_jax import sharding as sharding_lib
from darl_jax.data import mixup as mixup_lib
from darl_jax.models import vit as vit_lib
from darl_jax.train import finetune
from darl_jax.train import loop
from darl_jax.train import transfer


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


def block_names(depth: int) -> tuple[str, ...]:
  return tuple(f"block_{i:02d}" for i in range(depth))


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
    out = frozen_patch_tokens(self.backbone, self.patch_size, images)
    names = block_names(self.backbone.depth)
    pooled = {k: out[k].mean(1) for k in names}
    return Probes(names, self.num_classes, name="probes")(pooled, train)


def frozen_patch_tokens(backbone: vit_lib.ViT, patch_size: int, images) -> dict:
  """The frozen backbone's outputs at the patch tokens: ``{block_XX, features:
  [B, N, D]}`` float32, gradient-stopped.

  Runs ``backbone`` (called from a compact module, so its parameters sit
  under that module's ``backbone``) on ``[SOS, x_0 .. x_{N-1}]`` in raster
  order, every patch an input, with no drop path; the SOS output is left
  out. The probes of linear_probe.py and attentive_probe.py read it.
  """
  grid_hw = (images.shape[1] // patch_size, images.shape[2] // patch_size)
  x = patches_lib.patchify(images, patch_size).astype(backbone.dtype)
  n = x.shape[1]
  rows, cols = np.divmod(np.arange(n), grid_hw[1])
  out = backbone(x, rows[None], cols[None], np.arange(1, n + 1)[None], grid_hw,
                 prepend_sos=True, train=False)   # frozen: no drop path, ever
  return {k: jax.lax.stop_gradient(v[:, 1:].astype(jnp.float32)) for k, v in out.items()}


# ----------------------------------------------------------------- trainer


class LinearProbeTrainer(loop.Trainer):
  """Per-block linear probes on a frozen, restored backbone."""

  def make_source(self, config, split, *, train):
    return finetune.build_source(config, split, train=train)

  def build_model(self, ctx):
    cfg = self.config
    loop.check_image_shape(cfg, ctx.train_source)
    if ctx.train_source.num_classes <= 1:
      raise ValueError(f"{cfg.data.name} has no class labels; a probe needs labels")
    if "^backbone/" not in list(cfg.optim.get("frozen") or []):
      logging.warning("optim.frozen lacks '^backbone/': the backbone gets no gradient "
                      "(stop_gradient) but weight decay would still move it")
    backbone, patch = vit_lib.vit_from_config(cfg.model)
    return LayerProbes(backbone=backbone, patch_size=patch,
                       num_classes=ctx.train_source.num_classes)

  def init_variables(self, model, rng, batch):
    return dict(model.init({"params": rng}, batch["image"], train=False))

  def load_pretrained(self, ctx, params):
    return finetune.restore_backbone(ctx, self.config, params)

  def loss_fn(self, model, params, model_state, batch, rng, train):
    del rng
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

  def eval_fn(self, model, params, model_state, batch, rng):
    del rng
    logits = model.apply({"params": params, **model_state}, batch["image"], train=False)
    labels = batch["label"]
    out = {f"accuracy_{k}": (jnp.argmax(v, -1) == labels).astype(jnp.float32)
           for k, v in logits.items()}
    last = sorted(logits)[-1]
    out["accuracy"] = out[f"accuracy_{last}"]
    out["loss"] = mixup_lib.soft_cross_entropy(
        logits[last], jax.nn.one_hot(labels, model.num_classes))
    return out

  def final_scores(self, ctx, model, state) -> dict:
    """``eval_fn``'s metrics over the eval split, for the reports ``finalize``
    writes: the loop's own eval step (its uint8 -> float input conversion
    included), not a second copy of it."""
    eval_step = jax.jit(loop.make_eval_step(self, model, jax.random.PRNGKey(0), ctx.mesh))
    return loop.evaluate(self, model, state, ctx.eval_source, eval_step,
                         sharding_lib.batch_sharding(ctx.mesh), self.config)

  def finalize(self, ctx, model, state):
    """Evaluates every probe once more and writes the per-layer report and plot."""
    scores = self.final_scores(ctx, model, state)
    names = block_names(model.backbone.depth)
    report = probe_report({k: scores[f"accuracy_{k}"] for k in names})
    step = int(jax.device_get(state["step"]))
    report["step"] = step
    ctx.writer.write_scalars(step, {"val_best_accuracy": report["best_accuracy"],
                                    "val_best_block": report["best_block_index"]})
    logging.info("linear probe: best %s (depth %.2f) %.4f", report["best_block"],
                 report["best_depth"], report["best_accuracy"])
    if jax.process_index() == 0:
      files.write_json_atomic(ctx.workdir / "probe_accuracy.json", report, indent=1)
      plot_probe_accuracy(report, str(ctx.workdir / "probe_accuracy.png"))


def probe_report(accuracy: dict[str, float]) -> dict:
  """``{block_XX: acc}`` -> report with normalised depths and the best block."""
  names = sorted(accuracy)
  depth = len(names)
  accs = [float(accuracy[k]) for k in names]
  best = int(np.argmax(accs))
  return {"blocks": names, "accuracy": accs,
          "normalized_depth": [(i + 1) / depth for i in range(depth)],
          "best_block": names[best], "best_block_index": best,
          "best_depth": (best + 1) / depth, "best_accuracy": accs[best]}


def plot_probe_accuracy(report: dict, path: str) -> None:
  """Accuracy vs normalised depth (the paper's linear-evaluation figure)."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  fig, ax = plt.subplots(figsize=(4.5, 3.2), dpi=120)
  ax.plot(report["normalized_depth"], [100 * a for a in report["accuracy"]], "o-")
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


def collect_features(features_fn, params, source, batch_size: int, max_examples: int,
                     sharding) -> tuple[np.ndarray, np.ndarray]:
  """Unaugmented features ``[n, D]`` and labels ``[n]`` of the first ``max_examples``
  examples of ``source`` (0 = all), gathered on every process."""
  feats, labels, have = [], [], 0
  for batch in source.eval_batches(batch_size, jax.process_index(), jax.process_count()):
    g = loop.to_global(batch, sharding)
    f, lab, mask = multihost_utils.process_allgather(
        (features_fn(params, loop.model_input(g)["image"]), g["label"], g["mask"]), tiled=True)
    mask = np.asarray(mask, bool)
    feats.append(np.asarray(f)[mask])
    labels.append(np.asarray(lab)[mask])
    have += int(mask.sum())
    if max_examples and have >= max_examples:
      break
  n = max_examples or have
  return np.concatenate(feats)[:n], np.concatenate(labels)[:n]


def darl_pooled_features(model, params, images, name: str = "features"):
  """Mean over the patch positions of a DARL model's output ``name``
  (``features``: the final, normalised one; ``block_XX``: a block's): ``[B, D]``.

  ``DARL.encode`` runs the backbone on ``[SOS, x_0 .. x_{N-2}]`` as in
  pretraining; the SOS output is left out of the mean.
  """
  from darl_jax.models import darl as darl_lib
  _, out = model.apply({"params": params}, images, train=False,
                       method=darl_lib.DARL.encode)
  if name not in out:
    raise ValueError(f"the model has no output {name!r}; valid: {', '.join(sorted(out))}")
  return out[name][:, 1:].astype(jnp.float32).mean(1)


class RidgeProbe:
  """The pretraining evaluator: ridge-regression accuracy of frozen DARL features.

  ``features_fn(params, images) -> [B, D]`` (jitted once); the two labelled
  splits of ``config.data`` named in ``config.probe_eval`` are built once.
  """

  def __init__(self, config, mesh, features_fn):
    self.cfg = config.probe_eval
    self.sharding = sharding_lib.batch_sharding(mesh)
    self.features_fn = jax.jit(features_fn)
    self.train_source = data_lib.build_source(config.data, split=self.cfg.train_split,
                                              seed=config.seed)
    self.eval_source = data_lib.build_source(config.data, split=self.cfg.eval_split,
                                             seed=config.seed)
    if self.train_source.num_classes <= 1:
      raise ValueError(f"probe_eval needs labels; {config.data.name} has none")
    self.batch_size = self.cfg.batch_size or config.eval_batch_size or config.batch_size

  def __call__(self, params) -> dict:
    xtr, ytr = collect_features(self.features_fn, params, self.train_source,
                                self.batch_size, self.cfg.num_train_examples, self.sharding)
    xte, yte = collect_features(self.features_fn, params, self.eval_source,
                                self.batch_size, self.cfg.num_eval_examples, self.sharding)
    acc = ridge_accuracy(xtr, ytr, xte, yte, self.train_source.num_classes, self.cfg.l2)
    return {"probe_accuracy": acc}
