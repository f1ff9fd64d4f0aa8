"""Optimizers, learning-rate schedules and per-parameter rules (``config.optim``).

Everything per-parameter is keyed on the parameter's path: the "/"-joined keys
of the Flax param dict, e.g. ``backbone/block_03/attn/qkv/kernel``. Scanned
layers (``nn.scan`` under ``blocks``) keep one leaf per stack whose leading axis
is the layer: ``backbone/blocks/block/mlp/fc1/kernel`` has shape ``[L, ...]``.

The update of a trainable leaf is (paper appendix, MAE recipe)::

    u = clip_by_global_norm(g)                  # trainable grads only
    u = adam(u)                                 # adamw only
    u = u + weight_decay * p                    # unless the leaf is in no_decay
    u = trust_ratio(u)                          # lars only, same mask as decay
    u = u * layer_multiplier                    # layer-wise lr decay (fine-tuning)
    u = -lr(step) * u                           # (sgd/lars: then momentum)

Frozen leaves (``frozen`` regexes) get exact zeros through
``optax.multi_transform``; the trainable branch holds no optimizer state for
them, so a linear probe does not pay for Adam moments of a frozen backbone.

Config keys (``config.optim``) and defaults are in ``DEFAULTS``; unknown keys
raise, so a typo (``warmup_epoch``) cannot be silently ignored.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

OPTIMIZERS = ("adamw", "lars", "sgd")
SCHEDULES = ("cosine", "constant")

# Biases and norm scales are caught by the 1D rule too (always on); the names
# matter for scanned stacks, where a bias is [L, D], and for the SOS token and
# position tables, which the MAE recipe also excludes from weight decay.
DEFAULT_NO_DECAY = (r"(^|/)bias$", r"(^|/)scale$", r"(^|/)sos$",
                    r"(^|/)pos_embed(/|$)", r"(^|/)type_embed(/|$)")

# Paper Table "ImageNet Pre-training Hyperparams" unless noted.
DEFAULTS = dict(
    name="adamw", base_lr=1.5e-4, lr_scaling=True,     # peak = base_lr * batch / 256
    b1=0.9, b2=0.95, eps=1e-8,                         # adamw
    momentum=0.9, nesterov=False, trust_coefficient=1e-3,  # lars / sgd
    weight_decay=0.05, no_decay=list(DEFAULT_NO_DECAY),
    schedule="cosine", warmup_steps=None, warmup_epochs=0.0, end_lr_fraction=0.0,
    grad_clip_norm=None, layer_decay=None, num_layers=None, frozen=[],
)


def default_config():
  """A ConfigDict with every key at its default (a base for experiment configs)."""
  return ml_collections.ConfigDict({k: list(v) if isinstance(v, list) else v
                                    for k, v in DEFAULTS.items()})


def _get(cfg, key):
  """``cfg[key]``; a missing key or None means the default (``no_decay=None``:
  the default regexes; ``no_decay=[]``: only the 1D rule)."""
  value = cfg.get(key, None)
  return DEFAULTS[key] if value is None else value


def _shape(x) -> tuple:
  return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)   # also ShapeDtypeStruct


def _check_keys(cfg):
  unknown = sorted(set(cfg.keys()) - set(DEFAULTS))
  if unknown:
    raise ValueError(f"unknown config.optim keys {unknown}; valid: {sorted(DEFAULTS)}")


def _key_str(k) -> str:
  for attr in ("key", "name", "idx"):   # DictKey, GetAttrKey, SequenceKey
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def param_paths(params):
  """Same structure as ``params``, each leaf its "/"-joined key path."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "/".join(_key_str(k) for k in path), params)


def _is_scanned(path: str) -> bool:
  return re.search(r"(^|/)blocks/", path) is not None


# ----------------------------------------------------------------------- schedule


def peak_lr(cfg, batch_size: int | None) -> float:
  """``base_lr * batch_size / 256`` when ``lr_scaling`` (paper), else ``base_lr``."""
  base = float(_get(cfg, "base_lr"))
  if not _get(cfg, "lr_scaling"):
    return base
  if not batch_size:
    raise ValueError("optim.lr_scaling=True needs the global batch_size")
  return base * batch_size / 256.0


def num_warmup_steps(cfg, total_steps: int, steps_per_epoch: int | None) -> int:
  """Warm-up length in steps, clipped to ``total_steps``.

  ``warmup_steps`` wins when it is > 0; otherwise (None, 0 or -1) the warm-up
  is ``round(warmup_epochs * steps_per_epoch)``. Clipping lets a 20-step smoke
  run use a 40-epoch config.
  """
  steps = _get(cfg, "warmup_steps")
  if steps is None or steps <= 0:
    epochs = float(_get(cfg, "warmup_epochs") or 0.0)
    steps = 0
    if epochs > 0:
      if not steps_per_epoch:
        raise ValueError(f"optim.warmup_epochs={epochs} needs steps_per_epoch; "
                         "pass it or set optim.warmup_steps instead")
      steps = int(round(epochs * steps_per_epoch))
  return int(min(steps, total_steps))


def _schedule_terms(cfg, total_steps: int, steps_per_epoch: int | None,
                    batch_size: int | None):
  kind = _get(cfg, "schedule")
  if kind not in SCHEDULES:
    raise ValueError(f"unknown schedule {kind!r}; valid: {', '.join(SCHEDULES)}")
  peak = peak_lr(cfg, batch_size)
  end = peak * float(_get(cfg, "end_lr_fraction") or 0.0)
  warm = num_warmup_steps(cfg, total_steps, steps_per_epoch)
  return kind, peak, end, warm, max(total_steps - warm, 1)


def _schedule_fn(xp, dtype, cfg, total_steps: int, steps_per_epoch: int | None,
                 batch_size: int | None) -> Callable:
  """The schedule's one body, over the array module ``xp`` (jnp or np)."""
  kind, peak, end, warm, decay = _schedule_terms(cfg, total_steps, steps_per_epoch,
                                                 batch_size)

  def schedule(step):
    step = xp.asarray(step, dtype)
    ramp = peak * step / max(warm, 1)
    if kind == "constant":
      after = xp.full_like(step, peak)
    else:
      frac = xp.clip((step - warm) / decay, 0.0, 1.0)
      after = end + (peak - end) * 0.5 * (1.0 + xp.cos(math.pi * frac))
    return xp.where(step < warm, ramp, after)

  return schedule


def make_schedule(cfg, total_steps: int, steps_per_epoch: int | None = None, *,
                  batch_size: int | None = None) -> optax.Schedule:
  """Linear warm-up from 0 to the peak, then cosine to ``end_lr_fraction * peak``
  at ``total_steps`` (or constant at the peak). ``batch_size`` is needed only
  for ``lr_scaling``; the value at step ``s`` is the lr of the ``s``-th update
  (0-based), so the very first update has lr 0 when there is a warm-up.

  This is the traceable (jnp, float32) form; the train loop feeds the step
  ``make_host_schedule``'s values instead (see ``Hyperparams``).
  """
  return _schedule_fn(jnp, jnp.float32, cfg, total_steps, steps_per_epoch, batch_size)


def make_host_schedule(cfg, total_steps: int, steps_per_epoch: int | None = None, *,
                       batch_size: int | None = None) -> Callable:
  """``make_schedule`` on the host: numpy, computed in float64 and rounded once
  to float32, so that the value of a step is the same on every platform and
  in every process (XLA's float32 ``cos`` and its rewriting of ``x / c`` into
  ``x * (1 / c)`` differ from numpy's by an ulp here and there: the two forms
  agree to a few float32 ulps, not bitwise). Scalars in, ``np.float32`` out;
  arrays work too."""
  body = _schedule_fn(np, np.float64, cfg, total_steps, steps_per_epoch, batch_size)

  def schedule(step):
    out = body(step).astype(np.float32)
    return out[()] if out.ndim == 0 else out

  return schedule


class Hyperparams:
  """The optimizer's per-step values (learning rate, weight decay, and layer
  decay's multipliers where set) as inputs of the train step rather than
  constants of its program: a change of ``total_steps``, warm-up,
  ``base_lr``, (nonzero) ``weight_decay`` or ``layer_decay`` then reuses the
  compiled step.

  The transformation ``make_train_optimizer`` builds reads them through
  ``learning_rate(count)``, ``weight_decay()`` and ``layer_multipliers()``:
  inside ``with hyperparams.bind(hyper)`` (the train step, ``hyper`` its
  argument ``{"learning_rate": f32[], "weight_decay": f32[]}``, with
  ``"layer_multipliers"``, a tree like the parameters', under layer decay)
  the bound values, else
  the in-graph schedule of the update count and the configured decay, as
  before. ``values(step)`` is ``hyper`` for the ``step``-th update (0-based,
  the step counter before it), on the host. The optimizer state is optax's as
  before (``ScaleByScheduleState`` keeps counting), so checkpoints resume.
  """

  def __init__(self, schedule: Callable, host_schedule: Callable, weight_decay: float,
               layer_multipliers=None):
    self.schedule, self.host_schedule = schedule, host_schedule
    self.weight_decay_value = float(weight_decay)
    # Layer decay's per-leaf multipliers (layer_multipliers), inputs of the
    # step as well: as constants each block's update would be a kernel of
    # its own, compiled once per block (benchmarks/RESULTS.md, fine-tuning's
    # compile time); as inputs the blocks share one.
    self.multipliers = layer_multipliers
    self._bound = None

  def values(self, step: int) -> dict:
    out = {"learning_rate": np.float32(self.host_schedule(step)),
           "weight_decay": np.float32(self.weight_decay_value)}
    if self.multipliers is not None:
      out["layer_multipliers"] = self.multipliers
    return out

  def abstract(self, sharding=None) -> dict:
    return jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(np.shape(v), jnp.float32, sharding=sharding),
        self.values(0))

  @contextlib.contextmanager
  def bind(self, hyper: dict):
    keys = tuple(self.values(0))
    if set(hyper) != set(keys):
      raise ValueError(f"hyper needs exactly the keys {keys}, got {sorted(hyper)}")
    previous, self._bound = self._bound, hyper
    try:
      yield
    finally:
      self._bound = previous

  def learning_rate(self, count):
    if self._bound is None:
      return self.schedule(count)
    return jnp.asarray(self._bound["learning_rate"], jnp.float32)

  def weight_decay(self):
    if self._bound is None:
      return self.weight_decay_value
    return jnp.asarray(self._bound["weight_decay"], jnp.float32)

  def layer_multipliers(self):
    if self._bound is None:
      return self.multipliers
    return self._bound["layer_multipliers"]


# ------------------------------------------------------------ per-parameter rules


def decay_mask(cfg, params):
  """True where weight decay applies: not in ``no_decay``, not 1D (scan axis not counted)."""
  pats = [re.compile(p) for p in (_get(cfg, "no_decay") or ())]
  def rule(path, x):
    ndim = len(_shape(x)) - (1 if _is_scanned(path) else 0)
    return bool(ndim > 1 and not any(p.search(path) for p in pats))
  return jax.tree.map(rule, param_paths(params), params)


def frozen_labels(cfg, params):
  """"frozen" / "train" per leaf; a ``frozen`` regex that matches nothing raises."""
  pats = list(_get(cfg, "frozen") or ())
  paths = jax.tree.leaves(param_paths(params))
  for p in pats:
    if not any(re.search(p, s) for s in paths):
      raise ValueError(f"optim.frozen regex {p!r} matches no parameter "
                       f"(e.g. {paths[:3]}); fix it or the backbone would train")
  return jax.tree.map(lambda s: "frozen" if any(re.search(p, s) for p in pats) else "train",
                      param_paths(params))


def _layer_id(path: str, num_layers: int) -> int:
  """0: embeddings; i + 1: ``block_{i}``; num_layers + 1: the rest (final norm, heads).

  ``decoder/`` and ``probes/`` also have ``block_XX`` names, but they are not
  backbone layers (the probe ``probes/block_05`` reads block 5's output), so
  they count as the top like the head.
  """
  parts = path.split("/")
  if parts[0] in ("decoder", "probes"):
    return num_layers + 1
  if any(s in ("patch_embed", "sos", "pos_embed", "type_embed") for s in parts):
    return 0
  for s in parts:
    m = re.fullmatch(r"block_(\d+)", s)
    if m:
      i = int(m.group(1))
      if i >= num_layers:
        raise ValueError(f"{path}: block {i} but optim.num_layers={num_layers}; set "
                         f"optim.num_layers to the backbone's depth (fine-tuning: 0 takes "
                         f"it from the model)")
      return i + 1
  return num_layers + 1


def layer_multipliers(cfg, params):
  """Per-leaf lr multipliers ``layer_decay ** (num_layers + 1 - layer_id)``, or None.

  A scanned leaf (under ``blocks/``, leading axis = layer) gets an array of
  shape ``[L, 1, ..., 1]`` with layer ``i``'s multiplier ``decay ** (L - i)``,
  which broadcasts over the leaf's update: the per-layer rate survives the
  stacking without unstacking the parameters.
  """
  ld = _get(cfg, "layer_decay")
  if not ld or ld == 1:
    return None
  n = _get(cfg, "num_layers")
  if not n:
    raise ValueError("optim.layer_decay needs optim.num_layers (the backbone depth)")
  found = []

  def rule(path, x):
    if _is_scanned(path) and path.split("/")[0] not in ("decoder", "probes"):
      if _shape(x)[0] != n:
        raise ValueError(f"{path}: scanned leading axis {_shape(x)[0]} != num_layers {n}")
      found.append(path)
      m = ld ** (n - np.arange(n, dtype=np.float64))
      return m.astype(np.float32).reshape((n,) + (1,) * (len(_shape(x)) - 1))
    lid = _layer_id(path, n)
    if 0 < lid <= n:
      found.append(path)
    return np.float32(ld ** (n + 1 - lid))

  mult = jax.tree.map(rule, param_paths(params), params)
  if not found:
    raise ValueError("optim.layer_decay is set but no parameter is in a block_XX or "
                     "scanned blocks/ layer; check the parameter names")
  return mult


def _scale_by_tree(mult: Callable[[], Any]) -> optax.GradientTransformation:
  """Multiplies each update by its leaf of ``mult()`` (read at update time,
  as ``_add_decayed_weights`` reads its rate; MaskedNode-aware, stateless)."""
  def update_fn(updates, state, params=None):
    del params
    scaled = jax.tree.map(
        lambda m, u: u if isinstance(u, optax.MaskedNode) else u * jnp.asarray(m, u.dtype),
        mult(), updates)
    return scaled, state
  return optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn)


def _add_decayed_weights(weight_decay: Callable[[], Any], mask) -> optax.GradientTransformation:
  """``optax.add_decayed_weights`` whose rate is read at update time
  (``weight_decay()``: a float or a traced scalar), with its state
  (``MaskedState(EmptyState())``), so checkpoints keep their layout."""
  def update_fn(updates, state, params):
    if params is None:
      raise ValueError("weight decay needs the params: tx.update(grads, state, params)")
    wd = weight_decay()
    updates = jax.tree.map(
        lambda g, p: None if g is None else g + jnp.asarray(wd, p.dtype) * p,
        updates, params, is_leaf=lambda x: x is None)
    return updates, state
  return optax.masked(optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn),
                      mask)


# ---------------------------------------------------------------------- optimizer


def make_optimizer(cfg, params, *, total_steps: int, steps_per_epoch: int | None = None,
                   batch_size: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The optax transformation for ``params`` and its lr schedule (for logging).

  ``params`` is used only for its paths and shapes (masks, labels, layer
  multipliers are fixed here, outside jit). The logged lr is that of the
  top layer (multiplier 1). The schedule and weight decay are constants of
  a program that calls ``tx.update``; the train loop uses
  ``make_train_optimizer``, whose values are inputs of its step.
  """
  tx, hyperparams = make_train_optimizer(cfg, params, total_steps=total_steps,
                                         steps_per_epoch=steps_per_epoch,
                                         batch_size=batch_size)
  return tx, hyperparams.schedule


def make_train_optimizer(cfg, params, *, total_steps: int,
                         steps_per_epoch: int | None = None,
                         batch_size: int) -> tuple[optax.GradientTransformation, Hyperparams]:
  """``make_optimizer`` with the learning rate and weight decay read through
  the returned ``Hyperparams`` (see there): bound to the step's ``hyper``
  argument inside the train step, the schedule and the configured decay
  otherwise. Same transformation, same state."""
  _check_keys(cfg)
  name = _get(cfg, "name")
  if name not in OPTIMIZERS:
    raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")
  schedule = make_schedule(cfg, total_steps, steps_per_epoch, batch_size=batch_size)
  wd = float(_get(cfg, "weight_decay") or 0.0)
  mask = decay_mask(cfg, params)
  mult = layer_multipliers(cfg, params)
  hyperparams = Hyperparams(
      schedule, make_host_schedule(cfg, total_steps, steps_per_epoch, batch_size=batch_size),
      wd, mult)

  parts = []
  # Clipping sits inside the trainable branch: the global norm counts only
  # the gradients that are applied, not those of frozen parameters.
  if _get(cfg, "grad_clip_norm"):
    parts.append(optax.clip_by_global_norm(float(_get(cfg, "grad_clip_norm"))))
  if name == "adamw":
    parts.append(optax.scale_by_adam(b1=_get(cfg, "b1"), b2=_get(cfg, "b2"),
                                     eps=_get(cfg, "eps")))
  # Decoupled decay (AdamW): added after the Adam normalisation, so it is
  # lr * wd * p. For sgd/lars it is added to the gradient before momentum /
  # trust ratio, as in torch SGD and LARS. Layer decay scales it too (BEiT).
  # Kept in the chain iff the configured decay is nonzero (the state's layout).
  if wd:
    parts.append(_add_decayed_weights(hyperparams.weight_decay, mask))
  if name == "lars":
    # Trust ratio ||p|| / ||u|| per leaf (for a scanned stack: per stack), only
    # where weight decay applies: biases, norms, SOS and position tables keep
    # the plain lr (SimCLR/MoCo-v3/MAE linear-probe LARS convention).
    parts.append(optax.masked(
        optax.scale_by_trust_ratio(trust_coefficient=_get(cfg, "trust_coefficient")),
        mask))
  if mult is not None:
    parts.append(_scale_by_tree(hyperparams.layer_multipliers))
  parts.append(optax.scale_by_learning_rate(hyperparams.learning_rate))
  if name in ("lars", "sgd") and _get(cfg, "momentum"):
    # After the lr, as optax.lars does: a changing lr only affects new gradients.
    parts.append(optax.trace(decay=_get(cfg, "momentum"), nesterov=_get(cfg, "nesterov")))

  tx = optax.multi_transform({"train": optax.chain(*parts), "frozen": optax.set_to_zero()},
                             frozen_labels(cfg, params))
  return tx, hyperparams
