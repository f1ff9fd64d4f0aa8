"""darl_jax: Denoising Autoregressive Representation Learning in JAX/Flax."""

from darl_jax import tpu_env as _tpu_env

# Before any JAX backend loads: libtpu, where installed without a TPU, must
# not query a metadata server (darl_jax/tpu_env.py).
_tpu_env.configure()
