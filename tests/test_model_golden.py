"""Today's model against numbers written by the model before the ops-layer redesign.

tests/golden/model_golden.py recorded, for nine model variants, the parameter
tree, the training loss and per-leaf gradient statistics on a fixed batch, and
the noise draws (gamma, eps) and random orderings the model made. Here the
same variants are built by today's code, initialised with the same rngs and
fed the recorded draws: the parameter tree must be identical and the loss and
gradients equal up to float32 rounding. tests/golden/pre_ops_workdir holds a
tiny diffusion run checkpointed at step 4 by that code; it must still resume.
"""

import json
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import metrics as metrics_lib
from darl_jax import objectives
from darl_jax.models import darl as darl_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "golden"))
import model_golden  # noqa: E402

from test_train import cli  # noqa: E402

with open(model_golden.PATH) as f:
  GOLDEN = json.load(f)

# Tolerances: the reference ran eagerly (jax.disable_jit), this test runs
# jitted; XLA's fusions reorder float32 sums, which moves the loss by ~1e-7
# relative and small gradient entries by more, relative to their size.
LOSS_RTOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 2e-4, 1e-6
# A gradient's sum can cancel to rounding noise (e.g. a kernel whose output
# feeds a LayerNorm, which ignores shifts: its columns' gradients sum to 0),
# so its absolute tolerance scales with the largest sum the leaf could have,
# l2 * sqrt(size) (Cauchy-Schwarz), times 1e-6: float32 rounding, not a
# change of the function.
SUM_ATOL_PER_BOUND = 1e-6


def test_every_golden_case_is_covered():
  assert sorted(GOLDEN) == sorted(model_golden.CASES)


def _recorded_draws(model, x, draws):
  """The reference's draws in the objective's layout: gamma ``[B, N, k]``,
  eps ``[B, N, k, P]`` (recorded flat over ``B * N``), perm ``[B, N]``."""
  bsz, n, p = objectives.noise_shape(model, x)
  out = {}
  if "gamma" in draws:
    gamma = np.asarray(draws["gamma"], np.float32)
    out["gamma"] = jnp.asarray(gamma.reshape(bsz, n, -1))
    out["eps"] = jnp.asarray(np.asarray(draws["eps"], np.float32).reshape(bsz, n, -1, p))
  if "perm" in draws:
    out["perm"] = jnp.asarray(np.asarray(draws["perm"], np.int32))
  return out


@pytest.mark.parametrize("name", sorted(model_golden.CASES))
def test_model_matches_the_pre_redesign_numbers(name):
  want = GOLDEN[name]
  model = darl_lib.darl_from_config(model_golden.config(name))
  x = model_golden.images()
  params = jax.jit(lambda x: model_golden.init_params(model, x))(x)

  # The parameter tree: the same paths and shapes, so old checkpoints restore.
  assert model_golden.tree_shapes(params) == want["params"]

  draws = _recorded_draws(model, x, want["draws"])
  assert (model.loss == "diffusion") == ("gamma" in draws)

  def loss_fn(p):
    # No "noise" rng: every random draw of the step is the recorded one.
    loss, _ = model.apply({"params": p}, x, train=True, **draws,
                          rngs={"dropout": jax.random.PRNGKey(4)},
                          method=objectives.loss_given_noise)
    return loss

  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
  np.testing.assert_allclose(float(loss), want["loss"], rtol=LOSS_RTOL)
  got = model_golden.leaf_stats(grads)
  assert sorted(got) == sorted(want["grads"])
  for path, (w_sum, w_l2, w_proj) in want["grads"].items():
    g_sum, g_l2, g_proj = got[path]
    where = f"{name}: gradient of {path}"
    bound = w_l2 * np.sqrt(np.prod(want["params"][path]))
    np.testing.assert_allclose(g_sum, w_sum, rtol=GRAD_RTOL,
                               atol=max(GRAD_ATOL, SUM_ATOL_PER_BOUND * bound),
                               err_msg=f"{where}: sum")
    np.testing.assert_allclose([g_l2, g_proj], [w_l2, w_proj], rtol=GRAD_RTOL,
                               atol=GRAD_ATOL, err_msg=f"{where}: l2, projection")


def test_a_workdir_written_before_the_redesign_resumes(tmp_path):
  """The tiny diffusion run (tests/tiny_config.py:objective=diffusion, total
  steps 4, checkpoint at step 4) continues to step 6 from its checkpoint."""
  wd = tmp_path / "run"
  shutil.copytree(ROOT / "tests" / "golden" / "pre_ops_workdir", wd)
  before = {r["step"]: r for r in metrics_lib.read_metrics(str(wd))}
  proc = cli(wd, arg="objective=diffusion,steps=6")
  assert "at step 4" in proc.stderr and "resumed from" in proc.stderr, proc.stderr[-3000:]
  records = metrics_lib.read_metrics(str(wd))
  trained = [r["step"] for r in records if "grad_norm" in r]
  assert trained == [1, 2, 3, 4, 5, 6]
  for r in records:
    if "grad_norm" in r and r["step"] <= 4:
      assert r["loss"] == before[r["step"]]["loss"]       # the old records are kept
    if "grad_norm" in r and r["step"] > 4:
      assert np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) and r["nonfinite"] == 0
  steps = sorted(int(p.name) for p in (wd / "checkpoints").iterdir() if p.name.isdigit())
  assert steps[-1] == 6
  assert json.loads((wd / "config.json").read_text())["total_steps"] == 6


def test_the_drawn_loss_is_the_loss_given_its_draws():
  """objectives.loss draws (gamma, eps) with draw_noise from its key and
  nothing else: fed the same draws, loss_given_noise gives the same numbers."""
  model = darl_lib.darl_from_config(model_golden.config("diffusion_transformer"))
  x = model_golden.images()
  params = jax.jit(lambda x: model_golden.init_params(model, x))(x)
  key = jax.random.PRNGKey(9)
  gamma, eps = objectives.draw_noise(key, objectives.noise_shape(model, x),
                                     model.noise_samples, model.noise_a, model.noise_b)
  drawn = jax.jit(lambda p: model.apply({"params": p}, x, key, train=True,
                                        method=objectives.loss))(params)
  given = jax.jit(lambda p: model.apply({"params": p}, x, train=True, gamma=gamma, eps=eps,
                                        method=objectives.loss_given_noise))(params)
  # Two compiled programs: equal up to float32 rounding.
  np.testing.assert_allclose(drawn[0], given[0], rtol=1e-6)
  np.testing.assert_allclose(drawn[1]["per_example_loss"], given[1]["per_example_loss"],
                             rtol=1e-6)
