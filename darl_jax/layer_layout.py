"""The two layouts of a stack of blocks in a parameter tree, and conversion between them.

Unrolled (``model.scan_layers=False``): one subtree per block, ``block_00``,
``block_01`` .. in the backbone, ``block_0``, ``block_1`` .. in the patch
decoder. Scanned (``nn.scan``, models/vit.py ``scan_blocks``): one subtree
``blocks/block`` of the same names whose leaves carry a leading layer axis.
The decoder scans all but its last block (the read-out one), which keeps its
unrolled name beside ``blocks``.

Every tree that mirrors the parameters converts the same way: the optimizer
state (Adam's ``mu``/``nu``), the EMA, a checkpoint's Orbax metadata, an
abstract state of ``jax.ShapeDtypeStruct`` (the sharding follows: the layer
axis is not split). ``convert(tree, like)`` brings ``tree`` into ``like``'s
layout wherever the two differ, so that a checkpoint saved in one form
resumes, initialises and exports a model of the other.

``scanned_twin`` gives a model's scanned form, which the train loop
initialises a fresh state with (train/loop.py, ``init_state_fn``).

Imports nothing of the package: models/, train/, export and sampling use it.
"""

from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

SCANNED = "blocks"   # the nn.scan module's name
LAYER = "block"      # the scanned module's name inside it
_BLOCK = re.compile(r"block_(\d+)")


def is_stack(node) -> bool:
  """Whether ``node`` is a scanned stack's subtree (``{"block": ...}``)."""
  return isinstance(node, dict) and set(node) == {LAYER}


def block_names(node: dict) -> list[str]:
  """``node``'s unrolled block keys in layer order (``block_2`` before ``block_10``)."""
  names = [k for k in node if isinstance(k, str) and _BLOCK.fullmatch(k)]
  return sorted(names, key=lambda k: int(_BLOCK.fullmatch(k).group(1)))


def is_scanned(tree) -> bool:
  """Whether any dict in ``tree`` holds a scanned stack."""
  if isinstance(tree, dict):
    return (is_stack(tree.get(SCANNED))
            or any(is_scanned(v) for v in tree.values()))
  if isinstance(tree, (list, tuple)):
    return any(is_scanned(v) for v in tree)
  return False


# ------------------------------------------------------------------ one stack


def _stack_leaves(*leaves):
  first = leaves[0]
  if isinstance(first, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype,
                                sharding=_layer_sharding(first.sharding, add=True))
  if isinstance(first, (np.ndarray, np.generic)):   # host arrays stay on the host
    return np.stack(leaves)
  return jnp.stack(leaves)


def _take_leaf(leaf, i: int):
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype,
                                sharding=_layer_sharding(leaf.sharding, add=False))
  return leaf[i]


def _layer_sharding(sharding, *, add: bool):
  """The sharding of a leaf with its layer axis added (``add``) or taken
  away: a named sharding's spec gains or loses its first entry (the layer
  axis is never split); others (one device, replicated) fit any shape."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  spec = tuple(sharding.spec)
  spec = (None, *spec) if add else spec[1:]
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


def _depth(stacked) -> int | None:
  shapes = [getattr(x, "shape", None) for x in jax.tree_util.tree_leaves(stacked)]
  shapes = [s for s in shapes if s]
  return shapes[0][0] if shapes else None


def stack(node: dict, names: list[str]) -> dict:
  """``node`` with its blocks ``names`` (in layer order) replaced by one
  ``blocks/block`` whose leaves are theirs stacked on a new first axis."""
  if not names:
    raise ValueError("no blocks to stack")
  blocks = [node[k] for k in names]
  structures = {jax.tree_util.tree_structure(b) for b in blocks}
  if len(structures) != 1:
    raise ValueError(f"blocks {', '.join(names)} hold different parameters; they cannot "
                     "be stacked into one scanned layer")
  out = {k: v for k, v in node.items() if k not in names}
  out[SCANNED] = {LAYER: jax.tree_util.tree_map(_stack_leaves, *blocks)}
  return out


def unstack(node: dict, names: list[str]) -> dict:
  """``node`` with ``blocks/block`` replaced by one block per name (layer
  ``i`` of every leaf under ``names[i]``)."""
  stacked = node[SCANNED][LAYER]
  depth = _depth(stacked)
  if depth is not None and depth != len(names):
    raise ValueError(f"the scanned blocks hold {depth} layers, not the {len(names)} "
                     f"blocks {names[0]} .. {names[-1]}")
  out = {k: v for k, v in node.items() if k != SCANNED}
  for i, name in enumerate(names):
    out[name] = jax.tree_util.tree_map(lambda leaf, i=i: _take_leaf(leaf, i), stacked)
  return out


def unscan(tree, name=lambda i: f"block_{i:02d}"):
  """``tree`` with every scanned stack unstacked, layer ``i`` named
  ``name(i)`` (the backbone's ``block_XX`` by default)."""
  if isinstance(tree, dict):
    if is_stack(tree.get(SCANNED)):
      depth = _depth(tree[SCANNED][LAYER])
      tree = unstack(tree, [name(i) for i in range(depth)])
    return {k: unscan(v, name) for k, v in tree.items()}
  return tree


# ------------------------------------------------------------------ whole trees


def _child(like, key):
  """``like``'s entry for ``key``, or None. ``like`` may be a live tree or
  Orbax's metadata of one, where namedtuples become dicts and sequences
  dicts or lists."""
  if isinstance(like, dict):
    for k in (key, str(key)):
      if k in like:
        return like[k]
    return None
  if isinstance(like, (list, tuple)) and isinstance(key, int) and key < len(like):
    return like[key]
  if isinstance(key, str) and hasattr(like, "_fields") and key in like._fields:
    return getattr(like, key)
  return None


def convert(tree, like):
  """``tree`` in ``like``'s block layout: at every dict where ``like``
  scans the blocks that ``tree`` holds unrolled they are stacked, and the
  other way round unstacked, taking ``like``'s names. The rest of ``tree``
  (its containers, namedtuples included, and leaves) is kept; where
  ``like`` has no counterpart nothing changes."""
  if like is None:
    return tree
  if isinstance(tree, dict):
    if isinstance(like, dict):
      tree = _convert_node(tree, like)
    return {k: convert(v, _child(like, k)) for k, v in tree.items()}
  if hasattr(tree, "_fields"):   # a namedtuple (optax states)
    return type(tree)(*(convert(v, _child(like, f)) for f, v in zip(tree._fields, tree)))
  if isinstance(tree, (list, tuple)):
    return type(tree)(convert(v, _child(like, i)) for i, v in enumerate(tree))
  return tree


def _convert_node(tree: dict, like: dict) -> dict:
  tree_scans, like_scans = is_stack(tree.get(SCANNED)), is_stack(like.get(SCANNED))
  if like_scans and not tree_scans:
    names = [k for k in block_names(tree) if k not in like]
    return stack(tree, names) if names else tree
  if tree_scans and not like_scans:
    names = [k for k in block_names(like) if k not in tree]
    if not names:
      raise ValueError(f"scanned blocks meet a tree without blocks (keys {sorted(like)})")
    return unstack(tree, names)
  return tree


def differs(tree, like) -> bool:
  """Whether ``convert(tree, like)`` changes ``tree``'s layout."""
  if like is None:
    return False
  if isinstance(tree, dict):
    if isinstance(like, dict) and (is_stack(tree.get(SCANNED))
                                   != is_stack(like.get(SCANNED))):
      return True
    return any(differs(v, _child(like, k)) for k, v in tree.items())
  if hasattr(tree, "_fields"):
    return any(differs(v, _child(like, f)) for f, v in zip(tree._fields, tree))
  if isinstance(tree, (list, tuple)):
    return any(differs(v, _child(like, i)) for i, v in enumerate(tree))
  return False


def describe(tree) -> str:
  """``"scanned"`` or ``"unrolled"`` blocks, for log lines."""
  return "scanned" if is_scanned(tree) else "unrolled"


# ------------------------------------------------------------------ modules


def scanned_twin(module):
  """``module`` (a Flax module) with every stack of blocks scanned: each
  module in its tree of module fields that has a ``scan_layers`` field gets
  ``scan_layers=True``. None when nothing changes (no unrolled stack). The
  twin's parameters are ``module``'s in the scanned layout (``convert``).
  None too for what is not a Flax module (a trainer's own model object)."""
  if not isinstance(module, nn.Module):
    return None
  changes = {}
  for field in dataclasses.fields(module):
    if field.name in ("parent", "name"):
      continue
    value = getattr(module, field.name)
    if isinstance(value, nn.Module):
      twin = scanned_twin(value)
      if twin is not None:
        changes[field.name] = twin
    elif field.name == "scan_layers" and not value:
      changes["scan_layers"] = True
  return module.clone(parent=None, **changes) if changes else None
