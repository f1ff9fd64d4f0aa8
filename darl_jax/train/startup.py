"""Start-up: every program a run uses, compiled (or loaded) before its first step.

The loop (train/loop.py) calls ``compile_programs`` once, after ``setup``
and ``resolve`` and before the checkpoint is read or the data flows: the
train step (its memory checked against the device's, train/fit.py), the
evaluation step, the state's initialisation, the EMA average that
evaluation sees and a trainer's closing programs (``finalize_programs``),
traced and lowered in turn and compiled side by side (train/aot.py), each
loaded instead where a run of the same program saved it
(train/executables.py). Nothing compiles mid-run or after the last step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from absl import logging
from etils import epath

from darl_jax import ops
from darl_jax.train import accumulate
from darl_jax.train import aot
from darl_jax.train import executables
from darl_jax.train import fit
from darl_jax.train import state as state_lib
from darl_jax.train.setup import Setup


@dataclasses.dataclass
class Compiled:
  """What ``compile_programs`` compiled (or loaded) at start-up."""
  train_step: Any                # the compiled train step
  info: dict                     # microbatch_size, footprint, capacity, the phases' seconds
  resolved: fit.Resolved         # the sizes the run uses (the microbatch the step runs)
  eval_step: Callable | None     # see _eval_step_of
  init_state: Any                # the compiled init_step, or None
  extra: dict                    # name -> compiled, of Trainer.finalize_programs
  eval_view: Callable | None = None   # state.eval_view with its EMA average compiled
  # The compiled programs being saved for the next run beside the first
  # steps (defer_saves; aot.DeferredSaves), or None.
  saves: aot.DeferredSaves | None = None

  def wait_saves(self) -> None:
    """Waits until the compiled programs are saved (the loop, at exit)."""
    if self.saves is not None:
      self.saves.wait()


def device_of(built: Setup, device=None):
  """The device whose memory the train step must fit: ``device``, or the mesh's first."""
  return device if device is not None else built.mesh.devices.flat[0]


def resolve(built: Setup, config, device=None) -> fit.Resolved:
  """``fit.resolve`` for the run ``built`` sets up, on ``device``'s memory
  (default: the mesh's first device; ``config.device_memory_gib`` overrides
  it) and memory.py's estimate of its parameters."""
  capacity = fit.device_capacity(device_of(built, device), config.get("device_memory_gib", 0.0))
  return fit.resolve(config, batch_shards=built.batch_shards, capacity=capacity,
                     estimate_for=fit.estimator(config, dict(built.mesh.shape),
                                                built.abstract_state["params"]))


def compile_programs(built: Setup, config, *, trainer=None, device=None, reuse: bool = True,
                     eval_step: bool = False, init: bool = False, view: bool = False,
                     extra: dict | None = None, defer_saves: bool = False,
                     resolved: fit.Resolved | None = None) -> Compiled:
  """Every program a run uses, compiled at start-up before the checkpoint is
  read or the data flows (aot.compile_all: traced and lowered in turn,
  compiled side by side): the train step for the state and batch it runs
  on, with ``eval_step`` the evaluation step, with ``init`` the state's
  initialisation, with ``view`` the EMA average evaluation and finalize
  see (state.eval_view, where there is one), and ``extra`` (``{name:
  (jitted, abstract args)}``, a trainer's finalize_programs).

  ``resolved``: the run's sizes (default: :func:`resolve` on ``device``).
  The train step is compiled at its microbatch and its memory checked
  against ``device``'s (default: the mesh's first) before any step runs: a
  step that cannot fit raises fit.DoesNotFit naming the fix. Under
  ``microbatch_size=-1`` the compiled figure may step the microbatch down
  once (fit.choose_microbatch): ``Compiled.resolved`` holds the one the
  step runs. ``reuse``: load what a run of the same program saved
  (train/executables.py; ``trainer`` is part of the key), else compile and
  save it: with ``defer_saves`` beside the first steps (``Compiled.saves``,
  aot.DeferredSaves)."""
  device = device_of(built, device)
  resolved = resolved or resolve(built, config, device)
  capacity = fit.device_capacity(device, config.get("device_memory_gib", 0.0))
  batch_size = config.batch_size
  sizes = accumulate.candidates(batch_size, built.batch_shards)
  automatic = fit.automatic(config)
  first = resolved.microbatch

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
    eval_args = (state["params"], state["model_state"],
                 abstract_eval_batch(built, config, resolved))
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
    programs.append(aot.Program("ema average", state_lib.ema_average_step(built.state_shardings),
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

    if automatic:
      microbatch, train.compiled = fit.choose_microbatch(compile_for, sizes, capacity, first)
      train.info["microbatch_size"] = microbatch
    elif train.compiled is None:        # the TPU compiler checks memory itself
      e = train.refused
      raise fit.DoesNotFit(fit.fix_line(e.footprint, e.capacity, batch_size=batch_size,
                                        microbatch=first, sizes=sizes),
                           footprint=e.footprint, microbatch=first)
    fit.check_fits(fit.footprint(train.compiled), capacity, batch_size=batch_size,
                   microbatch=train.info["microbatch_size"], sizes=sizes)

  saves = aot.compile_all(programs, after=choose, defer_saves=defer_saves)
  microbatch = train.info["microbatch_size"]
  # The microbatch the compiled step runs: the resolved one, or the one the
  # compiled figure stepped down to (or a loaded step's, saved with it).
  resolved = dataclasses.replace(resolved, microbatch=microbatch)
  fp = fit.footprint(train.compiled)
  fit.check_fits(fp, capacity, batch_size=batch_size, microbatch=microbatch, sizes=sizes)
  if evaluation is not None:
    fit.check_eval_fits(fit.footprint(evaluation.compiled), fp, capacity,
                        eval_batch_size=resolved.eval_batch, batch_shards=built.batch_shards)
  estimate = fit.estimator(config, dict(built.mesh.shape),
                           built.abstract_state["params"])(microbatch)
  logging.info(
      "train step: %s per device%s%s; %d microbatch(es) of %d",
      fp.describe() if fp else "no memory analysis on this backend",
      f" of {capacity / fit.GIB:.2f} GiB" if capacity else "",
      f"; memory.py's estimate {estimate / fit.GIB:.2f} GiB" if estimate else "",
      resolved.num_microbatches(batch_size), resolved.microbatch)
  if eval_step and resolved.eval_batch != batch_size:
    logging.info("evaluating %d examples per batch%s", resolved.eval_batch,
                 "" if config.get("eval_batch_size", 0) else
                 " (eval_batch_size=0 under gradient accumulation: the microbatch)")
  times = {f"{k}_s": v for k, v in train.times.items()}
  if "load_s" in times:
    times["loaded_s"] = times["load_s"]
  info = {**times, "microbatch_size": microbatch, "footprint": fp, "capacity": capacity,
          "resolved": resolved, "programs": {p.name: dict(p.times) for p in programs}}
  by_name = {p.name: p for p in programs}
  return Compiled(
      train_step=train.compiled, info=info, resolved=resolved,
      eval_step=(_eval_step_of(built, config, by_name["eval step"].compiled, resolved)
                 if eval_step else None),
      init_state=by_name["init step"].compiled if init else None,
      extra={name: by_name[name].compiled for name in (extra or {})},
      eval_view=(state_lib.eval_view(config, built.state_shardings,
                                     by_name["ema average"].compiled)
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
                       trainer=None, resolved: fit.Resolved | None = None) -> tuple[Any, dict]:
  """The train step alone, compiled ahead of time as ``compile_programs``
  compiles it (memory checked, ``microbatch_size=-1`` resolved). Returns
  ``(compiled, info)``: info holds the microbatch, the footprint, the
  device's capacity, the phases' seconds and ``resolved``."""
  compiled = compile_programs(built, config, trainer=trainer, device=device, reuse=reuse,
                              resolved=resolved)
  return compiled.train_step, compiled.info


def abstract_eval_batch(built: Setup, config, resolved: fit.Resolved | None = None) -> dict:
  """The evaluation batch as ``evaluate`` feeds the eval step: the training
  batch's entries at the resolved evaluation batch's rows (``resolved``,
  default ``fit.resolve``'s without a device) and the ``mask`` of real rows
  and each row's ``index`` in the split, as ShapeDtypeStructs laid out like
  the batch."""
  size = (resolved or fit.resolve(config, batch_shards=built.batch_shards)).eval_batch
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


def _eval_step_of(built: Setup, config, compiled, resolved: fit.Resolved) -> Callable:
  """The compiled eval step for the batches it was compiled for
  (``abstract_eval_batch``); any other batch (a source with other entries)
  goes to the jitted step, once with a warning."""
  expected = _signature(abstract_eval_batch(built, config, resolved))
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
