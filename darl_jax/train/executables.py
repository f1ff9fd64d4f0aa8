"""Compiled train steps kept on disk and loaded by the next run of the same program.

JAX's persistent compilation cache keeps XLA's executable, but a run still
traces and lowers its step (and builds its Pallas kernels) at every start.
A step compiled here is serialized (``jax.experimental.serialize_executable``)
into ``<cache dir>/executables/<key>.bin`` and a rerun or resume whose key
matches loads it instead: no tracing, lowering or compiling.

The key is a digest of the traced step's jaxpr (tracing takes seconds; it
is lowering and compiling that a match skips) and of everything that can
change the program without showing in it: the resolved config less the keys
that do not reach the program (``NOT_PROGRAM_KEYS``: run length and
cadence, where things are written; ``NOT_PROGRAM_OPTIM_KEYS``: the
schedule's scalars, inputs of the step, or literals of the jaxpr where a
program reads them), the source of every darl_jax module and of the
trainer's class (custom gradient rules are not in a jaxpr's text), the
versions of jax, jaxlib and the libraries the step calls, the devices
(platform, kind, count, ids), the mesh and the kernels chosen. Off by default, on with ``DARL_COMPILED_STEP_CACHE=1``: with jax 0.10.2 on
the CPU, an executable saved by one process and loaded by another
deserializes but fails at its first call (``NOT_FOUND: Function
convert_power_fusion not found``; the same process loads and runs it
fine), and on GPUs a load in a new process has not been tried yet. Until a
new process's load is shown to run on a backend, the loop compiles. A file whose key differs is
never read; a file that fails to load (truncated, from another jaxlib that
kept the same version string, ...) is removed and the step compiled as
usual, with one log line. Files are written atomically, so a killed run
leaves none half-written.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import pickle
import time
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
                    "eval_batch_size")
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


def cache_dir(config) -> Path | None:
  """``<compilation_cache_dir>/executables`` ("" = off; a
  JAX_COMPILATION_CACHE_DIR environment variable wins, as for JAX's cache),
  only with DARL_COMPILED_STEP_CACHE=1 (see the module docstring: off by
  default); None where it is off or not a local path."""
  if os.environ.get("DARL_COMPILED_STEP_CACHE", "0") != "1":
    return None
  path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or config.get("compilation_cache_dir", "")
  if not path or "://" in path:
    return None
  return Path(os.path.expanduser(path)) / "executables"


def load(path: Path) -> tuple[object, dict] | None:
  """``(compiled step, info saved with it)`` from ``path``, or None (with
  one log line, and the file removed) where it does not load."""
  from jax.experimental import serialize_executable  # pylint: disable=g-import-not-at-top
  try:
    with open(path, "rb") as f:
      (payload, in_tree, out_tree), info = pickle.load(f)
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree), info
  except Exception as e:  # pylint: disable=broad-except  # any failure: compile instead
    logging.warning("the saved train step %s did not load (%s: %s); compiling it instead",
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
    logging.warning("could not save the compiled train step to %s (%s: %s)", path,
                    type(e).__name__, " ".join(str(e).split())[:200])
    return False


def load_or_compile(directory: Path | None, key: str,
                    compile_fn: Callable[[], tuple[object, dict]],
                    keep: tuple[str, ...] = ()) -> tuple[object, dict]:
  """``compile_fn() -> (compiled, info)``, or the step saved under ``key``
  in ``directory``: then ``info`` holds the ``keep`` entries saved with it
  and ``loaded_s``. Saves what it compiled (process 0 only)."""
  if directory is None:
    return compile_fn()
  path = directory / f"{key}.bin"
  if path.exists():
    t0 = time.perf_counter()
    loaded = load(path)
    if loaded is not None:
      compiled, info = loaded
      info["loaded_s"] = time.perf_counter() - t0
      logging.info("loaded the compiled train step %s in %.1f s (no lowering or compiling)",
                   path.name, info["loaded_s"])
      return compiled, info
  compiled, info = compile_fn()
  if jax.process_index() == 0 and save(path, compiled, {k: info[k] for k in keep if k in info}):
    logging.info("saved the compiled train step as %s for the next run", path)
  return compiled, info

