"""Data-parallel and FSDP scaling of the real DARL pretraining step on one host.

    python benchmarks/scaling_benchmark.py                         # B/16 diffusion, 64/device
    python benchmarks/scaling_benchmark.py --variant=L/16 --per_device_batch=32 \\
        --modes=dp,fsdp,fsdp_tensor --set kernels.attention=cudnn

In one process, measures img/s of the training step the loop runs
(``loop.setup`` for each mesh: the optax chain of ``darl_jax/optim.py``,
state sharded by ``darl_jax/sharding.py`` and donated, batches on the loop's
batch sharding, the config's kernel choices, ``auto`` by default) on

* 1 device (the baseline; or ``--baseline_img_s``, an earlier run's figure),
  then
* all local devices, once per ``--modes`` entry: ``dp`` (replicated state,
  batch over ``data``), ``fsdp`` (state and batch over ``fsdp``), ``tensor`` /
  ``fsdp_tensor`` (tensor parallelism over 2 devices, the rest as before).

Weak scaling: every device gets ``--per_device_batch`` images, so the global
batch grows with the devices. Efficiency = img/s on N devices / (N x img/s on
1 device). Each measurement: compile, ``--warmup`` steps, then ``--steps``
steps dispatched back to back (as the loop runs them) and timed to the last
result; img/s = steps x global batch / time. Also printed: XLA's per-device
memory of the compiled step (arguments + outputs + temporaries - donated) and
``darl_jax/memory.py``'s estimate for the same mesh.

Random data on the devices, no TensorFlow. On CPU it runs too (e.g.
``XLA_FLAGS=--xla_force_host_platform_device_count=2 ... --variant=mu/4
--image_size=32 --per_device_batch=8``), which only checks that it works.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from darl_jax import config_lib, memory, ops  # noqa: E402
from darl_jax.train import loop  # noqa: E402
from darl_jax.train.trainers import pretrain  # noqa: E402

MODES = {  # mode -> (rules, mesh for n devices)
    "dp": ("replicated", lambda n: {"data": n, "fsdp": 1, "tensor": 1}),
    "fsdp": ("fsdp", lambda n: {"data": 1, "fsdp": n, "tensor": 1}),
    "tensor": ("tensor", lambda n: {"data": n // 2, "fsdp": 1, "tensor": 2}),
    "fsdp_tensor": ("fsdp_tensor", lambda n: {"data": 1, "fsdp": n // 2, "tensor": 2}),
}


def make_config(args):
  config = config_lib.imagenet_pretrain_config(args.variant, args.objective)
  config.model.image_size = args.image_size
  for item in args.set:
    key, value = item.split("=", 1)
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
      node = node[p]
    old = node[leaf]
    node[leaf] = value if isinstance(old, str) else type(old)(json.loads(value))
  return config


def measure(config, devices, mode: str, per_device_batch: int, warmup: int,
            steps: int) -> dict:
  """img/s of the loop's own step (loop.setup) on ``devices`` in ``mode``."""
  n = len(devices)
  rules_name, mesh_of = MODES[mode] if n > 1 else ("replicated", MODES["dp"][1])
  mesh_sizes = mesh_of(n)
  global_batch = per_device_batch * mesh_sizes["data"] * mesh_sizes["fsdp"]
  config = ml_collections.ConfigDict(config.to_dict())
  config.update(batch_size=global_batch, sharding=rules_name)
  config.mesh.update(**mesh_sizes)
  config.data.update(name="synthetic", image_size=config.model.image_size,
                     channels=config.model.channels)
  built = loop.setup(pretrain.PretrainTrainer(config), config, devices=devices)
  batch_sharding = built.batch_sharding
  state = built.init_state()
  size, channels = config.model.image_size, config.model.channels
  batches = []
  for k in jax.random.split(jax.random.PRNGKey(1), 2):
    image = jax.jit(lambda k: jax.random.uniform(k, (global_batch, size, size, channels),
                                                 jnp.float32, -1, 1),
                    out_shardings=batch_sharding)(k)
    label = jax.device_put(np.zeros((global_batch,), np.int32), batch_sharding)
    batches.append({"image": image, "label": label})

  t0 = time.perf_counter()
  compiled = built.train_step.lower(state, batches[0], built.hyper(0)).compile()
  compile_s = time.perf_counter() - t0
  ma = compiled.memory_analysis()
  xla_gib = float("nan")
  if ma is not None:
    xla_gib = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
               - ma.alias_size_in_bytes) / 2**30
  est = memory.estimate(config, mesh_sizes, rules_name, global_batch,
                        params=built.abstract_state["params"])
  remat = config.model.get("remat", "none")

  for i in range(warmup):
    state, metrics = compiled(state, batches[i % 2], built.hyper(i))
  jax.block_until_ready(metrics["loss"])
  t0 = time.perf_counter()
  for i in range(steps):
    state, metrics = compiled(state, batches[i % 2], built.hyper(warmup + i))
  jax.block_until_ready(metrics["loss"])
  seconds = time.perf_counter() - t0
  del state
  return dict(mode=mode if n > 1 else "1 device", devices=n, mesh=mesh_sizes,
              global_batch=global_batch, img_s=steps * global_batch / seconds,
              step_ms=1000 * seconds / steps, compile_s=compile_s, xla_gib=xla_gib,
              estimate_gib=est.total(remat) / 2**30, loss=float(metrics["loss"]))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--variant", default="B/16")
  parser.add_argument("--objective", default="diffusion", choices=("diffusion", "mse"))
  parser.add_argument("--image_size", type=int, default=224)
  parser.add_argument("--per_device_batch", type=int, default=64)
  parser.add_argument("--modes", default="dp,fsdp", help=f"comma list of {', '.join(MODES)}")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--set", action="append", default=[],
                      help="config override key=value, e.g. model.remat=full")
  parser.add_argument("--json", default="", help="also write the rows to this file")
  parser.add_argument("--baseline_img_s", type=float, default=0.0,
                      help="skip the 1-device run and take this img/s (an earlier run's, "
                           "same card and settings) as the baseline: for meshes whose "
                           "compiles do not fit one sitting together with the baseline's")
  args = parser.parse_args(argv)
  if args.baseline_img_s < 0:
    parser.error(f"--baseline_img_s must be positive (or 0 to measure the baseline), "
                 f"got {args.baseline_img_s}")

  devices = jax.local_devices()
  config = make_config(args)
  print(f"jax {jax.__version__}, {len(devices)} x {devices[0].device_kind}; "
        f"{args.variant} {args.objective} {args.image_size}px, {args.per_device_batch} "
        f"images/device, dtype {config.model.dtype}, remat {config.model.remat}; "
        f"{ops.describe(config.kernels, ops.resolve(config.kernels, config.model.dtype))}")
  if args.baseline_img_s:
    rows = [dict(mode="1 device (given)", devices=1, global_batch=args.per_device_batch,
                 img_s=args.baseline_img_s, step_ms=1000 * args.per_device_batch
                 / args.baseline_img_s, compile_s=float("nan"), xla_gib=float("nan"),
                 estimate_gib=float("nan"), loss=float("nan"))]
  else:
    rows = [measure(config, devices[:1], "dp", args.per_device_batch, args.warmup, args.steps)]
  for mode in filter(None, args.modes.split(",")):
    if len(devices) < 2:
      print("only one local device: nothing to scale to")
      break
    if mode.endswith("tensor") and len(devices) % 2:
      print(f"{mode}: needs an even device count, skipped")
      continue
    rows.append(measure(config, devices, mode, args.per_device_batch, args.warmup, args.steps))

  base = rows[0]["img_s"]
  head = (f"{'run':<12} {'devices':>7} {'batch':>6} {'img/s':>9} {'step ms':>8} "
          f"{'efficiency':>10} {'XLA GiB/dev':>11} {'est GiB/dev':>11} {'compile s':>9}")
  print(head)
  print("-" * len(head))
  for r in rows:
    r["efficiency"] = r["img_s"] / (r["devices"] * base)
    print(f"{r['mode']:<12} {r['devices']:>7} {r['global_batch']:>6} {r['img_s']:>9.1f} "
          f"{r['step_ms']:>8.1f} {r['efficiency']:>10.1%} {r['xla_gib']:>11.2f} "
          f"{r['estimate_gib']:>11.2f} {r['compile_s']:>9.1f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1, default=str)
  return rows


if __name__ == "__main__":
  main()
