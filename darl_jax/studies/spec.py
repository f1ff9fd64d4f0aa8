"""Stages, runs, studies and the scales they run at.

A ``Stage`` is one ``python -m darl_jax.main`` job: an experiment config
(``"experiments/x.py:arg=1"``) and a dict of config overrides (the
``--config.<key>=<value>`` flags), plus optionally the stage whose workdir it
starts from (``config.init_from``). Its id is a hash of exactly these, so two
runs (or two studies) that need the same pretraining share one job and one
result; results are keyed by stage id.

A ``Run`` is a chain of stages with the labels that place it in the study's
tables (``{"posenc": "rope2d", "protocol": "darl", "seed": 0}``). A ``Study``
is its runs plus how to report them (``report.Table``, ``report.Plot``).

A ``Scale`` says which configs and lengths a study uses: ``tiny`` (seconds on
CPU, for tests), ``fmnist`` (Fashion-MNIST, minutes on one GPU: the numbers in
docs/STUDIES.md) and ``imagenet`` (the paper's setting with ViT-B/16; the same
studies, other configs).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib
import runpy
from typing import Any

from darl_jax import config_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Stage:
  kind: str                      # "pretrain", "finetune", "supervised", "probe",
                                 # "attentive_probe", "knn"
  config: str                    # experiment file[:arg], relative to the repository
  overrides: tuple = ()          # sorted ((key, value), ...)
  parent: "Stage | None" = None  # its workdir becomes config.init_from

  @property
  def id(self) -> str:
    """``<kind>-<hash of the resolved config and the parent's id>``: two stages
    that resolve to the same config share one job, however they were written."""
    blob = json.dumps({"config": _resolved(self.config, self.overrides),
                       "parent": self.parent.id if self.parent else None}, sort_keys=True)
    return f"{self.kind}-{hashlib.sha1(blob.encode()).hexdigest()[:10]}"

  def override_dict(self) -> dict:
    return dict(self.overrides)


def stage(kind: str, config: str, *override_dicts: dict, parent: Stage | None = None) -> Stage:
  """A stage whose overrides are the union of ``override_dicts`` (later wins)."""
  merged: dict = {}
  for d in override_dicts:
    merged.update(d)
  return Stage(kind, config, tuple(sorted((k, _freeze(v)) for k, v in merged.items())), parent)


# A stage's id hashes what it computes. Left out of it:
# - keys that say how a stage runs, not what it computes (the data workers
#   give the same batches, tests/test_pipeline.py; the kernels compute the
#   same functions; model.attention_impl was their choice before
#   config.kernels; the preemption signal and deadline say how a run is
#   stopped and checkpointed);
# - config keys added after stage results were recorded, at the value that
#   reproduces the code before them (any other value is part of the id).
# So adding a config key or a speed option does not re-key, and rerun, every
# recorded stage: when a new key fails tests/test_studies.py's pinned ids,
# add it to KEYS_ADDED. A code change that does change results (a bug fix)
# needs its stage files deleted by hand.
HOW_KEYS = ("compilation_cache_dir", "data.num_workers", "tensorboard", "kernels",
            "model.attention_impl", "device_memory_gib", "profile", "preemption_signal",
            "preemption_deadline_s")
KEYS_ADDED = {
    "microbatch_size": 0,
    # The sharded and mixed data sources (data/sources/webdataset.py, parquet.py,
    # mixture.py): their keys at the values that read as before.
    "data.eval_path": None, "data.image_column": "image", "data.index_cache_dir": None,
    "data.label_column": "label", "data.label_key": "label", "data.mixture": None,
    "data.num_classes": 0,
    "data.process_files": "own",
    "data.crop_scale": [0.2, 1.0],
    "model.prefix": "off",
    "ema_decay": 0.0,
    "eval_with_ema": True,
    "use_ema": None,
    "fewshot_eval": config_lib.fewshot_eval_config().to_dict(),
    # The probe grid (train/probe_grid.py) at its single setting: the linear
    # probe's whole ``probe`` dict, then the attentive probe's grid keys
    # beside its blocks and heads.
    "probe": {"learning_rates": [], "weight_decays": [], "holdout_size": -1,
              "poolings": ["mean"]},
    "probe.learning_rates": [],
    "probe.weight_decays": [],
    "probe.holdout_size": -1,
    "probe.poolings": ["mean"],
    # The padded classifier head (train/classifier.py, VTAB's shared steps):
    # 0 = the data's class count, as before.
    "head.num_classes": 0,
    # The dense layers' precision (darl_jax/fp8.py): bf16 is the model's dtype, as before.
    "precision": "bf16",
}


def _parent(resolved: dict, dotted: str) -> tuple[dict, str]:
  """The dict holding ``dotted``'s last key (an empty one if a level is absent)."""
  *path, key = dotted.split(".")
  node = resolved
  for part in path:
    node = node.get(part, {})
  return node, key


@functools.lru_cache(maxsize=None)
def _resolved(config: str, overrides: tuple) -> str:
  """The stage's resolved config as the JSON its id hashes (see HOW_KEYS)."""
  as_json = lambda obj: json.loads(json.dumps(obj, default=repr))  # tuples -> lists
  resolved = as_json(load_config(Stage("", config, overrides)).to_dict())
  for dotted in HOW_KEYS:
    node, key = _parent(resolved, dotted)
    node.pop(key, None)
  for dotted, old_behaviour in KEYS_ADDED.items():
    node, key = _parent(resolved, dotted)
    if key in node and node[key] == as_json(old_behaviour):
      del node[key]
  return json.dumps(resolved, sort_keys=True)


def _freeze(value):
  return tuple(value) if isinstance(value, list) else value


@dataclasses.dataclass(frozen=True)
class Run:
  labels: dict
  stages: tuple[Stage, ...]

  @property
  def name(self) -> str:
    return ",".join(f"{k}={v}" for k, v in self.labels.items())


@dataclasses.dataclass
class Study:
  name: str
  title: str
  paper: str                     # the paper's finding / numbers, markdown
  runs: list[Run]
  tables: list = dataclasses.field(default_factory=list)
  plots: list = dataclasses.field(default_factory=list)
  # Rows that come from a result file in <out> rather than from stages
  # (runner.COMPARATORS): the raw-pixel linear classifier.
  comparators: tuple = ()
  # The paper's claims as differences of means (report.Comparison), read in
  # the report as beyond noise, suggestive or within noise.
  comparisons: tuple = ()

  def __post_init__(self):
    names = [r.name for r in self.runs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
      raise ValueError(f"study {self.name!r} has runs with the same labels: {dupes}")

  def stages(self) -> list[Stage]:
    """Every distinct stage, parents before children."""
    return distinct_stages([s for run in self.runs for s in run.stages])


def distinct_stages(stages) -> list[Stage]:
  """``stages`` and their parents, each id once, parents before children."""
  out: dict[str, Stage] = {}

  def add(s: Stage):
    if s.parent is not None:
      add(s.parent)
    out.setdefault(s.id, s)

  for s in stages:
    add(s)
  return list(out.values())


# ------------------------------------------------------------------- scales


@dataclasses.dataclass(frozen=True)
class Scale:
  """Configs, lengths and sweep values of one size of the studies."""
  name: str
  pretrain_mse: str
  pretrain_diff: str
  finetune: str
  supervised: str
  probe: str
  attentive_probe: str           # "" where the scale has no attentive-probe config
  common: dict                   # overrides for every stage
  pretrain: dict                 # overrides for pretraining stages (length, ...)
  downstream: dict               # overrides for fine-tune / supervised stages
  supervised_overrides: dict     # and on top of those for supervised stages
  probe_overrides: dict
  length_key: str                # "total_steps" or "total_epochs"
  lengths: tuple                 # training-length study
  model_family: str              # variant size name; patch sizes are appended
  patch: int                     # the default patch size
  patch_sizes: tuple             # noise-schedule study: (small, large)
  beta_grid: tuple               # noise-schedule study: values of a and b
  eval_size: int                 # positional-encoding study: larger resolution
  ordering_image: dict           # ordering study: image size / patch overrides
  ordering_blocks: tuple
  two_stream_lengths: tuple
  model_sizes: dict              # scaling study: name -> model overrides
  decoder_depths: tuple
  seeds: dict                    # study name -> default number of seeds
  # Linear-probe-only overrides (its LARS lr), kept off the attentive probe.
  linear_probe_overrides: dict = dataclasses.field(default_factory=dict)
  # finetune_recipe study: the crops' smallest area fractions (besides no
  # augmentation) and the lengths, as multiples of the downstream length.
  recipe_crop_scales: tuple = (0.2, 0.5, 0.8)
  recipe_lengths: tuple = (1, 2)
  # The kNN job's config (train/jobs/knn.py); "" where the scale has none. And
  # its overrides on top of ``common``.
  knn: str = ""
  knn_overrides: dict = dataclasses.field(default_factory=dict)

  def variant(self, patch: int | None = None) -> str:
    return f"{self.model_family}/{patch or self.patch}"


_FMNIST_MODEL = {f"model.{k}": config_lib.FASHION_MNIST_MODEL[k]
                 for k in ("width", "depth", "num_heads", "mlp_dim")}

SCALES = {
    # Seconds per stage on CPU: exercises every study's wiring, not its findings.
    "tiny": Scale(
        name="tiny",
        pretrain_mse="experiments/fashion_mnist_mse.py",
        pretrain_diff="experiments/fashion_mnist_diff.py",
        finetune="experiments/fashion_mnist_finetune.py:light",
        supervised="experiments/supervised_fashion_mnist.py",
        probe="experiments/fashion_mnist_linear_probe.py",
        attentive_probe="experiments/fashion_mnist_attentive_probe.py",
        knn="experiments/fashion_mnist_knn.py",
        # Seconds, not the 3,400 batches of 16 of every training image.
        knn_overrides={"knn.num_train_examples": 256},
        common={"batch_size": 16, "eval_max_batches": 1, "log_every_steps": 1,
                "checkpoint_every_steps": 1000, "keep_checkpoints": 1,
                "tensorboard": False,   # TensorFlow's import: most of a stage's start-up
                "model.width": 32, "model.depth": 2, "model.num_heads": 2,
                "model.mlp_dim": 64},
        pretrain={"total_steps": 3, "eval_every_steps": 3, "predictions.num_images": 0,
                  "optim.warmup_steps": 1},
        downstream={"total_steps": 2, "eval_every_steps": 2, "optim.warmup_steps": 1},
        supervised_overrides={},
        probe_overrides={"total_steps": 2, "eval_every_steps": 2, "optim.warmup_steps": 1},
        length_key="total_steps", lengths=(2, 4),
        model_family="Ti", patch=4, patch_sizes=(4, 7), beta_grid=(0.1, 10.0),
        eval_size=36,
        ordering_image={"data.image_size": 16, "model.image_size": 16, "model.variant": "Ti/2"},
        ordering_blocks=(2, 4), two_stream_lengths=(2, 4),
        model_sizes={"S": {"model.width": 16, "model.num_heads": 2, "model.mlp_dim": 32},
                     "M": {"model.width": 32, "model.num_heads": 2, "model.mlp_dim": 64}},
        decoder_depths=(1, 2),
        seeds={}),
    # Fashion-MNIST on one GPU: each stage under a minute; docs/STUDIES.md.
    "fmnist": Scale(
        name="fmnist",
        pretrain_mse="experiments/fashion_mnist_mse.py",
        pretrain_diff="experiments/fashion_mnist_diff.py",
        finetune="experiments/fashion_mnist_finetune.py:light",
        supervised="experiments/supervised_fashion_mnist.py",
        probe="experiments/fashion_mnist_linear_probe.py",
        attentive_probe="experiments/fashion_mnist_attentive_probe.py",
        knn="experiments/fashion_mnist_knn.py",
        common={"batch_size": 256, "eval_max_batches": 0, "log_every_steps": 50,
                "checkpoint_every_steps": 100_000, "keep_checkpoints": 1, **_FMNIST_MODEL},
        pretrain={"total_steps": 600, "eval_every_steps": 100_000,
                  "predictions.num_images": 0, "optim.warmup_steps": 60},
        # The light recipe (no RandAugment / mixup / crops) for fine-tuning and
        # the supervised baseline alike: a few hundred steps are too short for
        # the heavy one to pay off (docs/RESULTS.md).
        downstream={"total_steps": 300, "eval_every_steps": 100_000,
                    "optim.warmup_steps": 30, "data.augment": "none",
                    "randaugment.num_ops": 0, "mixup.mixup_alpha": 0.0,
                    "mixup.cutmix_alpha": 0.0},
        # As many optimizer steps as pretraining + fine-tuning.
        supervised_overrides={"total_steps": 900, "optim.warmup_steps": 90},
        probe_overrides={"total_steps": 300, "eval_every_steps": 100_000},
        length_key="total_steps", lengths=(300, 600, 1200, 2400),
        model_family="Ti", patch=4, patch_sizes=(4, 7), beta_grid=(0.1, 1.0, 10.0),
        eval_size=48,
        # 32 x 32 images in 2 x 2 patches: a 16 x 16 grid, the paper's 256 / 16.
        ordering_image={"data.image_size": 32, "model.image_size": 32, "model.variant": "Ti/2"},
        ordering_blocks=(2, 4, 8), two_stream_lengths=(600, 2400),
        model_sizes={"S": {"model.width": 64, "model.depth": 4, "model.num_heads": 2,
                           "model.mlp_dim": 256},
                     "M": dict(_FMNIST_MODEL),
                     "L": {"model.width": 192, "model.depth": 6, "model.num_heads": 6,
                           "model.mlp_dim": 768}},
        decoder_depths=(1, 2, 4),
        # Three seeds for the seven studies and prefix (docs/STUDIES.md reads
        # their verdicts off mean +- std); downstream and finetune_recipe run
        # one, their three-seed figures are fmnist_long's.
        seeds={name: 3 for name in ("positional_encoding", "readout", "training_length",
                                    "patch_decoder", "noise_schedule", "ordering",
                                    "scaling", "prefix")}),
    # The paper's setting (ViT-B/16 to keep the sweeps affordable; the configs
    # give L/16 and H/14 too). Not run here: hundreds of TPU-days.
    "imagenet": Scale(
        name="imagenet",
        pretrain_mse="experiments/vit_b16_mse.py",
        pretrain_diff="experiments/vit_b16_diff.py",
        finetune="experiments/finetune_in1k.py:variant=B/16,epochs=50",
        supervised="experiments/supervised_in1k.py:variant=B/16",
        probe="experiments/linear_probe_in1k.py:variant=B/16",
        # Not experiments/attentive_probe_in1k.py: the downstream study names
        # the attentive probe's blocks from common's model.depth, which this
        # scale leaves to the variant, so its rows would read the wrong blocks.
        attentive_probe="",
        knn="experiments/knn_in1k.py:variant=B/16",
        common={"keep_checkpoints": 1},
        pretrain={"total_epochs": 100.0},
        downstream={},
        supervised_overrides={},
        probe_overrides={},
        length_key="total_epochs", lengths=(100.0, 200.0, 400.0, 800.0),
        model_family="B", patch=16, patch_sizes=(16, 56),
        beta_grid=(0.1, 0.3, 1.0, 3.0, 10.0), eval_size=384,
        ordering_image={"data.image_size": 256, "model.image_size": 256},
        ordering_blocks=(2, 4, 8), two_stream_lengths=(100.0, 400.0),
        model_sizes={"B": {"model.variant": "B/16"}, "L": {"model.variant": "L/16"},
                     "H": {"model.variant": "H/14"}},
        decoder_depths=(1, 2, 4, 8),
        seeds={}),
}


# Fashion-MNIST with a larger ViT trained for tens of epochs, three seeds,
# on one GPU; docs/STUDIES.md, section "fmnist_long". Adapted from the paper's recipes, each change stated:
# - model: width 256, 6 blocks, 4 heads of 64, MLP 1024 (about 4.8M
#   parameters, between the fmnist scale's "L" and a ViT-S), 4x4 patches;
# - pretraining: batch 512, 40 epochs (4300 steps), AdamW at the Fashion-MNIST
#   configs' base lr 1e-3 (scaled by 512/256 to a 2e-3 peak), 200 warm-up
#   steps, cosine;
# - fine-tuning: 20 epochs at batch 256 (4300 steps), full attention, last
#   token, layer-wise decay 0.75, drop path 0.1, random-resized crops of
#   80-100% of the image (not the paper's 8-100%: the finetune_recipe study
#   measured 93.1 for 80-100%, 91.1 for 50-100%, 90.9 for 20-100% and 92.3
#   without crops; 40 epochs added 0.2) and flips, but no RandAugment / mixup
#   / cutmix (they did not pay off on these 28x28 images at the fmnist scale,
#   docs/RESULTS.md);
# - the supervised baseline: the same ViT and augmentation from scratch with
#   the supervised recipe (mean pool, no layer decay), at the fine-tuning
#   budget and at the pretraining + fine-tuning budget (downstream study);
# - probes: 10 epochs at batch 256 on frozen causal features (linear: LARS at
#   peak lr 32 rather than the config's 6.4, since LARS's 1e-3 trust ratio
#   makes small rates slow over a short probe; attentive:
#   AdamW 1e-3).
_LONG_MODEL = {"model.width": 256, "model.depth": 6, "model.num_heads": 4,
               "model.mlp_dim": 1024}
SCALES["fmnist_long"] = dataclasses.replace(
    SCALES["fmnist"], name="fmnist_long",
    common={**SCALES["fmnist"].common, **_LONG_MODEL, "log_every_steps": 200,
            "tensorboard": False,
            # Batches of 28x28 images take milliseconds on one core: a few
            # workers per stage leave the host's cores to the other stages.
            "data.num_workers": 2},
    pretrain={"batch_size": 512, "total_steps": 4300, "eval_every_steps": 100_000,
              "predictions.num_images": 0, "optim.warmup_steps": 200},
    downstream={"total_steps": 4300, "eval_every_steps": 100_000,
                "optim.warmup_steps": 430, "data.augment": "spatial",
                "data.crop_scale": (0.8, 1.0),
                "model.drop_path": 0.1, "randaugment.num_ops": 0,
                "mixup.mixup_alpha": 0.0, "mixup.cutmix_alpha": 0.0},
    supervised_overrides={},
    probe_overrides={"total_steps": 2150, "eval_every_steps": 100_000,
                     "optim.warmup_steps": 215},
    linear_probe_overrides={"optim.base_lr": 32.0},
    lengths=(2150, 4300, 8600),
    two_stream_lengths=(4300,),
    model_sizes={"S": {"model.width": 128, "model.depth": 4, "model.num_heads": 4,
                       "model.mlp_dim": 512},
                 "M": dict(_LONG_MODEL)},
    seeds={name: 3 for name in ("positional_encoding", "readout", "training_length",
                                "patch_decoder", "noise_schedule", "ordering", "scaling",
                                "prefix", "downstream", "precision")})


def training_images(stages) -> str:
  """Training images the stages see (steps x batch), as text; stages whose
  length is in epochs are counted as such."""
  images, epochs = 0, 0.0
  for s in stages:
    config = load_config(s)
    if config.get("total_steps", 0) > 0:
      images += config.total_steps * config.batch_size
    else:
      epochs += config.total_epochs
  parts = ([f"{images:,} training images"] if images or not epochs else [])
  parts += [f"{epochs:g} epochs of training"] if epochs else []
  return " + ".join(parts)


def get_scale(name: str) -> Scale:
  if name not in SCALES:
    raise ValueError(f"unknown study scale {name!r}; valid: {', '.join(SCALES)}")
  return SCALES[name]


# --------------------------------------------------------- configs and flags


def load_config(stage_: Stage, extra: dict | None = None, init_from: str = ""):
  """The stage's ConfigDict: the experiment file, its overrides, ``extra``
  (command-line ``--set`` values) and ``init_from``."""
  path, _, arg = stage_.config.partition(":")
  file = pathlib.Path(path)
  if not file.is_absolute() and not file.exists():
    file = ROOT / path
  if not file.exists():
    raise FileNotFoundError(f"stage config {path!r} not found (relative to the current "
                            f"directory or {ROOT})")
  config = runpy.run_path(str(file))["get_config"](arg or None)
  overrides = stage_.override_dict()
  overrides.update(extra or {})
  if init_from:
    overrides["init_from"] = init_from
  apply_overrides(config, overrides)
  return config


def apply_overrides(config, overrides: dict) -> None:
  """``{"model.posenc": "none"}`` -> ``config.model.posenc = "none"``; an unknown
  key fails naming the valid ones, as the command line does."""
  for dotted, value in overrides.items():
    try:
      node, key = config_lib.config_node(config, dotted)
    except ValueError as e:
      raise ValueError(f"override {dotted}: {e}") from None
    old = node[key]
    if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    if isinstance(old, (tuple, list)) and isinstance(value, (tuple, list)):
      value = type(old)(value)
    node[key] = value


# ``--set`` says where things are and how they are computed, not what is
# trained, so it is not part of a stage's id; keys that change results are
# refused (write them into the scale instead).
ENVIRONMENT_KEYS = ("data.path", "data.tfds_data_dir", "data.backend", "eval_batch_size",
                    "kernels.attention", "kernels.mlp", "kernels.norm")


def parse_set(items) -> dict:
  """``["data.path=/x"]`` -> typed dict (int, float, bool, str)."""
  out = {}
  for item in items or ():
    key, eq, raw = item.partition("=")
    if not eq or not key:
      raise ValueError(f"--set takes key=value, got {item!r}")
    if key not in ENVIRONMENT_KEYS:
      raise ValueError(f"--set {key}: only {', '.join(ENVIRONMENT_KEYS)} may be set for a "
                       "whole study (they do not change what a stage computes)")
    out[key] = _literal(raw)
  return out


def _literal(raw: str) -> Any:
  if raw.lower() in ("true", "false"):
    return raw.lower() == "true"
  for cast in (int, float):
    try:
      return cast(raw)
    except ValueError:
      pass
  return raw


def command(stage_: Stage, workdir: str, parent_workdir: str = "", extra: dict | None = None) -> str:
  """The equivalent ``python -m darl_jax.main`` command line."""
  flags = dict(stage_.override_dict())
  flags.update(extra or {})
  if parent_workdir:
    flags["init_from"] = parent_workdir
  parts = ["python -m darl_jax.main", f"--config={stage_.config}", f"--workdir={workdir}"]
  for key, value in flags.items():
    if isinstance(value, tuple):
      value = "(" + ",".join(map(str, value)) + ("," if len(value) == 1 else "") + ")"
    parts.append(f"--config.{key}={value}")
  return " ".join(parts)
