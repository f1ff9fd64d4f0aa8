"""Profiles a few pretraining steps: a kernel table, and a trace for xprof.

    python benchmarks/profile_step.py --case=L/16:mse:128 --out=/tmp/trace [--set key=value]
    python benchmarks/profile_step.py ... --command_buffers   # as the benchmark runs

Prints the GPU kernels of one step (command buffers off unless
``--command_buffers``, so each kernel is named by its HLO op),
grouped by kind and source op with the 24 or so blocks merged, longest first:
time per step, launches, and for XLA fusions the bytes their operands and
results occupy (from the compiled HLO) with the bandwidth that implies, so
memory-bound kernels that run far under the card's bandwidth stand out (a
fusion that slices its operand reads less than it is counted for). Also
writes the step's compiled HLO (``step.hlo.txt``) and the trace (open with
``xprof --logdir=<out>`` or TensorBoard's profile plugin).

Then where the GPU waits: the step time measured as pretrain_benchmark
does (synchronised after each step) and as a training loop runs it (steps
enqueued back to back, one synchronisation at the end: the host's dispatch
overlaps the previous step), the traced span per step, how much of
it some kernel runs, and the longest idle stretches by the kernels around
them. Kernel time short of the step time is time no optimisation of a
kernel can win back.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pretrain_benchmark as bench  # noqa: E402

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1,
               "u8": 1, "f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")


def show_each_kernel() -> None:
  """Turns XLA's command buffers (CUDA graphs) off, so a trace shows each
  kernel rather than one graph launch per step (the step runs a little
  slower this way). Call before JAX first touches the GPU."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_gpu_enable_command_buffer=").strip()


def _key(name: str) -> str:
  return re.sub(r"[^0-9a-z]", "", name.lower())


def _shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in SHAPE.findall(text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * DTYPE_BYTES[dtype]
  return total


def fusion_bytes(hlo_text: str) -> dict[str, tuple[int, str]]:
  """Per instruction of the entry computation: (bytes read + written, i.e. its
  result's size plus its operands', looked up by name; its source op name)."""
  entry = hlo_text[hlo_text.find("ENTRY"):]
  result, operands, source = {}, {}, {}
  for line in entry.splitlines()[1:]:
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*?)\)(?:, |$)", line)
    if not m:
      continue
    name, shape, _, args = m.groups()
    result[name] = _shape_bytes(shape)
    operands[name] = re.findall(r"%([\w.\-]+)", args)
    op = re.search(r'op_name="([^"]*)"', line)
    source[name] = op.group(1) if op else ""
  return {_key(n): (result[n] + sum(result.get(a, 0) for a in operands[n]), source[n])
          for n in result}


def _group(op: str, source: str) -> str:
  """Kernels of the same kind at the same place of every block share a row."""
  base = re.sub(r"[.\d]+$", "", op)
  where = re.sub(r"block_\d+", "block_*", re.sub(r"^jit\([^)]*\)/", "", source))
  return f"{base} @ {where}" if where else base


def gpu_kernels(trace_dir: str):
  """The GPU kernel events of the newest perfetto trace under ``trace_dir``:
  (start us, duration us, HLO op, kernel name), in start order."""
  files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise FileNotFoundError(f"no perfetto trace under {trace_dir}")
  events = json.load(gzip.open(max(files, key=os.path.getmtime)))["traceEvents"]
  pids = {e["pid"]: e["args"]["name"] for e in events
          if e.get("ph") == "M" and e.get("name") == "process_name"}
  found = []
  for e in events:
    if e.get("ph") != "X" or "GPU" not in pids.get(e["pid"], ""):
      continue
    op = (e.get("args") or {}).get("hlo_op") or e["name"]
    if op.startswith("command_buffer"):
      # run from a CUDA graph: the op is the graph's, so name it by its kernel
      op = "[graph] " + e["name"]
    found.append((e["ts"], e["dur"], op, e["name"]))
  return sorted(found)


def _per_op(kernels):
  """(total microseconds, launches, kernel name) per HLO op of ``kernels``."""
  total, count, names = collections.Counter(), collections.Counter(), {}
  for _, dur, op, name in kernels:
    total[op] += dur
    count[op] += 1
    names[op] = name
  return total, count, names


def gpu_kernel_times(trace_dir: str):
  """(total microseconds, launches, kernel name) per HLO op from a perfetto trace."""
  return _per_op(gpu_kernels(trace_dir))


def idle_table(kernels, steps: int, sources: dict, top: int = 10) -> str:
  """Where the GPU waits: the traced span (first kernel start to last kernel
  end) against the time some kernel runs, and the longest idle stretches
  between kernels, grouped by the kernels on either side (blocks merged).
  Idle time inside a step means the host did not enqueue work fast enough
  (many short kernels, host callbacks, synchronisations)."""
  if not kernels:
    return "no GPU kernels in the trace"
  start = kernels[0][0]
  end = busy = 0.0
  cursor = start
  gaps = collections.defaultdict(lambda: [0.0, 0])
  previous = None
  for ts, dur, op, _ in kernels:
    group = _group(op, sources.get(_key(op), (0, ""))[1])
    if ts > cursor and previous is not None:
      g = gaps[(previous, group)]
      g[0] += ts - cursor
      g[1] += 1
    busy += max(0.0, ts + dur - max(ts, cursor))
    cursor = max(cursor, ts + dur)
    end = max(end, ts + dur)
    previous = group
  span = end - start
  lines = [f"traced span per step: {span / steps / 1e3:.1f} ms, some kernel running "
           f"{busy / steps / 1e3:.1f} ms, idle {(span - busy) / steps / 1e3:.1f} ms "
           f"({(span - busy) / span:.1%})", "",
           "| idle between (after -> before) | ms/step | gaps/step |", "|---|---|---|"]
  for (a, b), (us, n) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]:
    lines.append(f"| {a[:70]} -> {b[:70]} | {us / steps / 1e3:.3f} | {n / steps:.0f} |")
  return "\n".join(lines)


def kernel_table(trace_dir: str, steps: int, hlo_text: str, top: int = 40) -> str:
  return _kernel_rows(gpu_kernels(trace_dir), steps, fusion_bytes(hlo_text), top)


def _kernel_rows(kernels, steps: int, info: dict, top: int) -> str:
  """kernel_table from loaded kernels and fusion_bytes' ``info``."""
  total, count, names = _per_op(kernels)
  if not total:
    return "no GPU kernels in the trace (not a GPU run?)"
  steps_total = sum(total.values())
  groups = collections.defaultdict(lambda: [0.0, 0, 0])   # us, launches, bytes
  kinds = collections.Counter()
  for op, us in total.items():
    nbytes, source = info.get(_key(op), (0, ""))
    g = groups[_group(op, source)]
    g[0] += us
    g[1] += count[op]
    g[2] += nbytes * count[op]
    kind = ("attention" if re.search(r"cudnn|fmha|flash|dot_product_attention", op + names[op], re.I)
            else "gemm" if re.search(r"gemm|cublas|nvjet|custom-call", op + names[op], re.I)
            else "fusion/other")
    kinds[kind] += us
  lines = [f"GPU kernel time per step: {steps_total / steps / 1e3:.1f} ms"]
  for kind, us in kinds.most_common():
    lines.append(f"  {kind}: {us / steps / 1e3:.1f} ms/step ({us / steps_total:.0%})")
  lines += ["", "| kernel @ source op (blocks merged) | ms/step | share | launches/step "
            "| MB/launch | GB/s |", "|---|---|---|---|---|---|"]
  for key, (us, n, nbytes) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
    mb = f"{nbytes / n / 1e6:.1f}" if nbytes else "-"
    bw = f"{nbytes / (us * 1e-6) / 1e9:.0f}" if nbytes else "-"
    lines.append(f"| {key[:150]} | {us / steps / 1e3:.3f} | {us / steps_total:.1%} | "
                 f"{n / steps:.0f} | {mb} | {bw} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--case", default="L/16:mse:128")
  parser.add_argument("--out", required=True)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--top", type=int, default=40)
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument("--command_buffers", action="store_true",
                      help="keep XLA's command buffers on, as the benchmark runs (kernels "
                           "inside a graph are then named by kernel, not by HLO op)")
  args = parser.parse_args()
  if not args.command_buffers:
    show_each_kernel()
  variant, objective, batch = args.case.split(":")
  config = bench.build(variant, objective, int(batch), args.set)
  _, state, step, hyper = bench.make_step(config)
  size = config.model.image_size
  x = {"image": jax.random.uniform(jax.random.PRNGKey(1), (int(batch), size, size, 3),
                                   jnp.float32, -1, 1),
       "label": jnp.zeros((int(batch),), jnp.int32)}
  compiled = step.lower(state, x, hyper(0)).compile()
  run_step = bench.with_hyper(compiled, hyper)
  hlo = compiled.as_text()
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "step.hlo.txt"), "w") as f:
    f.write(hlo)
  # warm-up, then the step time as pretrain_benchmark measures it (synchronised
  # after each step), to set against the kernel time and the traced span
  state, times, _ = bench.time_steps(run_step, state, [x], 3, max(5, args.steps))
  state, pipelined = bench.time_pipelined(run_step, state, [x], max(10, args.steps))
  jax.profiler.start_trace(args.out, create_perfetto_trace=True)
  for _ in range(args.steps):
    state, m = run_step(state, x)
  jax.block_until_ready(m["loss"])
  jax.profiler.stop_trace()
  buffers = "on" if args.command_buffers else "off"
  print(f"step time (command buffers {buffers}): synchronised each step "
        f"{1e3 * float(np.median(times)):.1f} ms, enqueued back to back "
        f"{1e3 * pipelined:.1f} ms")
  kernels, info = gpu_kernels(args.out), fusion_bytes(hlo)    # each read once
  print(_kernel_rows(kernels, args.steps, info, args.top))
  print()
  print(idle_table(kernels, args.steps, info))
  print("trace and step.hlo.txt written to", args.out)


if __name__ == "__main__":
  main()
