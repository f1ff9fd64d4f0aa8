"""Is the GPU free when a job exits? Runs a command and watches the card.

    python benchmarks/card_release_check.py -- python -m darl_jax.main \\
        --config=experiments/finetune_in1k.py:variant=H/14 --workdir=/tmp/ft ...

Polls ``nvidia-smi`` every ``--every`` seconds from before the command starts
until ``--settle`` seconds after it exits: the card's used memory and the
processes holding it (their pids and command lines). Prints the memory used
before the command, its peak, and how long after the command's exit the card
came back to within ``--slack_mib`` of where it started; and every process
still holding the card then, with its command line (a data worker or saver
that outlived the job). Exits 1 when the card was not free by the end of
``--settle``, 0 otherwise (the command's own status is printed, not used).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def card() -> tuple[int, dict[int, int]]:
  """(used MiB of GPU 0, {pid: MiB} of the processes holding it)."""
  used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                         "-i", "0"], capture_output=True, text=True, check=True).stdout
  apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                         "--format=csv,noheader,nounits", "-i", "0"],
                        capture_output=True, text=True, check=True).stdout
  holders = {}
  for line in apps.splitlines():
    if line.strip():
      pid, mib = (field.strip() for field in line.split(","))
      holders[int(pid)] = int(mib) if mib.isdigit() else 0
  return int(used.split()[0]), holders


def command_line(pid: int) -> str:
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
  except OSError:
    return "(gone)"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--every", type=float, default=0.5)
  parser.add_argument("--settle", type=float, default=20.0)
  parser.add_argument("--slack_mib", type=int, default=256)
  parser.add_argument("--json", default="", help="append the summary to this file")
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = [a for a in args.command if a != "--"] if args.command else []
  if not command:
    parser.error("give the command to run after --")
  try:
    baseline, _ = card()
  except (OSError, subprocess.CalledProcessError) as e:
    print(f"error: nvidia-smi does not answer ({e}): run this on a GPU machine")
    return 2
  proc = subprocess.Popen(command)
  peak, exited, free_after, holders = baseline, None, None, {}
  while True:
    used, holders = card()
    peak = max(peak, used)
    now = time.monotonic()
    if exited is None and proc.poll() is not None:
      exited = now
    if exited is not None:
      if free_after is None and used <= baseline + args.slack_mib and not holders:
        free_after = now - exited
      if free_after is not None or now - exited > args.settle:
        break
    time.sleep(args.every)
  summary = {"command": " ".join(command)[:300], "exit_status": proc.returncode,
             "used_mib_before": baseline, "peak_mib": peak,
             "free_seconds_after_exit": None if free_after is None else round(free_after, 2),
             "holders_at_end": {pid: {"mib": mib, "command": command_line(pid)}
                                for pid, mib in holders.items()}}
  print(json.dumps(summary, indent=1))
  if args.json:
    with open(args.json, "a") as f:
      f.write(json.dumps(summary) + "\n")
  if free_after is None:
    print(f"error: the card still held {used} MiB ({len(holders)} processes) "
          f"{args.settle:g} s after the command exited")
    return 1
  print(f"the card was free {free_after:.1f} s after the command exited "
        f"(status {proc.returncode}); peak {peak} MiB, {baseline} MiB before")
  return 0


if __name__ == "__main__":
  sys.exit(main())
