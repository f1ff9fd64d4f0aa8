"""Pieces the launchers share: argument splitting, the training command, checks.

Every launcher takes its own flags, then ``--``, then flags for
``darl_jax.main`` that are passed through unchanged (config overrides)::

    python launch/<launcher>.py --config=experiments/vit_l16_diff.py \\
        --workdir=gs://bucket/run ... -- --config.total_steps=10

Standard library only: the launchers run on a laptop or a cluster login node,
and ``--dry_run`` needs nothing installed (not even JAX).
"""

from __future__ import annotations

import os
import pathlib
import shlex
from typing import Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]

# The environment that makes `darl_jax.distributed` initialise or fail: a
# launched multi-host job must never fall back to N independent processes.
DISTRIBUTED_ENV = {"DARL_DISTRIBUTED": "on"}

# What a copy of the repository for the machines leaves out (tar --exclude and
# shutil.ignore_patterns patterns): git, virtualenvs, run outputs, caches.
SOURCE_EXCLUDES = (".git", ".venv", "venv", "workdirs", "__pycache__", "*.egg-info",
                   ".pytest_cache")


def split_passthrough(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """``[prog, own..., "--", passed...]`` -> (own flags with prog, passed flags)."""
  argv = list(argv)
  if "--" not in argv:
    return argv, []
  i = argv.index("--")
  passed = argv[i + 1:]
  bad = [a for a in passed if not a.startswith("--")]
  if bad:
    raise SystemExit(f"error: arguments after -- go to darl_jax.main and must be flags "
                     f"like --config.total_steps=10; got {bad}")
  return argv[:i], passed


def check_config(config: str) -> str:
  """The config argument (``path[:args]``) with an existing path in the repository."""
  path = config.split(":", 1)[0]
  if not (REPO / path).is_file():
    raise SystemExit(f"error: config file {path!r} not found under {REPO} (give a path "
                     "relative to the repository root, e.g. experiments/vit_l16_diff.py)")
  return config


def check_workdir(workdir: str, *, shared: str) -> str:
  """Multi-host jobs need a workdir every host sees: ``gs://`` (or a shared FS)."""
  if not workdir:
    raise SystemExit("error: --workdir is required")
  if shared == "gcs" and not workdir.startswith("gs://"):
    raise SystemExit(f"error: --workdir must be on GCS (gs://bucket/dir) so that every "
                     f"host writes into the same place; got {workdir!r}")
  return workdir


def check_line(what: str, value):
  """``value``, refused (one error line) if it holds a newline or another
  control character: a generated script or command line keeps each value on
  its line."""
  if value is not None and any(ord(c) < 32 or ord(c) == 127 for c in str(value)):
    raise SystemExit(f"error: {what} {str(value)!r} holds a newline or another control "
                     "character, which a job script cannot carry; remove it")
  return value


def main_args(config: str, workdir: str, passthrough: Sequence[str]) -> list[str]:
  """Flags of ``python -m darl_jax.main`` (without the interpreter)."""
  return [f"--config={config}", f"--workdir={workdir}", *passthrough]


def main_command(config: str, workdir: str, passthrough: Sequence[str],
                 python: str = "python3") -> list[str]:
  return [python, "-m", "darl_jax.main", *main_args(config, workdir, passthrough)]


# darl_jax/preemption.EXIT_STATUS (the launchers import nothing of the
# package, so that --dry_run needs nothing installed): the training
# processes stopped at a preemption notice (SIGTERM, or the preemption
# signal) with the checkpoint of the stop step saved; rerunning resumes.
PREEMPTED = 143


def rerun_while_preempted(command: str, restarts: int) -> str:
  """A bash line that runs ``command`` and reruns it (at most ``restarts``
  times) while it exits with PREEMPTED; the last exit status is its own.
  ``restarts=0``: ``command`` as it is."""
  if restarts < 0:
    raise SystemExit("error: --max_restarts must be >= 0")
  if restarts == 0:
    return command
  return (f"for attempt in $(seq 0 {restarts}); do {command}; status=$?; "
          f"[ $status -eq {PREEMPTED} ] || break; "
          f"echo \"preempted (exit {PREEMPTED}): rerunning, which resumes from the last "
          f"checkpoint\"; done; exit $status")


def env_prefix(env: dict[str, str]) -> str:
  """``A=1 B=2 `` for a shell command line."""
  return "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())


def show(cmd: Sequence[str]) -> str:
  """One shell-quoted line, as a dry run prints it."""
  return "+ " + shlex.join(cmd)


def run_or_print(commands: list[list[str]], dry_run: bool) -> None:
  """Prints every command; runs them in order (stopping at a failure) unless dry."""
  import subprocess  # pylint: disable=g-import-not-at-top
  for cmd in commands:
    print(show(cmd), flush=True)
    if not dry_run:
      subprocess.run(cmd, check=True, cwd=REPO, env=os.environ.copy())
