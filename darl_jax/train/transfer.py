"""Partial restore of a pretraining checkpoint into a downstream model.

A DARL pretraining checkpoint holds ``params = {"backbone": ..., "decoder":
...}``. Downstream models (``models.heads.Classifier``, the linear probes)
hold ``{"backbone": ..., <their own heads>}``. ``restore_into`` copies every
pretrained leaf whose path the downstream tree also has, drops the rest of the
checkpoint (the patch decoder), keeps the fresh initialisation of everything
else (the new heads) and returns a report of the three lists.

Rules (so a wrong checkpoint cannot pass silently):

* a leaf present on both sides with another shape is a ``ValueError`` naming
  the parameter and both shapes (usually another model variant or patch size);
* a leaf under a prefix that must come from the checkpoint (``required``,
  default ``("backbone",)``) but is missing from it is a ``ValueError``
  listing the missing paths (e.g. a checkpoint of a shallower model);
* dtypes follow the downstream model (a bfloat16 checkpoint loads into float32
  parameters);
* the model keys that change what the same parameters compute without
  changing any shape (``SHAPELESS_MODEL_KEYS``: the positional encoding) must
  match the config stored with the checkpoint (the config it was trained
  with, never a config.json a later command could have rewritten); a
  ``ValueError`` names them.

The blocks' layout needs nothing either: a checkpoint saved with
``model.scan_layers`` (blocks stacked under ``blocks/block``) initialises
an unrolled model (``block_XX``) and the other way round, converted first
(darl_jax/layer_layout.py, logged).

Resolution changes need nothing here: position tables keep their shape
(``model.reference_image_size`` = the pretraining size makes the backbone
interpolate positions at the new resolution).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from absl import logging

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import files
from darl_jax import layer_layout
from darl_jax import optim


@dataclasses.dataclass
class RestoreReport:
  """What a partial restore did, as sorted "/"-joined parameter paths."""
  loaded: list[str]
  dropped: list[str]
  new: list[str]
  source: str = ""
  step: int | None = None
  weights: str = "params"     # "ema": the checkpoint's EMA of the parameters

  def summary(self) -> str:
    def fmt(names, limit=8):
      head = ", ".join(names[:limit])
      return head + (f", ... ({len(names)} in all)" if len(names) > limit else "")
    which = " (its EMA weights)" if self.weights == "ema" else ""
    return (f"restored {self.source} (step {self.step}){which}: loaded {len(self.loaded)} "
            f"parameters; dropped {len(self.dropped)} [{fmt(_prefixes(self.dropped))}]; "
            f"newly initialised {len(self.new)} [{fmt(self.new)}]")


def _prefixes(paths: list[str], depth: int = 1) -> list[str]:
  """Top-level groups of paths ("decoder/..." -> "decoder/*"), for short logs."""
  out = []
  for p in paths:
    parts = p.split("/")
    key = "/".join(parts[:depth]) + ("/*" if len(parts) > depth else "")
    if key not in out:
      out.append(key)
  return out


def flatten(tree) -> dict[str, Any]:
  """Nested dict -> ``{"a/b/c": leaf}`` (same path convention as optim)."""
  return dict(zip(jax.tree_util.tree_leaves(optim.param_paths(tree)),
                  jax.tree_util.tree_leaves(tree)))


def _unflatten_like(tree, flat: dict[str, Any]):
  paths = optim.param_paths(tree)
  return jax.tree_util.tree_map(lambda p, _: flat[p], paths, tree)


def merge(target, pretrained, *, required: tuple[str, ...] = ("backbone",)):
  """Copies ``pretrained`` leaves into ``target`` by path.

  Args:
    target: the downstream model's freshly initialised params (nested dicts of
      arrays; may be jax.Arrays or ShapeDtypeStructs for the shapes).
    pretrained: the checkpoint's params (nested dicts of numpy arrays).
    required: top-level prefixes whose every leaf must come from the checkpoint.

  Returns:
    ``(params, report)``: params with the target's structure, host numpy leaves
    where loaded and the target's own leaves elsewhere, and a ``RestoreReport``.
  """
  if layer_layout.differs(pretrained, target):
    logging.info("the checkpoint holds %s blocks: converted to the model's %s layout "
                 "(model.scan_layers)", layer_layout.describe(pretrained),
                 layer_layout.describe(target))
    try:
      pretrained = layer_layout.convert(pretrained, target)
    except ValueError as e:
      raise ValueError(f"the checkpoint does not fit the model ({e}); check "
                       "model.variant/depth against the pretraining config") from None
  tgt = flatten(target)
  src = flatten(pretrained)
  mismatched = []
  for path in sorted(set(tgt) & set(src)):
    ts, ss = tuple(np.shape(tgt[path])), tuple(np.shape(src[path]))
    if ts != ss:
      mismatched.append(f"{path}: checkpoint {ss} vs model {ts}")
  if mismatched:
    raise ValueError(
        "the checkpoint does not fit the model (another variant, patch size or "
        "positional encoding?): " + "; ".join(mismatched))
  missing = sorted(p for p in tgt if p not in src
                   and any(p == r or p.startswith(r + "/") for r in required))
  if missing:
    raise ValueError(
        f"the checkpoint lacks {len(missing)} backbone parameter(s) of the model, e.g. "
        f"{', '.join(missing[:5])}; it has e.g. {', '.join(sorted(src)[:5])}. Check "
        "model.variant/width/depth and model.posenc against the pretraining config")
  out = {}
  for path, leaf in tgt.items():
    if path in src:
      dtype = getattr(leaf, "dtype", None)
      out[path] = np.asarray(src[path]).astype(dtype) if dtype is not None else src[path]
    else:
      out[path] = leaf
  report = RestoreReport(loaded=sorted(p for p in tgt if p in src),
                         dropped=sorted(p for p in src if p not in tgt),
                         new=sorted(p for p in tgt if p not in src))
  return _unflatten_like(target, out), report


# Model keys under which the same parameter shapes compute something else: a
# backbone pretrained with 2D RoPE read with 1D RoPE loads without a shape
# error and gives wrong features. (model.causal may differ on purpose: the
# paper fine-tunes its causal backbones with full attention.)
SHAPELESS_MODEL_KEYS = ("posenc", "rope_max_wavelength")


def pretrained_model_config(meta: dict) -> dict | None:
  """The pretraining run's ``model`` config, from the checkpoint's meta: its
  stored config, or (older checkpoints) its architecture record."""
  for section in (meta.get("config"), meta.get("architecture")):
    if isinstance(section, dict) and isinstance(section.get("model"), dict):
      return section["model"]
  return None


def check_model_config(pretrained: dict | None, model_config) -> None:
  """ValueError if ``model_config`` reads the pretrained backbone differently
  (``SHAPELESS_MODEL_KEYS``); nothing to check without both configs."""
  if not pretrained or model_config is None:
    return
  diffs = [f"model.{k}: {pretrained[k]!r} in the checkpoint, {model_config[k]!r} here"
           for k in SHAPELESS_MODEL_KEYS
           if k in pretrained and k in model_config and pretrained[k] != model_config[k]]
  if diffs:
    raise ValueError("the pretrained backbone was trained with another positional "
                     "encoding than this config builds (" + "; ".join(diffs) + "); set "
                     "them as in the pretraining run")


def restore_into(target, init_from: str, *, step: int | None = None,
                 required: tuple[str, ...] = ("backbone",), model_config=None,
                 use_ema: bool | None = None):
  """Reads the checkpoint at ``init_from`` and merges it into ``target``.

  ``init_from`` is a pretraining workdir, its ``checkpoints`` directory or one
  step directory (see ``checkpoint.restore_params``). ``model_config``: the
  downstream ``config.model``, checked against the checkpoint's stored one
  (``check_model_config``). ``use_ema``: which weights to read, the
  checkpoint's EMA of the parameters (True) or the parameters (False); None:
  the EMA where the checkpoint has one. Logs the report.
  """
  pretrained, meta = checkpoint_lib.restore_params(init_from, step=step, use_ema=use_ema)
  check_model_config(pretrained_model_config(meta), model_config)
  params, report = merge(target, pretrained, required=required)
  report.source, report.step = init_from, meta.get("step", step)
  report.weights = meta.get("restored_weights", "params")
  logging.info("%s", report.summary())
  logging.info("loaded: %s", ", ".join(report.loaded))
  logging.info("dropped: %s", ", ".join(report.dropped))
  logging.info("newly initialised: %s", ", ".join(report.new))
  arch = pretrained_model_config(meta)
  if arch:
    logging.info("pretraining model config: %s", arch)
  return params, report


def write_report(workdir, report: RestoreReport) -> None:
  """``<workdir>/init_report.json``: the three lists, for later inspection."""
  if jax.process_index() != 0:
    return
  files.write_json_atomic(workdir / "init_report.json", dataclasses.asdict(report), indent=1)
