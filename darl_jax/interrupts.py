"""Ctrl-C and SIGTERM as exceptions, held back while a checkpoint is being saved.

A preempted job gets SIGTERM, a user presses Ctrl-C. Python's default for
SIGTERM ends the process on the spot (the save in flight is lost, the lock
file stays), and an exception raised at an arbitrary point inside Orbax's
save leaves its threads half set up, which then fail with pages of
tracebacks. With ``install()`` (the CLI calls it) both signals raise an
exception, ``Terminated`` or ``KeyboardInterrupt``, so that the loop's
clean-up runs; inside ``deferred()`` (``Checkpointer.save`` and its waits)
the exception waits for the end of the block.
"""

from __future__ import annotations

import signal
import threading


class Terminated(Exception):
  """SIGTERM (a preemption, a scheduler's stop), raised in the main thread."""


_depth = 0
_pending: BaseException | None = None


def _handler(signum, frame):
  del frame
  global _pending
  exc = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
  if _depth:
    _pending = _pending or exc
  else:
    raise exc


def install() -> None:
  """Routes SIGTERM and SIGINT through ``_handler`` (main thread only)."""
  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


class deferred:  # pylint: disable=invalid-name
  """``with deferred():`` a signal that arrives inside raises at its end
  (unless the block raises anyway). Nests; only the main thread counts."""

  def __enter__(self):
    global _depth
    if threading.current_thread() is threading.main_thread():
      _depth += 1
    return self

  def __exit__(self, exc_type, *exc):
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread():
      return
    _depth -= 1
    if _depth == 0 and _pending is not None:
      pending, _pending = _pending, None
      if exc_type is None:
        raise pending
