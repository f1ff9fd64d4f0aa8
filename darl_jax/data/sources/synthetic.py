"""Random uint8 images with no host work: the training step alone, through the loop.

``data.name=synthetic`` feeds the loop a few fixed random batches (made
once, cycled), so a run measures the step and the loop around it with the
input pipeline taken out (benchmarks/cli_benchmark.py compares it with a
folder of JPEGs). Labels are random over ``NUM_CLASSES``; the split sizes
are ImageNet's, so epochs and schedules come out as on ImageNet. Not for
learning anything.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from darl_jax.data.base import DataSource, cfg_get, local_batch_size, pad_batch

NUM_CLASSES = 1000
SPLIT_SIZES = {"train": 1_281_167, "validation": 50_000, "test": 50_000}
DISTINCT_BATCHES = 4


class SyntheticSource(DataSource):

  random_access = True

  def __init__(self, *, split: str, image_size: int, channels: int, seed: int):
    if split not in SPLIT_SIZES:
      raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLIT_SIZES)}")
    self.image_shape = (image_size, image_size, channels)
    self.num_classes = NUM_CLASSES
    self.num_examples = SPLIT_SIZES[split]
    self.seed = seed
    self._cache: dict[int, list[dict]] = {}

  def _batches(self, rows: int) -> list[dict]:
    if rows not in self._cache:
      rng = np.random.default_rng(self.seed)
      self._cache[rows] = [
          {"image": rng.integers(0, 256, (rows, *self.image_shape), dtype=np.uint8),
           "label": rng.integers(0, NUM_CLASSES, (rows,), dtype=np.int32)}
          for _ in range(DISTINCT_BATCHES)]
    return self._cache[rows]

  def train_batch(self, step: int, batch_size: int, process_index: int = 0,
                  process_count: int = 1) -> dict:
    del process_index
    return self._batches(local_batch_size(batch_size, process_count))[
        step % DISTINCT_BATCHES]

  def train_iterator(self, batch_size: int, **kwargs):
    # Always in this process: there is no work to hand to workers.
    return super().train_iterator(batch_size, **{**kwargs, "num_workers": 0})

  def eval_batches(self, batch_size: int, process_index: int = 0,
                   process_count: int = 1, num_workers: int = 0) -> Iterator[dict]:
    del process_index
    local = local_batch_size(batch_size, process_count)
    for batch in self._batches(local)[:1]:
      yield pad_batch(batch, local, self.image_shape)


def build(config: Any, *, split: str, seed: int) -> DataSource:
  return SyntheticSource(split=split, image_size=int(cfg_get(config, "image_size", 224)),
                         channels=int(cfg_get(config, "channels", 3)), seed=seed)
