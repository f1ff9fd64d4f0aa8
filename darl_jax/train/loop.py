"""The one shared train loop. Trainers own only their model, loss and predictions.

Phases, top to bottom: workdir and writers -> ``setup`` (mesh -> data ->
model and optimizer -> sharded state, built under jit from ``jax.eval_shape``,
never on the host -> jitted steps; the benchmarks call it too) -> resume ->
loop (log, evaluate, checkpoint) -> trainer artifacts.

State is a dict ``{step, params, opt_state, model_state, bad_step}``, and
``ema`` with ``config.ema_decay > 0``: ``model_state`` holds non-trained
collections (e.g. BatchNorm statistics), ``bad_step`` the first step whose
loss or gradient was non-finite (-1 if none), ``ema`` the exponential moving
average of the parameters (darl_jax/ema.py; sharded as they are), updated
after each step's update. With ``eval_with_ema`` (the default) evaluation,
``extra_eval`` and ``finalize`` see the averaged parameters as
``state["params"]``.
Steps are numbered one way everywhere: step n is the update that makes the
step counter n, and metrics.jsonl's record ``step: n`` covers it.
A non-finite step leaves the state untouched, so no NaN can reach a checkpoint;
the loop then stops with the step and the metric named (or, with
``skip_nonfinite``, counts the skipped steps and goes on).

Randomness is ``fold_in(PRNGKey(seed), step)`` and the data for step ``s`` is a
function of ``(seed, s)`` and the number of data streams fixed when the run
started (kept in the checkpoint's data state; data/base.py), so a resumed run
replays exactly the losses of an uninterrupted one, on any number of devices
or processes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import cli
from darl_jax import config_lib
from darl_jax import data as data_lib
from darl_jax import ema as ema_lib
from darl_jax import files
from darl_jax import layer_layout
from darl_jax import metrics as metrics_lib
from darl_jax import ops
from darl_jax import optim
from darl_jax import preemption
from darl_jax import sharding as sharding_lib
from darl_jax.data import base as data_base
from darl_jax.data import pipeline as data_pipeline
from darl_jax import workdir as workdir_lib
from darl_jax.train import accumulate
from darl_jax.train import aot
from darl_jax.train import feed as feed_lib
from darl_jax.train import startup


# Steps the loop dispatches ahead of the device: the host waits for step
# n - IN_FLIGHT before it dispatches step n + 1 (preemption.py's agreement
# reasons from this bound).
IN_FLIGHT = 2


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


# The start-up programs (train/startup.py), re-exported for the benchmarks,
# the TPU compile command and the tests.
Programs = startup.Programs
compile_programs = startup.compile_programs
compile_train_step = startup.compile_train_step
compile_eval_step = startup.compile_eval_step
abstract_eval_batch = startup.abstract_eval_batch
newest_saved_step = startup.newest_saved_step
eval_view = startup.eval_view
ema_average_step = startup.ema_average_step

# Host batches -> device arrays, uint8 -> float images (re-exported for the
# trainers' evaluators).
to_global = feed_lib.to_global
model_input = feed_lib.model_input


def _mean_metrics(history: list[dict], carry: dict | None = None) -> dict:
  """The window's mean metrics (``carry``: metrics_lib.window_mean)."""
  return metrics_lib.window_mean(jax.device_get(history), carry)


def eval_offset(eval_source, process_index: int, process_count: int) -> int:
  """The index in the eval split of this process's first example: the
  examples of the processes before it (data/base.py, ``process_range``;
  a source of per-process files counts its ``process_examples``). A
  mixture, whose components split by process one by one, gets indices
  that may differ from its global order but not with the batch."""
  if process_count == 1:
    return 0
  if getattr(eval_source, "owner", None) is not None:
    return int(sum(eval_source.process_examples[:process_index]))
  return data_base.process_range(eval_source.num_examples, process_index, process_count)[0]


def eval_cap(config, process_count: int) -> int:
  """The examples of the eval split each process evaluates, 0 for all:
  ``eval_max_batches`` batches of ``batch_size`` (the training batch, not
  the evaluation batch), so that a capped evaluation covers the same
  examples whatever ``eval_batch_size`` is, or the microbatch it defaults to."""
  max_batches = config.get("eval_max_batches", 0)
  return max_batches * data_base.local_batch_size(config.batch_size, process_count)


def evaluate(trainer, model, state, eval_source, eval_fn, sharding, config) -> dict:
  """Averages the trainer's per-example metrics over one pass of the eval split.

  The result does not depend on the evaluation batch: each row of a batch
  carries ``index``, its example's index in the split (make_eval_step draws
  the example's randomness from it), padding rows are masked out, and the
  cap (eval_cap) counts examples, whose rows past it are masked as well.
  """
  del trainer, model
  sums, count = {}, 0.0
  process, processes = jax.process_index(), jax.process_count()
  cap = eval_cap(config, processes)
  offset = eval_offset(eval_source, process, processes)
  batches = eval_source.eval_batches(config.eval_batch_size or config.batch_size,
                                     process, processes,
                                     num_workers=config.data.get("num_workers", -1))
  seen = 0      # this process's real rows so far: the next one's ordinal
  previous = None
  batches = iter(batches)
  while not (cap and _all_processes(seen >= cap, processes)):
    batch = next(batches, None)
    if batch is None:
      break
    real = np.asarray(batch["mask"], bool)
    ordinal = seen + np.cumsum(real) - 1
    seen += int(real.sum())
    mask = real & (ordinal < cap) if cap else real
    batch = {**batch, "mask": mask, "index": (offset + ordinal).astype(np.int32)}
    batch = to_global(batch, sharding)
    out = eval_fn(state["params"], state["model_state"], batch)
    for k, v in out.items():
      sums[k] = sums.get(k, 0.0) + v
    count += jnp.sum(batch["mask"])
    # At most one batch ahead of the devices, as the train loop's IN_FLIGHT:
    # a host that queues batch after batch while one device lags fills that
    # device's queue, and XLA:CPU's client then deadlocks in a collective
    # and aborts (train/knn.py, "Dispatch", has the mechanism).
    jax.block_until_ready(previous)
    previous = out
  count = float(count)
  return {k: float(v) / max(count, 1.0) for k, v in sums.items()}


def _all_processes(done: bool, process_count: int) -> bool:
  """Whether every process is ``done``: the eval steps are collective, so
  all processes leave the evaluation after the same batch (a process whose
  slice has fewer real rows than the cap runs masked batches until then)."""
  if process_count == 1:
    return done
  return bool(np.all(multihost_utils.process_allgather(np.asarray(done))))


def host_readable(state: dict, mesh) -> dict:
  """``state`` with ``params`` and ``model_state`` readable on every process.

  A trainer's ``finalize`` may run on process 0 alone (pictures, reports) and
  read parameters with ``jax.device_get``, which fails for arrays sharded over
  other processes' devices (FSDP on several hosts). On multi-process runs the
  parameters are therefore first replicated onto every device, a collective
  that all processes run here; single-process runs get ``state`` unchanged.
  """
  if jax.process_count() == 1:
    return state
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  gather = jax.jit(lambda tree: tree, out_shardings=replicated)
  return {**state, "params": gather(state["params"]),
          "model_state": gather(state["model_state"])}


def on_mesh(fn: Callable, mesh) -> Callable:
  """``fn`` traced with ``mesh`` as the context's (abstract) mesh, so that the
  Pallas kernels inside it run per device on the batch's shards
  (kernels/per_shard.py); ``fn`` itself for ``mesh=None``."""
  if mesh is None:
    return fn

  @functools.wraps(fn)
  def traced_on_mesh(*args):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args)
  return traced_on_mesh


def make_train_step(trainer: Trainer, model, tx, hyperparams: optim.Hyperparams, base_rng,
                    mesh=None, ema_decay: float = 0.0, num_microbatches: int = 1) -> Callable:
  """The (unjitted) update ``(state, batch, hyper) -> (state, metrics)``.

  ``hyper``: the update's learning rate and weight decay, ``{"learning_rate":
  f32[], "weight_decay": f32[]}`` (``hyperparams.values(state["step"])``, made
  on the host), which ``tx`` (optim.make_train_optimizer, ``hyperparams``
  its values) reads: they are inputs of the program, not constants, so a
  change of schedule, peak lr or nonzero weight decay compiles nothing new.

  A step whose loss or gradient norm is non-finite leaves the state as it was
  (EMA included) and records its index in ``bad_step``. Shared by the loop
  and the benchmarks. ``mesh``: the mesh the step is jitted for (its batch
  split is the kernels', see on_mesh); None for one device. ``ema_decay > 0``:
  the state has an ``ema``, which averages in the updated parameters.
  ``num_microbatches > 1``: the batch's gradient is accumulated over that
  many microbatches in one scan (train/accumulate.py), one update per step.
  """
  batch_shards = sharding_lib.batch_shards(mesh)
  spec = None if mesh is None else sharding_lib.batch_sharding(mesh).spec

  @functools.partial(on_mesh, mesh=mesh)
  def train_step(state, batch, hyper):
    batch = feed_lib.model_input(batch)
    rng = jax.random.fold_in(base_rng, state["step"])
    batch = trainer.prepare_batch(model, batch, rng, True)

    def loss_of(params, batch, key):
      return trainer.loss_fn(model, params, state["model_state"], batch, key, True)

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)
    if num_microbatches == 1:
      (loss, (metrics, model_state)), grads = grad_fn(state["params"], batch, rng)
      metrics, _ = accumulate.pop_weights(metrics)
    else:
      keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(num_microbatches))
      microbatches = accumulate.split(batch, num_microbatches, batch_shards, spec)
      loss, metrics, model_state, grads = accumulate.accumulate(
          grad_fn, state["params"], microbatches, keys)
    grad_norm = optax.tree.norm(grads)
    with hyperparams.bind(hyper):
      updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree_util.tree_map(
        lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = {
        "step": state["step"] + 1,
        "params": keep(params, state["params"]),
        "opt_state": keep(opt_state, state["opt_state"]),
        "model_state": keep(model_state, state["model_state"]),
        # Numbered as logged: the update that makes the step counter n is step n.
        "bad_step": jnp.where(~finite & (state["bad_step"] < 0), state["step"] + 1,
                              state["bad_step"]),
    }
    if ema_decay > 0:
      new_state["ema"] = keep(ema_lib.update(state["ema"], params, ema_decay), state["ema"])
    metrics = {k: v for k, v in metrics.items() if jnp.ndim(v) == 0}
    # The parameter norm is not a per-step metric: it is read from the state
    # when metrics are logged (run), so that the step does not read every
    # parameter once more for it.
    metrics.update(loss=loss, grad_norm=grad_norm,
                   learning_rate=jnp.asarray(hyper["learning_rate"], jnp.float32),
                   nonfinite=(~finite).astype(jnp.float32))
    return new_state, metrics

  return train_step


def example_keys(rng: jax.Array, index: jax.Array) -> jax.Array:
  """One key per example: ``rng`` folded with each example's ``index [B]``."""
  return jax.vmap(lambda i: jax.random.fold_in(rng, i))(index)


def make_eval_step(trainer: Trainer, model, base_rng, mesh=None) -> Callable:
  """The (unjitted) ``(params, model_state, batch) -> {metric: sum over the
  batch's real rows}`` that ``evaluate`` averages. ``mesh``: as for
  make_train_step.

  Its noise is fixed, so evaluations are comparable between steps and runs,
  and it is each example's own, so they are comparable between evaluation
  batches: ``batch["index"]`` holds each row's index in the eval split, and
  the trainer's ``eval_fn`` draws example i's randomness from
  ``example_keys(rng, batch["index"])[i]``, never from ``rng`` for the batch
  as a whole (whose draw would depend on the row and the batch's size)."""

  @functools.partial(on_mesh, mesh=mesh)
  def eval_step(params, model_state, batch):
    batch = feed_lib.model_input(batch)
    rng = jax.random.fold_in(base_rng, 2**31 - 2)
    out = trainer.eval_fn(model, params, model_state, batch, rng)
    # A masked row's metric is left out, not multiplied by zero: a padding
    # row's NaN would otherwise reach the sum.
    return {k: jnp.sum(jnp.where(batch["mask"], v, 0.0)) for k, v in out.items()}

  return eval_step


def init_state_fn(trainer: Trainer, model, tx, init_batch, ema_decay: float = 0.0, *,
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
  draws into kernels of their own that no two blocks share. The H/14
  initialisation compiled for 58.7 s on the H200, longer than its train
  step (41.0 s), and so set the time to the first step. The scanned twin
  draws all blocks in one loop body, compiled once whatever the depth.
  What it changes: the parameters have the same shapes and initialisers,
  but not the values the unrolled model's own ``init`` gave (each block's
  key is the stack's key split per layer instead of folded in with the
  block's name). A fresh run's initial parameters are therefore the same
  for ``model.scan_layers`` True and False (same seed, same values in
  either layout), and differ from those of runs made before this change.
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
  return layer_layout.convert(ema_target(abstract_state, saved), saved)


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


@contextlib.contextmanager
def job(config, workdir, model_dtype: str):
  """What a job that runs no training loop (sampling, few-shot) shares with
  the loop: the workdir checked and locked (darl_jax/workdir.py), the metric
  writer, the compilation cache and the kernel choice for the model's dtype.
  Yields ``(workdir, writer, is_main)``."""
  workdir = workdir_lib.prepare(workdir, config)
  is_main = jax.process_index() == 0
  with workdir_lib.hold(workdir, is_main=is_main), metrics_lib.MetricWriter(
      str(workdir), is_main_process=is_main,
      tensorboard=config.get("tensorboard", True)) as writer:
    enable_compilation_cache(config)
    ops.configure(config.get("kernels"), model_dtype)
    yield workdir, writer, is_main


def enable_compilation_cache(config) -> None:
  """JAX's persistent compilation cache at ``config.compilation_cache_dir``
  ("" = off; a JAX_COMPILATION_CACHE_DIR environment variable wins)."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return
  path = config.get("compilation_cache_dir", "")
  if not path:
    return
  if "://" not in path:
    path = os.path.expanduser(path)
  jax.config.update("jax_compilation_cache_dir", path)
  # Only programs that take a while to compile are worth a cache entry.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


@dataclasses.dataclass
class Setup:
  """Everything a run trains with, built by ``setup`` without touching the
  workdir: the loop (``run``) adds checkpoints, logging and the loop itself;
  the benchmarks time ``train_step`` as the loop runs it."""
  ctx: Context
  model: Any
  mesh: jax.sharding.Mesh
  batch_sharding: Any
  steps_per_epoch: int
  tx: Any
  schedule: Callable             # the lr schedule, traceable (optim.make_schedule)
  hyperparams: Any               # optim.Hyperparams: the per-step values the step reads
  base_rng: jax.Array
  abstract_state: Any            # ShapeDtypeStructs carrying the state's shardings
  state_shardings: Any
  train_step: Callable           # jitted (state, batch, hyper) -> (state, metrics), state
                                 # donated; hyper = self.hyper(state["step"])
  eval_step: Callable            # jitted (params, model_state, batch) -> metric sums
  init_state_fn: Callable        # rng -> state (unjitted)
  eval_view: Callable            # state -> the state evaluation sees (see eval_view)
  make_step: Callable            # num_microbatches -> a jitted train step like train_step
  abstract_batch: Any            # the training batch as ShapeDtypeStructs (aot.abstract_batch)
  batch_shards: int              # data x fsdp: the devices a batch is split over
  abstract_hyper: Any            # the step's hyper argument as (replicated) ShapeDtypeStructs
  init_step: Callable = None     # jitted init_state_fn (rng -> state), out on the state's shardings

  def hyper(self, step: int) -> dict:
    """The train step's ``hyper`` argument for the update from step counter
    ``step`` to ``step + 1`` (host values, optim.Hyperparams.values)."""
    return self.hyperparams.values(step)

  def init_rng(self) -> jax.Array:
    """The key a fresh state is drawn from, replicated over the mesh."""
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    return jax.device_put(jax.random.fold_in(self.base_rng, -1 % (2**31)), replicated)

  def abstract_init_rng(self) -> jax.ShapeDtypeStruct:
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(self.base_rng.shape, self.base_rng.dtype, sharding=replicated)

  def init_state(self, compiled=None) -> dict:
    """A fresh state, built on the mesh (never on the host), by ``compiled``
    (``init_step`` compiled at start-up) or else ``init_step``."""
    return (compiled or self.init_step)(self.init_rng())


def setup(trainer: Trainer, config, *, workdir=None, writer=None, devices=None) -> Setup:
  """Mesh, data sources, model, optimizer, state shardings and the jitted
  steps of ``trainer`` under ``config``, in that order. ``devices``: the
  mesh's devices (default: all)."""
  # ------------------------------------------------------------ mesh and data
  mesh = sharding_lib.make_mesh(config.mesh, devices=devices)
  # How the model's ops run, set once for everything traced from here on.
  if "model" in config:
    kernels = ops.configure(config.get("kernels"), config.model.get("dtype", "float32"))
    logging.info("%s", ops.describe(config.get("kernels"), kernels))
  warning = sharding_lib.kernel_mesh_warning(config, mesh)
  if warning:
    logging.warning(warning)
  batch_sharding = sharding_lib.batch_sharding(mesh)
  if config.batch_size % jax.process_count():
    raise ValueError(f"batch_size {config.batch_size} must be divisible by the number "
                     f"of processes ({jax.process_count()})")
  batch_shards = sharding_lib.batch_shards(mesh)
  if config.batch_size % batch_shards:
    raise ValueError(f"batch_size {config.batch_size} must be divisible by the data x fsdp "
                     f"mesh size {batch_shards}")
  train_source = trainer.make_source(config, config.data.train_split, train=True)
  eval_source = trainer.make_source(config, config.data.eval_split, train=False)
  if config.batch_size > train_source.num_examples:
    # The sources would fill each batch by wrapping around the split: the
    # same images several times in one batch, silently.
    raise config_lib.ConfigError(
        f"config.batch_size {config.batch_size} is larger than the training split "
        f"({train_source.num_examples} examples of {config.data.name!r} "
        f"{config.data.train_split!r}): set --config.batch_size to at most "
        f"{train_source.num_examples}")
  steps_per_epoch = max(train_source.num_examples // config.batch_size, 1)
  total_steps = config_lib.resolve_total_steps(config, steps_per_epoch)
  ctx = Context(config, workdir, mesh, train_source, eval_source, writer, total_steps)

  # ---------------------------------------------------- model and optimizer
  model = trainer.build_model(ctx)
  base_rng = jax.random.PRNGKey(config.seed)
  h, w, c = train_source.image_shape
  init_batch = {"image": jnp.zeros((1, h, w, c), jnp.float32),
                "label": jnp.zeros((1,), jnp.int32)}

  def init_params_fn(module, rng):
    return trainer.init_variables(module, rng, init_batch)

  abstract_vars = jax.eval_shape(functools.partial(init_params_fn, model), base_rng)
  tx, hyperparams = optim.make_train_optimizer(config.optim, abstract_vars["params"],
                                               total_steps=total_steps,
                                               steps_per_epoch=steps_per_epoch,
                                               batch_size=config.batch_size)

  ema_decay = float(config.get("ema_decay", 0.0) or 0.0)
  init_state = init_state_fn(trainer, model, tx, init_batch, ema_decay,
                             init_model=initialising_model(init_params_fn, model, abstract_vars),
                             layout=abstract_vars)

  # ----------------------------------------------------------- sharded state
  abstract_state = jax.eval_shape(init_state, base_rng)
  rules = sharding_lib.check_rules(config.get("sharding", "replicated"))
  state_shardings = sharding_lib.tree_shardings(abstract_state, mesh, rules)
  if "ema" in state_shardings:          # the average lies where its parameters do
    state_shardings["ema"]["params"] = state_shardings["params"]
  abstract_state = jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract_state, state_shardings)

  # --------------------------------------------------------------- the steps
  # The step's learning rate and weight decay (optim.Hyperparams), on every device.
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def make_step(num_microbatches: int):
    step = make_train_step(trainer, model, tx, hyperparams, base_rng, mesh, ema_decay,
                           num_microbatches)
    return jax.jit(step, in_shardings=(state_shardings, batch_sharding, replicated),
                   out_shardings=(state_shardings, None), donate_argnums=(0,))

  microbatch = config.get("microbatch_size", 0)
  # -1 (automatic) is resolved when the step is compiled (compile_programs).
  num_microbatches = (1 if microbatch == -1 else
                      accumulate.num_microbatches(config.batch_size, microbatch, batch_shards))
  eval_step = jax.jit(make_eval_step(trainer, model, base_rng, mesh))
  return Setup(ctx=ctx, model=model, mesh=mesh, batch_sharding=batch_sharding,
               steps_per_epoch=steps_per_epoch, tx=tx, schedule=hyperparams.schedule,
               hyperparams=hyperparams, base_rng=base_rng,
               abstract_state=abstract_state, state_shardings=state_shardings,
               train_step=make_step(num_microbatches), eval_step=eval_step,
               init_state_fn=init_state, eval_view=eval_view(config, state_shardings),
               make_step=make_step, batch_shards=batch_shards,
               abstract_batch=aot.abstract_batch(train_source.image_shape, config.batch_size,
                                                 batch_sharding),
               abstract_hyper=hyperparams.abstract(replicated),
               init_step=jax.jit(init_state, out_shardings=state_shardings))


def _memory_line(stats: dict) -> str:
  return ", ".join(f"{k[len('memory_'):-len('_gib')].replace('_', ' ')} {v:.2f} GiB"
                   for k, v in stats.items())


class Profile:
  """A jax.profiler trace of the steps ``[profile.start_step, start_step +
  num_steps)`` into ``<workdir>/profile`` (config.profile; start_step 0 =
  off), on the main process. The last traced step is waited for before the
  trace stops, so its device work is in it."""

  def __init__(self, config, workdir, is_main: bool):
    cfg = config.get("profile") or {}
    self.first = int(cfg.get("start_step", 0) or 0) if is_main else 0
    self.last = self.first + int(cfg.get("num_steps", 3) or 1) - 1
    self.directory = str(workdir / "profile")
    self.active = False

  def before(self, step: int) -> None:
    if self.first and step == self.first:
      jax.profiler.start_trace(self.directory)
      self.active = True
      logging.info("profiling steps %d to %d into %s", self.first, self.last, self.directory)

  def after(self, step: int, metrics) -> None:
    if self.active and step == self.last:
      jax.block_until_ready(metrics)
      self.stop()

  def stop(self) -> None:
    if self.active:
      self.active = False
      jax.profiler.stop_trace()
      logging.info("wrote the profile to %s (TensorBoard's profile plugin or Perfetto)",
                   self.directory)


def run(trainer: Trainer, config, workdir: str) -> dict:
  """Trains ``trainer`` per ``config`` in ``workdir``; returns the last metrics.

  Nothing is written before every config value passed ``config_lib.validate``
  and the workdir is usable and locked (workdir.py: one run per workdir);
  config.json and metrics.jsonl only once every resume check passed. Whatever
  the loop raises, the checkpoint save in flight is finished or removed
  (``Checkpointer.__exit__``), so the previous complete checkpoint survives
  and no temporary folder is left, and the lock is released.
  """
  config_lib.validate(config)
  # Orbax wants absolute paths; a relative local --workdir (as in the README)
  # is taken relative to the current directory. URLs (gs://...) stay as given.
  workdir = workdir_lib.prepare(workdir, config)
  # A clean-up that fails after an error (a full disk) never hides that error.
  with cli.CleanupStack() as cleanup:
    cleanup.enter_context(workdir_lib.hold(workdir, is_main=jax.process_index() == 0))
    return _run(trainer, config, workdir, cleanup)


def _run(trainer: Trainer, config, workdir: epath.Path,
         cleanup: contextlib.ExitStack) -> dict:
  """``run`` in a validated, locked workdir; ``cleanup`` closes the writers
  and the checkpointer, also when an error ends the run."""
  # ------------------------------------------------------------------ writers
  is_main = jax.process_index() == 0
  # The preemption signal stops set-up as SIGTERM does (the CLI's handlers).
  preemption.route_signals(config)
  # config.json and metrics.jsonl are written by writer.start, after the
  # resume checks: a refused resume leaves the workdir as it was.
  writer = cleanup.enter_context(metrics_lib.MetricWriter(
      str(workdir), is_main_process=is_main, tensorboard=config.get("tensorboard", True)))

  started = time.perf_counter()
  enable_compilation_cache(config)
  built = setup(trainer, config, workdir=workdir, writer=writer)
  ctx, model, mesh, batch_sharding = built.ctx, built.model, built.mesh, built.batch_sharding
  train_source, eval_source = ctx.train_source, ctx.eval_source
  total_steps, steps_per_epoch = ctx.total_steps, built.steps_per_epoch
  state_shardings, eval_step = built.state_shardings, built.eval_step
  logging.info("start-up: setup (mesh, data sources, model, shardings): %.1f s",
               time.perf_counter() - started)
  # Room for the checkpoints, before anything compiles: a disk that cannot
  # hold one stops the run now, not at its first save.
  checkpoint_lib.check_free_space(workdir / "checkpoints",
                                  checkpoint_lib.state_bytes(built.abstract_state),
                                  config.keep_checkpoints)
  # Every program the run uses, compiled (or loaded) side by side before the
  # checkpoint is read or the data flows: a step that cannot fit the device
  # stops here, naming the fix; no evaluation compiles mid-run, and the
  # closing picture nothing after the last step. Which of the initialisation
  # and the picture it uses, the newest checkpoint's step tells (a hint: a
  # program it did not foresee is jitted when used).
  saved = newest_saved_step(workdir)

  def start_feed(start_step: int, data_state):
    """The thread that puts the host pipeline's batches (from ``start_step``
    / ``data_state``) on the devices, closed by ``cleanup``, and the
    pipeline's number of data streams, read before the thread starts
    iterating it."""
    host_batches = train_source.train_iterator(
        config.batch_size, start_step=start_step, process_index=jax.process_index(),
        process_count=jax.process_count(), num_workers=config.data.get("num_workers", -1),
        state=data_state)
    streams = (feed_lib.state_of(host_batches) or {}).get("streams", 1)
    feed = feed_lib.DeviceFeed(host_batches, batch_sharding)
    cleanup.callback(feed.close)
    return feed, streams

  # A fresh run's data starts from step 0 whatever the checkpoint: its
  # workers start and fill the feed while the programs compile or load
  # (a resume learns its data position from the checkpoint, read below).
  early = start_feed(0, None) if saved is None else None
  stop_after = config.get("stop_after_steps", 0)
  finalizes = stop_after <= 0 or (saved or 0) + stop_after >= total_steps
  # What compiled is saved for the next run beside the first steps (the
  # serialising and writing would otherwise delay the first step), and
  # waited for whenever the run ends.
  programs = compile_programs(
      built, config, trainer=trainer, eval_step=bool(config.eval_every_steps),
      init=saved is None, view=bool(config.eval_every_steps) or finalizes,
      extra=(trainer.finalize_programs(ctx, model, built.abstract_state["params"])
             if finalizes else None), defer_saves=True)
  cleanup.callback(programs.wait_saves)
  built.eval_view = programs.eval_view or built.eval_view
  train_step = programs.train_step
  eval_step = programs.eval_step or eval_step
  ctx.compiled.update(programs.extra)
  device = mesh.devices.flat[0]
  if aot.memory_stats(device):
    logging.info("device memory after compiling: %s", _memory_line(aot.memory_stats(device)))

  # Closed by ``cleanup``; on an error it first finishes (or removes) the save
  # in flight, so that the newest complete checkpoint survives the error.
  ckpt = cleanup.enter_context(checkpoint_lib.Checkpointer(
      str(workdir / "checkpoints"), max_to_keep=config.keep_checkpoints))
  try:
    # The newest checkpoint that restores: damaged ones are moved aside.
    resumed = ckpt.restore_newest(
        functools.partial(restore_target, built.abstract_state),
        lambda meta: config_lib.check_resume_compatible(meta, config))
  except checkpoint_lib.StateMismatchError as e:
    changed = config_lib.changed_keys(e.meta, config)
    raise ValueError(
        f"{e}; " + (f"config keys changed since: {config_lib.short_diff(changed)}; "
                    if changed else "") + "use that run's config or a new --workdir"
    ) from None
  resume_meta = {}
  if resumed is not None:
    start_step, state, resume_meta = resumed
    logging.info("resumed from %s at step %d", ckpt.directory, start_step)
    state = adopt_layout(state, built.abstract_state, start_step)
    state = adopt_ema(state, start_step, resume_meta, config, state_shardings)
  else:
    init_started = time.perf_counter()
    state = built.init_state(programs.init_state)
    params = trainer.load_pretrained(ctx, state["params"])
    state["params"] = jax.device_put(params, state_shardings["params"])
    jax.block_until_ready(state)
    logging.info("start-up: initialisation: %.1f s", time.perf_counter() - init_started)
    start_step = 0
    if ckpt.skipped_damaged and is_main and (workdir / "metrics.jsonl").exists():
      # Every checkpoint was damaged: the run starts over, and the records of
      # the earlier one go beside its checkpoints instead of being dropped.
      kept = checkpoint_lib.numbered(workdir / checkpoint_lib.DAMAGED_DIR / "metrics.jsonl")
      files.write_text_atomic(kept, (workdir / "metrics.jsonl").read_text())
      logging.warning("the earlier run's metrics.jsonl is kept as %s", kept)
  # Every resume check passed: from here on the run writes into the workdir.
  # Surplus checkpoints (a kill between a commit and Orbax's keep-N clean-up)
  # go now, records a killed run logged past this step leave metrics.jsonl
  # (this run logs them again), and config.json gets this run's config;
  # a rerun of a finished run leaves all three as they are (finalize then
  # only rewrites its pictures and reports).
  ckpt.prune(config.keep_checkpoints)
  writer.start(start_step, config.to_dict(), finished=start_step >= total_steps)
  # The log window the checkpoint cut in two: its first part, so that the
  # first log after a resume averages the same steps as without the kill.
  log_carry = resume_meta.get("log_window")

  def check_finite(state, where: str):
    bad = int(jax.device_get(state["bad_step"]))
    if bad >= 0 and not config.get("skip_nonfinite", False):
      raise NonFiniteError(
          f"non-finite loss or gradient norm at step {bad} (seen {where}); the state was "
          f"not updated by that step and no NaN was checkpointed. Lower optim.base_lr, "
          f"set optim.grad_clip_norm, or set skip_nonfinite=True to skip such steps")

  def save(state, step):
    check_finite(state, f"before the checkpoint at step {step}")
    # The data iterator's position after this step's batch: a resumed run
    # continues the same stream from it (every process runs the same
    # pipeline structure, so process 0's state, the one Orbax writes, is
    # every process's).
    meta = {**config_lib.checkpoint_meta(config, step), "data_state": data_state,
            "topology": topology,    # where it was written: a resume may use another
            # The unfinished log window (see log_carry).
            "log_window": metrics_lib.window_carry(jax.device_get(history), log_carry)}
    ckpt.save(step, state, meta)

  # ---------------------------------------------------------------- the loop
  resume_data_state = resume_meta.get("data_state")
  if early is not None and start_step == 0:
    feed, streams = early
  else:
    if early is not None:       # a checkpoint appeared since: its position counts
      early[0].close()
    feed, streams = start_feed(start_step, resume_data_state)
  data_state = resume_data_state
  topology = config_lib.topology(
      mesh.shape, jax.process_count(),
      data_pipeline.resolve_num_workers(config.data.get("num_workers", -1)))
  moved = config_lib.topology_change(resume_meta, topology, config.batch_size, streams)
  if moved:
    logging.info("%s", moved)
  clock = feed_lib.StepClock(feed)
  progress = metrics_lib.Progress(total_steps, config.batch_size, start_step=start_step)
  param_norm = jax.jit(optax.tree.norm)
  history, last = [], {}
  in_flight = collections.deque()
  logging.info("training %s from step %d to %d (%d steps/epoch)", type(trainer).__name__,
               start_step, total_steps, steps_per_epoch)
  # stop_after_steps > 0 ends this process early (with a checkpoint), e.g. to
  # fit a job into a preemptible time slice; rerunning continues the run.
  stop_at = total_steps
  if config.get("stop_after_steps", 0) > 0:
    stop_at = min(total_steps, start_step + config.stop_after_steps)
  profile = Profile(config, workdir, is_main)
  cleanup.callback(profile.stop)
  # A preemption notice (SIGTERM, config.preemption_signal) stops the loop at
  # a step every process reaches, with that step's checkpoint (preemption.py).
  preempt = preemption.Preemption(config, in_flight=IN_FLIGHT, unfinished=ckpt.tmp_dirs,
                                  is_main=is_main, start_step=start_step)
  cleanup.callback(preempt.close)
  preempt.open()
  step = start_step
  for step in range(start_step + 1, stop_at + 1):
    batch, data_state = next(feed)
    profile.before(step)
    state, metrics = train_step(state, batch, built.hyper(step - 1))
    profile.after(step, metrics)
    history.append(metrics)
    record = {}     # this step's one line in metrics.jsonl: log window and evaluation
    # At most IN_FLIGHT steps in flight: the host waits for the device here,
    # so time spent in next(feed) is the device waiting for input (feed.py).
    in_flight.append(metrics["loss"])
    if len(in_flight) > IN_FLIGHT:
      in_flight.popleft().block_until_ready()
    clock.tick()
    if step == start_step + 1:
      jax.block_until_ready(metrics["loss"])
      logging.info("start-up: first batch: waited %.1f s", feed.wait_s)
      if feed.first_batch_s is not None:
        logging.info("start-up: data: the first host batch came %.1f s after the pipeline "
                     "started", feed.first_batch_s)
      logging.info("start-up: first step done %.1f s after the run started",
                   time.perf_counter() - started)
      clock.skip()    # the first step's compilation is not a step's time
    if step % config.log_every_steps == 0 or step == total_steps:
      last = _mean_metrics(history, log_carry)
      history, log_carry = [], None
      last["param_norm"] = float(param_norm(state["params"]))   # after this step
      last.update(aot.memory_stats(device))
      timing = clock.window()
      shown = {k: last[k] for k in ("loss", "learning_rate", "grad_norm") if k in last}
      if "input_wait_fraction" in timing:
        shown["input_wait"] = f"{timing['input_wait_fraction']:.0%}"
        shown["goodput"] = f"{timing['goodput']:.0%}"
      last.update(timing)
      last.update(progress.update(step, shown))
      record.update(last)
      if (timing.get("input_wait_fraction", 0.0) > feed_lib.INPUT_BOUND_FRACTION
          and not clock.warned_input_bound):
        clock.warned_input_bound = True
        logging.warning(
            "input-bound: the step waited for data %.0f%% of the last window; raise "
            "data.num_workers (now %d) or give the job more host cores",
            100 * timing["input_wait_fraction"],
            data_pipeline.resolve_num_workers(config.data.get("num_workers", -1)))
    if config.eval_every_steps and (step % config.eval_every_steps == 0
                                    or step == total_steps):
      seen = built.eval_view(state)      # the EMA's parameters with eval_with_ema
      scores = evaluate(trainer, model, seen, eval_source, eval_step, batch_sharding,
                        config)
      scores.update(trainer.extra_eval(ctx, model, seen))
      del seen
      record.update({f"val_{k}": v for k, v in scores.items()})
      logging.info("step %d eval: %s", step, scores)
      last.update({f"val_{k}": v for k, v in scores.items()})
      clock.skip()
    if record:
      # Written before the finiteness check, so that the step a non-finite
      # error names is in metrics.jsonl, with its nonfinite count.
      writer.write_scalars(step, record)
      check_finite(state, f"at the log of step {step}")
    stop = preempt.stop_step(step)     # None until a preemption notice
    if step % config.checkpoint_every_steps == 0 or step in (total_steps, stop_at, stop):
      save(state, step)
      clock.skip()
    if step == stop:
      preempt.stop(step, ckpt.wait)     # waits for the commit, raises Terminated

  feed.close()
  ckpt.wait()
  preempt.after_loop(step)     # a notice after the last step: Terminated, no finalize
  preempt.close()
  if stop_at == total_steps:
    trainer.finalize(ctx, model, host_readable(built.eval_view(state), mesh))
  ckpt.close()
  writer.close()
  return last
