"""fp8 against bf16 at the backbone's matmul shapes: which scaling path to take.

For each dense shape of a ViT at a given batch (rows M = batch x tokens) it
times, on one device:

* ``bf16``: ``x @ w`` in bfloat16 (what the step runs today);
* ``fp8 raw``: inputs already e4m3, the matmul alone (the ceiling);
* ``fp8 qdq``: bf16 inputs quantized with given (delayed) scales, then
  dequantized in front of a bf16 dot: the pattern XLA's GEMM rewriter turns
  into one scaled fp8 GEMM, the quantization fused into a pass of its own;
* ``fp8 flax``: ``flax.linen.fp8_ops.fp8_scaled_dot_general`` with an amax
  history (delayed scaling as flax's ``Fp8DirectDotGeneralOp`` runs it).
* ``fp8 rows``: darl_jax/fp8.py's ``dense``, what ``config.precision='fp8'``
  runs: scales from the inputs themselves, one per row of ``x`` (current
  scaling), the scales applied to the product's output.

Each forward alone, then forward and backward (the input's and the kernel's
gradients, e5m2 gradients for the fp8 paths), in TFLOP/s, and an MLP block
(layer norm, fc1, GELU, fc2) forward and backward, where the quantization can
fuse into its neighbours. Run it on the GPU:

  python benchmarks/fp8_matmul_bench.py --variant=H/14 --batch=192
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mlp_kernel_bench import timed  # pylint: disable=g-import-not-at-top,wrong-import-position
from darl_jax import fp8  # pylint: disable=g-import-not-at-top,wrong-import-position

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
VARIANTS = {"B/16": (768, 3072, 197), "L/16": (1024, 4096, 197), "H/14": (1280, 5120, 257)}
HISTORY = 16


def quantize(x, scale, dtype):
  """``x / scale`` clipped to ``dtype``'s range and cast (the scale from an
  amax history: known before ``x`` is)."""
  limit = float(jnp.finfo(dtype).max)
  return jnp.clip(x / scale.astype(x.dtype), -limit, limit).astype(dtype)


def dequantize(q, scale, dtype=jnp.bfloat16):
  return q.astype(dtype) * scale.astype(dtype)


@jax.custom_vjp
def qdq_dot(x, w, sx, sw, sg):
  """Forward ``x @ w`` through e4m3 quantize-dequantize (delayed scales)."""
  return dequantize(quantize(x, sx, E4M3), sx) @ dequantize(quantize(w, sw, E4M3), sw)


def _qdq_fwd(x, w, sx, sw, sg):
  xq, wq = quantize(x, sx, E4M3), quantize(w, sw, E4M3)
  y = dequantize(xq, sx) @ dequantize(wq, sw)
  return y, (xq, wq, sx, sw, sg)


def _qdq_bwd(res, g):
  xq, wq, sx, sw, sg = res
  gd = dequantize(quantize(g, sg, E5M2), sg)
  dx = gd @ dequantize(wq, sw).T
  dw = dequantize(xq, sx).T @ gd
  return dx, dw, None, None, None


qdq_dot.defvjp(_qdq_fwd, _qdq_bwd)


def paths():
  from flax.linen import fp8_ops  # pylint: disable=g-import-not-at-top
  dims = (((1,), (0,)), ((), ()))
  one = jnp.ones((1,), jnp.float32)
  hist = jnp.zeros((HISTORY,), jnp.float32)

  def flax_dot(x, w):
    return fp8_ops.fp8_scaled_dot_general(
        x, w, dims, preferred_element_type=jnp.bfloat16, lhs_scale=one, rhs_scale=one,
        grad_scale=one, lhs_amax_history=hist, rhs_amax_history=hist,
        grad_amax_history=hist, quantize_compute_type=jnp.bfloat16)

  scale = jnp.float32(1.0)
  return {
      "bf16": lambda x, w: x @ w,
      "fp8 qdq": lambda x, w: qdq_dot(x, w, scale, scale, scale),
      "fp8 flax": flax_dot,
      "fp8 rows": lambda x, w: fp8.dense(x, w, 1, jnp.bfloat16),
  }


def fwd_bwd(dot):
  def step(x, w, dy):
    y, vjp = jax.vjp(dot, x, w)
    return y, vjp(dy)
  return step


def mlp_block(dot):
  def block(x, w1, w2):
    mean = jnp.mean(x.astype(jnp.float32), -1, keepdims=True)
    var = jnp.var(x.astype(jnp.float32), -1, keepdims=True)
    h = ((x - mean) * jax.lax.rsqrt(var + 1e-6)).astype(jnp.bfloat16)
    h = jax.nn.gelu(dot(h, w1))
    return x + dot(h, w2)

  def step(x, w1, w2, dy):
    y, vjp = jax.vjp(block, x, w1, w2)
    return y, vjp(dy)
  return step


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--variant", default="H/14", choices=sorted(VARIANTS))
  parser.add_argument("--batch", type=int, default=192)
  args = parser.parse_args()
  width, hidden, tokens = VARIANTS[args.variant]
  m = args.batch * tokens
  shapes = {"qkv": (width, 3 * width), "proj": (width, width),
            "mlp in": (width, hidden), "mlp out": (hidden, width)}
  key = jax.random.PRNGKey(0)
  results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
             "variant": args.variant, "rows": m, "matmul": {}, "mlp_block": {}}
  print(f"{results['device']}, jax {jax.__version__}, {args.variant}, M = {m}")
  for name, (k, n) in shapes.items():
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    w = (jax.random.normal(key, (k, n), jnp.bfloat16) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(key, (m, n), jnp.bfloat16)
    flop = 2 * m * k * n
    row = {"fp8 raw fwd": flop / timed(jax.jit(
        lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.bfloat16)),
        x.astype(E4M3), w.astype(E4M3)) / 1e12}
    for label, dot in paths().items():
      row[f"{label} fwd"] = flop / timed(jax.jit(dot), x, w) / 1e12
      row[f"{label} fwd+bwd"] = 3 * flop / timed(jax.jit(fwd_bwd(dot)), x, w, dy) / 1e12
    results["matmul"][name] = row
    print(f"{name:8s} {m}x{k}x{n}: " + ", ".join(f"{k_} {v:.0f}" for k_, v in row.items()),
          flush=True)
  x = jax.random.normal(key, (m, width), jnp.bfloat16)
  w1 = (jax.random.normal(key, (width, hidden)) / np.sqrt(width)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(key, (hidden, width)) / np.sqrt(hidden)).astype(jnp.bfloat16)
  for label, dot in paths().items():
    ms = 1e3 * timed(jax.jit(mlp_block(dot)), x, w1, w2, x)
    results["mlp_block"][label] = ms
    print(f"MLP block fwd+bwd, {label}: {ms:.3f} ms", flush=True)
  print(json.dumps(results))


if __name__ == "__main__":
  main()
