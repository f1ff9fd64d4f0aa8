"""The launchers' dry runs (and their submit paths with stand-in gcloud/sbatch).

No cloud access: dry runs print what would run; the submit paths are checked
with fake ``gcloud`` / ``sbatch`` executables that record their arguments; the
XManager launcher's objects are built with the real xmanager (the ``launch``
extra; skipped without it) and handed to its Vertex client, with only the
calls that would reach Google Cloud faked.
"""

import importlib.metadata
import importlib.util
import os
import pathlib
import pwd
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
sys.path.insert(0, str(LAUNCH))
import slurm  # noqa: E402  pylint: disable=g-import-not-at-top
import tpu_vm  # noqa: E402  pylint: disable=g-import-not-at-top
import xm_launch  # noqa: E402  pylint: disable=g-import-not-at-top

GCS = "gs://bucket/runs/l16"


def run(module, capsys, *argv):
  module.main([f"launch/{module.__name__}.py", *argv])
  return capsys.readouterr().out


def fail(module, capsys, *argv) -> str:
  with pytest.raises(SystemExit) as e:
    module.main([f"launch/{module.__name__}.py", *argv])
  return str(e.value)


def lines_with(out: str, *words) -> list[str]:
  return [l for l in out.splitlines() if all(w in l for w in words)]


# ------------------------------------------------------------------ XManager


def test_xm_tpu_slice_goes_through_the_tpu_vm_launcher(capsys):
  out = run(xm_launch, capsys, "--config=experiments/vit_l16_diff.py", "--platform=tpu",
            "--topology=v5p-256", f"--workdir={GCS}", "--tpu_name=darl-v5p",
            "--zone=us-east5-a", "--create", "--dry_run", "--", "--config.total_steps=10")
  assert "XManager's executors cannot start" in out and "launch/tpu_vm.py" in out
  [create] = lines_with(out, "tpu-vm create")
  assert shlex.split(create[2:]) == [
      "gcloud", "compute", "tpus", "tpu-vm", "create", "darl-v5p",
      "--accelerator-type=v5p-256", "--version=v2-alpha-tpuv5", "--zone=us-east5-a"]
  [train] = lines_with(out, "darl_jax.main")
  cmd = shlex.split(train[2:])
  assert cmd[:7] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "darl-v5p", "--worker=all"]
  remote = cmd[7].removeprefix("--command=")
  assert remote.startswith(
      "cd ~/darl_jax && for attempt in $(seq 0 3); do DARL_DISTRIBUTED=on python3 -m "
      f"darl_jax.main --config=experiments/vit_l16_diff.py --workdir={GCS} "
      "--config.total_steps=10; status=$?; [ $status -eq 143 ] || break;")
  assert "xmanager" not in sys.modules


def test_xm_gpu_hosts_become_vertex_worker_pools(capsys):
  out = run(xm_launch, capsys, "--config=experiments/vit_h14_diff.py", "--platform=gpu",
            "--topology=a100-8", "--num_hosts=4", f"--workdir={GCS}", "--dry_run", "--",
            "--config.total_steps=10", "--config.kernels.attention=cudnn")
  assert "on Vertex AI" in out
  assert lines_with(out, "job chief: 1 replica(s), xm.JobRequirements(a100=8), "
                    "machine a2-highgpu-8g")
  assert lines_with(out, "job workers: 3 replica(s), xm.JobRequirements(a100=8, replicas=3), "
                    "machine a2-highgpu-8g")
  assert lines_with(out, "RUN pip install", "'jax[cuda12]'", "-c constraints.txt")
  [every] = lines_with(out, "every replica runs:")
  assert every.endswith(
      "DARL_DISTRIBUTED=on python -m darl_jax.main --config=experiments/vit_h14_diff.py "
      f"--workdir={GCS} --config.total_steps=10 --config.kernels.attention=cudnn")
  assert "xmanager" not in sys.modules


def test_xm_single_host_tpu_uses_vertex_and_no_coordinator(capsys):
  out = run(xm_launch, capsys, "--config=experiments/vit_b16_mse.py:", "--platform=tpu",
            "--topology=v3-8", f"--workdir={GCS}", "--dry_run")
  assert lines_with(out, "job chief: 1 replica(s), xm.JobRequirements(tpu_v3=8)")
  assert not lines_with(out, "job workers")
  assert "DARL_DISTRIBUTED" not in out and "'jax[tpu]'" in out


@pytest.mark.parametrize("argv,message", [
    (["--platform=gpu", "--topology=a100-8", "--workdir=/tmp/run"], "must be on GCS"),
    (["--platform=gpu", "--topology=h100-4", f"--workdir={GCS}"], "one of: h100-8, h200-8"),
    (["--platform=gpu", "--topology=a100-3", f"--workdir={GCS}"], "a100-4, a100-8, a100-16"),
    (["--platform=gpu", "--topology=l4-4", "--num_hosts=0", f"--workdir={GCS}"],
     "--num_hosts must be positive"),
    (["--platform=tpu", "--topology=v9x-8", f"--workdir={GCS}"], "unknown TPU topology"),
    (["--platform=tpu", "--topology=v5p-16", f"--workdir={GCS}", "--zone=z"],
     "--tpu_name and --zone are required"),
])
def test_xm_bad_arguments_name_the_fix(capsys, argv, message):
  assert message in fail(xm_launch, capsys, "--config=experiments/vit_l16_diff.py", *argv,
                         "--dry_run")


def test_launchers_check_the_config_and_the_passthrough(capsys):
  common = ["--platform=gpu", "--topology=a100-8", f"--workdir={GCS}", "--dry_run"]
  assert "config file 'experiments/vit_l17.py' not found" in fail(
      xm_launch, capsys, "--config=experiments/vit_l17.py", *common)
  assert "must be flags" in fail(xm_launch, capsys, "--config=experiments/vit_l16_diff.py",
                                 *common, "--", "total_steps=10")


@pytest.mark.skipif(importlib.util.find_spec("xmanager") is not None,
                    reason="xmanager installed: this would really launch")
def test_xm_launch_without_xmanager_says_how_to_install_it(capsys):
  assert "pip install -c constraints.txt -e '.[launch]'" in fail(
      xm_launch, capsys, "--config=experiments/vit_l16_diff.py", "--platform=gpu",
      "--topology=a100-8", f"--workdir={GCS}")


def test_xm_dry_run_as_a_script_needs_no_xmanager():
  proc = subprocess.run(
      [sys.executable, "launch/xm_launch.py", "--config=experiments/vit_l16_diff.py",
       "--platform=gpu", "--topology=l4-4", f"--workdir={GCS}", "--dry_run"],
      cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert "xm.JobRequirements(l4_24th=4), machine g2-standard-48" in proc.stdout


# ------------------------------------------- XManager: the real objects, faked cloud
# Built with the xmanager that constraints.txt pins (the `launch` extra, in CI's
# install): pip install -c constraints.txt -e ".[tfds,test,launch]"

# What Vertex AI custom training offers, from its machine-type documentation:
# (machine type, accelerator, accelerators per machine). Written out here, not
# taken from the launcher, so that a wrong row of its table fails.
VERTEX_MACHINES = {
    ("a3-highgpu-8g", "NVIDIA_H100_80GB", 8),
    ("a3-ultragpu-8g", "NVIDIA_H200_141GB", 8),
    *((f"a2-ultragpu-{n}g", "NVIDIA_A100_80GB", n) for n in (1, 2, 4, 8)),
    *((f"a2-highgpu-{n}g", "NVIDIA_TESLA_A100", n) for n in (1, 2, 4, 8)),
    ("a2-megagpu-16g", "NVIDIA_TESLA_A100", 16),
    *((f"g2-standard-{c}", "NVIDIA_L4", 1) for c in (4, 8, 12, 16, 32)),
    ("g2-standard-24", "NVIDIA_L4", 2),
    ("g2-standard-48", "NVIDIA_L4", 4),
    ("g2-standard-96", "NVIDIA_L4", 8),
    ("cloud-tpu", "TPU_V2", 8),
    ("cloud-tpu", "TPU_V3", 8),
}
CASES = ([("gpu", t, hosts) for t in xm_launch.GPU_TOPOLOGIES for hosts in (1, 3)]
         + [("tpu", t, 1) for t in xm_launch.VERTEX_TPUS])
DRY_JOB = re.compile(r"job (\w+): (\d+) replica\(s\), xm\.JobRequirements\((.*)\), machine (\S+)")


@pytest.fixture
def xmanager():
  """xmanager's modules, or a skip naming the install."""
  pytest.importorskip("xmanager", reason='needs the launch extra: pip install -c '
                      'constraints.txt -e ".[tfds,test,launch]"')
  from xmanager import xm, xm_local  # pylint: disable=g-import-not-at-top
  from xmanager.cloud import build_image, vertex  # pylint: disable=g-import-not-at-top
  from xmanager.xm_local import executables  # pylint: disable=g-import-not-at-top
  return xm, xm_local, vertex, build_image, executables


@pytest.fixture
def vertex_submissions(xmanager, monkeypatch):
  """XManager's Vertex client with the Google Cloud calls faked: what it would
  submit (aiplatform.CustomJob's arguments) is appended to the returned list."""
  _, _, vertex, _, _ = xmanager
  submitted = []

  class CustomJob:   # google.cloud.aiplatform.CustomJob, recording instead of calling out
    def __init__(self, **kwargs):
      submitted.append(kwargs)

    def submit(self, **kwargs):
      submitted[-1]["submit"] = kwargs

    def _dashboard_uri(self):
      return "https://console.cloud.google.com/fake"

    resource_name = "projects/p/locations/us-central1/customJobs/1"

  monkeypatch.setattr(vertex.aiplatform, "init", lambda **kwargs: None)
  monkeypatch.setattr(vertex.aiplatform, "CustomJob", CustomJob)
  monkeypatch.setattr(vertex.auth, "get_bucket", lambda: "bucket")
  monkeypatch.setattr(vertex.auth, "get_service_account", lambda: "xm@p.iam.gserviceaccount.com")
  monkeypatch.setattr(vertex, "_default_client", vertex.Client(project="p"))
  return submitted


def launcher_argv(platform, topology, hosts):
  return ["launch/xm_launch.py", "--config=experiments/vit_l16_diff.py",
          f"--platform={platform}", f"--topology={topology}", f"--num_hosts={hosts}",
          f"--workdir={GCS}", "--dry_run", "--", "--config.total_steps=10"]


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("platform,topology,hosts", CASES)
def test_xm_objects_build_and_vertex_gets_the_dry_runs_jobs(xmanager, vertex_submissions,
                                                           capsys, platform, topology, hosts):
  xm, xm_local, vertex, build_image, executables = xmanager
  argv = launcher_argv(platform, topology, hosts)
  xm_launch.main(argv)
  dry = [DRY_JOB.fullmatch(l).groups() for l in capsys.readouterr().out.splitlines()
         if DRY_JOB.fullmatch(l)]
  plan = xm_launch.vertex_plan(*xm_launch.parse(argv))
  assert [d[0] for d in dry] == [j.name for j in plan.jobs] == (
      ["chief", "workers"] if hosts > 1 else ["chief"])

  # The container: xmanager's Dockerfile of it has the plan's lines after FROM.
  packageable = xm_launch.packageable(plan, source="/tmp/staged/darl_jax")
  spec = packageable.executable_spec
  assert isinstance(spec, xm.PythonContainer) and spec.path == "/tmp/staged/darl_jax"
  assert isinstance(packageable.executor_spec, xm_local.Vertex.Spec)
  dockerfile = pathlib.Path(build_image._create_dockerfile(spec, xm.SequentialArgs(), {}))
  text = dockerfile.read_text()
  dockerfile.unlink()
  assert f"FROM {xm_launch.BASE_IMAGE}\n" in text
  assert "\n".join(plan.docker_instructions) in text
  assert ("'jax[cuda12]'" if platform == "gpu" else "'jax[tpu]'") in text
  assert build_image._get_entrypoint_commands(spec) == 'python -m darl_jax.main "$@"'

  # The jobs, as experiment.add gets them, on the image experiment.package
  # would return once the container is built and pushed.
  image = executables.GoogleContainerRegistryImage(
      name="darl_jax", image_path="gcr.io/p/darl_jax:1", args=packageable.args,
      env_vars=packageable.env_vars)
  group = xm_launch.job_group(plan, image)
  jobs = list(group.jobs.values()) if hosts > 1 else [group]
  assert isinstance(group, xm.JobGroup if hosts > 1 else xm.Job)
  for job, planned, (_, replicas, kwargs, machine) in zip(jobs, plan.jobs, dry, strict=True):
    assert isinstance(job.executor, xm_local.Vertex)
    requirements = job.executor.requirements
    assert requirements.replicas == planned.replicas == int(replicas)
    assert kwargs == ", ".join(f"{k}={v}" for k, v in
                               xm_launch.requirements_kwargs(planned).items())
    assert machine == planned.host.machine_type
    assert requirements.accelerator.name.lower() == planned.host.resource
    assert requirements.task_requirements[requirements.accelerator] == planned.host.count

  # What XManager's Vertex client submits: one worker pool per job.
  with xm_launch.vertex_machine_types(), xm_launch.vertex_submit_options(plan):
    vertex.launch("darl", "1", group)
  assert vertex.get_machine_spec.__module__ == vertex.__name__   # restored
  assert vertex.aiplatform.CustomJob.submit.__qualname__.endswith("CustomJob.submit")
  [custom_job] = vertex_submissions
  pools = custom_job["worker_pool_specs"]
  assert len(pools) == len(plan.jobs)
  for pool, planned, (_, replicas, _, machine) in zip(pools, plan.jobs, dry, strict=True):
    ms = pool.machine_spec
    assert (ms.machine_type, ms.accelerator_type.name, ms.accelerator_count) in VERTEX_MACHINES
    assert ms.machine_type == machine and pool.replica_count == int(replicas)
    assert pool.container_spec.image_uri == "gcr.io/p/darl_jax:1"
    assert list(pool.container_spec.args) == planned.args
    env = {e.name: e.value for e in pool.container_spec.env}
    assert env == ({"DARL_DISTRIBUTED": "on"} if hosts > 1 else {})
  # A preempted or repaired worker restarts the whole job, which resumes.
  assert custom_job["submit"]["restart_job_on_worker_restart"] is True
  assert "scheduling_strategy" not in custom_job["submit"]
  # Vertex AI cannot run TPUs with a custom service account (xmanager drops it).
  assert custom_job["submit"]["service_account"] == (
      None if platform == "tpu" else "xm@p.iam.gserviceaccount.com")


@pytest.mark.usefixtures("no_network")
def test_xm_spot_asks_vertex_for_spot_vms(xmanager, vertex_submissions, capsys):
  xm, _, vertex, _, executables = xmanager
  argv = launcher_argv("gpu", "h100-8", 2)
  argv.insert(-2, "--spot")
  xm_launch.main(argv)
  assert lines_with(capsys.readouterr().out, "scheduling: restart_job_on_worker_restart=True, "
                    "scheduling_strategy=SPOT")
  plan = xm_launch.vertex_plan(*xm_launch.parse(argv))
  image = executables.GoogleContainerRegistryImage(name="darl_jax",
                                                   image_path="gcr.io/p/darl_jax:1")
  with xm_launch.vertex_machine_types(), xm_launch.vertex_submit_options(plan):
    vertex.launch("darl", "1", xm_launch.job_group(plan, image))
  from google.cloud.aiplatform_v1.types import custom_job  # pylint: disable=g-import-not-at-top
  [submitted] = vertex_submissions
  assert submitted["submit"]["scheduling_strategy"] == custom_job.Scheduling.Strategy.SPOT
  assert submitted["submit"]["restart_job_on_worker_restart"] is True


def test_xmanager_alone_gives_machines_vertex_does_not_offer(xmanager):
  """Why the launcher sets machine types: xmanager 0.8.5's Vertex client asks
  for n1-standard-4 for 8 H100, H200 or A100 80 GB. When this fails, xmanager
  picks them itself and xm_launch.vertex_machine_types may go."""
  xm, xm_local, vertex, _, _ = xmanager
  for resource in ("h100", "h200", "a100_80gib"):
    job = xm.Job(executable=None, executor=xm_local.Vertex(
        requirements=xm.JobRequirements(**{resource: 8})))
    assert vertex.get_machine_spec(job)["machine_type"] == "n1-standard-4"
  with pytest.raises(KeyError, match="Unknown ResourceType 'l4'"):
    xm.JobRequirements(l4=4)


def test_xm_launch_tables_name_xmanager_resources(xmanager):
  xm, _, _, _, _ = xmanager
  hosts = [*xm_launch.GPU_TOPOLOGIES.values(), *xm_launch.VERTEX_TPUS.values()]
  for host in hosts:
    assert xm.ResourceType[host.resource.upper()] in xm.AcceleratorType
  # vertex_machine_spec finds a job's machine by (resource, count): one row each.
  assert len({(h.resource, h.count) for h in hosts}) == len(hosts)


def test_xmanager_pin_is_the_one_installed_and_built_against():
  pins = dict(l.split("==") for l in (ROOT / "constraints.txt").read_text().splitlines()
              if "==" in l)
  setup = (ROOT / "setup.py").read_text()
  assert f'"launch": ["xmanager=={pins["xmanager"]}"]' in setup
  if importlib.util.find_spec("xmanager") is not None:
    assert importlib.metadata.version("xmanager") == pins["xmanager"]


def test_jax_pin_offers_the_images_cuda_builds():
  """The image installs jax[cuda12] (or --cuda=13) under constraints.txt's jax."""
  pins = dict(l.split("==") for l in (ROOT / "constraints.txt").read_text().splitlines()
              if "==" in l)
  assert importlib.metadata.version("jax") == pins["jax"]
  extras = importlib.metadata.metadata("jax").get_all("Provides-Extra")
  for build in xm_launch.JAX_GPU_BUILDS.values():
    assert build.removeprefix("jax[").removesuffix("]") in extras


def test_xm_cuda_13_image(capsys):
  out = run(xm_launch, capsys, "--config=experiments/vit_l16_diff.py", "--platform=gpu",
            "--topology=h200-8", "--cuda=13", f"--workdir={GCS}", "--dry_run")
  assert lines_with(out, "RUN pip install", "'jax[cuda13]'")


def test_xm_build_context_leaves_out_virtualenvs_and_runs(tmp_path):
  source = pathlib.Path(xm_launch.stage_source(str(tmp_path)))
  assert source.name == "darl_jax"
  for kept in ("setup.py", "constraints.txt", "darl_jax/main.py", "experiments/vit_l16_diff.py"):
    assert (source / kept).is_file(), kept
  for left_out in (".git", ".venv", "workdirs"):
    assert not (source / left_out).exists(), left_out
  assert not list(source.rglob("__pycache__"))


# -------------------------------------------------------------------- TPU VM


def test_tpu_vm_dry_run_copies_installs_and_runs_on_every_worker(capsys):
  out = run(tpu_vm, capsys, "--tpu_name=t1", "--zone=europe-west4-a", "--project=p",
            "--config=experiments/vit_b16_diff.py", f"--workdir={GCS}", "--detach",
            "--dry_run", "--", "--config.batch_size=1024")
  cmds = [shlex.split(l[2:]) for l in out.splitlines() if l.startswith("+ ")]
  assert [c[0] for c in cmds] == ["tar", "gcloud", "gcloud", "gcloud"]   # no create
  assert "--exclude=.venv" in cmds[0] and cmds[0][-3:] == ["-C", str(ROOT), "."]
  assert cmds[1][4] == "scp" and "--worker=all" in cmds[1] and "--project=p" in cmds[1]
  assert "pip install -q -c constraints.txt -e '.[tfds]' 'jax[tpu]'" in cmds[2][7]
  remote = cmds[3][7].removeprefix("--command=")
  assert remote.startswith("cd ~/darl_jax && nohup bash -c ")
  assert remote.endswith(" > ~/darl_jax_run.log 2>&1 &")
  [loop] = shlex.split(remote.removeprefix("cd ~/darl_jax && nohup bash -c ").removesuffix(
      " > ~/darl_jax_run.log 2>&1 &"))
  assert ("DARL_DISTRIBUTED=on python3 -m darl_jax.main --config=experiments/vit_b16_diff.py "
          f"--workdir={GCS} --config.batch_size=1024; status=$?") in loop


def _run_remote(tmp_path, remote: str, statuses: list[int]) -> tuple[int, list[str]]:
  """Runs a TPU VM's remote command in bash, in a home with ~/darl_jax, where
  ``python3`` is a stand-in exiting with ``statuses`` in turn; returns the
  exit status and the stand-in's calls (its arguments)."""
  home = tmp_path / "home"
  (home / "darl_jax").mkdir(parents=True)
  calls = tmp_path / "calls"
  table = " ".join(str(s) for s in statuses)
  env = stand_in(tmp_path, "python3",
                 f'echo "$*" >> {calls}; n=$(wc -l < {calls}); set -- {table}; '
                 'shift $((n - 1)); exit $1')
  proc = subprocess.run(["bash", "-c", remote], env={**env, "HOME": str(home)},
                        capture_output=True, text=True, timeout=60)
  return proc.returncode, calls.read_text().splitlines()


@pytest.mark.parametrize("statuses,runs,status", [
    ([143, 143, 0], 3, 0),        # preempted twice, then done
    ([143, 143, 143, 143, 143], 4, 143),   # --max_restarts=3: four runs at most
    ([1, 0], 1, 1),               # a failure is not rerun
])
def test_tpu_vm_reruns_the_training_while_it_stops_at_a_preemption(
    capsys, tmp_path, statuses, runs, status):
  out = run(tpu_vm, capsys, "--tpu_name=t1", "--zone=z", "--steps=run",
            "--config=experiments/vit_b16_diff.py", f"--workdir={GCS}", "--dry_run")
  [ssh] = [shlex.split(l[2:]) for l in out.splitlines() if l.startswith("+ ")]
  got, calls = _run_remote(tmp_path, ssh[7].removeprefix("--command="), statuses)
  assert (got, len(calls)) == (status, runs)
  assert set(calls) == {"-m darl_jax.main --config=experiments/vit_b16_diff.py "
                        f"--workdir={GCS}"}


def test_the_launchers_requeue_on_the_status_a_preempted_run_exits_with():
  import launchlib  # pylint: disable=g-import-not-at-top
  from darl_jax import preemption  # pylint: disable=g-import-not-at-top
  assert launchlib.PREEMPTED == slurm.PREEMPTED == preemption.EXIT_STATUS == 143


def test_tpu_vm_max_restarts_zero_is_the_plain_command(capsys):
  out = run(tpu_vm, capsys, "--tpu_name=t1", "--zone=z", "--steps=run", "--max_restarts=0",
            "--config=experiments/vit_b16_diff.py", f"--workdir={GCS}", "--dry_run")
  assert "--command=cd ~/darl_jax && DARL_DISTRIBUTED=on python3 -m darl_jax.main " \
         "--config=experiments/vit_b16_diff.py" in out and "seq" not in out
  assert "--max_restarts must be >= 0" in fail(
      tpu_vm, capsys, "--tpu_name=t1", "--zone=z", "--steps=run", "--max_restarts=-1",
      "--config=experiments/vit_b16_diff.py", f"--workdir={GCS}", "--dry_run")


def stand_in(tmp_path, tool: str, line: str) -> dict:
  """An environment whose PATH finds a shell-script ``tool`` that runs ``line``."""
  fake = tmp_path / "bin"
  fake.mkdir()
  (fake / tool).write_text(f"#!/bin/sh\n{line}\n")
  (fake / tool).chmod(0o755)
  return dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")


def test_tpu_vm_submit_path_with_a_stand_in_gcloud(tmp_path):
  env = stand_in(tmp_path, "gcloud", f'printf "%s\\n" "$@" > {tmp_path}/args')
  proc = subprocess.run(
      [sys.executable, "launch/tpu_vm.py", "--tpu_name=t1", "--zone=z", "--steps=run",
       "--config=experiments/vit_b16_diff.py", f"--workdir={GCS}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  args = (tmp_path / "args").read_text().splitlines()
  assert args[:6] == ["compute", "tpus", "tpu-vm", "ssh", "t1", "--worker=all"]
  assert "DARL_DISTRIBUTED=on python3 -m darl_jax.main" in args[6]


def test_tpu_vm_packs_the_tree_in_a_private_folder_and_removes_it(tmp_path):
  """With stand-in ``tar`` (recording the archive's folder and its mode) and
  ``gcloud``: the archive is made in a folder only this user can open, and
  the folder is gone once the launcher ends."""
  env = stand_in(tmp_path, "tar",
                 f'd=$(dirname "$2"); stat -c "%a %U" "$d" > {tmp_path}/mode; '
                 f'echo "$d" > {tmp_path}/folder; echo archive > "$2"')
  (tmp_path / "bin" / "gcloud").write_text(
      f'#!/bin/sh\nfor a in "$@"; do [ -f "$a" ] && echo "$a" >> {tmp_path}/sent; done; exit 0\n')
  (tmp_path / "bin" / "gcloud").chmod(0o755)
  proc = subprocess.run(
      [sys.executable, "launch/tpu_vm.py", "--tpu_name=t1", "--zone=z", "--steps=copy"],
      cwd=ROOT, env={**env, "TMPDIR": str(tmp_path)}, capture_output=True, text=True,
      timeout=60)
  assert proc.returncode == 0, proc.stderr
  folder = (tmp_path / "folder").read_text().strip()
  assert (tmp_path / "mode").read_text().split() == ["700", pwd.getpwuid(os.getuid()).pw_name]
  assert (tmp_path / "sent").read_text().split() == [f"{folder}/darl_jax.tar.gz"]
  assert not os.path.exists(folder)


# --------------------------------------------------------------------- Slurm


def sbatch_arguments(line: str, old: bool = False) -> list[str]:
  """The arguments sbatch reads from an ``#SBATCH`` line (a port of the
  parser of src/sbatch/opt.c, ``_get_argument``): a backslash makes the next
  character literal, single or double quotes keep spaces, an unquoted ``#``
  starts a comment. ``old=True``: the parser of older releases, where only
  double quotes quote and ``#`` ends the line even inside them."""
  assert line.startswith("#SBATCH ")
  rest, out = line[len("#SBATCH"):], []
  while True:
    rest = rest.lstrip()
    if not rest:
      return out
    arg, i, quote, escape = "", 0, "", False
    while i < len(rest) and (quote or not rest[i].isspace()):
      ch = rest[i]
      i += 1
      if escape:
        escape = False
      elif ch == "\\":
        escape = True
        continue
      elif quote and ch == quote:
        quote = ""
        continue
      elif ch == "#" and (old or not quote):
        return out + ([arg] if arg else [])
      elif not quote and (ch == '"' or (ch == "'" and not old)):
        quote = ch
        continue
      arg += ch
    assert not quote, f"unmatched quote in {line!r}"
    out.append(arg)
    rest = rest[i:]


AWKWARD = {"--job_name": "exp#3 it's \"a\" b\\c", "--account": "team's #1",
           "--partition": "gpu a"}


def test_slurm_quotes_every_value_that_is_not_plainly_safe(capsys, tmp_path):
  workdir = "/shared/it's #3/\"run\" x"
  out = run(slurm, capsys, "--config=experiments/vit_l16_diff.py", f"--workdir={workdir}",
            f"--log_dir={tmp_path}/l#gs", *(f"{k}={v}" for k, v in AWKWARD.items()),
            "--dry_run", "--", "--config.data.name=it's #1 \"x\"")
  text = _script(out)
  sbatch = {}
  for line in text.splitlines():
    if line.startswith("#SBATCH"):
      for old in (False, True):
        [arg] = sbatch_arguments(line, old=old)
        name, _, value = arg.partition("=")
        assert sbatch.setdefault(name, value) == value, (line, old)
  assert sbatch["--job-name"] == AWKWARD["--job_name"]
  assert sbatch["--account"] == AWKWARD["--account"]
  assert sbatch["--partition"] == AWKWARD["--partition"]
  assert sbatch["--output"] == f"{tmp_path}/l#gs/%x-%j.out"
  assert sbatch["--signal"] == "USR1@90" and "#SBATCH --signal=USR1@90" in text
  # The command line: a shell round trip gives back every argument.
  [srun] = [l for l in text.splitlines() if l.startswith("srun ")]
  assert shlex.split(srun)[2:] == [
      "python3", "-m", "darl_jax.main", "--config=experiments/vit_l16_diff.py",
      f"--workdir={workdir}", "--config.data.name=it's #1 \"x\"", "||", "status=$?"]
  env = stand_in(tmp_path, "srun", f'printf "%s\\n" "$@" > "{tmp_path}/srun_args"')
  (tmp_path / "job.sbatch").write_text(text.replace(f"cd {shlex.quote(str(ROOT))}", "cd ."))
  proc = subprocess.run(["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert (tmp_path / "srun_args").read_text().splitlines()[-2:] == [
      f"--workdir={workdir}", "--config.data.name=it's #1 \"x\""]


@pytest.mark.parametrize("argv", [
    ["--account=acct\nsrun rm -rf ~"], ["--job_name=a\rb"], ["--partition=gpu\x1b"],
    ["--workdir=/shared/a\nb"], ["--", "--config.data.name=a\nb"]])
def test_slurm_refuses_newlines_and_control_characters(capsys, argv):
  base = ["--config=experiments/vit_l16_diff.py", "--dry_run"]
  if not any(a.startswith("--workdir") for a in argv):
    base.append("--workdir=/shared/l16")
  if argv[0] == "--":
    argv = base + argv
  else:
    argv = argv + base
  message = fail(slurm, capsys, *argv)
  assert message.startswith("error: ") and "\n" not in message
  assert "newline or another control character" in message and "remove it" in message
  assert "SBATCH" not in capsys.readouterr().out


def _slurm(capsys, *argv):
  return run(slurm, capsys, "--config=experiments/vit_l16_diff.py", "--workdir=/shared/l16",
             "--dry_run", *argv)


def _script(out: str) -> str:
  return out.split(":\n", 1)[1].rsplit("+ sbatch", 1)[0]


def test_slurm_one_process_per_gpu(capsys, tmp_path):
  out = _slurm(capsys, "--nodes=4", "--gpus_per_node=8", "--partition=gpu", "--",
               "--config.kernels.attention=cudnn")
  text = _script(out)
  for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8",
               "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
               "export DARL_DISTRIBUTED=on"):
    assert line in text.splitlines(), line
  assert "JAX_LOCAL_DEVICE_IDS" not in text    # JAX picks GPU $SLURM_LOCALID per task
  assert ("srun --kill-on-bad-exit=1 python3 -m darl_jax.main "
          "--config=experiments/vit_l16_diff.py --workdir=/shared/l16 "
          "--config.kernels.attention=cudnn || status=$?") in text.splitlines()
  for line in ("#SBATCH --requeue", "#SBATCH --signal=USR1@90", "#SBATCH --open-mode=append"):
    assert line in text.splitlines(), line
  assert lines_with(out, "+ sbatch", "darl.sbatch")
  (tmp_path / "job.sbatch").write_text(text)
  check = subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], capture_output=True,
                         text=True)
  assert check.returncode == 0, check.stderr


def test_slurm_one_process_per_node_sees_all_gpus(capsys):
  text = _script(_slurm(capsys, "--nodes=2", "--gpus_per_node=4", "--processes=per_node",
                        "--port=12345", "--venv=/shared/venv"))
  lines = text.splitlines()
  assert "#SBATCH --ntasks-per-node=1" in lines
  assert any(l.startswith("export JAX_LOCAL_DEVICE_IDS=0,1,2,3") for l in lines)
  assert "export JAX_COORDINATOR_PORT=12345" in lines
  assert "source /shared/venv/bin/activate" in lines


def test_slurm_submit_path_with_a_stand_in_sbatch(tmp_path):
  env = stand_in(tmp_path, "sbatch", f'echo "$1" > {tmp_path}/submitted')
  proc = subprocess.run(
      [sys.executable, "launch/slurm.py", "--config=experiments/vit_l16_diff.py",
       "--workdir=/shared/l16", f"--log_dir={tmp_path}/logs", "--job_name=l16"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  submitted = (tmp_path / "submitted").read_text().strip()
  assert submitted == f"{tmp_path}/logs/l16.sbatch"
  assert "srun --kill-on-bad-exit=1" in pathlib.Path(submitted).read_text()


def _slurm_job(tmp_path, capsys, srun: str, *argv):
  """The sbatch script in a real bash with stand-in ``srun`` (running the
  shell line ``srun``) and ``scontrol`` (recording its arguments); returns
  the bash process (started) and the file scontrol writes."""
  text = _script(_slurm(capsys, *argv))
  requeued = tmp_path / "scontrol_args"
  env = stand_in(tmp_path, "srun", srun)
  (tmp_path / "bin" / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {requeued}\n')
  (tmp_path / "bin" / "scontrol").chmod(0o755)
  (tmp_path / "job.sbatch").write_text(text.replace(f"cd {shlex.quote(str(ROOT))}", "cd ."))
  proc = subprocess.Popen(["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path,
                          env={**env, "SLURM_JOB_ID": "4242"}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  return proc, requeued


@pytest.mark.parametrize("srun_status,requeued", [(143, True), (0, False), (1, False)])
def test_slurm_requeues_the_job_when_the_training_stops_at_a_preemption(
    capsys, tmp_path, srun_status, requeued):
  proc, args = _slurm_job(tmp_path, capsys, f"exit {srun_status}")
  out, _ = proc.communicate(timeout=60)
  assert proc.returncode == srun_status, out
  assert (args.read_text().split() if args.exists() else []) == (
      ["requeue", "4242"] if requeued else [])


def test_slurm_batch_shell_outlives_sigterm_to_requeue(capsys, tmp_path):
  """Slurm's SIGTERM reaches the batch shell too: it waits for the tasks
  (here a stand-in srun that saves for a second, then exits 143) and
  requeues."""
  proc, args = _slurm_job(tmp_path, capsys, f"touch {tmp_path}/started; sleep 1; exit 143")
  deadline = time.time() + 30
  while not (tmp_path / "started").exists() and time.time() < deadline:
    time.sleep(0.02)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=60)
  assert proc.returncode == 143 and "batch shell: SIGTERM" in out, out
  assert args.read_text().split() == ["requeue", "4242"]


def test_slurm_no_requeue_is_the_plain_job(capsys):
  text = _script(_slurm(capsys, "--no-requeue"))
  assert not [l for l in text.splitlines() if "requeue" in l or "--signal" in l or "trap" in l]
  assert text.rstrip().splitlines()[-1].startswith("srun --kill-on-bad-exit=1 python3 -m")
  assert "--notice_s must be a positive" in fail(
      slurm, capsys, "--config=experiments/vit_l16_diff.py", "--workdir=/shared/l16",
      "--notice_s=0", "--dry_run")


def test_slurm_notice_seconds(capsys):
  text = _script(_slurm(capsys, "--notice_s=300"))
  assert "#SBATCH --signal=USR1@300" in text.splitlines()


# ------------------------------------------ flag names, quoting, the docs' commands
# Long options as sbatch(1) and `gcloud compute tpus tpu-vm create|ssh|scp`
# document them; neither tool exists here, so the generated lines are
# shell-parsed and checked against these names.
SBATCH_OPTIONS = {"--job-name", "--nodes", "--ntasks-per-node", "--gpus-per-node",
                  "--cpus-per-task", "--time", "--output", "--partition", "--account",
                  "--requeue", "--signal", "--open-mode"}
GCLOUD_TPU_VM_FLAGS = {
    "create": {"--accelerator-type", "--version", "--zone", "--project", "--spot"},
    "ssh": {"--worker", "--command", "--zone", "--project"},
    "scp": {"--worker", "--zone", "--project"},
}
SPACED = "/shared/my runs/l16 a"   # a path with spaces


def _flag_names(args):
  return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def test_slurm_sbatch_lines_are_documented_options_and_quote_spaces(capsys, tmp_path):
  out = run(slurm, capsys, "--config=experiments/vit_l16_diff.py", f"--workdir={SPACED}",
            f"--log_dir={tmp_path}/my logs", "--partition=gpu", "--account=acct",
            "--job_name=l16", "--dry_run", "--", "--config.total_steps=10")
  text = _script(out)
  sbatch = [shlex.split(l.removeprefix("#SBATCH ")) for l in text.splitlines()
            if l.startswith("#SBATCH")]
  assert all(len(words) == 1 for words in sbatch), sbatch   # one option a line
  options = dict((w[0].split("=", 1) + [""])[:2] for w in sbatch)
  assert set(options) == SBATCH_OPTIONS
  assert options["--signal"] == "USR1@90" and options["--requeue"] == ""
  assert options["--output"] == f"{tmp_path}/my logs/%x-%j.out"
  [submit] = lines_with(out, "+ sbatch")
  assert shlex.split(submit[2:]) == ["sbatch", f"{tmp_path}/my logs/l16.sbatch"]

  # The script in a real bash, with a stand-in srun that records its arguments.
  env = stand_in(tmp_path, "srun", f'printf "%s\\n" "$@" > "{tmp_path}/srun_args"')
  script_file = tmp_path / "job.sbatch"
  script_file.write_text(text)
  proc = subprocess.run(["bash", str(script_file)], env=env, capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert (tmp_path / "srun_args").read_text().splitlines() == [
      "--kill-on-bad-exit=1", "python3", "-m", "darl_jax.main",
      "--config=experiments/vit_l16_diff.py", f"--workdir={SPACED}", "--config.total_steps=10"]


def test_tpu_vm_gcloud_lines_use_documented_flags_and_quote_spaces(capsys):
  out = run(tpu_vm, capsys, "--tpu_name=t1", "--zone=us-east5-a", "--project=p",
            "--topology=v5p-16", "--create", "--spot", "--remote_dir=my code",
            "--max_restarts=0",
            "--config=experiments/vit_l16_diff.py", f"--workdir=gs://bucket/my runs",
            "--dry_run", "--", "--config.total_steps=10")
  cmds = [shlex.split(l[2:]) for l in out.splitlines() if l.startswith("+ ")]
  gcloud = [c for c in cmds if c[0] == "gcloud"]
  assert [c[4] for c in gcloud] == ["create", "scp", "ssh", "ssh"]
  for cmd in gcloud:
    assert cmd[:4] == ["gcloud", "compute", "tpus", "tpu-vm"]
    assert _flag_names(cmd[5:]) <= GCLOUD_TPU_VM_FLAGS[cmd[4]], cmd
  create, scp, setup, train = gcloud
  assert create[5] == "t1" and "--accelerator-type=v5p-16" in create and "--spot" in create
  [tar] = [c for c in cmds if c[0] == "tar"]
  assert scp[5] == tar[2] and scp[6] == "t1:darl_jax.tar.gz"
  assert os.path.dirname(scp[5]) != tempfile.gettempdir()     # a private folder, gone
  assert not os.path.exists(os.path.dirname(scp[5]))
  remote = shlex.split(setup[7].removeprefix("--command="))
  assert remote[:3] == ["mkdir", "-p", "~/my code"]   # the remote bash expands ~/'my code'
  remote = shlex.split(train[7].removeprefix("--command="))
  assert remote[:3] == ["cd", "~/my code", "&&"]
  assert remote[3:] == ["DARL_DISTRIBUTED=on", "python3", "-m", "darl_jax.main",
                        "--config=experiments/vit_l16_diff.py", "--workdir=gs://bucket/my runs",
                        "--config.total_steps=10"]


def docs_commands() -> list[list[str]]:
  """The launch commands of docs/LAUNCH.md, placeholders filled in."""
  text = (ROOT / "docs" / "LAUNCH.md").read_text()
  blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
  lines = [l for b in blocks for l in b.splitlines() if l.startswith("python launch/")]
  fill = {"<bucket>": "bucket", "<partition>": "gpu"}
  return [shlex.split(re.sub("|".join(fill), lambda m: fill[m.group(0)], l)) for l in lines]


def test_docs_have_one_command_per_platform():
  assert [(c[1], c[3] if "xm_launch" in c[1] else "") for c in docs_commands()] == [
      ("launch/xm_launch.py", "--platform=gpu"), ("launch/xm_launch.py", "--platform=tpu"),
      ("launch/tpu_vm.py", ""), ("launch/slurm.py", "")]


@pytest.mark.parametrize("cmd", docs_commands(), ids=lambda c: f"{c[1]}:{c[3]}")
def test_docs_launch_commands_dry_run(capsys, cmd):
  module = {"launch/xm_launch.py": xm_launch, "launch/tpu_vm.py": tpu_vm,
            "launch/slurm.py": slurm}[cmd[1]]
  i = cmd.index("--") if "--" in cmd else len(cmd)
  module.main([*cmd[1:i], "--dry_run", *cmd[i:]])
  out = capsys.readouterr().out
  assert "darl_jax" in out and ("dry run" in out)
