"""Test-wide settings.

Many tests compile the same tiny programs, often in subprocesses (the CLI
tests). A persistent XLA compilation cache shared by the whole run (and
inherited by subprocesses through the environment) turns repeats into cache
hits. It lives in a per-run temporary folder, so no state leaks between runs.
"""

import os
import tempfile

_CACHE = os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="darl_jax_test_cache_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
