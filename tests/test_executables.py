"""Compiled programs saved and loaded by key (darl_jax/train/executables.py,
train/aot.py's Program): a match loads without compiling, anything that
changes the program changes the key, a broken file falls back to
compiling, and a rerun of the loop loads every program the first run saved."""

import json
import os
import pathlib
import subprocess
import sys
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import config_lib
from darl_jax.train import aot
from darl_jax.train import executables

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _program(directory, scale=1.0):
  # Each test compiles its own constant: the suite's persistent compilation
  # cache, shared by its workers, would otherwise hand a test the executable
  # another test compiled, and an XLA:CPU executable taken from that cache
  # fails at its first call once saved and reloaded (executables.py).
  f = jax.jit(lambda s, x: (s + scale * x.sum(), {"loss": x.mean()}), donate_argnums=(0,))
  args = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((4, 3), jnp.float32))
  return aot.Program("small step", f, args, directory / "k1.bin", info={"microbatch_size": 4})


class CompileCounter:
  def __init__(self, monkeypatch):
    self.calls = 0
    real = aot.compile_lowered

    def compile_lowered(lowered):
      self.calls += 1
      return real(lowered)

    monkeypatch.setattr(aot, "compile_lowered", compile_lowered)


def test_a_saved_program_loads_without_compiling_and_runs_the_same(tmp_path, monkeypatch):
  counter = CompileCounter(monkeypatch)
  first = _program(tmp_path)
  aot.compile_programs([first])
  assert counter.calls == 1 and "compile" in first.times and (tmp_path / "k1.bin").exists()
  second = _program(tmp_path)
  second.info = {}
  aot.compile_programs([second])
  assert counter.calls == 1 and "load" in second.times and "lower" not in second.times
  assert second.info == {"microbatch_size": 4}          # saved with it
  x = jnp.arange(12.0).reshape(4, 3)
  a, b = first.compiled(jnp.zeros(()), x), second.compiled(jnp.zeros(()), x)
  np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
  assert not list(tmp_path.glob(".*.tmp"))            # written atomically


def test_a_broken_file_is_removed_and_the_program_compiled(tmp_path, monkeypatch, caplog):
  (tmp_path / "k1.bin").write_bytes(b"not an executable")
  counter = CompileCounter(monkeypatch)
  program = _program(tmp_path, scale=5.0)
  aot.compile_programs([program])
  assert counter.calls == 1 and program.compiled is not None
  assert "did not load" in caplog.text
  # The broken file was replaced by a good one, which now loads.
  aot.compile_programs([_program(tmp_path, scale=5.0)])
  assert counter.calls == 1


def test_a_saved_file_of_another_program_is_recompiled_and_replaced(tmp_path, monkeypatch,
                                                                     caplog):
  """The file is named before tracing; the jaxpr saved inside decides: a
  program changed by what the name does not cover (here a constant of the
  function) compiles, runs its own arithmetic, and replaces the file."""
  counter = CompileCounter(monkeypatch)
  aot.compile_programs([_program(tmp_path, scale=6.0)])
  changed = _program(tmp_path, scale=2.0)
  aot.compile_programs([changed])
  assert counter.calls == 2 and "load" not in changed.times and "compile" in changed.times
  assert "compiled from another program" in caplog.text
  x = jnp.ones((4, 3))
  assert float(changed.compiled(jnp.zeros(()), x)[0]) == 24.0
  again = _program(tmp_path, scale=2.0)
  aot.compile_programs([again])                       # the replaced file is its own
  assert counter.calls == 2 and "load" in again.times
  assert float(again.compiled(jnp.zeros(()), x)[0]) == 24.0


def test_a_saved_program_loads_while_it_is_traced(tmp_path, monkeypatch):
  """The load is handed to the pool before the trace begins (a warm start
  waits for the longer of the two, not their sum)."""
  aot.compile_programs([_program(tmp_path, scale=7.0)])
  events, load_started = [], threading.Event()
  real_load, real_trace = aot.Program.load, aot.Program.trace

  def load(self):
    events.append("load starts")
    load_started.set()
    return real_load(self)

  def trace(self):
    load_started.wait(timeout=5)      # a load handed over before the trace has begun
    real_trace(self)
    events.append("trace ends")

  monkeypatch.setattr(aot.Program, "load", load)
  monkeypatch.setattr(aot.Program, "trace", trace)
  program = _program(tmp_path, scale=7.0)
  aot.compile_programs([program])
  assert "load" in program.times
  assert events.index("load starts") < events.index("trace ends")


def _mesh(kind="cpu", count=1):
  devices = np.array([types.SimpleNamespace(platform="cpu", device_kind=kind, id=i,
                                            process_index=0) for i in range(count)])
  return types.SimpleNamespace(devices=devices, shape={"data": count, "fsdp": 1, "tensor": 1})


def test_the_key_changes_with_config_code_devices_and_kernels(monkeypatch):
  c = config_lib.pretrain_config()
  base = executables.program_key(c, _mesh())
  assert executables.program_key(c, _mesh()) == base
  wider = c.copy_and_resolve_references()
  wider.model.width = 64
  assert executables.program_key(wider, _mesh()) != base
  seeded = c.copy_and_resolve_references()
  seeded.seed = 1                              # the step's base key is a constant
  assert executables.program_key(seeded, _mesh()) != base
  assert executables.program_key(c, _mesh(kind="NVIDIA H200")) != base
  assert executables.program_key(c, _mesh(count=2)) != base
  assert executables.program_key(c, _mesh(), kernels="hopper") != base
  monkeypatch.setattr(executables, "code_digest", lambda: "edited")
  assert executables.program_key(c, _mesh()) != base


def test_keys_that_do_not_reach_the_program_keep_the_key():
  c = config_lib.pretrain_config()
  base = executables.program_key(c, _mesh())
  other = c.copy_and_resolve_references()
  other.log_every_steps = 7
  other.checkpoint_every_steps = 9
  other.keep_checkpoints = 1
  other.tensorboard = False
  other.total_steps = 12345                    # the schedule is an input of the step
  other.optim.base_lr = 0.5
  other.optim.warmup_steps = 7
  assert executables.program_key(other, _mesh()) == base


def _cli(workdir, cache, *overrides, steps=2):
  """The training command on the tiny config, saved executables forced on,
  in a new process (a saved executable must load in another process)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", DARL_COMPILED_STEP_CACHE="1",
             JAX_COMPILATION_CACHE_DIR=str(cache),
             # XLA:CPU executables JAX took from its own persistent cache do
             # not run again once saved and reloaded (executables.py); a
             # program compiled afresh does. The cache keeps nothing here.
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="100000",
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                      os.environ.get("PYTHONPATH")])))
  done = subprocess.run(
      [sys.executable, "-m", "darl_jax.main",
       f"--config={ROOT}/tests/tiny_config.py:objective=diffusion,steps={steps}",
       f"--workdir={workdir}", "--config.eval_every_steps=2",
       "--config.checkpoint_every_steps=2", *overrides],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stderr


def _records(workdir):
  lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
  return [json.loads(line) for line in lines]


PROGRAMS = ("train step", "eval step", "init step", "picture")


def test_a_rerun_loads_every_program_the_first_run_saved_and_trains_the_same(tmp_path):
  cache = tmp_path / "cache"
  log = _cli(tmp_path / "a", cache)
  for name in PROGRAMS:
    assert f"start-up: {name}: trace" in log and f"saved the compiled {name} as" in log, name
  assert "start-up: saved 4 of 4 compiled programs beside the first steps" in log
  saved = sorted((cache / "executables").glob("*.bin"))
  assert len(saved) == len(PROGRAMS)
  # Another workdir, another cadence: the same programs, all loaded and run.
  log = _cli(tmp_path / "b", cache, "--config.keep_checkpoints=1")
  for name in PROGRAMS:
    line = next(l for l in log.splitlines() if f"start-up: {name}: " in l)
    assert ", load " in line and "compile" not in line, line
  assert "4 programs ready" in log and "(0 compiled, 1 at a time; 4 loaded)" in log
  assert (tmp_path / "b" / "predictions.png").exists()
  # The loaded programs compute what the compiled ones did.
  scores = lambda w: [(r["step"], r.get("loss"), r.get("val_loss"), r.get("param_norm"))
                      for r in _records(w)]
  assert scores(tmp_path / "b") == scores(tmp_path / "a")
  assert sorted((cache / "executables").glob("*.bin")) == saved


def test_deferred_saves_write_a_program_after_it_is_handed_over(tmp_path, monkeypatch):
  """defer_saves: a compiled program is handed back before its file is
  written (serialising and writing it is off the first step's path);
  waiting for the DeferredSaves writes it, and it then loads."""
  release = threading.Event()
  real_save = executables.save

  def save(path, compiled, info=None):
    assert release.wait(timeout=60)
    return real_save(path, compiled, info)

  monkeypatch.setattr(executables, "save", save)
  program = _program(tmp_path, scale=10.0)
  saves = aot.compile_programs([program], defer_saves=True)
  assert "compile" in program.times and saves is not None
  assert not (tmp_path / "k1.bin").exists()
  assert float(program.compiled(jnp.zeros(()), jnp.ones((4, 3)))[0]) == 120.0
  release.set()
  saves.wait()
  assert (tmp_path / "k1.bin").exists() and saves.saved == 1
  again = _program(tmp_path, scale=10.0)
  assert aot.compile_programs([again], defer_saves=True) is None     # loaded: nothing to save
  assert "load" in again.times
  # Without defer_saves nothing is left to a thread.
  assert aot.compile_programs([_program(tmp_path, scale=11.0)]) is None


def test_saved_executables_are_off_on_the_cpu_and_on_gpus_and_tpus(monkeypatch, tmp_path):
  c = config_lib.pretrain_config()
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("DARL_COMPILED_STEP_CACHE", raising=False)
  assert executables.cache_dir(c, "cpu") is None
  assert executables.cache_dir(c, "gpu") == tmp_path / "executables"
  assert executables.cache_dir(c, "tpu") == tmp_path / "executables"
  monkeypatch.setenv("DARL_COMPILED_STEP_CACHE", "1")
  assert executables.cache_dir(c, "cpu") == tmp_path / "executables"
  monkeypatch.setenv("DARL_COMPILED_STEP_CACHE", "0")
  assert executables.cache_dir(c, "gpu") is None
  monkeypatch.delenv("DARL_COMPILED_STEP_CACHE")
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
  c.compilation_cache_dir = ""                  # no cache, nothing saved
  assert executables.cache_dir(c, "gpu") is None


def test_each_evaluation_batch_has_a_saved_file_of_its_own(tmp_path, monkeypatch):
  """A saved program's file is named before tracing, from the config key and
  its arguments' layout: an evaluation batch the config key leaves out names
  a file of its own (no recompiling over one file), and each loads again."""
  sys.path.insert(0, str(ROOT / "tests"))
  import tiny_config  # pylint: disable=g-import-not-at-top
  from darl_jax.train import loop, pretrain, startup  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("DARL_COMPILED_STEP_CACHE", "1")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path))
  phases = []
  for size in (8, 16, 8):
    config = tiny_config.get_config("objective=mse,steps=2")
    config.predictions.num_images = 0
    config.eval_batch_size = size
    built = loop.setup(pretrain.PretrainTrainer(config), config)
    programs = startup.compile_programs(built, config, eval_step=True)
    phases.append(programs.info["programs"]["eval step"])
  assert len(list((tmp_path / "executables").glob("*.bin"))) == 3    # train + 2 evals
  assert "compile" in phases[0] and "compile" in phases[1] and "load" in phases[2]


def test_a_loaded_program_that_fails_at_its_first_call_is_removed_and_named(tmp_path):
  """An executable can deserialize and still not run (XLA:CPU's from JAX's
  own cache; a driver that no longer runs saved kernels): its first call
  removes the file and names the fix, so that the rerun compiles; an
  out-of-memory error is the program's own and passes unchanged."""
  # A constant of its own: compiled afresh, not taken from JAX's caches
  # (whose XLA:CPU executables fail after a reload, as below).
  aot.compile_programs([_program(tmp_path, scale=3.0)])
  loaded = _program(tmp_path, scale=3.0)
  aot.compile_programs([loaded])
  assert "load" in loaded.times and isinstance(loaded.compiled, executables.FirstCall)
  assert aot.footprint(loaded.compiled) is not None or jax.default_backend() != "gpu"
  x = jnp.ones((4, 3))
  assert float(loaded.compiled(jnp.zeros(()), x)[0]) == 36.0      # runs: kept

  def fails(message):
    def call(*args):
      raise RuntimeError(message)
    return call

  again = _program(tmp_path, scale=3.0)
  aot.compile_programs([again])
  again.compiled._compiled = fails("RESOURCE_EXHAUSTED: Out of memory")
  with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
    again.compiled(jnp.zeros(()), x)
  assert (tmp_path / "k1.bin").exists()
  again.compiled._compiled = fails("NOT_FOUND: Function wrapped_broadcast not found")
  with pytest.raises(executables.SavedProgramFailed,
                     match=r"k1\.bin loaded but failed at its first call.*run the command again"):
    again.compiled(jnp.zeros(()), x)
  assert not (tmp_path / "k1.bin").exists()
