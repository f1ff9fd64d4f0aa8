"""Launches any experiment config on Google Cloud through XManager.

    python launch/xm_launch.py --config=experiments/vit_l16_diff.py --platform=gpu \\
        --topology=a100-8 --num_hosts=4 --workdir=gs://bucket/l16 -- --config.total_steps=10
    python launch/xm_launch.py --config=experiments/vit_l16_diff.py --platform=tpu \\
        --topology=v5p-256 --tpu_name=darl-v5p --zone=us-east5-a --create \\
        --workdir=gs://bucket/l16 -- --config.total_steps=10

Where each platform goes, and why:

* ``--platform=gpu``: a Vertex AI custom job built by XManager
  (``xm_local.Vertex``): a container with this repository and
  ``jax[cuda12]``, one replica per host (``--num_hosts``), each with
  ``--topology=<gpu>-<count>`` GPUs. The first replica is Vertex's chief
  (``workerpool0``), the others one more worker pool; every replica gets
  ``DARL_DISTRIBUTED=on`` and ``darl_jax.distributed`` reads Vertex's
  ``CLUSTER_SPEC`` (coordinator = the chief). XManager's Vertex client picks
  machine types for A100 (a2) and L4 (g2) only, so those are the GPUs offered.
* ``--platform=tpu`` with ``v2-8`` / ``v3-8`` (one host): a Vertex AI job
  through XManager (``xm.JobRequirements(tpu_v3=8)``), XManager's TPU support.
* ``--platform=tpu`` with a pod slice (``v4-*``, ``v5p-*``, ``v5litepod-*``,
  ``v6e-*``, or any v2/v3 larger than 8): XManager's open-source executors
  cannot start multi-host TPU VM slices (Vertex runs only single-host v2/v3,
  and its Kubernetes executor has no TPU-VM node pools), so the job goes
  through ``launch/tpu_vm.py`` (gcloud ``tpu-vm ssh --worker=all``) with the
  same config, workdir and overrides, and this script says so.

The workdir must be on GCS. Arguments after ``--`` are passed to
``darl_jax.main`` unchanged. ``--dry_run`` prints what would be built and
started and needs no XManager; ``xmanager`` (``pip install -e .[launch]``) is
imported only to launch.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import sys

import launchlib as common
import tpu_vm

# GPUs whose Vertex machine type XManager's Vertex client chooses, with the
# largest count one machine of that family has.
GPUS = {"a100": 16, "l4": 8}
VERTEX_TPUS = {"v2-8": "tpu_v2", "v3-8": "tpu_v3"}
BASE_IMAGE = "python:3.11-slim"


@dataclasses.dataclass
class Job:
  """One XManager job: ``replicas`` identical hosts running ``args``."""
  name: str
  resources: dict
  replicas: int
  args: list
  env: dict


@dataclasses.dataclass
class VertexPlan:
  """Everything the XManager launch needs, as plain data (printed by --dry_run)."""
  title: str
  base_image: str
  docker_instructions: list
  jobs: list


def parse_gpu_topology(topology: str) -> tuple[str, int]:
  """``"a100-8"`` -> ("a100", 8)."""
  m = re.fullmatch(r"([a-z0-9_]+)-(\d+)", topology or "")
  if not m or m.group(1) not in GPUS or not 1 <= int(m.group(2)) <= GPUS[m.group(1)]:
    raise SystemExit(f"error: unknown GPU topology {topology!r}; use <gpu>-<count per host> "
                     f"with gpu one of {', '.join(GPUS)} (XManager's Vertex machine types), "
                     f"e.g. a100-8")
  return m.group(1), int(m.group(2))


def docker_instructions(platform: str, extras: str) -> list[str]:
  """Dockerfile lines after FROM: copy the repository, install it with JAX."""
  name = common.REPO.name
  jax_pkg = "jax[cuda12]" if platform == "gpu" else "jax[tpu]"
  package = f".[{extras}]" if extras else "."
  return [
      "ENV LANG=C.UTF-8",
      f"COPY {name}/ /workdir/{name}",
      f"WORKDIR /workdir/{name}",
      f"RUN pip install --no-cache-dir -c constraints.txt -e '{package}' '{jax_pkg}'",
  ]


def vertex_plan(args, passthrough: list[str]) -> VertexPlan:
  config = common.check_config(args.config)
  workdir = common.check_workdir(args.workdir, shared="gcs")
  main_args = common.main_args(config, workdir, passthrough)
  if args.platform == "gpu":
    gpu, count = parse_gpu_topology(args.topology)
    resources = {gpu: count}
    hosts = args.num_hosts
  else:
    resources = {VERTEX_TPUS[args.topology]: 8}
    hosts = 1
  if hosts < 1:
    raise SystemExit("error: --num_hosts must be positive")
  env = dict(common.DISTRIBUTED_ENV) if hosts > 1 else {}
  jobs = [Job("chief", resources, 1, main_args, env)]
  if hosts > 1:   # Vertex: the first pool must have one replica; the rest join a second
    jobs.append(Job("workers", resources, hosts - 1, main_args, env))
  name = args.config.split(':')[0].rsplit('/', 1)[-1].removesuffix('.py')
  title = args.experiment_title or f"darl {name}"
  return VertexPlan(title, args.base_image, docker_instructions(args.platform, args.extras),
                    jobs)


def describe(plan: VertexPlan) -> str:
  """Human-readable plan: what --dry_run prints."""
  lines = [f"XManager experiment {plan.title!r} on Vertex AI",
           f"container FROM {plan.base_image}, entrypoint python -m darl_jax.main:"]
  lines += [f"  {line}" for line in plan.docker_instructions]
  for job in plan.jobs:
    res = ", ".join(f"{k}={v}" for k, v in job.resources.items())
    lines.append(f"job {job.name}: {job.replicas} replica(s), xm.JobRequirements({res})")
  job = plan.jobs[0]
  lines.append("every replica runs: " + common.env_prefix(job.env)
               + shlex.join(["python", "-m", "darl_jax.main", *job.args]))
  return "\n".join(lines)


def launch_vertex(plan: VertexPlan) -> None:
  """Builds the container and starts the jobs with XManager (imported here only)."""
  try:
    from absl import flags  # pylint: disable=g-import-not-at-top
    from xmanager import xm, xm_local  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise SystemExit(f"error: launching needs XManager: pip install -e '.[launch]' ({e})")
  # XManager's cloud clients read absl flags; mark them parsed (defaults).
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(sys.argv[:1])
  with xm_local.create_experiment(experiment_title=plan.title) as experiment:
    spec = xm.PythonContainer(path=str(common.REPO), base_image=plan.base_image,
                              docker_instructions=plan.docker_instructions,
                              entrypoint=xm.ModuleName("darl_jax.main"))
    [executable] = experiment.package([xm.Packageable(
        executable_spec=spec, executor_spec=xm_local.Vertex.Spec())])
    jobs = {}
    for job in plan.jobs:
      extra = {"replicas": job.replicas} if job.replicas > 1 else {}
      requirements = xm.JobRequirements(**job.resources, **extra)
      jobs[job.name] = xm.Job(executable=executable,
                              executor=xm_local.Vertex(requirements=requirements),
                              args=list(job.args), env_vars=dict(job.env))
    experiment.add(xm.JobGroup(**jobs) if len(jobs) > 1 else jobs["chief"])
  print(f"launched XManager experiment {plan.title!r}")


def main(argv=None) -> None:
  own, passthrough = common.split_passthrough(sys.argv if argv is None else argv)
  parser = argparse.ArgumentParser(prog="launch/xm_launch.py",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True, help="e.g. experiments/vit_l16_diff.py[:args]")
  parser.add_argument("--workdir", required=True, help="gs://bucket/dir")
  parser.add_argument("--platform", required=True, choices=("tpu", "gpu"))
  parser.add_argument("--topology", required=True,
                      help="tpu: v3-8, v5p-256, ...; gpu: <gpu>-<count per host>, e.g. a100-8")
  parser.add_argument("--num_hosts", type=int, default=1, help="gpu: number of hosts")
  parser.add_argument("--experiment_title", default=None)
  parser.add_argument("--base_image", default=BASE_IMAGE)
  parser.add_argument("--extras", default="tfds", help="setup.py extras for the image")
  parser.add_argument("--dry_run", action="store_true",
                      help="print what would be launched; needs no XManager")
  tpu_vm.add_tpu_flags(parser)
  args = parser.parse_args(own[1:])
  prefix = "dry run (nothing is submitted): " if args.dry_run else ""

  if args.platform == "tpu" and args.topology not in VERTEX_TPUS:
    tpu_vm.parse_topology(args.topology)   # a clear error for a typo
    print(f"{prefix}{args.topology} is a multi-host TPU VM slice, which XManager's "
          "executors cannot start (Vertex AI: v2-8/v3-8 only); launching through "
          "launch/tpu_vm.py (gcloud) instead")
    common.run_or_print(tpu_vm.commands(args, passthrough), args.dry_run)
    return
  plan = vertex_plan(args, passthrough)
  print(prefix + describe(plan))
  if not args.dry_run:
    launch_vertex(plan)


if __name__ == "__main__":
  main()
