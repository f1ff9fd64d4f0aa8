"""Data sources and host input pipelines.

    source = build_source(config.data, split="train", seed=0)
    for batch in source.train_batches(256, start_step=step,
                                      process_index=jax.process_index(),
                                      process_count=jax.process_count()):
      batch["image"]  # uint8 [256 // P, H, W, C] (float [-1, 1] on the device)
      batch["label"]  # int32 [256 // P]

Sources (``config.name``):
  fashion_mnist  Debian IDX files (numpy in memory, or backend="tfds": a local
                 TFDS builder over the same files); 55000/5000/10000 split.
  digits         scikit-learn's 8x8 digits; fixed 1257/180/360 split.
  image_folder   image files (PIL); split folders (train/, val/) or a hash split.
  webdataset     tar shards ({key}.jpg + optional {key}.cls), read by member
                 offset (sources/webdataset.py; patterns in sources/shards.py).
  parquet        Parquet files of encoded images, read by row group (sources/parquet.py).
  arrayrecord    ArrayRecord files of msgpack image records, random access
                 (sources/arrayrecord.py; written by convert.py --format=arrayrecord).
  hf_disk        Hugging Face datasets saved with save_to_disk, memory-mapped
                 (sources/hf_disk.py; the ``hf`` extra).
  mixture        weighted mixture of any of these, config.mixture (sources/mixture.py).
  imagenet2012   prepared TFDS imagenet2012 (ArrayRecord records through Grain,
                 or tf.data with JPEG crop-decode).
  tfds           any prepared TFDS dataset (``config.tfds_name``).
  synthetic      fixed random batches: the step alone, for benchmarks.
  vtab           a VTAB-1k task (config.vtab_task) with its own splits (sources/vtab_tasks.py).

Config keys: name, image_size, channels (1|3), augment ("none"|"spatial":
random-resized crop, area crop_scale (0.2-1), ratio 3/4-4/3, + horizontal flip),
crop_scale, path,
backend (Fashion-MNIST: "auto"|"numpy"|"tfds"; TFDS names: "auto"|"records"|"tf",
records = ArrayRecord files read through the Grain pipeline,
sources/tfds_records.py), tfds_name, tfds_data_dir, val_split_size,
num_workers (-1: the host's share of cores; 0: in the training process);
sharded sources: eval_path, label_key, index_cache_dir, image_column,
label_column, num_classes, process_files ("own": each of P > 1 processes
reads only its own training files; "all": one global stream, sources/encoded.py);
optional: crop_fraction (TFDS eval centre crop; 0.875 for imagenet2012, else
1), shuffle_buffer (TFDS).

Batches: uint8 images, int32 labels. train -- infinite, per-process local,
deterministic in (seed, step) so that resuming needs only the step (see
`sources/indexed.py` / `sources/tfds_source.py`); the loop takes them from
``source.train_iterator``, which for the in-memory and image-folder sources
is a Grain pipeline building whole batches in worker processes
(`pipeline.py`);
eval -- one pass, padded final batch with ``mask`` False on padding, equal
batch counts on all processes. ``batch_size`` is global; each process gets
``batch_size // process_count`` rows.

Only the TFDS paths import TensorFlow (lazily, GPUs hidden from it); the rest
needs numpy (+ PIL for image_folder, scikit-learn for digits). Nothing is
downloaded at run time.
"""

from darl_jax.data.base import AUGMENTS, SPLITS, Batch, DataSource, check_labels
from darl_jax.data.registry import SOURCES, build_source

__all__ = ["AUGMENTS", "SPLITS", "SOURCES", "Batch", "DataSource",
           "build_source", "check_labels"]
