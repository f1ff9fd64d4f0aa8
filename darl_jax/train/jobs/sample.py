"""The sampling job: complete held-out images with a pretrained DARL model.

    python -m darl_jax.main --config=experiments/fashion_mnist_sample.py \\
        --config.init_from=<pretraining workdir> --workdir=<dir>

``config.trainer == "sample"`` makes darl_jax/main.py call :func:`run`, a
small driver of its own: nothing is trained, so there is no data pipeline,
optimizer, state or checkpoint, only the workdir contract (a lock,
``config.json`` written after the checks, metrics.jsonl). The steps:

1. the config stored in the pretraining run's newest checkpoint (or
   ``init_step``) rebuilds the exact model: variant, positional encoding,
   ordering, decoder, loss and schedule; the same checkpoint gives the
   parameters (a config.json rewritten by a later command does not matter):
   its EMA of the parameters where it has one (``sample.use_ema``: True
   insists on it, False takes the raw parameters);
2. ``sample.num_images`` images of ``sample.split`` (the pretraining dataset)
   are completed ``sample.num_samples`` times each from the known part
   (``sample.condition``), with ``sample.num_steps`` reverse diffusion steps
   per patch at ``sample.temperature`` (darl_jax/sampling.py);
3. the workdir gets ``samples.png`` (per image: the original in a red frame,
   then the completions with a red line along the edge of the given part),
   ``samples.npz`` (originals, labels, completions, known mask) and
   ``sample_metrics.json`` (also in metrics.jsonl at step 0): how far the given
   pixels moved (must be 0), the diversity of the completions of one image,
   their distance to the original, ``used_ema`` (1: the EMA weights) and,
   with ``sample.classifier_steps > 0`` on labelled data, whether a pixel
   classifier trained here on the training split still recognises each
   image's class in its completions, and how many programs the job compiled
   (``programs_compiled``; ``programs_loaded_from_cache``: those the
   persistent compilation cache of setup_lib.job gave, so a rerun of the same
   model, batch and sampling settings compiles none of its sampling
   programs; train/compile_count.py).
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from ml_collections.config_dict import placeholder
from PIL import Image

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import config_lib
from darl_jax import data as data_lib
from darl_jax import ema as ema_lib
from darl_jax import files
from darl_jax import sampling
from darl_jax.models import darl as darl_lib
from darl_jax.train import setup as setup_lib
from darl_jax.train import feed as feed_lib
from darl_jax.train import compile_count
from darl_jax.train import backbone as backbone_lib


def sample_config() -> ml_collections.ConfigDict:
  """Keys of every sampling config; experiments/*_sample.py set the values."""
  c = config_lib.base_config()
  c.trainer = "sample"
  c.total_steps = 0              # nothing is trained
  c.batch_size = 32              # images per compiled sampling call (x num_samples rows)
  # The model, optimizer and data come from the pretraining run; nothing is
  # trained, so there is no EMA to keep (sample.use_ema picks the weights).
  for unused in ("model", "optim", "data", "ema_decay", "eval_with_ema"):
    del c[unused]
  c.init_from = placeholder(str)  # the pretraining workdir (or a checkpoint dir)
  c.init_step = -1                # -1: the newest checkpoint
  c.sample = ml_collections.ConfigDict({
      "num_images": 16, "num_samples": 4, "num_steps": 1000, "temperature": 1.0,
      "condition": "top_half", "prefix_len": 0, "clip": True, "split": "test",
      # Sampling-time overrides of the pretraining config (None: keep it).
      "dtype": placeholder(str), "data_path": placeholder(str),
      "tfds_data_dir": placeholder(str),
      # The checkpoint's EMA weights (True), its raw parameters (False);
      # None: the EMA where the checkpoint has one.
      "use_ema": placeholder(bool),
      "grid_images": 8, "grid_scale": 4,
      # > 0: train a pixel MLP for this many steps and score class retention.
      "classifier_steps": 0, "classifier_batch_size": 256})
  return c


def resolve(config) -> tuple[ml_collections.ConfigDict, int]:
  """``(pretraining config, checkpoint step)`` for a sampling ``config``, with
  the ``sample.*`` overrides applied; fails naming the fix before anything
  is written (also ``sample.use_ema=True`` on a run without an EMA)."""
  if not config.get("init_from"):
    raise ValueError("the sample job needs --config.init_from=<pretraining workdir>")
  s = config.sample
  if s.condition not in sampling.CONDITIONS:
    raise ValueError(f"unknown sample.condition {s.condition!r}; valid: "
                     f"{', '.join(sampling.CONDITIONS)}")
  pre, step = backbone_lib.load_pretrain_config(config.init_from,
                                   None if config.init_step < 0 else config.init_step)
  if s.get("use_ema") and not pre.get("ema_decay", 0.0):
    raise ema_lib.MissingEmaError(
        f"sample.use_ema=True but the run in {config.init_from} kept no EMA of its "
        "parameters (ema_decay=0): leave out --config.sample.use_ema to sample from its "
        "parameters, or pretrain with --config.ema_decay=0.9999")
  if s.get("dtype"):
    pre.model.dtype = s.dtype
  if s.get("data_path"):
    pre.data.path = s.data_path
  if s.get("tfds_data_dir"):
    pre.data.tfds_data_dir = s.tfds_data_dir
  return pre, step


def run(config, workdir: str) -> dict:
  """Samples per ``config`` into ``workdir``; returns the sample metrics
  (empty on processes other than 0, which only hold the workdir with it).

  The workdir contract of every run: locked for this run, ``config.json``
  written (atomically) once the checks passed, metrics.jsonl started afresh
  (a rerun writes every record again). No checkpoints.
  """
  count = compile_count.Count()
  config_lib.validate(config)
  pre, step = resolve(config)
  dtype = pre.model.get("dtype", "float32")
  with setup_lib.job(config, workdir, dtype) as (workdir, writer, is_main):
    model = darl_lib.darl_from_config(pre)
    writer.start(None, config.to_dict())
    if not is_main:
      return {}
    return complete(config, pre, step, model, workdir, writer, count)


def complete(config, pre, step: int, model, workdir, writer,
             count: compile_count.Count | None = None) -> dict:
  """Loads the parameters, completes the images, writes the artifacts.
  ``count``: the job's program count (default: from this call on)."""
  if count is None:
    count = compile_count.Count()
  s = config.sample
  image_shape = (pre.model.image_size, pre.model.image_size, pre.model.get("channels", 3))
  # The step whose config built the model (load_pretrain_config).
  params, meta = checkpoint_lib.restore_params(config.init_from, step=step,
                                               use_ema=s.get("use_ema"))
  backbone_lib.check_params(model, image_shape, params)
  params = jax.device_put(params)
  logging.info("sampling from %s (step %s, %s)", config.init_from, meta.get("step"),
               "its EMA weights" if meta["restored_weights"] == "ema" else "its parameters")

  images, labels, num_classes = first_images(pre.data, s.split, s.num_images, config.seed)
  if images.shape[1:] != image_shape:
    raise ValueError(f"data gives images of shape {images.shape[1:]}, the model "
                     f"expects {image_shape}")
  sampler = sampling.Sampler(model, image_shape, num_steps=s.num_steps,
                             temperature=s.temperature, num_samples=s.num_samples,
                             clip=s.clip)
  known = sampling.known_mask(s.condition, sampler.grid_hw, sampler.ordering, s.prefix_len)
  start = time.time()
  samples = complete_all(sampler, params, images, known, config.batch_size,
                         jax.random.PRNGKey(config.seed))
  seconds = time.time() - start
  known_px = pixel_mask(known, sampler.grid_hw, model.patch_size)
  metrics = completion_metrics(images, samples, known_px)
  metrics.update(sampling_seconds=seconds, images_per_sec=len(images) / seconds,
                 completions_per_sec=samples.shape[0] * samples.shape[1] / seconds,
                 used_ema=float(meta["restored_weights"] == "ema"))
  if s.classifier_steps > 0 and num_classes > 0:
    classify = train_pixel_classifier(pre.data, num_classes, s.classifier_steps,
                                      s.classifier_batch_size, config.seed)
    metrics.update(class_retention(classify, images, labels, samples, known_px))

  report = count.report()
  metrics.update(programs_compiled=float(report["compiled"]),
                 programs_loaded_from_cache=float(report["loaded_from_cache"]))
  n = min(s.grid_images, len(images))
  grid = completion_grid(images[:n], samples[:n], known_px, scale=s.grid_scale)
  Image.fromarray(grid).save(str(workdir / "samples.png"))
  writer.write_images(0, {"samples": grid[None]})
  np.savez_compressed(str(workdir / "samples.npz"), images=images, labels=labels,
                      samples=samples, known=known)
  files.write_text_atomic(workdir / "sample_metrics.json", json.dumps(metrics, indent=2) + "\n")
  writer.write_scalars(0, metrics)
  logging.info("wrote %s/samples.png; metrics: %s", workdir,
               {k: round(v, 4) for k, v in metrics.items()})
  logging.info("%s", count.line("sampling"))
  return metrics


# ------------------------------------------------------------------- helpers


def first_images(data_cfg, split: str, num: int, seed: int):
  """The first ``num`` images ``[num, H, W, C]`` and labels ``[num]`` of
  ``split``, and the dataset's number of classes (0: unlabelled)."""
  source = data_lib.build_source(data_cfg, split=split, seed=seed)
  images, labels = [], []
  for batch in source.eval_batches(min(num, 256), 0, 1):
    keep = batch["mask"]
    images.append(batch["image"][keep])
    labels.append(batch["label"][keep])
    if sum(len(x) for x in images) >= num:
      break
  images, labels = np.concatenate(images)[:num], np.concatenate(labels)[:num]
  images = np.asarray(feed_lib.model_input({"image": images})["image"])   # uint8 -> [-1, 1]
  if len(images) < num:
    raise ValueError(f"split {split!r} has only {len(images)} images; lower sample.num_images")
  return images.astype(np.float32), labels, source.num_classes


def complete_all(sampler, params, images, known, batch_size: int, key) -> np.ndarray:
  """Completions ``[n, S, H, W, C]`` of all images, ``batch_size`` images per
  call (the last batch padded, so one program serves every batch)."""
  out = []
  for i, lo in enumerate(range(0, len(images), batch_size)):
    chunk = images[lo:lo + batch_size]
    pad = batch_size - len(chunk)
    padded = np.concatenate([chunk, np.zeros((pad,) + chunk.shape[1:], chunk.dtype)])
    result = sampler(params, padded, known, jax.random.fold_in(key, i))
    out.append(np.asarray(result)[:len(chunk)])
  return np.concatenate(out)


def pixel_mask(known: np.ndarray, grid_hw, patch_size: int) -> np.ndarray:
  """Raster patch mask ``[N]`` -> pixel mask ``[H, W]``."""
  grid = np.asarray(known, bool).reshape(grid_hw)
  return np.repeat(np.repeat(grid, patch_size, 0), patch_size, 1)


def completion_metrics(images, samples, known_px) -> dict:
  """Given-pixel error, diversity and distance to the original (RMS, [-1, 1] units).

  ``images [n, H, W, C]``, ``samples [n, S, H, W, C]``, ``known_px [H, W]``.
  ``diversity_rms``: RMS difference between two completions of the same image
  over the generated pixels, averaged over pairs and images (0 for MSE).
  """
  gen = ~known_px
  given_error = float(np.abs(samples - images[:, None])[:, :, known_px].max()) \
      if known_px.any() else 0.0
  g = samples[:, :, gen]                                  # [n, S, pixels, C]
  orig = images[:, None][:, :, gen]
  out = {"given_max_abs_error": given_error,
         "distance_to_original_rms": float(np.sqrt(np.mean((g - orig) ** 2)))}
  s = samples.shape[1]
  if s > 1:
    pairs = [np.mean((g[:, i] - g[:, j]) ** 2) for i in range(s) for j in range(i + 1, s)]
    out["diversity_rms"] = float(np.sqrt(np.mean(pairs)))
  # Mean absolute difference of neighbouring generated pixels, relative to the
  # originals': about 1 for samples as sharp as real images, < 1 for blur
  # (the MSE model's conditional mean).
  out["sharpness_ratio"] = float(_edge_energy(samples, gen) / _edge_energy(images, gen))
  return out


def _edge_energy(x, mask) -> float:
  """Mean |vertical| and |horizontal| neighbour difference of ``x [..., H, W, C]``
  over pixel pairs that both lie in ``mask [H, W]``."""
  dy = np.abs(np.diff(x, axis=-3))[..., mask[1:] & mask[:-1], :]
  dx = np.abs(np.diff(x, axis=-2))[..., mask[:, 1:] & mask[:, :-1], :]
  return 0.5 * (dy.mean() + dx.mean()) + 1e-12


# ------------------------------------------------------- class retention


def train_pixel_classifier(data_cfg, num_classes: int, steps: int, batch_size: int,
                           seed: int):
  """A one-hidden-layer MLP on raw pixels (512 ReLU units, Adam), trained on
  the training split; returns ``images [n, H, W, C] -> labels [n]``.

  A judge independent of DARL: if it recognises the class of a completion,
  the completion kept what the given part implied about the class.
  """
  source = data_lib.build_source(data_cfg, split="train", seed=seed)
  dim = int(np.prod(source.image_shape))
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  params = {"w1": jax.random.normal(k1, (dim, 512)) * np.sqrt(2.0 / dim),
            "b1": jnp.zeros(512),
            "w2": jax.random.normal(k2, (512, num_classes)) * np.sqrt(1.0 / 512),
            "b2": jnp.zeros(num_classes)}

  def logits(p, x):
    h = jax.nn.relu(x.reshape(x.shape[0], -1) @ p["w1"] + p["b1"])
    return h @ p["w2"] + p["b2"]

  tx = optax.adam(1e-3)
  opt = tx.init(params)

  @jax.jit
  def step(p, opt, x, y):
    loss, g = jax.value_and_grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
        logits(p, x), y).mean())(p)
    updates, opt = tx.update(g, opt, p)
    return optax.apply_updates(p, updates), opt, loss

  batches = source.train_batches(batch_size)
  for _ in range(steps):
    batch = next(batches)
    params, opt, _ = step(params, opt, feed_lib.model_input(batch)["image"], batch["label"])
  predict = jax.jit(lambda x: jnp.argmax(logits(params, x), -1))
  return lambda x: np.concatenate([np.asarray(predict(x[i:i + 1024]))
                                   for i in range(0, len(x), 1024)])


def class_retention(classify, images, labels, samples, known_px) -> dict:
  """Classifier accuracy on originals, on completions and on two baselines.

  * ``mismatched``: the given part of image i with the generated region of
    image i + 1 (another test image): what an unrelated completion scores.
  * ``given_only``: the generated region set to -1 (the black background).
  """
  n, s = samples.shape[:2]
  pred_orig = classify(images)
  pred_comp = classify(samples.reshape((n * s,) + samples.shape[2:])).reshape(n, s)
  mask = known_px[None, :, :, None]
  mismatched = np.where(mask, images, np.roll(images, 1, axis=0))
  given_only = np.where(mask, images, -1.0)
  return {
      "classifier_acc_original": float(np.mean(pred_orig == labels)),
      "classifier_acc_completion": float(np.mean(pred_comp == labels[:, None])),
      "classifier_agreement_with_original": float(np.mean(pred_comp == pred_orig[:, None])),
      "classifier_acc_mismatched": float(np.mean(classify(mismatched) == labels)),
      "classifier_acc_given_only": float(np.mean(classify(given_only) == labels)),
  }


# --------------------------------------------------------------- the picture


def completion_grid(images, samples, known_px, *, scale: int = 4, pad: int = 2) -> np.ndarray:
  """uint8 RGB grid: one row per image, the original in a red frame, then its
  completions with a red line along the given part's edge.

  ``images [n, H, W, C]`` and ``samples [n, S, H, W, C]`` in [-1, 1],
  ``known_px [H, W]`` bool.
  """
  n, s, h, w, c = samples.shape
  red = np.array([255, 0, 0], np.uint8)

  def to_rgb(img):
    img = np.clip((np.asarray(img) + 1) * 127.5, 0, 255).astype(np.uint8)
    img = np.repeat(np.repeat(img, scale, 0), scale, 1)
    return np.repeat(img, 3, -1) if c == 1 else img

  big = np.repeat(np.repeat(known_px, scale, 0), scale, 1)
  # Given pixels within `width` pixels of a generated one: the edge line.
  width = max(1, scale // 2)
  near = np.zeros_like(big)
  padded = np.pad(~big, width, constant_values=False)
  for dy in range(-width, width + 1):
    for dx in range(-width, width + 1):
      near |= padded[width + dy:width + dy + big.shape[0], width + dx:width + dx + big.shape[1]]
  edge = big & near
  frame = np.zeros_like(big)
  frame[:width], frame[-width:], frame[:, :width], frame[:, -width:] = True, True, True, True

  cell_h, cell_w = h * scale + pad, w * scale + pad
  grid = np.full((n * cell_h + pad, (s + 1) * cell_w + pad, 3), 255, np.uint8)
  for i in range(n):
    cells = [np.where(frame[..., None], red, to_rgb(images[i]))]
    cells += [np.where(edge[..., None], red, to_rgb(samples[i, j])) for j in range(s)]
    for j, cell in enumerate(cells):
      y, x = pad + i * cell_h, pad + j * cell_w
      grid[y:y + h * scale, x:x + w * scale] = cell
  return grid
