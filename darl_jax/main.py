"""Entry point: ``python -m darl_jax.main --config=experiments/<name>.py --workdir=<dir>``.

Runs the job named by ``config.trainer``: a trainer from the explicit registry
``trainers()`` (its loss is its ``loss_fn``; pretraining's is
darl_jax/objectives.py) handed to the shared loop, or a job's own driver
(sampling, train/jobs/sample.py; few-shot scoring of a checkpoint,
train/jobs/fewshot.py). Rerunning the same command on the same workdir resumes
from the newest complete checkpoint.

Every error is one ``error:`` line on stderr. Exit status (darl_jax/cli.py,
shared by every command): 0 done; 1 the run could not do its work (a missing
or damaged data file or checkpoint, a refused resume, an unusable or busy
workdir, a step that does not fit, a diverged run; an unexpected error names
the file its traceback went to, the workdir's error.log); 2 bad input (an
unknown flag or config key, a value of the wrong type or one the config's
checks refuse, a --config file that does not exist or does not load, a
missing --config or --workdir); 130 interrupted; 143 terminated (SIGTERM).
"""

from __future__ import annotations

import os

from absl import app, flags, logging

from darl_jax import cli as cli_lib
from darl_jax import distributed  # defines --distributed, --coordinator, ...
from darl_jax import interrupts

cli_lib.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")


def trainers():
  """name -> Trainer class of the shared loop (train/trainers/__init__.py). Imported
  here, not at the top, so that ``--help`` and a config error come before
  JAX's import; a typo still fails before any work."""
  from darl_jax.train import trainers as trainers_lib
  return trainers_lib.trainers()


def get_trainer(name: str):
  from darl_jax.train import trainers as trainers_lib
  return trainers_lib.get_trainer(name)


def get_job(name: str):
  """``config.trainer`` -> ``run(config, workdir)``: sampling (train/jobs/sample.py)
  and few-shot scoring of a checkpoint (train/jobs/fewshot.py) have drivers of
  their own, nothing to train; every other name is a Trainer run by the
  shared loop."""
  if name == "sample":
    from darl_jax.train.jobs import sample
    return sample.run
  if name == "fewshot":
    from darl_jax.train.jobs import fewshot
    return fewshot.run
  if name == "knn":
    from darl_jax.train.jobs import knn
    return knn.run
  trainer_class = get_trainer(name)
  from darl_jax.train import loop
  return lambda config, workdir: loop.run(trainer_class(config), config, workdir)


# The share of each GPU's memory JAX's pool may take (JAX's own default is
# 0.75). The rest is for what lives outside the pool: the CUDA context,
# cuDNN and cuBLAS handles, NCCL's buffers on several GPUs. With cuda_async
# (below) the pool does not fragment, so the step can use nearly all of
# the card; benchmarks/RESULTS.md has the 500-step H/14 run at this value.
GPU_MEMORY_FRACTION = "0.92"


def default_gpu_allocator() -> None:
  """The GPU memory allocator the CLI starts JAX with: CUDA's stream-ordered
  pool (``XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async``) instead of XLA's BFC
  pool, taking ``GPU_MEMORY_FRACTION`` of the card, unless the environment
  names its own (``XLA_PYTHON_CLIENT_ALLOCATOR``, e.g. ``=default`` for
  BFC; ``XLA_PYTHON_CLIENT_MEM_FRACTION``, e.g. ``=0.8`` to leave room for
  another process on the card; or ``JAX_PJRT_CLIENT_CREATE_OPTIONS``).

  Why cuda_async: a train step is one large temporary allocated anew every
  step. In the BFC pool the small arrays that outlive a step (metrics, the
  next batches) land right after the first step's temporary, so the pool
  splits into a hole of exactly that size and the rest; a few steps later
  the hole no longer holds the temporary and the run dies out of memory
  with most of the pool free. cuda_async remaps free pages instead of
  needing one contiguous block (benchmarks/RESULTS.md has the run that
  showed it). Only the GPU client reads these variables."""
  if "JAX_PJRT_CLIENT_CREATE_OPTIONS" in os.environ:
    return
  os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)


def precision_xla_flags(precision: str) -> None:
  """Under ``precision='fp8'``, XLA's GPU GEMMs go to cuBLAS, not Triton
  (``--xla_gpu_enable_triton_gemm=false`` added to ``XLA_FLAGS``), unless
  ``XLA_FLAGS`` already says which. With Triton on, XLA autotunes every fp8
  GEMM against Triton's kernels, which takes minutes per program and picks
  kernels slower than cuBLAS's; bf16 steps are as fast either way, so
  nothing else changes (benchmarks/RESULTS.md, "fp8", has the figures).
  Call before JAX first compiles; only the GPU reads the flag."""
  if precision != "fp8":
    return
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_gpu_enable_triton_gemm" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_triton_gemm=false".strip()


def _quiet_library_logs():
  """Orbax logs every save step at INFO through absl; keep its warnings only.
  An interrupt (Ctrl-C, SIGTERM) that lands while Orbax waits for a save makes
  it log that wait's traceback as an error: the loop then finishes the save
  itself, so that report goes too."""
  import logging as py_logging

  class DropChatter(py_logging.Filter):
    def filter(self, record):
      if "/orbax/" not in record.pathname:
        return True
      exc = record.exc_info[0] if record.exc_info else None
      if exc is not None and issubclass(exc, (KeyboardInterrupt, interrupts.Terminated)):
        return False
      return record.levelno >= py_logging.WARNING

  logging.get_absl_handler().addFilter(DropChatter())

  class DropOrbaxTaskReports(py_logging.Filter):
    """A failed Orbax read (a damaged checkpoint, skipped and reported in one
    line) leaves asyncio tasks whose errors asyncio reports again when they
    are garbage-collected, each with a page of tensorstore spec."""

    def filter(self, record):
      tb = record.exc_info[2] if record.exc_info else None
      while tb is not None:
        if "/orbax/" in tb.tb_frame.f_code.co_filename:
          return False
        tb = tb.tb_next
      return True

  py_logging.getLogger("asyncio").addFilter(DropOrbaxTaskReports())

  from darl_jax import checkpoint
  checkpoint.drop_closed_loop_reports()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = cli_lib.loaded_config(
      required="--config is required, e.g. --config=experiments/fashion_mnist_diff.py")
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required (a local path or gs://bucket/dir)")
  # Keep TensorFlow (used only by the TFDS input pipeline) off the accelerators.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  _quiet_library_logs()
  default_gpu_allocator()
  precision_xla_flags(config.get("precision", "bf16"))
  try:
    # Multi-host jobs connect here, before anything touches a device.
    distributed.initialize()
  except ValueError as e:
    cli_lib.fail(cli_lib.one_line(e), cli_lib.FAILED)
  from darl_jax.train import fit
  from darl_jax.train import trainer as trainer_lib
  # Ctrl-C and SIGTERM raise (once any checkpoint save under way has started),
  # so that the loop finishes that save and releases the workdir's lock;
  # cli_lib.report turns them into one line (130, 143).
  interrupts.install()
  try:
    get_job(config.trainer)(config, _WORKDIR.value)
  except (fit.DoesNotFit, trainer_lib.NonFiniteError) as e:
    # A step too large for the device (a ConfigError, but the config is
    # valid: the devices are too small), a diverged run: the run's failure,
    # status 1, its message names the fix.
    cli_lib.fail(cli_lib.one_line(e), cli_lib.FAILED)


def cli():
  """Every error as one line (darl_jax/cli.py has the exit statuses)."""
  logging.set_verbosity(logging.INFO)
  cli_lib.run(main, workdir=lambda: _WORKDIR.value, resumable=True)


if __name__ == "__main__":
  cli()
