"""Prepared TFDS datasets read as random-access records, through the Grain pipeline.

A TFDS dataset prepared in the ArrayRecord format (``tfds build <name>
--file_format=array_record``) can be read record by record
(``tfds.data_source``). ``TfdsRecordSource`` is then an ordinary
random-access source (indexed.py): the same epoch permutations, per-process
slices and counter-based crops as in-memory arrays and image folders, and
the same worker processes (data/pipeline.py). Each record's image stays encoded
(``SkipDecoding``) until a worker decodes it with PIL (image_folder.py's
``decode_crop``: reduced JPEG decoding, random-resized crop and flip for
training, a central crop of ``crop_fraction`` for evaluation). No tf.data, no
TensorFlow graph: what a GPU host needs.

``data.backend`` chooses for the TFDS names (``imagenet2012``, ``tfds``):
``records`` (this module), ``tf`` (tf.data, tfds_source.py), or ``auto``:
records when the prepared dataset is ArrayRecord, tf.data otherwise.
"""

from __future__ import annotations

import io
from typing import Any, Optional

import numpy as np

from darl_jax.data.transforms import augment as aug
from darl_jax.data.sources import image_folder
from darl_jax.data.sources.indexed import IndexedSource


def file_format(builder) -> str:
  """The prepared dataset's file format ("array_record", "tfrecord", ...)."""
  fmt = getattr(builder.info, "file_format", None)
  return str(getattr(fmt, "value", fmt) or "tfrecord")


def array_record_command(name: str, data_dir: str) -> str:
  return f"tfds build {name} --file_format=array_record --data_dir={data_dir}"


class TfdsRecordSource(IndexedSource):
  """One split of a prepared TFDS dataset, read record by record."""

  decodes_files = True
  # Labels are read with each record and checked there (``_examples``).
  labels_listed = False
  PER_PROCESS = {"_records": lambda: None}   # the record reader, opened on first use

  def __init__(self, name: str, split: str, data_dir: Optional[str], *, num_examples: int,
               num_classes: int, image_size: int, channels: int, augment: str, seed: int,
               crop_fraction: float = 1.0, crop_scale=aug.CROP_SCALE):
    # Labels are read with each record (listing them up front would read the
    # whole split); the base class only needs the count.
    super().__init__(labels=np.zeros((num_examples,), np.int32), num_classes=num_classes,
                     image_size=image_size, channels=channels, augment=augment, seed=seed,
                     crop_scale=crop_scale)
    self.name, self.split, self.data_dir = name, split, data_dir
    self.crop_fraction = float(crop_fraction)

  def set_num_examples(self, num: int) -> None:
    self.labels = np.zeros((num,), np.int32)
    self.size = self.num_examples = int(num)

  def records(self):
    if self._records is None:
      import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
      self._records = tfds.data_source(self.name, split=self.split, data_dir=self.data_dir,
                                       decoders={"image": tfds.decode.SkipDecoding()})
    return self._records

  def _examples(self, indices, positions):
    records = self.records()
    us = aug.crop_uniforms(self.seed, positions, len(indices))
    images, labels = [], []
    for i, u in zip(indices, us):
      record = records[int(i)]
      images.append(image_folder.decode_crop(io.BytesIO(record["image"]), u,
                                             self.image_shape, self.crop_fraction,
                                             self.crop_scale))
      label = int(record.get("label", 0))
      if self.num_classes and not 0 <= label < self.num_classes:
        raise ValueError(f"record {int(i)} of {self.name} {self.split} has the label {label}, "
                         f"not one of its {self.num_classes} classes: prepare the dataset "
                         f"again (tfds build {self.name})")
      labels.append(label)
    return np.stack(images), np.asarray(labels, np.int32)

  def _load(self, indices, positions):
    return self._examples(indices, positions)[0]


def build(config: Any, builder, *, name: str, split: str, data_dir: str, seed: int,
          crop_fraction: float) -> TfdsRecordSource:
  """The records source of ``split`` (a TFDS split string) of ``builder``."""
  from darl_jax.data.base import cfg_get  # pylint: disable=g-import-not-at-top
  fmt = file_format(builder)
  if builder.info.splits and fmt != "array_record":
    raise ValueError(f"{name} in {data_dir} is prepared as {fmt}, not array_record: run "
                     f"`{array_record_command(name, data_dir)}` for data.backend='records', "
                     f"or use data.backend='tf'")
  features = builder.info.features
  label = features["label"] if "label" in features else None
  source = TfdsRecordSource(
      name, split, data_dir,
      num_examples=int(builder.info.splits[split].num_examples) if builder.info.splits else 0,
      num_classes=int(getattr(label, "num_classes", 0) or 0),
      image_size=int(cfg_get(config, "image_size", 224)),
      channels=int(cfg_get(config, "channels", 3)),
      augment=cfg_get(config, "augment", "none"), seed=seed, crop_fraction=crop_fraction,
      crop_scale=cfg_get(config, "crop_scale", aug.CROP_SCALE))
  if not builder.info.splits:      # metadata unknown (e.g. under tfds.testing.mock_data)
    try:
      source.set_num_examples(len(source.records()))
    except Exception as e:  # pylint: disable=broad-except  # TFDS raises several kinds
      raise FileNotFoundError(
          f"{name} is not prepared as ArrayRecord in {data_dir} ({type(e).__name__}); run "
          f"`{array_record_command(name, data_dir)}`") from e
  return source
