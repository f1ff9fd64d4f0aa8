"""XLA_FLAGS for test subprocesses with several virtual CPU devices."""

import os


def cpu_devices_flags(devices: int) -> str:
  """The test run's XLA_FLAGS (see conftest.py) with ``devices`` CPU devices."""
  return " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                f"--xla_force_host_platform_device_count={devices}"]))
