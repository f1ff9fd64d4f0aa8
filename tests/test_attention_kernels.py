"""The Hopper attention kernels (darl_jax/kernels/hopper_attention.py) on CPU:
their numbers in Pallas's GPU interpret mode, the block-diagonal causal mask
as properties, and their lowering for CUDA at the model sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import config_lib
from darl_jax.kernels import hopper_attention as ha
from darl_jax.models import attention, vit

# 4 images of 80 tokens: 320 rows = 5 tiles of 64, three of which straddle
# two images, and a query tile sees up to 3 key tiles.
B, T, H, D = 4, 80, 2, 64


def _qkv(key, shape=(B, T, H, D)):
  return [jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16)
          for k in jax.random.split(key, 4)]


def _reference(q, k, v):
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  return jax.nn.dot_product_attention(*f32, is_causal=True)


def _kernel(slots=0):
  return lambda q, k, v: ha.causal_attention(q, k, v, ha.AttentionTiling(slots), True)


def _rel(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("slots,head_dim", [(0, 64), (2, 64), (2, 80)])
def test_attention_and_its_gradients_match_float32(slots, head_dim):
  """slots=0 loads each streamed tile once; slots=2 refills slots, so a
  barrier goes through several phases (the interpreter checks them).
  head_dim 80 is ViT-H/14's (narrower shared-memory swizzle)."""
  q, k, v, do = _qkv(jax.random.key(0), (B, T, H, head_dim))
  out, vjp = jax.vjp(_kernel(slots), q, k, v)
  ref, ref_vjp = jax.vjp(_reference, q, k, v)
  assert out.shape == q.shape and out.dtype == jnp.bfloat16
  # bf16 inputs, float32 softmax: the bf16 xla path's error is about 2e-3.
  assert _rel(out, ref) < 4e-3
  np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=2e-2)
  for got, want in zip(vjp(do), ref_vjp(do.astype(jnp.float32))):
    assert _rel(got, want) < 8e-3


def test_each_token_sees_only_earlier_tokens_of_its_own_image():
  """Changing tokens t+1.. of image 1 leaves its outputs up to t alone, and
  changing image 1 at all leaves every other image alone (two of the tiles
  hold rows of images 0 and 1 together)."""
  q, k, v, _ = _qkv(jax.random.key(1))
  f = jax.jit(_kernel())
  base = f(q, k, v)
  t = 37
  noise = _qkv(jax.random.key(2))
  later = [x.at[1, t + 1:].set(n[1, t + 1:]) for x, n in zip((q, k, v), noise)]
  out = f(*later)
  np.testing.assert_array_equal(out[1, :t + 1], base[1, :t + 1])
  assert not np.array_equal(out[1, t + 1:], base[1, t + 1:])
  other = [x.at[1].set(n[1]) for x, n in zip((q, k, v), noise)]
  out = f(*other)
  for b in (0, 2, 3):
    np.testing.assert_array_equal(out[b], base[b])


@pytest.mark.parametrize("seg", [64, 80, 100, 196, 256])
def test_tile_spans_cover_exactly_the_tiles_with_unmasked_pairs(seg):
  """_q_span / _kv_span (which tiles each CTA streams) against a brute force
  over the flat block-diagonal causal mask: no tile missed, none extra."""
  images = 64 * 3 // np.gcd(seg, 64) if seg % 64 else 3
  rows = images * seg
  tiles = rows // ha.BLOCK
  r = np.arange(rows)
  allowed = (r[None, :] <= r[:, None]) & (r[None, :] // seg == r[:, None] // seg)
  per_tile = allowed.reshape(tiles, ha.BLOCK, tiles, ha.BLOCK).any(axis=(1, 3))
  for i in range(tiles):
    lo, n = ha._q_span(i, seg)
    assert list(range(lo, lo + n)) == list(np.flatnonzero(per_tile[i])), (i, seg)
    first, n = ha._kv_span(i, seg)
    assert list(range(first, first + n)) == list(np.flatnonzero(per_tile[:, i])), (i, seg)


def test_shapes_the_kernels_cannot_take_name_the_fix():
  q = jnp.zeros((3, 80, 2, 64), jnp.bfloat16)    # 240 rows: not whole tiles
  with pytest.raises(ValueError, match="batch x tokens = 240 .*attention_impl='cudnn'"):
    ha.check_shapes(q, q, q)
  f32 = jnp.zeros((4, 80, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match="bfloat16"):
    ha.check_shapes(f32, f32, f32)
  odd = jnp.zeros((4, 80, 2, 72), jnp.bfloat16)
  with pytest.raises(ValueError, match="head_dim 72"):
    ha.check_shapes(odd, odd, odd)
  assert not ha.fits(odd, odd, odd) and ha.fits(*_qkv(jax.random.key(0))[:3])


@pytest.mark.parametrize("model", ["B/16", "L/16", "H/14"])
def test_attention_kernels_lower_for_hopper_at_model_sizes(model):
  """Forward and both backward kernels fit a CTA's shared memory and have a
  layout for every operation (checked while lowering; no GPU needed)."""
  variant, patch = vit.parse_variant(model)
  tokens = (224 // patch) ** 2
  heads = variant.num_heads
  s = jax.ShapeDtypeStruct((32, tokens, heads, variant.width // heads), jnp.bfloat16)

  def loss(q, k, v):
    return jnp.sum(ha.causal_attention(q, k, v).astype(jnp.float32))

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(s, s, s).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 3


def test_attention_impl_hopper_is_the_same_attention():
  """model.attention_impl='hopper' in the attention module: same output and
  gradients as the xla path (bf16), and non-causal attention, which the
  kernels do not do, takes the plain path."""
  x = jax.random.normal(jax.random.key(3), (2, 64, 128)).astype(jnp.bfloat16)

  def run(impl, causal=True):
    mod = attention.MultiHeadAttention(2, causal=causal, impl=impl, dtype=jnp.bfloat16)
    params = mod.init(jax.random.key(4), x)

    def f(p, x):
      y = mod.apply(p, x).astype(jnp.float32)
      return jnp.sum(y * jnp.sin(y)), y
    (_, y), g = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, x)
    return y, g

  y_x, g_x = run("xla")
  y_h, g_h = run("hopper")
  assert _rel(y_h, y_x) < 1e-2
  for a, b in zip(jax.tree.leaves(g_h), jax.tree.leaves(g_x)):
    assert _rel(a, b) < 3e-2
  np.testing.assert_array_equal(run("hopper", causal=False)[0], run("xla", causal=False)[0])


def test_vit_from_config_takes_attention_impl_hopper():
  config = config_lib.imagenet_pretrain_config("L/16", "mse")
  config.model.attention_impl = "hopper"
  assert vit.vit_from_config(config.model)[0].attention_impl == "hopper"
  config.model.attention_impl = "flash"
  with pytest.raises(ValueError, match="valid: xla, cudnn, hopper"):
    vit.vit_from_config(config.model)


def test_attention_kernel_bench_parses_shapes():
  import argparse
  import sys
  from pathlib import Path
  sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
  import attention_kernel_bench
  assert attention_kernel_bench.parse_shape("H/14:192") == (192, 256, 16, 80)
  assert attention_kernel_bench.parse_shape("L/16") == (128, 196, 16, 64)
  with pytest.raises(argparse.ArgumentTypeError, match="valid: B/16, L/16, H/14"):
    attention_kernel_bench.parse_shape("G/14:64")


def test_hopper_options_on_other_devices_name_the_fix(monkeypatch):
  """attention_impl / mlp_impl = 'hopper' on a TPU or a non-Hopper GPU."""
  from types import SimpleNamespace
  from darl_jax.kernels import mosaic
  q = _qkv(jax.random.key(0))[0]
  tpu = SimpleNamespace(platform="tpu", device_kind="TPU v5p")
  monkeypatch.setattr(jax, "devices", lambda *a: [tpu])
  with pytest.raises(ValueError, match="not tpu; use model.attention_impl='xla'"):
    attention._hopper_attention_fits(q, q, q)
  blackwell = SimpleNamespace(platform="gpu", device_kind="NVIDIA B200", compute_capability="10.0")
  monkeypatch.setattr(jax, "devices", lambda *a: [blackwell])
  with pytest.raises(ValueError,
                     match="needs a Hopper GPU .* NVIDIA B200; use model.attention_impl='cudnn'"):
    attention._hopper_attention_fits(q, q, q)
  with pytest.raises(ValueError, match="model.mlp_impl='hopper' needs a Hopper GPU"):
    mosaic.require_hopper("model.mlp_impl='hopper'", "model.mlp_impl='xla'", "model.mlp_impl='xla'")
  hopper = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100", compute_capability="9.0")
  monkeypatch.setattr(jax, "devices", lambda *a: [hopper])
  assert attention._hopper_attention_fits(q, q, q)
