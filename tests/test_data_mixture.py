"""Weighted mixtures of sources (data/sources/mixture.py)."""

import logging as py_logging

import numpy as np
import pytest
from PIL import Image

from darl_jax.data import SOURCES, build_source
from darl_jax.data.sources import mixture


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  root = tmp_path_factory.mktemp("mix_folder")
  rng = np.random.default_rng(0)
  for c in ("a", "b", "c"):
    (root / c).mkdir()
    for i in range(8):
      Image.fromarray(rng.integers(0, 255, (8, 8), np.uint8)).save(root / c / f"{i}.png")
  return str(root)


def cfg(folder, spec=None, **kw):
  return {"name": "mixture", "image_size": 8, "channels": 1, "augment": "spatial",
          "val_split_size": 0, "mixture": spec or f"digits=3,image_folder:{folder}=1", **kw}


def test_parse_specs_and_weights(folder):
  assert mixture.parse("gs://b/x-{000..009}.tar=0.7, digits=0.3") == [
      ("gs://b/x-{000..009}.tar", 0.7), ("digits", 0.3)]
  assert mixture.parse({"digits": 2}) == [("digits", 2.0)]
  assert mixture.component_config({}, "s/{0..3}.tar", SOURCES)["name"] == "webdataset"
  assert mixture.component_config({}, "x-*.parquet", SOURCES)["name"] == "parquet"
  assert mixture.component_config({}, folder, SOURCES)["name"] == "image_folder"
  with pytest.raises(ValueError, match="positive"):
    mixture.parse("digits=0")
  with pytest.raises(ValueError, match="no weight"):
    mixture.parse("digits")
  with pytest.raises(ValueError, match="cannot tell"):
    mixture.component_config({}, "no/such/thing", SOURCES)


def test_proportions_determinism_and_process_slices(folder, caplog):
  source = build_source(cfg(folder), split="train", seed=5)
  assert list(source.counts) == [750, 250]
  comp, _ = source.assign(np.arange(4000))
  assert np.bincount(comp).tolist() == [3000, 1000]
  np.testing.assert_array_equal(source.examples_before(40, 100), [3000, 1000])
  whole = source.train_batch(7, 32)
  parts = [source.train_batch(7, 32, p, 2) for p in range(2)]
  np.testing.assert_array_equal(whole["image"], np.concatenate([p["image"] for p in parts]))
  again = build_source(cfg(folder), split="train", seed=5).train_batch(7, 32)
  np.testing.assert_array_equal(whole["image"], again["image"])
  assert source.num_classes == 10       # both labeled: the larger class count
  with caplog.at_level(py_logging.INFO):
    it = source.train_iterator(32, start_step=3, num_workers=1)
    try:
      for step in (3, 4):
        np.testing.assert_array_equal(next(it)["image"], source.train_batch(step, 32)["image"])
      assert it.get_state() == {"next_step": 5}
    finally:
      it.close()
  assert any("data.mixture at step 3" in r.getMessage() for r in caplog.records)


def test_eval_covers_every_component(folder):
  source = build_source(cfg(folder, val_split_size=3), split="validation", seed=0)
  n = sum(c.num_examples for c in source.components)
  assert sum(int(b["mask"].sum()) for b in source.eval_batches(16)) == n
