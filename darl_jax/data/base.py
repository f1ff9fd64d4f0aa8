"""The `DataSource` interface and helpers shared by all sources.

Batch-size convention (train and eval alike): ``batch_size`` is the GLOBAL
batch size; each of ``process_count`` processes yields local batches of
``batch_size // process_count`` rows, and the trainer assembles the global
array from the local pieces (process ``p`` holds rows ``[p * b, (p + 1) * b)``
of the global batch).
"""

from __future__ import annotations

import abc
import math
from typing import Any, Iterator

import numpy as np
from absl import logging

Batch = dict[str, np.ndarray]

SPLITS = ("train", "validation", "test")
AUGMENTS = ("none", "spatial")


def cfg_get(config: Any, key: str, default: Any = None) -> Any:
  """`config.key` for a ConfigDict / any attribute object; default if absent
  or None (so a ConfigDict placeholder set to None also means "default")."""
  if isinstance(config, dict):
    value = config.get(key, default)
  else:
    value = getattr(config, key, default)
  return default if value is None else value


_WARNED: set = set()


def warn_once(key, message: str, *args) -> None:
  """``logging.warning(message, *args)`` the first time ``key`` is seen in
  this process. A source is built once per split (train, then validation,
  probes, few-shot support and query...), and each build meets the same
  condition: the warning belongs to the data, not to the build."""
  if key in _WARNED:
    return
  _WARNED.add(key)
  logging.warning(message, *args)


def local_batch_size(batch_size: int, process_count: int) -> int:
  """Per-process rows of a global batch; ValueError unless it divides."""
  if batch_size <= 0:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  if process_count <= 0 or batch_size % process_count:
    raise ValueError(
        f"batch_size {batch_size} is not divisible by process_count "
        f"{process_count}: every process must get the same number of rows")
  return batch_size // process_count


def check_process(process_index: int, process_count: int) -> None:
  if not 0 <= process_index < process_count:
    raise ValueError(
        f"process_index {process_index} not in [0, {process_count})")


def process_range(num: int, process_index: int,
                  process_count: int) -> tuple[int, int]:
  """Contiguous [lo, hi) slice of ``num`` examples for one process.

  The first ``num % process_count`` processes get one extra example (the same
  rule as ``tfds.even_splits(drop_remainder=False)``), so the slices of all
  processes tile ``[0, num)`` exactly.
  """
  base, extra = divmod(num, process_count)
  lo = process_index * base + min(process_index, extra)
  hi = lo + base + (1 if process_index < extra else 0)
  return lo, hi


def num_eval_batches(num: int, local_batch: int, process_count: int) -> int:
  """Eval batches per process: equal on all processes (the largest slice
  decides), because multi-host steps are collective and every process must
  take part in each one; shorter slices are padded with masked rows."""
  return math.ceil(math.ceil(num / process_count) / local_batch)


def this_process() -> tuple[int, int]:
  """(jax.process_index(), jax.process_count()) of this training process.
  jax is imported here, when a source that splits its files by process is
  built, never in the pipeline's worker processes."""
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index(), jax.process_count()


def gather_ints(values: list[int], process_count: int) -> np.ndarray:
  """int64 [P, len(values)]: every process's ``values``, in process order (a
  collective: all processes call it together; one row for one process)."""
  values = np.asarray([values], np.int64)
  if process_count == 1:
    return values
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(values)).reshape(process_count, -1)


def pad_batch(batch: Batch, size: int, image_shape) -> Batch:
  """Pads an eval batch to ``size`` rows; adds ``mask`` (False on padding).

  Padding images are zeros (uint8) and labels 0.
  """
  n = 0 if batch is None else len(batch["label"])
  if n > size:
    raise ValueError(f"batch of {n} rows exceeds the padded size {size}")
  image = np.zeros((size, *image_shape), np.uint8)
  label = np.zeros((size,), np.int32)
  mask = np.zeros((size,), bool)
  if n:
    image[:n] = batch["image"]
    label[:n] = batch["label"]
    mask[:n] = True
  return {"image": image, "label": label, "mask": mask}


class DataSource(abc.ABC):
  """One split of a dataset, able to produce host batches.

  Attributes:
    image_shape: (H, W, C) of every batch's images.
    num_classes: number of labels, or 0 for unlabeled data (labels are 0).
    num_examples: examples in this split (all processes together).
  """

  image_shape: tuple[int, int, int]
  num_classes: int
  num_examples: int

  # True for sources that build the batch of any step directly
  # (``train_batch``); their training batches then come from the Grain
  # pipeline, built in worker processes (pipeline.py).
  random_access = False

  def train_batch(self, step: int, batch_size: int, process_index: int = 0,
                  process_count: int = 1) -> Batch:
    """The local batch of global step ``step`` (random-access sources)."""
    raise NotImplementedError(f"{type(self).__name__} has no random access")

  def train_iterator(self, batch_size: int, *, start_step: int = 0,
                     process_index: int = 0, process_count: int = 1,
                     num_workers: int = 0, state: dict | None = None):
    """The training loop's iterator: ``train_batches``' batches from
    ``start_step`` on, with ``get_state()`` / ``set_state()`` (the state a
    checkpoint stores; ``state``, if given, must agree with ``start_step``).
    Random-access sources build batches in ``num_workers`` processes
    (-1: the host's share of cores, 0: in this process)."""
    from darl_jax.data import pipeline  # pylint: disable=g-import-not-at-top
    local_batch_size(batch_size, process_count)
    check_process(process_index, process_count)
    pipeline.check_state(state, start_step)
    if not self.random_access:
      return pipeline.SequentialIterator(
          self.train_batches(batch_size, start_step, process_index, process_count),
          start_step)
    if self.num_examples == 0:
      raise ValueError("cannot train on an empty split")
    return pipeline.StepIterator(
        CallAt(self, "train_batch", batch_size, process_index, process_count),
        start_step=start_step,
        num_workers=pipeline.resolve_num_workers(num_workers))

  def train_batches(self, batch_size: int, start_step: int = 0,
                    process_index: int = 0,
                    process_count: int = 1) -> Iterator[Batch]:
    """Infinite shuffled (and, per config, augmented) local batches.

    Random-access sources get ``train_iterator`` in this process (no
    workers); the others implement it.

    Yields {"image": uint8 [b, H, W, C], "label": int32 [b]},
    b = batch_size // process_count. The batch for global step s depends only
    on (seed, s, batch_size, process_index, process_count): starting at
    ``start_step = s`` yields exactly the batches that a run started at 0
    yields from its step s on. A checkpoint therefore only needs the step.
    """
    if not self.random_access:
      raise NotImplementedError(f"{type(self).__name__} implements neither "
                                "train_batch nor train_batches")
    return self.train_iterator(batch_size, start_step=start_step,
                               process_index=process_index,
                               process_count=process_count, num_workers=0)

  @abc.abstractmethod
  def eval_batches(self, batch_size: int, process_index: int = 0,
                   process_count: int = 1, num_workers: int = 0) -> Iterator[Batch]:
    """One deterministic, unaugmented pass over the split.

    Yields {"image" (uint8), "label", "mask": bool [b]} local batches of
    b = batch_size // process_count rows. Process p reads the contiguous
    slice `process_range(num_examples, p, P)`; all processes yield the same
    number of batches, padding rows have mask False, so every example is
    counted exactly once over all processes. Sources whose decoding is
    worth it (image folders) build the batches in ``num_workers`` worker
    processes (-1: automatic); the others ignore it.
    """

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(image_shape={self.image_shape}, "
            f"num_classes={self.num_classes}, "
            f"num_examples={self.num_examples})")


class CallAt:
  """``k -> getattr(source, method)(k, *args)``: the picklable function the
  pipeline's worker processes run (``train_batch`` of step k, ``eval_batch``
  k, ...)."""

  def __init__(self, source: DataSource, method: str, *args):
    self.source, self.method, self.args = source, method, args

  def __call__(self, k: int) -> Batch:
    return getattr(self.source, self.method)(int(k), *self.args)
