"""The step programs: the train step and the eval step, and the evaluation that runs them.

Steps are numbered one way everywhere: step n is the update that makes the
step counter n, and metrics.jsonl's record ``step: n`` covers it. A
non-finite step leaves the state untouched, so no NaN can reach a
checkpoint; its index is kept in ``bad_step`` for the loop to report.

Randomness is ``fold_in(PRNGKey(seed), step)`` for the train step and each
example's own key for the eval step (``example_keys``), so evaluations are
comparable between steps, runs and evaluation batches.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

from darl_jax import ema as ema_lib
from darl_jax import fp8
from darl_jax import optim
from darl_jax import sharding as sharding_lib
from darl_jax.data import base as data_base
from darl_jax.train import accumulate
from darl_jax.train import feed as feed_lib
from darl_jax.train import fit
from darl_jax.train.trainer import Trainer


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


def evaluate(trainer, model, state, eval_source, eval_fn, sharding, config,
             resolved: fit.Resolved | None = None) -> dict:
  """Averages the trainer's per-example metrics over one pass of the eval split.

  The result does not depend on the evaluation batch: each row of a batch
  carries ``index``, its example's index in the split (make_eval_step draws
  the example's randomness from it), padding rows are masked out, and the
  cap (eval_cap) counts examples, whose rows past it are masked as well.
  ``resolved``: the run's sizes (its evaluation batch and data workers;
  default: ``fit.resolve(config)``).
  """
  del trainer, model
  resolved = resolved or fit.resolve(config)
  sums, count = {}, 0.0
  process, processes = jax.process_index(), jax.process_count()
  cap = eval_cap(config, processes)
  offset = eval_offset(eval_source, process, processes)
  batches = eval_source.eval_batches(resolved.eval_batch, process, processes,
                                     num_workers=resolved.num_workers)
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
    batch = feed_lib.to_global(batch, sharding)
    out = eval_fn(state["params"], state["model_state"], batch)
    for k, v in out.items():
      sums[k] = sums.get(k, 0.0) + v
    count += jnp.sum(batch["mask"])
    # At most one batch ahead of the devices, as the train loop's IN_FLIGHT:
    # a host that queues batch after batch while one device lags fills that
    # device's queue, and XLA:CPU's client then deadlocks in a collective
    # and aborts (train/jobs/knn.py, "Dispatch", has the mechanism).
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
  f32[], "weight_decay": f32[]}`` and layer decay's multipliers where set
  (``hyperparams.values(state["step"])``, made on the host), which ``tx``
  (optim.make_train_optimizer, ``hyperparams`` its values) reads: they are
  inputs of the program, not constants, so a change of schedule, peak lr,
  nonzero weight decay or layer decay compiles nothing new.

  A step whose loss or gradient norm is non-finite leaves the state as it was
  (EMA included) and records its index in ``bad_step``; one on empty fp8
  histories (fp8.warming) updates only them. Shared by the loop
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

    # fp8's histories (darl_jax/fp8.py), where the model keeps them: the
    # loss is differentiated with respect to them too, and their
    # "gradients" are the step's records of largest magnitudes.
    histories = state["model_state"].get(fp8.COLLECTION)

    def loss_of(params, histories, batch, key):
      model_state = state["model_state"]
      if histories is not None:
        model_state = {**model_state, fp8.COLLECTION: histories}
      return trainer.loss_fn(model, params, model_state, batch, key, True)

    grad_fn = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)
    if num_microbatches == 1:
      (loss, (metrics, model_state)), (grads, records) = grad_fn(
          state["params"], histories, batch, rng)
      metrics, _ = accumulate.pop_weights(metrics)
    else:
      keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(num_microbatches))
      microbatches = accumulate.split(batch, num_microbatches, batch_shards, spec)
      loss, metrics, model_state, grads, records = accumulate.accumulate(
          grad_fn, state["params"], microbatches, keys, histories)
    grad_norm = optax.tree.norm(grads)
    with hyperparams.bind(hyper):
      updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # A step on empty fp8 histories only fills them (fp8.warming).
    update = finite & ~fp8.warming(histories, records)
    keep = lambda ok, new, old: jax.tree_util.tree_map(
        lambda n, o: jnp.where(ok, n, o), new, old)
    new_state = {
        "step": state["step"] + 1,
        "params": keep(update, params, state["params"]),
        "opt_state": keep(update, opt_state, state["opt_state"]),
        "model_state": keep(update, model_state, state["model_state"]),
        # Numbered as logged: the update that makes the step counter n is step n.
        "bad_step": jnp.where(~finite & (state["bad_step"] < 0), state["step"] + 1,
                              state["bad_step"]),
    }
    if histories is not None:
      new_state["model_state"] = {
          **new_state["model_state"],
          fp8.COLLECTION: keep(finite, fp8.updated_histories(histories, records), histories)}
    if ema_decay > 0:
      new_state["ema"] = keep(update, ema_lib.update(state["ema"], params, ema_decay),
                              state["ema"])
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
