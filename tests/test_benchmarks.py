"""The benchmark scripts still run (CPU smoke runs; their numbers are for GPUs)."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from xla_env import cpu_devices_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(script, *args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  return done.stdout


def test_pretrain_benchmark_prints_a_row_per_case():
  out = run("pretrain_benchmark.py", "--cases=mu/16:mse:2,mu/16:diffusion:2", "--timm_batch=0",
            "--steps=2", "--warmup=1")
  rows = [line for line in out.splitlines() if line.startswith("| mu/16")]
  assert [r.split("|")[1].strip() for r in rows] == ["mu/16 mse", "mu/16 diffusion"]


def test_compile_benchmark_prints_both_forms_of_a_case():
  out = run("compile_benchmark.py", "--cases=mu/16:diffusion:2", "--steps=2")
  rows = [line.split("|") for line in out.splitlines() if line.startswith("| mu/16")]
  assert [(r[1].strip(), r[2].strip()) for r in rows] == [
      ("mu/16:diffusion:2", "unrolled"), ("mu/16:diffusion:2", "scanned")]
  assert all(float(r[7]) > 0 for r in rows)    # ms per step


def test_fp8_matmul_bench_prints_each_measurement_as_it_lands():
  out = run("fp8_matmul_bench.py", "--variant=B/16", "--batch=1", "--shapes=proj",
            "--paths=bf16,fp8 raw,fp8 rows,fp8 delayed", "--no-block", "--iters=1", "--reps=1")
  lines = [line.split() for line in out.splitlines() if "(compile" in line]
  assert [" ".join(l[:-5]) for l in lines] == [
      "fp8 raw fwd", "bf16 fwd", "bf16 fwd+bwd", "fp8 rows fwd", "fp8 rows fwd+bwd",
      "fp8 delayed fwd", "fp8 delayed fwd+bwd"]
  result = json.loads(out.splitlines()[-1])
  assert list(result["matmul"]["proj"]) == [" ".join(l[:-5]) for l in lines]
  assert all(v > 0 for v in result["matmul"]["proj"].values())
  assert result["mlp_block"] == {}
  # The MLP block, its two layers each with a history of its own.
  out = run("fp8_matmul_bench.py", "--variant=B/16", "--batch=1", "--shapes=proj",
            "--paths=fp8 delayed", "--iters=1", "--reps=1")
  assert json.loads(out.splitlines()[-1])["mlp_block"]["fp8 delayed"] > 0
  bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_matmul_bench.py"),
                        "--paths=bf16,fp8 fast"], capture_output=True, text=True, cwd=ROOT)
  assert bad.returncode == 2 and "--paths: unknown fp8 fast; choose from" in bad.stderr


def test_step_benchmarks_start_jax_with_the_clis_gpu_pool(monkeypatch):
  """The step is timed in the pool a training run gets (or XLA's, asked
  for); the environment's own setting wins."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import pretrain_benchmark as bench
  from darl_jax import main as main_lib
  for name in ("XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_PYTHON_CLIENT_MEM_FRACTION",
               "JAX_PJRT_CLIENT_CREATE_OPTIONS"):
    monkeypatch.delenv(name, raising=False)
  bench.use_allocator("bfc")
  assert "XLA_PYTHON_CLIENT_ALLOCATOR" not in os.environ
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")
  bench.use_allocator("cli")
  assert os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] == "cuda_async"
  assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8"
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
  bench.use_allocator("cli")
  assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == main_lib.GPU_MEMORY_FRACTION


def test_pretrain_benchmark_target_status():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import pretrain_benchmark as bench
  row = lambda case, mfu, ips: dict(case=case, mfu=mfu, img_s=ips)
  assert bench.target_status(row("B/16 mse", 0.41, 1.0), None).startswith("met")
  assert bench.target_status(row("B/16 mse", 0.39, 1.0), None).startswith("not met")
  # L/16 needs both the MFU and 1.2x the fastest timm row.
  assert bench.target_status(row("L/16 mse", 0.51, 1300), 1000).startswith("met")
  assert bench.target_status(row("L/16 mse", 0.51, 1100), 1000) == (
      "not met: >= 1.2x timm; met: MFU >= 0.5")
  assert bench.target_status(row("L/16 mse", 0.4996, 1300), 1000) == (
      "not met: MFU >= 0.5; met: >= 1.2x timm")
  assert bench.target_status(row("L/16 mse", 0.45, 1100), 1000) == (
      "not met: MFU >= 0.5, >= 1.2x timm")
  assert bench.target_status(row("mu/16 mse", 0.1, 1.0), None) == ""


def test_layer_norm_bench_checks_and_times_each_setting():
  out = run("layer_norm_bench.py", "--shape=mu/16:1", "--blocks=4x2:4x2x3,8x4:2x2x5", "--iters=1")
  rows = [r for r in out.splitlines() if r.startswith("| ") and "ms" not in r and "---" not in r]
  assert [r.split("|")[1].strip() for r in rows] == [
      "XLA (nn.LayerNorm)", "kernels 4x2:4x2x3", "kernels 8x4:2x2x5",
      "XLA add, XLA norm", "XLA add, kernels", "add_layer_norm (fused)",
      "XLA's branch-bias sum (before), default blocks", "kernel sum, 4x2:4x2x3",
      "kernel sum, 8x4:2x2x5"]
  for r in rows[:3]:   # the kernels agree with float32 as XLA's LayerNorm does
    err_y = float(r.split("|")[6])
    assert err_y < 5e-3, r
  for r in rows[3:6]:   # and with the add before the norm
    cells = r.split("|")
    assert float(cells[4]) < 5e-3, r
    assert all(float(e) < 5e-3 for e in cells[5].split(",")), r
  for r in rows[6:]:   # the kernel's branch-bias gradient is XLA's sum
    assert float(r.split("|")[3]) < 1e-5, r


def test_kernel_check_reports_small_errors():
  """kernel_check.py's tiny shapes in the interpreters: the attention kernels
  and add_bias_layer_norm within bf16 rounding of their references, and the
  norm's sum the same bits as XLA's."""
  import re
  out = run("kernel_check.py", "--tiny")
  lines = [line for line in out.splitlines() if line.startswith(("attention", "add_bias"))]
  assert len(lines) == 4, out
  for line in lines:
    errors = [float(e) for e in re.findall(r" (\d\.\de[-+]\d\d)", line)]
    assert len(errors) == (3 if line.startswith("attention") else 5), line
    assert max(errors) < 2e-2, line
    assert "add_bias" not in line or "the same bits: True" in line, line


def test_sampling_benchmark_tiny():
  out = run("sampling_benchmark.py", "--tiny", "--batch_sizes=1,2", "--steps=2",
            "--repeats=1", "--dtype=float32")
  assert "| 2 |" in out and "batch 1, seconds per image" in out


def test_input_pipeline_benchmark_sizes_hosts():
  out = run("input_pipeline_benchmark.py", "--threads=1", "--images=8", "--seconds=0.5",
            "--batch=4", "--size=64", "--gpu_img_s=x=100")
  assert "| 1 |" in out and "| x | 100 |" in out


def test_block_bench_and_profile_step_run(tmp_path):
  out = run("block_bench.py", "--variant=mu/16", "--batch=2", "--reps=1",
            "--only=copy,colsum,gelu,block")
  assert "| block fwd+bwd |" in out and "| gelu fwd+bwd [N,F] (model) |" in out
  out = run("profile_step.py", "--case=mu/16:mse:2", "--steps=1", f"--out={tmp_path / 'profile'}")
  assert "no GPU kernels" in out and "step.hlo.txt written" in out
  assert (tmp_path / "profile" / "step.hlo.txt").stat().st_size > 0


def test_profile_step_finds_where_the_gpu_waits(tmp_path):
  """idle_table on a made-up trace: two steps of three kernels, the GPU idle
  2 us inside each step and 10 us between them; overlap is counted once."""
  import gzip
  import json
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import profile_step
  kernels = []
  for step in range(2):
    t = 100 + step * 30
    kernels += [(t, 5, "fusion.1", "k"), (t + 4, 6, "gemm.2", "k"),      # overlap 1 us
                (t + 12, 8, "fusion.3", "k")]                           # 2 us idle before
  events = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "X", "pid": 1, "ts": 0, "dur": 500, "name": "host", "args": {}}]
  events += [{"ph": "X", "pid": 7, "ts": ts, "dur": dur, "name": name, "args": {"hlo_op": op}}
             for ts, dur, op, name in kernels]
  with gzip.open(tmp_path / "x.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  found = profile_step.gpu_kernels(str(tmp_path))
  assert found == sorted(kernels)                       # the host event is not a kernel
  table = profile_step.idle_table(found, 2, {})
  # span 100 .. 150 = 50 us; busy 2 x 18 us; idle 2 x 2 + 10 = 14 us
  assert "traced span per step: 0.0 ms" in table and "idle 0.0 ms (28.0%)" in table
  rows = [r for r in table.splitlines() if r.startswith("| ") and "->" in r and "ms/step" not in r]
  assert rows[0].startswith("| fusion -> fusion | 0.005 | 0 |")     # 10 us between steps
  assert rows[1].startswith("| gemm -> fusion | 0.002 | 1 |")


def test_profile_step_names_kernels_run_from_a_cuda_graph(tmp_path):
  """With command buffers on, the trace gives a kernel the graph's op; it is
  named by its kernel instead, so kernels of one graph do not merge."""
  import gzip
  import json
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import profile_step
  events = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
            {"ph": "X", "pid": 7, "ts": 10, "dur": 5, "name": "nvjet_gemm",
             "args": {"hlo_op": "command_buffer.3"}},
            {"ph": "X", "pid": 7, "ts": 16, "dur": 2, "name": "loop_add_fusion",
             "args": {"hlo_op": "command_buffer.3"}},
            {"ph": "X", "pid": 7, "ts": 20, "dur": 2, "name": "k", "args": {"hlo_op": "fusion.1"}}]
  with gzip.open(tmp_path / "x.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  ops = [op for _, _, op, _ in profile_step.gpu_kernels(str(tmp_path))]
  assert ops == ["[graph] nvjet_gemm", "[graph] loop_add_fusion", "fusion.1"]
  table = profile_step._kernel_rows(profile_step.gpu_kernels(str(tmp_path)), 1, {}, 10)
  assert "| [graph] nvjet_gemm |" in table and "| [graph] loop_add_fusion |" in table


def test_profile_step_counts_fusion_bytes_from_hlo():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import profile_step
  hlo = """HloModule m

%fused (p0: bf16[8,4]) -> f32[8,4] {
  %p0 = bf16[8,4]{1,0} parameter(0)
}

ENTRY %main (a: bf16[8,4], b: f32[4]) -> f32[8,4] {
  %a = bf16[8,4]{1,0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %loop_add_fusion.3 = f32[8,4]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused, metadata={op_name="jit(f)/block_07/mlp/add"}
  ROOT %t = (f32[8,4]{1,0}) tuple(%loop_add_fusion.3)
}
"""
  info = profile_step.fusion_bytes(hlo)
  nbytes, source = info[profile_step._key("loop_add_fusion.3")]
  assert nbytes == 8 * 4 * 4 + 8 * 4 * 2 + 4 * 4      # result + both operands
  assert profile_step._group("loop_add_fusion.3", source) == "loop_add_fusion @ block_*/mlp/add"


def test_scaling_benchmark_on_two_cpu_devices():
  """Weak scaling over 2 fake CPU devices: a row per mode with efficiency
  against the 1-device run, or against ``--baseline_img_s`` when given
  (then no 1-device run)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=cpu_devices_flags(2))
  common = ["--variant=mu/4", "--image_size=32", "--per_device_batch=4", "--steps=1",
            "--warmup=1", "--modes=fsdp"]

  def rows(*args):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scaling_benchmark.py"),
                           *common, *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line.split() for line in done.stdout.splitlines()
            if line.startswith(("1 device", "fsdp "))]

  measured = rows()
  assert [r[0] for r in measured] == ["1", "fsdp"] and measured[0][2:4] == ["1", "4"]
  assert measured[0][6] == "100.0%"
  given = rows("--baseline_img_s=1000")
  assert given[0][:6] == ["1", "device", "(given)", "1", "4", "1000.0"]
  fsdp = given[1]   # devices, global batch, img/s, step ms, efficiency = img/s / (2 x 1000)
  assert fsdp[1:3] == ["2", "8"] and float(fsdp[5].rstrip("%")) == pytest.approx(
      float(fsdp[3]) / 2000 * 100, abs=0.06)


def test_attention_kernel_bench_tilings_table(monkeypatch, capsys):
  """``--tilings``: one row per AttentionTiling with its error against
  float32, its largest difference from the first row (tilings that only
  move tiles through shared memory differently give the same numbers),
  whether reruns give the same bits, and alternating timing rounds. Run
  here on the interpreter, at a tiny shape."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import attention_kernel_bench as bench
  from darl_jax.kernels import hopper_attention as ha
  kernel = ha.causal_attention_qkv
  monkeypatch.setattr(ha, "causal_attention_qkv",
                      lambda x, bias, rope, tiling: kernel(x, bias, rope, tiling, True))
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(key, (2, 64, 1, 64)).astype(jnp.bfloat16) for key in keys)
  tilings = {"slots=2": ha.AttentionTiling(2), "slots=0": ha.AttentionTiling(0)}
  bench.tilings_table(q, k, v, do, tilings, iters=1, rounds=2, reruns=1)
  rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
  assert [row[0] for row in rows] == ["| slots=2", "| slots=0"]
  for row in rows:
    assert all(float(e) < 1e-2 for e in row[1].split(", "))   # out, dqkv vs float32
    assert float(row[2]) == 0.0
    assert row[3] == "yes"
    assert float(row[4].split(" ")[0]) > 0


def test_cli_benchmark_runs_the_cli_on_jpegs_and_on_synthetic_data(tmp_path):
  """The end-to-end benchmark on a tiny model and a few generated JPEGs: both
  runs and the warm rerun report, and the ratio line comes out."""
  out = run("cli_benchmark.py", "--config=tests/tiny_config.py", "--batch=8", "--steps=6",
            "--log_every=2", "--skip=1", "--images=24", f"--folder={tmp_path / 'jpegs'}",
            "--runs=synthetic,folder,tar",
            "--", "--config.data.image_size=8", "--config.data.channels=1",
            "--config.data.augment=spatial")
  assert "| folder |" in out and "| synthetic |" in out and "| tar |" in out
  assert "CLI on JPEGs / step alone:" in out and "CLI on tar shards / on the folder:" in out
  assert "compilation cache warm" in out


def test_pipeline_benchmark_compares_with_the_plain_loop(tmp_path):
  out = run("pipeline_benchmark.py", "--images=16", "--size=16", "--batch=4",
            "--workers=0,1", "--seconds=0.3", f"--folder={tmp_path / 'jpegs'}")
  rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
  assert rows[1:] == ["plain PIL loop", "pipeline, 0 workers", "pipeline, 1 workers"]


_FAKE_SMI = """#!/bin/sh
# nvidia-smi as card_release_check.py asks it: the used MiB and the holders, from files.
case "$*" in
  *--query-gpu*) cat "{state}/used" ;;
  *--query-compute-apps*) cat "{state}/apps" ;;
esac
"""


@pytest.mark.parametrize("outlives", [False, True])
def test_card_release_check_reports_what_outlives_the_job(tmp_path, outlives):
  """A fake nvidia-smi whose card the job takes and hands to a process of
  its own that frees it 1 s after the job exits (a process winding down),
  or that keeps it, which the report names by its command line (exit 1).
  The holder writes to no pipe of the test's, so the test waits for the
  check alone, not for the holder's minute."""
  state = tmp_path / "state"
  state.mkdir()
  (state / "used").write_text("5\n")
  (state / "apps").write_text("")
  smi = tmp_path / "bin" / "nvidia-smi"
  smi.parent.mkdir()
  smi.write_text(_FAKE_SMI.format(state=state))
  smi.chmod(0o755)
  linger = 60 if outlives else 1
  holder = (f"import time, pathlib; s = pathlib.Path({str(state)!r}); time.sleep({linger}); "
            f"s.joinpath('apps').write_text(''); s.joinpath('used').write_text('5')")
  job = (f"import subprocess, sys, pathlib; s = pathlib.Path({str(state)!r}); "
         f"s.joinpath('used').write_text('70000'); "
         f"p = subprocess.Popen([sys.executable, '-c', {holder!r}], start_new_session=True, "
         f"stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
         f"s.joinpath('apps').write_text(f'{{p.pid}}, 70000')")
  env = dict(os.environ, PATH=f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
  try:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "card_release_check.py"),
                           "--every=0.1", "--settle=4", "--", sys.executable, "-c", job],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
  finally:
    apps = (state / "apps").read_text().strip()
    if apps:
      os.kill(int(apps.split(",")[0]), 9)
  if outlives:
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the card still held 70000 MiB (1 processes)" in done.stdout
    assert "time.sleep(60)" in done.stdout          # the holder, by its command line
  else:
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"free_seconds_after_exit": ' in done.stdout and '"peak_mib": 70000' in done.stdout
    assert "the card was free " in done.stdout
