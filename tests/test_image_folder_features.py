"""Prefix-causal pretraining with an EMA and few-shot evaluation, then the
attentive probe and the few-shot job, from the CLI on a folder of image files
(the tests draw them): the features that issue 37 added, end to end on the
data users bring, not only on the bundled datasets."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
from PIL import Image

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import metrics as metrics_lib
from tests.xla_env import cpu_devices_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLASSES = ("circle", "square", "stripes")


def _draw(path: pathlib.Path, kind: str, rng: np.random.Generator) -> None:
  """A 20-36 px grayscale picture of its class, with noise."""
  size = int(rng.integers(20, 37))
  yy, xx = np.mgrid[:size, :size] / size
  if kind == "circle":
    img = ((yy - 0.5) ** 2 + (xx - 0.5) ** 2 < 0.1).astype(float)
  elif kind == "square":
    img = ((abs(yy - 0.5) < 0.3) & (abs(xx - 0.5) < 0.3)).astype(float)
  else:
    img = (np.sin(xx * 20) > 0).astype(float)
  img = np.clip(img * 200 + rng.normal(0, 20, img.shape) + 20, 0, 255).astype(np.uint8)
  path.parent.mkdir(parents=True, exist_ok=True)
  Image.fromarray(img, mode="L").save(path, quality=95)


def _folder(root: pathlib.Path) -> pathlib.Path:
  rng = np.random.default_rng(0)
  for split, count in (("train", 16), ("val", 6)):
    for cls in CLASSES:
      for i in range(count):
        _draw(root / split / cls / f"{i}.jpg", cls, rng)
  return root


def _cli(config: str, workdir, *flags) -> None:
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             XLA_FLAGS=cpu_devices_flags(1))
  proc = subprocess.run([sys.executable, "-m", "darl_jax.main", f"--config={config}",
                         f"--workdir={workdir}", *flags], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]


def test_issue_37_features_run_end_to_end_on_an_image_folder(tmp_path):
  data = _folder(tmp_path / "images")
  folder = ["--config.data.name=image_folder", f"--config.data.path={data}",
            "--config.data.image_size=8", "--config.data.channels=1",
            "--config.data.num_workers=0"]
  fewshot = ["--config.fewshot_eval.shots=(1,2)", "--config.fewshot_eval.num_seeds=2",
             "--config.fewshot_eval.num_support_examples=48",
             "--config.fewshot_eval.num_query_examples=18"]
  pre = tmp_path / "pretrain"
  _cli("tests/tiny_config.py:steps=8", pre, *folder, *fewshot,
       "--config.model.prefix=uniform", "--config.ema_decay=0.9",
       "--config.fewshot_eval.enabled=True", "--config.predictions.num_images=0")
  records = metrics_lib.read_metrics(str(pre))
  losses = [r["loss"] for r in records if "loss" in r]
  assert len(losses) == 8 and np.all(np.isfinite(losses))
  shots = [r for r in records if "val_fewshot_2shot" in r]
  assert [r["step"] for r in shots] == [4, 8]
  params, _ = checkpoint_lib.restore_params(str(pre))
  assert params   # a checkpoint the downstream jobs can read

  probe = tmp_path / "attentive"
  _cli(f"experiments/fashion_mnist_attentive_probe.py:tiny,steps=4,init={pre}", probe,
       *folder)
  report = json.loads((probe / "attentive_probe.json").read_text())
  assert report["step"] == 4 and 0.0 <= report["accuracy"] <= 1.0

  job = tmp_path / "fewshot"
  _cli("experiments/fashion_mnist_fewshot.py:tiny", job, f"--config.init_from={pre}",
       "--config.batch_size=16", *fewshot)
  scores = json.loads((job / "fewshot.json").read_text())
  assert scores["num_classes"] == len(CLASSES) and sorted(scores["shots"]) == ["1", "2"]
