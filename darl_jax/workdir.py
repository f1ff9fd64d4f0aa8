"""A run's --workdir: checked before anything is written, owned by one run at a time.

``prepare(workdir)`` resolves the path (Orbax wants absolute local paths; URLs
such as ``gs://...`` stay as given), creates the directory and fails with one
line when it cannot be used: a file in its place, no permission to write.

``WorkdirLock`` is the lock file ``<workdir>/run.lock``, held by process 0 of
a run from start to exit. Two runs on one workdir would otherwise delete each
other's temporary checkpoints and write every step twice into metrics.jsonl;
the second run fails at once, naming the holder (pid, host, start time).

* Local paths: the lock is ``fcntl.flock`` on the file. The kernel drops it
  when the holding process dies, however it dies (``kill -9`` included), so a
  lock left behind by a killed run is stale by construction and the next run
  takes it over; the file's JSON (pid, host, start time) only names the holder.
  flock also covers NFS (Linux maps it onto NFS byte-range locks).
* Remote paths (``gs://``): object stores have no locks, so the lock is
  best-effort: the file's presence. A lock naming a process of this host that
  no longer runs is stale and taken over; one from another host cannot be
  checked from here and is refused with the command that removes it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import socket
import sys
import time

from absl import logging
from etils import epath

LOCK_NAME = "run.lock"


class WorkdirError(ValueError):
  """The workdir cannot be used (a file, not writable) or another run holds it."""


def is_remote(path) -> bool:
  return "://" in str(path)


def prepare(workdir) -> epath.Path:
  """The absolute workdir, created; a WorkdirError (one line) if it is unusable."""
  workdir = str(workdir)
  if not is_remote(workdir):
    workdir = os.path.abspath(workdir)
  path = epath.Path(workdir)
  if path.exists() and not path.is_dir():
    raise WorkdirError(f"--workdir {workdir} is a file, not a directory; pass a "
                       "directory (it is created if missing)")
  try:
    path.mkdir(parents=True, exist_ok=True)
  except (FileExistsError, NotADirectoryError) as e:
    raise WorkdirError(f"--workdir {workdir} cannot be created: a part of the path "
                       "is a file, not a directory") from e
  except OSError as e:
    raise WorkdirError(f"--workdir {workdir} cannot be created ({e.strerror or e}); "
                       "choose a writable directory") from e
  if not is_remote(workdir):
    # A real write, not os.access: root passes access checks on read-only
    # directories, and read-only mounts fail only on writing.
    # Named per process: every process of a multi-host job checks, possibly
    # on one shared file system.
    probe = os.path.join(workdir, f".write-test-{socket.gethostname()}-{os.getpid()}")
    try:
      with open(probe, "w"):
        pass
      os.remove(probe)
    except OSError as e:
      raise WorkdirError(f"--workdir {workdir} is not writable ({e.strerror or e}); "
                         "choose a writable directory or fix its permissions") from e
  return path


def _process_start_time(pid: int) -> str | None:
  """The start time of ``pid`` in clock ticks since boot (Linux), to tell a
  live holder from an unrelated process that reused its pid; None elsewhere."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      # The command name (field 2) may hold spaces; fields after it are plain.
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _pid_alive(pid: int, start_time: str | None) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True                     # someone else's live process
  if start_time is not None:
    now = _process_start_time(pid)
    return now is None or now == start_time
  return True


def _describe(holder: dict | None) -> str:
  if not holder:
    return "a run whose lock file is unreadable"
  return (f"pid {holder.get('pid')} on {holder.get('host')} (started "
          f"{holder.get('started')}: {holder.get('command', '?')})")


class WorkdirLock:
  """``<workdir>/run.lock``; see the module docstring.

  Args:
    workdir: the run's workdir (must exist).
    use_flock: None picks flock for local paths and the best-effort file for
      remote ones; tests pass False to exercise the remote protocol locally.
  """

  def __init__(self, workdir, *, use_flock: bool | None = None):
    self.path = epath.Path(workdir) / LOCK_NAME
    self._flock = (not is_remote(workdir)) if use_flock is None else use_flock
    self._fd = None
    self._held = False
    self._record = {
        "pid": os.getpid(), "host": socket.gethostname(),
        "pid_start_time": _process_start_time(os.getpid()),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "command": " ".join(sys.argv)[:500]}

  def read_holder(self) -> dict | None:
    try:
      return json.loads(self.path.read_text())
    except (OSError, ValueError):
      return None

  def _held_by_other_error(self, holder, how_to_clear: str) -> WorkdirError:
    return WorkdirError(
        f"the workdir {self.path.parent} is in use by {_describe(holder)}; wait for "
        f"that run to end, stop it, or use another --workdir{how_to_clear}")

  def acquire(self) -> "WorkdirLock":
    if self._held:
      return self
    if self._flock:
      self._acquire_flock()
    else:
      self._acquire_file()
    self._held = True
    return self

  def _acquire_flock(self):
    import fcntl
    path = os.fspath(self.path)
    while True:
      try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
      except OSError as e:
        raise WorkdirError(f"cannot create the lock file {path} ({e.strerror or e}); "
                           "the workdir must be writable") from e
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
          # A file system without flock (some network mounts): the lock file.
          logging.warning("%s: no flock on this file system (%s); using the lock "
                          "file's pid and host instead", path, e)
          self._flock = False
          self._acquire_file()
          return
        raise self._held_by_other_error(self.read_holder(), "") from None
      # A holder releasing at this moment unlinks the file it locked: if the
      # file we locked is no longer the one at the path, lock the new one.
      try:
        same = os.fstat(fd).st_ino == os.stat(path).st_ino
      except FileNotFoundError:
        same = False
      if same:
        break
      os.close(fd)
    stale = self.read_holder()
    if stale and stale.get("pid") != os.getpid():
      logging.info("took over the lock of %s, which no longer runs", _describe(stale))
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(self._record) + "\n").encode())
    os.fsync(fd)
    self._fd = fd

  def _acquire_file(self):
    holder = self.read_holder() if self.path.exists() else None
    if self.path.exists():
      same_host = holder and holder.get("host") == socket.gethostname()
      if holder is None and not self.path.read_text().strip():
        pass      # empty: left by a flock attempt, or a writer killed mid-write
      elif same_host and not _pid_alive(int(holder.get("pid", -1)),
                                        holder.get("pid_start_time")):
        logging.info("taking over the stale lock of %s", _describe(holder))
      elif holder == self._record:
        pass                                    # ours, from an earlier call
      else:
        raise self._held_by_other_error(
            holder, f"; if that run is gone, delete {self.path}")
    try:
      self.path.write_text(json.dumps(self._record) + "\n")
    except OSError as e:
      raise WorkdirError(f"cannot create the lock file {self.path} ({e}); the workdir "
                         "must be writable") from e
    # Best effort against a simultaneous start: the last writer wins the file,
    # the other sees someone else's record and backs off.
    time.sleep(0.2)
    if self.read_holder() != self._record:
      raise self._held_by_other_error(self.read_holder(), "")

  def release(self) -> None:
    """Removes the lock file (if still ours) and drops the lock. Idempotent."""
    if not self._held:
      return
    self._held = False
    try:
      if self._flock:
        # Unlink before unlocking: a run that opened the old file meanwhile
        # sees that the path now names another file and retries (acquire).
        try:
          os.unlink(os.fspath(self.path))
        except FileNotFoundError:
          pass
        os.close(self._fd)
        self._fd = None
      elif self.read_holder() == self._record:
        self.path.unlink()
    except OSError as e:           # a lock left behind is stale, not harmful
      logging.warning("could not remove %s: %s", self.path, e)

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def hold(workdir, *, is_main: bool):
  """The lock of ``workdir`` for this run, as a context manager: process 0
  takes it; in a multi-process job the others learn whether it succeeded (a
  collective), so that every process fails together instead of waiting for
  process 0 at the first collective of the run."""

  @contextlib.contextmanager
  def held():
    lock = WorkdirLock(workdir) if is_main else None
    error = None
    if lock is not None:
      try:
        lock.acquire()
      except WorkdirError as e:
        error = e
    import jax
    if jax.process_count() > 1:
      import numpy as np
      from jax.experimental import multihost_utils
      ok = multihost_utils.broadcast_one_to_all(np.int32(error is None))
      if not int(ok) and error is None:
        error = WorkdirError(f"process 0 could not lock the workdir {workdir}; see "
                             "its error")
    if error is not None:
      raise error
    try:
      yield lock
    finally:
      if lock is not None:
        lock.release()

  return held()
