"""The Hopper attention kernels (darl_jax/kernels/hopper_attention.py) on CPU:
their numbers in Pallas's GPU interpret mode, the block-diagonal causal mask
as properties, and their lowering for CUDA at the model sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import config_lib, ops
from darl_jax.kernels import per_shard
from darl_jax.kernels import hopper_attention as ha
from darl_jax.models import attention, posenc, vit

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


def _rope_tables(key, t, d):
  angles = jax.random.uniform(key, (t, d // 2), maxval=6.0)
  return jnp.cos(angles), jnp.sin(angles)


def _reference_qkv(qkv, bias, rope):
  """The model's function: the bias added in bf16 (as the projection does),
  then float32 RoPE and attention."""
  x = (qkv if bias is None else qkv + bias).astype(jnp.float32)
  q, k, v = x[:, :, 0], x[:, :, 1], x[:, :, 2]
  if rope is not None:
    cos, sin = (t[None] for t in rope)
    q, k = posenc.apply_rope(q, cos, sin), posenc.apply_rope(k, cos, sin)
  return jax.nn.dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("head_dim,with_bias,with_rope,tables",
                         [(64, True, True, "bfloat16"), (80, True, True, "bfloat16"),
                          (64, True, True, "float32"), (80, False, True, "float32"),
                          (64, False, True, "bfloat16"), (64, True, False, "bfloat16"),
                          (80, True, False, "float32"), (64, False, False, "bfloat16")])
def test_packed_attention_with_rope_in_the_kernels_matches_float32(head_dim, with_bias,
                                                                   with_rope, tables):
  """causal_attention_qkv: q, k, v read from the packed projection (v's bias
  added to the output, RoPE's backward in the kernels' epilogues), all three
  gradients written into one [B, T, 3, H, D] array. Against float32 bias +
  RoPE + attention, per part, and the bias gradient (summed in the kernels'
  epilogues, or by XLA at head dim 80 with RoPE); with either dtype of RoPE
  tables."""
  keys = jax.random.split(jax.random.key(5), 4)
  qkv = jax.random.normal(keys[0], (B, T, 3, H, head_dim)).astype(jnp.bfloat16)
  do = jax.random.normal(keys[1], (B, T, H, head_dim)).astype(jnp.bfloat16)
  bias = (0.3 * jax.random.normal(keys[3], (3, H, head_dim))).astype(jnp.bfloat16)
  bias = bias if with_bias else None
  rope = _rope_tables(keys[2], T, head_dim) if with_rope else None
  out, vjp = jax.vjp(
      lambda x, b: ha.causal_attention_qkv(x, b, rope, ha.AttentionTiling(2, tables), True),
      qkv, bias)
  ref, ref_vjp = jax.vjp(lambda x, b: _reference_qkv(x, b, rope), qkv, bias)
  assert out.shape == (B, T, H, head_dim) and out.dtype == jnp.bfloat16
  assert _rel(out, ref) < 4e-3
  (got, got_bias), (want, want_bias) = vjp(do), ref_vjp(do.astype(jnp.float32))
  assert got.shape == qkv.shape and got.dtype == jnp.bfloat16
  for part in range(3):
    assert _rel(got[:, :, part], want[:, :, part]) < 8e-3, part
  if with_bias:
    # the column sum of the (bf16) packed gradient, as the projection's own
    # backward takes it; float32 throughout in the reference
    assert got_bias.shape == bias.shape
    np.testing.assert_allclose(got_bias.astype(jnp.float32),
                               got.astype(jnp.float32).sum((0, 1)), rtol=1e-2, atol=1e-2)
    assert _rel(got_bias, want_bias) < 2e-2


def _full_gradient_sums(fn, *args, size):
  """The reduce_sum equations, anywhere in ``fn``'s jaxpr (sub-jaxprs
  included), whose operand has ``size`` elements."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "reduce_sum" and eqn.invars[0].aval.size == size:
        found.append(eqn)
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          sub = getattr(sub, "jaxpr", sub)     # a ClosedJaxpr's Jaxpr
          if hasattr(sub, "eqns"):
            walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.parametrize("head_dim,with_rope,in_kernel",
                         [(64, True, True), (64, False, True), (80, False, True),
                          (80, True, False)])
def test_the_bias_gradient_is_summed_in_the_backward_kernels(head_dim, with_rope, in_kernel):
  """The qkv bias gradient from the backward kernels' per-tile column sums
  (_column_sums: the staged bf16 tiles, or RoPE's two halves, through the
  same ones-matrix product and diagonal as on the GPU, which the
  interpreter takes as plain dots), not from a pass of XLA over the whole
  gradient, wherever the staged pieces are swizzled tiles: head dim 64
  with or without RoPE (ViT-B/16, L/16) and 80 without (two vectors of
  sums, columns 0..63 and 64..79). At 80 with RoPE the halves are untiled
  (not a wgmma operand) and XLA sums: this test fails if either path
  silently changes."""
  assert ha._sums_in_kernel(head_dim, with_rope) == in_kernel
  keys = jax.random.split(jax.random.key(8), 4)
  qkv = jax.random.normal(keys[0], (B, T, 3, H, head_dim)).astype(jnp.bfloat16)
  do = jax.random.normal(keys[1], (B, T, H, head_dim)).astype(jnp.bfloat16)
  bias = (0.3 * jax.random.normal(keys[2], (3, H, head_dim))).astype(jnp.bfloat16)
  rope = _rope_tables(keys[3], T, head_dim) if with_rope else None
  tiling = ha.AttentionTiling(2)

  # the kernels' sums: the float32 column sums of the bf16 gradient they
  # store, exact but for the order of the additions
  _, (qk, v, v_bias, o, lse, _, _) = ha._qkv_fwd(qkv, bias, rope, tiling, True)
  tables = None if rope is None else ha.extended_tables(*rope, T, tiling.rope_tables)
  grads, sums = ha._backward(qk, qk, v, v_bias, o, lse, do, tables, (H, 0, H, 0), tiling, True,
                             sums=True)
  assert sums.shape == (3, H, head_dim) and sums.dtype == jnp.float32
  np.testing.assert_allclose(sums, grads.astype(jnp.float32).sum((0, 1)), rtol=1e-5, atol=1e-4)

  # causal_attention_qkv's backward: no sum over the whole gradient where
  # the kernels take it, one where they do not (its numbers:
  # test_packed_attention_with_rope_in_the_kernels_matches_float32); and
  # none without a bias (causal_attention takes none either)
  def grad(x, b, do):
    return jax.vjp(lambda x, b: ha.causal_attention_qkv(x, b, rope, tiling, True), x, b)[1](do)
  assert len(_full_gradient_sums(grad, qkv, bias, do, size=qkv.size)) == (0 if in_kernel else 1)
  assert not _full_gradient_sums(lambda x, do: grad(x, None, do), qkv, do, size=qkv.size)


@pytest.mark.parametrize("slots", [0, 2, 3])
def test_the_forward_copies_out_v_from_its_last_streamed_tile(slots):
  """With ``keep_v`` the forward kernel stores v's heads from the slot of the
  last tile it streamed (the diagonal; which slot that is depends on how
  many tiles the query tile sees, 1 to 3 here); the backward of
  causal_attention_qkv keeps that array instead of the packed product. Every
  row of every head, bitwise, and the attention output unchanged."""
  qkv = jax.random.normal(jax.random.key(7), (B * T, 3 * H, D)).astype(jnp.bfloat16)
  tiling = ha.AttentionTiling(slots)
  o, lse, v = ha._forward(qkv, qkv, qkv, None, ha._packed(H), T, tiling, True, keep_v=True)
  np.testing.assert_array_equal(np.asarray(v), np.asarray(qkv[:, 2 * H:]))
  o_plain, lse_plain = ha._forward(qkv, qkv, qkv, None, ha._packed(H), T, tiling, True)
  np.testing.assert_array_equal(np.asarray(o), np.asarray(o_plain))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_plain))


def test_the_backward_does_not_keep_the_packed_product():
  """With a bias or RoPE, the residuals of causal_attention_qkv are the
  rotated q, k and v alone: no array as large as the packed product."""
  qkv = jnp.zeros((B, T, 3, H, D), jnp.bfloat16)
  bias = jnp.zeros((3, H, D), jnp.bfloat16)
  rope = _rope_tables(jax.random.key(0), T, D)
  _, res = ha._qkv_fwd(qkv, bias, rope, ha.DEFAULT_ATTENTION_TILING, True)
  sizes = [x.size for x in jax.tree.leaves(res)]
  assert qkv.size not in sizes
  assert sorted(sizes)[-2:] == [B * T * H * D, B * T * 2 * H * D]   # v; q and k
  _, res = ha._qkv_fwd(qkv, None, None, ha.DEFAULT_ATTENTION_TILING, True)
  assert max(x.size for x in jax.tree.leaves(res)) == qkv.size      # q, k, v in place


@pytest.mark.parametrize("seg", [64, 80, 196, 256])
def test_extended_rope_tables_give_every_tile_its_rows_positions(seg):
  """Tile i of the flat sequence reads entry i % P of the extended tables;
  row r of that entry must be position (64 i + r) % T, for every tile of a
  batch longer than a period. bfloat16: cos | sin in one row."""
  cos = jnp.arange(seg * 2, dtype=jnp.float32).reshape(seg, 2) / (2 * seg)
  ext_cos, ext_sin = ha.extended_tables(cos, -cos, seg, "float32")
  combined, = ha.extended_tables(cos, -cos, seg, "bfloat16")
  period = ext_cos.shape[0]
  assert ext_cos.shape == (period, ha.BLOCK, 2) and ext_sin.dtype == jnp.float32
  assert combined.shape == (period, ha.BLOCK, 4) and combined.dtype == jnp.bfloat16
  for i in range(3 * period):
    rows = (ha.BLOCK * i + np.arange(ha.BLOCK)) % seg
    np.testing.assert_array_equal(ext_cos[i % period], cos[rows])
    np.testing.assert_array_equal(ext_sin[i % period], -cos[rows])
    np.testing.assert_array_equal(combined[i % period],
                                  jnp.concatenate([cos[rows], -cos[rows]], -1).astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="float32 or bfloat16"):
    ha.extended_tables(cos, cos, seg, "float16")


def test_packed_input_the_kernels_cannot_take_names_the_fix():
  qkv = jnp.zeros((B, T, 3, H, D), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"\[batch, tokens, 3, heads, head_dim\]"):
    ha.check_qkv(qkv[:, :, 0])
  per_image = tuple(jnp.zeros((B, T, D // 2)) for _ in range(2))
  with pytest.raises(ValueError, match="shared by every image.*causal_attention on rotated"):
    ha.check_qkv(qkv, None, per_image)
  with pytest.raises(ValueError, match=r"bias must be \[3, heads, head_dim\]"):
    ha.check_qkv(qkv, jnp.zeros((3 * H * D,)))
  assert ha.fits_qkv(qkv, jnp.zeros((3, H, D)), tuple(jnp.zeros((T, D // 2)) for _ in range(2)))
  assert not ha.fits_qkv(qkv[:3])      # 240 rows: not whole tiles


def _projected_inputs(key, b, t, heads, width):
  ks = jax.random.split(key, 5)
  x = jax.random.normal(ks[0], (b, t, width)).astype(jnp.bfloat16)
  kernel = (jax.random.normal(ks[1], (width, 3, heads, D)) * width ** -0.5).astype(jnp.bfloat16)
  bias = 0.3 * jax.random.normal(ks[2], (3, heads, D))
  do = jax.random.normal(ks[4], (b, t, heads, D)).astype(jnp.bfloat16)
  return x, kernel, bias, _rope_tables(ks[3], t, D), do


def _projected_reference(x, kernel, bias, rope):
  """float32: the product, its bias, RoPE on q and k, causal attention."""
  qkv = jnp.einsum("btw,wchd->btchd", x.astype(jnp.float32), kernel.astype(jnp.float32))
  return _reference_qkv(qkv, bias, rope)


def test_attention_from_the_blocks_input_matches_float32():
  """causal_attention_projected: the q/k/v product in our kernel with the
  bias and RoPE in its epilogue, then the attention kernels on that packed
  array; output and the gradients of x, the kernel and the bias against
  float32. 4 images of 96 tokens: 64-row attention tiles straddle images,
  and the projection's 128-row tiles take 3 different entries of its RoPE
  tables."""
  x, kernel, bias, rope, do = _projected_inputs(jax.random.key(8), 4, 96, H, 128)
  packed = ha.project_qkv(x, kernel, bias, rope, interpret=True)
  qkv = jnp.einsum("btw,wchd->btchd", x.astype(jnp.float32), kernel.astype(jnp.float32))
  want = ha._query_keys(qkv, bias, rope)
  assert packed.shape == (4 * 96, 3 * H, D) and packed.dtype == jnp.bfloat16
  # one rounding of the float32 result (relative 2^-9 per element)
  assert _rel(packed[:, :2 * H], want) < 3e-3
  assert _rel(packed[:, 2 * H:], (qkv[:, :, 2] + bias[2]).reshape(4 * 96, H, D)) < 3e-3

  out, vjp = jax.vjp(lambda *a: ha.causal_attention_projected(
      *a, rope, ha.DEFAULT_ATTENTION_TILING, True), x, kernel, bias)
  ref, ref_vjp = jax.vjp(lambda *a: _projected_reference(*a, rope), x, kernel, bias)
  assert out.shape == do.shape and out.dtype == jnp.bfloat16
  assert _rel(out, ref) < 4e-3
  grads, want_grads = vjp(do), ref_vjp(do.astype(jnp.float32))
  for got, want, dtype in zip(grads, want_grads, (jnp.bfloat16, jnp.bfloat16, jnp.float32)):
    assert got.shape == want.shape and got.dtype == dtype
    assert _rel(got, want) < 8e-3


@pytest.mark.parametrize("seg", [80, 96, 196, 256])
def test_projection_tables_give_every_tile_its_rows_positions(seg):
  """Tile e of the projection (``tile_m`` rows) reads entry e % P: row r of
  it must be position (tile_m e + r) % T; the last entry (v's columns) is
  the identity rotation."""
  tile_m = ha.PROJECTION_TILING.tile_m
  cos = jnp.arange(seg * 2, dtype=jnp.float32).reshape(seg, 2) / (2 * seg)
  ext_cos, ext_sin = ha.projection_tables(cos, -cos, seg, tile_m)
  period = ext_cos.shape[0] - 1
  assert period * tile_m % seg == 0 and ext_cos.shape == (period + 1, tile_m, 2)
  for e in range(3 * period):
    rows = (tile_m * e + np.arange(tile_m)) % seg
    np.testing.assert_array_equal(ext_cos[e % period], cos[rows])
    np.testing.assert_array_equal(ext_sin[e % period], -cos[rows])
  np.testing.assert_array_equal(ext_cos[period], 1.0)
  np.testing.assert_array_equal(ext_sin[period], 0.0)


def test_inputs_the_projected_attention_cannot_take_name_the_fix():
  x, kernel, bias, rope, _ = _projected_inputs(jax.random.key(9), 2, 64, H, 128)
  assert ha.fits_projected(x, kernel, bias, rope)
  cases = {
      "head_dim 64": (x, jnp.zeros((128, 3, 1, 128), jnp.bfloat16), jnp.zeros((3, 1, 128)),
                      tuple(jnp.zeros((64, 64)) for _ in range(2))),
      "shared by every image": (x, kernel, bias, tuple(r[None] for r in rope)),
      "bf16 x and kernel": (x.astype(jnp.float32), kernel, bias, rope),
      r"a bias \[3, heads, head_dim\]": (x, kernel, None, rope),
      "rows.*by tile_m=128": (x[:1, :48], kernel, bias, tuple(r[:48] for r in rope)),
  }
  for match, args in cases.items():
    with pytest.raises(ValueError, match=match + ".*causal_attention_qkv"):
      ha.check_projected(*args)
    assert not ha.fits_projected(*args)
  with pytest.raises(ValueError, match=r"\[batch, tokens, width\]"):
    ha.check_projected(x[0], kernel, bias, rope)


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


@pytest.mark.parametrize("seg", [64, 80, 100, 196, 256])
def test_tile_masks_are_the_block_diagonal_causal_mask(seg):
  """_mask for every streamed tile pair, as the kernels lay it out (keys on
  the rows for dK/dV), against the flat mask by brute force: same image and
  key <= query. Covers pairs whose tiles straddle two images."""
  images = 64 * 3 // np.gcd(seg, 64) if seg % 64 else 3
  rows = images * seg
  r = np.arange(rows)
  allowed = (r[None, :] <= r[:, None]) & (r[None, :] // seg == r[:, None] // seg)
  ops = ha._Ops(interpret=True)
  for i in range(rows // ha.BLOCK):
    lo, n = ha._q_span(i, seg)
    for c in range(lo, lo + n):
      want = allowed[i * ha.BLOCK:(i + 1) * ha.BLOCK, c * ha.BLOCK:(c + 1) * ha.BLOCK]
      got = ha._mask(jnp.int32(i * ha.BLOCK), jnp.int32(c * ha.BLOCK), seg, False, ops)
      np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{seg} {i} {c}")
      got_t = ha._mask(jnp.int32(i * ha.BLOCK), jnp.int32(c * ha.BLOCK), seg, True, ops)
      np.testing.assert_array_equal(np.asarray(got_t), want.T, err_msg=f"{seg} {i} {c} T")


def test_shapes_the_kernels_cannot_take_name_the_fix():
  q = jnp.zeros((3, 80, 2, 64), jnp.bfloat16)    # 240 rows: not whole tiles
  with pytest.raises(ValueError, match="batch x tokens = 240 .*kernels.attention='cudnn'"):
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

  packed = jax.ShapeDtypeStruct((32, tokens, 3, heads, s.shape[-1]), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((tokens, s.shape[-1] // 2), jnp.float32)
  bias = jax.ShapeDtypeStruct(packed.shape[2:], jnp.bfloat16)

  def packed_loss(qkv, bias, cos, sin):
    return jnp.sum(ha.causal_attention_qkv(qkv, bias, (cos, sin)).astype(jnp.float32))

  text = jax.jit(jax.grad(packed_loss, (0, 1))).trace(packed, bias, table, table).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 3
  # dK/dV are written into dQ's kernel output in place, not into a new array
  assert "output_operand_alias" in text
  # The bias gradient: the backward kernels' column sums (their ones-matrix
  # products, diagonal masks and copies lowered for sm_90) where the staged
  # pieces allow (head dim 64: B/16, L/16), else XLA's sum over the whole
  # float32 gradient (H/14: head dim 80, with RoPE).
  d = s.shape[-1]
  whole = "tensor<{}xf32>".format("x".join(map(str, packed.shape)))
  assert ha._sums_in_kernel(d, True) == (d == 64)
  assert (whole in text) != ha._sums_in_kernel(d, True)

  # and with a bias but no RoPE: the sums in the kernels at every model size
  def biased_loss(qkv, bias):
    return jnp.sum(ha.causal_attention_qkv(qkv, bias).astype(jnp.float32))

  text = jax.jit(jax.grad(biased_loss, (0, 1))).trace(packed, bias).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 3 and whole not in text

  # and from the block's input, the product in our kernel (head dim 64 only:
  # H/14 takes the packed path above on XLA's product)
  x = jax.ShapeDtypeStruct((32, tokens, variant.width), jnp.bfloat16)
  kernel = jax.ShapeDtypeStruct((variant.width,) + packed.shape[2:], jnp.bfloat16)
  assert ha.fits_projected(x, kernel, bias, (table, table)) == (d == 64)
  if d == 64:
    def projected_loss(x, kernel, bias, cos, sin):
      return jnp.sum(ha.causal_attention_projected(x, kernel, bias, (cos, sin))
                     .astype(jnp.float32))

    text = jax.jit(jax.grad(projected_loss, (0, 1, 2))).trace(
        x, kernel, bias, table, table).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 4 and whole not in text


def test_hopper_attention_is_the_same_attention(monkeypatch):
  """kernels.attention='hopper' in the attention module (ops.self_attention):
  same output and gradients as XLA's path (bf16), and non-causal attention,
  which the kernels do not do, takes the plain path."""
  x = jax.random.normal(jax.random.key(3), (2, 64, 128)).astype(jnp.bfloat16)

  shared = tuple(t[None] for t in _rope_tables(jax.random.key(6), 64, 64))
  per_image = tuple(jnp.broadcast_to(t, (2,) + t.shape[1:]) for t in shared)

  def run(choice, causal=True, rope=None):
    mod = attention.Attention(2, causal=causal, dtype=jnp.bfloat16)
    params = mod.init(jax.random.key(4), x)   # XLA's (the tests' default): no kernels run
    calls.clear()

    def f(p, x):
      y = mod.apply(p, x, rope).astype(jnp.float32)
      return jnp.sum(y * jnp.sin(y)), y
    with ops.using(attention=choice):
      (_, y), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(params, x)
    return y, g

  calls = []      # which kernel entry point the model's forward called
  for name in ("causal_attention", "causal_attention_qkv", "causal_attention_projected"):
    monkeypatch.setattr(ha, name, lambda *a, _f=getattr(ha, name), _n=name, **kw:
                        calls.append(_n) or _f(*a, **kw))
    per_shard._SHARED.clear()   # kernels traced before the patch are traced again
  # RoPE shared by the batch: the projection's product in our kernel, its
  # bias and RoPE in the epilogue; no RoPE: the packed path on XLA's
  # product; per-image RoPE: rotated in XLA, then the kernels
  for rope, path in ((None, "causal_attention_qkv"), (shared, "causal_attention_projected"),
                     (per_image, "causal_attention")):
    y_x, g_x = run("xla", rope=rope)
    assert not calls
    y_h, g_h = run("hopper", rope=rope)
    assert set(calls) == {path}, (calls, path)
    assert _rel(y_h, y_x) < 1e-2
    for a, b in zip(jax.tree.leaves(g_h), jax.tree.leaves(g_x)):
      assert _rel(a, b) < 3e-2
  np.testing.assert_array_equal(run("hopper", causal=False)[0], run("xla", causal=False)[0])
  assert not calls


def test_head_dim_80_takes_xlas_product_then_the_packed_kernels(monkeypatch):
  """ViT-H/14's head dim 80 is not one epilogue sub-tile: ops.self_attention
  projects with XLA's product and calls causal_attention_qkv (same
  parameters, same output as XLA's path)."""
  x = jax.random.normal(jax.random.key(0), (2, 64, 160)).astype(jnp.bfloat16)
  rope = tuple(t[None] for t in _rope_tables(jax.random.key(1), 64, 80))
  calls = []
  for name in ("causal_attention_qkv", "causal_attention_projected"):
    monkeypatch.setattr(ha, name, lambda *a, _f=getattr(ha, name), _n=name, **kw:
                        calls.append(_n) or _f(*a, **kw))
    per_shard._SHARED.clear()   # kernels traced before the patch are traced again
  mod = attention.Attention(2, dtype=jnp.bfloat16)
  params = mod.init(jax.random.key(2), x, rope)
  assert params["params"]["qkv"]["kernel"].shape == (160, 3, 2, 80)
  outs = {}
  for choice in ("hopper", "xla"):
    with ops.using(attention=choice):
      outs[choice] = mod.apply(params, x, rope)
  assert calls == ["causal_attention_qkv"]
  assert _rel(outs["hopper"], outs["xla"]) < 1e-2


def test_config_takes_kernels_attention_hopper():
  config = config_lib.imagenet_pretrain_config("L/16", "mse")
  config.kernels.attention = "hopper"
  config_lib.validate(config)
  assert ops.resolve(config.kernels, config.model.dtype).attention == "hopper"
  config.kernels.attention = "flash"
  with pytest.raises(config_lib.ConfigError, match="kernels.attention must be one of auto, xla, cudnn, "
                                                   "hopper, got 'flash'"):
    config_lib.validate(config)
  with pytest.raises(ValueError, match="valid: auto, xla, cudnn, hopper"):
    ops.resolve(config.kernels)


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


def test_kernel_options_on_other_devices_name_the_fix(monkeypatch):
  """kernels.attention / mlp = 'hopper' and kernels.norm = 'triton' on a TPU
  or a non-Hopper GPU: errors that name the setting to use instead."""
  from types import SimpleNamespace
  q = _qkv(jax.random.key(0))[0]
  x = jnp.zeros((2, 64, 128), jnp.bfloat16)
  kernel, bias = jnp.zeros((128, 3, 2, 64)), jnp.zeros((3, 2, 64))
  w1, b1, w2, b2 = jnp.zeros((128, 256)), jnp.zeros((256,)), jnp.zeros((256, 128)), jnp.zeros(128)
  self_attention = lambda: ops.self_attention(x, kernel, bias, None, causal=True,  # noqa: E731
                                              dtype=jnp.bfloat16)
  mlp = lambda: ops.mlp(x, w1, b1, w2, b2, dtype=jnp.bfloat16)  # noqa: E731
  tpu = SimpleNamespace(platform="tpu", device_kind="TPU v5p")
  monkeypatch.setattr(jax, "devices", lambda *a: [tpu])
  with ops.using(attention="hopper", mlp="hopper", norm="triton"):
    with pytest.raises(ValueError, match="not tpu; use kernels.attention='xla'"):
      ops.attention(q, q, q, causal=True)
    with pytest.raises(ValueError, match="not tpu; use kernels.attention='xla'"):
      self_attention()
    with pytest.raises(ValueError, match="kernels.mlp='hopper' is for NVIDIA Hopper GPUs, not "
                                         "tpu; use kernels.mlp='xla'"):
      mlp()
    with pytest.raises(ValueError, match="kernels.norm='triton' runs on NVIDIA GPUs, not tpu; "
                                         "use kernels.norm='xla'"):
      ops.layer_norm(x, w2[0], w2[0], dtype=jnp.bfloat16)
  blackwell = SimpleNamespace(platform="gpu", device_kind="NVIDIA B200", compute_capability="10.0")
  monkeypatch.setattr(jax, "devices", lambda *a: [blackwell])
  with ops.using(attention="hopper", mlp="hopper"):
    with pytest.raises(ValueError, match="needs a Hopper GPU .* NVIDIA B200; use "
                                         "kernels.attention='cudnn'"):
      ops.attention(q, q, q, causal=True)
    with pytest.raises(ValueError, match="needs a Hopper GPU .* NVIDIA B200; use "
                                         "kernels.attention='cudnn'"):
      self_attention()
    with pytest.raises(ValueError, match="kernels.mlp='hopper' needs a Hopper GPU .* NVIDIA "
                                         "B200; use kernels.mlp='xla'"):
      mlp()
  hopper = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100", compute_capability="9.0")
  monkeypatch.setattr(jax, "devices", lambda *a: [hopper])
  assert ops._hopper_attention_fits(q, q, q)
  assert ops._hopper_mlp_fits(x, 256, jnp.bfloat16)
