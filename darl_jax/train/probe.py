"""What the probes on a frozen backbone share: the trainer base, the head, the recipe.

``ProbeTrainer`` is the trainer of train/trainers/linear_probe.py and
train/trainers/attentive_probe.py less their models and reports: the
backbone restored from ``init_from`` and frozen, the held-out rows and the
heads of a grid (train/probe_grid.py), the loss over a dict of logits with
label smoothing, the per-head evaluation. ``BlockProbe`` is the head both
probes end in (BatchNorm without affine parameters, then a linear layer),
and ``linear_probe_config`` the linear-evaluation recipe, which the
attentive probe re-sets (the recipe is linear_probe.py's docstring).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from flax import linen as nn

from darl_jax import config_lib
from darl_jax import data as data_lib
from darl_jax import fp8
from darl_jax import mixup as mixup_lib
from darl_jax import sharding as sharding_lib
from darl_jax.train import backbone as backbone_lib
from darl_jax.train import compile_count
from darl_jax.train import probe_grid
from darl_jax.train import step as step_lib
from darl_jax.train import trainer as trainer_lib


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
  # The hyper-parameter grid (train/probe_grid.py); at these defaults, the
  # single setting of optim.base_lr / optim.weight_decay with mean pooling.
  c.probe = probe_grid.grid_config()
  c.probe.poolings = ("mean",)
  return c


class BlockProbe(nn.Module):
  """BatchNorm (no affine) + linear layer on pooled features ``[B, D]`` -> ``[B, K]``."""
  num_classes: int

  @nn.compact
  def __call__(self, feats, train: bool):
    x = nn.BatchNorm(use_running_average=not train, use_bias=False, use_scale=False,
                     momentum=0.9, epsilon=1e-6, name="bn")(feats.astype(jnp.float32))
    return nn.Dense(self.num_classes, kernel_init=nn.initializers.normal(0.01),
                    name="head")(x)


class ProbeTrainer(trainer_lib.Trainer):
  """Probes on a frozen, restored backbone: one setting (a model returning
  ``{name: logits}``, trained by the loop's optimizer) or a grid of them
  (a frozen pass + probe_grid.HeadGrid, chosen on held-out rows). A
  subclass builds the model (``build_model``, with ``make_grid`` for a
  grid) and writes the report (``finalize``)."""

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
    """Heads per block a grid trains: one per optimizer setting."""
    return len(probe_grid.settings(self.config))

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

  def init_variables(self, model, rng, batch):
    variables = dict(model.init({"params": rng}, batch["image"], train=False))
    # The backbone is frozen, so no step would record its fp8 histories:
    # without them every dense layer (the heads' too) scales its inputs row
    # by row (darl_jax/fp8.py).
    variables.pop(fp8.COLLECTION, None)
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
