"""Runs that start in seconds (issues 46, 54): the learning-rate schedule and
the weight decay are values fed to the train step, not constants of its
program, so a change of them reuses the compiled step; the optimizer state
keeps its layout (old checkpoints resume) and a resumed run replays the
uninterrupted one bit for bit; every program a run uses is compiled at
start-up, with a log line per phase."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from darl_jax import metrics as metrics_lib
from darl_jax import optim
from darl_jax.train import loop
from darl_jax.train import step as step_lib
from darl_jax.train import startup
from darl_jax.train.trainers import pretrain

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import resumed as resumed_lib  # noqa: E402  pylint: disable=wrong-import-position
import tiny_config  # noqa: E402  pylint: disable=wrong-import-position
from test_optim import _params  # noqa: E402  pylint: disable=wrong-import-position


def tiny(steps=4, **overrides):
  c = tiny_config.get_config(f"objective=mse,steps={steps}")
  c.predictions.num_images = 0
  c.eval_every_steps = 0
  for dotted, value in overrides.items():
    node = c
    *parents, key = dotted.split(".")
    for p in parents:
      node = node[p]
    node[key] = value
  return c


def lowered_train_step(config) -> str:
  built = loop.setup(pretrain.PretrainTrainer(config), config)
  return built.train_step.lower(built.abstract_state, built.abstract_batch,
                                built.abstract_hyper).as_text()


def test_schedule_and_weight_decay_values_leave_the_train_step_program_unchanged():
  a = lowered_train_step(tiny(8, **{"optim.warmup_steps": 2, "optim.base_lr": 2e-3,
                                    "optim.weight_decay": 0.05}))
  b = lowered_train_step(tiny(20, **{"optim.warmup_steps": 5, "optim.base_lr": 7e-4,
                                     "optim.weight_decay": 0.3}))
  assert a == b
  # Structure still counts: no weight decay at all takes the term out.
  c = lowered_train_step(tiny(8, **{"optim.warmup_steps": 2, "optim.weight_decay": 0.0}))
  assert c != a


@pytest.mark.parametrize("kind", ["cosine", "constant"])
def test_host_schedule_is_the_jnp_schedule(kind):
  cfg = ml_collections.ConfigDict(dict(name="adamw", base_lr=1.5e-4, schedule=kind,
                                       warmup_steps=37, end_lr_fraction=0.1))
  total = 5000
  jnp_schedule = optim.make_schedule(cfg, total, batch_size=4096)
  host = optim.make_host_schedule(cfg, total, batch_size=4096)
  steps = np.arange(0, total + 100, dtype=np.int32)
  want = np.asarray(jax.jit(jnp_schedule)(steps))
  got = host(steps)
  assert got.dtype == np.float32 and isinstance(host(3), np.float32)
  # The host form is float64 rounded once; XLA's float32 arithmetic (its
  # cos, x / c as x * (1 / c)) is a few ulps off it, never more.
  ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32))
  assert ulps.max() <= 8
  np.testing.assert_array_equal(np.asarray([host(int(s)) for s in steps[::97]]), got[::97])
  peak = np.float32(1.5e-4 * 4096 / 256)
  assert host(0) == 0.0 and host(37) == peak
  assert host(total) == host(total + 50) == (peak if kind == "constant"
                                             else np.float32(0.1 * 1.5e-4 * 4096 / 256))


CASES = {
    "adamw": dict(name="adamw", weight_decay=0.05, schedule="cosine", warmup_steps=3,
                  grad_clip_norm=1.0),
    "adamw_layer_decay_frozen": dict(name="adamw", weight_decay=0.05, layer_decay=0.75,
                                     num_layers=4, frozen=["^backbone/patch_embed/"]),
    "lars_momentum": dict(name="lars", weight_decay=1e-4, momentum=0.9, schedule="cosine",
                          warmup_steps=2),
    "sgd": dict(name="sgd", weight_decay=0.0, momentum=0.0, schedule="constant"),
    "sgd_momentum_frozen": dict(name="sgd", weight_decay=0.01, momentum=0.9,
                                frozen=["^backbone/"]),
}


def _case(name):
  return ml_collections.ConfigDict(dict(base_lr=0.1, lr_scaling=False, **CASES[name]))


@pytest.mark.parametrize("scanned", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_optimizer_state_layout_is_unchanged(name, scanned):
  p = _params(scanned)
  tx, hyperparams = optim.make_train_optimizer(_case(name), p, total_steps=10, batch_size=8)
  assert str(jax.tree_util.tree_structure(tx.init(p))) == EXPECTED_OPT_STATE[(name, scanned)]
  tx_old_api, _ = optim.make_optimizer(_case(name), p, total_steps=10, batch_size=8)
  assert (jax.tree_util.tree_structure(tx_old_api.init(p))
          == jax.tree_util.tree_structure(tx.init(p)))
  assert isinstance(hyperparams, optim.Hyperparams)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bound_values_give_the_update_of_the_configured_ones(name):
  """The step's ``hyper`` at the configured values updates as the schedule
  and decay inside the program did (a constant schedule: exactly; under
  layer decay within two float32 roundings, since XLA folds a constant
  multiplier into the constant learning rate where bound values multiply
  in turn)."""
  p = _params()
  cfg = _case(name)
  cfg.schedule, cfg.warmup_steps = "constant", 0
  tx, hyperparams = optim.make_train_optimizer(cfg, p, total_steps=10, batch_size=8)
  grads = jax.tree.map(lambda x: 0.1 * x + 0.01, p)

  def bound(g, s, params, hyper):
    with hyperparams.bind(hyper):
      return tx.update(g, s, params)

  state_a = state_b = tx.init(p)
  for count in range(3):
    (ua, state_a), (ub, state_b) = (jax.jit(tx.update)(grads, state_a, p),
                                    jax.jit(bound)(grads, state_b, p, hyperparams.values(count)))
    for x, y in zip(jax.tree.leaves((ua, state_a)), jax.tree.leaves((ub, state_b)), strict=True):
      rtol = 2.4e-7 if cfg.get("layer_decay") else 0.0   # two float32 roundings
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=0)
  # Another weight decay is another update, through the same program.
  other = dict(hyperparams.values(0), weight_decay=np.float32(0.5))
  changed = jax.jit(bound)(grads, tx.init(p), p, other)[0]
  same = jax.jit(bound)(grads, tx.init(p), p, hyperparams.values(0))[0]
  differs = any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(changed),
                                                          jax.tree.leaves(same)))
  assert differs == bool(cfg.weight_decay)


def _logged(workdir, key):
  return {m["step"]: m[key] for m in metrics_lib.read_metrics(str(workdir)) if key in m}


def test_resumed_run_is_bit_identical_and_logs_the_fed_learning_rate(tmp_path):
  config = tiny(4, checkpoint_every_steps=2, **{"optim.warmup_steps": 2,
                                                "optim.schedule": "cosine"})
  straight, resumed = resumed_lib.straight_and_resumed(pretrain.PretrainTrainer, config, tmp_path)
  assert resumed["loss"] == straight["loss"]
  assert resumed["param_norm"] == straight["param_norm"]
  assert _logged(tmp_path / "a", "loss") == _logged(tmp_path / "b", "loss")
  host = optim.make_host_schedule(config.optim, 4, batch_size=config.batch_size)
  lrs = _logged(tmp_path / "b", "learning_rate")
  assert lrs == {s: float(host(s - 1)) for s in range(1, 5)}
  assert lrs[1] == 0.0 and lrs[3] > 0.0


EXPECTED_OPT_STATE = {   # captured from optim.make_optimizer before the change
    ('adamw', False): (
        "PyTreeDef(CustomNode(namedtuple[PartitionState], [{'frozen': CustomNode(namedtuple[Maske"
        "dState], [CustomNode(namedtuple[EmptyState], [])]), 'train': CustomNode(namedtuple[Maske"
        'dState], [(CustomNode(namedtuple[EmptyState], []), CustomNode(namedtuple[ScaleByAdamStat'
        "e], [*, {'backbone': {'block_00': {'attn': {'qkv': {'bias': *, 'kernel': *}}, 'norm1': {"
        "'scale': *}}, 'block_01': {'attn': {'qkv': {'bias': *, 'kernel': *}}, 'norm1': {'scale':"
        " *}}, 'block_02': {'attn': {'qkv': {'bias': *, 'kernel': *}}, 'norm1': {'scale': *}}, 'b"
        "lock_03': {'attn': {'qkv': {'bias': *, 'kernel': *}}, 'norm1': {'scale': *}}, 'norm': {'"
        "bias': *, 'scale': *}, 'patch_embed': {'bias': *, 'kernel': *}, 'pos_embed': {'table': *"
        "}, 'sos': *}, 'head': {'bias': *, 'kernel': *}}, {'backbone': {'block_00': {'attn': {'qk"
        "v': {'bias': *, 'kernel': *}}, 'norm1': {'scale': *}}, 'block_01': {'attn': {'qkv': {'bi"
        "as': *, 'kernel': *}}, 'norm1': {'scale': *}}, 'block_02': {'attn': {'qkv': {'bias': *, "
        "'kernel': *}}, 'norm1': {'scale': *}}, 'block_03': {'attn': {'qkv': {'bias': *, 'kernel'"
        ": *}}, 'norm1': {'scale': *}}, 'norm': {'bias': *, 'scale': *}, 'patch_embed': {'bias': "
        "*, 'kernel': *}, 'pos_embed': {'table': *}, 'sos': *}, 'head': {'bias': *, 'kernel': *}}"
        ']), CustomNode(namedtuple[MaskedState], [CustomNode(namedtuple[EmptyState], [])]), Custo'
        'mNode(namedtuple[ScaleByScheduleState], [*]))])}]))'),
    ('adamw', True): (
        "PyTreeDef(CustomNode(namedtuple[PartitionState], [{'frozen': CustomNode(namedtuple[Maske"
        "dState], [CustomNode(namedtuple[EmptyState], [])]), 'train': CustomNode(namedtuple[Maske"
        'dState], [(CustomNode(namedtuple[EmptyState], []), CustomNode(namedtuple[ScaleByAdamStat'
        "e], [*, {'backbone': {'blocks': {'block': {'mlp': {'fc1': {'bias': *, 'kernel': *}}, 'no"
        "rm1': {'scale': *}}}, 'norm': {'bias': *, 'scale': *}, 'patch_embed': {'bias': *, 'kerne"
        "l': *}, 'pos_embed': {'table': *}, 'sos': *}, 'head': {'bias': *, 'kernel': *}}, {'backb"
        "one': {'blocks': {'block': {'mlp': {'fc1': {'bias': *, 'kernel': *}}, 'norm1': {'scale':"
        " *}}}, 'norm': {'bias': *, 'scale': *}, 'patch_embed': {'bias': *, 'kernel': *}, 'pos_em"
        "bed': {'table': *}, 'sos': *}, 'head': {'bias': *, 'kernel': *}}]), CustomNode(namedtupl"
        'e[MaskedState], [CustomNode(namedtuple[EmptyState], [])]), CustomNode(namedtuple[ScaleBy'
        'ScheduleState], [*]))])}]))'),
    ('adamw_layer_decay_frozen', False): (
        "PyTreeDef(CustomNode(namedtuple[PartitionState], [{'frozen': CustomNode(namedtuple[Maske"
        "dState], [CustomNode(namedtuple[EmptyState], [])]), 'train': CustomNode(namedtuple[Maske"
        "dState], [(CustomNode(namedtuple[ScaleByAdamState], [*, {'backbone': {'block_00': {'attn"
        "': {'qkv': {'bias': *, 'kernel': *}}, 'norm1': {'scale': *}}, 'block_01': {'attn': {'qkv"
        "': {'bias': *, 'kernel': *}}, 'norm1': {'scale': *}}, 'block_02': {'attn': {'qkv': {'bia"
        "s': *, 'kernel': *}}, 'norm1': {'scale': *}}, 'block_03': {'attn': {'qkv': {'bias': *, '"
        "kernel': *}}, 'norm1': {'scale': *}}, 'norm': {'bias': *, 'scale': *}, 'patch_embed': {'"
        "bias': CustomNode(namedtuple[MaskedNode], []), 'kernel': CustomNode(namedtuple[MaskedNod"
        "e], [])}, 'pos_embed': {'table': *}, 'sos': *}, 'head': {'bias': *, 'kernel': *}}, {'bac"
        "kbone': {'block_00': {'attn': {'qkv': {'bias': *, 'kernel': *}}, 'norm1': {'scale': *}},"
        " 'block_01': {'attn': {'qkv': {'bias': *, 'kernel': *}}, 'norm1': {'scale': *}}, 'block_"
        "02': {'attn': {'qkv': {'bias': *, 'kernel': *}}, 'norm1': {'scale': *}}, 'block_03': {'a"
        "ttn': {'qkv': {'bias': *, 'kernel': *}}, 'norm1': {'scale': *}}, 'norm': {'bias': *, 'sc"
        "ale': *}, 'patch_embed': {'bias': CustomNode(namedtuple[MaskedNode], []), 'kernel': Cust"
        "omNode(namedtuple[MaskedNode], [])}, 'pos_embed': {'table': *}, 'sos': *}, 'head': {'bia"
        "s': *, 'kernel': *}}]), CustomNode(namedtuple[MaskedState], [CustomNode(namedtuple[Empty"
        'State], [])]), CustomNode(namedtuple[EmptyState], []), CustomNode(namedtuple[ScaleBySche'
        'duleState], [*]))])}]))'),
    ('adamw_layer_decay_frozen', True): (
        "PyTreeDef(CustomNode(namedtuple[PartitionState], [{'frozen': CustomNode(namedtuple[Maske"
        "dState], [CustomNode(namedtuple[EmptyState], [])]), 'train': CustomNode(namedtuple[Maske"
        "dState], [(CustomNode(namedtuple[ScaleByAdamState], [*, {'backbone': {'blocks': {'block'"
        ": {'mlp': {'fc1': {'bias': *, 'kernel': *}}, 'norm1': {'scale': *}}}, 'norm': {'bias': *"
        ", 'scale': *}, 'patch_embed': {'bias': CustomNode(namedtuple[MaskedNode], []), 'kernel':"
        " CustomNode(namedtuple[MaskedNode], [])}, 'pos_embed': {'table': *}, 'sos': *}, 'head': "
        "{'bias': *, 'kernel': *}}, {'backbone': {'blocks': {'block': {'mlp': {'fc1': {'bias': *,"
        " 'kernel': *}}, 'norm1': {'scale': *}}}, 'norm': {'bias': *, 'scale': *}, 'patch_embed':"
        " {'bias': CustomNode(namedtuple[MaskedNode], []), 'kernel': CustomNode(namedtuple[Masked"
        "Node], [])}, 'pos_embed': {'table': *}, 'sos': *}, 'head': {'bias': *, 'kernel': *}}]), "
        'CustomNode(namedtuple[MaskedState], [CustomNode(namedtuple[EmptyState], [])]), CustomNod'
        'e(namedtuple[EmptyState], []), CustomNode(namedtuple[ScaleByScheduleState], [*]))])}]))'),
    ('lars_momentum', False): (
        "PyTreeDef(CustomNode(namedtuple[PartitionState], [{'frozen': CustomNode(namedtuple[Maske"
        "dState], [CustomNode(namedtuple[EmptyState], [])]), 'train': CustomNode(namedtuple[Maske"
        'dState], [(CustomNode(namedtuple[MaskedState], [CustomNode(namedtuple[EmptyState], [])])'
        ', CustomNode(namedtuple[MaskedState], [CustomNode(namedtuple[EmptyState], [])]), CustomN'
        "ode(namedtuple[ScaleByScheduleState], [*]), CustomNode(namedtuple[TraceState], [{'backbo"
        "ne': {'block_00': {'attn': {'qkv': {'bias': *, 'kernel': *}}, 'norm1': {'scale': *}}, 'b"
        "lock_01': {'attn': {'qkv': {'bias': *, 'kernel': *}}, 'norm1': {'scale': *}}, 'block_02'"
        ": {'attn': {'qkv': {'bias': *, 'kernel': *}}, 'norm1': {'scale': *}}, 'block_03': {'attn"
        "': {'qkv': {'bias': *, 'kernel': *}}, 'norm1': {'scale': *}}, 'norm': {'bias': *, 'scale"
        "': *}, 'patch_embed': {'bias': *, 'kernel': *}, 'pos_embed': {'table': *}, 'sos': *}, 'h"
        "ead': {'bias': *, 'kernel': *}}]))])}]))"),
    ('lars_momentum', True): (
        "PyTreeDef(CustomNode(namedtuple[PartitionState], [{'frozen': CustomNode(namedtuple[Maske"
        "dState], [CustomNode(namedtuple[EmptyState], [])]), 'train': CustomNode(namedtuple[Maske"
        'dState], [(CustomNode(namedtuple[MaskedState], [CustomNode(namedtuple[EmptyState], [])])'
        ', CustomNode(namedtuple[MaskedState], [CustomNode(namedtuple[EmptyState], [])]), CustomN'
        "ode(namedtuple[ScaleByScheduleState], [*]), CustomNode(namedtuple[TraceState], [{'backbo"
        "ne': {'blocks': {'block': {'mlp': {'fc1': {'bias': *, 'kernel': *}}, 'norm1': {'scale': "
        "*}}}, 'norm': {'bias': *, 'scale': *}, 'patch_embed': {'bias': *, 'kernel': *}, 'pos_emb"
        "ed': {'table': *}, 'sos': *}, 'head': {'bias': *, 'kernel': *}}]))])}]))"),
    ('sgd', False): (
        "PyTreeDef(CustomNode(namedtuple[PartitionState], [{'frozen': CustomNode(namedtuple[Maske"
        "dState], [CustomNode(namedtuple[EmptyState], [])]), 'train': CustomNode(namedtuple[Maske"
        'dState], [(CustomNode(namedtuple[ScaleByScheduleState], [*]),)])}]))'),
    ('sgd', True): (
        "PyTreeDef(CustomNode(namedtuple[PartitionState], [{'frozen': CustomNode(namedtuple[Maske"
        "dState], [CustomNode(namedtuple[EmptyState], [])]), 'train': CustomNode(namedtuple[Maske"
        'dState], [(CustomNode(namedtuple[ScaleByScheduleState], [*]),)])}]))'),
    ('sgd_momentum_frozen', False): (
        "PyTreeDef(CustomNode(namedtuple[PartitionState], [{'frozen': CustomNode(namedtuple[Maske"
        "dState], [CustomNode(namedtuple[EmptyState], [])]), 'train': CustomNode(namedtuple[Maske"
        'dState], [(CustomNode(namedtuple[MaskedState], [CustomNode(namedtuple[EmptyState], [])])'
        ', CustomNode(namedtuple[ScaleByScheduleState], [*]), CustomNode(namedtuple[TraceState], '
        "[{'backbone': {'block_00': {'attn': {'qkv': {'bias': CustomNode(namedtuple[MaskedNode], "
        "[]), 'kernel': CustomNode(namedtuple[MaskedNode], [])}}, 'norm1': {'scale': CustomNode(n"
        "amedtuple[MaskedNode], [])}}, 'block_01': {'attn': {'qkv': {'bias': CustomNode(namedtupl"
        "e[MaskedNode], []), 'kernel': CustomNode(namedtuple[MaskedNode], [])}}, 'norm1': {'scale"
        "': CustomNode(namedtuple[MaskedNode], [])}}, 'block_02': {'attn': {'qkv': {'bias': Custo"
        "mNode(namedtuple[MaskedNode], []), 'kernel': CustomNode(namedtuple[MaskedNode], [])}}, '"
        "norm1': {'scale': CustomNode(namedtuple[MaskedNode], [])}}, 'block_03': {'attn': {'qkv':"
        " {'bias': CustomNode(namedtuple[MaskedNode], []), 'kernel': CustomNode(namedtuple[Masked"
        "Node], [])}}, 'norm1': {'scale': CustomNode(namedtuple[MaskedNode], [])}}, 'norm': {'bia"
        "s': CustomNode(namedtuple[MaskedNode], []), 'scale': CustomNode(namedtuple[MaskedNode], "
        "[])}, 'patch_embed': {'bias': CustomNode(namedtuple[MaskedNode], []), 'kernel': CustomNo"
        "de(namedtuple[MaskedNode], [])}, 'pos_embed': {'table': CustomNode(namedtuple[MaskedNode"
        "], [])}, 'sos': CustomNode(namedtuple[MaskedNode], [])}, 'head': {'bias': *, 'kernel': *"
        '}}]))])}]))'),
    ('sgd_momentum_frozen', True): (
        "PyTreeDef(CustomNode(namedtuple[PartitionState], [{'frozen': CustomNode(namedtuple[Maske"
        "dState], [CustomNode(namedtuple[EmptyState], [])]), 'train': CustomNode(namedtuple[Maske"
        'dState], [(CustomNode(namedtuple[MaskedState], [CustomNode(namedtuple[EmptyState], [])])'
        ', CustomNode(namedtuple[ScaleByScheduleState], [*]), CustomNode(namedtuple[TraceState], '
        "[{'backbone': {'blocks': {'block': {'mlp': {'fc1': {'bias': CustomNode(namedtuple[Masked"
        "Node], []), 'kernel': CustomNode(namedtuple[MaskedNode], [])}}, 'norm1': {'scale': Custo"
        "mNode(namedtuple[MaskedNode], [])}}}, 'norm': {'bias': CustomNode(namedtuple[MaskedNode]"
        ", []), 'scale': CustomNode(namedtuple[MaskedNode], [])}, 'patch_embed': {'bias': CustomN"
        "ode(namedtuple[MaskedNode], []), 'kernel': CustomNode(namedtuple[MaskedNode], [])}, 'pos"
        "_embed': {'table': CustomNode(namedtuple[MaskedNode], [])}, 'sos': CustomNode(namedtuple"
        "[MaskedNode], [])}, 'head': {'bias': *, 'kernel': *}}]))])}]))"),
}


def test_every_program_compiles_at_start_up_with_a_log_line_per_phase(tmp_path, monkeypatch):
  """Train, eval, init and the closing picture are compiled side by side
  before the first step; the start-up log has one line per phase; nothing
  is lowered after the last step (the picture runs its start-up program);
  the compiled eval step scores as the jitted one."""
  from jax._src import dispatch  # pylint: disable=g-import-not-at-top
  from darl_jax import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  messages, warnings = [], []
  real_info, real_warning = loop.logging.info, loop.logging.warning

  def record(into, real):
    def log(msg, *args, **kw):
      into.append(str(msg) % args if args else str(msg))
      real(msg, *args, **kw)
    return log

  # Programs lowered while finalize runs (JAX reports every lowering).
  lowered_in_finalize, in_finalize = [], []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, *a, **k: lowered_in_finalize.append(event)
      if in_finalize and event == dispatch.JAXPR_TO_MLIR_MODULE_EVENT else None)
  real_finalize = pretrain.PretrainTrainer.finalize

  def finalize(self, *args):
    in_finalize.append(True)
    try:
      return real_finalize(self, *args)
    finally:
      in_finalize.clear()

  monkeypatch.setattr(pretrain.PretrainTrainer, "finalize", finalize)
  monkeypatch.setattr(loop.logging, "info", record(messages, real_info))
  monkeypatch.setattr(loop.logging, "warning", record(warnings, real_warning))
  config = tiny_config.get_config("objective=diffusion,steps=4")
  config.update(eval_every_steps=2, checkpoint_every_steps=4, ema_decay=0.0)
  last = loop.run(pretrain.PretrainTrainer(config), config, str(tmp_path / "w"))
  monkeypatch.undo()
  assert (tmp_path / "w" / "predictions.png").exists() and lowered_in_finalize == []

  def line(prefix):
    found = [i for i, m in enumerate(messages) if m.startswith(prefix)]
    assert len(found) == 1, (prefix, messages)
    return found[0]

  order = [line("start-up: setup (")]
  for program in ("train step", "eval step", "init step", "picture"):
    i = line(f"start-up: {program}: trace ")
    assert ", lower " in messages[i] and ", compile " in messages[i]
    order.append(i)
  order += [line("start-up: 4 programs ready in "), line("start-up: initialisation: "),
            line("training "), line("start-up: first batch: waited "),
            line("start-up: first step done ")]
  assert order == sorted(order)
  assert not [w for w in warnings if "eval step was compiled for" in w]
  scores = {k[len("val_"):]: v for k, v in last.items() if k.startswith("val_")}
  assert scores

  # The jitted eval step, called as before, on the final parameters.
  trainer = pretrain.PretrainTrainer(config)
  built = loop.setup(trainer, config)
  params, meta = checkpoint_lib.restore_params(str(tmp_path / "w"))
  assert meta["step"] == 4
  state = {"params": jax.device_put(params, built.state_shardings["params"]),
           "model_state": built.init_state()["model_state"]}
  want = step_lib.evaluate(trainer, built.model, state,
                       built.ctx.eval_source, built.eval_step, built.batch_sharding, config)
  assert want == scores


def test_startup_benchmark_runs_a_config_cold_then_warm(tmp_path):
  """benchmarks/startup_benchmark.py on the tiny config (a CPU smoke run; its
  numbers are for the GPU): both runs' phases, first step, speed and exit."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = tmp_path / "rows.jsonl"
  done = subprocess.run(
      [sys.executable, str(ROOT / "benchmarks" / "startup_benchmark.py"),
       "--config=tests/tiny_config.py:objective=diffusion", "--steps=2", "--warm_steps=3",
       "--log_every=1", "--skip=0", "--data=config", f"--json={out}",
       f"--logs={tmp_path / 'logs'}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  rows = {r["run"]: r for r in map(json.loads, out.read_text().splitlines())}
  assert sorted(rows) == ["cold", "warm"]
  for row in rows.values():
    assert 0 < row["first_step_s"] < row["wall_s"] and row["img_s"] > 0
    assert 0 <= row["exit_after_last_checkpoint_s"] < row["wall_s"]
    for phase in ("setup", "train step trace", "eval step trace", "init step trace",
                  "picture trace", "programs ready", "initialisation", "first batch", "data"):
      assert f"phase: {phase}" in row, (phase, row)
  for name in ("cold", "warm"):       # each line with its arrival, seconds since launch
    log = (tmp_path / "logs" / f"{name}.log").read_text().splitlines()
    done_at = [float(line.split()[0]) for line in log if "first step done" in line]
    assert len(done_at) == 1 and abs(done_at[0] - rows[name]["first_step_s"]) < 0.01
  assert "phase: train step compile" in rows["cold"]
  table = done.stdout[done.stdout.index("| | cold | warm |"):]
  assert "| first_step_s |" in table and "| exit_after_last_checkpoint_s |" in table


def test_programs_compile_side_by_side_on_threads(monkeypatch, caplog):
  """Four small programs compiled by four threads at once compute what they
  compute jitted; a bad DARL_COMPILE_THREADS is one error naming the fix."""
  import logging as py_logging  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from darl_jax import config_lib  # pylint: disable=g-import-not-at-top
  from darl_jax.train import aot  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("DARL_COMPILE_THREADS", "4")
  caplog.set_level(py_logging.INFO)
  x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  fns = {f"power {k}": jax.jit(lambda a, k=k: jnp.tanh(a @ a.T) ** k + k) for k in range(4)}
  programs = [aot.Program(name, fn, (x,)) for name, fn in fns.items()]
  aot.compile_all(programs)
  assert "(4 compiled, 4 at a time; 0 loaded)" in caplog.text
  value = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
  for program in programs:
    np.testing.assert_allclose(np.asarray(program.compiled(value)),
                               np.asarray(fns[program.name](value)), rtol=1e-5)
  monkeypatch.setenv("DARL_COMPILE_THREADS", "many")
  with pytest.raises(config_lib.ConfigError, match="DARL_COMPILE_THREADS"):
    aot.compile_threads(4)
  monkeypatch.delenv("DARL_COMPILE_THREADS")
  assert aot.compile_threads(0) == 1 and 1 <= aot.compile_threads(100)


def test_the_ema_average_evaluation_sees_is_compiled_at_start_up():
  config = tiny(2, ema_decay=0.9)
  trainer = pretrain.PretrainTrainer(config)
  built = loop.setup(trainer, config)
  programs = startup.compile_programs(built, config, trainer=trainer, init=True, view=True,
                                   reuse=False)
  assert set(programs.info["programs"]) == {"train step", "init step", "ema average"}
  state = built.init_state(programs.init_state)
  state, _ = programs.train_step(state, jax.device_put(
      {"image": np.full((16, 8, 8, 1), 7, np.uint8), "label": np.zeros(16, np.int32)},
      built.batch_sharding), built.hyper(0))
  seen, want = programs.eval_view(state), built.eval_view(state)
  for a, b in zip(jax.tree.leaves(seen["params"]), jax.tree.leaves(want["params"]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(seen["params"]),
                                                      jax.tree.leaves(state["params"])))
