"""A quick check, on one Hopper GPU, of the kernels' numbers against XLA (under a minute).

    python benchmarks/kernel_check.py
    python benchmarks/kernel_check.py --tiny     # small shapes; off the GPU, in the interpreters

- ``hopper_attention.causal_attention_qkv`` with a q/k/v bias and RoPE at
  ViT-L/16's and ViT-H/14's head shapes (196 tokens and head dim 64, 256
  and 80) against float32 attention of the same bf16 inputs: relative error
  of the output, the packed gradient and the bias gradient. This covers the
  forward kernel's copy of v that the backward reads, and the backward
  kernels' column sums that make the bias gradient at head dim 64 (at 80
  with RoPE XLA sums the gradient; each line says which).
- ``layer_norm.add_bias_layer_norm`` (a residual add with the branch's
  deferred float32 bias, then the norm) at widths 1024 and 1280 against
  XLA's ``x + (y + b)`` and a float32 LayerNorm: whether the sum is the same
  bits, and the relative error of every gradient. The reference's bias
  gradient is XLA's sum through the bias's bf16 cast, the least exact of the
  two.

The CPU tests run the same computations in Pallas's interpreters; this is
the check that the compiled kernels agree with them.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from attention_kernel_bench import causal_xla, rotated  # noqa: E402
from darl_jax import ops  # noqa: E402
from darl_jax.kernels import hopper_attention as ha  # noqa: E402
from darl_jax.kernels import layer_norm as ln  # noqa: E402
from layer_norm_bench import reference as norm_reference  # noqa: E402
from mlp_kernel_bench import rel_err as rel  # noqa: E402


# Off the GPU the kernels run in Pallas's interpreters (a smoke test of this script).
INTERPRET = jax.default_backend() != "gpu"


def check_attention(tokens: int, head_dim: int, batch: int = 16, heads: int = 4) -> str:
  k = jax.random.split(jax.random.key(0), 4)
  qkv = jax.random.normal(k[0], (batch, tokens, 3, heads, head_dim)).astype(jnp.bfloat16)
  bias = (0.3 * jax.random.normal(k[1], (3, heads, head_dim))).astype(jnp.bfloat16)
  angles = jax.random.uniform(k[2], (tokens, head_dim // 2), maxval=6.0)
  rope = (jnp.cos(angles), jnp.sin(angles))
  do = jax.random.normal(k[3], (batch, tokens, heads, head_dim)).astype(jnp.bfloat16)

  tiling = ha.DEFAULT_ATTENTION_TILING
  out, vjp = jax.vjp(lambda x, b: ha.causal_attention_qkv(x, b, rope, tiling, INTERPRET),
                     qkv, bias)
  want, want_vjp = jax.vjp(rotated(causal_xla, rope, jnp.float32), qkv, bias)
  got, ref = vjp(do), want_vjp(do.astype(jnp.float32))
  summed = "in the kernels" if ha._sums_in_kernel(head_dim, rope=True) else "by XLA"
  return (f"attention, {tokens} tokens, head dim {head_dim}: out {rel(out, want):.1e}, "
          f"dqkv {rel(got[0], ref[0]):.1e}, dbias {rel(got[1], ref[1]):.1e} (summed {summed})")


def check_add_bias_norm(width: int, rows: int = 4096) -> str:
  k = jax.random.split(jax.random.key(1), 6)
  x = (2 * jax.random.normal(k[0], (rows, width))).astype(jnp.bfloat16)
  y = jax.random.normal(k[1], (rows, width)).astype(jnp.bfloat16)
  y_bias = 0.5 * jax.random.normal(k[2], (width,))
  scale = 1 + 0.1 * jax.random.normal(k[3], (width,))
  bias = 0.1 * jax.random.normal(k[4], (width,))
  w = jax.random.normal(k[5], (rows, width))

  def loss(s, out):
    return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(s.astype(jnp.float32) * w[::-1])

  def kernel(*args):
    s, out = ln.add_bias_layer_norm(*args, ops.LN_EPS, ln.DEFAULT_BLOCKS, INTERPRET)
    return loss(s, out), s

  def reference(x, y, y_bias, scale, bias):
    s = x + (y + y_bias.astype(y.dtype))
    return loss(s, norm_reference(s, scale, bias)[1]), s

  args = (x, y, y_bias, scale, bias)
  (_, s), got = jax.jit(jax.value_and_grad(kernel, range(5), has_aux=True))(*args)
  (_, s_ref), want = jax.jit(jax.value_and_grad(reference, range(5), has_aux=True))(*args)
  errors = ", ".join(f"{name} {rel(a, b):.1e}" for name, a, b in
                     zip(("dx", "dy", "dy_bias", "dscale", "dbias"), got, want))
  return (f"add_bias_layer_norm, width {width}: sum the same bits: "
          f"{bool(jnp.array_equal(s, s_ref))}; {errors}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tiny", action="store_true",
                      help="4 images of 80 tokens, 2 heads; 37 rows of widths 64 and 80")
  args = parser.parse_args()
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
  if args.tiny:
    for head_dim in (64, 80):
      print(check_attention(80, head_dim, batch=4, heads=2), flush=True)
    for width in (64, 80):
      print(check_add_bias_norm(width, rows=37), flush=True)
    return
  for tokens, head_dim in ((196, 64), (256, 80)):
    print(check_attention(tokens, head_dim), flush=True)
  for width in (1024, 1280):
    print(check_add_bias_norm(width), flush=True)


if __name__ == "__main__":
  main()
