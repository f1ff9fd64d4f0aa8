"""The attentive probe: attention pooling, its head on chosen blocks, the trainer and its CLI job."""

import json
import os
import pathlib
import runpy
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import metrics as metrics_lib
from darl_jax.models import vit as vit_lib
from darl_jax.train.trainers import attentive_probe
from darl_jax.train import loop
from darl_jax.train.trainers import pretrain
from darl_jax.train import backbone as backbone_lib
from xla_env import cpu_devices_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import tiny_config  # pylint: disable=wrong-import-position

EXPERIMENT = ROOT / "experiments" / "fashion_mnist_attentive_probe.py"


def _head(blocks=("block_00", "block_02"), heads=2, classes=3):
  return attentive_probe.AttentiveHead(blocks, heads, classes)


def _tokens(seed=0, b=4, n=5, d=8, depth=3):
  keys = jax.random.split(jax.random.PRNGKey(seed), depth)
  return {f"block_{i:02d}": jax.random.normal(keys[i], (b, n, d)) for i in range(depth)}


def test_pooled_output_reads_only_the_chosen_blocks_as_a_set():
  head = _head()
  tokens = _tokens()
  variables = head.init(jax.random.PRNGKey(1), tokens, False)
  apply = jax.jit(lambda t: head.apply(variables, t, False))
  logits, pooled = apply(tokens)
  assert logits.shape == (4, 3) and pooled.shape == (4, 8)
  # No positions: any order of the tokens (within and across the chosen
  # blocks, which are concatenated) pools to the same vector.
  joined = jnp.concatenate([tokens["block_00"], tokens["block_02"]], 1)
  perm = np.random.default_rng(0).permutation(joined.shape[1])
  shuffled = dict(tokens, block_00=joined[:, perm[:5]], block_02=joined[:, perm[5:]])
  np.testing.assert_allclose(apply(shuffled)[1], pooled, atol=1e-5)
  # A block that is not chosen does not matter; a chosen one does.
  other = _tokens(seed=9)
  np.testing.assert_array_equal(apply(dict(tokens, block_01=other["block_01"]))[1], pooled)
  assert not np.allclose(apply(dict(tokens, block_02=other["block_02"]))[1], pooled)
  # Multi-head: the query and the projections have one slice per head.
  params = variables["params"]["pool"]
  assert params["query"].shape == (2, 4) and params["key"]["kernel"].shape == (8, 2, 4)


def test_block_indices_resolve_and_bad_ones_name_the_fix():
  assert backbone_lib.resolve_blocks((-1,), 4) == ("block_03",)
  assert backbone_lib.resolve_blocks((0, 2), 4) == ("block_00", "block_02")
  with pytest.raises(ValueError, match="indices in"):
    backbone_lib.resolve_blocks((4,), 4)
  with pytest.raises(ValueError, match="distinct"):
    backbone_lib.resolve_blocks((1, -3), 4)


def test_attentive_head_learns_a_separable_toy_task():
  """The class is carried by one marked token at a random place among noise tokens."""
  rng = np.random.default_rng(0)
  num, n, d, classes = 512, 8, 16, 4
  protos = rng.normal(size=(classes, d)) * 3
  labels = rng.integers(0, classes, num)
  x = rng.normal(size=(num, n, d))
  where = rng.integers(0, n, num)
  x[np.arange(num), where] = protos[labels] + 0.3 * rng.normal(size=(num, d))
  x[:, :, -1] = 0.0
  x[np.arange(num), where, -1] = 4.0      # a marker channel the keys can pick up
  tokens = {"block_00": jnp.asarray(x, jnp.float32)}
  head = _head(blocks=("block_00",), heads=2, classes=classes)
  variables = head.init(jax.random.PRNGKey(0), tokens, False)
  params, stats = variables["params"], variables["batch_stats"]
  tx = optax.adam(1e-2)
  opt = tx.init(params)

  @jax.jit
  def step(params, stats, opt):
    def loss(p):
      (logits, _), upd = head.apply({"params": p, "batch_stats": stats}, tokens, True,
                                    mutable=["batch_stats"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), upd
    (value, upd), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt = tx.update(grads, opt)
    return optax.apply_updates(params, updates), upd["batch_stats"], opt, value

  for _ in range(300):
    params, stats, opt, value = step(params, stats, opt)
  logits, _ = head.apply({"params": params, "batch_stats": stats}, tokens, False)
  assert float(jnp.mean(jnp.argmax(logits, -1) == labels)) > 0.95


def test_backbone_gets_no_gradient():
  c = attentive_probe.attentive_probe_config()
  c.model.update(variant="mu/2", image_size=8, channels=1, rope_max_wavelength=100.0)
  c.probe.blocks = (0, 1)
  backbone, patch = vit_lib.vit_from_config(c.model)
  model = attentive_probe.AttentiveProbe(backbone=backbone, patch_size=patch, num_classes=10,
                                         blocks=("block_00", "block_01"), num_heads=2)
  images = jax.random.uniform(jax.random.PRNGKey(1), (4, 8, 8, 1), minval=-1, maxval=1)
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), images)
  assert sorted(variables["params"]) == ["backbone", "head"]
  trainer = attentive_probe.AttentiveProbeTrainer(c)
  batch = {"image": images, "label": jnp.arange(4)}
  grads = jax.jit(jax.grad(lambda p: trainer.loss_fn(
      model, p, {"batch_stats": variables["batch_stats"]}, batch, None, True)[0]))(
          variables["params"])
  assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree_util.tree_leaves(grads["backbone"]))
  assert all(float(jnp.abs(g).max()) > 0
             for g in jax.tree_util.tree_leaves(grads["head"]["pool"]))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """4 steps of tests/tiny_config.py's pretraining."""
  wd = tmp_path_factory.mktemp("pretrain")
  c = tiny_config.get_config("steps=4")
  c.predictions.num_images = 0
  c.eval_every_steps = 0
  loop.run(pretrain.PretrainTrainer(c), c, str(wd))
  return wd


def test_cli_job_runs_from_a_tiny_checkpoint_with_a_frozen_backbone(pretrained, tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             XLA_FLAGS=cpu_devices_flags(1))
  proc = subprocess.run(
      [sys.executable, "-m", "darl_jax.main",
       f"--config={EXPERIMENT}:tiny,steps=4,blocks=0+-1,init={pretrained}",
       f"--workdir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  report = json.loads((tmp_path / "attentive_probe.json").read_text())
  assert report["blocks"] == ["block_00", "block_01"] and report["step"] == 4
  assert 0.0 <= report["accuracy"] <= 1.0
  evals = [r for r in metrics_lib.read_metrics(str(tmp_path)) if "val_accuracy" in r]
  assert [r["step"] for r in evals] == [2, 4]
  # Frozen: the backbone is bit-identical to the pretrained one.
  start, _ = checkpoint_lib.restore_params(str(pretrained))
  probed, _ = checkpoint_lib.restore_params(str(tmp_path))
  for a, b in zip(jax.tree_util.tree_leaves(start["backbone"]),
                  jax.tree_util.tree_leaves(probed["backbone"])):
    np.testing.assert_array_equal(a, b)
  assert json.loads((tmp_path / "init_report.json").read_text())["loaded"]


def test_experiment_config():
  get_config = runpy.run_path(str(EXPERIMENT))["get_config"]
  c = get_config("blocks=1+3")
  assert c.trainer == "attentive_probe" and c.probe.blocks == (1, 3)
  assert c.optim.frozen == ["^backbone/"] and c.model.causal
  assert get_config(None).probe.blocks == (-1,)
