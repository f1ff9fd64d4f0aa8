"""A hyper-parameter grid of probe heads, trained in one frozen pass and chosen
on held-out training data.

A frozen-feature accuracy is only as good as its probe's learning rate and
weight decay, and the best ones differ from model to model. The peers train
the whole grid at once on one frozen forward pass (DINOv2's eval/linear.py:
13 learning rates x blocks x pooling on the same features; ml-l3m's
probe_hparam_search: heads named ``HP_LR_<v>_WD_<v>``) and pick the best on
data the heads did not train on. Here (``config.probe``):

    learning_rates  base rates (the optim.base_lr convention: x batch / 256
                    with optim.lr_scaling); () = (optim.base_lr,)
    weight_decays   () = (optim.weight_decay,)
    poolings        linear probe only: "mean" over the patch tokens, "last"
                    token (the one that has seen every patch under the causal mask)
    holdout_size    held-out training rows that choose the setting
                    (data/holdout.py); -1 = min(2%, 10000) when a block has
                    more than one candidate, else 0

Every key at its default is the single-setting probe of before, run by the
same code (linear_probe.LayerProbes, attentive_probe.AttentiveProbe), so old
stage ids, checkpoints and numbers stay as they were.

Design: why the grid's heads carry their own optimizer
------------------------------------------------------
The loop builds one optimizer for all trained parameters from
``config.optim`` (optim.make_optimizer), with no per-path learning rate or
weight decay (its per-leaf rules are the frozen mask, the decay mask and
layer-wise decay). Moving the setting into the loss would not be exact for
the probes' own optimizers: scaling a head's loss by ``lr_g / lr`` scales
its update under SGD, but LARS's trust ratio ``||p|| / ||u||`` and Adam's
``m / sqrt(v)`` divide that factor out again, and AdamW's decoupled decay
``lr * wd * p`` cannot come through a gradient at all. So the grid's heads
are, to the loop, a non-trained collection beside the BatchNorm statistics
(``model_state["grid"]``: ``params``, ``batch_stats``, ``opt_state``, each a
dict keyed ``lr_<v>_wd_<v>``), and ``loss_fn`` steps them: one optax
transformation per setting, built by ``optim.make_optimizer`` from
``config.optim`` with that setting's base_lr and weight_decay (the rule is
optim.py's LARS / AdamW, warm-up and cosine, not a copy), applied with
``jax.vmap`` over that setting's heads, so that the trust ratio, the moments
and the clipping norm are each head's own. A head in the grid therefore
takes exactly the steps it would take alone at its setting
(tests/test_probe_grid.py checks it against the loop's single-setting path).

Vectorised: the settings' parameter trees are stacked into a leading grid
axis for the forward pass, ``[S, H, ...]`` (S settings, H heads per setting:
poolings x blocks for the linear probe, one for the attentive probe), and
the head module (BatchNorm without affine + linear, or attention pooling +
that) runs under two ``jax.vmap`` s: one batched computation for every head
of every setting on the one frozen pass, each head with its own BatchNorm
statistics. Only the optimizer update is a Python loop over the S settings
(its hyper-parameters are Python floats in optim.py), each vmapped over H.

What this costs the loop's bookkeeping: its ``grad_norm`` is the frozen
backbone's (zero) and ``head_grad_norm`` is logged instead; its EMA would
average the backbone only (``ema_decay > 0`` is refused); and gradient
accumulation would step the heads once per microbatch (``microbatch_size``
is refused: a frozen forward pass holds no activations for a backward pass,
so the probe's batch rarely needs it). A per-path learning rate and weight
decay in optim.py would let the heads move back into ``params`` and lift
both limits.

Selection: the chosen setting of a block is the argmax of its held-out
accuracy (ties: the first in grid order); the reported number is that
setting's accuracy on ``data.eval_split``, never used to choose.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import linen as nn

from darl_jax import config_lib
from darl_jax import mixup as mixup_lib
from darl_jax import optim
from darl_jax.data import holdout as holdout_lib

POOLINGS = ("mean", "last")


def grid_config() -> ml_collections.ConfigDict:
  """``config.probe``'s grid keys at the single setting (module docstring)."""
  return ml_collections.ConfigDict({"learning_rates": (), "weight_decays": (),
                                    "holdout_size": -1})


@dataclasses.dataclass(frozen=True)
class Setting:
  """One optimizer setting of the grid: a base learning rate and a weight decay."""
  learning_rate: float
  weight_decay: float

  @property
  def name(self) -> str:
    return f"lr_{self.learning_rate:g}_wd_{self.weight_decay:g}"


def is_grid(config) -> bool:
  """True unless every grid key is at its default (the single-setting probe)."""
  p = config.probe
  return bool(tuple(p.learning_rates) or tuple(p.weight_decays)
              or tuple(p.get("poolings", ("mean",))) != ("mean",))


def settings(config) -> tuple[Setting, ...]:
  """The grid's optimizer settings, learning rate major."""
  lrs = tuple(config.probe.learning_rates) or (config.optim.base_lr,)
  wds = tuple(config.probe.weight_decays) or (config.optim.weight_decay,)
  for key, values, low in (("learning_rates", lrs, 0.0), ("weight_decays", wds, -1.0)):
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > low
           for v in values):
      raise config_lib.ConfigError(
          f"probe.{key} must hold numbers {'> 0' if low == 0 else '>= 0'}, got {values!r}")
  out = tuple(Setting(float(lr), float(wd)) for lr in lrs for wd in wds)
  if len({s.name for s in out}) != len(out):
    raise config_lib.ConfigError(f"probe.learning_rates {lrs!r} x weight_decays {wds!r} "
                                 "repeat a setting")
  return out


def check_poolings(poolings) -> tuple[str, ...]:
  poolings = tuple(poolings)
  if not poolings or len(set(poolings)) != len(poolings) or set(poolings) - set(POOLINGS):
    raise config_lib.ConfigError(f"probe.poolings must be distinct names of {POOLINGS}, "
                                 f"got {poolings!r}")
  return poolings


def check_loop_options(config) -> None:
  """The loop options a grid cannot honour (module docstring) are refused."""
  micro = config.get("microbatch_size", 0) or 0
  if micro not in (0, config.batch_size):
    raise config_lib.ConfigError(
        f"microbatch_size={micro}: a probe grid steps its heads inside the loss, once per "
        f"microbatch; set --config.microbatch_size=0 (the frozen pass keeps no "
        f"activations for a backward pass, so the batch usually fits)")
  if float(config.get("ema_decay", 0.0) or 0.0) > 0:
    raise config_lib.ConfigError("ema_decay > 0: the EMA averages the loop's parameters, "
                                 "not a probe grid's heads; set --config.ema_decay=0")


def split_source(config, source, num_candidates: int):
  """``(train, held_out or None)`` of the training source: ``probe.holdout_size``
  rows held out (-1: min(2%, 10000) if a block has several candidates, else none)."""
  size = int(config.probe.holdout_size)
  if size == -1 and num_candidates == 1:
    size = 0
  if size == 0:
    if num_candidates > 1:
      raise config_lib.ConfigError(
          f"probe.holdout_size=0 with {num_candidates} candidates per block: the grid "
          "chooses on held-out training rows; set --config.probe.holdout_size=-1")
    return source, None
  try:
    return holdout_lib.split(source, size)
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from None


def setting_optim(optim_cfg, setting: Setting) -> ml_collections.ConfigDict:
  """``config.optim`` at one setting, for one head's parameters (nothing frozen)."""
  cfg = ml_collections.ConfigDict(optim_cfg.to_dict())
  cfg.update(base_lr=setting.learning_rate, weight_decay=setting.weight_decay, frozen=[])
  return cfg


class HeadGrid:
  """``S`` settings x ``H`` copies of ``head`` (a Flax module ``(x, train) ->
  logits [B, K]``), each copy with its own parameters, BatchNorm statistics
  and optimizer state. ``example``: one head's input (shapes and dtypes);
  ``shared_input``: every head reads the same input (else head ``h`` reads
  row ``h`` of a stacked ``[H, ...]`` input)."""

  def __init__(self, head: nn.Module, grid: tuple[Setting, ...], num_heads: int,
               optim_cfg, example: Any, *, shared_input: bool, total_steps: int,
               steps_per_epoch: int, batch_size: int):
    self.head, self.settings, self.num_heads = head, tuple(grid), int(num_heads)
    self.example, self.in_axes = example, None if shared_input else 0
    one = jax.eval_shape(lambda: head.init(jax.random.PRNGKey(0), self._zeros(), False))
    self.txs = {s.name: optim.make_optimizer(
        setting_optim(optim_cfg, s), one["params"], total_steps=total_steps,
        steps_per_epoch=steps_per_epoch, batch_size=batch_size)[0] for s in self.settings}

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(s.name for s in self.settings)

  def _zeros(self):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.example)

  def init(self, rng) -> dict:
    """``{"params", "batch_stats", "opt_state"}``, each ``{setting: [H, ...] tree}``."""
    out = {"params": {}, "batch_stats": {}, "opt_state": {}}
    x = self._zeros()
    for name, key in zip(self.names, jax.random.split(rng, len(self.settings))):
      v = jax.vmap(lambda k: self.head.init(k, x, False))(jax.random.split(key, self.num_heads))
      out["params"][name] = v["params"]
      out["batch_stats"][name] = v.get("batch_stats", {})
      out["opt_state"][name] = jax.vmap(self.txs[name].init)(v["params"])
    return out

  def apply(self, params: dict, batch_stats: dict, inputs, train: bool):
    """``({setting: logits [H, B, K]}, new batch_stats)``: every head of every
    setting in one vmapped computation over the stacked ``[S, H, ...]`` trees."""
    stack = lambda tree: jax.tree.map(lambda *xs: jnp.stack(xs), *[tree[n] for n in self.names])

    def one(p, stats, x):
      variables = {"params": p, "batch_stats": stats}
      if not train:
        return self.head.apply(variables, x, False), stats
      logits, new = self.head.apply(variables, x, True, mutable=["batch_stats"])
      return logits, new.get("batch_stats", {})

    heads = jax.vmap(one, in_axes=(0, 0, self.in_axes))
    logits, stats = jax.vmap(heads, in_axes=(0, 0, None))(stack(params), stack(batch_stats),
                                                          inputs)
    unstack = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
    return ({n: logits[i] for i, n in enumerate(self.names)},
            {n: unstack(stats, i) for i, n in enumerate(self.names)})

  def update(self, grads: dict, opt_state: dict, params: dict) -> tuple[dict, dict]:
    """One optimizer step of every head: setting ``s``'s transformation,
    vmapped over its ``H`` heads."""
    new_params, new_opt = {}, {}
    for n in self.names:
      updates, new_opt[n] = jax.vmap(self.txs[n].update)(grads[n], opt_state[n], params[n])
      new_params[n] = optax.apply_updates(params[n], updates)
    return new_params, new_opt


def loss_and_step(grid: HeadGrid, state: dict, inputs, targets, train: bool):
  """``(total loss, {setting: losses [H]}, new grid state, gradient norm)``:
  the total is the sum over heads of each head's mean soft cross entropy
  against ``targets [B, K]``; in training the heads take one step (otherwise
  ``state`` comes back unchanged and the norm is None). Each head's gradient
  is that of its own loss: the heads share nothing."""

  def loss_of(params):
    logits, stats = grid.apply(params, state["batch_stats"], inputs, train)
    losses = {n: jnp.mean(mixup_lib.soft_cross_entropy(lg, targets[None]), -1)
              for n, lg in logits.items()}                        # [H] per setting
    return sum(jnp.sum(v) for v in losses.values()), (losses, stats)

  if not train:
    total, (losses, _) = loss_of(state["params"])
    return total, losses, state, None
  (total, (losses, stats)), grads = jax.value_and_grad(loss_of, has_aux=True)(
      state["params"])
  params, opt_state = grid.update(grads, state["opt_state"], state["params"])
  return total, losses, {"params": params, "batch_stats": stats,
                         "opt_state": opt_state}, optax.tree.norm(grads)


def correct(grid: HeadGrid, state: dict, inputs, labels, head_names) -> dict:
  """``{grid_accuracy_<head>_<setting>: [B]}`` (1.0 where the argmax is the label)."""
  logits, _ = grid.apply(state["params"], state["batch_stats"], inputs, False)
  return {f"grid_accuracy_{head}_{n}": (jnp.argmax(lg[h], -1) == labels).astype(jnp.float32)
          for n, lg in logits.items() for h, head in enumerate(head_names)}


def choose(rows: list[dict], group: str) -> dict:
  """``{group value: row}``: per group (a block), the row of the highest
  ``holdout_accuracy`` (the first in ``rows``' order on ties); rows without
  a held-out accuracy (no held-out part: one candidate) are chosen alone."""
  chosen = {}
  for row in rows:
    best = chosen.get(row[group])
    if best is None or (row["holdout_accuracy"] is not None
                        and row["holdout_accuracy"] > best["holdout_accuracy"]):
      chosen[row[group]] = row
  return chosen
