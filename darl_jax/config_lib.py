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

from darl_jax import ops
from darl_jax.crop_scale import check_crop_scale


def base_config() -> ml_collections.ConfigDict:
  """Defaults shared by all trainers (a tiny CPU-sized run)."""
  c = ml_collections.ConfigDict()
  c.trainer = "pretrain"
  c.seed = 0
  c.batch_size = 128
  # 0: batch_size, or under gradient accumulation (microbatch_size) the
  # microbatch: the whole batch never runs at once there, and evaluating it
  # in one program can need more memory than the device has (train/fit.py).
  c.eval_batch_size = 0
  c.total_steps = 0              # > 0 overrides total_epochs
  c.total_epochs = 1.0
  c.log_every_steps = 50
  # Also write TensorBoard events beside metrics.jsonl. The clu writer
  # imports TensorFlow, several seconds of every start-up on CPU: the tests'
  # many short runs and the tiny study scale turn it off.
  c.tensorboard = True
  c.checkpoint_every_steps = 1000
  c.eval_every_steps = 1000      # 0: never
  # The first eval_max_batches * batch_size examples of the eval split (batches
  # of the training batch, whatever eval_batch_size is); 0: the whole split.
  c.eval_max_batches = 0
  c.keep_checkpoints = 3
  c.stop_after_steps = 0         # > 0: leave after this many steps (checkpointed)
  # Preemption (darl_jax/preemption.py): SIGTERM and this signal, which a
  # scheduler can send ahead of the stop (Slurm: --signal=USR1@90; "" for
  # none), stop the loop at a step every process reaches, save it and exit
  # with status 143; a save not committed preemption_deadline_s after the
  # notice is removed and the process exits (25: a 30-second notice).
  c.preemption_signal = "SIGUSR1"
  c.preemption_deadline_s = 25.0
  c.skip_nonfinite = False
  # > 0: keep an exponential moving average of the parameters in the train
  # state (darl_jax/ema.py; MAR's 0.9999), checkpointed with it; with
  # eval_with_ema, evaluation, its probes and the final artifacts use it.
  c.ema_decay = 0.0
  c.eval_with_ema = True
  # JAX's persistent compilation cache, so that a rerun or a resumed run skips
  # most of its compilation; "" turns it off. JAX_COMPILATION_CACHE_DIR in the
  # environment wins over this key.
  c.compilation_cache_dir = "~/.cache/darl_jax/jax"
  # Gradient accumulation (train/accumulate.py): global examples per
  # microbatch. 0 = the whole batch at once; -1 = the largest microbatch
  # that fits the device, chosen from memory.py's estimate before anything
  # compiles and checked on the compiled step (train/fit.py; on a CPU, whose
  # memory is not checked, the whole batch). The recipe (batch, learning
  # rate, schedule, EMA) is batch_size's either way.
  c.microbatch_size = 0
  # The memory the train step may use per device, in GiB, checked against
  # XLA's figure of the compiled step before the first step. 0 = the
  # device's own (a GPU's allocator pool, a TPU's HBM; unchecked on CPU).
  c.device_memory_gib = 0.0
  # jax.profiler trace of the steps [start_step, start_step + num_steps)
  # into <workdir>/profile (TensorBoard's profile plugin, Perfetto);
  # start_step 0 = off.
  c.profile = ml_collections.ConfigDict({"start_step": 0, "num_steps": 3})
  c.sharding = "replicated"      # darl_jax.sharding.PARTITION_RULES
  c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})

  c.data = ml_collections.ConfigDict({
      "name": "fashion_mnist", "image_size": 28, "channels": 1, "augment": "none",
      # None = the source's default (e.g. /usr/share/datasets/fashion-mnist).
      "path": placeholder(str), "backend": "auto", "tfds_name": placeholder(str),
      "tfds_data_dir": placeholder(str),
      "val_split_size": 5000, "train_split": "train", "eval_split": "validation",
      # augment="spatial": the random-resized crop's (min, max) fraction of
      # the image's area (data/transforms/augment.py).
      "crop_scale": (0.2, 1.0),
      # Processes building training batches (data/pipeline.py): -1 = this
      # process's share of the host's cores, 0 = in the training process.
      "num_workers": -1,
      # Sharded sources (webdataset, parquet): the validation split's files
      # (None: a hash split of path's), the JSON label field, where shard
      # indexes are cached when not beside the shards, Parquet columns, and
      # the class count (0: max label + 1).
      "eval_path": placeholder(str), "label_key": "label",
      "index_cache_dir": placeholder(str), "image_column": "image",
      "label_column": "label", "num_classes": 0,
      # Sharded sources with several processes: "own" = each process reads
      # only its own training files (p, p + P, ...), "all" = every process
      # reads its slice of one global stream (data/sources/encoded.py).
      "process_files": "own",
      # name="mixture": "spec=weight,spec=weight" (or (spec, weight) pairs),
      # spec a source name or a path (data/sources/mixture.py).
      "mixture": placeholder(str)})

  c.model = ml_collections.ConfigDict({
      "variant": "Ti/4", "width": 0, "depth": 0, "num_heads": 0, "mlp_dim": 0,
      "image_size": 28, "reference_image_size": 0, "channels": 1,
      "posenc": "rope2d", "rope_max_wavelength": 10_000.0,
      "causal": True, "dtype": "float32",
      "drop_path": 0.0, "scan_layers": False, "remat": "none",
      "ordering": "raster", "ordering_block": 2,
      # Prefix-causal pretraining (models/darl.py PREFIXES): "uniform" = per
      # example a prefix of U{1..N-1} patches attends both ways, no loss on it.
      "prefix": "off",
      # XLNet-style query stream (models/two_stream.py); with ordering="random"
      # every example gets a fresh patch order.
      "two_stream": False})

  # How the model's ops run (darl_jax/ops.py): "auto" = the fastest this
  # backend supports, or one named explicitly: attention xla | cudnn |
  # hopper, mlp xla | hopper, norm xla | triton. Not part of the model: a
  # checkpoint resumes, fine-tunes and exports under any choice.
  c.kernels = ml_collections.ConfigDict({"attention": "auto", "mlp": "auto", "norm": "auto"})
  # The dense layers' matmul inputs (darl_jax/fp8.py): "bf16" = the model's
  # dtype; "fp8" = float8 inputs for the backbone's and the decoder's q/k/v,
  # attention output and MLP layers (GPUs of compute capability 8.9 or
  # later), scaled from histories of their largest magnitudes kept in the
  # train state. Not part of the model: a checkpoint of either precision
  # resumes, fine-tunes and exports under the other (the histories start
  # empty or are dropped). Every paper config keeps bf16: fp8 reached bf16's
  # pretraining loss, fine-tuned and linearly probed accuracy within the
  # seeds' noise (the precision study at fmnist_long, 3 seeds,
  # docs/STUDIES.md), but it is not faster on XLA's fp8 GEMMs
  # (benchmarks/RESULTS.md).
  c.precision = "bf16"

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
  c.fewshot_eval = fewshot_eval_config()
  return c


def probe_eval_config() -> ml_collections.ConfigDict:
  """``config.probe_eval``: a closed-form ridge probe on frozen mean-pooled
  features, fitted at every evaluation of a pretraining run and logged as
  ``val_probe_accuracy`` (train/evaluators.py). Off by default."""
  return ml_collections.ConfigDict({
      "enabled": False, "train_split": "train", "eval_split": "validation",
      "num_train_examples": 5000, "num_eval_examples": 2000, "l2": 1e-3,
      "batch_size": 0})


def fewshot_eval_config() -> ml_collections.ConfigDict:
  """``config.fewshot_eval``: few-shot linear classification as big_vision
  evaluates during pretraining (train/evaluators.py): closed-form ridge
  regression of one-hot targets on frozen, mean-pooled features of
  ``shots`` examples per class drawn from ``support_split`` (one draw per
  seed ``0 .. num_seeds - 1``), scored on the first ``num_query_examples``
  of ``query_split``; the L2 strength per fit from ``l2_grid``. Logged as
  ``val_fewshot_<k>shot`` (mean over seeds) and ``..._std``. ``features``:
  ``features`` (the backbone's final, normalised output) or ``block_XX``.
  Off by default; the ``fewshot`` job reads the same keys (without
  ``enabled``)."""
  return ml_collections.ConfigDict({
      "enabled": False, "support_split": "train", "query_split": "validation",
      "shots": (1, 5, 10, 25), "num_seeds": 3,
      "num_support_examples": 10_000, "num_query_examples": 2000,
      "l2_grid": tuple(2.0 ** k for k in range(0, 16, 2)),
      "features": "features", "batch_size": 0})


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
# resolution, precision and memory knobs, not the parameters' shapes (and
# the kernel choices that configs written before ``config.kernels`` kept
# under ``model``); scan_layers stacks the blocks' parameters, which a resume
# converts (darl_jax/layer_layout.py).
RESUMABLE_MODEL_KEYS = ("image_size", "reference_image_size", "dtype", "remat", "drop_path",
                        "scan_layers", "attention_impl", "mlp_impl", "norm_impl")


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


def _json_config(config) -> dict:
  """The resolved config as plain JSON types (what config.json holds)."""
  d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  return json.loads(json.dumps(d, default=str))


def checkpoint_meta(config, step: int) -> dict:
  """The JSON meta saved with every checkpoint: the step, the architecture
  (for the resume check) and the whole resolved config, so that every reader
  of the checkpoint (export, sampling, fine-tuning) takes the config it was
  trained with, not a config.json a later command could have rewritten."""
  arch = _architecture(config)
  return {"step": step, "architecture": arch,
          "architecture_hash": hashlib.sha1(
              json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest(),
          "config": _json_config(config)}


def config_diff(old, new, prefix: str = "") -> list[str]:
  """``["a.b: 1 -> 2", ...]`` for every leaf key whose value differs
  (recursively through dicts; a key on one side only shows as ``None``)."""
  if isinstance(old, dict) and isinstance(new, dict):
    out = []
    for key in sorted(set(old) | set(new), key=str):
      out += config_diff(old.get(key), new.get(key), f"{prefix}{key}.")
    return out
  if old != new:
    # JSON turns tuples into lists: the same value, not a change.
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)) \
        and list(old) == list(new):
      return []
    return [f"{prefix[:-1]}: {old!r} -> {new!r}"]
  return []


def short_diff(diffs: list[str], limit: int = 6) -> str:
  return "; ".join(diffs[:limit]) + (f"; ... ({len(diffs)} keys in all)"
                                     if len(diffs) > limit else "")


# Architecture keys added after checkpoints were written, with the value
# that reproduces what those checkpoints were trained as: a checkpoint that
# lacks the key counts as having that value.
ADDED_MODEL_KEYS = {"prefix": "off"}


def check_resume_compatible(meta: dict, config) -> None:
  """A workdir's checkpoint from another architecture gives a clear error
  naming the changed keys (and only those)."""
  saved = meta.get("architecture")
  if saved is None:
    return
  if isinstance(saved.get("model"), dict):
    # Keys made resumable since the checkpoint was written are left out too.
    saved = {**saved, "model": {k: v for k, v in {**ADDED_MODEL_KEYS, **saved["model"]}.items()
                                if k not in RESUMABLE_MODEL_KEYS}}
  now = json.loads(json.dumps(_architecture(config), default=str))
  diffs = config_diff(saved, now)
  if diffs:
    raise ValueError("the workdir holds a checkpoint of another architecture ("
                     + short_diff(diffs) + "); use a new --workdir or restore the config")


def topology(mesh_shape: dict, processes: int, workers: int) -> dict:
  """Where a run trains, saved with every checkpoint: the mesh's axis sizes,
  the processes and each one's data workers. None of it is part of what a
  checkpoint means: a run resumes on any other (``topology_change``)."""
  axes = {str(k): int(v) for k, v in mesh_shape.items()}
  return {"devices": int(math.prod(axes.values())), "mesh": axes,
          "processes": int(processes), "workers": int(workers)}


def _topology_text(t: dict) -> str:
  mesh = " x ".join(f"{k} {v}" for k, v in t.get("mesh", {}).items())
  return (f"{t.get('devices')} devices ({mesh}) in {t.get('processes')} process(es), "
          f"{t.get('workers')} data worker(s) each")


def topology_change(meta: dict, now: dict, batch_size: int, streams: int) -> str | None:
  """The one line a resumed run logs when it trains on another topology than
  its checkpoint's (None when the same, or the checkpoint predates the record):
  the state was restored onto this run's mesh, and the data goes on with the
  same global batches (base.stream_rows: ``streams`` streams)."""
  before = meta.get("topology")
  if not isinstance(before, dict) or before == now:
    return None
  return (f"resuming on another topology: {_topology_text(before)} -> "
          f"{_topology_text(now)}; parameters and optimizer state restored onto this mesh, "
          f"the global batch ({batch_size}) and the schedule unchanged, the data continues "
          f"in its {streams} stream(s)")


# Keys whose change says nothing about the state's shape: left out when a
# state mismatch lists the config keys that changed since the checkpoint.
RUN_LENGTH_KEYS = ("total_steps", "total_epochs", "stop_after_steps", "log_every_steps",
                   "checkpoint_every_steps", "eval_every_steps", "keep_checkpoints",
                   "preemption_signal", "preemption_deadline_s")


def changed_keys(meta: dict, config) -> list[str]:
  """The config keys that differ between a checkpoint's run and ``config``
  (empty for checkpoints that do not hold their config)."""
  saved = meta.get("config")
  if not isinstance(saved, dict):
    return []
  diffs = config_diff(saved, _json_config(config))
  return [d for d in diffs if d.split(":")[0] not in RUN_LENGTH_KEYS]


# ------------------------------------------------------------------ validation


class ConfigError(ValueError):
  """A config value that no run can use; the message names the key and the fix."""


def _check(config, dotted: str, ok, want: str, example) -> None:
  node = config
  for key in dotted.split("."):
    if not hasattr(node, "keys") or key not in node:
      return                       # trainers without this key
    node = node[key]
  value = node
  is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
  good = is_number and math.isfinite(value) and ok(value)
  if not good:
    raise ConfigError(f"config.{dotted} must be {want}, got {value!r}: set "
                      f"--config.{dotted}={example}")


def _int(lo):
  return lambda v: float(v).is_integer() and v >= lo


# (key, test, what it must be, an example value). Keys a trainer's config
# does not have are skipped.
_RULES = [
    ("batch_size", _int(1), "a positive integer", 128),
    ("eval_batch_size", _int(0), "an integer >= 0 (0: batch_size, or the microbatch)", 0),
    ("total_steps", _int(0), "an integer >= 0 (0: use total_epochs)", 1000),
    ("total_epochs", lambda v: v >= 0, "a number >= 0", 1.0),
    ("log_every_steps", _int(1), "a positive integer", 50),
    ("checkpoint_every_steps", _int(1), "a positive integer", 1000),
    ("eval_every_steps", _int(0), "an integer >= 0 (0: never)", 1000),
    ("eval_max_batches", _int(0), "an integer >= 0 (0: the whole split)", 0),
    ("keep_checkpoints", _int(1), "an integer >= 1 (checkpoints kept)", 3),
    ("stop_after_steps", _int(0), "an integer >= 0 (0: run to the end)", 0),
    ("preemption_deadline_s", lambda v: v > 0, "a positive number of seconds", 25.0),
    ("seed", _int(0), "an integer >= 0", 0),
    ("microbatch_size", _int(-1), "an integer >= -1 (0: the whole batch, -1: automatic)", 0),
    ("device_memory_gib", lambda v: v >= 0, "a number >= 0 (0: the device's own)", 0.0),
    ("profile.start_step", _int(0), "an integer >= 0 (0: no profile)", 0),
    ("profile.num_steps", _int(1), "a positive integer", 3),
    ("label_smoothing", lambda v: 0 <= v < 1, "in [0, 1)", 0.1),
    ("ema_decay", lambda v: 0 <= v < 1, "in [0, 1)", 0.0),
    ("optim.base_lr", lambda v: v > 0, "a positive number", 1e-3),
    ("optim.eps", lambda v: v > 0, "a positive number", 1e-8),
    ("optim.b1", lambda v: 0 <= v < 1, "in [0, 1)", 0.9),
    ("optim.b2", lambda v: 0 <= v < 1, "in [0, 1)", 0.95),
    ("optim.momentum", lambda v: 0 <= v <= 1, "in [0, 1]", 0.9),
    ("optim.weight_decay", lambda v: v >= 0, "a number >= 0", 0.05),
    ("optim.warmup_steps", _int(-1), "an integer >= -1 (-1: use warmup_epochs)", 100),
    ("optim.warmup_epochs", lambda v: v >= 0, "a number >= 0", 0.0),
    ("optim.end_lr_fraction", lambda v: 0 <= v <= 1, "in [0, 1]", 0.0),
    ("optim.grad_clip_norm", lambda v: v >= 0, "a number >= 0 (0: off)", 1.0),
    ("optim.layer_decay", lambda v: 0 <= v <= 1, "in [0, 1] (0: off)", 0.75),
    ("optim.num_layers", _int(0), "an integer >= 0", 0),
    ("model.image_size", _int(1), "a positive integer", 224),
    ("model.channels", _int(1), "a positive integer", 3),
    ("model.width", _int(0), "an integer >= 0 (0: the variant's)", 0),
    ("model.depth", _int(0), "an integer >= 0 (0: the variant's)", 0),
    ("model.num_heads", _int(0), "an integer >= 0 (0: the variant's)", 0),
    ("model.mlp_dim", _int(0), "an integer >= 0 (0: the variant's)", 0),
    ("model.reference_image_size", _int(0), "an integer >= 0 (0: image_size)", 0),
    ("model.rope_max_wavelength", lambda v: v > 0, "a positive number", 10000.0),
    ("model.drop_path", lambda v: 0 <= v < 1, "in [0, 1)", 0.1),
    ("model.ordering_block", _int(1), "a positive integer", 2),
    ("data.image_size", _int(1), "a positive integer", 224),
    ("data.channels", _int(1), "a positive integer", 3),
    ("data.val_split_size", _int(0), "an integer >= 0", 5000),
    ("data.num_workers", _int(-1), "an integer >= -1 (-1: automatic)", -1),
    ("data.num_classes", _int(0), "an integer >= 0 (0: from the labels)", 0),
    # 0 is the paper's linear patch decoder whatever decoder.kind says (the
    # patch_decoder study's depth-0 column); the models treat it so.
    ("decoder.depth", _int(0), "an integer >= 0 (0: one linear layer)", 1),
    ("decoder.width", _int(0), "an integer >= 0 (0: the backbone's)", 0),
    ("decoder.num_heads", _int(0), "an integer >= 0 (0: the backbone's)", 0),
    ("loss.noise_a", lambda v: v > 0, "a positive number", 0.03),
    ("loss.noise_b", lambda v: v > 0, "a positive number", 1.0),
    ("loss.noise_samples", _int(1), "a positive integer", 1),
    ("loss.gamma_bins", _int(1), "a positive integer", 10),
    ("loss.eval_gammas", _int(1), "a positive integer", 8),
    ("predictions.num_images", _int(0), "an integer >= 0", 8),
    ("predictions.num_steps", _int(1), "a positive integer", 100),
    ("sample.num_images", _int(1), "a positive integer", 16),
    ("sample.num_samples", _int(1), "a positive integer", 4),
    ("sample.num_steps", _int(1), "a positive integer", 1000),
    ("sample.temperature", lambda v: v >= 0, "a number >= 0", 1.0),
    ("sample.classifier_steps", _int(0), "an integer >= 0", 0),
    ("sample.classifier_batch_size", _int(1), "a positive integer", 256),
    ("probe_eval.num_train_examples", _int(1), "a positive integer", 5000),
    ("probe_eval.num_eval_examples", _int(1), "a positive integer", 2000),
    ("probe_eval.l2", lambda v: v >= 0, "a number >= 0", 1e-3),
    ("probe_eval.batch_size", _int(0), "an integer >= 0 (0: batch_size, or the microbatch)", 0),
    ("fewshot_eval.num_seeds", _int(1), "a positive integer", 3),
    ("fewshot_eval.num_support_examples", _int(1), "a positive integer", 10000),
    ("fewshot_eval.num_query_examples", _int(1), "a positive integer", 2000),
    ("fewshot_eval.batch_size", _int(0), "an integer >= 0 (0: batch_size, or the microbatch)", 0),
    ("randaugment.num_ops", _int(0), "an integer >= 0 (0: off)", 2),
    ("randaugment.magnitude", lambda v: v >= 0, "a number >= 0", 9.0),
    ("randaugment.magnitude_std", lambda v: v >= 0, "a number >= 0", 0.5),
    ("randaugment.prob", lambda v: 0 <= v <= 1, "in [0, 1]", 0.5),
    ("mixup.mixup_alpha", lambda v: v >= 0, "a number >= 0 (0: off)", 0.8),
    ("mixup.cutmix_alpha", lambda v: v >= 0, "a number >= 0 (0: off)", 1.0),
    ("mixup.switch_prob", lambda v: 0 <= v <= 1, "in [0, 1]", 0.5),
    ("mixup.prob", lambda v: 0 <= v <= 1, "in [0, 1]", 1.0),
]


# Lists of numbers: (key, test of each entry, what each must be, an example).
_LIST_RULES = [
    ("fewshot_eval.shots", _int(1), "positive integers", "1,5,10,25"),
    ("fewshot_eval.l2_grid", lambda v: v > 0, "positive numbers", "1.0,1024.0"),
]


def _check_list(config, dotted: str, ok, want: str, example) -> None:
  node = config
  for key in dotted.split("."):
    if not hasattr(node, "keys") or key not in node:
      return
    node = node[key]
  values = node if isinstance(node, (list, tuple)) else None
  good = bool(values) and all(
      isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and ok(v)
      for v in values)
  if not good:
    raise ConfigError(f"config.{dotted} must be a non-empty list of {want}, got {node!r}: "
                      f"set --config.{dotted}=({example})")


def validate(config) -> None:
  """Fails on the first config value no run can use, with one line naming the
  key and a value that works. Called before anything is written or compiled:
  a zero interval would otherwise fail with ZeroDivisionError only once
  training has started, and keep_checkpoints=0 would keep no checkpoint."""
  for dotted, ok, want, example in _RULES:
    _check(config, dotted, ok, want, example)
  for dotted, ok, want, example in _LIST_RULES:
    _check_list(config, dotted, ok, want, example)
  if "preemption_signal" in config:
    try:
      preemption_signal_number(config.preemption_signal)
    except ValueError as e:
      raise ConfigError(f"config.{e}: set --config.preemption_signal=SIGUSR1") from None
  scale = config.get("data", {}).get("crop_scale")
  if scale is not None:
    try:
      check_crop_scale(scale)   # the rule the data sources apply
    except ValueError as e:
      raise ConfigError(f"config.{e}") from None
  for op, valid in ops.CHOICES.items():
    value = config.get("kernels", {}).get(op, "auto")
    if value not in valid:
      raise ConfigError(f"config.kernels.{op} must be one of {', '.join(valid)}, got "
                        f"{value!r}: set --config.kernels.{op}=auto")
  if config.get("precision", "bf16") not in ops.PRECISIONS:
    raise ConfigError(f"config.precision must be one of {', '.join(ops.PRECISIONS)}, got "
                      f"{config.precision!r}: set --config.precision=bf16")
  mesh = config.get("mesh")
  if mesh is not None:
    for axis in mesh.keys():
      _check(config, f"mesh.{axis}", lambda v: v == -1 or _int(1)(v),
             "-1 (all remaining devices) or a positive integer", 1)


# Signals that cannot be config.preemption_signal: SIGINT is Ctrl-C's (it
# interrupts at once), the others cannot be caught or mean a fault.
UNUSABLE_SIGNALS = ("SIGINT", "SIGKILL", "SIGSTOP", "SIGCHLD", "SIGSEGV", "SIGBUS", "SIGFPE",
                    "SIGILL", "SIGABRT", "SIGPIPE")


def preemption_signal_number(name) -> int | None:
  """``"SIGUSR1"`` or ``"USR1"`` -> its number; ``""`` -> None (no signal
  beside SIGTERM). ValueError (``preemption_signal ...``) naming the valid
  names otherwise."""
  import signal  # pylint: disable=g-import-not-at-top
  text = name.strip().upper() if isinstance(name, str) else None
  if text == "":
    return None
  valid = sorted(s.name for s in signal.Signals
                 if s.name not in UNUSABLE_SIGNALS and not s.name.startswith("SIGRT"))
  full = None if text is None else (text if text.startswith("SIG") else "SIG" + text)
  if full not in valid:
    raise ValueError(f"preemption_signal must be a signal name such as SIGUSR1, or \"\" for "
                     f"none, got {name!r}; valid: {', '.join(valid)}")
  return int(signal.Signals[full])


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


def imagenet_frozen_backbone(c, variant: str, *, augment: str) -> None:
  """Sets ``c`` (a frozen-feature evaluation's config: linear or attentive
  probe, kNN) to read ImageNet at 224 through the paper's causal ViT
  ``variant`` (2D RoPE, bfloat16)."""
  c.data.update(name="imagenet2012", tfds_name="imagenet2012", image_size=224, channels=3,
                augment=augment, train_split="train", eval_split="validation")
  c.model.update(variant=variant, image_size=224, reference_image_size=224, channels=3,
                 posenc="rope2d", causal=True, dtype="bfloat16", drop_path=0.0)


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
