"""XLA_FLAGS for the test run (conftest.py) and its multi-device subprocesses."""

import os


def with_xla_flag(flag: str) -> str:
  """This process's XLA_FLAGS with ``flag`` appended."""
  return " ".join(filter(None, [os.environ.get("XLA_FLAGS"), flag]))


def cpu_devices_flags(devices: int) -> str:
  """The test run's XLA_FLAGS (see conftest.py) with ``devices`` CPU devices."""
  return with_xla_flag(f"--xla_force_host_platform_device_count={devices}")
