"""The classifier trainer that fine-tuning and the supervised baseline share.

    backbone -> read-out -> linear head
    loss: soft cross entropy against smoothed, mixup/cutmix-mixed targets

``ClassifierTrainer`` owns the model, loss and evaluation;
train/trainers/finetune.py's trainer restores its backbone from a
pretraining checkpoint, train/trainers/supervised.py's trains it from
scratch. ``finetune_config`` is the fine-tuning recipe, which the
supervised baseline and the VTAB suite (train/jobs/vtab.py) re-set.

Recipe (appendix "ImageNet Fine-tuning Hyperparameters"; ``finetune_config``):
full attention by default (``model.causal=False``; the paper's ablation
"read-out" finds it 1% better than causal), the last token's output as the
image descriptor (``head.readout="last"``, or ``"mean"``), RandAugment(9, 0.5)
on the host, mixup 0.8 / cutmix 1.0 (switch 0.5) and label smoothing 0.1 on
device, AdamW (0.9, 0.95), weight decay 0.05, layer-wise lr decay 0.75,
cosine with 5 warm-up epochs, optional EMA of the weights (``ema_decay``,
kept and evaluated with by the shared loop for every trainer: train/loop.py,
darl_jax/ema.py).

Learning rate. The table gives "Learning rate 1e-3 (H: 3e-3)" while the
pretraining and supervised tables say "Base learning rate" with "Learning rate
scaling: True". We read the fine-tuning value literally, as the peak rate
(``optim.lr_scaling=False``). MAE's convention would scale it by batch/256;
``--config.optim.lr_scaling=True`` gives that reading.

Programs. The train step, the evaluation step and the state's
initialisation are compiled before the first step (train/loop.py) and kept
by JAX's persistent compilation cache (``compilation_cache_dir``), so a
rerun, or another run of the same program in the same process, loads them
instead of compiling. What reaches the programs: the model and the batch's
shape, the recipe's constants (drop path, mixup, label smoothing, layer
decay) and the head's size; not the run's length, learning rate or weight
decay (inputs of the step, optim.Hyperparams). ``head.num_classes`` pads
the head to a fixed size (models/heads.py: the task's classes are a
variable of the model state, the rest masked), so that tasks with other
class counts share the train and evaluation steps (VTAB); only the state's
initialisation, which sets that variable, is one program per class count.
Each run logs at its end how many programs it compiled (train/compile_count.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from ml_collections.config_dict import placeholder

from darl_jax import config_lib
from darl_jax import sharding as sharding_lib
from darl_jax import data as data_lib
from darl_jax import mixup as mixup_lib
from darl_jax.models import heads
from darl_jax.models import vit as vit_lib
from darl_jax.train import trainer as trainer_lib
from darl_jax.train import step as step_lib
from darl_jax.train import compile_count
from darl_jax.train import backbone as backbone_lib


def finetune_config() -> ml_collections.ConfigDict:
  """``base_config`` plus the fine-tuning keys, at the paper's recipe."""
  c = config_lib.base_config()
  c.trainer = "finetune"
  c.init_from = ""            # pretraining workdir / checkpoint; "" = random init
  c.init_step = -1            # checkpoint step to restore; -1 = the newest
  c.data.augment = "spatial"  # random-resized crop + flip on the host
  c.model.update(causal=False, drop_path=0.0)
  # head.num_classes: 0 = the data's class count; more = a head of that many
  # outputs whose first (the data's count) are the classes and the rest
  # masked, so that datasets with other class counts share the programs.
  c.head = ml_collections.ConfigDict({"readout": "last", "sos": True, "num_classes": 0})
  # num_ops = 0 turns RandAugment off.
  c.randaugment = ml_collections.ConfigDict({
      "num_ops": 2, "magnitude": 9.0, "magnitude_std": 0.5, "prob": 0.5})
  # Both alphas 0 turn mixing off.
  c.mixup = ml_collections.ConfigDict({
      "mixup_alpha": 0.8, "cutmix_alpha": 1.0, "switch_prob": 0.5, "prob": 1.0})
  c.label_smoothing = 0.1
  c.use_ema = placeholder(bool)   # init_from's EMA weights; None: where it has them
  # Also evaluate at these resolutions (no further training), logged as
  # val_accuracy_at_<size>: the paper's "evaluate with resolution 384" rows.
  # Positions are interpolated onto the trained grid (model.reference_image_size)
  # for every encoding (a learned table is resized bilinearly).
  c.eval_image_sizes = ()
  c.optim.update(name="adamw", base_lr=1e-3, lr_scaling=False, b1=0.9, b2=0.95,
                 weight_decay=0.05, layer_decay=0.75, num_layers=0, warmup_epochs=5.0,
                 warmup_steps=-1, schedule="cosine")
  return c


class ClassifierTrainer(trainer_lib.Trainer):
  """A ``Classifier`` trained with soft targets: the model, loss and evaluation of
  fine-tuning (train/trainers/finetune.py) and the supervised baseline
  (train/trainers/supervised.py), which differ in where the backbone starts."""

  def __init__(self, config):
    super().__init__(config)
    optim_cfg = config.optim
    if optim_cfg.get("layer_decay") and not optim_cfg.get("num_layers"):
      # The decay is per backbone block: default the depth from the variant.
      optim_cfg.num_layers = vit_lib.depth(config.model)
    self._at_size = {}   # eval_image_sizes: size -> (eval source, jitted eval step)
    self.programs = compile_count.Count()   # logged by finalize

  # -------------------------------------------------------------- data

  def make_source(self, config, split: str, *, train: bool):
    return backbone_lib.build_source(config, split, train=train)

  # ------------------------------------------------------------- model

  def build_model(self, ctx):
    cfg = self.config
    trainer_lib.check_image_shape(cfg, ctx.train_source)
    num_classes = ctx.train_source.num_classes
    if num_classes <= 1:
      raise ValueError(f"{cfg.data.name} has no class labels (num_classes={num_classes}); "
                       "classification needs a labelled dataset")
    data_lib.check_labels(ctx.eval_source, num_classes, cfg.data.eval_split)
    if cfg.head.readout not in heads.READOUTS:
      raise ValueError(f"unknown head.readout {cfg.head.readout!r}; valid: "
                       f"{', '.join(heads.READOUTS)}")
    outputs, task_classes = head_size(cfg.head, num_classes, cfg.data.name)
    backbone, patch = vit_lib.vit_from_config(cfg.model)
    return heads.Classifier(backbone=backbone, patch_size=patch, num_classes=outputs,
                            readout=cfg.head.readout, sos=cfg.head.sos,
                            task_classes=task_classes)

  def init_variables(self, model, rng, batch):
    # params, and for a padded head its class mask (model state: "classes")
    return dict(model.init({"params": rng}, batch["image"], train=False))

  # -------------------------------------------------------- loss / eval

  def prepare_batch(self, model, batch, rng, train):
    """Targets and, in training, mixup / cutmix, made on the whole batch:
    mixup pairs examples across it, so it runs once per step before any
    split into microbatches (train/accumulate.py). Adds ``batch["targets"]
    [B, K]`` (one-hot, mixed; the loss smooths them, see smooth_targets);
    ``image`` is the mixed batch."""
    mix_rng, _ = jax.random.split(rng)
    images = batch["image"]
    targets = jax.nn.one_hot(batch["label"], model.num_classes, dtype=jnp.float32)
    mix = self.config.get("mixup")
    if train and mix is not None:
      images, targets, _ = mixup_lib.mix_batch(
          mix_rng, images, targets, mixup_alpha=mix.mixup_alpha,
          cutmix_alpha=mix.cutmix_alpha, switch_prob=mix.switch_prob, prob=mix.prob)
    return {**batch, "image": images, "targets": targets}

  def loss_fn(self, model, params, model_state, batch, rng, train):
    _, drop_rng = jax.random.split(rng)
    if "targets" not in batch:    # called outside the train step (benchmarks, tests)
      batch = self.prepare_batch(model, batch, rng, train)
    logits, _ = model.apply({"params": params, **model_state}, batch["image"], train=train,
                            rngs={"dropout": drop_rng})
    targets = smooth_targets(batch["targets"], self.config.get("label_smoothing", 0.0),
                             heads.class_mask(model_state))
    loss = jnp.mean(mixup_lib.soft_cross_entropy(logits, targets))
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return loss, ({"train_accuracy": accuracy}, model_state)

  def extra_eval(self, ctx, model, state):
    """Accuracy at each of ``config.eval_image_sizes`` with the weights
    evaluation uses (the EMA's with ``eval_with_ema``)."""
    return {f"accuracy_at_{size}": self.accuracy_at(ctx, model, state, int(size))
            for size in self.config.get("eval_image_sizes", None) or ()}

  def accuracy_at(self, ctx, model, state, size: int) -> float:
    cfg = self.config
    if size == cfg.model.image_size:
      raise ValueError(f"eval_image_sizes holds the training size {size}; list other sizes")
    if size not in self._at_size:
      at = cfg.copy_and_resolve_references()
      with at.unlocked():
        at.data.image_size = size
        at.model.image_size = size
        at.model.reference_image_size = (cfg.model.get("reference_image_size", 0)
                                         or cfg.model.image_size)
      resized = model.clone(backbone=vit_lib.vit_from_config(at.model)[0])
      source = self.make_source(at, at.data.eval_split, train=False)
      step = step_lib.make_eval_step(self, resized, jax.random.PRNGKey(cfg.seed), ctx.mesh)
      self._at_size[size] = (source, jax.jit(step))
    source, step = self._at_size[size]
    scores = step_lib.evaluate(self, None, state, source, step,
                           sharding_lib.batch_sharding(ctx.mesh), cfg)
    return scores["accuracy"]

  def eval_fn(self, model, params, model_state, batch, rng):
    del rng
    logits, _ = model.apply({"params": params, **model_state}, batch["image"], train=False)
    labels = batch["label"]
    loss = mixup_lib.soft_cross_entropy(logits, jax.nn.one_hot(labels, model.num_classes))
    return {"accuracy": (jnp.argmax(logits, -1) == labels).astype(jnp.float32),
            "loss": loss}

  def finalize(self, ctx, model, state):
    logging.info("%s", self.programs.line(f"{type(self).__name__} ({ctx.workdir})"))


def head_size(head_cfg, data_classes: int, data_name: str = "the data") -> tuple[int, int]:
  """``(outputs, task_classes)`` of the Classifier for ``data_classes``
  classes: ``(data_classes, 0)`` without padding (``head.num_classes`` 0),
  ``(head.num_classes, data_classes)`` for a padded head."""
  size = int(head_cfg.get("num_classes", 0) or 0)
  if size == 0:
    return data_classes, 0
  if size < data_classes:
    raise ValueError(f"head.num_classes={size} is smaller than the {data_classes} classes of "
                     f"{data_name}; set --config.head.num_classes to at least {data_classes} "
                     "(or 0: the data's count)")
  return size, data_classes


def smooth_targets(targets, smoothing: float, valid=None):
  """Label smoothing of (mixed) one-hot ``targets [B, K]``: ``1 - smoothing``
  of each row's mass stays, ``smoothing`` spreads evenly over the classes:
  all K, or a padded head's ``valid`` ones (heads.class_mask), so that a
  padded head gets the targets of an unpadded one. Mixing and smoothing
  commute (both are affine and keep rows summing to 1), so smoothing after
  mixup gives the targets of mixing smoothed labels."""
  if not smoothing:
    return targets
  if valid is None:
    uniform = 1.0 / targets.shape[-1]
  else:
    uniform = valid.astype(jnp.float32) / jnp.sum(valid.astype(jnp.float32))
  return targets * (1.0 - smoothing) + smoothing * uniform
