"""DARL pretraining trainer: next-patch prediction with MSE or patch diffusion."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from PIL import Image

from darl_jax import diffusion
from darl_jax.models import darl as darl_lib
from darl_jax.train import loop


class PretrainTrainer(loop.Trainer):
  """Owns the DARL model, its loss, its validation loss and the prediction picture."""

  def build_model(self, ctx):
    loop.check_image_shape(self.config, ctx.train_source)
    return darl_lib.darl_from_config(self.config)

  def init_variables(self, model, rng, batch):
    p, n = jax.random.split(rng)
    return model.init({"params": p, "noise": n}, batch["image"], train=False)

  def loss_fn(self, model, params, model_state, batch, rng, train):
    noise, dropout = jax.random.split(rng)
    loss, metrics = model.apply({"params": params}, batch["image"], train=train,
                                rngs={"noise": noise, "dropout": dropout})
    return loss, (metrics, model_state)

  def eval_fn(self, model, params, model_state, batch, rng):
    """Per-example validation loss; diffusion at a fixed gamma grid."""
    gammas = None
    if self.config.loss.kind == "diffusion":
      gammas = diffusion.eval_gamma_grid(self.config.loss.get("eval_gammas", 8))
    _, metrics = model.apply({"params": params}, batch["image"], train=False,
                             eval_gammas=gammas, rngs={"noise": rng})
    return {"loss": metrics["per_example_loss"]}

  def extra_eval(self, ctx, model, state):
    """``probe_accuracy``: a ridge probe on frozen features, when ``probe_eval.enabled``."""
    probe_cfg = self.config.get("probe_eval")
    if probe_cfg is None or not probe_cfg.get("enabled", False):
      return {}
    if getattr(self, "_ridge_probe", None) is None:
      from darl_jax.train import linear_probe
      self._ridge_probe = linear_probe.RidgeProbe(
          self.config, ctx.mesh, lambda p, x: linear_probe.darl_pooled_features(model, p, x))
    return self._ridge_probe(state["params"])

  def finalize(self, ctx, model, state):
    """Writes ``predictions.png``: originals beside teacher-forced predictions."""
    num = self.config.predictions.num_images
    if not num or jax.process_index() != 0:
      return
    batch = next(iter(ctx.eval_source.eval_batches(num)))
    images = loop.model_input({"image": batch["image"][:num]})["image"]
    predict = jax.jit(lambda p, x, r: model.apply(
        {"params": p}, x, num_steps=self.config.predictions.num_steps,
        rngs={"noise": r}, method=darl_lib.DARL.predict_patches))
    params = jax.device_get(state["params"])
    rows = [np.asarray(images)]
    samples = 1 if self.config.loss.kind == "mse" else 2
    for s in range(samples):
      rows.append(np.asarray(predict(params, images, jax.random.PRNGKey(s))))
    grid = prediction_grid(rows)
    path = ctx.workdir / "predictions.png"
    Image.fromarray(grid).save(str(path))
    ctx.writer.write_images(int(state["step"]), {"predictions": grid[None]})
    logging.info("wrote %s (columns: original, then %d teacher-forced prediction(s))",
                 path, samples)


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
