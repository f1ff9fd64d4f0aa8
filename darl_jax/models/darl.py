"""The DARL pretraining model: ordered patches -> causal ViT -> patch decoder.

    images [B, H, W, C]
      -> patchify + ordering              tokens x_0 .. x_{N-1} (ordered), positions
      -> backbone([SOS, x_0 .. x_{N-2}])  z [B, N, D]; z_t only sees x_{<t}
      -> patch decoder(z_t [, x_t^gamma, gamma])   (DARL.decode)

The module composes ordering, backbone and decoder and holds the objective's
settings (``loss``, ``noise_a`` ...) as plain attributes; the losses
themselves are in darl_jax/objectives.py, the denoising chain that samples
from the decoder in darl_jax/diffusion.py (``reverse_diffusion``).

Parameters: ``backbone/...`` and ``decoder/...``. ``model.init(rngs, images,
train=False)`` creates both (the call runs the decoder once while
initialising); their values depend only on the module paths and the
``params`` rng, so checkpoints of every earlier version of this module restore.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from darl_jax import objectives
from darl_jax import patches as patches_lib
from darl_jax.models import decoders as decoders_lib
from darl_jax.models import two_stream as two_stream_lib
from darl_jax.models import vit as vit_lib

# Prefix-causal pretraining (model.prefix): "off", or "uniform": per example
# a prefix of k ~ U{1, .., N-1} patches that attend to each other both ways,
# with no loss on them (objectives.prefix_weights).
PREFIXES = ("off", "uniform")


class DARL(nn.Module):
  """Targets and backbone features of a batch; ``decode`` runs the patch decoder.

  Attributes are plain values built from the config by ``darl_from_config``;
  the ordering is static (numpy) unless a per-example ``perm`` is passed.
  ``loss`` .. ``gamma_bins`` are the objective's settings (config ``loss.*``),
  read by darl_jax/objectives.py and the sampler.
  """
  backbone: vit_lib.ViT
  decoder: decoders_lib.PatchDecoder
  patch_size: int
  ordering: str = "raster"
  ordering_block: int = 2
  ordering_seed: int = 0
  loss: str = "mse"
  norm_pix: bool = False
  noise_a: float = 0.03
  noise_b: float = 1.0
  predict: str = "x0"
  noise_samples: int = 1
  gamma_bins: int = 10
  prefix: str = "off"

  def make_ordering(self, grid_hw) -> patches_lib.Ordering:
    """The configured ordering of a ``grid_hw`` patch grid."""
    return patches_lib.make_ordering(self.ordering, *grid_hw, block=self.ordering_block,
                                     seed=self.ordering_seed)

  @property
  def two_stream(self) -> bool:
    return isinstance(self.backbone, two_stream_lib.TwoStreamViT)

  def encode(self, images, *, train: bool, perm=None, prefix=None):
    """Ordered targets ``[B, N, P]`` and the backbone's output dict
    (``features [B, N, D]``, ``block_XX``).

    ``perm`` (``[N]`` or per-example ``[B, N]``) overrides the configured
    ordering. A two-stream model with ``ordering="random"`` draws a fresh
    permutation per example from the ``noise`` rng; a plain model's "random"
    ordering is one fixed permutation (it has no way to know which patch
    comes next otherwise). ``prefix [B]`` (prefix-causal pretraining): the
    first ``prefix[b]`` patches of example b attend to each other both ways
    (vit.prefix_causal_mask).
    """
    grid_hw = (images.shape[1] // self.patch_size, images.shape[2] // self.patch_size)
    x = patches_lib.patchify(images, self.patch_size)
    b, n = x.shape[0], x.shape[1]
    if perm is None and self.two_stream and self.ordering == "random":
      perm = patches_lib.random_permutations(
          jax.random.fold_in(self.make_rng("noise"), 7), b, n)
    if perm is None:
      order = self.make_ordering(grid_hw)
      perm = jnp.asarray(order.perm)
      rows, cols = jnp.asarray(order.rows)[None], jnp.asarray(order.cols)[None]
    else:
      rows, cols = patches_lib.positions_of(perm, grid_hw[1])
      rows, cols = (rows[None], cols[None]) if rows.ndim == 1 else (rows, cols)
    tokens = patches_lib.order_tokens(x, perm)
    index = jnp.arange(1, n + 1, dtype=jnp.int32)[None]
    inputs = (tokens[:, :-1].astype(self.backbone.dtype), rows[:, :-1], cols[:, :-1],
              index[:, :-1], grid_hw)
    if self.two_stream:
      # Query t carries the position of patch t, the one it predicts.
      out = self.backbone(*inputs, query_rows=rows, query_cols=cols, query_index=index,
                          prepend_sos=True, train=train)
    else:
      mask = None if prefix is None else vit_lib.prefix_causal_mask(prefix, n)
      out = self.backbone(*inputs, prepend_sos=True, train=train, mask=mask)
    return objectives.patch_targets(tokens, self.norm_pix), out

  def __call__(self, images, *, train: bool, perm=None, prefix=None) -> dict:
    """``{"target": [B, N, P], "z": [B, N, D], "backbone": the backbone's
    output dict}``: ``z[:, t]`` predicts ``target[:, t]`` from patches ``< t``
    (with ``prefix``, for ``t >= prefix`` only: earlier outputs have seen
    the whole prefix)."""
    target, out = self.encode(images, train=train, perm=perm, prefix=prefix)
    if self.is_initializing():
      self._init_decoder(out["features"], target.shape[-1])
    return {"target": target, "z": out["features"], "backbone": out}

  def _init_decoder(self, z, patch_dim):
    """Creates the decoder's parameters (one call on one row per example)."""
    z = z[:, 0]
    if self.loss == "diffusion":
      self.decode(z, jnp.zeros((z.shape[0], patch_dim), z.dtype),
                  jnp.ones((z.shape[0],), jnp.float32))
    else:
      self.decode(z)

  def decode(self, z, x_noisy=None, gamma=None):
    """The patch decoder on rows: ``z [M, D]`` (``x_noisy [M, P]``, ``gamma [M]``
    for denoising) -> float32 ``[M, P]``."""
    return self.decoder(z, x_noisy, gamma)


def darl_from_config(config) -> DARL:
  """Builds the DARL module from ``config.model``, ``config.decoder``, ``config.loss``."""
  backbone, patch = vit_lib.vit_from_config(config.model)
  if config.model.get("two_stream", False):
    backbone = two_stream_lib.two_stream_from_vit(backbone)
  loss_cfg = config.loss
  if loss_cfg.kind not in objectives.LOSSES:
    raise ValueError(f"unknown loss {loss_cfg.kind!r}; valid: {', '.join(objectives.LOSSES)}")
  decoder = decoders_lib.decoder_from_config(
      config.decoder, patch_dim=patch * patch * config.model.get("channels", 3),
      backbone_width=backbone.width, backbone_heads=backbone.num_heads,
      dtype=backbone.dtype, scan_layers=backbone.scan_layers)
  prefix = config.model.get("prefix", "off")
  if prefix not in PREFIXES:
    raise ValueError(f"unknown model.prefix {prefix!r}; valid: {', '.join(PREFIXES)}")
  if prefix != "off" and (config.model.get("two_stream", False)
                          or not config.model.get("causal", True)):
    raise ValueError("model.prefix needs the plain causal backbone (model.causal=True, "
                     "model.two_stream=False): set model.prefix='off'")
  if decoder.kind == "transformer" and loss_cfg.kind == "mse":
    raise ValueError("decoder.kind='transformer' is a denoising decoder; use it with "
                     "loss.kind='diffusion', or decoder.kind='linear' for MSE")
  patches_lib.make_ordering(config.model.get("ordering", "raster"),
                            config.model.image_size // patch,
                            config.model.image_size // patch,
                            block=config.model.get("ordering_block", 2), seed=0)
  return DARL(
      backbone=backbone, decoder=decoder, patch_size=patch,
      ordering=config.model.get("ordering", "raster"),
      ordering_block=config.model.get("ordering_block", 2),
      ordering_seed=config.get("seed", 0),
      loss=loss_cfg.kind, norm_pix=loss_cfg.get("norm_pix", False),
      noise_a=loss_cfg.get("noise_a", 0.03), noise_b=loss_cfg.get("noise_b", 1.0),
      predict=loss_cfg.get("predict", "x0"),
      noise_samples=loss_cfg.get("noise_samples", 1),
      gamma_bins=loss_cfg.get("gamma_bins", 10),
      prefix=prefix)
