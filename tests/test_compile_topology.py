"""darl_jax/compile.py's --topology: a mistyped topology is reported as the
mistake (naming valid ones) before libtpu is asked; the libtpu hint only
where libtpu is missing. libtpu never looks for a metadata server here
(TPU_SKIP_MDS_QUERY, set before it loads)."""

import os
import pathlib
import subprocess
import sys

os.environ["TPU_SKIP_MDS_QUERY"] = "1"

import pytest  # noqa: E402

from darl_jax import compile as compile_lib  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1", TF_CPP_MIN_LOG_LEVEL="3")


@pytest.mark.parametrize("topology,why", [
    ("v5e:2x", "is not a topology"),
    ("v5e:", "is not a topology"),
    ("v5e", "is not a topology"),
    ("v5e:2x2x2x2", "has 4 axes; v5e slices have 2"),
    ("v5e:3x3", "is not a v5e slice (its shapes: 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16)"),
    ("v5e:32x32", "is not a v5e slice"),
    ("v6e:1x3", "is not a v6e slice"),
    ("v5p:2x2x3", "is not a v5p slice (its shapes: 2x2x1, 2x2x2, 2x2x4, 2x4x4, or every "
                  "axis a multiple of 4 up to 8960 chips)"),
    ("v4:16x16x32", "is not a v4 slice"),
    ("v9x:1x1", "names no known TPU generation (known: v2, v3, v4, v5e, v5p, v6e)"),
    ("v5p-256", "is a Cloud TPU accelerator type"),
])
def test_a_mistyped_topology_is_the_error(topology, why):
  with pytest.raises(ValueError) as e:
    compile_lib.check_topology(topology)
  message = str(e.value)
  assert message.startswith(f"--topology {topology!r} {why}"), message
  assert "e.g. v4:2x2x2, v5e:2x2, v5e:4x4, v5p:4x4x8, v6e:8x8" in message
  assert "libtpu" not in message and "\n" not in message


@pytest.mark.parametrize("topology", [
    "v5e:2x2", "v5e:4x2", "v5e:2x2x1", "V5E:16x16", "v6e:8x8", "v2:4x8", "v3:32x32",
    "v4:2x2x1", "v4:2x2x2", "v4:16x16x16", "v5p:2x2", "v5p:4x4x8", "v5p:16x20x28",
    "v5p:8x8x16_twisted"])
def test_the_shapes_each_generation_offers_pass(topology):
  compile_lib.check_topology(topology)


def test_without_libtpu_the_hint_says_how_to_install_it(monkeypatch):
  real = compile_lib.importlib.util.find_spec
  monkeypatch.setattr(compile_lib.importlib.util, "find_spec",
                      lambda name, *a: None if name == "libtpu" else real(name, *a))
  with pytest.raises(ValueError, match=r"needs libtpu: pip install -e \"\.\[tpu\]\""):
    compile_lib.topology_devices("v5e:2x2")
  with pytest.raises(ValueError, match="is not a v5e slice"):    # the mistake first
    compile_lib.topology_devices("v5e:3x3")


@pytest.mark.parametrize("topology", ["v5e:2x", "v5e:3x3"])
def test_the_command_reports_the_topology_not_libtpu(topology):
  proc = subprocess.run(
      [sys.executable, "-m", "darl_jax.compile", "--config=tests/tiny_config.py",
       f"--topology={topology}"], cwd=ROOT, env=ENV, capture_output=True, text=True,
      timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  [line] = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert line.startswith(f"error: --topology '{topology}' ")
  assert "v5p:4x4x8" in line and "libtpu" not in line
