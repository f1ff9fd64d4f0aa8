"""Per-device memory estimate for DARL pretraining, to choose a mesh before a run.

    python -m darl_jax.memory --variant=L/16 --batch_size=4096 \\
        --mesh=data:8,fsdp:4,tensor:1 --sharding=fsdp

prints one row per variant (default: B/16, L/16, H/14, g/14) with the
per-device GiB of each part, for the paper's ImageNet pretraining setup
(224x224, bf16 compute, diffusion decoder of one Transformer block).

What is counted
---------------
Parameter shapes come from the real model (``jax.eval_shape`` of its init, so
nothing is allocated) and each leaf is divided by the number of devices the
partition rules of ``--sharding`` split it over (``darl_jax/sharding.py``,
the rules the training loop uses):

* parameters: fp32, 4 bytes per element;
* gradients: fp32, sharded like the parameters, 4 bytes;
* Adam moments ``mu`` and ``nu``: fp32, 8 bytes;
* the EMA of the parameters (``ema_decay > 0``): fp32, 4 bytes (counted in
  the state total, not shown as a column);
* FSDP gather buffer (fsdp > 1): two blocks' worth of whole fp32 parameters
  (the block being computed and the next one being gathered).

Activations are what the backward pass keeps, per example and per block of
width ``D``, MLP width ``F``, ``H`` heads, ``T`` tokens, activation dtype of
``a`` bytes (2 for bf16) and tensor-parallel size ``t``::

    block (no remat) = a * T * (4 D + (4 D + 2 F) / t) + attention
        4 D:   block input, LN1 output, residual after attention, LN2 output
        4 D/t: rotated q and k, v, attention output (heads split over t)
        2 F/t: MLP hidden before and after the GELU
    attention = (4 + a) * (H / t) * T^2   for kernels.attention=xla (fp32
                softmax probabilities and their compute-dtype copy; also
                ``auto`` where it resolves to XLA's), 4 * (H / t) * T for
                cudnn and hopper (flash kernels keep only the log-sum-exp)
    block (remat=save_dots) = a * T * (2 D + (3 D + F) / t + D)
        the block input, q/k/v, both Dense outputs of width D, fc1 output
    block (remat=full) = a * T * D  (the block input)
        plus, once, one whole block being recomputed during the backward pass

The patch decoder (not rematerialised) adds ``depth * noise_samples`` blocks of
its own width over 2 tokens for every patch (attention over 2 tokens is
negligible). Per device the batch is ``batch_size / (data * fsdp)``.

Other trainers (fine-tuning, probes) are estimated from their own parameter
tree (``params=``) with the same block formula and no decoder. Parameters
that ``optim.frozen`` freezes get no gradient or Adam moments, and a frozen
backbone (a probe's, under ``stop_gradient``) keeps nothing for a backward
pass: one block's activations per example, transient, instead.

Gradient accumulation (``num_microbatches > 1``, ``batch_size`` then being
the microbatch) adds what lives for the whole step: the float32 gradient
sum (4 bytes per trained parameter) and the whole batch as the step
prepares it before splitting (float32 images, and for diffusion one noise
draw of the same size per ``noise_samples``); ``accumulation`` holds it.
Ignored: embeddings, the final LayerNorm, the loss, XLA's temporaries and
fragmentation, and the input pipeline.

The block formula omits float32 copies that LayerNorm and the loss keep,
so it reads low against XLA's buffer assignment of the real step, more so
without remat than with full remat (docs/TPU.md and benchmarks/RESULTS.md
hold the comparisons); the table therefore plans with 1.4x the ``none``
column and 1.1x the ``full`` column.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from darl_jax import cli as cli_lib

GIB = 2.0 ** 30
DEFAULT_VARIANTS = ("B/16", "L/16", "H/14", "g/14")
REMATS = ("none", "save_dots", "full")


@dataclasses.dataclass
class Estimate:
  """Per-device bytes of one configuration (see the module docstring)."""
  variant: str
  num_params: int
  params: float
  grads: float
  adam: float
  fsdp_buffer: float
  activations: dict          # remat -> bytes
  per_device_batch: int
  ema: float = 0.0
  accumulation: float = 0.0   # gradient sum and the prepared batch (module docstring)

  def state(self) -> float:
    return (self.params + self.grads + self.adam + self.ema + self.fsdp_buffer
            + self.accumulation)

  def total(self, remat: str) -> float:
    return self.state() + self.activations[remat]


def parse_mesh(text: str) -> dict[str, int]:
  """``"data:8,fsdp:4,tensor:1"`` -> ``{"data": 8, "fsdp": 4, "tensor": 1}``."""
  from darl_jax import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  sizes = {a: 1 for a in sharding_lib.MESH_AXES}
  for item in filter(None, text.split(",")):
    name, _, value = item.partition(":")
    if name not in sizes or not value.isdigit() or int(value) < 1:
      raise ValueError(f"bad mesh entry {item!r}: use axis:size with axis one of "
                       f"{', '.join(sizes)}, e.g. data:8,fsdp:4,tensor:1")
    sizes[name] = int(value)
  return sizes


def pretrain_config(variant: str, objective: str = "diffusion", *, kernels=None, **model):
  """The paper's ImageNet pretraining config for ``variant``, model keys
  (and ``kernels``: ``config.kernels`` keys) overridden."""
  from darl_jax import config_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.imagenet_pretrain_config(variant, objective)
  config.model.update(model)
  config.kernels.update(kernels or {})
  return config


def abstract_params(config):
  """``jax.ShapeDtypeStruct`` tree of the DARL model's parameters (nothing allocated)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from darl_jax.models import darl as darl_lib  # pylint: disable=g-import-not-at-top
  model = darl_lib.darl_from_config(config)
  size, channels = config.model.image_size, config.model.channels
  image = jnp.zeros((1, size, size, channels), jnp.float32)
  init = lambda rng: model.init({"params": rng, "noise": rng}, image, train=False)
  return jax.eval_shape(init, jax.random.PRNGKey(0))["params"]


def _shards(spec, mesh: dict[str, int]) -> int:
  n = 1
  for entry in spec:
    for axis in (entry if isinstance(entry, tuple) else (entry,)):
      if axis is not None:
        n *= mesh[axis]
  return n


def block_activation_bytes(*, tokens: int, width: int, mlp_dim: int, heads: int,
                           act_bytes: int, tensor: int, remat: str,
                           attention: str = "xla") -> float:
  """Bytes one example keeps for the backward pass of one block (module
  docstring); ``attention``: the implementation that runs (``cudnn`` and
  ``hopper`` keep no probabilities; anything else counts as XLA's)."""
  t, a, d, f = tensor, act_bytes, width, mlp_dim
  if remat == "full":
    return a * tokens * d
  if remat == "save_dots":
    return a * tokens * (2 * d + (3 * d + f) / t + d)
  if remat != "none":
    raise ValueError(f"unknown remat {remat!r}; valid: {', '.join(REMATS)}")
  if attention in ("cudnn", "hopper"):   # flash kernels keep the log-sum-exp only
    attention = 4 * heads / t * tokens
  else:
    attention = (4 + a) * heads / t * tokens ** 2
  return a * tokens * (4 * d + (4 * d + 2 * f) / t) + attention


def estimate(config, mesh: dict[str, int], sharding: str, batch_size: int,
             params=None, num_microbatches: int = 1) -> Estimate:
  """Per-device memory of pretraining ``config`` on ``mesh`` with rules
  ``sharding`` (another trainer's: pass its ``params``), ``batch_size``
  examples at once, ``num_microbatches`` of them per step (module
  docstring). The attention's share follows ``config.kernels.attention``
  as resolved on this backend (``ops.resolve``: ``auto`` is the Hopper
  kernels on an H100 in bfloat16, else counted as XLA's)."""
  import jax  # pylint: disable=g-import-not-at-top
  from darl_jax import ops  # pylint: disable=g-import-not-at-top
  from darl_jax import optim  # pylint: disable=g-import-not-at-top
  from darl_jax import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  from darl_jax.models import vit as vit_lib  # pylint: disable=g-import-not-at-top

  params = abstract_params(config) if params is None else params
  rules = sharding_lib.check_rules(sharding)
  specs = sharding_lib.tree_specs(params, mesh, rules)
  leaves = jax.tree_util.tree_leaves(params)
  numels = [int(np.prod(x.shape)) for x in leaves]
  shares = [n / _shards(s, mesh) for n, s in zip(numels, jax.tree_util.tree_leaves(specs))]
  local = sum(shares)
  # What optim.frozen freezes has no gradient and no optimizer state.
  labels = jax.tree_util.tree_leaves(
      optim.frozen_labels(config.get("optim", {}), params)) if config.get("optim") else None
  frozen_paths = [p for p, label in zip(
      jax.tree_util.tree_leaves(optim.param_paths(params)), labels or ()) if label == "frozen"]
  trained = local if labels is None else sum(
      x for x, label in zip(shares, labels) if label == "train")
  frozen_backbone = any(p.startswith("backbone/") for p in frozen_paths)

  batch_shards = mesh["data"] * mesh["fsdp"]
  if batch_size % batch_shards:
    raise ValueError(f"batch_size {batch_size} does not divide by data x fsdp = {batch_shards}")
  per_device = batch_size // batch_shards

  m = config.model
  variant, patch = vit_lib.parse_variant(m.variant)
  width = m.get("width") or variant.width
  depth = m.get("depth") or variant.depth
  heads = m.get("num_heads") or variant.num_heads
  mlp_dim = m.get("mlp_dim") or variant.mlp_dim
  tokens = (m.image_size // patch) ** 2          # [SOS, x_1 .. x_{N-1}]: N tokens
  dtype = m.get("dtype", "float32")
  act_bytes = 2 if dtype == "bfloat16" else 4
  kw = dict(act_bytes=act_bytes, tensor=mesh["tensor"],
            attention=ops.resolve(config.get("kernels"), dtype).attention)

  dec = config.get("decoder", {})
  dec_blocks = 0
  if dec and dec.get("kind") == "transformer":
    dec_blocks = dec.get("depth", 1) * config.loss.get("noise_samples", 1)
  dec_width = (dec.get("width", 0) if dec else 0) or width
  dec_heads = (dec.get("num_heads", 0) if dec else 0) or heads
  # Every one of the `tokens` patches runs the decoder over a 2-token sequence.
  decoder = dec_blocks * tokens * block_activation_bytes(
      tokens=2, width=dec_width, mlp_dim=4 * dec_width, heads=dec_heads, remat="none",
      **kw)

  one_block = block_activation_bytes(tokens=tokens, width=width, mlp_dim=mlp_dim,
                                     heads=heads, remat="none", **kw)
  activations = {}
  for remat in REMATS:
    per_example = depth * block_activation_bytes(
        tokens=tokens, width=width, mlp_dim=mlp_dim, heads=heads, remat=remat, **kw)
    if remat != "none":   # one block recomputed at a time in the backward pass
      per_example += one_block
    if frozen_backbone:   # a forward pass only: one block's activations at a time
      per_example = one_block
    activations[remat] = per_device * (per_example + decoder)

  accumulation = 0.0
  if num_microbatches > 1:
    pixels = m.image_size * m.image_size * m.get("channels", 3)
    draws = config.loss.get("noise_samples", 1) if config.get("loss", {}).get(
        "kind") == "diffusion" else 0
    accumulation = 4 * trained + 4 * pixels * (1 + draws) * per_device * num_microbatches

  block_params = 4 * width * width + 2 * width * mlp_dim + 9 * width + mlp_dim
  fsdp_buffer = 2 * 4 * block_params if mesh["fsdp"] > 1 else 0.0
  return Estimate(variant=m.variant, num_params=sum(numels), params=4 * local,
                  grads=4 * trained, adam=8 * trained, fsdp_buffer=fsdp_buffer,
                  activations=activations, per_device_batch=per_device,
                  ema=4 * local if config.get("ema_decay", 0.0) else 0.0,
                  accumulation=accumulation)


def table(estimates: list[Estimate], device_gib: float | None = None) -> str:
  """Fixed-width text table, GiB per device."""
  head = ["variant", "params", "param", "grad", "adam", "gather",
          *(f"act:{r}" for r in REMATS), *(f"total:{r}" for r in REMATS)]
  rows = []
  for e in estimates:
    row = [e.variant, f"{e.num_params / 1e6:.0f}M",
           *(f"{v / GIB:.2f}" for v in (e.params, e.grads, e.adam, e.fsdp_buffer)),
           *(f"{e.activations[r] / GIB:.2f}" for r in REMATS)]
    for r in REMATS:
      cell = f"{e.total(r) / GIB:.2f}"
      if device_gib:
        measured = e.total(r) * (1.4 if r == "none" else 1.1)   # see the docstring
        cell += " ok" if measured <= 0.85 * device_gib * GIB else " !!"
      row.append(cell)
    rows.append(row)
  widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
  fmt = lambda r: "  ".join(str(x).rjust(w) for x, w in zip(r, widths))
  return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def main(argv=None) -> str:
  # cli_lib.ArgumentParser: a flag error is one ``error:`` line, status 2; the
  # ValueErrors below (a bad --mesh or --variant) are the flags' too: 2.
  parser = cli_lib.ArgumentParser(
      prog="python -m darl_jax.memory",
      description="Per-device memory estimate (GiB) for DARL pretraining.")
  parser.add_argument("--variant", default=",".join(DEFAULT_VARIANTS),
                      help="comma-separated ViT variants, e.g. L/16 or B/16,H/14")
  parser.add_argument("--batch_size", type=int, default=4096, help="global batch size")
  parser.add_argument("--mesh", default="data:8,fsdp:4,tensor:1",
                      help="mesh sizes, axis:size comma-separated")
  parser.add_argument("--sharding", default="fsdp",
                      help="partition rules: replicated, fsdp, tensor, fsdp_tensor")
  parser.add_argument("--image_size", type=int, default=224)
  parser.add_argument("--objective", default="diffusion", choices=("diffusion", "mse"))
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--attention", default="xla", choices=("xla", "cudnn", "hopper"),
                      help="kernels.attention of the run (cudnn and hopper keep no "
                           "attention probabilities)")
  parser.add_argument("--device_gib", type=float, default=None,
                      help="device memory; marks totals that fit in 85%% of it 'ok' "
                           "(after the measured 1.4x for remat none, 1.1x otherwise)")
  args = parser.parse_args(argv)
  mesh = parse_mesh(args.mesh)
  estimates = []
  for variant in filter(None, args.variant.split(",")):
    config = pretrain_config(variant, args.objective, image_size=args.image_size,
                             dtype=args.dtype, kernels={"attention": args.attention})
    estimates.append(estimate(config, mesh, args.sharding, args.batch_size))
  n = int(np.prod(list(mesh.values())))
  lines = [f"per-device GiB: batch {args.batch_size} ({estimates[0].per_device_batch} per "
           f"device), mesh {mesh} ({n} devices), sharding={args.sharding}, "
           f"{args.image_size}px, {args.dtype} activations, attention={args.attention}",
           table(estimates, args.device_gib),
           "act:<remat> = activations with model.remat=<remat>; gather = FSDP all-gather "
           "buffer. Measured XLA peaks were up to 1.4x total:none and 1.0x total:full "
           "(see darl_jax/memory.py)"]
  return "\n".join(lines)


def cli(argv=None) -> None:
  """The command: ``main``'s table, or one ``error:`` line (status 2 for a
  bad flag value, the ValueErrors of main; darl_jax/cli.py)."""
  print(cli_lib.guarded(main, argv, failed=cli_lib.USAGE))


if __name__ == "__main__":
  cli()
