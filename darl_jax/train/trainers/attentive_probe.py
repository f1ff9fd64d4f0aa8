"""Attentive probe on a frozen backbone (AIM's evaluation).

    frozen backbone over [SOS, x_0 .. x_{N-1}] -> patch tokens of the chosen blocks
      -> one learned query, multi-head cross-attention over them (models/probe_heads.py)
      -> BatchNorm without affine parameters -> linear classifier

AIM (El-Nouby et al., 2024) evaluates its autoregressive image models with
this probe rather than a linear one on mean-pooled features: a causal
backbone's patch tokens carry unequal amounts of the image (the first token
has seen one patch, the last all of them), and a learned pooling can weigh
them. Everything else follows the linear probe (train/trainers/linear_probe.py;
both extend train/probe.py's ``ProbeTrainer``): the same frozen backbone pass (causal, no
drop path, gradient-stopped outputs, ``optim.frozen=["^backbone/"]``), the
same BatchNorm + linear head on the pooled vector, the same loss with label
smoothing, the same backbone restore from ``init_from``.

Several blocks (``probe.blocks``, indices into the backbone's blocks,
negative from the end): their patch tokens are concatenated along the token
axis (``[B, len(blocks) * N, D]``), not averaged. The query then sees every
block's tokens as they are and its softmax decides, per image and head,
how much of each block to read; an average would fix equal weights before
the probe sees anything and mix residual streams whose scales differ from
block to block. The price is ``len(blocks)`` times more keys, small beside
the backbone's forward pass. (AIM averages the chosen layers' features.)

Where AIM normalises the tokens (BatchNorm before the key and value
projections), this probe normalises the pooled vector, as the linear probe
does, so that the two probes differ only in how they pool.

Metrics: ``val_accuracy`` (and ``val_loss``); at the end
``attentive_probe.json`` in the workdir (blocks, accuracy, step).

A grid of learning rates x weight decays (``probe.learning_rates``,
``probe.weight_decays``): one attentive probe per setting over the same
chosen blocks, all trained on the one frozen pass and chosen on held-out
training rows (train/probe_grid.py); ``attentive_probe.json`` then also
holds the chosen setting, its held-out accuracy and the full grid.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from flax import linen as nn

from darl_jax import files
from darl_jax import mixup as mixup_lib
from darl_jax.models import probe_heads
from darl_jax.models import vit as vit_lib
from darl_jax.train import backbone as backbone_lib
from darl_jax.train import probe as probe_lib
from darl_jax.train import probe_grid


def attentive_probe_config() -> ml_collections.ConfigDict:
  """The linear probe's keys plus ``probe`` (which blocks, how many heads).

  Optimiser: AdamW (0.9, 0.999), base lr 1e-3 x batch / 256, weight decay
  0.05, cosine with 5 warm-up epochs, 90 epochs at batch 1024, label
  smoothing 0.1, spatial augmentation. These are this project's defaults,
  not a published table: AIM sweeps its probe's learning rate and weight
  decay per model.
  """
  c = probe_lib.linear_probe_config()
  c.trainer = "attentive_probe"
  # blocks: indices into the backbone's blocks (-1: the last);
  # num_heads: 0 = the backbone's number of heads. The grid keys
  # (probe_grid.grid_config) at their defaults: one setting, optim's.
  c.probe = probe_grid.grid_config()
  c.probe.update(blocks=(-1,), num_heads=0)
  c.batch_size = 1024
  c.total_epochs = 90.0
  c.optim.update(name="adamw", base_lr=1e-3, lr_scaling=True, b1=0.9, b2=0.999,
                 weight_decay=0.05, warmup_epochs=5.0, warmup_steps=-1,
                 schedule="cosine", frozen=["^backbone/"])
  return c


class AttentiveHead(nn.Module):
  """``{block_XX: [B, N, D]}`` -> logits ``[B, K]`` and the pooled ``[B, D]``:
  the chosen blocks' tokens concatenated along the token axis, pooled by
  ``AttentionPool``, then ``BlockProbe`` (BatchNorm without affine + linear)."""
  blocks: tuple[str, ...]
  num_heads: int
  num_classes: int

  @nn.compact
  def __call__(self, tokens: dict, train: bool):
    x = jnp.concatenate([tokens[k] for k in self.blocks], axis=1)
    pooled = probe_heads.AttentionPool(self.num_heads, name="pool")(x)
    return probe_lib.BlockProbe(self.num_classes, name="probe")(pooled, train), pooled


class TokenProbe(nn.Module):
  """One head of the probe grid: ``tokens [B, T, D]`` (the chosen blocks'
  tokens, concatenated) -> logits ``[B, K]``, as ``AttentiveHead`` (the same
  submodules, ``pool`` and ``probe``)."""
  num_heads: int
  num_classes: int

  @nn.compact
  def __call__(self, tokens, train: bool):
    pooled = probe_heads.AttentionPool(self.num_heads, name="pool")(tokens)
    return probe_lib.BlockProbe(self.num_classes, name="probe")(pooled, train)


class ChosenTokens(nn.Module):
  """The probe grid's input: frozen backbone -> the chosen blocks' patch
  tokens, concatenated along the token axis, ``[B, len(blocks) * N, D]``."""
  backbone: vit_lib.ViT
  patch_size: int
  blocks: tuple[str, ...]

  @nn.compact
  def __call__(self, images, *, train: bool = False):
    del train
    tokens = backbone_lib.frozen_patch_tokens(self.backbone, self.patch_size, images)
    return jnp.concatenate([tokens[k] for k in self.blocks], axis=1)


class AttentiveProbe(nn.Module):
  """Frozen backbone -> ``AttentiveHead``; returns ``{"attentive": logits}``
  (a dict as ``LayerProbes`` returns, so the linear probe's loss applies)."""
  backbone: vit_lib.ViT
  patch_size: int
  num_classes: int
  blocks: tuple[str, ...]
  num_heads: int

  @nn.compact
  def __call__(self, images, *, train: bool = False):
    tokens = backbone_lib.frozen_patch_tokens(self.backbone, self.patch_size, images)
    logits, _ = AttentiveHead(self.blocks, self.num_heads, self.num_classes,
                              name="head")(tokens, train)
    return {"attentive": logits}


class AttentiveProbeTrainer(probe_lib.ProbeTrainer):
  """One attentive probe over the chosen blocks of a frozen, restored backbone,
  or a grid of them (one per setting)."""

  def build_model(self, ctx):
    cfg = self.config
    self.check_labels(ctx)
    backbone, patch = vit_lib.vit_from_config(cfg.model)
    heads = cfg.probe.num_heads or backbone.num_heads
    if heads < 1 or backbone.width % heads:
      raise ValueError(f"probe.num_heads {cfg.probe.num_heads} does not divide the width "
                       f"{backbone.width}; set --config.probe.num_heads=0 (the backbone's)")
    blocks = backbone_lib.resolve_blocks(tuple(cfg.probe.blocks), backbone.depth)
    num_classes = ctx.train_source.num_classes
    if not self.is_grid:
      return AttentiveProbe(backbone=backbone, patch_size=patch, num_classes=num_classes,
                            blocks=blocks, num_heads=heads)
    self.head_names = ("attentive",)
    h, w, _ = ctx.train_source.image_shape
    tokens = len(blocks) * (h // patch) * (w // patch)
    self.grid = self.make_grid(ctx, TokenProbe(heads, num_classes), 1,
                               jax.ShapeDtypeStruct((1, tokens, backbone.width), jnp.float32),
                               shared_input=True)
    self.grid_blocks, self.grid_heads = blocks, heads
    return ChosenTokens(backbone=backbone, patch_size=patch, blocks=blocks)

  def eval_fn(self, model, params, model_state, batch, rng):
    if self.grid is not None:
      return super().eval_fn(model, params, model_state, batch, rng)
    del rng
    logits = model.apply({"params": params, **model_state}, batch["image"],
                         train=False)["attentive"]
    labels = batch["label"]
    return {"accuracy": (jnp.argmax(logits, -1) == labels).astype(jnp.float32),
            "loss": mixup_lib.soft_cross_entropy(logits,
                                                 jax.nn.one_hot(labels, model.num_classes))}

  def finalize(self, ctx, model, state):
    """Writes ``attentive_probe.json``: the blocks read and the final accuracy
    (a grid's: the chosen setting's, with its held-out accuracy and the grid)."""
    step = int(jax.device_get(state["step"]))
    if self.grid is None:
      scores = self.final_scores(ctx, model, state)
      report = {"blocks": list(model.blocks), "num_heads": model.num_heads,
                "accuracy": scores["accuracy"], "loss": scores["loss"], "step": step}
    else:
      test, held = self.grid_scores(ctx, model, state)
      rows = [{"block": "attentive", "learning_rate": s.learning_rate,
               "weight_decay": s.weight_decay, "setting": s.name,
               "holdout_accuracy": held.get(f"grid_accuracy_attentive_{s.name}"),
               "accuracy": test[f"grid_accuracy_attentive_{s.name}"]}
              for s in self.grid.settings]
      chosen = probe_grid.choose(rows, "block")["attentive"]
      report = {"blocks": list(self.grid_blocks), "num_heads": self.grid_heads,
                "accuracy": chosen["accuracy"], "holdout_accuracy": chosen["holdout_accuracy"],
                "chosen": chosen, "grid": rows, "step": step,
                "selection": "holdout" if held else "single setting",
                "holdout_size": 0 if self.held_out is None else self.held_out.num_examples}
      scalars = {"val_accuracy": chosen["accuracy"],
                 "val_chosen_learning_rate": chosen["learning_rate"],
                 "val_chosen_weight_decay": chosen["weight_decay"],
                 **{f"val_{k}": v for k, v in test.items()},
                 **{f"val_holdout_{k}": v for k, v in held.items()}}
      if held:
        scalars["val_holdout_accuracy"] = chosen["holdout_accuracy"]
      ctx.writer.write_scalars(step, scalars)
    logging.info("attentive probe over %s: accuracy %.4f", ", ".join(report["blocks"]),
                 report["accuracy"])
    report["programs"] = self.programs.report()     # counted from the trainer's start
    logging.info("%s", self.programs.line("attentive probe"))
    if jax.process_index() == 0:
      files.write_json_atomic(ctx.workdir / "attentive_probe.json", report, indent=1)
