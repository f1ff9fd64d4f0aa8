"""The Pallas kernels on a mesh of several devices: each device runs them on
its own rows of the batch.

A Pallas call is a custom call with no partitioning rule (jax registers none
for Mosaic GPU or Triton calls), so under plain ``jit`` XLA's partitioner
would run it on replicated operands: every device gathering the whole
batch's activations and computing the layer for all of it. ``over_batch``
instead runs the kernel's function under ``jax.shard_map`` over the mesh's
batch axes, so that a device's kernels see only its own images:

- the batched operands (activations, and their gradients) keep the batch
  split they already have: no collective moves them;
- the parameters enter replicated (``P()``): under FSDP they are gathered
  for the layer, as XLA gathers them for any layer, and their gradients are
  summed over the batch axes by shard_map's transpose, the all-reduce that
  data parallelism needs anyway.

The mesh comes from the trace's context: ``jax.sharding.use_abstract_mesh``,
which the training loop and the evaluation step set (step.make_train_step's
``mesh``). Which of its axes split the batch is the caller's to say
(``axes``: darl_jax/ops.py passes mesh_axes.BATCH_AXES, the axes
sharding.batch_sharding splits the batch over); this module imports nothing
of the package above kernels/. Without a mesh, or with a single device on
the batch axes, the function runs as it is. Any other axis of more than one
device (``tensor``) is not split: the kernels compute whole heads and whole
MLP widths, so their parameters are gathered over it too and its devices
repeat the same work (sharding.kernel_mesh_warning says so).

The kernels' shape checks (``fits``) must see the per-device shapes: use
``local`` on the batched operands before checking.

Every kernel call also goes through one ``jax.jit`` per program
(``_shared``): a model's identical blocks then trace, lower and compile
each kernel once instead of once per block. Lowering a Pallas call runs
its whole kernel compiler, so without this a deep unrolled model spends
most of its start-up there, at the same step time (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P


def _batch_axes(axes: Sequence[str]) -> tuple[str, ...]:
  """Those of ``axes`` on the current mesh (none without a mesh). Axes of
  one device stay in: the spec must be the batch's own."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  return tuple(a for a in axes if a in mesh.axis_names)


def batch_shards(axes: Sequence[str]) -> int:
  """How many pieces the batch is split into over ``axes`` on the current
  mesh (1 without one)."""
  mesh = jax.sharding.get_abstract_mesh()
  return math.prod(mesh.shape[a] for a in _batch_axes(axes))


def local(x, axes: Sequence[str]):
  """``x``'s per-device shape on the current mesh (leading, batch, axis
  divided by the shards of ``axes``) as a ``jax.ShapeDtypeStruct``; ``x``
  itself without a mesh. None when the batch does not divide: then no
  kernel fits and the caller takes XLA's path."""
  shards = batch_shards(axes)
  if shards == 1:
    return x
  if x.shape[0] % shards:
    return None
  return jax.ShapeDtypeStruct((x.shape[0] // shards,) + tuple(x.shape[1:]), x.dtype)


def over_batch(fn: Callable, *args, batched: Sequence[bool], axes: Sequence[str]):
  """``fn(*args)``, each device on its own rows of the batch, which is
  split over the mesh axes ``axes``.

  ``batched[i]``: whether ``args[i]`` (an array, or a pytree of arrays) has
  the batch as its leading axis; the others (parameters, tables) are
  replicated. Every output has the batch as its leading axis. Static
  settings go into ``fn`` (a closure), not ``args``."""
  if len(batched) != len(args):
    raise ValueError(f"batched has {len(batched)} entries for {len(args)} arguments")
  fn = _shared(fn)
  if batch_shards(axes) == 1:
    return fn(*args)
  spec = P(_batch_axes(axes))
  # check_vma=False: the Pallas calls carry no varying-axes types to check.
  # The replicated inputs' gradients are still summed over the batch axes
  # (tests/test_kernel_sharding.py compares them with one device's).
  return jax.shard_map(fn, in_specs=tuple(spec if b else P() for b in batched),
                       out_specs=spec, check_vma=False)(*args)


_SHARED: dict = {}
_SHARED_LOCK = threading.Lock()


def _shared(fn: Callable) -> Callable:
  """``fn`` as a ``jax.jit`` shared by every call of the same code with the
  same values closed over (the kernel's static settings: tilings, eps,
  the interpreter switch). Traced again only for new argument shapes, and
  a jitted call nested in a trace lowers to one function that every call
  site calls, so N identical layers lower their kernels once (jax caches
  a nested jit's lowering by its jaxpr). A closure over something
  unhashable (an array) is called as it is."""
  try:
    key = (fn.__code__, tuple(cell.cell_contents for cell in fn.__closure__ or ()))
    hash(key)
  except (TypeError, ValueError, AttributeError):
    return fn
  with _SHARED_LOCK:   # programs may be traced from several threads at start-up
    if key not in _SHARED:
      _SHARED[key] = jax.jit(fn)
    return _SHARED[key]


__all__: Sequence[str] = ("batch_shards", "local", "over_batch")
