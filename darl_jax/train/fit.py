"""Whether the train step fits the device, and the run's resolved sizes.

The loop (and ``python -m darl_jax.compile`` for a TPU topology from a CPU
host) compiles the step ahead of time (train/aot.py), reads XLA's memory
analysis of the compiled program (:class:`Footprint`) and compares it with
the device's memory. A step that cannot fit stops there, with one line
naming the fix (``microbatch_size``, remat, FSDP), instead of an allocator
dump after the first steps.

The microbatch, the evaluation batch and the data workers are decided once,
by :func:`resolve`, into a :class:`Resolved` that the rest of the run reads;
the config is never written. ``microbatch_size=-1`` picks the largest
microbatch whose step fits, from darl_jax/memory.py's estimate before
compiling anything (:func:`first_microbatch`); the compiled figure may step
it down once (:func:`choose_microbatch`).

The figure is XLA's buffer assignment of the program: arguments (the train
state and the batch) + outputs - the outputs that alias donated arguments +
temporaries + generated code, per device. It does not count what lives
beside the step (prefetched batches, evaluation programs, the allocator's
fragmentation), hence the headroom of ``FIT_FRACTION``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from absl import logging

from darl_jax import config_lib
from darl_jax.data import pipeline as data_pipeline
from darl_jax.train import accumulate

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



class CompilerOutOfMemory(RuntimeError):
  """XLA refused to compile the step for want of memory (the TPU compiler
  does, at compile time); ``footprint`` and ``capacity`` are its figures."""

  def __init__(self, message: str, footprint: Footprint, capacity: int):
    super().__init__(message)
    self.footprint, self.capacity = footprint, capacity




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
# darl_jax/memory.py's analytic estimate (no compile): compiling a candidate
# that cannot fit is slow for a large model (XLA first tries hard to make it
# fit), and the whole batch on one device is often such a candidate.

# memory.py's estimate is within this factor of XLA's compiled figure on the
# configurations it was checked on (docs/TPU.md, benchmarks/RESULTS.md). The
# first candidate is the largest whose estimate, raised by it, fits: it fits
# when compiled unless the estimate is off by more than it is known to be.
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
                   params=None, backend: str | None = None) -> float | None:
  """darl_jax/memory.py's estimate of the train step's bytes per device at
  ``microbatch`` examples at once, ``num_microbatches`` per step (its
  ``model.remat`` column), for any trainer; ``params``: the run's parameter
  tree (default: the DARL model of ``config``), whose shardings name the
  backend that compiles the step (``backend`` overrides it; memory.py
  counts what XLA:CPU keeps beyond the accelerators). None where memory.py
  cannot read the config (no ViT ``config.model``)."""
  if "model" not in config or not config.model.get("variant"):
    return None
  from darl_jax import memory  # pylint: disable=g-import-not-at-top
  try:
    est = memory.estimate(config, mesh_shape, config.get("sharding", "replicated"),
                          microbatch, params=params, num_microbatches=num_microbatches,
                          backend=backend)
    return est.total(config.model.get("remat", "none"))
  except (ValueError, KeyError) as e:
    logging.info("memory.py gives no estimate for this config: %s", e)
    return None


def describe_estimate(config, mesh_shape: dict, microbatch: int, *, params=None,
                      backend: str = "tpu") -> str | None:
  """darl_jax/memory.py's analytic estimate of the train step at
  ``microbatch`` examples (of ``config.batch_size`` per step), for the TPU
  compile report beside the compiled figure (darl_jax/compile.py, which
  compiles for ``backend`` from a host whose own backend is the CPU).
  ``params``: the run's parameter tree, which every trainer but pretraining
  must pass (its head, and what it freezes); None where there is no
  estimate."""
  if params is None and (config.get("trainer") != "pretrain" or "decoder" not in config):
    return None
  total = estimate_bytes(config, mesh_shape, microbatch,
                         num_microbatches=max(config.batch_size // microbatch, 1),
                         params=params, backend=backend)
  return None if total is None else f"{total / GIB:.2f} GiB"


# ------------------------------------------------------- the resolved sizes


@dataclasses.dataclass(frozen=True)
class Resolved:
  """The run's sizes, decided once (:func:`resolve`) and read by everything
  after: ``microbatch``, the examples one forward and backward runs at once
  (``batch_size``: no accumulation); ``eval_batch``, the rows of an
  evaluation batch; ``num_workers``, each process's data workers."""
  microbatch: int
  eval_batch: int
  num_workers: int

  def num_microbatches(self, batch_size: int) -> int:
    return batch_size // self.microbatch


def estimator(config, mesh_shape: dict, params=None) -> Callable[[int], float | None]:
  """``microbatch -> estimate_bytes`` of the train step at ``config.batch_size``
  per step, each size estimated once."""
  @functools.cache
  def estimate_for(microbatch: int):
    return estimate_bytes(config, mesh_shape, microbatch,
                          num_microbatches=config.batch_size // microbatch, params=params)
  return estimate_for


def automatic(config) -> bool:
  """Whether ``config.microbatch_size`` asks for the automatic microbatch
  (-1), which :func:`resolve` chooses from the device's memory."""
  return config.get("microbatch_size", 0) == -1


def resolve(config, *, batch_shards: int = 1, capacity: int | None = None,
            estimate_for: Callable[[int], float | None] | None = None,
            microbatch: int | None = None) -> Resolved:
  """The microbatch, evaluation batch and data workers of ``config``.

  ``microbatch_size``: 0 is the whole batch, n > 0 n examples (checked to
  divide the batch over ``batch_shards``, accumulate.num_microbatches), -1
  the largest valid size whose estimate (``estimate_for``) fits
  ``capacity`` (:func:`first_microbatch`; the whole batch where the
  capacity is unknown). ``eval_batch_size``: 0 is the microbatch, since
  under gradient accumulation the whole batch never runs at once and one
  evaluation program over it can need more than the device has, while the
  microbatch, whose forward and backward fit, evaluates forward only.
  ``data.num_workers``: -1 is this process's share of the host's cores
  (data/pipeline.py). ``microbatch``: one chosen already (the compile
  report's, for a step that fits at none) instead of ``microbatch_size``."""
  batch_size = config.batch_size
  requested = config.get("microbatch_size", 0)
  if microbatch is not None:
    pass
  elif automatic(config):
    sizes = accumulate.candidates(batch_size, batch_shards)
    microbatch = first_microbatch(estimate_for or (lambda size: None), sizes,
                                  capacity, batch_shards=batch_shards,
                                  remat=config.get("model", {}).get("remat", "none"))
  else:
    microbatch = batch_size // accumulate.num_microbatches(batch_size, requested, batch_shards)
  eval_batch = config.get("eval_batch_size", 0) or microbatch
  # A job without a data section of its own (few-shot) reads no workers from it.
  workers = data_pipeline.resolve_num_workers((config.get("data") or {}).get("num_workers", -1))
  return Resolved(microbatch=microbatch, eval_batch=eval_batch, num_workers=workers)
