"""A checkpoint at the preemption point (darl_jax/preemption.py, issue 56).

SIGTERM, or the configured preemption signal, makes the loop stop at a step
every process reaches, save it like a periodic save and exit with status
143; the rerun resumes there, losing no step. Runs are the seconds-long
tests/tiny_config.py: in process where the CLI adds nothing, subprocesses
where the exit status, the signal from outside and two real processes are
the point.
"""

import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import config_lib
from darl_jax import interrupts
from darl_jax import metrics as metrics_lib
from darl_jax import preemption
from darl_jax.train import loop
from darl_jax.train.trainers import pretrain
from test_reliability import tiny  # tests/tiny_config.py without evaluations or pictures
from xla_env import cpu_devices_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "tiny_config.py")
# Values of a record that do not depend on timing (metrics.jsonl also holds
# step times, goodput and the like).
DETERMINISTIC = ("loss", "grad_norm", "learning_rate", "param_norm", "nonfinite")




def steps_on_disk(workdir) -> list[int]:
  d = pathlib.Path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit())


def tmp_dirs(workdir) -> list[str]:
  d = pathlib.Path(workdir) / "checkpoints"
  return sorted(p.name for p in d.iterdir() if not p.name.isdigit())


def records(workdir) -> list[dict]:
  return metrics_lib.read_metrics(str(workdir))


def assert_same_records(got: list[dict], want: list[dict]):
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for a, b in zip(got, want):
    for key in DETERMINISTIC:
      if key in b:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-6, err_msg=f"step {b['step']}")


@pytest.fixture
def signals_restored(monkeypatch):
  """Leaves this process's handlers as they were (the loop must, too), and
  interrupts as if the CLI had not installed its handlers."""
  monkeypatch.setattr(interrupts, "_installed", False)
  before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
  yield before
  for s, handler in before.items():
    signal.signal(s, handler)


# ------------------------------------------------------------ config keys


@pytest.mark.parametrize("name,number", [("SIGUSR1", signal.SIGUSR1), ("USR2", signal.SIGUSR2),
                                         ("sighup", signal.SIGHUP), ("", None)])
def test_preemption_signal_names(name, number):
  assert config_lib.preemption_signal_number(name) == number
  config_lib.validate(tiny(preemption_signal=name))


@pytest.mark.parametrize("key,value,message", [
    ("preemption_signal", "SIGINT", "SIGUSR1.*got 'SIGINT'"),
    ("preemption_signal", "SIGKILL", "got 'SIGKILL'"),
    ("preemption_signal", "USR3", "got 'USR3'; valid: .*SIGUSR2"),
    ("preemption_deadline_s", 0.0, "a positive number of seconds"),
])
def test_bad_preemption_keys_name_the_fix(key, value, message):
  with pytest.raises(config_lib.ConfigError, match=f"config.{key} .*{message}.* set --config.{key}="):
    config_lib.validate(tiny(**{key: value}))


def test_notice_signals():
  assert preemption.notice_signals(tiny()) == (signal.SIGUSR1, signal.SIGTERM)
  assert preemption.notice_signals(tiny(preemption_signal="")) == (signal.SIGTERM,)
  assert preemption.notice_signals(tiny(preemption_signal="SIGTERM")) == (signal.SIGTERM,)


# ------------------------------------------------------ interrupts.watch


def test_watched_signals_record_a_notice_instead_of_raising(signals_restored):
  seen = []
  with interrupts.watch([signal.SIGTERM, signal.SIGUSR1], on_notice=seen.append) as w:
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)          # a repeat: ignored
    time.sleep(0.05)
  assert w.notice.name == "SIGUSR1" and seen == [w.notice]
  assert signal.getsignal(signal.SIGTERM) is signals_restored[signal.SIGTERM]
  assert signal.getsignal(signal.SIGUSR1) is signals_restored[signal.SIGUSR1]
  with pytest.raises(ValueError, match="Ctrl-C"):
    interrupts.watch([signal.SIGINT])


def test_outside_a_watch_the_cli_handlers_raise(signals_restored):
  interrupts.install()
  interrupts.terminate_on(signal.SIGUSR1)
  with pytest.raises(interrupts.Terminated, match="terminated \\(SIGUSR1\\)"):
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(1)
  with interrupts.watch([signal.SIGUSR1]) as w:
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.05)
  assert w.notice is not None
  # The CLI's handler is back once the watch ends.
  assert signal.getsignal(signal.SIGUSR1) is interrupts._handler


# ----------------------------------------------- the agreement, a fake store


class FakeStore:
  """The coordination service's key-value calls that Agreement makes."""

  def __init__(self):
    self.kv, self.barriers = {}, []

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

  def key_value_set(self, key, value):
    if key in self.kv:
      raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists")
    self.kv[key] = value

  def wait_at_barrier(self, name, timeout_ms):
    self.barriers.append(name)


def test_the_first_proposal_holds_for_every_process():
  store = FakeStore()
  a, b = (preemption.Agreement(store, margin=3, prefix="run/0") for _ in range(2))
  assert a.stop_step(4, noticed=False) is None and b.stop_step(5, noticed=False) is None
  assert b.stop_step(6, noticed=True) == 9          # b proposes 6 + 3
  assert a.stop_step(5, noticed=True) == 9          # a's own notice finds b's proposal
  assert a.stop_step(6, noticed=False) == 9

  # A proposal that loses the race to the key (both read no key, both
  # write) reads the winner's.
  store = FakeStore()
  a, b = (preemption.Agreement(store, margin=3, prefix="run/0") for _ in range(2))
  assert a._propose(7 + 3) == 10 and b._propose(8 + 3) == 10
  assert store.kv == {"run/0/stop": "10"}


def test_the_end_of_the_loop_gives_every_process_the_same_answer():
  store = FakeStore()
  a, b = (preemption.Agreement(store, margin=3, prefix="run/4") for _ in range(2))
  # b had a notice that the loop did not reach; a had none. Both pass the
  # barrier before either reads, as jax.distributed's does.
  assert b.at_end(noticed=True) is True
  assert a.at_end(noticed=False) is True
  assert store.barriers == ["run/4_end", "run/4_end"]
  quiet = FakeStore()
  assert preemption.Agreement(quiet, margin=3, prefix="run/4").at_end(noticed=False) is False


# ------------------------------------------------------- the deadline


def test_past_the_deadline_the_save_in_flight_goes_and_the_process_exits(
    tmp_path, monkeypatch, capsys):
  complete, unfinished = tmp_path / "4", tmp_path / "8.orbax-checkpoint-tmp-123"
  for d in (complete, unfinished / "state"):
    d.mkdir(parents=True)
  (unfinished / "state" / "part").write_bytes(b"x" * 1000)
  from etils import epath
  exits = []
  monkeypatch.setattr(preemption.os, "_exit", exits.append)
  p = preemption.Preemption(tiny(preemption_deadline_s=0.05), in_flight=2, is_main=True,
                            unfinished=lambda: [epath.Path(unfinished)])
  p._arm("SIGTERM")                  # what a notice does: the timer starts
  deadline = time.time() + 10
  while not exits and time.time() < deadline:
    time.sleep(0.01)
  p.close()
  assert exits == [preemption.EXIT_STATUS] == [143]
  assert sorted(os.listdir(tmp_path)) == ["4"]           # the complete one survives
  err = capsys.readouterr().err
  assert "error: preempted (SIGTERM): the checkpoint was not committed within " \
         "preemption_deadline_s=0.05; removed the unfinished save 8.orbax-checkpoint-tmp-123" in err


# ------------------------------------------------------- in process


class Signalling(pretrain.PretrainTrainer):
  """Sends ``signum`` to this process when the loop fetches batch ``at``
  (the feed fetches a few ahead of the step), and counts finalize calls."""
  at, signum, finalized = 3, signal.SIGUSR1, 0

  def make_source(self, config, split, *, train):
    source = super().make_source(config, split, train=train)
    return _SignalAt(source, self.at, self.signum) if train else source

  def finalize(self, ctx, model, state):
    type(self).finalized += 1


class _SignalAt:
  def __init__(self, source, at, signum):
    self._source, self._at, self._signum = source, at, signum

  def __getattr__(self, name):
    return getattr(self._source, name)

  def train_iterator(self, *args, **kwargs):
    return _SignalIterator(self._source.train_iterator(*args, **kwargs), self._at, self._signum)


class _SignalIterator:
  def __init__(self, it, at, signum):
    self._it, self._at, self._signum, self._n = it, at, signum, 0

  def __getattr__(self, name):
    return getattr(self._it, name)

  def __iter__(self):
    return self

  def __next__(self):
    self._n += 1
    if self._n == self._at:
      os.kill(os.getpid(), self._signum)
    return next(self._it)


# One uninterrupted run that the interrupted ones must equal: long enough
# for a signal from outside to land mid-run, with an EMA in the state.
STRAIGHT = dict(total_steps=60, checkpoint_every_steps=1000, ema_decay=0.9)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("straight")
  config = tiny(**STRAIGHT)
  loop.run(pretrain.PretrainTrainer(config), config, str(workdir))
  return workdir


def test_a_notice_in_process_saves_its_step_and_the_rerun_loses_none(tmp_path, straight,
                                                                   signals_restored):
  config = tiny(**STRAIGHT)
  # The feed fetches up to three batches ahead: from the sixth on, the steps
  # (and their watch of the signals) have begun.
  Signalling.at = random.randint(6, 9)
  with pytest.raises(interrupts.Terminated, match=r"preempted \(SIGUSR1\): saved the "
                     r"checkpoint of step \d+"):
    loop.run(Signalling(config), config, str(tmp_path / "b"))
  [stop] = steps_on_disk(tmp_path / "b")
  assert 2 <= stop < 12 and tmp_dirs(tmp_path / "b") == []
  assert [r["step"] for r in records(tmp_path / "b")] == list(range(1, stop + 1))
  assert not (tmp_path / "b" / "run.lock").exists()
  for s, handler in signals_restored.items():
    assert signal.getsignal(s) is handler, s
  # The checkpoint is a periodic save's: the data position and the log window.
  meta = checkpoint_lib.Checkpointer(str(tmp_path / "b" / "checkpoints")).restore_meta(stop)
  assert meta["step"] == stop and "data_state" in meta and "log_window" in meta

  loop.run(pretrain.PretrainTrainer(config), config, str(tmp_path / "b"))
  assert_same_records(records(tmp_path / "b"), records(straight))
  for use_ema in (False, True):
    want, _ = checkpoint_lib.restore_params(str(straight), use_ema=use_ema)
    got, _ = checkpoint_lib.restore_params(str(tmp_path / "b"), use_ema=use_ema)
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_notice_after_the_last_step_skips_the_final_artifacts(tmp_path, monkeypatch,
                                                               signals_restored):
  """A notice between the last step boundary and the end: the last
  checkpoint is saved, the final artifacts wait for the rerun."""
  config = tiny(total_steps=4, checkpoint_every_steps=2)
  real_wait = checkpoint_lib.Checkpointer.wait

  def wait_hit_by_sigterm(self):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    return real_wait(self)
  Signalling.at, Signalling.finalized = 10**6, 0
  with monkeypatch.context() as m:
    m.setattr(checkpoint_lib.Checkpointer, "wait", wait_hit_by_sigterm)
    with pytest.raises(interrupts.Terminated, match="after the last step: the checkpoint of "
                       "step 4 is saved"):
      loop.run(Signalling(config), config, str(tmp_path))
  assert steps_on_disk(tmp_path) == [2, 4] and Signalling.finalized == 0
  loop.run(Signalling(config), config, str(tmp_path))        # resumes at 4: finalize only
  assert Signalling.finalized == 1
  assert [r["step"] for r in records(tmp_path)] == [1, 2, 3, 4]


# ------------------------------------------------------------ the CLI


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("DARL_", "SLURM_"))}
  env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1", **extra)
  return env


def _last_logged_step(workdir) -> int:
  path = pathlib.Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return 0
  steps = [json.loads(l)["step"] for l in path.read_text().splitlines() if l.endswith("}")]
  return max(steps, default=0)


def _signal_when_logged(proc, workdir, step: int, signum, timeout: float = 240,
                        pause=None) -> int:
  """Sends ``signum`` to ``proc`` once metrics.jsonl has a record of ``step``;
  returns the last step logged when it was sent.

  The run's processes (``pause``, default ``proc``) are stopped (SIGSTOP)
  while the log is read again and the signal sent, then continued: the step
  returned is where the run was when the signal reached it, however long
  this test process itself waited to be scheduled between the two."""
  pause = pause or [proc]
  deadline = time.time() + timeout
  while time.time() < deadline and proc.poll() is None:
    if _last_logged_step(workdir) >= step:
      for p in pause:
        p.send_signal(signal.SIGSTOP)
      try:
        logged = _last_logged_step(workdir)
        proc.send_signal(signum)
      finally:
        for p in pause:
          p.send_signal(signal.SIGCONT)
      return logged
    time.sleep(0.01)
  raise AssertionError(f"the run never logged step {step} (exit {proc.poll()})")


CLI_COMMON = ("--config.eval_every_steps=0", "--config.predictions.num_images=0",
              "--config.checkpoint_every_steps=1000")


def test_cli_sigterm_at_a_random_step_saves_it_and_the_rerun_equals_a_straight_run(
    tmp_path, straight):
  wd = tmp_path / "wd"
  cmd = [sys.executable, "-m", "darl_jax.main",
         f"--config={TINY}:steps={STRAIGHT['total_steps']}", f"--workdir={wd}", *CLI_COMMON,
         f"--config.ema_decay={STRAIGHT['ema_decay']}"]
  log = tmp_path / "first.log"
  with open(log, "w") as out:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
  at = random.randint(2, 20)
  try:
    sent = _signal_when_logged(proc, wd, at, signal.SIGTERM)
    status = proc.wait(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  text = log.read_text()
  assert status == preemption.EXIT_STATUS == 143, text[-3000:]
  [stop] = steps_on_disk(wd)
  # That step, or the one or two the host had run ahead when it arrived.
  assert sent <= stop <= sent + 3, (sent, stop, text[-3000:])
  assert f"the checkpoint of step {stop} is committed" in text
  assert tmp_dirs(wd) == [] and _last_logged_step(wd) == stop
  [line] = [l for l in text.splitlines() if l.startswith("error:")]
  # The one line says what was saved and how to resume.
  assert line.startswith(f"error: preempted (SIGTERM): saved the checkpoint of step {stop} ")
  assert line.endswith("rerun the same command to resume from it"), line

  rerun = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=240)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert f"at step {stop}" in rerun.stderr                  # 0 steps lost
  assert_same_records(records(wd), records(straight))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_save_the_same_step_when_one_gets_the_signal(tmp_path):
  """SIGUSR1 (the default preemption signal) to process 1 only: both
  processes stop at one step, its checkpoint holds both processes' shards,
  within the deadline."""
  wd, port, deadline = tmp_path / "wd", _free_port(), 25.0
  procs, logs = [], []
  for i in range(2):
    logs.append(tmp_path / f"p{i}.log")
    env = _env(XLA_FLAGS=cpu_devices_flags(1), DARL_COORDINATOR=f"127.0.0.1:{port}",
               DARL_NUM_PROCESSES="2", DARL_PROCESS_ID=str(i))
    with open(logs[-1], "w") as out:
      procs.append(subprocess.Popen(
          [sys.executable, "-m", "darl_jax.main", f"--config={TINY}:steps=200",
           f"--workdir={wd}", *CLI_COMMON, "--config.mesh.fsdp=2", "--config.sharding=fsdp",
           f"--config.preemption_deadline_s={deadline}"],
          cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
  try:
    sent = _signal_when_logged(procs[1], wd, random.randint(2, 15), signal.SIGUSR1,
                               pause=procs)
    sent_at = time.time()
    statuses = [p.wait(timeout=120) for p in procs]
    took = time.time() - sent_at
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  texts = [l.read_text() for l in logs]
  assert statuses == [143, 143], "\n".join(t[-3000:] for t in texts)
  [stop] = steps_on_disk(wd)
  # The proposer's step plus the agreement's margin (3), the two processes'
  # hosts up to two steps apart, and the poll's lag.
  assert sent < stop <= sent + 8 and took < deadline, (sent, stop, took)
  for text in texts:
    assert f"every process stops and saves at step {stop}" in text
    assert f"the checkpoint of step {stop} is committed" in text
  assert "preemption notice (SIGUSR1)" in texts[1]
  assert "preemption notice (another process's notice)" in texts[0]
  assert tmp_dirs(wd) == [] and _last_logged_step(wd) == stop
  # The checkpoint is whole: both processes' shards of the FSDP state read.
  params, meta = checkpoint_lib.restore_params(str(wd))
  assert meta["step"] == stop and all(np.isfinite(np.asarray(x)).all()
                                      for x in jax.tree_util.tree_leaves(params))


# ------------------------------------------------------------ the benchmark


def test_checkpoint_save_benchmark_on_the_tiny_config(tmp_path):
  """benchmarks/checkpoint_save_bench.py (the H/14 figure is measured on a
  GPU) runs on the tiny config, with an EMA, and needs no TensorFlow."""
  done = subprocess.run(
      [sys.executable, "benchmarks/checkpoint_save_bench.py",
       "--config=tests/tiny_config.py:objective=diffusion", "--repeats=2",
       f"--workdir={tmp_path}", "--", "--config.model.width=32"],
      cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  out = done.stdout
  rows = [l.split("|")[1:-1] for l in out.splitlines() if l.startswith("| 1") or
          l.startswith("| 2")]
  assert [r[0].strip() for r in rows] == ["1 (first)", "2"], out
  for row in rows:
    state_gb, written_gb, returned, committed = (float(x) for x in row[1:5])
    assert 0 < state_gb and 0 < written_gb and 0 <= returned <= committed, out
  assert "(bad_step, ema, model_state, opt_state, params, step)" in out
  assert "tensorflow imported: no" in out
  assert steps_on_disk(tmp_path) == [1, 2]
