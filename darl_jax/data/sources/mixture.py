"""Weighted mixtures of sources (``data.name=mixture``, ``data.mixture``).

``data.mixture`` lists the components and their weights: a string
``"spec=weight,spec=weight"`` (what a command line can pass; commas inside
braces belong to the spec), a sequence of ``(spec, weight)`` pairs, or a dict
(keys without dots: ConfigDict refuses them in keys). A spec is

- a source name (``fashion_mnist``, ``digits``...), built from the rest of
  ``data`` as if it were ``data.name``;
- ``name:path`` (``webdataset:gs://b/train-{0000..0099}.tar``,
  ``image_folder:/data/imgs``);
- a path: ``*.tar`` patterns are tar shards, ``*.parquet`` Parquet files,
  ``*.array_record`` ArrayRecord files, a folder an image folder.

All components share ``data``'s image size, channels, augmentation and seed.

The stream: global training position i (step s holds ``[s*B, (s+1)*B)``)
belongs to block ``i // BLOCK``; every block has exactly ``n_j`` slots of
component j (``BLOCK * w_j / sum(w)``, largest remainders), placed by a
permutation drawn from (seed, block). Position i then is component j's
position ``block * n_j + rank`` in j's own stream (its epoch permutations and
counter-based crops, indexed.py). Everything is a pure function of (seed,
step): resume from the step (the pipeline's iterator state, saved with each
checkpoint), per-process slices and worker processes hold as for one
source, and the per-component counts up to any step are exact; they are
logged when the stream starts and every ``LOG_EVERY`` steps.

Streams of owned files (encoded.py, indexed.py, ``data.process_files="own"``):
when a component's training files are split into S > 1 streams (one per
process when the run starts), the mixture has S streams too: stream g's
position j (step s holds ``[s*B/S, (s+1)*B/S)``) is assigned to a component
as above, and a component's position k is k of its stream g if it splits
its files, else position ``k * S + g`` of its global stream (interleaved, so
streams never share an example). The counts logged are one stream's (every
stream has the same). A run resumed on another number of processes keeps S
(``stream_source`` builds the mixture of any stream g).

Labels: each component's own; the mixture is labeled when all components are,
with the largest class count, else unlabeled (one warning). Evaluation runs
over every component's evaluation split in turn.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator

import numpy as np
from absl import logging

from darl_jax.data import pipeline
from darl_jax.data.base import (Batch, CallAt, DataSource, cfg_get, check_process,
                                local_batch_size, stream_state, warn_once)
from darl_jax.data.sources.indexed import IndexedSource

BLOCK = 1000
LOG_EVERY = 1000


def parse(mixture: Any) -> list[tuple[str, float]]:
  """[(spec, weight)] of ``data.mixture`` (see the module docstring)."""
  if isinstance(mixture, str):
    parts, depth, cur = [], 0, ""
    for ch in mixture:
      depth += {"{": 1, "}": -1}.get(ch, 0)
      if ch == "," and depth == 0:
        parts.append(cur)
        cur = ""
      else:
        cur += ch
    parts.append(cur)
    pairs = []
    for part in (p.strip() for p in parts if p.strip()):
      spec, sep, weight = part.rpartition("=")
      if not sep:
        raise ValueError(f"data.mixture entry {part!r} has no weight: write spec=weight, "
                         f"e.g. 'shards/train-{{000..009}}.tar=0.7,image_folder:/imgs=0.3'")
      pairs.append((spec.strip(), weight))
  elif hasattr(mixture, "items"):
    pairs = list(mixture.items())
  else:
    pairs = [tuple(p) for p in (mixture or ())]
  out = []
  for spec, weight in pairs:
    try:
      w = float(weight)
    except (TypeError, ValueError):
      w = -1.0
    if not w > 0 or not np.isfinite(w):
      raise ValueError(f"data.mixture weight of {spec!r} must be a positive number, "
                       f"got {weight!r}")
    out.append((str(spec), w))
  if not out:
    raise ValueError("data.name='mixture' needs data.mixture, e.g. "
                     "'shards/train-{000..009}.tar=0.7,fashion_mnist=0.3'")
  return out


def component_config(config: Any, spec: str, names=()) -> dict:
  """``data`` with the name and path of component ``spec``; ``names`` are the
  registry's source names (passed in: the registry imports this module)."""
  known = set(names)
  base = dict(config.items()) if hasattr(config, "items") else dict(vars(config))
  base.update(mixture=None, eval_path=None)
  head, sep, tail = spec.partition(":")
  if spec in known and spec != "mixture":
    return {**base, "name": spec}
  if sep and head in known and head != "mixture" and not tail.startswith("//"):
    return {**base, "name": head, "path": tail}
  pattern = re.sub(r"\{[^{}]*\}", "0", spec)
  if pattern.endswith(".tar"):
    return {**base, "name": "webdataset", "path": spec}
  if pattern.endswith(".parquet"):
    return {**base, "name": "parquet", "path": spec}
  if pattern.endswith(".array_record"):
    return {**base, "name": "arrayrecord", "path": spec}
  if os.path.isdir(os.path.expanduser(spec)):
    return {**base, "name": "image_folder", "path": spec}
  raise ValueError(f"data.mixture: cannot tell what {spec!r} is: give a source name "
                   f"({', '.join(sorted(s for s in known if s != 'mixture'))}), "
                   f"name:path, a *.tar, *.parquet or *.array_record pattern, or a folder of images")


def slot_counts(weights: list[float], block: int = BLOCK) -> np.ndarray:
  """Slots per block of each component (largest remainders; each >= 1)."""
  w = np.asarray(weights, np.float64) / np.sum(weights)
  exact = w * block
  counts = np.floor(exact).astype(np.int64)
  for j in np.argsort(-(exact - counts), kind="stable")[:block - counts.sum()]:
    counts[j] += 1
  if (counts == 0).any():
    raise ValueError(f"a data.mixture weight is below 1/{block} of the total: raise it")
  return counts


class MixtureSource(DataSource):
  """Components mixed by weight (see the module docstring)."""

  random_access = True

  def __init__(self, components: list[IndexedSource], specs: list[str],
               weights: list[float], seed: int):
    shapes = {c.image_shape for c in components}
    if len(shapes) != 1:
      raise ValueError(f"the data.mixture components give images of shapes {shapes}")
    for spec, c in zip(specs, components):
      if not isinstance(c, IndexedSource):
        raise ValueError(f"data.mixture component {spec!r} ({type(c).__name__}) has no "
                         f"random access; use its ArrayRecord / files form")
      if c.num_examples == 0:
        raise ValueError(f"data.mixture component {spec!r} is empty")
    self.components, self.specs, self.weights = components, specs, list(weights)
    self.seed = int(seed)
    self.image_shape = components[0].image_shape
    self.num_examples = sum(c.num_examples for c in components)
    classes = [c.num_classes for c in components]
    self.num_classes = max(classes) if min(classes) > 0 else 0
    if not self.num_classes and max(classes) > 0:
      warn_once(("mixture labels", tuple(specs)), "data.mixture: %s unlabeled, so the "
                "mixture is read as unlabeled", ", ".join(
                    s for s, c in zip(specs, classes) if c == 0))
    owners = {c.owner for c in components if c.owner is not None}
    if len(owners) > 1:
      raise ValueError(f"data.mixture components were built for different processes: {owners}")
    self.owner = owners.pop() if owners else None
    # The stream this mixture reads: (g, S), or None for the one global stream.
    self.stream = self.owner
    self.counts = slot_counts(weights)
    self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

  def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(component of each slot, its rank among that component's slots)."""
    cached = self._blocks.get(block)
    if cached is None:
      rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0x6D6978, block]))
      owner = rng.permutation(np.repeat(np.arange(len(self.counts)), self.counts))
      rank = np.empty(BLOCK, np.int64)
      for j in range(len(self.counts)):
        sel = owner == j
        rank[sel] = np.arange(int(sel.sum()))
      cached = (owner, rank)
      if len(self._blocks) >= 4:
        self._blocks.pop(min(self._blocks))
      self._blocks[block] = cached
    return cached

  def assign(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(component, position in that component's stream) of stream positions."""
    blocks, slots = np.divmod(positions, BLOCK)
    comp, local = np.empty_like(positions), np.empty_like(positions)
    for b in np.unique(blocks):
      sel = blocks == b
      owner, rank = self._block(int(b))
      comp[sel] = owner[slots[sel]]
      local[sel] = b * self.counts[comp[sel]] + rank[slots[sel]]
    return comp, local

  def examples_before(self, step: int, batch_size: int) -> np.ndarray:
    """Examples of each component in the global steps before ``step``."""
    end = int(step) * int(batch_size)
    full, rest = divmod(end, BLOCK)
    out = full * self.counts
    if rest:
      owner, _ = self._block(full)
      out = out + np.bincount(owner[:rest], minlength=len(self.counts))
    return out

  # -- streams (base.DataSource): the mixture of stream g mixes each owned
  # component's stream g and the shared components' positions k * S + g.

  def default_streams(self, process_count: int) -> int:
    split = any(c.regroup is not None for c in self.components)
    return process_count if split else 1

  def stream_source(self, stream: int, streams: int) -> "MixtureSource":
    want = None if streams == 1 else (int(stream), int(streams))
    if self.stream == want:
      return self
    if not any(c.regroup is not None for c in self.components):
      return super().stream_source(stream, streams)
    parts = [c.stream_source(stream, streams) if c.regroup is not None else c
             for c in self.components]
    mixed = MixtureSource(parts, self.specs, self.weights, self.seed)
    mixed.stream = want
    return mixed

  def stream_batch(self, positions: np.ndarray) -> Batch:
    comp, pos = self.assign(positions)
    images = np.zeros((len(positions), *self.image_shape), np.uint8)
    labels = np.zeros((len(positions),), np.int32)
    for j, source in enumerate(self.components):
      sel = np.flatnonzero(comp == j)
      if not len(sel):
        continue
      if source.owner is None and self.stream is not None:
        # A component every stream shares: stream g of S takes its global
        # positions k * S + g, so that no two streams read the same one.
        g, count = self.stream
        spread = pos[sel] * count + g
        idx, counters = source.stream_indices(spread), spread
      else:
        idx, counters = source.stream_positions(pos[sel])
      spatial = source.augment == "spatial"
      images[sel], labels[sel] = source._examples(idx, counters if spatial else None)  # pylint: disable=protected-access
    return {"image": images, "label": labels if self.num_classes else labels * 0}

  def train_batch(self, step: int, batch_size: int, process_index: int = 0,
                  process_count: int = 1) -> Batch:
    local_batch_size(batch_size, process_count)
    return self.streamed_batch(step, batch_size, process_index, process_count)

  def log_counts(self, step: int, batch_size: int) -> None:
    streams = self.__dict__.get("_streams") or 1
    per_stream = batch_size // streams
    counts = self.examples_before(step, per_stream)
    total = max(int(counts.sum()), 1)
    logging.info("data.mixture at step %d: %s", step, ", ".join(
        f"{spec} {int(n)} ({100 * n / total:.1f}%)" for spec, n in zip(self.specs, counts)))

  def train_iterator(self, batch_size: int, *, start_step: int = 0, process_index: int = 0,
                     process_count: int = 1, num_workers: int = 0, state: dict | None = None):
    local_batch_size(batch_size, process_count)
    check_process(process_index, process_count)
    pipeline.check_state(state, start_step)
    streams = self.resumed_streams(state, process_count)
    self.use_streams(streams, batch_size, process_index, process_count)
    self.log_counts(start_step, batch_size)
    return _LoggedCounts(self, pipeline.StepIterator(
        CallAt(self, "train_batch", batch_size, process_index, process_count),
        start_step=start_step, num_workers=pipeline.resolve_num_workers(num_workers),
        state=stream_state(streams)), batch_size)

  def eval_batches(self, batch_size: int, process_index: int = 0, process_count: int = 1,
                   num_workers: int = 0) -> Iterator[Batch]:
    for source in self.components:
      for batch in source.eval_batches(batch_size, process_index, process_count, num_workers):
        if not self.num_classes:
          batch = {**batch, "label": batch["label"] * 0}
        yield batch


class _LoggedCounts:
  """A StepIterator that logs the mixture's counts every LOG_EVERY steps."""

  def __init__(self, source: MixtureSource, it: pipeline.StepIterator, batch_size: int):
    self._source, self._it, self._batch_size = source, it, batch_size

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = next(self._it)
    step = self._it.get_state()["next_step"]
    if step % LOG_EVERY == 0:
      self._source.log_counts(step, self._batch_size)
    return batch

  def get_state(self) -> dict:
    return self._it.get_state()

  def set_state(self, state: dict) -> None:
    self._it.set_state(state)

  def close(self) -> None:
    self._it.close()


def build(config: Any, *, split: str, seed: int, build_source, names) -> MixtureSource:
  """The mixture of ``data.mixture``; ``build_source`` and ``names`` are the
  registry's (which calls this)."""
  pairs = parse(cfg_get(config, "mixture", None))
  components = [build_source(component_config(config, spec, names), split=split, seed=seed)
                for spec, _ in pairs]
  return MixtureSource(components, [s for s, _ in pairs], [w for _, w in pairs], seed)
