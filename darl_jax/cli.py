"""How every command answers bad input and failures: one ``error:`` line on
stderr and a documented exit status, never a Python traceback for a mistake
on the command line.

    cli.run(main)                     # instead of absl's app.run(main)
    parser = cli.ArgumentParser(...)  # argparse commands (export, memory)

Exit statuses, the same in every command (``python -m darl_jax.main`` and the
sampling job it runs, ``darl_jax.compile``, ``.export``, ``.memory``,
``.data.convert``, ``.train.vtab``, ``.studies``); compile adds its own
(its docstring):

    0    done
    1    the command could not do its work: a file it reads is missing or
         damaged (data, checkpoint), a refused resume, an unusable workdir,
         a step that does not fit the device, a diverged run, a name that is
         not known (a model variant, a study); or an unexpected error (a bug:
         the line names the file its traceback went to)
    2    bad input, refused before any work: an unknown flag or config key,
         a value of the wrong type or one the config's checks refuse
         (config_lib.ConfigError, which names the key and a value that works),
         a --config file that does not exist or does not load, a required
         flag left out, an unexpected argument
    130  interrupted (Ctrl-C)
    143  terminated (SIGTERM)

The line is the exception's message on one line: the messages of this code
base name the fix, so nothing else is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import tempfile
import traceback
from typing import Any, Callable, NoReturn, Optional

from absl import app, flags, logging

from darl_jax import interrupts

FAILED = 1
USAGE = 2
INTERRUPTED = 130
TERMINATED = 143

STATUSES = ("exit status: 0 done; 1 the command could not do its work (a missing or damaged "
            "file, a refused resume, ...; an unexpected error names its traceback file); "
            "2 bad input (an unknown flag or config key, a bad value, a --config file that "
            "does not exist or does not load); 130 interrupted; 143 terminated")

_RESUME = "; rerun the same command to resume from the last checkpoint"


def one_line(e: BaseException) -> str:
  """``e``'s message with its whitespace folded, or its type's name."""
  return " ".join(str(e).split()) or type(e).__name__


def fail(message: str, status: int) -> NoReturn:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(status)


# ------------------------------------------------------------------ flags


def define_config_flag(help_text: str = "Experiment config file (experiments/*.py[:args]).") -> None:
  """``--config`` (ml_collections' config file flag), defined once: main,
  compile and vtab each define it, and a process (a test) may hold more
  than one of them."""
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  if "config" not in flags.FLAGS:
    config_flags.DEFINE_config_file("config", None, help_text, lock_config=True)


def config_arg(argv) -> Optional[str]:
  """The value of ``--config=<file>[:args]`` in ``argv``."""
  return next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)


def config_path(argv) -> Optional[str]:
  """The file of ``--config=<file>[:args]``."""
  arg = config_arg(argv)
  return arg.partition(":")[0] if arg else None


def _unknown_override(argv) -> Optional[str]:
  """Names the first ``--config.a.b=...`` whose key the config file lacks."""
  import runpy  # pylint: disable=g-import-not-at-top
  arg = config_arg(argv)
  if arg is None:
    return None
  path, _, config_args = arg.partition(":")
  config = runpy.run_path(path)["get_config"](config_args or None)
  from darl_jax import config_lib  # pylint: disable=g-import-not-at-top
  for a in argv:
    if not a.startswith("--config."):
      continue
    try:
      config_lib.config_node(config, a[len("--config."):].split("=", 1)[0])
    except ValueError as e:
      return f"{a}: {e}"
  return None


def _config_load_error(argv, e: BaseException) -> str:
  """The line for a ``--config`` file that does not load: it does not exist,
  or running it raised (a syntax error, a bad ``:args``)."""
  path = config_path(argv)
  if path and not os.path.exists(path):
    return f"the --config file {path} does not exist"
  while e.__cause__ is not None:
    e = e.__cause__
  text = str(e)
  if "Error whilst parsing config file" in text:
    # config_flags folds the file's traceback into its message: keep the
    # exception's own last line ("ValueError: unknown config argument ...").
    text = [l for l in text.splitlines() if l.strip()][-1]
  else:
    text = f"{type(e).__name__}: {text}"
  return f"cannot load --config {path}: {' '.join(text.split())[:500]}"


def parse_flags(argv) -> list[str]:
  """absl's flag parsing (``app.run``'s ``flags_parser``) with every error as
  one ``error:`` line, status 2: an unknown flag, an unknown ``--config.*``
  key (config_flags raises AttributeError/KeyError while applying
  overrides), a value of the wrong type, a config file that does not load."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    message = one_line(e)
    if "Error whilst parsing config file" in str(e):
      message = _config_load_error(argv, e)
  except (AttributeError, KeyError) as e:
    try:
      message = _unknown_override(argv) or f"bad config override: {one_line(e)}"
    except Exception:  # pylint: disable=broad-except  # the file itself fails to load
      message = _config_load_error(argv, e)
  except Exception as e:  # pylint: disable=broad-except
    # The config file fails while it is loaded (missing, a syntax error, an
    # exception in get_config).
    message = _config_load_error(argv, e)
  fail(message, USAGE)


def loaded_config(required: str = "") -> Any:
  """The ``--config`` flag's value, loaded. config_flags loads a file it
  cannot open lazily, on first use: this uses it, so that a missing file is
  one line (status 2) here and not a traceback later. ``required``: the
  usage line when the flag is left out (None is returned otherwise)."""
  try:
    config = flags.FLAGS["config"].value
    if config is not None:
      config.get("trainer")      # a file that failed to load raises on first use
  except Exception as e:  # pylint: disable=broad-except
    fail(_config_load_error(sys.argv, e), USAGE)
  if config is None and required:
    fail(required, USAGE)
  return config


class ArgumentParser(argparse.ArgumentParser):
  """argparse with its errors as one ``error:`` line, status 2 (argparse's
  own prints the usage first), and the statuses in ``--help``."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("epilog", STATUSES)
    super().__init__(*args, **kwargs)

  def error(self, message: str) -> NoReturn:
    fail(f"{message} (--help lists the flags)", USAGE)


# --------------------------------------------------------------- failures


def traceback_file(workdir: Optional[str], exc: BaseException) -> Optional[str]:
  """Writes the traceback of an unexpected error beside the run (or into the
  temporary directory); returns the path, None if nothing could be written."""
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


def _is_config_error(e: BaseException) -> bool:
  # config_lib imports JAX: if it was never imported, nothing raised its error.
  config_lib = sys.modules.get("darl_jax.config_lib")
  return config_lib is not None and isinstance(e, config_lib.ConfigError)


def report(e: BaseException, *, workdir: Optional[str] = None, failed: int = FAILED,
           unexpected: Optional[int] = None, resumable: bool = False) -> NoReturn:
  """One line and the status for ``e`` (the module docstring's table).

  ``failed``: the status of a ValueError or OSError (1; compile and memory,
  which read no data, give 2: theirs come from their flags); ``unexpected``:
  of anything else (default ``failed``), whose traceback goes to a file
  (``workdir``'s error.log, else the temporary directory); ``resumable``:
  the interrupt lines say that a rerun resumes."""
  if isinstance(e, KeyboardInterrupt):
    fail("interrupted" + (_RESUME if resumable else ""), INTERRUPTED)
  if isinstance(e, interrupts.Terminated):
    # Its message says which signal and, after a preemption save, which
    # step was saved and how to resume (darl_jax/preemption.py).
    message = one_line(e) or "terminated (SIGTERM)"
    fail(message + (_RESUME if resumable and "rerun" not in message else ""), TERMINATED)
  if isinstance(e, app.UsageError):
    fail(f"{one_line(e)} (--help lists the flags)", USAGE)
  if _is_config_error(e):
    fail(one_line(e), USAGE)
  if isinstance(e, (ValueError, OSError)):
    # The messages of user errors name the fix: one line, no traceback.
    # OSError covers unreadable files.
    fail(one_line(e), failed)
  # Anything else is a bug, here or in a library: still one line on the
  # console, and the traceback in a file for the bug report.
  where = traceback_file(workdir, e)
  fail(f"{type(e).__name__}: {one_line(e)[:500]}"
       + (f" (traceback in {where})" if where else ""),
       failed if unexpected is None else unexpected)


class CleanupStack(contextlib.ExitStack):
  """An ExitStack whose clean-up never hides the error that ended its block:
  a clean-up that fails after it (a full disk fails the removal of the save
  it cut short, and the last flush of the logs) is logged as a warning and
  attached to that error as a note, and the first error is what is raised
  and reported."""

  def __exit__(self, exc_type, exc, tb):
    try:
      return super().__exit__(exc_type, exc, tb)
    except BaseException as later:  # pylint: disable=broad-except
      if exc is None or later is exc:
        raise
      text = f"{type(later).__name__}: {one_line(later)}"
      logging.warning("clean-up after the error failed too: %s", text[:500])
      exc.add_note(f"clean-up after it failed too: {text}")
    raise exc


def guarded(fn: Callable, *args, workdir: Optional[Callable[[], Optional[str]]] = None,
            **how) -> Any:
  """``fn(*args)``, with what it raises reported as ``report`` says (the
  commands that parse their flags with ``ArgumentParser``; ``run`` does this
  for absl's). ``workdir``: a function giving the folder for the traceback
  file, called only on an error."""
  try:
    return fn(*args)
  except SystemExit:
    raise
  except BaseException as e:  # pylint: disable=broad-except
    report(e, workdir=workdir() if workdir else None, **how)


def run(main: Callable[[list[str]], Any], *, argv: Optional[list[str]] = None,
        workdir: Optional[Callable[[], Optional[str]]] = None, failed: int = FAILED,
        unexpected: Optional[int] = None, resumable: bool = False) -> NoReturn:
  """``app.run(main)`` with every error as one ``error:`` line and the
  statuses of the module docstring: flag errors through ``parse_flags``,
  what ``main`` raises through ``report`` (``workdir``: a function giving
  the folder for the traceback file, called after the flags are parsed)."""
  app.run(functools.partial(guarded, main, workdir=workdir, failed=failed,
                            unexpected=unexpected, resumable=resumable),
          argv=argv, flags_parser=parse_flags)
