"""Compiled programs saved and loaded by key (darl_jax/train/executables.py,
train/aot.py's Program): a match loads without compiling, anything that
changes the program changes the key, a broken file falls back to
compiling, and a rerun of the loop loads every program the first run saved.
Nothing in a file is unpickled, and a folder others can write is refused."""

import hashlib
import json
import os
import pathlib
import stat
import subprocess
import sys
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import config_lib
from darl_jax import interrupts
from darl_jax.train import aot
from darl_jax.train import fit
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
  aot.compile_all([first])
  assert counter.calls == 1 and "compile" in first.times and (tmp_path / "k1.bin").exists()
  second = _program(tmp_path)
  second.info = {}
  aot.compile_all([second])
  assert counter.calls == 1 and "load" in second.times and "lower" not in second.times
  assert second.info == {"microbatch_size": 4}          # saved with it
  x = jnp.arange(12.0).reshape(4, 3)
  a, b = first.compiled(jnp.zeros(()), x), second.compiled(jnp.zeros(()), x)
  np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
  assert not list(tmp_path.glob(".*.tmp"))            # written atomically


def test_a_program_with_an_array_it_mutates_inside_itself_loads(tmp_path, monkeypatch):
  # The Hopper attention kernels' backward pass writes into a jax.new_ref:
  # the train step's trace carries the effect, its compiled program does
  # not. Such a step was saved and then refused at every load (H100,
  # 2026-12-07: "the program has effects"), so a warm start compiled it.
  def step(s, x):
    ref = jax.new_ref(x)
    ref[...] = ref[...] * 3.0
    return s + ref[...].sum(), {"loss": x.mean()}

  def program():
    args = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((4, 3), jnp.float32))
    return aot.Program("ref step", jax.jit(step, donate_argnums=(0,)), args,
                       tmp_path / "k1.bin", info={})

  counter = CompileCounter(monkeypatch)
  first = program()
  aot.compile_all([first])
  assert first.traced.jaxpr.effects          # what the load used to refuse
  second = program()
  aot.compile_all([second])
  assert counter.calls == 1 and "load" in second.times, second.times
  x = jnp.arange(12.0).reshape(4, 3)
  assert float(second.compiled(jnp.zeros(()), x)[0]) == float(3 * x.sum())


def test_a_broken_file_is_removed_and_the_program_compiled(tmp_path, monkeypatch, caplog):
  (tmp_path / "k1.bin").write_bytes(b"not an executable")
  counter = CompileCounter(monkeypatch)
  program = _program(tmp_path, scale=5.0)
  aot.compile_all([program])
  assert counter.calls == 1 and program.compiled is not None
  assert "did not load" in caplog.text
  # The broken file was replaced by a good one, which now loads.
  aot.compile_all([_program(tmp_path, scale=5.0)])
  assert counter.calls == 1


def test_a_saved_file_of_another_program_is_recompiled_and_replaced(tmp_path, monkeypatch,
                                                                     caplog):
  """The file is named before tracing; the jaxpr saved inside decides: a
  program changed by what the name does not cover (here a constant of the
  function) compiles, runs its own arithmetic, and replaces the file."""
  counter = CompileCounter(monkeypatch)
  aot.compile_all([_program(tmp_path, scale=6.0)])
  changed = _program(tmp_path, scale=2.0)
  aot.compile_all([changed])
  assert counter.calls == 2 and "load" not in changed.times and "compile" in changed.times
  assert "compiled from another program" in caplog.text
  x = jnp.ones((4, 3))
  assert float(changed.compiled(jnp.zeros(()), x)[0]) == 24.0
  again = _program(tmp_path, scale=2.0)
  aot.compile_all([again])                       # the replaced file is its own
  assert counter.calls == 2 and "load" in again.times
  assert float(again.compiled(jnp.zeros(()), x)[0]) == 24.0


def test_a_saved_program_loads_while_it_is_traced(tmp_path, monkeypatch):
  """The file's read and XLA's deserialization of its bytes (Program.load)
  are handed to a thread before the trace begins and need nothing of it;
  only making it this run's program waits for the trace's jaxpr check."""
  aot.compile_all([_program(tmp_path, scale=7.0)])
  events, prepared = [], threading.Event()
  real_trace, real_prepare = aot.Program.trace, executables.prepare

  def prepare(saved):
    events.append("load starts")
    out = real_prepare(saved)
    events.append("deserialized")
    prepared.set()
    return out

  def trace(self):
    prepared.wait(timeout=5)      # deserialized before the trace has begun
    real_trace(self)
    events.append("trace ends")

  monkeypatch.setattr(executables, "prepare", prepare)
  monkeypatch.setattr(aot.Program, "trace", trace)
  program = _program(tmp_path, scale=7.0)
  aot.compile_all([program])
  assert "load" in program.times and "compile" not in program.times
  assert events == ["load starts", "deserialized", "trace ends"]


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
  saves = aot.compile_all([program], defer_saves=True)
  assert "compile" in program.times and saves is not None
  assert not (tmp_path / "k1.bin").exists()
  assert float(program.compiled(jnp.zeros(()), jnp.ones((4, 3)))[0]) == 120.0
  release.set()
  saves.wait()
  assert (tmp_path / "k1.bin").exists() and saves.saved == 1
  again = _program(tmp_path, scale=10.0)
  assert aot.compile_all([again], defer_saves=True) is None     # loaded: nothing to save
  assert "load" in again.times
  # Without defer_saves nothing is left to a thread.
  assert aot.compile_all([_program(tmp_path, scale=11.0)]) is None


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
  from darl_jax.train import loop  # pylint: disable=g-import-not-at-top
  from darl_jax.train import startup  # pylint: disable=g-import-not-at-top
  from darl_jax.train.trainers import pretrain  # pylint: disable=g-import-not-at-top
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
  aot.compile_all([_program(tmp_path, scale=3.0)])
  loaded = _program(tmp_path, scale=3.0)
  aot.compile_all([loaded])
  assert "load" in loaded.times and isinstance(loaded.compiled, executables.FirstCall)
  assert fit.footprint(loaded.compiled) is not None or jax.default_backend() != "gpu"
  x = jnp.ones((4, 3))
  assert float(loaded.compiled(jnp.zeros(()), x)[0]) == 36.0      # runs: kept

  def fails(message):
    def call(*args):
      raise RuntimeError(message)
    return call

  again = _program(tmp_path, scale=3.0)
  aot.compile_all([again])
  again.compiled._compiled = fails("RESOURCE_EXHAUSTED: Out of memory")
  with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
    again.compiled(jnp.zeros(()), x)
  assert (tmp_path / "k1.bin").exists()
  again.compiled._compiled = fails("NOT_FOUND: Function wrapped_broadcast not found")
  with pytest.raises(executables.SavedProgramFailed,
                     match=r"k1\.bin loaded but failed at its first call.*run the command again"):
    again.compiled(jnp.zeros(()), x)
  assert not (tmp_path / "k1.bin").exists()


# ------------------------------------------ the file: nothing in it is unpickled

class _WritesMarker:
  """A pickle that, once unpickled, writes ``marker`` (what a planted file
  would run)."""

  def __init__(self, marker):
    self.marker = str(marker)

  def __reduce__(self):
    return (pathlib.Path.write_text, (pathlib.Path(self.marker), "ran"))


def _header(path):
  data = path.read_bytes()
  size = int.from_bytes(data[len(executables.MAGIC):len(executables.MAGIC) + 8], "little")
  start = len(executables.MAGIC) + 8
  return json.loads(data[start:start + size]), data[start + size:]


def _write(path, header, payload):
  blob = json.dumps(header).encode()
  path.write_bytes(executables.MAGIC + len(blob).to_bytes(8, "little") + blob + payload)


def test_a_saved_file_is_a_plain_header_and_xla_bytes(tmp_path):
  aot.compile_all([_program(tmp_path, scale=12.0)])
  path = tmp_path / "k1.bin"
  assert path.read_bytes().startswith(executables.MAGIC)
  header, payload = _header(path)
  assert header["format"] == executables.FORMAT and header["key"] == "k1"
  assert header["info"] == {"microbatch_size": 4} and len(header["jaxpr"]) == 64
  assert header["payload_bytes"] == len(payload)
  assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_planted_pickle_never_runs_and_the_program_compiles(tmp_path, monkeypatch, caplog):
  """Neither a pickle in place of the file nor one behind a valid header
  (the right key and jaxpr, as a writer who knows the program could plant)
  is unpickled: the marker it would write never appears."""
  import pickle  # pylint: disable=g-import-not-at-top  # only to plant the file
  marker = tmp_path / "marker"
  evil = pickle.dumps(((_WritesMarker(marker), None, None), {}))
  counter = CompileCounter(monkeypatch)
  (tmp_path / "k1.bin").write_bytes(evil)
  program = _program(tmp_path, scale=13.0)
  with monkeypatch.context() as m:
    m.setattr(executables, "save", lambda *args: False)      # nothing replaces it yet
    aot.compile_all([program])
  assert counter.calls == 1 and "load" not in program.times and not marker.exists()
  assert "did not load" in caplog.text
  assert (tmp_path / "k1.bin").read_bytes() == evil           # not ours to delete
  # A valid header of this very program, and a pickle as its executable.
  aot.compile_all([_program(tmp_path, scale=13.0)])
  header, _ = _header(tmp_path / "k1.bin")
  header.update(payload_bytes=len(evil), payload_sha256=hashlib.sha256(evil).hexdigest())
  _write(tmp_path / "k1.bin", header, evil)
  caplog.clear()
  program = _program(tmp_path, scale=13.0)
  aot.compile_all([program])
  assert counter.calls == 3 and "compile" in program.times and not marker.exists()
  assert "did not load" in caplog.text
  assert float(program.compiled(jnp.zeros(()), jnp.ones((4, 3)))[0]) == 156.0


@pytest.mark.parametrize("damage", ["version", "key", "truncated", "json", "info"])
def test_a_malformed_file_is_ignored_with_one_line_and_kept(tmp_path, monkeypatch, caplog,
                                                             damage):
  aot.compile_all([_program(tmp_path, scale=14.0)])
  path = tmp_path / "k1.bin"
  header, payload = _header(path)
  if damage == "version":
    header["format"] = executables.FORMAT + 1
  elif damage == "key":
    header["key"] = "k2"
  elif damage == "info":
    header["info"] = "not a dict"
  _write(path, header, payload[:-10] if damage == "truncated" else payload)
  if damage == "json":
    path.write_bytes(executables.MAGIC + (5).to_bytes(8, "little") + b"{nope" + payload)
  planted = path.read_bytes()
  counter = CompileCounter(monkeypatch)
  program = _program(tmp_path, scale=14.0)
  monkeypatch.setattr(executables, "save", lambda *args: False)    # nothing replaces it
  aot.compile_all([program])
  assert counter.calls == 1 and "load" not in program.times
  assert caplog.text.count("did not load") == 1
  assert path.read_bytes() == planted


def test_a_file_of_another_jaxpr_never_becomes_the_program(tmp_path, monkeypatch, caplog):
  """The jaxpr's digest in the header is checked against this run's trace
  before the file's executable is made this run's program (XLA may have
  deserialized its bytes beside the trace; they are dropped)."""
  aot.compile_all([_program(tmp_path, scale=15.0)])
  path = tmp_path / "k1.bin"
  header, payload = _header(path)
  header["jaxpr"] = "0" * 64
  _write(path, header, payload)
  calls = []
  real = executables.deserialize
  monkeypatch.setattr(executables, "deserialize", lambda *a: calls.append(a) or real(*a))
  counter = CompileCounter(monkeypatch)
  program = _program(tmp_path, scale=15.0)
  aot.compile_all([program])
  assert not calls and counter.calls == 1 and "load" not in program.times
  assert "compiled from another program" in caplog.text
  again = _program(tmp_path, scale=15.0)                 # replaced by its own program
  aot.compile_all([again])
  assert len(calls) == 1 and "load" in again.times and counter.calls == 1


_SHARDED = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import dataclasses, pathlib
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from darl_jax.train import executables
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "fsdp"))
state = NamedSharding(mesh, P("fsdp", None))
batch = NamedSharding(mesh, P("data"))
f = jax.jit(lambda s, x, unused: (s * 2 + x.sum(), {"m": x.mean(), "w": s}),
            donate_argnums=(0,))
args = (jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=state),
        jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=batch),
        jax.ShapeDtypeStruct((3,), jnp.int32, sharding=NamedSharding(mesh, P())))
traced = f.trace(*args)
compiled = traced.lower().compile()
path = pathlib.Path(sys.argv[1]) / "sharded.bin"
assert executables.save(path, compiled, {executables.JAXPR_KEY: "j"})
saved = executables.prepare(executables.read(path))
loaded, info = executables.deserialize(saved, f.trace(*args))
a, b = compiled._executable._unloaded_executable, loaded._executable._unloaded_executable
for field in dataclasses.fields(a):
  if field.name != "xla_executable":
    assert getattr(a, field.name) == getattr(b, field.name), field.name
assert loaded.in_tree == compiled.in_tree and loaded.out_tree == compiled.out_tree
assert loaded.input_shardings == compiled.input_shardings
assert loaded.output_shardings == compiled.output_shardings
x = jax.device_put(jnp.arange(32.0).reshape(8, 4), batch)
s = lambda: jax.device_put(jnp.ones((8, 4)), state)
want, got = compiled(s(), x, jnp.zeros(3, jnp.int32)), loaded(s(), x, jnp.zeros(3, jnp.int32))
assert jax.tree.all(jax.tree.map(lambda u, v: bool((u == v).all()), want, got))
assert got[1]["w"].sharding == want[1]["w"].sharding
print("same")
"""


def test_a_sharded_program_is_rebuilt_as_it_was_compiled(tmp_path):
  """On a mesh of four (host) devices: every part of the executable JAX
  builds around XLA's bytes (shardings, layouts, avals, kept arguments) is
  rebuilt equal, from the header and this run's trace, and computes the
  same in the same layout."""
  (tmp_path / "ex").mkdir(mode=0o700)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                      os.environ.get("PYTHONPATH")])))
  done = subprocess.run([sys.executable, "-c", _SHARDED, str(tmp_path / "ex")], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0 and "same" in done.stdout, done.stderr[-3000:]


# ------------------------------------------------------------ the folder

def test_a_group_writable_folder_is_refused(tmp_path, monkeypatch, caplog):
  directory = tmp_path / "executables"
  directory.mkdir(mode=0o700)
  aot.compile_all([_program(directory, scale=16.0)])
  saved = (directory / "k1.bin").read_bytes()
  directory.chmod(0o770)
  counter = CompileCounter(monkeypatch)
  program = _program(directory, scale=16.0)
  aot.compile_all([program])
  assert counter.calls == 1 and "load" not in program.times
  assert caplog.text.count("can be written by its group or others") == 1
  assert (directory / "k1.bin").read_bytes() == saved           # nothing saved there
  # The cache folder above it counts too.
  directory.chmod(0o700)
  tmp_path.chmod(0o757)
  try:
    caplog.clear()
    config = config_lib.pretrain_config()
    monkeypatch.setenv("DARL_COMPILED_STEP_CACHE", "1")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path))
    assert executables.cache_dir(config, "gpu") is None
    assert "can be written by its group or others" in caplog.text
  finally:
    tmp_path.chmod(0o700)


def test_a_folder_of_another_user_is_refused(tmp_path, monkeypatch, caplog):
  """A folder that another user made (mkdir's exist_ok would take it) is
  refused, and nothing in it is read."""
  directory = tmp_path / "executables"
  directory.mkdir(mode=0o700)
  aot.compile_all([_program(directory, scale=17.0)])
  real = os.getuid()
  monkeypatch.setattr(os, "getuid", lambda: real + 1)
  counter = CompileCounter(monkeypatch)
  program = _program(directory, scale=17.0)
  aot.compile_all([program])
  assert counter.calls == 1 and "load" not in program.times
  assert caplog.text.count("belongs to another user") == 1
  monkeypatch.setenv("DARL_COMPILED_STEP_CACHE", "1")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "other"))
  assert executables.cache_dir(config_lib.pretrain_config(), "gpu") is None


def test_the_folder_is_created_for_its_user_alone(tmp_path, monkeypatch):
  monkeypatch.setenv("DARL_COMPILED_STEP_CACHE", "1")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "cache"))
  directory = executables.cache_dir(config_lib.pretrain_config(), "gpu")
  assert directory == tmp_path / "cache" / "executables"
  assert stat.S_IMODE(directory.stat().st_mode) == 0o700
  assert stat.S_IMODE(directory.parent.stat().st_mode) == 0o700


# ------------------------------------------------------------ the key

def test_the_key_changes_with_xla_flags_and_lowering_options(tmp_path, monkeypatch):
  """The same program under other XLA flags or JAX lowering options is
  filed under another name: the other run's file is never loaded."""
  c = config_lib.pretrain_config()
  monkeypatch.setattr(executables, "code_digest", lambda: "this code")  # flags alone change
  monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  base = executables.path_for(tmp_path, c, _mesh(), "train step")
  assert executables.path_for(tmp_path, c, _mesh(), "train step") == base
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=1")
  assert executables.path_for(tmp_path, c, _mesh(), "train step") != base
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_latency_hiding_scheduler=true")
  assert executables.path_for(tmp_path, c, _mesh(), "train step") != base
  monkeypatch.delenv("LIBTPU_INIT_ARGS")
  with jax.default_matmul_precision("highest"):
    assert executables.path_for(tmp_path, c, _mesh(), "train step") != base
  with jax.enable_x64(True) if hasattr(jax, "enable_x64") else jax.experimental.enable_x64():
    assert executables.path_for(tmp_path, c, _mesh(), "train step") != base
  assert executables.path_for(tmp_path, c, _mesh(), "train step") == base


def test_a_program_saved_under_other_xla_flags_is_not_loaded(tmp_path, monkeypatch):
  config = config_lib.pretrain_config()
  monkeypatch.setattr(executables, "code_digest", lambda: "this code")  # flags alone change
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  counter = CompileCounter(monkeypatch)

  def program():
    p = _program(tmp_path, scale=18.0)
    p.path = executables.path_for(tmp_path, config, _mesh(), "small step")
    return p

  aot.compile_all([program()])
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                     "--xla_cpu_use_thunk_runtime=true")
  other = program()
  aot.compile_all([other])
  assert counter.calls == 2 and "load" not in other.times
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  again = program()
  aot.compile_all([again])
  assert counter.calls == 2 and "load" in again.times


# ------------------------------------------------------------ a signal

@pytest.mark.parametrize("signal,scale", [(interrupts.Terminated, 19.0),
                                          (KeyboardInterrupt, 20.0)])
def test_a_signal_in_a_loaded_programs_first_call_passes_and_keeps_the_file(tmp_path, signal,
                                                                            scale):
  aot.compile_all([_program(tmp_path, scale=scale)])
  loaded = _program(tmp_path, scale=scale)
  aot.compile_all([loaded])
  assert isinstance(loaded.compiled, executables.FirstCall)

  def interrupted(*args):
    raise signal("stopped")

  real, loaded.compiled._compiled = loaded.compiled._compiled, interrupted
  with pytest.raises(signal):
    loaded.compiled(jnp.zeros(()), jnp.ones((4, 3)))
  assert (tmp_path / "k1.bin").exists()
  loaded.compiled._compiled = real                    # still its first call: runs, kept
  assert float(loaded.compiled(jnp.zeros(()), jnp.ones((4, 3)))[0]) == 12 * scale
  assert (tmp_path / "k1.bin").exists()
