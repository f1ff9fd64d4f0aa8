"""The Hopper MLP kernels (darl_jax/kernels/hopper_mlp.py) on CPU: their
numbers in Pallas's GPU interpret mode, and their lowering for CUDA at the
model sizes (shared memory and layouts are checked there, no GPU needed)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from darl_jax import ops
from darl_jax.kernels import per_shard
from darl_jax.kernels import hopper_gemm
from darl_jax.kernels import hopper_mlp as hm
from darl_jax.models import layers, vit

# 64 x 128 CTA tiles: the test shapes below give each of the interpreter's two
# CTAs 8 tiles, so the persistent loop, the reuse of the output buffers and the
# two alternating aux buffers are all exercised.
SMALL = hm.Tiling(tile_m=64, tile_n=64, tile_k=64, stages=2)
M, K, N = 512, 128, 256


def _gelu_grad(x):
  """The model's GELU derivative (ops.gelu's custom gradient), elementwise."""
  return jax.grad(lambda v: jnp.sum(ops.gelu(v)))(x)


def _rand(key, shape, scale=1.0, dtype=jnp.float32):
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def test_kernel_gelu_is_the_exact_gelu():
  x = jnp.linspace(-12.0, 12.0, 100_001, dtype=jnp.float32)
  np.testing.assert_allclose(hm.kernel_gelu(x), ops.gelu(x), rtol=0, atol=2e-6)
  np.testing.assert_allclose(hm.kernel_gelu_grad(x), _gelu_grad(x), rtol=0, atol=2e-6)
  # Far in the negative tail the kernel form keeps a relative accuracy (no
  # 1 + erf cancellation), the approximation's own 1% there: Phi(-8) = 6.2e-16.
  tail = float(hm.kernel_gelu(jnp.float32(-8.0)))
  assert tail == pytest.approx(-8.0 * 0.5 * math.erfc(8.0 / math.sqrt(2.0)), rel=0.02, abs=0)


def test_dense_gelu_matches_xla():
  ks = jax.random.split(jax.random.key(0), 3)
  x = _rand(ks[0], (M, K), 1.0, jnp.bfloat16)
  w = _rand(ks[1], (K, N), K ** -0.5, jnp.bfloat16)
  b = _rand(ks[2], (N,), 0.5)
  g, dg = hm.dense_gelu(x, w, b, tiling=SMALL, interpret=True)
  assert g.shape == dg.shape == (M, N) and g.dtype == dg.dtype == jnp.bfloat16
  # The kernel takes the GELU of the float32 pre-activation (not rounded to
  # bf16 first, as the XLA MLP's fc1 output is).
  h = x.astype(jnp.float32) @ w.astype(jnp.float32) + b
  for got, want in ((g, ops.gelu(h)), (dg, _gelu_grad(h))):
    got, want = np.asarray(got, np.float32), np.asarray(want)
    # Every element compared, so an unwritten tile fails: one bf16 rounding
    # of the result (2^-9 relative), plus the summation order's and the
    # GELU approximation's few float32 ulps.
    np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=1e-5)


@pytest.mark.parametrize("tiling", [SMALL, hm.Tiling(tile_m=128, tile_n=128, tile_k=64, stages=2),
                                    hm.Tiling(tile_m=64, tile_n=64, tile_k=64, stages=2,
                                              ctas=3, ordered=True),
                                    hm.Tiling(tile_m=64, tile_n=64, tile_k=32, stages=3,
                                              inflight=2)],
                         ids=["one_row_of_subtiles", "two_rows_of_subtiles", "ordered",
                              "two_steps_in_flight"])
def test_matmul_scaled_matches_xla(tiling):
  ks = jax.random.split(jax.random.key(1), 3)
  dy = _rand(ks[0], (M, K), 1.0, jnp.bfloat16)
  wt = _rand(ks[1], (K, N), K ** -0.5, jnp.bfloat16)
  scale = _rand(ks[2], (M, N), 1.0, jnp.bfloat16)
  dh = hm.matmul_scaled(dy, wt, scale, tiling=tiling, interpret=True)
  ref = (dy.astype(jnp.float32) @ wt.astype(jnp.float32)) * scale.astype(jnp.float32)
  np.testing.assert_allclose(dh.astype(jnp.float32), ref, rtol=2 ** -7, atol=2e-3)
  # With the column sums (fc1's bias gradient): the same dh, and the float32
  # sum of its bf16 values over every row (each tile's rows counted once).
  dh2, sums = hm.matmul_scaled(dy, wt, scale, col_sums=True, tiling=tiling, interpret=True)
  np.testing.assert_array_equal(dh2, dh)
  assert sums.shape == (N,) and sums.dtype == jnp.float32
  np.testing.assert_allclose(sums, jnp.sum(dh.astype(jnp.float32), axis=0), rtol=1e-6, atol=1e-5)


def test_gemm_options_that_do_not_go_together_name_the_fix():
  x, w = jnp.zeros((128, 64), jnp.bfloat16), jnp.zeros((64, 128), jnp.bfloat16)
  same = lambda a, *_: (a,)  # noqa: E731
  with pytest.raises(ValueError, match="col_sums needs one output computed from aux"):
    hopper_gemm.gemm(x, w, epilogue=same, num_out=1, col_sums=True, tiling=SMALL,
                     interpret=True)
  with pytest.raises(ValueError, match="row_tables need table_entry"):
    hopper_gemm.gemm(x, w, epilogue=same, num_out=1, row_tables=(jnp.zeros((1, 64, 32)),),
                     tiling=SMALL, interpret=True)
  with pytest.raises(ValueError, match="out_pieces=3 must divide epi=64"):
    hopper_gemm.gemm(x, w, epilogue=same, num_out=1, out_pieces=3, tiling=SMALL,
                     interpret=True)


def test_gemm_row_tables_and_pieces():
  """Each tile's epilogue gets the rows of the table entry it asked for (by
  its row and column), and outputs returned as column pieces are stored side
  by side: here out = acc * t[0] + t[1] per half, with the entry chosen by
  both the tile's row and its column."""
  ks = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(ks[0], (256, 64)).astype(jnp.bfloat16)
  w = jax.random.normal(ks[1], (64, 128)).astype(jnp.bfloat16)
  scale, shift = (jax.random.normal(k, (4, 64, 32)) for k in jax.random.split(ks[2]))

  def entry(row, col):   # 64-row, 64-column tiles: (row // 64 + col // 64) % 4
    return (row // 64 + col // 64) % 4

  def epilogue(acc, _, __, a, b):
    half = acc.shape[1] // 2
    return ((acc[:, :half] * a + b, acc[:, half:] * a - b),)

  (out,) = hopper_gemm.gemm(x, w, epilogue=epilogue, num_out=1, row_tables=(scale, shift),
                            table_entry=entry, out_pieces=2, tiling=SMALL, interpret=True)
  acc = jnp.dot(x, w, preferred_element_type=jnp.float32)
  want = np.zeros((256, 128), np.float32)
  for i in range(4):
    for j in range(2):
      e = (i + j) % 4
      tile = acc[64 * i:64 * (i + 1), 64 * j:64 * (j + 1)]
      want[64 * i:64 * (i + 1), 64 * j:64 * j + 32] = tile[:, :32] * scale[e] + shift[e]
      want[64 * i:64 * (i + 1), 64 * j + 32:64 * (j + 1)] = tile[:, 32:] * scale[e] - shift[e]
  np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=1e-2, atol=1e-2)


def test_mlp_gradients_are_at_least_as_accurate_as_the_plain_bf16_mlp():
  """Against float32 arithmetic on the same bf16-rounded inputs, the kernel
  MLP's outputs and gradients are as close as the model's XLA MLP's in bf16 (its
  bias gradients closer: they are summed in float32)."""
  ks = jax.random.split(jax.random.key(2), 6)
  d, f = K, N
  x = _rand(ks[0], (4, M // 4, d), 1.0, jnp.bfloat16)
  params = {"fc1": {"kernel": _rand(ks[1], (d, f), d ** -0.5), "bias": _rand(ks[2], (f,), 0.1)},
            "fc2": {"kernel": _rand(ks[3], (f, d), f ** -0.5), "bias": _rand(ks[4], (d,), 0.1)}}
  dy = _rand(ks[5], x.shape)
  kernels = hm.MlpKernels(SMALL, SMALL)

  def mlp_plain(p, x):
    with ops.using(mlp="xla"):
      return layers.Mlp(f, jnp.bfloat16).apply({"params": p}, x)

  def mlp_kernels(p, x):
    return hm.mlp(x, p["fc1"]["kernel"], p["fc1"]["bias"], p["fc2"]["kernel"],
                  p["fc2"]["bias"], kernels, True)

  def mlp_f32(p, x):
    r = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    h = x.astype(jnp.float32) @ r(p["fc1"]["kernel"]) + r(p["fc1"]["bias"])
    return ops.gelu(h) @ r(p["fc2"]["kernel"]) + r(p["fc2"]["bias"])

  def rel(a, b):
    b = b.astype(jnp.float32)
    return float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))

  y_k, y_p, y_32 = (fn(params, x) for fn in (mlp_kernels, mlp_plain, mlp_f32))
  assert y_k.dtype == jnp.bfloat16
  assert rel(y_k, y_32) <= max(1.25 * rel(y_p, y_32), 5e-3)
  grad = lambda fn: jax.grad(  # noqa: E731
      lambda p, x: jnp.vdot(fn(p, x).astype(jnp.float32), dy), argnums=(0, 1))(params, x)
  g_k, g_p, g_32 = grad(mlp_kernels), grad(mlp_plain), grad(mlp_f32)

  errs_k = jax.tree.map(rel, g_k, g_32)
  errs_p = jax.tree.map(rel, g_p, g_32)
  assert jax.tree.structure(g_k) == jax.tree.structure(g_32)
  for (path, e_k), e_p in zip(jax.tree_util.tree_leaves_with_path(errs_k),
                              jax.tree.leaves(errs_p)):
    assert e_k <= max(1.25 * e_p, 5e-3), (jax.tree_util.keystr(path), e_k, e_p)
  assert jax.tree.map(lambda a: a.dtype, g_k) == jax.tree.map(lambda a: a.dtype, g_p)


def test_tiling_names_the_fix_for_shapes_it_cannot_divide():
  with pytest.raises(ValueError, match="rows 100 .* multiple of tile_m"):
    hm.Tiling().check(100, 4096, 1024)
  with pytest.raises(ValueError, match="columns 4000"):
    hm.Tiling().check(128, 4000, 1024)
  with pytest.raises(ValueError, match="inflight=4 products in flight with 4 slots"):
    hm.Tiling(inflight=4).check(128, 4096, 1024)
  with pytest.raises(ValueError, match="inflight=2 .* and 1 k-steps"):
    hm.Tiling(inflight=2).check(128, 4096, 64)


@pytest.mark.parametrize("model,ordered,inflight", [("L/16", False, 1), ("H/14", False, 1),
                                                    ("L/16", True, 2)])
def test_mlp_kernels_lower_for_hopper_at_model_sizes(model, ordered, inflight):
  """The training MLP's kernels fit a Hopper CTA's 227 KB of shared memory and
  have a layout for every operation (both are checked while lowering)."""
  variant, patch = vit.parse_variant(model)
  tokens = (224 // patch) ** 2
  s = jax.ShapeDtypeStruct
  args = (s((32, tokens, variant.width), jnp.bfloat16),     # 32 x 196 = 49 x 128 rows
          s((variant.width, variant.mlp_dim), jnp.float32), s((variant.mlp_dim,), jnp.float32),
          s((variant.mlp_dim, variant.width), jnp.float32), s((variant.width,), jnp.float32))
  tiling = hm.Tiling(ctas=132, ordered=ordered, inflight=inflight)
  kernels = hm.MlpKernels(tiling, tiling)

  def loss(*a):
    return jnp.sum(hm.mlp(*a, kernels, False).astype(jnp.float32))

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 2     # the forward and the backward kernel
  # The forward epilogue's rsqrt in its flush-to-zero form (hopper_mlp._rsqrt_ftz;
  # this fails if a jax version sends it down the public, non-ftz fallback).
  assert "rsqrt.approx.ftz.f32" in text and "rsqrt.approx.f32" not in text


def vit_inputs(batch: int, side: int):
  """ViT call arguments for ``batch`` images of a ``side x side`` patch grid
  (12-dim patches, raster order, the last patch dropped for the SOS token)."""
  n = side * side - 1
  rows, cols = jnp.divmod(jnp.arange(side * side), side)
  return (jax.random.normal(jax.random.key(0), (batch, n, 12)), rows[None, :n], cols[None, :n],
          jnp.arange(1, n + 1)[None], (side, side))


def perturbed(params, scale: float = 0.1):
  """``params`` plus Gaussian noise: biases and norms away from 0 and 1, so
  an implementation that loses one shows."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  return jax.tree.unflatten(tree, [p + scale * jax.random.normal(k, p.shape)
                                   for p, k in zip(leaves, keys)])


def _tiny_vit(dtype=jnp.bfloat16, depth=2):
  # 2 images x 64 tokens (SOS + 63 patches) = 128 rows; MLP 64 -> 256 -> 64.
  return vit.ViT(64, depth, 2, 256, reference_grid=(8, 8), dtype=dtype)


def test_vit_with_hopper_mlp_matches_the_xla_mlp(monkeypatch):
  """kernels.mlp='hopper' is the same model: the same parameter tree, and
  the features and parameter gradients agree to bf16 rounding. One block:
  the kernels' interpreter is the test's cost, and each block runs the same
  code (the gradient still flows from the MLP into the attention and
  embedding)."""
  args = vit_inputs(2, 8)
  model = _tiny_vit(depth=1)
  params = model.init(jax.random.key(1), *args)["params"]
  # eval_shape: the structure without running the (interpreted) kernels
  with ops.using(mlp="hopper"):
    assert (jax.tree.structure(jax.eval_shape(
        lambda: model.init(jax.random.key(1), *args)["params"]))
            == jax.tree.structure(params))
  params = perturbed(params)   # non-zero biases, so a lost bias shows

  def loss(mlp):
    def f(p):
      feats = model.apply({"params": p}, *args)["features"].astype(jnp.float32)
      return jnp.mean(feats * jnp.sin(feats)), feats
    with ops.using(mlp=mlp):
      return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

  calls = []
  monkeypatch.setattr(hm, "mlp", lambda *a, _f=hm.mlp: calls.append(1) or _f(*a))
  per_shard._SHARED.clear()   # kernels traced before the patch are traced again
  (_, f_x), g_x = loss("xla")
  assert not calls
  (_, f_h), g_h = loss("hopper")
  assert calls   # the kernels ran
  assert f_h.shape == (2, 64, 64)
  np.testing.assert_allclose(f_h, f_x, atol=0.1, rtol=0.05)
  assert float(jnp.linalg.norm(f_h - f_x) / jnp.linalg.norm(f_x)) < 1e-2
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_h), jax.tree.leaves(g_x)):
    err = float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-12))
    assert err < 5e-2, (jax.tree_util.keystr(path), err)


def test_hopper_mlp_errors_name_the_fix_and_untiled_shapes_fall_back(monkeypatch):
  with pytest.raises(ValueError, match="unknown kernels.mlp 'fast'; valid: auto, xla, hopper"):
    with ops.using(mlp="fast"):
      pass
  rows, cols = jnp.divmod(jnp.arange(64), 8)
  args = (jnp.zeros((2, 63, 12)), rows[None, :63], cols[None, :63], jnp.arange(1, 64)[None],
          (8, 8))
  with ops.using(mlp="hopper"), pytest.raises(
      ValueError, match="kernels.mlp='hopper' runs in bfloat16; set model.dtype='bfloat16' "
                        "or kernels.mlp='xla'"):
    _tiny_vit(jnp.float32).init(jax.random.key(0), *args)
  # 1 x 64 rows do not tile: the XLA MLP runs instead (parameter init on one
  # example, a partial last batch), with the same result.
  one = (jax.random.normal(jax.random.key(3), (1, 63, 12)),) + args[1:]
  params = _tiny_vit().init(jax.random.key(0), *one)["params"]
  want = _tiny_vit().apply({"params": params}, *one)["features"]
  monkeypatch.setattr(hm, "mlp", lambda *a: pytest.fail("the kernels ran on 64 rows"))
  per_shard._SHARED.clear()   # kernels traced before the patch are traced again
  with ops.using(mlp="hopper"):
    got = _tiny_vit().apply({"params": params}, *one)["features"]
  np.testing.assert_array_equal(got, want)


def test_mlp_kernel_bench_parses_tilings():
  import argparse
  import sys
  from pathlib import Path
  sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
  import mlp_kernel_bench
  assert mlp_kernel_bench.parse_tiling("64x256x32x6") == hm.Tiling(
      tile_m=64, tile_n=256, tile_k=32, stages=6)
  assert mlp_kernel_bench.parse_tiling("128x128x64x4x32").epi == 32
  assert mlp_kernel_bench.parse_tiling("128x128x64x4o") == hm.Tiling(ordered=True)
  assert mlp_kernel_bench.parse_tiling("128x128x64x5i2o") == hm.Tiling(
      stages=5, inflight=2, ordered=True)
  with pytest.raises(argparse.ArgumentTypeError, match="MxNxKxSTAGES"):
    mlp_kernel_bench.parse_tiling("128x128x64xo4")
  with pytest.raises(argparse.ArgumentTypeError, match="MxNxKxSTAGES"):
    mlp_kernel_bench.parse_tiling("128x128")


def test_kernel_trace_summary_counts_overlap_and_idle_time(tmp_path):
  """mlp_kernel_bench's reading of a kernel trace (hopper_gemm.gemm's
  trace_dir), on a hand-made one: in CTA 0 warpgroup 0 runs its main loop
  over [0, 100) and [220, 300), its epilogues over [100, 140) and [300, 320);
  warpgroup 1 its main loop over [100, 200) and its epilogue over [200, 250).
  Warpgroup 2 (the producer) records nothing."""
  import json
  import sys
  from pathlib import Path
  sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
  import mlp_kernel_bench

  events = []
  for tid, name, start, end in [(1, "mainloop", 0, 100), (1, "epilogue", 100, 140),
                                (2, "mainloop", 100, 200), (2, "epilogue", 200, 250),
                                (1, "mainloop", 220, 300), (1, "epilogue", 300, 320)]:
    events += [{"name": name, "ph": "B", "ts": start / 1e3, "pid": 1, "tid": tid},
               {"name": name, "ph": "E", "ts": end / 1e3, "pid": 1, "tid": tid}]
  trace = tmp_path / "trace.json"
  trace.write_text(json.dumps({"traceEvents": events}))
  summary = mlp_kernel_bench.overlap_summary(str(trace))
  # Epilogues under the other's main loop: 40/40, 0/20, 30/50 -> median 60%.
  # Main loops (median of 100, 80, 100) and epilogues (40, 20, 50).
  # No main loop in [200, 220) and [300, 320): 40 of 320 cycles.
  assert summary == ("1 CTAs; cycles per tile: main loop 100, epilogue 40; epilogue under "
                     "the other's main loop 60% (median); no main loop running 12.5% of "
                     "the time")


def test_hopper_mlp_without_fc2s_bias_plus_the_bias_is_the_mlp(monkeypatch):
  """``ops.mlp`` without fc2's bias (the fused stack's call: the
  bias is added in the next norm's kernel) runs ``hopper_mlp.mlp`` with
  ``b2=None``: product + bias is ``ops.mlp``'s output, and the gradients are
  the same (fc2's bias gradient to bf16 rounding: here it goes through a
  cast of the bias to bf16; in the model the norm kernel's float32 sum
  reaches it)."""
  x = jax.random.normal(jax.random.key(0), (2, 64, 64), jnp.bfloat16)
  params = perturbed(layers.Mlp(256, jnp.bfloat16).init(jax.random.key(1), x)["params"])
  readout = jax.random.normal(jax.random.key(2), x.shape)
  calls = []   # whether each call of the kernels got fc2's bias
  monkeypatch.setattr(hm, "mlp", lambda *a, _f=hm.mlp: calls.append(a[4] is not None) or _f(*a))
  per_shard._SHARED.clear()   # kernels traced before the patch are traced again

  def mlp(p, x, apart):
    w1, b1, w2, b2 = p["fc1"]["kernel"], p["fc1"]["bias"], p["fc2"]["kernel"], p["fc2"]["bias"]
    if apart:
      y = ops.mlp(x, w1, b1, w2, None, dtype=jnp.bfloat16)
      return y + b2.astype(y.dtype)   # as fused_stack._value adds it
    return ops.mlp(x, w1, b1, w2, b2, dtype=jnp.bfloat16)

  def loss(apart):
    def f(p, x):
      y = mlp(p, x, apart)
      return jnp.sum(y.astype(jnp.float32) * readout), y
    with ops.using(mlp="hopper"):
      return jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(params, x)

  (_, y_d), (g_d, dx_d) = loss(True)
  (_, y), (g, dx) = loss(False)
  assert calls == [False, True]   # the kernels ran both times, b2=None the first
  np.testing.assert_array_equal(y_d, y)
  np.testing.assert_array_equal(dx_d, dx)
  db2 = g_d["fc2"].pop("bias"), g["fc2"].pop("bias")
  jax.tree.map(np.testing.assert_array_equal, g_d, g)
  np.testing.assert_allclose(db2[0], db2[1], rtol=1e-2, atol=1e-2 * float(jnp.abs(db2[1]).max()))
