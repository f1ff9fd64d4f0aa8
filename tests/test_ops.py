"""darl_jax/ops.py: the kernel choice and the fused block stack.

- The fused stack (kernels/fused_stack.py, ``ops.block_stack`` under
  ``kernels.norm='triton'``; Pallas's interpreter on CPU) is the plain
  blocks: the same features, block outputs and gradients (parameters and
  input) on the same parameters, unrolled and scanned, causal and full; and
  where it does not apply (drop path in training, remat) the plain blocks
  run.
- ``ops.resolve`` / ``describe`` / ``configure`` and the config's check of
  ``config.kernels``.
- ``ops.using`` restores the previous choice, whatever happens inside.
"""

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import config_lib, ops
from darl_jax.kernels import fused_stack
from darl_jax.models import vit
from test_kernels import perturbed, vit_inputs

H100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                       compute_capability="9.0")
A100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB",
                       compute_capability="8.0")


def _rel(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))


def _tiny_vit(**kw):
  return vit.ViT(64, 2, 2, 128, reference_grid=(4, 4), **kw)


# ------------------------------------------------------------------ the fused stack


def _features_and_grads(model, params, args, readout, norm, train=False):
  """The backbone's outputs, and the gradients w.r.t. the parameters and the
  input patches of a random readout of all of them, under ``norm``."""
  def f(p, patches):
    out = model.apply({"params": p}, patches, *args[1:], train=train)
    total = sum(jnp.sum(out[k].astype(jnp.float32) * readout[i])
                for i, k in enumerate(sorted(out)))
    return total, out

  with ops.using(norm=norm):   # a fresh function: traced under this choice
    return jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(params, args[0])


# (dtype, tolerance of the outputs, of the gradients). bf16: the stack adds
# in the norm kernels exactly as XLA adds (layer_norm.py's invariant), but
# the norms' outputs are rounded from the kernel's float32 arithmetic and
# XLA's, which differ in the last place.
F32 = (jnp.float32, 1e-5, 1e-4)
BF16 = (jnp.bfloat16, 1.5e-2, 3e-2)


@pytest.mark.parametrize("scan_layers,causal,precision", [
    (False, True, F32), (True, True, F32), (False, False, F32), (True, False, F32),
    (False, True, BF16)], ids=["unrolled", "scan", "unrolled_full", "scan_full", "bf16"])
def test_the_fused_stack_is_the_plain_blocks(monkeypatch, scan_layers, causal, precision):
  dtype, tol_out, tol_grad = precision
  runs = []
  monkeypatch.setattr(fused_stack, "run", lambda *a, _f=fused_stack.run, **kw:
                      runs.append(kw["scanned"]) or _f(*a, **kw))
  model = _tiny_vit(causal=causal, scan_layers=scan_layers, dtype=dtype)
  args = vit_inputs(2, 4)
  params = perturbed(model.init(jax.random.key(1), *args)["params"])   # norms off 1 and 0
  readout = jax.random.normal(jax.random.key(3), (3, 2, 16, 64))
  (_, want), (g_want, dx_want) = _features_and_grads(model, params, args, readout, "xla")
  assert not runs
  (_, got), (g_got, dx_got) = _features_and_grads(model, params, args, readout, "triton")
  assert runs == [scan_layers]   # traced once, as the unit
  assert got.keys() == want.keys() == {"features", "block_00", "block_01"}
  for key in want:
    assert got[key].dtype == want[key].dtype == dtype, key
    assert _rel(got[key], want[key]) < tol_out, (key, _rel(got[key], want[key]))
  assert jax.tree.structure(g_got) == jax.tree.structure(g_want)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_got), jax.tree.leaves(g_want)):
    assert a.dtype == b.dtype and _rel(a, b) < tol_grad, (jax.tree_util.keystr(path), _rel(a, b))
  assert _rel(dx_got, dx_want) < tol_grad, _rel(dx_got, dx_want)


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scan"])
def test_the_fused_stack_scales_fp8_from_the_same_histories(monkeypatch, scan_layers):
  """Under precision='fp8' the fused stack reads each dense layer's history
  (the model's ``fp8`` collection) as the plain blocks do: the same outputs,
  and the same records (the histories' cotangents), within fp8 rounding."""
  from darl_jax import fp8
  runs = []
  monkeypatch.setattr(fused_stack, "run", lambda *a, _f=fused_stack.run, **kw:
                      runs.append(kw["histories"] is not None) or _f(*a, **kw))
  model = _tiny_vit(scan_layers=scan_layers, dtype=jnp.bfloat16)
  args = vit_inputs(2, 4)
  with ops.using(precision="fp8"):
    variables = model.init(jax.random.key(1), *args)
  params = perturbed(variables["params"])
  histories = jax.tree.map(lambda h: h.at[..., 0, 2].set(4.0).at[..., 1, 0].set(0.05),
                           variables[fp8.COLLECTION])
  readout = jax.random.normal(jax.random.key(3), (3, 2, 16, 64))

  def f(p, h):
    out = model.apply({"params": p, fp8.COLLECTION: h}, *args, train=False)
    return sum(jnp.sum(out[k].astype(jnp.float32) * readout[i])
               for i, k in enumerate(sorted(out))), out

  results = {}
  for norm in ("xla", "triton"):
    with ops.using(norm=norm, precision="fp8"):
      results[norm] = jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(params, histories)
  assert runs == [True]
  (_, want), (_, records_want) = results["xla"]
  (_, got), (_, records_got) = results["triton"]
  for key in want:
    assert _rel(got[key], want[key]) < 0.06, (key, _rel(got[key], want[key]))   # fp8 rounding
  assert jax.tree.structure(records_got) == jax.tree.structure(histories)
  for a, b in zip(jax.tree.leaves(records_got), jax.tree.leaves(records_want)):
    assert np.all(np.asarray(b)[..., :, 0] > 0) and not np.any(np.asarray(b)[..., :, 1:])
    np.testing.assert_allclose(a, b, rtol=5e-2)


@pytest.mark.parametrize("kw,train,fused", [
    ({"drop_path": 0.5}, True, False),          # drop path in training: the plain blocks
    ({"drop_path": 0.5}, False, True),          # drop path off in evaluation: fused
    ({"remat": "full"}, False, False),
    ({"remat": "save_dots", "scan_layers": True}, False, False)],
    ids=["drop_path_train", "drop_path_eval", "remat", "remat_scan"])
def test_the_plain_blocks_run_where_the_fused_stack_does_not_apply(monkeypatch, kw, train,
                                                                   fused):
  """Drop path in training and remat run the plain blocks (each norm the
  plain kernel, no add inside a norm); the trace shows which ran."""
  if not fused:
    monkeypatch.setattr(fused_stack, "run", lambda *a, **k: pytest.fail("the fused stack ran"))
  model = _tiny_vit(**kw)
  args = vit_inputs(2, 4)
  params = model.init(jax.random.key(1), *args)["params"]
  with ops.using(norm="triton"):
    jaxpr = str(jax.make_jaxpr(lambda p: model.apply(
        {"params": p}, *args, train=train, rngs={"dropout": jax.random.key(2)}))(params))
  assert "layer_norm_fwd" in jaxpr   # the norms are the kernels either way
  assert ("add_bias_layer_norm_fwd" in jaxpr) == fused
  assert "add_layer_norm_fwd" not in jaxpr


def test_initialisation_and_decoding_run_the_plain_blocks(monkeypatch):
  """``init`` (the parameters do not exist yet) and cached decoding take the
  plain blocks under norm='triton', with the same parameter tree."""
  monkeypatch.setattr(fused_stack, "run", lambda *a, **k: pytest.fail("the fused stack ran"))
  model = _tiny_vit()
  args = vit_inputs(1, 4)
  params = model.init(jax.random.key(1), *args)["params"]
  with ops.using(norm="triton"):
    assert (jax.tree.structure(jax.eval_shape(lambda: model.init(jax.random.key(1), *args)))
            == jax.tree.structure({"params": params}))
    cached = vit.with_cache(model, 16)
    out, _ = jax.eval_shape(lambda p: cached.apply({"params": p}, *args, mutable=["cache"]),
                            params)
  assert out["features"].shape == (1, 16, 64)


def test_the_fused_stack_is_written_for_the_models_block():
  """kernels/fused_stack.py re-implements the model's block; it records the
  block code it implements. If this fails, the block, the attention, the
  layers or the backbone's stack changed: port the change to
  fused_stack.py (test_the_fused_stack_is_the_plain_blocks checks it), then
  set its WRITTEN_FOR to the digest below."""
  digest = ops.block_digest(vit.FUSED_BLOCK_CODE)
  assert fused_stack.WRITTEN_FOR == digest, digest


def test_an_edited_block_runs_the_plain_blocks(monkeypatch):
  """Once the model's block code differs from the fused stack's, the
  triton norms run the plain blocks (no fused add), never the stale fused
  block, and say so once."""
  monkeypatch.setattr(fused_stack, "WRITTEN_FOR", "an older block")
  monkeypatch.setattr(fused_stack, "run", lambda *a, **k: pytest.fail("the fused stack ran"))
  warnings = []
  monkeypatch.setattr(ops, "_warn_once", warnings.append)
  model = _tiny_vit()
  args = vit_inputs(2, 4)
  params = model.init(jax.random.key(1), *args)["params"]
  with ops.using(norm="triton"):
    jaxpr = str(jax.make_jaxpr(lambda p: model.apply({"params": p}, *args))(params))
  assert "layer_norm_fwd" in jaxpr and "add_bias_layer_norm_fwd" not in jaxpr
  assert warnings and "fused_stack.py" in warnings[0] and "models.vit.Block" in warnings[0]
  assert repr(ops.block_digest(vit.FUSED_BLOCK_CODE)) in warnings[0]   # the value to set


def test_the_block_digest_reads_code_not_docstrings_or_comments():
  code = 'class A:\n  """Doc."""\n  x: int = 1  # a note\n\n  def f(self):\n    """More."""\n    return f"{self.x}"\n'
  same = 'class A:\n  """Other doc."""\n  x: int = 1\n  def f(self):\n    return f"{self.x}"  # why\n'
  other = code.replace("= 1", "= 2")
  assert ops._code_text(code) == ops._code_text(same) != ops._code_text(other)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_norm_kernel_is_xlas_layer_norm(dtype):
  """ops.layer_norm under norm='triton' and 'xla': the same values and
  gradients (x, scale, bias), leading axes of any shape."""
  k = jax.random.split(jax.random.key(0), 4)
  x = (2 * jax.random.normal(k[0], (3, 7, 80)) + 1).astype(dtype)
  scale, bias = 1 + 0.2 * jax.random.normal(k[1], (80,)), 0.2 * jax.random.normal(k[2], (80,))
  readout = jax.random.normal(k[3], x.shape)

  def run(norm):
    f = lambda x, s, b: jnp.sum(ops.layer_norm(x, s, b, dtype=dtype).astype(jnp.float32)
                                * readout)
    with ops.using(norm=norm):
      return ops.layer_norm(x, scale, bias, dtype=dtype), jax.grad(f, (0, 1, 2))(x, scale, bias)

  (y_t, g_t), (y_x, g_x) = run("triton"), run("xla")
  tol = 1e-6 if dtype == jnp.float32 else 5e-3
  assert y_t.dtype == y_x.dtype == dtype and _rel(y_t, y_x) < tol
  for a, b in zip(g_t, g_x):
    assert a.dtype == b.dtype and _rel(a, b) < max(tol, 1e-5)


# ------------------------------------------------------------------ the choice


def test_resolve_auto_on_cpu():
  assert ops.resolve(None) == ops.Kernels(attention="auto", mlp="xla", norm="xla")
  auto = {"attention": "auto", "mlp": "auto", "norm": "auto"}
  for dtype in ("float32", "bfloat16"):
    assert ops.resolve(auto, dtype) == ops.Kernels("auto", "xla", "xla")
  # a missing or empty entry is auto
  assert ops.resolve({"attention": "xla", "mlp": ""}) == ops.Kernels("xla", "xla", "xla")
  assert ops.resolve(config_lib.base_config().kernels) == ops.Kernels("auto", "xla", "xla")


def test_resolve_keeps_explicit_values():
  for choice in ({"attention": "cudnn", "mlp": "hopper", "norm": "triton"},
                 {"attention": "hopper", "mlp": "xla", "norm": "xla"},
                 {"attention": "xla", "mlp": "hopper", "norm": "xla"}):
    assert dataclasses.asdict(ops.resolve(choice, "float32")) == choice


def test_resolve_on_a_hopper_gpu(monkeypatch):
  """auto: the Hopper kernels and the Triton norms on sm_90 in bfloat16, not
  in float32 and not on other GPUs; explicit values still win."""
  auto = {"attention": "auto", "mlp": "auto", "norm": "auto"}
  monkeypatch.setattr(jax, "devices", lambda *a: [H100])
  assert ops.on_hopper()
  assert ops.resolve(auto, "bfloat16") == ops.Kernels("hopper", "hopper", "triton")
  assert ops.resolve(None, "bfloat16") == ops.Kernels("hopper", "hopper", "triton")
  assert ops.resolve(auto, "float32") == ops.Kernels("auto", "xla", "xla")
  assert ops.resolve({"attention": "cudnn", "norm": "xla"}, "bfloat16") == ops.Kernels(
      "cudnn", "hopper", "xla")
  monkeypatch.setattr(jax, "devices", lambda *a: [A100])
  assert not ops.on_hopper()
  assert ops.resolve(auto, "bfloat16") == ops.Kernels("auto", "xla", "xla")


@pytest.mark.parametrize("op,value,valid", [("attention", "flash", "auto, xla, cudnn, hopper"),
                                            ("mlp", "fast", "auto, xla, hopper"),
                                            ("norm", "apex", "auto, xla, triton")])
def test_unknown_values_name_the_valid_ones(op, value, valid):
  with pytest.raises(ValueError, match=f"unknown kernels.{op} '{value}'; valid: {valid}$"):
    ops.resolve({op: value})
  with pytest.raises(ValueError, match=f"unknown kernels.{op} '{value}'; valid: {valid}$"):
    ops.Kernels(**{op: value})
  config = config_lib.base_config()
  config_lib.validate(config)   # the defaults pass
  config.kernels[op] = value
  with pytest.raises(config_lib.ConfigError,
                     match=f"config.kernels.{op} must be one of {valid}, got '{value}'"):
    config_lib.validate(config)


def test_describe_says_what_runs_and_what_auto_chose(monkeypatch):
  monkeypatch.setattr(jax, "devices", lambda *a: [H100])
  asked = {"attention": "cudnn", "mlp": "auto", "norm": "auto"}
  chosen = ops.resolve(asked, "bfloat16")
  assert ops.describe(asked, chosen) == (
      "kernels on NVIDIA H100 80GB HBM3: attention=cudnn, mlp=hopper (auto), "
      "norm=triton (auto)")
  assert ops.describe(None, ops.Kernels()) == (
      "kernels on NVIDIA H100 80GB HBM3: attention=xla (auto), mlp=xla (auto), "
      "norm=xla (auto)")


def test_configure_sets_the_choice_for_what_is_traced_next():
  chosen = ops.configure({"attention": "xla", "mlp": "auto", "norm": "triton"})
  assert chosen == ops.current() == ops.Kernels("xla", "xla", "triton")
  x, scale, bias = jnp.ones((2, 8)), jnp.ones((8,)), jnp.zeros((8,))
  assert "layer_norm_fwd" in str(jax.make_jaxpr(
      lambda x: ops.layer_norm(x, scale, bias, dtype=jnp.float32))(x))
  ops.configure(None)
  assert ops.current() == ops.Kernels("auto", "xla", "xla")
  assert "pallas_call" not in str(jax.make_jaxpr(
      lambda x: ops.layer_norm(x, scale, bias, dtype=jnp.float32))(x))


def test_using_restores_the_previous_choice():
  before = ops.current()
  with ops.using(norm="triton") as inside:
    assert ops.current() is inside
    assert inside == dataclasses.replace(before, norm="triton")
    with ops.using(mlp="hopper", attention="cudnn"):
      assert ops.current() == ops.Kernels("cudnn", "hopper", "triton")
    assert ops.current() is inside
  assert ops.current() is before
  # on an exception inside, too
  with pytest.raises(RuntimeError, match="inside"):
    with ops.using(attention="hopper", mlp="hopper", norm="triton"):
      raise RuntimeError("inside")
  assert ops.current() is before
  # a choice that is not valid changes nothing
  with pytest.raises(ValueError, match="unknown kernels.norm 'fast'"):
    with ops.using(norm="fast"):
      pass
  assert ops.current() is before
