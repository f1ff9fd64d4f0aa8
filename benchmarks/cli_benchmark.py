"""What a user gets: the training CLI's images/s on a folder of JPEGs, against the step.

    python benchmarks/cli_benchmark.py --config=experiments/vit_l16_diff.py --batch=256
    python benchmarks/cli_benchmark.py --config=experiments/vit_b16_diff.py --batch=1024 \\
        --processes=2                       # two processes on two GPUs (jax.distributed)

Generates (once, in parallel) a folder of ImageNet-like JPEGs (sides 300-500
px, quality 90, ten class folders under ``train/`` plus a ``val/`` folder),
then runs ``python -m darl_jax.main`` exactly as a user would, twice on the
same config:

- ``synthetic``: the loop on random uint8 batches made on the device side of
  nothing (``data.name=synthetic``): the step alone, with the loop around it;
- ``folder``: the loop on the JPEG folder through the input pipeline;
- ``tar``, ``arrayrecord``, ``parquet`` (when named in ``--runs``): the same
  JPEGs converted once into shards of 1000 (``python -m darl_jax.data.convert``,
  bytes unchanged), each printed against the folder.

Each run gets a fresh workdir; evaluation is off and one checkpoint is
written at the end. From each run's metrics.jsonl the benchmark reports the
median img/s of the logged windows after ``--skip`` warm-up windows, the
median input-wait fraction and the final goodput; from its log, the seconds
from launch to the first step. Then it starts the folder command once more
on a new workdir (``--restart``; the same config, so the same programs,
stopped after two steps): with the persistent compilation cache warm, the
time to the first step is what a rerun or a resumed run pays.
The last line is the ratio CLI / step. Extra config overrides go after
``--``: ``... -- --config.kernels.attention=cudnn``.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _jpeg(seed: int) -> bytes:
  """One ImageNet-like JPEG: 300-500 px short side, aspect 3/4-4/3,
  smooth content plus texture (60-120 kB at quality 90)."""
  from PIL import Image
  rng = np.random.default_rng(seed)
  short = int(rng.integers(300, 501))
  ratio = float(rng.uniform(3 / 4, 4 / 3))
  h, w = (short, int(short * ratio)) if ratio >= 1 else (int(short / ratio), short)
  low = rng.uniform(0, 255, (max(h // 32, 2), max(w // 32, 2), 3)).astype(np.uint8)
  img = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC), np.float32)
  img += rng.normal(0, 12, img.shape)
  buf = io.BytesIO()
  Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
  return buf.getvalue()


def _write(args) -> None:
  path, seed = args
  with open(path, "wb") as f:
    f.write(_jpeg(seed))


def make_folder(root: str, num_train: int, num_val: int, classes: int = 10) -> str:
  """``root/train/class_k/*.jpg`` and ``root/val/class_k/*.jpg``; kept if complete."""
  marker = os.path.join(root, f".complete_{num_train}_{num_val}")
  if os.path.exists(marker):
    return root
  jobs = []
  for split, num, offset in (("train", num_train, 0), ("val", num_val, num_train)):
    for i in range(num):
      folder = os.path.join(root, split, f"class_{i % classes}")
      os.makedirs(folder, exist_ok=True)
      jobs.append((os.path.join(folder, f"{i:06d}.jpg"), offset + i))
  with multiprocessing.Pool() as pool:
    pool.map(_write, jobs, chunksize=64)
  open(marker, "w").close()
  return root


def run_cli(config: str, workdir: str, overrides: list[str], processes: int,
            timeout: float) -> dict:
  """Runs the training CLI (``processes`` processes, one GPU each, through
  jax.distributed on this host); returns its timings and metrics."""
  base = [sys.executable, "-m", "darl_jax.main", f"--config={config}",
          f"--workdir={workdir}", *overrides]
  procs = []
  first_step = {}
  start = time.perf_counter()
  for p in range(processes):
    env = dict(os.environ)
    cmd = list(base)
    if processes > 1:
      env["CUDA_VISIBLE_DEVICES"] = str(p)
      cmd += ["--distributed", "--coordinator=127.0.0.1:12355",
              f"--num_processes={processes}", f"--process_id={p}"]
    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  logs = [[] for _ in procs]

  def read(i, proc):
    for line in proc.stdout:
      logs[i].append(line)
      if "first step done" in line and i not in first_step:
        first_step[i] = time.perf_counter() - start

  threads = [threading.Thread(target=read, args=(i, p), daemon=True)
             for i, p in enumerate(procs)]
  for t in threads:
    t.start()
  codes = [p.wait(timeout=timeout) for p in procs]
  for t in threads:
    t.join(timeout=10)
  if any(codes):
    tail = "".join(logs[codes.index(next(c for c in codes if c))][-40:])
    raise RuntimeError(f"the CLI failed (exit codes {codes}):\n{tail}")
  records = []
  path = os.path.join(workdir, "metrics.jsonl")
  if os.path.exists(path):
    with open(path) as f:
      records = [json.loads(line) for line in f if line.strip()]
  return {"records": [r for r in records if "img_per_sec" in r],
          "first_step_s": max(first_step.values()) if first_step else float("nan"),
          "wall_s": time.perf_counter() - start}


def summary(result: dict, skip: int) -> dict:
  rows = result["records"][skip:] or result["records"]
  pick = lambda k: [r[k] for r in rows if r.get(k) is not None]
  med = lambda v: float(np.median(v)) if v else float("nan")
  return {"img_s": med(pick("img_per_sec")), "input_wait": med(pick("input_wait_fraction")),
          "goodput": (pick("goodput") or [float("nan")])[-1],
          "first_step_s": result["first_step_s"], "windows": len(rows)}


# The same JPEGs in shards (python -m darl_jax.data.convert): run name -> format.
SHARDED = {"tar": "tar", "arrayrecord": "arrayrecord", "parquet": "parquet"}


def shard_config(folder: str, dst: str, fmt: str, shard_size: int = 1000) -> dict:
  """The data config (name, path, eval_path) of ``folder``'s images written
  into ``fmt`` shards of ``shard_size`` under ``dst`` (``python -m
  darl_jax.data.convert``); the split folders' val/ is the evaluation split.
  Converted once: a ``DONE`` file marks a finished conversion."""
  sys.path.insert(0, ROOT)
  from darl_jax.data import convert  # pylint: disable=g-import-not-at-top
  if not os.path.exists(os.path.join(dst, "DONE")):
    t0 = time.perf_counter()
    shutil.rmtree(dst, ignore_errors=True)
    convert.convert(folder, dst, fmt, shard_size=shard_size)
    open(os.path.join(dst, "DONE"), "w").close()
    print(f"{fmt} shards {dst} ({time.perf_counter() - t0:.0f} s)", flush=True)
  ext = convert.WRITERS[fmt].suffix
  return {"name": convert.SOURCE_NAMES[fmt], "path": f"{dst}/train-*{ext}",
          "eval_path": f"{dst}/validation-*{ext}"}


def shards_of(folder: str, fmt: str) -> list[str]:
  """The CLI's data overrides for ``folder`` converted (once) into ``fmt`` shards
  of 1000 images beside it."""
  config = shard_config(folder, f"{folder.rstrip('/')}_{fmt}", fmt)
  return [f"--config.data.{key}={value}" for key, value in config.items()]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="experiments/vit_l16_diff.py")
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--steps", type=int, default=120)
  parser.add_argument("--log_every", type=int, default=10)
  parser.add_argument("--skip", type=int, default=2, help="warm-up windows left out")
  parser.add_argument("--images", type=int, default=6000)
  parser.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "darl_jpegs"))
  parser.add_argument("--processes", type=int, default=1)
  parser.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True)
  parser.add_argument("--runs", default="synthetic,folder")
  parser.add_argument("--timeout", type=float, default=1800)
  args, extra = parser.parse_known_args()
  extra = [a for a in extra if a != "--"]

  folder = args.folder
  if {"folder", *SHARDED} & set(args.runs.split(",")):
    t0 = time.perf_counter()
    make_folder(folder, args.images, max(args.images // 20, 64))
    print(f"JPEG folder {folder}: {args.images} train images "
          f"({time.perf_counter() - t0:.0f} s); {os.cpu_count()} host cores", flush=True)
  common = [f"--config.batch_size={args.batch}", f"--config.total_steps={args.steps}",
            f"--config.log_every_steps={args.log_every}", "--config.eval_every_steps=0",
            f"--config.checkpoint_every_steps={args.steps}", "--config.tensorboard=False",
            "--config.predictions.num_images=0", *extra]
  data = {"synthetic": ["--config.data.name=synthetic"],
          "folder": ["--config.data.name=image_folder", f"--config.data.path={folder}"]}
  for fmt in set(args.runs.split(",")) & set(SHARDED):
    data[fmt] = shards_of(folder, fmt)
  rows = {}
  scratch = tempfile.mkdtemp(prefix="darl_cli_bench_")
  for name in args.runs.split(","):
    workdir = os.path.join(scratch, name)
    rows[name] = summary(run_cli(args.config, workdir, common + data[name], args.processes,
                                 args.timeout), args.skip)
    print(name, json.dumps(rows[name]), flush=True)
  if args.restart:
    last = name
    again = run_cli(args.config, os.path.join(scratch, "restart"),
                    common + ["--config.stop_after_steps=2"] + data[last],
                    args.processes, args.timeout)
    rows[last]["restart_first_step_s"] = again["first_step_s"]
  shutil.rmtree(scratch, ignore_errors=True)

  print(f"\n{args.config}, batch {args.batch}, {args.processes} process(es), "
        f"{os.cpu_count()} host cores\n")
  print("| run | img/s | input wait | goodput | first step (s) |\n|---|---|---|---|---|")
  for name, r in rows.items():
    print(f"| {name} | {r['img_s']:.0f} | {r['input_wait']:.1%} | {r['goodput']:.1%} | "
          f"{r['first_step_s']:.0f} |")
  for name, r in rows.items():
    if "restart_first_step_s" in r:
      print(f"\n{name} rerun on a new workdir, compilation cache warm: first step after "
            f"{r['restart_first_step_s']:.0f} s")
  if {"synthetic", "folder"} <= rows.keys():
    print(f"\nCLI on JPEGs / step alone: "
          f"{rows['folder']['img_s'] / rows['synthetic']['img_s']:.3f}")
  for fmt in SHARDED:
    if {fmt, "folder"} <= rows.keys():
      print(f"CLI on {fmt} shards / on the folder: "
            f"{rows[fmt]['img_s'] / rows['folder']['img_s']:.3f}")


if __name__ == "__main__":
  main()
