"""Partition rules (FSDP, tensor parallelism), mesh layout, and a tensor-parallel run.

The numerical test trains a tiny config with FSDP x tensor parallelism in a
subprocess with 4 fake CPU devices and compares it with the replicated run of
the same config in the same process.
"""

import json
import os
import pathlib
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import sharding as sharding_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import tiny_config  # noqa: E402  pylint: disable=g-import-not-at-top
from xla_env import cpu_devices_flags  # noqa: E402


def _abstract_params(**model):
  from darl_jax import memory  # pylint: disable=g-import-not-at-top
  config = tiny_config.get_config("objective=diffusion")
  config.model.update(model)
  return memory.abstract_params(config)


def _specs(rules, mesh, **model):
  params = _abstract_params(**model)
  # Optimizer moments carry the parameter path as a suffix: same rules.
  tree = {"params": params, "opt_state": {"0": {"mu": params}}}
  specs = sharding_lib.tree_specs(tree, mesh, sharding_lib.check_rules(rules))
  flat = {}
  for path, spec in zip(jax.tree_util.tree_leaves(sharding_lib.leaf_paths(tree)),
                        jax.tree_util.tree_leaves(specs)):
    flat[path] = spec
  return flat


MESH = {"data": 2, "fsdp": 2, "tensor": 2}
BLOCK = "params/backbone/block_00/"


def test_tensor_rules_split_heads_and_mlp_hidden():
  s = _specs("tensor", MESH)
  assert s[BLOCK + "attn/qkv/kernel"] == P(None, None, "tensor", None)   # [D, 3, H, hd]
  assert s[BLOCK + "attn/qkv/bias"] == P(None, "tensor", None)           # [3, H, hd]
  assert s[BLOCK + "attn/out/kernel"] == P("tensor", None, None)         # [H, hd, D]
  assert s[BLOCK + "attn/out/bias"] == P()
  assert s[BLOCK + "mlp/fc1/kernel"] == P(None, "tensor")                # [D, F]
  assert s[BLOCK + "mlp/fc1/bias"] == P("tensor")
  assert s[BLOCK + "mlp/fc2/kernel"] == P("tensor", None)                # [F, D]
  assert s[BLOCK + "norm1/scale"] == P()
  assert s["params/backbone/patch_embed/kernel"] == P()
  # The decoder's Transformer block follows the same rules; its head does not.
  assert s["params/decoder/block_0/attn/qkv/kernel"] == P(None, None, "tensor", None)
  assert s["params/decoder/head/kernel"] == P()
  assert s["opt_state/0/mu/backbone/block_00/mlp/fc1/kernel"] == P(None, "tensor")


def test_fsdp_tensor_adds_fsdp_on_the_largest_other_axis():
  s = _specs("fsdp_tensor", MESH)
  assert s[BLOCK + "attn/qkv/kernel"] == P("fsdp", None, "tensor", None)
  assert s[BLOCK + "attn/out/kernel"] == P("tensor", None, "fsdp")
  assert s[BLOCK + "mlp/fc1/kernel"] == P("fsdp", "tensor")
  assert s[BLOCK + "mlp/fc2/kernel"] == P("tensor", "fsdp")
  assert s[BLOCK + "norm1/scale"] == P("fsdp")
  # Without a tensor axis the tensor entries vanish: plain FSDP.
  assert _specs("fsdp_tensor", {"data": 2, "fsdp": 2, "tensor": 1})[
      BLOCK + "mlp/fc1/kernel"] == P(None, "fsdp")


def test_existing_rules_keep_their_behaviour():
  s = _specs("fsdp", MESH)
  assert s[BLOCK + "mlp/fc1/kernel"] == P(None, "fsdp")     # largest axis, as before
  assert s[BLOCK + "attn/qkv/kernel"] == P("fsdp", None, None, None)
  assert set(_specs("replicated", MESH).values()) == {P()}
  with pytest.raises(ValueError, match="unknown sharding 'zero3'; valid: replicated, fsdp, "
                                       "tensor, fsdp_tensor"):
    sharding_lib.check_rules("zero3")


def test_scanned_layers_keep_the_layer_axis_whole():
  s = _specs("fsdp_tensor", MESH, scan_layers=True)
  # [L, D, 3, H, hd]: rules are right-aligned, the leading layer axis stays whole.
  assert s["params/backbone/blocks/block/attn/qkv/kernel"] == P(None, "fsdp", None, "tensor",
                                                                  None)


def test_indivisible_heads_name_the_parameter_and_the_fix():
  with pytest.raises(ValueError, match=r"attn/(qkv|out)/kernel of shape \(.*\): dimension "
                                       r"\d \(2\) does not divide by the 'tensor' mesh "
                                       r"axis \(4\); choose config.mesh.tensor"):
    _specs("tensor", {"data": 1, "fsdp": 1, "tensor": 4})


def _fake_devices(processes, per_process):
  return [types.SimpleNamespace(id=p * per_process + i, process_index=p, platform="cpu")
          for p in range(processes) for i in range(per_process)]


def test_multi_process_mesh_gives_each_process_contiguous_batch_rows():
  devices = _fake_devices(4, 2)[::-1]             # any enumeration order
  grid = sharding_lib.device_grid([2, 2, 2], devices)
  assert sharding_lib.process_layout(grid)
  # Batch shard k = data * fsdp_size + fsdp: process p holds shard p.
  owners = [[d.process_index for d in row] for row in grid.reshape(4, 2)]
  assert owners == [[0, 0], [1, 1], [2, 2], [3, 3]]
  grid = sharding_lib.device_grid([1, 8, 1], _fake_devices(2, 4))
  assert [d.process_index for d in grid.ravel()] == [0] * 4 + [1] * 4


def test_tensor_axis_across_processes_is_refused():
  with pytest.raises(ValueError, match="tensor axis \\(size 4\\) spans processes.*"
                                       "must divide the 2 local devices"):
    sharding_lib.process_layout(sharding_lib.device_grid([2, 1, 4], _fake_devices(4, 2)))


def test_make_mesh_on_the_local_device():
  mesh = sharding_lib.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
  assert dict(mesh.shape) == {"data": jax.device_count(), "fsdp": 1, "tensor": 1}
  with pytest.raises(ValueError, match="needs 2 devices"):
    sharding_lib.make_mesh({"data": 2})


def test_kernel_options_with_a_tensor_axis_get_a_warning_that_names_the_fix(monkeypatch):
  import ml_collections
  from types import SimpleNamespace
  config = ml_collections.ConfigDict({
      "model": {"dtype": "bfloat16"},
      "kernels": {"attention": "hopper", "mlp": "xla", "norm": "triton"}})
  tensor = {"data": 2, "fsdp": 1, "tensor": 2}
  text = sharding_lib.kernel_mesh_warning(config, tensor)
  assert "kernels.attention=hopper, kernels.norm=triton with mesh.tensor=2" in text
  assert "mlp=hopper" not in text and "(auto)" not in text
  assert "kernels.attention=cudnn" in text and "kernels.norm=xla" in text
  # the batch axes are split per device (kernels/per_shard.py): no warning
  assert sharding_lib.kernel_mesh_warning(config, {"data": 4, "fsdp": 2, "tensor": 1}) is None
  plain = ml_collections.ConfigDict({"model": {"dtype": "bfloat16"}, "kernels": {
      "attention": "cudnn", "mlp": "xla", "norm": "xla"}})
  assert sharding_lib.kernel_mesh_warning(plain, tensor) is None
  assert sharding_lib.kernel_mesh_warning(None, tensor) is None
  # ``auto`` counts as what it resolves to: XLA's ops here (CPU), the
  # kernels on a Hopper GPU in bfloat16
  auto = ml_collections.ConfigDict({"model": {"dtype": "bfloat16"}, "kernels": {
      "attention": "auto", "mlp": "auto", "norm": "auto"}})
  assert sharding_lib.kernel_mesh_warning(auto, tensor) is None
  hopper = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100", compute_capability="9.0")
  monkeypatch.setattr(jax, "devices", lambda *a: [hopper])
  text = sharding_lib.kernel_mesh_warning(auto, tensor)
  assert text.startswith("kernels.attention=hopper (auto), kernels.mlp=hopper (auto), "
                         "kernels.norm=triton (auto) with mesh.tensor=2"), text
  auto.model.dtype = "float32"
  assert sharding_lib.kernel_mesh_warning(auto, tensor) is None


# ------------------------------------------------------------ memory estimate
# Hand count for tests/tiny_config.py (MSE): width D=64, 2 blocks, H=2 heads,
# MLP F=256, 2x2 patches of 1 channel (P=4) on 8x8 images: T=16 tokens, fp32.
D, F, H, T, DEPTH, P_DIM = 64, 256, 2, 16, 2, 4
# qkv 3D^2+3D, out D^2+D, fc1 DF+F, fc2 FD+D, two LayerNorms 4D.
BLOCK_PARAMS = 4 * D * D + 2 * D * F + 9 * D + F                  # 49,984
# Of these, split by the tensor rules: qkv kernel+bias, out kernel, fc1, fc2 kernel.
TENSOR_PARAMS = 3 * D * D + 3 * D + D * D + D * F + F + F * D      # 49,600
# patch embedding P*D+D, SOS token D, final LayerNorm 2D, linear decoder D*P+P.
OTHER_PARAMS = (P_DIM * D + D) + D + 2 * D + (D * P_DIM + P_DIM)  # 772


def test_memory_estimate_matches_a_hand_count():
  from darl_jax import memory  # pylint: disable=g-import-not-at-top
  config = tiny_config.get_config()
  total = DEPTH * BLOCK_PARAMS + OTHER_PARAMS
  assert total == 100_740

  # The accelerators' count (backend="gpu"); XLA:CPU's own terms are
  # tests/test_memory_estimate.py's.
  estimate = lambda config, mesh, rules, batch_size: memory.estimate(
      config, mesh, rules, batch_size=batch_size, backend="gpu")
  est = estimate(config, {"data": 2, "fsdp": 2, "tensor": 1}, "fsdp", batch_size=16)
  assert est.num_params == total
  # Every leaf has an even largest axis: FSDP over 2 halves all of them.
  assert est.params == est.grads == 4 * total / 2 and est.adam == 8 * total / 2
  assert est.fsdp_buffer == 2 * 4 * BLOCK_PARAMS
  assert est.per_device_batch == 16 // (2 * 2)
  assert est.ema == 0 and est.state() == est.params + est.grads + est.adam + est.fsdp_buffer
  config.ema_decay = 0.999   # one more float32 copy of the (sharded) parameters
  with_ema = estimate(config, {"data": 2, "fsdp": 2, "tensor": 1}, "fsdp", batch_size=16)
  assert with_ema.state() - est.state() == 4 * total / 2
  config.ema_decay = 0.0
  a = 4   # float32 activations
  block = a * T * (4 * D + 4 * D + 2 * F) + (4 + a) * H * T * T     # 69,632 bytes
  # Beside the blocks: the patches (8x8 pixels), the final LayerNorm, one MLP
  # hidden layer's gradient; the float32 prediction and its error per patch.
  outside = a * 64 + a * T * D + a * T * F + 2 * 4 * T * P_DIM       # 21,248 bytes
  assert est.activations["none"] == 4 * (DEPTH * block + outside)
  assert est.activations["full"] == 4 * (DEPTH * a * T * D + block + outside)
  assert est.activations["save_dots"] == 4 * (
      DEPTH * a * T * (3 * D + 3 * D + F) + block + outside)
  assert est.update == 0 and est.total("none") == est.state() + est.activations["none"]

  est = estimate(config, {"data": 1, "fsdp": 1, "tensor": 2}, "tensor", batch_size=16)
  local = DEPTH * (TENSOR_PARAMS / 2 + BLOCK_PARAMS - TENSOR_PARAMS) + OTHER_PARAMS
  assert est.params == 4 * local and est.fsdp_buffer == 0
  block_t = a * T * (4 * D + (4 * D + 2 * F) / 2) + (4 + a) * (H / 2) * T * T
  outside_t = a * 64 + a * T * D + a * T * F / 2 + 2 * 4 * T * P_DIM
  assert est.activations["none"] == 16 * (DEPTH * block_t + outside_t)


def test_memory_cli_prints_a_table():
  from darl_jax import memory  # pylint: disable=g-import-not-at-top
  out = memory.main(["--variant=B/16", "--batch_size=4096", "--mesh=data:8,fsdp:4,tensor:1",
                     "--sharding=fsdp", "--device_gib=80"])
  header, rule, row = out.splitlines()[1:4]
  assert header.split()[:3] == ["variant", "params", "param"]
  assert row.split()[:2] == ["B/16", "95M"]   # ViT-B/16 86M + the diffusion decoder
  assert "128 per device" in out and "sharding=fsdp" in out
  with pytest.raises(ValueError, match="bad mesh entry 'model:2'"):
    memory.parse_mesh("data:2,model:2")


# ----------------------------------------------- 4 fake devices, real training

RUNS = {  # name -> (sharding, mesh)
    "replicated": ("replicated", {"data": 4, "fsdp": 1, "tensor": 1}),
    "fsdp_tensor": ("fsdp_tensor", {"data": 1, "fsdp": 2, "tensor": 2}),
}


def _run_config(rules, mesh):
  # MSE with a residual-MLP patch decoder: tensor parallelism in the backbone's
  # attention and MLP and in the decoder's MLP, at a fraction of the compile
  # time of the diffusion config (the rules for its Transformer decoder are
  # checked above).
  config = tiny_config.get_config()
  config.update(sharding=rules, total_steps=3, checkpoint_every_steps=3, eval_every_steps=0)
  config.decoder.update(kind="mlp", depth=1, width=32)
  config.mesh.update(mesh)
  config.predictions.num_images = 0
  return config


def _worker(outdir: str, precision: str = "float32") -> None:
  """Runs inside the 4-device subprocess: the loop once per entry of RUNS
  (``precision='fp8'``: bfloat16 with fp8 dense layers)."""
  from darl_jax import metrics  # pylint: disable=g-import-not-at-top
  from darl_jax.train import loop  # pylint: disable=g-import-not-at-top
  from darl_jax.train.trainers import pretrain  # pylint: disable=g-import-not-at-top
  assert jax.device_count() == 4
  result = {}
  for name, (rules, mesh) in RUNS.items():
    config = _run_config(rules, mesh)
    if precision == "fp8":
      config.model.dtype, config.precision = "bfloat16", "fp8"
    workdir = os.path.join(outdir, name)
    loop.run(pretrain.PretrainTrainer(config), config, workdir)
    result[name] = [m["loss"] for m in metrics.read_metrics(workdir) if "grad_norm" in m]
    if precision == "fp8":     # the saved histories, as read back
      import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
      state = ocp.PyTreeCheckpointer().restore(os.path.join(workdir, "checkpoints", "3", "state"))
      result[f"{name} histories"] = [
          np.asarray(h).tolist() for h in jax.tree.leaves(state["model_state"]["fp8"])]
  print("RESULT " + json.dumps(result))


def _four_devices(tmp_path, *args) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             XLA_FLAGS=cpu_devices_flags(4),
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  proc = subprocess.run([sys.executable, __file__, str(tmp_path), *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
  return json.loads(line[len("RESULT "):])


def test_tensor_parallel_training_matches_the_replicated_run(tmp_path):
  losses = _four_devices(tmp_path)
  assert len(losses["replicated"]) == 3
  # float32; the sharded matmuls and reductions sum in another order.
  np.testing.assert_allclose(losses["fsdp_tensor"], losses["replicated"], rtol=2e-5)
  ref, _ = checkpoint_lib.restore_params(str(tmp_path / "replicated"))
  got, _ = checkpoint_lib.restore_params(str(tmp_path / "fsdp_tensor"))
  paths = jax.tree_util.tree_leaves(sharding_lib.leaf_paths(ref))
  peak_lr = 2e-3 * 16 / 256
  for path, a, b in zip(paths, jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
    a, b = np.asarray(a), np.asarray(b)
    if path.endswith("attn/qkv/bias"):
      # The key bias adds q . b_k to every logit of a query: softmax cancels it,
      # so its gradient is 0 up to rounding, and Adam rescales that rounding
      # noise to steps of about the learning rate. Bound it by the steps taken.
      np.testing.assert_allclose(a[1], b[1], atol=2 * 3 * peak_lr, rtol=0)
      a, b = a[[0, 2]], b[[0, 2]]
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=0, err_msg=path)


def test_fp8_histories_train_alike_sharded_and_replicated(tmp_path):
  """fp8 training under fsdp x tensor (histories whole on every device:
  test_fp8.py) records each step's largest magnitudes over the whole batch:
  its losses and recorded magnitudes are the replicated run's, within fp8
  rounding."""
  from darl_jax import fp8  # pylint: disable=g-import-not-at-top
  losses = _four_devices(tmp_path, "fp8")
  assert len(losses["replicated"]) == 3 and np.all(np.isfinite(losses["fsdp_tensor"]))
  # bfloat16 products summed in another order, then rounded to fp8.
  np.testing.assert_allclose(losses["fsdp_tensor"], losses["replicated"], rtol=2e-2)
  sharded, replicated = losses["fsdp_tensor histories"], losses["replicated histories"]
  assert len(sharded) == len(replicated) > 0
  for a, b in zip(sharded, replicated):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape[-2:] == (2, fp8.HISTORY)
    assert np.all(b[..., :, :3] > 0) and not np.any(b[..., :, 3:])   # three steps recorded
    # The same magnitudes, not the same bits: a summation order that flips
    # one rounding of an e4m3 input (3 mantissa bits, steps of 6-12%) or an
    # e5m2 gradient (2 bits, 12-25%) moves every later layer's values.
    # Seen: inputs within 2.5%, gradients within 10%.
    np.testing.assert_allclose(a[..., 0, :], b[..., 0, :], rtol=0.1)
    np.testing.assert_allclose(a[..., 1, :], b[..., 1, :], rtol=0.25)


if __name__ == "__main__":
  _worker(*sys.argv[1:])
