"""Multi-process start-up: ``jax.distributed.initialize`` from the launcher's environment.

Every process of a multi-host job runs the same command; before anything
touches a device, ``initialize()`` connects it to the others. Where the
numbers come from, first match wins:

1. explicit: ``--coordinator`` / ``DARL_COORDINATOR`` (``host:port`` of process
   0) with ``--num_processes`` / ``DARL_NUM_PROCESSES`` and ``--process_id`` /
   ``DARL_PROCESS_ID`` (flags win over the environment);
2. a cluster that JAX detects by itself, recognised here from its environment
   variables: Slurm under ``srun`` (coordinator = first node of the step, port
   from the job id), Open MPI (``mpirun``), TPU slices on GKE
   (``TPU_WORKER_HOSTNAMES``);
3. Vertex AI custom jobs with several replicas: ``CLUSTER_SPEC`` (coordinator
   = the first replica of ``workerpool0``, process ids in pool order);
4. otherwise one process, and ``jax.distributed.initialize`` is *not* called.

Mode (``--distributed`` / ``DARL_DISTRIBUTED``): ``auto`` (the rules above),
``on`` (initialise even if none matched: ``jax.distributed.initialize()``
without arguments, which on a Cloud TPU VM reads the slice from the metadata
server; fail if JAX finds nothing) or ``off`` (never). The launchers in
``launch/`` set ``on``: a multi-host job that failed to find its peers must
stop, not run N independent copies that overwrite each other's workdir.

CPU processes use gloo collectives (JAX's default for
``jax_cpu_collectives_implementation``), so the same path runs two processes
on one laptop (``tests/test_multihost.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Mapping

from absl import flags, logging

ENV_MODE = "DARL_DISTRIBUTED"
ENV_COORDINATOR = "DARL_COORDINATOR"
ENV_NUM_PROCESSES = "DARL_NUM_PROCESSES"
ENV_PROCESS_ID = "DARL_PROCESS_ID"
MODES = ("auto", "on", "off")

# Flags default to None so that "not given" falls through to the environment;
# the environment is read at call time (tests and launchers set it per process).
_MODE = flags.DEFINE_enum(
    "distributed", None, list(MODES),
    f"Multi-process start-up: auto | on | off (default: ${ENV_MODE} or auto).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, f"host:port of process 0 (default: ${ENV_COORDINATOR}).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, f"Number of processes (default: ${ENV_NUM_PROCESSES}).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, f"This process's index (default: ${ENV_PROCESS_ID}).")


@dataclasses.dataclass(frozen=True)
class Plan:
  """How this process joins the job.

  ``kind``: ``single`` (no initialisation), ``explicit`` (all three numbers
  known here) or ``detect`` (``jax.distributed.initialize()`` finds them).
  ``source`` says where the decision came from, for the log and errors.
  """
  kind: str
  source: str
  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None


def _int(value, name: str) -> int | None:
  if value is None or value == "":
    return None
  try:
    return int(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _slurm_tasks(env: Mapping[str, str]) -> int:
  """Tasks of the current ``srun`` step; 0 outside one.

  JAX's own Slurm detection needs the step variables (a bare ``sbatch`` batch
  script has SLURM_NTASKS but no SLURM_STEP_NODELIST): a plain ``python`` in
  the batch script is one process, not N.
  """
  needed = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
            "SLURM_LOCALID")
  if not all(k in env for k in needed):
    return 0
  return _int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"], "SLURM_NTASKS") or 0


def _vertex_plan(env: Mapping[str, str]) -> Plan | None:
  """A Vertex AI custom job's ``CLUSTER_SPEC`` -> explicit plan (None: not one).

  ``{"cluster": {"workerpool0": ["host:port"], "workerpool1": [...], ...},
  "task": {"type": "workerpool1", "index": 3}}``. Processes are numbered
  through the pools in order, so the single replica of ``workerpool0`` (the
  chief, as Vertex requires) is process 0 and serves as the coordinator.
  """
  raw = env.get("CLUSTER_SPEC")
  if not raw:
    return None
  try:
    spec = json.loads(raw)
    cluster, task = spec["cluster"], spec["task"]
    pools = sorted(cluster, key=lambda name: (len(name), name))   # workerpool0..3
    sizes = {name: len(cluster[name]) for name in pools}
    total = sum(sizes.values())
    if total <= 1:
      return None
    offset = 0
    for name in pools:
      if name == task["type"]:
        break
      offset += sizes[name]
    else:
      raise KeyError(f"task type {task['type']!r} not in cluster {pools}")
    coordinator = cluster[pools[0]][0]
    return Plan("explicit", "Vertex AI CLUSTER_SPEC", coordinator, total,
                offset + int(task["index"]))
  except (ValueError, KeyError, TypeError, IndexError) as e:
    raise ValueError(f"cannot read Vertex AI CLUSTER_SPEC {raw!r}: {e}") from None


def detect(env: Mapping[str, str] | None = None, *, mode: str | None = None,
           coordinator: str | None = None, num_processes: int | None = None,
           process_id: int | None = None) -> Plan:
  """Decides how to start, from arguments (flags) and ``env``; touches nothing.

  Raises ValueError with the fix for incomplete or inconsistent settings.
  """
  env = os.environ if env is None else env
  mode = mode or env.get(ENV_MODE) or "auto"
  if mode not in MODES:
    raise ValueError(f"{ENV_MODE}/--distributed must be one of {', '.join(MODES)}, "
                     f"got {mode!r}")
  if mode == "off":
    return Plan("single", "--distributed=off")

  coordinator = coordinator or env.get(ENV_COORDINATOR) or None
  if num_processes is None:
    num_processes = _int(env.get(ENV_NUM_PROCESSES), ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _int(env.get(ENV_PROCESS_ID), ENV_PROCESS_ID)
  if coordinator:
    missing = [name for name, v in ((ENV_NUM_PROCESSES, num_processes),
                                    (ENV_PROCESS_ID, process_id)) if v is None]
    if missing:
      raise ValueError(f"a coordinator ({coordinator}) is set but {' and '.join(missing)} "
                       "is not: set all three (or --coordinator, --num_processes, "
                       "--process_id) on every process")
    if ":" not in coordinator:
      raise ValueError(f"coordinator must be host:port, got {coordinator!r}")
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(f"need 0 <= process_id < num_processes, got process_id="
                       f"{process_id}, num_processes={num_processes}")
    if num_processes == 1:
      return Plan("single", "explicit, one process")
    return Plan("explicit", "DARL_COORDINATOR / --coordinator", coordinator,
                num_processes, process_id)
  if num_processes is not None or process_id is not None:
    raise ValueError(f"{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID} are set but {ENV_COORDINATOR} "
                     "(host:port of process 0) is not")

  if _slurm_tasks(env) > 1:
    return Plan("detect", "Slurm")
  if (_int(env.get("OMPI_COMM_WORLD_SIZE"), "OMPI_COMM_WORLD_SIZE") or 0) > 1:
    return Plan("detect", "Open MPI")
  hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
  if len([h for h in hosts.split(",") if h]) > 1:
    return Plan("detect", "TPU slice (TPU_WORKER_HOSTNAMES)")
  vertex = _vertex_plan(env)
  if vertex is not None:
    return vertex
  if mode == "on":
    return Plan("detect", "--distributed=on (JAX cluster detection)")
  return Plan("single", "no multi-process environment found")


def plan_from_flags(env: Mapping[str, str] | None = None) -> Plan:
  """``detect`` with the absl flags of this module (when they were parsed)."""
  parsed = flags.FLAGS.is_parsed()
  value = lambda f: f.value if parsed else None
  return detect(env, mode=value(_MODE), coordinator=value(_COORDINATOR),
                num_processes=value(_NUM_PROCESSES), process_id=value(_PROCESS_ID))


def initialize(plan: Plan | None = None) -> Plan:
  """Connects this process to the job (if the plan says so); returns the plan.

  Must run before the first JAX call that touches a device (``jax.devices()``,
  any computation). A single-process plan does nothing, so the same entry
  point serves laptops and pods.
  """
  plan = plan or plan_from_flags()
  if plan.kind == "single":
    logging.info("single process (%s)", plan.source)
    return plan
  import jax  # pylint: disable=g-import-not-at-top
  logging.info("jax.distributed.initialize via %s: coordinator=%s num_processes=%s "
               "process_id=%s", plan.source, plan.coordinator or "(detected)",
               plan.num_processes or "(detected)",
               "(detected)" if plan.process_id is None else plan.process_id)
  try:
    jax.distributed.initialize(coordinator_address=plan.coordinator,
                               num_processes=plan.num_processes,
                               process_id=plan.process_id)
  except (ValueError, RuntimeError) as e:
    raise ValueError(f"multi-process start-up via {plan.source} failed: {e}. Set "
                     f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} "
                     f"explicitly, or {ENV_MODE}=off for a single process") from e
  logging.info("process %d of %d; %d local of %d devices", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  return plan
