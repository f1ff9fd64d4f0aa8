"""libtpu on a machine without a TPU: never let it look for a metadata server.

libtpu, when JAX loads it (a TPU backend, or a TPU topology compiled for
ahead of time by darl_jax/compile.py), asks the GCE metadata server for the
TPU's type and its workers unless ``TPU_SKIP_MDS_QUERY`` is set. On a TPU VM
that query is how a pod's hosts find each other; anywhere else it is a
connection to an address that is not ours. ``configure()`` sets the variable
(and lifts libtpu's one-process lock, which guards chips this host does not
have) where this host has no TPU device files, before any JAX backend loads (it
is called from darl_jax/__init__.py, so every entry point runs it first).
"""

from __future__ import annotations

import glob
import importlib.util
import os


def on_tpu_vm() -> bool:
  """A TPU VM exposes its chips as /dev/accel* (v2-v4, v5e) or /dev/vfio/<n>
  (v5p, v6e)."""
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def configure() -> None:
  if not on_tpu_vm():
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    if importlib.util.find_spec("libtpu") is not None:
      # JAX would try libtpu as a backend and print its complaints about a
      # TPU it cannot find; a GPU where there is one, else the CPU. (An
      # explicit JAX_PLATFORMS wins; "cuda" is skipped where JAX has none.)
      os.environ.setdefault("JAX_PLATFORMS", "cuda,cpu")
    # libtpu's lockfile guards a host's chips against two processes; with
    # no chips it would only stop two compiles (two test workers) at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
