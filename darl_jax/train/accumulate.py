"""Gradient accumulation: one optimizer update from several microbatches.

The recipe's global batch (the paper's 4096) is a property of the
experiment; ``microbatch_size`` says how many of its examples the devices
hold at once. The train step (step.make_train_step) then runs its
microbatches in a ``lax.scan`` inside the one jitted step, sums their
gradients in float32 and applies one update, so the learning rate, its
schedule, weight decay and the EMA see the recipe's batch.

What makes the accumulated step the one-shot step on the same batch:

* **Layout.** Microbatch ``i`` takes rows ``[i * b_d, (i + 1) * b_d)`` of
  every device's own slice of the batch (``b_d`` = microbatch rows per
  device), so each microbatch is split over ``data x fsdp`` exactly like the
  batch: splitting moves no data between devices (:func:`split`).
* **Randomness.** Per-example draws (diffusion levels and noise, prefix
  lengths, random orders) and mixing across examples (mixup) are made once,
  on the whole batch, by ``Trainer.prepare_batch`` before the split, and are
  sliced with it; a microbatch sees exactly the rows and draws it would see
  in the one-shot step. Dropout and drop path are drawn inside the model
  from the microbatch's key (``fold_in(step_key, i)``): the same
  distribution, but not the one-shot step's masks (drawing them at batch
  size would put accumulation machinery into the model code).
* **Weights.** A loss that is a weighted mean (prefix-causal pretraining
  scores only the patches after the prefix) is exact only if each
  microbatch counts by its weight: a trainer's metrics may carry
  ``METRIC_WEIGHTS``, ``{name: weight}`` (the denominator of that mean), and
  the step combines loss, gradients and those metrics as
  ``sum_i w_i v_i / sum_i w_i``. Metrics without a weight are plain means
  over the (equal-sized) microbatches; the gradient norm is the
  accumulated gradient's.
* **Model state.** Non-trained collections (the probes' BatchNorm
  statistics) are updated by each microbatch from the step's incoming
  state and averaged: every microbatch normalises with its own statistics
  (ghost batch norm over ``microbatch_size`` examples), and the running
  mean moves by the mean of the microbatch means, which is the batch's mean.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from darl_jax import config_lib
from darl_jax import fp8

# The key of a trainer's metrics dict that holds ``{metric: weight}``.
METRIC_WEIGHTS = "metric_weights"


def num_microbatches(batch_size: int, microbatch_size: int, batch_shards: int) -> int:
  """How many microbatches of ``microbatch_size`` make ``batch_size``
  (0 or ``batch_size``: one, no accumulation). Both must split evenly over
  the ``batch_shards`` (data x fsdp) devices."""
  if microbatch_size in (0, batch_size):
    return 1
  if microbatch_size < 0:
    raise ValueError("microbatch_size=-1 (automatic) is resolved by the loop "
                     "(choose_microbatch) before the step is built")
  if microbatch_size > batch_size or batch_size % microbatch_size:
    raise config_lib.ConfigError(
        f"config.microbatch_size {microbatch_size} must divide batch_size {batch_size}: "
        f"set --config.microbatch_size to one of {', '.join(map(str, candidates(batch_size, batch_shards)[:8]))}")
  if microbatch_size % batch_shards:
    raise config_lib.ConfigError(
        f"config.microbatch_size {microbatch_size} must split over the data x fsdp "
        f"devices ({batch_shards}): set --config.microbatch_size to one of "
        f"{', '.join(map(str, candidates(batch_size, batch_shards)[:8]))}")
  return batch_size // microbatch_size


def candidates(batch_size: int, batch_shards: int) -> list[int]:
  """The valid microbatch sizes of ``batch_size``, largest first: the
  divisors that are multiples of ``batch_shards``."""
  return [b for b in range(batch_size, 0, -1)
          if batch_size % b == 0 and b % batch_shards == 0]


def split(tree: Any, num: int, batch_shards: int, spec=None) -> Any:
  """Every ``[B, ...]`` leaf of ``tree`` as ``[num, B / num, ...]``, where
  microbatch ``i`` holds rows ``[i * r, (i + 1) * r)`` of each of the
  ``batch_shards`` contiguous device slices (``r = B / (batch_shards *
  num)``): a per-device reshape, no communication. ``spec``: the
  PartitionSpec of a microbatch (the batch's), pinned on the result so the
  compiler keeps that layout (None on one device)."""

  def one(x):
    b = x.shape[0]
    x = x.reshape((batch_shards, num, b // (batch_shards * num)) + x.shape[1:])
    x = jnp.swapaxes(x, 0, 1).reshape((num, b // num) + x.shape[3:])
    if spec is not None:
      x = jax.lax.with_sharding_constraint(
          x, jax.sharding.PartitionSpec(None, *spec))
    return x

  return jax.tree_util.tree_map(one, tree)


def pop_weights(metrics: dict) -> tuple[dict, dict]:
  """``(metrics without METRIC_WEIGHTS, {name: weight})``."""
  metrics = dict(metrics)
  return metrics, dict(metrics.pop(METRIC_WEIGHTS, None) or {})


def weighted_mean(values: jax.Array, weights: jax.Array | None) -> jax.Array:
  """``sum_i w_i v_i / sum_i w_i`` over axis 0 (a value of weight 0, e.g.
  the NaN of an empty gamma bin, counts for nothing; NaN if every weight is
  0); the plain mean for ``weights=None``."""
  if weights is None:
    return jnp.mean(values, 0)
  weights = weights.astype(jnp.float32)
  total = jnp.sum(weights, 0)
  summed = jnp.sum(jnp.where(weights > 0, values * weights, 0.0), 0)
  return jnp.where(total > 0, summed / jnp.maximum(total, 1e-30), jnp.nan)


def accumulate(grad_fn: Callable, params: Any, microbatches: Any, keys: jax.Array,
               histories: Any = None):
  """Runs ``grad_fn(params, histories, microbatch, key) -> ((loss, (metrics,
  model_state)), (grads, records))`` over the leading axis of
  ``microbatches`` and ``keys`` in a scan (``histories``: fp8's, or None).

  Returns ``(loss, metrics, model_state, grads, records)`` of the whole
  batch: loss and gradients weighted by the metrics'
  ``METRIC_WEIGHTS["loss"]`` (1 if absent), the other scalar metrics by
  their own weights, the model state averaged (see the module docstring),
  the fp8 records (largest magnitudes) combined by their maximum
  (fp8.combined_records). Gradients are summed in float32 and returned in
  the parameters' dtypes.
  """

  def body(grad_sum, xs):
    microbatch, key = xs
    (loss, (metrics, model_state)), (grads, records) = grad_fn(
        params, histories, microbatch, key)
    metrics, weights = pop_weights(metrics)
    w = jnp.asarray(weights.get("loss", 1.0), jnp.float32)
    grad_sum = jax.tree_util.tree_map(lambda s, g: s + w * g.astype(jnp.float32),
                                      grad_sum, grads)
    scalars = {k: v for k, v in metrics.items() if jnp.ndim(v) == 0}
    weights = {k: jnp.asarray(weights.get(k, 1.0), jnp.float32) for k in scalars}
    return grad_sum, (loss, w, scalars, weights, model_state, records)

  zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  grad_sum, (losses, loss_w, scalars, weights, states, records) = jax.lax.scan(
      body, zeros, (microbatches, keys))
  total = jnp.sum(loss_w)
  grads = jax.tree_util.tree_map(lambda s, p: (s / total).astype(p.dtype), grad_sum, params)
  loss = jnp.sum(losses * loss_w) / total
  metrics = {k: weighted_mean(v, weights[k]) for k, v in scalars.items()}
  model_state = jax.tree_util.tree_map(
      lambda x: jnp.mean(x, 0).astype(x.dtype)
      if jnp.issubdtype(x.dtype, jnp.floating) else x[-1], states)
  return loss, metrics, model_state, grads, fp8.combined_records(records)
