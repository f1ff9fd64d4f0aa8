"""A run's --workdir: checked before anything is written, owned by one run at a time.

``prepare(workdir, config)`` resolves the path (Orbax wants absolute local
paths; URLs such as ``gs://...`` stay as given), creates the directory and
fails with one line when it cannot be used: a file in its place, no
permission to write, a directory of another user, or another run's:

* A job never writes into the run it reads: a ``--workdir`` equal to or
  inside ``config.init_from`` (or the run that holds it, when ``init_from``
  names its ``checkpoints`` directory or a step of it) is refused before
  anything is written, since the job would empty that run's metrics.jsonl
  and replace its config.json.
* A workdir holds one kind of job: ``config.json`` records the job kind
  (``job``, the trainer or driver name), and a job of another kind on it is
  refused, naming both (a config.json from before the field: its
  ``trainer``; neither: accepted).

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
import pwd
import socket
import sys
import tempfile
import time

from absl import logging
from etils import epath

LOCK_NAME = "run.lock"
CONFIG_NAME = "config.json"
# The key of config.json that names the job kind (metrics.MetricWriter writes it).
JOB_KEY = "job"


class WorkdirError(ValueError):
  """The workdir cannot be used (a file, not writable) or another run holds it."""


def is_remote(path) -> bool:
  return "://" in str(path)


def _normalized(path: str) -> str:
  """A local path resolved (symbolic links, ``..``); a URL without trailing slashes."""
  path = str(path)
  return path.rstrip("/") if is_remote(path) else os.path.realpath(path)


def _is_within(path: str, root: str) -> bool:
  if is_remote(path) != is_remote(root):
    return False
  if is_remote(path):
    return path == root or path.startswith(root + "/")
  return path == root or os.path.commonpath([path, root]) == root


def source_run(init_from: str) -> str:
  """The run directory that ``init_from`` reads: a workdir as given; for its
  ``checkpoints`` directory or a step directory of it, the workdir above."""
  path = _normalized(init_from)
  parts = path.split("/")
  if len(parts) > 2 and parts[-1].isdigit() and parts[-2] == "checkpoints":
    return "/".join(parts[:-2]) or "/"
  if len(parts) > 1 and parts[-1] == "checkpoints":
    return "/".join(parts[:-1]) or "/"
  return path


def check_not_in_source(workdir, init_from) -> None:
  """A WorkdirError if ``workdir`` is or lies inside the run ``init_from``
  reads (local paths resolved, URLs compared as strings)."""
  if not init_from:
    return
  source = source_run(str(init_from))
  if _is_within(_normalized(str(workdir)), source):
    raise WorkdirError(
        f"--workdir {workdir} is inside the run this job reads (init_from {init_from}): "
        f"the job would overwrite that run's files; pass a --workdir outside {source}")


def stored_job(workdir) -> str | None:
  """The job kind recorded in ``<workdir>/config.json``: its ``job``, else
  its ``trainer`` (written before the field); None without either."""
  path = epath.Path(workdir) / CONFIG_NAME
  try:
    text = path.read_text()
  except FileNotFoundError:
    return None
  except OSError as e:
    raise WorkdirError(f"cannot read {path} ({e}); fix its permissions or use another "
                       "--workdir") from e
  try:
    stored = json.loads(text)
  except ValueError:
    stored = None
  if not isinstance(stored, dict):
    raise WorkdirError(f"{path} is not a darl_jax config (not a JSON object), so the "
                       "workdir's job is unknown; use another --workdir")
  kind = stored.get(JOB_KEY) or stored.get("trainer")
  return str(kind) if kind else None


def check_job(workdir, kind: str | None) -> None:
  """A WorkdirError if ``workdir`` holds a run of another job kind."""
  if not kind:
    return
  old = stored_job(workdir)
  if old is not None and old != kind:
    raise WorkdirError(
        f"--workdir {workdir} holds a {old} run (its {CONFIG_NAME}) and this is a {kind} "
        f"job; a workdir holds one kind of job: use another --workdir")


def check_owner(workdir: str) -> None:
  """A WorkdirError if the local directory ``workdir`` belongs to another user:
  its files (the lock, links planted in it) are not this run's to trust."""
  owner = os.stat(workdir).st_uid
  if owner == os.geteuid():
    return
  try:
    name = pwd.getpwuid(owner).pw_name
  except KeyError:
    name = f"uid {owner}"
  raise WorkdirError(f"--workdir {workdir} belongs to user {name}, not to this user: "
                     "use a --workdir of your own (or have its owner hand it over with chown)")


def prepare(workdir, config=None) -> epath.Path:
  """The absolute workdir, created; a WorkdirError (one line) if it is unusable.
  With ``config``: also refused inside the run its ``init_from`` reads, or
  when it holds a run of another job kind (``config.trainer``)."""
  workdir = str(workdir)
  if not is_remote(workdir):
    workdir = os.path.abspath(workdir)
  path = epath.Path(workdir)
  if config is not None:
    check_not_in_source(workdir, config.get("init_from", ""))
  if path.exists() and not path.is_dir():
    raise WorkdirError(f"--workdir {workdir} is a file, not a directory; pass a "
                       "directory (it is created if missing)")
  if not is_remote(workdir) and path.exists():
    check_owner(workdir)
  if config is not None and path.exists():
    check_job(workdir, config.get("trainer"))
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
    # A fresh name per process (mkstemp: O_EXCL, unpredictable): every process
    # of a multi-host job checks, possibly on one shared file system, and no
    # link planted under a known name is followed.
    try:
      fd, probe = tempfile.mkstemp(dir=workdir, prefix=f".write-test-{socket.gethostname()}-")
      os.close(fd)
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


# O_NOFOLLOW: a link planted at the lock's path would have the run truncate
# and write whatever file it points to; O_CLOEXEC: the lock stays with this
# process, not with the programs it starts.
_LOCK_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def _lock_open_error(path: str, e: OSError) -> WorkdirError:
  if e.errno == errno.ELOOP:
    return WorkdirError(f"the lock file {path} is a symbolic link, which a run never "
                        "creates: delete it (or use another --workdir)")
  return WorkdirError(f"cannot create the lock file {path} ({e.strerror or e}); the "
                      "workdir must be writable")


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
      if is_remote(self.path):
        return json.loads(self.path.read_text())
      fd = os.open(os.fspath(self.path), os.O_RDONLY | _LOCK_OPEN_FLAGS)
      with os.fdopen(fd, "rb") as f:
        return json.loads(f.read())
    except (OSError, ValueError):
      return None

  def _write_record(self) -> None:
    text = json.dumps(self._record) + "\n"
    if is_remote(self.path):
      self.path.write_text(text)
      return
    path = os.fspath(self.path)
    try:
      fd = os.open(path, _LOCK_OPEN_FLAGS | os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:
      raise _lock_open_error(path, e) from e
    with os.fdopen(fd, "w") as f:
      f.write(text)

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
        fd = os.open(path, _LOCK_OPEN_FLAGS | os.O_RDWR | os.O_CREAT, 0o644)
      except OSError as e:
        raise _lock_open_error(path, e) from e
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
    if not is_remote(self.path) and os.path.islink(os.fspath(self.path)):
      raise _lock_open_error(os.fspath(self.path), OSError(errno.ELOOP, "a link"))
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
      self._write_record()
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
