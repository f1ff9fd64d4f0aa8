"""Resumable execution of a study's stages.

Layout (``out`` is committed-size: JSON and reports; ``work`` holds the
stages' workdirs with checkpoints and logs):

    <out>/stages/<stage id>.json   one per finished stage: metrics, seconds, command
    <out>/superseded/<stage id>.<finished>.json   earlier executions of a stage
    <out>/<study>/README.md        the report (tables, plots, commands)
    <work>/<stage id>/             the stage's --workdir
    <work>/<stage id>.log          its output when run as a subprocess

A stage is done when its JSON exists; only missing stages run, so a killed
study reruns only what is missing, and a stage killed midway resumes from its
own checkpoint (the shared train loop's resume). A stage whose parent's
checkpoint is gone (another machine, a cleaned work folder) reruns the parent
first. Fine-tuning, probe and supervised stages delete their checkpoints when
done; pretraining stages keep their last one for later downstream stages.

Provenance. A rerun of a stage (its chain's checkpoint gone with a machine)
is another execution: GPU training is not bit-reproducible, and a code
change since may draw other initial values. So a stage file never loses an
execution: a rerun moves the file it replaces to ``<out>/superseded/``, and
every stage records which execution of its parent it started from
(``parent_finished``, the parent's ``finished`` stamp, read from the
parent's workdir, ``execution.json``). The reports read each run's chain as
its last stage read it (``chain``), so a row's pretraining numbers are those
of the checkpoint its fine-tune or probe started from.

``parallel > 1`` runs up to that many stages at once as subprocesses (a
small model leaves most of a GPU idle; each process allocates GPU memory as
it needs it), in dependency order. SIGTERM or SIGINT then stops every stage
started (a second one kills them) before the runner ends, wherever the
signal lands, and a stage ends with its runner even when the runner is
killed outright (``_Stop``, ``_die_with_runner``): no stage trains on
without a parent.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

from absl import logging

from darl_jax import files
from darl_jax import metrics as metrics_lib
from darl_jax.studies import spec as S


class Runner:

  def __init__(self, out, work, extra: dict | None = None):
    self.out = pathlib.Path(out).resolve()
    self.work = pathlib.Path(work).resolve()
    self.extra = dict(extra or {})

  # ------------------------------------------------------------- state

  def result_path(self, stage: S.Stage) -> pathlib.Path:
    return self.out / "stages" / f"{stage.id}.json"

  def workdir(self, stage: S.Stage) -> pathlib.Path:
    return self.work / stage.id

  def result(self, stage: S.Stage) -> dict | None:
    path = self.result_path(stage)
    return files.read_json_or_none(path)

  def superseded_path(self, result: dict) -> pathlib.Path:
    stamp = result["finished"].replace(":", "")
    return self.out / SUPERSEDED / f"{result['id']}.{stamp}.json"

  def executions(self, stage: S.Stage) -> dict[str, dict]:
    """Every recorded execution of ``stage`` by its ``finished`` stamp: the
    stage file's and those it superseded."""
    found = [files.read_json_or_none(p)
             for p in sorted((self.out / SUPERSEDED).glob(f"{stage.id}.*.json"))]
    found.append(self.result(stage))
    return {r["finished"]: r for r in found if r is not None and r.get("id") == stage.id}

  def checkpoint_execution(self, stage: S.Stage) -> str | None:
    """The ``finished`` stamp of the execution whose checkpoint is in the
    stage's workdir; for a workdir from before the stamp was written, the
    stage file's (the execution that ran where the checkpoint is)."""
    stamp = files.read_json_or_none(self.workdir(stage) / EXECUTION_FILE)
    if stamp is not None and stamp.get("id") == stage.id:
      return stamp["finished"]
    result = self.result(stage)
    return result["finished"] if result is not None else None

  def has_checkpoint(self, stage: S.Stage) -> bool:
    ckpt = self.workdir(stage) / "checkpoints"
    return ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())

  def plan(self, stages: list[S.Stage], rerun: bool = False) -> list[S.Stage]:
    """The stages to run, parents first: every stage without a result, and
    every parent whose checkpoint such a stage needs but which is gone;
    ``rerun``: every stage (a new execution of each, the recorded ones
    kept in ``superseded/``)."""
    if rerun:
      return list(stages)
    todo: dict[str, S.Stage] = {}

    def need(stage: S.Stage):
      if stage.parent is not None and not self.has_checkpoint(stage.parent):
        need(stage.parent)
      todo.setdefault(stage.id, stage)

    for stage in stages:
      if self.result(stage) is None:
        need(stage)
    order = [s.id for s in stages]
    return sorted(todo.values(), key=lambda s: order.index(s.id) if s.id in order else -1)

  def command(self, stage: S.Stage, portable: bool = False) -> str:
    """The stage's ``darl_jax.main`` command; ``portable``: workdirs under
    ``<work>`` and without the ``--set`` values (paths of this machine)."""
    if portable:
      parent = f"<work>/{stage.parent.id}" if stage.parent else ""
      return S.command(stage, f"<work>/{stage.id}", parent)
    parent = str(self.workdir(stage.parent)) if stage.parent else ""
    return S.command(stage, str(self.workdir(stage)), parent, self.extra)

  # ---------------------------------------------------------- execution

  def run_stage(self, stage: S.Stage) -> dict:
    """Runs one stage in this process and records its result."""
    _die_with_runner()
    from darl_jax import main
    parent = str(self.workdir(stage.parent)) if stage.parent else ""
    config = S.load_config(stage, self.extra, init_from=parent)
    workdir = self.workdir(stage)
    logging.info("study stage %s: %s", stage.id, self.command(stage))
    # Read before training: a parent rerun meanwhile does not change which
    # execution this stage's initial checkpoint came from.
    parent_finished = self.checkpoint_execution(stage.parent) if stage.parent else None
    start = time.time()
    # A trainer through the shared loop, or a job with a driver of its own
    # (the kNN classifier: nothing to train).
    main.get_job(config.trainer)(config, str(workdir))
    metrics = metrics_lib.final_metrics(str(workdir))
    result = {"id": stage.id, "kind": stage.kind, "config": stage.config,
              "overrides": stage.override_dict(), "parent": stage.parent.id if stage.parent
              else None, "metrics": metrics, "seconds": round(time.time() - start, 1),
              # To the millisecond: the stamp names the execution (older
              # files have seconds).
              "finished": datetime.datetime.now().isoformat(timespec="milliseconds"),
              "command": self.command(stage, portable=True)}
    if stage.parent is not None:
      result["parent_finished"] = parent_finished
    previous = self.result(stage)
    if previous is not None and previous.get("finished") != result["finished"]:
      _write_json(self.superseded_path(previous), previous)
    _write_json(self.result_path(stage), result)
    _write_json(workdir / EXECUTION_FILE, {"id": stage.id, "finished": result["finished"]})
    if stage.kind != "pretrain":
      shutil.rmtree(workdir / "checkpoints", ignore_errors=True)
    return result

  def run(self, stages: list[S.Stage], *, parallel: int = 1, stop_after_minutes: float = 0,
          child_args: list[str] | None = None, rerun: bool = False) -> list[str]:
    """Runs ``plan(stages, rerun)``; returns the ids of the stages that failed
    (or whose parent failed). Stages left for the deadline are logged."""
    todo = self.plan(stages, rerun)
    logging.info("%d of %d stages to run", len(todo), len(stages))
    deadline = time.time() + 60 * stop_after_minutes if stop_after_minutes > 0 else None
    pending = {s.id: s for s in todo}
    by_id = dict(pending)
    running: dict[str, tuple] = {}
    failed: list[str] = []

    def ready(stage):
      return stage.parent is None or (stage.parent.id not in pending
                                      and stage.parent.id not in running
                                      and self.has_checkpoint(stage.parent))

    # With subprocesses, a signal only sets ``stop.signals``; the loop looks
    # at it where ``running`` holds every stage started (see _Stop). Stages
    # run in this process take signals as the caller set them up.
    with _Stop() if parallel > 1 else contextlib.nullcontext(None) as stop:
      stopping = lambda: stop is not None and bool(stop.signals)
      try:
        while (pending or running) and not stopping():
          out_of_time = deadline is not None and time.time() > deadline
          for sid, stage in list(pending.items()):
            if out_of_time or len(running) >= max(parallel, 1) or stopping():
              break
            if stage.parent is not None and stage.parent.id in failed:
              failed.append(sid)
              del pending[sid]
              continue
            if not ready(stage):
              continue
            del pending[sid]
            if rerun:     # from scratch: the train loop would resume a checkpoint left there
              shutil.rmtree(self.workdir(stage), ignore_errors=True)
            if parallel <= 1:
              try:
                self.run_stage(stage)
              except Exception as e:  # pylint: disable=broad-except
                logging.exception("stage %s failed", sid)
                print(f"stage {sid} failed: {e}", file=sys.stderr)
                failed.append(sid)
            else:
              running[sid] = self._spawn(stage, parallel, child_args or [])
          if out_of_time and not running:
            break
          if running and not stopping():
            time.sleep(0.5)
          if stopping():
            break        # the stages a signal ended are not failures
          failed += self._finished(running, by_id)
          if not running and pending and not out_of_time and not any(
              ready(s) or (s.parent is not None and s.parent.id in failed)
              for s in pending.values()):
            raise RuntimeError(f"stages wait on parents that never ran: {sorted(pending)}")
      finally:
        # A signal or an error here: stop the stages still running; each
        # resumes from its last checkpoint on the next run.
        _stop_stages(list(running.values()), stop)
    if pending:
      print(f"{len(pending)} stage(s) not started (--stop_after_minutes); rerun to continue",
            file=sys.stderr)
    return failed

  def _finished(self, running: dict[str, tuple], by_id: dict[str, S.Stage]) -> list[str]:
    """Takes the stages that ended off ``running``; returns those that failed."""
    failed = []
    for sid, (proc, log, started) in list(running.items()):
      if proc.poll() is None:
        continue
      log.close()
      del running[sid]
      if proc.returncode != 0 or self.result(by_id[sid]) is None:
        failed.append(sid)
        print(f"stage {sid} failed (exit {proc.returncode}); see {log.name}",
              file=sys.stderr)
      else:
        logging.info("stage %s done in %.0f s", sid, time.time() - started)
    return failed

  def _spawn(self, stage: S.Stage, parallel: int, child_args: list[str]):
    self.work.mkdir(parents=True, exist_ok=True)
    log = open(self.work / f"{stage.id}.log", "w")
    env = dict(os.environ)
    # Stages allocate GPU memory as they need it instead of each taking an
    # equal 1/parallel slice up front: a pretraining stage needs several times
    # a probe's memory, and at --parallel=30 a 3% slice (4 GB of an H200) ran
    # the fmnist_long pretraining stages out of memory. (The caller's own
    # XLA_* settings win.)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # The stages share the host's cores: each sizes its automatic data
    # workers (data.num_workers=-1) to its share. Without this each stage
    # started one worker per core, --parallel times more workers than cores,
    # and the small CPU-bound stages ran several times slower
    # (docs/STUDIES.md, "Throughput for planning").
    env.setdefault("DARL_PROCESSES_PER_HOST", str(parallel))
    env[RUNNER_PID_ENV] = str(os.getpid())      # read by the stage: _die_with_runner
    try:
      proc = subprocess.Popen([sys.executable, "-m", "darl_jax.studies", *child_args,
                               f"--stage={stage.id}"], stdout=log, stderr=subprocess.STDOUT,
                              env=env)
    except BaseException:
      log.close()
      raise
    return proc, log, time.time()


# Earlier executions of a stage, under ``out`` (module docstring, "Provenance").
SUPERSEDED = "superseded"
# In a stage's workdir: which execution its checkpoint is ({"id", "finished"}).
EXECUTION_FILE = "execution.json"


# SIGTERM: a scheduler's stop or a preemption; SIGINT: Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Where a stage started by ``Runner._spawn`` finds its runner's process id.
RUNNER_PID_ENV = "DARL_STUDY_RUNNER_PID"
_PR_SET_PDEATHSIG = 1      # <linux/prctl.h>


class _Stop:
  """``with _Stop() as stop:`` SIGTERM and SIGINT are noted in
  ``stop.signals`` instead of acting; at the end the first one is handed to
  the handler it displaced (the CLI's exit with status 143, Ctrl-C's
  KeyboardInterrupt, or the default action), unless an error ends the block.

  Why: Python runs a signal's handler between any two bytecodes of the main
  thread, and the CLI's handlers raise. Raised inside ``subprocess.Popen``
  after the fork, or after Popen returned but before the runner recorded
  the process, the exception lost the stage's handle: the runner stopped
  the stages it knew of and exited, and that one trained on without a
  parent (issue 56). A handler that only takes note can run anywhere; the
  runner reads the note where its record of stages is whole. Blocking the
  signals around the spawn (``pthread_sigmask``) was the alternative; but a
  child inherits the blocked mask through exec, which Popen cannot reset,
  and a process-directed signal still reaches any other thread of the
  runner that has it unblocked. Signals ignored on entry (``nohup``) stay
  ignored; outside the main thread nothing changes (no Python handler runs
  there)."""

  def __init__(self):
    self.signals: list[int] = []
    self._displaced: dict[int, object] = {}

  def __enter__(self) -> "_Stop":
    if threading.current_thread() is threading.main_thread():
      for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
          self._displaced[signum] = signal.signal(signum, self._note)
    return self

  def _note(self, signum, frame) -> None:
    del frame
    self.signals.append(signum)

  def __exit__(self, exc_type, *exc) -> None:
    for signum, handler in self._displaced.items():
      # None: a handler not set from Python; the default is the closest.
      signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    if exc_type is None and self.signals and self.signals[0] in self._displaced:
      signal.raise_signal(self.signals[0])   # runs the displaced handler right here


def _stop_stages(running: list[tuple], stop: _Stop | None) -> None:
  """Ends the stages ``running`` (``(process, log, started)`` each) with
  SIGTERM and waits for them; a signal that arrives meanwhile (a second
  Ctrl-C) kills them instead. Closes their logs."""
  procs = [proc for proc, _, _ in running]
  for proc in procs:
    proc.terminate()          # a no-op for a process already reaped
  noted = len(stop.signals) if stop is not None else 0
  while any(proc.poll() is None for proc in procs):
    if stop is not None and len(stop.signals) > noted:
      noted = len(stop.signals)
      for proc in procs:
        proc.kill()           # likewise
    time.sleep(0.05)
  for _, log, _ in running:
    log.close()


def _die_with_runner() -> None:
  """In a stage started by ``Runner._spawn``: asks Linux to send this process
  SIGTERM when its runner ends, however it ends (SIGKILL, the OOM killer),
  and ends at once if the runner is already gone. The runner stops its
  stages itself when it can (``_Stop``); this is the net for when it
  cannot. Elsewhere (not Linux, not started by a runner) a no-op."""
  runner_pid = os.environ.pop(RUNNER_PID_ENV, None)
  if runner_pid is None or not sys.platform.startswith("linux"):
    return
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
    logging.warning("prctl(PR_SET_PDEATHSIG) failed (%s): this stage outlives a runner "
                    "that is killed", os.strerror(ctypes.get_errno()))
    return
  # Checked after the prctl: a runner gone before it sends no signal, and
  # this process was then handed to another parent.
  if os.getppid() != int(runner_pid):
    raise SystemExit(f"error: the study runner (pid {runner_pid}) that started this stage "
                     f"is gone; rerun the study to run it")


def _write_json(path: pathlib.Path, obj) -> None:
  """Written whole or not at all: a killed writer leaves no half file."""
  files.write_json_atomic(path, obj, indent=1, sort_keys=True, default=list)


BLOCK_ACCURACY = "val_accuracy_block_"
HOLDOUT_BLOCK_ACCURACY = "val_holdout_accuracy_block_"
# A linear probe grid's candidates (train/trainers/linear_probe.py, finalize_grid):
# ``val_grid_accuracy_block_03_mean_lr_16_wd_0`` and its held-out twin.
_GRID_CANDIDATE = re.compile(r"^val_grid_accuracy_(block_\d+)_([a-z]+)_lr_([^_]+)_wd_([^_]+)$")
# The kNN job's accuracies (train/jobs/knn.py): ``val_knn_accuracy_mean_k20_block_03``.
_KNN_ACCURACY = re.compile(r"^val_knn_accuracy_([a-z]+)_k(\d+)_block_\d+$")


def derived(metrics: dict) -> dict:
  """A stage's metrics plus what the tables read off them:

  - ``best_block_accuracy``: the largest per-block accuracy (the block chosen
    on the eval split), where there are per-block accuracies. Tables read it
    rather than the probe's own ``val_best_accuracy``: the linear probes of
    the fmnist_long runs wrote that one from an evaluation fed unconverted
    uint8 images (fixed since; their per-block accuracies were right).
  - a linear probe grid's held-out choice, nothing read off the eval split:
    ``chosen_block_accuracy``, the eval accuracy of the block of the best
    held-out accuracy, each block at its held-out setting (the grid's own
    ``val_best_accuracy``); ``chosen_block_accuracy_<pooling>``, the same
    with each block's setting chosen among that pooling's candidates only
    (``grid_choice``: the read-out study's mean-pool and last-token rows).
  - kNN: ``best_block_accuracy_<pooling>_k<k>`` for every k it ran.
  """
  out = dict(metrics)
  blocks = [v for k, v in metrics.items() if k.startswith(BLOCK_ACCURACY) and v is not None]
  if blocks:
    out["best_block_accuracy"] = max(blocks)
  held = sorted(k[len("val_holdout_accuracy_"):] for k in metrics
                if k.startswith(HOLDOUT_BLOCK_ACCURACY))
  if held:
    best = max(held, key=lambda b: metrics[f"val_holdout_accuracy_{b}"])  # first on ties
    out["chosen_block_accuracy"] = metrics[f"val_accuracy_{best}"]
  poolings = {m.group(2) for m in map(_GRID_CANDIDATE.match, metrics) if m}
  for pooling in sorted(poolings):
    out[f"chosen_block_accuracy_{pooling}"] = grid_choice(metrics, pooling)["accuracy"]
  knn: dict = {}
  for key, value in metrics.items():
    m = _KNN_ACCURACY.match(key)
    if m and value is not None:
      name = f"best_block_accuracy_{m.group(1)}_k{m.group(2)}"
      knn[name] = max(knn.get(name, value), value)
  out.update(knn)
  return out


def grid_choice(metrics: dict, pooling: str) -> dict:
  """A linear probe grid's choice among one pooling's candidates, from its
  ``val_grid_accuracy_*`` / ``val_holdout_grid_accuracy_*`` metrics: per
  block the setting of the best held-out accuracy, then the block of the
  best held-out accuracy (ties: the smaller learning rate, then the smaller
  weight decay, then the lower block: the grid's own order, since
  catalog.PROBE_GRIDS lists its values ascending). Returns ``{block,
  accuracy, holdout_accuracy, learning_rate, weight_decay}``, the accuracy
  on the eval split."""
  per_block: dict = {}
  for key in metrics:
    m = _GRID_CANDIDATE.match(key)
    if not m or m.group(2) != pooling:
      continue
    block, lr, wd = m.group(1), float(m.group(3)), float(m.group(4))
    row = {"block": block, "learning_rate": lr, "weight_decay": wd,
           "accuracy": metrics[key], "holdout_accuracy": metrics[f"val_holdout_{key[4:]}"]}
    per_block.setdefault(block, []).append(row)
  if not per_block:
    raise ValueError(f"no linear probe grid candidates with pooling {pooling!r} in the metrics")
  rank = lambda row: (-row["holdout_accuracy"], row["learning_rate"], row["weight_decay"])
  chosen = [min(rows, key=rank) for _, rows in sorted(per_block.items())]
  return min(chosen, key=lambda row: (-row["holdout_accuracy"], row["block"]))


def choice(stage: S.Stage, metrics: dict) -> dict | None:
  """What a frozen-feature stage chose, for the report's ``Choices`` tables:
  ``{block, accuracy, holdout_accuracy?, learning_rate?, weight_decay?,
  pooling?}``. A grid's choice was made on held-out training rows (the
  block too); a single-setting probe's and kNN's block is the best on the
  eval split. None for stages without per-block or grid accuracies."""
  overrides = stage.override_dict()
  held = sorted(k[len("val_holdout_accuracy_"):] for k in metrics
                if k.startswith(HOLDOUT_BLOCK_ACCURACY))
  if held:                                  # a linear probe grid
    best = max(held, key=lambda b: metrics[f"val_holdout_accuracy_{b}"])
    poolings = tuple(overrides.get("probe.poolings", ("mean",)))
    return {"block": str(int(best[len("block_"):])),
            "accuracy": metrics[f"val_accuracy_{best}"],
            "holdout_accuracy": metrics[f"val_holdout_accuracy_{best}"],
            "learning_rate": metrics[f"val_chosen_learning_rate_{best}"],
            "weight_decay": metrics[f"val_chosen_weight_decay_{best}"],
            "pooling": poolings[int(metrics[f"val_chosen_pooling_{best}"])]}
  if "val_chosen_learning_rate" in metrics:  # an attentive probe grid
    return {"block": "+".join(str(b) for b in overrides.get("probe.blocks", ())),
            "accuracy": metrics["val_accuracy"],
            "holdout_accuracy": metrics.get("val_holdout_accuracy"),
            "learning_rate": metrics["val_chosen_learning_rate"],
            "weight_decay": metrics["val_chosen_weight_decay"]}
  blocks = sorted((k, v) for k, v in metrics.items()
                  if k.startswith(BLOCK_ACCURACY) and v is not None)
  if blocks:                                # single setting, kNN: the eval split's best
    key, acc = max(blocks, key=lambda kv: kv[1])
    return {"block": str(int(key[len(BLOCK_ACCURACY):])), "accuracy": acc}
  return None


def pixel_records(out: pathlib.Path) -> tuple[list[dict], list[str]]:
  """The raw-pixel classifiers of ``<out>/pixels.json`` as rows of the
  linear-probe table (``family=linear``) and, where the file has it, of the
  kNN tables (``family=knn``: the pixels are one "block", read at every k
  under the names a kNN stage's ``best_block_accuracy_mean_k<k>`` has), or
  the command that makes them."""
  result = files.read_json_or_none(out / "pixels.json")
  if result is None:
    return [], [f"raw pixels: python -m darl_jax.studies.pixels --data_path=<dir> "
                f"--out={out / 'pixels.json'}"]
  rows = []
  for model, name in (("logistic", "logistic regression"), ("ridge", "ridge regression")):
    acc = result[model]["val_accuracy"]
    rows.append({"labels": {"init": f"raw pixels, {name}", "protocol": "linear classifier",
                            "family": "linear", "seed": 0},
                 "metrics": {"last/val_accuracy": acc, "last/best_block_accuracy": acc}})
  if "knn" in result:
    per_k = {int(k): a for k, a in result["knn"]["val_accuracy"].items()}
    headline = per_k.get(20)
    metrics = {f"last/best_block_accuracy_mean_k{k}": a for k, a in per_k.items()}
    if headline is not None:      # the kNN stages' headline k (train/jobs/knn.py's report_k)
      metrics.update({"last/val_accuracy": headline, "last/best_block_accuracy": headline})
    rows.append({"labels": {"init": "raw pixels, kNN", "protocol": "kNN", "family": "knn",
                            "seed": 0}, "metrics": metrics})
  return rows, []


COMPARATORS = {"pixels": pixel_records}


def comparator_records(runner: Runner, study: S.Study) -> tuple[list[dict], list[str]]:
  """(report rows of the study's comparators, commands for those missing)."""
  rows, missing = [], []
  for name in study.comparators:
    found, absent = COMPARATORS[name](runner.out)
    rows += found
    missing += absent
  return rows, missing


def chain(runner: Runner, run: S.Run) -> list[dict] | None:
  """The results of a run's stages as its last stage read them: the last
  stage's file, then each parent's execution that its child's
  ``parent_finished`` names, from the stage file or ``superseded/``. None if
  the last stage has not run; shorter than the run where an execution a
  child read is not recorded (the chain ends at that child)."""
  results = [runner.result(run.stages[-1])]
  if results[0] is None:
    return None
  for stage in reversed(run.stages[:-1]):
    parent = parent_execution(runner.executions(stage), results[0])
    if parent is None:
      break
    results.insert(0, parent)
  return results


def parent_execution(executions: dict[str, dict], child: dict) -> dict | None:
  """Of a parent's ``executions`` (``Runner.executions``), the one ``child``
  started from. A stage file written before ``parent_finished`` was
  recorded names none; for it, the parent's last execution finished before
  the child started (its ``finished`` less its ``seconds``, plus a second:
  the stamps are cut to the second): the one whose checkpoint was in the
  workdir then."""
  if "parent_finished" in child:
    return executions.get(child["parent_finished"])
  when = datetime.datetime.fromisoformat
  start = when(child["finished"]) - datetime.timedelta(seconds=child["seconds"] - 1)
  before = [stamp for stamp in executions if when(stamp) <= start]
  return executions[max(before, key=when)] if before else None


def records(runner: Runner, study: S.Study) -> tuple[list[dict], list[str]]:
  """(report records of the complete runs, names of incomplete runs).

  A record holds the metrics of its run's chain (``chain``): where an
  execution a stage started from is not recorded, the stages before it are
  left out of the record (``unrecorded``: their ids), so no row mixes a
  stage with another execution of its parent; ``superseded``: the
  ``<id>@<finished>`` of the executions read that a later one replaced in
  ``stages/``."""
  out, missing = [], []
  for run in study.runs:
    results = chain(runner, run)
    if results is None:
      missing.append(run.name)
      continue
    cut = len(run.stages) - len(results)      # the stages before it: unrecorded
    stages = run.stages[cut:]
    metrics = {}
    for stage, result in zip(stages, results):
      metrics.update({f"{stage.kind}/{k}": v for k, v in derived(result["metrics"]).items()})
    metrics.update({f"last/{k}": v for k, v in derived(results[-1]["metrics"]).items()})
    record = {"labels": run.labels, "metrics": metrics, "run": run.name}
    chosen = choice(run.stages[-1], results[-1]["metrics"])
    if chosen is not None:
      record["choice"] = chosen
    unrecorded = [s.id for s in run.stages[:cut]]
    if unrecorded:
      record["unrecorded"] = unrecorded
    superseded = [f"{r['id']}@{r['finished']}" for s, r in zip(stages, results)
                  if (runner.result(s) or {}).get("finished") != r["finished"]]
    if superseded:
      record["superseded"] = superseded
    out.append(record)
  return out, missing
