"""What the Pallas Mosaic GPU kernels of this package share."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_params(interpret: bool):
  """``plgpu.kernel``'s ``interpret`` argument: Pallas's GPU interpreter (CPU
  tests) when asked, else None (compile for the GPU)."""
  if not interpret:
    return None
  params = getattr(plgpu, "InterpretParams", None)
  if params is None:   # jax 0.10 keeps it private
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
  return params()


def swizzled(cols: int, dtype) -> tuple:
  """Shared-memory tiling + swizzle for a tile whose rows hold ``cols``
  elements: the widest swizzle (up to 128 bytes) that divides a row."""
  swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def require_hopper(option: str, tpu_fix: str, gpu_fix: str) -> None:
  """Errors that name the fix when ``option`` (a Hopper-kernel setting) meets
  a device the kernels cannot run on. CPU is allowed: there the kernels run
  in Pallas's GPU interpreter (tests)."""
  device = jax.devices()[0]
  if device.platform not in ("gpu", "cpu"):
    raise ValueError(f"{option} is for NVIDIA Hopper GPUs, not {device.platform}; "
                     f"use {tpu_fix}")
  # wgmma is sm_90 only (Blackwell's tensor cores take other instructions).
  if device.platform == "gpu" and not str(getattr(device, "compute_capability", "9.0")
                                          ).startswith("9."):
    raise ValueError(f"{option} needs a Hopper GPU (sm_90), not {device.device_kind}; "
                     f"use {gpu_fix}")
