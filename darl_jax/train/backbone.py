"""What the trainers and jobs on a frozen or restored backbone share.

Restoring a backbone from a pretraining run (``restore_backbone``,
``load_pretrain_config``, ``check_params``), building a labelled split's
source (``build_source``), the frozen backbone's per-block patch tokens
and their pooled grid (``frozen_patch_tokens``, ``PooledBlocks``,
``resolve_blocks``) and collecting frozen features over a split
(``collect_features``, ``darl_pooled_features``). Kept apart so that no
trainer or job imports another for them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import linen as nn
from jax.experimental import multihost_utils

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import data as data_lib
from darl_jax import ema as ema_lib
from darl_jax import patches as patches_lib
from darl_jax.data.transforms import randaugment
from darl_jax.models import vit as vit_lib
from darl_jax.train import feed as feed_lib
from darl_jax.train import transfer


def build_source(config, split: str, *, train: bool):
  """The split's source from the data registry (VTAB tasks too: ``data.name="vtab"``);
  RandAugment on the training split when ``config.randaugment.num_ops``."""
  source = data_lib.build_source(config.data, split=split, seed=config.seed)
  ra = config.get("randaugment")
  if train and ra is not None and ra.num_ops > 0:
    source = randaugment.RandAugmentSource(
        source, seed=config.seed, num_ops=ra.num_ops, magnitude=ra.magnitude,
        magnitude_std=ra.magnitude_std, prob=ra.prob)
  return source


def restore_backbone(ctx, config, params):
  """``params`` with the backbone of ``config.init_from`` swapped in (if set);
  writes ``init_report.json`` (loaded / dropped / newly initialised)."""
  init_from = config.get("init_from", "")
  if not init_from:
    logging.info("init_from is empty: the backbone starts from random initialisation")
    return params
  step = config.get("init_step", -1)
  try:
    merged, report = transfer.restore_into(params, init_from,
                                           step=None if step is None or step < 0 else step,
                                           model_config=config.get("model"),
                                           use_ema=config.get("use_ema", None))
  except ema_lib.MissingEmaError as e:
    raise ema_lib.MissingEmaError(
        f"{e}: leave out --config.use_ema to load its parameters") from None
  transfer.write_report(ctx.workdir, report)
  return merged


def block_names(depth: int) -> tuple[str, ...]:
  return tuple(f"block_{i:02d}" for i in range(depth))


def frozen_patch_tokens(backbone: vit_lib.ViT, patch_size: int, images) -> dict:
  """The frozen backbone's outputs at the patch tokens: ``{block_XX, features:
  [B, N, D]}`` float32, gradient-stopped.

  Runs ``backbone`` (called from a compact module, so its parameters sit
  under that module's ``backbone``) on ``[SOS, x_0 .. x_{N-1}]`` in raster
  order, every patch an input, with no drop path; the SOS output is left
  out. The probes of linear_probe.py and attentive_probe.py read it.
  """
  grid_hw = (images.shape[1] // patch_size, images.shape[2] // patch_size)
  x = patches_lib.patchify(images, patch_size).astype(backbone.dtype)
  n = x.shape[1]
  rows, cols = np.divmod(np.arange(n), grid_hw[1])
  out = backbone(x, rows[None], cols[None], np.arange(1, n + 1)[None], grid_hw,
                 prepend_sos=True, train=False)   # frozen: no drop path, ever
  return {k: jax.lax.stop_gradient(v[:, 1:].astype(jnp.float32)) for k, v in out.items()}


class PooledBlocks(nn.Module):
  """The probe grid's input: frozen backbone -> ``[H, B, D]``, the pooled patch
  tokens of every (pooling, block), pooling-major (``head_names``' order).
  ``mean``: over the patch tokens; ``last``: the last patch token, the one
  that has seen every patch under the causal mask."""
  backbone: vit_lib.ViT
  patch_size: int
  poolings: tuple[str, ...]

  @nn.compact
  def __call__(self, images, *, train: bool = False):
    del train                       # frozen: the heads' BatchNorm lives in the grid
    out = frozen_patch_tokens(self.backbone, self.patch_size, images)
    pool = {"mean": lambda t: t.mean(1), "last": lambda t: t[:, -1]}
    return jnp.stack([pool[p](out[k]) for p in self.poolings
                      for k in block_names(self.backbone.depth)])


def collect_features(features_fn, params, source, batch_size: int, max_examples: int,
                     sharding) -> tuple[np.ndarray, np.ndarray]:
  """Unaugmented features ``[n, D]`` and labels ``[n]`` of the first ``max_examples``
  examples of ``source`` (0 = all), gathered on every process."""
  feats, labels, have = [], [], 0
  for batch in source.eval_batches(batch_size, jax.process_index(), jax.process_count()):
    g = feed_lib.to_global(batch, sharding)
    f, lab, mask = multihost_utils.process_allgather(
        (features_fn(params, feed_lib.model_input(g)["image"]), g["label"], g["mask"]), tiled=True)
    mask = np.asarray(mask, bool)
    feats.append(np.asarray(f)[mask])
    labels.append(np.asarray(lab)[mask])
    have += int(mask.sum())
    if max_examples and have >= max_examples:
      break
  n = max_examples or have
  return np.concatenate(feats)[:n], np.concatenate(labels)[:n]


def darl_pooled_features(model, params, images, name: str = "features"):
  """Mean over the patch positions of a DARL model's output ``name``
  (``features``: the final, normalised one; ``block_XX``: a block's): ``[B, D]``.

  ``DARL.encode`` runs the backbone on ``[SOS, x_0 .. x_{N-2}]`` as in
  pretraining; the SOS output is left out of the mean.
  """
  from darl_jax.models import darl as darl_lib
  _, out = model.apply({"params": params}, images, train=False,
                       method=darl_lib.DARL.encode)
  if name not in out:
    raise ValueError(f"the model has no output {name!r}; valid: {', '.join(sorted(out))}")
  return out[name][:, 1:].astype(jnp.float32).mean(1)


def resolve_blocks(blocks, depth: int) -> tuple[str, ...]:
  """Block indices (negative from the end) -> ``block_XX`` names, in the
  given order; an index out of range or a repeated block is a ValueError."""
  names = []
  for i in blocks:
    if isinstance(i, bool) or not isinstance(i, int) or not -depth <= i < depth:
      raise ValueError(f"probe.blocks holds {i!r}; the backbone has {depth} blocks: use "
                       f"indices in [{-depth}, {depth - 1}], e.g. --config.probe.blocks=(-1,)")
    names.append(f"block_{i % depth:02d}")
  if not names or len(set(names)) != len(names):
    raise ValueError(f"probe.blocks must name distinct blocks, got {tuple(blocks)!r}")
  return tuple(names)


def load_pretrain_config(init_from: str, step: int | None = None
                         ) -> tuple[ml_collections.ConfigDict, int]:
  """``(config, step)``: the resolved config stored with the pretraining
  run's checkpoint ``step`` (None: the newest that reads) and that step, whose
  parameters :func:`run` then loads. Checkpoints from before the meta held
  the config fall back to the workdir's config.json."""
  try:
    step, meta = checkpoint_lib.read_meta(init_from, step=step)
    stored = checkpoint_lib.stored_config(init_from, meta)
  except FileNotFoundError as e:
    raise FileNotFoundError(
        f"{e}; set --config.init_from to the workdir of a pretraining run (python -m "
        "darl_jax.main --config=experiments/fashion_mnist_diff.py --workdir=<dir>)") from e
  return ml_collections.ConfigDict(stored), step


def check_params(model, image_shape, params) -> None:
  """Fails naming the parameters whose shapes differ from the rebuilt model's."""
  h, w, c = image_shape
  abstract = jax.eval_shape(
      lambda: model.init({"params": jax.random.PRNGKey(0), "noise": jax.random.PRNGKey(0)},
                         jnp.zeros((1, h, w, c)), train=False))["params"]
  want = {jax.tree_util.keystr(k): v.shape
          for k, v in jax.tree_util.tree_leaves_with_path(abstract)}
  have = {jax.tree_util.keystr(k): np.shape(v)
          for k, v in jax.tree_util.tree_leaves_with_path(params)}
  diffs = [f"{k}: {have.get(k)} in the checkpoint, {want.get(k)} in the model"
           for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)]
  if diffs:
    raise ValueError("the checkpoint does not fit the model its config describes: "
                     + "; ".join(diffs[:10]))
