"""The run's sizes are decided once (train/fit.py's ``resolve``) and the
start-up says what the compiled step runs; nothing is written into the
config."""

import json

import pytest
from absl import logging

import test_accumulate as acc
from darl_jax import config_lib
from darl_jax.data import pipeline as data_pipeline
from darl_jax.train import fit
from darl_jax.train import setup as setup_lib
from darl_jax.train import startup
from darl_jax.train.trainers import pretrain


def _dump(config) -> str:
  return json.dumps(config.to_dict(), sort_keys=True, default=str)


def test_resolve_decides_the_sizes_without_touching_the_config():
  config = acc.pretrain_config("diffusion", batch_size=16, microbatch_size=8)
  config.data.num_workers = -1
  before = _dump(config)
  resolved = fit.resolve(config, batch_shards=1)
  assert resolved == fit.Resolved(microbatch=8, eval_batch=8,
                                  num_workers=data_pipeline.resolve_num_workers(-1))
  assert resolved.num_microbatches(16) == 2
  assert _dump(config) == before
  config.eval_batch_size = 4               # a set evaluation batch is kept
  assert fit.resolve(config).eval_batch == 4
  config.eval_batch_size, config.microbatch_size = 0, 0
  assert fit.resolve(config) == fit.Resolved(16, 16, resolved.num_workers)
  config.microbatch_size = 5               # bad input: one line naming the fix
  with pytest.raises(config_lib.ConfigError, match="microbatch_size to one of"):
    fit.resolve(config)


def test_automatic_microbatch_is_resolved_before_setup_builds_a_step(monkeypatch):
  """``microbatch_size=-1``: setup builds no train step at a placeholder size;
  the start-up compiles the one ``resolve`` chose, leaves the config as given
  and logs the microbatch the compiled step runs."""
  config = acc.pretrain_config("diffusion", microbatch_size=-1, eval_every_steps=1)
  built = setup_lib.setup(pretrain.PretrainTrainer(config), config)
  with pytest.raises(config_lib.ConfigError, match="microbatch_size=-1 is decided"):
    built.train_step  # pylint: disable=pointless-statement
  params = built.abstract_state["params"]
  estimate = fit.estimator(config, dict(built.mesh.shape), params)
  # Memory for 8 of the 16 examples by the estimate: the microbatch is 8.
  config.device_memory_gib = ((estimate(16) + estimate(8)) * fit.ESTIMATE_ERROR / 2
                              / fit.FIT_FRACTION / fit.GIB)
  monkeypatch.setattr(fit, "device_capacity",
                      lambda device, gib=0.0: int(gib * fit.GIB) if gib else None)
  before = _dump(config)
  lines = []
  monkeypatch.setattr(logging, "info", lambda msg, *a: lines.append(msg % a if a else msg))
  compiled = startup.compile_programs(built, config, eval_step=True, reuse=False)
  assert compiled.resolved.microbatch == compiled.info["microbatch_size"]
  assert compiled.resolved.eval_batch == 8
  assert _dump(config) == before
  step_lines = [line for line in lines if line.startswith("train step: ")]
  assert len(step_lines) == 1
  assert step_lines[0].endswith(f"{16 // compiled.resolved.microbatch} microbatch(es) of "
                                f"{compiled.resolved.microbatch}")


def test_only_minus_one_asks_for_the_automatic_microbatch():
  """fit.automatic is the one reading of microbatch_size's -1 (setup,
  startup and the TPU compile report ask it); an explicit size resolves to
  itself over the batch."""
  config = config_lib.pretrain_config()
  config.batch_size = 32
  for value, automatic, microbatch in ((-1, True, None), (0, False, 32), (8, False, 8)):
    config.microbatch_size = value
    assert fit.automatic(config) is automatic
    if microbatch is not None:
      resolved = fit.resolve(config, batch_shards=2)
      assert resolved.microbatch == microbatch
      assert resolved.num_microbatches(32) == 32 // microbatch
