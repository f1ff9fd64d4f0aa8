"""JAX's Pallas TPU flash attention (jax.experimental.pallas.ops.tpu), as
benchmarks/tpu_attention_bench.py calls it (``[B, T, H, D]`` transposed to
``[B, H, T, D]``, T zero-padded at the end to the block size, causal), run in
Pallas's TPU interpreter on the CPU and compared with ops.attention's XLA
path: output and the gradients of q, k, v."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import ops

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import tpu_attention_bench as bench  # noqa: E402  pylint: disable=wrong-import-position


def _interpret_mode():
  try:
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.force_tpu_interpret_mode
  except (ImportError, AttributeError):
    return None


# Its kernels take blocks of 128 rows (multiples of 128): 197 tokens pad to
# two blocks (the causal skip and the running softmax across blocks), 128 is
# one block unpadded.
@pytest.mark.parametrize("t,block", [(197, 128), (128, 128)])
def test_pallas_tpu_flash_attention_matches_xla_attention_in_interpret_mode(t, block):
  interpret = _interpret_mode()
  if interpret is None:
    pytest.skip("this jax has no Pallas TPU interpret mode (pltpu.force_tpu_interpret_mode)")
  b, h, d = 1, 2, 16
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, g = (jax.random.normal(key, (b, t, h, d), jnp.float32) for key in keys)

  def run(fn):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(g))

  with ops.using(attention="xla"):
    want = run(lambda q, k, v: ops.attention(q, k, v, causal=True))
  with interpret():
    got = run(lambda q, k, v: bench.pallas_tpu_attention(q, k, v, block=block))
  for name, w, x in zip(("out", "dq", "dk", "dv"), want, got):
    assert x.shape == w.shape, name
    np.testing.assert_allclose(np.asarray(x), np.asarray(w), rtol=2e-4, atol=2e-4,
                               err_msg=name)
