"""Feeding the step, and where the wall time goes.

``DeviceFeed`` turns the host pipeline's process-local uint8 batches into
global ``jax.Array``s on the mesh in a background thread, a couple of
batches ahead of the step, and remembers the data iterator's state after
each batch so that a checkpoint can store exactly where the data stood.

``StepClock`` splits the loop's wall time into time blocked on input, time
blocked on the device, and the rest (evaluation, checkpoints, compilation),
and reports per log window and for the whole run:

- ``step_time_ms``: wall time per step over the window;
- ``input_wait_fraction``: share of the window spent waiting for a batch;
- ``goodput``: share of the run's wall time (since the loop started, so
  start-up, compilation, evaluations and saves count against it) spent in
  steps that did not wait for input.

The loop keeps at most two steps in flight (it blocks on the older one
before dispatching more), so the host cannot run ahead of the device and
book the device's time as input wait: waiting in ``next(feed)`` then means
that the device is idle for lack of data.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Iterator

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

# A window spending more than this share waiting for input is input-bound.
INPUT_BOUND_FRACTION = 0.1


def model_input(batch: dict) -> dict:
  """``batch`` with its uint8 images (the host pipeline's wire format) as
  float32 in [-1, 1]. Runs on the device, inside the jitted steps: the host
  sends a quarter of float32's bytes and does no per-pixel arithmetic.
  Float images (already converted) pass through unchanged."""
  image = batch["image"]
  if image.dtype == jnp.uint8:
    image = image.astype(jnp.float32) * jnp.float32(1 / 127.5) - jnp.float32(1.0)
  return {**batch, "image": image}


def to_global(batch: dict, sharding) -> dict:
  """Process-local numpy batch -> global jax.Arrays laid out on the mesh."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in batch.items()}


def state_of(it) -> Any:
  """The host iterator's data state (``get_state()``), None if it has none."""
  # A trainer's make_source may wrap a source's iterator in a plain
  # generator: it then has no state, and a resume goes by the step alone.
  get_state = getattr(it, "get_state", None)
  return get_state() if get_state is not None else None


# How long ``DeviceFeed.close`` waits for a batch the producer is reading:
# seconds for any source here, far more than a batch takes on a loaded host.
STOP_TIMEOUT_S = 120.0


class DeviceFeed:
  """Global device batches from a host iterator, ``size`` batches ahead.

  Each item is ``(batch, data_state)``: ``data_state`` is the host
  iterator's ``get_state()`` right after this batch (None if it has none),
  the position a checkpoint taken after this batch's step must store.
  Errors of the host pipeline are raised in the consumer. ``wait_s`` is the
  total time the consumer spent blocked waiting for a batch;
  ``first_batch_s`` the seconds from the feed's start to the host
  pipeline's first batch (its workers' start-up; None until it came).
  """

  def __init__(self, host_iter: Iterator, sharding, size: int = 2):
    self._host_iter = host_iter
    self._queue: queue.Queue = queue.Queue(maxsize=size)
    self._stop = threading.Event()
    self.wait_s = 0.0
    self.first_batch_s = None
    self._started = time.perf_counter()
    self._thread = threading.Thread(target=self._work, args=(host_iter, sharding),
                                    daemon=True)
    self._thread.start()

  def _put(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def _work(self, it, sharding):
    try:
      while not self._stop.is_set():
        batch = next(it)
        if self.first_batch_s is None:
          self.first_batch_s = time.perf_counter() - self._started
        if not self._put((to_global(batch, sharding), state_of(it))):
          return
    except BaseException as e:  # pylint: disable=broad-except  # raised in the consumer
      self._put(e)

  def __iter__(self):
    return self

  def __next__(self):
    start = time.perf_counter()
    item = self._queue.get()
    self.wait_s += time.perf_counter() - start
    if isinstance(item, BaseException):
      raise item
    return item

  def close(self) -> None:
    """Stops the producer thread (it may be blocked on a full queue, or
    inside the host iterator's ``next``), then the host iterator's worker
    processes and files, if it has any: not under a ``next`` still running,
    which could be reading them (a Parquet reader whose file is closed
    under it can crash the process), and not left running into the
    interpreter's exit with JAX calls (``to_global``) in flight. It waits up
    to STOP_TIMEOUT_S for the producer, then closes anyway, with a
    warning."""
    self._stop.set()
    self._thread.join(timeout=STOP_TIMEOUT_S)
    if self._thread.is_alive():
      logging.warning("the data feed's thread is still reading a batch %.0f s after the "
                      "stop; closing the data pipeline under it", STOP_TIMEOUT_S)
    close = getattr(self._host_iter, "close", None)
    if close is not None:
      close()


class StepClock:
  """Wall-time accounting of the train loop (see the module docstring).

  ``tick()`` after each step, ``window()`` at each log, ``skip()`` after
  work that is neither a step nor input wait (compilation of the first
  step, evaluations, saves): that time only lowers ``goodput``.
  """

  def __init__(self, feed: DeviceFeed):
    self._feed = feed
    self._run_start = time.perf_counter()
    self._stepping_s = 0.0      # time in windows not spent waiting for input
    self.warned_input_bound = False
    self.skip()

  def tick(self) -> None:
    self._steps += 1

  def skip(self) -> None:
    self._start = time.perf_counter()
    self._wait_start = self._feed.wait_s
    self._steps = 0

  def window(self) -> dict:
    """Closes the current window; returns its fields (empty if it has no steps)."""
    now = time.perf_counter()
    steps, wall = self._steps, max(now - self._start, 1e-9)
    wait = min(self._feed.wait_s - self._wait_start, wall)
    self.skip()
    if not steps:
      return {}
    self._stepping_s += wall - wait
    return {"step_time_ms": 1e3 * wall / steps,
            "input_wait_fraction": wait / wall,
            "goodput": self._stepping_s / max(now - self._run_start, 1e-9)}
