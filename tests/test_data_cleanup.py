"""The input pipeline leaves nothing behind: no shared-memory segment in
/dev/shm after a run (closed, left open, failed, killed), no resource-tracker
warning, and one log line per data warning."""

import logging as py_logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from PIL import Image

from darl_jax.data import base
from darl_jax.data.sources import image_folder

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")

# Logs the name of every shared-memory segment created in the child and its
# worker processes (one file per process), so that the test checks the
# child's own segments, whatever other processes on the host do.
SITECUSTOMIZE = textwrap.dedent("""\
    import os
    from multiprocessing import shared_memory as _sm
    _init = _sm.SharedMemory.__init__
    def __init__(self, name=None, create=False, size=0):
      _init(self, name, create, size)
      if create:
        with open(os.path.join(os.environ["SHM_LOG_DIR"], str(os.getpid())), "a") as f:
          f.write(self.name.lstrip("/") + "\\n")
    _sm.SharedMemory.__init__ = __init__
""")

CHILD = textwrap.dedent("""\
    import sys, time
    from darl_jax.data.sources import image_folder

    def main(path, mode):
      source = image_folder.build({"path": path, "image_size": 8, "channels": 1,
                                   "augment": "spatial"}, split="train", seed=0)
      it = source.train_iterator(4, num_workers=2)
      batches = [next(it) for _ in range(3)]
      if mode == "closed":
        it.close()
        # An eval pass run to its end, and one broken off (a max-batches eval).
        list(source.eval_batches(4, num_workers=1))
        for _ in source.eval_batches(2, num_workers=1):
          break
        print("done", flush=True)
      elif mode == "error":
        raise RuntimeError("a failing run, its pipeline still open")
      elif mode == "kill":
        print("ready", flush=True)
        time.sleep(60)

    if __name__ == "__main__":   # the workers are spawned: they import this file
      main(*sys.argv[1:])
""")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  root = tmp_path_factory.mktemp("images")
  rng = np.random.default_rng(0)
  for i in range(12):
    Image.fromarray(rng.integers(0, 255, (10, 12, 3), np.uint8)).save(root / f"{i}.png")
  return str(root)


def _start(tmp_path, folder, mode):
  site = tmp_path / "site"
  site.mkdir()
  (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
  (tmp_path / "child.py").write_text(CHILD)
  logs = tmp_path / "shm_log"
  logs.mkdir()
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(site), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]),
             SHM_LOG_DIR=str(logs), JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, str(tmp_path / "child.py"), folder, mode],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env)
  return proc, logs


def _segments(logs) -> list[str]:
  return [name for f in logs.iterdir() for name in f.read_text().split()]


def _left(names) -> list[str]:
  return [n for n in names if os.path.exists(os.path.join("/dev/shm", n))]


@pytest.mark.parametrize("mode,code", [("closed", 0), ("error", 1)])
def test_no_shared_memory_is_left_and_no_leak_warning(tmp_path, folder, mode, code):
  """A run that closes its iterators and one that dies of an error with its
  pipeline open: both leave none of their segments in /dev/shm, and neither
  Python's resource tracker nor a finalizer complains."""
  proc, logs = _start(tmp_path, folder, mode)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == code, err
  names = _segments(logs)
  assert len(names) >= 6, "the workers handed batches over in shared memory"
  assert not _left(names), err
  assert "leaked shared_memory" not in err
  assert "Exception ignored" not in err, err
  if mode == "closed":
    assert out.strip() == "done"


def test_workers_end_and_segments_go_when_the_parent_is_killed(tmp_path, folder):
  """SIGKILL of the training process: its workers end within seconds (they
  watch their parent), unlink the segments they made that are still there,
  and Python's resource tracker (which outlives the parent and writes to
  the same stderr) has nothing left to warn about."""
  proc, logs = _start(tmp_path, folder, "kill")
  assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
  workers = [int(f.name) for f in logs.iterdir() if int(f.name) != proc.pid]
  assert workers
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait(timeout=10)
  # stderr ends when its last writer (a worker, the tracker) is gone.
  err = proc.stderr.read()
  deadline = time.time() + 15
  while time.time() < deadline and (
      _left(_segments(logs)) or any(os.path.exists(f"/proc/{w}") for w in workers)):
    time.sleep(0.2)
  assert not any(os.path.exists(f"/proc/{w}") for w in workers), "orphaned workers"
  assert not _left(_segments(logs))
  assert "leaked shared_memory" not in err, err
  assert "Traceback" not in err, err
  proc.stdout.close()
  proc.stderr.close()


def test_a_split_warning_is_logged_once_for_all_splits(tmp_path, caplog):
  """The hash split's val_split_size fallback and the ignored-files note are
  met by every split's build (train, validation): each is logged once."""
  rng = np.random.default_rng(1)
  for i in range(6):
    Image.fromarray(rng.integers(0, 255, (8, 8, 3), np.uint8)).save(tmp_path / f"{i}.png")
  (tmp_path / "notes.txt").write_text("not an image")
  base._WARNED.clear()
  cfg = {"path": str(tmp_path), "image_size": 8, "channels": 1, "val_split_size": 5000}
  with caplog.at_level(py_logging.WARNING):
    for split in ("train", "validation", "train"):
      image_folder.build(cfg, split=split, seed=0)
  fallback = [r for r in caplog.records if "val_split_size=5000" in r.getMessage()]
  ignored = [r for r in caplog.records if "not images" in r.getMessage()]
  assert len(fallback) == 1 and len(ignored) == 1, [r.getMessage() for r in caplog.records]
