"""Patch decoders (paper Table "patch decoder"): backbone output -> pixels.

Every decoder maps ``z [M, D]`` (the backbone output at step t, flattened over
batch and sequence) to a patch prediction ``[M, P]``. Denoising decoders also
take the noise-corrupted patch ``x_noisy [M, P]`` and, optionally, ``gamma
[M]``; with ``gamma_conditioning`` gamma is appended to the corrupted patch as
one extra channel before its linear embedding (paper section "Patch
Decoder").

Depth 0 is a single linear layer for every kind, as in the paper's table.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import linen as nn

from darl_jax.models import layers
from darl_jax.models import vit as vit_lib

DECODERS = ("linear", "mlp", "transformer")


def check_decoder(kind: str) -> str:
  if kind not in DECODERS:
    raise ValueError(f"unknown patch decoder {kind!r}; valid: {', '.join(DECODERS)}")
  return kind


def _noisy_input(x_noisy, gamma, gamma_conditioning: bool):
  if gamma_conditioning:
    if gamma is None:
      raise ValueError("gamma_conditioning needs gamma")
    x_noisy = jnp.concatenate([x_noisy, gamma[:, None].astype(x_noisy.dtype)], -1)
  return x_noisy


class PatchDecoder(nn.Module):
  """All three decoder kinds behind one interface.

  * ``linear``: Dense over ``z`` (MSE) or over ``[z, x_noisy(, gamma)]``.
  * ``mlp``: a residual MLP of ``depth`` pre-LN blocks (width ``width``) on
    ``Dense(z) (+ Dense(x_noisy(, gamma)))``.
  * ``transformer``: ``depth`` Transformer blocks over two tokens,
    ``[Dense(z), Dense(x_noisy(, gamma))]`` plus a learned type embedding each,
    full attention (no mask). The prediction is read from the second token, the
    one that carries the corrupted patch: the decoder refines its own noisy
    input while the first token only supplies the autoregressive context, the
    usual arrangement of a conditional denoiser (the paper does not say which
    token it reads). With ``scan_layers`` (the backbone's ``model.scan_layers``)
    its first ``depth - 1`` blocks run as one ``nn.scan`` (parameters stacked
    under ``blocks/block``); the last, in the read-out mode, stays
    ``block_<depth-1>``.
  """
  kind: str
  patch_dim: int
  depth: int = 1
  width: int = 256
  num_heads: int = 4
  mlp_ratio: int = 4
  gamma_conditioning: bool = False
  dtype: Any = jnp.float32
  scan_layers: bool = False

  @nn.compact
  def __call__(self, z, x_noisy=None, gamma=None):
    check_decoder(self.kind)
    dense = lambda n, name: nn.Dense(n, dtype=self.dtype,
                                     kernel_init=layers.DENSE_INIT, name=name)
    noisy = None if x_noisy is None else _noisy_input(x_noisy, gamma,
                                                      self.gamma_conditioning)
    if self.kind == "linear" or self.depth == 0:
      inp = z if noisy is None else jnp.concatenate([z, noisy.astype(z.dtype)], -1)
      return dense(self.patch_dim, "linear")(inp).astype(jnp.float32)

    if self.kind == "mlp":
      h = dense(self.width, "z_embed")(z)
      if noisy is not None:
        h = h + dense(self.width, "noisy_embed")(noisy)
      for i in range(self.depth):
        h = h + layers.Mlp(self.width * self.mlp_ratio, self.dtype, name=f"mlp_{i}")(
            layers.LayerNorm(self.dtype, name=f"norm_{i}")(h))
      h = layers.LayerNorm(self.dtype, name="norm")(h)
      return dense(self.patch_dim, "head")(h).astype(jnp.float32)

    # transformer
    if noisy is None:
      raise ValueError("the transformer patch decoder is a denoising decoder: use "
                       "loss.kind='diffusion', or decoder.kind='linear'/'mlp' for MSE")
    # each token is its embedding plus a learned type embedding
    tokens = [dense(self.width, "z_embed")(z), dense(self.width, "noisy_embed")(noisy)]
    type_embed = self.param("type_embed", nn.initializers.normal(0.02),
                            (2, self.width), jnp.float32)
    context, token = (t[:, None] + e.astype(t.dtype) for t, e in zip(tokens, type_embed))
    block = dict(num_heads=self.num_heads, mlp_dim=self.width * self.mlp_ratio,
                 causal=False, dtype=self.dtype)
    if self.depth > 1:
      h = jnp.concatenate([context, token], axis=1)
      if self.scan_layers:
        stack = vit_lib.scan_blocks(vit_lib.ScanBlock, self.depth - 1, "blocks",
                                    block_kwargs=block, emit=False)
        h, _ = stack(h, None, None, None)
      else:
        for i in range(self.depth - 1):
          h = vit_lib.Block(name=f"block_{i}", **block)(h)
      context, token = h[:, :1], h[:, 1:]
    # Only the second token's output is read, so the last block computes
    # that token's output alone, the first token giving keys and values
    # (the read-out mode): the same function, 40% fewer FLOPs in that block.
    h = vit_lib.Block(name=f"block_{self.depth - 1}", **block)(token, context=context)
    h = layers.LayerNorm(self.dtype, name="norm")(h)[:, 0]
    return dense(self.patch_dim, "head")(h).astype(jnp.float32)


def decoder_from_config(decoder_cfg, *, patch_dim: int, backbone_width: int,
                        backbone_heads: int, dtype, scan_layers: bool = False) -> PatchDecoder:
  """``config.decoder``: kind, depth, width (0 = backbone width), num_heads
  (0 = backbone heads), gamma_conditioning. ``scan_layers``: the backbone's
  (``model.scan_layers``), so that one flag scans every stack of blocks."""
  get = lambda k, d=None: decoder_cfg.get(k, d)
  return PatchDecoder(
      kind=check_decoder(get("kind", "linear")),
      patch_dim=patch_dim,
      depth=get("depth", 1),
      width=get("width", 0) or backbone_width,
      num_heads=get("num_heads", 0) or backbone_heads,
      gamma_conditioning=get("gamma_conditioning", False),
      dtype=dtype, scan_layers=scan_layers)
