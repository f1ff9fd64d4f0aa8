"""The exponential moving average (EMA) of the parameters that a run can keep.

MAR samples and evaluates from an EMA of its weights (decay 0.9999); here
every trainer can keep one (``config.ema_decay > 0``): the train state's
``ema`` entry, updated by the jitted step after the optimizer's update
(darl_jax/train/loop.py) and checkpointed with the rest of the state.

``ema = {"params": sum, "weight": w}``, both float32. The sum starts at zero
and each step adds the new parameters at ``1 - decay``::

    sum <- decay * sum + (1 - decay) * params
    w   <- decay * w   + (1 - decay)          (w = 1 - decay ** n after n steps)

and the average is ``sum / w`` (the debiasing of Adam's moments). It starts
exactly at the first step's parameters, so neither restored pretrained
weights nor a run that turns the EMA on when it resumes need a copy of
earlier parameters, and ``w`` follows the same arithmetic as the sum, so
the average of a constant is that constant (no ``decay ** n`` rounding) even
if the decay changes between a run and its resumption.

Fine-tuning runs of earlier versions kept ``{"params": sum, "count": n}`` in
``model_state["ema"]`` (the same sum, debiased by ``1 - decay ** n``):
``from_legacy`` converts it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


class MissingEmaError(ValueError):
  """An EMA of the parameters was asked for; the checkpoint has none."""


def init(params) -> dict:
  """An empty average (weight 0) for parameters shaped like ``params``."""
  return {"params": jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
          "weight": jnp.zeros((), jnp.float32)}


def update(ema: dict, params, decay: float) -> dict:
  """``ema`` after one step whose new parameters are ``params``."""
  params = jax.lax.stop_gradient(params)
  return {"params": jax.tree_util.tree_map(
              lambda e, p: decay * e + (1.0 - decay) * p.astype(jnp.float32),
              ema["params"], params),
          "weight": decay * ema["weight"] + (1.0 - decay)}


def average(ema: dict, params):
  """The averaged parameters (``params``' dtypes); ``params`` themselves while
  the average is empty (no step since it started). Traceable."""
  weight = ema["weight"]
  started = weight > 0
  divisor = jnp.where(started, weight, 1.0)
  return jax.tree_util.tree_map(
      lambda e, p: jnp.where(started, e / divisor, p.astype(jnp.float32)).astype(p.dtype),
      ema["params"], params)


def host_average(ema: dict, where: str = "the checkpoint"):
  """``average`` of host (numpy) arrays, float32; MissingEmaError if empty."""
  weight = float(np.asarray(ema["weight"]))
  if weight <= 0:
    raise MissingEmaError(f"the EMA of the parameters in {where} has not been updated "
                          "yet (no step since it started): read its parameters instead")
  return jax.tree_util.tree_map(
      lambda e: (np.asarray(e, np.float32) / np.float32(weight)).astype(np.float32),
      ema["params"])


def from_legacy(legacy: dict, decay: float) -> dict:
  """``model_state["ema"] = {"params", "count"}`` of earlier fine-tuning runs
  -> ``{"params", "weight"}`` (host arrays)."""
  count = int(np.asarray(jax.device_get(legacy["count"])))
  weight = 1.0 - float(decay) ** count if count > 0 else 0.0
  return {"params": legacy["params"], "weight": np.float32(weight)}


def is_legacy(tree) -> bool:
  """Whether a state (or its checkpoint's tree) keeps the EMA the old way."""
  model_state = tree.get("model_state") if isinstance(tree, dict) else None
  legacy = model_state.get("ema") if isinstance(model_state, dict) else None
  return isinstance(legacy, dict) and set(legacy) == {"params", "count"}
