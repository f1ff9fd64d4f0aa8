"""Test-wide settings.

Many tests compile the same tiny programs, often in subprocesses (the CLI
tests). A persistent XLA compilation cache shared by the whole run (and
inherited by subprocesses through the environment) turns repeats into cache
hits. It lives in a per-run temporary folder, so no state leaks between runs.
"""

import os
import tempfile

from xla_env import with_xla_flag

_CACHE = os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="darl_jax_test_cache_"))
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
