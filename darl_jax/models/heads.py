"""The backbone with a classifier head, for fine-tuning and supervised training.

Read-outs (paper Table "read-out"):

* ``last``: the output at the last image patch (the paper's default). The
  input holds all N patches in raster order; the last patch, never an input in
  pretraining, is now one.
* ``mean``: the mean over the patch tokens (the SOS token excluded).

``sos``: whether to prepend the SOS token. A pretrained backbone was trained
with it; dropping it gives an even sequence length (N = 196 or 256), which
some fused attention kernels need (darl_jax/ops.py).

A padded head (``task_classes`` > 0): ``num_classes`` outputs of which the
first ``task_classes`` are the task's classes. Which outputs are classes is
the variable ``classes/valid`` (a model-state collection, set at
initialisation), not a constant of the program, so the programs compiled
for one task run every task with another class count and the same head size
(VTAB's 19 tasks, darl_jax/train/jobs/vtab.py). The other outputs' logits are
``ABSENT_LOGIT``: softmax, cross entropy and argmax then see the task's
classes alone, the absent outputs get zero gradients and, from the zero
initialisation, stay zero, so the padded head trains exactly as a head of
``task_classes`` outputs would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from darl_jax import patches as patches_lib
from darl_jax.models import vit as vit_lib

READOUTS = ("last", "mean")
# The logit of an output a padded head's task does not have. Its exp() is
# exactly 0 in float32, as -inf's is, but a soft cross entropy's
# ``target * log_softmax`` stays 0 * finite = 0 where -inf would give NaN.
ABSENT_LOGIT = -1e30
CLASSES = "classes"          # the model-state collection of a padded head


def class_mask(model_state) -> jax.Array | None:
  """A padded head's ``valid [num_classes]`` (bool) from the model state (or
  variables) it was applied with; None for a head whose outputs are all classes."""
  return (model_state or {}).get(CLASSES, {}).get("valid")


class Classifier(nn.Module):
  backbone: vit_lib.ViT
  patch_size: int
  num_classes: int
  readout: str = "last"
  sos: bool = True
  # > 0: a padded head whose first task_classes outputs are classes (see the
  # module docstring); read at initialisation only, the programs read the
  # variable it sets.
  task_classes: int = 0

  @nn.compact
  def __call__(self, images, *, train: bool = False):
    """Logits ``[B, num_classes]`` (float32; ``ABSENT_LOGIT`` at the outputs a
    padded head's task lacks) and the backbone's named outputs."""
    if self.readout not in READOUTS:
      raise ValueError(f"unknown readout {self.readout!r}; valid: {', '.join(READOUTS)}")
    if not 0 <= self.task_classes <= self.num_classes:
      raise ValueError(f"a head of {self.num_classes} outputs cannot hold "
                       f"{self.task_classes} classes; raise num_classes")
    grid_hw = (images.shape[1] // self.patch_size, images.shape[2] // self.patch_size)
    x = patches_lib.patchify(images, self.patch_size).astype(self.backbone.dtype)
    n = x.shape[1]
    rows, cols = np.divmod(np.arange(n), grid_hw[1])
    index = np.arange(1, n + 1)
    out = self.backbone(x, rows[None], cols[None], index[None], grid_hw,
                        prepend_sos=self.sos, train=train)
    feats = out["features"]
    if self.readout == "last":
      pooled = feats[:, -1]
    else:
      pooled = feats[:, 1:].mean(1) if self.sos else feats.mean(1)
    # Zero-initialised head (MAE fine-tuning recipe uses a small init; zero
    # makes the first step's logits uniform, i.e. loss = log(num_classes)).
    logits = nn.Dense(self.num_classes, kernel_init=nn.initializers.zeros,
                      name="head")(pooled.astype(jnp.float32))
    if self.task_classes:
      valid = self.variable(CLASSES, "valid",
                            lambda: jnp.arange(self.num_classes) < self.task_classes)
      logits = jnp.where(valid.value, logits, ABSENT_LOGIT)
    return logits, out
