"""Start-up and shut-down of the training CLI: a config cold, then warm, in one command.

    python benchmarks/startup_benchmark.py --config=experiments/vit_h14_diff.py --batch=192
    python benchmarks/startup_benchmark.py --config=experiments/vit_b16_diff.py --batch=512 \\
        --data=folder -- --config.model.scan_layers=True

Runs ``python -m darl_jax.main`` as a user would, twice, each on a new
workdir:

- ``cold``: empty caches (a new JAX compilation cache folder, and with it a
  new folder of saved executables, train/executables.py);
- ``warm``: the same config with another ``total_steps`` (``--warm_steps``)
  and the same caches: what a rerun, a resumed run or the next run of a
  sweep pays.

Evaluation runs every ``--steps`` steps (the first evaluation at the end of
the cold run), a checkpoint is written at the end, the closing prediction
picture is made (``predictions.num_images`` as configured), TensorBoard is
off: nothing needs TensorFlow. The data is ``synthetic`` (random batches, no
host work) or, with ``--data=folder``, a folder of ImageNet-like JPEGs made
once (benchmarks/cli_benchmark.py's), or ``config`` (the config's own).

Printed per run, from the log's ``start-up:`` lines (darl_jax/train/loop.py)
and the lines' arrival times: seconds from launch to the first step, each
phase's seconds (setup; per program trace, lower, compile or load; the
programs together; initialisation; the first batch's wait), the median
img/s of the logged windows after ``--skip`` warm-up windows, and the
seconds from the start of the last checkpoint's save to the process's exit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# "start-up: <phase>: <text>", e.g. "start-up: train step: trace 1.2 s, lower 3.4 s,
# compile 5.6 s" or "start-up: initialisation: 0.5 s".
_PHASE = re.compile(r"start-up: (?P<phase>[^:]+): (?P<text>.*)$")
_SECONDS = re.compile(r"(?:(?P<name>[a-z]+) )?(?P<value>\d+(?:\.\d+)?) s\b")
_READY = re.compile(r"start-up: (?P<count>\d+) programs ready in (?P<value>[\d.]+) s")


def phases(lines: list[str]) -> dict:
  """``{phase: seconds}`` from the log's ``start-up:`` lines: a program's line
  gives ``<program> <trace|lower|compile|load>`` entries, the others one
  entry each (the first number of the line)."""
  out = {}
  for line in lines:
    ready = _READY.search(line)
    if ready:
      out["programs ready"] = float(ready["value"])
      continue
    found = _PHASE.search(line.rstrip())
    if not found or found["phase"].startswith("first step done"):
      continue
    phase, text = found["phase"], found["text"]
    numbers = list(_SECONDS.finditer(text))
    if len(numbers) > 1 or (numbers and numbers[0]["name"] in ("trace", "load")):
      for n in numbers:
        out[f"{phase} {n['name']}"] = float(n["value"])
    elif numbers:
      out[phase.split(" (")[0]] = float(numbers[0]["value"])
  return out


def run(config: str, workdir: str, overrides: list[str], cache: str, final_step: int,
        timeout: float, logs: str = "", name: str = "run") -> dict:
  """One CLI run; its log timed line by line as it arrives."""
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache)
  cmd = [sys.executable, "-m", "darl_jax.main", f"--config={config}", f"--workdir={workdir}",
         *overrides]
  start = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  lines, arrivals, first_step, last_save = [], [], None, None
  deadline = start + timeout
  for line in proc.stdout:
    now = time.perf_counter() - start
    lines.append(line)
    arrivals.append(now)
    if first_step is None and "first step done" in line:
      first_step = now
    if f"Saving checkpoint for step {final_step} " in line:
      last_save = now
    if time.perf_counter() > deadline:
      proc.kill()
      break
  code = proc.wait()
  exited = time.perf_counter() - start
  if logs:      # also, and above all, when the run failed
    os.makedirs(logs, exist_ok=True)
    with open(os.path.join(logs, f"{name}.log"), "w") as f:
      f.writelines(f"{t:7.2f} {line}" for t, line in zip(arrivals, lines))
  if code:
    raise RuntimeError(f"the CLI failed (exit {code}): {' '.join(cmd)}\n"
                       + "".join(lines[-40:]))
  records = []
  path = os.path.join(workdir, "metrics.jsonl")
  if os.path.exists(path):
    with open(path) as f:
      records = [json.loads(line) for line in f if line.strip()]
  return {"lines": lines, "arrivals": arrivals, "records": [r for r in records if "img_per_sec" in r],
          "first_step_s": first_step, "wall_s": exited,
          "exit_after_last_checkpoint_s": None if last_save is None else exited - last_save,
          "phases": phases(lines)}


def summary(result: dict, skip: int) -> dict:
  rows = result["records"][skip:] or result["records"]
  speeds = [r["img_per_sec"] for r in rows]
  return {"first_step_s": result["first_step_s"],
          "img_s": float(np.median(speeds)) if speeds else float("nan"),
          "exit_after_last_checkpoint_s": result["exit_after_last_checkpoint_s"],
          "wall_s": result["wall_s"], **{f"phase: {k}": v for k, v in result["phases"].items()}}


def table(rows: dict) -> str:
  keys = []
  for r in rows.values():
    keys += [k for k in r if k not in keys]
  fmt = lambda v: "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))
  out = ["| | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
  for k in keys:
    out.append(f"| {k} | " + " | ".join(fmt(r.get(k)) for r in rows.values()) + " |")
  return "\n".join(out)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="experiments/vit_b16_diff.py")
  parser.add_argument("--batch", type=int, default=0, help="batch_size (0: the config's)")
  parser.add_argument("--steps", type=int, default=30, help="the cold run's total_steps")
  parser.add_argument("--warm_steps", type=int, default=0,
                      help="the warm run's total_steps (0: --steps + 10)")
  parser.add_argument("--log_every", type=int, default=5)
  parser.add_argument("--skip", type=int, default=1, help="warm-up windows left out")
  parser.add_argument("--data", default="synthetic", choices=("synthetic", "folder", "config"))
  parser.add_argument("--images", type=int, default=3000, help="--data=folder's train images")
  parser.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "darl_jpegs"))
  parser.add_argument("--cache", default="",
                      help="the compilation cache folder (default: a new, empty one)")
  parser.add_argument("--timeout", type=float, default=560,
                      help="seconds per run (one device call is 10 minutes)")
  parser.add_argument("--json", default="", help="append each run's summary to this file")
  parser.add_argument("--logs", default="",
                      help="write each run's log here as <run>.log, each line with the "
                           "seconds since launch it arrived at")
  parser.add_argument("--runs", default="cold,warm",
                      help="which runs: cold, warm or both (warm after cold shares its caches)")
  args, extra = parser.parse_known_args(argv)
  extra = [a for a in extra if a != "--"]
  warm_steps = args.warm_steps or args.steps + 10

  data = []
  if args.data == "synthetic":
    data = ["--config.data.name=synthetic"]
  elif args.data == "folder":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cli_benchmark  # pylint: disable=g-import-not-at-top
    cli_benchmark.make_folder(args.folder, args.images, max(args.images // 20, 64))
    data = ["--config.data.name=image_folder", f"--config.data.path={args.folder}"]
  scratch = tempfile.mkdtemp(prefix="darl_startup_bench_")
  cache = args.cache or os.path.join(scratch, "cache")
  rows = {}
  try:
    runs = [r for r in args.runs.split(",") if r]
    if not runs or set(runs) - {"cold", "warm"}:
      parser.error(f"--runs={args.runs}: a comma-separated subset of cold,warm")
    for name, steps in (("cold", args.steps), ("warm", warm_steps)):
      if name not in runs:
        continue
      overrides = [f"--config.total_steps={steps}", f"--config.log_every_steps={args.log_every}",
                   f"--config.eval_every_steps={args.steps}",
                   f"--config.checkpoint_every_steps={steps}", "--config.tensorboard=False",
                   *([f"--config.batch_size={args.batch}"] if args.batch else []), *data, *extra]
      result = run(args.config, os.path.join(scratch, name), overrides, cache, steps,
                   args.timeout, logs=args.logs, name=name)
      rows[name] = summary(result, args.skip)
      print(name, json.dumps(rows[name]), flush=True)
      if args.json:
        with open(args.json, "a") as f:
          f.write(json.dumps({"run": name, "config": args.config, "batch": args.batch,
                              "overrides": extra, **rows[name]}) + "\n")
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  print(f"\n{args.config}, batch {args.batch or 'as configured'}, data {args.data}, "
        f"{os.cpu_count()} host cores; seconds unless named\n")
  print(table(rows))


if __name__ == "__main__":
  main()
