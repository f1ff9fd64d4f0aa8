"""The EMA of the parameters (darl_jax/ema.py, kept by train/loop.py for every
trainer): its value, its checkpoint, evaluation with it, sampling, export and
fine-tuning from it, and its errors. Tiny models on CPU."""

import json
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import config_lib
from darl_jax import ema as ema_lib
from darl_jax import export
from darl_jax import metrics as metrics_lib
from darl_jax.train.trainers import finetune
from darl_jax.train import loop
from darl_jax.train import trainer as trainer_lib
from darl_jax.train import step as step_lib
from darl_jax.train.trainers import pretrain
from darl_jax.train.jobs import sample as sample_lib
from darl_jax.train import transfer

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import tiny_config  # pylint: disable=wrong-import-position

DECAY = 0.5     # far from 1, so that the average differs clearly from the parameters


def tiny(**overrides):
  """tests/tiny_config.py (4 steps) without pictures, then dotted ``overrides``."""
  c = tiny_config.get_config("steps=4")
  c.predictions.num_images = 0
  for dotted, value in overrides.items():
    parent, key = config_lib.config_node(c, dotted)
    parent[key] = value
  return c


def train(workdir, trainer_cls=pretrain.PretrainTrainer, config=None, **overrides):
  config = config or tiny(**overrides)
  return loop.run(trainer_cls(config), config, str(workdir))


def leaves(tree):
  return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(tree)]


def assert_trees_equal(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def saved_state(workdir, trainer_cls, config, step=None):
  """``(state, meta)`` of a checkpoint, read as the run of ``config`` builds its state."""
  built = loop.setup(trainer_cls(config), config)
  with checkpoint_lib.Checkpointer(str(pathlib.Path(workdir) / "checkpoints")) as ckpt:
    state, meta = ckpt.restore(step, built.abstract_state)
  return jax.device_get(state), meta


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
  """Four pretraining steps with an EMA (decay 0.5), evaluated at step 4."""
  wd = tmp_path_factory.mktemp("ema_run")
  last = train(wd, ema_decay=DECAY, eval_every_steps=4, checkpoint_every_steps=1,
               keep_checkpoints=10)
  return wd, last


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
  """The same four steps without an EMA."""
  wd = tmp_path_factory.mktemp("plain_run")
  train(wd, eval_every_steps=0)
  return wd


# --------------------------------------------------------------- the average


class ConstantStep(trainer_lib.Trainer):
  """Parameters ``w`` whose loss is ``-sum(w)``: SGD moves each by +lr a step."""

  def build_model(self, ctx):
    return None

  def init_variables(self, model, rng, batch):
    return {"params": {"w": jnp.arange(3.0), "b": jnp.ones((2, 2))}}

  def loss_fn(self, model, params, model_state, batch, rng, train):
    return -sum(jnp.sum(p) for p in jax.tree_util.tree_leaves(params)), ({}, model_state)

  def eval_fn(self, model, params, model_state, batch, rng):
    total = sum(jnp.sum(p) for p in jax.tree_util.tree_leaves(params))
    return {"total": jnp.full(batch["label"].shape, total)}


def constant_step_config(steps, decay, lr=0.25):
  c = tiny(total_steps=steps, ema_decay=decay, eval_every_steps=0)
  c.optim.update(name="sgd", momentum=0.0, base_lr=lr, lr_scaling=False, weight_decay=0.0,
                 warmup_steps=0, schedule="constant")
  return c


def test_ema_after_n_steps_is_the_closed_form(tmp_path):
  n, decay, lr = 5, 0.8, 0.25
  c = constant_step_config(n, decay, lr)
  train(tmp_path, ConstantStep, c)
  state, _ = saved_state(tmp_path, ConstantStep, c)
  # p_k = p_0 + k lr; the debiased average of p_1 .. p_n with weights
  # decay^(n-k) (1 - decay), divided by their sum 1 - decay^n.
  weights = np.array([decay ** (n - k) * (1 - decay) for k in range(1, n + 1)])
  assert float(state["ema"]["weight"]) == pytest.approx(1 - decay ** n, rel=1e-6)
  p0 = {"w": np.arange(3.0), "b": np.ones((2, 2))}
  want = {k: sum(w * (v + k_ * lr) for k_, w in zip(range(1, n + 1), weights)) / weights.sum()
          for k, v in p0.items()}
  got, meta = checkpoint_lib.restore_params(str(tmp_path), use_ema=True)
  assert meta["restored_weights"] == "ema"
  for k in p0:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(state["params"][k], p0[k] + n * lr, rtol=1e-6)
  assert state["ema"]["params"]["w"].dtype == np.float32


def test_average_is_the_parameters_until_the_first_update_and_debiased_after():
  p0, p1 = {"w": jnp.asarray(2.0)}, {"w": jnp.asarray(4.0)}
  ema = ema_lib.init(p0)
  assert float(ema_lib.average(ema, p0)["w"]) == 2.0            # empty: the parameters
  ema = ema_lib.update(ema, p0, 0.5)
  assert float(ema_lib.average(ema, p1)["w"]) == 2.0            # starts exactly at them
  ema = ema_lib.update(ema, p1, 0.5)
  # (0.5 * 0.5 * 2 + 0.5 * 4) / (1 - 0.25)
  assert float(ema_lib.average(ema, p1)["w"]) == pytest.approx(10 / 3)
  assert float(ema_lib.host_average(jax.device_get(ema))["w"]) == pytest.approx(10 / 3)
  with pytest.raises(ema_lib.MissingEmaError, match="not been updated"):
    ema_lib.host_average(ema_lib.init(p0))


def test_a_nonfinite_step_leaves_the_ema_untouched():
  class NaNStep(ConstantStep):
    def loss_fn(self, model, params, model_state, batch, rng, train):
      loss, aux = super().loss_fn(model, params, model_state, batch, rng, train)
      return loss * jnp.nan, aux

  c = constant_step_config(3, 0.9)
  built = loop.setup(NaNStep(c), c)
  state = built.init_state()
  batch = next(built.ctx.train_source.train_batches(c.batch_size))
  for i in range(2):
    state, _ = built.train_step(state, jax.device_put(batch, built.batch_sharding),
                                built.hyper(i))
  assert int(state["bad_step"]) == 1 and float(state["ema"]["weight"]) == 0.0
  assert all((x == 0).all() for x in leaves(state["ema"]["params"]))


def test_ema_shares_the_parameters_sharding():
  c = tiny(ema_decay=0.9)
  built = loop.setup(pretrain.PretrainTrainer(c), c)
  assert built.state_shardings["ema"]["params"] == built.state_shardings["params"]
  assert all(x.dtype == jnp.float32
             for x in jax.tree_util.tree_leaves(built.abstract_state["ema"]))


# ------------------------------------------------------------- checkpoints


def test_turning_the_ema_on_at_a_resume_starts_it_there(tmp_path, caplog):
  train(tmp_path, stop_after_steps=2, eval_every_steps=0, checkpoint_every_steps=1,
        keep_checkpoints=10)
  with pytest.raises(ema_lib.MissingEmaError, match="holds no EMA"):
    checkpoint_lib.restore_params(str(tmp_path), use_ema=True)
  caplog.set_level("INFO")
  train(tmp_path, ema_decay=DECAY, eval_every_steps=0, checkpoint_every_steps=1,
        keep_checkpoints=10)
  assert "has no EMA of the parameters" in caplog.text and "starts now" in caplog.text
  p3, _ = checkpoint_lib.restore_params(str(tmp_path), step=3)
  p4, _ = checkpoint_lib.restore_params(str(tmp_path), step=4)
  ema, meta = checkpoint_lib.restore_params(str(tmp_path), step=4, use_ema=None)
  assert meta["restored_weights"] == "ema"
  # Averaged from step 3 on: (d (1 - d) p3 + (1 - d) p4) / (1 - d^2).
  for e, a, b in zip(leaves(ema), leaves(p3), leaves(p4), strict=True):
    np.testing.assert_allclose(e, (DECAY * a + b) / (1 + DECAY), rtol=1e-5, atol=1e-6)


def test_turning_the_ema_off_at_a_resume_names_the_key(ema_run, tmp_path):
  wd = tmp_path / "wd"
  shutil.copytree(ema_run[0], wd)
  with pytest.raises(ValueError) as e:
    train(wd, total_steps=6, eval_every_steps=0)
  assert "only in the checkpoint: ema/" in str(e.value)
  assert f"ema_decay: {DECAY} -> 0.0" in str(e.value)


def test_an_earlier_finetune_checkpoint_with_its_ema_in_model_state_resumes(tmp_path):
  """Fine-tuning runs of earlier versions kept ``{"params", "count"}`` in
  ``model_state["ema"]``: such a checkpoint resumes, and continues as the
  same run in today's layout does."""
  c = finetune.finetune_config()
  c.update(total_steps=5, batch_size=16, log_every_steps=1, eval_every_steps=0,
           checkpoint_every_steps=1, ema_decay=0.9, tensorboard=False)
  c.data.update(name="digits", image_size=8, channels=1, augment="none", num_workers=0)
  c.model.update(variant="mu/2", image_size=8, channels=1, rope_max_wavelength=100.0)
  c.randaugment.num_ops = 0
  c.optim.update(warmup_steps=1)
  now, old = tmp_path / "now", tmp_path / "old"
  c.stop_after_steps = 3
  train(now, finetune.FinetuneTrainer, c)
  # The same checkpoint as the earlier code would have written it.
  state, meta = saved_state(now, finetune.FinetuneTrainer, c, 3)
  ema = state.pop("ema")
  state["model_state"] = {"ema": {"params": ema["params"], "count": np.int32(3)}}
  with checkpoint_lib.Checkpointer(str(old / "checkpoints")) as ckpt:
    ckpt.save(3, state, meta)
  legacy, read = checkpoint_lib.restore_params(str(old), use_ema=True)
  assert read["restored_weights"] == "ema"
  for a, b in zip(leaves(legacy), leaves(ema_lib.host_average(ema)), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5)
  c.stop_after_steps = 0
  train(now, finetune.FinetuneTrainer, c)
  train(old, finetune.FinetuneTrainer, c)
  a, _ = saved_state(now, finetune.FinetuneTrainer, c)
  b, _ = saved_state(old, finetune.FinetuneTrainer, c)
  assert "ema" in b and b["model_state"] == {}
  assert_trees_equal(a["params"], b["params"])
  for x, y in zip(leaves(a["ema"]), leaves(b["ema"]), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-5)


# -------------------------------------------------------------- evaluation


def manual_eval(config, params):
  trainer = pretrain.PretrainTrainer(config)
  built = loop.setup(trainer, config)
  state = {"params": jax.device_put(params), "model_state": {}}
  return step_lib.evaluate(trainer, built.model, state, built.ctx.eval_source, built.eval_step,
                       built.batch_sharding, config)["loss"]


def test_evaluation_uses_the_ema_when_asked(ema_run, tmp_path):
  wd, last = ema_run
  c = tiny(ema_decay=DECAY)
  raw, _ = checkpoint_lib.restore_params(str(wd))
  ema, _ = checkpoint_lib.restore_params(str(wd), use_ema=True)
  with_ema, with_raw = manual_eval(c, ema), manual_eval(c, raw)
  assert last["val_loss"] == pytest.approx(with_ema, rel=1e-5)
  assert abs(with_ema - with_raw) > 1e-3
  # eval_with_ema=False: the same run evaluates its parameters.
  last = train(tmp_path, ema_decay=DECAY, eval_with_ema=False, eval_every_steps=4)
  assert last["val_loss"] == pytest.approx(with_raw, rel=1e-5)


def test_the_ema_is_optional_everywhere_and_validated(tmp_path):
  assert config_lib.base_config().ema_decay == 0.0
  assert config_lib.base_config().eval_with_ema is True
  with pytest.raises(config_lib.ConfigError, match="config.ema_decay must be in"):
    train(tmp_path, ema_decay=1.0)
  assert not tmp_path.exists() or not any(tmp_path.iterdir())


# ------------------------------------------- sampling, export, fine-tuning


def sample_config(init_from, **over):
  c = sample_lib.sample_config()
  c.init_from = str(init_from)
  c.tensorboard = False
  c.batch_size = 2
  c.sample.update(num_images=2, num_samples=1, num_steps=2, grid_images=2, **over)
  return c


@pytest.mark.parametrize("use_ema,weights", [(None, "ema"), (True, "ema"), (False, "params")])
def test_sampling_takes_the_ema_by_choice(ema_run, tmp_path, monkeypatch, use_ema, weights):
  seen = []
  real = sample_lib.complete_all

  def complete_all(sampler, params, *args):
    seen.append(jax.device_get(params))
    return real(sampler, params, *args)

  monkeypatch.setattr(sample_lib, "complete_all", complete_all)
  metrics = sample_lib.run(sample_config(ema_run[0], use_ema=use_ema), str(tmp_path))
  want, _ = checkpoint_lib.restore_params(str(ema_run[0]), use_ema=weights == "ema")
  assert_trees_equal(seen[0], want)
  assert metrics["used_ema"] == float(weights == "ema")


def test_sampling_an_ema_the_run_did_not_keep_is_an_error(plain_run, tmp_path):
  with pytest.raises(ema_lib.MissingEmaError, match="leave out --config.sample.use_ema"):
    sample_lib.run(sample_config(plain_run, use_ema=True), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()                 # nothing written
  metrics = sample_lib.run(sample_config(plain_run), str(tmp_path / "out"))
  assert metrics["used_ema"] == 0.0


def test_export_takes_the_ema_by_choice(ema_run, plain_run, tmp_path, capsys):
  from safetensors.numpy import load_file
  wd = str(ema_run[0])
  ema, _ = checkpoint_lib.restore_params(wd, use_ema=True)
  raw, _ = checkpoint_lib.restore_params(wd)
  config = checkpoint_lib.stored_config(wd, checkpoint_lib.read_meta(wd)[1])
  for flags, params, weights in (([], ema, "ema"), (["--use_ema"], ema, "ema"),
                                 (["--no-use_ema"], raw, "params")):
    out = tmp_path / f"{weights}{len(flags)}.safetensors"
    assert export.main([f"--checkpoint={wd}", f"--out={out}", *flags]) == 0
    want = export.backbone_tensors(params["backbone"], export.backbone_spec(config))
    got = load_file(str(out))
    assert sorted(got) == sorted(want)
    for name in want:
      np.testing.assert_array_equal(got[name], want[name])
    assert json.loads(export.sidecar_path(out).read_text())["source"]["weights"] == weights
  capsys.readouterr()
  out = tmp_path / "none.safetensors"
  assert export.main([f"--checkpoint={plain_run}", f"--out={out}", "--use_ema"]) == 1
  error = capsys.readouterr().err
  assert "holds no EMA of the parameters" in error and "leave out --use_ema" in error
  assert not out.exists()


def test_finetuning_loads_the_ema_by_choice(ema_run, plain_run, tmp_path):
  from test_finetune import abstract_classifier_params, tiny_finetune_config
  wd = str(ema_run[0])
  _, target = abstract_classifier_params(tiny_finetune_config())
  ema, _ = checkpoint_lib.restore_params(wd, use_ema=True)
  raw, _ = checkpoint_lib.restore_params(wd)
  for use_ema, want, weights in ((None, ema, "ema"), (True, ema, "ema"),
                                 (False, raw, "params")):
    merged, report = transfer.restore_into(target, wd, use_ema=use_ema)
    assert report.weights == weights
    assert_trees_equal(merged["backbone"], want["backbone"])
  # The fine-tuning config's key, and its error on a run without an EMA.
  c = tiny_finetune_config(str(plain_run))
  c.use_ema = True
  with pytest.raises(ema_lib.MissingEmaError, match="leave out --config.use_ema"):
    train(tmp_path / "ft", finetune.FinetuneTrainer, c)
  assert not (tmp_path / "ft" / "config.json").exists()
  c = tiny_finetune_config(wd)
  train(tmp_path / "ft2", finetune.FinetuneTrainer, c)
  report = json.loads((tmp_path / "ft2" / "init_report.json").read_text())
  assert report["weights"] == "ema"
  records = metrics_lib.read_metrics(str(tmp_path / "ft2"))
  assert any("val_accuracy" in r for r in records)
