"""The training state: its initialisation, its restore targets, its layouts and its EMA.

State is a dict ``{step, params, opt_state, model_state, bad_step}``, and
``ema`` with ``config.ema_decay > 0``: ``model_state`` holds non-trained
collections (e.g. BatchNorm statistics), ``bad_step`` the first step whose
loss or gradient was non-finite (-1 if none), ``ema`` the exponential moving
average of the parameters (darl_jax/ema.py; sharded as they are), updated
after each step's update. With ``eval_with_ema`` (the default) evaluation,
``extra_eval`` and ``finalize`` see the averaged parameters as
``state["params"]`` (:func:`eval_view`).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from darl_jax import ema as ema_lib
from darl_jax import fp8
from darl_jax import layer_layout


def init_state_fn(trainer, model, tx, init_batch, ema_decay: float = 0.0, *,
                  init_model=None, layout=None) -> Callable:
  """``rng -> state``: parameters, optimizer state, model state, counters and
  (``ema_decay > 0``) an empty EMA, which needs no copy of the parameters
  (darl_jax/ema.py): pretrained ones swapped in later are averaged from the
  first step on. ``init_model``: the model whose initialisation draws the
  variables (``initialising_model``), converted to ``layout``'s block
  layout (``model``'s abstract variables; layer_layout.convert)."""

  def init_state(rng):
    if init_model is None:
      variables = dict(trainer.init_variables(model, rng, init_batch))
    else:
      variables = layer_layout.convert(
          dict(trainer.init_variables(init_model, rng, init_batch)), layout)
    params = variables.pop("params")
    state = {"step": jnp.zeros((), jnp.int32), "params": params,
             "opt_state": tx.init(params), "model_state": variables,
             "bad_step": jnp.full((), -1, jnp.int32)}
    if ema_decay > 0:
      state["ema"] = ema_lib.init(params)
    return state

  return init_state


def initialising_model(init_params_fn: Callable, model, abstract_vars: dict):
  """The model a fresh state's variables are drawn with: ``model``'s scanned
  twin (layer_layout.scanned_twin) where ``model`` unrolls its blocks,
  None (``model`` itself) where it scans them or cannot scan (the
  two-stream backbone). ``init_params_fn``: ``(model, rng) -> variables``.

  Why: in the unrolled model each block draws its parameters from its own
  key, a constant of the program, so XLA compiles every block's random
  draws into kernels of their own that no two blocks share; for a deep
  model that initialisation compiles longer than the train step and so
  sets the time to the first step. The scanned twin draws all blocks in one
  loop body, compiled once whatever the depth.
  What it changes: the parameters have the same shapes and initialisers,
  but not the values the unrolled model's own ``init`` gave (each block's
  key is the stack's key split per layer instead of folded in with the
  block's name). A fresh run's initial parameters are therefore the same
  for ``model.scan_layers`` True and False (same seed, same values in
  either layout), and differ from those the unrolled model's own ``init``
  would draw.
  """
  twin = layer_layout.scanned_twin(model)
  if twin is None:
    return None
  try:
    twin_vars = jax.eval_shape(lambda rng: init_params_fn(twin, rng), jax.random.PRNGKey(0))
  except ValueError:        # a model that refuses model.scan_layers
    return None
  converted = layer_layout.convert(dict(twin_vars), abstract_vars)
  same = (jax.tree_util.tree_structure(converted) == jax.tree_util.tree_structure(abstract_vars)
          and all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(
              jax.tree_util.tree_leaves(converted), jax.tree_util.tree_leaves(abstract_vars))))
  if not same:
    logging.warning("the model's scanned form holds other variables than the model; the "
                    "state is initialised with the unrolled model (slower to compile)")
    return None
  return twin


def restore_target(abstract_state: dict, saved) -> dict:
  """The abstract state to restore a checkpoint whose state tree is ``saved``
  (Orbax metadata; None where it does not read) as: ``ema_target``'s, in
  the checkpoint's block layout (darl_jax/layer_layout.py: a checkpoint of
  the unrolled blocks resumes a scanned run and the other way round);
  ``adopt_layout`` then brings the restored state into this run's."""
  return layer_layout.convert(ema_target(precision_target(abstract_state, saved), saved), saved)


def adopt_layout(state: dict, abstract_state: dict, step: int) -> dict:
  """A restored state in this run's block layout (``model.scan_layers``),
  its arrays stacked or unstacked on the devices into the run's shardings;
  logs one line when it converts. (No buffer donation: the stacked and the
  per-block arrays differ in shape, so none could be reused.)"""
  like = ema_target(abstract_state, state)
  if not layer_layout.differs(state, like):
    return state
  logging.info("the checkpoint at step %d holds %s blocks: converted to this run's %s "
               "layout (model.scan_layers)", step, layer_layout.describe(state["params"]),
               layer_layout.describe(like["params"]))
  shardings = jax.tree.map(lambda leaf: leaf.sharding, like)
  return jax.jit(functools.partial(layer_layout.convert, like=like),
                 out_shardings=shardings)(state)


def precision_target(abstract_state: dict, saved) -> dict:
  """``abstract_state`` with the fp8 histories (``model_state["fp8"]``,
  darl_jax/fp8.py) as the checkpoint has them: a run under
  ``precision='fp8'`` reads a bf16 checkpoint without them, and a bf16 run
  reads an fp8 one with them (replicated, as saved); ``adopt_precision``
  then brings the state to this run's precision."""
  model_state = abstract_state["model_state"]
  saved_state = saved.get("model_state") if isinstance(saved, dict) else None
  if not isinstance(saved_state, dict) or (
      (fp8.COLLECTION in model_state) == (fp8.COLLECTION in saved_state)):
    return abstract_state
  if fp8.COLLECTION in model_state:
    model_state = {k: v for k, v in model_state.items() if k != fp8.COLLECTION}
  else:
    replicated = abstract_state["step"].sharding
    model_state = {**model_state, fp8.COLLECTION: jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(tuple(m.shape), jnp.float32, sharding=replicated),
        saved_state[fp8.COLLECTION], is_leaf=lambda m: hasattr(m, "shape"))}
  return {**abstract_state, "model_state": model_state}


def adopt_precision(state: dict, abstract_state: dict, step: int) -> dict:
  """A restored state with this run's fp8 histories or without them (see
  precision_target): a bf16 checkpoint under ``precision='fp8'`` gets empty
  histories, whose first step fills them (fp8.warming); an fp8 one under
  bf16 drops them. Logs one line when it changes anything."""
  wanted = abstract_state["model_state"].get(fp8.COLLECTION)
  if (wanted is None) == (fp8.COLLECTION not in state["model_state"]):
    return state
  model_state = {k: v for k, v in state["model_state"].items() if k != fp8.COLLECTION}
  if wanted is None:
    logging.info("the checkpoint at step %d was saved under precision='fp8': its fp8 "
                 "histories are not used under bf16", step)
  else:
    model_state[fp8.COLLECTION] = jax.tree.map(
        lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding), wanted)
    logging.info("the checkpoint at step %d was saved under precision='bf16': the fp8 "
                 "scales start empty, and the next step fills them instead of updating "
                 "the parameters", step)
  return {**state, "model_state": model_state}


def ema_target(abstract_state: dict, saved) -> dict:
  """``abstract_state``, except that a run with an EMA reads a checkpoint
  without one (the EMA is turned on at this resume) or with an earlier
  fine-tuning run's EMA in ``model_state["ema"]``; ``adopt_ema`` then
  completes the state."""
  if "ema" not in abstract_state or not isinstance(saved, dict) or "ema" in saved:
    return abstract_state
  target = {k: v for k, v in abstract_state.items() if k != "ema"}
  if ema_lib.is_legacy(saved):
    count = jax.ShapeDtypeStruct((), jnp.int32, sharding=abstract_state["step"].sharding)
    target["model_state"] = {**target["model_state"], "ema": {
        "params": abstract_state["ema"]["params"], "count": count}}
  return target


def adopt_ema(state: dict, step: int, meta: dict, config, state_shardings) -> dict:
  """A restored state in this run's layout (see restore_target): an EMA read
  from ``model_state["ema"]`` moves to ``state["ema"]``; a run that turns the
  EMA on at this resume starts an empty one (averaged from the next step)."""
  if "ema" not in state_shardings or "ema" in state:
    return state
  state = dict(state)
  if ema_lib.is_legacy(state):
    model_state = dict(state["model_state"])
    legacy = model_state.pop("ema")
    # The decay the sum was accumulated with: the checkpoint's own.
    decay = (meta.get("config") or {}).get("ema_decay") or config.ema_decay
    state["model_state"] = model_state
    state["ema"] = jax.device_put(ema_lib.from_legacy(legacy, decay), state_shardings["ema"])
    logging.info("the checkpoint at step %d keeps its EMA in model_state['ema'] (earlier "
                 "fine-tuning runs); it continues as state['ema']", step)
  else:
    state["ema"] = jax.jit(ema_lib.init, out_shardings=state_shardings["ema"])(
        state["params"])
    logging.warning("the checkpoint at step %d has no EMA of the parameters: the EMA "
                    "(ema_decay=%g) starts now, from the current parameters", step,
                    config.ema_decay)
  return state


def eval_view(config, state_shardings, average=None) -> Callable[[dict], dict]:
  """``state -> state`` as evaluation, ``extra_eval`` and ``finalize`` see it:
  with an EMA (``ema_decay > 0``) and ``eval_with_ema`` (default True) its
  ``params`` are the averaged ones (a new tree beside the state's; the
  state itself is unchanged; ``average``: ``ema_average_step`` compiled),
  otherwise the state as it is."""
  if "ema" not in state_shardings or not config.get("eval_with_ema", True):
    return lambda state: state
  averaged = average or ema_average_step(state_shardings)
  return lambda state: {**state, "params": averaged(state["ema"], state["params"])}


def ema_average_step(state_shardings) -> Callable:
  """The jitted ``(ema, params) -> averaged params`` eval_view runs."""
  return jax.jit(ema_lib.average, out_shardings=state_shardings["params"])
