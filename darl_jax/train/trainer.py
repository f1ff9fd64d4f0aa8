"""What a trainer author needs: the ``Trainer`` hooks, the ``Context`` the loop
hands them, and the checks and errors they share.

A trainer owns its model, loss and predictions (``build_model``,
``init_variables``, ``loss_fn``, ``eval_fn``); the shared loop
(train/loop.py) owns everything else: set-up (train/setup.py), the state
(train/state.py), the step programs (train/step.py), start-up
(train/startup.py), logging, evaluation, checkpoints and resume. The
registry of trainers by ``config.trainer`` is train/trainers/__init__.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from etils import epath

from darl_jax import data as data_lib
from darl_jax import metrics as metrics_lib


class NonFiniteError(RuntimeError):
  """Raised when a step's loss or gradient norm is NaN or infinite."""


@dataclasses.dataclass
class Context:
  """What the loop hands to a trainer's hooks."""
  config: Any
  workdir: epath.Path
  mesh: jax.sharding.Mesh
  train_source: Any
  eval_source: Any
  writer: metrics_lib.MetricWriter
  total_steps: int
  # The programs of ``Trainer.finalize_programs``, compiled at start-up: name -> compiled.
  compiled: dict = dataclasses.field(default_factory=dict)
  # The run's microbatch, evaluation batch and data workers (train/fit.py's
  # ``Resolved``), set by the loop once they are decided; None before.
  resolved: Any = None


class Trainer:
  """Base class of the trainers. Override the hooks; the loop does the rest."""

  def __init__(self, config):
    self.config = config

  def build_model(self, ctx: Context):
    raise NotImplementedError

  def init_variables(self, model, rng, batch) -> dict:
    """Variables dict with at least ``params`` (other collections = model_state)."""
    raise NotImplementedError

  def loss_fn(self, model, params, model_state, batch, rng, train: bool):
    """-> (loss, (metrics dict, new model_state)). Scalar metrics are logged.

    With gradient accumulation (``microbatch_size``) ``batch`` is one
    microbatch of the step's prepared batch (``prepare_batch``) and ``rng``
    that microbatch's key; ``metrics[accumulate.METRIC_WEIGHTS]``, if given,
    weighs a weighted-mean loss or metric across microbatches."""
    raise NotImplementedError

  def prepare_batch(self, model, batch, rng, train: bool) -> dict:
    """The step's per-example randomness (noise, prefix lengths, orders) and
    mixing across examples (mixup), made once on the whole batch before it
    is split into microbatches (train/accumulate.py), from the step's
    ``rng``: returns ``batch`` with whatever ``loss_fn`` reads, every new
    entry with the batch's leading axis. Default: ``batch`` unchanged."""
    del model, rng, train
    return batch

  def eval_fn(self, model, params, model_state, batch, rng) -> dict:
    """-> dict of per-example arrays ``[b]``; the loop averages them over valid rows."""
    raise NotImplementedError

  def load_pretrained(self, ctx: Context, params):
    """Hook for transfer learning: return params with pretrained parts swapped in."""
    return params

  def make_source(self, config, split: str, *, train: bool):
    """The data source of ``split`` (``train``: the training split). Override to
    wrap it (e.g. RandAugment) or to read a dataset the registry does not know."""
    del train
    return data_lib.build_source(config.data, split=split, seed=config.seed)

  def extra_eval(self, ctx: Context, model, state) -> dict:
    """Whole-split evaluators beyond the per-example ``eval_fn`` (e.g. a probe
    fitted on features): ``{name: float}``, logged as ``val_<name>``."""
    return {}

  def finalize(self, ctx: Context, model, state) -> None:
    """Artifacts after training (pictures, reports)."""

  def finalize_programs(self, ctx: Context, model, abstract_params) -> dict:
    """The programs ``finalize`` will run, ``{name: (jitted, abstract
    arguments)}`` (``abstract_params``: the parameters' ShapeDtypeStructs):
    the loop compiles them at start-up beside the train step (saved with
    it, train/executables.py) and hands them to ``finalize`` compiled, as
    ``ctx.compiled[name]``, so that nothing compiles after the last step."""
    del ctx, model, abstract_params
    return {}


def check_image_shape(config, source) -> None:
  """The data's images must be the size and channels the model is built for."""
  h, w, c = source.image_shape
  m = config.model
  if (h, w, c) != (m.image_size, m.image_size, m.channels):
    raise ValueError(
        f"data gives {h}x{w}x{c} images but the model expects {m.image_size}x"
        f"{m.image_size}x{m.channels}; set data.image_size/data.channels and "
        "model.image_size/model.channels to agree")


