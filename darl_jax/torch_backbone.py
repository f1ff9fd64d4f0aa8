"""The DARL backbone in PyTorch, rebuilt from a ``darl_jax.export`` file pair.

    from darl_jax.torch_backbone import DarlBackbone
    model = DarlBackbone.from_exported("darl.safetensors").eval()
    out = model(images)          # images [B, C, H, W] in [-1, 1]
    out["features"]              # [B, 1 + N, D]: SOS token, then N patch tokens
    out["block_05"]              # [B, 1 + N, D]: residual stream after block 5
    model.pool(out["features"])  # [B, D]: the sidecar's read-out (last | mean)
    model.feature_map(out["features"], grid_hw)   # [B, D, H/p, W/p] (ViTDet)

It reproduces ``darl_jax.models.vit.ViT`` (as ``heads.Classifier`` calls it)
in float32 within ``1e-4 + 1e-5 |x|`` (observed: 3e-6 against eager Flax; see
tests/test_export.py), for every positional encoding, causal and full
attention, and at other resolutions than the training one.

Dependencies are PyTorch and ``safetensors`` only: this module imports
nothing from ``darl_jax`` (so no JAX), and ``darl_jax`` never imports it, so
the JAX package works without PyTorch installed. It can be copied into a
PyTorch project on its own.
"""

from __future__ import annotations

import json
import pathlib

try:
  import torch
  import torch.nn.functional as F
  from torch import nn
except ImportError as e:  # pragma: no cover - exercised only without torch
  raise ImportError("darl_jax.torch_backbone needs PyTorch: pip install torch "
                    "(the pinned CPU build comes with the [test] extra)") from e

FORMAT = "darl_jax.backbone"
SUPPORTED_VERSIONS = (1,)
SIDECAR_METADATA_KEY = "darl_sidecar"
READOUTS = ("last", "mean")


# ------------------------------------------------------------------ sidecar


def load_sidecar(path) -> dict:
  """The sidecar of ``<file>.safetensors`` (or a ``.json`` path given directly).

  Prefers ``<file>.json``; falls back to the copy in the safetensors header.
  """
  path = pathlib.Path(path)
  if path.suffix == ".json":
    return json.loads(path.read_text())
  json_path = path.with_suffix(".json")
  if json_path.exists():
    return json.loads(json_path.read_text())
  from safetensors import safe_open
  with safe_open(str(path), framework="pt") as f:
    meta = f.metadata() or {}
  if SIDECAR_METADATA_KEY not in meta:
    raise ValueError(f"{path} has no sidecar ({json_path} is missing and the file's "
                     "metadata has no darl_sidecar): not a darl_jax export")
  return json.loads(meta[SIDECAR_METADATA_KEY])


def _check(cond: bool, what: str):
  if not cond:
    raise NotImplementedError(f"this torch_backbone cannot rebuild the export: {what}")


# --------------------------------------------------------------- positions


def inv_timescales(num: int, max_wavelength: float) -> torch.Tensor:
  """``max_wavelength ** (-i / num)`` for i < num; float64 math, float32 result
  (as ``posenc.rope_inv_timescales``, which uses numpy float64)."""
  i = torch.arange(num, dtype=torch.float64)
  return (max_wavelength ** (-i / num)).to(torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
  """Rotates ``x [B, T, H, hd]`` by ``cos/sin [B or 1, T, hd/2]`` ("rotate half":
  channel j pairs with j + hd/2). Runs in float32, returns ``x.dtype``."""
  dtype = x.dtype
  x = x.float()
  x1, x2 = x.chunk(2, dim=-1)
  c, s = cos[:, :, None], sin[:, :, None]
  return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(dtype)


def resize_table(table: torch.Tensor, grid_hw) -> torch.Tensor:
  """Bilinear resize of a ``[gh, gw, D]`` table to ``[*grid_hw, D]``.

  Equals ``jax.image.resize(table, (*grid_hw, D), "bilinear")``: half-pixel
  centres (``align_corners=False``) and, when shrinking, the same
  triangle-kernel antialiasing (``antialias=True``; without it torch only
  matches jax when enlarging). Checked in tests/test_export.py.
  """
  x = table.permute(2, 0, 1)[None].float()
  x = F.interpolate(x, size=tuple(grid_hw), mode="bilinear", align_corners=False,
                    antialias=True)
  return x[0].permute(1, 2, 0).to(table.dtype)


# ------------------------------------------------------------------ modules


class Attention(nn.Module):
  """Fused-qkv multi-head attention; qkv output rows are ``(q|k|v, head, hd)``."""

  def __init__(self, width: int, num_heads: int, causal: bool):
    super().__init__()
    self.num_heads, self.head_dim, self.causal = num_heads, width // num_heads, causal
    self.qkv = nn.Linear(width, 3 * width)
    self.proj = nn.Linear(width, width)

  def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
    """``x [B, T, D]``, ``rope`` = (cos, sin) ``[B or 1, T, hd/2]`` or None."""
    b, t, d = x.shape
    q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).unbind(2)
    if rope is not None:
      q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    # SDPA wants [B, H, T, hd]; its default scale is 1/sqrt(hd), as in jax.
    q, k, v = (a.transpose(1, 2) for a in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
    return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
  def __init__(self, width: int, hidden: int):
    super().__init__()
    self.fc1 = nn.Linear(width, hidden)
    self.act = nn.GELU(approximate="none")     # exact (erf) GELU, as the Flax Mlp
    self.fc2 = nn.Linear(hidden, width)

  def forward(self, x):
    return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
  """Pre-LayerNorm block: x + attn(norm1(x)); x + mlp(norm2(x))."""

  def __init__(self, width: int, num_heads: int, mlp_dim: int, causal: bool, eps: float):
    super().__init__()
    self.norm1 = nn.LayerNorm(width, eps=eps)
    self.attn = Attention(width, num_heads, causal)
    self.norm2 = nn.LayerNorm(width, eps=eps)
    self.mlp = Mlp(width, mlp_dim)

  def forward(self, x, rope=None):
    x = x + self.attn(self.norm1(x), rope)
    return x + self.mlp(self.norm2(x))


class DarlBackbone(nn.Module):
  """The causal (or full-attention) ViT of a DARL checkpoint.

  Built from the sidecar's ``backbone`` section (``spec``); weights come from
  ``load_state_dict`` of the safetensors file (``from_exported`` does both).
  """

  def __init__(self, spec: dict):
    super().__init__()
    # Every convention the forward pass hard-codes is checked against the sidecar,
    # so a future format change fails here instead of giving wrong numbers.
    for key, want in [("patch_layout", "row_col_channel"), ("block", "pre_layernorm"),
                      ("mlp_activation", "gelu_exact")]:
      _check(spec.get(key) == want, f"{key} {spec.get(key)!r}")
    # "scale_positions_and_index" also scales the 1D index and the SOS slot
    # (posenc.index_scale, posenc.sos_position); "scale_positions" did not.
    interpolation = spec.get("position_interpolation")
    _check(interpolation in ("scale_positions", "scale_positions_and_index"),
           f"position_interpolation {interpolation!r}")
    self.scale_index = interpolation == "scale_positions_and_index"
    _check(spec["attention"]["mask"] in ("causal", "full"), f"mask {spec['attention']['mask']}")
    self.spec = spec
    d = spec["width"]
    self.width, self.patch_size, self.channels = d, spec["patch_size"], spec["channels"]
    self.posenc = spec["posenc"]
    self.reference_grid = tuple(spec["reference_grid"])
    self.readout = spec.get("readout", "last")
    self.has_sos = bool(spec["sos_token"])
    self.patch_embed = nn.Linear(self.patch_size ** 2 * self.channels, d)
    if self.has_sos:
      self.sos = nn.Parameter(torch.zeros(d))
    if self.posenc == "learned":
      _check(spec["learned"]["resize"] == "bilinear_half_pixel_antialias",
             f"learned-table resize {spec['learned']['resize']}")
      self.pos_embed = nn.Parameter(torch.zeros(*spec["learned"]["table_shape"]))
    elif self.posenc == "sincos2d":
      s = spec["sincos"]
      _check(s["layout"] == "sin_row_cos_row_sin_col_cos_col", f"sin-cos layout {s['layout']}")
      self.register_buffer("sincos_inv", inv_timescales(s["num_frequencies"], s["temperature"]),
                           persistent=False)
    elif self.posenc in ("rope1d", "rope2d"):
      r = spec["rope"]
      _check(r["channel_layout"] == "rotate_half", f"RoPE layout {r['channel_layout']}")
      _check(self.posenc == "rope1d" or r["pairs_2d"] == "rows_then_cols",
             f"2D RoPE pairs {r.get('pairs_2d')}")
      self.sos_position = (r["sos_position"]["row"], r["sos_position"]["col"],
                           r["sos_position"]["index"])
      self.register_buffer("rope_inv", inv_timescales(r["num_frequencies"], r["max_wavelength"]),
                           persistent=False)
    else:
      _check(self.posenc == "none", f"positional encoding {self.posenc!r}")
    causal = spec["attention"]["mask"] == "causal"
    self.blocks = nn.ModuleList(
        Block(d, spec["num_heads"], spec["mlp_dim"], causal, spec["layer_norm_eps"])
        for _ in range(spec["depth"]))
    self.norm = nn.LayerNorm(d, eps=spec["layer_norm_eps"])

  @classmethod
  def from_exported(cls, path, *, causal: bool | None = None,
                    map_location="cpu") -> "DarlBackbone":
    """Builds the model from ``<file>.safetensors`` (+ ``<file>.json``), weights loaded
    strictly (a missing or extra backbone tensor is an error; ``decoder.*`` is skipped).

    ``causal`` overrides the exported mask, as ``vit_from_config(causal=...)``
    does in Flax: fine-tuning without the causal mask classifies better (paper
    Table "read-out": 82.7 vs 81.7 top-1 for ViT-L/16).
    """
    from safetensors.torch import load_file
    sidecar = load_sidecar(path)
    if sidecar.get("format") != FORMAT or sidecar.get("format_version") not in SUPPORTED_VERSIONS:
      raise ValueError(f"{path}: format {sidecar.get('format')!r} version "
                       f"{sidecar.get('format_version')!r} is not {FORMAT} "
                       f"{SUPPORTED_VERSIONS}")
    spec = dict(sidecar["backbone"])
    if causal is not None:
      spec["attention"] = dict(spec["attention"], mask="causal" if causal else "full")
    model = cls(spec)
    tensors = load_file(str(path), device=str(map_location))
    model.load_state_dict({k: v for k, v in tensors.items() if not k.startswith("decoder.")})
    return model

  # -------------------------------------------------------------- forward

  def patchify(self, images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """``[B, C, H, W]`` -> patches ``[B, N, p*p*C]`` (raster; pixels (row, col, channel))."""
    b, c, h, w = images.shape
    p = self.patch_size
    if c != self.channels or h % p or w % p:
      raise ValueError(f"images of shape {tuple(images.shape)} do not fit the model: "
                       f"want [B, {self.channels}, H, W] with H and W multiples of {p}")
    gh, gw = h // p, w // p
    x = images.permute(0, 2, 3, 1).reshape(b, gh, p, gw, p, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, gh * gw, p * p * c), (gh, gw)

  def forward(self, images: torch.Tensor, *, sos: bool = True) -> dict:
    """Images ``[B, C, H, W]`` in [-1, 1], any multiple of the patch size.

    All ``N = (H/p)(W/p)`` patches in raster order (behind the SOS token if
    ``sos``), as ``heads.Classifier`` feeds them. Returns ``features`` (final
    LayerNorm, ``[B, T, D]``) and ``block_XX`` (each block's output), with
    ``T = N + 1`` (SOS first) or ``N``.
    """
    patches, (gh, gw) = self.patchify(images)
    n = gh * gw
    pos = torch.arange(n, device=images.device)
    rows, cols = (pos // gw)[None], (pos % gw)[None]
    return self.forward_tokens(patches, rows, cols, (pos + 1)[None], (gh, gw), sos=sos)

  def additive_posenc(self, rows, cols, grid_hw) -> torch.Tensor | None:
    """The vectors ``sincos2d``/``learned`` add to patch tokens, ``[B or 1, T, D]``
    for grid ``rows``/``cols`` ``[B or 1, T]`` on a ``grid_hw`` grid (None otherwise)."""
    if self.posenc == "sincos2d":
      # Positions scaled onto the reference grid, as for RoPE.
      r = (rows.float() * (self.reference_grid[0] / grid_hw[0]))[..., None] * self.sincos_inv
      c = (cols.float() * (self.reference_grid[1] / grid_hw[1]))[..., None] * self.sincos_inv
      return torch.cat([r.sin(), r.cos(), c.sin(), c.cos()], -1)
    if self.posenc == "learned":
      table = self.pos_embed
      if tuple(grid_hw) != self.reference_grid:
        table = resize_table(table, grid_hw)
      return table[rows.long(), cols.long()]
    return None

  def forward_tokens(self, patches, rows, cols, index, grid_hw, *, sos: bool = True) -> dict:
    """Any token order: ``patches [B, T, P]``, grid ``rows``/``cols`` and 1D
    ``index`` (ordering position + 1) ``[B or 1, T]``, ``grid_hw`` the patch grid.

    This is ``ViT.__call__``'s signature; pretraining feeds the ordered
    ``[x_1 .. x_{N-1}]`` here (see ``DARL.encode``).
    """
    if sos and not self.has_sos:
      raise ValueError("this backbone was exported without an SOS token; call with sos=False")
    b = patches.shape[0]
    x = self.patch_embed(patches)
    # Another grid than the reference one: scale positions onto it (float32).
    sy = self.reference_grid[0] / grid_hw[0]
    sx = self.reference_grid[1] / grid_hw[1]
    si = (self.reference_grid[0] * self.reference_grid[1]) / (grid_hw[0] * grid_hw[1])
    if not self.scale_index:
      si = 1.0
    frows, fcols, findex = rows.float() * sy, cols.float() * sx, index.float() * si
    pe = self.additive_posenc(rows, cols, grid_hw)
    if pe is not None:
      x = x + pe.to(x.dtype)
    if sos:
      x = torch.cat([self.sos.to(x.dtype).expand(b, 1, self.width), x], 1)
    rope = None
    if self.posenc in ("rope1d", "rope2d"):
      if sos:   # the SOS slot's position: (row 0, col -1), index 0 (posenc.py)
        lead = frows.shape[:-1] + (1,)
        sr, sc, sos_index = self.sos_position
        if self.scale_index:
          sr, sc = sr * sy, sc * sx
        frows = torch.cat([frows.new_full(lead, sr), frows], -1)
        fcols = torch.cat([fcols.new_full(lead, sc), fcols], -1)
        findex = torch.cat([findex.new_full(lead, sos_index), findex], -1)
      if self.posenc == "rope1d":
        angles = findex[..., None] * self.rope_inv
      else:
        angles = torch.cat([frows[..., None] * self.rope_inv,
                            fcols[..., None] * self.rope_inv], -1)
      rope = (angles.cos(), angles.sin())
    out = {}
    for i, block in enumerate(self.blocks):
      x = block(x, rope)
      out[f"block_{i:02d}"] = x
    out["features"] = self.norm(x)
    return out

  # ------------------------------------------------------------- read-outs

  def pool(self, features: torch.Tensor, readout: str | None = None,
           *, sos: bool = True) -> torch.Tensor:
    """``[B, T, D] -> [B, D]``: ``last`` token (the paper's default) or ``mean``
    over the patch tokens (SOS excluded), as ``heads.Classifier``."""
    readout = readout or self.readout
    if readout not in READOUTS:
      raise ValueError(f"unknown readout {readout!r}; valid: {', '.join(READOUTS)}")
    if readout == "last":
      return features[:, -1]
    return features[:, 1:].mean(1) if sos else features.mean(1)

  @staticmethod
  def feature_map(tokens: torch.Tensor, grid_hw, *, sos: bool = True) -> torch.Tensor:
    """Patch tokens ``[B, (1 +) N, D]`` (raster) -> ``[B, D, H/p, W/p]`` for a
    dense head such as ViTDet's simple feature pyramid; the SOS token is dropped."""
    if sos:
      tokens = tokens[:, 1:]
    b, n, d = tokens.shape
    gh, gw = grid_hw
    if n != gh * gw:
      raise ValueError(f"{n} patch tokens do not form a {gh}x{gw} grid")
    return tokens.reshape(b, gh, gw, d).permute(0, 3, 1, 2)


# --------------------------------------------------------------------- timm


def timm_kwargs(model: DarlBackbone, *, global_pool: str = "avg") -> dict:
  """Constructor arguments of ``timm.models.vision_transformer.VisionTransformer``
  for the architecture ``timm_state_dict`` maps to (see docs/EXPORT.md).

  ``global_pool="avg"`` with ``fc_norm=False`` is DARL's ``mean`` read-out (final
  LayerNorm per token, then the mean over patch tokens); ``"token"`` would read
  the SOS token, which is no DARL read-out; ``last`` is
  ``forward_features(x)[:, -1]``.
  """
  spec = model.spec
  return dict(img_size=spec["image_size"], patch_size=spec["patch_size"],
              in_chans=spec["channels"], embed_dim=spec["width"], depth=spec["depth"],
              num_heads=spec["num_heads"], mlp_ratio=spec["mlp_dim"] / spec["width"],
              qkv_bias=True, class_token=model.has_sos, no_embed_class=False,
              global_pool=global_pool, fc_norm=False, num_classes=0)


def timm_state_dict(model: DarlBackbone) -> dict:
  """The backbone's weights under timm ``VisionTransformer`` names.

  Only a bidirectional (``mask == "full"``, e.g. ``from_exported(causal=False)``)
  backbone with an absolute encoding (``learned`` or ``sincos2d``) maps: timm's
  ViT has no causal mask and no RoPE. The SOS token becomes ``cls_token``;
  ``pos_embed [1, 1 + N, D]`` holds a zero row for it (DARL's SOS has no position
  vector) and the encoding of the reference grid in raster order; the linear
  patch embedding ``[D, p*p*C]`` (pixels in (row, col, channel) order) becomes
  the ``[D, C, p, p]`` convolution. Blocks and the final norm keep their names.
  """
  spec = model.spec
  if spec["attention"]["mask"] != "full":
    raise ValueError("timm's VisionTransformer has no causal mask; load the export "
                     "with DarlBackbone.from_exported(path, causal=False) to map it "
                     "(fine-tuning without the mask, as the paper's best read-out)")
  if model.posenc not in ("learned", "sincos2d"):
    raise ValueError(f"positional encoding {model.posenc!r} has no timm "
                     "VisionTransformer equivalent (it knows absolute embeddings only)")
  d, p, c = model.width, model.patch_size, model.channels
  gh, gw = model.reference_grid
  pos = torch.arange(gh * gw)
  with torch.no_grad():
    pos_embed = model.additive_posenc((pos // gw)[None], (pos % gw)[None], (gh, gw))[0]
    out = {k: v for k, v in model.state_dict().items() if k.startswith(("blocks.", "norm."))}
    out["patch_embed.proj.weight"] = (
        model.patch_embed.weight.reshape(d, p, p, c).permute(0, 3, 1, 2))
    out["patch_embed.proj.bias"] = model.patch_embed.bias
    if model.has_sos:
      out["cls_token"] = model.sos.reshape(1, 1, d)
      pos_embed = torch.cat([pos_embed.new_zeros(1, d), pos_embed])
    out["pos_embed"] = pos_embed[None]
  return {k: v.detach().clone().contiguous() for k, v in out.items()}
