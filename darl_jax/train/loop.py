"""The one shared train loop: the run's start-up, then its steps.

    run -> workdir checked and locked (workdir.py)
        -> start_up: writers -> setup (setup.py) -> sizes resolved (fit.py)
           -> every program compiled or loaded (startup.py) -> resume or
           initialise (state.py) -> config.json and metrics.jsonl -> the feed
        -> train_steps: step, log, evaluate, checkpoint; a preemption
           notice stops at a step every process reaches
        -> the trainer's finalize

Trainers own only their model, loss and predictions (train/trainer.py).
Steps are numbered one way everywhere: step n is the update that makes the
step counter n (train/step.py), and metrics.jsonl's record ``step: n``
covers it. A non-finite step leaves the state untouched, so no NaN can
reach a checkpoint; the loop then stops with the step and the metric named
(or, with ``skip_nonfinite``, counts the skipped steps and goes on).

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
import time
from typing import Any

import jax
import optax
from absl import logging
from etils import epath

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import cli
from darl_jax import config_lib
from darl_jax import files
from darl_jax import fp8
from darl_jax import metrics as metrics_lib
from darl_jax import preemption
from darl_jax import workdir as workdir_lib
from darl_jax.train import feed as feed_lib
from darl_jax.train import fit
from darl_jax.train import startup
from darl_jax.train import state as state_lib
from darl_jax.train import step as step_lib
from darl_jax.train.setup import Setup
from darl_jax.train.setup import enable_compilation_cache
from darl_jax.train.setup import setup
from darl_jax.train.trainer import NonFiniteError
from darl_jax.train.trainer import Trainer


# Steps the loop dispatches ahead of the device: the host waits for step
# n - IN_FLIGHT before it dispatches step n + 1 (preemption.py's agreement
# reasons from this bound).
IN_FLIGHT = 2


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
    started = start_up(trainer, config, workdir, cleanup)
    return train_steps(trainer, config, workdir, cleanup, started)


@dataclasses.dataclass
class Started:
  """What start-up hands the steps: the run as set up, its compiled
  programs and sizes, its checkpointer and writer, and the state and feed
  it starts from."""
  built: Setup
  compiled: startup.Compiled
  resolved: fit.Resolved
  writer: metrics_lib.MetricWriter
  ckpt: checkpoint_lib.Checkpointer
  state: dict
  start_step: int
  resume_meta: dict
  feed: Any                      # feed_lib.DeviceFeed from start_step
  streams: int                   # the pipeline's number of data streams
  started: float                 # time.perf_counter() when the run started


def start_up(trainer: Trainer, config, workdir: epath.Path,
             cleanup: contextlib.ExitStack) -> Started:
  """Everything before the first step, in a validated, locked workdir;
  ``cleanup`` closes the writers, the feed and the checkpointer, also when
  an error ends the run."""
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
  ctx, model = built.ctx, built.model
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
  saved = startup.newest_saved_step(workdir)
  # The microbatch, evaluation batch and data workers, decided once here
  # (a batch that fits at no microbatch stops the run now).
  resolved = ctx.resolved = startup.resolve(built, config)
  # A fresh run's data starts from step 0 whatever the checkpoint: its
  # workers start and fill the feed while the programs compile or load
  # (a resume learns its data position from the checkpoint, read below).
  early = _start_feed(built, config, resolved, cleanup, 0, None) if saved is None else None
  stop_after = config.get("stop_after_steps", 0)
  finalizes = stop_after <= 0 or (saved or 0) + stop_after >= ctx.total_steps
  # What compiled is saved for the next run beside the first steps (the
  # serialising and writing would otherwise delay the first step), and
  # waited for whenever the run ends.
  compiled = startup.compile_programs(
      built, config, trainer=trainer, eval_step=bool(config.eval_every_steps),
      init=saved is None, view=bool(config.eval_every_steps) or finalizes,
      extra=(trainer.finalize_programs(ctx, model, built.abstract_state["params"])
             if finalizes else None), defer_saves=True, resolved=resolved)
  cleanup.callback(compiled.wait_saves)
  resolved = ctx.resolved = compiled.resolved
  built.eval_view = compiled.eval_view or built.eval_view
  ctx.compiled.update(compiled.extra)
  device = built.mesh.devices.flat[0]
  if fit.memory_stats(device):
    logging.info("device memory after compiling: %s", _memory_line(fit.memory_stats(device)))

  # Closed by ``cleanup``; on an error it first finishes (or removes) the save
  # in flight, so that the newest complete checkpoint survives the error.
  ckpt = cleanup.enter_context(checkpoint_lib.Checkpointer(
      str(workdir / "checkpoints"), max_to_keep=config.keep_checkpoints))
  start_step, state, resume_meta = _resume_or_initialise(trainer, config, workdir, built,
                                                          compiled, ckpt)
  # Every resume check passed: from here on the run writes into the workdir.
  # Surplus checkpoints (a kill between a commit and Orbax's keep-N clean-up)
  # go now, records a killed run logged past this step leave metrics.jsonl
  # (this run logs them again), and config.json gets this run's config;
  # a rerun of a finished run leaves all three as they are (finalize then
  # only rewrites its pictures and reports).
  ckpt.prune(config.keep_checkpoints)
  writer.start(start_step, config.to_dict(), finished=start_step >= ctx.total_steps)
  if early is not None and start_step == 0:
    feed, streams = early
  else:
    if early is not None:       # a checkpoint appeared since: its position counts
      early[0].close()
    feed, streams = _start_feed(built, config, resolved, cleanup, start_step,
                                resume_meta.get("data_state"))
  return Started(built=built, compiled=compiled, resolved=resolved, writer=writer,
                 ckpt=ckpt, state=state, start_step=start_step, resume_meta=resume_meta,
                 feed=feed, streams=streams, started=started)


def _start_feed(built: Setup, config, resolved: fit.Resolved, cleanup: contextlib.ExitStack,
                start_step: int, data_state):
  """The thread that puts the host pipeline's batches (from ``start_step``
  / ``data_state``) on the devices, closed by ``cleanup``, and the
  pipeline's number of data streams, read before the thread starts
  iterating it."""
  host_batches = built.ctx.train_source.train_iterator(
      config.batch_size, start_step=start_step, process_index=jax.process_index(),
      process_count=jax.process_count(), num_workers=resolved.num_workers,
      state=data_state)
  streams = (feed_lib.state_of(host_batches) or {}).get("streams", 1)
  feed = feed_lib.DeviceFeed(host_batches, built.batch_sharding)
  cleanup.callback(feed.close)
  return feed, streams


def _resume_or_initialise(trainer: Trainer, config, workdir: epath.Path, built: Setup,
                          compiled: startup.Compiled, ckpt) -> tuple[int, dict, dict]:
  """``(start_step, state, checkpoint meta)``: the newest checkpoint that
  restores (damaged ones are moved aside), in this run's layout and with
  its EMA, or a fresh state with the trainer's pretrained parts."""
  try:
    resumed = ckpt.restore_newest(
        functools.partial(state_lib.restore_target, built.abstract_state),
        lambda meta: config_lib.check_resume_compatible(meta, config))
  except checkpoint_lib.StateMismatchError as e:
    changed = config_lib.changed_keys(e.meta, config)
    raise ValueError(
        f"{e}; " + (f"config keys changed since: {config_lib.short_diff(changed)}; "
                    if changed else "") + "use that run's config or a new --workdir"
    ) from None
  if resumed is not None:
    start_step, state, resume_meta = resumed
    logging.info("resumed from %s at step %d", ckpt.directory, start_step)
    state = state_lib.adopt_precision(state, built.abstract_state, start_step)
    state = state_lib.adopt_layout(state, built.abstract_state, start_step)
    state = state_lib.adopt_ema(state, start_step, resume_meta, config, built.state_shardings)
    return start_step, state, resume_meta
  init_started = time.perf_counter()
  state = built.init_state(compiled.init_state)
  params = trainer.load_pretrained(built.ctx, state["params"])
  state["params"] = jax.device_put(params, built.state_shardings["params"])
  jax.block_until_ready(state)
  logging.info("start-up: initialisation: %.1f s", time.perf_counter() - init_started)
  if fp8.COLLECTION in state["model_state"]:
    logging.info("precision=fp8: the first step fills the fp8 scales' histories and leaves "
                 "the parameters as they are (darl_jax/fp8.py)")
  if (ckpt.skipped_damaged and jax.process_index() == 0
      and (workdir / "metrics.jsonl").exists()):
    # Every checkpoint was damaged: the run starts over, and the records of
    # the earlier one go beside its checkpoints instead of being dropped.
    kept = checkpoint_lib.numbered(workdir / checkpoint_lib.DAMAGED_DIR / "metrics.jsonl")
    files.write_text_atomic(kept, (workdir / "metrics.jsonl").read_text())
    logging.warning("the earlier run's metrics.jsonl is kept as %s", kept)
  return 0, state, {}


def train_steps(trainer: Trainer, config, workdir: epath.Path, cleanup: contextlib.ExitStack,
                s: Started) -> dict:
  """The steps from ``s.start_step``: each logged, evaluated and checkpointed
  on its schedule, then the trainer's ``finalize``; returns the last metrics."""
  built, ckpt, writer, feed = s.built, s.ckpt, s.writer, s.feed
  ctx, model, state, start_step = built.ctx, built.model, s.state, s.start_step
  total_steps, is_main = ctx.total_steps, jax.process_index() == 0
  train_step = s.compiled.train_step
  eval_step = s.compiled.eval_step or built.eval_step
  # The log window the checkpoint cut in two: its first part, so that the
  # first log after a resume averages the same steps as without the kill.
  log_carry = s.resume_meta.get("log_window")
  data_state = s.resume_meta.get("data_state")
  topology = config_lib.topology(built.mesh.shape, jax.process_count(), s.resolved.num_workers)
  moved = config_lib.topology_change(s.resume_meta, topology, config.batch_size, s.streams)
  if moved:
    logging.info("%s", moved)
  clock = feed_lib.StepClock(feed)
  progress = metrics_lib.Progress(total_steps, config.batch_size, start_step=start_step)
  param_norm = jax.jit(optax.tree.norm)
  device = built.mesh.devices.flat[0]
  history, last = [], {}
  in_flight = collections.deque()
  logging.info("training %s from step %d to %d (%d steps/epoch)", type(trainer).__name__,
               start_step, total_steps, built.steps_per_epoch)
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

  def save(state, step):
    check_finite(config, state, f"before the checkpoint at step {step}")
    # The data iterator's position after this step's batch: a resumed run
    # continues the same stream from it (every process runs the same
    # pipeline structure, so process 0's state, the one Orbax writes, is
    # every process's).
    meta = {**config_lib.checkpoint_meta(config, step), "data_state": data_state,
            "topology": topology,    # where it was written: a resume may use another
            # The unfinished log window (see log_carry).
            "log_window": metrics_lib.window_carry(jax.device_get(history), log_carry)}
    ckpt.save(step, state, meta)

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
      _first_step_done(metrics, feed, s.started)
      clock.skip()    # the first step's compilation is not a step's time
    if step % config.log_every_steps == 0 or step == total_steps:
      last = _mean_metrics(history, log_carry)
      history, log_carry = [], None
      last["param_norm"] = float(param_norm(state["params"]))   # after this step
      last.update(fit.memory_stats(device))
      _log_window(last, clock, progress, step, s.resolved)
      record.update(last)
    if config.eval_every_steps and (step % config.eval_every_steps == 0
                                    or step == total_steps):
      seen = built.eval_view(state)      # the EMA's parameters with eval_with_ema
      scores = step_lib.evaluate(trainer, model, seen, ctx.eval_source, eval_step,
                                 built.batch_sharding, config, s.resolved)
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
      check_finite(config, state, f"at the log of step {step}")
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
    trainer.finalize(ctx, model, step_lib.host_readable(built.eval_view(state), built.mesh))
  ckpt.close()
  writer.close()
  return last


def check_finite(config, state, where: str) -> None:
  """Raises NonFiniteError where a step's loss or gradient was non-finite
  (``state["bad_step"]``), unless ``skip_nonfinite``."""
  bad = int(jax.device_get(state["bad_step"]))
  if bad >= 0 and not config.get("skip_nonfinite", False):
    raise NonFiniteError(
        f"non-finite loss or gradient norm at step {bad} (seen {where}); the state was "
        f"not updated by that step and no NaN was checkpointed. Lower optim.base_lr, "
        f"set optim.grad_clip_norm, or set skip_nonfinite=True to skip such steps")


def _first_step_done(metrics, feed, started: float) -> None:
  """The start-up's last lines, once the first step is done."""
  jax.block_until_ready(metrics["loss"])
  logging.info("start-up: first batch: waited %.1f s", feed.wait_s)
  if feed.first_batch_s is not None:
    logging.info("start-up: data: the first host batch came %.1f s after the pipeline "
                 "started", feed.first_batch_s)
  logging.info("start-up: first step done %.1f s after the run started",
               time.perf_counter() - started)


def _log_window(last: dict, clock, progress, step: int, resolved: fit.Resolved) -> None:
  """Adds the window's timing and progress to ``last`` (the window's mean
  metrics), logs its line, and warns once when the steps wait for data."""
  timing = clock.window()
  shown = {k: last[k] for k in ("loss", "learning_rate", "grad_norm") if k in last}
  if "input_wait_fraction" in timing:
    shown["input_wait"] = f"{timing['input_wait_fraction']:.0%}"
    shown["goodput"] = f"{timing['goodput']:.0%}"
  last.update(timing)
  last.update(progress.update(step, shown))
  if (timing.get("input_wait_fraction", 0.0) > feed_lib.INPUT_BOUND_FRACTION
      and not clock.warned_input_bound):
    clock.warned_input_bound = True
    logging.warning(
        "input-bound: the step waited for data %.0f%% of the last window; raise "
        "data.num_workers (now %d) or give the job more host cores",
        100 * timing["input_wait_fraction"], resolved.num_workers)


def _mean_metrics(history: list[dict], carry: dict | None = None) -> dict:
  """The window's mean metrics (``carry``: metrics_lib.window_mean)."""
  return metrics_lib.window_mean(jax.device_get(history), carry)


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
