"""The launchers' dry runs (and their submit paths with stand-in gcloud/sbatch).

No cloud access: dry runs print what would run; the submit paths are checked
with fake ``gcloud`` / ``sbatch`` executables that record their arguments.
"""

import importlib.util
import os
import pathlib
import shlex
import subprocess
import sys

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
  assert remote == ("cd ~/darl_jax && DARL_DISTRIBUTED=on python3 -m darl_jax.main "
                    f"--config=experiments/vit_l16_diff.py --workdir={GCS} "
                    "--config.total_steps=10")
  assert "xmanager" not in sys.modules


def test_xm_gpu_hosts_become_vertex_worker_pools(capsys):
  out = run(xm_launch, capsys, "--config=experiments/vit_h14_diff.py", "--platform=gpu",
            "--topology=a100-8", "--num_hosts=4", f"--workdir={GCS}", "--dry_run", "--",
            "--config.total_steps=10", "--config.kernels.attention=cudnn")
  assert "on Vertex AI" in out
  assert lines_with(out, "job chief: 1 replica(s), xm.JobRequirements(a100=8)")
  assert lines_with(out, "job workers: 3 replica(s), xm.JobRequirements(a100=8)")
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
    (["--platform=gpu", "--topology=h100-8", f"--workdir={GCS}"], "a100, l4"),
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
  assert "pip install -e '.[launch]'" in fail(
      xm_launch, capsys, "--config=experiments/vit_l16_diff.py", "--platform=gpu",
      "--topology=a100-8", f"--workdir={GCS}")


def test_xm_dry_run_as_a_script_needs_no_xmanager():
  proc = subprocess.run(
      [sys.executable, "launch/xm_launch.py", "--config=experiments/vit_l16_diff.py",
       "--platform=gpu", "--topology=l4-4", f"--workdir={GCS}", "--dry_run"],
      cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert "xm.JobRequirements(l4=4)" in proc.stdout


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
  assert remote.startswith("cd ~/darl_jax && nohup env DARL_DISTRIBUTED=on python3 -m "
                           "darl_jax.main --config=experiments/vit_b16_diff.py")
  assert remote.endswith("--config.batch_size=1024 > ~/darl_jax_run.log 2>&1 &")


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


# --------------------------------------------------------------------- Slurm


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
  assert text.rstrip().endswith(
      "srun --kill-on-bad-exit=1 python3 -m darl_jax.main "
      "--config=experiments/vit_l16_diff.py --workdir=/shared/l16 "
      "--config.kernels.attention=cudnn")
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
