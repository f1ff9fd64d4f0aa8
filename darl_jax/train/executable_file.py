"""A saved program's file: its format, written, read, and rebuilt into a program.

train/executables.py names the file (the key) and decides where files
may be read and written (the cache folder's policy); this module holds
what is in one.

Nothing read from the folder is unpickled: ``jax.experimental.
serialize_executable`` pickles the executable with JAX's objects around
it (shardings, avals, layouts), and an unpickler runs whatever a planted
file names. A file here is a plain header, then XLA's serialized
executable: the header (JSON) holds the format's version, the key, the
jaxpr's digest, the ``info`` saved with the program and the executable's
devices, shardings, layouts and kept arguments as plain data; avals,
argument info and the in/out tree structures come from this run's trace
of the same program.

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
import json
import os
from pathlib import Path

import jax
from absl import logging

# The entry of the info handed to :func:`write` that holds the jaxpr's digest
# (kept in the file's header, not in the info handed back).
JAXPR_KEY = "_jaxpr"


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


# The file: MAGIC, the header's length (8 bytes, little-endian), the header (JSON),
# then XLA's serialized executable.
MAGIC = b"darl_jax saved program\n"
FORMAT = 1
MAX_HEADER = 1 << 26       # bytes: shardings of a large mesh, not more


@dataclasses.dataclass
class Saved:
  """A saved program's file as read (:func:`read`); ``executable``: XLA's
  executable deserialized from its bytes (:func:`prepare`), not yet this
  run's program (:func:`deserialize`)."""
  path: Path
  header: dict
  payload: bytes
  executable: object = None

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
  with one log line, where the file is not a saved program of this format
  (it is left where it is). Its folder is the caller's to check
  (executables.read)."""
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


def runtime_effects(closed_jaxpr) -> list:
  """The effects of a traced program that its compiled form keeps: all but
  the mutable arrays it creates and uses inside itself (``jax.new_ref`` in
  the attention kernels' backward pass), which lowering turns into plain
  values, so the compiled program has none of them (:func:`describe` saw
  it). Any other effect needs the runtime support a saved file lacks."""
  from jax._src import core  # pylint: disable=g-import-not-at-top
  return [e for e in closed_jaxpr.effects
          if not isinstance(e, core.InternalMutableArrayEffect)]


def xla_executable(data: dict, payload: bytes):
  """XLA's executable of :func:`describe`'s ``(data, payload)`` on this
  process's backend (the bytes only: nothing of the program JAX builds
  around it)."""
  from jax._src.lib import xla_client as xc  # pylint: disable=g-import-not-at-top
  backend = jax.devices()[0].client
  if backend.platform != data["platform"]:
    raise ValueError(f"saved for {data['platform']}, not {backend.platform}")
  return backend.deserialize_executable(
      payload, executable_devices=xc.DeviceList(tuple(backend.devices())))


def rebuild(data: dict, executable, traced):
  """The ``jax.stages.Compiled`` of :func:`describe`'s ``data`` and XLA's
  ``executable`` (:func:`xla_executable`), with the avals, argument info
  and in/out trees of ``traced`` (this run's trace of the same program, its
  jaxpr checked against the saved one)."""
  from jax._src import stages  # pylint: disable=g-import-not-at-top
  from jax._src.interpreters import pxla  # pylint: disable=g-import-not-at-top
  from jax._src.lib import xla_client as xc  # pylint: disable=g-import-not-at-top
  backend = jax.devices()[0].client
  if runtime_effects(traced.jaxpr):
    raise ValueError("the program has effects")
  devices = {d.id: d for d in backend.devices()}
  closed = traced.jaxpr
  kept = sorted(int(i) for i in data["kept_var_idx"])
  in_avals = [closed.in_avals[i] for i in kept]
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


def prepare(saved: Saved) -> Saved | None:
  """``saved`` with XLA's executable deserialized from its bytes: XLA's
  work, outside the GIL, so a thread does it while the program is traced
  (a large step takes seconds either way); None, with one log line, where
  the bytes do not deserialize (the file is left for the compiled program
  to replace)."""
  try:
    executable = xla_executable(saved.header["executable"], saved.payload)
  except Exception as e:  # pylint: disable=broad-except  # any failure: compile instead
    _did_not_load(saved.path, e)
    return None
  return dataclasses.replace(saved, payload=b"", executable=executable)


def deserialize(saved: Saved, traced) -> tuple[FirstCall, dict] | None:
  """``(loaded program, info saved with it)`` of ``saved`` (:func:`read`,
  then :func:`prepare`), rebuilt with ``traced``, whose jaxpr's digest the
  caller has checked against ``saved.jaxpr``; None, with one log line,
  where it does not load (the file is left for the compiled program to
  replace)."""
  try:
    if saved.executable is None:
      raise ValueError("its bytes were not deserialized (executable_file.prepare)")
    compiled = rebuild(saved.header["executable"], saved.executable, traced)
  except Exception as e:  # pylint: disable=broad-except  # any failure: compile instead
    _did_not_load(saved.path, e)
    return None
  return FirstCall(compiled, saved.path), saved.info


def write(path: Path, compiled, info: dict | None = None) -> bool:
  """Writes ``compiled`` and the plain-data ``info`` to hand back with it
  (its JAXPR_KEY entry, the jaxpr's digest, goes to the header) to
  ``path`` atomically; False (logged) where the executable cannot be
  described or the file not written. Its folder is the caller's to check
  (executables.save)."""
  info = dict(info or {})
  jaxpr = info.pop(JAXPR_KEY, "")
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
