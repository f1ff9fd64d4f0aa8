"""Device mesh and regex partition rules.

The mesh has three named axes, ``data``, ``fsdp`` and ``tensor``. Batches are
split over ``(data, fsdp)`` and replicated over ``tensor``; parameters and
optimizer state follow a list of ``(regex, rule)`` pairs chosen by name in the
config (``config.sharding``). The first regex that *searches* a leaf's
"/"-joined path wins, and every leaf must be covered (the lists end with a
catch-all).

A rule is one of

* a ``PartitionSpec``: used as is;
* ``"fsdp"``: shard the largest axis that divides by the ``fsdp`` axis size,
  replicate otherwise (ZeRO-3);
* a :class:`Split`: named mesh axes for the *trailing* dimensions of the leaf
  (right-aligned, so a scanned stack's leading layer axis stays whole), plus
  optionally ``"fsdp"`` on the largest remaining axis. This is how tensor
  (Megatron-style) parallelism is written.

Optimizer-state leaves carry their parameter's path as a suffix
(``0/mu/backbone/...``), so one rule list shards both.

Tensor parallelism splits attention heads and the MLP hidden dimension
(``tensor`` rules below)::

    attn/qkv/kernel  [D, 3, H, hd]  H over tensor
    attn/qkv/bias    [3, H, hd]     H
    attn/out/kernel  [H, hd, D]     H
    mlp/fc1/kernel   [D, F]         F
    mlp/fc1/bias     [F]            F
    mlp/fc2/kernel   [F, D]         F

so each block needs one reduction of its attention output and one of its MLP
output over ``tensor``; XLA's SPMD partitioner derives them from these
parameter shardings. Everything else (embeddings, norms, biases of size D,
the decoder head) is replicated over ``tensor``.

Multi-process meshes are laid out so that the devices of one process hold a
contiguous block of batch rows, in process order: process ``p`` feeds rows
``[p * b, (p + 1) * b)`` of the global batch, exactly the rows its data
source reads (``darl_jax/data/base.py``), so a run on P processes sees the same
global batches as a run on one process.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from darl_jax import ops
from darl_jax.mesh_axes import BATCH_AXES, MESH_AXES   # data, fsdp (the batch's), tensor


@dataclasses.dataclass(frozen=True)
class Split:
  """Trailing dimensions over named mesh axes (``None`` = whole), + optional fsdp.

  ``Split((None, "tensor"))`` on a ``[D, F]`` kernel shards F over ``tensor``;
  on a scanned ``[L, D, F]`` stack it shards the same F. With ``fsdp=True`` the
  largest of the remaining axes that divides by the fsdp size is split over
  ``fsdp`` as well.
  """
  dims: tuple = ()
  fsdp: bool = False


# Head and MLP-hidden dimensions, right-aligned (see the module docstring).
# ``mlp(_\d+)?`` also covers the residual-MLP decoder's ``mlp_0``, ``mlp_1``.
TENSOR_DIMS = (
    (r"attn/qkv/kernel$", (None, None, "tensor", None)),
    (r"attn/qkv/bias$", (None, "tensor", None)),
    (r"attn/out/kernel$", ("tensor", None, None)),
    (r"mlp(_\d+)?/fc1/kernel$", (None, "tensor")),
    (r"mlp(_\d+)?/fc1/bias$", ("tensor",)),
    (r"mlp(_\d+)?/fc2/kernel$", ("tensor", None)),
)

# fp8's histories (model_state["fp8"], darl_jax/fp8.py: 2 x 16 numbers a
# layer) stay whole on every device: each scale reads its whole history.
HISTORIES = (r"(^|/)history$", P())

PARTITION_RULES = {
    # Pure data parallelism: every device holds the whole state.
    "replicated": [(r".*", P())],
    # ZeRO-3 style: each parameter (and its Adam moments) split over `fsdp`.
    "fsdp": [HISTORIES, (r".*", "fsdp")],
    # Tensor parallelism over heads / MLP hidden units; the rest replicated.
    "tensor": [*((r, Split(d)) for r, d in TENSOR_DIMS), (r".*", P())],
    # Both: tensor dims as above, and every leaf's largest other axis over fsdp.
    "fsdp_tensor": [HISTORIES, *((r, Split(d, fsdp=True)) for r, d in TENSOR_DIMS),
                    (r".*", "fsdp")],
}


def check_rules(name: str):
  if name not in PARTITION_RULES:
    raise ValueError(f"unknown sharding {name!r}; valid: {', '.join(PARTITION_RULES)}")
  return PARTITION_RULES[name]


# ------------------------------------------------------------------------ mesh


def mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
  """``{data, fsdp, tensor}`` sizes for ``num_devices``; one size may be -1 (the rest)."""
  sizes = [int(mesh_cfg.get(a, 1)) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f"{num_devices} devices cannot be split into a mesh of "
                       f"{dict(zip(MESH_AXES, sizes))}")
    sizes[sizes.index(-1)] = num_devices // known
  if int(np.prod(sizes)) != num_devices:
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} "
                     f"devices, found {num_devices}; set config.mesh sizes to match "
                     "(use -1 for one axis to take the rest)")
  return dict(zip(MESH_AXES, sizes))


def _process_major(devices, sizes) -> np.ndarray:
  """Devices sorted by (process, id) and reshaped row-major: each process's
  devices form one contiguous block of the flattened mesh."""
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  return np.asarray(ordered, dtype=object).reshape(sizes)


def device_grid(sizes: list[int], devices) -> np.ndarray:
  """The ``[data, fsdp, tensor]`` array of devices for ``Mesh``.

  TPUs: ``mesh_utils.create_device_mesh``, which follows the physical torus so
  that neighbouring mesh positions are neighbouring chips (one slice), or
  ``create_hybrid_device_mesh`` over slices (multi-slice: the outer axes,
  ``data`` first, span slices). Everything else, and any TPU layout that
  cannot feed contiguous batch rows per process: process-major order.
  """
  devices = list(devices)
  if devices[0].platform == "tpu":
    from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
    try:
      slices = {getattr(d, "slice_index", 0) for d in devices}
      if len(slices) > 1:
        dcn = _split_outer(sizes, len(slices))
        ici = [s // d for s, d in zip(sizes, dcn)]
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
      else:
        grid = mesh_utils.create_device_mesh(sizes, devices)
      process_layout(grid)
      return grid
    except ValueError as e:
      logging.info("TPU topology-aware mesh not usable (%s); using process-major order", e)
  return _process_major(devices, sizes)


def _split_outer(sizes: list[int], parts: int) -> list[int]:
  """Factors ``parts`` over the mesh axes, outermost (``data``) first."""
  out, rest = [], parts
  for s in sizes:
    g = int(np.gcd(s, rest))
    out.append(g)
    rest //= g
  if rest != 1:
    raise ValueError(f"{parts} slices do not divide the mesh {sizes} axis by axis")
  return out


def process_layout(grid: np.ndarray) -> bool:
  """Checks that every batch shard lives on one process; True if in process order.

  Batch shard ``k = data_index * fsdp_size + fsdp_index`` is replicated over
  ``tensor``. If its devices belong to several processes, each of them would
  have to feed the same rows, but every process reads different data: that
  is a ValueError naming the fix. Returns whether process ``p`` holds shards
  ``[p * n, (p + 1) * n)`` (the data pipeline's order; any other order is
  still correct, but the global batch is then a permutation of the one a
  single process would build).
  """
  d, f, t = grid.shape
  owners = np.vectorize(lambda dev: dev.process_index, otypes=[int])(grid).reshape(d * f, t)
  split = [k for k in range(d * f) if len(set(owners[k])) > 1]
  if split:
    per_process = {}
    for p in owners.ravel():
      per_process[p] = per_process.get(p, 0) + 1
    local = min(per_process.values())
    raise ValueError(
        f"the mesh's tensor axis (size {t}) spans processes: batch shard {split[0]} "
        f"would need the same rows on processes {sorted(set(owners[split[0]]))}, but each "
        f"process reads its own data. Keep tensor parallelism inside a host: "
        f"config.mesh.tensor must divide the {local} local devices of a process")
  first = owners[:, 0]
  return bool(np.all(np.diff(first) >= 0))


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  """Mesh from ``{data, fsdp, tensor}`` sizes; one size may be -1 (the rest).

  ``devices`` given: reshaped in that order (tests). Otherwise all devices,
  laid out by :func:`device_grid` and checked by :func:`process_layout`.
  """
  explicit = devices is not None
  devices = np.asarray(devices if explicit else jax.devices(), dtype=object).ravel()
  sizes = list(mesh_shape(mesh_cfg, devices.size).values())
  grid = devices.reshape(sizes) if explicit else device_grid(sizes, devices)
  in_order = process_layout(grid)
  if not in_order:
    logging.info("mesh order differs from process order: global batches are assembled "
                 "in mesh order (correct, but not the row order of a 1-process run)")
  return Mesh(grid, MESH_AXES)


# The ``config.kernels`` choices that run our Pallas kernels (darl_jax/ops.py).
KERNEL_CHOICES = {"attention": ("hopper",), "mlp": ("hopper",), "norm": ("triton",)}


def kernel_mesh_warning(config, mesh: Mesh) -> str | None:
  """A warning for Pallas kernels on a mesh with a ``tensor`` axis of
  several devices, else None. ``config``: the run's config; its
  ``kernels`` section is resolved for this backend and ``model.dtype`` as
  the loop resolves it (``ops.resolve``), so ``auto`` choices count too.

  On the batch axes (data, fsdp) each device runs the kernels on its own
  rows (kernels/per_shard.py). The kernels compute whole heads and whole MLP
  widths, so over a tensor axis their parameters are gathered and every
  tensor device repeats its group's work: correct, but the tensor split
  buys nothing in those layers."""
  tensor = _axis_sizes(mesh).get("tensor", 1)
  if config is None or tensor <= 1:
    return None
  asked = config.get("kernels") or {}
  model = config.get("model") or {}
  chosen = ops.resolve(asked, model.get("dtype", "float32"), config.get("precision", "bf16"))
  on = []
  for op, values in KERNEL_CHOICES.items():
    value = getattr(chosen, op)
    if value in values:
      auto = (asked.get(op, "auto") or "auto") == "auto"
      on.append(f"kernels.{op}={value}" + (" (auto)" if auto else ""))
  if not on:
    return None
  return (f"{', '.join(on)} with mesh.tensor={tensor}: these Pallas "
          "kernels split over the batch axes (data, fsdp) only, so the tensor devices gather "
          "the layer's parameters and repeat the same work (correct, but slower than without "
          "them). With tensor parallelism set kernels.attention=cudnn, kernels.mlp=xla "
          "and kernels.norm=xla, or put the devices on data / fsdp.")


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over data x fsdp, the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def batch_shards(mesh: Mesh | None) -> int:
  """The devices a batch is split over (data x fsdp); 1 without a mesh."""
  return 1 if mesh is None else int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


# ------------------------------------------------------------- partition rules


def leaf_paths(tree):
  """Pytree of "/"-joined key paths, same structure as ``tree``."""
  def name(k):
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "/".join(name(k) for k in path), tree)


def _axis_sizes(mesh) -> Mapping[str, int]:
  """``Mesh`` / ``AbstractMesh`` / plain dict -> {axis: size}."""
  return dict(mesh.shape) if hasattr(mesh, "shape") and not isinstance(mesh, dict) else mesh


def _spec_for(rule, shape, mesh, path: str = "") -> P:
  """PartitionSpec of a leaf of ``shape`` under ``rule`` (see module docstring)."""
  if isinstance(rule, P):
    return rule
  if rule == "fsdp":
    rule = Split((), fsdp=True)
  if not isinstance(rule, Split):
    raise ValueError(f"unknown partition rule {rule!r}")
  sizes = _axis_sizes(mesh)
  spec = [None] * len(shape)
  if len(rule.dims) > len(shape):
    raise ValueError(f"partition rule {rule.dims} for {path!r} has more dimensions than "
                     f"its shape {tuple(shape)}")
  offset = len(shape) - len(rule.dims)
  for i, axis in enumerate(rule.dims):
    if axis is None or sizes.get(axis, 1) == 1:
      continue
    dim = shape[offset + i]
    if dim % sizes[axis]:
      raise ValueError(
          f"{path or 'a parameter'} of shape {tuple(shape)}: dimension {offset + i} "
          f"({dim}) does not divide by the {axis!r} mesh axis ({sizes[axis]}); choose "
          f"config.mesh.{axis} dividing the number of heads and the MLP width")
    spec[offset + i] = axis
  n = sizes.get("fsdp", 1)
  if rule.fsdp and n > 1:
    for axis in np.argsort(shape)[::-1]:   # the largest axis first
      if spec[axis] is None and shape[axis] % n == 0:
        spec[axis] = "fsdp"
        break
  return P(*spec) if any(a is not None for a in spec) else P()


def tree_specs(tree, mesh, rules) -> object:
  """PartitionSpecs for every leaf of ``tree`` (arrays or ShapeDtypeStructs).

  ``mesh`` may be a ``Mesh`` or just ``{axis: size}``, so memory estimates
  (``darl_jax/memory.py``) use the same rules without devices.
  """
  compiled = [(re.compile(r), rule) for r, rule in rules]

  def one(path, leaf):
    for regex, rule in compiled:
      if regex.search(path):
        return _spec_for(rule, tuple(getattr(leaf, "shape", ())), mesh, path)
    raise ValueError(f"no partition rule covers {path!r}; add a catch-all rule")

  return jax.tree_util.tree_map(one, leaf_paths(tree), tree)


def tree_shardings(tree, mesh: Mesh, rules) -> object:
  """NamedShardings for every leaf of ``tree`` (arrays or ShapeDtypeStructs)."""
  specs = tree_specs(tree, mesh, rules)
  if mesh.shape.get("tensor", 1) > 1 and not any(
      "tensor" in tuple(s) for s in jax.tree_util.tree_leaves(specs)):
    logging.warning("mesh.tensor=%d but no parameter is split over 'tensor': the tensor "
                    "devices repeat the same work; use sharding 'tensor' or 'fsdp_tensor'",
                    mesh.shape["tensor"])
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs)
