"""The input pipeline alone against a plain PIL loop, on a folder of JPEGs.

    python benchmarks/pipeline_benchmark.py [--images=600] [--size=224] [--workers=0,1,2] \
        [--formats=folder,tar,parquet,arrayrecord,hf_disk] [--repeats=5]

On the folder of ImageNet-like JPEGs that benchmarks/cli_benchmark.py
generates (300-500 px, quality 90), prints images/s of

- ``plain PIL loop``: one single-threaded loop that opens each file, decodes
  it whole, takes the same random-resized crop and flip, resizes it to
  ``--size`` and stacks a uint8 batch: what a first hand-written loader does;
- ``pipeline, N workers``: the training iterator of ``data.name=image_folder``
  with ``augment=spatial`` (darl_jax/data/pipeline.py), N worker processes
  (0: in this process), batches drawn as the loop draws them;
- ``pipeline, FORMAT, N workers`` for each other ``--formats`` entry: the same
  JPEG bytes (unchanged, so the same decode and crop) in tar shards,
  ArrayRecord or Parquet files (``python -m darl_jax.data.convert``; Parquet
  in Hugging Face's image layout, row groups of 256) or a Hugging Face
  dataset saved with ``save_to_disk`` (needs the ``hf`` extra), written to a
  temporary folder before timing;

each timed for ``--seconds`` after a warm-up batch (the median of
``--repeats`` rounds over all rows), with its ratio to the plain loop and to
the folder at the same worker count.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import cli_benchmark  # noqa: E402
from darl_jax.data.transforms import augment as aug  # noqa: E402
from darl_jax.data import build_source, convert, pipeline  # noqa: E402
from darl_jax.data.sources import image_folder  # noqa: E402

FORMATS = ("folder", "tar", "parquet", "arrayrecord", "hf_disk")


def plain_loop_rate(paths: list[str], size: int, batch: int, seconds: float) -> float:
  """Images/s of one single-threaded PIL loop: full decode, crop, resize, flip."""
  count, start, i = 0, time.perf_counter(), 0
  while time.perf_counter() - start < seconds:
    rows = []
    for _ in range(batch):
      u = aug.hash_uniform(0, np.asarray([i]), 4 * aug.CROP_ATTEMPTS + 1)[0]
      with Image.open(paths[i % len(paths)]) as img:
        img = img.convert("RGB")
        w, h = img.size
        top, left, bh, bw = aug.sample_crop_boxes(u[None], h, w)
        img = img.resize((size, size), Image.BILINEAR,
                         box=(left[0], top[0], left[0] + bw[0], top[0] + bh[0]))
        if u[-1] < aug.FLIP_PROB:
          img = img.transpose(Image.FLIP_LEFT_RIGHT)
        rows.append(np.asarray(img, np.uint8))
      i += 1
    np.stack(rows)
    count += batch
  return count / (time.perf_counter() - start)


def write_format(fmt: str, root: str, paths: list[str], dst: str) -> dict:
  """The data config of ``root``'s training images written as ``fmt`` under ``dst``."""
  if fmt in convert.FORMATS:
    return cli_benchmark.shard_config(root, dst, fmt, shard_size=10_000)
  images = []
  for path in paths:
    with open(path, "rb") as f:
      images.append(f.read())
  if fmt == "hf_disk":
    import datasets  # pylint: disable=g-import-not-at-top
    datasets.Dataset.from_dict({"image": images}).save_to_disk(os.path.join(dst, "hf"))
    return {"name": "hf_disk", "path": os.path.join(dst, "hf"), "val_split_size": 0}
  raise ValueError(f"--formats: unknown {fmt!r}; valid: {', '.join(FORMATS)}")


def pipeline_rate(folder, size: int, batch: int, workers: int, seconds: float) -> float:
  """Images/s of the training iterator of an image folder (a path) or of a
  data config (a dict)."""
  data = folder if isinstance(folder, dict) else {"name": "image_folder", "path": folder}
  source = build_source({**data, "image_size": size, "channels": 3, "augment": "spatial"},
                        split="train", seed=0)
  it = source.train_iterator(batch, num_workers=workers)
  try:
    next(it)                                     # warm-up: worker start, first batch
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
      count += len(next(it)["label"])
    return count / (time.perf_counter() - start)
  finally:
    it.close()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--images", type=int, default=600)
  parser.add_argument("--size", type=int, default=224)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--workers", default="0,1,2")
  parser.add_argument("--seconds", type=float, default=10.0)
  parser.add_argument("--repeats", type=int, default=1,
                      help="rounds over all rows; each row prints its median")
  parser.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "darl_jpegs"))
  parser.add_argument("--formats", default="folder",
                      help=f"comma-separated, of {', '.join(FORMATS)}")
  args = parser.parse_args()
  from absl import flags
  flags.FLAGS.mark_as_parsed()
  cli_benchmark.make_folder(args.folder, args.images, max(args.images // 20, 64))
  train = os.path.join(args.folder, "train")
  paths = [os.path.join(train, f) for f in image_folder.list_images(train)]
  formats = args.formats.split(",")
  workers = [int(w) for w in args.workers.split(",")]
  dsts = {fmt: tempfile.mkdtemp(prefix=f"darl_{fmt}_") for fmt in formats if fmt != "folder"}
  try:
    data = {fmt: train if fmt == "folder" else write_format(fmt, args.folder, paths, dsts[fmt])
            for fmt in formats}
    # Every row is timed once per round, the rounds one after another, so
    # that a slow spell of a shared machine falls on all rows alike; the
    # median of the rounds is printed.
    rates: dict = {}
    bases = []
    for _ in range(args.repeats):
      bases.append(plain_loop_rate(paths, args.size, args.batch, args.seconds))
      for fmt in formats:
        for w in workers:
          rates.setdefault((fmt, w), []).append(
              pipeline_rate(data[fmt], args.size, args.batch, w, args.seconds))
  finally:
    for dst in dsts.values():
      shutil.rmtree(dst, ignore_errors=True)
  base = float(np.median(bases))
  print(f"{len(paths)} JPEGs, output {args.size}x{args.size}, batch {args.batch}, "
        f"{pipeline.host_cores()} host cores, median of {args.repeats} round(s) of "
        f"{args.seconds:g} s per row\n")
  print("| loader | images/s | x plain loop | x folder |\n|---|---|---|---|")
  print(f"| plain PIL loop | {base:.0f} | 1.00 | |")
  for (fmt, w), r in rates.items():
    r = float(np.median(r))
    label = "" if fmt == "folder" else f"{fmt}, "
    folder = rates.get(("folder", w))
    versus = f"{r / float(np.median(folder)):.2f}" if folder else ""
    print(f"| pipeline, {label}{w} workers | {r:.0f} | {r / base:.2f} | {versus} |", flush=True)

if __name__ == "__main__":
  main()
