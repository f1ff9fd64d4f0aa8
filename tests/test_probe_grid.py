"""The probe grid (train/probe_grid.py): each head trains as it would alone at
its setting, the held-out rows are apart from everything else, the report
holds the choice and the grid."""

import json
import pathlib
import sys

import jax
import numpy as np
import pytest

from darl_jax import config_lib
from darl_jax import metrics as metrics_lib
from darl_jax.data import holdout
from darl_jax.studies import spec as S
from darl_jax.train.trainers import attentive_probe
from darl_jax.train.trainers import linear_probe
from darl_jax.train import loop
from darl_jax.train import probe_grid
from darl_jax.train import backbone as backbone_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_linear_probe import tiny_probe_config  # pylint: disable=wrong-import-position

STEPS = 3


def _config(kind="linear", **probe):
  c = tiny_probe_config()
  if kind == "attentive":
    a = attentive_probe.attentive_probe_config()
    a.update(total_steps=c.total_steps, batch_size=c.batch_size, eval_max_batches=2)
    a.data.update(c.data.to_dict())
    a.model.update(c.model.to_dict())
    a.optim.update(warmup_steps=1)
    a.probe.blocks = (0, 1)
    c = a
  c.update(tensorboard=False)
  c.data.num_workers = 0
  c.probe.update(probe)
  return c


def _trained(trainer_class, config, init=None, batches=None):
  """``(state, batches)`` after STEPS train steps of ``trainer_class`` at
  ``config``; ``init(state) -> state`` edits the initial state; the batches
  are the first steps' of the full training split unless given."""
  built = loop.setup(trainer_class(config), config)
  state = built.init_state()
  if init is not None:
    state = init(state)
  if batches is None:
    source = linear_probe.backbone_lib.build_source(config, config.data.train_split, train=True)
    batches = [source.train_batch(s, config.batch_size) for s in range(STEPS)]
  for i, batch in enumerate(batches):
    state, _ = built.train_step(state, batch, built.hyper(i))
  return jax.device_get(state), batches


def _stack(trees):
  return jax.tree.map(lambda *xs: np.stack(xs), *trees)


def _close(a, b, skip=()):
  a, b = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  assert [p for p, _ in a] == [p for p, _ in b]
  for (path, x), (_, y) in zip(a, b):
    if jax.tree_util.keystr(path) not in skip:
      np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def single_init():
  """The initial state of the single-setting probes (linear, attentive)."""
  return {kind: jax.device_get(loop.setup(cls(_config(kind)), _config(kind)).init_state())
          for kind, cls in (("linear", linear_probe.LinearProbeTrainer),
                            ("attentive", attentive_probe.AttentiveProbeTrainer))}


# The grid's initial heads are the single-setting probe's, so that both start alike.
def _linear_init(single_state, blocks):
  heads = _stack([single_state["params"]["probes"][k] for k in blocks])

  def init(state):
    grid = state["model_state"]["grid"]
    grid["params"] = {n: heads for n in grid["params"]}
    state["params"]["backbone"] = single_state["params"]["backbone"]
    return state
  return init


@pytest.mark.parametrize("grid", [
    # A grid of one: the single setting through the grid's own optimizer.
    dict(learning_rates=(6.4,)),
    # Two learning rates at a weight decay (LARS: trust ratio and decay per head).
    dict(learning_rates=(0.5, 6.4), weight_decays=(0.1,)),
])
def test_linear_grid_heads_train_as_alone(grid, single_init):
  blocks = backbone_lib.block_names(2)
  single0 = single_init["linear"]
  state, batches = _trained(linear_probe.LinearProbeTrainer, _config(**grid),
                            _linear_init(single0, blocks))
  for s in probe_grid.settings(_config(**grid)):
    alone = _config()
    alone.optim.update(base_lr=s.learning_rate, weight_decay=s.weight_decay)
    ref, _ = _trained(linear_probe.LinearProbeTrainer, alone,
                      lambda st: {**st, "params": single0["params"]}, batches)
    grid_state = state["model_state"]["grid"]
    _close(grid_state["params"][s.name],
           _stack([ref["params"]["probes"][k] for k in blocks]))
    _close(grid_state["batch_stats"][s.name],
           _stack([ref["model_state"]["batch_stats"]["probes"][k] for k in blocks]))
    assert not np.allclose(grid_state["params"][s.name]["head"]["kernel"],
                           single0["params"]["probes"]["block_00"]["head"]["kernel"][None])


def test_attentive_grid_heads_train_as_alone(single_init):
  grid = dict(learning_rates=(1e-3, 3e-2), weight_decays=(0.0, 0.5))
  single0 = single_init["attentive"]

  def init(state):
    g = state["model_state"]["grid"]
    g["params"] = {n: _stack([single0["params"]["head"]]) for n in g["params"]}
    state["params"]["backbone"] = single0["params"]["backbone"]
    return state

  state, batches = _trained(attentive_probe.AttentiveProbeTrainer,
                            _config("attentive", **grid), init)
  for s in probe_grid.settings(_config("attentive", **grid))[-1:]:   # lr and wd both apart
    alone = _config("attentive")
    alone.optim.update(base_lr=s.learning_rate, weight_decay=s.weight_decay)
    ref, _ = _trained(attentive_probe.AttentiveProbeTrainer, alone,
                      lambda st: {**st, "params": single0["params"]}, batches)
    # The key and value biases have zero gradients in exact arithmetic (the
    # key bias adds one constant to every token's score; the value bias one
    # vector to every pooled row, which the BatchNorm subtracts again); Adam
    # turns their rounding noise into steps of size lr, and the two runs'
    # noise differs.
    _close(state["model_state"]["grid"]["params"][s.name], _stack([ref["params"]["head"]]),
           skip=("['pool']['key']['bias']", "['pool']['value']['bias']"))


def test_held_out_rows_are_deterministic_and_apart():
  source = linear_probe.backbone_lib.build_source(_config(), "train", train=True)
  train, held = holdout.split(source, -1)
  assert held.num_examples == round(0.02 * source.num_examples)
  assert train.num_examples + held.num_examples == source.num_examples
  assert not set(train.rows) & set(held.rows)
  np.testing.assert_array_equal(holdout.split(source, -1)[1].rows, held.rows)
  # Training batches come from the kept rows only, over many epochs.
  labels = source.labels
  for step in range(0, 400, 37):
    images = train.train_batch(step, 16)["image"]
    rows = train.train_indices(step, 16)[0]
    expected, _ = source._examples(train.rows[rows], None)  # pylint: disable=protected-access
    np.testing.assert_array_equal(images, expected)
    assert not set(train.rows[rows]) & set(held.rows)
  # The held-out evaluation reads exactly its rows, unaugmented.
  seen = np.concatenate([b["label"][b["mask"]] for b in held.eval_batches(16)])
  np.testing.assert_array_equal(seen, labels[held.rows])
  assert holdout.resolve_size(-1, 10**7) == 10_000
  with pytest.raises(ValueError, match="holdout_size"):
    holdout.resolve_size(source.num_examples, source.num_examples)


def test_choice_is_the_held_out_argmax():
  rows = [dict(block="b0", setting=s, holdout_accuracy=h, accuracy=a)
          for s, h, a in (("x", 0.5, 0.9), ("y", 0.7, 0.1), ("z", 0.7, 0.8))]
  assert probe_grid.choose(rows, "block")["b0"]["setting"] == "y"   # first of a tie; not test


def test_grid_report(tmp_path):
  c = _config(learning_rates=(0.5, 6.4), poolings=("mean", "last"), holdout_size=32)
  loop.run(linear_probe.LinearProbeTrainer(c), c, str(tmp_path))
  report = json.loads((tmp_path / "probe_accuracy.json").read_text())
  assert report["selection"] == "holdout" and report["holdout_size"] == 32
  assert len(report["grid"]) == 2 * 2 * 2          # settings x poolings x blocks
  for block in report["blocks"]:
    rows = [r for r in report["grid"] if r["block"] == block]
    assert report["chosen"][block] == max(rows, key=lambda r: r["holdout_accuracy"])
  assert report["accuracy"] == [report["chosen"][k]["accuracy"] for k in report["blocks"]]
  best = int(np.argmax(report["holdout_accuracy"]))
  assert report["best_block"] == report["blocks"][best]
  final = metrics_lib.final_metrics(str(tmp_path))
  for k in report["blocks"]:
    assert final[f"val_accuracy_{k}"] == report["chosen"][k]["accuracy"]
    assert final[f"val_holdout_accuracy_{k}"] == report["chosen"][k]["holdout_accuracy"]
    assert final[f"val_chosen_learning_rate_{k}"] == report["chosen"][k]["learning_rate"]
  # Only the chosen heads' accuracies look like per-block ones (the study
  # tables take the best of val_accuracy_block_*).
  assert sorted(k for k in final if k.startswith("val_accuracy_block_")) == [
      "val_accuracy_block_00", "val_accuracy_block_01"]
  assert (tmp_path / "probe_accuracy.png").stat().st_size > 1000


def test_grid_keys_at_their_defaults_leave_stage_ids_alone():
  for kind, config in (("linear", linear_probe.linear_probe_config()),
                       ("attentive", attentive_probe.attentive_probe_config())):
    assert not probe_grid.is_grid(config), kind
  stage = S.stage("probe", "experiments/fashion_mnist_linear_probe.py")
  assert '"probe"' not in S._resolved(stage.config, stage.overrides)  # pylint: disable=protected-access
  gridded = S.stage("probe", "experiments/fashion_mnist_linear_probe.py",
                    {"probe.learning_rates": (1.0, 2.0)})
  assert gridded.id != stage.id


def test_grid_refuses_what_it_cannot_honour():
  with pytest.raises(config_lib.ConfigError, match="microbatch_size"):
    linear_probe.LinearProbeTrainer(_with(microbatch_size=8))
  with pytest.raises(config_lib.ConfigError, match="ema_decay"):
    linear_probe.LinearProbeTrainer(_with(ema_decay=0.99))
  with pytest.raises(config_lib.ConfigError, match="repeat"):
    probe_grid.settings(_config(learning_rates=(1.0, 1.0)))
  with pytest.raises(config_lib.ConfigError, match="poolings"):
    probe_grid.check_poolings(("mean", "max"))


def _with(**top):
  c = _config(learning_rates=(1.0, 2.0))
  for k, v in top.items():
    c[k] = v
  return c


def test_imagenet_probe_configs_run_a_grid_by_default_and_fashion_mnist_one_setting():
  import runpy
  load = lambda name, arg=None: runpy.run_path(str(ROOT / "experiments" / name))["get_config"](arg)
  linear = load("linear_probe_in1k.py", "variant=H/14")
  assert probe_grid.is_grid(linear) and tuple(linear.probe.poolings) == ("mean", "last")
  assert len(probe_grid.settings(linear)) == 8 and linear.optim.base_lr in linear.probe.learning_rates
  probe_grid.check_loop_options(linear)            # no option the grid refuses
  attentive = load("attentive_probe_in1k.py", "variant=H/14,blocks=-8+-1")
  assert probe_grid.is_grid(attentive) and len(probe_grid.settings(attentive)) == 6
  assert tuple(attentive.probe.blocks) == (-8, -1) and attentive.trainer == "attentive_probe"
  probe_grid.check_loop_options(attentive)
  for config in (linear, attentive):
    config_lib.validate(config)
  for name in ("fashion_mnist_linear_probe.py", "fashion_mnist_attentive_probe.py"):
    assert not probe_grid.is_grid(load(name))
