"""The data side's place in the import graph: config_lib sits below data/, data/ is
host-side (no JAX at import), and every source, VTAB's included, is built through the
registry's one table. Read from the source with test_imports.py's graph where it can be."""

import ast
import pathlib

import numpy as np
import pytest

from darl_jax import config_lib
from darl_jax import crop_scale
from darl_jax.data.transforms import augment
from darl_jax.data import registry
from darl_jax.data.sources import vtab_tasks
from test_imports import _cycles, _graph, _import_time_nodes

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_config_lib_imports_nothing_of_data():
  graph = _graph()
  upward = sorted(t for t in graph["darl_jax.config_lib"] if t.startswith("darl_jax.data"))
  assert not upward, f"config_lib imports data/, which sits above it: {upward}"
  assert "darl_jax.crop_scale" in graph["darl_jax.config_lib"]
  assert "darl_jax.crop_scale" in graph["darl_jax.data.transforms.augment"]


def test_config_and_sources_apply_one_crop_scale_rule():
  assert augment.check_crop_scale is crop_scale.check_crop_scale
  config = config_lib.base_config()
  config.data.crop_scale = (0.9, 0.1)
  with pytest.raises(config_lib.ConfigError) as config_error:
    config_lib.validate(config)
  with pytest.raises(ValueError) as source_error:
    augment.check_crop_scale((0.9, 0.1))
  assert str(config_error.value) == f"config.{source_error.value}"


def test_no_data_module_imports_jax_at_import_time():
  """Batches are built on the host (in Grain's worker processes too); what runs on the
  device inside the loss, mixup and cutmix, lives beside the losses."""
  found = {}
  for path in sorted((ROOT / "darl_jax" / "data").rglob("*.py")):
    tree = ast.parse(path.read_text(), str(path))
    for node in _import_time_nodes(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      if any(n == "jax" or n.startswith("jax.") for n in names):
        found.setdefault(path.name, node.lineno)
  assert not found, f"data/ modules import JAX at import time: {found}"
  assert "darl_jax.mixup" in _graph()["darl_jax.train.classifier"]


def _table_modules() -> set[str]:
  """The modules the registry's table imports by name (``_module_builder`` rows)."""
  tree = ast.parse((ROOT / "darl_jax" / "data" / "registry.py").read_text())
  return {f"darl_jax.data.{node.args[0].value}" for node in ast.walk(tree)
          if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_module_builder"}


def test_the_registry_table_closes_no_import_cycle():
  """The table's rows import their modules by name, which the import graph does not
  see: add those edges and check the graph still runs one way."""
  graph = _graph()
  table = _table_modules()
  assert "darl_jax.data.sources.vtab_tasks" in table and len(table) == 9
  assert table <= set(graph), f"rows name no module: {table - set(graph)}"
  graph["darl_jax.data.registry"] = graph["darl_jax.data.registry"] | table
  assert _cycles(graph) == set()


def _vtab_data(**overrides) -> dict:
  return {"name": "vtab", "vtab_task": "dtd", "vtab_source": "synthetic", "image_size": 8,
          "channels": 3, "augment": "none", "vtab_train_examples": 8,
          "vtab_val_examples": 4, **overrides}


def test_the_registry_builds_vtab_sources():
  assert "vtab" in registry.SOURCES
  for split, n in (("train800", 8), ("train800val200", 12), ("test", 4)):
    source = registry.build_source(_vtab_data(), split=split, seed=0)
    direct = vtab_tasks.build_source(_vtab_data(), split=split, seed=0)
    assert source.num_examples == direct.num_examples == n
    np.testing.assert_array_equal(source.images, direct.images)
    np.testing.assert_array_equal(source.labels, direct.labels)
  with pytest.raises(ValueError, match="unknown VTAB split 'train'"):
    registry.build_source(_vtab_data(), split="train", seed=0)
  with pytest.raises(ValueError, match="valid names: .*vtab"):
    registry.build_source({"name": "vtab1k"}, split="train", seed=0)


def test_a_mixture_takes_no_source_with_splits_of_its_own():
  with pytest.raises(ValueError, match="cannot tell what 'vtab' is") as e:
    registry.build_source({"name": "mixture", "mixture": "vtab=1,digits=1"}, split="train",
                          seed=0)
  assert "digits" in str(e.value)


def test_backbone_builds_every_source_through_the_registry():
  graph = _graph()
  assert "darl_jax.data.sources.vtab_tasks" not in graph["darl_jax.train.backbone"]
  tree = ast.parse((ROOT / "darl_jax" / "train" / "backbone.py").read_text())
  by_name = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
             and any(isinstance(c, ast.Constant) and c.value == "vtab"
                     for c in [node.left, *node.comparators])]
  assert not by_name, f"backbone.py dispatches on a source name (lines {by_name})"
