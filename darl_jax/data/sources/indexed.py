"""Index-based batching for sources whose examples are addressable by index
(in-memory arrays, lists of image files). No TensorFlow.

Training stream and resume semantics
------------------------------------
The training data is one infinite stream: epoch e is the split in the order
of permutation ``perm_e = default_rng(SeedSequence([seed, e])).permutation(N)``,
and the epochs are concatenated. Global step s consumes stream positions
``[s * B, (s + 1) * B)`` (B = global batch size; a batch may straddle an
epoch boundary), and process p takes the contiguous local slice
``[s * B + p * b, s * B + (p + 1) * b)``, b = B / P. Augmentation randomness
of an example is a hash of (seed, stream position) (see `augment.py`).
Everything is a pure function of (seed, step), so ``start_step = s``
reproduces the uninterrupted run exactly: a checkpoint needs only the step.
``train_batch(step)`` builds any step's batch directly; the Grain pipeline
(data/pipeline.py) runs it in worker processes.
The 1-process batch equals the concatenation of the P process batches.

Streams of owned files (``data.process_files="own"``, encoded.py): a
sharded source's training split read by P > 1 processes is cut into S = P
streams when the run starts, stream g holding the files ``g, g + S, ...``.
Stream g's epoch e is its examples in the order of
``default_rng(SeedSequence([seed, e, g]))``, and the crop counter of its
position j is ``j * S + g`` (distinct over streams). The global batch of
step s is the streams side by side: rows ``[g * B/S, (g + 1) * B/S)`` are
stream g's positions ``[s * B/S, (s + 1) * B/S)`` (``base.stream_rows``).
When P = S process p reads exactly stream p, its own files; S is kept in
the data state, so a run resumed on P' processes reads the same global
batches: each process takes its rows of them, building (``stream_source``,
from the builder ``regroup``) the sources of the streams those rows are in.
``num_examples`` is the sum over all streams (what epochs and schedules
count), ``size`` this stream's share. A pure function of (seed, step, S):
the batch does not equal a 1-stream run's, but it is the same on any
number of processes, devices or workers.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Iterator, Optional

import numpy as np
from absl import logging

from darl_jax.data.transforms import augment as aug
from darl_jax.data import pipeline
from darl_jax.data.base import (AUGMENTS, Batch, CallAt, DataSource, check_process,
                                local_batch_size, num_eval_batches, pad_batch,
                                process_range)


def check_owner(owner: Optional[tuple[int, int]], process_index: int,
                process_count: int) -> None:
  """A source built as process ``owner``'s own files is read by that process only."""
  if owner is not None and owner != (process_index, process_count):
    raise ValueError(f"this source holds the files of process {owner[0]} of {owner[1]}, "
                     f"not of process {process_index} of {process_count}")


class IndexedSource(DataSource):
  """Base for sources whose example i can be loaded on demand.

  Subclasses implement `_load(indices, positions)`.
  """

  # What a process opens for itself (files, readers, row-group caches), by
  # attribute: made by the factory at construction and again in every
  # pickled copy, so that each worker process opens its own.
  PER_PROCESS: dict[str, Callable[[], Any]] = {}

  def __init__(self, *, labels: np.ndarray, num_classes: int, image_size: int,
               channels: int, augment: str, seed: int, crop_scale=aug.CROP_SCALE):
    if augment not in AUGMENTS:
      raise ValueError(f"augment must be one of {AUGMENTS}, got {augment!r}")
    if channels not in (1, 3):
      raise ValueError(f"channels must be 1 or 3, got {channels}")
    self.labels = np.asarray(labels, np.int32)
    # Examples this source holds; num_examples counts all processes' when
    # they own their files (see the module docstring), else the same.
    self.size = int(len(self.labels))
    self.num_examples = self.size
    self.owner: Optional[tuple[int, int]] = None
    self.process_examples: Optional[list[int]] = None
    self.num_classes = int(num_classes)
    self.image_shape = (int(image_size), int(image_size), int(channels))
    self.augment = augment
    self.crop_scale = aug.check_crop_scale(crop_scale)
    self.seed = int(seed)
    self._perms: dict[int, np.ndarray] = {}
    # The builder of stream (g, S)'s source, for sources whose training files
    # can be split between streams (encoded.make sets it); None: one global
    # stream only.
    self.regroup: Optional[Callable[[tuple[int, int]], "IndexedSource"]] = None
    for name, fresh in self.PER_PROCESS.items():
      setattr(self, name, fresh())

  def __getstate__(self):
    state = dict(self.__dict__)
    state.update({name: fresh() for name, fresh in self.PER_PROCESS.items()})
    # Worker processes read the streams built for them; they build none.
    state["regroup"] = None
    return state

  def example_name(self, index: int) -> str:
    """Example ``index`` in messages (sources of files name the file)."""
    return str(index)

  labels_listed = True

  def first_label_outside(self, num_classes: int) -> Optional[tuple[str, int]]:
    bad = (self.labels < 0) | (self.labels >= num_classes)
    if not bad.any():
      return None
    i = int(np.argmax(bad))
    return self.example_name(i), int(self.labels[i])

  @abc.abstractmethod
  def _load(self, indices: np.ndarray,
            positions: Optional[np.ndarray]) -> np.ndarray:
    """Images of examples ``indices`` as uint8 [n, H, W, C].

    ``positions`` (int [n]) are the training-stream positions, the rng
    counters of the spatial augmentation; None means eval preprocessing.
    """

  def _examples(self, indices: np.ndarray, positions: Optional[np.ndarray]):
    """(images uint8 [n, H, W, C], labels int32 [n]) of examples ``indices``;
    sources that read both from one record override this."""
    return self._load(indices, positions), self.labels[indices]

  # -- training -------------------------------------------------------------

  def own_files(self, process_index: int, process_examples: list[int]) -> None:
    """Marks this source as process ``process_index``'s own files, of
    ``process_examples`` (every process's ``size``) examples in all."""
    if process_examples[process_index] != self.size:
      raise ValueError(f"process {process_index} holds {self.size} examples, not "
                       f"{process_examples[process_index]}")
    self.owner = (int(process_index), len(process_examples))
    self.process_examples = [int(n) for n in process_examples]
    self.num_examples = sum(self.process_examples)

  def _check_owner(self, process_index: int, process_count: int) -> None:
    check_owner(self.owner, process_index, process_count)

  # -- streams (base.DataSource; the module docstring) ------------------------

  def default_streams(self, process_count: int) -> int:
    """One stream per process when the training files are split between
    processes (data.process_files='own'), else one global stream."""
    return process_count if self.regroup is not None else 1

  def stream_source(self, stream: int, streams: int) -> "IndexedSource":
    """This source when it holds stream ``stream`` of ``streams`` (one stream:
    the whole split), else the source of that stream's files, built now."""
    want = None if streams == 1 else (int(stream), int(streams))
    if self.owner == want:
      return self
    if self.regroup is None:
      return super().stream_source(stream, streams)
    source = self.regroup((int(stream), int(streams)))
    # What the whole split is, as judged when it was built over all files:
    # its size, and whether it is labeled (a stream whose own files all have
    # labels, of a split where some have none, is read unlabeled too).
    source.num_examples, source.num_classes = self.num_examples, self.num_classes
    if not self.num_classes:
      source.labels = np.zeros_like(source.labels)
    return source

  def use_streams(self, streams: int, batch_size: int, process_index: int,
                  process_count: int) -> None:
    super().use_streams(streams, batch_size, process_index, process_count)
    rows = batch_size // streams
    for (g, count), source in self._stream_sources.items():
      if count == streams and streams > 1 and source.size < rows:
        raise ValueError(f"the files of stream {g} of {streams} hold {source.size} examples, "
                         f"fewer than its {rows} rows of a batch: write more, smaller shards "
                         f"or set data.process_files='all'")

  def stream_positions(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(examples, crop counters) at ``positions`` of this source's stream:
    the global stream, or stream g of S (counters ``positions * S + g``,
    distinct over the streams)."""
    counters = positions if self.owner is None else positions * self.owner[1] + self.owner[0]
    return self.stream_indices(positions), counters

  def stream_batch(self, positions: np.ndarray) -> Batch:
    indices, counters = self.stream_positions(positions)
    images, labels = self._examples(indices, counters if self.augment == "spatial" else None)
    return {"image": images, "label": labels}

  def epoch_rng(self, epoch: int) -> np.random.Generator:
    """The generator of training epoch ``epoch``'s order."""
    key = [self.seed, epoch] if self.owner is None else [self.seed, epoch, self.owner[0]]
    return np.random.default_rng(np.random.SeedSequence(key))

  def epoch_order(self, epoch: int) -> np.ndarray:
    """The example order of training epoch ``epoch``, made anew: a uniform
    permutation (sources that read in blocks override it)."""
    return self.epoch_rng(epoch).permutation(self.size)

  def epoch_permutation(self, epoch: int) -> np.ndarray:
    """The example order of training epoch ``epoch`` (int64 [size]), cached."""
    perm = self._perms.get(epoch)
    if perm is None:
      perm = self.epoch_order(epoch)
      # A batch touches at most a few consecutive epochs: keep a small cache.
      if len(self._perms) >= 4:
        self._perms.pop(min(self._perms))
      self._perms[epoch] = perm
    return perm

  def stream_indices(self, positions: np.ndarray) -> np.ndarray:
    """The examples at ``positions`` of this source's training stream."""
    epochs, offsets = np.divmod(positions, self.size)
    indices = np.empty_like(positions)
    for epoch in np.unique(epochs):
      sel = epochs == epoch
      indices[sel] = self.epoch_permutation(int(epoch))[offsets[sel]]
    return indices

  def process_stream(self, positions: np.ndarray, process_index: int,
                     process_count: int) -> tuple[np.ndarray, np.ndarray]:
    """(examples, crop counters) at ``positions`` of process p's own stream:
    its own files' stream when it owns them, else the global stream's
    positions ``positions * P + p`` (interleaved: disjoint over processes)."""
    if self.owner is not None:
      self._check_owner(process_index, process_count)
      return self.stream_indices(positions), positions * process_count + process_index
    spread = positions * process_count + process_index
    return self.stream_indices(spread), spread

  def train_indices(self, step: int, batch_size: int, process_index: int = 0,
                    process_count: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(example indices, crop counters), both int64 [b], of a local batch."""
    local = local_batch_size(batch_size, process_count)
    if self.owner is not None:
      if local > self.size:
        raise ValueError(f"this process's files hold {self.size} examples, fewer than its "
                         f"{local} rows of a batch: write more, smaller shards or set "
                         f"data.process_files='all'")
      own = np.arange(step * local, (step + 1) * local, dtype=np.int64)
      return self.process_stream(own, process_index, process_count)
    start = step * batch_size + process_index * local
    positions = np.arange(start, start + local, dtype=np.int64)
    return self.stream_indices(positions), positions

  random_access = True

  def train_batch(self, step: int, batch_size: int, process_index: int = 0,
                  process_count: int = 1) -> Batch:
    return self.streamed_batch(step, batch_size, process_index, process_count)

  # -- evaluation -----------------------------------------------------------

  def eval_batches(self, batch_size: int, process_index: int = 0,
                   process_count: int = 1, num_workers: int = 0) -> Iterator[Batch]:
    local = local_batch_size(batch_size, process_count)
    check_process(process_index, process_count)
    self._check_owner(process_index, process_count)
    if self.owner is not None:   # every process passes over its own files
      count = -(-max(self.process_examples) // local)
    else:
      count = num_eval_batches(self.num_examples, local, process_count)
    batch_at = CallAt(self, "eval_batch", local, process_index, process_count)
    workers = pipeline.resolve_num_workers(num_workers) if self.decodes_files else 0
    if workers:
      return pipeline.StepIterator(batch_at, num_workers=workers, stop=count)
    return map(batch_at, range(count))

  # Sources that decode files per example (image folders) evaluate in the
  # pipeline's worker processes; in-memory arrays are cheaper in-process.
  decodes_files = False

  def eval_batch(self, k: int, local: int, process_index: int,
                 process_count: int) -> Batch:
    """Eval batch ``k`` of this process (padded; ``mask`` False on padding)."""
    lo, hi = ((0, self.size) if self.owner is not None
              else process_range(self.size, process_index, process_count))
    indices = np.arange(lo + k * local, min(lo + (k + 1) * local, hi))
    batch = None
    if len(indices):
      images, labels = self._examples(indices, None)
      batch = {"image": images, "label": labels}
    return pad_batch(batch, local, self.image_shape)


class DecodedSource(IndexedSource):
  """Base for sources that decode each example from a file or record of its
  own (image folders, encoded.py's tar, Parquet, ArrayRecord and Hugging
  Face rows). An example that cannot be read or decoded (a truncated file,
  bytes that are no image) is replaced as a whole, image and label, by the
  next readable example of the split, so that no image is ever paired with
  another's label: a damaged file costs one duplicate example, never the
  run. Each bad example is named in one warning line (once per process),
  with the count of bad examples met so far.

  Subclasses implement ``_decode(index, u)``, and ``example_name(index)``
  (the file, or the shard and member) for the messages."""

  decodes_files = True
  what = "example"      # what an example is called in messages

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self._bad: dict[int, str] = {}   # this process's: example -> error

  @abc.abstractmethod
  def _decode(self, index: int, u: Optional[np.ndarray]) -> np.ndarray:
    """Example ``index``'s image, uint8 [H, W, C]: the crop of the uniforms
    ``u`` (``augment.crop_uniforms``), or the eval crop when ``u`` is None."""

  def _readable(self, index: int, u: Optional[np.ndarray]) -> tuple[np.ndarray, int]:
    """(image, example it is of): example ``index``, or the next readable
    example after it when it cannot be decoded."""
    for offset in range(self.size):
      i = (index + offset) % self.size
      if i in self._bad:
        continue
      try:
        return self._decode(i, u), i
      except Exception as e:  # pylint: disable=broad-except  # PIL, tarfile, pyarrow: many kinds
        self._bad[i] = f"{type(e).__name__}: {' '.join(str(e).split())}"
        logging.warning("unreadable %s %s (%s): the next readable example, image and label, "
                        "is read in its place; %d unreadable %s(s) met so far in this process",
                        self.what, self.example_name(i), self._bad[i], len(self._bad),
                        self.what)
    first = next(iter(self._bad))
    raise ValueError(f"no {self.what} of this split can be read; e.g. "
                     f"{self.example_name(first)}: {self._bad[first]}")

  def _examples(self, indices, positions):
    us = aug.crop_uniforms(self.seed, positions, len(indices))
    found = [self._readable(int(i), u) for i, u in zip(indices, us)]
    used = np.asarray([i for _, i in found], np.int64)
    return np.stack([image for image, _ in found]), self.labels[used]

  def _load(self, indices, positions):
    return self._examples(indices, positions)[0]


class ArraySource(IndexedSource):
  """A split held in memory as uint8 images [N, h, w, c] (native size)."""

  def __init__(self, images: np.ndarray, labels: np.ndarray, *,
               num_classes: int, image_size: int, channels: int, augment: str,
               seed: int, crop_scale=aug.CROP_SCALE):
    if images.ndim != 4 or images.dtype != np.uint8:
      raise ValueError(f"images must be uint8 [N, h, w, c], got "
                       f"{images.dtype} {images.shape}")
    if len(images) != len(labels):
      raise ValueError(f"{len(images)} images but {len(labels)} labels")
    super().__init__(labels=labels, num_classes=num_classes,
                     image_size=image_size, channels=channels, augment=augment,
                     seed=seed, crop_scale=crop_scale)
    # Kept at native resolution; resizing happens per batch (the resampler
    # is antialiased, so targets smaller than the source are fine too).
    self.images = images
    found = self.first_label_outside(self.num_classes) if self.num_classes else None
    if found is not None:
      raise ValueError(f"example {found[0]} has the label {found[1]}, not one of the "
                       f"{self.num_classes} classes 0-{self.num_classes - 1}: fix the labels"
                       + (f", or give num_classes={found[1] + 1} or more" if found[1] > 0
                          else ""))

  def _load(self, indices, positions):
    images = self.images[indices]
    size = self.image_shape[0]
    if positions is None:
      x = aug.resize_full(images, size)
    else:
      x = aug.random_resized_crop(images, self.seed, positions, size, self.crop_scale)
    return aug.to_uint8(aug.convert_channels(x, self.image_shape[2]))
