"""A checkpoint at the preemption point: every process stops at one step and saves it.

A preempted job gets SIGTERM, or ahead of it the signal its scheduler was
told to send (``config.preemption_signal``, SIGUSR1 by default: Slurm's
``--signal=USR1@90``). Inside the train loop's steps neither raises
(interrupts.watch): the loop finishes the step under way, every process
agrees on one step ``S``, runs to it, saves ``S`` exactly as a periodic
save would (its data position and log window), waits for the commit and
stops with ``interrupts.Terminated``, which the CLI turns into exit status
``EXIT_STATUS`` (143), the status on which the launchers requeue
(docs/LAUNCH.md). The rerun resumes at ``S``: no step is lost.

A deadline (``config.preemption_deadline_s``, counted from the notice,
default 25 s: a 30-second notice less the time to exit) bounds it all: if
``S``'s checkpoint is not committed by then, the save in flight is removed
(the newest complete checkpoint survives, keep-N deletes only after a
commit) and the process exits with the same status.

Agreement between processes (``Agreement``): the signal may reach one
process only, and the processes' host loops run up to a few steps apart
(the loop keeps ``in_flight`` steps dispatched ahead of the device). The
first process that sees a notice at its step boundary ``k`` proposes
``S = k + in_flight + 1`` in the jax.distributed coordination service
(a key written once: if two propose, the first write wins and the other
reads it); every process reads that key at each step boundary. ``S`` is
late enough that every process reads it at or before ``S``: a process
that runs step ``k + in_flight + 1`` has waited for step ``k + 1`` to
finish, which needed the proposer's ``k + 1``, dispatched after it wrote
the key. Nothing waits for anything, so no process can stall the others'
steps. The cost is one read of the coordination service per step and
process (0.2-0.5 ms on localhost; the host runs ahead of the device, so
the device does not wait for it).

Why not JAX's preemption sync point
(``multihost_utils.reached_preemption_sync_point``, on by default with
``jax.distributed`` also on CPU): it does propagate a SIGTERM sent to one
process to all of them (measured with two CPU processes), but it learns of
SIGTERM only through a C handler that the CLI's Python handler (needed to
stop cleanly outside the steps) replaces, after which it never fires
(measured too), and it takes no other signal, so Slurm's USR1 could not
reach it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable

from absl import logging

from darl_jax import config_lib
from darl_jax import interrupts

# The exit status of a run stopped by a notice: 128 + SIGTERM, what a shell
# reports for a process SIGTERM killed, so that a launcher's requeue rule
# also covers a process killed before its handler was installed.
EXIT_STATUS = 143
DEFAULT_SIGNAL = "SIGUSR1"
DEFAULT_DEADLINE_S = 25.0


def notice_signals(config) -> tuple[int, ...]:
  """SIGTERM and ``config.preemption_signal`` (if any), as numbers."""
  extra = config_lib.preemption_signal_number(config.get("preemption_signal", DEFAULT_SIGNAL))
  return tuple(sorted({int(signal.SIGTERM)} | ({extra} if extra is not None else set())))


def route_signals(config) -> None:
  """In the CLI (after ``interrupts.install()``): the preemption signal
  raises Terminated outside the steps, as SIGTERM does, instead of
  Python's default for it (SIGUSR1's ends the process with no clean-up)."""
  for signum in notice_signals(config):
    if signum != signal.SIGTERM:
      interrupts.terminate_on(signum)


class Agreement:
  """The stop step of a multi-process run, through the coordination
  service's key-value store (``client``: jax.distributed's). ``margin``:
  how many steps after the proposer's the stop step lies (the module
  docstring says why ``in_flight + 1`` suffices)."""

  def __init__(self, client, margin: int, prefix: str, barrier_timeout_s: float = 600.0):
    self._client = client
    self._margin = int(margin)
    self._dir = prefix.rstrip("/") + "/"
    self._key = self._dir + "stop"
    self._name = prefix.rstrip("/")
    self._barrier_ms = int(barrier_timeout_s * 1000)

  @classmethod
  def for_this_job(cls, margin: int, prefix: str) -> "Agreement | None":
    """An agreement over jax.distributed's processes; None for one process."""
    import jax  # pylint: disable=g-import-not-at-top
    if jax.process_count() == 1:
      return None
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
    # Private, as Orbax reads it (multihost.get_jax_distributed_client):
    # JAX exposes the coordination service's key-value store nowhere else.
    client = distributed.global_state.client
    if client is None:
      return None
    return cls(client, margin, prefix)

  def _read(self) -> int | None:
    # An empty directory is an empty list; a missing single key would be an
    # exception, dearer on every step.
    for key, value in self._client.key_value_dir_get(self._dir):
      if key.rstrip("/").endswith("/stop") or key == self._key:
        return int(value)
    return None

  def _propose(self, step: int) -> int:
    try:
      self._client.key_value_set(self._key, str(step))
      return step
    except Exception:  # pylint: disable=broad-except
      # ALREADY_EXISTS: another process proposed first; its step holds.
      agreed = self._read()
      if agreed is None:
        raise
      return agreed

  def stop_step(self, step: int, noticed: bool) -> int | None:
    """At the boundary after ``step``: the agreed stop step, once there is
    one (proposing ``step + margin`` if this process has a notice)."""
    agreed = self._read()
    if agreed is None and noticed:
      agreed = self._propose(step + self._margin)
    return agreed

  def saved(self, timeout_s: float) -> None:
    """Returns once every process's save of the stop step has returned, so
    that none exits before process 0 committed it: a launcher that ends the
    job when its first process exits (srun --kill-on-bad-exit) would
    otherwise cut the commit short."""
    self._client.wait_at_barrier(f"{self._name}_saved", max(1, int(timeout_s * 1000)))

  def at_end(self, noticed: bool) -> bool:
    """After the last step: whether any process had a notice, the same
    answer on every process (a notice proposed before a barrier that all
    pass, read after it)."""
    if noticed and self._read() is None:
      self._propose(-1)
    self._client.wait_at_barrier(f"{self._name}_end", self._barrier_ms)
    return self._read() is not None


class Preemption:
  """The loop's side of a preemption: ``open()`` before the first step,
  ``stop_step(step)`` at each step boundary, ``stop(step, wait)`` once the
  stop step's save has started, ``after_loop(step)`` after the last step
  (it ends the watch of notices), ``close()`` always (idempotent).

  ``in_flight``: how many steps the loop dispatches ahead of the device
  (the agreement's margin is one more); ``unfinished``: the checkpoint
  saves in flight on disk (Checkpointer.tmp_dirs), removed on process 0
  when the deadline passes.
  """

  def __init__(self, config, *, in_flight: int, unfinished: Callable[[], list],
               is_main: bool, start_step: int = 0):
    self.signals = notice_signals(config)
    self.deadline_s = float(config.get("preemption_deadline_s", DEFAULT_DEADLINE_S))
    self._in_flight = int(in_flight)
    self._unfinished = unfinished
    self._is_main = is_main
    self._start_step = int(start_step)
    self._watch = interrupts.watch(self.signals, on_notice=lambda notice: self._arm(notice.name))
    self._agreement = None
    self._stop: int | None = None
    self._timer: threading.Timer | None = None
    self._since: float | None = None
    self._why = ""
    self._open = False

  # ------------------------------------------------------------- lifetime

  def open(self) -> "Preemption":
    self._agreement = Agreement.for_this_job(
        self._in_flight + 1, f"darl_jax/preemption/{self._start_step}")
    self._watch.__enter__()
    self._open = True
    return self

  def close(self) -> None:
    # The watch ends before the deadline is cancelled: a notice recorded
    # after the cancel would start a deadline that nothing cancels, which
    # would later end the process wherever it is (the closing programs, an
    # error's clean-up) with a false "not committed".
    self._end_watch()
    if self._timer is not None:
      self._timer.cancel()
      self._timer = None

  def _end_watch(self) -> None:
    """Puts back the handlers in place before ``open()`` (the CLI's raise
    Terminated); from here on a signal raises instead of being recorded."""
    if self._open:
      self._open = False
      self._watch.__exit__(None, None, None)

  # ------------------------------------------------------------- the deadline

  def _arm(self, why: str) -> None:
    """Starts the deadline (once): from the notice's arrival, or for a
    process that learns of another's notice, from then."""
    if self._timer is not None:
      return
    self._since = time.monotonic()
    self._why = why
    logging.warning("preemption notice (%s): stopping at a step every process reaches, "
                    "saving it within preemption_deadline_s=%g", why, self.deadline_s)
    self._timer = threading.Timer(self.deadline_s, self._expire)
    self._timer.daemon = True
    self._timer.start()

  def _expire(self) -> None:
    """The deadline passed (timer thread): the save in flight goes, the
    process exits now. The main thread may be anywhere (a step, Orbax's
    commit, a collective that another process left), so nothing waits
    for it."""
    removed = []
    if self._is_main:
      for tmp in self._unfinished():
        try:
          # Renamed first, atomically: an Orbax commit (a rename of the same
          # folder) either happened before, then this finds nothing, or it
          # fails after; never a half-deleted folder under a step's name.
          gone = tmp.parent / f"{tmp.name}.abandoned"
          tmp.rename(gone)
          gone.rmtree(missing_ok=True)
          removed.append(tmp.name)
        except OSError:
          pass
    message = (f"error: preempted ({self._why}): the checkpoint was not committed within "
               f"preemption_deadline_s={self.deadline_s:g}"
               + (f"; removed the unfinished save {', '.join(removed)}" if removed else "")
               + "; rerun the same command to resume from the last complete checkpoint")
    logging.error("%s", message)
    try:
      logging.flush()
    except Exception:  # pylint: disable=broad-except
      pass
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_STATUS)  # pylint: disable=protected-access

  # ------------------------------------------------------------- the loop

  @property
  def noticed(self) -> bool:
    return self._watch.notice is not None

  def stop_step(self, step: int) -> int | None:
    """At the boundary after ``step``: the step every process stops at
    (``>= step``), once a notice is known here or from another process;
    None before."""
    if self._stop is not None:
      return self._stop
    notice = self._watch.notice
    if self._agreement is None:
      self._stop = step if notice is not None else None
    else:
      self._stop = self._agreement.stop_step(step, notice is not None)
      if self._stop is not None and self._stop < step:
        # The margin argument (module docstring) rules this out; saving
        # another step than the other processes would hang them.
        raise RuntimeError(f"the processes agreed to stop at step {self._stop}, which this "
                           f"process already passed (step {step})")
    if self._stop is not None:
      self._arm(notice.name if notice is not None else "another process's notice")
      logging.warning("preemption: every process stops and saves at step %d (now at %d)",
                      self._stop, step)
    return self._stop

  def stop(self, step: int, wait: Callable[[], None]) -> None:
    """The stop step's save has started: waits for its commit (``wait``)
    and raises Terminated with the line the CLI prints."""
    wait()
    if self._agreement is not None:
      left = self.deadline_s - (time.monotonic() - (self._since or time.monotonic()))
      self._agreement.saved(left)
    took = time.monotonic() - self._since if self._since is not None else 0.0
    logging.warning("preemption: the checkpoint of step %d is committed, %.1f s after the "
                    "notice", step, took)
    raise interrupts.Terminated(
        f"preempted ({self._why}): saved the checkpoint of step {step} {took:.1f} s after the "
        f"notice; rerun the same command to resume from it")

  def after_loop(self, step: int) -> None:
    """After the last step, its checkpoint committed: Terminated on every
    process if any had a notice that the loop did not reach (it came after
    the last boundary, or the stop step lay beyond the last step), so that
    all skip the final artifacts alike; a rerun resumes at ``step`` and
    makes them.

    The watch ends here, before the answer is final, and a notice recorded
    up to its end counts too: a signal either lands in the watch and is
    read below, or comes after it and raises Terminated at once. Ending it
    later, in ``close()``, would leave a gap after the last read in which a
    notice is recorded and read by no one: the closing programs would run
    and the run end as if no signal had come. A notice that arrives during
    the agreement's barrier of a multi-process run stops its own process
    only, as a signal a moment later would."""
    noticed = self._stop is not None or self.noticed
    if self._agreement is not None:
      noticed = self._agreement.at_end(noticed)
    self._end_watch()
    noticed = noticed or self.noticed
    if noticed:
      self._why = self._why or (self._watch.notice.name if self._watch.notice
                                else "another process's notice")
      raise interrupts.Terminated(
          f"preempted ({self._why}) after the last step: the checkpoint of step {step} is "
          "saved; rerun the same command to finish the run")
