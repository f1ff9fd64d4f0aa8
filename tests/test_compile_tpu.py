"""darl_jax/compile.py: the real train step compiled for a TPU topology on this
CPU host (libtpu from the ``tpu`` extra; skipped without it). Nothing here
opens a TPU: JAX stays on the CPU (conftest.py) and the topology is a
description (jax.experimental.topologies)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("libtpu")

from darl_jax import compile as compile_lib  # noqa: E402  pylint: disable=wrong-import-position
from darl_jax.train import fit  # noqa: E402  pylint: disable=wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import tiny_config  # noqa: E402  pylint: disable=wrong-import-position

TOPOLOGY = "v5e:2x2"     # 4 chips of 16 GiB


def test_tiny_config_compiles_for_a_tpu_topology_and_reports_per_chip(tmp_path):
  config = tiny_config.get_config("objective=diffusion")
  devices = compile_lib.topology_devices(TOPOLOGY)
  assert len(devices) == 4 and devices[0].platform == "tpu"
  report = compile_lib.compile_for_topology(config, devices, TOPOLOGY,
                                            save=str(tmp_path / "step.bin"))
  assert report.fits and report.device_kind == "TPU v5 lite"
  assert report.hbm == 16 * fit.GIB
  assert report.mesh == {"data": 4, "fsdp": 1, "tensor": 1}
  assert report.microbatch_size == 16
  t = report.train
  # The state (parameters, two Adam moments, step counters) and the batch
  # are the arguments; the donated state comes back as aliased outputs.
  assert t.arguments > 0 and t.aliased > 0
  assert 0 < t.total < report.hbm
  assert report.eval is not None and report.eval.total > 0
  assert report.model_flops > 0 and report.xla_seconds > 0 and 0 < report.mfu() < 1
  assert report.estimate.endswith("GiB")
  lines = "\n".join(report.lines())
  assert "4 x TPU v5 lite" in lines and "fits:" in lines
  assert (tmp_path / "step.bin").stat().st_size > 0
  # The same config with 4 microbatches: the same state and batch in.
  config.microbatch_size = 4
  accumulated = compile_lib.compile_for_topology(config, devices, TOPOLOGY)
  assert accumulated.microbatch_size == 4 and accumulated.fits
  assert accumulated.train.arguments == t.arguments
  # Its evaluation is the run's: the microbatch, not the batch, per program.
  assert accumulated.eval.arguments < report.eval.arguments     # a smaller batch in
  assert report.compile_seconds > 0 and report.as_dict()["compile_seconds"] > 0
  # Scanned blocks: XLA's cost model counts the scan's body once, so no step
  # time is read from it; memory and compile time are.
  config.microbatch_size = 0
  config.model.scan_layers = True
  scanned = compile_lib.compile_for_topology(config, devices, TOPOLOGY)
  assert scanned.fits and scanned.xla_seconds is None and scanned.mfu() is None
  assert scanned.compile_seconds > 0 and scanned.train.arguments == t.arguments


def test_compile_cli_says_when_a_step_does_not_fit_and_names_the_fix(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  out = tmp_path / "report.jsonl"
  proc = subprocess.run(
      [sys.executable, "-m", "darl_jax.compile", f"--config={ROOT}/tests/tiny_config.py",
       f"--topology={TOPOLOGY}", "--config.device_memory_gib=0.0003", f"--json={out}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "does NOT fit" in proc.stdout
  assert "--config.microbatch_size=" in proc.stdout or "model.remat=full" in proc.stdout
  row = json.loads(out.read_text())
  assert row["fits"] is False and row["chips"] == 4
  assert "--config.device_memory_gib=0.0003" in row["config"]


def test_an_unknown_topology_is_one_line_naming_valid_ones():
  with pytest.raises(ValueError, match="v5p:4x4x8"):
    compile_lib.topology_devices("v9x:1x1")


def test_fp8_is_refused_for_tpu_topologies_in_one_line():
  """No TPU generation the compile table covers (v4, v5e, v5p, v6e) has
  fp8 matrix units: the step is not compiled, and the line names bf16."""
  config = tiny_config.get_config()
  config.precision = "fp8"
  devices = compile_lib.topology_devices(TOPOLOGY)
  with pytest.raises(ValueError, match=r"TPU v5 lite has none: run with "
                                       r"--config\.precision=bf16$"):
    compile_lib.compile_for_topology(config, devices, TOPOLOGY)
