"""Fine-tuning and the supervised baseline: partial restore, config wiring, end to end."""

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
from darl_jax import optim
from darl_jax.models import heads
from darl_jax.models import vit as vit_lib
from darl_jax.train.trainers import finetune
from darl_jax.train import loop
from darl_jax.train import feed as feed_lib
from darl_jax.train.trainers import pretrain
from darl_jax.train.trainers import supervised
from darl_jax.train import transfer
from darl_jax.train import backbone as backbone_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import tiny_config  # pylint: disable=wrong-import-position


def experiment(name, arg=None):
  return runpy.run_path(str(ROOT / "experiments" / f"{name}.py"))["get_config"](arg)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """A 4-step tiny DARL pretraining run on digits (mu/2 backbone, linear decoder)."""
  wd = tmp_path_factory.mktemp("pretrain")
  c = tiny_config.get_config("steps=4")
  c.eval_every_steps = 0
  c.predictions.num_images = 0
  loop.run(pretrain.PretrainTrainer(c), c, str(wd))
  return wd


def tiny_finetune_config(init=""):
  c = finetune.finetune_config()
  c.init_from = init
  c.update(total_steps=3, batch_size=16, log_every_steps=1, eval_every_steps=3,
           checkpoint_every_steps=3, eval_max_batches=2, ema_decay=0.9)
  c.data.update(name="digits", image_size=8, channels=1, augment="spatial")
  c.model.update(variant="mu/2", image_size=8, channels=1, rope_max_wavelength=100.0)
  c.optim.update(warmup_steps=1)
  return c


def abstract_classifier_params(config, num_classes=10):
  backbone, patch = vit_lib.vit_from_config(config.model)
  model = heads.Classifier(backbone=backbone, patch_size=patch, num_classes=num_classes,
                           readout=config.head.readout)
  size, ch = config.model.image_size, config.model.channels
  return model, jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, size, size, ch)))["params"])


# ------------------------------------------------------------------ restore


def test_restore_reports_loaded_dropped_and_new(pretrained):
  _, target = abstract_classifier_params(tiny_finetune_config())
  merged, report = transfer.restore_into(target, str(pretrained))
  ckpt, _ = checkpoint_lib.restore_params(str(pretrained))
  ckpt_flat = transfer.flatten(ckpt)
  assert report.new == ["head/bias", "head/kernel"]
  assert report.loaded == sorted(p for p in ckpt_flat if p.startswith("backbone/"))
  assert report.dropped == sorted(p for p in ckpt_flat if p.startswith("decoder/"))
  assert report.dropped and report.step == 4
  flat = transfer.flatten(merged)
  for path in report.loaded:
    np.testing.assert_array_equal(flat[path], ckpt_flat[path])


def test_shape_mismatch_names_the_parameter_and_both_shapes(pretrained):
  c = tiny_finetune_config()
  c.model.mlp_dim = 128                                    # mu/2 was pretrained with 256
  _, target = abstract_classifier_params(c)
  with pytest.raises(ValueError, match=r"backbone/block_00/mlp/fc1/kernel: checkpoint "
                                       r"\(64, 256\) vs model \(64, 128\)"):
    transfer.restore_into(target, str(pretrained))


def test_missing_backbone_parameters_are_an_error(pretrained):
  c = tiny_finetune_config()
  c.model.depth = 3                                        # mu/2 was pretrained with 2
  _, target = abstract_classifier_params(c)
  with pytest.raises(ValueError, match="lacks .* backbone parameter.*block_02"):
    transfer.restore_into(target, str(pretrained))


def test_higher_resolution_restores_and_runs(pretrained):
  c = tiny_finetune_config()
  c.model.update(image_size=16, reference_image_size=8)    # pretrain 8 -> fine-tune 16
  model, target = abstract_classifier_params(c)
  merged, report = transfer.restore_into(target, str(pretrained))
  assert report.new == ["head/bias", "head/kernel"]
  merged["head"] = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype),
                                          merged["head"])
  logits, _ = jax.jit(model.apply)({"params": merged}, jnp.zeros((2, 16, 16, 1)))
  assert logits.shape == (2, 10) and np.isfinite(np.asarray(logits)).all()


# ------------------------------------------------------------ config wiring


def test_layer_decay_multipliers_from_the_finetune_in1k_config():
  c = experiment("finetune_in1k", "variant=B/16,epochs=90")
  assert c.optim.num_layers == 12 and c.optim.layer_decay == 0.75
  _, params = abstract_classifier_params(c, num_classes=1000)
  mult = transfer.flatten(optim.layer_multipliers(c.optim, params))
  for i in range(12):
    assert mult[f"backbone/block_{i:02d}/attn/qkv/kernel"] == pytest.approx(0.75 ** (12 - i))
  assert mult["backbone/patch_embed/kernel"] == pytest.approx(0.75 ** 13)
  assert mult["backbone/sos"] == pytest.approx(0.75 ** 13)
  assert mult["backbone/norm/scale"] == 1.0 and mult["head/kernel"] == 1.0


def test_finetune_in1k_recipes_per_variant():
  assert experiment("finetune_in1k", "variant=L/16,epochs=50").model.drop_path == 0.0
  c = experiment("finetune_in1k", "variant=L/16,epochs=90,res=384,init=/ckpt")
  assert c.model.drop_path == 0.1 and c.init_from == "/ckpt"
  assert (c.model.image_size, c.model.reference_image_size) == (384, 224)
  assert not c.model.causal and c.head.readout == "last"
  h = experiment("finetune_in1k", "variant=H/14")
  assert (h.optim.base_lr, h.model.drop_path, h.optim.num_layers) == (3e-3, 0.2, 32)
  assert (h.mixup.mixup_alpha, h.mixup.cutmix_alpha, h.label_smoothing) == (0.8, 1.0, 0.1)
  assert (h.randaugment.magnitude, h.randaugment.magnitude_std) == (9.0, 0.5)
  with pytest.raises(ValueError, match="variant must be one of"):
    experiment("finetune_in1k", "variant=S/16")


def test_trainer_defaults_num_layers_to_the_backbone_depth():
  c = tiny_finetune_config()
  assert c.optim.num_layers == 0
  finetune.FinetuneTrainer(c)
  assert c.optim.num_layers == 2


def test_supervised_config_and_no_checkpoint():
  c = experiment("supervised_in1k", "posenc=learned,causal=True")
  assert c.trainer == "supervised" and c.model.posenc == "learned" and c.model.causal
  assert c.head.readout == "mean" and c.model.drop_path == 0.2
  assert (c.optim.base_lr, c.optim.lr_scaling, c.optim.weight_decay) == (1e-4, True, 0.3)
  assert (c.total_epochs, c.optim.warmup_epochs, c.batch_size) == (200.0, 20.0, 4096)
  c.init_from = "/some/run"
  with pytest.raises(ValueError, match="trains from scratch"):
    supervised.SupervisedTrainer(c).load_pretrained(None, {})


def test_main_registers_the_downstream_trainers():
  from darl_jax import main
  registry = main.trainers()
  assert registry["finetune"] is finetune.FinetuneTrainer
  assert registry["supervised"] is supervised.SupervisedTrainer
  assert "linear_probe" in registry


# -------------------------------------------------------------- end to end


def test_finetune_from_tiny_pretraining_writes_val_accuracy(pretrained, tmp_path):
  c = tiny_finetune_config(str(pretrained))
  last = loop.run(finetune.FinetuneTrainer(c), c, str(tmp_path))
  assert 0.0 <= last["val_accuracy"] <= 1.0
  records = metrics_lib.read_metrics(str(tmp_path))
  assert [r["step"] for r in records if "val_accuracy" in r] == [3]
  assert {"config.json", "metrics.jsonl", "checkpoints", "init_report.json"} <= {
      p.name for p in tmp_path.iterdir()}
  report = json.loads((tmp_path / "init_report.json").read_text())
  assert report["new"] == ["head/bias", "head/kernel"]
  assert all(p.startswith("decoder/") for p in report["dropped"])
  tuned, _ = checkpoint_lib.restore_params(str(tmp_path))
  start, _ = checkpoint_lib.restore_params(str(pretrained))
  moved = np.abs(np.asarray(tuned["backbone"]["block_01"]["mlp"]["fc2"]["kernel"])
                 - np.asarray(start["backbone"]["block_01"]["mlp"]["fc2"]["kernel"])).max()
  assert moved > 0                                         # the backbone is fine-tuned


def test_eval_image_sizes_scores_the_trained_weights_at_another_resolution(tmp_path):
  c = tiny_finetune_config()
  c.ema_decay = 0.0
  c.eval_image_sizes = [16]
  last = loop.run(finetune.FinetuneTrainer(c), c, str(tmp_path))
  assert "val_accuracy_at_16" in last
  # The same number by hand: the trained weights in a 16 x 16 classifier whose
  # positions are interpolated to the 8 x 8 training grid, on upsampled images.
  at = tiny_finetune_config()
  at.data.image_size = 16
  at.model.update(image_size=16, reference_image_size=8)
  model, _ = abstract_classifier_params(at)
  params, _ = checkpoint_lib.restore_params(str(tmp_path))
  source = backbone_lib.build_source(at, "validation", train=False)
  correct = count = 0
  for i, batch in enumerate(source.eval_batches(16, 0, 1)):
    if i >= c.eval_max_batches:
      break
    logits, _ = model.apply({"params": params}, feed_lib.model_input(batch)["image"])
    mask = np.asarray(batch["mask"], bool)
    correct += int((np.argmax(np.asarray(logits), -1) == batch["label"])[mask].sum())
    count += int(mask.sum())
  assert last["val_accuracy_at_16"] == pytest.approx(correct / count, abs=1e-6)


def test_eval_image_sizes_refuses_the_training_size(tmp_path):
  c = tiny_finetune_config()
  c.update(eval_image_sizes=[8], ema_decay=0.0)
  with pytest.raises(ValueError, match="training size 8"):
    loop.run(finetune.FinetuneTrainer(c), c, str(tmp_path))
