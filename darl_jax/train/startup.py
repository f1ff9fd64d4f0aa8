"""Start-up: every program a run uses, compiled (or loaded) before its first step.

The loop (train/loop.py) calls ``compile_programs`` once, after ``setup``
and before the checkpoint is read or the data flows: the train step (its
memory checked against the device's, ``microbatch_size=-1`` resolved), the
evaluation step, the state's initialisation, the EMA average that
evaluation sees and a trainer's closing programs (``finalize_programs``),
traced and lowered in turn and compiled side by side (train/aot.py),
each loaded instead where a run of the same program saved it
(train/executables.py). Nothing compiles mid-run or after the last step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from absl import logging
from etils import epath

from darl_jax import ema as ema_lib
from darl_jax import ops
from darl_jax.train import accumulate
from darl_jax.train import aot
from darl_jax.train import executables

# ``built`` below is the loop's ``Setup`` (train/loop.py), which imports this
# module: it is taken by its attributes, not imported.
Setup = Any


@dataclasses.dataclass
class Programs:
  """What ``compile_programs`` compiled (or loaded) at start-up."""
  train_step: Any                # the compiled train step
  info: dict                     # microbatch_size, footprint, capacity, the phases' seconds
  eval_step: Callable | None     # see compile_eval_step
  init_state: Any                # the compiled init_step, or None
  extra: dict                    # name -> compiled, of Trainer.finalize_programs
  eval_view: Callable | None = None   # eval_view with its EMA average compiled
  # The compiled programs being saved for the next run beside the first
  # steps (defer_saves; aot.DeferredSaves), or None.
  saves: aot.DeferredSaves | None = None

  def wait_saves(self) -> None:
    """Waits until the compiled programs are saved (the loop, at exit)."""
    if self.saves is not None:
      self.saves.wait()


def compile_programs(built: Setup, config, *, trainer=None, device=None, reuse: bool = True,
                     eval_step: bool = False, init: bool = False, view: bool = False,
                     extra: dict | None = None, defer_saves: bool = False) -> Programs:
  """Every program a run uses, compiled at start-up before the checkpoint is
  read or the data flows (train/aot.py's compile_programs: traced and
  lowered in turn, compiled side by side): the train step for the state
  and batch it runs on, with ``eval_step`` the evaluation step, with
  ``init`` the state's initialisation, with ``view`` the EMA average
  evaluation and finalize see (eval_view, where there is one), and
  ``extra`` (``{name: (jitted, abstract args)}``, a trainer's
  finalize_programs).

  The train step's memory is checked against ``device``'s (default: the
  mesh's first) before any step runs: a step that cannot fit raises
  aot.DoesNotFit naming the fix. ``microbatch_size=-1`` is resolved here:
  the largest microbatch whose memory.py estimate fits, chosen before
  anything compiles, stepped down at most once on the compiled figure
  (aot.first_microbatch, aot.choose_microbatch). ``reuse``: load what a
  run of the same program saved (train/executables.py; ``trainer`` is part
  of the key), else compile and save it: with ``defer_saves`` beside the
  first steps (``Programs.saves``, aot.DeferredSaves)."""
  device = device if device is not None else built.mesh.devices.flat[0]
  capacity = aot.device_capacity(device, config.get("device_memory_gib", 0.0))
  batch_size = config.batch_size
  sizes = accumulate.candidates(batch_size, built.batch_shards)
  requested = config.get("microbatch_size", 0)
  mesh_shape = dict(built.mesh.shape)

  @functools.cache
  def estimate_for(microbatch: int):
    return aot.estimate_bytes(config, mesh_shape, microbatch,
                              num_microbatches=batch_size // microbatch,
                              params=built.abstract_state["params"])

  if requested == -1:     # before anything compiles; may refuse the batch
    first = aot.first_microbatch(estimate_for, sizes, capacity,
                                 batch_shards=built.batch_shards,
                                 remat=config.get("model", {}).get("remat", "none"))
  else:
    first = requested or batch_size
  if eval_step and not config.eval_batch_size and first < batch_size:
    # Under gradient accumulation the whole batch never runs at once, and
    # one evaluation program over it can need more than the device has (the
    # H/14 row of benchmarks/RESULTS.md). The microbatch, whose
    # forward and backward fit, evaluates forward only. Resolved in the
    # config: evaluation and its compiled program read it from there.
    config.eval_batch_size = first
    logging.info("eval_batch_size=0 under gradient accumulation: evaluating %d examples "
                 "per batch (the microbatch)", first)

  directory = executables.cache_dir(config, device.platform) if reuse else None
  kernels = ops.current() if "model" in config else ""
  # A program's file is named before it is traced: its arguments' shapes,
  # dtypes and layouts join the name, so that settings the config key leaves
  # out (an evaluation batch, a picture's image count) name files of their own.
  path_for = lambda name, args, extra_key=None: executables.path_for(
      directory, config, built.mesh, name, kernels=kernels, trainer=trainer,
      extra={"args": _layout(args), "extra": extra_key})
  state, args = built.abstract_state, (built.abstract_state, built.abstract_batch,
                                       built.abstract_hyper)
  train = aot.Program("train step", built.make_step(batch_size // first), args,
                      path_for("train step", args, {"capacity": capacity, "microbatch": first}),
                      info={"microbatch_size": first})
  programs = [train]
  evaluation = None
  if eval_step:
    eval_args = (state["params"], state["model_state"], abstract_eval_batch(built, config))
    evaluation = aot.Program("eval step", built.eval_step, eval_args,
                             path_for("eval step", eval_args))
    programs.append(evaluation)
  if init:
    init_args = (built.abstract_init_rng(),)
    programs.append(aot.Program("init step", built.init_step, init_args,
                                path_for("init step", init_args)))
  for name, (jitted, abstract_args) in (extra or {}).items():
    programs.append(aot.Program(name, jitted, tuple(abstract_args),
                                path_for(name, tuple(abstract_args))))
  # What evaluation and finalize see with an EMA: its average, compiled too.
  averages = view and "ema" in state and config.get("eval_with_ema", True)
  if averages:
    ema_args = (state["ema"], state["params"])
    programs.append(aot.Program("ema average", ema_average_step(built.state_shardings),
                                ema_args, path_for("ema average", ema_args)))

  def choose(program):
    if program is not train or "load" in train.times:
      return

    def compile_for(microbatch: int):
      if microbatch == first:
        if train.compiled is None:
          raise train.refused
        return train.compiled
      compiled, times = aot.compile_step(built.make_step(batch_size // microbatch), *args)
      for phase in ("trace", "lower", "compile"):
        train.times[phase] += times[f"{phase}_s"]
      return compiled

    if requested == -1:
      microbatch, train.compiled = aot.choose_microbatch(compile_for, sizes, capacity, first)
      train.info["microbatch_size"] = microbatch
    elif train.compiled is None:        # the TPU compiler checks memory itself
      e = train.refused
      raise aot.DoesNotFit(aot.fix_line(e.footprint, e.capacity, batch_size=batch_size,
                                        microbatch=first, sizes=sizes),
                           footprint=e.footprint, microbatch=first)
    aot.check_fits(aot.footprint(train.compiled), capacity, batch_size=batch_size,
                   microbatch=train.info["microbatch_size"], sizes=sizes)

  saves = aot.compile_programs(programs, after=choose, defer_saves=defer_saves)
  microbatch = train.info["microbatch_size"]
  fp = aot.footprint(train.compiled)
  aot.check_fits(fp, capacity, batch_size=batch_size, microbatch=microbatch, sizes=sizes)
  if evaluation is not None:
    aot.check_eval_fits(aot.footprint(evaluation.compiled), fp, capacity,
                        eval_batch_size=config.eval_batch_size or batch_size,
                        batch_shards=built.batch_shards)
  estimate = estimate_for(microbatch)
  logging.info(
      "train step: %s per device%s%s; %d microbatch(es) of %d",
      fp.describe() if fp else "no memory analysis on this backend",
      f" of {capacity / aot.GIB:.2f} GiB" if capacity else "",
      f"; memory.py's estimate {estimate / aot.GIB:.2f} GiB" if estimate else "",
      batch_size // microbatch, microbatch)
  times = {f"{k}_s": v for k, v in train.times.items()}
  if "load_s" in times:
    times["loaded_s"] = times["load_s"]
  info = {**times, "microbatch_size": microbatch, "footprint": fp, "capacity": capacity,
          "programs": {p.name: dict(p.times) for p in programs}}
  by_name = {p.name: p for p in programs}
  return Programs(
      train_step=train.compiled, info=info,
      eval_step=(_eval_step_of(built, config, by_name["eval step"].compiled)
                 if eval_step else None),
      init_state=by_name["init step"].compiled if init else None,
      extra={name: by_name[name].compiled for name in (extra or {})},
      eval_view=(eval_view(config, built.state_shardings, by_name["ema average"].compiled)
                 if averages else None),
      saves=saves)


def newest_saved_step(workdir) -> int | None:
  """The newest step saved under ``<workdir>/checkpoints`` by its folder's
  name (Orbax's committed step folders; unfinished ones carry a suffix),
  None if none: whether a run will resume, before the checkpoint is read."""
  directory = epath.Path(workdir) / "checkpoints"
  if not directory.exists():
    return None
  steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()]
  return max(steps) if steps else None


def compile_train_step(built: Setup, config, device=None, *, reuse: bool = True,
                       trainer=None) -> tuple[Any, dict]:
  """The train step alone, compiled ahead of time as ``compile_programs``
  compiles it (memory checked, ``microbatch_size=-1`` resolved). Returns
  ``(compiled, info)``: info holds the microbatch, the footprint, the
  device's capacity and the phases' seconds."""
  programs = compile_programs(built, config, trainer=trainer, device=device, reuse=reuse)
  return programs.train_step, programs.info


def abstract_eval_batch(built: Setup, config) -> dict:
  """The evaluation batch as ``evaluate`` feeds the eval step: the training
  batch's entries at ``eval_batch_size`` (default ``batch_size``) rows and
  the ``mask`` of real rows and each row's ``index`` in the split, as
  ShapeDtypeStructs laid out like the batch."""
  size = config.eval_batch_size or config.batch_size
  batch = aot.abstract_batch(built.ctx.eval_source.image_shape, size, built.batch_sharding)
  batch["mask"] = jax.ShapeDtypeStruct((size,), jnp.bool_, sharding=built.batch_sharding)
  batch["index"] = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=built.batch_sharding)
  return batch


def _layout(args) -> str:
  """The arguments' tree, shapes, dtypes and shardings as text (part of a
  saved program's name)."""
  leaves, tree = jax.tree_util.tree_flatten(args)
  return str(tree) + "".join(
      f"|{getattr(x, 'shape', ())} {getattr(x, 'dtype', type(x).__name__)} "
      f"{getattr(x, 'sharding', None)}" for x in leaves)


def _signature(tree) -> tuple:
  return (jax.tree_util.tree_structure(tree),
          tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in jax.tree_util.tree_leaves(tree)))


def _eval_step_of(built: Setup, config, compiled) -> Callable:
  """The compiled eval step for the batches it was compiled for
  (``abstract_eval_batch``); any other batch (a source with other entries)
  goes to the jitted step, once with a warning."""
  expected = _signature(abstract_eval_batch(built, config))
  warned = []

  def eval_step(params, model_state, batch):
    if _signature(batch) == expected:
      return compiled(params, model_state, batch)
    if not warned:
      warned.append(True)
      logging.warning("the evaluation batch %s is not the one the eval step was compiled "
                      "for (%s): it is compiled now", _signature(batch)[1], expected[1])
    return built.eval_step(params, model_state, batch)

  return eval_step


def compile_eval_step(built: Setup, config) -> tuple[Callable, dict]:
  """``built.eval_step`` compiled ahead of time for the parameters, model
  state and evaluation batch it runs on (``abstract_eval_batch``), so that
  the first evaluation compiles nothing (the loop compiles it in
  ``compile_programs``, beside the train step). Returns ``(step,
  seconds)``: ``step`` as ``_eval_step_of``'s; ``seconds`` as
  aot.compile_step's."""
  params, model_state = built.abstract_state["params"], built.abstract_state["model_state"]
  compiled, times = aot.compile_step(built.eval_step, params, model_state,
                                     abstract_eval_batch(built, config))
  return _eval_step_of(built, config, compiled), times


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
