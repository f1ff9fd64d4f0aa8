"""Times the memory-bound pieces of a ViT training step at a real shape.

    python benchmarks/block_bench.py [--variant=L/16 --batch=128]

Each row is one jitted function on random bf16 inputs (rotated over 3 sets):
its GPU kernel time per call from a profiler trace of ``--reps`` calls (so
launch overhead is left out; on CPU, wall time), the bytes it must move
(each input read once, each output written once) and the bandwidth that implies, beside
a plain copy that gives the card's practical bandwidth. Used to find which of
the step's elementwise and reduction kernels run far under bandwidth, and to
A/B replacements.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import linen as nn  # noqa: E402

from darl_jax import ops  # noqa: E402
from darl_jax.models import posenc as posenc_lib  # noqa: E402
from darl_jax.models import vit  # noqa: E402

import profile_step  # noqa: E402


def bench(fn, inputs, reps):
  """Seconds per call: summed GPU kernel time from a trace, or CPU wall time."""
  fn = jax.jit(fn)
  for x in inputs:
    jax.block_until_ready(fn(*x))
  if jax.default_backend() != "gpu":
    t0 = time.perf_counter()
    for i in range(reps):
      jax.block_until_ready(fn(*inputs[i % len(inputs)]))
    return (time.perf_counter() - t0) / reps
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    for i in range(reps):
      jax.block_until_ready(fn(*inputs[i % len(inputs)]))
    jax.profiler.stop_trace()
    total, _, _ = profile_step.gpu_kernel_times(trace_dir)
  return sum(total.values()) / 1e6 / reps


def main():
  profile_step.show_each_kernel()
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--variant", default="L/16")
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--tokens", type=int, default=196)
  parser.add_argument("--reps", type=int, default=30)
  parser.add_argument("--only", default="", help="comma list of row-name prefixes")
  args = parser.parse_args()
  variant, _ = vit.parse_variant(args.variant)
  n, d, f = args.batch * args.tokens, variant.width, variant.mlp_dim
  counter = iter(range(10**6))

  def rand(*shape, dtype=jnp.bfloat16):
    key = jax.random.fold_in(jax.random.PRNGKey(0), next(counter))
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)
  rows = []

  def row(name, fn, make, moved):
    if args.only and not any(name.startswith(p) for p in args.only.split(",")):
      return
    inputs = [make() for _ in range(3)]
    t = bench(fn, inputs, args.reps)
    rows.append((name, t * 1e3, moved / 1e6, moved / t / 1e9))
    print(f"{name:44s} {t * 1e3:8.3f} ms {moved / 1e6:8.1f} MB {moved / t / 1e9:7.0f} GB/s",
          flush=True)

  big = (n, f)
  row("copy x*2 [N,F] bf16", lambda x: x * 2, lambda: (rand(*big),), 2 * n * f * 2)
  for c in (d, 3 * d, f):
    row(f"colsum sum(0) [N,{c}]", lambda y: jnp.sum(y.astype(jnp.float32), 0),
        lambda c=c: (rand(n, c),), n * c * 2)
    row(f"colsum dot(ones) [N,{c}]",
        lambda y, o: jnp.dot(o, y, preferred_element_type=jnp.float32),
        lambda c=c: (rand(n, c), jnp.ones((n,), jnp.bfloat16)), n * c * 2)
    row(f"colsum 2-stage [N,{c}]",
        lambda y: jnp.sum(jnp.sum(y.reshape(args.batch, -1, y.shape[-1]).astype(jnp.float32), 1), 0),
        lambda c=c: (rand(n, c),), n * c * 2)

  # Dense backward alone: dx = dy W^T, dW = x^T dy, db = sum(dy).
  def dense_vjp(x, w, b, dy):
    _, vjp = jax.vjp(lambda x, w, b: x @ w + b, x, w, b)
    return vjp(dy)
  row("dense fc1 bwd (dx, dW, db)", dense_vjp,
      lambda: (rand(n, d), rand(d, f), rand(f), rand(n, f)), (2 * n * d + n * f) * 2)

  ln = nn.LayerNorm(epsilon=ops.LN_EPS, dtype=jnp.bfloat16)
  ln_params = ln.init(jax.random.PRNGKey(0), jnp.zeros((1, d), jnp.bfloat16))

  def ln_fwd_bwd(x, dy):
    y, vjp = jax.vjp(lambda p, x: ln.apply(p, x), ln_params, x)
    return y, vjp(dy)
  row("layernorm fwd+bwd [N,D]", ln_fwd_bwd, lambda: (rand(n, d), rand(n, d)),
      n * d * 2 * 4)

  # The model's GELU (erf form, custom gradient) beside jax.nn.gelu's erfc
  # form under autodiff (see ops.gelu for why the model's is faster).
  erfc_gelu = lambda h: nn.gelu(h.astype(jnp.float32), approximate=False).astype(h.dtype)
  for name, gelu in (("model", ops.gelu), ("erfc autodiff", erfc_gelu)):
    def gelu_fwd_bwd(h, dy, gelu=gelu):
      y, vjp = jax.vjp(gelu, h)
      return y, vjp(dy)
    row(f"gelu fwd+bwd [N,F] ({name})", gelu_fwd_bwd, lambda: (rand(n, f), rand(n, f)),
        n * f * 2 * 4)

    def bias_gelu_fwd_bwd(h, b, dy, gelu=gelu):
      y, vjp = jax.vjp(lambda h, b: gelu(h + b), h, b)
      return y, vjp(dy)
    row(f"bias+gelu fwd+bwd [N,F] ({name})", bias_gelu_fwd_bwd,
        lambda: (rand(n, f), rand(f), rand(n, f)), n * f * 2 * 4)

  # One transformer block, forward + backward, as the step runs it (cuDNN's
  # attention on GPUs, XLA's ops otherwise: darl_jax/ops.py).
  block = vit.Block(variant.num_heads, variant.mlp_dim, causal=True, dtype=jnp.bfloat16)
  attention = "cudnn" if jax.default_backend() == "gpu" else "xla"
  b, t = args.batch, args.tokens
  side = int(np.ceil(np.sqrt(t)))
  rows_i, cols_i = np.divmod(np.arange(t), side)
  angles = posenc_lib.rope_angles("rope2d", d // variant.num_heads, 10_000.0,
                                  jnp.arange(t, dtype=jnp.float32)[None],
                                  jnp.asarray(rows_i, jnp.float32)[None],
                                  jnp.asarray(cols_i, jnp.float32)[None])
  rope = posenc_lib.rope_cos_sin(jnp.broadcast_to(angles, (b,) + angles.shape[1:]))
  params = block.init(jax.random.PRNGKey(0), jnp.zeros((1, t, d), jnp.bfloat16),
                      jax.tree_util.tree_map(lambda a: a[:1], rope))

  def block_fwd_bwd(p, x, dy):
    y, vjp = jax.vjp(lambda p, x: block.apply(p, x, rope), p, x)
    return vjp(dy)
  with ops.using(attention=attention, mlp="xla", norm="xla"):   # traced in row
    row("block fwd+bwd", block_fwd_bwd, lambda: (params, rand(b, t, d), rand(b, t, d)), 0)

  print("\n| piece | ms | MB moved | GB/s |\n|---|---|---|---|")
  for name, ms, mb, gbs in rows:
    print(f"| {name} | {ms:.3f} | {mb:.1f} | {gbs:.0f} |")


if __name__ == "__main__":
  main()
