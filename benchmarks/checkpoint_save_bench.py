"""How long a checkpoint at the preemption point takes: the state saved and committed.

    python benchmarks/checkpoint_save_bench.py                        # ViT-H/14 diffusion
    python benchmarks/checkpoint_save_bench.py --config=tests/tiny_config.py --repeats=2

Builds a config's training state on the device as the train loop does
(``loop.setup``, the state initialised under jit on its shardings; nothing
is trained), by default experiments/vit_h14_diff.py's: ViT-H/14 with its
diffusion decoder, 632M parameters, AdamW's two moments and an EMA of the
parameters (``--ema_decay``, 0.9999 as MAR keeps; the experiment file sets
none), then saves it ``--repeats`` times through the loop's Checkpointer
with the meta a periodic save writes, each save to its end: ``save``
returns once the arrays are on the host (the part the step waits for), and
``wait`` once Orbax has committed the checkpoint, which is what a
preemption's stop waits for before it exits (darl_jax/preemption.py). The
first save of a process also sets up Orbax's handlers and threads, as a
preemption that comes before any periodic save would.

The saved state's floating arrays are drawn at random first (``--state
random``, the default): a fresh state's optimizer moments are zeros, which
the checkpoint's compression writes as almost nothing (2.4 of 10.45 GB at
H/14), while a run preempted mid-training writes all of them.
``--state=fresh`` saves the initialised state as it is.

Prints one row per save: the state's size, the bytes on disk, the seconds
until ``save`` returned and until the commit, and the write rate; compare
the commit time with ``preemption_deadline_s`` (25 s by default). The data
is ``synthetic`` (no dataset, no TensorFlow; ``--data=config`` keeps the
config's). Arguments after ``--`` are config overrides
(``--config.model.dtype=float32``). The checkpoints go to ``--workdir``
(default: a temporary folder on local disk, removed at the end).
"""

from __future__ import annotations

import argparse
import ast
import os
import runpy
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import functools  # noqa: E402  pylint: disable=g-import-not-at-top

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from darl_jax import checkpoint as checkpoint_lib  # noqa: E402
from darl_jax import config_lib  # noqa: E402
from darl_jax.train import loop  # noqa: E402
from darl_jax.train import trainers  # noqa: E402

GB = 1e9


def load_config(spec: str, overrides: list[str], data: str, ema_decay: float):
  """``path[:arg]`` -> its config with ``--config.a.b=value`` overrides."""
  path, _, arg = spec.partition(":")
  config = runpy.run_path(os.path.join(ROOT, path) if not os.path.isabs(path) else path)[
      "get_config"](arg or None)
  if data == "synthetic":
    config.data.name = "synthetic"
  config.ema_decay = ema_decay
  for item in overrides:
    if not item.startswith("--config.") or "=" not in item:
      raise SystemExit(f"error: overrides after -- look like --config.a.b=value, got {item!r}")
    dotted, value = item[len("--config."):].split("=", 1)
    parent, key = config_lib.config_node(config, dotted)
    try:
      parent[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      parent[key] = value
  config_lib.validate(config)
  return config


def tree_bytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes"))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw(key, shape, dtype, sharding):
  return jax.lax.with_sharding_constraint(jax.random.normal(key, shape, dtype), sharding)


def randomized(state: dict, seed: int = 0) -> dict:
  """``state`` with every floating array drawn from a normal, on its own
  sharding (one small program per shape, not one for the whole state)."""
  leaves, treedef = jax.tree_util.tree_flatten(state)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  out = []
  for key, x in zip(keys, leaves):
    if jnp.issubdtype(x.dtype, jnp.floating):
      x = _draw(key, x.shape, x.dtype, x.sharding)
    out.append(x)
  return jax.block_until_ready(treedef.unflatten(out))


def disk_bytes(path: str) -> int:
  total = 0
  for folder, _, files in os.walk(path):
    total += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
  return total


def main(argv=None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  overrides = argv[argv.index("--") + 1:] if "--" in argv else []
  own = argv[:argv.index("--")] if "--" in argv else argv
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="experiments/vit_h14_diff.py")
  parser.add_argument("--ema_decay", type=float, default=0.9999,
                      help="an EMA of the parameters in the state (0: none)")
  parser.add_argument("--data", default="synthetic", choices=("synthetic", "config"))
  parser.add_argument("--state", default="random", choices=("random", "fresh"),
                      help="random: floating arrays drawn at random, as a trained state "
                           "compresses; fresh: the initialised state (zero moments)")
  parser.add_argument("--repeats", type=int, default=3, help="saves, one after the other")
  parser.add_argument("--workdir", default=None,
                      help="where the checkpoints go (default: a temporary folder, removed)")
  args = parser.parse_args(own)
  config = load_config(args.config, overrides, args.data, args.ema_decay)

  workdir = args.workdir or tempfile.mkdtemp(prefix="darl_ckpt_bench_")
  trainer = trainers.get_trainer(config.trainer)(config)
  started = time.perf_counter()
  built = loop.setup(trainer, config, workdir=None)
  state = jax.block_until_ready(built.init_state())
  if args.state == "random":
    state = randomized(state)
  params = sum(x.size for x in jax.tree_util.tree_leaves(state["params"]))
  print(f"{args.config} ({config.model.variant}): {params / 1e6:.0f}M parameters, state "
        f"{tree_bytes(state) / GB:.2f} GB ({', '.join(sorted(state))}) on "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s), built in "
        f"{time.perf_counter() - started:.1f} s, {args.state} values")
  print(f"checkpoints in {workdir}")
  print("| save | state GB | written GB | save returned s | committed s | GB/s |")
  print("|------|----------|------------|-----------------|-------------|------|")
  committed = []
  try:
    with checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                     max_to_keep=args.repeats + 1) as ckpt:
      for i in range(1, args.repeats + 1):
        meta = {**config_lib.checkpoint_meta(config, i), "data_state": None,
                "log_window": None}
        start = time.perf_counter()
        ckpt.save(i, state, meta)
        returned = time.perf_counter() - start
        ckpt.wait()
        done = time.perf_counter() - start
        committed.append(done)
        written = disk_bytes(os.path.join(workdir, "checkpoints", str(i)))
        print(f"| {i}{' (first)' if i == 1 else ''} | {tree_bytes(state) / GB:.3g} | "
              f"{written / GB:.3g} | {returned:.2f} | {done:.2f} | {written / GB / done:.3g} |",
              flush=True)
  finally:
    if args.workdir is None:
      shutil.rmtree(workdir, ignore_errors=True)
  later = committed[1:] or committed
  print(f"committed in {statistics.median(later):.2f} s (median after the first; first "
        f"{committed[0]:.2f} s); preemption_deadline_s is {config.preemption_deadline_s:g}")
  print(f"tensorflow imported: {'yes' if 'tensorflow' in sys.modules else 'no'}")


if __name__ == "__main__":
  main()
