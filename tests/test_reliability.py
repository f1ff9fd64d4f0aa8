"""Nothing lost, nothing wrong: refused resumes, errors and kills mid-run, two
runs on one workdir, damaged checkpoints, bad config values (issue 34).

Each test names the case of the issue it covers. Runs are the seconds-long
tests/tiny_config.py, in process where the CLI adds nothing; subprocesses
only where the exit code and the one-line error are the point.
"""

import json
import os
import pathlib
import runpy
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from etils import epath

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import config_lib
from darl_jax import export
from darl_jax import metrics as metrics_lib
from darl_jax import workdir as workdir_lib
from darl_jax.train import loop
from darl_jax.train.trainers import pretrain
from darl_jax.train import backbone as backbone_lib
from darl_jax.train import transfer

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "tiny_config.py")


def tiny(**overrides):
  """tests/tiny_config.py without evaluations or pictures, then ``overrides``
  (dotted keys: ``{"optim.name": "sgd"}``)."""
  sys.path.insert(0, str(ROOT / "tests"))
  import tiny_config
  c = tiny_config.get_config()
  c.eval_every_steps = 0
  c.predictions.num_images = 0
  for dotted, value in overrides.items():
    parent, key = config_lib.config_node(c, dotted)
    parent[key] = value
  return c


def train(workdir, trainer_cls=pretrain.PretrainTrainer, **overrides):
  config = tiny(**overrides)
  return loop.run(trainer_cls(config), config, str(workdir))


def steps_on_disk(workdir) -> list[int]:
  d = pathlib.Path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit())


def tmp_dirs(workdir) -> list[str]:
  d = pathlib.Path(workdir) / "checkpoints"
  return sorted(p.name for p in d.iterdir() if "tmp" in p.name) if d.exists() else []


def records(workdir) -> list[dict]:
  return metrics_lib.read_metrics(str(workdir))


def cli(workdir, *overrides, config=TINY, timeout=240):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  return subprocess.run(
      [sys.executable, "-m", "darl_jax.main", f"--config={config}", f"--workdir={workdir}",
       *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc, code=1):
  assert proc.returncode == code, proc.stderr[-3000:]
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  return errors[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """Four steps, checkpoints at 2 and 4: copied by the tests that change it."""
  wd = tmp_path_factory.mktemp("trained")
  train(wd, total_steps=4, checkpoint_every_steps=2)
  assert steps_on_disk(wd) == [2, 4]
  return wd


@pytest.fixture
def workdir(trained, tmp_path):
  wd = tmp_path / "wd"
  shutil.copytree(trained, wd)
  return wd


# ------------------------------------------ 1: a refused resume changes nothing


@pytest.mark.parametrize("override", [{"model.posenc": "rope1d"}, {"model.causal": False},
                                      {"model.width": 32}])
def test_refused_resume_leaves_config_json_and_readers_use_the_checkpoint_config(
    workdir, tmp_path, override):
  before = (workdir / "config.json").read_bytes()
  with pytest.raises(ValueError, match="another architecture .*" + list(override)[0]):
    train(workdir, total_steps=6, **override)
  assert (workdir / "config.json").read_bytes() == before
  assert steps_on_disk(workdir) == [2, 4] and not (workdir / "run.lock").exists()

  # Even a config.json rewritten by hand (or by an older version of this
  # code, which wrote it before the resume check) changes no reader.
  stale = json.loads(before)
  stale["model"].update(posenc="rope1d", causal=False, width=32)
  (workdir / "config.json").write_text(json.dumps(stale))
  _, sidecar = export.export(str(workdir), str(tmp_path / "m.safetensors"))
  backbone = json.loads(sidecar.read_text())["backbone"]
  assert backbone["posenc"] == "rope2d" and backbone["attention"]["mask"] == "causal"
  pre, step = backbone_lib.load_pretrain_config(str(workdir))
  assert (pre.model.posenc, pre.model.causal, pre.model.width, step) == ("rope2d", True, 0, 4)
  # Fine-tuning with another positional encoding than the checkpoint's fails.
  params, meta = checkpoint_lib.restore_params(str(workdir))
  stored = transfer.pretrained_model_config(meta)
  assert stored["posenc"] == "rope2d"
  with pytest.raises(ValueError, match="model.posenc: 'rope2d' in the checkpoint, 'rope1d'"):
    transfer.check_model_config(stored, {**stored, "posenc": "rope1d"})


def test_config_json_is_written_atomically_after_the_checks(tmp_path, monkeypatch):
  # A crash while writing config.json leaves the previous file whole.
  writer = metrics_lib.MetricWriter(str(tmp_path), tensorboard=False)
  writer.write_config({"a": 1})
  path_class = type(epath.Path(str(tmp_path)))

  def crash(self, target):
    raise OSError("disk full")
  with monkeypatch.context() as m:
    m.setattr(path_class, "replace", crash)
    with pytest.raises(OSError):
      writer.write_config({"a": 2, "big": "x" * 100_000})
  assert json.loads((tmp_path / "config.json").read_text()) == {"a": 1}
  assert sorted(os.listdir(tmp_path)) == ["config.json"]


# ---------------------------------- 2 (and 4): an error mid-run keeps checkpoints


class FailingEval(pretrain.PretrainTrainer):
  """Raises in the evaluation of step 3, while the save of step 2 is in flight."""

  def extra_eval(self, ctx, model, state):
    if int(jax.device_get(state["step"])) == 3:
      raise RuntimeError("evaluation blew up")
    return {}


class UnreadableImage(pretrain.PretrainTrainer):
  """The training data raises OSError for the fourth batch (an unreadable file)."""

  def make_source(self, config, split, *, train):
    source = super().make_source(config, split, train=train)
    return _FailingSource(source) if train else source


class _FailingSource:
  def __init__(self, source):
    self._source = source

  def __getattr__(self, name):
    return getattr(self._source, name)

  def _wrap(self, it):
    for i, batch in enumerate(it):
      if i == 3:
        raise OSError("cannot identify image file 'broken.png'")
      yield batch

  def train_iterator(self, *args, **kwargs):
    return self._wrap(self._source.train_iterator(*args, **kwargs))

  def train_batches(self, *args, **kwargs):
    return self._wrap(self._source.train_batches(*args, **kwargs))


@pytest.mark.parametrize("trainer_cls,error", [(FailingEval, RuntimeError),
                                               (UnreadableImage, OSError)])
def test_an_error_mid_run_leaves_complete_checkpoints(tmp_path, trainer_cls, error):
  with pytest.raises(error):
    train(tmp_path, trainer_cls, total_steps=8, checkpoint_every_steps=1, eval_every_steps=1)
  # Checked the moment run() returns: the save in flight was finished (or
  # removed), not left to a background thread that dies with the process.
  assert tmp_dirs(tmp_path) == []
  assert steps_on_disk(tmp_path)[-1] in (2, 3)
  assert not (tmp_path / "run.lock").exists()
  # And the newest checkpoint restores.
  params, meta = checkpoint_lib.restore_params(str(tmp_path))
  assert meta["step"] == steps_on_disk(tmp_path)[-1]


def test_cli_nonfinite_loss_is_one_line_and_keeps_every_checkpoint(tmp_path):
  proc = cli(tmp_path, "--config.optim.base_lr=1e9", "--config.checkpoint_every_steps=1")
  line = assert_one_line_error(proc)
  assert "non-finite loss or gradient norm at step" in line
  assert len(proc.stderr.splitlines()) < 40, proc.stderr     # no library tracebacks
  assert tmp_dirs(tmp_path) == [] and steps_on_disk(tmp_path)
  bad = int(line.split("at step ")[1].split()[0])
  # 11: the step the error names is the step metrics.jsonl shows as non-finite,
  # and the last checkpoint is the step before it.
  by_step = {r["step"]: r for r in records(tmp_path)}
  assert by_step[bad]["loss"] is None and by_step[bad]["nonfinite"] == 1.0
  assert all(by_step[s]["loss"] is not None for s in range(1, bad))
  assert steps_on_disk(tmp_path)[-1] == bad - 1


# ------------------------------------------------ 3: one run per workdir (lock)


_HOLDER = """
import sys, time
from darl_jax import workdir
workdir.WorkdirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def test_a_second_run_on_a_locked_workdir_fails_naming_the_holder(tmp_path):
  holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
  try:
    assert holder.stdout.readline().strip() == "locked"
    start = time.time()
    with pytest.raises(workdir_lib.WorkdirError, match=f"in use by pid {holder.pid} on"):
      train(tmp_path, total_steps=2)
    assert time.time() - start < 30
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "config.json").exists()
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  # The holder was killed: its lock is stale and the next run takes it over.
  assert json.loads((tmp_path / "run.lock").read_text())["pid"] == holder.pid
  train(tmp_path, total_steps=2, checkpoint_every_steps=2)
  assert steps_on_disk(tmp_path) == [2] and not (tmp_path / "run.lock").exists()


def test_remote_style_lock_file(tmp_path):
  # The protocol used for gs:// workdirs, exercised on a local directory.
  lock = workdir_lib.WorkdirLock(tmp_path, use_flock=False).acquire()
  with pytest.raises(workdir_lib.WorkdirError, match=f"pid {os.getpid()}"):
    other = workdir_lib.WorkdirLock(tmp_path, use_flock=False)
    other._record = {**other._record, "pid": os.getpid() + 1}     # another process
    other.acquire()
  lock.release()
  assert not (tmp_path / "run.lock").exists()
  # A lock of a process of this host that no longer runs is taken over ...
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  record = {"pid": dead.pid, "host": workdir_lib.socket.gethostname(), "started": "then"}
  (tmp_path / "run.lock").write_text(json.dumps(record))
  workdir_lib.WorkdirLock(tmp_path, use_flock=False).acquire().release()
  # ... one from another host cannot be checked: refused, with the way out.
  (tmp_path / "run.lock").write_text(json.dumps({**record, "host": "elsewhere"}))
  with pytest.raises(workdir_lib.WorkdirError, match="on elsewhere.*delete .*run.lock"):
    workdir_lib.WorkdirLock(tmp_path, use_flock=False).acquire()


def test_lock_falls_back_to_the_lock_file_without_flock(tmp_path, monkeypatch):
  # Some network file systems have no flock: the pid + host protocol instead.
  import errno
  import fcntl

  def no_flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")
  monkeypatch.setattr(fcntl, "flock", no_flock)
  lock = workdir_lib.WorkdirLock(tmp_path).acquire()
  assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
  other = workdir_lib.WorkdirLock(tmp_path)
  other._record = {**other._record, "pid_start_time": "another process"}
  with pytest.raises(workdir_lib.WorkdirError, match=f"in use by pid {os.getpid()}"):
    other.acquire()
  lock.release()
  assert not (tmp_path / "run.lock").exists()


# ------------------------------------- 5, 7: bad values fail before any write


@pytest.mark.parametrize("key,value", [
    ("keep_checkpoints", 0), ("batch_size", 0), ("log_every_steps", 0),
    ("checkpoint_every_steps", 0), ("eval_every_steps", -1), ("total_steps", -3),
    ("stop_after_steps", -1), ("optim.base_lr", float("nan")), ("optim.base_lr", -1.0),
    ("optim.b2", 1.0), ("model.image_size", 0), ("model.drop_path", 1.5),
    ("data.channels", 0), ("loss.noise_samples", 0), ("mesh.data", 0),
])
def test_bad_values_fail_naming_the_key_before_anything_is_written(tmp_path, key, value):
  wd = tmp_path / "wd"
  with pytest.raises(config_lib.ConfigError, match=f"config.{key} must be .* set --config.{key}="):
    train(wd, **{key: value})
  assert not wd.exists()


def test_batch_larger_than_the_dataset_is_refused(tmp_path):           # 10
  with pytest.raises(config_lib.ConfigError,
                     match=r"batch_size 5000 is larger than the training split \(1257"):
    train(tmp_path, batch_size=5000)
  assert not (tmp_path / "config.json").exists()


def test_cli_bad_values_and_workdirs_are_one_line(tmp_path):         # 5, 7, 8
  (tmp_path / "a_file").write_text("")
  # Bad input is status 2, a workdir the run cannot use 1 (darl_jax/cli.py).
  line = assert_one_line_error(cli(tmp_path / "wd", "--config.checkpoint_every_steps=0"), 2)
  assert "config.checkpoint_every_steps must be a positive integer" in line
  line = assert_one_line_error(cli(tmp_path / "a_file"))
  assert "is a file, not a directory" in line
  line = assert_one_line_error(cli(tmp_path / "wd", config=str(tmp_path / "missing.py")), 2)
  assert "missing.py does not exist" in line


# ------------------------------------------------- 8: unusable workdirs


def test_unusable_workdirs_are_one_clear_error(tmp_path):
  (tmp_path / "a_file").write_text("")
  with pytest.raises(workdir_lib.WorkdirError, match="is a file, not a directory"):
    workdir_lib.prepare(tmp_path / "a_file")
  with pytest.raises(workdir_lib.WorkdirError, match="a part of the path is a file"):
    workdir_lib.prepare(tmp_path / "a_file" / "wd")
  if os.geteuid() == 0:
    # root writes into read-only directories; /sys refuses even root.
    unwritable = pathlib.Path("/sys/kernel/darl_jax_test")
  else:
    unwritable = tmp_path / "ro"
    unwritable.mkdir(mode=0o555)
  with pytest.raises(workdir_lib.WorkdirError, match="not writable|cannot be created"):
    workdir_lib.prepare(unwritable / "wd")


# ---------------------------------------- 6: damaged newest checkpoint (loop)


def test_resume_skips_a_damaged_newest_checkpoint(workdir, caplog):
  for f in (workdir / "checkpoints" / "4" / "state" / "d").iterdir():
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])      # truncated
  train(workdir, total_steps=6, checkpoint_every_steps=2)
  assert steps_on_disk(workdir) == [2, 4, 6]
  assert (workdir / "checkpoints.damaged" / "4" / "DAMAGED.txt").exists()
  assert "skipped the damaged checkpoint at step 4" in caplog.text
  # Resumed from 2: steps 3 and 4 were logged again, once each.
  assert [r["step"] for r in records(workdir)] == [1, 2, 3, 4, 5, 6]


def test_an_empty_step_folder_is_skipped_not_a_config_error(workdir):
  (workdir / "checkpoints" / "9").mkdir()
  train(workdir, total_steps=4, checkpoint_every_steps=2)     # finished: resumes at 4
  assert steps_on_disk(workdir) == [2, 4]
  assert (workdir / "checkpoints.damaged" / "9").is_dir()


def test_when_no_checkpoint_restores_the_run_starts_over_keeping_the_old_metrics(workdir):
  old = (workdir / "metrics.jsonl").read_text()
  for step in ("2", "4"):
    (workdir / "checkpoints" / step / "meta" / "metadata").write_text("")   # zeroed
  train(workdir, total_steps=4, checkpoint_every_steps=2)
  assert steps_on_disk(workdir) == [2, 4]
  assert sorted(os.listdir(workdir / "checkpoints.damaged")) == ["2", "4", "metrics.jsonl"]
  assert (workdir / "checkpoints.damaged" / "metrics.jsonl").read_text() == old
  assert [r["step"] for r in records(workdir)] == [1, 2, 3, 4]


# ------------------------------------------- 9: another optimizer on resume


def test_another_optimizer_on_resume_is_one_line_naming_the_key(workdir):
  with pytest.raises(ValueError) as e:
    train(workdir, total_steps=6, **{"optim.name": "sgd"})
  message = str(e.value)
  assert "optim.name: 'adamw' -> 'sgd'" in message and "\n" not in message
  assert len(message) < 800, message
  assert steps_on_disk(workdir) == [2, 4]      # not taken for damage


def test_architecture_change_names_only_the_changed_keys():
  meta = config_lib.checkpoint_meta(tiny(), 4)
  with pytest.raises(ValueError) as e:
    config_lib.check_resume_compatible(meta, tiny(**{"model.width": 32, "decoder.depth": 2}))
  assert "(decoder.depth: 1 -> 2; model.width: 0 -> 32)" in str(e.value)


# ------------------------------------------------------------ 11: metrics.jsonl


def test_metrics_after_a_kill_have_one_record_per_step(workdir):
  # A kill after step 4 was logged but before its checkpoint: the rerun
  # resumes from 2 and logs 3 and 4 again.
  shutil.rmtree(workdir / "checkpoints" / "4")
  with open(workdir / "metrics.jsonl", "a") as f:
    f.write('{"step": 5, "loss": 1.')                     # torn by the kill
  train(workdir, total_steps=4, checkpoint_every_steps=2)
  assert [r["step"] for r in records(workdir)] == [1, 2, 3, 4]


def test_first_window_after_a_resume_covers_the_steps_it_says(tmp_path):
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  common = dict(total_steps=6, log_every_steps=3, checkpoint_every_steps=4)
  train(straight, **common)
  train(resumed, stop_after_steps=4, **common)          # stops at 4, window 4..6 cut
  train(resumed, **common)
  a = {r["step"]: r for r in records(straight)}
  b = {r["step"]: r for r in records(resumed)}
  assert sorted(a) == sorted(b) == [3, 6]
  for key in ("loss", "grad_norm", "learning_rate"):
    np.testing.assert_allclose(b[6][key], a[6][key], rtol=1e-5)


def test_a_resumed_run_with_an_ema_equals_the_uninterrupted_one(tmp_path):
  """The EMA of the parameters is checkpointed with the state: stopped and
  resumed, a run ends with the same losses, parameters and EMA, bit for bit."""
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  common = {"total_steps": 6, "checkpoint_every_steps": 4, "ema_decay": 0.9}
  train(straight, **common)
  train(resumed, stop_after_steps=3, **common)          # a checkpoint at 3
  train(resumed, **common)
  a = {r["step"]: r["loss"] for r in records(straight)}
  b = {r["step"]: r["loss"] for r in records(resumed)}
  assert a == b and sorted(a) == list(range(1, 7))
  for use_ema in (False, True):
    want, _ = checkpoint_lib.restore_params(str(straight), use_ema=use_ema)
    got, meta = checkpoint_lib.restore_params(str(resumed), use_ema=use_ema)
    assert meta["step"] == 6 and meta["restored_weights"] == ("ema" if use_ema else "params")
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_nonfinite_error_names_the_step_as_logged(tmp_path):
  class NaN(pretrain.PretrainTrainer):
    def loss_fn(self, model, params, model_state, batch, rng, train):
      loss, aux = super().loss_fn(model, params, model_state, batch, rng, train)
      return loss * np.nan, aux

  with pytest.raises(loop.NonFiniteError, match="non-finite loss or gradient norm at step 1 "):
    train(tmp_path, NaN, total_steps=3)
  assert records(tmp_path)[0]["step"] == 1 and records(tmp_path)[0]["loss"] is None


# -------------------------------------------- 12: surplus checkpoints go


def test_surplus_checkpoints_are_removed_at_start_up(workdir):
  # A kill between the commit of 4 and keep-N's clean-up left a third.
  shutil.copytree(workdir / "checkpoints" / "2", workdir / "checkpoints" / "1")
  train(workdir, total_steps=4, checkpoint_every_steps=2, keep_checkpoints=2)
  assert steps_on_disk(workdir) == [2, 4]
  train(workdir, total_steps=4, checkpoint_every_steps=2, keep_checkpoints=1)
  assert steps_on_disk(workdir) == [4]


def test_sigterm_during_a_save_waits_for_the_save(tmp_path):               # 2
  # SIGTERM (a preemption) raises Terminated, but only once the checkpoint
  # save under way has started cleanly; the loop's clean-up then finishes it.
  from darl_jax import interrupts
  old_term, old_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  interrupts.install()
  try:
    ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "ck"))
    saved = []
    real_save = ckpt._save

    def save_hit_by_sigterm(*args):
      os.kill(os.getpid(), signal.SIGTERM)      # arrives in the middle of the save
      time.sleep(0.05)
      saved.append(real_save(*args))
      return saved[-1]
    ckpt._save = save_hit_by_sigterm
    with pytest.raises(interrupts.Terminated):
      with ckpt:
        ckpt.save(1, {"w": jax.numpy.ones((256, 256))}, {"step": 1})
        raise AssertionError("not reached: Terminated is raised when save returns")
    assert saved == [True]
    assert os.listdir(tmp_path / "ck") == ["1"]
    with pytest.raises(interrupts.Terminated):        # outside a save: at once
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(1)
  finally:
    signal.signal(signal.SIGTERM, old_term)
    signal.signal(signal.SIGINT, old_int)


# ----------------------- every shipped config passes the checks main.py applies


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "experiments").glob("*.py")))
def test_every_experiment_config_passes_validation(name):
  config = runpy.run_path(str(ROOT / "experiments" / name))["get_config"](None)
  config_lib.validate(config)


def test_decoder_depth_zero_is_the_linear_decoder_and_valid():
  # The patch_decoder study's depth-0 column; validation once refused it.
  config_lib.validate(tiny(**{"decoder.kind": "transformer", "decoder.depth": 0}))
  with pytest.raises(config_lib.ConfigError, match=r"set --config.decoder.depth=1"):
    config_lib.validate(tiny(**{"decoder.depth": -1}))
