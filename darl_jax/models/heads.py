"""The backbone with a classifier head, for fine-tuning and supervised training.

Read-outs (paper Table "read-out"):

* ``last``: the output at the last image patch (the paper's default). The
  input holds all N patches in raster order; the last patch, never an input in
  pretraining, is now one.
* ``mean``: the mean over the patch tokens (the SOS token excluded).

``sos``: whether to prepend the SOS token. A pretrained backbone was trained
with it; dropping it gives an even sequence length (N = 196 or 256), which
some fused attention kernels need (darl_jax/ops.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from darl_jax import patches as patches_lib
from darl_jax.models import vit as vit_lib

READOUTS = ("last", "mean")


class Classifier(nn.Module):
  backbone: vit_lib.ViT
  patch_size: int
  num_classes: int
  readout: str = "last"
  sos: bool = True

  @nn.compact
  def __call__(self, images, *, train: bool = False):
    """Logits ``[B, num_classes]`` (float32) and the backbone's named outputs."""
    if self.readout not in READOUTS:
      raise ValueError(f"unknown readout {self.readout!r}; valid: {', '.join(READOUTS)}")
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
    return logits, out
