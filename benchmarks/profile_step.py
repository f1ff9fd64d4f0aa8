"""Captures a jax.profiler trace of a few pretraining steps (for xprof / TensorBoard).

    python benchmarks/profile_step.py --case=L/16:mse:128 --out=/tmp/trace [--set key=value]

Open the trace with xprof (``xprof --logdir=/tmp/trace``) or TensorBoard's
profile plugin; the HLO op profile shows where a step's time goes.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pretrain_benchmark as bench  # noqa: E402


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--case", default="L/16:mse:128")
  parser.add_argument("--out", required=True)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--set", action="append", default=[])
  args = parser.parse_args()
  variant, objective, batch = args.case.split(":")
  config = bench.build(variant, objective, int(batch), args.set)
  _, state, step = bench.make_step(config)
  size = config.model.image_size
  x = {"image": jax.random.uniform(jax.random.PRNGKey(1), (int(batch), size, size, 3),
                                   jnp.float32, -1, 1),
       "label": jnp.zeros((int(batch),), jnp.int32)}
  for _ in range(3):
    state, m = step(state, x)
  jax.block_until_ready(m["loss"])
  with jax.profiler.trace(args.out):
    for _ in range(args.steps):
      state, m = step(state, x)
    jax.block_until_ready(m["loss"])
  print("trace written to", args.out)


if __name__ == "__main__":
  main()
