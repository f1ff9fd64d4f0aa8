"""Device mesh and regex partition rules.

The mesh has three named axes, ``data``, ``fsdp`` and ``tensor``. Batches are
split over ``(data, fsdp)``; parameters and optimizer state follow a list of
``(regex, rule)`` pairs chosen by name in the config (``config.sharding``). The
first regex that *searches* a leaf's "/"-joined path wins, and every leaf must
be covered (the lists end with a catch-all).

Rules are a ``PartitionSpec`` or ``"fsdp"``: shard the largest axis that divides
by the ``fsdp`` axis size, replicate otherwise. Optimizer-state leaves carry
their parameter's path as a suffix (``0/mu/backbone/...``), so one rule list
shards both.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

PARTITION_RULES = {
    # Pure data parallelism: every device holds the whole state.
    "replicated": [(r".*", P())],
    # ZeRO-3 style: each parameter (and its Adam moments) split over `fsdp`.
    "fsdp": [(r".*", "fsdp")],
}


def check_rules(name: str):
  if name not in PARTITION_RULES:
    raise ValueError(f"unknown sharding {name!r}; valid: {', '.join(PARTITION_RULES)}")
  return PARTITION_RULES[name]


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  """Mesh from ``{data, fsdp, tensor}`` sizes; one size may be -1 (the rest)."""
  devices = np.asarray(devices if devices is not None else jax.devices())
  sizes = [int(mesh_cfg.get(a, 1)) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if devices.size % known:
      raise ValueError(f"{devices.size} devices cannot be split into a mesh of "
                       f"{dict(zip(MESH_AXES, sizes))}")
    sizes[sizes.index(-1)] = devices.size // known
  if int(np.prod(sizes)) != devices.size:
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} "
                     f"devices, found {devices.size}; set config.mesh sizes to match "
                     "(use -1 for one axis to take the rest)")
  return Mesh(devices.reshape(sizes), MESH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over data x fsdp, the rest replicated."""
  return NamedSharding(mesh, P(("data", "fsdp")))


def leaf_paths(tree):
  """Pytree of "/"-joined key paths, same structure as ``tree``."""
  def name(k):
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "/".join(name(k) for k in path), tree)


def _spec_for(rule, shape, mesh: Mesh) -> P:
  if isinstance(rule, P):
    return rule
  if rule != "fsdp":
    raise ValueError(f"unknown partition rule {rule!r}")
  n = mesh.shape["fsdp"]
  if n == 1 or not shape:
    return P()
  for axis in np.argsort(shape)[::-1]:
    if shape[axis] % n == 0:
      spec = [None] * len(shape)
      spec[axis] = "fsdp"
      return P(*spec)
  return P()


def tree_shardings(tree, mesh: Mesh, rules) -> object:
  """NamedShardings for every leaf of ``tree`` (arrays or ShapeDtypeStructs)."""
  compiled = [(re.compile(r), rule) for r, rule in rules]

  def one(path, leaf):
    for regex, rule in compiled:
      if regex.search(path):
        return NamedSharding(mesh, _spec_for(rule, tuple(getattr(leaf, "shape", ())), mesh))
    raise ValueError(f"no partition rule covers {path!r}; add a catch-all rule")

  return jax.tree_util.tree_map(one, leaf_paths(tree), tree)
