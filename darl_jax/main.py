"""Entry point: ``python -m darl_jax.main --config=experiments/<name>.py --workdir=<dir>``.

Picks the trainer named by ``config.trainer`` from an explicit registry,
then hands it to the shared loop. Rerunning the same command on the same
workdir resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from darl_jax import distributed  # defines --distributed, --coordinator, ...

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (experiments/*.py[:args]).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")


def trainers():
  """name -> Trainer class. Imported here so a typo fails before any work."""
  from darl_jax.train import pretrain
  from darl_jax.train import sample
  from darl_jax.train import finetune, linear_probe, supervised
  return {"pretrain": pretrain.PretrainTrainer, "sample": sample.SampleTrainer,
          "finetune": finetune.FinetuneTrainer,
          "linear_probe": linear_probe.LinearProbeTrainer,
          "supervised": supervised.SupervisedTrainer}


def get_trainer(name: str):
  registry = trainers()
  if name not in registry:
    raise ValueError(f"unknown trainer {name!r}; valid: {', '.join(registry)}")
  return registry[name]


def _quiet_library_logs():
  """Orbax logs every save step at INFO through absl; keep its warnings only."""
  import logging as py_logging

  class DropChatter(py_logging.Filter):
    def filter(self, record):
      return record.levelno >= py_logging.WARNING or "/orbax/" not in record.pathname

  logging.get_absl_handler().addFilter(DropChatter())


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=experiments/fashion_mnist_diff.py")
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required (a local path or gs://bucket/dir)")
  # Keep TensorFlow (used only by the TFDS input pipeline) off the accelerators.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  _quiet_library_logs()
  try:
    # Multi-host jobs connect here, before anything touches a device.
    distributed.initialize()
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  from darl_jax.train import loop
  config = _CONFIG.value
  try:
    trainer = get_trainer(config.trainer)(config)
    loop.run(trainer, config, _WORKDIR.value)
  except (ValueError, FileNotFoundError, loop.NonFiniteError) as e:
    logging.error("%s", e)
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


def _unknown_override(argv) -> str | None:
  """Names the first ``--config.a.b=...`` whose key the config file lacks."""
  import runpy
  cfg_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if cfg_arg is None:
    return None
  path, _, arg = cfg_arg.partition(":")
  config = runpy.run_path(path)["get_config"](arg or None)
  from darl_jax import config_lib
  for a in argv:
    if not a.startswith("--config."):
      continue
    try:
      config_lib.config_node(config, a[len("--config."):].split("=", 1)[0])
    except ValueError as e:
      return f"{a}: {e}"
  return None


def cli():
  logging.set_verbosity(logging.INFO)
  try:
    app.run(main)
  except (AttributeError, KeyError) as e:
    # Config overrides are applied while absl parses flags, before main().
    message = _unknown_override(sys.argv) or f"bad config override: {e}"
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  cli()
