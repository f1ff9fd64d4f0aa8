"""Scanned blocks (``model.scan_layers``) against unrolled ones, on tiny models.

- The backbone and the denoising decoder compute the same function in both
  forms on the same parameters (darl_jax/layer_layout.py converts them):
  outputs, every block's output, gradients.
- Drop path inside the scan: each layer gets its own rate (the scan's
  input), drawn with the statistics of the unrolled model's; evaluation is
  exact; a training step with drop path runs scanned.
- The fused stack (kernels/fused_stack.py, Pallas's interpreter on CPU)
  takes scanned parameters of a model with drop path in evaluation.
- Layouts convert both ways exactly, for parameters, Adam's state, abstract
  states with shardings and Orbax's metadata trees.
- Checkpoints cross-load through the loop (unrolled -> scanned -> unrolled
  resumes match the straight unrolled run, EMA included), fine-tuning
  initialises from a scanned pretraining checkpoint and the other way
  round, and export writes the same tensors from either layout.
"""

import json
import logging
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from darl_jax import layer_layout, objectives, ops
from darl_jax.checkpoint import restore_params
from darl_jax.kernels import fused_stack
from darl_jax.models import darl as darl_lib
from darl_jax.models import heads, layers, vit
from darl_jax.train.trainers import finetune
from darl_jax.train.trainers import pretrain
from darl_jax.train import transfer
from darl_jax.train import loop
from darl_jax.train import state as state_lib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import tiny_config  # noqa: E402  pylint: disable=wrong-import-position
from test_kernels import perturbed, vit_inputs  # noqa: E402
from test_models import images, tiny_config as model_config  # noqa: E402


def _vit(**kw):
  return vit.ViT(64, kw.pop("depth", 3), 2, 128, reference_grid=(4, 4), **kw)


def _shapes(model, *args, **kw):
  return jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kw)["params"])


def _assert_trees_close(a, b, tol=1e-5):
  """Same structure; each leaf within ``tol`` of ``b``'s in relative norm
  (0: equal). Gradients sum many terms, so single entries that cancel
  carry relative rounding of their own; the leaf's norm does not."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    assert x.shape == y.shape, jax.tree_util.keystr(path)
    err = np.linalg.norm(x - y) / (np.linalg.norm(y) + 1e-30)
    assert err <= tol, (jax.tree_util.keystr(path), err)


# ------------------------------------------------------------------ same function


def test_scanned_backbone_is_the_unrolled_one_outputs_blocks_and_gradients():
  """Drop path set (0.3) but evaluation: deterministic, so both are exact
  functions of the parameters and must agree."""
  unrolled = _vit(depth=2, drop_path=0.3)
  scanned = _vit(depth=2, drop_path=0.3, scan_layers=True)
  args = vit_inputs(2, 3)
  params = perturbed(unrolled.init(jax.random.key(1), *args)["params"])
  stacked = layer_layout.convert(params, _shapes(scanned, *args))
  assert stacked["blocks"]["block"]["mlp"]["fc1"]["kernel"].shape == (2, 64, 128)
  readout = jax.random.normal(jax.random.key(3), (4, 2, 9, 64))

  def loss(model):
    def f(p):
      out = model.apply({"params": p}, *args, train=False)
      return sum(jnp.sum(out[k] * readout[i]) for i, k in enumerate(sorted(out))), out
    return jax.jit(jax.value_and_grad(f, has_aux=True))

  (_, want), g_want = loss(unrolled)(params)
  (_, got), g_got = loss(scanned)(stacked)
  assert got.keys() == want.keys() == {"features", "block_00", "block_01"}
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=key)
  assert layer_layout.is_scanned(g_got) and not layer_layout.is_scanned(g_want)
  _assert_trees_close(layer_layout.convert(g_got, params), g_want)


# ------------------------------------------------------------------ drop path


def test_each_scanned_layer_drops_with_its_own_rate():
  """Both branches of block i dropped leaves its output equal to its input
  exactly, with probability rate_i ** 2: over 2048 examples the fraction
  per block matches the linearly increasing rates (0, .3, .6), scanned and
  unrolled alike."""
  depth, batch = 3, 2048
  args = vit_inputs(batch, 2)
  rates = _vit(depth=depth, drop_path=0.6).drop_path_rates()
  np.testing.assert_allclose(rates, [0.0, 0.3, 0.6])
  for scan in (False, True):
    model = _vit(depth=depth, drop_path=0.6, scan_layers=scan)
    params = model.init(jax.random.key(1), *args)["params"]
    out = jax.jit(lambda p, model=model: model.apply(
        {"params": p}, *args, train=True, rngs={"dropout": jax.random.key(5)}))(params)
    for i in range(1, depth):
      same = jnp.all(out[f"block_{i:02d}"] == out[f"block_{i - 1:02d}"], axis=(1, 2))
      assert abs(float(same.mean()) - rates[i] ** 2) < 0.05, (scan, i, float(same.mean()))


def test_drop_path_takes_a_traced_rate():
  x = jnp.ones((4000, 3))
  drop = lambda rate: jax.jit(lambda r: layers.DropPath(r).apply(
      {}, x, False, rngs={"dropout": jax.random.key(0)}))(rate)
  kept = drop(jnp.float32(0.25))
  np.testing.assert_allclose(np.unique(np.asarray(kept)), [0.0, 1 / 0.75], rtol=1e-6)
  assert abs(float(kept.mean()) - 1.0) < 0.05          # the expected value is x
  np.testing.assert_array_equal(drop(jnp.float32(0.0)), x)   # a traced 0 keeps all
  assert layers.DropPath(jnp.float32(0.5)).apply({}, x, True) is x


def test_training_step_scanned_and_unrolled():
  """One optimizer step of the DARL model (diffusion; a 2-block transformer
  decoder: one scanned, then the read-out block). Without drop
  path the scanned step is the unrolled one: loss, updated parameters and
  momentum (backbone and decoder). With drop path 0.5 the scanned
  step draws per layer: finite, and another loss than without."""
  over = {"loss.kind": "diffusion", "decoder.kind": "transformer", "decoder.depth": 2,
          "decoder.gamma_conditioning": True, "decoder.width": 16, "model.image_size": 8}
  unrolled = darl_lib.darl_from_config(model_config(**over))
  scanned = darl_lib.darl_from_config(model_config(**over, **{"model.scan_layers": True}))
  x = images(2, size=8)
  rngs = {"params": jax.random.key(0), "noise": jax.random.key(1)}
  params = unrolled.init(rngs, x, train=False)["params"]
  like = jax.eval_shape(lambda: scanned.init(rngs, x, train=False)["params"])
  assert sorted(like["decoder"]) == ["block_1", "blocks", "head", "noisy_embed", "norm",
                                     "type_embed", "z_embed"]
  stacked = layer_layout.convert(params, like)
  assert stacked["decoder"]["blocks"]["block"]["attn"]["qkv"]["kernel"].shape[0] == 1
  # SGD with momentum: the update is linear in the gradient. (Adam's first
  # step is lr * sign(gradient), and the gradient of the key projection's
  # bias is 0 up to rounding, so its sign is noise; the loop's test below
  # carries Adam's state across the layouts.)
  tx = optax.sgd(0.1, momentum=0.9)

  def step(model):
    def f(p, opt):
      def loss(p):
        return model.apply({"params": p}, x, jax.random.key(5), train=True,
                           rngs={"noise": jax.random.key(3), "dropout": jax.random.key(4)},
                           method=objectives.loss)[0]
      value, grads = jax.value_and_grad(loss)(p)
      updates, opt = tx.update(grads, opt, p)
      return value, optax.apply_updates(p, updates), opt
    return jax.jit(f)

  loss_u, new_u, opt_u = step(unrolled)(params, tx.init(params))
  loss_s, new_s, opt_s = step(scanned)(stacked, tx.init(stacked))
  np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5)
  _assert_trees_close(layer_layout.convert(new_s, params), new_u)
  _assert_trees_close(layer_layout.convert(opt_s, opt_u), opt_u, tol=1e-4)

  dropping = scanned.clone(backbone=scanned.backbone.clone(drop_path=0.5))
  loss_d, new_d, _ = step(dropping)(stacked, tx.init(stacked))
  assert np.isfinite(float(loss_d)) and float(loss_d) != float(loss_s)
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(new_d))


# ------------------------------------------------------------------ fused stack


def test_fused_stack_evaluates_scanned_parameters_of_a_model_with_drop_path(monkeypatch):
  """Scanned, drop path 0.5: evaluation runs the fused stack on the stacked
  parameters, with the plain scanned blocks' outputs (training runs the
  plain blocks: tests/test_ops.py)."""
  runs = []
  monkeypatch.setattr(fused_stack, "run", lambda *a, _f=fused_stack.run, **kw:
                      runs.append(kw["scanned"]) or _f(*a, **kw))
  model = _vit(depth=2, drop_path=0.5, scan_layers=True)
  args = vit_inputs(2, 3)
  params = perturbed(model.init(jax.random.key(1), *args)["params"])
  apply = lambda: model.apply({"params": params}, *args, train=False)
  want = apply()
  with ops.using(norm="triton"):
    got = apply()
  assert runs == [True]
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=key)


# ------------------------------------------------------------------ layouts


def test_layouts_convert_both_ways_exactly_for_every_tree_that_mirrors_the_parameters():
  """Parameters, Adam's state (namedtuples), abstract states with named
  shardings (the layer axis unsplit) and Orbax's metadata, where
  namedtuples are dicts."""
  args = vit_inputs(1, 2)
  unrolled, scanned = _vit(), _vit(scan_layers=True)
  params = jax.jit(lambda: unrolled.init(jax.random.key(1), *args)["params"])()
  like = _shapes(scanned, *args)
  tx = optax.adam(1e-3)
  state = {"params": params, "opt_state": tx.init(params), "step": jnp.int32(3)}
  stacked = layer_layout.convert(state, {"params": like, "opt_state": tx.init(like)})
  assert jax.tree.structure(stacked["opt_state"]) == jax.tree.structure(tx.init(like))
  mu = stacked["opt_state"][0].mu
  assert mu["blocks"]["block"]["norm1"]["scale"].shape == (3, 64)
  back = layer_layout.convert(stacked, state)
  assert jax.tree.structure(back) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
  assert layer_layout.differs(state, stacked) and not layer_layout.differs(back, state)

  # Orbax's metadata: the namedtuple ScaleByAdamState as a dict, the chain a list
  metadata = {"params": like, "opt_state": [{"count": None, "mu": like, "nu": like}, None]}
  target = layer_layout.convert(state, metadata)
  assert target["opt_state"][0].nu["blocks"]["block"]["mlp"]["fc2"]["bias"].shape == (3, 64)

  # abstract leaves keep their shardings, the layer axis replicated
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  named = lambda spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                         sharding=named(("fsdp",))), params)
  stacked_abstract = layer_layout.convert(abstract, like)
  leaf = stacked_abstract["blocks"]["block"]["mlp"]["fc1"]["kernel"]
  assert leaf.shape == (3, 64, 128) and leaf.sharding.spec == jax.sharding.PartitionSpec(
      None, "fsdp")
  again = layer_layout.convert(stacked_abstract, abstract)["block_02"]["mlp"]["fc1"]["kernel"]
  assert again.shape == (64, 128) and again.sharding.spec == jax.sharding.PartitionSpec("fsdp")

  # the backbone's names come back zero-padded; blocks go in numeric order
  assert sorted(layer_layout.unscan(stacked["params"])) == sorted(params)
  assert layer_layout.block_names({"block_10": 0, "norm": 0, "block_2": 0}) == [
      "block_2", "block_10"]
  assert vit.unscan_params(stacked["params"], 3).keys() == params.keys()
  with pytest.raises(ValueError, match="3 layers, not the 4 blocks"):
    vit.unscan_params(stacked["params"], 4)


# ------------------------------------------------------------------ checkpoints


def _metrics(workdir):
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _pretrain_config(**kw):
  c = tiny_config.get_config("objective=diffusion,steps=4")
  c.update(checkpoint_every_steps=2, eval_every_steps=0, ema_decay=0.9, **kw)
  c.predictions.num_images = 0
  c.decoder.depth = 2            # a scanned decoder stack, and its read-out block
  return c


@pytest.fixture(scope="module")
def cross_loaded(tmp_path_factory):
  """``a``: 4 unrolled steps straight. ``b``: 2 unrolled steps, resumed
  scanned to step 3, resumed unrolled to step 4 (every resume converts)."""
  root = tmp_path_factory.mktemp("scan_resume")
  records = []
  handler = logging.Handler()
  handler.emit = lambda record: records.append(record.getMessage())
  absl_logger = logging.getLogger("absl")
  level = absl_logger.level
  absl_logger.addHandler(handler)
  absl_logger.setLevel(logging.INFO)
  try:
    c = _pretrain_config()
    straight = loop.run(pretrain.PretrainTrainer(c), c, str(root / "a"))
    for scan, stop in ((False, 2), (True, 1), (False, 0)):
      c = _pretrain_config(stop_after_steps=stop)
      c.model.scan_layers = scan
      resumed = loop.run(pretrain.PretrainTrainer(c), c, str(root / "b"))
  finally:
    absl_logger.removeHandler(handler)
    absl_logger.setLevel(level)
  return root, straight, resumed, records


def test_checkpoints_cross_load_through_the_loop_both_ways(cross_loaded):
  root, straight, resumed, records = cross_loaded
  converted = [r for r in records if "converted to this run's" in r]
  assert len(converted) == 2, converted
  assert "step 2 holds unrolled blocks: converted to this run's scanned" in converted[0]
  assert "step 3 holds scanned blocks: converted to this run's unrolled" in converted[1]
  a, b = _metrics(root / "a"), _metrics(root / "b")
  assert sorted(a) == sorted(b) == [1, 2, 3, 4]
  for step in a:
    np.testing.assert_allclose(b[step], a[step], rtol=1e-4, err_msg=f"step {step}")
  np.testing.assert_allclose(resumed["param_norm"], straight["param_norm"], rtol=1e-5)
  # The EMA crossed both ways too. Adam's steps are about lr * sign(gradient),
  # and the key projection's bias has a gradient of 0 up to rounding, so
  # that bias differs at the percent level; a block read as another layer
  # or a lost average would differ by order 1.
  ema = [restore_params(str(root / w), use_ema=True)[0] for w in ("a", "b")]
  assert not layer_layout.is_scanned(ema[1])
  _assert_trees_close(ema[1], ema[0], tol=1e-2)


def test_fine_tuning_initialises_from_either_layout(cross_loaded):
  """Step 3 of ``b`` was saved scanned, step 4 unrolled: each initialises
  both forms of the classifier (the fine-tuning trainer's restore), with
  the checkpoint's numbers."""
  root = cross_loaded[0]
  # step 3 by its EMA, step 4 by its parameters
  saved = {s: restore_params(str(root / "b"), step=s, use_ema=s == 3)[0] for s in (3, 4)}
  assert layer_layout.is_scanned(saved[3]) and not layer_layout.is_scanned(saved[4])
  c = finetune.finetune_config()
  c.model.update(variant="mu/2", image_size=8, channels=1, rope_max_wavelength=100.0)
  for scan in (False, True):
    c.model.scan_layers = scan
    backbone, patch = vit.vit_from_config(c.model)
    model = heads.Classifier(backbone=backbone, patch_size=patch, num_classes=10)
    target = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
                            ["params"])
    for step in (3, 4):
      merged, report = transfer.restore_into(target, str(root / "b"), step=step,
                                             use_ema=step == 3)
      assert report.new == ["head/bias", "head/kernel"]
      assert layer_layout.is_scanned(merged) == scan
      want = layer_layout.convert(saved[step]["backbone"], merged["backbone"])
      _assert_trees_close(merged["backbone"], want, tol=0)


def test_export_writes_the_same_tensors_from_either_layout(tmp_path):
  """Backbone and decoder (depth 3: two scanned blocks and the read-out one)."""
  from safetensors import numpy as st_numpy
  from darl_jax import export
  over = {"loss.kind": "diffusion", "decoder.kind": "transformer", "decoder.depth": 3,
          "decoder.gamma_conditioning": True}
  configs = {scan: model_config(**over, **{"model.scan_layers": scan}) for scan in (False, True)}
  shapes = {scan: jax.eval_shape(lambda c=c: darl_lib.darl_from_config(c).init(
      {"params": jax.random.key(0), "noise": jax.random.key(1)}, images(1),
      train=False)["params"]) for scan, c in configs.items()}
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes[False])
  stacked = layer_layout.convert(params, shapes[True])
  assert layer_layout.is_scanned(stacked["backbone"]) and layer_layout.is_scanned(
      stacked["decoder"])
  tensors = []
  for scan, p in ((False, params), (True, stacked)):
    out, _ = export.export_params(p, configs[scan].to_dict(), str(tmp_path / f"{scan}.safetensors"),
                                  with_decoder=True)
    tensors.append(st_numpy.load_file(str(out)))
  assert tensors[0].keys() == tensors[1].keys()
  assert "decoder.blocks.1.mlp.fc1.weight" in tensors[0]
  for name in tensors[0]:
    np.testing.assert_array_equal(tensors[1][name], tensors[0][name], err_msg=name)


# ------------------------------------------------ a fresh state's initialisation


def _built(scan: bool, depth: int = 3):
  c = _pretrain_config()
  c.model.scan_layers = scan
  c.model.depth = depth
  return loop.setup(pretrain.PretrainTrainer(c), c)


def _fresh_state(scan: bool):
  return _built(scan).init_state()


def test_a_fresh_state_is_the_same_in_either_layout():
  """The loop draws a fresh state with the model's scanned form
  (state_lib.initialising_model): the unrolled run starts from the scanned run's
  parameters, block for block, the decoder's stack included, and its
  optimizer state and EMA have the unrolled layout."""
  unrolled, scanned = _fresh_state(False), _fresh_state(True)
  assert not layer_layout.is_scanned(unrolled)
  assert layer_layout.is_scanned(scanned["params"])
  _assert_trees_close(unrolled["params"], layer_layout.convert(scanned["params"],
                                                               unrolled["params"]), tol=0)
  # the blocks differ from each other (one key per layer, not one for all)
  blocks = unrolled["params"]["backbone"]
  first, second = (jax.tree.leaves(blocks[b]) for b in ("block_00", "block_01"))
  assert not all(np.array_equal(x, y) for x, y in zip(first, second))
  assert jax.tree.structure(unrolled["opt_state"]) == jax.tree.structure(
      layer_layout.convert(scanned["opt_state"], unrolled["opt_state"]))


def test_the_initialisation_draws_one_block_whatever_the_depth():
  """The program that initialises an unrolled model holds one block's
  random draws (in the scanned twin's loop body), not one per block: the
  count of random-bit draws does not grow with depth. Without the scanned
  twin it grows by a block's draws per block."""
  def count(jaxpr, name: str) -> int:     # nested jaxprs (jit, scan) included
    n = 0
    for eqn in jaxpr.eqns:
      n += eqn.primitive.name == name
      for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value)
        if hasattr(inner, "eqns"):
          n += count(inner, name)
    return n

  def draws(depth):
    built = _built(False, depth)
    return count(jax.make_jaxpr(built.init_state_fn)(built.init_rng()).jaxpr, "random_bits")

  assert draws(2) == draws(5) > 0


def test_a_model_that_cannot_scan_initialises_unrolled():
  """The two-stream backbone refuses model.scan_layers: its state is drawn
  by the model itself, and the run starts."""
  c = _pretrain_config()
  c.model.two_stream = True
  c.decoder.depth = 1
  built = loop.setup(pretrain.PretrainTrainer(c), c)
  assert layer_layout.scanned_twin(built.model) is not None
  state = built.init_state()
  assert not layer_layout.is_scanned(state)
