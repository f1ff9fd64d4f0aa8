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
* ``fp8 delayed``: darl_jax/fp8.py's ``dense_delayed``: the input's and the
  gradient's power-of-two scales from an amax history, the kernel's from
  itself; its history's record (the step's largest magnitudes) is computed
  and returned, as a train step would.

Each forward alone, then forward and backward (the input's and the kernel's
gradients, e5m2 gradients for the fp8 paths), in TFLOP/s, and an MLP block
(layer norm, fc1, GELU, fc2) forward and backward, where the quantization can
fuse into its neighbours. Run it on the GPU:

  python benchmarks/fp8_matmul_bench.py --variant=H/14 --batch=192
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python benchmarks/fp8_matmul_bench.py \\
      --paths="bf16,fp8 rows" --shapes=qkv

Each measurement prints as it lands, with its compile time: fp8 programs can
spend minutes in GEMM autotuning, so choose ``--shapes`` and ``--paths`` to
fit one device call.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

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
  """label -> ``dot(x, w, history)`` (the history: fp8.new_history's shape,
  read by ``fp8 delayed`` only; the others' history gradient is zeros)."""
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
      "bf16": lambda x, w, h: x @ w,
      "fp8 qdq": lambda x, w, h: qdq_dot(x, w, scale, scale, scale),
      "fp8 flax": lambda x, w, h: flax_dot(x, w),
      "fp8 rows": lambda x, w, h: fp8.dense(x, w, 1, jnp.bfloat16),
      "fp8 delayed": lambda x, w, h: fp8.dense_delayed(x, w, h, 1, jnp.bfloat16),
  }


def history():
  """A history as a train step would hold it: N(0, 1) inputs and small
  gradients seen before."""
  return fp8.new_history().at[0, :].set(4.5).at[1, :].set(1e-3)


def fwd_bwd(dot):
  def step(x, w, h, dy):
    y, vjp = jax.vjp(dot, x, w, h)
    return y, vjp(dy)
  return step


def mlp_block(dot):
  def block(x, w1, w2, h1, h2):
    mean = jnp.mean(x.astype(jnp.float32), -1, keepdims=True)
    var = jnp.var(x.astype(jnp.float32), -1, keepdims=True)
    h = ((x - mean) * jax.lax.rsqrt(var + 1e-6)).astype(jnp.bfloat16)
    h = jax.nn.gelu(dot(h, w1, h1))
    return x + dot(h, w2, h2)

  def step(x, w1, w2, h1, h2, dy):
    y, vjp = jax.vjp(block, x, w1, w2, h1, h2)
    return y, vjp(dy)
  return step


def measure(fn, *args, iters: int = 10, reps: int = 7) -> tuple[float, float]:
  """(seconds to compile ``fn`` at ``args``, median seconds per call over
  ``reps`` timings of ``iters`` calls)."""
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return time.perf_counter() - start, timed(compiled, *args, iters=iters, reps=reps)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--variant", default="H/14", choices=sorted(VARIANTS))
  parser.add_argument("--batch", type=int, default=192)
  parser.add_argument("--shapes", default="qkv,proj,mlp in,mlp out",
                      help="comma list of the matmuls to time")
  parser.add_argument("--paths", default="bf16,fp8 raw,fp8 qdq,fp8 flax,fp8 rows,fp8 delayed",
                      help="comma list of the paths to time")
  parser.add_argument("--block", action=argparse.BooleanOptionalAction, default=True,
                      help="also time the MLP block")
  parser.add_argument("--iters", type=int, default=10, help="calls per timing")
  parser.add_argument("--reps", type=int, default=7, help="timings; the median is reported")
  args = parser.parse_args()
  width, hidden, tokens = VARIANTS[args.variant]
  m = args.batch * tokens
  all_shapes = {"qkv": (width, 3 * width), "proj": (width, width),
                "mlp in": (width, hidden), "mlp out": (hidden, width)}
  every_dot = paths()
  chosen_shapes, chosen = args.shapes.split(","), args.paths.split(",")
  for flag, names, valid in (("--shapes", chosen_shapes, list(all_shapes)),
                             ("--paths", chosen, ["fp8 raw", *every_dot])):
    unknown = [n for n in names if n not in valid]
    if unknown:
      parser.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(valid)}")
  shapes = {name: all_shapes[name] for name in chosen_shapes}
  dots = {label: dot for label, dot in every_dot.items() if label in chosen}
  time_program = functools.partial(measure, iters=args.iters, reps=args.reps)
  key = jax.random.PRNGKey(0)
  results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
             "variant": args.variant, "rows": m, "xla_flags": os.environ.get("XLA_FLAGS", ""),
             "matmul": {}, "mlp_block": {}}
  print(f"{results['device']}, jax {jax.__version__}, {args.variant}, M = {m}, "
        f"XLA_FLAGS={results['xla_flags']!r}", flush=True)

  def report(row, label, compile_s, value, unit):
    # One line per measurement as it lands: fp8 programs can take minutes
    # to compile (GEMM autotuning), and a run cut short still reports.
    row[label] = value
    print(f"  {label:18s} {value:8.1f} {unit}  (compile {compile_s:.1f} s)", flush=True)

  for name, (k, n) in shapes.items():
    print(f"{name} {m}x{k}x{n}, TFLOP/s:", flush=True)
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    w = (jax.random.normal(key, (k, n), jnp.bfloat16) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(key, (m, n), jnp.bfloat16)
    flop = 2 * m * k * n
    row = results["matmul"][name] = {}
    if "fp8 raw" in chosen:
      c, t = time_program(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.bfloat16),
                          x.astype(E4M3), w.astype(E4M3))
      report(row, "fp8 raw fwd", c, flop / t / 1e12, "TFLOP/s")
    for label, dot in dots.items():
      c, t = time_program(dot, x, w, history())
      report(row, f"{label} fwd", c, flop / t / 1e12, "TFLOP/s")
      c, t = time_program(fwd_bwd(dot), x, w, history(), dy)
      report(row, f"{label} fwd+bwd", c, 3 * flop / t / 1e12, "TFLOP/s")
  if args.block:
    print("MLP block (norm, fc1, GELU, fc2) fwd+bwd, ms:", flush=True)
    x = jax.random.normal(key, (m, width), jnp.bfloat16)
    w1 = (jax.random.normal(key, (width, hidden)) / np.sqrt(width)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(key, (hidden, width)) / np.sqrt(hidden)).astype(jnp.bfloat16)
    for label, dot in dots.items():
      c, t = time_program(mlp_block(dot), x, w1, w2, history(), history(), x)
      report(results["mlp_block"], label, c, 1e3 * t, "ms")
  print(json.dumps(results))


if __name__ == "__main__":
  main()
