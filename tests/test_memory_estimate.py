"""darl_jax/memory.py's estimate against XLA's compiled train step, per trainer.

The automatic microbatch (``microbatch_size=-1``) is chosen from memory.py's
estimate before anything compiles (train/fit.py), so the estimate must agree
with what XLA then needs. Each case builds a run as the CLI does (its
trainer from the registry, ``setup``), compiles its train step through the
start-up's path (``startup.compile_train_step``) and compares the compiled
figure that the start-up logs, arguments + outputs beyond the donated state
+ temporaries (``fit.Footprint``), with the estimate it logs beside it
(``fit.estimator`` of the run's parameters): within ``TOLERANCE``.

The reference is XLA:CPU's buffer assignment, which keeps more than the
GPU's fusions do; memory.py counts that for the CPU backend (its module
docstring, "XLA:CPU"), so these cases check the same accounting the GPUs
use plus the CPU's own terms. The models are float32: XLA:CPU computes
bfloat16 products in float32, through converted copies no accelerator makes.

Shapes: the trainers at a small width (128, 2 heads, MLP 512, 2 blocks, 64
patches of 8x8, 16 examples), where the activations outweigh the state as
they do at the batch the automatic microbatch picks, and the widths, heads
and MLPs of ViT-B/16, L/16 and H/14 (at 224 pixels: 196 or 256 patches) in
one or two blocks at a few examples, where the parameters and their update
weigh as much as the activations.
"""

import pathlib
import runpy

import jax
import jax.numpy as jnp
import pytest

from darl_jax import config_lib
from darl_jax import memory
from darl_jax.models import heads
from darl_jax.models import vit as vit_lib
from darl_jax.train import fit
from darl_jax.train import setup as setup_lib
from darl_jax.train import startup
from darl_jax.train import trainers as trainers_lib
from darl_jax.train.trainers import attentive_probe
from darl_jax.train.trainers import linear_probe

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOLERANCE = 0.10

# The small width: every trainer's activations dominate its footprint.
SMALL = {"model.variant": "mu/8", "model.width": 128, "model.num_heads": 2,
         "model.mlp_dim": 512, "model.depth": 2, "model.image_size": 64,
         "data.image_size": 64, "batch_size": 16}


# 8x8 digits (10 classes, 16 patches of 2x2) at the small width.
DIGITS = {**SMALL, "model.variant": "mu/2", "model.image_size": 8, "model.channels": 1,
          "data.name": "digits", "data.image_size": 8, "data.channels": 1}


def _configure(c, overrides: dict):
  for dotted, value in overrides.items():
    parent, key = config_lib.config_node(c, dotted)
    parent[key] = value
  return c


def _run_config(c, overrides: dict):
  """``c`` as a short run on synthetic ImageNet-shaped data (1000 classes),
  float32, no host augmentation, the whole batch at once; ``overrides``
  (dotted keys) last."""
  c.update(total_steps=2, log_every_steps=1, eval_every_steps=0, tensorboard=False,
           microbatch_size=0)
  c.data.update(name="synthetic", num_workers=0, augment="none")
  c.model.dtype = "float32"
  if "randaugment" in c:
    c.randaugment.num_ops = 0
  if "predictions" in c:
    c.predictions.num_images = 0
  return _configure(c, overrides)


def pretrain_config(objective: str, variant: str = "B/16", **overrides):
  c = memory.pretrain_config(variant, objective)
  c.update(sharding="replicated")
  c.mesh.update(data=1, fsdp=1)
  return _run_config(c, overrides)


def finetune_config(variant: str = "B/16", **overrides):
  """experiments/finetune_in1k.py's recipe (mixup, cutmix, label smoothing,
  drop path, layer-wise lr decay) with an EMA of the weights."""
  c = runpy.run_path(str(ROOT / "experiments" / "finetune_in1k.py"))["get_config"](
      f"variant={variant},ema=0.9999")
  c.update(sharding="replicated")
  c.mesh.update(data=1, fsdp=1)
  c.model.drop_path = 0.1
  depth = overrides.get("model.depth")
  if depth:
    c.optim.num_layers = depth     # layer decay over the blocks the model has
  return _run_config(c, overrides)


def probe_config(kind: str, variant: str = "B/16", **overrides):
  c = (linear_probe.linear_probe_config() if kind == "linear_probe"
       else attentive_probe.attentive_probe_config())
  c.model.variant = variant
  return _run_config(c, overrides)


def compiled_and_estimated(config) -> tuple[fit.Footprint, float]:
  """The compiled train step's footprint and memory.py's estimate of it, as
  the start-up logs them (startup.compile_programs)."""
  trainer = trainers_lib.get_trainer(config.trainer)(config)
  built = setup_lib.setup(trainer, config)
  _, info = startup.compile_train_step(built, config, reuse=False)
  estimate = fit.estimator(config, dict(built.mesh.shape),
                           built.abstract_state["params"])(info["microbatch_size"])
  return info["footprint"], estimate


CASES = {
    # The trainers, at the small width.
    "pretrain_mse": lambda: pretrain_config("mse", **SMALL),
    "pretrain_diffusion": lambda: pretrain_config("diffusion", **SMALL),
    # fp8 dense layers keep 1-byte copies of their inputs (darl_jax/fp8.py).
    "pretrain_diffusion_fp8": lambda: pretrain_config("diffusion", **SMALL, precision="fp8"),
    "finetune_fp8": lambda: finetune_config(**SMALL, precision="fp8"),
    "finetune": lambda: finetune_config(**SMALL),
    "linear_probe": lambda: probe_config("linear_probe", **SMALL),
    "attentive_probe": lambda: probe_config("attentive_probe",
                                            **{**SMALL, "probe.blocks": (0, 1)}),
    # A grid holds its rows out of an indexed source: scikit-learn's digits.
    "linear_probe_grid": lambda: probe_config(
        "linear_probe", **{**DIGITS, "probe.learning_rates": (0.1, 0.01)}),
    # XLA:CPU merges a rematerialised block's recomputation into the forward
    # pass: remat saves nothing there, and memory.py counts it so.
    "pretrain_mse_remat_full": lambda: pretrain_config("mse", **{**SMALL, "model.remat": "full"}),
    # The real widths, heads and MLPs, at 224 pixels.
    "B/16 finetune": lambda: finetune_config(
        "B/16", **{"model.depth": 2, "batch_size": 4}),
    "L/16 pretrain_diffusion": lambda: pretrain_config(
        "diffusion", "L/16", **{"model.depth": 1, "batch_size": 4}),
    "H/14 attentive_probe": lambda: probe_config(
        "attentive_probe", "H/14", **{"model.depth": 2, "batch_size": 4}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_estimate_is_within_ten_percent_of_the_compiled_step(case):
  fp, estimate = compiled_and_estimated(CASES[case]())
  assert fp is not None and fp.total > 0
  error = (estimate - fp.total) / fp.total
  assert abs(error) <= TOLERANCE, (
      f"{case}: memory.py's estimate {estimate / 2**20:.1f} MiB against the compiled "
      f"{fp.describe()}: {error:+.1%}")


# ------------------------------------------- which attention the GPUs run


def test_attention_follows_the_ops_dispatch():
  impl = memory.attention_implementation
  gpu = dict(dtype="bfloat16", backend="gpu")
  # cuDNN (and auto) take 16-bit sequences of even length on a GPU.
  assert impl("auto", causal=True, tokens=256, **gpu) == "flash"
  assert impl("auto", causal=False, tokens=197, **gpu) == "xla"
  assert impl("auto", causal=False, tokens=196, dtype="float32", backend="gpu") == "xla"
  assert impl("auto", causal=False, tokens=196, dtype="bfloat16", backend="tpu") == "xla"
  # The Hopper kernel runs causal attention; full attention falls back to auto.
  assert impl("hopper", causal=True, tokens=257, **gpu) == "flash"
  assert impl("hopper", causal=False, tokens=257, **gpu) == "xla"
  assert impl("hopper", causal=False, tokens=256, **gpu) == "flash"
  assert impl("xla", causal=True, tokens=256, **gpu) == "xla"


def finetune_in1k_params(variant: str):
  """experiments/finetune_in1k.py at ``variant`` and its classifier's
  parameter shapes (nothing allocated)."""
  c = runpy.run_path(str(ROOT / "experiments" / "finetune_in1k.py"))["get_config"](
      f"variant={variant}")
  backbone, patch = vit_lib.vit_from_config(c.model)
  model = heads.Classifier(backbone=backbone, patch_size=patch, num_classes=1000)
  image = jnp.zeros((1, 224, 224, 3))
  return c, jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), image))["params"]


def test_a_gpu_fine_tune_counts_the_probabilities_of_its_full_attention():
  """experiments/finetune_in1k.py at H/14: full attention over SOS and 256
  patches, 257 tokens, which no fused kernel takes: XLA's attention, whose
  probabilities the estimate counts whatever kernels.attention asks."""
  c, params = finetune_in1k_params("H/14")
  mesh = {"data": 1, "fsdp": 1, "tensor": 1}

  def activations(attention):
    c.kernels.attention = attention
    return memory.estimate(c, mesh, "replicated", 8, params=params,
                           backend="gpu").activations["none"]

  xla = activations("xla")
  assert activations("auto") == activations("hopper") == xla
  depth, num_heads, tokens = 32, 16, 257
  flash = activations("cudnn")
  assert xla - flash == 8 * depth * ((4 + 2) * num_heads * tokens ** 2 - 4 * num_heads * tokens)


def test_a_tpu_fine_tune_counts_the_logits_of_its_full_attention():
  """XLA:TPU keeps one float32 [H, T, T] per block more than the GPU count
  for full attention (memory.py, "XLA:TPU"; docs/TPU.md's fine-tuning rows),
  none for causal attention; with rematerialised blocks, only the block
  being recomputed keeps it."""
  c, params = finetune_in1k_params("B/16")
  mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  tpu, gpu = (memory.estimate(c, mesh, "replicated", 8, params=params, backend=b)
              for b in ("tpu", "gpu"))
  depth, num_heads, tokens = 12, 12, 197
  logits = 8 * 4 * num_heads * tokens ** 2        # one block's, 8 examples
  assert tpu.activations["none"] - gpu.activations["none"] == depth * logits
  assert tpu.activations["full"] - gpu.activations["full"] == logits
  # Causal pretraining with XLA's attention on both: the same count.
  causal = memory.pretrain_config("B/16", "diffusion", kernels={"attention": "xla"})
  assert (memory.estimate(causal, mesh, "replicated", 8, backend="tpu").activations ==
          memory.estimate(causal, mesh, "replicated", 8, backend="gpu").activations)


def test_fp8_keeps_one_byte_copies_of_the_dense_layers_inputs():
  """On a GPU the fp8 dense layers keep their inputs as 1-byte copies: the
  LN outputs and the GELU's output replace their 2-byte ones, the attention
  output's copy comes beside it (memory.py's block formula)."""
  c = memory.pretrain_config("H/14", "diffusion")
  mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  params = memory.abstract_params(c)

  def activations(precision):
    c.precision = precision
    return memory.estimate(c, mesh, "replicated", 8, params=params,
                           backend="gpu").activations["none"]

  depth, d, f, tokens = 32, 1280, 5120, 256
  saved = activations("bf16") - activations("fp8")
  assert saved == 8 * depth * tokens * ((2 * d + f) - d)


def test_the_tpu_report_estimates_every_trainer_from_its_parameters():
  """darl_jax/compile.py's report gives memory.py's estimate beside the
  compiled figure for a fine-tune too, from the run's parameter tree (the
  figure the start-up compares), not only for pretraining."""
  config = finetune_config(**SMALL)
  trainer = trainers_lib.get_trainer(config.trainer)(config)
  built = setup_lib.setup(trainer, config)
  mesh, params = dict(built.mesh.shape), built.abstract_state["params"]
  assert fit.describe_estimate(config, mesh, 8, backend="cpu") is None  # no tree: no guess
  expected = fit.estimate_bytes(config, mesh, 8, num_microbatches=2, params=params,
                                backend="cpu")
  described = fit.describe_estimate(config, mesh, 8, params=params, backend="cpu")
  assert described == f"{expected / fit.GIB:.2f} GiB"
  # Pretraining reads the same figure from its config alone or from its tree.
  config = pretrain_config("diffusion", **SMALL)
  built = setup_lib.setup(trainers_lib.get_trainer(config.trainer)(config), config)
  assert fit.describe_estimate(config, dict(built.mesh.shape), 16, backend="cpu") == (
      fit.describe_estimate(config, dict(built.mesh.shape), 16, backend="cpu",
                            params=built.abstract_state["params"]))
