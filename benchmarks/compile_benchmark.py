"""Compile time, step speed and memory of the pretraining step, unrolled and scanned, in one call.

    python benchmarks/compile_benchmark.py --cases=B/16:diffusion:512,H/14:diffusion:192
    python benchmarks/compile_benchmark.py --cases=L/16:diffusion:256 --forms=unrolled \\
        --set kernels.attention=cudnn --set kernels.mlp=xla --set kernels.norm=xla

For each case and each form (``unrolled``: the blocks as written;
``scanned``: ``model.scan_layers=True``) it builds the loop's own step
(pretrain_benchmark.make_step: ``loop.setup``, the state's initialisation
compiled and run, which is the ``setup`` column), then times the step's
trace, lower and compile separately, XLA's memory figure for it, and the
median of ``--steps`` synchronised steps on one random uint8 batch. Runs
without TensorFlow; overrides as pretrain_benchmark's ``--set``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pretrain_benchmark as bench  # noqa: E402

FORMS = {"unrolled": "false", "scanned": "true"}


def measure(variant: str, objective: str, batch: int, overrides: list[str], steps: int) -> dict:
  """One row: seconds of each phase, ms per step, img/s and compiled GiB."""
  config = bench.build(variant, objective, batch, overrides)
  start = time.perf_counter()
  _, state, step, hyper = bench.make_step(config)
  jax.block_until_ready(state)
  row = {"setup_s": time.perf_counter() - start}
  size, channels = config.model.image_size, config.model.channels
  images = jax.random.randint(jax.random.key(1), (batch, size, size, channels), 0, 256,
                              jnp.int32).astype(jnp.uint8)
  x = {"image": images, "label": jnp.zeros((batch,), jnp.int32)}
  start = time.perf_counter()
  traced = step.trace(state, x, hyper(0))
  row["trace_s"] = time.perf_counter() - start
  start = time.perf_counter()
  lowered = traced.lower()
  row["lower_s"] = time.perf_counter() - start
  start = time.perf_counter()
  compiled = lowered.compile()
  row["compile_s"] = time.perf_counter() - start
  mem = compiled.memory_analysis()
  if mem is not None:
    row["gib"] = (mem.temp_size_in_bytes + mem.argument_size_in_bytes
                  + mem.output_size_in_bytes - mem.alias_size_in_bytes) / 2**30
  _, times, _ = bench.time_steps(bench.with_hyper(compiled, hyper), state, [x], 3, steps)
  row["ms"] = 1e3 * float(np.median(times))
  row["img_s"] = batch / row["ms"] * 1e3
  return row


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", default="B/16:diffusion:512",
                      help="comma list of variant:objective:batch")
  parser.add_argument("--forms", default="unrolled,scanned", help="unrolled, scanned or both")
  parser.add_argument("--steps", type=int, default=15)
  parser.add_argument("--set", action="append", default=[],
                      help="config override key=value, for every row")
  parser.add_argument("--allocator", default="cli", choices=("cli", "bfc"),
                      help="the CLI's GPU pool (cuda_async, 92%%) or XLA's BFC pool (75%%)")
  args = parser.parse_args(argv)
  bench.use_allocator(args.allocator)
  forms = args.forms.split(",")
  unknown = sorted(set(forms) - set(FORMS))
  if unknown:
    parser.error(f"--forms takes {', '.join(FORMS)}; got {', '.join(unknown)}")
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; overrides {args.set}")
  print("| case | form | setup | trace | lower | compile | ms/step | img/s | GiB |")
  print("|---|---|---|---|---|---|---|---|---|")
  rows = []
  for case in args.cases.split(","):
    variant, objective, batch = case.split(":")
    for form in forms:
      row = measure(variant, objective, int(batch),
                    args.set + [f"model.scan_layers={FORMS[form]}"], args.steps)
      rows.append({"case": case, "form": form, **row})
      print(f"| {case} | {form} | {row['setup_s']:.1f} s | {row['trace_s']:.1f} s | "
            f"{row['lower_s']:.1f} s | {row['compile_s']:.1f} s | {row['ms']:.1f} | "
            f"{row['img_s']:.0f} | {row.get('gib', float('nan')):.2f} |", flush=True)
  return rows


if __name__ == "__main__":
  main()
