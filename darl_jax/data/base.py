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
from typing import Any, Iterator, Optional

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


def stream_rows(step: int, batch_size: int, process_index: int, process_count: int,
                streams: int) -> list[tuple[int, slice, np.ndarray]]:
  """Where the rows of process p's local batch of global step ``step`` come
  from, when the global batch is made of ``streams`` streams: rows
  ``[g * B/S, (g + 1) * B/S)`` of the global batch are positions
  ``[step * B/S, (step + 1) * B/S)`` of stream g (S = ``streams``), and
  process p reads rows ``[p * b, (p + 1) * b)`` (b = B / P). Returns
  ``[(g, rows of the local batch, positions in stream g)]`` in row order:
  one entry when the process's rows lie inside one stream (P a multiple of
  S), several when they span streams (S a multiple of P, or neither).
  The global batch depends on (step, B, S), never on P."""
  local = local_batch_size(batch_size, process_count)
  if streams <= 0 or batch_size % streams:
    raise ValueError(f"batch_size {batch_size} is not divisible by the {streams} data "
                     f"streams the run started with: keep the run's batch_size")
  per = batch_size // streams
  out, row, end = [], process_index * local, (process_index + 1) * local
  while row < end:
    g = row // per
    stop = min(end, (g + 1) * per)
    first = step * per + row - g * per
    out.append((g, slice(row - process_index * local, stop - process_index * local),
                np.arange(first, first + stop - row, dtype=np.int64)))
    row = stop
  return out


def stream_state(streams: int) -> dict:
  """The data state's entry for ``streams`` (``stream_rows``) beside the step:
  none for one global stream, the state every checkpoint of a source with
  one stream held before streams were recorded. (A checkpoint of that time
  from a run whose processes read their own files, data.process_files='own',
  had one stream per process: resumed now it continues as one global
  stream, a new order for the rest of that epoch.)"""
  return {} if streams == 1 else {"streams": int(streams)}


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
    (-1: the host's share of cores, 0: in this process); their state also
    holds the number of streams the run started with (``streams``), which a
    resumed run keeps whatever its process count."""
    from darl_jax.data import pipeline  # pylint: disable=g-import-not-at-top
    local_batch_size(batch_size, process_count)
    check_process(process_index, process_count)
    pipeline.check_state(state, start_step)
    if not self.random_access:
      # A sequential stream (tf.data) is cut into one part per process: it
      # continues only on the number of processes that wrote the state.
      saved = (state or {}).get("processes", process_count)
      if saved != process_count:
        raise ValueError(
            f"the checkpoint's data stream was read by {saved} processes and "
            f"{type(self).__name__} splits its stream by process: resume on {saved} "
            f"processes, or use a random-access form of the data (for TFDS datasets "
            f"data.backend='records'), whose stream any number of processes continues")
      return pipeline.SequentialIterator(
          self.train_batches(batch_size, start_step, process_index, process_count),
          start_step, state={"processes": process_count})
    if self.num_examples == 0:
      raise ValueError("cannot train on an empty split")
    streams = self.resumed_streams(state, process_count)
    self.use_streams(streams, batch_size, process_index, process_count)
    return pipeline.StepIterator(
        CallAt(self, "train_batch", batch_size, process_index, process_count),
        start_step=start_step,
        num_workers=pipeline.resolve_num_workers(num_workers), state=stream_state(streams))

  # -- streams (random-access sources) ----------------------------------------
  #
  # A global batch is made of S streams, each a pure function of (seed, its
  # positions): rows [g * B/S, (g + 1) * B/S) of step s are positions
  # [s * B/S, (s + 1) * B/S) of stream g (``stream_rows``). S is fixed when a
  # run starts (``default_streams``: 1, one global stream, unless the source
  # splits its files between processes) and kept in the data state, so that
  # a run resumed on another number of processes reads the same global
  # batches: each process takes its rows, from whichever streams hold them.

  def default_streams(self, process_count: int) -> int:
    """S for a run that starts on ``process_count`` processes."""
    del process_count
    return 1

  def resumed_streams(self, state: dict | None, process_count: int) -> int:
    """S of a run: the data state's when resumed (``stream_state``: no
    ``streams`` entry is one stream), else ``default_streams``."""
    if state is not None:
      return int(state.get("streams", 1))
    return self.default_streams(process_count)

  def stream_source(self, stream: int, streams: int) -> "DataSource":
    """The source of stream ``stream`` of ``streams`` (``stream_batch``)."""
    if streams == 1:
      return self
    raise ValueError(
        f"the checkpoint's data stream is made of {streams} streams (each process's own "
        f"files, data.process_files='own', when the run started), but "
        f"{type(self).__name__} reads one global stream: set "
        f"--config.data.process_files=own and the run's data.path")

  def stream_batch(self, positions: np.ndarray) -> Batch:
    """The examples at ``positions`` of this stream (random-access sources)."""
    raise NotImplementedError(f"{type(self).__name__} has no streams")

  def use_streams(self, streams: int, batch_size: int, process_index: int,
                  process_count: int) -> None:
    """Makes ``train_batch`` read ``streams`` streams, and builds (here, in
    the training process, before the source is sent to worker processes)
    the sources of the streams whose rows process ``process_index`` reads."""
    needed = [g for g, _, _ in stream_rows(0, batch_size, process_index, process_count,
                                           streams)]
    cache = self.__dict__.setdefault("_stream_sources", {})
    for g in needed:
      if (g, streams) not in cache:
        cache[(g, streams)] = self.stream_source(g, streams)
    self._streams = int(streams)

  def streamed_batch(self, step: int, batch_size: int, process_index: int,
                     process_count: int) -> Batch:
    """Process p's local batch of ``step``, its rows read from the streams
    that hold them (``stream_rows``)."""
    streams = self.__dict__.get("_streams")
    if streams is None:       # called directly (tests, wrappers): a new run's streams
      streams = self.default_streams(process_count)
      self.use_streams(streams, batch_size, process_index, process_count)
    parts = stream_rows(step, batch_size, process_index, process_count, streams)
    cache = self.__dict__["_stream_sources"]
    for g, _, _ in parts:
      if (g, streams) not in cache:   # another process's rows: its streams too
        cache[(g, streams)] = self.stream_source(g, streams)
    batches = [cache[(g, streams)].stream_batch(positions) for g, _, positions in parts]
    if len(batches) == 1:
      return batches[0]
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}

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

  # True for sources that list every label up front (sources/indexed.py), which
  # ``first_label_outside`` then looks at; the others' labels come with
  # each record, and only their class count is known before reading.
  labels_listed = False

  def first_label_outside(self, num_classes: int) -> Optional[tuple[str, int]]:
    """(name, label) of the first example whose label is not in [0,
    ``num_classes``), or None (always, for sources that do not list their
    labels)."""
    del num_classes
    return None

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(image_shape={self.image_shape}, "
            f"num_classes={self.num_classes}, "
            f"num_examples={self.num_examples})")


def check_labels(source: DataSource, num_classes: int, split: str) -> None:
  """One error line, naming the example and the fix, unless every label of
  ``source`` (the split ``split``, which a classifier of the training split's
  ``num_classes`` classes is scored on) is one of those classes: a label at
  or above the count, or negative, would be scored against no class at all
  (a one-hot of zeros), and an unlabeled split against label 0, silently."""
  if source.num_classes <= 0:
    raise ValueError(f"the {split!r} split has no labels (or some of its examples have none), "
                     f"so a classifier of {num_classes} classes cannot be scored on it: label "
                     f"every example of it, or set data.eval_split / data.eval_path to a "
                     f"labelled split")
  if not source.labels_listed and source.num_classes > num_classes:
    raise ValueError(f"the {split!r} split has {source.num_classes} classes and the training "
                     f"split {num_classes}: set data.num_classes to at least "
                     f"{source.num_classes} so that every split has the same classes")
  found = source.first_label_outside(num_classes)
  if found is not None:
    name, label = found
    fix = (f"set data.num_classes to at least {label + 1} so that every split has the same "
           f"classes, or fix or leave out that example" if label >= 0
           else "fix or leave out that example")
    raise ValueError(f"{split!r} example {name} has the label {label}, not one of the "
                     f"{num_classes} classes 0-{num_classes - 1} of the training split: {fix}")


class CallAt:
  """``k -> getattr(source, method)(k, *args)``: the picklable function the
  pipeline's worker processes run (``train_batch`` of step k, ``eval_batch``
  k, ...)."""

  def __init__(self, source: DataSource, method: str, *args):
    self.source, self.method, self.args = source, method, args

  def __call__(self, k: int) -> Batch:
    return getattr(self.source, self.method)(int(k), *self.args)
