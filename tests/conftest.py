"""Test-wide settings.

Tests write nothing outside their temporary folders. The run gets one
temporary folder (removed at its end) that holds HOME, so that whatever
defaults to a path under ``~`` (the compilation cache and shard indexes
under ~/.cache/darl_jax, matplotlib's font cache) lands there, and the
subprocesses' TMPDIR; subprocesses inherit both through the environment. At the end the run fails
if it left files in the user's ~/.cache/darl_jax or new git-ignored output
(a workdir, a benchmark's folder) in the repository
(``pytest_sessionfinish``).

Many tests compile the same tiny programs, often in subprocesses (the CLI
tests). A persistent XLA compilation cache shared by the whole run (and
inherited by subprocesses through the environment) turns repeats into cache
hits. It lives in the run's folder, so no state leaks between runs.
"""

import os
import pathlib
import shutil
import subprocess
import tempfile

from xla_env import with_xla_flag

ROOT = pathlib.Path(__file__).resolve().parents[1]
# pytest-xdist's workers inherit the environment of the process that starts
# them: the whole run shares one folder, made and removed by that process.
_RUN_DIR_ENV = "DARL_TEST_RUN_DIR"
_OWNS_RUN_DIR = _RUN_DIR_ENV not in os.environ
if _OWNS_RUN_DIR:
  os.environ[_RUN_DIR_ENV] = tempfile.mkdtemp(prefix="darl_jax_tests_")
  os.environ["DARL_TEST_REAL_HOME"] = os.path.expanduser("~")
_RUN_DIR = pathlib.Path(os.environ[_RUN_DIR_ENV])
_REAL_HOME = pathlib.Path(os.environ["DARL_TEST_REAL_HOME"])
os.environ["HOME"] = str(_RUN_DIR / "home")
os.makedirs(os.environ["HOME"], exist_ok=True)
# Subprocesses' temporary files too (an error's traceback file, a benchmark's
# scratch folder). This process keeps the folder it already uses, where
# pytest puts tmp_path (the workers get theirs from it).
os.environ["TMPDIR"] = str(_RUN_DIR / "tmp")
os.makedirs(os.environ["TMPDIR"], exist_ok=True)
os.environ.pop("XDG_CACHE_HOME", None)          # caches follow HOME
os.environ.pop("MPLCONFIGDIR", None)
_CACHE = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_RUN_DIR / "jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Saved train-step executables (train/executables.py): off, as by default,
# except where a test turns them on.
os.environ.setdefault("DARL_COMPILED_STEP_CACHE", "0")
# The tests run JAX on the CPU. Where libtpu is installed (the tpu extra, for
# the ahead-of-time TPU compile tests) JAX would otherwise load it as a
# backend, and libtpu must never query a metadata server here; the TPU
# compile tests get their topology from jax.experimental.topologies.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # two test workers compile at once
# The tests' programs are tiny, so compiling them is most of their time, and
# LLVM's optimisation passes are most of a CPU compile: without them a model's
# init compiles in half the time (15.8 s against 32.8 s for test_models'
# option cases). Subprocesses that set their own XLA_FLAGS append to these.
os.environ["XLA_FLAGS"] = with_xla_flag("--xla_backend_optimization_level=0")


import socket  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def no_network(monkeypatch):
  """Fails any Python-level connection attempt: nothing may download. Opt-in
  (``pytestmark = pytest.mark.usefixtures("no_network")``): the multi-host
  tests connect to local coordinators."""

  def refuse(self, address):
    raise RuntimeError(f"network access attempted in a test: {address}")

  monkeypatch.setattr(socket.socket, "connect", refuse)
  monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.fixture(autouse=True)
def _kernel_choice_per_test():
  """The ops' implementation choice is process-wide (ops.configure, set by
  the loop's setup): each test starts from, and leaves, the default."""
  from darl_jax import ops
  with ops.using(attention="xla", mlp="xla", norm="xla"):
    yield


# Output the repository may hold but a test run must not add (git-ignored:
# run folders, benchmark output); bytecode and pytest's cache do not count.
_NOT_OUTPUT = ("__pycache__", ".pytest_cache", ".egg-info")


def _outputs() -> set[str]:
  """Files under the user's ~/.cache/darl_jax, and the repository's
  git-ignored paths (folders collapsed), as strings."""
  found = set()
  cache = _REAL_HOME / ".cache" / "darl_jax"
  if cache.is_dir():
    found.update(str(p) for p in cache.rglob("*") if not p.is_dir())
  listed = subprocess.run(
      ["git", "ls-files", "--others", "--ignored", "--exclude-standard", "--directory"],
      cwd=ROOT, capture_output=True, text=True, check=False,
      env=dict(os.environ, HOME=str(_REAL_HOME)))    # git's own settings (safe.directory)
  if listed.returncode == 0:      # a copy without git: the home check alone
    found.update(str(ROOT / line.rstrip("/")) for line in listed.stdout.splitlines()
                 if not any(part in line for part in _NOT_OUTPUT))
  return found


_BEFORE = _outputs() if _OWNS_RUN_DIR else set()


def pytest_sessionfinish(session, exitstatus):
  """Fails the run (exit status 1) if it left files outside its temporary
  folders; removes the run's folder."""
  del exitstatus
  if not _OWNS_RUN_DIR:
    return
  shutil.rmtree(_RUN_DIR, ignore_errors=True)
  leftovers = sorted(_outputs() - _BEFORE)
  if leftovers:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = ("the tests left files outside their temporary folders (write into "
               "tmp_path): " + ", ".join(leftovers[:20]))
    if reporter is not None:
      reporter.write_line("")       # past the progress line
      reporter.write_line(message, red=True)
    else:
      print(message)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def fresh_kernel_programs():
  """Each test traces the kernels anew: per_shard shares one jitted program
  per kernel call site across a process (kernels/per_shard.py), which would
  keep a test's monkeypatched kernel function out of a later test's trace."""
  import sys
  per_shard = sys.modules.get("darl_jax.kernels.per_shard")
  if per_shard is not None:
    per_shard._SHARED.clear()
  yield
