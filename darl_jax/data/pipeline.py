"""The host input pipeline: Grain over step-indexed batches.

Every random-access source can build the local batch of any step directly
(``batch_at(step)``: a pure function of the seed, the step and the process's
slice, see indexed.py). The pipeline is therefore a Grain ``MapDataset``
whose element ``k`` is the batch of step ``k``::

    MapDataset.range(start, END).map(batch_at) -> to_iter_dataset()
      -> mp_prefetch(num_workers)      # whole batches built in worker processes

so each of ``num_workers`` processes decodes and augments whole batches,
Grain hands them back in step order, and nothing about the order depends on
the worker count: 0, 1 or 16 workers give the same batches. The iterator's
state is the next step it will deliver (``{"next_step": k}``); a resumed
run rebuilds the dataset from ``k``. Batches are uint8 (images) and int32
(labels): conversion to float happens on the device.

Sources that cannot address a step directly (the tf.data TFDS path) keep
their own sequential iterator, wrapped to the same interface
(``SequentialIterator``).
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

# Steps the dataset can address: a run never gets near it.
END = 1 << 40
# Workers used by num_workers=-1 at most; more rarely pays for its memory.
MAX_AUTO_WORKERS = 32


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


class _Counted:
  """An iterator over ``self._iter`` that counts the steps it delivered."""

  _iter: Iterator[dict]
  _next_step: int

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = next(self._iter)
    self._next_step += 1
    return batch

  def get_state(self) -> dict:
    return {"next_step": self._next_step}


class StepIterator(_Counted):
  """Batches of steps ``start_step, start_step + 1, ...`` (up to ``stop``,
  exclusive) from ``batch_at``.

  ``batch_at`` must be picklable when ``num_workers > 0`` (it is sent to the
  worker processes). ``get_state()`` / ``set_state()`` give and take
  ``{"next_step": k}``.
  """

  def __init__(self, batch_at: Callable[[int], dict], *, start_step: int = 0,
               num_workers: int = 0, stop: int = END):
    self._batch_at = batch_at
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
          num_workers=self._num_workers, per_worker_buffer_size=2))
    self._iter = iter(iterable)
    self._next_step = step

  def set_state(self, state: dict) -> None:
    step = int(state["next_step"])
    if step != self._next_step:
      self.close()
      self._open(step)

  def close(self) -> None:
    """Stops the worker processes (if any)."""
    close = getattr(self._iter, "close", None)
    if close is not None:
      close()


class SequentialIterator(_Counted):
  """A source's own sequential batch iterator, with the same state interface."""

  def __init__(self, batches: Iterator[dict], start_step: int):
    self._iter = batches
    self._next_step = int(start_step)

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
  if int(state["next_step"]) != int(start_step):
    raise ValueError(
        f"the checkpoint's data state is at step {state['next_step']} but its "
        f"training state at step {start_step}: the checkpoint is inconsistent")
