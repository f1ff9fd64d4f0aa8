"""Programs compiled ahead of time, side by side, or loaded where a run saved them.

Every program a run uses (train and eval steps, the state's
initialisation, a trainer's closing picture) is a :class:`Program`, traced
and lowered on abstract arguments and compiled at start-up beside the others
(:func:`compile_all`), or loaded from the executable a run of the same
program saved (train/executables.py). The training loop saves what compiled
beside its first steps (:class:`DeferredSaves`). Which programs a run
compiles, and whether its train step fits the device, train/startup.py and
train/fit.py decide.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
from absl import logging

from darl_jax import config_lib
from darl_jax.train import fit

def abstract_batch(image_shape, batch_size: int, sharding) -> dict:
  """The training batch as the feed delivers it (uint8 images, int32
  labels), as ShapeDtypeStructs laid out by ``sharding``."""
  h, w, c = image_shape
  return {"image": jax.ShapeDtypeStruct((batch_size, h, w, c), jnp.uint8, sharding=sharding),
          "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=sharding)}


# The TPU compiler's refusal, e.g. "the total memory required for HLO
# temporaries (35.25G) exceeds available HBM (15.75G)".
_COMPILER_OOM = re.compile(r"temporaries \(([\d.]+)([KMGT])\) exceeds available HBM "
                           r"\(([\d.]+)([KMGT])\)")
_UNITS = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def compile_lowered(lowered):
  """``lowered.compile()``; raises CompilerOutOfMemory where XLA itself says
  the program cannot fit."""
  try:
    return lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    found = _COMPILER_OOM.search(str(e))
    if "RESOURCE_EXHAUSTED" not in str(e) or not found:
      raise
    temps = float(found.group(1)) * _UNITS[found.group(2)]
    hbm = float(found.group(3)) * _UNITS[found.group(4)]
    raise fit.CompilerOutOfMemory(" ".join(str(e).split())[:300],
                                  fit.Footprint(0, 0, 0, int(temps), 0), int(hbm)) from None


def compile_step(jitted, *args, traced=None) -> tuple[object, dict]:
  """``jitted.lower(*args).compile()``, with the seconds of each phase
  (``traced``: ``jitted.trace(*args)`` done already, its time not counted).
  Raises CompilerOutOfMemory where XLA itself says the step cannot fit."""
  t0 = time.perf_counter()
  traced = traced if traced is not None else jitted.trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  compiled = compile_lowered(lowered)
  t3 = time.perf_counter()
  return compiled, {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2}


# Host cores per program compiled at once. XLA's compile of one program
# keeps about one core busy for most of its passes, but not only one (LLVM
# code generation fans out), so several programs at once on a host of few
# cores shared with other work take longer than one after the other: a
# small host compiles one at a time, a large one a program per
# COMPILE_CORES cores (benchmarks/startup_benchmark.py with
# DARL_COMPILE_THREADS=1 against the default compares the two).
COMPILE_CORES = 4


@dataclasses.dataclass
class Program:
  """One program a run uses (the train step, the eval step, the state's
  initialisation, a trainer's closing picture), compiled at start-up.

  ``jitted`` is traced and lowered on ``args`` (ShapeDtypeStructs) in the
  calling thread, then compiled beside the others (:func:`compile_all`);
  ``path``, where given, is the file its executable is saved as, which a
  rerun loads instead (train/executables.py): named before tracing, so that
  the file is read while the program is traced, and deserialized only where
  the trace's jaxpr is the one saved with it. ``times``: the seconds of
  ``trace``, ``lower``, ``compile`` or ``load``."""
  name: str
  jitted: Callable
  args: tuple
  path: object = None
  traced: object = None
  lowered: object = None
  compiled: object = None
  info: dict = dataclasses.field(default_factory=dict)   # saved with the executable
  times: dict = dataclasses.field(default_factory=dict)
  refused: fit.CompilerOutOfMemory | None = None   # XLA's refusal for want of memory
  saved_jaxpr: str = ""         # the saved program's jaxpr's digest
  saved: object = None          # its file as read (executables.Saved), not deserialized

  def trace(self) -> None:
    t0 = time.perf_counter()
    self.traced = self.jitted.trace(*self.args)
    self.times["trace"] = time.perf_counter() - t0

  def find_saved(self) -> bool:
    """Whether a run saved this program's file."""
    return self.path is not None and self.path.exists()

  def load(self) -> bool:
    """Reads the saved program's file and has XLA deserialize its bytes
    (executables.prepare), in a thread while the program is traced; False
    where there is none, it is not a saved program or its bytes do not
    deserialize (then it is to be lowered and compiled). Whether it is this
    program, :meth:`loaded_matches` tells once the program is traced, and
    only then does :meth:`deserialize` make it this run's program."""
    from darl_jax.train import executables  # pylint: disable=g-import-not-at-top
    if not self.find_saved():
      return False
    t0 = time.perf_counter()
    saved = executables.read(self.path)
    if saved is not None:
      saved = executables.prepare(saved)
    if saved is None:
      return False
    self.saved, self.saved_jaxpr = saved, saved.jaxpr
    self.times["load"] = time.perf_counter() - t0
    return True

  def loaded_matches(self) -> bool:
    """Whether the saved program was compiled from this trace's program;
    where not (code outside the key changed it), it is dropped, with one
    log line, for the caller to lower and compile."""
    from darl_jax.train import executables  # pylint: disable=g-import-not-at-top
    if self.saved_jaxpr == executables.jaxpr_digest(self.traced):
      return True
    logging.warning("the saved %s (%s) was compiled from another program than this "
                    "run's; compiling it instead", self.name, self.path)
    self._drop_saved()
    return False

  def deserialize(self) -> bool:
    """Makes the saved program read by :meth:`load`, whose jaxpr
    :meth:`loaded_matches` checked, this program's executable (JAX's program
    around XLA's executable); False where it does not load (then it is to
    be lowered and compiled)."""
    from darl_jax.train import executables  # pylint: disable=g-import-not-at-top
    t0 = time.perf_counter()
    loaded = executables.deserialize(self.saved, self.traced)
    if loaded is None:
      self._drop_saved()
      return False
    self.compiled, self.info = loaded
    self.saved = None
    self.times["load"] += time.perf_counter() - t0
    return True

  def _drop_saved(self) -> None:
    self.compiled, self.saved, self.saved_jaxpr = None, None, ""
    self.times.pop("load", None)

  def lower(self) -> None:
    t0 = time.perf_counter()
    self.lowered = self.traced.lower()
    self.times["lower"] = time.perf_counter() - t0

  def compile(self) -> object:
    """Compiles the lowered program; a refusal for want of memory (the TPU
    compiler's) is kept in ``refused`` for the caller to judge."""
    t0 = time.perf_counter()
    try:
      self.compiled = compile_lowered(self.lowered)
    except fit.CompilerOutOfMemory as e:
      self.refused = e
    self.times["compile"] = time.perf_counter() - t0
    return self.compiled

  def to_save(self) -> bool:
    """Whether :meth:`save` writes a file: a program compiled here (not
    loaded), with a path, on process 0."""
    return self.path is not None and "compile" in self.times and jax.process_index() == 0

  def save(self) -> bool:
    """Saves what was compiled where :meth:`to_save`, with the digest of the
    jaxpr it was traced as (what a rerun's trace must match); whether it
    was written."""
    from darl_jax.train import executables  # pylint: disable=g-import-not-at-top
    if not self.to_save():
      return False
    info = {**self.info, executables.JAXPR_KEY: executables.jaxpr_digest(self.traced)}
    if not executables.save(self.path, self.compiled, info):
      return False
    logging.info("saved the compiled %s as %s for the next run", self.name, self.path)
    return True

  def describe(self) -> str:
    """``trace 0.4 s, lower 1.2 s, compile 3.1 s`` or ``trace 0.4 s, load 0.2 s``."""
    order = ("trace", "lower", "compile", "load")
    return ", ".join(f"{k} {self.times[k]:.1f} s" for k in order if k in self.times)


class DeferredSaves:
  """Compiled programs saved for the next run in a thread beside the training
  loop's first steps, instead of between the last compile and the first
  step: serialising and writing a large program takes seconds, which the
  first steps hide for the most part. :meth:`wait` joins the thread; the loop waits for
  it whenever it exits, so that a run leaves its files written (each is
  written atomically: a killed run leaves none half-written)."""

  def __init__(self, programs: list[Program]):
    self.programs, self.saved, self.seconds = list(programs), 0, 0.0
    self._thread = threading.Thread(target=self._run, name="save-programs", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    t0 = time.perf_counter()
    self.saved = sum(program.save() for program in self.programs)
    self.seconds = time.perf_counter() - t0

  def wait(self) -> None:
    self._thread.join()
    if self.programs:
      logging.info("start-up: saved %d of %d compiled programs beside the first steps in "
                   "%.1f s", self.saved, len(self.programs), self.seconds)
      self.programs = []


def compile_threads(num_programs: int) -> int:
  """How many programs compile at once: ``DARL_COMPILE_THREADS`` if set,
  else one per COMPILE_CORES host cores this process may use (at least 1),
  at most ``num_programs``."""
  forced = os.environ.get("DARL_COMPILE_THREADS", "")
  if forced:
    if not forced.isdigit() or int(forced) < 1:
      raise config_lib.ConfigError(
          f"DARL_COMPILE_THREADS={forced!r}: set it to a whole number >= 1 (programs "
          "compiled at once) or unset it")
    threads = int(forced)
  else:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // COMPILE_CORES)
  return max(1, min(threads, num_programs))


def compile_all(programs: list[Program], *, after: Callable | None = None,
                     defer_saves: bool = False) -> DeferredSaves | None:
  """Every one of ``programs``, in order (the train step first): where a run
  saved it, its file is read and XLA's executable deserialized in a thread
  while this thread traces it (both outside the GIL), and once the trace's
  jaxpr is the one saved with it, making it this run's program is handed
  to a thread pool of :func:`compile_threads`; otherwise it is
  traced and lowered in this thread (Python work, under the GIL) and handed
  to the pool to compile while this thread goes on to the next program. So
  the first program compiles or loads while the others are still being
  traced, and a warm start waits for its traces and its last load, not for
  their sum. A saved program compiled from another jaxpr than this trace's
  is lowered and compiled at once; one that does not deserialize, after
  the others.

  ``defer_saves``: what compiled is saved by a :class:`DeferredSaves`,
  returned (None where nothing is to be saved), instead of here; the
  caller waits for it before it exits.

  ``after(program)`` then runs on each program in this thread (the train
  step's memory check and automatic microbatch, which may compile it
  again); it may raise, and a program XLA refused for want of memory that
  it leaves uncompiled raises CompilerOutOfMemory. Saves what compiled
  (Program.save; or leaves it to the DeferredSaves) and logs one line per
  program, and one for them all."""
  t0 = time.perf_counter()
  threads = compile_threads(len(programs))
  # Files are read in a thread of their own: a read queued behind a compile
  # would hold this thread's next trace until that compile ends.
  with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="compile") as pool, \
       concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="read") as reader:
    futures, reads = {}, []
    try:
      for program in programs:
        reading = reader.submit(program.load) if program.find_saved() else None
        reads.append(reading)
        program.trace()
        # Nothing saved becomes the program before this trace's jaxpr matches it.
        if reading is not None and reading.result() and program.loaded_matches():
          futures[pool.submit(program.deserialize)] = program
        else:
          program.lower()
          futures[pool.submit(program.compile)] = program
      unloaded = []
      for future in concurrent.futures.as_completed(futures):
        program = futures[future]
        if future.result() is False:
          unloaded.append(program)        # only a deserialize returns False
      for program in unloaded:
        program.lower()
      for future in [pool.submit(program.compile) for program in unloaded]:
        future.result()
    except BaseException:
      for future in [*futures, *filter(None, reads)]:
        future.cancel()
      raise
  for program in programs:
    if after is not None:
      after(program)
    if program.compiled is None:
      raise program.refused
    if not defer_saves:
      program.save()
    logging.info("start-up: %s: %s", program.name, program.describe())
  seconds = time.perf_counter() - t0
  if len(programs) > 1:
    loaded = sum("load" in program.times for program in programs)
    logging.info("start-up: %d programs ready in %.1f s (%d compiled, %d at a time; %d loaded)",
                 len(programs), seconds, len(programs) - loaded, threads, loaded)
  if not defer_saves:
    return None
  unsaved = [program for program in programs if program.to_save()]
  return DeferredSaves(unsaved) if unsaved else None
