"""Launches any experiment config on Google Cloud through XManager.

    python launch/xm_launch.py --config=experiments/vit_l16_diff.py --platform=gpu \\
        --topology=h100-8 --num_hosts=4 --workdir=gs://bucket/l16 -- --config.total_steps=10
    python launch/xm_launch.py --config=experiments/vit_l16_diff.py --platform=tpu \\
        --topology=v5p-256 --tpu_name=darl-v5p --zone=us-east5-a --create \\
        --workdir=gs://bucket/l16 -- --config.total_steps=10

Where each platform goes, and why:

* ``--platform=gpu``: a Vertex AI custom job built by XManager
  (``xm_local.Vertex``): a container with this repository and JAX's CUDA build,
  one replica per host (``--num_hosts``), each one Vertex machine of
  ``--topology`` (``GPU_TOPOLOGIES``: H100 and H200 eight per A3 machine, A100
  40 GB / 80 GB and L4 in the counts their A2 / G2 machines have). The first
  replica is Vertex's chief (``workerpool0``), the others one more worker pool;
  every replica gets ``DARL_DISTRIBUTED=on`` and ``darl_jax.distributed`` reads
  Vertex's ``CLUSTER_SPEC`` (coordinator = the chief). The machine type comes
  from the table, not from XManager's Vertex client, which asks for
  ``n1-standard-4`` (a machine Vertex does not offer with these GPUs) for
  H100, H200 and A100 80 GB.
* ``--platform=tpu`` with ``v2-8`` / ``v3-8`` (one host): a Vertex AI job
  through XManager (``xm.JobRequirements(tpu_v3=8)``), XManager's TPU support.
* ``--platform=tpu`` with a pod slice (``v4-*``, ``v5p-*``, ``v5litepod-*``,
  ``v6e-*``, or any v2/v3 larger than 8): XManager's open-source executors
  cannot start multi-host TPU VM slices (Vertex runs only single-host v2/v3,
  and its Kubernetes executor has no TPU-VM node pools), so the job goes
  through ``launch/tpu_vm.py`` (gcloud ``tpu-vm ssh --worker=all``) with the
  same config, workdir and overrides, and this script says so.

Preemption: a Vertex AI job is submitted with ``restart_job_on_worker_restart``
(a worker that Vertex restarts, after a preemption or a host's maintenance,
restarts every replica, and the run resumes from its checkpoint; the
training processes save the step they stop at when SIGTERM comes,
darl_jax/preemption.py), and with ``--spot`` on Vertex's Spot VMs
(``scheduling_strategy=SPOT``). XManager's Vertex client sets neither, so
``vertex_submit_options`` adds them to its ``CustomJob.submit`` call.

The workdir must be on GCS. Arguments after ``--`` are passed to
``darl_jax.main`` unchanged. ``--dry_run`` prints what would be built and
started and needs no XManager; ``xmanager`` (``pip install -c constraints.txt
-e '.[launch]'``, the version tests/test_launch.py builds against) is imported
only to build the XManager objects.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shlex
import shutil
import sys
import tempfile

import launchlib as common
import tpu_vm


@dataclasses.dataclass(frozen=True)
class VertexHost:
  """One Vertex AI machine: ``count`` accelerators of XManager's ``resource``."""
  resource: str       # xm.ResourceType name, lower case: the xm.JobRequirements keyword
  count: int          # accelerators per host
  machine_type: str   # the Vertex machine type that has exactly these accelerators


# --topology for --platform=gpu. The machine types are the accelerator-optimized
# ones Vertex AI training offers for each GPU and count (A3: 8 x H100 80 GB or
# 8 x H200 141 GB; A2 ultra: A100 80 GB; A2 high/mega: A100 40 GB; G2: L4, the
# smallest G2 with that many GPUs). The resources are xmanager 0.8.5's names
# (the L4 is L4_24TH, not l4).
GPU_TOPOLOGIES = {
    "h100-8": VertexHost("h100", 8, "a3-highgpu-8g"),
    "h200-8": VertexHost("h200", 8, "a3-ultragpu-8g"),
    "a100-80gb-1": VertexHost("a100_80gib", 1, "a2-ultragpu-1g"),
    "a100-80gb-2": VertexHost("a100_80gib", 2, "a2-ultragpu-2g"),
    "a100-80gb-4": VertexHost("a100_80gib", 4, "a2-ultragpu-4g"),
    "a100-80gb-8": VertexHost("a100_80gib", 8, "a2-ultragpu-8g"),
    "a100-1": VertexHost("a100", 1, "a2-highgpu-1g"),       # A100 40 GB
    "a100-2": VertexHost("a100", 2, "a2-highgpu-2g"),
    "a100-4": VertexHost("a100", 4, "a2-highgpu-4g"),
    "a100-8": VertexHost("a100", 8, "a2-highgpu-8g"),
    "a100-16": VertexHost("a100", 16, "a2-megagpu-16g"),
    "l4-1": VertexHost("l4_24th", 1, "g2-standard-4"),
    "l4-2": VertexHost("l4_24th", 2, "g2-standard-24"),
    "l4-4": VertexHost("l4_24th", 4, "g2-standard-48"),
    "l4-8": VertexHost("l4_24th", 8, "g2-standard-96"),
}
# --topology for --platform=tpu that Vertex runs (one host; "cloud-tpu" is the
# machine type Vertex takes for them, and XManager's client sets it itself).
# Every other TPU topology goes through launch/tpu_vm.py.
VERTEX_TPUS = {
    "v2-8": VertexHost("tpu_v2", 8, "cloud-tpu"),
    "v3-8": VertexHost("tpu_v3", 8, "cloud-tpu"),
}
# JAX's CUDA builds (extras of the jax pinned in constraints.txt). All the GPUs
# above (A100: sm80, L4: sm89, H100/H200: sm90) run both; CUDA 12 is the
# default because its wheels need an NVIDIA driver >= 525, CUDA 13's >= 580,
# and a Vertex container runs on the driver of Vertex's host image.
JAX_GPU_BUILDS = {"12": "jax[cuda12]", "13": "jax[cuda13]"}
BASE_IMAGE = "python:3.11-slim"
SOURCE_DIR = "darl_jax"   # the repository's directory in the build context and image


@dataclasses.dataclass
class Job:
  """One XManager job: ``replicas`` identical hosts running ``args``."""
  name: str
  host: VertexHost
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
  spot: bool = False     # Vertex's Spot VMs (preemptible) instead of on-demand ones


def gpu_host(topology: str) -> VertexHost:
  """``"h100-8"`` -> its row of GPU_TOPOLOGIES, or an error listing the valid names."""
  if topology not in GPU_TOPOLOGIES:
    raise SystemExit(f"error: unknown GPU topology {topology!r}; use <gpu>-<GPUs per host>, "
                     f"one of: {', '.join(GPU_TOPOLOGIES)} (the Vertex AI machines "
                     "with those GPUs)")
  return GPU_TOPOLOGIES[topology]


def docker_instructions(platform: str, extras: str, cuda: str = "12") -> list[str]:
  """Dockerfile lines after FROM: copy the repository, install it with JAX."""
  jax_pkg = JAX_GPU_BUILDS[cuda] if platform == "gpu" else "jax[tpu]"
  package = f".[{extras}]" if extras else "."
  return [
      "ENV LANG=C.UTF-8",
      f"COPY {SOURCE_DIR}/ /workdir/{SOURCE_DIR}",
      f"WORKDIR /workdir/{SOURCE_DIR}",
      f"RUN pip install --no-cache-dir -c constraints.txt -e '{package}' '{jax_pkg}'",
  ]


def vertex_plan(args, passthrough: list[str]) -> VertexPlan:
  config = common.check_config(args.config)
  workdir = common.check_workdir(args.workdir, shared="gcs")
  main_args = common.main_args(config, workdir, passthrough)
  if args.platform == "gpu":
    host, hosts = gpu_host(args.topology), args.num_hosts
  else:
    host, hosts = VERTEX_TPUS[args.topology], 1
  if hosts < 1:
    raise SystemExit("error: --num_hosts must be positive")
  env = dict(common.DISTRIBUTED_ENV) if hosts > 1 else {}
  jobs = [Job("chief", host, 1, main_args, env)]
  if hosts > 1:   # Vertex: the first pool must have one replica; the rest join a second
    jobs.append(Job("workers", host, hosts - 1, main_args, env))
  name = args.config.split(':')[0].rsplit('/', 1)[-1].removesuffix('.py')
  title = args.experiment_title or f"darl {name}"
  return VertexPlan(title, args.base_image,
                    docker_instructions(args.platform, args.extras, args.cuda), jobs,
                    spot=bool(args.spot))


def requirements_kwargs(job: Job) -> dict:
  """The keywords of the job's xm.JobRequirements (also what --dry_run prints)."""
  replicas = {"replicas": job.replicas} if job.replicas > 1 else {}
  return {job.host.resource: job.host.count, **replicas}


def describe(plan: VertexPlan) -> str:
  """Human-readable plan: what --dry_run prints."""
  lines = [f"XManager experiment {plan.title!r} on Vertex AI",
           f"container FROM {plan.base_image}, entrypoint python -m darl_jax.main:"]
  lines += [f"  {line}" for line in plan.docker_instructions]
  for job in plan.jobs:
    res = ", ".join(f"{k}={v}" for k, v in requirements_kwargs(job).items())
    lines.append(f"job {job.name}: {job.replicas} replica(s), xm.JobRequirements({res}), "
                 f"machine {job.host.machine_type}")
  lines.append("scheduling: " + ", ".join(f"{k}={v}" for k, v in
                                          submit_options(plan, names_only=True).items()))
  job = plan.jobs[0]
  lines.append("every replica runs: " + common.env_prefix(job.env)
               + shlex.join(["python", "-m", "darl_jax.main", *job.args]))
  return "\n".join(lines)


# ------------------------------------------------ the objects XManager gets
# Function-level imports: xmanager is the optional `launch` extra.


def _xmanager():
  try:
    from xmanager import xm, xm_local  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise SystemExit("error: launching needs XManager: "
                     f"pip install -c constraints.txt -e '.[launch]' ({e})")
  return xm, xm_local


def stage_source(parent: str) -> str:
  """Copies the repository without virtualenvs, workdirs and caches into
  ``parent/darl_jax`` (XManager sends the whole directory to the image build)."""
  dest = f"{parent}/{SOURCE_DIR}"
  shutil.copytree(common.REPO, dest, symlinks=True,
                  ignore=shutil.ignore_patterns(*common.SOURCE_EXCLUDES))
  return dest


def packageable(plan: VertexPlan, source: str):
  """The xm.Packageable of the image: ``source`` (from stage_source) built FROM
  the base image with the plan's Dockerfile lines, for the Vertex executor."""
  xm, xm_local = _xmanager()
  spec = xm.PythonContainer(path=source, base_image=plan.base_image,
                            docker_instructions=list(plan.docker_instructions),
                            entrypoint=xm.ModuleName("darl_jax.main"))
  return xm.Packageable(executable_spec=spec, executor_spec=xm_local.Vertex.Spec())


def job_group(plan: VertexPlan, executable):
  """What experiment.add gets: the chief's xm.Job alone, or an xm.JobGroup of
  the chief and the workers (Vertex's worker pools, in this order)."""
  xm, xm_local = _xmanager()
  jobs = {}
  for job in plan.jobs:
    executor = xm_local.Vertex(requirements=xm.JobRequirements(**requirements_kwargs(job)))
    jobs[job.name] = xm.Job(executable=executable, executor=executor, args=list(job.args),
                            env_vars=dict(job.env))
  return xm.JobGroup(**jobs) if len(jobs) > 1 else jobs["chief"]


def vertex_machine_spec(job, *, xmanager_spec) -> dict:
  """XManager's Vertex machine spec of ``job`` with the machine type of our
  table (xmanager's client picks n1-standard-4 for H100, H200, A100 80 GB)."""
  xm, _ = _xmanager()
  spec = xmanager_spec(job)
  [(resource, count)] = [(r, c) for r, c in job.executor.requirements.task_requirements.items()
                         if r in xm.AcceleratorType]
  hosts = [h for h in (*GPU_TOPOLOGIES.values(), *VERTEX_TPUS.values())
           if (h.resource, h.count) == (resource.name.lower(), int(count))]
  if len(hosts) != 1:
    raise ValueError(f"no Vertex machine in xm_launch's tables for {resource.name}={count}")
  spec["machine_type"] = hosts[0].machine_type
  return spec


def submit_options(plan: VertexPlan, *, names_only: bool = False) -> dict:
  """What ``aiplatform.CustomJob.submit`` gets beside XManager's arguments:
  every replica restarts when Vertex restarts one (a preempted or repaired
  worker; the run resumes from its checkpoint), and with ``plan.spot`` Spot
  VMs. ``names_only``: the strategy as its name (no aiplatform import), as
  --dry_run prints it."""
  options = {"restart_job_on_worker_restart": True}
  if plan.spot:
    if names_only:
      options["scheduling_strategy"] = "SPOT"
    else:
      from google.cloud.aiplatform_v1.types import custom_job  # pylint: disable=g-import-not-at-top
      options["scheduling_strategy"] = custom_job.Scheduling.Strategy.SPOT
  return options


@contextlib.contextmanager
def vertex_submit_options(plan: VertexPlan):
  """Adds ``submit_options(plan)`` to the ``CustomJob.submit`` call of
  XManager's Vertex client while it is open."""
  from xmanager.cloud import vertex  # pylint: disable=g-import-not-at-top
  job_class = vertex.aiplatform.CustomJob
  original = job_class.submit
  extra = submit_options(plan)

  def submit(self, **kwargs):
    return original(self, **{**kwargs, **extra})

  job_class.submit = submit
  try:
    yield
  finally:
    job_class.submit = original


@contextlib.contextmanager
def vertex_machine_types():
  """Makes XManager's Vertex client use vertex_machine_spec while it is open."""
  from xmanager.cloud import vertex  # pylint: disable=g-import-not-at-top
  original = vertex.get_machine_spec
  vertex.get_machine_spec = lambda job: vertex_machine_spec(job, xmanager_spec=original)
  try:
    yield
  finally:
    vertex.get_machine_spec = original


def launch_vertex(plan: VertexPlan) -> None:
  """Builds the container and starts the jobs with XManager."""
  _, xm_local = _xmanager()
  from absl import flags  # pylint: disable=g-import-not-at-top
  # XManager's cloud clients read absl flags; mark them parsed (defaults).
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(sys.argv[:1])
  with tempfile.TemporaryDirectory() as staging, vertex_machine_types(), \
      vertex_submit_options(plan), xm_local.create_experiment(experiment_title=plan.title) as experiment:
    [executable] = experiment.package([packageable(plan, stage_source(staging))])
    experiment.add(job_group(plan, executable))
  print(f"launched XManager experiment {plan.title!r}")


def parse(argv) -> tuple[argparse.Namespace, list[str]]:
  """``[prog, flags..., "--", main's flags...]`` -> (this script's flags, main's)."""
  own, passthrough = common.split_passthrough(argv)
  parser = argparse.ArgumentParser(prog="launch/xm_launch.py",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True, help="e.g. experiments/vit_l16_diff.py[:args]")
  parser.add_argument("--workdir", required=True, help="gs://bucket/dir")
  parser.add_argument("--platform", required=True, choices=("tpu", "gpu"))
  parser.add_argument("--topology", required=True,
                      help="tpu: v3-8, v5p-256, ...; gpu: one of " + ", ".join(GPU_TOPOLOGIES))
  parser.add_argument("--num_hosts", type=int, default=1, help="gpu: number of hosts")
  parser.add_argument("--cuda", default="12", choices=tuple(JAX_GPU_BUILDS),
                      help="gpu: CUDA version of the image's JAX build")
  parser.add_argument("--experiment_title", default=None)
  parser.add_argument("--base_image", default=BASE_IMAGE)
  parser.add_argument("--extras", default="tfds", help="setup.py extras for the image")
  parser.add_argument("--dry_run", action="store_true",
                      help="print what would be launched; needs no XManager")
  tpu_vm.add_tpu_flags(parser)
  return parser.parse_args(own[1:]), passthrough


def main(argv=None) -> None:
  args, passthrough = parse(sys.argv if argv is None else argv)
  prefix = "dry run (nothing is submitted): " if args.dry_run else ""

  if args.platform == "tpu" and args.topology not in VERTEX_TPUS:
    tpu_vm.parse_topology(args.topology)   # a clear error for a typo
    print(f"{prefix}{args.topology} is a multi-host TPU VM slice, which XManager's "
          "executors cannot start (Vertex AI: v2-8/v3-8 only); launching through "
          "launch/tpu_vm.py (gcloud) instead")
    tpu_vm.launch(args, passthrough, dry_run=args.dry_run)
    return
  plan = vertex_plan(args, passthrough)
  print(prefix + describe(plan))
  if not args.dry_run:
    launch_vertex(plan)


if __name__ == "__main__":
  main()
