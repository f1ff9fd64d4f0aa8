"""``auto``: the fastest implementation of each kernel option on this backend.

``model.attention_impl``, ``model.mlp_impl`` and ``model.norm_impl`` default
to ``auto``. ``resolve(model_cfg)`` turns them into what runs here:

- Hopper GPUs (sm_90: H100, H200) in bfloat16: our Pallas kernels
  (``hopper`` attention, ``hopper`` MLP, ``triton`` LayerNorm); shapes the
  kernels do not take fall back inside the model (attention as ``auto``
  below, the MLP to XLA's).
- Other NVIDIA GPUs in bfloat16: attention stays ``auto``, which
  ``models.attention.dot_product_attention`` runs as cuDNN's fused kernel
  where cuDNN takes the shape (16-bit inputs, an even sequence length) and
  as XLA's otherwise; MLP and LayerNorm XLA's.
- float32, CPUs and TPUs: XLA everywhere (``auto`` attention is XLA's there).
- The two-stream model has no kernel MLP or LayerNorm: XLA's.

An explicit value is kept as given (the model then runs exactly that, or
fails with an error naming the fix).
"""

from __future__ import annotations

import jax

AUTO = "auto"
OPTIONS = ("attention_impl", "mlp_impl", "norm_impl")


def _get(model_cfg, key, default=None):
  if hasattr(model_cfg, "get"):
    return model_cfg.get(key, default)
  return getattr(model_cfg, key, default)


def on_hopper() -> bool:
  """Whether the default device is an sm_90 NVIDIA GPU."""
  device = jax.devices()[0]
  return (device.platform == "gpu"
          and str(getattr(device, "compute_capability", "")).startswith("9."))


def resolve(model_cfg) -> dict[str, str]:
  """``{option: implementation}`` for the three options of ``model_cfg``."""
  fast = _get(model_cfg, "dtype", "float32") == "bfloat16" and on_hopper()
  kernels = {"attention_impl": "hopper" if fast else AUTO,
             "mlp_impl": "hopper" if fast else "xla",
             "norm_impl": "triton" if fast else "xla"}
  if _get(model_cfg, "two_stream", False):
    kernels.update(mlp_impl="xla", norm_impl="xla")
  out = {}
  for option in OPTIONS:
    value = _get(model_cfg, option, AUTO) or AUTO
    out[option] = kernels[option] if value == AUTO else value
  return out


def describe(model_cfg) -> str:
  """One log line: what runs, and which of it ``auto`` chose."""
  chosen = resolve(model_cfg)
  parts = []
  for option in OPTIONS:
    asked = _get(model_cfg, option, AUTO) or AUTO
    parts.append(f"{option}={chosen[option]}" + (" (auto)" if asked == AUTO else ""))
  device = jax.devices()[0]
  return f"kernels on {device.device_kind}: " + ", ".join(parts)
