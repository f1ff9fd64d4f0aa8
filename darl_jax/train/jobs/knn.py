"""k-nearest-neighbour classification of frozen features, per block (DINO's evaluator).

    frozen backbone (the linear probe's pass: backbone_lib.PooledBlocks)
      -> pooled features of every chosen (pooling, block), L2-normalised
      -> cosine similarity of each test image to every training image
      -> its k most similar training images vote for their labels,
         each with weight exp(similarity / T)
      -> the class of the largest vote

The protocol of DINO (Caron et al., 2021) and DINOv2's evaluation suite:
cosine similarity, temperature T = 0.07, k in {10, 20, 100, 200}, all in one
pass (the k = 200 neighbours are kept and every smaller k reads their
prefix). Nothing is trained: the number says how well the frozen features
separate the classes without any fitted read-out, and one run gives it for
every block (next-patch models keep their best features in middle blocks).

Memory. A test image needs every training image's similarity, but not all
at once: the running top-k of every test image is kept on the device
(``Neighbours``: similarities and labels, ``[M, H, k]``) and each batch of
training images, straight out of the frozen pass, is merged into it and
dropped. The training features are never held: at ImageNet size they would
be 1.28M x 1280 x 4 bytes = 6.6 GB per block (210 GB for ViT-H/14's 32
blocks). What is held is the test features ``[M, H, D]`` (50k x 32 x 1280 x
4 bytes = 8.2 GB) and the neighbours ``[M, H, 200]`` (2.6 GB), both split
over the devices by test row, plus one merge's similarities, bounded by
``knn.test_chunk_size`` (``[t, H, batch]``: 1024 x 32 x 1024 x 4 bytes =
134 MB). docs/PROBES.md gives the figures.

Ties. Equal similarities are ordered by the training image's position in
the stream (the training split's deterministic, unaugmented pass: batch by
batch, row by row), the earlier first: ``lax.top_k`` keeps the lower index
of equal values first, and each merge puts the neighbours so far (all from
earlier positions, already in that order) before the new batch. Equal votes
go to the lower class index (``argmax``). The votes are sums over the
neighbour axis (a reduction, no scatter), so they do not depend on the
order of atomic additions. With these rules the result is one function of
the features (tests/test_knn.py compares it with a brute-force NumPy kNN).

Similarities are computed at full float32 precision
(``Precision.HIGHEST``): the GPU's default TF32 products would reorder
near neighbours.

Dispatch. The host runs at most one training batch ahead of the devices:
each merge is dispatched once the previous one has finished
(``Scorer.add``), as the train loop keeps at most two steps in flight.
Nothing else in the pass waits for the devices, and unbounded the host
can queue a device's 32nd unfinished program, which on a CPU mesh
deadlocks: XLA's CPU client runs a multi-device program's shares on a
pool of max(cores, devices) threads, a launch blocks one of those threads
while its device has 32 programs in flight, and the merge's all-gather
holds another until every device's share has arrived. With 2 cores and 2
devices no thread is left for the other share, and XLA aborts the process
after 40 s (``Termination timeout ... all gather``, SIGABRT); it happened
when a device fell behind the host on a busy machine. The wait costs no
overlap: while the host reads the next batch, the devices compute this
batch's features and merge.

``k`` larger than the training set (or than a class) needs nothing special:
the neighbour list is filled with empty entries (similarity -inf, label -1)
that carry no vote.

The job (``config.trainer = "knn"``, ``run``): restores the backbone of
``init_from`` (random with ``init_from=""``: the baseline), scores the eval
split against the training split, and writes ``knn_accuracy.json`` (and
``knn_accuracy.png``) in the workdir and one metrics.jsonl record:
``val_accuracy_block_XX`` at ``knn.report_k`` with the first pooling (what
the study tables' best-block column reads), ``val_accuracy`` the last
chosen block's, and every (pooling, k, block) as
``val_knn_accuracy_<pooling>_k<k>_block_XX``.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from darl_jax import config_lib
from darl_jax import data as data_lib
from darl_jax import files
from darl_jax import mesh_axes
from darl_jax import sharding as sharding_lib
from darl_jax.models import vit as vit_lib
from darl_jax.train import trainer as trainer_lib
from darl_jax.train import step as step_lib
from darl_jax.train import setup as setup_lib
from darl_jax.train import feed as feed_lib
from darl_jax.train import fit
from darl_jax.train import probe_grid
from darl_jax.train import backbone as backbone_lib

KS = (10, 20, 100, 200)
TEMPERATURE = 0.07
# The prediction's one-hot votes are built for this many (row, neighbour,
# class) entries at a time at most (1 GiB of float32).
VOTE_ENTRIES = 2 ** 28


def knn_config() -> ml_collections.ConfigDict:
  """``base_config`` plus the kNN keys (DINO's protocol) and the backbone to read.

  ``knn.blocks``: block indices (negative from the end), () = every block;
  ``knn.poolings``: as the linear probe's (``mean`` over the patch tokens,
  ``last`` patch token); ``knn.report_k``: the k of the headline
  (``val_accuracy_block_XX``; DINO reports 20-NN); ``knn.test_chunk_size``:
  test rows per device compared with a training batch at once;
  ``knn.num_train_examples``: the first n training images (0: all).
  ``batch_size`` (or ``eval_batch_size``) is the frozen pass's batch: the
  training images merged at once. ``eval_max_batches`` limits the test set
  as in every evaluation (0: the whole eval split).
  """
  c = config_lib.base_config()
  c.trainer = "knn"
  del c["optim"]                 # nothing is trained
  c.total_epochs = 0.0           # (what the studies' --list counts as training)
  c.init_from = ""               # pretraining workdir / checkpoint; "" = random backbone
  c.init_step = -1
  c.model.update(causal=True, drop_path=0.0)
  c.batch_size = 1024
  c.knn = ml_collections.ConfigDict({
      "ks": KS, "temperature": TEMPERATURE, "report_k": 20, "blocks": (),
      "poolings": ("mean",), "test_chunk_size": 1024, "num_train_examples": 0})
  return c


def check_config(config) -> None:
  """The kNN keys no run can use fail here, each naming a value that works."""
  cfg = config.knn
  ks = tuple(cfg.ks)
  if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks) \
      or len(set(ks)) != len(ks):
    raise config_lib.ConfigError(f"knn.ks must be distinct positive integers, got {ks!r}: "
                                 "set --config.knn.ks='(10,20,100,200)'")
  if cfg.report_k not in ks:
    raise config_lib.ConfigError(f"knn.report_k={cfg.report_k!r} is not one of knn.ks "
                                 f"{ks!r}: set --config.knn.report_k={ks[0]}")
  t = cfg.temperature
  if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
    raise config_lib.ConfigError(f"knn.temperature must be a positive number, got {t!r}: "
                                 f"set --config.knn.temperature={TEMPERATURE}")
  for key, low in (("test_chunk_size", 1), ("num_train_examples", 0)):
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
      raise config_lib.ConfigError(f"knn.{key} must be an integer >= {low}, got {v!r}: set "
                                   f"--config.knn.{key}={knn_config().knn[key]}")
  probe_grid.check_poolings(cfg.poolings)


def chosen_blocks(blocks, depth: int) -> tuple[int, ...]:
  """``knn.blocks`` as block indices in [0, depth): () = every block."""
  if not tuple(blocks):
    return tuple(range(depth))
  try:
    names = backbone_lib.resolve_blocks(tuple(blocks), depth)
  except ValueError as e:
    raise config_lib.ConfigError(str(e).replace("probe.blocks", "knn.blocks")) from None
  return tuple(int(n.split("_")[1]) for n in names)


# ------------------------------------------------------------ the classifier


def l2_normalize(x):
  """``x / max(||x||, 1e-12)`` over the last axis, float32 (a zero vector stays 0)."""
  x = x.astype(jnp.float32)
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


class Neighbours(NamedTuple):
  """The running top-k of every test row and head, most similar first:
  ``sims [M, H, k]`` float32 and ``labels [M, H, k]`` int32; empty entries
  are (-inf, -1)."""
  sims: jax.Array
  labels: jax.Array


def empty_neighbours(num_test: int, num_heads: int, k: int) -> Neighbours:
  return Neighbours(jnp.full((num_test, num_heads, k), -jnp.inf, jnp.float32),
                    jnp.full((num_test, num_heads, k), -1, jnp.int32))


def merge(nb: Neighbours, test, train, train_labels, train_valid, chunk: int) -> Neighbours:
  """``nb`` with the training rows ``train [C, H, D]`` (labels ``[C]``, rows
  with ``train_valid`` False left out) merged in: per test row ``test [M, H,
  D]`` and head, the k most similar of the neighbours so far and these rows.
  Features are L2-normalised; ``M`` is a multiple of ``chunk``, the test
  rows compared at once. Ties: the neighbours so far, then the rows in order
  (module docstring)."""
  m, h, k = nb.sims.shape
  labels = jnp.where(train_valid, train_labels.astype(jnp.int32), -1)

  def one(args):
    q, sims, lab = args                                   # [t, H, D], [t, H, k] x 2
    s = jnp.einsum("thd,chd->thc", q, train, precision=jax.lax.Precision.HIGHEST)
    s = jnp.where(train_valid, s, -jnp.inf)
    all_s = jnp.concatenate([sims, s], axis=-1)
    all_l = jnp.concatenate([lab, jnp.broadcast_to(labels, s.shape)], axis=-1)
    top, idx = jax.lax.top_k(all_s, k)
    return top, jnp.take_along_axis(all_l, idx, axis=-1)

  split = lambda a: a.reshape((m // chunk, chunk) + a.shape[1:])
  sims, labs = jax.lax.map(one, (split(test), split(nb.sims), split(nb.labels)))
  return Neighbours(sims.reshape(m, h, k), labs.reshape(m, h, k))


def predict(nb: Neighbours, ks, num_classes: int, temperature: float):
  """``[len(ks), M, H]`` int32: per k, the class of the largest vote of the
  first k neighbours, each weighted ``exp(sim / temperature)`` (empty
  entries weigh 0; equal votes: the lower class)."""
  m, h, kmax = nb.sims.shape
  if max(ks) > kmax:
    raise ValueError(f"k={max(ks)} but only {kmax} neighbours are kept")
  rows = m * h
  # Rows per step so that the one-hot votes stay within VOTE_ENTRIES.
  step = max(1, min(rows, VOTE_ENTRIES // (kmax * num_classes)))
  pad = -rows % step
  sims = jnp.pad(nb.sims.reshape(rows, kmax), ((0, pad), (0, 0)), constant_values=-jnp.inf)
  labs = jnp.pad(nb.labels.reshape(rows, kmax), ((0, pad), (0, 0)), constant_values=-1)
  classes = jnp.arange(num_classes, dtype=jnp.int32)

  def one(args):
    s, lab = args                                         # [step, kmax]
    w = jnp.where(lab >= 0, jnp.exp(s / jnp.float32(temperature)), 0.0)
    hits = lab[:, :, None] == classes                     # [step, kmax, C]
    out = []
    for k in ks:
      votes = jnp.sum(jnp.where(hits[:, :k], w[:, :k, None], 0.0), axis=1)
      out.append(jnp.argmax(votes, axis=-1).astype(jnp.int32))
    return jnp.stack(out)                                 # [len(ks), step]

  n = (rows + pad) // step
  preds = jax.lax.map(one, (sims.reshape(n, step, kmax), labs.reshape(n, step, kmax)))
  preds = jnp.moveaxis(preds, 0, 1).reshape(len(ks), rows + pad)[:, :rows]
  return preds.reshape(len(ks), m, h)


def knn_predict(test, train, train_labels, num_classes: int, ks=KS,
                temperature: float = TEMPERATURE, train_chunk: int = 0,
                test_chunk: int = 0):
  """The whole classifier on in-memory features (for tests and small sets):
  ``test [M, H, D]``, ``train [N, H, D]`` (normalised here) ->
  ``[len(ks), M, H]`` predictions. ``train_chunk``/``test_chunk``: rows
  merged / compared at once (0: all), as the job streams them."""
  test, train = l2_normalize(jnp.asarray(test)), l2_normalize(jnp.asarray(train))
  train_labels = jnp.asarray(train_labels, jnp.int32)
  m, n = test.shape[0], train.shape[0]
  tq = test_chunk or m
  test = jnp.pad(test, ((0, -m % tq), (0, 0), (0, 0)))
  nb = empty_neighbours(test.shape[0], test.shape[1], max(ks))
  tc = train_chunk or n
  step = jax.jit(merge, static_argnames="chunk")
  for start in range(0, n, tc):
    rows = jnp.arange(start, start + tc)
    valid = rows < n
    take = jnp.minimum(rows, n - 1)
    nb = step(nb, test, train[take], train_labels[take], valid, chunk=tq)
  return predict(nb, tuple(ks), num_classes, temperature)[:, :m]


# -------------------------------------------------------------------- the job


class Scorer:
  """The kNN of one backbone on a mesh: test rows split over the batch
  axes (each device keeps the neighbours of its own test rows), every
  training batch replicated to all of them."""

  def __init__(self, mesh, test_feats: np.ndarray, ks, chunk: int):
    self.mesh, self.ks = mesh, tuple(ks)
    shards = sharding_lib.batch_shards(mesh)
    m = test_feats.shape[0]
    per_device = max(1, -(-m // shards))
    self.chunk = min(chunk, per_device)
    local = -(-per_device // self.chunk) * self.chunk
    self.num_test = m
    padded = np.zeros((local * shards,) + test_feats.shape[1:], np.float32)
    padded[:m] = test_feats
    self.rows = NamedSharding(mesh, P(mesh_axes.BATCH_AXES))
    self.test = jax.make_array_from_callback(padded.shape, self.rows, lambda i: padded[i])
    h = test_feats.shape[1]
    self.nb = jax.jit(lambda: empty_neighbours(padded.shape[0], h, max(self.ks)),
                      out_shardings=Neighbours(self.rows, self.rows))()
    spec, rep = P(mesh_axes.BATCH_AXES), P()
    self._merge = jax.jit(jax.shard_map(
        lambda nb, q, x, y, v: merge(nb, q, x, y, v, self.chunk), mesh=mesh,
        in_specs=(Neighbours(spec, spec), spec, rep, rep, rep),
        out_specs=Neighbours(spec, spec)), donate_argnums=0)

  def add(self, train_feats, train_labels, train_valid) -> None:
    """Merges one training batch (``[B, H, D]`` normalised features, labels,
    validity; global arrays), once the previous merge has finished (module
    docstring, Dispatch)."""
    jax.block_until_ready(self.nb)
    self.nb = self._merge(self.nb, self.test, train_feats, train_labels, train_valid)

  def predictions(self, num_classes: int, temperature: float) -> np.ndarray:
    """``[len(ks), M, H]`` on every process."""
    spec = P(None, mesh_axes.BATCH_AXES)
    fn = jax.jit(jax.shard_map(lambda nb: predict(nb, self.ks, num_classes, temperature),
                               mesh=self.mesh, in_specs=(Neighbours(P(mesh_axes.BATCH_AXES),
                                                                    P(mesh_axes.BATCH_AXES)),),
                               out_specs=spec))
    preds = multihost_utils.process_allgather(fn(self.nb), tiled=True)
    return np.asarray(preds)[:, :self.num_test]


def features_fn(model, heads: np.ndarray):
  """``(params, images) -> [B, H, D]``: the chosen heads of the linear probe's
  frozen pass (``PooledBlocks``' ``[P * depth, B, D]``), L2-normalised."""
  def fn(params, images):
    pooled = model.apply({"params": params}, images)
    return l2_normalize(jnp.moveaxis(pooled[heads], 0, 1))
  return fn


def run(config, workdir: str) -> dict:
  """The ``knn`` job (module docstring); returns the metrics it logged."""
  config_lib.validate(config)
  check_config(config)
  cfg = config.knn
  with setup_lib.job(config, workdir, config.model.get("dtype", "float32")) as (
      workdir, writer, is_main):
    mesh = sharding_lib.make_mesh(config.mesh)
    train_source = data_lib.build_source(config.data, split=config.data.train_split,
                                         seed=config.seed)
    eval_source = data_lib.build_source(config.data, split=config.data.eval_split,
                                        seed=config.seed)
    trainer_lib.check_image_shape(config, train_source)
    num_classes = train_source.num_classes
    if num_classes <= 1:
      raise ValueError(f"{config.data.name} has no class labels; a kNN classifier needs labels")
    data_lib.check_labels(eval_source, num_classes, config.data.eval_split)
    backbone, patch = vit_lib.vit_from_config(config.model)
    poolings = tuple(cfg.poolings)
    blocks = chosen_blocks(cfg.blocks, backbone.depth)
    model = backbone_lib.PooledBlocks(backbone=backbone, patch_size=patch, poolings=poolings)
    heads = np.array([p * backbone.depth + b for p in range(len(poolings)) for b in blocks])
    h, w, c = train_source.image_shape
    params = model.init(jax.random.PRNGKey(config.seed), jnp.zeros((1, h, w, c)))["params"]
    ctx = trainer_lib.Context(config, workdir, mesh, train_source, eval_source, writer, 0)
    params = backbone_lib.restore_backbone(ctx, config, params)
    writer.start(None, config.to_dict())
    # Replicated: a frozen forward pass keeps no optimizer state, and ViT-H/14's
    # 632M float32 parameters are 2.5 GB. (Through the host, so that a random
    # backbone's arrays, made on one device, reach every process's devices.)
    params = jax.device_put(jax.device_get(params), NamedSharding(mesh, P()))
    feats = jax.jit(features_fn(model, heads))
    resolved = fit.resolve(config)
    batch = resolved.eval_batch
    rows = sharding_lib.batch_sharding(mesh)
    started = time.time()

    # Batches of batch_size, as every evaluation counts them (step_lib.eval_cap).
    max_test = config.eval_max_batches * config.batch_size
    test_x, test_y = backbone_lib.collect_features(feats, params, eval_source, batch,
                                                   max_test, rows)
    scorer = Scorer(mesh, np.asarray(test_x, np.float32), cfg.ks, cfg.test_chunk_size)
    num_train = stream_train(scorer, feats, params, train_source, batch, rows,
                             cfg.num_train_examples, resolved.num_workers)
    preds = scorer.predictions(num_classes, float(cfg.temperature))
    acc = (preds == np.asarray(test_y)[None, :, None]).mean(1)          # [len(ks), H]
    logging.info("kNN of %d test against %d training images in %.0f s", len(test_y),
                 num_train, time.time() - started)
    report = knn_report(acc, tuple(cfg.ks), poolings, blocks, backbone.depth, cfg.report_k)
    report.update(temperature=float(cfg.temperature), num_train=num_train,
                  num_test=int(len(test_y)), num_classes=int(num_classes),
                  init_from=str(config.get("init_from", "")))
    metrics = knn_metrics(report)
    writer.write_scalars(0, metrics)
    if is_main:
      files.write_json_atomic(workdir / "knn_accuracy.json", report, indent=1)
      plot_knn_accuracy(report, str(workdir / "knn_accuracy.png"))
    logging.info("kNN (k=%d): best %s %.4f", cfg.report_k, report["best_block"],
                 report["best_accuracy"])
    return metrics


def stream_train(scorer: Scorer, feats, params, source, batch_size: int, sharding,
                 max_examples: int, num_workers: int) -> int:
  """Merges the training split's features, batch by batch, into ``scorer``;
  the first ``max_examples`` images (0: all). Returns how many were used."""
  seen = 0
  for batch in source.eval_batches(batch_size, jax.process_index(), jax.process_count(),
                                   num_workers):
    g = feed_lib.to_global(batch, sharding)
    valid = g["mask"]
    if max_examples:
      position = jnp.arange(seen, seen + valid.shape[0])
      valid = jnp.logical_and(valid, position < max_examples)
    x = feats(params, feed_lib.model_input(g)["image"])
    scorer.add(x, g["label"], valid)
    seen += valid.shape[0]
    if max_examples and seen >= max_examples:
      break
  return min(max_examples or source.num_examples, source.num_examples)


def knn_report(accuracy: np.ndarray, ks, poolings, blocks, depth: int, report_k: int) -> dict:
  """``accuracy [len(ks), len(poolings) * len(blocks)]`` -> the report: the
  headline curve (``report_k``, first pooling) with its best block, and
  every (pooling, k, block)."""
  names = [f"block_{b:02d}" for b in blocks]
  at = lambda ki, pi, bi: float(accuracy[ki, pi * len(blocks) + bi])
  head = [at(ks.index(report_k), 0, i) for i in range(len(blocks))]
  best = int(np.argmax(head))                      # the first of equal blocks
  return {"ks": list(ks), "report_k": report_k, "pooling": poolings[0],
          "poolings": list(poolings), "blocks": names, "accuracy": head,
          "normalized_depth": [(b + 1) / depth for b in blocks],
          "best_block": names[best], "best_block_index": int(blocks[best]),
          "best_accuracy": head[best],
          "grid": [{"block": names[bi], "pooling": p, "k": k, "accuracy": at(ki, pi, bi)}
                   for pi, p in enumerate(poolings) for ki, k in enumerate(ks)
                   for bi in range(len(blocks))]}


def knn_metrics(report: dict) -> dict:
  """metrics.jsonl's record (module docstring)."""
  out = {f"val_accuracy_{b}": a for b, a in zip(report["blocks"], report["accuracy"])}
  out["val_accuracy"] = report["accuracy"][-1]
  for row in report["grid"]:
    out[f"val_knn_accuracy_{row['pooling']}_k{row['k']}_{row['block']}"] = row["accuracy"]
  return out


def plot_knn_accuracy(report: dict, path: str) -> None:
  """Accuracy against normalised depth, one line per (pooling, k)."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  fig, ax = plt.subplots(figsize=(4.5, 3.2), dpi=120)
  depth = dict(zip(report["blocks"], report["normalized_depth"]))
  for pooling in report["poolings"]:
    for k in report["ks"]:
      rows = [r for r in report["grid"] if r["pooling"] == pooling and r["k"] == k]
      ax.plot([depth[r["block"]] for r in rows], [100 * r["accuracy"] for r in rows],
              "o-" if k == report["report_k"] else ".-", ms=3,
              lw=1.6 if k == report["report_k"] else 0.8, label=f"{pooling}, k={k}")
  ax.set_xlabel("normalised depth (block / depth)")
  ax.set_ylabel("kNN top-1 (%)")
  ax.set_xlim(0, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=6)
  ax.set_title(f"k={report['report_k']}, best: {report['best_block']} "
               f"({100 * report['best_accuracy']:.1f}%)")
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
