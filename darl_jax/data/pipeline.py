"""The host input pipeline: Grain over step-indexed batches.

Every random-access source can build the local batch of any step directly
(``batch_at(step)``: a pure function of the seed, the step and the process's
slice, see sources/indexed.py). The pipeline is therefore a Grain ``MapDataset``
whose element ``k`` is the batch of step ``k``::

    MapDataset.range(start, END).map(batch_at) -> to_iter_dataset()
      -> mp_prefetch(num_workers)      # whole batches built in worker processes

so each of ``num_workers`` processes decodes and augments whole batches,
Grain hands them back in step order, and nothing about the order depends on
the worker count: 0, 1 or 16 workers give the same batches. The iterator's
state is the next step it will deliver (``{"next_step": k}``) and, when the
global batch is made of several streams, their number (``"streams"``,
base.stream_rows); a resumed run rebuilds the dataset from ``k``, with any
number of workers and processes. Batches are uint8 (images) and int32
(labels): conversion to float happens on the device.

Shared memory: Grain's workers hand each batch over as POSIX shared-memory
segments (``/dev/shm/psm_*``), which Grain unlinks only when the receiving
array is garbage collected, in a background thread. A batch still alive at
interpreter exit (the device feed's queue, a jax array aliasing it on CPU, the
caller's last batch) or one whose deletion was still queued is never
unlinked: Python's resource tracker then warns about "leaked shared_memory
objects", and a killed run leaves the segments in /dev/shm. ``StepIterator``
therefore maps every batch's memory into a plain numpy array of its own as
it arrives and unlinks the segment's name at once (no copy, ``_remap``), so
no name outlives its delivery; the ones still in flight are released by
``close()``, which also runs at interpreter exit for every iterator left
open. When the parent is killed (SIGKILL), its workers end within a second
and unlink the segments they made that are still there (``_DieWithParent``),
so nothing is left and Python's resource tracker finds nothing to warn of.

Sources that cannot address a step directly (the tf.data TFDS path) keep
their own sequential iterator, wrapped to the same interface
(``SequentialIterator``).
"""

from __future__ import annotations

import atexit
import collections
import mmap
import os
import threading
import time
import weakref
from typing import Callable, Iterator

import numpy as np

# Steps the dataset can address: a run never gets near it.
END = 1 << 40
# Workers used by num_workers=-1 at most; more rarely pays for its memory.
MAX_AUTO_WORKERS = 32
# How often a worker checks that its training process is still alive.
PARENT_POLL_S = 1.0


def host_cores() -> int:
  """CPU cores this process may run on."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:   # not Linux
    return os.cpu_count() or 1


def processes_on_host() -> int:
  """Training processes sharing this host, from the launcher's environment
  (Slurm, torchrun-style launchers); 1 when none says."""
  for key in ("SLURM_NTASKS_PER_NODE", "LOCAL_WORLD_SIZE", "DARL_PROCESSES_PER_HOST"):
    value = os.environ.get(key, "").split("(")[0]
    if value.isdigit() and int(value) > 0:
      return int(value)
  return 1


def resolve_num_workers(num_workers: int) -> int:
  """``data.num_workers``: -1 = one worker per core of this process's share
  of the host (at least 1, at most MAX_AUTO_WORKERS); 0 = build batches in
  the training process. No core is held back for the training process: it
  mostly waits for the accelerator, and on a 2-core machine one worker
  would leave half the decoding power unused."""
  if num_workers >= 0:
    return int(num_workers)
  share = host_cores() // processes_on_host()
  return max(1, min(MAX_AUTO_WORKERS, share))


def _parse_absl_flags() -> None:
  """Grain's workers read absl flags; a caller that never parsed them (a
  notebook, a test) would make them fail. Parsing with no arguments only
  fixes the defaults."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def _remap(value):
  """``value``, a Grain ``SharedMemoryArray`` (a numpy array with a ``shm``
  segment), as a plain numpy array over a mapping of its own, and the
  segment's name unlinked now: the memory lives exactly as long as the array
  (the OS frees it with the last mapping), nothing is left in /dev/shm
  whenever, or whether, the array is collected, and there is no copy (a
  batch of 256 images at 224 px is 38 MB; copying it took ~0.1 s on the
  2-core host). Without POSIX shared memory (or on any error) the array is
  copied instead. Other values pass through."""
  shm = getattr(value, "shm", None)
  if shm is None or not isinstance(value, np.ndarray):
    return value
  try:
    import _posixshmem  # pylint: disable=g-import-not-at-top  # CPython's, as multiprocessing uses
    fd = _posixshmem.shm_open("/" + shm.name.lstrip("/"), os.O_RDWR, mode=0o600)
    try:
      mapping = mmap.mmap(fd, max(value.nbytes, 1))
    finally:
      os.close(fd)
    out = np.frombuffer(mapping, value.dtype, count=value.size).reshape(value.shape)
  except (ImportError, OSError, ValueError):
    out = np.array(value, copy=True, subok=False)
  if getattr(value, "_unlink_on_del", False):
    value._unlink_on_del = False   # pylint: disable=protected-access  # Grain's flag
    try:
      shm.unlink()
    except FileNotFoundError:
      pass
  return out


def own_batch(batch):
  """``batch`` (a dict of arrays) with every array out of shared memory."""
  if isinstance(batch, dict):
    return {k: _remap(v) for k, v in batch.items()}
  return _remap(batch)


class _DieWithParent:
  """Grain worker init: a daemon thread ends the worker (``os._exit``) once
  the training process that started it is gone (killed, even by SIGKILL),
  so that no orphan keeps producing shared memory. (Not
  ``PR_SET_PDEATHSIG``: Grain starts its workers from short-lived threads,
  and that signal fires when the starting thread ends, killing healthy
  workers mid-batch.)

  Before it exits, the worker unlinks the segments it made that are still
  in /dev/shm (batches in flight: queued, or received by the parent but not
  yet unlinked by ``_remap``) and takes them off Python's resource tracker.
  The tracker, shared by the parent and its workers, would otherwise unlink
  them itself once the last of them is gone, warning about "leaked
  shared_memory objects" for a run that leaked nothing. It stays the
  safety net for a worker that dies without cleaning up (the OOM killer):
  its segments are still registered, the tracker unlinks them, and that
  warning is then a true one. Segment names are random (``psm_`` and 8 hex
  digits), so an unlink of a name the parent already unlinked fails with
  FileNotFoundError and touches nothing else."""

  # Names kept per worker: far more than its batches in flight (its buffer
  # of ``per_worker_buffer_size`` batches, a few arrays each).
  KEEP = 256

  def __init__(self):
    self.parent_pid = os.getpid()

  def __call__(self, worker_index: int, worker_count: int) -> None:
    del worker_index, worker_count
    from multiprocessing import resource_tracker  # pylint: disable=g-import-not-at-top
    self._made: collections.deque = collections.deque(maxlen=self.KEEP)
    self._lock = threading.Lock()
    self._ending = False
    self._register = resource_tracker.register
    self._unregister = resource_tracker.unregister
    resource_tracker.register = self._register_and_remember
    threading.Thread(target=self._watch, daemon=True, name="darl-parent-watch").start()

  def _register_and_remember(self, name: str, rtype: str) -> None:
    if rtype != "shared_memory":
      self._register(name, rtype)
      return
    with self._lock:
      if self._ending:      # made while the worker ends: never handed over
        _unlink_segment(name)
        return
      self._register(name, rtype)
      self._made.append(name)

  def _watch(self) -> None:
    while True:
      time.sleep(PARENT_POLL_S)
      if os.getppid() != self.parent_pid:
        with self._lock:
          self._ending = True
          for name in self._made:
            if _unlink_segment(name):
              self._unregister(name, "shared_memory")
        os._exit(1)   # pylint: disable=protected-access  # no cleanup: the parent is gone


def _unlink_segment(name: str) -> bool:
  """Unlinks the POSIX shared-memory segment ``name``; False if it was gone."""
  try:
    import _posixshmem  # pylint: disable=g-import-not-at-top  # CPython's, as multiprocessing uses
    _posixshmem.shm_unlink(name if name.startswith("/") else "/" + name)
    return True
  except (ImportError, OSError):
    return False


def _drain_shared_memory_deletes() -> None:
  """Runs the shared-memory deletions Grain queued in its background thread
  pool (arrays that its own prefetch buffers dropped), and makes later ones
  synchronous until the next pipeline starts: queued deletions would die
  with the interpreter, their segments unlinked by no one. Grain's private
  API, pinned in constraints.txt; a Grain without it has nothing to drain."""
  try:
    from grain._src.python.ipc import shared_memory_array  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  cls = getattr(shared_memory_array, "SharedMemoryArray", None)
  lock = getattr(cls, "_lock", None)
  if lock is None or not hasattr(cls, "_del_thread_pool"):
    return
  with lock:
    pool = cls._del_thread_pool                 # pylint: disable=protected-access
    cls._del_thread_pool = None                 # pylint: disable=protected-access
    cls._outstanding_del_requests = None        # pylint: disable=protected-access
  if pool is not None:
    pool.close()
    pool.join()


# Iterators with worker processes not yet closed; closed at interpreter exit,
# before module teardown (when Grain's own finalizers can no longer run).
_OPEN: "weakref.WeakSet[StepIterator]" = weakref.WeakSet()


def _close_open_iterators() -> None:
  for it in list(_OPEN):
    it.close()


def _register_exit_close() -> None:
  """(Re)registers ``_close_open_iterators`` as the newest exit handler:
  handlers run newest first, and it must run before multiprocessing's own
  (registered once worker processes exist), which terminates the workers
  with their batches still in flight."""
  atexit.unregister(_close_open_iterators)
  atexit.register(_close_open_iterators)


class _Counted:
  """An iterator over ``self._iter`` that counts the steps it delivered."""

  _iter: Iterator[dict]
  _next_step: int
  # What the stream is besides its position (``streams``), saved beside it.
  _extra: dict = {}

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = next(self._iter)
    self._next_step += 1
    return batch

  def get_state(self) -> dict:
    return {"next_step": self._next_step, **self._extra}


class StepIterator(_Counted):
  """Batches of steps ``start_step, start_step + 1, ...`` (up to ``stop``,
  exclusive) from ``batch_at``.

  ``batch_at`` must be picklable when ``num_workers > 0`` (it is sent to the
  worker processes). ``get_state()`` / ``set_state()`` give and take
  ``{"next_step": k}``, with ``state``'s entries beside it (``streams``:
  what the batches are made of, fixed for the iterator).
  """

  def __init__(self, batch_at: Callable[[int], dict], *, start_step: int = 0,
               num_workers: int = 0, stop: int = END, state: dict | None = None):
    self._batch_at = batch_at
    self._extra = dict(state or {})
    self._num_workers = int(num_workers)
    self._stop = int(stop)
    self._open(int(start_step))

  def _open(self, step: int) -> None:
    import grain  # pylint: disable=g-import-not-at-top
    if step < 0:
      raise ValueError(f"start step must be >= 0, got {step}")
    dataset = grain.MapDataset.range(step, max(step, self._stop)).map(self._batch_at)
    # One batch at a time per process: a batch is already the unit of work,
    # and threads under the GIL would only add buffered batches.
    iterable = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0,
                                                         prefetch_buffer_size=0))
    if self._num_workers > 0:
      _parse_absl_flags()
      iterable = iterable.mp_prefetch(grain.MultiprocessingOptions(
          num_workers=self._num_workers, per_worker_buffer_size=2),
                                      worker_init_fn=_DieWithParent())
      _OPEN.add(self)
    self._iter = iter(iterable)
    if self._num_workers > 0:
      _register_exit_close()
    self._next_step = step

  def __next__(self) -> dict:
    return own_batch(super().__next__())

  def set_state(self, state: dict) -> None:
    step = int(state["next_step"])
    for key, value in self._extra.items():
      if key in state and state[key] != value:
        raise ValueError(f"the data state's {key} is {state[key]!r} but this iterator "
                         f"reads {value!r}: build a new iterator from that state")
    if step != self._next_step:
      self.close()
      self._open(step)

  def close(self) -> None:
    """Stops the worker processes (if any) and unlinks the shared memory of
    the batches they still held. Idempotent; also runs when the iterator is
    collected and at interpreter exit."""
    _OPEN.discard(self)
    it = getattr(self, "_iter", None)
    close = getattr(it, "close", None)
    if close is None:
      return
    close()
    # Grain's iterators are dropped now, not at interpreter teardown (where
    # their finalizers fail); then what their buffers held is deleted.
    self._iter = iter(())
    del it, close
    _drain_shared_memory_deletes()

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except  # interpreter teardown
      pass


class SequentialIterator(_Counted):
  """A source's own sequential batch iterator, with the same state interface."""

  def __init__(self, batches: Iterator[dict], start_step: int, state: dict | None = None):
    self._iter = batches
    self._next_step = int(start_step)
    self._extra = dict(state or {})

  def set_state(self, state: dict) -> None:
    if int(state["next_step"]) != self._next_step:
      raise ValueError(f"this source restarts only at the step it was built for "
                       f"({self._next_step}), not at {state['next_step']}")

  def close(self) -> None:
    pass


def check_state(state: dict | None, start_step: int) -> None:
  """A checkpoint's data state must be where its step says the data is."""
  if state is None:
    return
  if "next_step" not in state:
    raise ValueError(f"unknown data iterator state {state!r} (expected next_step)")
  streams = state.get("streams", 1)
  if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
    raise ValueError(f"the data state's streams must be a positive integer, got "
                     f"{streams!r}: the checkpoint is inconsistent")
  if int(state["next_step"]) != int(start_step):
    raise ValueError(
        f"the checkpoint's data state is at step {state['next_step']} but its "
        f"training state at step {start_step}: the checkpoint is inconsistent")
