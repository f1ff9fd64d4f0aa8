"""Runs an experiment on a Cloud TPU VM slice with plain ``gcloud``.

    python launch/tpu_vm.py --tpu_name=darl-v5p --zone=us-east5-a --topology=v5p-256 \\
        --create --config=experiments/vit_l16_diff.py --workdir=gs://bucket/run \\
        -- --config.total_steps=10

Steps (``--steps``, in this order; ``--create`` adds the first):

* ``create``: ``gcloud compute tpus tpu-vm create`` with the software version
  JAX uses for the generation (``--runtime_version`` overrides);
* ``copy``: packs this working tree (no .git, virtualenvs or workdirs) into
  a private temporary folder (removed afterwards) and copies it to every
  worker (``scp --worker=all``);
* ``setup``: unpacks it in ``~/<remote_dir>`` and ``pip install``s it with
  ``jax[tpu]`` on every worker;
* ``run``: ``ssh --worker=all`` starts ``python3 -m darl_jax.main`` on every
  host at once with ``DARL_DISTRIBUTED=on``; JAX reads the slice's hosts and
  this host's index from the TPU metadata server, so there is nothing to pass.
  ``--detach`` leaves it running under ``nohup`` (log in ``~/darl_jax_run.log``).
  A run that stops at a preemption notice (SIGTERM: exit status 143, with
  the checkpoint of the stop step saved, darl_jax/preemption.py) is rerun
  on the same hosts, up to ``--max_restarts`` times; it resumes there.

Spot and preemptible TPU VMs (``--spot``) that Google Cloud takes back give
the processes SIGTERM about 30 s ahead, in which they save; the VM itself is
then gone (state PREEMPTED) and the rerun loop with it: delete it and run
the launcher again with ``--create`` (or ``--steps=create,copy,setup,run``),
and the run resumes from that checkpoint.

The workdir must be on GCS: each host writes its checkpoint shards there and
process 0 the metrics. ``--dry_run`` prints the commands and runs nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import tempfile

import launchlib as common

STEPS = ("create", "copy", "setup", "run")

# Software versions Cloud TPU documents for JAX, by generation.
RUNTIME_VERSIONS = {
    "v2": "tpu-ubuntu2204-base",
    "v3": "tpu-ubuntu2204-base",
    "v4": "tpu-ubuntu2204-base",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v5p": "v2-alpha-tpuv5",
    "v6e": "v2-alpha-tpuv6e",
}


def parse_topology(topology: str) -> tuple[str, int]:
  """``"v5p-256"`` -> ("v5p", 256): generation and the accelerator-type size."""
  m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", topology or "")
  if not m or m.group(1) not in RUNTIME_VERSIONS:
    raise SystemExit(f"error: unknown TPU topology {topology!r}; use <generation>-<size> "
                     f"with generation one of {', '.join(RUNTIME_VERSIONS)}, e.g. v5p-256")
  return m.group(1), int(m.group(2))


def add_tpu_flags(parser: argparse.ArgumentParser) -> None:
  """Flags shared with launch/xm_launch.py, which hands TPU slices to this script."""
  parser.add_argument("--tpu_name", help="name of the TPU VM (slice)")
  parser.add_argument("--zone", help="GCP zone of the TPU, e.g. us-east5-a")
  parser.add_argument("--project", default=None, help="GCP project (default: gcloud's)")
  parser.add_argument("--create", action="store_true", help="create the TPU VM first")
  parser.add_argument("--spot", action="store_true",
                      help="Spot capacity: a Spot TPU VM (with --create), Vertex's Spot VMs "
                           "(launch/xm_launch.py)")
  parser.add_argument("--runtime_version", default=None,
                      help="TPU software version (default: by generation)")
  parser.add_argument("--remote_dir", default="darl_jax",
                      help="code directory on the workers, relative to $HOME")
  parser.add_argument("--pip_args", default="-c constraints.txt -e '.[tfds]' 'jax[tpu]'",
                      help="what `pip install` gets on the workers")
  parser.add_argument("--detach", action="store_true",
                      help="leave the run going under nohup instead of waiting for it")
  parser.add_argument("--max_restarts", type=int, default=3,
                      help=f"rerun the training command this often while it exits "
                           f"{common.PREEMPTED} (stopped at a preemption notice, "
                           "checkpointed); 0: never")


def _gcloud(args, verb: str, *rest: str) -> list[str]:
  cmd = ["gcloud", "compute", "tpus", "tpu-vm", verb, *rest, f"--zone={args.zone}"]
  if args.project:
    cmd.append(f"--project={args.project}")
  return cmd


def _ssh(args, remote: str) -> list[str]:
  return _gcloud(args, "ssh", args.tpu_name, "--worker=all", f"--command={remote}")


def commands(args, passthrough: list[str], steps=None,
             archive: str | None = None) -> list[list[str]]:
  """The gcloud (and tar) commands of ``steps``, in order. ``archive``: where
  ``copy`` packs the working tree (``launch`` gives a private folder's path)."""
  steps = list(steps or [s for s in STEPS if s != "create" or args.create])
  unknown = sorted(set(steps) - set(STEPS))
  if unknown:
    raise SystemExit(f"error: unknown steps {unknown}; valid: {', '.join(STEPS)}")
  if not args.tpu_name or not args.zone:
    raise SystemExit("error: --tpu_name and --zone are required")
  if "copy" in steps and not archive:
    raise ValueError("the copy step needs the archive's path (launch() makes one)")
  home = "~/" + shlex.quote(args.remote_dir)   # the remote shell expands ~/ before quotes
  out = []
  if "create" in steps:
    generation, _ = parse_topology(args.topology)
    runtime = args.runtime_version or RUNTIME_VERSIONS[generation]
    cmd = _gcloud(args, "create", args.tpu_name, f"--accelerator-type={args.topology}",
                  f"--version={runtime}")
    out.append(cmd + (["--spot"] if args.spot else []))
  if "copy" in steps:
    out.append(["tar", "-czf", archive, *(f"--exclude={e}" for e in common.SOURCE_EXCLUDES),
                "-C", str(common.REPO), "."])
    out.append(_gcloud(args, "scp", archive, f"{args.tpu_name}:darl_jax.tar.gz",
                       "--worker=all"))
  if "setup" in steps:
    out.append(_ssh(args, f"mkdir -p {home} && tar -xzf ~/darl_jax.tar.gz -C {home} && "
                          f"cd {home} && python3 -m pip install -q {args.pip_args}"))
  if "run" in steps:
    config = common.check_config(args.config)
    workdir = common.check_workdir(args.workdir, shared="gcs")
    train = common.env_prefix(common.DISTRIBUTED_ENV) + shlex.join(
        common.main_command(config, workdir, passthrough))
    train = common.rerun_while_preempted(train, args.max_restarts)
    if args.detach:
      # bash -c: nohup runs one program, and the rerun loop is a shell's.
      train = f"nohup bash -c {shlex.quote(train)} > ~/darl_jax_run.log 2>&1 &"
    out.append(_ssh(args, f"cd {home} && {train}"))
  return out


def launch(args, passthrough: list[str], steps=None, dry_run: bool = False) -> None:
  """Runs (or prints) the commands of ``steps``. The archive of the working
  tree goes into a folder only this user can read (``tempfile``), removed
  afterwards: a fixed name in /tmp would let other users read the code, or
  plant a file of theirs to be copied to the workers."""
  with tempfile.TemporaryDirectory(prefix="darl_jax_launch_") as private:
    archive = os.path.join(private, "darl_jax.tar.gz")
    common.run_or_print(commands(args, passthrough, steps, archive=archive), dry_run)


def main(argv=None) -> None:
  own, passthrough = common.split_passthrough(sys.argv if argv is None else argv)
  parser = argparse.ArgumentParser(prog="launch/tpu_vm.py", description=__doc__.split("\n")[0])
  parser.add_argument("--config", help="experiment config, e.g. experiments/vit_l16_diff.py")
  parser.add_argument("--workdir", help="gs://bucket/dir")
  parser.add_argument("--topology", help="accelerator type, e.g. v5p-256 (for --create)")
  parser.add_argument("--steps", default=None,
                      help=f"comma-separated subset of {','.join(STEPS)} "
                           "(default: copy,setup,run, plus create with --create)")
  parser.add_argument("--dry_run", action="store_true", help="print the commands only")
  add_tpu_flags(parser)
  args = parser.parse_args(own[1:])
  steps = args.steps.split(",") if args.steps else None
  if args.dry_run:
    print("dry run: nothing is executed")
  launch(args, passthrough, steps, args.dry_run)


if __name__ == "__main__":
  main()
