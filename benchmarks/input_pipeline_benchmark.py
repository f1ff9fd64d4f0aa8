"""Host input pipeline speed: ImageNet-style JPEG decode + random-resized crop + flip.

    python benchmarks/input_pipeline_benchmark.py [--threads=1,2] [--images=512] [--size=224]

Runs the training preprocessing of the ImageNet source
(``darl_jax.data.sources.tfds_source.JpegPreprocess.random``: decode only the crop
window of the JPEG, resize to ``--size`` with antialiasing, random flip)
through tf.data on generated JPEGs, with tf.data limited to ``--threads``
threads, and prints images/s and images/s per thread. From the per-thread
rate it prints how many host cores keep one GPU fed at the step rates
measured in benchmarks/RESULTS.md (``--gpu_img_s``).

The JPEGs imitate ImageNet's: sizes drawn around the dataset's typical
500 x 375 (short side 300-500, aspect 3/4-4/3), smooth content with texture,
quality 90 (about 60-120 kB each, as ImageNet files are). They are generated
in memory; nothing is downloaded. Reading files from disk and the TFDS
shuffle buffer are not included (the decode dominates).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from darl_jax.data.sources import tfds_source  # noqa: E402

# img/s of one H200 at the pretraining step (benchmarks/RESULTS.md).
DEFAULT_GPU_RATES = "L/16 mse=1129,L/16 diffusion=1024,B/16 mse=3579,H/14 mse=455"


def make_jpegs(n: int, seed: int = 0) -> list[bytes]:
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    short = int(rng.integers(300, 501))
    ratio = float(rng.uniform(3 / 4, 4 / 3))
    h, w = (short, int(short * ratio)) if ratio >= 1 else (int(short / ratio), short)
    low = rng.uniform(0, 255, (max(h // 32, 2), max(w // 32, 2), 3))
    img = np.asarray(Image.fromarray(low.astype(np.uint8)).resize((w, h), Image.BICUBIC),
                     np.float32)
    img += rng.normal(0, 12, img.shape)           # texture, so files are not trivially small
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    out.append(buf.getvalue())
  return out


def rate(jpegs: list[bytes], threads: int, size: int, seconds: float, batch: int) -> float:
  """Images/s of the training preprocessing on ``threads`` tf.data threads."""
  tf = tfds_source.import_tf()
  prep = tfds_source.JpegPreprocess((size, size, 3), 3, crop_fraction=0.875)
  ds = tf.data.Dataset.from_tensor_slices(tf.constant(jpegs)).repeat().enumerate()
  ds = ds.map(lambda i, x: prep.random(x, tf.stack([tf.constant(7, tf.int64), i])),
              num_parallel_calls=threads)
  ds = ds.batch(batch).prefetch(2)
  options = tf.data.Options()
  options.threading.private_threadpool_size = threads
  options.threading.max_intra_op_parallelism = 1
  it = ds.with_options(options).as_numpy_iterator()
  for _ in range(3):
    next(it)                                      # warm-up: tracing, thread start
  count, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    count += next(it).shape[0]
  return count / (time.perf_counter() - start)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--threads", default=f"1,{os.cpu_count()}")
  parser.add_argument("--images", type=int, default=512, help="distinct JPEGs, cycled")
  parser.add_argument("--size", type=int, default=224)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--seconds", type=float, default=15.0, help="timed per setting")
  parser.add_argument("--gpu_img_s", default=DEFAULT_GPU_RATES,
                      help="name=img/s of a GPU step, comma-separated")
  args = parser.parse_args()

  jpegs = make_jpegs(args.images)
  kb = np.mean([len(j) for j in jpegs]) / 1024
  print(f"{len(jpegs)} JPEGs, mean {kb:.0f} kB; output {args.size}x{args.size}; "
        f"{os.cpu_count()} cores on this host")
  print("\n| threads | images/s | per thread |\n|---|---|---|")
  per_thread = []
  for threads in (int(t) for t in args.threads.split(",")):
    r = rate(jpegs, threads, args.size, args.seconds, args.batch)
    per_thread.append(r / threads)
    print(f"| {threads} | {r:.0f} | {r / threads:.0f} |", flush=True)
  # Sizing uses the per-thread rate of the run with the most threads: with
  # every core busy, the Python side (batching, numpy) competes for them too.
  best = per_thread[-1]
  print(f"\nCores to feed one GPU at {best:.0f} images/s per core (all cores busy):\n")
  print("| GPU step | img/s | cores |\n|---|---|---|")
  for item in args.gpu_img_s.split(","):
    name, value = item.split("=")
    print(f"| {name} | {float(value):.0f} | {float(value) / best:.1f} |")


if __name__ == "__main__":
  main()
