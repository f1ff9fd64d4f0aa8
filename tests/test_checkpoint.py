"""Tests for darl_jax.checkpoint (Orbax CheckpointManager wrapper)."""

import errno
import glob
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from darl_jax import checkpoint as checkpoint_lib
from darl_jax.checkpoint import (DAMAGED_DIR, CheckpointDamagedError, Checkpointer,
                                 CheckpointReadError, CheckpointWriteError, StateMismatchError,
                                 numbered, read_failure, read_meta, restore_params)
from xla_env import cpu_devices_flags

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[1])


def _make_state(seed=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  params = {
      "dense": {"kernel": jax.random.normal(k1, (4, 3)),
                "bias": jnp.zeros((3,))},
      "embed": jax.random.normal(k2, (5, 2)).astype(jnp.bfloat16),
  }
  tx = optax.adamw(1e-3)
  opt_state = tx.init(params)
  # One real update so the Adam moments are not all zeros.
  grads = jax.tree.map(jnp.ones_like, params)
  _, opt_state = tx.update(grads, opt_state, params)
  return {"params": params, "opt_state": opt_state,
          "step": jnp.asarray(7, jnp.int32)}


def _abstract(state):
  """ShapeDtypeStructs carrying the arrays' shardings, as the loop builds."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state)


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


META = {"step": 7, "data": {"epoch": 1, "position": 1234},
        "rng": {"seed": 42}, "config_hash": "abc123", "lr": 1e-3,
        "shape": [28, 28, 1]}


def test_round_trip_with_optax_state_and_meta(tmp_path):
  state = _make_state()
  ckpt = Checkpointer(str(tmp_path / "checkpoints"), async_save=True)
  assert ckpt.latest_step() is None
  assert ckpt.save(7, state, META)
  ckpt.close()

  # A fresh Checkpointer, as in a resumed process, reads from disk only.
  ckpt = Checkpointer(str(tmp_path / "checkpoints"))
  assert ckpt.latest_step() == 7
  restored, meta = ckpt.restore(None, _abstract(state))
  _assert_trees_equal(restored, state)
  # optax namedtuples (ScaleByAdamState, ...) are rebuilt from the target.
  assert type(restored["opt_state"][0]) is type(state["opt_state"][0])
  assert restored["opt_state"][0].count == 1
  assert meta == META
  assert ckpt.restore_meta(7) == META
  assert ckpt.restore_meta(None) == META
  ckpt.close()


def test_restore_onto_named_sharding(tmp_path):
  x = jnp.arange(24.0).reshape(8, 3)
  ckpt = Checkpointer(str(tmp_path / "ck"), async_save=False)
  ckpt.save(1, {"x": x}, {})
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  sharding = NamedSharding(mesh, P("data", None))
  target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}
  restored, meta = ckpt.restore(1, target)
  assert isinstance(restored["x"], jax.Array)
  assert restored["x"].sharding == sharding
  np.testing.assert_array_equal(restored["x"], x)
  assert meta == {}
  ckpt.close()


_RESHARD_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from darl_jax.checkpoint import Checkpointer
    assert jax.device_count() == 2, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4),
                       NamedSharding(mesh, P("data", None)))
    ckpt = Checkpointer(sys.argv[1], async_save=True)
    ckpt.save(3, {"params": {"x": x}}, {"n": 2})
    ckpt.wait()
    for spec in (P(None, "data"), P()):
      target = {"params": {"x": jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=NamedSharding(mesh, spec))}}
      got, meta = ckpt.restore(3, target)
      assert got["params"]["x"].sharding.spec == spec, got["params"]["x"].sharding
      np.testing.assert_array_equal(got["params"]["x"], np.arange(32.0).reshape(8, 4))
      assert meta == {"n": 2}
    ckpt.close()
    print("RESHARD_OK")
""")


def _child_env(**extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT)
  env.update(extra)
  return env


def test_reshard_across_devices_and_load_on_other_topology(tmp_path):
  """Saved on 2 (virtual) devices, restored with other specs and on 1 device."""
  d = tmp_path / "wd" / "checkpoints"
  env = _child_env(XLA_FLAGS=cpu_devices_flags(2))
  proc = subprocess.run([sys.executable, "-c", _RESHARD_SCRIPT, str(d)],
                        env=env, capture_output=True, text=True, timeout=120)
  assert "RESHARD_OK" in proc.stdout, proc.stderr[-3000:]
  params, meta = restore_params(str(tmp_path / "wd"))
  np.testing.assert_array_equal(params["x"], np.arange(32.0).reshape(8, 4))
  assert meta == {"n": 2, "restored_weights": "params"}


def test_async_save_then_wait_is_visible_to_other_readers(tmp_path):
  d = tmp_path / "ck"
  ckpt = Checkpointer(str(d), async_save=True)
  state = {"w": jnp.ones((256, 256))}
  assert ckpt.save(5, state, {"step": 5})
  ckpt.wait()
  assert (d / "5" / "state").is_dir()
  assert not glob.glob(str(d / "*tmp*"))
  other = Checkpointer(str(d))
  assert other.latest_step() == 5
  restored, _ = other.restore(5, _abstract(state))
  _assert_trees_equal(restored, state)
  other.close()
  ckpt.close()


def test_max_to_keep_keeps_last_n(tmp_path):
  d = tmp_path / "ck"
  ckpt = Checkpointer(str(d), max_to_keep=2, async_save=True)
  for step in range(1, 6):
    assert ckpt.save(step, {"x": jnp.full((3,), step)}, {"step": step})
  ckpt.wait()
  assert ckpt.all_steps() == [4, 5]
  assert sorted(p.name for p in d.iterdir() if p.name.isdigit()) == ["4", "5"]
  restored, meta = ckpt.restore(4, {"x": jax.ShapeDtypeStruct((3,), jnp.int32)})
  np.testing.assert_array_equal(restored["x"], [4, 4, 4])
  assert meta == {"step": 4}
  ckpt.close()


def test_empty_dir_and_missing_step(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ck"))
  assert ckpt.latest_step() is None
  with pytest.raises(FileNotFoundError):
    ckpt.restore(None, {"x": jax.ShapeDtypeStruct((3,), jnp.float32)})
  ckpt.save(1, {"x": jnp.zeros(3)}, {})
  with pytest.raises(FileNotFoundError, match="step 2"):
    ckpt.restore_meta(2)
  ckpt.close()


def test_saving_existing_step_is_skipped(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ck"), async_save=True)
  assert ckpt.save(10, {"x": jnp.ones(3)}, {"v": 1})
  # Same step again (e.g. periodic save and final save coincide): no crash,
  # and the first checkpoint is left untouched -- also with force=True.
  assert not ckpt.save(10, {"x": jnp.zeros(3)}, {"v": 2})
  assert not ckpt.save(10, {"x": jnp.zeros(3)}, {"v": 2}, force=True)
  ckpt.wait()
  got, meta = ckpt.restore(10, {"x": jax.ShapeDtypeStruct((3,), jnp.float32)})
  np.testing.assert_array_equal(got["x"], np.ones(3))
  assert meta == {"v": 1}
  ckpt.close()


def test_meta_must_be_json(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ck"))
  with pytest.raises(TypeError, match="JSON"):
    ckpt.save(1, {"x": jnp.ones(3)}, {"bad": object()})
  assert ckpt.latest_step() is None
  ckpt.close()


_KILLED_CHILD = textwrap.dedent("""
    import sys, time
    import jax, jax.numpy as jnp
    from darl_jax.checkpoint import Checkpointer
    directory, n = sys.argv[1], int(sys.argv[2])
    ckpt = Checkpointer(directory, async_save=True)
    ckpt.save(1, {"x": jnp.arange(8.0)}, {"step": 1})
    ckpt.wait()
    big = {f"x{i}": jnp.full((n,), i, jnp.float32) for i in range(4)}
    jax.block_until_ready(big)
    ckpt.save(2, big, {"step": 2})
    ckpt.wait()
    time.sleep(120)  # Only the test's SIGKILL ends this process.
""")


def _run_and_kill_during_step2(d, n):
  """Returns True if the kill landed while step 2 was still being written."""
  proc = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, str(d), str(n)],
                          env=_child_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
  try:
    deadline = time.monotonic() + 90
    while True:
      # Wait until files appear inside the tmp directory's items, so the kill
      # leaves a genuinely partial checkpoint (not just an empty directory).
      partial = glob.glob(str(d / "2.orbax-checkpoint-tmp*" / "*" / "*"))
      if partial or (d / "2").exists():
        break
      if proc.poll() is not None:
        raise AssertionError(f"child exited early: {proc.stderr.read()[-3000:]}")
      if time.monotonic() > deadline:
        raise AssertionError("step 2 save never started")
      time.sleep(0.001)
    os.kill(proc.pid, signal.SIGKILL)
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait()
  assert proc.returncode == -signal.SIGKILL
  return not (d / "2").exists()


def test_killed_run_resumes_from_last_complete_checkpoint(tmp_path):
  # ~200 MB first; if the write happened to finish before the kill landed,
  # retry with bigger arrays (the write window grows, the poll latency not).
  interrupted = False
  for attempt, n in enumerate((12_500_000, 50_000_000, 100_000_000)):
    d = tmp_path / f"attempt{attempt}" / "checkpoints"
    if _run_and_kill_during_step2(d, n):
      interrupted = True
      break
  ckpt = Checkpointer(str(d))
  abstract = {"x": jax.ShapeDtypeStruct((8,), jnp.float32)}
  if interrupted:
    assert ckpt.latest_step() == 1
    state, meta = ckpt.restore(None, abstract)
    np.testing.assert_array_equal(state["x"], np.arange(8.0))
    assert meta == {"step": 1}
    # The resumed run can write step 2 again; the stale tmp dir is gone.
    assert ckpt.save(2, {"x": jnp.ones(8)}, {"step": 2})
    ckpt.wait()
    assert ckpt.latest_step() == 2
    assert not glob.glob(str(d / "*orbax-checkpoint-tmp*"))
  else:
    # The kill never landed mid-write (extremely fast storage): step 2 must
    # then be a checkpoint Orbax considers complete, and readable.
    assert ckpt.latest_step() == 2
    assert ckpt.restore_meta(None) == {"step": 2}
  ckpt.close()


@pytest.fixture(name="workdir")
def _workdir(tmp_path):
  wd = tmp_path / "run"
  state = _make_state(seed=1)
  ckpt = Checkpointer(str(wd / "checkpoints"), async_save=False)
  ckpt.save(100, state, {"step": 100})
  state2 = jax.tree.map(lambda x: x + 1 if x.dtype != jnp.int32 else x, state)
  ckpt.save(200, state2, {"step": 200})
  ckpt.close()
  return wd, state, state2


def test_restore_params_from_workdir_and_step_dir(workdir):
  wd, state, state2 = workdir
  params, meta = restore_params(str(wd))  # latest
  assert meta == {"step": 200, "restored_weights": "params"}
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params))
  _assert_trees_equal(params, state2["params"])
  assert params["embed"].dtype == jnp.bfloat16

  params, meta = restore_params(str(wd), step=100)
  assert meta == {"step": 100, "restored_weights": "params"}
  _assert_trees_equal(params, state["params"])

  params, meta = restore_params(str(wd / "checkpoints" / "100"))
  assert meta == {"step": 100, "restored_weights": "params"}
  _assert_trees_equal(params, state["params"])

  params, meta = restore_params(str(wd / "checkpoints"))
  assert meta == {"step": 200, "restored_weights": "params"}

  with pytest.raises(FileNotFoundError, match="step 300 not found"):
    restore_params(str(wd), step=300)


def test_restore_params_error_on_empty_or_missing_dir(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError) as e:
    restore_params(str(empty))
  assert f"no DARL checkpoint found under {empty}" in str(e.value)
  assert "checkpoints/<step>/" in str(e.value)
  (empty / "checkpoints").mkdir()
  with pytest.raises(FileNotFoundError, match="no DARL checkpoint found"):
    restore_params(str(empty))
  with pytest.raises(FileNotFoundError, match="no DARL checkpoint found"):
    restore_params(str(tmp_path / "does_not_exist"))


def test_restore_params_requires_params_key(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
  ckpt.save(1, {"weights": jnp.ones(2)}, {})
  ckpt.close()
  with pytest.raises(KeyError, match="no 'params'"):
    restore_params(str(tmp_path))


# ---------------------------------------------- damaged checkpoints (issue 34)


def _truncate(path):
  for f in path.iterdir():
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _zero(path):
  for f in (path.iterdir() if path.is_dir() else [path]):
    f.write_bytes(b"\0" * f.stat().st_size)


def _remove(path):
  shutil.rmtree(path) if path.is_dir() else path.unlink()


def _empty(step_dir):
  for p in step_dir.iterdir():
    _remove(p)


# How a committed checkpoint gets damaged: a disk error or a copy cut short
# (truncated or zeroed data), files deleted by hand, a save whose files never
# arrived (an empty step folder).
DAMAGE = {
    "truncated data": lambda s: _truncate(s / "state" / "d"),
    "zeroed data": lambda s: _zero(s / "state" / "d"),
    "no data file": lambda s: _remove(s / "state" / "d"),
    "no manifest": lambda s: _remove(s / "state" / "manifest.ocdbt"),
    "zeroed manifest": lambda s: _zero(s / "state" / "manifest.ocdbt"),
    "no _METADATA": lambda s: _remove(s / "state" / "_METADATA"),
    "zeroed _METADATA": lambda s: _zero(s / "state" / "_METADATA"),
    "no meta item": lambda s: _remove(s / "meta"),
    "zeroed meta": lambda s: _zero(s / "meta" / "metadata"),
    "no state item": lambda s: _remove(s / "state"),
    "empty step folder": _empty,
}


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory):
  d = tmp_path_factory.mktemp("three") / "checkpoints"
  with Checkpointer(str(d)) as ckpt:
    for step in (1, 2, 3):
      ckpt.save(step, {**_make_state(step), "step": jnp.asarray(step, jnp.int32)},
                {"step": step})
  return d


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_restore_walks_back_past_a_damaged_newest_checkpoint(three_checkpoints, tmp_path,
                                                            damage, caplog):
  d = tmp_path / "checkpoints"
  shutil.copytree(three_checkpoints, d)
  DAMAGE[damage](d / "3")
  expected = _make_state(2)

  # Readers skip it (and leave it where it is) ...
  params, meta = restore_params(str(tmp_path))
  assert meta == {"step": 2, "restored_weights": "params"}
  _assert_trees_equal(params, jax.device_get(expected["params"]))
  assert (d / "3").exists()
  with pytest.raises(CheckpointDamagedError, match=f"{d}/3 is damaged"):
    restore_params(str(tmp_path), step=3)

  # ... the training run restores the previous one and moves the damaged one
  # aside, so that it no longer counts for keep-N.
  ckpt = Checkpointer(str(d))
  step, state, meta = ckpt.restore_newest(_abstract({**expected, "step": expected["step"]}))
  assert (step, meta) == (2, {"step": 2})
  _assert_trees_equal(state["params"], expected["params"])
  assert ckpt.all_steps() == [1, 2] and not (d / "3").exists()
  assert (tmp_path / DAMAGED_DIR / "3" / "DAMAGED.txt").exists()
  assert "skipped the damaged checkpoint at step 3" in caplog.text
  ckpt.close()


def test_a_state_that_does_not_fit_is_not_damage(three_checkpoints, tmp_path):
  d = tmp_path / "checkpoints"
  shutil.copytree(three_checkpoints, d)
  state = _make_state()
  sgd = {**state, "opt_state": optax.sgd(0.1, momentum=0.9).init(state["params"])}
  ckpt = Checkpointer(str(d))
  with pytest.raises(StateMismatchError, match=(
      r"only in the checkpoint: opt_state/0/count, opt_state/0/mu/\* \(3\), "
      r"opt_state/0/nu/\* \(3\); only in this run: opt_state/0/trace/\* \(3\)")):
    ckpt.restore_newest(_abstract(sgd))
  # A config check that refuses is not damage either.
  with pytest.raises(ValueError, match="refused"):
    ckpt.restore_newest(_abstract(state), lambda meta: (_ for _ in ()).throw(
        ValueError("refused")))
  assert ckpt.all_steps() == [1, 2, 3]
  ckpt.close()


def test_prune_removes_checkpoints_beyond_keep(three_checkpoints, tmp_path):
  d = tmp_path / "checkpoints"
  shutil.copytree(three_checkpoints, d)
  ckpt = Checkpointer(str(d), max_to_keep=2)
  assert ckpt.prune(2) == [1]
  assert ckpt.all_steps() == [2, 3] and sorted(os.listdir(d)) == ["2", "3"]
  ckpt.close()


def test_an_error_during_an_async_save_leaves_the_previous_checkpoints(tmp_path):
  d = tmp_path / "ck"
  with pytest.raises(RuntimeError, match="boom"):
    with Checkpointer(str(d), max_to_keep=2) as ckpt:
      for step in (1, 2):
        ckpt.save(step, {"w": jnp.full((512, 512), step)}, {"step": step})
      raise RuntimeError("boom")           # while the save of 2 is in flight
  assert sorted(os.listdir(d)) == ["1", "2"]
  # A save that fails itself is removed, and the earlier ones stay.
  ckpt = Checkpointer(str(d), max_to_keep=3)
  ckpt.save(3, {"w": jnp.full((512, 512), 3)}, {"step": 3})
  real_wait = ckpt._manager.wait_until_finished

  def save_fails():
    # What a save that fails in its background thread leaves: no commit.
    real_wait()
    os.rename(d / "3", d / "3.orbax-checkpoint-tmp-1")
    raise OSError("disk full")
  ckpt._manager.wait_until_finished = save_fails
  ckpt.finish_or_abandon()
  assert sorted(os.listdir(d)) == ["1", "2"]


# ----------------------------- damage, interruption and transient errors


def _read_fails(monkeypatch, ckpt, errors, step=3):
  """``ckpt``'s reads of ``step``'s state raise ``errors`` one by one, then
  read; returns the list of attempts."""
  attempts = []
  real = ckpt._manager.restore

  def restore(s, *args, **kwargs):
    if s == step and "state" in str(kwargs.get("args", args)):
      attempts.append(s)
      if errors:
        raise errors.pop(0)
    return real(s, *args, **kwargs)
  monkeypatch.setattr(ckpt._manager, "restore", restore)
  return attempts


def test_a_signal_during_a_restore_moves_nothing(three_checkpoints, tmp_path, monkeypatch):
  from darl_jax import interrupts
  d = tmp_path / "checkpoints"
  shutil.copytree(three_checkpoints, d)
  ckpt = Checkpointer(str(d))
  _read_fails(monkeypatch, ckpt, [interrupts.Terminated(), KeyboardInterrupt()])
  for signal_raised in (interrupts.Terminated, KeyboardInterrupt):
    with pytest.raises(signal_raised):
      ckpt.restore_newest(_abstract(_make_state(3)))
    assert ckpt.all_steps() == [1, 2, 3] and not (tmp_path / DAMAGED_DIR).exists()
  # Nor while the state's metadata is read, whose failure the restore then
  # judges: a signal there is neither damage nor a reason to read on.
  real = ckpt._manager.item_metadata

  def item_metadata(step):
    raise interrupts.Terminated()
  monkeypatch.setattr(ckpt._manager, "item_metadata", item_metadata)
  with pytest.raises(interrupts.Terminated):
    ckpt.restore_newest(_abstract(_make_state(3)))
  assert ckpt.all_steps() == [1, 2, 3] and not (tmp_path / DAMAGED_DIR).exists()
  monkeypatch.setattr(ckpt._manager, "item_metadata", real)
  ckpt.close()


@pytest.mark.parametrize("error", [
    OSError(errno.EIO, "Input/output error"),
    TimeoutError("read timed out"),
    ValueError("UNAVAILABLE: Error reading \"state/d/x\": HTTP response code: 503 "
               "[tensorstore_spec='{\"driver\": \"gcs\"}']"),
])
def test_a_transient_read_error_is_retried_then_stops_the_run_moving_nothing(
    three_checkpoints, tmp_path, monkeypatch, caplog, error):
  d = tmp_path / "checkpoints"
  shutil.copytree(three_checkpoints, d)
  ckpt = Checkpointer(str(d), read_retry_delays=(0.01, 0.01, 0.01))
  # Fails twice, then reads: the newest checkpoint restores.
  attempts = _read_fails(monkeypatch, ckpt, [error, error])
  step, state, _ = ckpt.restore_newest(_abstract(_make_state(3)))
  assert step == 3 and len(attempts) == 3 and "retrying in 0.01 s" in caplog.text
  # Fails on every attempt: one error line, nothing moved.
  ckpt = Checkpointer(str(d), read_retry_delays=(0.01, 0.01, 0.01))
  _read_fails(monkeypatch, ckpt, [error] * 10)
  with pytest.raises(CheckpointReadError, match=rf"cannot read the state of the checkpoint at "
                     rf"step 3 in {d}: a storage error persisted over 4 attempts .*Nothing was "
                     r"moved; rerun the same command once the storage answers") as e:
    ckpt.restore_newest(_abstract(_make_state(3)))
  assert "tensorstore_spec" not in str(e.value) and "\n" not in str(e.value)
  assert ckpt.all_steps() == [1, 2, 3] and not (tmp_path / DAMAGED_DIR).exists()
  ckpt.close()


def test_an_unknown_read_error_is_not_damage(three_checkpoints, tmp_path, monkeypatch):
  d = tmp_path / "checkpoints"
  shutil.copytree(three_checkpoints, d)
  ckpt = Checkpointer(str(d), read_retry_delays=(0.01,))
  attempts = _read_fails(monkeypatch, ckpt, [RuntimeError("INTERNAL: out of host memory")])
  with pytest.raises(CheckpointReadError, match=rf"cannot read the state of the checkpoint at "
                     rf"step 3 in {d}: RuntimeError: INTERNAL: out of host memory. Not a known "
                     rf"kind of damage, so it stays where it is: .* move {d}/3 into "
                     rf"{tmp_path}/{DAMAGED_DIR} to resume"):
    ckpt.restore_newest(_abstract(_make_state(3)))
  assert attempts == [3] and ckpt.all_steps() == [1, 2, 3]
  assert not (tmp_path / DAMAGED_DIR).exists()
  ckpt.close()


@pytest.mark.parametrize("error,kind", [
    (KeyError('Item "meta" was not found in the checkpoint. Available items: []'), "damage"),
    (ValueError("NOT_FOUND: Error opening \"zarr\" driver: Metadata at x does not exist"),
     "damage"),
    (ValueError("OUT_OF_RANGE: Requested byte range [0, 540) is not valid"), "damage"),
    (ValueError("DATA_LOSS: Error decoding manifest: Expected to start with hex bytes"),
     "damage"),
    (json.JSONDecodeError("Expecting value", "", 0), "damage"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory"), "damage"),
    (OSError(errno.EIO, "Input/output error"), "transient"),
    (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), "transient"),
    (ValueError("DEADLINE_EXCEEDED: reading gs://b/x"), "transient"),
    # A missing file behind an I/O error is not known to be missing.
    (ValueError("NOT_FOUND: Error reading x: Input/output error [os_error_code='5']"),
     "transient"),
    (ValueError("RESOURCE_EXHAUSTED: out of memory"), None),
    (ValueError("pytree structure error: different types at key path"), None),
    (RuntimeError("something else"), None),
])
def test_read_failures_are_damage_only_when_definite(error, kind):
  assert read_failure(error) == kind


def test_damaged_copies_are_numbered_never_overwritten(three_checkpoints, tmp_path):
  d = tmp_path / "checkpoints"
  shutil.copytree(three_checkpoints, d)
  for n in range(3):
    if n:
      shutil.copytree(three_checkpoints / "3", d / "3")
    (d / "3" / "meta" / "metadata").write_text(f"damaged {n}")
    ckpt = Checkpointer(str(d))
    assert ckpt.restore_newest(_abstract(_make_state(2)))[0] == 2
    ckpt.close()
  kept = tmp_path / DAMAGED_DIR
  assert sorted(os.listdir(kept)) == ["3", "3.1", "3.2"]
  assert [(kept / name / "meta" / "metadata").read_text() for name in ("3", "3.1", "3.2")] \
      == ["damaged 0", "damaged 1", "damaged 2"]
  assert numbered(kept / "metrics.jsonl") == kept / "metrics.jsonl"
  (kept / "metrics.jsonl").write_text("{}")
  assert numbered(kept / "metrics.jsonl") == kept / "metrics.1.jsonl"


# --------------------- the readers (restore_params, read_meta) sort errors too


def _reader_fails(monkeypatch, method, errors, step=3):
  """Every reader's ``ocp.CheckpointManager.<method>`` of ``step`` (for
  ``restore``: of the item the reader reads first, state or meta) raises
  ``errors`` one by one, then reads; returns the list of attempts."""
  import orbax.checkpoint as ocp
  attempts = []
  real = getattr(ocp.CheckpointManager, method)

  def read(self, s, *args, **kwargs):
    if s == step:
      attempts.append(s)
      if errors:
        raise errors.pop(0)
    return real(self, s, *args, **kwargs)
  monkeypatch.setattr(ocp.CheckpointManager, method, read)
  return attempts


_EIO = OSError(errno.EIO, "Input/output error")
_READERS = {
    "restore_params": lambda wd, **kw: restore_params(wd, **kw)[1]["step"],
    "read_meta": lambda wd, **kw: read_meta(wd, **kw)[0],
}


@pytest.mark.parametrize("reader", sorted(_READERS))
@pytest.mark.parametrize("method", ["restore", "item_metadata"])
def test_a_reader_retries_a_transient_error_and_never_falls_back_past_it(
    three_checkpoints, tmp_path, monkeypatch, caplog, reader, method):
  d = tmp_path / "checkpoints"
  shutil.copytree(three_checkpoints, d)
  read = _READERS[reader]
  # Fails once, then reads: the newest checkpoint, not the one before it.
  attempts = _reader_fails(monkeypatch, method, [_EIO])
  assert read(str(tmp_path), read_retry_delays=(0.01, 0.01)) == 3
  assert len(attempts) == 2 and "retrying in 0.01 s" in caplog.text
  assert "skipping" not in caplog.text
  # Fails on every attempt: one error, and no older step is read instead.
  monkeypatch.undo()
  attempts = _reader_fails(monkeypatch, method, [_EIO] * 10)
  with pytest.raises(CheckpointReadError, match=(
      rf"cannot read the .* of the checkpoint {d}/3: a storage error persisted over 3 "
      r"attempts .*No older checkpoint was read in its place; rerun the same command")) as e:
    read(str(tmp_path), read_retry_delays=(0.01, 0.01))
  assert e.value.transient and "\n" not in str(e.value) and len(attempts) == 3
  assert "skipping" not in caplog.text
  # The default waits come from READ_RETRY_DELAYS_S, read when called.
  monkeypatch.setattr(checkpoint_lib, "READ_RETRY_DELAYS_S", (0.01,))
  attempts.clear()
  with pytest.raises(CheckpointReadError, match="persisted over 2 attempts"):
    read(str(tmp_path))
  assert attempts == [3, 3] and sorted(os.listdir(d)) == ["1", "2", "3"]


@pytest.mark.parametrize("reader", sorted(_READERS))
def test_a_reader_stops_at_an_unknown_error_or_a_signal(three_checkpoints, tmp_path,
                                                       monkeypatch, caplog, reader):
  from darl_jax import interrupts
  d = tmp_path / "checkpoints"
  shutil.copytree(three_checkpoints, d)
  read = _READERS[reader]
  attempts = _reader_fails(monkeypatch, "restore", [
      RuntimeError("INTERNAL: out of host memory"), interrupts.Terminated(),
      KeyboardInterrupt()])
  with pytest.raises(CheckpointReadError, match=(
      rf"cannot read the .* of the checkpoint {d}/3: RuntimeError: INTERNAL: out of host "
      r"memory. Not a known kind of damage, so no older checkpoint is read in its place: "
      r"fix the cause and rerun, or ask for an earlier step \(--step of the export, "
      r"--config.init_step of a downstream job; steps here: 1, 2, 3\)$")) as e:
    read(str(tmp_path), read_retry_delays=(0.01,))
  assert not e.value.transient
  for signal_raised in (interrupts.Terminated, KeyboardInterrupt):
    with pytest.raises(signal_raised):
      read(str(tmp_path), read_retry_delays=(0.01,))
  assert attempts == [3, 3, 3] and "skipping" not in caplog.text
  assert sorted(os.listdir(d)) == ["1", "2", "3"]


@pytest.mark.parametrize("reader", sorted(_READERS))
@pytest.mark.parametrize("damage", ["zeroed meta", "no _METADATA", "no state item"])
def test_a_reader_skips_definite_damage_with_one_warning(three_checkpoints, tmp_path, caplog,
                                                        reader, damage):
  d = tmp_path / "checkpoints"
  shutil.copytree(three_checkpoints, d)
  DAMAGE[damage](d / "3")
  read = _READERS[reader]
  assert read(str(tmp_path), read_retry_delays=(0.01,)) == 2
  skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping")]
  assert len(skipped) == 1 and f"checkpoint {d}/3 is damaged: " in skipped[0], skipped
  assert "retrying" not in caplog.text and (d / "3").exists()
  with pytest.raises(CheckpointDamagedError, match=f"checkpoint {d}/3 is damaged"):
    read(str(tmp_path), step=3, read_retry_delays=(0.01,))


def test_the_export_stops_at_a_storage_error_instead_of_reading_an_older_step(
    three_checkpoints, tmp_path, monkeypatch):
  from darl_jax import export
  shutil.copytree(three_checkpoints, tmp_path / "checkpoints")
  monkeypatch.setattr(checkpoint_lib, "READ_RETRY_DELAYS_S", (0.01,))
  _reader_fails(monkeypatch, "restore", [_EIO] * 10)
  # Not turned into an ExportError about the checkpoint: the CLI reports the
  # storage error as it is, and writes nothing.
  with pytest.raises(CheckpointReadError, match="a storage error persisted over 2 attempts"):
    export.export(str(tmp_path), str(tmp_path / "out.safetensors"))
  assert not (tmp_path / "out.safetensors").exists()


# ------------------------------------------------------ failed writes


@pytest.mark.parametrize("error,cause", [
    (ValueError("RESOURCE_EXHAUSTED: Error writing \"w/0.0\" in OCDBT database: Failed to "
                "write 1803991 bytes to file 9: No space left on device [os_error_code='28'] "
                "[tensorstore_spec='{\"driver\": \"zarr\"}']"), "no space left on device"),
    (OSError(errno.EROFS, "Read-only file system"), "read-only file system"),
    (PermissionError(errno.EACCES, "Permission denied"), "permission denied"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota exceeded"),
])
def test_an_async_save_that_fails_names_its_cause_step_and_size_first(tmp_path, error, cause):
  d = tmp_path / "ck"
  ckpt = Checkpointer(str(d), max_to_keep=3)
  ckpt.save(1, {"w": jnp.ones((256, 256))}, {"step": 1})
  ckpt.save(2, {"w": jnp.ones((256, 256))}, {"step": 2})
  real_wait = ckpt._manager.wait_until_finished

  def save_fails():
    # What a save that fails in its background thread leaves: no commit.
    real_wait()
    if (d / "2").exists():
      os.rename(d / "2", d / "2.orbax-checkpoint-tmp-1")
      raise error
  ckpt._manager.wait_until_finished = save_fails
  # The failure of 2 surfaces at the next save (Orbax waits for the previous
  # one first): it names step 2, not 3.
  with pytest.raises(CheckpointWriteError) as e:
    ckpt.save(3, {"w": jnp.ones((256, 256))}, {"step": 3})
  assert str(e.value).startswith(f"{cause} writing the checkpoint of step 2 to {d} (about "
                                 "262 kB; "), str(e.value)
  assert " free): " in str(e.value) and "tensorstore_spec" not in str(e.value)
  ckpt.finish_or_abandon()
  assert sorted(os.listdir(d)) == ["1"]
