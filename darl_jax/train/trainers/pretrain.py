"""DARL pretraining trainer: next-patch prediction with MSE or patch diffusion.

The loss is darl_jax/objectives.py's, run in one ``model.apply`` (backbone and
decoder together, so gradients reach both). The noise comes from the rng the
loop gives each step: split into the objective's draws (noise levels, noise,
and a two-stream model's random orderings through the ``noise`` stream) and
dropout. Validation scores every patch at a fixed gamma grid with fixed noise,
each example's drawn from its index in the eval split.
After training, ``predictions.png`` shows teacher-forced predictions
(sampling.predict_patches, the sampler's denoising chain), by a program the
loop compiles at start-up (``finalize_programs``), so that the run ends
promptly after its last checkpoint.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from PIL import Image

from darl_jax import diffusion
from darl_jax import objectives
from darl_jax import patches
from darl_jax import sampling
from darl_jax.models import darl as darl_lib
from darl_jax.train import accumulate
from darl_jax.train import evaluators
from darl_jax.train import trainer as trainer_lib
from darl_jax.train import step as step_lib
from darl_jax.train import feed as feed_lib
from darl_jax.train import backbone as backbone_lib
from darl_jax.models import vit as vit_lib


class PretrainTrainer(trainer_lib.Trainer):
  """Owns the DARL model, its loss, its validation loss and the prediction picture."""

  def build_model(self, ctx):
    trainer_lib.check_image_shape(self.config, ctx.train_source)
    fewshot_cfg = self.config.get("fewshot_eval")
    if fewshot_cfg is not None and fewshot_cfg.get("enabled", False):
      # a wrong feature name fails before training
      evaluators.check_features_name(fewshot_cfg.features, vit_lib.depth(self.config.model))
    return darl_lib.darl_from_config(self.config)

  def init_variables(self, model, rng, batch):
    p, n = jax.random.split(rng)
    return model.init({"params": p, "noise": n}, batch["image"], train=False)

  def prepare_batch(self, model, batch, rng, train):
    """The step's draws, made once on the whole batch and sliced with it
    (train/accumulate.py): ``batch["draws"]`` holds the diffusion levels and
    noise and the prefix lengths (objectives.draws), and a two-stream model
    with ``ordering="random"`` its per-example orders ``perm [B, N]``."""
    if not train:
      return batch
    noise, _ = jax.random.split(rng)
    key, stream = jax.random.split(noise)
    draws = objectives.draws(model, batch["image"], key)
    if model.two_stream and model.ordering == "random":
      b, n = objectives.noise_shape(model, batch["image"])[:2]
      draws["perm"] = patches.random_permutations(jax.random.fold_in(stream, 7), b, n)
    return {**batch, "draws": draws}

  def loss_fn(self, model, params, model_state, batch, rng, train):
    _, dropout = jax.random.split(rng)
    if "draws" not in batch:    # called outside the train step (benchmarks, tests)
      batch = self.prepare_batch(model, batch, rng, train)
    if train:
      loss, metrics = model.apply({"params": params, **model_state}, batch["image"], train=True,
                                  rngs={"dropout": dropout},
                                  method=objectives.loss_given_noise, **batch["draws"])
    else:
      draws, stream = jax.random.split(jax.random.split(rng)[0])
      loss, metrics = model.apply({"params": params, **model_state}, batch["image"], draws, train=False,
                                  rngs={"noise": stream}, method=objectives.loss)
    metrics = dict(metrics)
    metrics[accumulate.METRIC_WEIGHTS] = metrics.pop("counts")
    return loss, (metrics, model_state)

  def eval_fn(self, model, params, model_state, batch, rng):
    """Per-example validation loss; diffusion at a fixed gamma grid. Each
    example's draws (noise, prefix length, a two-stream model's random
    order) come from its own key (step_lib.example_keys of its index in the
    eval split), so its loss does not depend on the evaluation batch."""
    gammas = None
    if self.config.loss.kind == "diffusion":
      gammas = diffusion.eval_gamma_grid(self.config.loss.get("eval_gammas", 8))
    one = batch["image"][:1]      # draws read the shape of one example only
    n = objectives.noise_shape(model, one)[1]

    def example_draws(key):
      key, stream = jax.random.split(key)
      draws = objectives.draws(model, one, key, eval_gammas=gammas)
      if model.two_stream and model.ordering == "random":
        draws["perm"] = patches.random_permutations(jax.random.fold_in(stream, 7), 1, n)
      return jax.tree.map(lambda x: x[0], draws)

    draws = jax.vmap(example_draws)(step_lib.example_keys(rng, batch["index"]))
    _, metrics = model.apply({"params": params, **model_state}, batch["image"], train=False,
                             method=objectives.loss_given_noise, **draws)
    return {"loss": metrics["per_example_loss"]}

  def extra_eval(self, ctx, model, state):
    """Evaluators on frozen features, each when its section is enabled:
    ``probe_accuracy`` (a ridge probe, ``probe_eval``) and
    ``fewshot_<k>shot`` / ``fewshot_<k>shot_std`` (few-shot ridge
    regression as big_vision evaluates it, ``fewshot_eval``; train/evaluators.py)."""
    scores = {}
    probe_cfg = self.config.get("probe_eval")
    if probe_cfg is not None and probe_cfg.get("enabled", False):
      if getattr(self, "_ridge_probe", None) is None:
        self._ridge_probe = evaluators.RidgeProbe(
            self.config, ctx.mesh, lambda p, x: backbone_lib.darl_pooled_features(model, p, x),
            eval_batch=ctx.resolved.eval_batch if ctx.resolved else None)
      scores.update(self._ridge_probe(state["params"]))
    fewshot_cfg = self.config.get("fewshot_eval")
    if fewshot_cfg is not None and fewshot_cfg.get("enabled", False):
      if getattr(self, "_fewshot", None) is None:
        self._fewshot = evaluators.from_pretrain_config(
            self.config, ctx.mesh, model, ctx.resolved.eval_batch if ctx.resolved else None)
      scores.update(self._fewshot(state["params"]))
    return scores

  def finalize_programs(self, ctx, model, abstract_params):
    """The prediction picture's program (``picture``), compiled by the loop at
    start-up: ``(params, uint8 images [num, H, W, C], key) -> (images in
    [-1, 1], teacher-forced predictions)`` for ``predictions.num_images``
    eval images. None where no picture is made (or on processes other than
    0, where ``finalize`` makes none)."""
    num = self.config.predictions.num_images
    if not num or jax.process_index() != 0:
      return {}
    params_sharding, sharding = _picture_shardings(ctx.mesh, abstract_params)
    h, w, c = ctx.eval_source.image_shape
    params = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract_params, params_sharding)
    key = jax.random.PRNGKey(0)
    return {"picture": (self._picture(model), (
        params, jax.ShapeDtypeStruct((num, h, w, c), jnp.uint8, sharding=sharding),
        jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding)))}

  def _picture(self, model):
    def picture(params, images, key):
      images = feed_lib.model_input({"image": images})["image"]
      return images, sampling.predict_patches(model, params, images, key,
                                              num_steps=self.config.predictions.num_steps)
    return jax.jit(picture)

  def finalize(self, ctx, model, state):
    """Writes ``predictions.png``: originals beside teacher-forced predictions,
    by the program compiled at start-up (``ctx.compiled["picture"]``; jitted
    here where finalize runs outside the loop), so that nothing compiles
    after the last step."""
    num = self.config.predictions.num_images
    if not num or jax.process_index() != 0:
      return
    params_sharding, sharding = _picture_shardings(ctx.mesh, state["params"])
    batch = next(iter(ctx.eval_source.eval_batches(num)))
    images = jax.device_put(np.asarray(batch["image"][:num]), sharding)
    params = jax.tree_util.tree_map(_placed, state["params"], params_sharding)
    picture = ctx.compiled.get("picture") or self._picture(model)
    samples = 1 if self.config.loss.kind == "mse" else 2
    rows = []
    for s in range(samples):
      original, predicted = picture(params, images,
                                    jax.device_put(jax.random.PRNGKey(s), sharding))
      rows += [np.asarray(original)] * (s == 0) + [np.asarray(predicted)]
    grid = prediction_grid(rows)
    path = ctx.workdir / "predictions.png"
    Image.fromarray(grid).save(str(path))
    ctx.writer.write_images(int(state["step"]), {"predictions": grid[None]})
    logging.info("wrote %s (columns: original, then %d teacher-forced prediction(s))",
                 path, samples)


def _picture_shardings(mesh, params):
  """Where the picture runs: one process, on the mesh as the parameters lie
  (nothing moves; images and key replicated); several processes, on process
  0's first device alone (``finalize`` runs there only, on parameters
  step_lib.host_readable replicated). Returns ``(a sharding per parameter, the
  images' and key's sharding)``."""
  if jax.process_count() == 1:
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree_util.tree_map(lambda x: x.sharding, params), replicated
  device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
  one = jax.sharding.SingleDeviceSharding(device)
  return jax.tree_util.tree_map(lambda _: one, params), one


def _placed(x, sharding):
  """``x`` with ``sharding``: already so on one process; with several, the
  replicated parameters' own copy on this process's device."""
  if x.sharding == sharding:
    return x
  if x.is_fully_replicated:
    x = x.addressable_data(0)
  return jax.device_put(x, sharding)


def prediction_grid(columns: list[np.ndarray], pad: int = 2, scale: int = 4) -> np.ndarray:
  """Images ``[N, H, W, C]`` in [-1, 1], one list entry per column -> uint8 RGB grid."""
  n, h, w, c = columns[0].shape
  cell_h, cell_w = h * scale + pad, w * scale + pad
  grid = np.full((n * cell_h + pad, len(columns) * cell_w + pad, 3), 255, np.uint8)
  for j, col in enumerate(columns):
    img = np.clip((np.asarray(col) + 1) * 127.5, 0, 255).astype(np.uint8)
    img = np.repeat(np.repeat(img, scale, 1), scale, 2)
    if c == 1:
      img = np.repeat(img, 3, -1)
    for i in range(n):
      y, x = pad + i * cell_h, pad + j * cell_w
      grid[y:y + h * scale, x:x + w * scale] = img[i]
  return grid
