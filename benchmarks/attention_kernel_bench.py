"""The Hopper attention kernels (darl_jax/kernels/hopper_attention.py) against
cuDNN and XLA, on one GPU.

    python benchmarks/attention_kernel_bench.py --shape=L/16:128 --slots=0,2,3
    python benchmarks/attention_kernel_bench.py --shape=L/16:256 --tilings=slots=2,slots=2/rope_tables=float32

For one layer's causal self-attention at a model's shape ([batch, tokens,
heads, head_dim] bf16), it checks output and gradients against float32
attention (relative error), then times the forward and forward + backward
(medians of back-to-back launches; TFLOP/s counts the causal half of the
four attention products, MaxText's convention) in three tables:

- on q, k, v: cuDNN (``jax.nn.dot_product_attention(implementation=
  'cudnn')``), XLA, and the kernels at each ``--slots``;
- from the packed projection's product ``[B, T, 3, H, D]``, its bias and
  RoPE tables shared by the batch: bias and RoPE in XLA then cuDNN or the
  kernels, and ``causal_attention_qkv`` with float32 and bfloat16 tables;
- from the block's input ``x [B, T, W]``: XLA's q/k/v product then
  ``causal_attention_qkv``, against ``causal_attention_projected`` (the
  product our kernel, bias and RoPE in its epilogue), and the forward
  projections alone.

With ``--tilings`` it prints one table instead: ``causal_attention_qkv``
at each AttentionTiling, timed in alternating rounds so that the rows share
the card's state, with each row's largest difference from the first row
and whether more runs give the same bits (a race between a CTA's warps
would not).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from darl_jax.kernels import hopper_attention as ha  # noqa: E402
from darl_jax.models import posenc  # noqa: E402
from mlp_kernel_bench import rel_err, timed  # noqa: E402

# tokens per image, heads, head_dim
SHAPES = {"B/16": (196, 12, 64), "L/16": (196, 16, 64), "H/14": (256, 16, 80)}


def parse_shape(text: str):
  model, _, batch = text.partition(":")
  if model not in SHAPES:
    raise argparse.ArgumentTypeError(f"unknown model {model!r}; valid: {', '.join(SHAPES)}")
  t, h, d = SHAPES[model]
  return (int(batch or 128), t, h, d)


def parse_tiling(text: str) -> ha.AttentionTiling:
  """``slots=3/rope_tables=float32`` (fields of AttentionTiling,
  ``/``-separated) -> the tiling."""
  fields = {}
  for item in text.split("/"):
    key, _, value = item.partition("=")
    if key not in ("slots", "rope_tables"):
      raise ValueError(f"unknown AttentionTiling field {key!r} in {text!r}; valid: slots, "
                       f"rope_tables")
    fields[key] = int(value) if key == "slots" else value
  return ha.AttentionTiling(**fields)


def fwd_bwd(f):
  """``g(*inputs, do)``, jitted: f's output and the gradients of its inputs
  for the output cotangent ``do``."""
  @jax.jit
  def g(*args):
    *inputs, do = args
    out, vjp = jax.vjp(f, *inputs)
    return (out,) + vjp(do.astype(out.dtype))
  return g


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", type=parse_shape, default="L/16:128",
                      help="MODEL:BATCH, MODEL one of " + ", ".join(SHAPES))
  parser.add_argument("--slots", default="0,2,3",
                      help="comma-separated AttentionTiling.slots values to time")
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--tilings", default="",
                      help="comma-separated AttentionTilings (fields, e.g. "
                           "slots=3/rope_tables=float32): only the tilings table")
  parser.add_argument("--rounds", type=int, default=4,
                      help="alternating timing rounds of the tilings table")
  parser.add_argument("--reruns", type=int, default=10,
                      help="runs of each tiling checked for the same bits (tilings table)")
  args = parser.parse_args()
  b, t, h, d = args.shape
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; "
        f"shape [B={b}, T={t}, H={h}, D={d}] causal")
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
                 for kk in ks)
  if args.tilings:
    try:
      tilings = {text: parse_tiling(text) for text in args.tilings.split(",")}
    except ValueError as e:
      parser.error(str(e))
    tilings_table(q, k, v, do, tilings, args.iters, args.rounds, args.reruns)
    return

  def plain(impl, dtype=None):
    def f(q, k, v):
      if dtype is not None:
        q, k, v = (x.astype(dtype) for x in (q, k, v))
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    return f

  def kernel(slots):
    tiling = ha.AttentionTiling(slots)
    return lambda q, k, v: ha.causal_attention(q, k, v, tiling)

  ref = fwd_bwd(plain("xla", jnp.float32))(q, k, v, do)
  slots = [int(s) for s in args.slots.split(",") if s]
  candidates = {"cudnn": plain("cudnn"), "xla (bf16)": plain("xla")}
  candidates.update({f"kernels, slots={s}": kernel(s) for s in slots})
  flops_fwd = 4 * b * h * t * t * d / 2
  print("| computation | max rel. error (out, dq, dk, dv) | fwd ms | fwd+bwd ms | "
        "fwd+bwd TFLOP/s |")
  print("|---|---|---|---|---|")
  for name, f in candidates.items():
    try:
      got = fwd_bwd(f)(q, k, v, do)
    except Exception as e:   # cuDNN refuses some shapes; report and go on
      print(f"| {name} | failed: {type(e).__name__}: {str(e)[:120]} | | | |")
      continue
    errs = ", ".join(f"{rel_err(a, r):.1e}" for a, r in zip(got, ref))
    t_f = timed(jax.jit(f), q, k, v, iters=args.iters) * 1e3
    t_fb = timed(fwd_bwd(f), q, k, v, do, iters=args.iters) * 1e3
    print(f"| {name} | {errs} | {t_f:.3f} | {t_fb:.3f} | "
          f"{3 * flops_fwd / (t_fb * 1e-3) / 1e12:.0f} |")

  rope_table(q, k, v, do, args.iters)
  projection_table(b, t, h, d, args.iters)


def rotated(impl_fn, rope, dtype=None):
  """``f(qkv, bias)``: attention from the packed projection as the model's
  plain path runs it, the bias added (in qkv's dtype), RoPE on q and k, then
  ``impl_fn(q, k, v)``; in ``dtype`` from the bias add on, if given."""
  def f(qkv, bias):
    x = qkv + bias
    x = x if dtype is None else x.astype(dtype)
    cos, sin = (r[None] for r in rope)
    q, k, v = (x[:, :, i] for i in range(3))
    return impl_fn(posenc.apply_rope(q, cos, sin), posenc.apply_rope(k, cos, sin), v)
  return f


def causal_xla(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def packed_inputs(q, k, v):
  """-> (the packed projection ``[B, T, 3, H, D]``, a bf16 qkv bias, RoPE
  tables ``[T, D/2]``) for the tables that start from the projection."""
  _, t, h, d = q.shape
  qkv = jnp.stack([q, k, v], axis=2)
  bias = (0.3 * jax.random.normal(jax.random.key(2), (3, h, d))).astype(qkv.dtype)
  angles = jax.random.uniform(jax.random.key(1), (t, d // 2), maxval=6.0)
  return qkv, bias, (jnp.cos(angles), jnp.sin(angles))


def rope_table(q, k, v, do, iters: int):
  """The second table: packed projection + RoPE -> output and its gradient."""
  qkv, bias, rope = packed_inputs(q, k, v)
  with_bias = lambda f: lambda qkv: f(qkv, bias)  # noqa: E731

  def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

  ref = fwd_bwd(with_bias(rotated(causal_xla, rope, jnp.float32)))(qkv, do)
  candidates = {
      "bias + RoPE in XLA, cuDNN": with_bias(rotated(cudnn, rope)),
      "bias + RoPE in XLA, kernels on q, k, v": with_bias(rotated(ha.causal_attention, rope)),
      **{f"causal_attention_qkv (bias, RoPE backward in the kernels), {dt} tables":
         (lambda x, dt=dt: ha.causal_attention_qkv(x, bias, rope, ha.AttentionTiling(2, dt)))
         for dt in ("float32", "bfloat16")}}
  print()
  print("| from packed qkv, with RoPE | max rel. error (out, dqkv) | fwd ms | fwd+bwd ms |")
  print("|---|---|---|---|")
  for name, f in candidates.items():
    try:
      got = fwd_bwd(f)(qkv, do)
    except Exception as e:
      print(f"| {name} | failed: {type(e).__name__}: {str(e)[:120]} | | |")
      continue
    errs = ", ".join(f"{rel_err(a, r):.1e}" for a, r in zip(got, ref))
    t_f = timed(jax.jit(f), qkv, iters=iters) * 1e3
    t_fb = timed(fwd_bwd(f), qkv, do, iters=iters) * 1e3
    print(f"| {name} | {errs} | {t_f:.3f} | {t_fb:.3f} |")


def tilings_table(q, k, v, do, tilings, iters: int, rounds: int, reruns: int = 10):
  """causal_attention_qkv (bias, bf16 RoPE tables) at each tiling: the
  error against float32, the largest difference from the first tiling,
  whether ``reruns`` more runs give the same bits, and fwd+bwd ms, the
  median of ``rounds`` rounds that time every tiling in turn (min-max of
  the rounds beside it)."""
  qkv, bias, rope = packed_inputs(q, k, v)
  ref = fwd_bwd(lambda x: rotated(causal_xla, rope, jnp.float32)(x, bias))(qkv, do)
  steps = {name: fwd_bwd(lambda x, tiling=tiling: ha.causal_attention_qkv(x, bias, rope, tiling))
           for name, tiling in tilings.items()}
  outs = {name: step(qkv, do) for name, step in steps.items()}
  first = next(iter(outs.values()))
  # the same bits on every run: a misplaced barrier (a race between the
  # warps of a CTA) shows as outputs that change from run to run
  stable = {name: all(all(bool(jnp.array_equal(a, b)) for a, b in zip(step(qkv, do), outs[name]))
                      for _ in range(reruns))
            for name, step in steps.items()}
  times = {name: [] for name in steps}
  for _ in range(rounds):
    for name, step in steps.items():
      times[name].append(timed(step, qkv, do, iters=iters) * 1e3)
  print(f"| tiling | max rel. error (out, dqkv) | max abs. diff. from the first row | "
        f"same bits in {reruns} more runs | fwd+bwd ms (min-max of rounds) |")
  print("|---|---|---|---|---|")
  for name, got in outs.items():
    errs = ", ".join(f"{rel_err(a, r):.1e}" for a, r in zip(got, ref))
    diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - f.astype(jnp.float32))))
               for a, f in zip(got, first))
    ts = times[name]
    print(f"| {name} | {errs} | {diff:.1e} | {'yes' if stable[name] else 'NO'} | "
          f"{statistics.median(ts):.4f} ({min(ts):.4f}-{max(ts):.4f}) |")


def projection_table(b: int, t: int, h: int, d: int, iters: int):
  """The third table: from the block's input x, the projection included."""
  width = h * d
  ks = jax.random.split(jax.random.key(3), 5)
  x = jax.random.normal(ks[0], (b, t, width)).astype(jnp.bfloat16)
  kernel = (jax.random.normal(ks[1], (width, 3, h, d)) * width ** -0.5).astype(jnp.bfloat16)
  bias = 0.3 * jax.random.normal(ks[2], (3, h, d))
  angles = jax.random.uniform(ks[3], (t, d // 2), maxval=6.0)
  rope = (jnp.cos(angles), jnp.sin(angles))
  do = jax.random.normal(ks[4], (b, t, h, d)).astype(jnp.bfloat16)
  product = lambda x, kernel: jnp.einsum("btw,wchd->btchd", x, kernel)  # noqa: E731

  def reference(x, kernel, bias):
    qkv = product(x.astype(jnp.float32), kernel.astype(jnp.float32))
    return rotated(causal_xla, rope)(qkv, bias)

  def xla_then_kernels(x, kernel, bias):
    return ha.causal_attention_qkv(product(x, kernel), bias.astype(x.dtype), rope)

  def projected(x, kernel, bias):
    return ha.causal_attention_projected(x, kernel, bias, rope)

  if not ha.fits_projected(x, kernel, bias, rope):
    print(f"\n(no projection table: {h} heads of {d} do not fit causal_attention_projected)")
    return
  ref = fwd_bwd(reference)(x, kernel, bias, do)
  print()
  print("| from the block's input x, with RoPE | max rel. error (out, dx, dkernel, dbias) "
        "| fwd ms | fwd+bwd ms |")
  print("|---|---|---|---|")
  for name, f in {"XLA qkv product, causal_attention_qkv": xla_then_kernels,
                  "causal_attention_projected": projected}.items():
    got = fwd_bwd(f)(x, kernel, bias, do)
    errs = ", ".join(f"{rel_err(a, r):.1e}" for a, r in zip(got, ref))
    t_f = timed(jax.jit(f), x, kernel, bias, iters=iters) * 1e3
    t_fb = timed(fwd_bwd(f), x, kernel, bias, do, iters=iters) * 1e3
    print(f"| {name} | {errs} | {t_f:.3f} | {t_fb:.3f} |")
  want = ha._query_keys(product(x, kernel).astype(jnp.float32), bias, rope)
  for name, f in {"XLA qkv product alone": lambda x, kernel, bias: product(x, kernel),
                  "XLA qkv product + bias + RoPE pass": lambda x, kernel, bias:
                  ha._query_keys(product(x, kernel), bias.astype(x.dtype), rope),
                  "project_qkv (bias + RoPE in the epilogue)": lambda x, kernel, bias:
                  ha.project_qkv(x, kernel, bias, rope)}.items():
    out = jax.jit(f)(x, kernel, bias)
    err = (f"{rel_err(out.reshape(want.shape[0], -1, d)[:, :2 * h], want):.1e} (q, k)"
           if "RoPE" in name else "")
    print(f"| {name} | {err} | {timed(jax.jit(f), x, kernel, bias, iters=iters) * 1e3:.3f} | |")


if __name__ == "__main__":
  main()
