"""Ctrl-C, SIGTERM and the preemption signal: exceptions, or notices the loop reads.

A preempted job gets SIGTERM (or, ahead of it, a signal its scheduler was
told to send, e.g. Slurm's ``--signal=USR1@90``), a user presses Ctrl-C.
Python's default for SIGTERM ends the process on the spot (the save in
flight is lost, the lock file stays), and an exception raised at an
arbitrary point inside Orbax's save leaves its threads half set up, which
then fail with pages of tracebacks. Two modes:

* With ``install()`` (the CLI calls it) SIGTERM and SIGINT raise an
  exception, ``Terminated`` or ``KeyboardInterrupt``, so that the loop's
  clean-up runs; ``terminate_on(signum)`` adds the preemption signal to
  SIGTERM's. Inside ``deferred()`` (``Checkpointer.save`` and its waits) the
  exception waits for the end of the block.
* Inside ``watch(signals)`` (the train loop's steps, darl_jax/preemption.py)
  those signals raise nothing: they record a ``Notice`` that the loop reads
  at its next step boundary, where it saves that step and stops. SIGINT is
  never watched: Ctrl-C is a person who wants the prompt back now, not a
  scheduler that waits for a checkpoint, so it keeps raising at once.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from typing import Callable, Iterable


class Terminated(BaseException):
  """SIGTERM (a preemption, a scheduler's stop) or the preemption signal,
  raised in the main thread; its message says what happened to the steps.

  A ``BaseException``, like ``KeyboardInterrupt``: every ``except Exception``
  on its way out (a restore that treats a failed read as damage, a loaded
  program's first call, a data reader's fallback) lets it pass, so a signal
  is never mistaken for a failure of what it interrupted."""

  def __init__(self, message: str = "terminated (SIGTERM)"):
    super().__init__(message)


_depth = 0
_pending: BaseException | None = None
_installed = False
_watch: "watch | None" = None       # the active watch, if any


def signal_name(signum: int) -> str:
  return signal.Signals(signum).name


def _handler(signum, frame):
  del frame
  global _pending
  if _watch is not None and signum in _watch.signals:
    _watch.record(signum)
    return
  if signum == signal.SIGINT:
    exc = KeyboardInterrupt()
  else:
    exc = Terminated(f"terminated ({signal_name(signum)})")
  if _depth:
    _pending = _pending or exc
  else:
    raise exc


def _main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


def install() -> None:
  """Routes SIGTERM and SIGINT through ``_handler`` (main thread only)."""
  global _installed
  if _main_thread():
    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    _installed = True


def terminate_on(signum: int | None) -> None:
  """After ``install()``: ``signum`` raises ``Terminated`` as SIGTERM does
  (outside a ``watch`` of it). A process that never called ``install()``
  (a library caller) keeps its own handlers."""
  if _installed and signum is not None and _main_thread():
    signal.signal(signum, _handler)


class deferred:  # pylint: disable=invalid-name
  """``with deferred():`` a signal that arrives inside raises at its end
  (unless the block raises anyway). Nests; only the main thread counts."""

  def __enter__(self):
    global _depth
    if _main_thread():
      _depth += 1
    return self

  def __exit__(self, exc_type, *exc):
    global _depth, _pending
    if not _main_thread():
      return
    _depth -= 1
    if _depth == 0 and _pending is not None:
      pending, _pending = _pending, None
      if exc_type is None:
        raise pending


@dataclasses.dataclass
class Notice:
  """The first watched signal that arrived: its number and ``time.monotonic()``."""
  signum: int
  time: float

  @property
  def name(self) -> str:
    return signal_name(self.signum)


class watch:  # pylint: disable=invalid-name
  """``with watch(signals, on_notice) as w:`` each of ``signals`` (SIGINT
  is refused) records ``w.notice`` (the first one only; repeats are
  ignored) and calls ``on_notice(notice)`` once, in the main thread,
  instead of raising. The handlers in place before are restored at the
  end. Only the main thread can receive signals: elsewhere (a loop run in
  a thread) the block watches nothing."""

  def __init__(self, signals: Iterable[int], on_notice: Callable[[Notice], None] | None = None):
    self.signals = frozenset(int(s) for s in signals)
    if signal.SIGINT in self.signals:
      raise ValueError("SIGINT (Ctrl-C) cannot be watched: it always interrupts at once")
    self.notice: Notice | None = None
    self._on_notice = on_notice
    self._previous: dict[int, object] = {}

  def record(self, signum: int) -> None:
    if self.notice is not None:
      return
    self.notice = Notice(int(signum), time.monotonic())
    if self._on_notice is not None:
      self._on_notice(self.notice)

  def __enter__(self) -> "watch":
    global _watch
    if _main_thread():
      for signum in sorted(self.signals):
        self._previous[signum] = signal.signal(signum, _handler)
      _watch = self
    return self

  def __exit__(self, *exc) -> None:
    global _watch
    if not _main_thread() or _watch is not self:
      return
    _watch = None
    for signum, previous in self._previous.items():
      # None: a handler not installed from Python, which cannot be put back;
      # the default action is the closest.
      signal.signal(signum, signal.SIG_DFL if previous is None else previous)
    self._previous.clear()
