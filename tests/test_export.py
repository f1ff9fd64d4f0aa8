"""Flax -> safetensors -> PyTorch export: parity, the CLI, and its error messages.

Parity is checked in float32 on tiny models with random (not initial) weights,
so every LayerNorm scale, bias and position table matters. Tolerance:
``|torch - flax| <= ATOL + RTOL * |flax|`` elementwise on ``features`` and every
``block_XX`` output, ATOL = 1e-4 and RTOL = 1e-5, on outputs up to ~10 in
magnitude. Observed: at most 3e-6 against eager Flax (most tests run Flax op by
op), up to 5e-5 against jitted or scanned Flax, which differs from eager Flax
by the same 5e-5 (XLA fuses and approximates erf/exp differently); so the
PyTorch port is as close to Flax as Flax is to itself.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from etils import epath

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import export
from darl_jax import metrics as metrics_lib
from darl_jax import patches as patches_lib
from darl_jax.models import darl as darl_lib
from darl_jax.models import heads
from darl_jax.models import vit as vit_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
ATOL, RTOL = 1e-4, 1e-5


def _have_torch() -> bool:
  try:
    import torch  # noqa: F401  (the parity tests import it anyway)
  except ImportError:
    return False
  return True


HAVE_TORCH = _have_torch()
requires_torch = pytest.mark.skipif(
    not HAVE_TORCH, reason="PyTorch is not installed; the Flax->PyTorch parity tests need "
    "it (pip install -c constraints.txt -e '.[test]')")


# ------------------------------------------------------------------ helpers


def model_config(**over) -> dict:
  """A tiny backbone config (mu/2 on 8x8: a 4x4 patch grid, width 64, 2 heads)."""
  model = dict(variant="mu/2", image_size=8, channels=1, posenc="rope2d",
               rope_max_wavelength=100.0, causal=True, reference_image_size=0,
               scan_layers=False)
  model.update(over)
  return {"model": model}


def random_params(module, *args, seed=0, **kwargs):
  """Parameters of ``module`` with random values of realistic scale (no compile:
  shapes come from ``jax.eval_shape``). Kernels ~ N(0, 1/fan_in), LayerNorm
  scales ~ 1 + N(0, 0.2^2), everything else ~ N(0, 0.5^2)."""
  shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *args, **kwargs))
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    name = str(path[-1].key)
    parent = str(path[-2].key) if len(path) > 1 else ""
    shape = leaf.shape
    if name == "kernel":
      fan_in = shape[0] if parent == "qkv" else math.prod(shape[:-1])
      return rng.normal(0, fan_in ** -0.5, shape).astype(np.float32)
    if name == "scale":
      return (1 + rng.normal(0, 0.2, shape)).astype(np.float32)
    return rng.normal(0, 0.5, shape).astype(np.float32)

  return jax.tree_util.tree_map_with_path(fill, shapes["params"])


def images(b, h, w, c=1, seed=0):
  return np.random.default_rng(seed).uniform(-1, 1, (b, h, w, c)).astype(np.float32)


def to_torch(x):
  import torch
  return torch.from_numpy(np.array(x))


def assert_outputs_close(torch_out, flax_out, keys=None):
  keys = keys or list(flax_out)
  assert set(keys) <= set(torch_out)
  for k in keys:
    np.testing.assert_allclose(torch_out[k].detach().numpy(), np.asarray(flax_out[k]),
                               atol=ATOL, rtol=RTOL, err_msg=k)


def load_torch(path):
  from darl_jax.torch_backbone import DarlBackbone
  return DarlBackbone.from_exported(path).eval()


def torch_forward(model, x_nhwc, **kw):
  import torch
  with torch.no_grad():
    return model(to_torch(x_nhwc).permute(0, 3, 1, 2), **kw)


def classifier_case(tmp_path, name, readout="last", sos=True, **over):
  """A Flax Classifier with random weights, its export, and the torch model."""
  cfg = model_config(**over)
  backbone, patch = vit_lib.vit_from_config(ml_collections.ConfigDict(cfg["model"]))
  clf = heads.Classifier(backbone, patch, num_classes=3, readout=readout, sos=sos)
  params = random_params(clf, images(1, 8, 8))
  out = tmp_path / f"{name}.safetensors"
  export.export_params({"backbone": params["backbone"]}, cfg, str(out))
  return clf, params, load_torch(out)


def flax_apply(clf, params, x):
  # Eager, not jitted: the tiny models compile faster op by op, and the op
  # cache is shared between the cases of one shape (B = 3, 8x8).
  return clf.apply({"params": params}, x)


# ------------------------------------------------------------------- parity

POSENCS = ("none", "sincos2d", "learned", "rope1d", "rope2d")


@requires_torch
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("posenc", POSENCS)
def test_parity_at_training_resolution(tmp_path, posenc, causal):
  clf, params, model = classifier_case(tmp_path, "m", posenc=posenc, causal=causal)
  x = images(3, 8, 8)
  logits, out = flax_apply(clf, params, x)
  got = torch_forward(model, x)
  assert_outputs_close(got, out)
  assert got["features"].shape == (3, 1 + 16, 64)
  # The read-out matches heads.Classifier's: its logits are pooled @ head.
  head = params["head"]
  pooled = model.pool(got["features"]).numpy()
  np.testing.assert_allclose(pooled @ head["kernel"] + head["bias"], logits,
                             atol=1e-4, rtol=1e-5)


@requires_torch
@pytest.mark.parametrize("posenc", ["sincos2d", "learned", "rope1d", "rope2d"])
def test_parity_at_another_resolution(tmp_path, posenc):
  """Position interpolation (sin-cos, RoPE) and the learned table's bilinear
  resize on a 12x6 image: a 6x3 grid, enlarged 1.5x along rows and shrunk to
  0.75x along columns (jax antialiases when shrinking; so does the export).
  test_learned_table_resize_matches_jax_image_resize checks more grids."""
  clf, params, model = classifier_case(tmp_path, "m", posenc=posenc)
  x = images(3, 12, 6, seed=1)
  _, out = flax_apply(clf, params, x)
  assert_outputs_close(torch_forward(model, x), out)


@requires_torch
def test_parity_with_reference_resolution_other_than_image_size(tmp_path):
  """A model trained at 12x12 (reference grid 6x6) and configured for 8x8 input."""
  clf, params, model = classifier_case(tmp_path, "m", posenc="learned",
                                       reference_image_size=12)
  assert model.reference_grid == (6, 6)
  x = images(3, 8, 8)             # a 4x4 grid: the 6x6 table shrinks
  _, out = flax_apply(clf, params, x)
  assert_outputs_close(torch_forward(model, x), out)


@requires_torch
@pytest.mark.parametrize("readout,sos", [("mean", True), ("last", False)])
def test_readouts_and_no_sos(tmp_path, readout, sos):
  clf, params, model = classifier_case(tmp_path, "m", readout=readout, sos=sos,
                                       posenc="rope2d")
  x = images(3, 8, 8)
  logits, out = flax_apply(clf, params, x)
  got = torch_forward(model, x, sos=sos)
  assert_outputs_close(got, out)
  pooled = model.pool(got["features"], readout, sos=sos).numpy()
  np.testing.assert_allclose(pooled @ params["head"]["kernel"] + params["head"]["bias"],
                             logits, atol=1e-4, rtol=1e-5)
  if not sos:
    assert not model.has_sos and got["features"].shape[1] == 16
    with pytest.raises(ValueError, match="without an SOS token"):
      torch_forward(model, x)


@requires_torch
def test_loading_a_causal_export_without_the_mask(tmp_path):
  """``from_exported(causal=False)`` is ``vit_from_config(causal=False)`` (fine-tuning
  without the mask, the paper's better read-out setting)."""
  clf, params, _ = classifier_case(tmp_path, "m", posenc="rope2d", causal=True)
  model = load_torch(tmp_path / "m.safetensors")
  assert model.spec["attention"]["mask"] == "causal"
  from darl_jax.torch_backbone import DarlBackbone
  full = DarlBackbone.from_exported(tmp_path / "m.safetensors", causal=False).eval()
  cfg = ml_collections.ConfigDict(model_config(posenc="rope2d")["model"])
  backbone, patch = vit_lib.vit_from_config(cfg, causal=False)
  x = images(3, 8, 8)
  _, want = flax_apply(heads.Classifier(backbone, patch, num_classes=3), params, x)
  assert_outputs_close(torch_forward(full, x), want)
  assert not np.allclose(torch_forward(model, x)["features"].numpy(), want["features"])


@requires_torch
def test_forward_tokens_matches_pretraining_encoder_with_an_ordering(tmp_path):
  """``forward_tokens`` is ViT.__call__: the pretraining input [SOS, x_1..x_{N-1}]
  in nested-raster order gives DARL.encode's backbone outputs."""
  import torch
  cfg = ml_collections.ConfigDict({
      "seed": 0,
      "model": dict(model_config(ordering="nested_raster", ordering_block=2)["model"],
                    dtype="float32", drop_path=0.0, remat="none"),
      "decoder": dict(kind="linear", depth=1, width=0, num_heads=0, gamma_conditioning=False),
      "loss": dict(kind="mse", norm_pix=True),
  })
  model = darl_lib.darl_from_config(cfg)
  x = images(3, 8, 8)
  params = random_params(model, x, train=False)
  _, out = model.apply({"params": params}, x, train=False, method=darl_lib.DARL.encode)
  path = tmp_path / "pre.safetensors"
  export.export_params(params, cfg.to_dict(), str(path))
  torch_model = load_torch(path)
  order = patches_lib.make_ordering("nested_raster", 4, 4, block=2)
  tokens = np.asarray(patches_lib.patchify(x, 2))[:, order.perm]
  with torch.no_grad():
    got = torch_model.forward_tokens(
        to_torch(tokens[:, :-1]), to_torch(order.rows[None, :-1]),
        to_torch(order.cols[None, :-1]), torch.arange(1, 16)[None], (4, 4))
  assert_outputs_close(got, out)
  sidecar = json.loads(path.with_suffix(".json").read_text())
  assert sidecar["pretraining"]["ordering"] == "nested_raster"
  assert sidecar["pretraining"]["norm_pix"] is True


@requires_torch
def test_learned_table_resize_matches_jax_image_resize():
  """torch bilinear + antialias == jax.image.resize 'bilinear' both ways; without
  antialias torch matches only when enlarging (why the export uses antialias)."""
  import torch
  import torch.nn.functional as F
  from darl_jax.torch_backbone import resize_table
  table = np.random.default_rng(0).normal(size=(4, 6, 8)).astype(np.float32)
  for grid in [(8, 12), (6, 9), (2, 3), (3, 2), (1, 1), (8, 3)]:
    want = np.asarray(jax.image.resize(table, (*grid, 8), "bilinear"))
    np.testing.assert_allclose(resize_table(to_torch(table), grid).numpy(), want,
                               atol=1e-6, err_msg=str(grid))
    plain = F.interpolate(to_torch(table).permute(2, 0, 1)[None], size=grid,
                          mode="bilinear", align_corners=False, antialias=False)
    plain = plain[0].permute(1, 2, 0).numpy()
    enlarging = grid[0] >= 4 and grid[1] >= 6
    assert np.allclose(plain, want, atol=1e-6) == enlarging, grid


@requires_torch
def test_feature_map_for_dense_heads(tmp_path):
  _, _, model = classifier_case(tmp_path, "m")
  import torch
  x = images(2, 8, 12)
  out = torch_forward(model, x)
  fmap = model.feature_map(out["features"], (4, 6))
  assert fmap.shape == (2, 64, 4, 6)
  # Token of raster patch (r, c) lands at [:, :, r, c].
  torch.testing.assert_close(fmap[:, :, 2, 5], out["features"][:, 1 + 2 * 6 + 5])


@requires_torch
def test_timm_state_dict(tmp_path):
  """The timm mapping without timm (not a dependency): names, the patch-embedding
  convolution and the position table. Checked once against timm 1.0.29's
  VisionTransformer by hand: identical features and read-outs (docs/EXPORT.md)."""
  import torch
  import torch.nn.functional as F
  from darl_jax import torch_backbone as tb
  classifier_case(tmp_path, "m", posenc="learned", causal=True)
  causal = load_torch(tmp_path / "m.safetensors")
  with pytest.raises(ValueError, match="no causal mask.*causal=False"):
    tb.timm_state_dict(causal)
  model = tb.DarlBackbone.from_exported(tmp_path / "m.safetensors", causal=False)
  sd = tb.timm_state_dict(model)
  per_block = ["norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.qkv.bias",
               "attn.proj.weight", "attn.proj.bias", "norm2.weight", "norm2.bias",
               "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias"]
  assert set(sd) == {"cls_token", "pos_embed", "patch_embed.proj.weight",
                     "patch_embed.proj.bias", "norm.weight", "norm.bias"} | {
                         f"blocks.{i}.{k}" for i in range(2) for k in per_block}
  x = to_torch(images(2, 8, 8)).permute(0, 3, 1, 2)
  with torch.no_grad():
    conv = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=2)
    linear = model.patch_embed(model.patchify(x)[0])
  torch.testing.assert_close(conv.flatten(2).transpose(1, 2), linear)
  assert sd["pos_embed"].shape == (1, 17, 64) and not sd["pos_embed"][0, 0].any()
  torch.testing.assert_close(sd["pos_embed"][0, 1:], model.pos_embed.detach().reshape(16, 64))
  assert tb.timm_kwargs(model)["mlp_ratio"] == 4.0
  classifier_case(tmp_path, "r", posenc="rope2d", causal=False)
  with pytest.raises(ValueError, match="'rope2d' has no timm"):
    tb.timm_state_dict(load_torch(tmp_path / "r.safetensors"))


@requires_torch
def test_sidecar_embedded_in_safetensors_is_enough(tmp_path):
  _, _, with_json = classifier_case(tmp_path, "m", posenc="learned")
  path = tmp_path / "m.safetensors"
  path.with_suffix(".json").unlink()
  alone = load_torch(path)
  assert alone.spec == with_json.spec
  x = images(2, 8, 8)
  want = torch_forward(with_json, x)
  assert_outputs_close(torch_forward(alone, x), {k: v.numpy() for k, v in want.items()})


def _fail_at(monkeypatch, name: str):
  """Makes the export fail where it would put ``name`` in place (its write or
  rename onto that name), as a kill or a full disk at that moment would."""
  gpath = type(epath.Path("/"))
  write_text, replace = gpath.write_text, gpath.replace

  def failing_write_text(self, *args, **kwargs):
    if self.name == name:
      raise OSError(f"injected failure writing {name}")
    return write_text(self, *args, **kwargs)

  def failing_replace(self, target):
    if epath.Path(target).name == name:
      raise OSError(f"injected failure renaming onto {name}")
    return replace(self, target)

  monkeypatch.setattr(gpath, "write_text", failing_write_text)
  monkeypatch.setattr(gpath, "replace", failing_replace)


def _export_pair(path, depth: int, posenc: str):
  cfg = model_config(variant="mu/2", posenc=posenc)
  cfg["model"]["depth"] = depth
  backbone, patch = vit_lib.vit_from_config(ml_collections.ConfigDict(cfg["model"]))
  clf = heads.Classifier(backbone, patch, num_classes=3)
  params = random_params(clf, images(1, 8, 8), seed=depth)
  export.export_params({"backbone": params["backbone"]}, cfg, str(path))


def _what_the_loader_reads(path):
  """The sidecar the loader takes for ``path`` and the one the tensors file
  carries in its header (the export it belongs to)."""
  from safetensors import safe_open
  from darl_jax import torch_backbone as tb
  with safe_open(str(path), framework="numpy") as f:
    header = json.loads(f.metadata()[export.SIDECAR_METADATA_KEY])
  return tb.load_sidecar(path), header


@requires_torch
@pytest.mark.parametrize("fail_at", ["m.safetensors", "m.json"])
def test_an_export_that_fails_half_way_leaves_no_mixed_pair(tmp_path, monkeypatch, fail_at):
  """A second export over a first one fails while it puts the tensors file
  (or, after it, the sidecar) in place: the loader then reads one whole
  export, never the new tensors beside the old sidecar or the reverse."""
  out = tmp_path / "m.safetensors"
  _export_pair(out, depth=2, posenc="learned")
  first_sidecar, _ = _what_the_loader_reads(out)
  with monkeypatch.context() as patch:
    _fail_at(patch, fail_at)
    with pytest.raises(OSError, match="injected failure"):
      _export_pair(out, depth=3, posenc="rope2d")
  sidecar, header = _what_the_loader_reads(out)
  assert sidecar == header
  want_depth = 2 if fail_at == "m.safetensors" else 3
  assert sidecar["backbone"]["depth"] == want_depth
  if fail_at == "m.safetensors":
    assert sidecar == first_sidecar
  model = load_torch(out)                   # the tensors fit the sidecar it reads
  assert len(model.blocks) == want_depth
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
      {"m.safetensors", "m.json"} & {p.name for p in tmp_path.iterdir()})   # no temporaries


def test_an_export_that_fails_writing_its_tensors_keeps_the_previous_pair(tmp_path,
                                                                           monkeypatch):
  out = tmp_path / "m.safetensors"
  _export_pair(out, depth=2, posenc="learned")
  before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
  from safetensors import numpy as st_numpy

  def full_disk(tensors, filename, metadata=None):
    pathlib.Path(filename).write_bytes(b"torn")
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(st_numpy, "save_file", full_disk)
  with pytest.raises(OSError, match="No space left"):
    _export_pair(out, depth=3, posenc="rope2d")
  assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


# ------------------------------------------------------ checkpoints and CLI


def make_checkpoint(workdir, params, config: dict | None, step=1):
  """A workdir as training leaves it: config.json and checkpoints/<step>/."""
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  if config is not None:
    (workdir / "config.json").write_text(json.dumps(config))
  with checkpoint_lib.Checkpointer(str(workdir / "checkpoints"), async_save=False) as ckpt:
    ckpt.save(step, {"params": jax.tree.map(jnp.asarray, params),
                     "step": jnp.asarray(step)}, {"step": step})
  return workdir


@pytest.fixture(scope="module")
def pretrained_workdir(tmp_path_factory):
  """Two real pretraining steps of tests/tiny_config.py (MSE, linear decoder)."""
  import runpy
  from darl_jax.train import loop
  from darl_jax.train.trainers import pretrain
  config = runpy.run_path(str(ROOT / "tests" / "tiny_config.py"))["get_config"]("steps=2")
  config.eval_every_steps = 0
  config.predictions.num_images = 0
  workdir = tmp_path_factory.mktemp("tiny_pretrain")
  # TensorBoard (a TensorFlow import) is irrelevant here and costs seconds.
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(metrics_lib, "_make_tensorboard_backend", lambda logdir: None)
    loop.run(pretrain.PretrainTrainer(config), config, str(workdir))
  return workdir


def run_cli(*args):
  """``python -m darl_jax.export``; ``-X importtime`` lists every module it imported."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  return subprocess.run([sys.executable, "-X", "importtime", "-m", "darl_jax.export", *args],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def imported_modules(stderr: str) -> set[str]:
  """Module names from ``-X importtime`` lines ``import time: self | cumulative | name``."""
  return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines()
          if line.startswith("import time:") and line.count("|") == 2}


def test_cli_end_to_end_on_a_pretraining_workdir(pretrained_workdir, tmp_path):
  """The CLI on a real workdir: sidecar, decoder tensors, a step directory, and
  (with PyTorch) the rebuilt backbone against the restored Flax one. One test, so
  that pytest-xdist builds the workdir once."""
  out = tmp_path / "export" / "darl.safetensors"
  proc = run_cli(f"--checkpoint={pretrained_workdir}", f"--out={out}", "--with_decoder")
  assert proc.returncode == 0, proc.stderr[-3000:]
  # Export needs no PyTorch: importing darl_jax (export, checkpoint, models)
  # never imports it.
  modules = imported_modules(proc.stderr)
  assert {"darl_jax.checkpoint", "darl_jax.models.vit", "safetensors.numpy"} <= modules
  assert not {m for m in modules if m.split(".")[0] == "torch"}
  sidecar = json.loads(out.with_suffix(".json").read_text())
  bb = sidecar["backbone"]
  assert (bb["variant"], bb["width"], bb["depth"], bb["num_heads"], bb["mlp_dim"]) == \
      ("mu/2", 64, 2, 2, 256)
  assert (bb["patch_size"], bb["image_size"], bb["reference_image_size"], bb["channels"]) == \
      (2, 8, 8, 1)
  assert bb["posenc"] == "rope2d" and bb["attention"]["mask"] == "causal"
  assert bb["rope"] == {"max_wavelength": 100.0, "num_frequencies": 8,
                        "channel_layout": "rotate_half", "pairs_2d": "rows_then_cols",
                        "sos_position": {"row": 0.0, "col": -1.0, "index": 0},
                        "first_patch_index": 1, "dtype": "float32"}
  assert (bb["layer_norm_eps"], bb["mlp_activation"], bb["readout"]) == \
      (1e-6, "gelu_exact", "last")
  assert sidecar["source"]["step"] == 2 and sidecar["pretraining"]["norm_pix"] is False
  assert sidecar["decoder"]["kind"] == "linear"

  params, _ = checkpoint_lib.restore_params(str(pretrained_workdir))
  config = ml_collections.ConfigDict(json.loads(
      (pretrained_workdir / "config.json").read_text()))
  backbone, patch = vit_lib.vit_from_config(config.model)
  clf = heads.Classifier(backbone, patch, num_classes=1)
  x = images(3, 8, 8)
  head = {"kernel": np.zeros((64, 1), np.float32), "bias": np.zeros(1, np.float32)}
  _, want = clf.apply({"params": {"backbone": params["backbone"], "head": head}}, x)

  # The decoder tensors are nn.Linear-shaped: the linear decoder is z @ W.T + b.
  from safetensors.numpy import load_file
  tensors = load_file(str(out))
  z = np.asarray(want["features"]).reshape(-1, 64)
  dec = params["decoder"]["linear"]
  np.testing.assert_allclose(
      z @ tensors["decoder.linear.weight"].T + tensors["decoder.linear.bias"],
      z @ dec["kernel"] + dec["bias"], atol=1e-5)
  assert {k for k in tensors if k.startswith("decoder.")} == {"decoder.linear.weight",
                                                              "decoder.linear.bias"}

  # A step directory, without the decoder: exactly the backbone tensors.
  step_out = tmp_path / "bb.safetensors"
  export.export(str(pretrained_workdir / "checkpoints" / "2"), str(step_out))
  names = set(load_file(str(step_out)))
  assert names == set(export.expected_backbone_shapes(bb))

  if HAVE_TORCH:   # the rebuilt backbone == the restored Flax backbone
    assert_outputs_close(torch_forward(load_torch(out), x), want)


def test_transformer_decoder_export(tmp_path):
  """--with_decoder on the diffusion decoder: nn.Linear layouts and a sidecar entry."""
  import runpy
  from safetensors.numpy import load_file
  config = runpy.run_path(str(ROOT / "tests" / "tiny_config.py"))["get_config"](
      "objective=diffusion")
  params = random_params(darl_lib.darl_from_config(config), images(1, 8, 8), train=False)
  out = tmp_path / "d.safetensors"
  export.export_params(params, config.to_dict(), str(out), with_decoder=True)
  tensors = load_file(str(out))
  dec = params["decoder"]
  np.testing.assert_array_equal(tensors["decoder.noisy_embed.weight"],
                                dec["noisy_embed"]["kernel"].T)      # [32, 4 + gamma]
  np.testing.assert_array_equal(
      tensors["decoder.blocks.0.attn.qkv.weight"],
      dec["block_0"]["attn"]["qkv"]["kernel"].reshape(32, 96).T)
  np.testing.assert_array_equal(tensors["decoder.type_embed"], dec["type_embed"])
  n_flax = len(jax.tree.leaves(dec))
  assert len([k for k in tensors if k.startswith("decoder.")]) == n_flax
  sidecar = json.loads(out.with_suffix(".json").read_text())["decoder"]
  assert (sidecar["kind"], sidecar["width"], sidecar["num_heads"], sidecar["depth"],
          sidecar["gamma_conditioning"], sidecar["patch_dim"], sidecar["loss"]) == \
      ("transformer", 32, 2, 1, True, 4, "diffusion")


@requires_torch
def test_scan_layers_checkpoint_is_unstacked(tmp_path):
  cfg = model_config(scan_layers=True, posenc="rope1d")
  backbone, patch = vit_lib.vit_from_config(ml_collections.ConfigDict(cfg["model"]))
  clf = heads.Classifier(backbone, patch, num_classes=2)
  params = random_params(clf, images(1, 8, 8))
  assert params["backbone"]["blocks"]["block"]["attn"]["qkv"]["kernel"].shape[0] == 2
  workdir = make_checkpoint(tmp_path / "scan", params, cfg)
  out = tmp_path / "scan.safetensors"
  assert export.main([f"--checkpoint={workdir}/checkpoints", f"--out={out}"]) == 0
  x = images(3, 8, 8)
  assert_outputs_close(torch_forward(load_torch(out), x), flax_apply(clf, params, x)[1])


# ------------------------------------------------------------------ errors


def test_cli_error_for_a_path_that_is_not_a_workdir(tmp_path):
  proc = run_cli(f"--checkpoint={tmp_path}", f"--out={tmp_path / 'x.safetensors'}")
  assert proc.returncode == 1
  assert "error:" in proc.stderr and "no DARL checkpoint found" in proc.stderr
  assert "checkpoints/<step>/ (a training workdir)" in proc.stderr


def test_errors_name_the_problem(tmp_path):
  out = str(tmp_path / "x.safetensors")
  with pytest.raises(export.ExportError, match="does not exist"):
    export.export(str(tmp_path / "missing"), out)
  # A checkpoint without a stored config whose config.json is not a DARL config.
  cfg = model_config()
  backbone, patch = vit_lib.vit_from_config(ml_collections.ConfigDict(cfg["model"]))
  params = random_params(heads.Classifier(backbone, patch, 2), images(1, 8, 8))
  make_checkpoint(tmp_path / "other", params, {"lr": 0.1})
  with pytest.raises(export.ExportError, match="not a DARL config"):
    export.export(str(tmp_path / "other"), out)
  # ... and one without any config.
  make_checkpoint(tmp_path / "bare", params, None)
  with pytest.raises(export.ExportError, match="holds no config.*--config_json"):
    export.export(str(tmp_path / "bare"), out)
  # A DARL config but no checkpoint.
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "config.json").write_text(json.dumps(model_config()))
  with pytest.raises(export.ExportError, match="no DARL checkpoint found"):
    export.export(str(tmp_path / "empty"), out)
  # A config that cannot be built.
  with pytest.raises(export.ExportError, match="cannot be built.*variant"):
    export.backbone_spec(model_config(variant="huge/3"))
  with pytest.raises(export.ExportError, match="must end in .safetensors"):
    export.export_params({"backbone": {}}, model_config(), str(tmp_path / "x.pt"))


def test_checkpoint_without_backbone_or_decoder(tmp_path):
  out = str(tmp_path / "x.safetensors")
  foreign = make_checkpoint(tmp_path / "foreign", {"encoder": {"w": np.ones((2, 2))}},
                            model_config())
  with pytest.raises(export.ExportError, match="no 'backbone' subtree.*encoder"):
    export.export(str(foreign), out)

  cfg = model_config()
  backbone, patch = vit_lib.vit_from_config(ml_collections.ConfigDict(cfg["model"]))
  params = random_params(heads.Classifier(backbone, patch, 2), images(1, 8, 8))
  with pytest.raises(export.ExportError, match="no 'decoder' parameters.*'backbone', 'head'"):
    export.export_params(params, cfg, out, with_decoder=True)


def test_parameters_that_do_not_fit_the_format_are_refused(tmp_path):
  cfg = model_config()
  backbone, patch = vit_lib.vit_from_config(ml_collections.ConfigDict(cfg["model"]))
  params = random_params(heads.Classifier(backbone, patch, 2), images(1, 8, 8))
  out = str(tmp_path / "x.safetensors")
  extra = dict(params["backbone"], adapter={"kernel": np.ones((64, 8), np.float32),
                                            "bias": np.ones(8, np.float32)})
  with pytest.raises(export.ExportError, match="cannot be expressed.*unexpected adapter"):
    export.export_params({"backbone": extra}, cfg, out)
  # Parameters of another width than the config says.
  with pytest.raises(export.ExportError, match=r"has shape \(64,\), the config implies \(32,\)"):
    export.export_params({"backbone": params["backbone"]},
                         model_config(width=32, num_heads=2, mlp_dim=64), out)
  assert not os.path.exists(out)


@requires_torch
def test_torch_loader_errors(tmp_path):
  from safetensors.numpy import save_file
  from darl_jax.torch_backbone import DarlBackbone
  path = tmp_path / "plain.safetensors"
  save_file({"w": np.ones(2, np.float32)}, str(path))
  with pytest.raises(ValueError, match="not a darl_jax export"):
    DarlBackbone.from_exported(path)
  _, _, model = classifier_case(tmp_path, "m")
  with pytest.raises(ValueError, match="multiples of 2"):
    torch_forward(model, images(1, 7, 8))
  spec = dict(model.spec, rope=dict(model.spec["rope"], channel_layout="interleaved"))
  with pytest.raises(NotImplementedError, match="RoPE layout interleaved"):
    DarlBackbone(spec)
