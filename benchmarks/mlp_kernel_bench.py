"""The Hopper MLP kernels (darl_jax/kernels/hopper_mlp.py) against XLA, on one GPU.

    python benchmarks/mlp_kernel_bench.py --shape=L/16:256 --tilings=128x128x64x2,128x128x32x4

For the MLP of one block at a model's shape (rows = batch x tokens), it
checks each kernel against the XLA computation it replaces (relative error,
bf16), then times:
- cuBLAS ``x @ w1`` alone (the floor for the fused forward);
- the forward as the model runs it under XLA (cuBLAS + bias, then the GELU
  kernel) and as ``dense_gelu``, for each tiling;
- the backward through fc2 and GELU under XLA and as ``matmul_scaled``;
- the backward with fc1's bias gradient summed by XLA after it and inside
  the kernel (``col_sums``);
- alternative epilogues as baselines: keeping ``h`` (not ``gelu'(h)``)
  for the backward and evaluating the derivative in the backward's
  epilogue, and rounding ``h`` to bf16 before the GELU as XLA does;
- the whole MLP, forward and backward (weight gradients and bias sums
  included), as models.layers.Mlp and as hopper_mlp.mlp.
Times are medians over repeats of back-to-back launches.

``--trace=DIR`` also runs the forward (with its epilogue and the rounding
one), a product-only and the backward kernel once each with Mosaic
GPU's on-device profiler, and prints per kernel the median cycles per tile
of a warpgroup's main loop and epilogue, how much of each epilogue ran
under the other warpgroup's main loop, and how long neither ran one.
``--study`` times the kernel with parts of its epilogue left out or doubled.
"""

from __future__ import annotations

import argparse
import collections
import glob
import itertools
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from darl_jax.kernels import hopper_gemm, hopper_mlp  # noqa: E402
from darl_jax import ops  # noqa: E402
from darl_jax.models import layers  # noqa: E402

# rows per image (tokens), width, MLP width
SHAPES = {"B/16": (196, 768, 3072), "L/16": (196, 1024, 4096), "H/14": (256, 1280, 5120)}


def parse_tiling(text: str) -> hopper_mlp.Tiling:
  """``128x128x64x2``: tile_m x tile_n x tile_k x stages (per compute
  warpgroup), optionally x epi (the epilogue's sub-tile, default 64); then
  optionally ``iN`` (``inflight``: k-steps of products left running) and a
  trailing ``o`` (``ordered``: the warpgroups take turns at their main
  loops): ``128x128x64x4o``, ``128x128x64x5i2``."""
  match = re.fullmatch(r"(\d+(?:x\d+){3,4})(?:i(\d+))?(o?)", text)
  if not match:
    raise argparse.ArgumentTypeError(f"tiling {text!r}: want MxNxKxSTAGES[xEPI][iN][o]")
  parts = [int(p) for p in match.group(1).split("x")]
  names = ("tile_m", "tile_n", "tile_k", "stages", "epi")
  return hopper_mlp.Tiling(**dict(zip(names, parts)), inflight=int(match.group(2) or 1),
                           ordered=bool(match.group(3)))


def timed(f, *args, iters=10, reps=7):
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(iters):
      out = f(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t) / iters)
  return statistics.median(times)


def rel_err(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _h_and_gelu(acc, bias, _):
  """A forward epilogue that keeps h instead of gelu'(h): (h, gelu(h))."""
  h = (acc + jax.lax.broadcast_in_dim(bias, acc.shape, [1])).astype(jnp.bfloat16)
  return h, hopper_mlp.kernel_gelu(h.astype(jnp.float32))


def _rounded_h_unfolded(acc, bias, _):
  """A forward epilogue with h rounded to bf16 before the GELU (as the XLA
  MLP's fc1 output is) and the constants not folded."""
  h = (acc + jax.lax.broadcast_in_dim(bias, acc.shape, [1])).astype(jnp.bfloat16)
  h = h.astype(jnp.float32)
  z = jnp.abs(h) * 2.0 ** -0.5
  r = jax.lax.rsqrt(1.0 + hopper_mlp._AS_P * z)
  t = r * r
  poly = hopper_mlp._AS_A[4]
  for a in hopper_mlp._AS_A[3::-1]:
    poly = a + t * poly
  e = jnp.exp2(h * h * (-0.5 * hopper_mlp._LOG2E))
  half_tail = (0.5 * t) * poly * e
  cdf = jnp.where(h >= 0, 1.0 - half_tail, half_tail)
  return h * cdf, cdf + h * (e * hopper_mlp._INV_SQRT_2PI)


def _times_gelu_grad(acc, _, h):
  """A backward epilogue that evaluates the derivative from h."""
  return (acc * hopper_mlp.kernel_gelu_grad(h),)


def epilogue_study(x, w, b, h, tiling, reference=False):
  """The forward / backward kernel with parts of its epilogue left out or
  doubled; ``reference``: also jax's own Hopper matmul example."""
  def erf_gelu(acc, bias, _):
    hh = (acc + jax.lax.broadcast_in_dim(bias, acc.shape, [1])).astype(jnp.bfloat16)
    return hh, ops.gelu(hh.astype(jnp.float32))

  def gelu_only(acc, bias, _):
    return (hopper_mlp.kernel_gelu(acc + jax.lax.broadcast_in_dim(bias, acc.shape, [1])),)

  def gelu_twice(acc, bias, _):
    return (hopper_mlp.kernel_gelu(gelu_only(acc, bias, _)[0]),)

  # If the epilogue ran under the other warpgroup's products, its arithmetic
  # would cost nothing until it outlasts them: "GELU twice" would cost what
  # "GELU, one output" does. If it is serialised with them, twice as much.
  cases = [
      ("product only (one output)", dict(epilogue=lambda acc, *_: (acc,), num_out=1)),
      ("+ bias + GELU, one output", dict(bias=b, num_out=1, epilogue=gelu_only)),
      ("+ bias + GELU twice (chained), one output", dict(bias=b, num_out=1,
                                                         epilogue=gelu_twice)),
      ("+ bias + (g, gelu'), two outputs: dense_gelu", dict(
          bias=b, num_out=2, epilogue=hopper_mlp._fwd_epilogue_for(interpret=False))),
      ("+ bias, stored twice", dict(bias=b, num_out=2, epilogue=lambda acc, bias, _: (
          acc + jax.lax.broadcast_in_dim(bias, acc.shape, [1]),) * 2)),
      ("+ bias + GELU (lax.erf)", dict(bias=b, num_out=2, epilogue=erf_gelu)),
      ("+ aux added (backward's reads)", dict(aux=h, num_out=1,
                                              epilogue=lambda acc, _, a: (acc + a,))),
  ]
  rows = []
  for name, kw in cases:
    fn = jax.jit(lambda x, w, kw=kw: hopper_gemm.gemm(x, w, tiling=tiling, **kw))
    try:
      rows.append((f"study: {name}", timed(fn, x, w), str(tiling)))
    except Exception as e:  # noqa: BLE001
      rows.append((f"study: {name}", float("nan"), f"failed: {str(e).splitlines()[0][:160]}"))
  if not reference:
    return rows
  try:   # jax's own Hopper matmul example, as a second Mosaic GPU reference
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as ref_mm
    dims = ref_mm.MatmulDimension
    for cluster, wgd, minor in itertools.product((None, dims.M, dims.N), dims, dims):
      cfg = ref_mm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                                grid_tile_width=8, cluster_dimension=cluster,
                                wg_dimension=wgd, grid_minor_dim=minor)
      fn = jax.jit(lambda x, w, cfg=cfg: ref_mm.matmul(x, w, None, cfg))
      name = f"study: jax hopper_matmul_mgpu 128x128x64 x4, cluster {cluster}, wg {wgd}, minor {minor}"
      try:
        rows.append((name, timed(fn, x, w, reps=3), ""))
      except Exception as e:  # noqa: BLE001
        rows.append((name, float("nan"), f"failed: {str(e).splitlines()[0][:100]}"))
  except Exception as e:  # noqa: BLE001
    rows.append(("study: jax hopper_matmul_mgpu", float("nan"),
                 f"failed: {str(e).splitlines()[0][:160]}"))
  return rows


def _intervals(trace_file):
  """{(cta, warpgroup): {region: [(start, end), ...]}} from a kernel trace
  (hopper_gemm.gemm's trace_dir; times in SM clock cycles)."""
  with open(trace_file) as f:
    events = json.load(f)["traceEvents"]
  open_at, spans = {}, collections.defaultdict(lambda: collections.defaultdict(list))
  for e in events:
    key = divmod(e["tid"] - 1, 3)   # (CTA, warpgroup): 3 warpgroups per CTA
    if e["ph"] == "B":
      open_at[key, e["name"]] = e["ts"] * 1e3
    else:
      spans[key][e["name"]].append((open_at.pop((key, e["name"])), e["ts"] * 1e3))
  return spans


def overlap_summary(trace_file):
  """How the two compute warpgroups' regions line up, over all CTAs: the
  median main loop and epilogue, the share of each epilogue during which
  the other warpgroup was in its main loop, and the share of the CTA's time
  with neither in a main loop (the tensor cores waiting on the epilogues)."""
  spans = _intervals(trace_file)
  ctas = sorted({cta for cta, _ in spans})

  def covered(a, b, intervals):   # length of [a, b) inside the union of intervals
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e in intervals)

  mains, epis, hidden, idle = [], [], [], []
  for cta in ctas:
    loops = [spans[cta, w]["mainloop"] for w in (0, 1)]
    for w in (0, 1):
      mains += [e - s for s, e in loops[w]]
      for s, e in spans[cta, w]["epilogue"]:
        epis.append(e - s)
        hidden.append(covered(s, e, loops[1 - w]) / max(e - s, 1.0))
    everything = [iv for w in (0, 1) for region in spans[cta, w].values() for iv in region]
    start, end = min(s for s, _ in everything), max(e for _, e in everything)
    union, reach = 0.0, start   # the length of the main loops' union
    for s, e in sorted(loops[0] + loops[1]):
      union += max(0.0, e - max(s, reach))
      reach = max(reach, e)
    idle.append(1.0 - union / (end - start))
  med = statistics.median
  return (f"{len(ctas)} CTAs; cycles per tile: main loop {med(mains):.0f}, epilogue "
          f"{med(epis):.0f}; epilogue under the other's main loop {100 * med(hidden):.0f}% "
          f"(median); no main loop running {100 * statistics.mean(idle):.1f}% of the time")


def trace_kernels(folder, x, w, b, dy, wt, scale, tiling):
  """Run the forward, a product-only and the backward kernel once each with
  the on-device trace, and summarise each (``overlap_summary``)."""
  cases = {
      "dense_gelu (g, gelu')": dict(a=x, b=w, bias=b, num_out=2,
                                    epilogue=hopper_mlp._fwd_epilogue_for(interpret=False)),
      "dense_gelu, h rounded first": dict(a=x, b=w, bias=b, num_out=2,
                                          epilogue=_rounded_h_unfolded),
      "product only": dict(a=x, b=w, num_out=1, epilogue=lambda acc, *_: (acc,)),
      "matmul_scaled (no column sums)": dict(a=dy, b=wt, aux=scale, num_out=1,
                                             epilogue=hopper_mlp._scale_epilogue),
  }
  lines = []
  for i, (name, kw) in enumerate(cases.items()):
    out = os.path.join(folder, f"kernel{i}")
    os.makedirs(out, exist_ok=True)
    fn = jax.jit(lambda kw=kw, out=out: hopper_gemm.gemm(tiling=tiling, trace_dir=out, **kw))
    jax.block_until_ready(fn())
    jax.effects_barrier()
    files = sorted(glob.glob(os.path.join(out, "*-trace.json")))
    lines.append(f"trace, {name}: " + (overlap_summary(files[-1]) if files else "no trace written"))
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shape", default="L/16:256", help="model:batch, model from "
                      f"{', '.join(SHAPES)}")
  parser.add_argument("--study", action="store_true",
                      help="also time the kernel with simpler epilogues (what each part costs)")
  parser.add_argument("--study_reference", action="store_true",
                      help="with --study: also time jax's hopper_matmul_mgpu example (27 configs)")
  parser.add_argument("--trace", default="",
                      help="also record the kernels' main loops and epilogues on the device "
                      "(per warpgroup) into this folder and summarise how they overlap")
  parser.add_argument("--profile", default="",
                      help="also trace both MLP versions into this folder and print their kernels")
  parser.add_argument("--tilings", default="128x128x64x2,128x128x32x4",
                      help="comma list of MxNxKxSTAGES")
  args = parser.parse_args()
  if args.profile:
    import profile_step
    profile_step.show_each_kernel()
  model, batch = args.shape.split(":")
  tokens, d, f = SHAPES[model]
  m = tokens * int(batch)
  tilings = [parse_tiling(t) for t in args.tilings.split(",")]
  bf = jnp.bfloat16
  ks = jax.random.split(jax.random.key(0), 8)
  x = jax.random.normal(ks[0], (m, d), bf)
  w1 = jax.random.normal(ks[1], (d, f), jnp.float32) * d ** -0.5
  b1 = jax.random.normal(ks[2], (f,), jnp.float32) * 0.1
  w2 = jax.random.normal(ks[3], (f, d), jnp.float32) * f ** -0.5
  b2 = jax.random.normal(ks[4], (d,), jnp.float32) * 0.1
  dy = jax.random.normal(ks[5], (m, d), bf)
  w1b, w2tb = w1.astype(bf), w2.T.astype(bf)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {model} MLP, "
        f"rows {m} ({batch} x {tokens}), {d} -> {f} -> {d}")

  @jax.jit
  def xla_fwd(x, w, b):
    h = jnp.dot(x, w) + b.astype(bf)
    return h, ops.gelu(h)

  @jax.jit
  def xla_bwd(dy, wt, h):
    return ops._gelu_bwd(h, jnp.dot(dy, wt))[0]

  h_ref, g_ref = xla_fwd(x, w1b, b1)
  dg_ref = jax.jit(lambda h: ops._gelu_bwd(h, jnp.ones_like(h))[0])(h_ref)
  dh_ref = xla_bwd(dy, w2tb, h_ref)
  fgemm = 2 * m * d * f
  rows = [("cuBLAS x @ w1", timed(jax.jit(jnp.dot), x, w1b), "")]   # (name, seconds, note[, GEMMs])

  def kernel_row(name, fn, args, check):
    try:
      out = fn(*args)
      rows.append((name, timed(fn, *args), check(out)))
    except Exception as e:  # noqa: BLE001  (a tiling that does not fit is reported)
      rows.append((name, float("nan"), f"failed: {str(e).splitlines()[0][:120]}"))

  rows.append(("XLA fc1 + bias + GELU (h, g)", timed(xla_fwd, x, w1b, b1), ""))
  def check_g(o):
    return f"g {rel_err(o[0], g_ref):.1e}, gelu' {rel_err(o[1], dg_ref):.1e}"

  def forward_with(epilogue):   # the forward kernel with another epilogue, first tiling
    return jax.jit(lambda x, w, b: hopper_gemm.gemm(x, w, bias=b, epilogue=epilogue,
                                                    num_out=2, tiling=tilings[0]))

  for t in tilings:
    kernel_row(f"dense_gelu -> (g, gelu'(h)) {t}",
               jax.jit(lambda x, w, b, t=t: hopper_mlp.dense_gelu(x, w, b, tiling=t)),
               (x, w1b, b1), check_g)
  kernel_row(f"dense_gelu with Mosaic's rsqrt (not flush-to-zero) {tilings[0]}",
             forward_with(hopper_mlp._fwd_epilogue), (x, w1b, b1), check_g)
  kernel_row(f"h rounded first, constants unfolded {tilings[0]}",
             forward_with(_rounded_h_unfolded), (x, w1b, b1), check_g)
  kernel_row(f"keeping h -> (h, g) {tilings[0]}", forward_with(_h_and_gelu), (x, w1b, b1),
             lambda o: f"h {rel_err(o[0], h_ref):.1e}, g {rel_err(o[1], g_ref):.1e}")
  rows.append(("XLA dy @ w2^T, GELU backward", timed(xla_bwd, dy, w2tb, h_ref), ""))
  for t in tilings:
    kernel_row(f"matmul_scaled by gelu'(h) {t}",
               jax.jit(lambda dy, wt, s, t=t: hopper_mlp.matmul_scaled(dy, wt, s, tiling=t)),
               (dy, w2tb, dg_ref.astype(bf)), lambda o: f"dh {rel_err(o, dh_ref):.1e}")
  t0 = tilings[0]
  db1_ref = jnp.sum(dh_ref.astype(jnp.float32), axis=0)
  kernel_row(f"matmul_scaled, then XLA's bias-gradient sum {t0}",
             jax.jit(lambda dy, wt, s: (lambda dh: (dh, jnp.sum(dh.astype(jnp.float32), 0)))(
                 hopper_mlp.matmul_scaled(dy, wt, s, tiling=t0))),
             (dy, w2tb, dg_ref.astype(bf)), lambda o: f"db1 {rel_err(o[1], db1_ref):.1e}")
  kernel_row(f"matmul_scaled, col_sums=True (the sum in the kernel) {t0}",
             jax.jit(lambda dy, wt, s: hopper_mlp.matmul_scaled(dy, wt, s, col_sums=True,
                                                                tiling=t0)),
             (dy, w2tb, dg_ref.astype(bf)),
             lambda o: f"dh {rel_err(o[0], dh_ref):.1e}, db1 {rel_err(o[1], db1_ref):.1e}")
  kernel_row(f"dgelu from h in the epilogue {tilings[0]}",
             jax.jit(lambda dy, wt, h: hopper_gemm.gemm(dy, wt, aux=h, epilogue=_times_gelu_grad,
                                                        num_out=1, tiling=tilings[0])[0]),
             (dy, w2tb, h_ref), lambda o: f"dh {rel_err(o, dh_ref):.1e}")

  if args.trace:
    for line in trace_kernels(args.trace, x, w1b, b1, dy, w2tb, dg_ref.astype(bf), tilings[0]):
      print(line, flush=True)
  if args.study:
    rows += epilogue_study(x, w1b, b1, h_ref, tilings[0], args.study_reference)

  mlp_xla = layers.Mlp(f, dtype=bf)
  params = {"fc1": {"kernel": w1, "bias": b1}, "fc2": {"kernel": w2, "bias": b2}}

  def loss_xla(p, x):
    with ops.using(mlp="xla"):   # the model's MLP on XLA's ops, whatever was configured
      y = mlp_xla.apply({"params": p}, x)
    return jnp.vdot(y.astype(jnp.float32), dy.astype(jnp.float32))

  def loss_kernel(p, x, kernels):
    y = hopper_mlp.mlp(x, p["fc1"]["kernel"], p["fc1"]["bias"], p["fc2"]["kernel"],
                       p["fc2"]["bias"], kernels, False)
    return jnp.vdot(y.astype(jnp.float32), dy.astype(jnp.float32))

  g_xla = jax.jit(jax.grad(loss_xla, argnums=(0, 1)))
  ref = g_xla(params, x)
  rows.append(("MLP fwd+bwd, models.layers.Mlp (XLA)", timed(g_xla, params, x), "", 6))
  graphs = {"xla": g_xla}
  for name, kernels in {"kernels": hopper_mlp.DEFAULT_KERNELS}.items():
    g_k = jax.jit(jax.grad(lambda p, x, k=kernels: loss_kernel(p, x, k), argnums=(0, 1)))
    graphs[name] = g_k
    try:
      out = g_k(params, x)
      errs = jax.tree.map(rel_err, out, ref)
      worst = max(jax.tree.leaves(errs))
      rows.append((f"MLP fwd+bwd, hopper_mlp.mlp, {name}", timed(g_k, params, x),
                   f"worst gradient {worst:.1e}", 6))
    except Exception as e:  # noqa: BLE001
      rows.append((f"MLP fwd+bwd, {name}", float("nan"),
                   f"failed: {str(e).splitlines()[0][:120]}"))

  if args.profile:
    import profile_step
    for name, fn in graphs.items():
      trace = os.path.join(args.profile, name)
      jax.block_until_ready(fn(params, x))
      with jax.profiler.trace(trace):
        for _ in range(3):
          out = fn(params, x)
        jax.block_until_ready(out)
      hlo = fn.lower(params, x).compile().as_text()
      print(f"### kernels of the MLP fwd+bwd, {name} (per call)")
      print(profile_step.kernel_table(trace, 3, hlo, top=14))

  print("| computation | ms | matmul TFLOP/s | check (relative error vs XLA) |")
  print("|---|---|---|---|")
  for name, sec, note, *gemms in rows:   # the MLP rows do 6 products of x @ w1's size
    flops = fgemm * (gemms[0] if gemms else 1)
    print(f"| {name} | {sec * 1e3:.3f} | {flops / sec / 1e12:.0f} | {note} |", flush=True)


if __name__ == "__main__":
  main()
