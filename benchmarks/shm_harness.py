"""Shared-memory leak harness: many short CLI runs in a row, some SIGKILLed (issue 47).

    python benchmarks/shm_harness.py [--runs=50] [--kill_every=3] [--workers=2] [--steps=6]

Generates a tar-shard dataset (2 classes of 8x8 RGB PNGs, written with
``python -m darl_jax.data.convert``'s converter), then runs
``python -m darl_jax.main --config=tests/tiny_config.py`` on it ``--runs``
times, each in a new workdir with ``data.num_workers=--workers``; every
``--kill_every``-th run is SIGKILLed as soon as its first checkpoint is on
disk (the workers and Python's resource tracker outlive the parent for a
moment). Each run's stderr is read to its end (the resource tracker writes
to the same pipe), so a warning printed after the parent's death still counts.

Reports, once the runs are over and orphaned workers had ``--settle`` seconds
to exit: the /dev/shm entries that appeared during the harness and are still
there (another job on the host may own some: their names are listed), and
every run whose stderr had ``leaked shared_memory``. Exits 1 if either is
non-empty.
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHM = pathlib.Path("/dev/shm")
LEAK = "leaked shared_memory"


def shm_entries() -> set[str]:
  try:
    return set(os.listdir(SHM))
  except FileNotFoundError:
    return set()


def make_shards(root: pathlib.Path, per_class: int) -> str:
  import numpy as np
  from PIL import Image
  from darl_jax.data import convert
  rng = np.random.default_rng(0)
  for cls in ("cat", "dog"):
    os.makedirs(root / "folder" / cls)
    for i in range(per_class):
      buf = io.BytesIO()
      Image.fromarray(rng.integers(0, 255, (8, 8, 3), np.uint8)).save(buf, "PNG")
      (root / "folder" / cls / f"{i:03d}.png").write_bytes(buf.getvalue())
  paths = convert.convert(str(root / "folder"), str(root / "shards"), "tar",
                          shard_size=per_class)
  n = len(paths["train"])
  return f"{root}/shards/train-{{000000..{n - 1:06d}}}.tar"


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--runs", type=int, default=50)
  ap.add_argument("--kill_every", type=int, default=3, help="SIGKILL every k-th run (0: none)")
  ap.add_argument("--workers", type=int, default=2, help="data.num_workers")
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument("--per_class", type=int, default=32)
  ap.add_argument("--settle", type=float, default=10.0,
                  help="seconds to let orphaned workers exit before the last /dev/shm look")
  args = ap.parse_args()

  tmp = pathlib.Path(tempfile.mkdtemp(prefix="shm_harness_"))
  path = make_shards(tmp, args.per_class)
  # The compiled-step cache off: each run traces and compiles, as a fresh
  # program would (and a stale saved executable cannot fail the runs).
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             DARL_COMPILED_STEP_CACHE="0")
  overrides = [
      "--config.data.name=webdataset", f"--config.data.path={path}",
      "--config.data.channels=3", "--config.model.channels=3",
      f"--config.data.num_workers={args.workers}", f"--config.total_steps={args.steps}",
      "--config.checkpoint_every_steps=2", "--config.eval_every_steps=0",
      "--config.predictions.num_images=0", "--config.tensorboard=False"]

  before = shm_entries()
  seen: set[str] = set()
  leaks, failed, killed, first_leak = [], [], 0, ""
  start = time.perf_counter()
  for i in range(args.runs):
    wd = tmp / f"run{i:03d}"
    cmd = [sys.executable, "-m", "darl_jax.main", "--config=tests/tiny_config.py",
           f"--workdir={wd}", *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    kill = args.kill_every > 0 and (i + 1) % args.kill_every == 0
    if kill:
      ckpts = wd / "checkpoints"
      deadline = time.time() + 300
      while time.time() < deadline and proc.poll() is None:
        if ckpts.exists() and any(p.name.isdigit() for p in ckpts.iterdir()):
          break
        seen |= shm_entries() - before
        time.sleep(0.02)
      if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        killed += 1
      else:
        kill = False   # it ended (or failed) before its first checkpoint
    _, stderr = proc.communicate(timeout=600)
    seen |= shm_entries() - before
    if LEAK in stderr:
      leaks.append(i + 1)
      first_leak = first_leak or next(l for l in stderr.splitlines() if LEAK in l).strip()
    if not kill and proc.returncode != 0:
      failed.append(i + 1)
      print(f"run {i + 1} exited {proc.returncode}:\n{stderr[-2000:]}", file=sys.stderr)
    print(f"run {i + 1}/{args.runs}: {'killed' if kill else f'exit {proc.returncode}'}"
          f"{', LEAK WARNING' if LEAK in stderr else ''}", flush=True)
  elapsed = time.perf_counter() - start

  deadline = time.time() + args.settle
  while time.time() < deadline and (shm_entries() - before):
    time.sleep(0.5)
  left = sorted(shm_entries() - before)
  print(f"\n{args.runs} runs ({killed} SIGKILLed after their first checkpoint, "
        f"num_workers={args.workers}) in {elapsed:.0f} s")
  print(f"/dev/shm entries seen during the runs: {len(seen)}; still there after "
        f"{args.settle:.0f} s: {len(left)}{' ' + ', '.join(left) if left else ''}")
  print(f"runs whose stderr had '{LEAK}': {len(leaks)}{' ' + str(leaks) if leaks else ''}")
  if first_leak:
    print(f"  the first: {first_leak}")
  if failed:
    print(f"runs that failed: {failed}")
  return 1 if (left or leaks or failed) else 0


if __name__ == "__main__":
  sys.exit(main())
