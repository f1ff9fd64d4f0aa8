"""The supervised baseline: the same ViT trained from scratch with labels.

Appendix "Supervised Baseline": the ViT of Dosovitskiy et al. with MAE's
initialisation and optimisation, positional encoding and causal masking as
the ablation asks (``model.posenc``, ``model.causal``), and global mean pooling
into a single linear layer (``head.readout="mean"``). Recipe (table "ImageNet
Supervised Training Hyperparameters", ``supervised_config``): drop path 0.2,
RandAugment(9, 0.5), mixup 0.8, cutmix 1.0, label smoothing 0.1, AdamW
(0.9, 0.95), base lr 1e-4 x batch / 256, weight decay 0.3, batch 4096, cosine
with 20 warm-up epochs, 200 epochs, no EMA (the ablation table's note).

The model, loss, augmentation and evaluation are the fine-tuning trainer's
(train/classifier.py's ``ClassifierTrainer``); only the initialisation
differs (no checkpoint) and there is no layer-wise decay.
"""

from __future__ import annotations

from darl_jax.train import classifier


def supervised_config():
  """``finetune_config`` re-set to the supervised table."""
  c = classifier.finetune_config()
  c.trainer = "supervised"
  c.model.update(causal=False, drop_path=0.2, posenc="rope2d")
  c.head.update(readout="mean", sos=True)
  c.label_smoothing = 0.1
  c.ema_decay = 0.0
  c.optim.update(name="adamw", base_lr=1e-4, lr_scaling=True, b1=0.9, b2=0.95,
                 weight_decay=0.3, layer_decay=0.0, num_layers=0, warmup_epochs=20.0,
                 warmup_steps=-1, schedule="cosine")
  c.total_epochs = 200.0
  c.batch_size = 4096
  return c


class SupervisedTrainer(classifier.ClassifierTrainer):
  """``ClassifierTrainer`` from random initialisation (no checkpoint)."""

  def load_pretrained(self, ctx, params):
    if self.config.get("init_from", ""):
      raise ValueError("the supervised baseline trains from scratch; to start from a "
                       "checkpoint use trainer='finetune' (experiments/finetune_*.py)")
    return params
