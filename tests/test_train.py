"""The pretraining command end to end: CLI, sharding, resume, kills, bad input."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
import pytest

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import metrics as metrics_lib
from darl_jax.train import loop
from darl_jax.train import step as step_lib
from darl_jax.train.trainers import pretrain
from xla_env import cpu_devices_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "tiny_config.py")


def cli(workdir, *overrides, arg="", devices=1, check=True, timeout=300, wait=True):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             XLA_FLAGS=cpu_devices_flags(devices))
  cmd = [sys.executable, "-m", "darl_jax.main", f"--config={TINY}{':' + arg if arg else ''}",
         f"--workdir={workdir}", *overrides]
  if not wait:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)
  if check and proc.returncode:
    raise AssertionError(f"exit {proc.returncode}\n{proc.stderr[-4000:]}")
  return proc


def losses(workdir) -> dict:
  """step -> training loss (the last record wins, as after a resume)."""
  out = {}
  for m in metrics_lib.read_metrics(str(workdir)):
    if "loss" in m and "grad_norm" in m:
      out[m["step"]] = m["loss"]
  return out


def final_params(workdir):
  params, meta = checkpoint_lib.restore_params(str(workdir))
  return params, meta


def assert_trees_close(a, b, atol):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                               atol=atol, rtol=0)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  """Eight steps in one go: the reference for resume and kill tests."""
  wd = tmp_path_factory.mktemp("straight")
  cli(wd)
  return wd


def test_cli_writes_the_workdir_contract_and_the_loss_falls(tmp_path):
  cli(tmp_path, "--config.total_steps=40", "--config.checkpoint_every_steps=20",
      "--config.eval_every_steps=20", "--config.tensorboard=True", arg="objective=diffusion")
  names = {p.name for p in tmp_path.iterdir()}
  assert {"config.json", "metrics.jsonl", "tensorboard", "checkpoints",
          "predictions.png"} <= names
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["trainer"] == "pretrain" and config["total_steps"] == 40
  ls = losses(tmp_path)
  assert sorted(ls) == list(range(1, 41))
  assert np.mean([ls[s] for s in range(36, 41)]) < 0.5 * np.mean([ls[s] for s in (1, 2, 3)])
  records = metrics_lib.read_metrics(str(tmp_path))
  assert any("val_loss" in r for r in records)
  logged = next(r for r in records if "grad_norm" in r)
  for key in ("learning_rate", "img_per_sec", "loss_gamma_bin_00"):
    assert key in logged
  assert any((tmp_path / "tensorboard").rglob("*")), "no TensorBoard events"
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
                if p.name.isdigit()) == [20, 40]


def test_logged_parameter_norm_is_the_checkpointed_parameters_norm(straight_run):
  """param_norm is read from the state at each log (not a per-step metric):
  at the last step it is the norm of the parameters saved there."""
  logged = [r for r in metrics_lib.read_metrics(str(straight_run)) if "param_norm" in r]
  params, meta = final_params(straight_run)
  # tiny_config's config.tensorboard=False: metrics.jsonl only
  assert not (straight_run / "tensorboard").exists()
  assert logged[-1]["step"] == meta["step"]
  want = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2)
                     for x in jax.tree_util.tree_leaves(params)))
  np.testing.assert_allclose(logged[-1]["param_norm"], want, rtol=1e-5)


def test_sharded_step_matches_single_device(tmp_path, straight_run):
  # 8 fake CPU devices, batch over data=4 x fsdp=2, parameters FSDP-sharded.
  cli(tmp_path, "--config.mesh.data=4", "--config.mesh.fsdp=2", "--config.sharding=fsdp",
      devices=8)
  single, sharded = losses(straight_run), losses(tmp_path)
  assert sorted(single) == sorted(sharded)
  # Tolerance: the sharded reductions sum in another order (float32).
  np.testing.assert_allclose([sharded[s] for s in sorted(single)],
                             [single[s] for s in sorted(single)], rtol=2e-5)
  assert_trees_close(final_params(tmp_path)[0], final_params(straight_run)[0], atol=2e-5)


def test_resumed_run_replays_the_uninterrupted_one(tmp_path, straight_run):
  cli(tmp_path, "--config.stop_after_steps=3")       # steps 1-3, checkpoint at 3
  assert checkpoint_lib.Checkpointer(str(tmp_path / "checkpoints")).latest_step() == 3
  assert not (tmp_path / "predictions.png").exists()
  cli(tmp_path)                                       # a new process: steps 4-8
  a, b = losses(straight_run), losses(tmp_path)
  assert sorted(a) == sorted(b) == list(range(1, 9))
  # Same data order, same noise, same updates: equal up to float32 rounding.
  np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=1e-6, atol=1e-7)
  assert_trees_close(final_params(tmp_path)[0], final_params(straight_run)[0], atol=1e-6)


def test_run_killed_mid_training_resumes_from_last_complete_checkpoint(tmp_path, straight_run):
  # Checkpoints every 2 steps; the losses do not depend on how often a run
  # saves, so the straight 8-step run is the reference.
  steps = ("--config.checkpoint_every_steps=2",)
  wd = tmp_path / "killed"
  proc = cli(wd, *steps, wait=False)
  ckpts = wd / "checkpoints"
  deadline = time.time() + 240
  while time.time() < deadline:
    done = [p for p in ckpts.glob("*") if p.name.isdigit()] if ckpts.exists() else []
    if done:
      break
    time.sleep(0.05)
  os.kill(proc.pid, signal.SIGKILL)     # wherever it is: maybe mid-save
  proc.wait()
  survivors = checkpoint_lib.Checkpointer(str(ckpts)).latest_step()
  assert survivors is not None and survivors < 8
  cli(wd, *steps)                       # the same command resumes and finishes
  a, b = losses(straight_run), losses(wd)
  np.testing.assert_allclose([b[s] for s in sorted(a)], [a[s] for s in sorted(a)],
                             rtol=1e-6, atol=1e-7)
  assert_trees_close(final_params(wd)[0], final_params(straight_run)[0], atol=1e-6)


# ------------------------------------------------------------------- bad input


def test_unknown_config_key_is_one_line_naming_the_valid_keys(tmp_path):
  proc = cli(tmp_path, "--config.model.widht=64", check=False)
  assert proc.returncode == 2
  lines = [l for l in proc.stderr.strip().splitlines() if l.startswith("error:")]
  assert len(lines) == 1, proc.stderr
  assert "model has no key 'widht'" in lines[0] and "width" in lines[0]
  assert "Traceback" not in proc.stderr


def test_architecture_mismatch_on_resume_names_the_difference(tmp_path, straight_run):
  # Resume the straight run's workdir (a copy) with another width.
  import shutil
  wd = tmp_path / "wd"
  shutil.copytree(straight_run, wd)
  proc = cli(wd, "--config.total_steps=10", "--config.model.width=32", check=False)
  assert proc.returncode == 1
  assert "another architecture (model.width: 0 -> 32)" in proc.stderr
  assert "use a new --workdir" in proc.stderr
  assert "Traceback" not in proc.stderr


def _tiny():
  sys.path.insert(0, str(ROOT / "tests"))
  import tiny_config
  return tiny_config.get_config()


@pytest.mark.parametrize("mutate,message", [
    (lambda c: c.model.update(variant="XL/2"), "unknown model variant 'XL/2'"),
    (lambda c: c.update(trainer="pretrain") or c.model.update(image_size=9),
     "model expects 9x9x1"),
    (lambda c: c.model.update(variant="mu/3"), "image size 8 is not divisible by patch size 3"),
    (lambda c: c.data.update(name="fashion_mnist", path="/nonexistent"),
     "apt-get install -y dataset-fashion-mnist"),
    (lambda c: c.data.update(name="imagenet2012", image_size=8, tfds_data_dir="/nonexistent"),
     "tfds build imagenet2012"),
    (lambda c: c.data.update(name="cifar11"), "unknown dataset|valid"),
    (lambda c: c.mesh.update(data=2), "needs 2 devices, found 1"),
])
def test_bad_input_fails_early_with_the_fix(tmp_path, mutate, message):
  config = _tiny()
  mutate(config)
  with pytest.raises((ValueError, FileNotFoundError, ImportError), match=message):
    loop.run(pretrain.PretrainTrainer(config), config, str(tmp_path))


def test_relative_workdir_is_resolved_against_the_current_directory(tmp_path, monkeypatch):
  # The README's command passes a relative --workdir; Orbax needs absolute paths.
  monkeypatch.chdir(tmp_path)
  config = _tiny()
  config.total_steps = 2
  config.checkpoint_every_steps = 1
  config.predictions.num_images = 0
  loop.run(pretrain.PretrainTrainer(config), config, "workdirs/relative")
  assert checkpoint_lib.Checkpointer(
      str(tmp_path / "workdirs/relative/checkpoints")).latest_step() == 2


class NaNTrainer(pretrain.PretrainTrainer):
  def loss_fn(self, model, params, model_state, batch, rng, train):
    loss, aux = super().loss_fn(model, params, model_state, batch, rng, train)
    return loss * np.nan, aux


def test_nonfinite_loss_stops_before_any_checkpoint(tmp_path):
  config = _tiny()
  with pytest.raises(loop.NonFiniteError, match="non-finite loss or gradient norm at step 1 "):
    loop.run(NaNTrainer(config), config, str(tmp_path))
  assert checkpoint_lib.Checkpointer(str(tmp_path / "checkpoints")).latest_step() is None


def test_skip_nonfinite_keeps_the_parameters_finite(tmp_path):
  config = _tiny()
  config.skip_nonfinite = True
  config.total_steps = 3
  config.predictions.num_images = 0
  last = loop.run(NaNTrainer(config), config, str(tmp_path))
  assert last["nonfinite"] == 1.0
  params, _ = final_params(tmp_path)
  assert all(np.isfinite(np.asarray(p, np.float32)).all()
             for p in jax.tree_util.tree_leaves(params))


def test_evaluation_keeps_at_most_one_batch_ahead_of_the_devices(monkeypatch):
  """step_lib.evaluate waits for batch i - 1's outputs once batch i is
  dispatched: a host that queued every batch while a device lagged
  deadlocked XLA:CPU's collectives (train/jobs/knn.py, "Dispatch")."""
  class Source:
    def eval_batches(self, size, *unused, **unused_kw):
      for i in range(5):
        yield {"image": np.full((size, 2, 2, 1), i, np.uint8),
               "label": np.zeros((size,), np.int32), "mask": np.ones((size,), bool)}

  events = []
  waited = jax.block_until_ready

  def eval_fn(params, model_state, batch):
    i = int(batch["image"][0, 0, 0, 0])
    events.append(("dispatch", i))
    return {"score": jax.numpy.full((), float(i)), "id": i}

  def block(tree):
    if tree is not None:
      events.append(("wait", tree["id"]))
    return waited(tree)

  monkeypatch.setattr(jax, "block_until_ready", block)
  config = ml_collections.ConfigDict({"eval_max_batches": 0, "eval_batch_size": 2,
                                      "batch_size": 2, "data": {"num_workers": 0}})
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  scores = step_lib.evaluate(None, None, {"params": None, "model_state": None}, Source(), eval_fn,
                         sharding, config)
  assert scores["score"] == pytest.approx(1.0)     # (0 + 1 + 2 + 3 + 4) x 2 rows / 10 rows
  for i in range(1, 5):   # batch i - 1 is waited for once batch i is dispatched ...
    assert events.index(("dispatch", i)) < events.index(("wait", i - 1))
  for i in range(1, 4):   # ... and before batch i + 1 is
    assert events.index(("wait", i - 1)) < events.index(("dispatch", i + 1))
