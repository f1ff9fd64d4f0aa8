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
its jit passes to XLA (:func:`jaxpr_digest`); the saved executable is
deserialized only where this run's trace has the same digest (tracing
takes seconds; it is lowering and compiling that a match skips), so what
the name misses (code outside darl_jax, a library changed under the same
version) recompiles, and the new program replaces the file.

Nothing read from the folder is unpickled: ``jax.experimental.
serialize_executable`` pickles the executable with JAX's objects around
it (shardings, avals, layouts), and an unpickler runs whatever a planted
file names. A file here is a plain header, then XLA's serialized
executable: the header (JSON) holds the format's version, the key, the
jaxpr's digest, the ``info`` saved with the program and the executable's
devices, shardings, layouts and kept arguments as plain data; avals,
argument info and the in/out tree structures come from this run's trace
of the same program. The executable's bytes are machine code for the
device all the same, so the folder must be the user's own: a folder
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
A file whose key differs is never read; a file that is not a saved
program of this format (another version, another key, truncated) or that
fails to load (from another jaxlib that kept the same version string,
...) is left alone, with one log line, and the program compiled; the
compiled program then replaces it. A loaded program that fails at its
first call removes its file (:class:`FirstCall`). Files are written
atomically, so a killed run leaves none half-written.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import inspect
import json
import os
import stat
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


# The entry of the info handed to :func:`save` that holds the jaxpr's digest
# (kept in the file's header, not in the info handed back).
JAXPR_KEY = "_jaxpr"
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


def _remove(path: Path) -> None:
  """Removes ``path`` where it is the user's own file."""
  try:
    if os.stat(path).st_uid == os.getuid():
      path.unlink()
  except OSError:
    pass


class SavedProgramFailed(RuntimeError):
  """A saved executable loaded but failed at its first call (removed)."""


class FirstCall:
  """A loaded executable whose first call, if it fails, removes the file and
  says so: a program that deserializes but does not run (an XLA:CPU one JAX
  took from its own cache; a driver that no longer runs the saved kernels)
  would otherwise fail every rerun the same way. Not retried in place: the
  arguments a train step donates may be gone. A signal (Terminated,
  KeyboardInterrupt: BaseExceptions) passes through and keeps the file.
  Everything else (memory analysis, ...) is the executable's."""

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
      _remove(self._path)
      raise SavedProgramFailed(
          f"the saved program {self._path} loaded but failed at its first call "
          f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); the file is removed: "
          "run the command again (it compiles the program; a run resumes from its "
          "checkpoint), or set DARL_COMPILED_STEP_CACHE=0 to compile every time") from e
    self._ran = True
    return out

  def __getattr__(self, name):
    return getattr(self._compiled, name)


# ------------------------------------------------------------- the file
#
# MAGIC, the header's length (8 bytes, little-endian), the header (JSON),
# then XLA's serialized executable.
MAGIC = b"darl_jax saved program\n"
FORMAT = 1
MAX_HEADER = 1 << 26       # bytes: shardings of a large mesh, not more


@dataclasses.dataclass
class Saved:
  """A saved program's file as read (:func:`read`), not yet deserialized."""
  path: Path
  header: dict
  payload: bytes

  @property
  def jaxpr(self) -> str:
    return self.header["jaxpr"]

  @property
  def info(self) -> dict:
    return dict(self.header["info"])


def _did_not_load(path: Path, e: BaseException) -> None:
  logging.warning("the saved program %s did not load (%s: %s); compiling it instead",
                  path, type(e).__name__, " ".join(str(e).split())[:200])


def _check_header(header, path: Path) -> None:
  if not isinstance(header, dict) or header.get("format") != FORMAT:
    raise ValueError(f"not a saved program of format {FORMAT}")
  if header.get("key") != path.stem:
    raise ValueError(f"saved under the key {header.get('key')!r}, not {path.stem!r}")
  types = {"jaxpr": str, "info": dict, "executable": dict, "payload_bytes": int,
           "payload_sha256": str}
  for name, kind in types.items():
    if not isinstance(header.get(name), kind):
      raise ValueError(f"the header's {name!r} is missing or not a {kind.__name__}")


def read(path: Path) -> Saved | None:
  """The header and executable bytes of the saved program ``path``, checked
  (format, key, length, digest of the bytes) but not deserialized; None,
  with one log line, where the folder is refused or the file is not a
  saved program of this format (it is left where it is)."""
  if not usable_dir(path.parent):
    return None
  try:
    with open(path, "rb") as f:
      owner = os.fstat(f.fileno()).st_uid
      if owner != os.getuid():
        raise PermissionError(f"the file belongs to another user (uid {owner})")
      if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a saved program (no header)")
      size = int.from_bytes(f.read(8), "little")
      if size > MAX_HEADER:
        raise ValueError(f"a header of {size} bytes")
      header = json.loads(f.read(size).decode("utf-8"))
      _check_header(header, path)
      payload = f.read()
    if (len(payload) != header["payload_bytes"]
        or hashlib.sha256(payload).hexdigest() != header["payload_sha256"]):
      raise ValueError(f"{len(payload)} bytes of executable, not the {header['payload_bytes']} "
                       "saved (truncated or changed)")
  except Exception as e:  # pylint: disable=broad-except  # any damage: compile instead
    _did_not_load(path, e)
    return None
  return Saved(path, header, payload)


def _encode_layout(layout):
  from jax._src.layout import Layout  # pylint: disable=g-import-not-at-top
  if layout is None:
    return None
  if type(layout) is not Layout:  # pylint: disable=unidiomatic-typecheck
    raise ValueError(f"a layout of type {type(layout).__name__}")
  return {"major_to_minor": list(layout.major_to_minor),
          "tiling": None if layout.tiling is None else [list(t) for t in layout.tiling],
          "sub_byte_element_size_in_bits": int(layout.sub_byte_element_size_in_bits)}


def _decode_layout(data):
  from jax._src.layout import Layout  # pylint: disable=g-import-not-at-top
  if data is None:
    return None
  tiling = data["tiling"]
  return Layout(tuple(int(i) for i in data["major_to_minor"]),
                None if tiling is None else tuple(tuple(int(i) for i in t) for t in tiling),
                int(data["sub_byte_element_size_in_bits"]))


def _encode_partition(part):
  if part is None or isinstance(part, str):
    return part
  if isinstance(part, tuple) and all(isinstance(a, str) for a in part):
    return list(part)
  raise ValueError(f"a partition {part!r}")


def _encode_sharding(sharding) -> dict:
  from jax._src import sharding_impls  # pylint: disable=g-import-not-at-top
  kind = sharding.memory_kind
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    (device,) = sharding.device_set
    return {"type": "single", "device": device.id, "memory_kind": kind}
  if (isinstance(sharding, jax.sharding.NamedSharding)
      and isinstance(sharding.mesh, jax.sharding.Mesh)):
    mesh, spec = sharding.mesh, sharding.spec
    if not all(isinstance(name, str) for name in mesh.axis_names):
      raise ValueError(f"mesh axis names {mesh.axis_names}")
    ids = sharding._logical_device_ids  # pylint: disable=protected-access
    return {"type": "named", "memory_kind": kind,
            "mesh_shape": list(mesh.devices.shape),
            "mesh_devices": [d.id for d in mesh.devices.flat],
            "axis_names": list(mesh.axis_names),
            "axis_types": [t.name for t in mesh.axis_types],
            "spec": [_encode_partition(p) for p in spec],
            "unreduced": sorted(spec.unreduced), "reduced": sorted(spec.reduced),
            "logical_device_ids": None if ids is None else [int(i) for i in ids]}
  if isinstance(sharding, sharding_impls.GSPMDSharding):
    # pylint: disable-next=protected-access
    proto = sharding._hlo_sharding.to_proto().SerializeToString()
    return {"type": "gspmd", "memory_kind": kind,
            "devices": [d.id for d in sharding._devices],  # pylint: disable=protected-access
            "op_sharding": base64.b64encode(proto).decode("ascii")}
  raise ValueError(f"a sharding of type {type(sharding).__name__}")


def _decode_sharding(data: dict, devices: dict):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax._src import sharding_impls  # pylint: disable=g-import-not-at-top
  from jax._src.lib import xla_client as xc  # pylint: disable=g-import-not-at-top
  kind = data["memory_kind"]
  if data["type"] == "single":
    return jax.sharding.SingleDeviceSharding(devices[data["device"]], memory_kind=kind)
  if data["type"] == "named":
    grid = np.empty(len(data["mesh_devices"]), dtype=object)
    grid[:] = [devices[i] for i in data["mesh_devices"]]
    mesh = jax.sharding.Mesh(grid.reshape(tuple(data["mesh_shape"])),
                             tuple(data["axis_names"]),
                             axis_types=tuple(jax.sharding.AxisType[t]
                                              for t in data["axis_types"]))
    spec = jax.sharding.PartitionSpec(
        *[tuple(p) if isinstance(p, list) else p for p in data["spec"]],
        unreduced=frozenset(data["unreduced"]), reduced=frozenset(data["reduced"]))
    ids = data["logical_device_ids"]
    return jax.sharding.NamedSharding(mesh, spec, memory_kind=kind,
                                      _logical_device_ids=None if ids is None else tuple(ids))
  if data["type"] == "gspmd":
    proto = xc.OpSharding()
    proto.ParseFromString(base64.b64decode(data["op_sharding"]))
    return sharding_impls.GSPMDSharding(
        xc.DeviceList(tuple(devices[i] for i in data["devices"])), proto, memory_kind=kind)
  raise ValueError(f"a sharding of type {data['type']!r}")


def describe(compiled) -> tuple[dict, bytes]:
  """``(plain data, XLA's bytes)`` of a compiled program: what
  :func:`rebuild` needs beside this run's trace. Raises ValueError for a
  program a saved file cannot hold (effects, host callbacks, constants,
  mutable references, a sharding or layout of another kind)."""
  from jax._src.interpreters import pxla  # pylint: disable=g-import-not-at-top
  unloaded = getattr(getattr(compiled, "_executable", None), "_unloaded_executable", None)
  if not isinstance(unloaded, pxla.UnloadedMeshExecutable):
    raise ValueError("the compiled program cannot be serialized")
  if (unloaded.unordered_effects or unloaded.ordered_effects or unloaded.keepalive
      or unloaded.host_callbacks or unloaded.mut is not None
      or compiled._params.const_args):  # pylint: disable=protected-access
    raise ValueError("the program has effects, host callbacks, constants or mutable "
                     "references, which a saved program does not keep")
  executable = unloaded.xla_executable
  data = {
      "platform": unloaded.backend.platform,
      "devices": [d.id for d in unloaded.device_list],
      "input_shardings": [_encode_sharding(s) for s in unloaded.input_shardings],
      "output_shardings": [_encode_sharding(s) for s in unloaded.output_shardings],
      "committed": bool(unloaded.committed),
      "name": str(unloaded.name),
      "kept_var_idx": sorted(int(i) for i in unloaded.kept_var_idx),
      "xla_in_layouts": [_encode_layout(l) for l in unloaded.xla_in_layouts],
      "dispatch_in_layouts": [_encode_layout(l) for l in unloaded.dispatch_in_layouts],
      "xla_out_layouts": [_encode_layout(l) for l in unloaded.xla_out_layouts],
      "no_kwargs": bool(compiled._no_kwargs),  # pylint: disable=protected-access
  }
  return data, bytes(executable.client.serialize_executable(executable))


def rebuild(data: dict, payload: bytes, traced):
  """The ``jax.stages.Compiled`` of :func:`describe`'s ``(data, payload)``,
  with the avals, argument info and in/out trees of ``traced`` (this run's
  trace of the same program, its jaxpr checked against the saved one)."""
  from jax._src import stages  # pylint: disable=g-import-not-at-top
  from jax._src.interpreters import pxla  # pylint: disable=g-import-not-at-top
  from jax._src.lib import xla_client as xc  # pylint: disable=g-import-not-at-top
  backend = jax.devices()[0].client
  if backend.platform != data["platform"]:
    raise ValueError(f"saved for {data['platform']}, not {backend.platform}")
  if traced.jaxpr.effects:
    raise ValueError("the program has effects")
  devices = {d.id: d for d in backend.devices()}
  closed = traced.jaxpr
  kept = sorted(int(i) for i in data["kept_var_idx"])
  in_avals = [closed.in_avals[i] for i in kept]
  executable = backend.deserialize_executable(
      payload, executable_devices=xc.DeviceList(tuple(backend.devices())))
  unloaded = pxla.UnloadedMeshExecutable(
      xla_executable=executable,
      device_list=xc.DeviceList(tuple(devices[i] for i in data["devices"])),
      backend=backend,
      input_avals=in_avals,
      input_shardings=[_decode_sharding(s, devices) for s in data["input_shardings"]],
      output_avals=list(closed.out_avals),
      output_shardings=[_decode_sharding(s, devices) for s in data["output_shardings"]],
      committed=bool(data["committed"]),
      name=str(data["name"]),
      unordered_effects=[], ordered_effects=[], keepalive=[], host_callbacks=[],
      kept_var_idx=set(kept), mut=None,
      xla_in_layouts=[_decode_layout(l) for l in data["xla_in_layouts"]],
      dispatch_in_layouts=[_decode_layout(l) for l in data["dispatch_in_layouts"]],
      xla_out_layouts=[_decode_layout(l) for l in data["xla_out_layouts"]],
      all_args_info=pxla.AllArgsInfo(list(closed.in_avals), closed.jaxpr.debug_info),
      pgle_profiler=None)
  counts = (len(unloaded.input_shardings), len(unloaded.xla_in_layouts),
            len(unloaded.dispatch_in_layouts))
  if counts != (len(in_avals),) * 3 or len(unloaded.output_shardings) != len(
      closed.out_avals) or len(unloaded.xla_out_layouts) != len(closed.out_avals):
    raise ValueError("the saved shardings and layouts do not match the program's arguments")
  return stages.Compiled(unloaded.load(), [], traced.args_info, traced.out_tree,
                         no_kwargs=bool(data["no_kwargs"]))


def deserialize(saved: Saved, traced) -> tuple[FirstCall, dict] | None:
  """``(loaded program, info saved with it)`` of ``saved`` (:func:`read`),
  rebuilt with ``traced``, whose jaxpr's digest the caller has checked
  against ``saved.jaxpr``; None, with one log line, where it does not load
  (the file is left for the compiled program to replace)."""
  try:
    compiled = rebuild(saved.header["executable"], saved.payload, traced)
  except Exception as e:  # pylint: disable=broad-except  # any failure: compile instead
    _did_not_load(saved.path, e)
    return None
  return FirstCall(compiled, saved.path), saved.info


def save(path: Path, compiled, info: dict | None = None) -> bool:
  """Writes ``compiled`` and the plain-data ``info`` to hand back with it
  (its JAXPR_KEY entry, the jaxpr's digest, goes to the header) to
  ``path`` atomically; False (logged) where the folder is refused, the
  executable cannot be described or the file not written."""
  info = dict(info or {})
  jaxpr = info.pop(JAXPR_KEY, "")
  if not usable_dir(path.parent):
    return False
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  try:
    data, payload = describe(compiled)
    header = json.dumps({"format": FORMAT, "key": path.stem, "jaxpr": jaxpr, "info": info,
                         "executable": data, "payload_bytes": len(payload),
                         "payload_sha256": hashlib.sha256(payload).hexdigest()}).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
      f.write(MAGIC + len(header).to_bytes(8, "little") + header)
      f.write(payload)
    os.replace(tmp, path)
    return True
  except Exception as e:  # pylint: disable=broad-except
    _remove(tmp)
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
