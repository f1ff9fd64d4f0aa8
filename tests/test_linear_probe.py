"""Per-block linear probes on a frozen backbone, and the ridge-probe pretraining evaluator."""

import json
import pathlib
import runpy
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import metrics as metrics_lib
from darl_jax import patches as patches_lib
from darl_jax.models import vit as vit_lib
from darl_jax.train.trainers import linear_probe
from darl_jax.train import loop
from darl_jax.train.trainers import pretrain

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import tiny_config  # pylint: disable=wrong-import-position


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """4 steps of tiny DARL pretraining with the ridge-probe evaluator on at step 4."""
  wd = tmp_path_factory.mktemp("pretrain")
  c = tiny_config.get_config("steps=4")
  c.predictions.num_images = 0
  c.eval_max_batches = 1
  c.probe_eval = linear_probe.probe_eval_config()
  c.probe_eval.update(enabled=True, num_train_examples=64, num_eval_examples=32)
  loop.run(pretrain.PretrainTrainer(c), c, str(wd))
  return wd


def tiny_probe_config(init=""):
  c = linear_probe.linear_probe_config()
  c.init_from = init
  c.update(total_steps=3, batch_size=16, log_every_steps=1, eval_every_steps=3,
           checkpoint_every_steps=3, eval_max_batches=2)
  c.data.update(name="digits", image_size=8, channels=1, augment="none")
  c.model.update(variant="mu/2", image_size=8, channels=1, rope_max_wavelength=100.0)
  c.optim.update(warmup_steps=1)
  return c


def _model(num_classes=10):
  backbone, patch = vit_lib.vit_from_config(tiny_probe_config().model)
  return linear_probe.LayerProbes(backbone=backbone, patch_size=patch,
                                  num_classes=num_classes)


def test_each_probe_reads_its_own_block():
  model = _model()
  images = jax.random.uniform(jax.random.PRNGKey(1), (4, 8, 8, 1), minval=-1, maxval=1)
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), images)
  assert sorted(variables["params"]["probes"]) == ["block_00", "block_01"]
  assert "bn" not in variables["params"]["probes"]["block_00"]     # no affine
  logits = jax.jit(model.apply)(variables, images)
  # The backbone's own outputs, computed outside the probe module.
  x = patches_lib.patchify(images, 2)
  rows, cols = np.divmod(np.arange(16), 4)
  out = jax.jit(lambda p: model.backbone.apply(
      {"params": p}, x, rows[None], cols[None], np.arange(1, 17)[None], (4, 4),
      prepend_sos=True))(variables["params"]["backbone"])
  for name in ("block_00", "block_01"):
    head = variables["params"]["probes"][name]["head"]
    stats = variables["batch_stats"]["probes"][name]["bn"]
    pooled = out[name][:, 1:].mean(1)
    feats = (pooled - stats["mean"]) / jnp.sqrt(stats["var"] + 1e-6)
    np.testing.assert_allclose(logits[name], feats @ head["kernel"] + head["bias"],
                               atol=1e-5)
  assert not np.allclose(logits["block_00"], logits["block_01"])


def test_gradients_reach_only_the_probes():
  model = _model()
  images = jax.random.uniform(jax.random.PRNGKey(1), (4, 8, 8, 1), minval=-1, maxval=1)
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), images)
  trainer = linear_probe.LinearProbeTrainer(tiny_probe_config())
  batch = {"image": images, "label": jnp.arange(4)}
  grads = jax.jit(jax.grad(lambda p: trainer.loss_fn(
      model, p, {"batch_stats": variables["batch_stats"]}, batch, None, True)[0]))(
          variables["params"])
  assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree_util.tree_leaves(grads["backbone"]))
  assert all(float(jnp.abs(g).max()) > 0 for g in
             jax.tree_util.tree_leaves(grads["probes"]["block_00"]["head"]))


def test_ridge_probe_separates_separable_classes():
  rng = np.random.default_rng(0)
  centers = rng.normal(size=(3, 16)) * 4
  labels = rng.integers(0, 3, 300)
  feats = centers[labels] + rng.normal(size=(300, 16))
  acc = linear_probe.ridge_accuracy(feats[:200], labels[:200], feats[200:], labels[200:], 3)
  assert acc > 0.95
  noise = rng.normal(size=(300, 16))
  assert linear_probe.ridge_accuracy(noise[:200], labels[:200], noise[200:],
                                     labels[200:], 3) < 0.6


def test_pretraining_logs_the_ridge_probe(pretrained):
  records = metrics_lib.read_metrics(str(pretrained))
  probe = [r for r in records if "val_probe_accuracy" in r]
  assert [r["step"] for r in probe] == [4]
  assert 0.0 <= probe[0]["val_probe_accuracy"] <= 1.0


def test_probe_configs():
  c = runpy.run_path(str(ROOT / "experiments" / "linear_probe_in1k.py"))["get_config"](
      "variant=B/16,init=/ckpt")
  assert c.model.causal and c.optim.name == "lars" and c.optim.frozen == ["^backbone/"]
  assert (c.optim.base_lr, c.optim.lr_scaling, c.optim.weight_decay) == (0.1, True, 0.0)
  assert (c.batch_size, c.total_epochs, c.optim.warmup_epochs) == (16384, 90.0, 10.0)
  assert c.label_smoothing == 0.1 and c.init_from == "/ckpt"


class Recording(linear_probe.LinearProbeTrainer):
  def finalize(self, ctx, model, state):
    self.state = jax.device_get(state)
    super().finalize(ctx, model, state)


def test_linear_probe_end_to_end(pretrained, tmp_path):
  c = tiny_probe_config(str(pretrained))
  trainer = Recording(c)
  last = loop.run(trainer, c, str(tmp_path))
  assert {"val_accuracy_block_00", "val_accuracy_block_01", "val_accuracy"} <= set(last)
  # Frozen: the backbone is bit-identical to the pretrained one.
  start, _ = checkpoint_lib.restore_params(str(pretrained))
  probed, _ = checkpoint_lib.restore_params(str(tmp_path))
  for a, b in zip(jax.tree_util.tree_leaves(start["backbone"]),
                  jax.tree_util.tree_leaves(probed["backbone"])):
    np.testing.assert_array_equal(a, b)
  assert set(probed["probes"]) == {"block_00", "block_01"}
  # BatchNorm statistics moved away from their initial (0, 1).
  stats = trainer.state["model_state"]["batch_stats"]["probes"]["block_01"]["bn"]
  assert np.abs(np.asarray(stats["mean"])).max() > 1e-3
  assert np.abs(np.asarray(stats["var"]) - 1).max() > 1e-3
  report = json.loads((tmp_path / "probe_accuracy.json").read_text())
  assert report["blocks"] == ["block_00", "block_01"]
  assert report["normalized_depth"] == [0.5, 1.0]
  assert report["best_accuracy"] == max(report["accuracy"])
  # The report re-evaluates the same probes on the same split: the loop's last
  # evaluation's numbers (a report fed other inputs, e.g. unconverted uint8
  # images, would read chance here).
  np.testing.assert_allclose(report["accuracy"], [last["val_accuracy_block_00"],
                                                  last["val_accuracy_block_01"]], atol=1e-6)
  assert (tmp_path / "probe_accuracy.png").stat().st_size > 1000
  final = [r for r in metrics_lib.read_metrics(str(tmp_path)) if "val_best_accuracy" in r]
  assert final and final[-1]["val_best_accuracy"] == report["best_accuracy"]


def test_fashion_mnist_pretraining_configs_switch_the_ridge_probe_on():
  """``:probe`` turns on the ridge probe during pretraining from the command line."""
  for name in ("fashion_mnist_diff", "fashion_mnist_mse"):
    get_config = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "experiments" /
                                    f"{name}.py"))["get_config"]
    assert get_config("probe").probe_eval.enabled
    assert not get_config(None).probe_eval.enabled
