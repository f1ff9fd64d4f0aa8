"""Compiled programs kept on disk and loaded by the next run of the same program.

JAX's persistent compilation cache keeps XLA's executable, but a run still
traces and lowers its programs (and builds its Pallas kernels) at every
start. Every program a run compiles at start-up (train and eval steps, the
state's initialisation, the closing picture: train/aot.py's Program) is
serialized (``jax.experimental.serialize_executable``) into
``<cache dir>/executables/<key>.bin``, and a rerun or resume whose key
matches loads it instead: no lowering or compiling.

The file's name is a digest of everything the program is built from,
known before it is traced, so that its load runs while the program is
traced: the resolved config less the keys that do not reach the program
(``NOT_PROGRAM_KEYS``: run length and cadence, where things are written;
``NOT_PROGRAM_OPTIM_KEYS``: the schedule's scalars, inputs of the step, or
literals of the jaxpr where a program reads them), the source of every
darl_jax module and of the trainer's class (custom gradient rules are not
in a jaxpr's text), the versions of jax, jaxlib and the libraries the step
calls, the devices (platform, kind, count, ids), the mesh, the kernels
chosen and the program's name. Inside the file is the digest of the traced
program's jaxpr (``JAXPR_KEY``); the loaded executable is used only where
this run's trace has the same (tracing takes seconds; it is lowering and
compiling that a match skips), so what the name misses (code outside
darl_jax, a library changed under the same version) recompiles, and the
new program replaces the file.

On by default where saved executables load in a new process and run: GPUs
(measured on an H200: a saved B/16 train step loaded in 1.7 s in a new
process and trained) and TPUs. Off by default on the CPU: with jax 0.10.2
an XLA:CPU executable that JAX took from its persistent compilation cache
serializes, deserializes in another process, and then fails at its first
call (``NOT_FOUND: Function wrapped_broadcast not found``, ``...fusion
not found``); one compiled afresh in the saving process runs again. A run
cannot tell the two apart, so the CPU compiles. ``DARL_COMPILED_STEP_CACHE=1``
turns it on anywhere, ``=0`` off anywhere. A file whose key differs is
never read; a file that fails to load (truncated, from another jaxlib that
kept the same version string, ...) is removed and the program compiled as
usual, with one log line. Files are written atomically, so a killed run
leaves none half-written.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import pickle
from importlib import metadata
from pathlib import Path
from typing import Callable

import jax
from absl import logging

PACKAGE = Path(__file__).resolve().parents[1]
# Config keys that do not reach the train step's program: run length and
# cadence, where things are written, and what is only read on the host.
NOT_PROGRAM_KEYS = ("total_steps", "total_epochs", "stop_after_steps", "log_every_steps",
                    "checkpoint_every_steps", "eval_every_steps", "eval_max_batches",
                    "keep_checkpoints", "compilation_cache_dir", "tensorboard", "profile",
                    "init_from", "init_step", "predictions", "skip_nonfinite",
                    "eval_batch_size", "preemption_signal", "preemption_deadline_s")
# The schedule's scalars: inputs of the loop's step (optim.Hyperparams), and
# where a program does read them (the probe grids' own optimizers) they are
# literals of its jaxpr, which is part of the key.
NOT_PROGRAM_OPTIM_KEYS = ("base_lr", "lr_scaling", "warmup_steps", "warmup_epochs",
                          "end_lr_fraction", "weight_decay")
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "jax-cuda12-plugin", "jax-cuda13-plugin",
             "libtpu")


def _version(name: str) -> str:
  try:
    return metadata.version(name)
  except metadata.PackageNotFoundError:
    return ""


def code_digest() -> str:
  """Digest of every darl_jax source file (what the step is traced from)."""
  h = hashlib.sha256()
  for path in sorted(PACKAGE.rglob("*.py")):
    h.update(str(path.relative_to(PACKAGE)).encode())
    h.update(path.read_bytes())
  return h.hexdigest()


def program_key(config, mesh, *, kernels="", extra=None) -> str:
  """The digest a compiled step is filed under (see the module docstring)."""
  resolved = json.loads(json.dumps(config.to_dict(), default=str))
  for key in NOT_PROGRAM_KEYS:
    resolved.pop(key, None)
  for key in NOT_PROGRAM_OPTIM_KEYS:
    resolved.get("optim", {}).pop(key, None)
  devices = mesh.devices.flat
  parts = {
      "config": resolved,
      "code": code_digest(),
      "libraries": {name: _version(name) for name in LIBRARIES},
      "devices": [(d.platform, d.device_kind, d.id, getattr(d, "process_index", 0))
                  for d in devices],
      "process_count": jax.process_count(),
      "mesh": {k: int(v) for k, v in mesh.shape.items()},
      "kernels": str(kernels),
      "extra": extra,
  }
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


# The entry of a saved executable's info that holds its jaxpr's digest.
JAXPR_KEY = "_jaxpr"


def jaxpr_digest(traced) -> str:
  """Digest of a traced step's jaxpr (``jitted.trace(...)``): any change of
  the program's operations, shapes or literal constants changes it. Array
  constants are not in its text; they come from the config, the other part
  of the key."""
  return hashlib.sha256(str(traced.jaxpr).encode()).hexdigest()


def trainer_digest(trainer) -> str:
  """The trainer's class and the source files of it and its bases (a
  researcher's own subclass lives outside darl_jax, and its loss is traced
  into the step)."""
  if trainer is None:
    return ""
  h = hashlib.sha256()
  for cls in type(trainer).__mro__:
    h.update(f"{cls.__module__}.{cls.__qualname__}".encode())
    try:
      h.update(Path(inspect.getsourcefile(cls)).read_bytes())
    except (TypeError, OSError):
      pass
  return h.hexdigest()


# Where saved executables are on unless DARL_COMPILED_STEP_CACHE says
# otherwise: the platforms whose executables run again in a new process
# (module docstring).
DEFAULT_ON = ("gpu", "cuda", "rocm", "tpu")


def enabled(platform: str) -> bool:
  """Whether saved executables are used on ``platform`` (a device's
  ``platform``): DARL_COMPILED_STEP_CACHE=1 / 0 forces it, else DEFAULT_ON."""
  forced = os.environ.get("DARL_COMPILED_STEP_CACHE", "")
  if forced in ("0", "1"):
    return forced == "1"
  return platform in DEFAULT_ON


def cache_dir(config, platform: str = "cpu") -> Path | None:
  """``<compilation_cache_dir>/executables`` ("" = off; a
  JAX_COMPILATION_CACHE_DIR environment variable wins, as for JAX's cache)
  where saved executables are :func:`enabled` on ``platform``; None where
  they are off or the cache is not a local path."""
  if not enabled(platform):
    return None
  path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or config.get("compilation_cache_dir", "")
  if not path or "://" in path:
    return None
  return Path(os.path.expanduser(path)) / "executables"


class SavedProgramFailed(RuntimeError):
  """A saved executable loaded but failed at its first call (removed)."""


class FirstCall:
  """A loaded executable whose first call, if it fails, removes the file and
  says so: a program that deserializes but does not run (an XLA:CPU one JAX
  took from its own cache; a driver that no longer runs the saved kernels)
  would otherwise fail every rerun the same way. Not retried in place: the
  arguments a train step donates may be gone. Everything else (memory
  analysis, ...) is the executable's."""

  def __init__(self, compiled, path: Path):
    self._compiled, self._path, self._ran = compiled, path, False

  def __call__(self, *args, **kwargs):
    if self._ran:
      return self._compiled(*args, **kwargs)
    try:
      out = self._compiled(*args, **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      if "RESOURCE_EXHAUSTED" in str(e):      # out of memory: the program is fine
        raise
      try:
        self._path.unlink()
      except OSError:
        pass
      raise SavedProgramFailed(
          f"the saved program {self._path} loaded but failed at its first call "
          f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); the file is removed: "
          "run the command again (it compiles the program; a run resumes from its "
          "checkpoint), or set DARL_COMPILED_STEP_CACHE=0 to compile every time") from e
    self._ran = True
    return out

  def __getattr__(self, name):
    return getattr(self._compiled, name)


def load(path: Path) -> tuple[object, dict] | None:
  """``(compiled step, info saved with it)`` from ``path``, or None (with
  one log line, and the file removed) where it does not load."""
  from jax.experimental import serialize_executable  # pylint: disable=g-import-not-at-top
  try:
    with open(path, "rb") as f:
      (payload, in_tree, out_tree), info = pickle.load(f)
    return FirstCall(serialize_executable.deserialize_and_load(payload, in_tree, out_tree),
                     path), info
  except Exception as e:  # pylint: disable=broad-except  # any failure: compile instead
    logging.warning("the saved program %s did not load (%s: %s); compiling it instead",
                    path, type(e).__name__, " ".join(str(e).split())[:200])
    try:
      path.unlink()
    except OSError:
      pass
    return None


def save(path: Path, compiled, info: dict | None = None) -> bool:
  """Writes ``compiled`` (and the plain-data ``info`` to hand back with it)
  to ``path`` atomically; False (logged) where the executable cannot be
  serialized or the file not written."""
  from jax.experimental import serialize_executable  # pylint: disable=g-import-not-at-top
  try:
    blob = pickle.dumps((serialize_executable.serialize(compiled), dict(info or {})))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
      f.write(blob)
    os.replace(tmp, path)
    return True
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("could not save the compiled program to %s (%s: %s)", path,
                    type(e).__name__, " ".join(str(e).split())[:200])
    return False


def path_for(directory: Path | None, config, mesh, name: str, *, kernels="", trainer=None,
             extra=None) -> Path | None:
  """``<directory>/<key>.bin``: the file the program ``name`` is saved as
  (``extra``: what else its program depends on), named before the program
  is traced (its jaxpr's digest is saved inside and checked by the loader,
  aot.Program); None where ``directory`` is None (off)."""
  if directory is None:
    return None
  key = program_key(config, mesh, kernels=kernels, extra={
      "name": name, "trainer": trainer_digest(trainer), "extra": extra})
  return directory / f"{key}.bin"
