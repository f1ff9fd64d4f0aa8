"""The ``fewshot`` job: few-shot classification of a pretraining checkpoint's features.

    support features (k shots per class, one draw per seed) -> whitening ->
    ridge regression onto one-hot targets in {-1, +1} -> argmax on a fixed query set

The fit and the evaluator (big_vision's protocol, the L2 strength chosen by
leave-one-out accuracy) are train/evaluators.py's ``FewShotEval``, which a
pretraining run also runs (``config.fewshot_eval``, train/trainers/pretrain.py's
``extra_eval``; ``val_fewshot_<k>shot``). This job (``run``) scores a
pretraining checkpoint's features the same way and writes them to
``fewshot.json`` and metrics.jsonl.
"""

from __future__ import annotations

import jax
import ml_collections
from absl import logging
from ml_collections.config_dict import placeholder

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import config_lib
from darl_jax import files
from darl_jax import sharding as sharding_lib
from darl_jax.train import setup as setup_lib
from darl_jax.train import compile_count
from darl_jax.train import evaluators
from darl_jax.train import fit
from darl_jax.train import backbone as backbone_lib
from darl_jax.models import vit as vit_lib


# ------------------------------------------------------------------ the job


def fewshot_config() -> ml_collections.ConfigDict:
  """Keys of the ``fewshot`` job: the checkpoint to read and ``fewshot_eval``'s
  keys (without ``enabled``). Model and data come from the pretraining run's
  stored config."""
  c = config_lib.base_config()
  c.trainer = "fewshot"
  c.total_steps = 0              # nothing is trained
  for unused in ("model", "optim", "data"):   # they come from the pretraining run
    del c[unused]
  c.init_from = placeholder(str)  # the pretraining workdir (or a checkpoint dir)
  c.init_step = -1                # -1: the newest checkpoint
  c.fewshot_eval = config_lib.fewshot_eval_config()
  del c.fewshot_eval["enabled"]
  # Overrides of the pretraining run's data location (None: keep it).
  c.data_path = placeholder(str)
  c.tfds_data_dir = placeholder(str)
  return c


def run(config, workdir: str) -> dict:
  """Scores the pretraining checkpoint ``config.init_from`` into ``workdir``:
  ``fewshot.json`` (per shot count: accuracy per seed, their mean and std,
  the chosen L2 strengths) and one metrics.jsonl record at the checkpoint's
  step with the keys pretraining logs (``val_fewshot_<k>shot``, ``_std``).
  The workdir contract of the sampling job: locked, config.json written
  once the checks passed, no checkpoints. The report and the last log line
  say how many programs the job compiled (train/compile_count.py); the features
  program is kept by the persistent compilation cache (setup_lib.job), so a rerun
  on a checkpoint of the same model loads it."""
  from darl_jax.models import darl as darl_lib

  count = compile_count.Count()
  config_lib.validate(config)
  if not config.get("init_from"):
    raise ValueError("the fewshot job needs --config.init_from=<pretraining workdir>")
  pre, step = backbone_lib.load_pretrain_config(config.init_from,
                                          None if config.init_step < 0 else config.init_step)
  if config.get("data_path"):
    pre.data.path = config.data_path
  if config.get("tfds_data_dir"):
    pre.data.tfds_data_dir = config.tfds_data_dir
  evaluators.check_features_name(config.fewshot_eval.features, vit_lib.depth(pre.model))
  dtype = pre.model.get("dtype", "float32")
  with setup_lib.job(config, workdir, dtype) as (workdir, writer, is_main):
    mesh = sharding_lib.make_mesh(config.mesh)
    model = darl_lib.darl_from_config(pre)
    # the EMA of the parameters where the checkpoint has one, unless use_ema says
    params, meta = checkpoint_lib.restore_params(config.init_from, step=step,
                                                 use_ema=config.get("use_ema", None))
    image_shape = (pre.model.image_size, pre.model.image_size, pre.model.get("channels", 3))
    backbone_lib.check_params(model, image_shape, params)
    writer.start(None, config.to_dict())
    params = jax.device_put(params, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))
    name = config.fewshot_eval.features
    evaluator = evaluators.FewShotEval(
        config.fewshot_eval, pre.data, mesh,
        lambda p, x: backbone_lib.darl_pooled_features(model, p, x, name),
        seed=config.seed, batch_size=fit.resolve(config).eval_batch)
    scores = evaluator.scores(params)
    ckpt_step = int(meta.get("step", step))
    report = {"init_from": str(config.init_from), "step": ckpt_step, "features": name,
              "support_split": config.fewshot_eval.support_split,
              "query_split": config.fewshot_eval.query_split,
              "num_classes": evaluator.num_classes,
              "shots": {str(k): v for k, v in scores.items()},
              "programs": count.report()}
    metrics = {f"val_{k}": v for k, v in evaluators.metric_dict(scores).items()}
    writer.write_scalars(ckpt_step, metrics)
    if is_main:
      files.write_json_atomic(workdir / "fewshot.json", report, indent=1)
    logging.info("few-shot accuracy of %s (step %d): %s", config.init_from, ckpt_step,
                 {k: round(v, 4) for k, v in metrics.items()})
    logging.info("%s", count.line("few-shot"))
    return metrics
