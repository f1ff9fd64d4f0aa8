"""XLA's attention against JAX's Pallas TPU flash attention, compiled for a TPU
chip on this CPU host (no TPU needed; libtpu must be importable).

    PYTHONPATH=/tmp/libtpu python benchmarks/tpu_attention_bench.py \\
        [--topologies=v5p:2x2x1,v5e:2x2] [--shapes=L16,H14] [--json=out.jsonl]

For each topology (one chip of it: the op is per chip, the batch split over
data parallelism) and each shape, the attention op alone, forward and
backward (``jax.vjp`` of the output against a given cotangent: dq, dk, dv),
bf16, causal, is compiled two ways:

- ``xla``: ``darl_jax.ops.attention`` under ``kernels.attention=xla``
  (``jax.nn.dot_product_attention``'s XLA path), inputs ``[B, T, H, D]``.
- ``pallas_tpu``: ``jax.experimental.pallas.ops.tpu.flash_attention``
  (layout ``[B, H, T, D]``, ``causal=True``, ``sm_scale=D**-0.5``, its
  default 128 x 128 blocks, ``--block`` for others). Its blocks must divide
  T and be multiples of 128, so T is padded with zeros at the end to a
  multiple of the block (at 128: 196, 197 -> 256; 256 -> 256;
  257 -> 384): with causal attention no real query sees a padded key, and
  the padded rows' outputs are sliced off (their cotangent is zero, so they
  add nothing to dk, dv). The transposes and the pad are included, since
  the model's q, k, v come as ``[B, T, H, D]``.
- ``pallas_kernel`` (not by default): the kernel alone on inputs already
  ``[B, H, T padded, D]``, to separate the kernel from the layout change.

Printed per row: compiled memory (``memory_analysis``: temporaries,
arguments, and their sum), XLA's cost analysis (``flops``, ``bytes
accessed``, ``optimal_seconds``) and the roofline ``max(flops / peak, bytes
/ bandwidth)`` from darl_jax/compile.py's PEAK_BF16 / HBM_BANDWIDTH tables,
and the same for the forward alone. Caveat: XLA's cost model does not look
inside a Pallas (Mosaic) custom call. The forward kernel declares a
``pl.CostEstimate`` (the reference attention's flops, its inputs' and
outputs' bytes) that XLA adds in; the backward kernels (dkv, dq) declare
none, so their flops and bytes count as 0 and the fwd+bwd cost of
``pallas_tpu`` is an undercount: compare fwd+bwd by memory only.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from darl_jax import compile as compile_lib  # noqa: E402  (sets TPU_SKIP_MDS_QUERY first)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from darl_jax import ops  # noqa: E402

MIB = 2.0 ** 20
# name -> (per-chip batch, heads, head dim, token counts)
SHAPES = {"L16": (64, 16, 64, (196, 197, 256, 257)),
          "H14": (16, 16, 80, (196, 197, 256, 257))}


def xla_attention(q, k, v):
  with ops.using(attention="xla"):
    return ops.attention(q, k, v, causal=True)


def pallas_tpu_attention(q, k, v, block: int = 128):
  """Flash attention of ``[B, T, H, D]`` inputs, T padded to ``block``."""
  from jax.experimental.pallas.ops.tpu import flash_attention as fa
  t, d = q.shape[1], q.shape[-1]
  pad = -t % block
  def prep(x):
    x = jnp.swapaxes(x, 1, 2)                                      # [B, H, T, D]
    return jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else x
  sizes = fa.BlockSizes(block_q=block, block_k_major=block, block_k=block, block_b=1,
                        block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block,
                        block_q_dkv=block, block_k_major_dq=block, block_k_dq=block,
                        block_q_dq=block)
  out = fa.flash_attention(prep(q), prep(k), prep(v), causal=True, sm_scale=d ** -0.5,
                           block_sizes=sizes)
  return jnp.swapaxes(out[:, :, :t], 1, 2)


def pallas_tpu_kernel(q, k, v, block: int = 128):
  """The kernel alone on ``[B, H, T, D]`` inputs already padded (no
  transpose, no pad: what it would cost if the model made that layout)."""
  from jax.experimental.pallas.ops.tpu import flash_attention as fa
  sizes = fa.BlockSizes(block_q=block, block_k_major=block, block_k=block, block_b=1,
                        block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block,
                        block_q_dkv=block, block_k_major_dq=block, block_k_dq=block,
                        block_q_dq=block)
  return fa.flash_attention(q, k, v, causal=True, sm_scale=q.shape[-1] ** -0.5,
                            block_sizes=sizes)


IMPLS = {"xla": xla_attention, "pallas_tpu": pallas_tpu_attention,
         "pallas_kernel": pallas_tpu_kernel}


def fwd_bwd(impl):
  def step(q, k, v, g):
    out, vjp = jax.vjp(impl, q, k, v)
    return (out, *vjp(g))
  return step


def measure(fn, args, device) -> dict:
  sharding = jax.sharding.SingleDeviceSharding(device)
  compiled = jax.jit(fn, in_shardings=sharding, out_shardings=sharding).lower(*args).compile()
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  peak = compile_lib.PEAK_BF16.get(device.device_kind)
  bandwidth = compile_lib.HBM_BANDWIDTH.get(device.device_kind)
  flops, nbytes = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
  roofline = max(flops / peak, nbytes / bandwidth) if peak and bandwidth else None
  return {"temp_mib": m.temp_size_in_bytes / MIB, "args_mib": m.argument_size_in_bytes / MIB,
          "mem_mib": (m.temp_size_in_bytes + m.argument_size_in_bytes) / MIB,
          "flops": flops, "bytes": nbytes,
          "optimal_seconds": float(cost.get("optimal_seconds", float("nan"))),
          "roofline_us": None if roofline is None else roofline * 1e6}


def run(topology: str, shape: str, t: int, impl: str, block: int = 128) -> dict:
  device = compile_lib.topology_devices(topology)[0]
  b, h, d, _ = SHAPES[shape]
  x = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  if impl == "pallas_kernel":
    x = jax.ShapeDtypeStruct((b, h, t + -t % block, d), jnp.bfloat16)
  row = {"topology": topology, "device_kind": device.device_kind, "shape": shape,
         "B": b, "T": t, "H": h, "D": d, "impl": impl}
  fn = IMPLS[impl]
  if impl != "xla":
    row["block"] = block
    fn = functools.partial(fn, block=block)
  try:
    row["fwd_bwd"] = measure(fwd_bwd(fn), (x, x, x, x), device)
    row["fwd"] = measure(fn, (x, x, x), device)
  except Exception as e:  # pylint: disable=broad-except
    row["error"] = " ".join(str(e).split())[:300]
  return row


def line(row: dict) -> str:
  head = (f"{row['topology']:9s} {row['shape']} B={row['B']:3d} T={row['T']} "
          f"{row['H']}x{row['D']} {row['impl'] + '/' + str(row.get('block', '')):14s}")
  if "error" in row:
    return head + " error: " + row["error"]
  fb, f = row["fwd_bwd"], row["fwd"]
  roof = lambda r: "n/a" if r["roofline_us"] is None else f"{r['roofline_us']:8.1f}"
  return (head + f" fwd+bwd: temp {fb['temp_mib']:7.1f} + args {fb['args_mib']:6.1f} = "
          f"{fb['mem_mib']:7.1f} MiB, {fb['flops'] / 1e9:7.2f} GFLOP, "
          f"{fb['bytes'] / MIB:7.1f} MiB acc, opt {fb['optimal_seconds'] * 1e6:8.1f} us, "
          f"roof {roof(fb)} us | fwd: temp {f['temp_mib']:6.1f} MiB, "
          f"{f['flops'] / 1e9:6.2f} GFLOP, {f['bytes'] / MIB:6.1f} MiB acc, "
          f"opt {f['optimal_seconds'] * 1e6:7.1f} us, roof {roof(f)} us")


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--topologies", default="v5p:2x2x1,v5e:2x2")
  p.add_argument("--shapes", default="L16,H14")
  p.add_argument("--tokens", default="", help="comma list; default 196,197,256,257")
  p.add_argument("--impls", default="xla,pallas_tpu")
  p.add_argument("--block", type=int, default=128,
                 help="Pallas block size (multiple of 128; T is padded to it)")
  p.add_argument("--json", default="")
  a = p.parse_args()
  for topology in a.topologies.split(","):
    for shape in a.shapes.split(","):
      tokens = [int(t) for t in a.tokens.split(",")] if a.tokens else SHAPES[shape][3]
      for t in tokens:
        for impl in a.impls.split(","):
          row = run(topology, shape, t, impl, a.block)
          print(line(row), flush=True)
          if a.json:
            with open(a.json, "a") as out:
              out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main()
