"""The README's twins of the image-folder example, through the real CLI (issue 47).

For tar shards, Parquet, ArrayRecord and a mixture of tar + Parquet, on
generated 8x8 RGB images (2 classes): `python -m darl_jax.main` pretrains a
few steps, fine-tunes from that checkpoint, and a pretraining run SIGKILLed
after its first checkpoint, then rerun, logs the same metrics.jsonl as the
uninterrupted run. This file is also the CLI's config:
``--config=tests/test_data_cli.py:pretrain`` / ``:finetune`` (tests/tiny_config.py's
mu/2 at 8x8, RGB).
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HERE = pathlib.Path(__file__).resolve()
STEPS = 4
# Keys of a metrics record that measure the machine, not the run.
TIMING = ("per_sec", "_ms", "fraction", "goodput", "time", "compile", "mfu")


def get_config(arg=None):
  """The CLI's config: tiny pretraining (4 steps, checkpoints at 2 and 4) or
  fine-tuning (3 steps) of tests/tiny_config.py's mu/2 backbone on RGB 8x8."""
  sys.path.insert(0, str(ROOT / "tests"))
  import tiny_config
  from darl_jax.train.trainers import finetune
  if arg == "finetune":
    c = finetune.finetune_config()
    c.update(total_steps=3, batch_size=16, log_every_steps=1, eval_every_steps=3,
             checkpoint_every_steps=3, eval_max_batches=1, tensorboard=False)
    c.model.update(variant="mu/2", rope_max_wavelength=100.0)
    c.optim.update(warmup_steps=1)
    c.randaugment.num_ops = 0
    c.mixup.update(mixup_alpha=0.0, cutmix_alpha=0.0)
  else:
    c = tiny_config.get_config(f"steps={STEPS}")
    c.update(checkpoint_every_steps=2, eval_every_steps=0)
    c.predictions.num_images = 0
  c.data.update(image_size=8, channels=3, augment="spatial", num_workers=0)
  c.model.update(image_size=8, channels=3)
  return c


def cli(workdir, data, arg="pretrain", *extra, wait=True):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             DARL_COMPILED_STEP_CACHE="0")
  cmd = [sys.executable, "-m", "darl_jax.main", f"--config={HERE}:{arg}",
         f"--workdir={workdir}", *data, *extra]
  if not wait:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "leaked shared_memory" not in proc.stderr, proc.stderr[-2000:]
  return proc


def records(workdir):
  """metrics.jsonl without the timing keys, the last record of a step winning."""
  out = {}
  for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines():
    r = json.loads(line)
    out[(r["step"], tuple(sorted(k for k in r if k.startswith("val"))))] = {
        k: v for k, v in r.items() if not any(t in k for t in TIMING)}
  return out


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
  """format -> the CLI's data overrides, all made from one image folder."""
  import image_files  # pylint: disable=g-import-not-at-top
  from darl_jax.data import convert  # pylint: disable=g-import-not-at-top
  pytest.importorskip("pyarrow")
  root = tmp_path_factory.mktemp("data")
  image_files.class_folder(root / "folder", (("train", 24), ("val", 8)), shape=(8, 8),
                           exts=("png",))
  # The README's commands: `python -m darl_jax.data.convert --format=...`.
  for fmt in ("tar", "arrayrecord", "parquet"):
    convert.convert(str(root / "folder"), str(root / fmt), fmt, shard_size=20)
  tar = f"{root}/tar/train-{{000000..000002}}.tar"
  pqt = f"{root}/parquet/train-*.parquet"
  return {
      "tar": ["--config.data.name=webdataset", f"--config.data.path={tar}",
              f"--config.data.eval_path={root}/tar/validation-000000.tar"],
      "parquet": ["--config.data.name=parquet", f"--config.data.path={pqt}",
                  f"--config.data.eval_path={root}/parquet/validation-000000.parquet"],
      "arrayrecord": ["--config.data.name=arrayrecord",
                      f"--config.data.path={root}/arrayrecord/train-{{000000..000002}}.array_record",
                      f"--config.data.eval_path={root}/arrayrecord/validation-000000.array_record"],
      "mixture": ["--config.data.name=mixture", f"--config.data.mixture={tar}=1,{pqt}=1"],
  }


def finish(proc):
  _, stderr = proc.communicate(timeout=240)
  assert proc.returncode == 0, stderr[-4000:]
  assert "leaked shared_memory" not in stderr, stderr[-2000:]


@pytest.mark.parametrize("fmt", ["tar", "parquet", "arrayrecord", "mixture"])
def test_pretrain_finetune_and_kill_resume_from_the_cli(fmt, datasets, tmp_path):
  # Two processes at a time (a run is mostly its start-up): the uninterrupted
  # pretraining beside the one SIGKILLed after its first checkpoint, then the
  # fine-tuning from the first beside the rerun of the second.
  data = datasets[fmt]
  straight, killed, tuned = tmp_path / "straight", tmp_path / "killed", tmp_path / "finetune"
  reference = cli(straight, data, wait=False)
  proc = cli(killed, data, wait=False)
  ckpts = killed / "checkpoints"
  deadline = time.time() + 200
  while time.time() < deadline and proc.poll() is None:
    if ckpts.exists() and any(p.name.isdigit() for p in ckpts.iterdir()):
      break
    time.sleep(0.02)
  if proc.poll() is None:
    os.kill(proc.pid, signal.SIGKILL)
  proc.communicate()
  assert proc.returncode == -signal.SIGKILL      # killed, not finished
  finish(reference)
  assert sorted(p.name for p in (straight / "checkpoints").iterdir() if p.name.isdigit()) == [
      "2", "4"]

  # Fine-tuning from the pretraining checkpoint (labels from the format),
  # beside the same pretraining command rerun on the killed workdir.
  tuning = cli(tuned, data, "finetune", f"--config.init_from={straight}", wait=False)
  cli(killed, data)
  finish(tuning)
  tuned_records = [json.loads(l) for l in (tuned / "metrics.jsonl").read_text().splitlines()]
  assert any("val_accuracy" in r for r in tuned_records)
  assert records(killed) == records(straight)
