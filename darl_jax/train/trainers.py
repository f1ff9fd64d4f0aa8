"""The explicit registry of the shared loop's trainers (``config.trainer``).

Kept apart from main.py (the absl entry point, which defines flags on
import) so that other commands (darl_jax/compile.py, the study runner)
pick a trainer by name without defining main's flags.
"""

from __future__ import annotations

from darl_jax.train import attentive_probe
from darl_jax.train import finetune
from darl_jax.train import linear_probe
from darl_jax.train import pretrain
from darl_jax.train import supervised


def trainers() -> dict:
  """name -> Trainer class of the shared loop (train/loop.py); each class owns
  its loss (``loss_fn``)."""
  return {"pretrain": pretrain.PretrainTrainer,
          "finetune": finetune.FinetuneTrainer,
          "linear_probe": linear_probe.LinearProbeTrainer,
          "attentive_probe": attentive_probe.AttentiveProbeTrainer,
          "supervised": supervised.SupervisedTrainer}


# Jobs with a driver of their own (nothing to train), dispatched by main.get_job.
DRIVERS = ("sample", "fewshot", "knn")


def get_trainer(name: str):
  registry = trainers()
  if name not in registry:
    raise ValueError(f"unknown trainer {name!r}; valid: {', '.join([*registry, *DRIVERS])}")
  return registry[name]
