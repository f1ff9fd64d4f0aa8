"""Compile a config's train and evaluation steps for a TPU topology, on a CPU host.

    python -m darl_jax.compile --config=experiments/vit_h14_diff.py --topology=v5p:4x4x8 \\
        [--config.batch_size=4096 --config.microbatch_size=... --config.mesh.fsdp=...] \\
        [--save=/path/train_step.bin]

needs libtpu (``pip install -e ".[tpu]"``) and no TPU: JAX describes the
topology's chips (``jax.experimental.topologies``), the loop's own ``setup``
builds the real steps (mesh, sharding rules, per-device batch, microbatches)
over them, and XLA compiles them here. Printed per chip: the compiled train
step's arguments, outputs, temporaries and total against the chip's HBM
(fits / does not fit, by how much), darl_jax/memory.py's analytic estimate
beside it, the evaluation step's total, the model FLOPs of a step and XLA's
estimated step time (its cost model, not a measurement) with the MFU it
implies.

Exit status: 0 the step fits; 1 it does not fit (the report names the fix);
2 bad input, one ``error:`` line: an unknown flag or config key, a bad
value, a --config file that does not exist or does not load, an unknown
topology or a missing libtpu (darl_jax/cli.py, as every command); 3 the
compile failed otherwise (a bug here or in XLA: the line names the file its
traceback went to). A script can tell "does not fit" from a mistake.

Topology names are JAX's: ``v4:2x2x2``, ``v5e:4x4`` (v5 lite), ``v5p:4x4x8``,
``v6e:8x8``, chips per axis in a shape the generation offers
(``check_topology``, before libtpu is asked); ``--num_slices`` > 1 compiles
for several slices of it. The
data source is replaced by synthetic images of the config's size (nothing
is read); the schedule's length is the config's. ``--save`` writes the
serialized train-step executable (jax.experimental.serialize_executable).
"""

from __future__ import annotations

import os

_PLATFORMS = os.environ.get("JAX_PLATFORMS")   # the user's, before darl_jax sets one

from darl_jax import tpu_env  # noqa: E402  (its import configures libtpu's environment)

# Before JAX loads a backend: the host's own device is the CPU (unless this
# is a TPU VM), and the TPU exists only as a topology.
if not tpu_env.on_tpu_vm() and _PLATFORMS is None:
  os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

from absl import app, flags, logging  # noqa: E402

from darl_jax import cli as cli_lib  # noqa: E402


def _define_flags() -> None:
  """The command's flags, defined only when it runs as the command: the
  module is also imported (tests, benchmarks) beside darl_jax.main, which
  defines --config too (cli_lib.define_config_flag defines it once). Once
  per process: a test runs the command more than once."""
  if "topology" in flags.FLAGS:
    return
  cli_lib.define_config_flag()
  flags.DEFINE_string("topology", None, "TPU topology, e.g. v5p:4x4x8, v5e:16x16.")
  flags.DEFINE_integer("num_slices", 1, "Slices of --topology (multislice).")
  flags.DEFINE_string("save", "", "Write the compiled train step here (serialized).")
  flags.DEFINE_string("json", "", "Also append the report as one JSON line to this file.")

GIB = 2.0 ** 30
# Dense bf16 peak FLOP/s and HBM bandwidth (bytes/s) per chip, public
# datasheets, by JAX's device_kind.
PEAK_BF16 = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5": 459e12, "TPU v5p": 459e12,
             "TPU v6 lite": 918e12, "TPU v6e": 918e12}
HBM_BANDWIDTH = {"TPU v4": 1228e9, "TPU v5 lite": 819e9, "TPU v5": 2765e9, "TPU v5p": 2765e9,
                 "TPU v6 lite": 1640e9, "TPU v6e": 1640e9}


def xla_step_seconds(cost: dict | None, device_kind: str) -> float | None:
  """A step's time by XLA's cost analysis of the compiled program: its own
  ``optimal_seconds`` where that is positive, else the roofline of its
  per-chip flop and byte counts, ``max(flops / peak, bytes / bandwidth)``
  (libtpu 0.0.42 gives a negative ``optimal_seconds`` for large programs).
  An estimate from XLA's cost model, not a measurement."""
  if not cost:
    return None
  seconds = float(cost.get("optimal_seconds", 0.0) or 0.0)
  if seconds > 0:
    return seconds
  peak, bandwidth = PEAK_BF16.get(device_kind), HBM_BANDWIDTH.get(device_kind)
  if not (peak and bandwidth):
    return None
  return max(float(cost.get("flops", 0.0)) / peak,
             float(cost.get("bytes accessed", 0.0)) / bandwidth) or None


@dataclasses.dataclass
class Report:
  """What one compile found (per chip)."""
  topology: str
  chips: int
  device_kind: str
  mesh: dict
  batch_size: int
  microbatch_size: int
  hbm: float | None
  train: object                 # fit.Footprint
  eval: object | None
  estimate: str | None
  model_flops: float | None     # per step, all chips
  xla_seconds: float | None     # XLA's estimated step time
  fits: bool
  message: str = ""
  compile_seconds: float | None = None   # the train step's trace + lower + compile here

  def as_dict(self) -> dict:
    """The report's figures as JSON types (GiB, seconds)."""
    gib = lambda b: None if b is None else round(b / GIB, 3)
    return {"topology": self.topology, "chips": self.chips, "device_kind": self.device_kind,
            "mesh": self.mesh, "batch_size": self.batch_size,
            "microbatch_size": self.microbatch_size, "hbm_gib": gib(self.hbm),
            "train_gib": gib(self.train.total), "temporaries_gib": gib(self.train.temporaries),
            "arguments_gib": gib(self.train.arguments),
            "eval_gib": gib(self.eval.total) if self.eval else None,
            "estimate": self.estimate, "model_flops": self.model_flops,
            "xla_seconds": self.xla_seconds, "mfu": self.mfu(), "fits": self.fits,
            "message": self.message, "compile_seconds": self.compile_seconds}

  def mfu(self) -> float | None:
    peak = PEAK_BF16.get(self.device_kind)
    if not (self.model_flops and self.xla_seconds and peak):
      return None
    return self.model_flops / (self.xla_seconds * peak * self.chips)

  def lines(self) -> list[str]:
    t = self.train
    hbm = f"{self.hbm / GIB:.1f} GiB" if self.hbm else "unknown"
    out = [f"topology {self.topology}: {self.chips} x {self.device_kind} (HBM {hbm} each), "
           f"mesh {self.mesh}",
           f"batch {self.batch_size}: {self.batch_size // self.microbatch_size} microbatch(es) "
           f"of {self.microbatch_size}, "
           f"{self.microbatch_size // (self.mesh['data'] * self.mesh['fsdp'])} per chip",
           f"train step per chip: arguments {t.arguments / GIB:.2f} GiB, outputs "
           f"{(t.outputs - t.aliased) / GIB:.2f} GiB beyond the donated state, temporaries "
           f"{t.temporaries / GIB:.2f} GiB, total {t.total / GIB:.2f} GiB"]
    if self.estimate:
      out.append(f"memory.py's estimate: {self.estimate}")
    if self.eval is not None:
      out.append(f"evaluation step per chip: total {self.eval.total / GIB:.2f} GiB")
    if self.xla_seconds:
      line = f"XLA's cost model: {self.xla_seconds * 1e3:.0f} ms per step"
      if self.model_flops:
        line += f", {self.model_flops / self.chips / 1e12:.1f} model TFLOP per chip per step"
      if self.mfu() is not None:
        line += f", implied MFU {self.mfu():.2f} (an estimate, not a measurement)"
      out.append(line)
    verdict = "fits" if self.fits else "does NOT fit"
    if self.hbm:
      verdict += (f": {t.total / GIB:.2f} of {self.hbm / GIB:.1f} GiB "
                  f"({t.total / self.hbm:.0%}; headroom {(self.hbm - t.total) / GIB:+.2f} GiB)")
    out.append(verdict)
    if self.message:
      out.append(self.message)
    return out


@dataclasses.dataclass(frozen=True)
class Generation:
  """The slice shapes (chips per axis) Cloud TPU offers for one generation."""
  dims: int                     # 2: AxB (a 2D torus), 3: AxBxC
  shapes: tuple = ()            # the offered shapes (either orientation) ...
  multiple: int = 0             # ... or (3D) every axis a multiple of this
  max_chips: int = 0


# Offered shapes per generation (the accelerator types of Cloud TPU's
# documentation, as JAX's chip grids). The smallest are whole hosts: JAX
# describes a topology host by host, 2x2 chips each.
GENERATIONS = {
    "v2": Generation(2, ((2, 2), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))),
    "v3": Generation(2, ((2, 2), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16), (16, 32),
                        (32, 32))),
    "v4": Generation(3, ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4)), 4, 4096),
    "v5e": Generation(2, ((2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))),
    "v5p": Generation(3, ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4)), 4, 8960),
    "v6e": Generation(2, ((2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))),
}
TOPOLOGY_EXAMPLES = "v4:2x2x2, v5e:2x2, v5e:4x4, v5p:4x4x8, v6e:8x8"
# JAX's topology names: generation, a separator, the chips per axis, an
# optional torus twist.
_TOPOLOGY = re.compile(r"([A-Za-z0-9]+)[=_:]([0-9x]+)(_twisted|_untwisted)?")


def check_topology(name: str) -> None:
  """A ValueError (one line naming valid topologies) unless ``name`` is a
  slice of a known generation in a shape that generation offers. Checked
  before libtpu is asked, so that a mistyped topology is reported as such."""
  def bad(why: str) -> ValueError:
    return ValueError(f"--topology {name!r} {why}; use JAX's <generation>:<chips per "
                      f"axis>, e.g. {TOPOLOGY_EXAMPLES}")

  if re.fullmatch(r"v\d+[a-z]*-\d+", name or ""):
    raise bad("is a Cloud TPU accelerator type (cores or chips in all), not a chip grid")
  m = _TOPOLOGY.fullmatch(name or "")
  if not m or not re.fullmatch(r"\d+(x\d+)*", m.group(2)):
    raise bad("is not a topology")
  generation = GENERATIONS.get(m.group(1).lower())
  if generation is None:
    raise bad(f"names no known TPU generation (known: {', '.join(GENERATIONS)})")
  axes = [int(a) for a in m.group(2).split("x")]
  # A trailing 1 is how JAX writes a 2D slice in three axes (v5e:2x2x1); a 3D
  # generation's single-host slice may leave it out (v5p:2x2).
  if len(axes) == generation.dims + 1 and axes[-1] == 1:
    axes = axes[:-1]
  if len(axes) == 2 and generation.dims == 3:
    axes.append(1)
  if len(axes) != generation.dims:
    raise bad(f"has {len(axes)} axes; {m.group(1)} slices have {generation.dims}")
  shape = tuple(sorted(axes))
  chips = math.prod(shape)
  offered = shape in {tuple(sorted(s)) for s in generation.shapes} or (
      generation.multiple and all(a % generation.multiple == 0 for a in shape)
      and 0 < chips <= generation.max_chips)
  if not offered:
    sizes = ", ".join("x".join(map(str, s)) for s in generation.shapes)
    more = (f", or every axis a multiple of {generation.multiple} up to "
            f"{generation.max_chips} chips" if generation.multiple else "")
    raise bad(f"is not a {m.group(1)} slice (its shapes: {sizes}{more})")


def topology_devices(name: str, num_slices: int = 1) -> list:
  """The devices of TPU topology ``name`` (JAX's naming), compile-only."""
  check_topology(name)
  if importlib.util.find_spec("libtpu") is None:
    raise ValueError("describing a TPU topology needs libtpu: pip install -e \".[tpu]\"")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=name,
                                        num_slices=num_slices)
  except Exception as e:  # pylint: disable=broad-except
    text = " ".join(str(e).split())
    raise ValueError(f"libtpu cannot describe TPU topology {name!r} ({num_slices} "
                     f"slice(s)): {text[:300]}") from None
  return list(desc.devices)


def for_compile(config):
  """``config`` with its data replaced by synthetic images of the same size
  (nothing is read; ImageNet's split sizes for the schedule's epochs)."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.data.name = "synthetic"      # ImageNet's split sizes (data/sources/synthetic.py)
    c.data.num_workers = 0
  return c


def compile_for_topology(config, devices, topology: str = "", save: str = "") -> Report:
  """Builds and compiles ``config``'s steps over ``devices`` (topology_devices)."""
  import jax  # pylint: disable=g-import-not-at-top
  from darl_jax import flops as flops_lib  # pylint: disable=g-import-not-at-top
  from darl_jax.train import accumulate  # pylint: disable=g-import-not-at-top
  from darl_jax.train import aot  # pylint: disable=g-import-not-at-top
  from darl_jax.train import fit  # pylint: disable=g-import-not-at-top
  from darl_jax.train import setup as setup_lib  # pylint: disable=g-import-not-at-top
  from darl_jax.train import startup  # pylint: disable=g-import-not-at-top
  from darl_jax.train.trainers import get_trainer  # pylint: disable=g-import-not-at-top

  config = for_compile(config)
  trainer = get_trainer(config.trainer)(config)
  built = setup_lib.setup(trainer, config, devices=devices)
  device = devices[0]
  hbm = fit.device_capacity(device, config.get("device_memory_gib", 0.0))
  mesh = dict(built.mesh.shape)
  fits, message, compile_seconds, resolved = True, "", None, None
  try:
    # The run's sizes as the loop decides them (fit.resolve), then its step.
    compiled, info = startup.compile_train_step(
        built, config, device=device, reuse=False,
        resolved=startup.resolve(built, config, device))
    fp = info["footprint"]
    resolved = info["resolved"]
    microbatch = resolved.microbatch
    compile_seconds = sum(info.get(f"{k}_s", 0.0) for k in ("trace", "lower", "compile"))
  except fit.DoesNotFit as e:
    # The footprint of the last step compiled (at microbatch_size=-1 the
    # size the choice stopped at, which the message names a fix for), for
    # the report; the TPU compiler refuses such a step, and then only its
    # temporaries are known. No cost analysis: a step that does not fit has
    # no step time to read.
    fits, message = False, str(e)
    compiled, fp, microbatch = None, e.footprint, e.microbatch or config.batch_size
    if fp is None:
      # Refused before any compile (microbatch_size=-1, by the estimate): the
      # smallest microbatch is compiled for the report's figures.
      microbatch = (accumulate.candidates(config.batch_size, built.batch_shards)[-1]
                    if fit.automatic(config)
                    else fit.resolve(config, batch_shards=built.batch_shards).microbatch)
      try:
        compiled, _ = aot.compile_step(built.make_step(config.batch_size // microbatch),
                                       built.abstract_state, built.abstract_batch,
                                       built.abstract_hyper)
        fp = fit.footprint(compiled)
      except fit.CompilerOutOfMemory as oom:
        compiled, fp = None, oom.footprint
  cost = compiled.cost_analysis() if compiled is not None else None
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  seconds = xla_step_seconds(cost, device.device_kind)
  if seconds and microbatch < config.batch_size:
    # XLA's cost analysis counts a loop's body once: the microbatch scan
    # runs it batch / microbatch times.
    seconds *= config.batch_size // microbatch
  if config.get("model", {}).get("scan_layers", False):
    # ... and a scan over the blocks once too, beside the parts outside it:
    # no step time is read from such a program.
    seconds = None

  eval_fp = None
  h, w, c = built.ctx.train_source.image_shape
  # The evaluation batch the run uses (fit.resolve: under gradient
  # accumulation the microbatch, else the batch).
  if resolved is None:
    resolved = fit.resolve(config, batch_shards=built.batch_shards, microbatch=microbatch)
  eval_size = resolved.eval_batch
  eval_batch = aot.abstract_batch(built.ctx.train_source.image_shape, eval_size,
                                  built.batch_sharding)
  eval_batch["mask"] = jax.ShapeDtypeStruct((eval_size,), jax.numpy.bool_,
                                            sharding=built.batch_sharding)
  eval_batch["index"] = jax.ShapeDtypeStruct((eval_size,), jax.numpy.int32,
                                             sharding=built.batch_sharding)
  try:
    state = built.abstract_state
    eval_compiled = built.eval_step.lower(state["params"], state["model_state"],
                                          eval_batch).compile()
    eval_fp = fit.footprint(eval_compiled)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("the evaluation step did not compile for %s: %s", topology, e)

  model_flops = None
  if config.trainer == "pretrain":
    model_flops = flops_lib.darl_train_flops(built.model, (h, w)) * config.batch_size
  if save and fits and compiled is not None:
    from jax.experimental import serialize_executable  # pylint: disable=g-import-not-at-top
    payload, _, _ = serialize_executable.serialize(compiled)
    with open(save, "wb") as f:
      f.write(payload)
    logging.info("wrote the compiled train step to %s (%d bytes)", save, len(payload))
  return Report(topology=topology, chips=len(devices), device_kind=device.device_kind,
                mesh=mesh, batch_size=config.batch_size, microbatch_size=microbatch,
                hbm=hbm, train=fp, eval=eval_fp,
                estimate=fit.describe_estimate(config, mesh, microbatch,
                                               params=built.abstract_state["params"]),
                model_flops=model_flops, xla_seconds=seconds, fits=fits,
                message=message, compile_seconds=compile_seconds)


def _config_arg(argv) -> str:
  """The command line's config and overrides, as the report's label."""
  return " ".join(a for a in argv[1:] if a.startswith("--config"))


# Exit statuses (the module docstring); bad input is cli_lib.USAGE (2).
FITS, DOES_NOT_FIT, COMPILE_FAILED = 0, 1, 3


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  f = flags.FLAGS
  config = cli_lib.loaded_config(required="--config is required, e.g. "
                             "--config=experiments/vit_h14_diff.py")
  if not f.topology:
    raise app.UsageError("--topology is required, e.g. --topology=v5p:4x4x8")
  check_topology(f.topology)
  logging.set_verbosity(logging.WARNING)
  from darl_jax import config_lib  # pylint: disable=g-import-not-at-top
  config_lib.validate(config)
  devices = topology_devices(f.topology, f.num_slices)
  report = compile_for_topology(config, devices, f.topology, f.save)
  print("\n".join(report.lines()))
  if f.json:
    import json  # pylint: disable=g-import-not-at-top
    with open(f.json, "a") as out:
      out.write(json.dumps({"config": _config_arg(sys.argv), **report.as_dict()}) + "\n")
  sys.exit(FITS if report.fits else DOES_NOT_FIT)


def cli(argv=None):
  """The command: its flags, then ``main`` under cli_lib.run. A ValueError or
  OSError is bad input here (status 2: nothing is read but the config, and
  the config's errors, an unknown variant or a mesh larger than the
  topology, are ValueErrors); anything else is COMPILE_FAILED, so that 1
  means only "does not fit"."""
  _define_flags()
  cli_lib.run(main, argv=argv, failed=cli_lib.USAGE, unexpected=COMPILE_FAILED)


if __name__ == "__main__":
  cli()
