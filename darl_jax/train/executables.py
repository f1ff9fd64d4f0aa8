"""Compiled programs kept on disk and loaded by the next run of the same program.

JAX's persistent compilation cache keeps XLA's executable, but a run still
traces and lowers its programs (and builds its Pallas kernels) at every
start. Every program a run compiles at start-up (train and eval steps, the
state's initialisation, the closing picture: train/aot.py's Program) is
saved as ``<cache dir>/executables/<key>.bin``, and a rerun or resume whose
key matches loads it instead: no lowering or compiling.

The file's name is a digest of everything the program is built from,
known before it is traced, so that its file is read while the program is
traced: the resolved config less the keys that do not reach the program
(``NOT_PROGRAM_KEYS``: run length and cadence, where things are written;
``NOT_PROGRAM_OPTIM_KEYS``: the schedule's scalars, inputs of the step, or
literals of the jaxpr where a program reads them), the source of every
darl_jax module and of the trainer's class (custom gradient rules are not
in a jaxpr's text), the versions of jax, jaxlib and the libraries the step
calls, the devices (platform, kind, count, ids), the mesh, the kernels
chosen, the program's name, and what changes what XLA builds from the same
program: the flag variables XLA reads (``XLA_FLAG_VARIABLES``) and the JAX
options that reach lowering and compiling (``LOWERING_OPTIONS``). Inside
the file is the digest of the traced program's jaxpr and of the options
its jit passes to XLA (:func:`jaxpr_digest`); the saved executable
becomes this run's program only where this run's trace has the same
digest (tracing takes seconds; it is lowering and compiling that a match
skips), so what the name misses (code outside darl_jax, a library changed
under the same version) recompiles, and the new program replaces the
file. XLA deserializes the file's bytes beside the trace (outside the
GIL), so a warm start waits for the longer of the two, not their sum.

A saved file holds machine code for the device (its format:
train/executable_file.py), so the folder must be the user's own: a folder
(``executables`` or the cache folder above it) that another user owns, or
that its group or others can write, is refused with one log line and
every program compiled (nothing loaded, nothing saved); the folder is
created with mode 0o700.

On by default where saved executables load in a new process and run: GPUs
and TPUs. Off by default on the CPU: with jax 0.10.2 an XLA:CPU executable
that JAX took from its persistent compilation cache serializes,
deserializes in another process, and then fails at its first call
(``NOT_FOUND: Function wrapped_broadcast not found``, ``...fusion not
found``); one compiled afresh in the saving process runs again. A run
cannot tell the two apart, so the CPU compiles.
``DARL_COMPILED_STEP_CACHE=1`` turns it on anywhere, ``=0`` off anywhere.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import stat
from importlib import metadata
from pathlib import Path

import jax
from absl import logging

from darl_jax.train import executable_file

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
# The environment variables whose flags XLA reads when it builds a program:
# the two JAX's own compilation cache keys on, and the Neuron compiler's.
XLA_FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "NEURON_CC_FLAGS")
# The JAX options that change the program XLA builds from the same jaxpr
# (precision, dtypes and PRNG lowering, the partitioner, XLA's optimisation
# and memory-fitting efforts, profile-guided recompiles, the kernels Pallas
# and threefry lower to, what is embedded as a constant) or the jaxpr
# itself (the x64 and promotion rules, which the jaxpr check would catch
# after a trace, but not the other way round). Options of the trace's
# checks and of dispatch (debug_nans, enable_checks, ...) build the same
# executable and stay out. An option this JAX does not have reads as absent.
LOWERING_OPTIONS = (
    "jax_default_matmul_precision", "jax_enable_x64", "jax_default_prng_impl",
    "jax_threefry_partitionable", "jax_threefry_gpu_kernel_lowering",
    "jax_use_shardy_partitioner", "jax_optimization_level", "jax_memory_fitting_level",
    "jax_exec_time_optimization_effort", "jax_memory_fitting_effort",
    "jax_xla_profile_version", "jax_enable_pgle", "jax_pgle_profiling_runs",
    "jax_compiler_enable_remat_pass", "jax_softmax_custom_jvp", "jax_numpy_dtype_promotion",
    "jax_numpy_rank_promotion", "jax_explicit_x64_dtypes", "jax_pallas_use_mosaic_gpu",
    "jax_embedded_constants_max_bytes", "jax_use_simplified_jaxpr_constants",
    "jax_allow_f16_reductions", "jax_high_dynamic_range_gumbel",
    "jax_remove_size_one_mesh_axis_from_type")


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


def compiler_settings() -> dict:
  """The XLA flag variables and JAX options that change what XLA builds
  from the same program (XLA_FLAG_VARIABLES, LOWERING_OPTIONS)."""
  return {"environment": {name: os.environ.get(name) for name in XLA_FLAG_VARIABLES},
          "options": {name: str(getattr(jax.config, name, None))
                      for name in LOWERING_OPTIONS}}


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
      "compiler": compiler_settings(),
      "extra": extra,
  }
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


# What the program's jit hands to lowering and compiling beside its jaxpr
# (aot.py passes no compile options of its own).
TRACED_PARAMS = ("donated_invars", "keep_unused", "compiler_options_kvs")


def jaxpr_digest(traced) -> str:
  """Digest of a traced step's jaxpr (``jitted.trace(...)``) and of the
  options its jit passes to XLA (TRACED_PARAMS): any change of the
  program's operations, shapes, literal constants, donations or compile
  options changes it. Array constants are not in its text; they come from
  the config, the other part of the key."""
  # pylint: disable-next=protected-access
  params = {name: repr(traced._params.get(name)) for name in TRACED_PARAMS}
  return hashlib.sha256((str(traced.jaxpr) + json.dumps(params, sort_keys=True)).encode()
                        ).hexdigest()


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
  where saved executables are :func:`enabled` on ``platform``, created
  (mode 0o700) and checked (:func:`usable_dir`); None where they are off,
  the cache is not a local path or the folder is refused."""
  if not enabled(platform):
    return None
  path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or config.get("compilation_cache_dir", "")
  if not path or "://" in path:
    return None
  directory = Path(os.path.expanduser(path)) / "executables"
  return directory if usable_dir(directory) else None


def _refusal(folder: Path) -> str | None:
  """Why ``folder`` may not hold saved programs, or None."""
  st = os.stat(folder)
  if not stat.S_ISDIR(st.st_mode):
    return f"{folder} is not a folder"
  if st.st_uid != os.getuid():
    return (f"{folder} belongs to another user (uid {st.st_uid}, not {os.getuid()}): set "
            "--config.compilation_cache_dir to a folder of your own")
  if st.st_mode & 0o022:
    return (f"{folder} can be written by its group or others (mode "
            f"{stat.S_IMODE(st.st_mode):o}): run chmod go-w {folder}")
  return None


_REFUSED: set[tuple[str, str]] = set()    # (folder, why) already logged, once each


def usable_dir(directory: Path) -> bool:
  """Whether ``directory`` (the ``executables`` folder) and the cache
  folder above it are the user's own and written by no one else; each is
  created with mode 0o700 where missing. A folder refused is logged once
  (its programs compile, nothing is loaded or saved)."""
  directory = Path(directory)
  try:
    directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
    # exist_ok accepts a folder someone else made: its owner and mode decide.
    reason = _refusal(directory.parent) or _refusal(directory)
  except OSError as e:
    reason = f"{type(e).__name__}: {e}"
  if reason is None:
    return True
  if (str(directory), reason) not in _REFUSED:
    _REFUSED.add((str(directory), reason))
    logging.warning("not using the saved programs in %s (%s); compiling every program "
                    "instead", directory, reason)
  return False


# The file (train/executable_file.py), read and written only in a folder
# usable_dir accepts; its names are the callers' through this module.
JAXPR_KEY = executable_file.JAXPR_KEY
MAGIC = executable_file.MAGIC
FORMAT = executable_file.FORMAT
Saved = executable_file.Saved
FirstCall = executable_file.FirstCall
SavedProgramFailed = executable_file.SavedProgramFailed
deserialize = executable_file.deserialize
prepare = executable_file.prepare


def read(path: Path) -> Saved | None:
  """The saved program ``path`` as read (executable_file.read: checked, not
  deserialized); None, with one log line, where its folder is refused
  (:func:`usable_dir`) or the file is not a saved program of this format."""
  if not usable_dir(path.parent):
    return None
  return executable_file.read(path)


def save(path: Path, compiled, info: dict | None = None) -> bool:
  """Writes ``compiled`` and ``info`` to ``path`` (executable_file.write);
  False (logged) where the folder is refused (:func:`usable_dir`), the
  executable cannot be described or the file not written."""
  if not usable_dir(path.parent):
    return False
  return executable_file.write(path, compiled, info)


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
