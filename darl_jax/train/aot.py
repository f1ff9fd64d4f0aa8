"""The train step compiled ahead of time, its memory known before the first step.

The loop (and ``python -m darl_jax.compile`` for a TPU topology from a CPU
host) lowers and compiles the jitted step on abstract arguments, reads XLA's
memory analysis of the compiled program and compares it with the device's
memory. A step that cannot fit stops there, with one line naming the fix
(``microbatch_size``, remat, FSDP), instead of an allocator dump after the
first steps. ``microbatch_size=-1`` picks the largest microbatch whose
compiled step fits (:func:`choose_microbatch`).

The figure is XLA's buffer assignment of the program: arguments (the train
state and the batch) + outputs - the outputs that alias donated arguments +
temporaries + generated code, per device. It does not count what lives
beside the step (prefetched batches, evaluation programs, the allocator's
fragmentation), hence the headroom of ``FIT_FRACTION``.
"""

from __future__ import annotations

import dataclasses
import re
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
  """The compiled step needs more memory than the device has."""


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


def compile_step(jitted, *args, traced=None) -> tuple[object, dict]:
  """``jitted.lower(*args).compile()``, with the seconds of each phase
  (``traced``: ``jitted.trace(*args)`` done already, its time not counted).
  Raises CompilerOutOfMemory where XLA itself says the step cannot fit."""
  t0 = time.perf_counter()
  traced = traced if traced is not None else jitted.trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    found = _COMPILER_OOM.search(str(e))
    if "RESOURCE_EXHAUSTED" not in str(e) or not found:
      raise
    temps = float(found.group(1)) * _UNITS[found.group(2)]
    hbm = float(found.group(3)) * _UNITS[found.group(4)]
    raise CompilerOutOfMemory(" ".join(str(e).split())[:300],
                              Footprint(0, 0, 0, int(temps), 0), int(hbm)) from None
  t3 = time.perf_counter()
  return compiled, {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2}


def suggest_microbatch(fp: Footprint, microbatch: int, capacity: int,
                       sizes: list[int]) -> int | None:
  """The largest of ``sizes`` (valid microbatch sizes) that should fit in
  ``capacity`` by ``fp``, the footprint at ``microbatch``: temporaries
  scale with the microbatch, the rest does not; None if not even the
  smallest should."""
  budget = FIT_FRACTION * capacity - (fp.total - fp.temporaries)
  per_example = fp.temporaries / max(microbatch, 1)
  fits = [b for b in sizes if b < microbatch and b * per_example <= budget]
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
    raise DoesNotFit(fix_line(fp, capacity, **kw))


def choose_microbatch(compile_for: Callable[[int], object], sizes: list[int],
                      capacity: int | None) -> tuple[int, object]:
  """``microbatch_size=-1``: the largest of ``sizes`` (largest first, the
  first one the whole batch) whose compiled step fits in ``capacity``.

  Compiles the whole batch first; where it does not fit, the footprint's
  temporaries (which scale with the microbatch) point at the candidate to
  compile next, so a choice takes two or three compiles. Returns
  ``(microbatch, compiled)``."""
  b = sizes[0]
  while True:
    try:
      compiled = compile_for(b)
      fp = footprint(compiled)
    except CompilerOutOfMemory as e:
      compiled, fp, capacity = None, e.footprint, capacity or e.capacity
    if compiled is not None and (fp is None or capacity is None
                                 or fp.total <= FIT_FRACTION * capacity):
      return b, compiled
    nxt = suggest_microbatch(fp, b, capacity, sizes)
    if nxt is None:
      smaller = [s for s in sizes if s < b]
      if not smaller:
        raise DoesNotFit(fix_line(fp, capacity, batch_size=sizes[0], microbatch=b,
                                  sizes=sizes))
      nxt = smaller[0] if fp.temporaries == 0 else smaller[-1]
    logging.info("microbatch_size=-1: %d examples need %s; trying %d", b, fp.describe(), nxt)
    b = nxt


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


def describe_estimate(config, mesh_shape: dict, microbatch: int) -> str | None:
  """darl_jax/memory.py's analytic estimate of a pretraining step at
  ``microbatch`` examples (its ``model.remat`` column), for the log beside
  the compiled figure; None for other trainers."""
  if config.get("trainer") != "pretrain" or "decoder" not in config:
    return None
  from darl_jax import memory  # pylint: disable=g-import-not-at-top
  try:
    est = memory.estimate(config, mesh_shape, config.get("sharding", "replicated"),
                          microbatch)
  except (ValueError, KeyError) as e:
    return f"(memory.py gives no estimate: {e})"
  total = (est.params + est.grads + est.adam + est.ema + est.fsdp_buffer
           + est.activations[config.model.get("remat", "none")])
  return f"{total / GIB:.2f} GiB"

