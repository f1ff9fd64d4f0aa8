"""A held-out part of a training split, carved out deterministically.

A probe grid chooses its hyper-parameters on examples it does not train on
and that are not the split it reports (train/probe_grid.py), as DINOv2 and
AIM choose theirs: ``split(source, size)`` returns two sources over disjoint
rows of one training split,

    train    -> the rows not held out (shuffled, augmented as configured)
    held_out -> ``size`` rows, evaluated unaugmented (``eval_batches``)

The held-out rows are the first ``size`` of a permutation of the split drawn
from a fixed seed (``HOLDOUT_SEED``), not from ``config.seed``: every seed of
a study selects on the same examples, so seeds differ by their training
noise only. They depend on the split's size alone, so a rerun, a resume or
another process sees the same rows.

Only sources whose examples are addressable by index (``IndexedSource``:
the in-memory arrays and image folders) can be split here; a streaming
source (TFDS) would need the split in its reader.
"""

from __future__ import annotations

import numpy as np

from darl_jax.data.sources import indexed

HOLDOUT_SEED = 2024
# The size of ``holdout_size=-1``: this fraction of the split, at most MAX.
DEFAULT_FRACTION = 0.02
DEFAULT_MAX = 10_000


def resolve_size(size: int, num_examples: int) -> int:
  """``size`` held-out rows; ``-1``: ``min(2% of the split, 10000)``."""
  if size == -1:
    return min(int(round(DEFAULT_FRACTION * num_examples)), DEFAULT_MAX)
  if isinstance(size, bool) or not isinstance(size, int) or size < 0:
    raise ValueError(f"probe.holdout_size must be an integer >= 0 or -1 "
                     f"(min(2%, 10000) examples), got {size!r}")
  if size >= num_examples:
    raise ValueError(f"probe.holdout_size {size} leaves nothing to train on "
                     f"(the split has {num_examples} examples)")
  return size


def held_out_rows(num_examples: int, size: int) -> np.ndarray:
  """The sorted indices (int64 ``[size]``) of the held-out rows of a split of
  ``num_examples``."""
  rng = np.random.default_rng(np.random.SeedSequence([HOLDOUT_SEED, num_examples]))
  return np.sort(rng.permutation(num_examples)[:size])


class Rows(indexed.IndexedSource):
  """The rows ``rows`` of an ``IndexedSource``, as a source of their own:
  training batches shuffle and augment them with the parent's seed and
  settings; example ``i`` of this source is example ``rows[i]`` of the parent."""

  def __init__(self, parent: indexed.IndexedSource, rows: np.ndarray):
    super().__init__(labels=parent.labels[rows], num_classes=parent.num_classes,
                     image_size=parent.image_shape[0], channels=parent.image_shape[2],
                     augment=parent.augment, seed=parent.seed, crop_scale=parent.crop_scale)
    self.parent, self.rows = parent, np.asarray(rows, np.int64)
    self.decodes_files = parent.decodes_files

  def _load(self, indices, positions):
    return self.parent._load(self.rows[indices], positions)  # pylint: disable=protected-access

  def _examples(self, indices, positions):
    return self.parent._examples(self.rows[indices], positions)  # pylint: disable=protected-access

  def example_name(self, index: int) -> str:
    return self.parent.example_name(int(self.rows[index]))


def split(source, size: int) -> tuple[indexed.IndexedSource, indexed.IndexedSource]:
  """``(train, held_out)``: disjoint row sets of ``source`` (module docstring)."""
  if not isinstance(source, indexed.IndexedSource):
    raise ValueError(
        f"a held-out part needs a source addressable by index (in-memory or image "
        f"folder); {type(source).__name__} is not: set --config.probe.holdout_size=0 "
        f"and a grid of one setting")
  if getattr(source, "owner", None) is not None:
    raise ValueError(
        "a held-out part is drawn from the whole training split, but this process reads "
        "only its own files of it: set --config.data.process_files=all (or "
        "--config.probe.holdout_size=0 and a grid of one setting)")
  size = resolve_size(size, source.num_examples)
  held = held_out_rows(source.num_examples, size)
  keep = np.setdiff1d(np.arange(source.num_examples), held)
  return Rows(source, keep), Rows(source, held)
