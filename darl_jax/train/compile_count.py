"""How many XLA programs a job compiled, counted from JAX's compile events.

Every program JAX hands to XLA is reported through ``jax.monitoring`` as the
duration event ``/jax/core/compile/backend_compile_duration`` with the
program's name (``jit(train_step)``), also when the executable comes from the
persistent compilation cache (loop.enable_compilation_cache): that load is
announced first, on the same thread, by the event
``/jax/compilation_cache/cache_hits``. One listener per process, installed on
first use and never removed, keeps running totals per program name; a
``Count`` taken at a job's start reads the difference at its end, so jobs
that share a process (VTAB's fine-tuning runs, the tests) each count their
own, and nothing piles up when many jobs run.

Counted: programs XLA compiled (``compiled``) and programs loaded from the
persistent cache (``loaded``), per name. Not counted: a train step that
train/executables.py loads itself (no XLA compile happens), and dispatches
of programs already compiled in this process (JAX's in-memory caches), which
reuse the executable they hold.
"""

from __future__ import annotations

import collections
import threading

from jax import monitoring

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
# Names shown one by one in a summary line, those that took longest first;
# the rest are summed as "others" (JAX compiles a small program for each
# eager operation, e.g. jnp.zeros).
SHOWN_NAMES = 6

_lock = threading.Lock()
_thread = threading.local()          # .hit: the cache announced a load on this thread
_compiled: collections.Counter = collections.Counter()
_loaded: collections.Counter = collections.Counter()
_seconds: collections.Counter = collections.Counter()   # per name: time in XLA's calls
_installed = [False]


def program_name(fun_name: str) -> str:
  """``jit(train_step)`` -> ``train_step``."""
  name = str(fun_name)
  if name.startswith("jit(") and name.endswith(")"):
    return name[4:-1]
  return name


def _on_event(event: str, **kwargs) -> None:
  del kwargs
  if event == CACHE_HIT_EVENT:
    _thread.hit = True


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
  if event != COMPILE_EVENT:
    return
  hit = getattr(_thread, "hit", False)
  _thread.hit = False
  name = program_name(kwargs.get("fun_name", "?"))
  with _lock:
    (_loaded if hit else _compiled)[name] += 1
    _seconds[name] += float(duration_secs)


def install() -> None:
  """Registers the process's listeners (once)."""
  with _lock:
    if _installed[0]:
      return
    _installed[0] = True
  monitoring.register_event_listener(_on_event)
  monitoring.register_event_duration_secs_listener(_on_duration)


def _snapshot() -> tuple[collections.Counter, collections.Counter, collections.Counter]:
  with _lock:
    return (collections.Counter(_compiled), collections.Counter(_loaded),
            collections.Counter(_seconds))


def _since(now: collections.Counter, start: collections.Counter) -> dict:
  now.subtract(start)
  return {k: v for k, v in now.items() if v > 0}


class Count:
  """The programs compiled and loaded in this process since it was made."""

  def __init__(self):
    install()
    self._compiled, self._loaded, self._seconds = _snapshot()

  def compiled(self) -> dict[str, int]:
    """``{program name: how many XLA compiled}`` since the start."""
    return _since(_snapshot()[0], self._compiled)

  def loaded(self) -> dict[str, int]:
    """``{program name: how many came from the persistent compilation cache}``."""
    return _since(_snapshot()[1], self._loaded)

  def seconds_by_name(self) -> dict[str, float]:
    """``{program name: seconds in XLA's compile calls, cache loads included}``."""
    return _since(_snapshot()[2], self._seconds)

  def seconds(self) -> float:
    """Seconds spent in XLA's compile calls (cache loads included) since the start."""
    return sum(self.seconds_by_name().values())

  def report(self) -> dict:
    """The counts as plain data, for a job's report file."""
    compiled, loaded = self.compiled(), self.loaded()
    return {"compiled": sum(compiled.values()), "loaded_from_cache": sum(loaded.values()),
            "compile_seconds": round(self.seconds(), 3),
            "compiled_by_name": dict(sorted(compiled.items())),
            "loaded_by_name": dict(sorted(loaded.items()))}

  def line(self, job: str) -> str:
    """One log line: ``<job> compiled N programs (train_step 1, ...) in S s and
    loaded M from the persistent compilation cache (...)``."""
    compiled, loaded, seconds = self.compiled(), self.loaded(), self.seconds_by_name()
    return (f"{job} compiled {sum(compiled.values())} programs{_by_name(compiled, seconds)} "
            f"and loaded {sum(loaded.values())} from the persistent compilation cache"
            f"{_by_name(loaded, seconds)}; {sum(seconds.values()):.1f} s in XLA's compile "
            "calls")


def _by_name(counts: dict[str, int], seconds: dict[str, float]) -> str:
  if not counts:
    return ""
  ranked = sorted(counts.items(), key=lambda kv: (-seconds.get(kv[0], 0.0), kv[0]))
  parts = [f"{name} {n}" for name, n in ranked[:SHOWN_NAMES]]
  rest = sum(n for _, n in ranked[SHOWN_NAMES:])
  if rest:
    parts.append(f"{rest} others")
  return " (" + ", ".join(parts) + ")"
