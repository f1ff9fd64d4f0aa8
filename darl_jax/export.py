"""Export a DARL backbone (and optionally its patch decoder) to safetensors + JSON.

    python -m darl_jax.export --checkpoint=<workdir | checkpoints dir | step dir> \\
        --out=<file>.safetensors [--with_decoder] [--step=N] [--config_json=<path>] \
        [--use_ema | --no-use_ema]

Exit status (darl_jax/cli.py, as every command): 0 written; 1 the export
could not be made (no DARL checkpoint at the path, a damaged one, no EMA
with ``--use_ema``, an unwritable ``--out``); 2 bad input, one ``error:``
line (an unknown or missing flag, a value of the wrong type, a
``--config_json`` that does not exist).

writes ``<file>.safetensors`` (float32 tensors under PyTorch names, see
``docs/EXPORT.md``) and ``<file>.json``, the *sidecar*: everything needed to
rebuild the network without this code base (sizes, positional encoding and its
exact channel layout, SOS position, mask mode, LayerNorm eps, GELU flavour,
read-out). The sidecar is also embedded in the safetensors header metadata
(key ``darl_sidecar``), so a lone ``.safetensors`` file still loads. The pair
is replaced as a unit (``commit_pair``): an export killed at any moment leaves
no tensors file beside another export's sidecar.
``darl_jax/torch_backbone.py`` rebuilds the backbone in PyTorch from the pair.

Export needs neither PyTorch nor a model: the parameters come from
``checkpoint.restore_params`` as host numpy arrays, the config from the same
checkpoint's meta (the config it was trained with; a ``config.json`` that a
later command rewrote does not matter; checkpoints from before the meta held
the config fall back to the workdir's ``config.json``), and the tensors are
written with ``safetensors.numpy``. The weights are the checkpoint's EMA of
the parameters where it has one (``config.ema_decay > 0``; darl_jax/ema.py),
else its parameters: ``--use_ema`` insists on the EMA (an error where there
is none), ``--no-use_ema`` takes the parameters; the sidecar's ``source``
records which (``weights``).

Name and layout conventions (Flax -> PyTorch):

* Dense ``kernel [in, out]`` -> ``weight [out, in]`` (``nn.Linear``); LayerNorm
  ``scale`` -> ``weight``.
* The fused attention projection ``qkv/kernel [D, 3, H, hd]`` -> ``qkv.weight
  [3 * H * hd, D]``, output rows in ``(q|k|v, head, head_dim)`` order (timm's
  layout); ``out/kernel [H, hd, D]`` -> ``proj.weight [D, H * hd]``.
* ``block_XX`` -> ``blocks.<i>``; with ``model.scan_layers`` the stacked
  ``blocks/block`` parameters (leading axis = depth) are unstacked, so both
  layouts export identically.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import ml_collections
import numpy as np
from etils import epath

from darl_jax import cli as cli_lib
from darl_jax import layer_layout
from darl_jax import ops
from darl_jax.models import decoders as decoders_lib
from darl_jax.models import posenc as posenc_lib
from darl_jax.models import vit as vit_lib

FORMAT = "darl_jax.backbone"
FORMAT_VERSION = 1
SIDECAR_METADATA_KEY = "darl_sidecar"
SINCOS_TEMPERATURE = 10_000.0   # posenc.sincos_2d's default, the one ViT.__call__ uses
# PatchDecoder.mlp_ratio default; decoder_from_config never overrides it.
DECODER_MLP_RATIO = decoders_lib.PatchDecoder.mlp_ratio


class ExportError(ValueError):
  """The checkpoint is not a DARL checkpoint, or cannot be written in the format."""


# ------------------------------------------------------------------ config


def load_config(config_path) -> dict:
  """Reads a resolved config (``config.json``) and checks it describes a DARL model."""
  try:
    config = json.loads(epath.Path(config_path).read_text())
  except json.JSONDecodeError as e:
    raise ExportError(f"{config_path} is not valid JSON: {e}") from e
  return check_config(config, config_path)


def check_config(config, where) -> dict:
  """``config`` if it describes a DARL model (has ``model.variant``)."""
  model = config.get("model") if isinstance(config, dict) else None
  if not isinstance(model, dict) or "variant" not in model:
    raise ExportError(f"{where} is not a DARL config: it has no model.variant "
                      "(expected the config.json a darl_jax training run writes)")
  return config


def backbone_spec(config: dict) -> dict:
  """The sidecar's ``backbone`` section, resolved from ``config["model"]``.

  Resolution goes through ``vit_lib.vit_from_config``, the function training
  uses, so width/depth overrides and the reference resolution mean the same here.
  """
  model_cfg = config["model"]
  try:
    vit, patch = vit_lib.vit_from_config(ml_collections.ConfigDict(model_cfg))
  except ValueError as e:
    raise ExportError(f"config.model cannot be built: {e}") from e
  head_dim = vit.width // vit.num_heads
  image_size = int(model_cfg["image_size"])
  ref_size = int(model_cfg.get("reference_image_size") or image_size)
  spec = {
      "variant": model_cfg["variant"],
      "width": vit.width, "depth": vit.depth, "num_heads": vit.num_heads,
      "head_dim": head_dim, "mlp_dim": vit.mlp_dim,
      "patch_size": patch, "channels": int(model_cfg.get("channels", 3)),
      "image_size": image_size, "reference_image_size": ref_size,
      "reference_grid": list(vit.reference_grid),
      # patches.patchify: pixels of a patch flattened in (row, col, channel) order.
      "patch_layout": "row_col_channel",
      "input_range": [-1.0, 1.0],
      "sos_token": True,                  # set from the parameters on export
      "posenc": vit.posenc,
      # Other grids: rows and columns are multiplied by reference_grid / grid
      # (sin-cos, RoPE), the 1D index by the ratio of token counts, the SOS
      # slot's column by the column ratio; the learned table is resized
      # (posenc.py module docstring). "scale_positions" (older exports)
      # left the index and the SOS slot unscaled.
      "position_interpolation": "scale_positions_and_index",
      "rope": None, "sincos": None, "learned": None,
      "attention": {"mask": "causal" if vit.causal else "full",
                    "qkv_layout": "qkv_head_headdim", "scale": "1/sqrt(head_dim)",
                    "softmax_dtype": "float32"},
      "block": "pre_layernorm", "layer_norm_eps": ops.LN_EPS,
      "mlp_activation": "gelu_exact", "final_norm": True,
      # A fine-tuning run's head.readout, else heads.Classifier's default and
      # the paper's: the last patch token.
      "readout": (config.get("head") or {}).get("readout") or "last",
  }
  if vit.posenc in posenc_lib.ROTARY:
    spec["rope"] = {
        "max_wavelength": float(vit.rope_max_wavelength),
        # Frequencies per rotated quantity: hd/2 for the 1D index, hd/4 each for
        # row and column in 2D; inv_timescale_i = max_wavelength ** (-i / n).
        "num_frequencies": head_dim // 2 if vit.posenc == "rope1d" else head_dim // 4,
        "channel_layout": "rotate_half",      # channel j pairs with j + hd/2
        # rope2d: the first hd/4 pairs turn with the row, the next hd/4 with the column.
        "pairs_2d": "rows_then_cols",
        "sos_position": {"row": posenc_lib.SOS_ROW, "col": posenc_lib.SOS_COL,
                         "index": 0},
        "first_patch_index": 1,
        "dtype": "float32",
    }
  elif vit.posenc == "sincos2d":
    spec["sincos"] = {"temperature": SINCOS_TEMPERATURE,
                      "num_frequencies": vit.width // 4,
                      "layout": "sin_row_cos_row_sin_col_cos_col",
                      "sos": "none"}          # the SOS token gets no position vector
  elif vit.posenc == "learned":
    spec["learned"] = {"table_shape": [*vit.reference_grid, vit.width],
                       # jax.image.resize(..., "bilinear") antialiases when it
                       # shrinks; torch F.interpolate(antialias=True) matches it
                       # both ways (tests/test_export.py).
                       "resize": "bilinear_half_pixel_antialias",
                       "sos": "none"}
  return spec


def decoder_spec(config: dict, backbone: dict) -> dict:
  """The sidecar's ``decoder`` section (``--with_decoder``)."""
  if "decoder" not in config:
    raise ExportError("--with_decoder: the config has no decoder section")
  patch_dim = backbone["patch_size"] ** 2 * backbone["channels"]
  try:
    dec = decoders_lib.decoder_from_config(
        config["decoder"], patch_dim=patch_dim, backbone_width=backbone["width"],
        backbone_heads=backbone["num_heads"], dtype=np.float32)
  except ValueError as e:
    raise ExportError(f"config.decoder cannot be built: {e}") from e
  loss = config.get("loss", {})
  return {
      "kind": dec.kind, "depth": dec.depth, "width": dec.width,
      "num_heads": dec.num_heads, "mlp_ratio": DECODER_MLP_RATIO,
      "gamma_conditioning": dec.gamma_conditioning, "patch_dim": patch_dim,
      "layer_norm_eps": ops.LN_EPS, "mlp_activation": "gelu_exact",
      "reference": "darl_jax/models/decoders.py PatchDecoder",
      "loss": loss.get("kind", "mse"), "predict": loss.get("predict", "x0"),
      "noise_a": loss.get("noise_a"), "noise_b": loss.get("noise_b"),
  }


# ------------------------------------------------------------- parameters


def _unstack_scan(backbone: dict, depth: int) -> dict:
  """``blocks/block`` (scan_layers, leading axis = depth) -> ``block_00 ..``."""
  if "blocks" not in backbone:
    return backbone
  stacked = backbone["blocks"]
  if set(stacked) != {"block"}:
    raise ExportError(f"scanned blocks hold {sorted(stacked)}, expected only 'block'")
  out = {k: v for k, v in backbone.items() if k != "blocks"}

  def take(tree, i):
    if isinstance(tree, dict):
      return {k: take(v, i) for k, v in tree.items()}
    if tree.shape[0] != depth:
      raise ExportError(f"scanned block parameter of shape {tree.shape} does not "
                        f"have the model depth {depth} as its leading axis")
    return tree[i]

  for i in range(depth):
    out[f"block_{i:02d}"] = take(stacked["block"], i)
  return out


def _module_name(name: str) -> str:
  m = re.fullmatch(r"block_(\d+)", name)
  if m:
    return f"blocks.{int(m.group(1))}"
  return {"out": "proj"}.get(name, name)


def _convert_layer(name: str, node: dict, path: str) -> dict[str, np.ndarray]:
  """One Dense / DenseGeneral / LayerNorm parameter dict -> nn.Linear / nn.LayerNorm."""
  f32 = lambda a: np.asarray(a, np.float32)
  if set(node) == {"scale", "bias"}:
    return {f"{path}.weight": f32(node["scale"]), f"{path}.bias": f32(node["bias"])}
  if set(node) != {"kernel", "bias"}:
    raise ExportError(f"parameter {path} holds {sorted(node)}; the export format "
                      "knows Dense (kernel, bias) and LayerNorm (scale, bias) only")
  kernel, bias = f32(node["kernel"]), f32(node["bias"])
  if name == "qkv" and kernel.ndim == 4:       # [D, 3, H, hd] -> [3*H*hd, D]
    return {f"{path}.weight": kernel.reshape(kernel.shape[0], -1).T,
            f"{path}.bias": bias.reshape(-1)}
  if name == "out" and kernel.ndim == 3:       # [H, hd, D] -> [D, H*hd]
    return {f"{path}.weight": kernel.reshape(-1, kernel.shape[-1]).T, f"{path}.bias": bias}
  if kernel.ndim == 2:
    return {f"{path}.weight": kernel.T, f"{path}.bias": bias}
  raise ExportError(f"parameter {path}/kernel has shape {kernel.shape}, which has "
                    "no nn.Linear equivalent")


def torch_tensors(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
  """A Flax parameter tree -> flat ``{torch_name: float32 array}``."""
  out = {}
  for name, node in tree.items():
    path = prefix + _module_name(name)
    if isinstance(node, dict) and ("kernel" in node or "scale" in node):
      out.update(_convert_layer(name, node, path))
    elif isinstance(node, dict):
      out.update(torch_tensors(node, path + "."))
    else:
      out[path] = np.asarray(node, np.float32)
  return out


def expected_backbone_shapes(spec: dict) -> dict[str, tuple]:
  """Every tensor name of an exported backbone and its shape."""
  d, m = spec["width"], spec["mlp_dim"]
  p = spec["patch_size"] ** 2 * spec["channels"]
  shapes = {"patch_embed.weight": (d, p), "patch_embed.bias": (d,),
            "norm.weight": (d,), "norm.bias": (d,)}
  if spec["sos_token"]:
    shapes["sos"] = (d,)
  if spec["posenc"] == "learned":
    shapes["pos_embed"] = tuple(spec["learned"]["table_shape"])
  for i in range(spec["depth"]):
    b = f"blocks.{i}."
    shapes.update({
        b + "norm1.weight": (d,), b + "norm1.bias": (d,),
        b + "attn.qkv.weight": (3 * d, d), b + "attn.qkv.bias": (3 * d,),
        b + "attn.proj.weight": (d, d), b + "attn.proj.bias": (d,),
        b + "norm2.weight": (d,), b + "norm2.bias": (d,),
        b + "mlp.fc1.weight": (m, d), b + "mlp.fc1.bias": (m,),
        b + "mlp.fc2.weight": (d, m), b + "mlp.fc2.bias": (d,)})
  return shapes


def backbone_tensors(backbone_params: dict, spec: dict) -> dict[str, np.ndarray]:
  """Backbone params (plain or scanned) -> checked torch-named tensors.

  Sets ``spec["sos_token"]`` from the parameters (a classifier fine-tuned with
  ``sos=False`` has no SOS token).
  """
  tree = _unstack_scan(dict(backbone_params), spec["depth"])
  tensors = torch_tensors(tree)
  if "pos_embed.table" in tensors:
    tensors["pos_embed"] = tensors.pop("pos_embed.table")
  spec["sos_token"] = "sos" in tensors
  want = expected_backbone_shapes(spec)
  problems = [f"unexpected {k} {v.shape}" for k, v in sorted(tensors.items()) if k not in want]
  problems += [f"missing {k}" for k in sorted(want) if k not in tensors]
  problems += [f"{k} has shape {tensors[k].shape}, the config implies {want[k]}"
               for k in sorted(want) if k in tensors and tensors[k].shape != want[k]]
  if problems:
    raise ExportError("the backbone parameters cannot be expressed in the export "
                      f"format for this config ({spec['variant']}, posenc "
                      f"{spec['posenc']}): " + "; ".join(problems[:10]))
  return tensors


# ------------------------------------------------------------------ writing


def sidecar_path(out) -> epath.Path:
  return epath.Path(str(out)[:-len(".safetensors")] + ".json")


def export_params(params: dict, config: dict, out: str, *, with_decoder: bool = False,
                  source: dict | None = None) -> tuple[epath.Path, epath.Path]:
  """Writes ``params`` (``{"backbone": ..., ["decoder": ...]}``) to ``out`` + sidecar.

  Args:
    params: a DARL parameter tree as nested dicts of arrays (numpy or jax).
    config: the resolved config as a dict (``config.json`` contents).
    out: the ``.safetensors`` path; the sidecar goes beside it as ``.json``.
    with_decoder: also write the patch decoder under ``decoder.*``.
    source: provenance recorded in the sidecar (checkpoint path, step).

  Returns:
    ``(safetensors path, sidecar path)``.
  """
  from safetensors import numpy as st_numpy

  if not str(out).endswith(".safetensors"):
    raise ExportError(f"--out must end in .safetensors, got {out!r}")
  if not isinstance(params, dict) or "backbone" not in params:
    keys = sorted(params) if isinstance(params, dict) else type(params).__name__
    raise ExportError("not a DARL checkpoint: its params have no 'backbone' subtree "
                      f"(top-level keys: {keys})")
  spec = backbone_spec(config)
  tensors = backbone_tensors(params["backbone"], spec)
  decoder = None
  if with_decoder:
    if "decoder" not in params:
      raise ExportError("--with_decoder: the checkpoint has no 'decoder' parameters "
                        f"(top-level keys: {sorted(params)}); it is not a pretraining "
                        "checkpoint")
    decoder = decoder_spec(config, spec)
    # A scanned decoder's stacked blocks export as its unrolled block_<i>.
    unrolled = layer_layout.unscan(dict(params["decoder"]), name=lambda i: f"block_{i}")
    tensors.update(torch_tensors(unrolled, "decoder."))
  model_cfg, loss = config["model"], config.get("loss", {})
  sidecar = {
      "format": FORMAT, "format_version": FORMAT_VERSION, "dtype": "float32",
      "tensors_file": epath.Path(out).name,
      "backbone": spec,
      "decoder": decoder,
      "pretraining": {
          "trainer": config.get("trainer"),
          "loss": loss.get("kind"), "norm_pix": bool(loss.get("norm_pix", False)),
          "ordering": model_cfg.get("ordering", "raster"),
          "ordering_block": model_cfg.get("ordering_block"),
          "compute_dtype": model_cfg.get("dtype", "float32"),
          "scan_layers": bool(model_cfg.get("scan_layers", False)),
      },
      "source": dict(source or {}),
  }
  text = json.dumps(sidecar, indent=2, sort_keys=True)
  out_path = epath.Path(out)
  json_path = sidecar_path(out_path)

  def write_tensors(path):
    st_numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                       os.fspath(path), metadata={"format": "pt", SIDECAR_METADATA_KEY: text})

  commit_pair(out_path, write_tensors, json_path, text + "\n")
  return out_path, json_path


def _fsync(path, directory: bool = False) -> None:
  fd = os.open(os.fspath(path), os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def commit_pair(data_path: epath.Path, write_data, json_path: epath.Path,
                sidecar: str) -> None:
  """Replaces the pair ``(data_path, json_path)`` so that a reader never sees a
  tensors file beside another export's sidecar, whatever moment the writer dies.

  Both are written whole to temporary names beside them (``write_data(path)``
  writes the tensors file) and synced; then the old sidecar goes, the tensors
  file is renamed into place, and the sidecar last. The tensors file embeds
  the same sidecar (``SIDECAR_METADATA_KEY``), which the loader reads when
  ``<file>.json`` is missing, so each moment in between leaves a whole
  export: the previous pair, the previous tensors file alone, the new
  tensors file alone, or the new pair. Local paths (safetensors writes files).
  """
  directory = data_path.parent
  directory.mkdir(parents=True, exist_ok=True)
  tag = f".tmp-{os.getpid()}"
  tmp_data = directory / f".{data_path.name}{tag}"
  tmp_json = directory / f".{json_path.name}{tag}"
  try:
    write_data(tmp_data)
    _fsync(tmp_data)
    tmp_json.write_text(sidecar)
    _fsync(tmp_json)
    if json_path.exists():
      json_path.unlink()
      _fsync(directory, directory=True)
    tmp_data.replace(data_path)
    _fsync(directory, directory=True)
    tmp_json.replace(json_path)
    _fsync(directory, directory=True)
  finally:
    for tmp in (tmp_data, tmp_json):
      if tmp.exists():
        tmp.unlink()


def export(checkpoint: str, out: str, *, with_decoder: bool = False,
           step: int | None = None, config_json: str | None = None,
           use_ema: bool | None = None):
  """Reads a DARL checkpoint and its config and writes the export (see module doc).

  The config is ``config_json`` if given, else the one stored in the
  checkpoint (``checkpoint.stored_config``). ``use_ema``: the checkpoint's
  EMA weights (True), its parameters (False); None: the EMA where it has one."""
  from darl_jax import checkpoint as checkpoint_lib
  from darl_jax import ema as ema_lib

  if config_json:
    config = load_config(config_json)
    backbone_spec(config)        # fail on a bad config before reading any array
  elif not epath.Path(checkpoint).exists():
    raise ExportError(f"no DARL checkpoint at {checkpoint}: the path does not exist")
  try:
    params, meta = checkpoint_lib.restore_params(checkpoint, step=step, use_ema=use_ema)
  except FileNotFoundError as e:     # its message names what was expected
    raise ExportError(str(e)) from e
  except ema_lib.MissingEmaError as e:
    raise ExportError(f"{e}: leave out --use_ema to export its parameters") from e
  except KeyError as e:              # a checkpoint whose state has no params
    raise ExportError(f"not a DARL checkpoint: {e.args[0]}") from e
  except checkpoint_lib.CheckpointDamagedError as e:
    raise ExportError(str(e)) from e
  if not config_json:
    try:
      config = check_config(checkpoint_lib.stored_config(checkpoint, meta),
                            f"the config of {checkpoint}")
    except (FileNotFoundError, ValueError) as e:
      raise ExportError(f"{e}; or give the config with --config_json=<path>") from e
  source = {"checkpoint": str(checkpoint), "step": meta.get("step", step),
            "weights": meta.get("restored_weights", "params")}
  return export_params(params, config, out, with_decoder=with_decoder, source=source)


def main(argv: list[str] | None = None) -> int:
  # argparse, not absl flags: absl registers flags globally at import, which
  # would clash with other CLIs' --checkpoint/--step in one test process.
  # cli_lib.ArgumentParser: a flag error is one ``error:`` line, status 2.
  parser = cli_lib.ArgumentParser(prog="python -m darl_jax.export",
                                  description=__doc__.split("\n\n")[0])
  parser.add_argument("--checkpoint", required=True,
                      help="workdir, <workdir>/checkpoints or <workdir>/checkpoints/<step>")
  parser.add_argument("--out", required=True, help="output <file>.safetensors")
  parser.add_argument("--with_decoder", action="store_true",
                      help="also export the patch decoder (decoder.* tensors)")
  parser.add_argument("--step", type=int, default=None,
                      help="checkpoint step (default: the newest)")
  parser.add_argument("--config_json", default=None,
                      help="a config.json to use instead of the config stored in the "
                           "checkpoint (needed only for checkpoints that lack it)")
  parser.add_argument("--use_ema", action=argparse.BooleanOptionalAction, default=None,
                      help="export the checkpoint's EMA of the parameters (--no-use_ema: "
                           "its parameters); default: the EMA where the checkpoint has one")
  args = parser.parse_args(argv)
  if args.config_json and not epath.Path(args.config_json).exists():
    parser.error(f"the --config_json file {args.config_json} does not exist")
  from darl_jax import checkpoint as checkpoint_lib
  checkpoint_lib.drop_closed_loop_reports()
  try:
    st_path, json_path = export(args.checkpoint, args.out, with_decoder=args.with_decoder,
                                step=args.step, config_json=args.config_json,
                                use_ema=args.use_ema)
  except ExportError as e:
    print(f"error: {cli_lib.one_line(e)}", file=sys.stderr)
    return cli_lib.FAILED
  print(f"wrote {st_path} and {json_path}")
  return 0


def cli(argv: list[str] | None = None):
  """The command: ``main``, and anything else it raises (an unwritable
  --out, a bug) one line too (darl_jax/cli.py)."""
  sys.exit(cli_lib.guarded(main, argv))


if __name__ == "__main__":
  cli()
