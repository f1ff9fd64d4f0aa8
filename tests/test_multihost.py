"""Multi-process training: start-up from the environment, and a real 2-process run.

The 2-process run uses the production path end to end: ``python -m
darl_jax.main`` twice on localhost, joined through ``DARL_COORDINATOR`` /
``DARL_NUM_PROCESSES`` / ``DARL_PROCESS_ID`` with gloo CPU collectives, one
CPU device each, parameters FSDP-sharded across the two processes. It
trains, checkpoints, stops, resumes (collective Orbax save and restore),
evaluates and writes the prediction picture, and must reproduce one process
driving two devices.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import distributed
from darl_jax import metrics as metrics_lib
from xla_env import cpu_devices_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "tiny_config.py")

# --------------------------------------------------------------- start-up plan


def test_single_process_needs_no_initialisation():
  assert distributed.detect({}).kind == "single"
  assert distributed.detect({"DARL_DISTRIBUTED": "off", "SLURM_NTASKS": "8"}).kind == "single"
  # A plain `python` inside an sbatch script (no srun step) is one process.
  assert distributed.detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8"}).kind == "single"


def test_explicit_environment_and_flags():
  env = {"DARL_COORDINATOR": "10.0.0.1:1234", "DARL_NUM_PROCESSES": "4",
         "DARL_PROCESS_ID": "3"}
  plan = distributed.detect(env)
  assert (plan.kind, plan.coordinator, plan.num_processes, plan.process_id) == (
      "explicit", "10.0.0.1:1234", 4, 3)
  plan = distributed.detect(env, process_id=1)      # a flag wins over the environment
  assert plan.process_id == 1
  assert distributed.detect({**env, "DARL_NUM_PROCESSES": "1",
                             "DARL_PROCESS_ID": "0"}).kind == "single"


@pytest.mark.parametrize("env,message", [
    ({"DARL_COORDINATOR": "h:1"}, "DARL_NUM_PROCESSES and DARL_PROCESS_ID"),
    ({"DARL_COORDINATOR": "h", "DARL_NUM_PROCESSES": "2", "DARL_PROCESS_ID": "0"},
     "host:port"),
    ({"DARL_COORDINATOR": "h:1", "DARL_NUM_PROCESSES": "2", "DARL_PROCESS_ID": "2"},
     "process_id < num_processes"),
    ({"DARL_NUM_PROCESSES": "2"}, "DARL_COORDINATOR"),
    ({"DARL_DISTRIBUTED": "maybe"}, "auto, on, off"),
    ({"DARL_COORDINATOR": "h:1", "DARL_NUM_PROCESSES": "two", "DARL_PROCESS_ID": "0"},
     "must be an integer"),
])
def test_incomplete_settings_name_the_fix(env, message):
  with pytest.raises(ValueError, match=message):
    distributed.detect(env)


def test_clusters_that_jax_detects_itself():
  slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[01-04]", "SLURM_NTASKS": "32",
           "SLURM_PROCID": "5", "SLURM_LOCALID": "5"}
  assert distributed.detect(slurm) == distributed.Plan("detect", "Slurm")
  assert distributed.detect({**slurm, "SLURM_NTASKS": "1"}).kind == "single"
  assert distributed.detect({"OMPI_COMM_WORLD_SIZE": "2"}).source == "Open MPI"
  assert distributed.detect({"TPU_WORKER_HOSTNAMES": "a,b,c,d"}).kind == "detect"
  assert distributed.detect({"TPU_WORKER_HOSTNAMES": "a"}).kind == "single"
  # `on`: initialise even without a recognised environment (Cloud TPU VMs read
  # the slice from the metadata server inside jax.distributed.initialize).
  assert distributed.detect({"DARL_DISTRIBUTED": "on"}).kind == "detect"


def test_vertex_ai_cluster_spec():
  spec = {"cluster": {"workerpool0": ["chief-0:2222"],
                      "workerpool1": ["w-0:2222", "w-1:2222", "w-2:2222"]},
          "task": {"type": "workerpool1", "index": 2}}
  plan = distributed.detect({"CLUSTER_SPEC": json.dumps(spec)})
  assert (plan.kind, plan.coordinator, plan.num_processes, plan.process_id) == (
      "explicit", "chief-0:2222", 4, 3)
  spec["task"] = {"type": "workerpool0", "index": 0}
  assert distributed.detect({"CLUSTER_SPEC": json.dumps(spec)}).process_id == 0
  single = {"cluster": {"workerpool0": ["chief-0:2222"]},
            "task": {"type": "workerpool0", "index": 0}}
  assert distributed.detect({"CLUSTER_SPEC": json.dumps(single)}).kind == "single"
  with pytest.raises(ValueError, match="CLUSTER_SPEC"):
    distributed.detect({"CLUSTER_SPEC": "{not json"})


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("DARL_", "SLURM_"))}
  env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1", **extra)
  return env


def test_cli_rejects_a_coordinator_without_the_process_numbers(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "darl_jax.main", f"--config={TINY}", f"--workdir={tmp_path}"],
      cwd=ROOT, env=_env(DARL_COORDINATOR="127.0.0.1:1"), capture_output=True, text=True,
      timeout=120)
  assert proc.returncode == 1
  assert "DARL_NUM_PROCESSES and DARL_PROCESS_ID" in proc.stderr
  assert "Traceback" not in proc.stderr


# --------------------------------------------------------- a 2-process run


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(workdir, logs, overrides, *, processes: int, devices: int):
  """Starts ``processes`` copies of the training command; returns their Popens."""
  port = _free_port()
  procs = []
  for i in range(processes):
    extra = {"XLA_FLAGS": cpu_devices_flags(devices)}
    if processes > 1:
      extra.update(DARL_COORDINATOR=f"127.0.0.1:{port}", DARL_NUM_PROCESSES=str(processes),
                   DARL_PROCESS_ID=str(i))
    log = open(logs / f"{workdir.name}_{i}.log", "a")
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "darl_jax.main", f"--config={TINY}", f"--workdir={workdir}",
         *overrides], cwd=ROOT, env=_env(**extra), stdout=log, stderr=subprocess.STDOUT))
    log.close()
  return procs


def _wait(procs, logs, timeout: float) -> None:
  """Waits for all; on a failure or the timeout kills the rest and fails with the log."""
  deadline = time.time() + timeout
  try:
    while any(p.poll() is None for p in procs):
      failed = [p for p in procs if p.poll() not in (None, 0)]
      if failed or time.time() > deadline:
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  bad = [p for p in procs if p.returncode != 0]
  if bad:
    tails = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(logs.glob("*.log")))
    pytest.fail(f"{len(bad)} process(es) failed or timed out (exit {bad[0].returncode})\n{tails}")


def _logged(workdir):
  """step -> list of training losses, and step -> validation losses (file order)."""
  train, val = {}, {}
  for m in metrics_lib.read_metrics(str(workdir)):
    if "grad_norm" in m:
      train.setdefault(m["step"], []).append(m["loss"])
    if "val_loss" in m:
      val.setdefault(m["step"], []).append(m["val_loss"])
  return train, val


def test_two_processes_train_resume_and_match_one_process(tmp_path):
  logs = tmp_path / "logs"
  logs.mkdir()
  common = ["--config.total_steps=4", "--config.checkpoint_every_steps=2",
            "--config.eval_every_steps=4", "--config.eval_max_batches=0",
            "--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.sharding=fsdp"]
  multi, single = tmp_path / "multi", tmp_path / "single"
  # The reference (one process, two devices) runs beside the first half.
  first = _start(multi, logs, [*common, "--config.stop_after_steps=2"], processes=2, devices=1)
  ref = _start(single, logs, [*common, "--config.predictions.num_images=0"],
               processes=1, devices=2)
  _wait(first + ref, logs, timeout=400)
  assert checkpoint_lib.Checkpointer(str(multi / "checkpoints")).latest_step() == 2
  # A new pair of processes restores the FSDP-sharded state collectively.
  _wait(_start(multi, logs, common, processes=2, devices=1), logs, timeout=400)

  (train_m, val_m), (train_s, val_s) = _logged(multi), _logged(single)
  # Only process 0 writes: every step once, although two processes logged it.
  assert sorted(train_m) == [1, 2, 3, 4] and all(len(v) == 1 for v in train_m.values())
  assert list(val_m) == [4] and len(val_m[4]) == 1
  np.testing.assert_allclose([train_m[s][0] for s in range(1, 5)],
                             [train_s[s][0] for s in range(1, 5)], rtol=1e-5, atol=1e-6)
  # The validation loss averages every one of the 180 examples exactly once:
  # 90 per process, padded to 12 local batches of 8.
  np.testing.assert_allclose(val_m[4][0], val_s[4][0], rtol=1e-5)
  params_m, meta = checkpoint_lib.restore_params(str(multi))
  params_s, _ = checkpoint_lib.restore_params(str(single))
  assert meta["step"] == 4
  import jax  # pylint: disable=g-import-not-at-top
  for a, b in zip(jax.tree_util.tree_leaves(params_m), jax.tree_util.tree_leaves(params_s)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
  assert json.loads((multi / "config.json").read_text())["sharding"] == "fsdp"
  # Process 0 drew the picture from parameters sharded over both processes.
  assert (multi / "predictions.png").exists()
