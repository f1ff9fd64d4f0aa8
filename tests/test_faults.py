"""Faults at each phase of a run: signals, a full disk, a read-only workdir.

SIGTERM at any phase (setup, compile, before / during / after the restore,
the first step, mid-run, a save, the end of the steps, the closing programs)
ends the CLI with status 143 and one line, the newest committed checkpoint
intact and nothing moved aside; SIGKILL at the same phases loses nothing
committed; each rerun resumes from the newest checkpoint. A save that fails
for lack of space or permission ends with one line that names the cause
first, which no clean-up failure after it replaces.

Each phase is hit deterministically: the subprocess runs the CLI through
``_DRIVER``, which wraps the phase's own function so that the process sends
itself the signal from inside it. One workdir carries the runs of a test
from phase to phase, so that each run is also the previous one's rerun.
"""

import errno
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import cli
from darl_jax import interrupts
from darl_jax import metrics as metrics_lib
from darl_jax import preemption
from darl_jax.train import loop
from darl_jax.train.trainers import pretrain
from test_reliability import tiny

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "tiny_config.py")
STEPS = 8

# Runs the CLI (darl_jax.main) with the function of one phase wrapped: on its
# ``nth`` call the process sends itself ``signal``, from inside that function.
_DRIVER = """
import os, signal, sys, time
phase, signame, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
import orbax.checkpoint as ocp
from darl_jax import checkpoint, interrupts, main
from darl_jax.train import loop, startup, state
from darl_jax.train.trainers import pretrain
targets = {
    "setup": (loop, "setup"),
    "compile": (startup, "compile_programs"),
    "before restore": (checkpoint.Checkpointer, "restore_newest"),
    "restore": (ocp.StandardCheckpointHandler, "restore"),   # inside Orbax's read
    "after restore": (state, "adopt_layout"),
    "step": (loop.Profile, "before"),                        # in the step loop
    "save": (checkpoint.Checkpointer, "_save"),
    "steps done": (interrupts.watch, "__exit__"),            # the notices' last moment
    "closing": (pretrain.PretrainTrainer, "finalize"),
}
owner, name = targets[phase]
real, calls = getattr(owner, name), []

def hit(*args, **kwargs):
  calls.append(1)
  if len(calls) == nth:
    print(f"fault: {signame} in {phase}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), getattr(signal, signame))
    time.sleep(0.2)     # where a raising handler lands; SIGKILL never returns
  return real(*args, **kwargs)
setattr(owner, name, hit)
sys.argv = ["darl_jax.main"] + sys.argv[4:]
main.cli()
"""


def _env():
  env = {k: v for k, v in os.environ.items() if not k.startswith(("DARL_", "SLURM_"))}
  env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
  return env


def _run(workdir, phase=None, signame="SIGTERM", nth=1):
  # Synthetic batches: what is under test is the run around them, and each of
  # these short runs would otherwise spend part of its start-up importing
  # scikit-learn for the digits.
  args = [f"--config={TINY}:steps={STEPS}", f"--workdir={workdir}",
          "--config.eval_every_steps=0", "--config.checkpoint_every_steps=2",
          "--config.keep_checkpoints=2", "--config.data.name=synthetic"]
  if phase is None:
    cmd = [sys.executable, "-m", "darl_jax.main", *args]
  else:
    cmd = [sys.executable, "-c", _DRIVER, phase, signame, str(nth), *args]
  return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                        timeout=240)


def _steps(workdir) -> list[int]:
  d = pathlib.Path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def _newest_reads(workdir) -> int | None:
  """The newest committed checkpoint's step, after reading it whole."""
  if not _steps(workdir):
    return None
  params, meta = checkpoint_lib.restore_params(str(workdir))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(params))
  return meta["step"]


def _check(proc, workdir, before, phase, signame):
  """The run ended as ``signame`` at ``phase`` should; returns the newest step."""
  text = proc.stderr[-4000:]
  assert f"fault: {signame} in {phase}" in proc.stderr, text
  if signame == "SIGTERM":
    assert proc.returncode == 143, text
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, text
  else:
    assert proc.returncode == -signal.SIGKILL, text
  newest = _newest_reads(workdir)
  # Nothing committed is lost, nothing is taken for damage.
  assert (newest or 0) >= (before or 0), (phase, before, newest)
  assert not (pathlib.Path(workdir) / checkpoint_lib.DAMAGED_DIR).exists(), text
  if before and phase in ("after restore", "step", "save", "steps done", "closing"):
    assert f"at step {before}" in proc.stderr, text      # it resumed from the newest
  return newest


# (phase, the call that is hit): the runs of each test in this order carry
# one workdir from a fresh start to a finished run. "steps done": SIGTERM as
# the steps' watch of notices ends (after the last step's checkpoint, before
# the closing programs), where a notice recorded but read by no one would let
# the run finish and exit 0.
SIGTERM_RUNS = [("setup", 1), ("compile", 1), ("step", 1), ("before restore", 1),
                ("restore", 1), ("after restore", 1), ("save", 1), ("step", 3),
                ("steps done", 1), ("closing", 1)]
# SIGKILL in the second save (step 4): the first (step 2) is committed by then,
# since each save waits for the one before.
SIGKILL_RUNS = [("setup", 1), ("compile", 1), ("save", 2), ("restore", 1), ("step", 1),
                ("save", 1), ("step", 3), ("closing", 1)]


@pytest.mark.parametrize("signame,runs", [("SIGTERM", SIGTERM_RUNS),
                                          ("SIGKILL", SIGKILL_RUNS)])
def test_a_signal_at_each_phase_loses_nothing_committed(tmp_path, signame, runs):
  wd = tmp_path / "wd"
  newest = None
  for phase, nth in runs:
    newest = _check(_run(wd, phase, signame, nth), wd, newest, phase, signame)
  assert newest == STEPS      # the closing programs run after the last save
  rerun = _run(wd)
  assert rerun.returncode == 0, rerun.stderr[-4000:]
  assert f"at step {STEPS}" in rerun.stderr
  assert (wd / "predictions.png").exists()


def test_a_notice_as_the_watch_ends_leaves_no_deadline_running(monkeypatch):
  """SIGTERM at the last moment of the steps' watch, as ``close()`` ends it
  (the clean-up after an error): the notice is recorded and starts the
  deadline, which ``close()`` must still cancel; one started after its
  cancel would end the process later, wherever it is, with a false "not
  committed"."""
  p = preemption.Preemption(tiny(), in_flight=loop.IN_FLIGHT, unfinished=list, is_main=True)
  # A deadline left running by a failure here must not end pytest (os._exit).
  monkeypatch.setattr(p, "_expire", lambda: None)
  p.open()
  real_exit = interrupts.watch.__exit__

  def exit_hit_by_sigterm(self, *exc):
    os.kill(os.getpid(), signal.SIGTERM)     # the watch still records it
    return real_exit(self, *exc)
  monkeypatch.setattr(interrupts.watch, "__exit__", exit_hit_by_sigterm)
  p.close()
  assert p.noticed and p._timer is None      # pylint: disable=protected-access


# ------------------------------------------ a full disk, a read-only workdir

_TENSORSTORE_ENOSPC = (
    'RESOURCE_EXHAUSTED: Error writing "params.w/0.0" in OCDBT database at local file '
    '"{d}/4.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/": Failed '
    'writing: "{d}/4.orbax-checkpoint-tmp/state/d/86773d5f": Failed to write 1803991 bytes '
    "to file 9: No space left on device [os_error_code='28'] [tensorstore_spec='{{\"driver\":"
    '\"zarr\"}}\']')


def _failing_save(monkeypatch, at_step: int, error: Exception, leave_tmp: bool):
  """Checkpointer._save fails at ``at_step`` (with a half-written temporary
  folder that its clean-up cannot remove, if ``leave_tmp``)."""
  real = checkpoint_lib.Checkpointer._save

  def save(self, step, state, meta, force):
    if step != at_step:
      return real(self, step, state, meta, force)
    if leave_tmp:
      (pathlib.Path(self.directory) / f"{step}.orbax-checkpoint-tmp" / "d").mkdir(parents=True)
    raise error
  monkeypatch.setattr(checkpoint_lib.Checkpointer, "_save", save)
  if leave_tmp:
    path_type = type(checkpoint_lib.absolute_path("/"))

    def rmtree(self, missing_ok=False):
      raise OSError(errno.ENOTEMPTY, "Directory not empty", "d")
    monkeypatch.setattr(path_type, "rmtree", rmtree)


@pytest.mark.parametrize("cause,error", [
    ("no space left on device", lambda d: ValueError(_TENSORSTORE_ENOSPC.format(d=d))),
    ("read-only file system", lambda d: OSError(errno.EROFS, "Read-only file system", d)),
])
def test_a_failed_save_puts_its_cause_first_and_the_rerun_resumes(tmp_path, monkeypatch,
                                                                  capsys, caplog, cause, error):
  config = tiny(total_steps=6, checkpoint_every_steps=2)
  wd = tmp_path / "wd"
  real_close = metrics_lib.MetricWriter.close

  def close_on_a_full_disk(self):
    real_close(self)
    raise OSError(errno.ENOSPC, "No space left on device", "metrics.jsonl")
  with monkeypatch.context() as m:
    _failing_save(m, 4, error(str(wd / "checkpoints")), leave_tmp=True)
    m.setattr(metrics_lib.MetricWriter, "close", close_on_a_full_disk)
    with pytest.raises(checkpoint_lib.CheckpointWriteError) as e:
      loop.run(pretrain.PretrainTrainer(config), config, str(wd))
  message = str(e.value)
  assert message.startswith(f"{cause} writing the checkpoint of step 4 to {wd}/checkpoints "
                            "(about "), message
  assert " free): " in message and "tensorstore_spec" not in message
  # The clean-up failures after it (the unfinished save's removal, the last
  # flush of metrics.jsonl) are logged and noted, never the error.
  assert e.value.__notes__ == ["clean-up after it failed too: OSError: [Errno 28] No space "
                               "left on device: 'metrics.jsonl'"]
  assert "could not remove an unfinished checkpoint ([Errno 39] Directory not empty" \
      in caplog.text
  with pytest.raises(SystemExit) as exit_status:
    cli.report(e.value)
  assert exit_status.value.code == 1
  assert capsys.readouterr().err == f"error: {message}\n"
  assert _steps(wd) == [2]             # the committed checkpoint is intact
  shutil.rmtree(wd / "checkpoints" / "4.orbax-checkpoint-tmp")
  loop.run(pretrain.PretrainTrainer(config), config, str(wd))
  assert _steps(wd)[-1] == 6 and not (wd / checkpoint_lib.DAMAGED_DIR).exists()


def _disk(free: int):
  usage = shutil.disk_usage("/")
  return lambda path: usage._replace(free=free)


def test_a_disk_that_cannot_hold_one_checkpoint_is_refused_before_anything_runs(
    tmp_path, monkeypatch):
  config = tiny(total_steps=2)
  nbytes = checkpoint_lib.state_bytes(loop.setup(pretrain.PretrainTrainer(config),
                                                 config).abstract_state)
  monkeypatch.setattr(checkpoint_lib.shutil, "disk_usage", _disk(nbytes // 2))
  with pytest.raises(checkpoint_lib.CheckpointWriteError,
                     match=rf"no space for a checkpoint in {tmp_path}/checkpoints: one takes "
                     rf"about {checkpoint_lib.human_bytes(nbytes)} and "
                     rf"{checkpoint_lib.human_bytes(nbytes // 2)} is free; free space"):
    loop.run(pretrain.PretrainTrainer(config), config, str(tmp_path))
  assert not (tmp_path / "config.json").exists() and _steps(tmp_path) == []


def test_a_disk_short_of_keep_n_checkpoints_warns_with_both_numbers(tmp_path, monkeypatch,
                                                                   caplog):
  config = tiny(total_steps=2, keep_checkpoints=3)
  nbytes = checkpoint_lib.state_bytes(loop.setup(pretrain.PretrainTrainer(config),
                                                 config).abstract_state)
  monkeypatch.setattr(checkpoint_lib.shutil, "disk_usage", _disk(2 * nbytes))
  loop.run(pretrain.PretrainTrainer(config), config, str(tmp_path))
  h = checkpoint_lib.human_bytes
  assert (f"has {h(2 * nbytes)} free, less than the {h(4 * nbytes)} that keep_checkpoints=3 "
          "needs") in caplog.text
  assert _steps(tmp_path) == [2]
