"""Per-device memory estimate of a train step, to choose a mesh and a microbatch.

    python -m darl_jax.memory --variant=L/16 --batch_size=4096 \\
        --mesh=data:8,fsdp:4,tensor:1 --sharding=fsdp

prints one row per variant (default: B/16, L/16, H/14, g/14) with the
per-device GiB of each part, for the paper's ImageNet pretraining setup on
GPUs (224x224, bf16 compute, diffusion decoder of one Transformer block).
The training CLI's automatic microbatch (``microbatch_size=-1``,
train/fit.py) reads ``estimate`` for every trainer, on the backend that
compiles the step, before anything compiles.

The state
---------
Parameter shapes come from the run's tree (``params=``; default: the DARL
model's, ``jax.eval_shape`` of its init) and each leaf is divided by the
number of devices the partition rules of ``--sharding`` split it over
(``darl_jax/sharding.py``, the rules the training loop uses):

* parameters: fp32, 4 bytes per element;
* gradients: fp32, sharded like the parameters, 4 bytes;
* optimizer state (column ``adam``): AdamW's ``mu`` and ``nu``, 8 bytes;
  LARS's or SGD's momentum, 4;
* the EMA of the parameters (``ema_decay > 0``): fp32, 4 bytes (counted in
  the state total, not shown as a column);
* FSDP gather buffer (fsdp > 1): two blocks' worth of whole fp32 parameters
  (the block being computed and the next one being gathered).

Parameters that ``optim.frozen`` freezes get no gradient or optimizer
state. Gradient accumulation (``num_microbatches > 1``, ``batch_size``
then being the microbatch) adds what lives for the whole step: the float32
gradient sum and the whole batch as the step prepares it before splitting
(float32 images, and for diffusion one noise draw of the same size per
``noise_samples``); ``accumulation`` holds it.

Activations of a trained backbone
---------------------------------
What the backward pass keeps, per example and per block of width ``D``,
MLP width ``F``, ``H`` heads, ``T`` tokens, activation dtype of ``a``
bytes (2 for bf16) and tensor-parallel size ``t``::

    block (no remat) = a * T * (4 D + (4 D + 2 F) / t) + attention
        4 D:   block input, LN1 output, residual after attention, LN2 output
        4 D/t: rotated q and k, v, attention output (heads split over t)
        2 F/t: MLP hidden before and after the GELU
    attention = (4 + a) * (H / t) * T^2   where XLA's attention runs (fp32
                softmax probabilities and their compute-dtype copy),
                4 * (H / t) * T where a flash kernel does (the log-sum-exp)
    fp8 (precision='fp8') adds T * ((1 - a) (2 D + F / t) + D / t): the
        LN outputs and the GELU's output kept as 1-byte copies instead,
        and a 1-byte copy of the attention output beside it
    block (remat=save_dots) = a * T * (2 D + (3 D + F) / t + D)
        the block input, q/k/v, both Dense outputs of width D, fc1 output
    block (remat=full) = a * T * D  (the block input)
        plus, once, one whole block being recomputed during the backward pass

Which attention runs follows darl_jax/ops.py's dispatch
(``attention_implementation``): the Hopper kernel takes causal attention
only, cuDNN 16-bit sequences of even length on a GPU, and the rest is
XLA's, so a fine-tune's full attention over ``[SOS, x_1 .. x_N]`` (N + 1
tokens, odd for N = 196 or 256) keeps its probabilities. ``T`` is the
trainer's sequence: N tokens in pretraining (``[SOS, x_1 .. x_{N-1}]``),
N + 1 in a classifier with ``head.sos`` and in a probe's frozen pass.

Beside the blocks, per example: the patches (``a`` bytes a pixel, the
embedding's gradient reads them), the final LayerNorm's output and the
backward's first wide temporary, the gradient of one MLP hidden layer.
Pretraining adds, per patch and noise draw, the float32 prediction and its
error, and for the Transformer decoder (not rematerialised) its two token
embeddings, its full blocks over the two tokens, the read-out block (the
last one, which computes the second token alone), its final LayerNorm and
the float32 noisy patch. A classifier's head, logits and mixed, smoothed
targets are ``K`` floats per example, nothing beside the blocks.

Probes: a frozen backbone
-------------------------
A probe's backbone (frozen by ``optim.frozen``, its output under
``stop_gradient``) keeps nothing for a backward pass: per example, the most
its forward pass holds at once, the larger of a block's MLP (the residual
and the hidden layer before and after the GELU) and its attention (the
residual, the LN1 output, and for XLA's attention the float32 logits and
exponentials and the probabilities). The attentive probe's head then holds,
per chosen block, the float32 patch tokens, their keys and values and, in
its backward pass, their gradients; a linear probe's pooled features are
``D`` floats. A probe grid's heads live in the model state, which
``estimate`` is not given: not counted.

The step's peak
---------------
XLA reuses the backward pass's memory for the optimizer's update, so the
total is the state plus the larger of the two: ``Estimate.total``.
Ignored: what lives beside the step (evaluation programs, prefetched
batches), the allocator's fragmentation and the input pipeline.

XLA:CPU
-------
The CPU compiler (tests, ``backend="cpu"``) keeps float32 intermediates
that the GPU's and TPU's fusions recompute, counted for it alone: two
float32 copies of each LayerNorm's input, GELU's float32 ``erf`` (common
subexpression of the forward pass and the recomputing backward), the
softmax's float32 exponentials, and for full attention one broadcast
``[H, T, T]`` float32 constant. Its pipeline merges a rematerialised
block's recomputation back into the forward pass, so every ``remat`` keeps
what ``none`` does. Its update copies the state it overwrites: half a float32
copy of the trained parameters (the old moments of the leaves being
updated), and with an EMA two whole copies more (the old parameters and
the update's direction, held for every leaf at once); the accelerators
update in place.

XLA:TPU
-------
For full attention run by XLA (a fine-tune's, a classifier's) the TPU
compiler keeps one float32 ``[H / t, T, T]`` more per block than the count
above (the logits beside the probabilities); for causal attention it does
not. Read off the TPU compile table's fine-tuning rows (docs/TPU.md has
them beside the estimate).

The CLI's table plans with 1.4x the ``none`` column and 1.1x the ``full``
column, the margin XLA's GPU buffer assignment needed beyond the block
formula with XLA's LayerNorm and MLP (docs/SCALING.md).
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
  update: float = 0.0         # the optimizer update's temporaries (module docstring)

  def state(self) -> float:
    return (self.params + self.grads + self.adam + self.ema + self.fsdp_buffer
            + self.accumulation)

  def total(self, remat: str) -> float:
    """The state and the larger of the backward pass's activations and the
    update's temporaries: XLA reuses the one's memory for the other."""
    return self.state() + max(self.activations[remat], self.update)


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


def attention_implementation(kernel: str, *, causal: bool, tokens: int, dtype: str,
                             backend: str) -> str:
  """What a self-attention over ``tokens`` keys keeps for its backward pass,
  by darl_jax/ops.py's dispatch (``ops.attention``) of ``kernel`` (the
  resolved ``kernels.attention``): ``"flash"`` (cuDNN's or the Hopper
  kernel: the log-sum-exp only) or ``"xla"`` (the probabilities). The
  Hopper kernel runs causal attention only; cuDNN, and ``auto``, take
  16-bit inputs of even length on a GPU; anything else is XLA's."""
  from darl_jax import ops  # pylint: disable=g-import-not-at-top
  if tokens <= ops.SHORT_KEYS:
    return "xla"
  if kernel == "hopper" and causal:
    return "flash"
  if kernel == "cudnn":
    return "flash"
  if kernel in ("auto", "hopper"):
    sixteen_bit = dtype in ("bfloat16", "float16")
    return "flash" if backend == "gpu" and sixteen_bit and tokens % 2 == 0 else "xla"
  return "xla"


@dataclasses.dataclass(frozen=True)
class Kernels:
  """What the step's ops keep (module docstring): ``attention``, ``"flash"``
  or ``"xla"`` (attention_implementation); ``mlp`` and ``norm``, whether
  XLA's ops run them (``"xla"``) or darl_jax/kernels' (anything else);
  ``cpu``, whether XLA:CPU compiles the step (its fusions keep more);
  ``tpu``, whether XLA:TPU does (tpu_block_bytes); ``fp8``, whether the
  dense layers keep float8 copies of their inputs (``precision='fp8'``,
  darl_jax/fp8.py)."""
  attention: str = "xla"
  mlp: str = "xla"
  norm: str = "xla"
  cpu: bool = False
  fp8: bool = False
  tpu: bool = False


def block_activation_bytes(*, tokens: int, width: int, mlp_dim: int, heads: int,
                           act_bytes: int, tensor: int, remat: str,
                           kernels: Kernels = Kernels(), causal: bool = True) -> float:
  """Bytes one example keeps for the backward pass of one block (module
  docstring): the accelerators' count, and XLA:CPU's or XLA:TPU's beyond it
  (``cpu_block_bytes``, ``tpu_block_bytes``) where ``kernels`` names them;
  ``causal``, whether the block's attention is."""
  t, a, d, f = tensor, act_bytes, width, mlp_dim
  if remat == "full":
    return a * tokens * d
  if remat == "save_dots":
    return a * tokens * (2 * d + (3 * d + f) / t + d)
  if remat != "none":
    raise ValueError(f"unknown remat {remat!r}; valid: {', '.join(REMATS)}")
  if kernels.attention == "flash":   # flash kernels keep the log-sum-exp only
    attention = 4 * heads / t * tokens
  else:
    attention = (4 + a) * heads / t * tokens ** 2
  fp8 = 0.0
  if kernels.fp8 and not kernels.cpu:   # XLA:CPU: cpu_block_bytes
    # The dense layers keep 1-byte copies of their inputs: LN1's and LN2's
    # outputs and the GELU's (which nothing else keeps) in place of their
    # a-byte ones; the attention output is kept by attention's backward
    # too, so its copy comes on top.
    fp8 = tokens * ((1 - a) * (2 * d + f / t) + d / t)
  return (a * tokens * (4 * d + (4 * d + 2 * f) / t) + attention + fp8
          + cpu_block_bytes(tokens=tokens, width=width, mlp_dim=mlp_dim, heads=heads,
                            tensor=tensor, kernels=kernels)
          + tpu_block_bytes(tokens=tokens, heads=heads, tensor=tensor, causal=causal,
                            kernels=kernels))


def cpu_block_bytes(*, tokens: int, width: int, mlp_dim: int, heads: int, tensor: int,
                    kernels: Kernels) -> float:
  """What XLA:CPU keeps of one block beyond ``block_activation_bytes``'s
  count (module docstring, "XLA:CPU"); 0 for other backends."""
  if not kernels.cpu:
    return 0.0
  t, d, f = tensor, width, mlp_dim
  extra = 0.0
  if kernels.norm == "xla":          # two float32 copies of each LayerNorm's input
    extra += 2 * 2 * 4 * tokens * d
  if kernels.mlp == "xla":           # GELU's float32 erf, shared with its backward
    extra += 4 * tokens * f / t
  if kernels.attention != "flash":   # the softmax's float32 exponentials
    extra += 4 * heads / t * tokens ** 2
  # fp8 (emulated): XLA:CPU multiplies float32 copies of the float8 inputs
  # and keeps them for the backward pass, so the 1-byte copies save nothing
  # there (block_activation_bytes leaves its fp8 term out on CPU).
  return extra


def tpu_block_bytes(*, tokens: int, heads: int, tensor: int, causal: bool,
                    kernels: Kernels) -> float:
  """What XLA:TPU keeps of one block beyond ``block_activation_bytes``'s
  count (module docstring, "XLA:TPU"); 0 for other backends."""
  if not kernels.tpu or causal or kernels.attention == "flash":
    return 0.0
  return 4 * heads / tensor * tokens ** 2


def _model_dims(config) -> dict:
  """Width, depth, heads, MLP width and patch size of ``config.model``."""
  from darl_jax.models import vit as vit_lib  # pylint: disable=g-import-not-at-top
  m = config.model
  variant, patch = vit_lib.parse_variant(m.variant)
  return dict(width=m.get("width") or variant.width, depth=m.get("depth") or variant.depth,
              heads=m.get("num_heads") or variant.num_heads,
              mlp_dim=m.get("mlp_dim") or variant.mlp_dim, patch=patch)


def _sequence(config, patches: int) -> tuple[int, bool]:
  """``(tokens, causal)`` of the backbone's pass in ``config.trainer``'s
  step: pretraining runs ``[SOS, x_1 .. x_{N-1}]`` (N tokens), a classifier
  ``[SOS, x_1 .. x_N]`` (without SOS where ``head.sos`` is off), a probe's
  frozen pass ``[SOS, x_1 .. x_N]``."""
  trainer = config.get("trainer", "pretrain")
  causal = bool(config.model.get("causal", True))
  if trainer in ("finetune", "supervised"):
    return patches + (1 if config.get("head", {}).get("sos", True) else 0), causal
  if trainer in ("linear_probe", "attentive_probe"):
    return patches + 1, causal
  return patches, causal


def estimate(config, mesh: dict[str, int], sharding: str, batch_size: int,
             params=None, num_microbatches: int = 1, backend: str | None = None) -> Estimate:
  """Per-device memory of pretraining ``config`` on ``mesh`` with rules
  ``sharding`` (another trainer's: pass its ``params``), ``batch_size``
  examples at once, ``num_microbatches`` of them per step (module
  docstring). The attention's share follows ``config.kernels.attention``
  as resolved on this backend (``ops.resolve``: ``auto`` is the Hopper
  kernels on an H100 in bfloat16, else cuDNN's where it takes the
  sequence, else XLA's); ``backend``: the XLA backend that compiles the
  step (default: JAX's default backend; ``cpu`` counts what XLA:CPU keeps
  beyond the GPU's and TPU's fusions)."""
  import jax  # pylint: disable=g-import-not-at-top
  from darl_jax import ops  # pylint: disable=g-import-not-at-top
  from darl_jax import optim  # pylint: disable=g-import-not-at-top
  from darl_jax import sharding as sharding_lib  # pylint: disable=g-import-not-at-top

  params = abstract_params(config) if params is None else params
  backend = backend or _platform(params) or jax.default_backend()
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
  dims = _model_dims(config)
  width, depth, heads, mlp_dim = dims["width"], dims["depth"], dims["heads"], dims["mlp_dim"]
  patch, channels = dims["patch"], m.get("channels", 3)
  patches = (m.image_size // patch) ** 2
  tokens, causal = _sequence(config, patches)
  dtype = m.get("dtype", "float32")
  act_bytes = 2 if dtype == "bfloat16" else 4
  tensor = mesh["tensor"]
  precision = config.get("precision", "bf16")
  resolved = ops.resolve(config.get("kernels"), dtype, precision)
  kernels = Kernels(
      attention=attention_implementation(resolved.attention, causal=causal, tokens=tokens,
                                         dtype=dtype, backend=backend),
      mlp=resolved.mlp, norm=resolved.norm, cpu=backend == "cpu", fp8=precision == "fp8",
      tpu=backend == "tpu")
  kw = dict(act_bytes=act_bytes, tensor=tensor, kernels=kernels)
  trainer = config.get("trainer", "pretrain")

  decoder = 0.0
  if trainer == "pretrain":
    decoder = decoder_bytes(config, width=width, heads=heads, patch_dim=patch * patch * channels,
                            **kw)

  block = lambda remat: block_activation_bytes(
      tokens=tokens, width=width, mlp_dim=mlp_dim, heads=heads, remat=remat, causal=causal,
      **kw)
  one_block = block("none")
  pixels = m.image_size * m.image_size * channels
  outside = outside_bytes(tokens=tokens, width=width, mlp_dim=mlp_dim, heads=heads,
                          causal=causal, pixels=pixels, **kw)
  activations = {}
  for remat in REMATS:
    # XLA:CPU merges a rematerialised block's recomputation back into the
    # forward pass (module docstring): there every remat keeps what none does.
    kept = "none" if kernels.cpu else remat
    per_example = depth * block(kept)
    if kept != "none":    # one block recomputed at a time in the backward pass
      per_example += one_block
    activations[remat] = per_device * (per_example + outside + decoder)
  if frozen_backbone:     # a forward pass only: the most it holds at once
    forward = frozen_forward_bytes(config, tokens=tokens, width=width, mlp_dim=mlp_dim,
                                   heads=heads, patches=patches, **kw)
    activations = {remat: per_device * forward for remat in REMATS}

  accumulation = 0.0
  if num_microbatches > 1:
    draws = config.loss.get("noise_samples", 1) if config.get("loss", {}).get(
        "kind") == "diffusion" else 0
    accumulation = 4 * trained + 4 * pixels * (1 + draws) * per_device * num_microbatches

  ema = 4 * local if config.get("ema_decay", 0.0) else 0.0
  block_params = 4 * width * width + 2 * width * mlp_dim + 9 * width + mlp_dim
  fsdp_buffer = 2 * 4 * block_params if mesh["fsdp"] > 1 else 0.0
  return Estimate(variant=m.variant, num_params=sum(numels), params=4 * local,
                  grads=4 * trained, adam=optimizer_state_bytes(config) * trained,
                  fsdp_buffer=fsdp_buffer,
                  activations=activations, per_device_batch=per_device,
                  ema=ema, accumulation=accumulation,
                  update=update_bytes(trained, ema, kernels))


def _platform(params) -> str | None:
  """The platform of the devices ``params`` (abstract, with shardings) lie
  on: the one that compiles the step, also where it differs from JAX's
  default backend (a TPU topology compiled for from a CPU host); None
  without shardings."""
  import jax  # pylint: disable=g-import-not-at-top
  for leaf in jax.tree_util.tree_leaves(params):
    sharding = getattr(leaf, "sharding", None)
    devices = getattr(sharding, "device_set", None)
    if devices:
      return next(iter(devices)).platform
  return None


def decoder_bytes(config, *, width: int, heads: int, patch_dim: int, act_bytes: int,
                  tensor: int, kernels: Kernels) -> float:
  """Per example, what pretraining's patch decoder and loss keep (module
  docstring): per patch and noise draw, the float32 prediction and its
  error, and for the Transformer decoder its two token embeddings, its
  blocks over the two tokens, the read-out block (the last: the second
  token's output alone, the first giving keys and values), its final
  LayerNorm and the float32 noisy patch."""
  a, t = act_bytes, tensor
  dec, loss = config.get("decoder", {}), config.get("loss", {})
  patches = (config.model.image_size // _model_dims(config)["patch"]) ** 2
  draws = loss.get("noise_samples", 1) if loss.get("kind") == "diffusion" else 1
  row = 2 * 4 * patch_dim                          # the prediction and its error
  depth = dec.get("depth", 1)
  if dec.get("kind") == "transformer" and depth > 0:
    d = dec.get("width", 0) or width
    f = 4 * d
    h = dec.get("num_heads", 0) or heads
    row += 4 * patch_dim + a * 2 * d               # the noisy patch, both token embeddings
    row += (depth - 1) * block_activation_bytes(
        tokens=2, width=d, mlp_dim=f, heads=h, remat="none", act_bytes=a, tensor=t,
        kernels=dataclasses.replace(kernels, attention="xla"))
    # Read-out block: LN1 of both tokens; k and v of both, q of one; the
    # attention's output, the residual, LN2 and the residual after the MLP
    # of one token; the MLP hidden twice; two-key attention's float32 terms.
    row += a * d * (2 + (4 + 1) / t + 1 / t + 3) + a * 2 * f / t + 2 * 4 * d / t
    row += a * d                                   # the final LayerNorm's output
    if kernels.cpu and kernels.norm == "xla":      # LN1 of two tokens, LN2 and the final of one
      row += 4 * 2 * 4 * d
    if kernels.cpu and kernels.mlp == "xla":
      row += 4 * f / t
  return draws * patches * row


def outside_bytes(*, tokens: int, width: int, mlp_dim: int, heads: int, causal: bool,
                  pixels: int, act_bytes: int, tensor: int, kernels: Kernels) -> float:
  """Per example, what a trained backbone's step keeps beside its blocks
  (module docstring): the patches, the final LayerNorm and the gradient of
  one MLP hidden layer (the backward's first wide temporary)."""
  a = act_bytes
  out = a * pixels                                # the patches, for the embedding's gradient
  out += a * tokens * width                       # the final LayerNorm's output
  out += a * tokens * mlp_dim / tensor            # the first block's backward: dMLP hidden
  if kernels.cpu and kernels.norm == "xla":       # as a block's LayerNorm (cpu_block_bytes)
    out += 2 * 4 * tokens * width
  if kernels.cpu and kernels.attention != "flash" and not causal:
    out += 4 * heads / tensor * tokens ** 2       # XLA:CPU's broadcast of the unmasked logits
  return out


def frozen_forward_bytes(config, *, tokens: int, width: int, mlp_dim: int, heads: int,
                         patches: int, act_bytes: int, tensor: int, kernels: Kernels) -> float:
  """Per example, the most a frozen backbone's forward pass holds at once
  (nothing is kept for a backward pass; module docstring) plus what the
  probe's head keeps: the attentive probe's float32 tokens of its blocks
  and their keys and values."""
  a, t, d, f = act_bytes, tensor, width, mlp_dim
  mlp = a * tokens * (d + 2 * f / t)                 # the residual, the MLP hidden twice
  attention = a * tokens * (d + 4 * d / t)           # the residual, q, k, v, output
  if kernels.attention != "flash":                   # float32 logits and exponentials, probabilities
    attention = a * tokens * 2 * d + (8 + a) * heads / t * tokens ** 2
  head = 0.0
  if config.get("trainer") == "attentive_probe":   # after the backbone's pass
    # The float32 tokens, their keys and values, and the keys' and values'
    # gradients in the backward pass.
    blocks = len(tuple(config.get("probe", {}).get("blocks", (-1,))))
    head = 5 * 4 * blocks * patches * d
  return max(mlp, attention, head)


def optimizer_state_bytes(config) -> int:
  """Bytes of optimizer state per trained parameter (darl_jax/optim.py):
  AdamW's two float32 moments, LARS's or SGD's float32 momentum."""
  cfg = config.get("optim") or {}
  name = cfg.get("name", "adamw")
  if name == "adamw":
    return 8
  return 4 if cfg.get("momentum", 0.0) else 0


def update_bytes(trained: float, ema: float, kernels: Kernels) -> float:
  """The optimizer update's temporaries beside the gradients (module
  docstring): XLA:CPU copies the state it overwrites; other backends
  update in place."""
  if not kernels.cpu:
    return 0.0
  return 0.5 * 4 * trained + 2 * ema


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
    # The table plans a GPU run (its --attention choices), wherever it is printed.
    estimates.append(estimate(config, mesh, args.sharding, args.batch_size, backend="gpu"))
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
