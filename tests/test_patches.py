"""Tests for darl_jax/patches.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import patches as P


@pytest.mark.parametrize("b,h,w,c,p", [
    (2, 8, 8, 1, 4),
    (1, 12, 8, 3, 4),
    (3, 6, 9, 3, 3),
    (2, 4, 4, 1, 1),
    (1, 8, 8, 3, 8),
])
def test_unpatchify_inverts_patchify(b, h, w, c, p):
  x = np.random.default_rng(0).normal(size=(b, h, w, c)).astype(np.float32)
  y = P.patchify(x, p)
  assert y.shape == (b, (h // p) * (w // p), p * p * c)
  np.testing.assert_array_equal(P.unpatchify(y, p, (h // p, w // p), c), x)


def test_patchify_pixel_order_hand_example():
  # 4x4 image, 2 channels, pixel value encodes (row, col, channel) as 100r+10c+ch.
  r, col, ch = np.meshgrid(np.arange(4), np.arange(4), np.arange(2), indexing="ij")
  img = (100 * r + 10 * col + ch).astype(np.float32)[None]
  y = np.asarray(P.patchify(img, 2))
  assert y.shape == (1, 4, 8)
  # Patch 1 (raster) is the top-right 2x2 block: rows 0-1, cols 2-3.
  np.testing.assert_array_equal(y[0, 1], [20, 21, 30, 31, 120, 121, 130, 131])
  # Patch 2 is bottom-left: rows 2-3, cols 0-1.
  np.testing.assert_array_equal(y[0, 2], [200, 201, 210, 211, 300, 301, 310, 311])


def test_patchify_bad_inputs():
  with pytest.raises(ValueError, match="30x30 is not divisible by patch size 4; choose an image_size"):
    P.patchify(np.zeros((1, 30, 30, 3)), 4)
  with pytest.raises(ValueError, match=r"\[B, H, W, C\]"):
    P.patchify(np.zeros((30, 30, 3)), 3)
  with pytest.raises(ValueError, match="positive integer"):
    P.patchify(np.zeros((1, 8, 8, 3)), 0)
  with pytest.raises(ValueError, match="do not match grid"):
    P.unpatchify(np.zeros((1, 4, 12)), 2, (2, 2), 1)


@pytest.mark.parametrize("name,gh,gw,block", [
    ("raster", 4, 6, None),
    ("nested_raster", 4, 6, 2),
    ("round_robin", 4, 6, 2),
    ("nested_raster", 8, 8, 4),
    ("round_robin", 8, 8, 4),
    ("round_robin", 8, 8, 8),
    ("random", 5, 3, None),
])
def test_ordering_is_permutation_with_inverse_and_positions(name, gh, gw, block):
  o = P.make_ordering(name, gh, gw, block=block, seed=7)
  n = o.num_tokens
  assert n == gh * gw
  np.testing.assert_array_equal(np.sort(o.perm), np.arange(n))
  np.testing.assert_array_equal(o.inverse[o.perm], np.arange(n))
  np.testing.assert_array_equal(o.perm[o.inverse], np.arange(n))
  np.testing.assert_array_equal(o.rows * gw + o.cols, o.perm)
  for a in (o.perm, o.inverse, o.rows, o.cols):
    assert a.dtype == np.int32
  rows, cols = P.positions_of(o.perm, gw)
  np.testing.assert_array_equal(rows, o.rows)
  np.testing.assert_array_equal(cols, o.cols)


def test_fixed_orderings_hand_examples():
  np.testing.assert_array_equal(P.make_ordering("raster", 4, 4).perm, np.arange(16))
  np.testing.assert_array_equal(
      P.make_ordering("nested_raster", 4, 4, block=2).perm,
      [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15])
  rr = P.make_ordering("round_robin", 4, 4, block=2)
  np.testing.assert_array_equal(rr.perm, [0, 2, 8, 10, 1, 3, 9, 11, 4, 6, 12, 14, 5, 7, 13, 15])
  np.testing.assert_array_equal(rr.rows[:4], [0, 0, 2, 2])
  np.testing.assert_array_equal(rr.cols[:4], [0, 2, 0, 2])
  # Non-square grid, 2x2 blocks: 1x2 blocks, nested raster walks the left block first.
  np.testing.assert_array_equal(
      P.make_ordering("nested_raster", 2, 4, block=2).perm, [0, 1, 4, 5, 2, 3, 6, 7])
  np.testing.assert_array_equal(
      P.make_ordering("round_robin", 2, 4, block=2).perm, [0, 2, 1, 3, 4, 6, 5, 7])


def test_random_ordering_is_seeded():
  a = P.make_ordering("random", 4, 4, seed=1).perm
  np.testing.assert_array_equal(a, P.make_ordering("random", 4, 4, seed=1).perm)
  assert not np.array_equal(a, P.make_ordering("random", 4, 4, seed=2).perm)
  assert not np.array_equal(a, np.arange(16))


def test_make_ordering_bad_inputs():
  with pytest.raises(ValueError, match="unknown ordering 'spiral'.*nested_raster.*raster.*round_robin"):
    P.make_ordering("spiral", 4, 4)
  with pytest.raises(ValueError, match="not divisible by block 3"):
    P.make_ordering("nested_raster", 4, 4, block=3)
  with pytest.raises(ValueError, match="needs `block`"):
    P.make_ordering("round_robin", 4, 4)
  with pytest.raises(ValueError, match="not a permutation"):
    P.Ordering.from_perm([0, 0, 1, 2], grid_w=2)


def test_order_unorder_shared_perm():
  x = np.arange(2 * 16 * 3, dtype=np.float32).reshape(2, 16, 3)
  o = P.make_ordering("round_robin", 4, 4, block=2)
  y = P.order_tokens(x, o.perm)
  np.testing.assert_array_equal(y[:, 1], x[:, 2])  # token 1 is raster patch 2
  np.testing.assert_array_equal(y, o.order(x))
  np.testing.assert_array_equal(P.unorder_tokens(y, o.perm), x)
  np.testing.assert_array_equal(o.unorder(y), x)


def test_order_unorder_per_example_perm():
  x = np.random.default_rng(2).normal(size=(8, 16, 2, 3)).astype(np.float32)
  perm = P.random_permutations(jax.random.key(1), 8, 16)
  y = jax.jit(P.order_tokens)(x, perm)
  for i in range(8):
    np.testing.assert_array_equal(y[i], x[i][np.asarray(perm[i])])
  np.testing.assert_array_equal(jax.jit(P.unorder_tokens)(y, perm), x)
  inv = P.invert_permutation(perm)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(perm), np.asarray(inv), 1),
                                np.tile(np.arange(16), (8, 1)))


def test_random_permutations():
  perm = P.random_permutations(jax.random.key(3), 8, 16)
  assert perm.shape == (8, 16) and perm.dtype == jnp.int32
  perm = np.asarray(perm)
  for row in perm:
    np.testing.assert_array_equal(np.sort(row), np.arange(16))
  assert len({tuple(r) for r in perm}) == 8  # all different (collision odds ~1e-12)
  rows, cols = P.positions_of(perm, 4)
  assert rows.shape == (8, 16)
  np.testing.assert_array_equal(np.asarray(rows) * 4 + np.asarray(cols), perm)


def test_patchify_order_unpatchify_round_trip():
  x = np.random.default_rng(1).normal(size=(2, 8, 8, 3)).astype(np.float32)
  o = P.make_ordering("nested_raster", 4, 4, block=2)
  tokens = o.order(P.patchify(x, 2))
  np.testing.assert_array_equal(P.unpatchify(o.unorder(tokens), 2, (4, 4), 3), x)
