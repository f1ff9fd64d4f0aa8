"""Orbax checkpointing for DARL training: async saves, keep-N, resume, transfer.

Layout on disk (``directory`` is ``<workdir>/checkpoints``, local or ``gs://``)::

    <workdir>/checkpoints/
        <step>/state/   the training state pytree (Orbax StandardSave, OCDBT)
        <step>/meta/    a JSON dict: data position, rng seeds, config hash, ...
        <step>.orbax-checkpoint-tmp/   a save in flight, or one a kill cut short

Orbax writes every checkpoint into a temporary directory and only renames it to
``<step>`` (on GCS: writes ``commit_success.txt``) once everything is on disk, so
step listings never include a half-written checkpoint. A checkpoint can still be
damaged after its commit (a disk error, a truncated copy, a file deleted by
hand): ``restore_newest`` walks back from the newest step to the newest one
that restores, and moves each damaged one aside to
``<workdir>/checkpoints.damaged/<step>`` (numbered ``<step>.1``, ``<step>.2``,
... when that name is taken: nothing there is ever overwritten; kept for
inspection, out of the way of keep-N and of later runs; delete it when done).
Readers (``restore_params``, ``read_meta``) skip damaged steps the same way
(and only those: ``read_retried``) but never move anything.

Only definite damage moves a checkpoint (``read_failure``): a missing item or
file (Orbax's "Item ... was not found", ``FileNotFoundError``, tensorstore's
``NOT_FOUND``), a truncated file (``OUT_OF_RANGE``), a format or checksum
error (``DATA_LOSS``), metadata that does not parse (``JSONDecodeError``) or
is absent. A storage error that usually passes (an I/O error, a timeout, an
HTTP 5xx or 429, tensorstore's ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED`` /
``ABORTED``) is retried with backoff and then stops the run; a signal
(``interrupts.Terminated`` and Ctrl-C are BaseExceptions) passes through;
anything else stops the run too, the checkpoint left where it is: a good
checkpoint moved aside would silently cost the steps since the previous one.

A save that fails (``CheckpointWriteError``) names its cause first: no space
left on the device, permission denied, a read-only file system, with the
step, the folder, the state's size and the free space.

The meta item holds the run's resolved config (``config``): every reader of a
checkpoint (export, sampling, fine-tuning) takes the config from there, not
from ``<workdir>/config.json``, which a later command could have rewritten
(``stored_config``).

Two entry points:

* :class:`Checkpointer` -- used by the training loop (every process of a
  multi-host job must call ``save``/``restore`` collectively; Orbax decides
  which host writes what).
* :func:`restore_params` -- used for transfer / fine-tuning and evaluation: it
  needs no model, mesh or abstract state and returns ``state["params"]`` (or,
  by choice, the EMA of them a run kept: ``use_ema``) as host numpy arrays.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import sys
import time
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from darl_jax import ema as ema_lib
from darl_jax import interrupts

# Item names inside each step directory. Kept as constants because
# restore_params reads checkpoints written by (possibly older) training runs.
STATE_ITEM = "state"
META_ITEM = "meta"


DAMAGED_DIR = "checkpoints.damaged"


class CheckpointDamagedError(ValueError):
  """A checkpoint exists but cannot be read (truncated, zeroed or missing files)."""


class CheckpointReadError(OSError):
  """A checkpoint could not be read, and the error is not known damage (or a
  storage error outlasted the retries: ``transient``): the run stops and
  nothing is moved."""
  transient = False


class CheckpointWriteError(OSError):
  """A checkpoint could not be written; the message puts the cause first."""


class _Damaged(Exception):
  """Definite damage found by Checkpointer.restore_newest: the step moves aside."""


class StateMismatchError(ValueError):
  """The checkpoint's state tree does not fit the state this run builds."""
  meta: dict = {}         # the checkpoint's meta


# tensorstore appends the whole spec of what it opened to its errors: kilobytes
# of JSON that say nothing about the cause.
_SPEC = re.compile(r"\s*\[tensorstore_spec(\[\d+\])?='.*?'\]", re.DOTALL)


def _short(e: BaseException, limit: int = 240) -> str:
  """One line of an exception (tensorstore errors run to several lines)."""
  text = " ".join(_SPEC.sub("", str(e)).split()) or type(e).__name__
  text = f"{type(e).__name__}: {text}" if not isinstance(e, (ValueError, OSError)) else text
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _path_str(path) -> str:
  """A pytree key path as ``a/0/b`` for both live trees (namedtuple fields are
  GetAttrKeys) and Orbax's metadata trees (namedtuples become dicts)."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def _leaf_shapes(tree) -> dict[str, tuple]:
  return {_path_str(p): tuple(getattr(v, "shape", np.shape(v)))
          for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def _group(paths: list[str], param_paths: set[str], limit: int = 4) -> str:
  """Short lists of state paths: the parameter path inside an optimizer
  state becomes ``*`` (``opt_state/0/mu/backbone/...`` x 40 ->
  ``opt_state/0/mu/* (40)``), so that what differs (``mu`` against
  ``trace``) shows, not 40 parameter names."""
  groups: dict[str, int] = {}
  for p in paths:
    parts = p.split("/")
    key = p
    for i in range(1, len(parts)):
      if "/".join(parts[i:]) in param_paths:
        key = "/".join(parts[:i]) + "/*"
        break
    groups[key] = groups.get(key, 0) + 1
  items = [k + (f" ({n})" if n > 1 else "") for k, n in sorted(groups.items())]
  return ", ".join(items[:limit]) + (f", ... ({len(items)} groups)" if len(items) > limit
                                     else "")


def state_difference(saved_tree, abstract_state) -> str | None:
  """What differs between a checkpoint's state tree (Orbax metadata) and the
  state this run builds, in one line; None when they fit (same leaves, same
  shapes; dtypes may differ, Orbax casts)."""
  saved, now = _leaf_shapes(saved_tree), _leaf_shapes(abstract_state)
  params = {p.split("/", 1)[1] for p in list(saved) + list(now)
            if p.startswith("params/")}
  parts = []
  only_saved = sorted(set(saved) - set(now))
  only_now = sorted(set(now) - set(saved))
  if only_saved:
    parts.append(f"only in the checkpoint: {_group(only_saved, params)}")
  if only_now:
    parts.append(f"only in this run: {_group(only_now, params)}")
  shapes = [f"{k} {saved[k]} -> {now[k]}" for k in sorted(set(saved) & set(now))
            if saved[k] != now[k]]
  if shapes:
    parts.append("other shapes: " + ", ".join(shapes[:4])
                 + (f", ... ({len(shapes)} in all)" if len(shapes) > 4 else ""))
  return "; ".join(parts) or None


def drop_closed_loop_reports() -> None:
  """Silences one kind of noise for the command-line tools (process-wide).

  An Orbax read that fails (a damaged checkpoint, then skipped) closes its
  asyncio loop while tensorstore still holds callbacks for it; each then
  reports "Event loop is closed" with a traceback through
  ``sys.unraisablehook``: hundreds of lines about an error already handled.
  """
  default_hook = sys.unraisablehook
  if getattr(default_hook, "drops_closed_loop_reports", False):
    return

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"):
      default_hook(unraisable)

  hook.drops_closed_loop_reports = True
  sys.unraisablehook = hook


# ------------------------------------------------------- what a failure means

# tensorstore's errors are ValueErrors whose message starts with the status
# code; Orbax reports a missing item as a KeyError.
_DAMAGE_CODES = ("NOT_FOUND", "OUT_OF_RANGE", "DATA_LOSS")
_TRANSIENT_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED")
_TRANSIENT_ERRNOS = frozenset({
    errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE,
    errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.ENETDOWN,
    errno.ENETUNREACH, errno.EHOSTUNREACH})
_TRANSIENT_TEXT = re.compile(
    r"HTTP response code: (5\d\d|429)|\b(503 Service Unavailable|429 Too Many Requests|"
    r"Connection reset|timed out|Input/output error)\b", re.IGNORECASE)
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _chain(e: BaseException):
  """``e`` and the exceptions it was raised from or while handling."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or e.__context__


def _errno(e: BaseException) -> int | None:
  if isinstance(e, OSError) and e.errno is not None:
    return e.errno
  found = _OS_ERROR_CODE.search(str(e))
  return int(found.group(1)) if found else None


def _status_code(e: BaseException) -> str:
  return str(e).lstrip().split(":", 1)[0] if isinstance(e, ValueError) else ""


def read_failure(e: BaseException) -> str | None:
  """What an error while reading a checkpoint means: ``"transient"`` (a
  storage error that usually passes: retry), ``"damage"`` (the checkpoint
  itself is broken: move it aside) or None (not known: stop, move nothing).
  A transient error anywhere in the chain wins: a file that could not be
  read is not a file that is missing."""
  chain = list(_chain(e))
  for x in chain:
    if (isinstance(x, (TimeoutError, ConnectionError)) or _errno(x) in _TRANSIENT_ERRNOS
        or _status_code(x) in _TRANSIENT_CODES or _TRANSIENT_TEXT.search(str(x))):
      return "transient"
  for x in chain:
    if (isinstance(x, (CheckpointDamagedError, FileNotFoundError, json.JSONDecodeError))
        or _errno(x) == errno.ENOENT or _status_code(x) in _DAMAGE_CODES
        or (isinstance(x, KeyError) and "was not found in the checkpoint" in str(x))):
      return "damage"
  return None


_WRITE_CAUSES = {
    errno.ENOSPC: ("no space left on device", "free space on that disk or pass a --workdir "
                   "on a larger one (keep_checkpoints sets how many checkpoints it holds)"),
    errno.EDQUOT: ("disk quota exceeded", "free space within the quota or pass a --workdir "
                   "elsewhere"),
    errno.EROFS: ("read-only file system", "pass a --workdir on a writable file system"),
    errno.EACCES: ("permission denied", "make the workdir writable for this user or pass "
                   "another --workdir"),
    errno.EPERM: ("operation not permitted", "make the workdir writable for this user or "
                  "pass another --workdir"),
}
_WRITE_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
               "Read-only file system": errno.EROFS, "Permission denied": errno.EACCES,
               "Operation not permitted": errno.EPERM}


def write_failure(e: BaseException) -> int | None:
  """The errno of ``_WRITE_CAUSES`` behind a failed write, if any."""
  for x in _chain(e):
    code = _errno(x)
    if code in _WRITE_CAUSES:
      return code
    for text, code in _WRITE_TEXT.items():
      if text in str(x):
        return code
  return None


def human_bytes(n: float) -> str:
  units, i = ("B", "kB", "MB", "GB", "TB"), 0
  while n >= 1000 and i < len(units) - 1:
    n, i = n / 1000, i + 1
  return f"{n:.0f} {units[i]}" if i == 0 or n >= 100 else f"{n:.1f} {units[i]}"


def free_bytes(directory) -> int | None:
  """Free space where ``directory`` is (or would be created); None for
  remote paths (gs://...), whose quota no local call knows."""
  path = str(directory)
  if "://" in path:
    return None
  path = os.path.abspath(path)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  try:
    return shutil.disk_usage(path).free
  except OSError:
    return None


def state_bytes(state) -> int:
  """The bytes of a state's arrays (global shapes; abstract ones too)."""
  return int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                 for x in jax.tree_util.tree_leaves(state) if hasattr(x, "dtype")))


def check_free_space(directory, nbytes: int, keep: int) -> None:
  """Before a run's first step: room in ``directory`` (``<workdir>/checkpoints``,
  local) for the checkpoints keep-N holds at its peak (``keep`` + the one being
  written, less those already there) of ``nbytes`` each. Too little for all:
  a warning with both numbers; not even one: CheckpointWriteError naming them
  and the fix."""
  free = free_bytes(directory)
  if free is None or nbytes <= 0:
    return
  path = str(directory)
  existing = (sum(1 for p in os.listdir(path) if p.isdigit()) if os.path.isdir(path) else 0)
  needed = max(1, keep + 1 - existing) * nbytes
  if free < nbytes:
    raise CheckpointWriteError(
        f"no space for a checkpoint in {path}: one takes about {human_bytes(nbytes)} and "
        f"{human_bytes(free)} is free; free space on that disk or pass a --workdir on a "
        "larger one")
  if free < needed:
    logging.warning(
        "%s has %s free, less than the %s that keep_checkpoints=%d needs at its peak (%d "
        "checkpoints of about %s, %d already there): a later save may fail for lack of "
        "space", path, human_bytes(free), human_bytes(needed), keep,
        max(1, keep + 1 - existing), human_bytes(nbytes), existing)


def numbered(path) -> epath.Path:
  """``path`` if nothing is there, else the first free ``<stem>.<n><suffix>``
  (``7`` -> ``7.1``, ``metrics.jsonl`` -> ``metrics.1.jsonl``): what is kept
  aside is never overwritten."""
  path = epath.Path(path)
  if not path.exists():
    return path
  stem, dot, suffix = path.name.partition(".")
  n = 1
  while True:
    candidate = path.parent / f"{stem}.{n}{dot}{suffix}"
    if not candidate.exists():
      return candidate
    n += 1


def _copy_tree(src: epath.Path, dst: epath.Path) -> None:
  dst.mkdir(parents=True, exist_ok=True)
  for p in src.iterdir():
    if p.is_dir():
      _copy_tree(p, dst / p.name)
    else:
      p.copy(dst / p.name)


def _state_metadata(metadata) -> Any:
  """The state item's entry of a step's ``item_metadata``; None where it has
  none (a missing ``state/`` or no readable ``_METADATA``: damage)."""
  return metadata[STATE_ITEM] if STATE_ITEM in metadata else None


def _item_handlers(state_handler: ocp.CheckpointHandler) -> dict[str, Any]:
  # Registering the handlers up front (instead of letting the first save/restore
  # infer them from the args) lets a fresh manager answer item_metadata()
  # for checkpoints written by another process.
  return {STATE_ITEM: state_handler, META_ITEM: ocp.JsonCheckpointHandler()}


def absolute_path(path) -> epath.Path:
  """Orbax needs absolute paths: local relative ones are resolved against the
  current directory; URLs such as gs://... are kept as given."""
  path = str(path)
  return epath.Path(path if "://" in path else os.path.abspath(path))


def _copy_json(meta: dict) -> dict:
  """Validates that ``meta`` is JSON-serialisable and returns a deep copy.

  With async saving the JSON is written on a background thread; validating here
  raises in the caller (with a useful traceback) instead of at the next
  ``wait()``, and the copy makes later mutation of the caller's dict harmless.
  """
  if not isinstance(meta, dict):
    raise TypeError(f"checkpoint meta must be a dict, got {type(meta).__name__}")
  try:
    return json.loads(json.dumps(meta))
  except (TypeError, ValueError) as e:
    raise TypeError(f"checkpoint meta is not JSON-serialisable: {e}") from e


# A transient read error is retried after these waits, within the budget.
READ_RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)
READ_RETRY_BUDGET_S = 60.0


def read_retried(read: Callable[[], Any], where: str, delays, *,
                 damaged: Callable[[BaseException], BaseException], unknown: str,
                 persisted: str) -> Any:
  """``read()`` of ``where`` (a part of one checkpoint), sorted by ``read_failure``.

  Definite damage raises ``damaged(error)``. A transient storage error is
  retried after each of ``delays`` seconds while the retries stay within
  ``READ_RETRY_BUDGET_S`` of the first failure, then raises CheckpointReadError
  (``transient``) ending in ``persisted``; any other error raises
  CheckpointReadError ending in ``unknown``. A signal passes through. The
  caller decides what damage means (the training run moves the checkpoint
  aside, a reader skips it); nothing else may make it read an older one.
  """
  delays = list(delays)
  first_failure, attempts = None, 0
  while True:
    attempts += 1
    try:
      return read()
    except Exception as e:  # pylint: disable=broad-except
      kind = read_failure(e)
      if kind == "damage":
        raise damaged(e) from e
      if kind != "transient":
        raise CheckpointReadError(f"cannot read {where}: {_short(e)}. {unknown}") from e
      first_failure = first_failure if first_failure is not None else time.monotonic()
      spent = time.monotonic() - first_failure
      if not delays or spent + delays[0] > READ_RETRY_BUDGET_S:
        error = CheckpointReadError(
            f"cannot read {where}: a storage error persisted over {attempts} attempts "
            f"({spent:.0f} s): {_short(e)}. {persisted}")
        error.transient = True
        raise error from e
      delay = delays.pop(0)
      logging.warning("reading %s failed (%s); retrying in %g s", where, _short(e), delay)
      time.sleep(delay)


class Checkpointer:
  """Thin wrapper over ``ocp.CheckpointManager`` with a state + JSON-meta item.

  Args:
    directory: checkpoint root, normally ``<workdir>/checkpoints``. Created if
      missing. May be a ``gs://`` path.
    max_to_keep: number of most recent checkpoints kept; older ones are deleted
      after each successful save.
    async_save: if True, ``save`` returns once the arrays are copied to host
      memory and the write to storage continues in a background thread (the
      train step can reuse/donate the device buffers right away). Call
      ``wait()`` before reading the checkpoint from another process and
      ``close()`` at the end of training.

    read_retry_delays: the seconds ``restore_newest`` waits before each retry
      of a read that failed with a transient storage error (``read_failure``);
      once they are used up, or ``READ_RETRY_BUDGET_S`` has passed since the
      first failure, the error stops the run.

  Temporary directories of saves that never finished (a killed or preempted
  run) are removed when the Checkpointer is created. Only the training job
  should therefore construct a Checkpointer on a directory; readers
  (evaluation, fine-tuning) use :func:`restore_params`, which never deletes.
  """

  def __init__(self, directory: str, *, max_to_keep: int = 3,
               async_save: bool = True,
               read_retry_delays: tuple[float, ...] = READ_RETRY_DELAYS_S):
    self._directory = absolute_path(directory)
    self._async = async_save
    self._closed = False
    self._read_retry_delays = tuple(read_retry_delays)
    self._in_flight: tuple[int, int] | None = None   # (step, bytes) of the save under way
    self.skipped_damaged: list[tuple[int, str]] = []   # (step, why) by restore_newest
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save,
        create=True,
        # Half-written "<step>.orbax-checkpoint-tmp" directories are ignored by
        # step listings anyway; removing them reclaims their (possibly large)
        # space and keeps the directory readable for humans.
        cleanup_tmp_directories=True,
    )
    self._manager = ocp.CheckpointManager(
        self._directory, options=options,
        item_handlers=_item_handlers(ocp.StandardCheckpointHandler()))

  @property
  def directory(self) -> epath.Path:
    return self._directory

  def all_steps(self) -> list[int]:
    """Steps of all checkpoints, oldest first (includes a save in flight)."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest checkpoint's step, or None if there is none.

    Half-written checkpoints of earlier (killed) runs are never reported. In the
    process that is saving, an async save in flight is reported as soon as
    ``save`` returns: it becomes readable after ``wait()`` (``restore`` waits
    by itself).
    """
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: dict, *,
           force: bool = False) -> bool:
    """Saves ``state`` (pytree of jax.Arrays, sharded allowed) and ``meta``.

    Returns True if a save was started, False if it was skipped: the step is
    already checkpointed (e.g. the final save at a step that was also a
    periodic save, or a resumed run reaching a step saved before the kill), or
    Orbax's policy declined (a step not newer than the latest, unless
    ``force``).
    """
    meta = _copy_json(meta)
    with interrupts.deferred():    # a save cut short would break Orbax's threads
      # Orbax waits for the previous save first: its failure is that save's.
      self._finish_in_flight()
      with self._writing(int(step), state_bytes(state)):
        saved = self._save(int(step), state, meta, force)
      if saved:
        self._in_flight = (int(step), state_bytes(state))
      return saved

  @contextlib.contextmanager
  def _writing(self, step: int, nbytes: int):
    """Turns a failed write of ``step`` into a CheckpointWriteError whose
    message starts with the cause (errors of unknown cause pass as raised)."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      error = self._write_error(step, nbytes, e)
      if error is None:
        raise
      raise error from e

  def _write_error(self, step: int, nbytes: int, e: BaseException) -> OSError | None:
    if isinstance(e, CheckpointWriteError):
      return None
    code = write_failure(e)
    if code is None:
      return None
    cause, fix = _WRITE_CAUSES[code]
    free = free_bytes(self._directory)
    size = f"about {human_bytes(nbytes)}" + (f"; {human_bytes(free)} free" if free is not None
                                              else "")
    error = CheckpointWriteError(f"{cause} writing the checkpoint of step {step} to "
                                 f"{self._directory} ({size}): {fix}, then rerun the same "
                                 "command to resume from the last complete checkpoint")
    error.errno = code
    return error

  def _finish_in_flight(self) -> None:
    """Waits for the save under way; its failure names its step."""
    step, nbytes = self._in_flight or (None, 0)
    if step is None:
      self._manager.wait_until_finished()
      return
    with self._writing(step, nbytes):
      self._manager.wait_until_finished()
    self._in_flight = None

  def _save(self, step: int, state: Any, meta: dict, force: bool) -> bool:
    if step in self._manager.all_steps():
      logging.info("Checkpoint for step %d already exists in %s; not saving.",
                   step, self._directory)
      return False
    saved = self._manager.save(
        step,
        args=ocp.args.Composite(**{
            STATE_ITEM: ocp.args.StandardSave(state),
            META_ITEM: ocp.args.JsonSave(meta),
        }),
        force=force)
    if saved:
      logging.info("Saving checkpoint for step %d to %s (async=%s).", step,
                   self._directory, self._async)
    return bool(saved)

  def _resolve_step(self, step: int | None) -> int:
    # Make a pending async save of this process visible before reading it.
    self._manager.wait_until_finished()
    if step is None:
      step = self._manager.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoint found in {self._directory}")
    step = int(step)
    if step not in self._manager.all_steps():
      raise FileNotFoundError(
          f"no checkpoint for step {step} in {self._directory}; available: "
          f"{self.all_steps()}")
    return step

  def restore(self, step: int | None, abstract_state: Any) -> tuple[Any, dict]:
    """Restores ``(state, meta)`` of ``step`` (None: the latest checkpoint).

    ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` carrying the
    target ``.sharding`` (e.g. ``jax.eval_shape`` of the init function with
    shardings attached), so each process reads only its shards and arrays land
    directly on the mesh -- possibly a different mesh than the one that saved.
    Concrete jax.Arrays are accepted as well (their shardings are used). The
    returned state has ``abstract_state``'s tree structure (namedtuples of
    optax states included).
    """
    step = self._resolve_step(step)
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(**{
            STATE_ITEM: ocp.args.StandardRestore(abstract_state),
            META_ITEM: ocp.args.JsonRestore(),
        }))
    return restored[STATE_ITEM], dict(restored[META_ITEM])

  def restore_meta(self, step: int | None = None) -> dict:
    """Restores only the JSON metadata of ``step`` (None: latest)."""
    step = self._resolve_step(step)
    restored = self._manager.restore(
        step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))
    return dict(restored[META_ITEM])

  def wait(self) -> None:
    """Blocks until any async save has been fully committed."""
    with interrupts.deferred():
      self._finish_in_flight()

  def close(self) -> None:
    """Waits for pending saves and releases the manager's resources. Idempotent."""
    if self._closed:
      return
    self._closed = True
    with interrupts.deferred():
      self._finish_in_flight()
      self._manager.close()

  def tmp_dirs(self) -> list[epath.Path]:
    """Temporary directories of saves in flight or cut short."""
    if not self._directory.exists():
      return []
    return sorted(p for p in self._directory.iterdir() if ".orbax-checkpoint-tmp" in p.name)

  def finish_or_abandon(self) -> None:
    """Ends this process's saves after an error elsewhere: waits for the save
    in flight (its state was checked finite before it started, so it is a good
    checkpoint) and, if that save itself fails, removes its temporary
    directory. Afterwards every checkpoint on disk is complete, and the
    previous ones are untouched (keep-N deletes only after a commit)."""
    if self._closed:
      return
    self._closed = True
    # Called while another error ends the run: nothing here may replace that
    # error (a full disk's clean-up fails too), so each failure is logged.
    try:
      with interrupts.deferred():
        self._finish_in_flight()
    except BaseException as e:  # pylint: disable=broad-except
      logging.warning("the checkpoint save in flight failed (%s); removing it", _short(e))
    finally:
      try:
        self._manager.close()
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("closing the checkpoint manager failed: %s", _short(e))
      # Only the lock holder writes here, so every temporary directory is ours.
      if jax.process_index() == 0:
        try:
          for tmp in self.tmp_dirs():
            logging.warning("removing the unfinished checkpoint %s", tmp)
            tmp.rmtree(missing_ok=True)
        except OSError as e:
          logging.warning("could not remove an unfinished checkpoint (%s); the next run "
                          "removes it", _short(e))

  def prune(self, keep: int) -> list[int]:
    """Deletes the oldest checkpoints beyond the newest ``keep``.

    Orbax applies keep-N only after a save, so a run killed between a commit
    and that clean-up leaves ``keep + 1`` checkpoints, and a rerun of a
    finished run (no save) would never remove them; the loop calls this at
    start-up. Returns the deleted steps."""
    steps = self.all_steps()
    surplus = steps[:-keep] if keep > 0 else []
    for step in surplus:
      logging.info("removing checkpoint %d beyond keep_checkpoints=%d", step, keep)
      with interrupts.deferred():       # not a half-deleted folder
        self._manager.delete(step)
    if surplus:
      self._manager.reload()
    return surplus

  def _move_aside(self, step: int, reason: str) -> epath.Path:
    """Moves the damaged ``<step>`` to ``<workdir>/checkpoints.damaged/``."""
    target = self._directory.parent / DAMAGED_DIR / str(step)
    if jax.process_index() == 0:
      src = self._directory / str(step)
      target.parent.mkdir(parents=True, exist_ok=True)
      target = numbered(target)
      try:
        src.rename(target)
      except OSError:               # object stores rename files, not folders
        _copy_tree(src, target)
        src.rmtree(missing_ok=True)
      (target / "DAMAGED.txt").write_text(reason + "\n")
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"darl_jax_damaged_{step}")
    self._manager.reload()
    return target

  def _read(self, step: int, what: str, read: Callable[[], Any]) -> Any:
    """``read()`` of checkpoint ``step``'s ``what`` (``read_retried``): raises
    ``_Damaged`` for definite damage and CheckpointReadError for the rest."""
    return read_retried(
        read, f"the {what} of the checkpoint at step {step} in {self._directory}",
        self._read_retry_delays,
        damaged=lambda e: _Damaged(f"its {what} cannot be read: {_short(e)}"),
        unknown=f"Not a known kind of damage, so it stays where it is: fix the cause and "
        f"rerun, or move {self._directory / str(step)} into "
        f"{self._directory.parent / DAMAGED_DIR} to resume from the checkpoint before it",
        persisted="Nothing was moved; rerun the same command once the storage answers")

  def restore_newest(self, abstract_state: Any, check_meta: Callable[[dict], None]
                     = lambda meta: None) -> tuple[int, Any, dict] | None:
    """``(step, state, meta)`` of the newest checkpoint that restores; None if
    there is none.

    ``abstract_state`` may also be a function of the checkpoint's state tree
    (Orbax metadata, None where it does not read) giving the abstract state
    to restore it as, for a run that reads an earlier layout of its state.

    Walks back from the newest step. A checkpoint with definite damage
    (``read_failure``) in its meta, its state metadata or its arrays is
    moved aside (``_move_aside``), logged with the reason, and the previous
    one is tried. Everything else stops the walk and moves nothing: a signal
    (it passes through), a storage error that outlasts the retries or one of
    unknown kind (CheckpointReadError), ``check_meta(meta)`` raising (the
    config does not fit the checkpoint) and a state tree that differs from
    ``abstract_state`` (StateMismatchError naming the difference), since an
    older checkpoint of the same run would not fit either.
    """
    self._manager.wait_until_finished()
    skipped = self.skipped_damaged = []
    try:
      for step in reversed(self.all_steps()):
        try:
          restored = self._restore_one(step, abstract_state, check_meta)
        except _Damaged as e:
          skipped.append((step, str(e)))
          self._move_aside(step, str(e))
          continue
        return (step, *restored)
    finally:
      for s, why in skipped:
        logging.warning("skipped the damaged checkpoint at step %d (%s); moved to %s",
                        s, why, self._directory.parent / DAMAGED_DIR)
    if skipped:
      logging.warning("no checkpoint in %s restores: starting from step 0", self._directory)
    return None

  def _restore_one(self, step: int, abstract_state: Any,
                   check_meta: Callable[[dict], None]) -> tuple[Any, dict]:
    """``(state, meta)`` of ``step`` for restore_newest; _Damaged if it is."""
    meta = self._read(step, "meta", lambda: self.restore_meta(step))
    check_meta(meta)
    try:
      saved = _state_metadata(
          self._read(step, "state metadata", lambda: self._manager.item_metadata(step)))
      if saved is None:
        raise _Damaged(f"its {STATE_ITEM}/ is missing or has no readable metadata "
                       "(_METADATA)")
      saved = getattr(saved, "tree", saved)
    except CheckpointReadError as e:
      if e.transient:
        raise
      saved = None     # a metadata layout this Orbax does not know: the restore judges
    target = abstract_state(saved) if callable(abstract_state) else abstract_state
    if saved is not None:
      diff = state_difference(saved, target)
      if diff:
        error = StateMismatchError(
            f"the checkpoint at step {step} in {self._directory} holds another "
            f"training state than this config builds ({diff})")
        error.meta = meta      # the caller names the config keys that changed
        raise error
    state, meta = self._read(step, "state", lambda: self.restore(step, target))
    return state, meta

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, exc_type, *exc) -> None:
    if exc_type is None:
      self.close()
    else:
      self.finish_or_abandon()


def _no_checkpoint_error(path: epath.Path, detail: str = "") -> FileNotFoundError:
  return FileNotFoundError(
      f"no DARL checkpoint found under {path}: expected {path}/checkpoints/"
      f"<step>/ (a training workdir), a checkpoints directory with <step>/ "
      f"subdirectories, or a step directory .../checkpoints/<step>/ containing "
      f"{STATE_ITEM}/ and {META_ITEM}/" + (f" ({detail})" if detail else ""))


def _resolve_checkpoint_dir(path: epath.Path,
                            step: int | None) -> tuple[epath.Path, int | None]:
  """Maps a workdir / checkpoints dir / step dir to (checkpoints dir, step)."""
  if not path.exists():
    raise _no_checkpoint_error(path, "path does not exist")
  if not path.is_dir():
    raise _no_checkpoint_error(path, "not a directory")
  if (path / "checkpoints").is_dir():
    return path / "checkpoints", step
  if path.name.isdigit() and (path / STATE_ITEM).is_dir():
    dir_step = int(path.name)
    if step is not None and int(step) != dir_step:
      raise ValueError(f"step={step} conflicts with step directory {path}")
    return path.parent, dir_step
  # Otherwise treat it as a checkpoints directory itself; the manager's step
  # listing (which skips temporary directories) decides whether it is one.
  return path, step


def restore_params(path_or_workdir: str, *, step: int | None = None,
                   use_ema: bool | None = False,
                   read_retry_delays: tuple[float, ...] | None = None) -> tuple[Any, dict]:
  """Loads ``state["params"]`` of a DARL checkpoint onto host as numpy arrays.

  Args:
    path_or_workdir: a training workdir (``<workdir>/checkpoints`` is used), a
      checkpoints directory, or one step directory ``.../checkpoints/<step>``.
    step: which step to load from a workdir / checkpoints directory; None means
      the newest checkpoint that reads (newer ones with definite damage,
      ``read_failure``, are skipped with a warning, and left in place).
    use_ema: False: the parameters; True: the EMA of the parameters
      (darl_jax/ema.py; ``ema.MissingEmaError`` where the checkpoint has
      none); None: the EMA where the checkpoint has one, else the parameters.
    read_retry_delays: the waits before each retry of a read that failed
      with a transient storage error (default ``READ_RETRY_DELAYS_S``); one
      that persists, or an error of unknown kind, raises CheckpointReadError:
      an older checkpoint is never read in place of one that may be good.

  Returns:
    ``(params, meta)``: params as nested dicts of ``np.ndarray`` (dtypes as
    saved, e.g. bfloat16 stays bfloat16; the EMA's float32) and the
    checkpoint's JSON metadata, plus ``restored_weights``: ``"ema"`` or
    ``"params"``, which of the two was read.

  No model, mesh or abstract state is needed: the tree structure comes from the
  checkpoint's own metadata, arrays are read whole on every host regardless of
  the sharding they were saved with (so a checkpoint from an 8-GPU run loads
  on a laptop), and only the ``params`` subtree is read (optimizer moments,
  typically 2x the parameter bytes, are skipped).
  """
  manager, ckpt_dir, step, candidates = _open_reader(path_or_workdir, step)
  read = _reader_read(manager, ckpt_dir, read_retry_delays)
  try:
    problems = []
    for s in candidates:
      try:
        params, meta, weights = _read_params(manager, ckpt_dir, s, use_ema, read)
      except CheckpointDamagedError as e:
        problems.append(str(e))
        if step is None:
          logging.warning("skipping %s", e)
        continue
      return params, {**(dict(meta) if meta is not None else {}), "restored_weights": weights}
  finally:
    manager.close()
  if step is not None:
    raise CheckpointDamagedError(problems[0])
  raise CheckpointDamagedError(f"every checkpoint under {ckpt_dir} is damaged: "
                               + "; ".join(problems))


def read_meta(path_or_workdir: str, *, step: int | None = None,
              read_retry_delays: tuple[float, ...] | None = None) -> tuple[int, dict]:
  """``(step, meta)`` of a checkpoint without reading its arrays: ``step`` or
  the newest one whose meta and state metadata read (definite damage
  skipped, other errors raised, as in restore_params). For readers that need
  the stored config before the parameters (sampling builds its model from
  it); they then read the parameters of exactly this step."""
  manager, ckpt_dir, step, candidates = _open_reader(path_or_workdir, step)
  read = _reader_read(manager, ckpt_dir, read_retry_delays)
  try:
    problems = []
    for s in candidates:
      try:
        meta = read(s, "meta", lambda s=s: manager.restore(
            s, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM])
        if _state_metadata(read(s, "state metadata",
                                lambda s=s: manager.item_metadata(s))) is None:
          raise CheckpointDamagedError(f"checkpoint {ckpt_dir}/{s} is damaged: its "
                                       f"{STATE_ITEM}/ has no readable metadata (_METADATA)")
      except CheckpointDamagedError as e:
        problems.append(str(e))
        if step is None:
          logging.warning("skipping %s", e)
        continue
      return s, dict(meta or {})
  finally:
    manager.close()
  raise CheckpointDamagedError("; ".join(problems))


def _reader_read(manager, ckpt_dir: epath.Path,
                 delays: tuple[float, ...] | None) -> Callable[..., Any]:
  """``read(step, what, fn)``: ``fn()`` through ``read_retried`` for the
  readers, whose answer to definite damage is CheckpointDamagedError (the
  walk skips the step, and moves nothing)."""
  delays = READ_RETRY_DELAYS_S if delays is None else tuple(delays)
  steps = ", ".join(str(s) for s in sorted(manager.all_steps()))

  def read(step: int, what: str, fn: Callable[[], Any]) -> Any:
    return read_retried(
        fn, f"the {what} of the checkpoint {ckpt_dir}/{step}", delays,
        damaged=lambda e: CheckpointDamagedError(
            f"checkpoint {ckpt_dir}/{step} is damaged: {_short(e)}"),
        unknown="Not a known kind of damage, so no older checkpoint is read in its place: "
        "fix the cause and rerun, or ask for an earlier step (--step of the export, "
        f"--config.init_step of a downstream job; steps here: {steps})",
        persisted="No older checkpoint was read in its place; rerun the same command once "
        "the storage answers")
  return read


def _open_reader(path_or_workdir: str, step: int | None):
  """``(manager, checkpoints dir, step, steps to try)`` for a reader of
  ``path_or_workdir`` (``step`` as asked, or a step directory's): ``[step]``
  when there is one, else every step newest first, so that a damaged newest
  checkpoint is skipped (and left where it is: a training run may own this
  directory; the run itself moves damaged ones aside). The caller closes the
  manager."""
  path = absolute_path(path_or_workdir)
  ckpt_dir, step = _resolve_checkpoint_dir(path, step)
  # A plain (non read-only) manager with create=False writes nothing unless
  # asked to save, and unlike read_only=True it does not log warnings. It
  # must not clean up temporary directories: a run may be writing right now.
  manager = ocp.CheckpointManager(
      ckpt_dir,
      options=ocp.CheckpointManagerOptions(
          create=False, enable_async_checkpointing=False),
      item_handlers=_item_handlers(ocp.PyTreeCheckpointHandler()))
  try:
    steps = sorted(manager.all_steps())
    if not steps:
      raise _no_checkpoint_error(path)
    if step is not None and int(step) not in steps:
      raise _no_checkpoint_error(
          path, f"step {step} not found; available steps: {steps}")
  except BaseException:
    manager.close()
    raise
  return manager, ckpt_dir, step, ([int(step)] if step is not None else steps[::-1])


def _read_params(manager, ckpt_dir, step: int, use_ema: bool | None, read):
  """``(params, meta, "params" | "ema")`` of one step (``use_ema`` as in
  restore_params; ``read`` from ``_reader_read``); CheckpointDamagedError
  for definite damage, CheckpointReadError for other read errors, KeyError
  if it reads but holds no ``params`` (not a DARL state)."""
  where = f"checkpoint {ckpt_dir}/{step}"
  metadata = _state_metadata(read(step, "state metadata", lambda: manager.item_metadata(step)))
  if metadata is None:
    raise CheckpointDamagedError(f"{where} is damaged: its {STATE_ITEM}/ has no "
                                 "readable metadata (_METADATA)")
  # Orbax >= 0.11 wraps the tree in TreeMetadata; older versions return it.
  tree = getattr(metadata, "tree", metadata)
  if not isinstance(tree, dict) or "params" not in tree:
    keys = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
    raise KeyError(f"checkpoint {ckpt_dir}/{step} has no 'params' in its "
                   f"state (top-level keys: {keys})")
  # The EMA: state["ema"], or model_state["ema"] of earlier fine-tuning runs.
  legacy = "ema" not in tree and ema_lib.is_legacy(tree)
  has_ema = "ema" in tree or legacy
  if use_ema and not has_ema:
    raise ema_lib.MissingEmaError(
        f"checkpoint {ckpt_dir}/{step} holds no EMA of the parameters (its run had "
        "ema_decay=0; training with --config.ema_decay=0.9999 keeps one)")
  use_ema = has_ema if use_ema is None else bool(use_ema)
  if not use_ema:
    wanted = {"params": tree["params"]}
  elif legacy:
    wanted = {"model_state": {"ema": tree["model_state"]["ema"]}}
  else:
    wanted = {"ema": tree["ema"]}
  restore_args = jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
  restored = read(step, "state", lambda: manager.restore(
      step,
      args=ocp.args.Composite(**{
          STATE_ITEM: ocp.args.PyTreeRestore(
              item=wanted, restore_args=restore_args, partial_restore=True),
          META_ITEM: ocp.args.JsonRestore(),
      })))
  state, meta = restored[STATE_ITEM], restored[META_ITEM]
  if not use_ema:
    return state["params"], meta, "params"
  ema = state["ema"] if not legacy else ema_lib.from_legacy(
      state["model_state"]["ema"], ((meta or {}).get("config") or {}).get("ema_decay", 0.0))
  return ema_lib.host_average(ema, where), meta, "ema"


def stored_config(path_or_workdir: str, meta: dict) -> dict:
  """The resolved config of the run that wrote a checkpoint, as a dict.

  From the checkpoint's own meta (``checkpoint_meta`` puts it there); for
  checkpoints written before it did, from the workdir's ``config.json`` (with
  a warning: a later command on that workdir may have rewritten it).
  """
  config = meta.get("config")
  if isinstance(config, dict):
    return config
  path = absolute_path(path_or_workdir)
  for candidate in (path, path.parent, path.parent.parent):  # workdir, ckpt dir, step dir
    config_path = candidate / "config.json"
    if config_path.exists():
      logging.warning("the checkpoint under %s does not hold its config (written by an "
                      "older version); reading %s instead", path, config_path)
      try:
        return json.loads(config_path.read_text())
      except ValueError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from e
  raise FileNotFoundError(
      f"the checkpoint under {path} holds no config and there is no config.json in "
      "its workdir: pass the pretraining run's workdir")
