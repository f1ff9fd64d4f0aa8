"""The TPU table of docs/TPU.md: the paper's configs compiled for TPU slices on a CPU host.

    python benchmarks/tpu_compile_table.py --out=/tmp/tpu.jsonl      # compile every row
    python benchmarks/tpu_compile_table.py --out=/tmp/tpu.jsonl --render   # the markdown
    python benchmarks/tpu_compile_table.py --out=/tmp/scan.jsonl --scanned [--render]

Each row is one ``python -m darl_jax.compile`` command (needs the ``tpu``
extra), run in its own process, its report appended to ``--out`` as a JSON
line; rows already in ``--out`` are skipped, so an interrupted job resumes.
A compile of an unscanned ViT takes minutes on a 2-core host.

``--scanned``: the diffusion pretraining rows again with ``model.scan_layers=True``
(the blocks in one ``nn.scan``), rendered with the train step's compile
time on this host: the scanned column of docs/TPU.md. XLA's cost model
counts a scan's body once, so those rows carry no step time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROWS = [  # (config, topology, overrides)
    ("experiments/vit_b16_diff.py", "v5p:4x4x4", ()),
    ("experiments/vit_b16_diff.py", "v5e:16x16", ()),
    ("experiments/vit_l16_diff.py", "v5p:4x4x4", ()),
    ("experiments/vit_l16_diff.py", "v5e:16x16", ()),
    ("experiments/vit_h14_diff.py", "v5p:4x4x4", ("--config.mesh.fsdp=4",)),
    ("experiments/vit_h14_diff.py", "v5e:16x16", ("--config.mesh.fsdp=16",)),
    ("experiments/vit_b16_mse.py", "v5p:4x4x4", ()),
    ("experiments/vit_l16_mse.py", "v5p:4x4x4", ()),
    ("experiments/vit_h14_mse.py", "v5p:4x4x4", ("--config.mesh.fsdp=4",)),
    ("experiments/vit_b16_mse.py", "v5e:16x16", ()),
    ("experiments/vit_l16_mse.py", "v5e:16x16", ()),
    ("experiments/vit_h14_mse.py", "v5e:16x16", ("--config.mesh.fsdp=16",)),
    # 64 H/14 examples per 16 GiB chip: does not fit in one pass
    # (microbatch_size=0; the config's default, -1, accumulates); the command
    # names the microbatch that does, and the next row runs it.
    ("experiments/vit_h14_diff.py", "v5e:8x8", ("--config.mesh.fsdp=8",
                                                 "--config.microbatch_size=0")),
    ("experiments/vit_h14_diff.py", "v5e:8x8", ("--config.mesh.fsdp=8",
                                                 "--config.microbatch_size=-1")),
    # Fine-tuning at the paper's batch (a random backbone: the program is the same).
    ("experiments/finetune_in1k.py:variant=B/16", "v5p:4x4x4", ()),
    ("experiments/finetune_in1k.py:variant=L/16", "v5p:4x4x4", ()),
    ("experiments/finetune_in1k.py:variant=H/14", "v5p:4x4x4", ("--config.sharding=fsdp",
                                                               "--config.mesh.data=-1",
                                                               "--config.mesh.fsdp=4")),
    # The paper's single linear probe per block (a grid's held-out rows need
    # an indexed source; the compile's synthetic images are not one).
    *[(f"experiments/linear_probe_in1k.py:variant={variant}", "v5p:4x4x4", (
        "--config.probe.holdout_size=0", "--config.probe.learning_rates=(0.1,)",
        '--config.probe.poolings=("mean",)')) for variant in ("B/16", "L/16", "H/14")],
]
# The diffusion pretraining rows at the paper's batch in one pass, scanned
# (the MSE programs are the same backbone without the decoder: smaller, and
# an H/14 row takes 10-20 minutes on 2 cores).
SCANNED_ROWS = [(config, topology, (*overrides, "--config.model.scan_layers=True"))
                for config, topology, overrides in ROWS[:6]]
EPOCHS = 800
IMAGENET = 1_281_167


def command(config: str, topology: str, overrides) -> list[str]:
  return [sys.executable, "-m", "darl_jax.compile", f"--config={config}",
          f"--topology={topology}", "--config.batch_size=4096", *overrides]


def done(out: str) -> set:
  if not os.path.exists(out):
    return set()
  keys = set()
  for line in open(out):
    row = json.loads(line)
    keys.add((row["config"], row["topology"]))
  return keys


def compile_rows(out: str, rows=ROWS) -> None:
  seen = done(out)
  for config, topology, overrides in rows:
    label = " ".join([f"--config={config}", "--config.batch_size=4096", *overrides])
    if (label, topology) in seen:
      continue
    t0 = time.perf_counter()
    proc = subprocess.run(command(config, topology, overrides) + [f"--json={out}"],
                          capture_output=True, text=True)
    print(f"{config} {topology} {' '.join(overrides)}: exit {proc.returncode} in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    if proc.returncode not in (0, 1):
      print(proc.stderr[-2000:], flush=True)


def render(out: str) -> str:
  lines = ["| config | slice | mesh (data x fsdp) | per chip (microbatch) | fits? | compiled GiB / HBM | "
           "memory.py GiB | XLA step ms | implied MFU | 800 epochs |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for line in open(out):
    r = json.loads(line)
    name = r["config"].split("--config=experiments/")[1].split(" ")[0].replace(".py", "")
    extra = [a.replace("--config.", "") for a in r["config"].split()[1:]
             if "batch_size=4096" not in a and "mesh.fsdp" not in a]
    name = " ".join([name, *extra])
    mesh = f"{r['mesh']['data']} x {r['mesh']['fsdp']}"
    per_chip = r["microbatch_size"] // (r["mesh"]["data"] * r["mesh"]["fsdp"])
    steps = EPOCHS * IMAGENET / r["batch_size"]
    hours = (f"{steps * r['xla_seconds'] / 3600:.1f} h" if r["xla_seconds"] else "-")
    mfu = f"{r['mfu']:.2f}" if r["mfu"] else "-"
    ms = f"{r['xla_seconds'] * 1e3:.0f}" if r["xla_seconds"] else "-"
    compiled = f"{r['train_gib']:.1f}"
    if not r["arguments_gib"]:
      compiled += " (temporaries; the compiler refused)"
    lines.append(f"| {name} | {r['topology']} ({r['chips']} chips) | {mesh} | {per_chip} | "
                 f"{'yes' if r['fits'] else '**no**'} | {compiled} / "
                 f"{r['hbm_gib']:.0f} | {r['estimate'] or '-'} | {ms} | {mfu} | {hours} |")
  return "\n".join(lines)


def render_scanned(out: str) -> str:
  lines = ["| config | slice | per chip | fits? | compiled GiB / HBM | temporaries GiB | "
           "train step compiled in |", "|---|---|---|---|---|---|---|"]
  for line in open(out):
    r = json.loads(line)
    name = r["config"].split("--config=experiments/")[1].split(" ")[0].replace(".py", "")
    per_chip = r["microbatch_size"] // (r["mesh"]["data"] * r["mesh"]["fsdp"])
    compiled = f"{r['train_gib']:.1f}"
    if not r["arguments_gib"]:
      compiled += " (temporaries; the compiler refused)"
    took = f"{r['compile_seconds']:.0f} s" if r.get("compile_seconds") else "-"
    lines.append(f"| {name} | {r['topology']} | {per_chip} | "
                 f"{'yes' if r['fits'] else '**no**'} | {compiled} / {r['hbm_gib']:.0f} | "
                 f"{r['temporaries_gib']:.1f} | {took} |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--render", action="store_true")
  parser.add_argument("--scanned", action="store_true",
                      help="the pretraining rows with model.scan_layers=True")
  args = parser.parse_args()
  if args.render:
    print(render_scanned(args.out) if args.scanned else render(args.out))
  else:
    compile_rows(args.out, SCANNED_ROWS if args.scanned else ROWS)


if __name__ == "__main__":
  main()
