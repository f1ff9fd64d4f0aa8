"""Entry point: ``python -m darl_jax.main --config=experiments/<name>.py --workdir=<dir>``.

Runs the job named by ``config.trainer``: a trainer from the explicit registry
``trainers()`` (its loss is its ``loss_fn``; pretraining's is
darl_jax/objectives.py) handed to the shared loop, or a job's own driver
(sampling, train/sample.py; few-shot scoring of a checkpoint,
train/fewshot.py). Rerunning the same command on the same workdir resumes
from the newest complete checkpoint.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from darl_jax import distributed  # defines --distributed, --coordinator, ...
from darl_jax import interrupts

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (experiments/*.py[:args]).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")


def trainers():
  """name -> Trainer class of the shared loop (train/trainers.py). Imported
  here, not at the top, so that ``--help`` and a config error come before
  JAX's import; a typo still fails before any work."""
  from darl_jax.train import trainers as trainers_lib
  return trainers_lib.trainers()


def get_trainer(name: str):
  from darl_jax.train import trainers as trainers_lib
  return trainers_lib.get_trainer(name)


def get_job(name: str):
  """``config.trainer`` -> ``run(config, workdir)``: sampling (train/sample.py)
  and few-shot scoring of a checkpoint (train/fewshot.py) have drivers of
  their own, nothing to train; every other name is a Trainer run by the
  shared loop."""
  if name == "sample":
    from darl_jax.train import sample
    return sample.run
  if name == "fewshot":
    from darl_jax.train import fewshot
    return fewshot.run
  if name == "knn":
    from darl_jax.train import knn
    return knn.run
  trainer_class = get_trainer(name)
  from darl_jax.train import loop
  return lambda config, workdir: loop.run(trainer_class(config), config, workdir)


def default_gpu_allocator() -> None:
  """The GPU memory allocator the CLI starts JAX with: CUDA's stream-ordered
  pool (``XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async``) instead of XLA's BFC
  pool, unless the environment names one (``XLA_PYTHON_CLIENT_ALLOCATOR``,
  e.g. ``=default`` for BFC, or ``JAX_PJRT_CLIENT_CREATE_OPTIONS``).

  Why: a train step is one large temporary (63.5 GiB at B/16, batch 1024)
  allocated anew every step. In the BFC pool the small arrays that outlive
  a step (metrics, the next batches) land right after the first step's
  temporary, so the pool splits into a hole of exactly that size and the
  rest; a few steps later the hole no longer holds the temporary and the run
  dies with 1.6 GiB of 104.85 in use (measured on an H200, see
  benchmarks/RESULTS.md: B/16 batch 1024 out of memory at step 5-10 with BFC,
  all 40 steps with cuda_async, which remaps free pages instead of needing
  one contiguous block). Only the GPU client reads the variable."""
  if ("XLA_PYTHON_CLIENT_ALLOCATOR" in os.environ
      or "JAX_PJRT_CLIENT_CREATE_OPTIONS" in os.environ):
    return
  os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "cuda_async"


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


def _traceback_file(workdir: str | None, exc: BaseException) -> str | None:
  """Writes the traceback of an unexpected error beside the run (or into the
  temporary directory); returns the path, None if nothing could be written."""
  import tempfile
  import traceback
  text = "".join(traceback.format_exception(exc))
  candidates = []
  if workdir and "://" not in workdir and os.path.isdir(workdir):
    candidates.append(os.path.join(workdir, "error.log"))
  candidates.append(os.path.join(tempfile.gettempdir(), f"darl_jax_error_{os.getpid()}.log"))
  for path in candidates:
    try:
      with open(path, "w") as f:
        f.write(text)
      return path
    except OSError:
      continue
  return None


def _fail(message: str, code: int = 1):
  print(f"error: {message}", file=sys.stderr)
  sys.exit(code)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    config = _CONFIG.value
    if config is not None:
      config.get("trainer")      # a file that failed to load raises on first use
  except Exception as e:  # pylint: disable=broad-except
    # config_flags loads the file lazily, on first use, and wraps its errors.
    path = _config_path(sys.argv)
    if path and not os.path.exists(path):
      _fail(f"the --config file {path} does not exist")
    while e.__cause__ is not None:
      e = e.__cause__
    _fail(f"cannot load --config {path}: {type(e).__name__}: {' '.join(str(e).split())}")
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=experiments/fashion_mnist_diff.py")
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required (a local path or gs://bucket/dir)")
  # Keep TensorFlow (used only by the TFDS input pipeline) off the accelerators.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  _quiet_library_logs()
  default_gpu_allocator()
  try:
    # Multi-host jobs connect here, before anything touches a device.
    distributed.initialize()
  except ValueError as e:
    _fail(str(e))
  from darl_jax.train import loop
  # Ctrl-C and SIGTERM raise (once any checkpoint save under way has started),
  # so that the loop finishes that save and releases the workdir's lock.
  interrupts.install()
  try:
    get_job(config.trainer)(config, _WORKDIR.value)
  except KeyboardInterrupt:
    _fail("interrupted; rerun the same command to resume from the last checkpoint", 130)
  except interrupts.Terminated:
    _fail("terminated (SIGTERM); rerun the same command to resume from the last "
          "checkpoint", 143)
  except (ValueError, OSError, loop.NonFiniteError) as e:
    # User errors (bad values, missing files, a refused resume, a busy or
    # unwritable workdir, a diverged run): their message names the fix.
    # OSError covers unreadable data files. One line, no traceback.
    _fail(" ".join(str(e).split()) or type(e).__name__)
  except Exception as e:  # pylint: disable=broad-except
    # Anything else is a bug, here or in a library: still one line on the
    # console (the checkpoints are safe, the loop saw to that), and the
    # traceback in a file for the bug report.
    where = _traceback_file(_WORKDIR.value, e)
    _fail(f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
          + (f" (traceback in {where})" if where else ""))


def _config_arg(argv) -> str | None:
  return next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)


def _config_path(argv) -> str | None:
  """The file of ``--config=<file>[:args]``."""
  cfg_arg = _config_arg(argv)
  return cfg_arg.partition(":")[0] if cfg_arg else None


def _unknown_override(argv) -> str | None:
  """Names the first ``--config.a.b=...`` whose key the config file lacks."""
  import runpy
  cfg_arg = _config_arg(argv)
  if cfg_arg is None:
    return None
  path, _, arg = cfg_arg.partition(":")
  config = runpy.run_path(path)["get_config"](arg or None)
  from darl_jax import config_lib
  for a in argv:
    if not a.startswith("--config."):
      continue
    try:
      config_lib.config_node(config, a[len("--config."):].split("=", 1)[0])
    except ValueError as e:
      return f"{a}: {e}"
  return None


def _parse_flags(argv):
  """absl's flag parsing with every error as one ``error:`` line (exit 2):
  an unknown ``--config.*`` key (config_flags raises AttributeError/KeyError
  while applying overrides), a value of the wrong type, an unknown flag."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    message = " ".join(str(e).split())
  except (AttributeError, KeyError) as e:
    message = _unknown_override(argv) or f"bad config override: {e}"
  except Exception as e:  # pylint: disable=broad-except
    # The config file itself fails while it is loaded (a syntax error, an
    # exception in get_config).
    path = _config_path(argv)
    if path and not os.path.exists(path):
      message = f"the --config file {path} does not exist"
    else:
      message = (f"cannot load --config {path}: {type(e).__name__}: "
                 f"{' '.join(str(e).split())[:500]}")
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def cli():
  logging.set_verbosity(logging.INFO)
  # main() turns every error into one line itself; what escapes app.run comes
  # from flag parsing (_parse_flags) or is SystemExit.
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  cli()
