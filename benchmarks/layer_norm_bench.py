"""The fused LayerNorm kernels (darl_jax/kernels/layer_norm.py) against XLA's
LayerNorm, on one GPU.

    python benchmarks/layer_norm_bench.py --shape=L/16:256 --blocks=8x8:8x8x528,4x4:8x8x1056

For one pre-LN norm at a model's shape (``[batch x tokens, width]`` bf16
rows, float32 scale and bias) it checks the kernels against a float32
LayerNorm (relative error; XLA's beside it), then times the forward alone
and forward + backward, where the backward is the one a pre-LN block runs:
the norm's output gradient plus the residual stream's gradient reaching
``x`` around it. Rows: flax's ``nn.LayerNorm`` as XLA compiles it, and
``residual_layer_norm`` at each ``--blocks`` setting
(``rows x warps : bwd_rows x bwd_warps x programs [x bwd_chunk [x
bwd_sweeps]][s]``, ``s`` for ``bwd_block_sums``; always the backward
kernel, whatever the width). GB/s counts the bytes the computation must
move (forward: x in, y out; backward: x, dy and the residual gradient in, dx
out), so 3000-4000 is the card's copy rate.

A second table times the residual add before the norm (``s = x + a``, then
``(s, LN(s))``, the same backward): XLA's add then XLA's norm, XLA's add then
the kernels, and ``add_layer_norm`` (the add inside the forward kernel, as
the triton ViT runs it).

A third times the norm as the triton ViT runs it in every block,
``add_bias_layer_norm`` (the branch's bias added in the forward kernel, its
gradient a third column sum in the backward kernel), at each ``--blocks``,
against the same kernels with that gradient summed by XLA instead (the
reference the kernel's sum is checked against, and what it saves).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import linen as nn  # noqa: E402

from darl_jax import ops  # noqa: E402
from darl_jax.kernels import layer_norm as ln  # noqa: E402
from darl_jax.models import vit  # noqa: E402
from mlp_kernel_bench import rel_err, timed  # noqa: E402

def parse_shape(text: str) -> tuple[int, int]:
  """``L/16:256`` -> (rows, width): batch x (patches + SOS) token rows."""
  name, batch = text.split(":")
  variant, patch = vit.parse_variant(name)
  tokens = (224 // patch) ** 2 + 1
  return int(batch) * tokens, variant.width


def parse_blocks(text: str) -> ln.Blocks:
  """``rows x warps : bwd_rows x bwd_warps x programs [x bwd_chunk [x bwd_sweeps]][s]``
  (``s``: ``bwd_block_sums``);
  the backward is the kernel's at every width (``Blocks.bwd='kernel'``)."""
  fwd, bwd = text.split(":")
  block_sums = bwd.endswith("s")     # suffix s: Blocks.bwd_block_sums
  rows, warps = (int(v) for v in fwd.split("x"))
  bwd_rows, bwd_warps, programs, *rest = (int(v) for v in bwd.rstrip("s").split("x"))
  extra = dict(zip(("bwd_chunk", "bwd_sweeps"), rest), bwd_block_sums=block_sums)
  return ln.Blocks(rows, warps, bwd_rows, bwd_warps, programs, bwd="kernel", **extra)


def reference(x, scale, bias):
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
  return x, (x32 - mean) * jax.lax.rsqrt(var + ops.LN_EPS) * scale + bias


def xla_norm(x, scale, bias):
  y = nn.LayerNorm(epsilon=ops.LN_EPS, dtype=x.dtype).apply(
      {"params": {"scale": scale, "bias": bias}}, x)
  return x, y


def fwd_bwd(norm):
  """Forward and the pre-LN backward: cotangents for both ``x`` (the
  residual) and ``y``. ``norm(*inputs) -> (x, y)``; the jitted function
  takes ``(*inputs, dres, dy)``."""
  def run(*args):
    *inputs, dres, dy = args
    out, vjp = jax.vjp(norm, *inputs)
    return out[1], vjp((dres, dy.astype(out[1].dtype)))
  return jax.jit(run)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shape", default="L/16:256")
  parser.add_argument("--blocks", default="8x8:8x8x528,4x4:8x8x1056,16x8:16x8x264,8x4:4x4x1056")
  parser.add_argument("--iters", type=int, default=20)
  args = parser.parse_args()
  rows, width = parse_shape(args.shape)
  k = jax.random.split(jax.random.PRNGKey(0), 5)
  x = (jax.random.normal(k[0], (rows, width)) * 2 + 0.5).astype(jnp.bfloat16)
  scale = 1 + 0.1 * jax.random.normal(k[1], (width,))
  bias = 0.1 * jax.random.normal(k[2], (width,))
  dres = jax.random.normal(k[3], (rows, width)).astype(jnp.bfloat16)
  dy = jax.random.normal(k[4], (rows, width)).astype(jnp.bfloat16)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.shape}: "
        f"{rows} rows x {width}")
  ref_y, ref_g = fwd_bwd(reference)(x, scale, bias, dres, dy)
  fwd_bytes = 2 * rows * width * 2
  bwd_bytes = 4 * rows * width * 2
  print("| computation | fwd ms | GB/s | fwd+bwd ms | bwd GB/s (est.) | err y | err dx, dscale |")
  print("|---|---|---|---|---|---|---|")
  candidates = [("XLA (nn.LayerNorm)", xla_norm)]
  interpret = jax.default_backend() != "gpu"    # CPU: Pallas's interpreter (smoke test)
  for text in args.blocks.split(","):
    blocks = parse_blocks(text)
    candidates.append((f"kernels {text}", lambda x, s, b, blocks=blocks:
                       ln.residual_layer_norm(x, s, b, ops.LN_EPS, blocks, interpret)))
  for name, norm in candidates:
    fwd = jax.jit(lambda x, s, b, norm=norm: norm(x, s, b)[1])
    both = fwd_bwd(norm)
    y, g = both(x, scale, bias, dres, dy)
    t_fwd = timed(fwd, x, scale, bias, iters=args.iters)
    t_both = timed(both, x, scale, bias, dres, dy, iters=args.iters)
    t_bwd = max(t_both - t_fwd, 1e-9)
    print(f"| {name} | {1e3 * t_fwd:.3f} | {fwd_bytes / t_fwd / 1e9:.0f} | "
          f"{1e3 * t_both:.3f} | {bwd_bytes / t_bwd / 1e9:.0f} | {rel_err(y, ref_y):.1e} | "
          f"{rel_err(g[0], ref_g[0]):.1e}, {rel_err(g[1], ref_g[1]):.1e} |", flush=True)
  add_rows(x, scale, bias, dres, dy, args.iters)
  bias_rows(x, scale, bias, dres, dy, args.iters, args.blocks)


def branch_output(x):
  """Another branch's output to add to ``x`` (the second and third tables)."""
  return (x.astype(jnp.float32) * 0.5 - 0.25).astype(x.dtype)


def add_rows(x, scale, bias, dres, dy, iters):
  """The residual add + norm three ways (fused and not), at the default blocks."""
  a = branch_output(x)
  interpret = jax.default_backend() != "gpu"

  def added(norm):
    return lambda x, a, s, b: norm(x + a, s, b)

  candidates = [
      ("XLA add, XLA norm", added(xla_norm)),
      ("XLA add, kernels", added(lambda x, s, b: ln.residual_layer_norm(
          x, s, b, ops.LN_EPS, ln.DEFAULT_BLOCKS, interpret))),
      ("add_layer_norm (fused)", lambda x, a, s, b: ln.add_layer_norm(
          x, a, s, b, ops.LN_EPS, ln.DEFAULT_BLOCKS, interpret)),
  ]

  ref_y, ref_g = fwd_bwd(added(reference))(x, a, scale, bias, dres, dy)
  print("| residual add + norm | fwd ms | fwd+bwd ms | err y | err dx, da |")
  print("|---|---|---|---|---|")
  for name, norm in candidates:
    fwd = jax.jit(lambda x, a, s, b, norm=norm: norm(x, a, s, b)[1])
    both = fwd_bwd(norm)
    y, g = both(x, a, scale, bias, dres, dy)
    t_fwd = timed(fwd, x, a, scale, bias, iters=iters)
    t_both = timed(both, x, a, scale, bias, dres, dy, iters=iters)
    print(f"| {name} | {1e3 * t_fwd:.3f} | {1e3 * t_both:.3f} | {rel_err(y, ref_y):.1e} | "
          f"{rel_err(g[0], ref_g[0]):.1e}, {rel_err(g[1], ref_g[1]):.1e} |", flush=True)


def xla_sum_add_bias_layer_norm():
  """``ln.add_bias_layer_norm`` with ``y_bias``'s gradient summed by XLA
  over the whole ``[rows, width]`` gradient, instead of a third column sum
  in the backward kernel."""
  @functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
  def add_bias_layer_norm(x, y, y_bias, scale, bias, eps=1e-6,
                          blocks=ln.DEFAULT_BLOCKS, interpret=False):
    s, out, _ = ln.add_forward(x, y, scale, bias, y_bias=y_bias, eps=eps,
                               blocks=blocks, interpret=interpret)
    return s, out

  def bwd(eps, blocks, interpret, saved, cotangents):
    *saved, bias_like = saved
    d, dy, dscale, dbias = ln._add_bwd(eps, blocks, interpret, tuple(saved), cotangents)
    dy_bias = jnp.sum(d.astype(jnp.float32), axis=tuple(range(d.ndim - 1)))
    return d, dy, dy_bias.astype(bias_like.dtype), dscale, dbias

  add_bias_layer_norm.defvjp(ln._add_bias_fwd, bwd, symbolic_zeros=True)
  return add_bias_layer_norm


def bias_rows(x, scale, bias, dres, dy, iters, blocks_text):
  """``add_bias_layer_norm`` fwd+bwd: XLA's sum of the branch bias's
  gradient and the kernels' at each ``--blocks``."""
  a = branch_output(x)
  a_bias = 0.1 * scale
  interpret = jax.default_backend() != "gpu"
  xla_sum = xla_sum_add_bias_layer_norm()
  candidates = [("XLA's branch-bias sum (before), default blocks",
                 lambda x, a, ab, s, b: xla_sum(x, a, ab, s, b, ops.LN_EPS, ln.DEFAULT_BLOCKS,
                                                interpret))]
  for text in blocks_text.split(","):
    blocks = parse_blocks(text)
    candidates.append((f"kernel sum, {text}", lambda x, a, ab, s, b, blocks=blocks:
                       ln.add_bias_layer_norm(x, a, ab, s, b, ops.LN_EPS, blocks, interpret)))
  print("| add_bias_layer_norm | fwd+bwd ms | err d(branch bias) |")
  print("|---|---|---|")
  want = None
  for name, norm in candidates:
    both = fwd_bwd(norm)
    _, g = both(x, a, a_bias, scale, bias, dres, dy)
    want = g[2] if want is None else want
    t_both = timed(both, x, a, a_bias, scale, bias, dres, dy, iters=iters)
    print(f"| {name} | {1e3 * t_both:.3f} | {rel_err(g[2], want):.1e} |", flush=True)


if __name__ == "__main__":
  main()
