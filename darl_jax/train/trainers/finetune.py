"""Fine-tuning a pretrained DARL backbone for classification (paper section 4).

    backbone (restored from ``config.init_from``) -> read-out -> linear head
    loss: soft cross entropy against smoothed, mixup/cutmix-mixed targets

The model, loss, augmentation and evaluation are train/classifier.py's
``ClassifierTrainer`` (with the recipe, ``finetune_config``, and how the
programs are shared); this trainer adds the backbone's restore.

Weights read from ``init_from``: the pretraining run's EMA where its
checkpoint has one (``use_ema=None``), or as ``use_ema`` says (True: the EMA,
an error where there is none; False: the raw parameters).
"""

from __future__ import annotations

from darl_jax.train import backbone as backbone_lib
from darl_jax.train import classifier

# The recipe and the head's helpers, which configs and tests name through this module.
finetune_config = classifier.finetune_config
head_size = classifier.head_size
smooth_targets = classifier.smooth_targets


class FinetuneTrainer(classifier.ClassifierTrainer):
  """A ``ClassifierTrainer`` that restores its backbone from a checkpoint."""

  def load_pretrained(self, ctx, params):
    return backbone_lib.restore_backbone(ctx, self.config, params)
