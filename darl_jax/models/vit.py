"""The ViT backbone: pre-LN blocks, a learned SOS token, causal or full attention.

``ViT`` embeds ordered patch tokens (positions: models/posenc.py), prepends
the SOS token and runs ``depth`` ``Block``s and a final LayerNorm; it returns
the final features and every block's output (for per-layer probes). The same
module, with ``cache_len``, decodes a token at a time for the sampler.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from darl_jax import fp8
from darl_jax import layer_layout
from darl_jax import ops
from darl_jax.models import attention as attention_lib
from darl_jax.models import layers
from darl_jax.models import posenc as posenc_lib

DENSE_INIT = layers.DENSE_INIT


@dataclasses.dataclass(frozen=True)
class Variant:
  width: int
  depth: int
  num_heads: int
  mlp_dim: int


# Standard ViT sizes (Dosovitskiy et al.; Zhai et al. for M and g). Depth and
# width set the parameter count; the patch size is the "/p" suffix.
VARIANTS = {
    "mu": Variant(64, 2, 2, 256),      # a micro model for unit tests
    "Ti": Variant(192, 12, 3, 768),
    "S": Variant(384, 12, 6, 1536),
    "M": Variant(512, 12, 8, 2048),
    "B": Variant(768, 12, 12, 3072),
    "L": Variant(1024, 24, 16, 4096),
    "H": Variant(1280, 32, 16, 5120),
    "g": Variant(1408, 40, 16, 6144),
}


def parse_variant(name: str) -> tuple[Variant, int]:
  """``"L/16"`` -> (Variant, 16). Fails early with the valid names."""
  m = re.fullmatch(r"(\w+)/(\d+)", name or "")
  if not m or m.group(1) not in VARIANTS:
    raise ValueError(
        f"unknown model variant {name!r}; use '<size>/<patch>' with size one of "
        f"{', '.join(VARIANTS)} (e.g. 'L/16', 'Ti/4')")
  return VARIANTS[m.group(1)], int(m.group(2))


def depth(model_cfg) -> int:
  """The number of blocks ``model_cfg`` builds: ``model.depth`` where set (> 0),
  else its variant's."""
  variant, _ = parse_variant(model_cfg.variant)
  return int(model_cfg.get("depth", 0) or variant.depth)



class Block(nn.Module):
  """Pre-LayerNorm Transformer block: x + attn(LN(x)); x + mlp(LN(x)).

  ``context`` (read-out): tokens that give the attention keys and values
  only; the block then computes ``x``'s outputs alone. ``cache_len``:
  decoding with a key/value cache. ``two_stream``: the block on the
  two-stream model's content and query streams, one set of parameters.
  """
  num_heads: int
  mlp_dim: int
  causal: bool = True
  drop_path: float | jax.Array = 0.0   # traced in a scanned stack (ScanBlock)
  dtype: Any = jnp.float32
  cache_len: int = 0

  def setup(self):
    self.norm1 = layers.LayerNorm(self.dtype)
    self.attn = attention_lib.Attention(self.num_heads, self.causal, self.dtype, self.cache_len)
    self.norm2 = layers.LayerNorm(self.dtype)
    self.mlp = layers.Mlp(self.mlp_dim, self.dtype)
    self.drop = layers.DropPath(self.drop_path)

  def __call__(self, x, rope=None, mask=None, deterministic: bool = True, context=None):
    context = None if context is None else self.norm1(context)
    x = x + self.drop(self.attn(self.norm1(x), rope, mask, context=context), deterministic)
    return x + self.drop(self.mlp(self.norm2(x)), deterministic)

  def two_stream(self, h, g, rope_h, rope_g, deterministic: bool = True):
    dh, dg = self.attn(self.norm1(h), rope_h, queries=self.norm1(g), query_rope=rope_g)
    h, g = h + self.drop(dh, deterministic), g + self.drop(dg, deterministic)
    return (h + self.drop(self.mlp(self.norm2(h)), deterministic),
            g + self.drop(self.mlp(self.norm2(g)), deterministic))


class ScanBlock(nn.Module):
  """``Block`` in the (carry, x) -> (carry, y) form that ``nn.scan`` wants.

  ``rate`` is the scanned input: this layer's drop path rate (a traced
  scalar, one entry of the stack's per-layer rates), or None for a stack
  without drop path. ``emit``: return each layer's output as the scan's
  output (the backbone's ``block_XX``), or nothing (the decoder reads only
  the last)."""
  block_kwargs: dict
  deterministic: bool = True
  emit: bool = True

  @nn.compact
  def __call__(self, x, rate, rope, mask):
    kwargs = self.block_kwargs if rate is None else {**self.block_kwargs, "drop_path": rate}
    x = Block(**kwargs, name="block")(x, rope, mask, self.deterministic)
    return x, (x if self.emit else None)


def scan_blocks(block: type, length: int, name: str, **kwargs) -> nn.Module:
  """``length`` layers of ``block`` (a ``ScanBlock``, possibly rematerialised)
  as one ``nn.scan``: parameters (and fp8 histories) stacked on a leading
  layer axis under ``<name>/block``, one dropout key per layer, the drop
  path rates scanned (``in_axes=0``), RoPE tables and mask the same for
  every layer."""
  stack = nn.scan(block, variable_axes={"params": 0, fp8.COLLECTION: 0},
                  split_rngs={"params": True, "dropout": True},
                  in_axes=(0, nn.broadcast, nn.broadcast), length=length)
  return stack(name=name, **kwargs)


REMAT_POLICIES = {"full": None,
                  "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class ViT(nn.Module):
  """Causal (or full-attention) ViT over a sequence of patch tokens.

  Call with ordered patches ``[B, T, P]`` and their integer grid positions
  ``rows``/``cols`` and 1D ``index`` (``[B or 1, T]``; index = position in the
  ordering + 1, so index 0 is the SOS slot). ``prepend_sos`` puts the learned
  start-of-sequence token in front (T + 1 outputs).

  Returns a dict: ``features`` (final LayerNorm output, ``[B, T', D]``) and
  ``block_XX`` (each block's residual-stream output, for per-layer probes).
  ``mask`` (``[B or 1, 1, T', T']``, True = attend; ``prefix_causal_mask``)
  replaces the causal or full attention pattern.

  ``cache_len > 0`` (``with_cache``): the next tokens of a sequence run
  against a key/value cache (``apply(..., mutable=["cache"])``), giving the
  full forward pass's outputs at those positions.
  """
  width: int
  depth: int
  num_heads: int
  mlp_dim: int
  posenc: str = "rope2d"
  reference_grid: tuple[int, int] = (14, 14)
  rope_max_wavelength: float = 10_000.0
  causal: bool = True
  drop_path: float = 0.0
  dtype: Any = jnp.float32
  scan_layers: bool = False
  remat: str = "none"   # none | full | save_dots
  cache_len: int = 0

  def drop_path_rates(self) -> list[float]:
    """Each block's drop path rate: from 0 at the first block linearly up to
    ``drop_path`` at the last."""
    return [self.drop_path * i / max(self.depth - 1, 1) for i in range(self.depth)]

  def _block_kwargs(self, i: int) -> dict:
    return dict(num_heads=self.num_heads, mlp_dim=self.mlp_dim, causal=self.causal,
                drop_path=self.drop_path_rates()[i], dtype=self.dtype,
                cache_len=self.cache_len)

  def embed_tokens(self, patches, rows, cols, index, grid_hw, prepend_sos: bool):
    """Patch embedding, additive positions, SOS and the RoPE tables.

    Called from a compact ``__call__`` (this one's or a subclass's), so the
    parameters it creates keep the backbone's names. Returns ``x [B, T', D]``
    and ``rope`` (``(cos, sin)`` tables ``[B, T', head_dim/2]``, or None).
    """
    posenc_lib.check_posenc(self.posenc)
    x = nn.Dense(self.width, dtype=self.dtype, kernel_init=DENSE_INIT,
                 name="patch_embed")(patches)
    x = x + self.additive_positions(rows, cols, grid_hw, x.dtype)
    rows_f, cols_f, index_f = self.scaled_positions(rows, cols, index, grid_hw)
    if prepend_sos:
      sos = self.param("sos", nn.initializers.normal(0.02), (self.width,), jnp.float32)
      x = jnp.concatenate([jnp.broadcast_to(sos.astype(x.dtype),
                                            (x.shape[0], 1, self.width)), x], 1)
      lead = rows_f.shape[:-1] + (1,)
      sos_row, sos_col, sos_index = posenc_lib.sos_position(grid_hw, self.reference_grid)
      rows_f = jnp.concatenate([jnp.full(lead, sos_row), rows_f], -1)
      cols_f = jnp.concatenate([jnp.full(lead, sos_col), cols_f], -1)
      index_f = jnp.concatenate([jnp.full(lead, sos_index), index_f], -1)
    return x, self.rope_tables(rows_f, cols_f, index_f)

  def scaled_positions(self, rows, cols, index, grid_hw):
    """float32 positions, interpolated onto the reference grid (rows and
    columns by the grid's ratio, the 1D index by the token count's)."""
    sy, sx = posenc_lib.interpolation_scale(grid_hw, self.reference_grid)
    si = posenc_lib.index_scale(grid_hw, self.reference_grid)
    # Per-example (e.g. permuted) and shared positions may be mixed: broadcast.
    return tuple(jnp.broadcast_arrays(jnp.asarray(rows, jnp.float32) * sy,
                                      jnp.asarray(cols, jnp.float32) * sx,
                                      jnp.asarray(index, jnp.float32) * si))

  def additive_positions(self, rows, cols, grid_hw, dtype):
    """The sin-cos / learned embedding to add (0 for NoPE and RoPE)."""
    if self.posenc == "sincos2d":
      r, c, _ = self.scaled_positions(rows, cols, rows, grid_hw)
      return posenc_lib.sincos_2d(r, c, self.width).astype(dtype)
    if self.posenc == "learned":
      return posenc_lib.LearnedPosEmbedding(
          tuple(self.reference_grid), self.width, name="pos_embed")(
              rows, cols, grid_hw).astype(dtype)
    return jnp.zeros((), dtype)

  def rope_tables(self, rows_f, cols_f, index_f):
    """``(cos, sin)`` for rotary encodings, else None: ``[1, T, head_dim/2]``
    when every image has the same positions (one table for the batch, which
    ops.self_attention can keep inside its kernels), ``[B, T, head_dim/2]``
    when positions are per image."""
    if self.posenc not in posenc_lib.ROTARY:
      return None
    angles = posenc_lib.rope_angles(self.posenc, self.width // self.num_heads,
                                    self.rope_max_wavelength, index_f, rows_f, cols_f)
    if angles.ndim == 2:
      angles = angles[None]
    return posenc_lib.rope_cos_sin(angles)

  @nn.compact
  def __call__(self, patches, rows, cols, index, grid_hw, *, prepend_sos: bool = True,
               train: bool = False, mask=None):
    if self.cache_len and not self.causal:
      raise ValueError("cached decoding needs a causal backbone (model.causal=True)")
    if self.remat not in ("none", *REMAT_POLICIES):
      raise ValueError(f"unknown remat {self.remat!r}; valid: none, {', '.join(REMAT_POLICIES)}")
    x, rope = self.embed_tokens(patches, rows, cols, index, grid_hw, prepend_sos)
    if (not self.is_initializing() and not self.cache_len and self.remat == "none"
        and (self.drop_path == 0 or not train)):
      # The kernels may run the whole stack as one unit on these parameters
      # (ops.block_stack): the same function as the blocks below.
      out = ops.block_stack(self.variables["params"], x, rope, mask, depth=self.depth,
                            num_heads=self.num_heads, causal=self.causal, dtype=self.dtype,
                            scanned=self.scan_layers, block_code=FUSED_BLOCK_CODE,
                            histories=self.variables.get(fp8.COLLECTION))
      if out is not None:
        return out
    out = {}
    if self.scan_layers:
      scan_cls = ScanBlock if self.remat == "none" else nn.remat(
          ScanBlock, policy=REMAT_POLICIES[self.remat])
      # Drop path's per-layer rates enter as the scan's input, one per layer.
      rates = (jnp.asarray(self.drop_path_rates(), jnp.float32)
               if train and self.drop_path else None)
      stack = scan_blocks(scan_cls, self.depth, "blocks",
                          block_kwargs=self._block_kwargs(0), deterministic=not train)
      x, ys = stack(x, rates, rope, mask)
      out.update({f"block_{i:02d}": ys[i] for i in range(self.depth)})
    else:
      block_cls = Block if self.remat == "none" else nn.remat(
          Block, policy=REMAT_POLICIES[self.remat], static_argnums=(4,))
      for i in range(self.depth):
        x = block_cls(**self._block_kwargs(i), name=f"block_{i:02d}")(x, rope, mask, not train)
        out[f"block_{i:02d}"] = x
    out["features"] = layers.LayerNorm(self.dtype, name="norm")(x)
    return out


# The code that the fused stack (ops.block_stack, kernels/fused_stack.py)
# re-implements. After an edit to any of it the plain blocks run, with a
# warning, until the change is ported to the fused stack.
FUSED_BLOCK_CODE = (Block, ScanBlock, ViT.__call__, attention_lib.Attention,
                    layers.DenseParams, layers.LayerNorm, layers.Mlp, layers.DropPath)


def prefix_causal_mask(prefix, length: int):
  """Prefix-causal attention over ``length`` tokens ``[SOS, x_0, x_1 ..]``:
  the SOS token and the first ``prefix[b]`` patches (tokens ``0 ..
  prefix[b]``) attend to each other both ways, every later token causally.
  ``prefix [B]`` int -> ``[B, 1, length, length]`` (True = attend)."""
  i = jnp.arange(length)[:, None]
  j = jnp.arange(length)[None, :]
  return (j <= jnp.maximum(i, jnp.asarray(prefix)[:, None, None]))[:, None]


def with_cache(vit: ViT, cache_len: int) -> ViT:
  """``vit`` for cached decoding (``ViT.cache_len``): the same parameter
  tree unscanned (pass scanned parameters through ``unscan_params``)."""
  return vit.clone(parent=None, cache_len=cache_len, scan_layers=False, remat="none")


def vit_from_config(model_cfg, *, image_size: int | None = None, causal=None,
                    dtype=None) -> tuple[ViT, int]:
  """Builds the backbone from ``config.model``; returns (module, patch_size).

  ``model_cfg`` keys: variant ("L/16"), optional width/depth/num_heads/mlp_dim
  overrides, image_size, reference_image_size (the resolution positions were
  trained at; defaults to image_size), posenc, rope_max_wavelength, causal,
  dtype, drop_path, scan_layers, remat. Which kernels run is not the
  model's business: ``config.kernels`` (darl_jax/ops.py).
  """
  variant, patch = parse_variant(model_cfg.variant)
  get = lambda k, d=None: model_cfg.get(k, d) if hasattr(model_cfg, "get") else getattr(model_cfg, k, d)
  size = image_size or get("image_size")
  ref = get("reference_image_size") or get("image_size")
  for s in (size, ref):
    if s % patch:
      raise ValueError(f"image size {s} is not divisible by patch size {patch}; choose "
                       f"an image_size that is a multiple of {patch}")
  module = ViT(
      width=get("width") or variant.width,
      depth=get("depth") or variant.depth,
      num_heads=get("num_heads") or variant.num_heads,
      mlp_dim=get("mlp_dim") or variant.mlp_dim,
      posenc=posenc_lib.check_posenc(get("posenc", "rope2d")),
      reference_grid=(ref // patch, ref // patch),
      rope_max_wavelength=get("rope_max_wavelength", 10_000.0),
      causal=get("causal", True) if causal is None else causal,
      drop_path=get("drop_path", 0.0),
      dtype=dtype_from_name(dtype or get("dtype", "float32")),
      scan_layers=get("scan_layers", False),
      remat=get("remat", "none"))
  return module, patch


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def dtype_from_name(name):
  if not isinstance(name, str):
    return name
  if name not in DTYPES:
    raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
  return DTYPES[name]


def unscan_params(params: dict, depth: int) -> dict:
  """Backbone parameters of ``scan_layers=True`` (stacked under ``blocks/block``)
  -> the per-block ``block_XX`` layout; other trees are returned as they are."""
  if not layer_layout.is_stack(params.get(layer_layout.SCANNED)):
    return params
  return layer_layout.unstack(params, [f"block_{i:02d}" for i in range(depth)])
