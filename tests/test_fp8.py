"""config.precision='fp8' (darl_jax/fp8.py, darl_jax/ops.py): the products
within the format's tolerance, a causal model still causal, training that
tracks bf16, checkpoints that cross between precisions, and a refusal where
the hardware has no fp8 matrix units. On CPU the fp8 products run emulated."""

import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import config_lib
from darl_jax import fp8
from darl_jax import metrics as metrics_lib
from darl_jax import ops
from darl_jax import patches as patches_lib
from darl_jax import sampling
from darl_jax import sharding as sharding_lib
from darl_jax.models import darl as darl_lib
from darl_jax.train import feed as feed_lib
from darl_jax.train import loop
from darl_jax.train.trainers import finetune
from darl_jax.train.trainers import linear_probe
from darl_jax.train.trainers import pretrain

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import test_accumulate  # pylint: disable=wrong-import-position
import test_finetune  # pylint: disable=wrong-import-position
import test_models  # pylint: disable=wrong-import-position
import tiny_config  # pylint: disable=wrong-import-position


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.abs(a - b).max() / np.abs(b).max())


def _reference(x, w, axes):
  dims = (tuple(range(x.ndim - axes, x.ndim)), tuple(range(axes)))
  return jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), (dims, ((), ())))


# --------------------------------------------------------------- the products


@pytest.mark.parametrize("x_shape,w_shape,axes", [
    ((4, 6, 32), (32, 3, 2, 8), 1),      # the packed q/k/v projection
    ((4, 6, 2, 16), (2, 16, 32), 2),     # the attention output over [heads, head_dim]
    ((24, 64), (64, 48), 1)])            # an MLP layer
def test_products_and_gradients_within_the_formats_tolerance(x_shape, w_shape, axes):
  """e4m3 keeps 3 mantissa bits (rounding error up to 2^-4 of a value),
  e5m2 2 bits (2^-3): forward within 0.06 of the largest output, the
  gradients (an e5m2 factor each) within 0.12."""
  kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, x_shape).astype(jnp.bfloat16)
  w = jax.random.normal(kw, w_shape) * 0.2
  got, vjp = jax.vjp(lambda x, w: fp8.dense(x, w, axes, jnp.bfloat16), x, w)
  want, vjp_want = jax.vjp(lambda x, w: _reference(x, w, axes), x, w)
  assert got.dtype == jnp.bfloat16 and got.shape == want.shape
  assert _rel(got, want) < 0.06
  g = jax.random.normal(kg, got.shape)
  dx, dw = vjp(g.astype(jnp.bfloat16))
  dx_want, dw_want = vjp_want(g)
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32     # the inputs' dtypes
  assert _rel(dx, dx_want) < 0.12 and _rel(dw, dw_want) < 0.12
  # A kernel of zeros (a zero-initialised layer) gives zeros, not NaN.
  assert not np.any(np.asarray(fp8.dense(x, jnp.zeros(w_shape), axes, jnp.float32)))


def test_the_inputs_really_are_float8():
  x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 8))
  text = str(jax.make_jaxpr(jax.grad(
      lambda x, w: fp8.dense(x, w, 1, jnp.bfloat16).astype(jnp.float32).sum(), (0, 1)))(x, w))
  assert "f8_e4m3fn" in text and "f8_e5m2" in text
  with ops.using(precision="fp8"):
    assert "f8_e4m3fn" in str(jax.make_jaxpr(
        lambda x, w: ops.mlp(x, w, jnp.zeros(8), w, jnp.zeros(8), dtype=jnp.bfloat16))(x, w))
  assert "f8_e4m3fn" not in str(jax.make_jaxpr(
      lambda x, w: ops.mlp(x, w, jnp.zeros(8), w, jnp.zeros(8), dtype=jnp.bfloat16))(x, w))


def test_a_row_is_rounded_by_its_own_values_only():
  """Each row's scale comes from that row: a large value anywhere else in
  the batch (another image, a later patch) leaves the row's output exactly
  as it was, so evaluation does not depend on the batch."""
  x = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 16))
  w = jax.random.normal(jax.random.PRNGKey(2), (16, 8))
  base = fp8.dense(x, w, 1, jnp.float32)
  bumped = fp8.dense(x.at[2, 4].mul(1000.0).at[0, 3].set(0.0), w, 1, jnp.float32)
  np.testing.assert_array_equal(bumped[1], base[1])
  np.testing.assert_array_equal(bumped[2, :4], base[2, :4])
  np.testing.assert_array_equal(bumped[0, :3], base[0, :3])


# ------------------------------------------------------ delayed scaling


def _delayed(x, w, history, axes, dtype=jnp.bfloat16):
  return fp8.dense_delayed(x, w, history, axes, dtype)


@pytest.mark.parametrize("x_shape,w_shape,axes", [
    ((4, 6, 32), (32, 3, 2, 8), 1), ((4, 6, 2, 16), (2, 16, 32), 2), ((24, 64), (64, 48), 1)])
def test_delayed_products_and_gradients_within_the_formats_tolerance(x_shape, w_shape, axes):
  """Scales from a history that holds the tensors' largest magnitudes (one
  step earlier): the tolerances of the per-row products above."""
  kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, x_shape).astype(jnp.bfloat16)
  w = jax.random.normal(kw, w_shape) * 0.2
  g = jax.random.normal(kg, x_shape[:x.ndim - axes] + w_shape[axes:]).astype(jnp.bfloat16)
  _, vjp = jax.vjp(lambda x, w, h: _delayed(x, w, h, axes), x, w, fp8.new_history())
  history = fp8.updated_history(fp8.new_history(), vjp(g)[2])   # the first step's record
  got, vjp = jax.vjp(lambda x, w: _delayed(x, w, history, axes), x, w)
  want, vjp_want = jax.vjp(lambda x, w: _reference(x, w, axes), x, w)
  assert got.dtype == jnp.bfloat16 and got.shape == want.shape
  assert _rel(got, want) < 0.06
  dx, dw = vjp(g)
  dx_want, dw_want = vjp_want(g.astype(jnp.float32))
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  assert _rel(dx, dx_want) < 0.12 and _rel(dw, dw_want) < 0.12
  assert not np.any(np.asarray(_delayed(x, jnp.zeros(w_shape), history, axes)))
  text = str(jax.make_jaxpr(jax.grad(
      lambda x, w: _delayed(x, w, history, axes).astype(jnp.float32).sum(), (0, 1)))(x, w))
  assert "f8_e4m3fn" in text and "f8_e5m2" in text


def test_delayed_scaling_rounds_each_row_independently_of_the_batch():
  """The input's scale comes from the history, not from the batch: a large
  value in another row (another image, a later patch) leaves every other
  row's output exactly as it was."""
  x = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 16))
  w = jax.random.normal(jax.random.PRNGKey(2), (16, 8))
  history = fp8.new_history().at[0, 5].set(3.0).at[1, 0].set(0.5)
  base = _delayed(x, w, history, 1, jnp.float32)
  bumped = _delayed(x.at[2, 4].mul(1000.0).at[0, 3].set(0.0), w, history, 1, jnp.float32)
  np.testing.assert_array_equal(bumped[1], base[1])
  np.testing.assert_array_equal(bumped[2, :4], base[2, :4])
  np.testing.assert_array_equal(bumped[0, :3], base[0, :3])


def test_the_history_records_each_steps_largest_magnitudes_newest_first():
  x = jnp.array([[1.0, -3.0], [2.0, 0.5]])
  w = jnp.eye(2)
  history = fp8.new_history().at[:, 0].set(jnp.array([7.0, 0.25]))
  _, vjp = jax.vjp(lambda x, w, h: _delayed(x, w, h, 1, jnp.float32), x, w, history)
  record = vjp(jnp.array([[0.5, 0.0], [0.0, -2.0]]))[2]
  np.testing.assert_array_equal(record[:, 0], [3.0, 2.0])       # max |x|, max |dy|
  assert not np.any(np.asarray(record[:, 1:]))
  updated = fp8.updated_history(history, record)
  np.testing.assert_array_equal(updated[:, :2], [[3.0, 7.0], [2.0, 0.25]])
  assert updated.shape == (2, fp8.HISTORY)
  # Scales are powers of two, the smallest that fits: 448 is e4m3's top.
  np.testing.assert_array_equal(fp8.power_of_two_scale(jnp.array([0.0, 448.0, 449.0, 3.0]),
                                                       fp8.E4M3), [1.0, 1.0, 2.0, 2.0 ** -7])


def test_an_empty_history_scales_by_one_and_clips_rather_than_overflows():
  x = jnp.array([[1000.0, 1.0]])          # past e4m3's 448 at the scale 1
  y = _delayed(x, jnp.eye(2), fp8.new_history(), 1, jnp.float32)
  np.testing.assert_array_equal(y, [[448.0, 1.0]])


@pytest.mark.parametrize("objective", ["mse", "diffusion"])
def test_prediction_for_patch_t_never_sees_patch_t_or_later_in_fp8(objective):
  """The causality property of tests/test_models.py, under fp8."""
  over = {}
  if objective == "diffusion":
    over = {"loss.kind": "diffusion", "decoder.kind": "transformer",
            "decoder.gamma_conditioning": True}
  model = darl_lib.darl_from_config(test_models.tiny_config(**over))
  x = test_models.images()
  params = test_models.init(model, x)
  with ops.using(precision="fp8"):
    predict = jax.jit(lambda imgs: sampling.predict_patches(
        model, params, imgs, jax.random.PRNGKey(7), num_steps=3))
    base = patches_lib.patchify(predict(x), 4)
    for j in (0, 5, 14):
      bumped = patches_lib.patchify(x, 4).at[:, j].add(0.5)
      new = patches_lib.patchify(predict(patches_lib.unpatchify(bumped, 4, (4, 4), 1)), 4)
      np.testing.assert_array_equal(new[:, :j + 1], base[:, :j + 1])
      assert float(jnp.abs(new[:, j + 1:] - base[:, j + 1:]).max()) > 1e-4


# ---------------------------------------------------- histories in the model


def _fp8_model(**over):
  """A tiny diffusion DARL initialised under fp8 (its ``fp8`` collection),
  with histories as a few steps of training would leave them."""
  over = {"loss.kind": "diffusion", "decoder.kind": "transformer",
          "decoder.gamma_conditioning": True, **over}
  model = darl_lib.darl_from_config(test_models.tiny_config(**over))
  x = test_models.images(n=4)
  with ops.using(precision="fp8"):
    variables = model.init({"params": jax.random.PRNGKey(0), "noise": jax.random.PRNGKey(1)},
                           x, train=False)
  histories = jax.tree.map(lambda h: h.at[..., 0, 3].set(2.5).at[..., 1, 0].set(0.01),
                           variables[fp8.COLLECTION])
  return model, {"params": variables["params"], fp8.COLLECTION: histories}, x


@pytest.mark.parametrize("scan", [False, True])
def test_every_dense_layer_keeps_a_history_in_the_fp8_collection(scan):
  """Backbone and decoder, unrolled or scanned; none under bf16."""
  model, variables, x = _fp8_model(**{"model.scan_layers": scan})
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_leaves_with_path(variables[fp8.COLLECTION])]
  kernels = [jax.tree_util.keystr(p[:-1]) for p, _ in
             jax.tree_util.tree_leaves_with_path(variables["params"])
             if jax.tree_util.keystr(p[-1:]) == "['kernel']"
             and any(k in jax.tree_util.keystr(p) for k in ("attn", "mlp"))]
  assert sorted(p.removesuffix("['history']") for p in paths) == sorted(kernels)
  depth = 2 if scan else None
  for leaf in jax.tree.leaves(variables[fp8.COLLECTION]):
    assert leaf.shape[-2:] == (2, fp8.HISTORY) and leaf.dtype == jnp.float32
    if scan and leaf.ndim == 3:
      assert leaf.shape[0] == depth
  assert fp8.COLLECTION not in model.init(
      {"params": jax.random.PRNGKey(0), "noise": jax.random.PRNGKey(1)}, x, train=False)


def test_causality_holds_with_scales_from_the_histories():
  """The backbone's token t, under delayed scaling, never sees patch t or later."""
  model, variables, x = _fp8_model()
  with ops.using(precision="fp8"):
    features = jax.jit(lambda imgs: model.apply(variables, imgs, train=False,
                                                method=darl_lib.DARL.encode)[1]["features"])
    base = features(x)
    for j in (0, 5, 14):          # raster patch j is input token j + 1 (after SOS)
      bumped = patches_lib.unpatchify(patches_lib.patchify(x, 4).at[:, j].add(0.5), 4, (4, 4), 1)
      new = features(bumped)
      np.testing.assert_array_equal(new[:, :j + 1], base[:, :j + 1])
      assert float(jnp.abs(new[:, j + 1:] - base[:, j + 1:]).max()) > 1e-4


def _pretrain_fp8(**over):
  return test_accumulate.pretrain_config(
      "diffusion", **{"model.dtype": "bfloat16", "precision": "fp8", **over})


def _step(built, state, i, num_microbatches=1):
  step = built.make_step(num_microbatches)
  batch = feed_lib.to_global(test_accumulate.host_batch(built, i), built.batch_sharding)
  new, _ = step(jax.device_get(state), batch, built.hyper(i))
  return jax.device_get(new)


def test_the_first_step_fills_empty_histories_and_the_next_one_trains():
  """Scales of 1 would have clipped or flushed the first step's tensors:
  it records their largest magnitudes and leaves the parameters and the
  optimizer as they were; the second step updates them and shifts its
  record in, newest first."""
  config = _pretrain_fp8()
  built = loop.setup(pretrain.PretrainTrainer(config), config)
  s0 = jax.device_get(built.init_state())
  assert not any(np.any(h) for h in jax.tree.leaves(s0["model_state"][fp8.COLLECTION]))
  s1 = _step(built, s0, 0)
  assert int(s1["step"]) == 1 and int(s1["bad_step"]) == -1
  test_accumulate.assert_close(s1["params"], s0["params"], rtol=0, atol=0)
  test_accumulate.assert_close(s1["opt_state"], s0["opt_state"], rtol=0, atol=0)
  first = jax.tree.leaves(s1["model_state"][fp8.COLLECTION])
  assert all(np.all(h[..., :, 0] > 0) and not np.any(h[..., :, 1:]) for h in first)
  s2 = _step(built, s1, 1)
  assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(s2["params"]),
                                            jax.tree.leaves(s1["params"])))
  for h1, h2 in zip(first, jax.tree.leaves(s2["model_state"][fp8.COLLECTION])):
    np.testing.assert_array_equal(h2[..., :, 1], h1[..., :, 0])
    assert np.all(h2[..., :, 0] > 0)


def test_microbatches_combine_their_records_by_the_largest_magnitude():
  """Accumulated over 2 microbatches, the step records the whole batch's
  largest input magnitudes (the one-shot step's) and gradients twice the
  one-shot step's (each microbatch's loss is a mean over half the rows);
  the parameters then move as the one-shot step's, within fp8 rounding."""
  config = _pretrain_fp8()
  built = loop.setup(pretrain.PretrainTrainer(config), config)
  s0 = jax.device_get(built.init_state())
  one = _step(built, _step(built, s0, 0), 1)
  acc = _step(built, _step(built, s0, 0, 2), 1, 2)
  # Column 1 is the first step's record, taken on the same parameters.
  for h1, h2 in zip(jax.tree.leaves(one["model_state"][fp8.COLLECTION]),
                    jax.tree.leaves(acc["model_state"][fp8.COLLECTION])):
    np.testing.assert_allclose(h2[..., 0, 1], h1[..., 0, 1], rtol=1e-6)
    np.testing.assert_allclose(h2[..., 1, 1], 2 * h1[..., 1, 1], rtol=0.1)
  test_accumulate.assert_close(acc["params"], one["params"], rtol=0, atol=2e-3)


def test_an_fp8_run_resumes_bit_identically_with_its_histories(tmp_path):
  """Stopped after 3 steps and resumed: the histories come back from the
  checkpoint, so the resumed run is the uninterrupted one."""
  import resumed as resumed_lib  # pylint: disable=import-outside-toplevel
  config = _pretrain_fp8(total_steps=6, microbatch_size=8, checkpoint_every_steps=3,
                         eval_every_steps=0)
  straight, resumed = resumed_lib.straight_and_resumed(pretrain.PretrainTrainer, config,
                                                       tmp_path, stop_at=3)
  assert resumed["loss"] == straight["loss"]
  assert resumed["param_norm"] == straight["param_norm"]


def test_validation_with_histories_does_not_depend_on_the_evaluation_batch():
  """Each example's loss is the same evaluated with others or alone."""
  config = _pretrain_fp8()
  trainer = pretrain.PretrainTrainer(config)
  built = loop.setup(trainer, config)
  state = _step(built, jax.device_get(built.init_state()), 0)
  assert np.any(jax.tree.leaves(state["model_state"][fp8.COLLECTION])[0])
  batch = test_accumulate.host_batch(built, 3)
  batch = {"image": batch["image"][:6], "index": np.arange(6, dtype=np.int32),
           "mask": np.ones(6, bool)}
  rng = jax.random.PRNGKey(5)
  with ops.using(precision="fp8"):
    # Jitted as the evaluation step is (op by op it compiled ~700 programs).
    evaluate = jax.jit(lambda params, model_state, part: trainer.eval_fn(
        built.model, params, model_state, part, rng)["loss"])

    def losses(rows):
      part = feed_lib.model_input({k: v[rows] for k, v in batch.items()})
      return np.asarray(evaluate(state["params"], state["model_state"], part))
    whole = losses(slice(0, 6))
    np.testing.assert_allclose(losses(slice(0, 2)), whole[:2], rtol=1e-6)
    np.testing.assert_allclose(losses(slice(3, 6)), whole[3:], rtol=1e-6)


def test_frozen_backbones_scale_row_by_row_and_trained_ones_keep_histories():
  """A probe's backbone is frozen (no step would record its histories): its
  state has none; a fine-tune's has them."""
  probe = test_accumulate.probe_config(**{"model.dtype": "bfloat16", "precision": "fp8"})
  state = loop.setup(linear_probe.LinearProbeTrainer(probe), probe).init_state()
  assert fp8.COLLECTION not in state["model_state"]
  ft = test_accumulate.finetune_config(**{"model.dtype": "bfloat16", "precision": "fp8"})
  state = loop.setup(finetune.FinetuneTrainer(ft), ft).init_state()
  assert jax.tree.leaves(state["model_state"][fp8.COLLECTION])


def test_histories_stay_whole_on_every_device_under_fsdp():
  tree = {"params": {"attn": {"qkv": {"kernel": jax.ShapeDtypeStruct((8, 3, 2, 16), jnp.float32)}}},
          "model_state": {fp8.COLLECTION: {"attn": {"qkv": {
              "history": jax.ShapeDtypeStruct((4, 2, 16), jnp.float32)}}}}}
  for rules in ("fsdp", "fsdp_tensor"):
    specs = sharding_lib.tree_specs(tree, {"fsdp": 2, "tensor": 1},
                                    sharding_lib.check_rules(rules))
    assert specs["model_state"][fp8.COLLECTION]["attn"]["qkv"]["history"] == \
        jax.sharding.PartitionSpec()
    assert specs["params"]["attn"]["qkv"]["kernel"] != jax.sharding.PartitionSpec()


# --------------------------------------------------------------- training


def _tiny(precision, steps=24, **kw):
  c = tiny_config.get_config(f"steps={steps}")
  c.eval_every_steps = 0
  c.predictions.num_images = 0
  c.model.dtype = "bfloat16"
  c.precision = precision
  c.update(kw)
  return c


def test_fp8_training_tracks_bf16_and_says_so(tmp_path, caplog):
  """24 steps of the tiny model in each precision: the same loss curve
  within a few percent, and the start-up log names the fp8 layers."""
  losses = {}
  for precision in ("bf16", "fp8"):
    c = _tiny(precision)
    with caplog.at_level("INFO"):
      loop.run(pretrain.PretrainTrainer(c), c, str(tmp_path / precision))
    records = metrics_lib.read_metrics(str(tmp_path / precision))
    losses[precision] = np.array([r["loss"] for r in records if "loss" in r])
  assert "dense layers in fp8" in caplog.text
  assert "the first step fills the fp8 scales' histories" in caplog.text
  assert losses["fp8"][-1] < 0.75 * losses["fp8"][0]              # it learns
  np.testing.assert_allclose(losses["fp8"][-4:].mean(), losses["bf16"][-4:].mean(), rtol=0.05)


def test_checkpoints_cross_between_precisions(tmp_path, caplog):
  """bf16 -> fp8 -> bf16 resumes of one pretraining run, then fine-tuning
  in fp8 from it: the fp8 run starts empty histories, the bf16 run after it
  leaves them aside, each saying so."""
  wd = tmp_path / "pretrain"
  for precision, steps in (("bf16", 4), ("fp8", 8), ("bf16", 12)):
    c = _tiny(precision, steps=steps)
    with caplog.at_level("INFO"):
      loop.run(pretrain.PretrainTrainer(c), c, str(wd))
    assert checkpoint_lib.read_meta(str(wd))[0] == steps
    saved_under = "bf16" if precision == "fp8" else "fp8"
    if steps > 4:
      assert f"checkpoint at step {steps - 4} was saved under precision='{saved_under}'" \
          in caplog.text
  records = metrics_lib.read_metrics(str(wd))
  assert [r["step"] for r in records if "loss" in r] == list(range(1, 13))
  assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)
  ft = test_finetune.tiny_finetune_config(str(wd))
  ft.precision = "fp8"
  last = loop.run(finetune.FinetuneTrainer(ft), ft, str(tmp_path / "ft"))
  assert 0.0 <= last["val_accuracy"] <= 1.0
  # The fp8 fine-tune's own checkpoint restores into bf16 code.
  params, _ = checkpoint_lib.restore_params(str(tmp_path / "ft"))
  assert jax.tree.leaves(params)[0].dtype == jnp.float32


# --------------------------------------------------------------- where it runs


@dataclasses.dataclass
class FakeDevice:
  platform: str
  device_kind: str
  compute_capability: str = ""


@pytest.mark.parametrize("device,ok", [
    (FakeDevice("gpu", "NVIDIA H100 80GB HBM3", "9.0"), True),
    (FakeDevice("gpu", "NVIDIA L4", "8.9"), True),
    (FakeDevice("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), False),
    (FakeDevice("tpu", "TPU v5 lite"), False),
    (FakeDevice("tpu", "TPU v4"), False),
    (FakeDevice("cpu", "cpu"), True)])
def test_fp8_is_refused_without_fp8_matrix_units(device, ok):
  fp8.check_backend("bf16", device)           # bf16 runs anywhere
  if ok:
    fp8.check_backend("fp8", device)
    return
  with pytest.raises(ValueError, match=rf"^precision='fp8' needs fp8 matrix units .*"
                                       rf"{device.device_kind} has none: run with "
                                       r"--config\.precision=bf16$"):
    fp8.check_backend("fp8", device)


def test_the_run_refuses_fp8_before_compiling(tmp_path, monkeypatch):
  monkeypatch.setattr(fp8, "supports_fp8", lambda device: False)
  c = _tiny("fp8", steps=2)
  with pytest.raises(ValueError, match="--config.precision=bf16"):
    loop.run(pretrain.PretrainTrainer(c), c, str(tmp_path))


def test_the_hopper_mlp_kernel_steps_aside_for_fp8(monkeypatch):
  monkeypatch.setattr(jax, "devices", lambda *a: [FakeDevice("gpu", "NVIDIA H100", "9.0")])
  auto = {"attention": "auto", "mlp": "auto", "norm": "auto"}
  assert ops.resolve(auto, "bfloat16", "bf16") == ops.Kernels("hopper", "hopper", "triton")
  assert ops.resolve(auto, "bfloat16", "fp8") == ops.Kernels("hopper", "xla", "triton")
  with pytest.raises(ValueError, match="kernels.mlp='hopper' multiplies in bfloat16; with "
                                       "precision='fp8' set kernels.mlp='auto' or 'xla'"):
    ops.resolve({"mlp": "hopper"}, "bfloat16", "fp8")
  with pytest.raises(ValueError, match="unknown precision 'fp4'; valid: bf16, fp8"):
    ops.resolve(auto, "bfloat16", "fp4")


def test_config_names_the_valid_precisions():
  c = config_lib.pretrain_config()
  assert c.precision == "bf16"
  config_lib.validate(c)
  c.precision = "fp16"
  with pytest.raises(config_lib.ConfigError,
                     match="config.precision must be one of bf16, fp8, got 'fp16'"):
    config_lib.validate(c)


def test_fp8_runs_take_cublas_gemms_unless_xla_flags_say_otherwise(monkeypatch):
  from darl_jax import main  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  main.precision_xla_flags("bf16")
  assert "triton_gemm" not in main.os.environ["XLA_FLAGS"]
  main.precision_xla_flags("fp8")
  assert main.os.environ["XLA_FLAGS"] == (
      "--xla_dump_to=/tmp/x --xla_gpu_enable_triton_gemm=false")
  monkeypatch.delenv("XLA_FLAGS")
  main.precision_xla_flags("fp8")
  assert main.os.environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=false"
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")   # the user's choice
  main.precision_xla_flags("fp8")
  assert main.os.environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=true"
