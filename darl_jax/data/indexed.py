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
(pipeline.py) runs it in worker processes.
The 1-process batch equals the concatenation of the P process batches.
"""

from __future__ import annotations

import abc
from typing import Iterator, Optional

import numpy as np

from darl_jax.data import augment as aug
from darl_jax.data import pipeline
from darl_jax.data.base import (AUGMENTS, Batch, CallAt, DataSource, check_process,
                                local_batch_size, num_eval_batches, pad_batch,
                                process_range)


class IndexedSource(DataSource):
  """Base for sources whose example i can be loaded on demand.

  Subclasses implement `_load(indices, positions)`.
  """

  def __init__(self, *, labels: np.ndarray, num_classes: int, image_size: int,
               channels: int, augment: str, seed: int, crop_scale=aug.CROP_SCALE):
    if augment not in AUGMENTS:
      raise ValueError(f"augment must be one of {AUGMENTS}, got {augment!r}")
    if channels not in (1, 3):
      raise ValueError(f"channels must be 1 or 3, got {channels}")
    self.labels = np.asarray(labels, np.int32)
    self.num_examples = int(len(self.labels))
    self.num_classes = int(num_classes)
    self.image_shape = (int(image_size), int(image_size), int(channels))
    self.augment = augment
    self.crop_scale = aug.check_crop_scale(crop_scale)
    self.seed = int(seed)
    self._perms: dict[int, np.ndarray] = {}

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

  def epoch_permutation(self, epoch: int) -> np.ndarray:
    """The example order of training epoch ``epoch`` (int64 [N])."""
    perm = self._perms.get(epoch)
    if perm is None:
      rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
      perm = rng.permutation(self.num_examples)
      # A batch touches at most a few consecutive epochs: keep a small cache.
      if len(self._perms) >= 4:
        self._perms.pop(min(self._perms))
      self._perms[epoch] = perm
    return perm

  def train_indices(self, step: int, batch_size: int, process_index: int = 0,
                    process_count: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(example indices, stream positions), both int64 [b], of a local batch."""
    local = local_batch_size(batch_size, process_count)
    start = step * batch_size + process_index * local
    positions = np.arange(start, start + local, dtype=np.int64)
    epochs, offsets = np.divmod(positions, self.num_examples)
    indices = np.empty_like(positions)
    for epoch in np.unique(epochs):
      sel = epochs == epoch
      indices[sel] = self.epoch_permutation(int(epoch))[offsets[sel]]
    return indices, positions

  random_access = True

  def train_batch(self, step: int, batch_size: int, process_index: int = 0,
                  process_count: int = 1) -> Batch:
    indices, positions = self.train_indices(step, batch_size, process_index,
                                            process_count)
    spatial = self.augment == "spatial"
    images, labels = self._examples(indices, positions if spatial else None)
    return {"image": images, "label": labels}

  # -- evaluation -----------------------------------------------------------

  def eval_batches(self, batch_size: int, process_index: int = 0,
                   process_count: int = 1, num_workers: int = 0) -> Iterator[Batch]:
    local = local_batch_size(batch_size, process_count)
    check_process(process_index, process_count)
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
    lo, hi = process_range(self.num_examples, process_index, process_count)
    indices = np.arange(lo + k * local, min(lo + (k + 1) * local, hi))
    batch = None
    if len(indices):
      images, labels = self._examples(indices, None)
      batch = {"image": images, "label": labels}
    return pad_batch(batch, local, self.image_shape)


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

  def _load(self, indices, positions):
    images = self.images[indices]
    size = self.image_shape[0]
    if positions is None:
      x = aug.resize_full(images, size)
    else:
      x = aug.random_resized_crop(images, self.seed, positions, size, self.crop_scale)
    return aug.to_uint8(aug.convert_channels(x, self.image_shape[2]))
