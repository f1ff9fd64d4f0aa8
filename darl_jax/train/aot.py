"""The train step compiled ahead of time, its memory known before the first step.

The loop (and ``python -m darl_jax.compile`` for a TPU topology from a CPU
host) lowers and compiles the jitted step on abstract arguments, reads XLA's
memory analysis of the compiled program and compares it with the device's
memory. A step that cannot fit stops there, with one line naming the fix
(``microbatch_size``, remat, FSDP), instead of an allocator dump after the
first steps. ``microbatch_size=-1`` picks the largest microbatch whose
step fits, from darl_jax/memory.py's estimate before compiling anything,
then checked (and stepped down once) on the compiled figure
(:func:`first_microbatch`, :func:`choose_microbatch`).

Every program a run uses (train and eval steps, the state's
initialisation, a trainer's closing picture) is a :class:`Program`,
compiled at start-up side by side (:func:`compile_programs`) or loaded
from the executable a run of the same program saved (train/executables.py).
The training loop saves what compiled beside its first steps
(:class:`DeferredSaves`).

The figure is XLA's buffer assignment of the program: arguments (the train
state and the batch) + outputs - the outputs that alias donated arguments +
temporaries + generated code, per device. It does not count what lives
beside the step (prefetched batches, evaluation programs, the allocator's
fragmentation), hence the headroom of ``FIT_FRACTION``.
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

GIB = 2.0 ** 30
# The share of the device's memory the step may take: the rest is for what
# lives beside it (see the module docstring).
FIT_FRACTION = 0.95

# HBM per chip by JAX's device_kind, for devices that do not report their
# memory (TPU topologies compiled for from a CPU host). Public datasheet
# figures.
HBM_GIB = {
    "TPU v2": 8, "TPU v3": 16, "TPU v4": 32, "TPU v4 lite": 8,
    "TPU v5 lite": 16, "TPU v5e": 16, "TPU v5": 95, "TPU v5p": 95,
    "TPU v6 lite": 32, "TPU v6e": 32, "TPU7x": 192,
}


class DoesNotFit(config_lib.ConfigError):
  """The compiled step needs more memory than the device has. ``footprint``
  and ``microbatch``: the last compiled program's (None where none was
  compiled), so that a report needs no compile of its own."""

  def __init__(self, message: str, *, footprint: "Footprint | None" = None,
               microbatch: int | None = None):
    super().__init__(message)
    self.footprint, self.microbatch = footprint, microbatch


@dataclasses.dataclass
class Footprint:
  """Per-device bytes of a compiled program (XLA's memory analysis)."""
  arguments: int
  outputs: int
  aliased: int
  temporaries: int
  code: int

  @property
  def total(self) -> int:
    return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

  def describe(self) -> str:
    return (f"{self.total / GIB:.2f} GiB (arguments {self.arguments / GIB:.2f}, outputs "
            f"{(self.outputs - self.aliased) / GIB:.2f} beyond the donated state, "
            f"temporaries {self.temporaries / GIB:.2f})")


def footprint(compiled) -> Footprint | None:
  """The compiled program's per-device memory, or None where the backend
  gives no analysis."""
  try:
    m = compiled.memory_analysis()
  except (NotImplementedError, RuntimeError, AttributeError):
    return None
  if m is None:
    return None
  get = lambda name: int(getattr(m, name, 0) or 0)
  return Footprint(arguments=get("argument_size_in_bytes"),
                   outputs=get("output_size_in_bytes"),
                   aliased=get("alias_size_in_bytes"),
                   temporaries=get("temp_size_in_bytes"),
                   code=get("generated_code_size_in_bytes"))


def device_capacity(device, override_gib: float = 0.0) -> int | None:
  """Bytes the step may use on ``device``: ``override_gib`` if > 0, else the
  device's own limit (``memory_stats()["bytes_limit"]``: on a GPU the
  allocator's pool), else the chip's HBM by its kind (HBM_GIB), else None
  (the host's memory on CPU: no check)."""
  if override_gib and override_gib > 0:
    return int(override_gib * GIB)
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except  # not every backend has it
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  gib = HBM_GIB.get(getattr(device, "device_kind", ""))
  return None if gib is None else int(gib * GIB)


def abstract_batch(image_shape, batch_size: int, sharding) -> dict:
  """The training batch as the feed delivers it (uint8 images, int32
  labels), as ShapeDtypeStructs laid out by ``sharding``."""
  h, w, c = image_shape
  return {"image": jax.ShapeDtypeStruct((batch_size, h, w, c), jnp.uint8, sharding=sharding),
          "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=sharding)}


class CompilerOutOfMemory(RuntimeError):
  """XLA refused to compile the step for want of memory (the TPU compiler
  does, at compile time); ``footprint`` and ``capacity`` are its figures."""

  def __init__(self, message: str, footprint: Footprint, capacity: int):
    super().__init__(message)
    self.footprint, self.capacity = footprint, capacity


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
    raise CompilerOutOfMemory(" ".join(str(e).split())[:300],
                              Footprint(0, 0, 0, int(temps), 0), int(hbm)) from None


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


def suggest_microbatch(fp: Footprint, microbatch: int, capacity: int,
                       sizes: list[int]) -> int | None:
  """The largest of ``sizes`` (valid microbatch sizes) that should fit in
  ``capacity`` by ``fp``, the footprint at ``microbatch``: temporaries
  scale with the microbatch, the rest does not; None if not even the
  smallest should."""
  budget = FIT_FRACTION * capacity
  per_example = fp.temporaries / max(microbatch, 1)
  fits = [b for b in sizes
          if b < microbatch and b * per_example <= budget - (fp.total - fp.temporaries)]
  return max(fits) if fits else None


def fix_line(fp: Footprint, capacity: int, *, batch_size: int, microbatch: int,
             sizes: list[int]) -> str:
  """One line: what the step needs, what the device has, what to change."""
  need = (f"the train step needs {fp.describe()} per device but the device has "
          f"{capacity / GIB:.2f} GiB (the step may use {FIT_FRACTION:.0%})")
  b = suggest_microbatch(fp, microbatch, capacity, sizes)
  if b is not None:
    return (f"{need}: set --config.microbatch_size={b} (gradient accumulation over "
            f"{batch_size // b} microbatches, same recipe) or --config.microbatch_size=-1 "
            "to choose it automatically")
  return (f"{need}, and no microbatch size fits: set --config.model.remat=full, or shard "
          "the state over more devices (--config.sharding=fsdp --config.mesh.fsdp=<n>)")


def check_fits(fp: Footprint | None, capacity: int | None, **kw) -> None:
  """Raises DoesNotFit (with :func:`fix_line`) when ``fp`` exceeds the share
  FIT_FRACTION of ``capacity``; no check where either is unknown."""
  if fp is None or capacity is None:
    return
  if fp.total > FIT_FRACTION * capacity:
    raise DoesNotFit(fix_line(fp, capacity, **kw), footprint=fp, microbatch=kw.get("microbatch"))


def check_eval_fits(eval_fp: Footprint | None, train_fp: Footprint | None,
                    capacity: int | None, *, eval_batch_size: int, batch_shards: int) -> None:
  """Raises DoesNotFit where the eval step's temporaries, beside the train
  step's arguments (the state and a batch, alive while it evaluates), pass
  the share FIT_FRACTION of ``capacity``, naming an ``eval_batch_size``
  that should fit (temporaries scale with it); no check where a figure is
  unknown."""
  if eval_fp is None or train_fp is None or capacity is None:
    return
  budget = FIT_FRACTION * capacity - train_fp.arguments
  if eval_fp.temporaries <= budget:
    return
  per_example = eval_fp.temporaries / max(eval_batch_size, 1)
  fits = (int(budget // per_example) // batch_shards) * batch_shards if budget > 0 else 0
  need = (f"the eval step at eval_batch_size={eval_batch_size} needs "
          f"{eval_fp.temporaries / GIB:.2f} GiB of temporaries per device beside the train "
          f"state's {train_fp.arguments / GIB:.2f} GiB, and the device has "
          f"{capacity / GIB:.2f} GiB (the run may use {FIT_FRACTION:.0%})")
  if fits >= batch_shards:
    raise DoesNotFit(f"{need}: set --config.eval_batch_size={fits} or smaller")
  raise DoesNotFit(f"{need}, and no evaluation batch fits: set --config.eval_every_steps=0 "
                   "or shard the state over more devices")


# ----------------------------------------------------- automatic microbatch
#
# ``microbatch_size=-1`` chooses before compiling anything, from
# darl_jax/memory.py's analytic estimate (seconds, no compile): compiling a
# candidate that cannot fit costs minutes at H/14 (XLA first tries hard to
# make it fit), and a whole batch of 4096 on one GPU is such a candidate.

# memory.py's estimate is within this factor of XLA's compiled figure on
# every row of docs/TPU.md and on the H200 (H/14 at 192 and 256 examples:
# 0.97x and 1.06x). The first candidate is the largest whose estimate,
# raised by it, fits: it fits when compiled unless the estimate is off by
# more than it is known to be.
ESTIMATE_ERROR = 1.2


def refusal_line(estimate_bytes: float, capacity: int, *, microbatch: int,
                 batch_shards: int, remat: str) -> str:
  """One line for a batch that fits at no microbatch, naming the fixes."""
  fixes = ["shard the state over more devices (--config.sharding=fsdp "
           "--config.mesh.fsdp=<n>, or run on more devices)",
           "a smaller --config.batch_size"]
  if remat != "full":
    fixes.append("--config.model.remat=full")
  return (f"the train step does not fit at any microbatch: even {microbatch // batch_shards} "
          f"example(s) per device (microbatch_size={microbatch}) needs an estimated "
          f"{estimate_bytes / GIB:.2f} GiB per device (darl_jax/memory.py, known to within "
          f"{ESTIMATE_ERROR - 1:.0%}) and the device has {capacity / GIB:.2f} GiB (the step "
          f"may use {FIT_FRACTION:.0%}): " + ", or ".join(fixes))


def first_microbatch(estimate_for: Callable[[int], float | None], sizes: list[int],
                     capacity: int | None, *, batch_shards: int = 1,
                     remat: str = "none") -> int:
  """The candidate ``microbatch_size=-1`` compiles first, chosen before any
  compile: the largest of ``sizes`` (valid sizes, largest first: the whole
  batch, then its divisors that split over ``batch_shards``) whose
  estimate (``estimate_for(size)``, bytes per device) times ESTIMATE_ERROR
  fits the share FIT_FRACTION of ``capacity``. The whole batch where
  ``capacity`` is unknown (CPU: no accumulation, as with
  ``microbatch_size=0``). Raises DoesNotFit (:func:`refusal_line`) when
  even the smallest size's estimate, lowered by ESTIMATE_ERROR, does not
  fit; where only the raised estimate does not, the smallest is compiled
  and its compiled figure decides."""
  if capacity is None:
    return sizes[0]
  budget = FIT_FRACTION * capacity
  for size in sizes:
    estimate = estimate_for(size)
    if estimate is None:
      raise config_lib.ConfigError(
          "microbatch_size=-1 chooses the microbatch from darl_jax/memory.py's estimate, "
          "which has none for this config (no ViT config.model); set "
          "--config.microbatch_size to one of " + ", ".join(map(str, sizes[:8])))
    if estimate * ESTIMATE_ERROR <= budget:
      return size
  smallest = sizes[-1]
  if estimate_for(smallest) / ESTIMATE_ERROR > budget:
    raise DoesNotFit(refusal_line(estimate_for(smallest), capacity, microbatch=smallest,
                                  batch_shards=batch_shards, remat=remat))
  return smallest


def choose_microbatch(compile_for: Callable[[int], object], sizes: list[int],
                      capacity: int | None, first: int) -> tuple[int, object]:
  """``microbatch_size=-1`` after :func:`first_microbatch`: compiles
  ``first`` (``compile_for(size)``); if its compiled footprint does not fit,
  steps down once, by the compiled figure: to the size
  :func:`suggest_microbatch` reads from it (its arguments and outputs, the
  state, stay; its temporaries scale with the microbatch), the size the
  fix line would name. The compiled figure, not the estimate, since it is
  exact where the estimate was just shown off. At most two compiles;
  raises DoesNotFit naming the fix when neither fits. Returns
  ``(microbatch, compiled)``."""
  def attempt(size):
    try:
      compiled = compile_for(size)
      return compiled, footprint(compiled)
    except CompilerOutOfMemory as e:
      # The TPU compiler refuses a program that cannot fit, naming only its
      # temporaries.
      return None, e.footprint

  def fits(compiled, fp):
    return compiled is not None and (fp is None or capacity is None
                                     or fp.total <= FIT_FRACTION * capacity)

  compiled, fp = attempt(first)
  if fits(compiled, fp):
    return first, compiled
  fix = lambda fp, size: fix_line(fp, capacity, batch_size=sizes[0], microbatch=size,
                                  sizes=sizes)
  size = suggest_microbatch(fp, first, capacity, sizes)
  if size is None:
    raise DoesNotFit(fix(fp, first), footprint=fp, microbatch=first)
  logging.info("microbatch_size=-1: %d examples compiled to %s; stepping down to %d",
               first, fp.describe(), size)
  compiled, fp = attempt(size)
  if not fits(compiled, fp):
    raise DoesNotFit(fix(fp, size), footprint=fp, microbatch=size)
  return size, compiled


def memory_stats(device) -> dict:
  """The device allocator's figures in GiB (``memory_in_use_gib``,
  ``memory_peak_gib``, ``memory_largest_free_gib``, ``memory_limit_gib``),
  {} where the backend keeps none (CPU)."""
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except
    return {}
  if not stats:
    return {}
  names = {"bytes_in_use": "memory_in_use_gib", "peak_bytes_in_use": "memory_peak_gib",
           "largest_free_block_bytes": "memory_largest_free_gib",
           "bytes_limit": "memory_limit_gib"}
  return {out: stats[k] / GIB for k, out in names.items() if k in stats}


def estimate_bytes(config, mesh_shape: dict, microbatch: int, *, num_microbatches: int = 1,
                   params=None) -> float | None:
  """darl_jax/memory.py's estimate of the train step's bytes per device at
  ``microbatch`` examples at once, ``num_microbatches`` per step (its
  ``model.remat`` column); ``params``: the run's parameter tree (default:
  the DARL model of ``config``). None where memory.py cannot read the
  config (no ViT ``config.model``)."""
  if "model" not in config or not config.model.get("variant"):
    return None
  from darl_jax import memory  # pylint: disable=g-import-not-at-top
  try:
    est = memory.estimate(config, mesh_shape, config.get("sharding", "replicated"),
                          microbatch, params=params, num_microbatches=num_microbatches)
    return est.total(config.model.get("remat", "none"))
  except (ValueError, KeyError) as e:
    logging.info("memory.py gives no estimate for this config: %s", e)
    return None


def describe_estimate(config, mesh_shape: dict, microbatch: int) -> str | None:
  """darl_jax/memory.py's analytic estimate of a pretraining step at
  ``microbatch`` examples (of ``config.batch_size`` per step), for the log
  and the TPU compile report beside the compiled figure; None for other
  trainers (memory.py's figures are checked for pretraining only)."""
  if config.get("trainer") != "pretrain" or "decoder" not in config:
    return None
  total = estimate_bytes(config, mesh_shape, microbatch,
                         num_microbatches=max(config.batch_size // microbatch, 1))
  return None if total is None else f"{total / GIB:.2f} GiB"


# ------------------------------------------------- every program at start-up

# Host cores per program compiled at once. XLA's compile of one program
# keeps about one core busy for most of its passes, but not only one (LLVM
# code generation fans out), and four programs at once on a 2-core host
# shared with other work took 1.3-1.5x the time of one after the other
# (70.7 and 73.9 s against 57.4 and 48.4 s for the Fashion-MNIST default
# with a diffusion decoder). So a 2-core host compiles one at a time and a
# GPU host's 16 cores four at once (not measured yet:
# benchmarks/startup_benchmark.py with DARL_COMPILE_THREADS=1 against the
# default measures it).
COMPILE_CORES = 4


@dataclasses.dataclass
class Program:
  """One program a run uses (the train step, the eval step, the state's
  initialisation, a trainer's closing picture), compiled at start-up.

  ``jitted`` is traced and lowered on ``args`` (ShapeDtypeStructs) in the
  calling thread, then compiled beside the others (:func:`compile_programs`);
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
  refused: CompilerOutOfMemory | None = None   # XLA's refusal for want of memory
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
    """Reads the saved program's file (its header and bytes; nothing is
    deserialized); False where there is none or it is not a saved program
    (then it is to be lowered and compiled). Whether it is this program,
    :meth:`loaded_matches` tells once the program is traced, and only then
    does :meth:`deserialize` make it an executable."""
    from darl_jax.train import executables  # pylint: disable=g-import-not-at-top
    if not self.find_saved():
      return False
    t0 = time.perf_counter()
    saved = executables.read(self.path)
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
    :meth:`loaded_matches` checked, this program's executable; False where
    it does not load (then it is to be lowered and compiled)."""
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
    except CompilerOutOfMemory as e:
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
  first steps hide for the most part (the start-up rows of
  benchmarks/RESULTS.md). :meth:`wait` joins the thread; the loop waits for
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


def compile_programs(programs: list[Program], *, after: Callable | None = None,
                     defer_saves: bool = False) -> DeferredSaves | None:
  """Every one of ``programs``, in order (the train step first): where a run
  saved it, its file is read in a thread while this thread traces it, and
  once the trace's jaxpr is the one saved with it (checked before anything
  is deserialized) its deserialization is handed to a thread pool of
  :func:`compile_threads` (XLA's work, outside the GIL); otherwise it is
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
        # Nothing saved is deserialized before this trace's jaxpr matches it.
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
