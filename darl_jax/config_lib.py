"""Shared config pieces: the keys every trainer has, durations, resume checks.

Experiment files in ``experiments/`` start from ``base_config()`` and set what
their paper table says. Every trainer config has ``total_steps`` (or
``total_epochs``, resolved here; a positive ``total_steps`` always wins),
``batch_size`` (global), ``seed``, ``log_every_steps``,
``checkpoint_every_steps`` and ``eval_every_steps``, so any run can be
shortened from the command line.
"""

from __future__ import annotations

import hashlib
import json
import math

import ml_collections
from ml_collections.config_dict import placeholder


def base_config() -> ml_collections.ConfigDict:
  """Defaults shared by all trainers (a tiny CPU-sized run)."""
  c = ml_collections.ConfigDict()
  c.trainer = "pretrain"
  c.seed = 0
  c.batch_size = 128
  c.eval_batch_size = 0          # 0: same as batch_size
  c.total_steps = 0              # > 0 overrides total_epochs
  c.total_epochs = 1.0
  c.log_every_steps = 50
  # Also write TensorBoard events beside metrics.jsonl. The clu writer
  # imports TensorFlow, several seconds of every start-up on CPU: the tests'
  # many short runs and the tiny study scale turn it off.
  c.tensorboard = True
  c.checkpoint_every_steps = 1000
  c.eval_every_steps = 1000      # 0: never
  c.eval_max_batches = 0         # 0: the whole eval split
  c.keep_checkpoints = 3
  c.stop_after_steps = 0         # > 0: leave after this many steps (checkpointed)
  c.skip_nonfinite = False
  # JAX's persistent compilation cache, so that a rerun or a resumed run skips
  # most of its compilation; "" turns it off. JAX_COMPILATION_CACHE_DIR in the
  # environment wins over this key.
  c.compilation_cache_dir = "~/.cache/darl_jax/jax"
  c.sharding = "replicated"      # darl_jax.sharding.PARTITION_RULES
  c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})

  c.data = ml_collections.ConfigDict({
      "name": "fashion_mnist", "image_size": 28, "channels": 1, "augment": "none",
      # None = the source's default (e.g. /usr/share/datasets/fashion-mnist).
      "path": placeholder(str), "backend": "auto", "tfds_name": placeholder(str),
      "tfds_data_dir": placeholder(str),
      "val_split_size": 5000, "train_split": "train", "eval_split": "validation"})

  c.model = ml_collections.ConfigDict({
      "variant": "Ti/4", "width": 0, "depth": 0, "num_heads": 0, "mlp_dim": 0,
      "image_size": 28, "reference_image_size": 0, "channels": 1,
      "posenc": "rope2d", "rope_max_wavelength": 10_000.0,
      # Implementations: "auto" = the fastest this backend supports
      # (darl_jax/kernels/select.py), or one named explicitly: attention
      # xla | cudnn | hopper, mlp xla | hopper, norm xla | triton.
      "causal": True, "attention_impl": "auto", "dtype": "float32",
      "mlp_impl": "auto",
      "norm_impl": "auto",
      "drop_path": 0.0, "scan_layers": False, "remat": "none",
      "ordering": "raster", "ordering_block": 2,
      # XLNet-style query stream (models/two_stream.py); with ordering="random"
      # every example gets a fresh patch order.
      "two_stream": False})

  c.optim = ml_collections.ConfigDict({
      "name": "adamw", "base_lr": 1.5e-4, "lr_scaling": True, "b1": 0.9, "b2": 0.95,
      "eps": 1e-8, "weight_decay": 0.05, "momentum": 0.9, "schedule": "cosine",
      "warmup_steps": -1, "warmup_epochs": 0.0, "end_lr_fraction": 0.0,
      "grad_clip_norm": 0.0, "layer_decay": 0.0, "num_layers": 0, "frozen": [],
      "no_decay": None})
  return c


def pretrain_config() -> ml_collections.ConfigDict:
  """``base_config`` plus the DARL decoder and loss sections."""
  c = base_config()
  c.decoder = ml_collections.ConfigDict({
      "kind": "linear", "depth": 1, "width": 0, "num_heads": 0,
      "gamma_conditioning": False})
  c.loss = ml_collections.ConfigDict({
      "kind": "mse", "norm_pix": False, "noise_a": 0.03, "noise_b": 1.0,
      "predict": "x0", "noise_samples": 1, "gamma_bins": 10, "eval_gammas": 8})
  c.predictions = ml_collections.ConfigDict({"num_images": 8, "num_steps": 100})
  c.probe_eval = probe_eval_config()
  return c


def probe_eval_config() -> ml_collections.ConfigDict:
  """``config.probe_eval``: a closed-form ridge probe on frozen mean-pooled
  features, fitted at every evaluation of a pretraining run and logged as
  ``val_probe_accuracy`` (train/linear_probe.py). Off by default."""
  return ml_collections.ConfigDict({
      "enabled": False, "train_split": "train", "eval_split": "validation",
      "num_train_examples": 5000, "num_eval_examples": 2000, "l2": 1e-3,
      "batch_size": 0})


# The small ViT of every Fashion-MNIST experiment (7x7 patches of 4x4 pixels);
# the fine-tune, probe and supervised configs repeat it so checkpoints load.
FASHION_MNIST_MODEL = {"variant": "Ti/4", "width": 128, "depth": 4, "num_heads": 4,
                       "mlp_dim": 512, "image_size": 28, "channels": 1, "posenc": "rope2d",
                       "rope_max_wavelength": 100.0}


def fashion_mnist_setup(c: ml_collections.ConfigDict, *, augment: str) -> None:
  """Sets ``c.data`` to Fashion-MNIST 28x28 and ``c.model`` to FASHION_MNIST_MODEL."""
  c.data.update(name="fashion_mnist", image_size=28, channels=1, augment=augment)
  c.model.update(**FASHION_MNIST_MODEL)


def fashion_mnist_pretrain_config(steps: int) -> ml_collections.ConfigDict:
  """The small Fashion-MNIST DARL setup shared by experiments/fashion_mnist_*.py.

  A causal ViT (width 128, 4 blocks, 4 heads) over 7x7 patches of 4x4 pixels
  with 2D RoPE, batch 128, AdamW at base lr 1e-3 (5e-4 peak after scaling by
  128/256: short runs want a larger lr than the paper's 1.5e-4, which is
  tuned for 800 ImageNet epochs), 100 warm-up steps. The objective and
  decoder are left at MSE / linear for the experiment file to set.
  """
  c = pretrain_config()
  c.total_steps = steps
  c.batch_size = 128
  c.log_every_steps = 50
  c.checkpoint_every_steps = 500
  c.eval_every_steps = 500
  c.eval_max_batches = 10
  fashion_mnist_setup(c, augment="none")
  c.optim.update(base_lr=1e-3, warmup_steps=100, weight_decay=0.05)
  return c


def resolve_total_steps(config, steps_per_epoch: int) -> int:
  """``total_steps`` if positive, else ``ceil(total_epochs * steps_per_epoch)``."""
  if config.get("total_steps", 0) and config.total_steps > 0:
    return int(config.total_steps)
  epochs = config.get("total_epochs", 0)
  if not epochs or epochs <= 0:
    raise ValueError("set config.total_steps or config.total_epochs to a positive value")
  return max(1, math.ceil(epochs * steps_per_epoch))


# Model keys that may change between a checkpoint and its resumed run:
# resolution, implementation and memory knobs, not the parameters' shapes.
RESUMABLE_MODEL_KEYS = ("image_size", "reference_image_size", "attention_impl", "mlp_impl",
                        "norm_impl", "dtype", "remat", "drop_path")


def _architecture(config) -> dict:
  """The config entries that decide what a checkpoint's state means."""
  d = config.to_dict()
  out = {"trainer": d.get("trainer")}
  if "model" in d:
    out["model"] = {k: v for k, v in d["model"].items() if k not in RESUMABLE_MODEL_KEYS}
  if "decoder" in d:
    out["decoder"] = d["decoder"]
  if "loss" in d:
    out["loss"] = {k: d["loss"].get(k) for k in ("kind", "predict")}
  return out


def checkpoint_meta(config, step: int) -> dict:
  arch = _architecture(config)
  return {"step": step, "architecture": arch,
          "architecture_hash": hashlib.sha1(
              json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()}


def check_resume_compatible(meta: dict, config) -> None:
  """A workdir's checkpoint from another architecture gives a clear error."""
  saved = meta.get("architecture")
  if saved is None:
    return
  now = _architecture(config)
  if saved != now:
    diffs = []
    for key in sorted(set(saved) | set(now)):
      a, b = saved.get(key), now.get(key)
      if isinstance(a, dict) and isinstance(b, dict):
        diffs += [f"{key}.{k}: {a.get(k)!r} -> {b.get(k)!r}"
                  for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
      elif a != b:
        diffs.append(f"{key}: {a!r} -> {b!r}")
    raise ValueError("the workdir holds a checkpoint of another architecture ("
                     + "; ".join(diffs) + "); use a new --workdir or restore the config")


def config_node(config, dotted: str):
  """``(parent, key)`` of the entry ``"a.b.c"`` of ``config``; a missing key is a
  ValueError naming the valid keys at that level (the command line's and the
  studies' override checks)."""
  keys = dotted.split(".")
  node = config
  for i, key in enumerate(keys):
    if not hasattr(node, "keys") or key not in node:
      where = ".".join(keys[:i]) or "the config"
      valid = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "(none)"
      raise ValueError(f"{where} has no key {key!r}; valid keys there: {valid}")
    if i < len(keys) - 1:
      node = node[key]
  return node, keys[-1]


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """``"variant=L/16,runlocal"`` -> ConfigDict, typed by the defaults.

  A bare ``name`` sets a boolean default to True. Unknown names fail with the
  list of valid ones.
  """
  out = ml_collections.ConfigDict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, eq, value = item.partition("=")
    if key not in defaults:
      raise ValueError(f"unknown config argument {key!r}; valid: {', '.join(defaults)}")
    default = defaults[key]
    if not eq:
      if not isinstance(default, bool):
        raise ValueError(f"config argument {key!r} needs a value ({key}=...)")
      out[key] = True
    elif isinstance(default, bool):
      out[key] = value.lower() in ("1", "true", "yes")
    else:
      out[key] = type(default)(value)
  return out


def imagenet_pretrain_config(variant: str, objective: str) -> ml_collections.ConfigDict:
  """The paper's ImageNet pretraining table (appendix "Hyperparameters").

  AdamW (0.9, 0.95), base lr 1.5e-4 x batch/256, wd 0.05, batch 4096, cosine
  with 40 warm-up epochs, 800 epochs, Xavier-uniform init, spatial
  augmentation, 2D RoPE, 224x224. MSE uses a linear patch decoder; diffusion
  a one-block Transformer decoder with gamma ~ Beta(0.03, 1) predicting x0.
  """
  if objective not in ("mse", "diffusion"):
    raise ValueError(f"unknown objective {objective!r}; valid: mse, diffusion")
  c = pretrain_config()
  c.batch_size = 4096
  c.total_epochs = 800.0
  c.log_every_steps = 100
  c.checkpoint_every_steps = 2000
  c.eval_every_steps = 10_000
  c.data.update(name="imagenet2012", image_size=224, channels=3, augment="spatial",
                tfds_name="imagenet2012")
  c.model.update(variant=variant, image_size=224, channels=3, posenc="rope2d",
                 dtype="bfloat16")
  c.optim.update(base_lr=1.5e-4, lr_scaling=True, b1=0.9, b2=0.95, weight_decay=0.05,
                 warmup_epochs=40.0, schedule="cosine")
  if objective == "diffusion":
    c.decoder.update(kind="transformer", depth=1)
    c.loss.update(kind="diffusion", noise_a=0.03, noise_b=1.0, predict="x0")
  else:
    c.decoder.update(kind="linear")
    c.loss.update(kind="mse")
  c.predictions.num_images = 8
  return c
