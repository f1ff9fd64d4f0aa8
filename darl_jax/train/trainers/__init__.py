"""The trainers of the shared loop, and their explicit registry (``config.trainer``).

Each module here owns one trainer's model, loss and predictions
(train/trainer.py's hooks): pretrain, finetune, supervised, linear_probe,
attentive_probe. None imports another (tests/test_train_rooms.py): what
they share lives in train/ (classifier.py, probe.py, probe_grid.py,
evaluators.py, backbone.py, transfer.py). Jobs with a driver of their own
live in train/jobs/ and reach a trainer through this registry.

The registry is kept apart from main.py (the absl entry point, which
defines flags on import) so that other commands (darl_jax/compile.py, the
study runner) pick a trainer by name without defining main's flags; each
trainer's module is imported only when the registry is read.
"""

from __future__ import annotations


def trainers() -> dict:
  """name -> Trainer class of the shared loop (train/loop.py); each class owns
  its loss (``loss_fn``)."""
  # pylint: disable=g-import-not-at-top
  from darl_jax.train.trainers import attentive_probe
  from darl_jax.train.trainers import finetune
  from darl_jax.train.trainers import linear_probe
  from darl_jax.train.trainers import pretrain
  from darl_jax.train.trainers import supervised
  return {"pretrain": pretrain.PretrainTrainer,
          "finetune": finetune.FinetuneTrainer,
          "linear_probe": linear_probe.LinearProbeTrainer,
          "attentive_probe": attentive_probe.AttentiveProbeTrainer,
          "supervised": supervised.SupervisedTrainer}


# Jobs with a driver of their own (nothing to train, train/jobs/), dispatched
# by main.get_job.
DRIVERS = ("sample", "fewshot", "knn")


def get_trainer(name: str):
  registry = trainers()
  if name not in registry:
    raise ValueError(f"unknown trainer {name!r}; valid: {', '.join([*registry, *DRIVERS])}")
  return registry[name]
