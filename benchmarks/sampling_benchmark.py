"""Sampling throughput of the paper's DARL sampling model on one accelerator.

    python benchmarks/sampling_benchmark.py --batch_sizes=1,64,256 --steps=100
    python benchmarks/sampling_benchmark.py --tiny --batch_sizes=1,2 --steps=2   # CPU smoke run

Model: experiments/vit_l8_64px_diff.py (ViT-L/8 at 64x64, 8-layer Transformer
denoising decoder of width 1024 conditioned on gamma, Beta(1, 1)) with random
weights (speed does not depend on them), bf16 compute by default. Each image
is completed from its top half (32 of 64 patches given) by the real sampler
(darl_jax/sampling.py: one jitted program, KV-cached backbone, ``--steps``
reverse diffusion steps per generated patch; the paper samples with T = 1000,
and the time is linear in T beyond the backbone's share).

Printed: for each batch size the compile time, the median seconds per batch
over ``--repeats`` timed runs, images/s, model TFLOP/s and MFU against
989 TFLOP/s (H100/H200 SXM dense bf16); then, at batch 1, the time per image
split into the backbone alone (prefill + 32 cached decoding steps, no decoder)
and the decoder alone (32 x T denoising passes on fixed backbone outputs).

FLOPs are analytic (the MaxText convention of darl_jax/flops.py: matmuls and
the two attention products at 2 FLOPs per multiply-add; norms, softmax, GELU
and RoPE not counted). A decoding step counts attention over the positions it
may see (causal), not the whole cache the kernel reads. Runs without
TensorFlow.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from darl_jax import flops  # noqa: E402
from darl_jax import patches as patches_lib  # noqa: E402
from darl_jax import sampling  # noqa: E402
from darl_jax.models import darl as darl_lib  # noqa: E402
from darl_jax.models import vit  # noqa: E402

PEAK_FLOPS = 989e12   # dense bf16 TFLOP/s of an H100/H200 SXM (datasheet)


# ------------------------------------------------------------------ FLOPs


def token_layer_flops(width: int, mlp_dim: int, keys: int) -> float:
  """One Transformer layer for one query token attending ``keys`` keys."""
  matmuls = 2 * width * 3 * width + 2 * width * width + 2 * 2 * width * mlp_dim
  return matmuls + 2 * 2 * keys * width


def backbone_flops(backbone, num_tokens: int, patch_dim: int) -> float:
  """Positions 0 .. num_tokens - 1 (SOS first), each seeing itself and earlier ones."""
  layers = sum(token_layer_flops(backbone.width, backbone.mlp_dim, j + 1)
               for j in range(num_tokens))
  return backbone.depth * layers + 2 * (num_tokens - 1) * patch_dim * backbone.width


def decoder_pass_flops(decoder, backbone_width: int, diffusion: bool) -> float:
  """One decoder pass for one patch (the training count of one prediction:
  the Transformer decoder's last block computes its read-out token only)."""
  return flops.decoder_forward_flops(decoder, 1, backbone_width, diffusion)


def image_flops(model, sampler, generated: int, steps: int) -> tuple[float, float]:
  """(backbone, decoder) FLOPs to complete one image."""
  patch_dim = model.decoder.patch_dim
  back = backbone_flops(model.backbone, sampler.num_patches + 1, patch_dim)
  diffusion = model.loss == "diffusion"
  passes = generated * (steps if diffusion else 1)
  return back, passes * decoder_pass_flops(model.decoder, model.backbone.width, diffusion)


# ------------------------------------------------------------------ setup


def build_model(tiny: bool, dtype: str):
  config = runpy.run_path(os.path.join(ROOT, "experiments", "vit_l8_64px_diff.py"))[
      "get_config"]()
  config.model.dtype = dtype
  if tiny:   # the same structure, small enough for a CPU
    config.model.update(variant="mu/8", image_size=32)
    config.decoder.update(depth=2, width=64, num_heads=2)
  model = darl_lib.darl_from_config(config)
  size = config.model.image_size
  rngs = {"params": jax.random.PRNGKey(0), "noise": jax.random.PRNGKey(1)}
  params = jax.jit(lambda: model.init(rngs, jnp.zeros((1, size, size, 3)),
                                      train=False))()["params"]
  return model, params, (size, size, 3)


def timed(fn, *args, repeats: int) -> tuple[float, float]:
  """(first call seconds, median of ``repeats`` further calls), synchronised."""
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return first, float(np.median(times))


def breakdown(model, params, sampler, images, known, repeats):
  """Batch-1 seconds of the backbone alone and of the decoder alone."""
  m = sampling.leading_known(known[sampler.ordering.perm][None])
  n = sampler.num_patches
  tokens = patches_lib.order_tokens(patches_lib.patchify(jnp.asarray(images), model.patch_size),
                                    sampler.ordering.perm)
  bparams = vit.unscan_params(params["backbone"], model.backbone.depth)

  @jax.jit
  def backbone_only(bparams, tokens):
    z, cache = sampler.prefill(bparams, tokens[:, :m])

    def body(carry, k):
      cache, z = carry
      z, cache = sampler.decode_step(bparams, cache, tokens[:, k], k)
      return (cache, z), None

    (_, z), _ = jax.lax.scan(body, (cache, z), jnp.arange(m, n))
    return z

  @jax.jit
  def decoder_only(dparams, z, key):
    def body(_, k):
      return None, sampler.sample_patch(dparams, z, jax.random.fold_in(key, k))

    return jax.lax.scan(body, None, jnp.arange(m, n))[1]

  z = jnp.zeros((1, model.backbone.width), model.backbone.dtype)
  _, t_back = timed(backbone_only, bparams, tokens, repeats=repeats)
  _, t_dec = timed(decoder_only, params["decoder"], z, jax.random.PRNGKey(0),
                   repeats=repeats)
  return t_back, t_dec, n - m


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch_sizes", default="1,64,256",
                      help="comma-separated numbers of images per sampling call")
  parser.add_argument("--steps", type=int, default=100, help="T, denoising steps per patch")
  parser.add_argument("--repeats", type=int, default=3, help="timed calls per batch size")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--tiny", action="store_true",
                      help="a mu/8 backbone at 32x32 with a small decoder (CPU smoke run)")
  args = parser.parse_args()
  batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

  model, params, image_shape = build_model(args.tiny, args.dtype)
  known = None
  rows = []
  for b in batch_sizes:
    sampler = sampling.Sampler(model, image_shape, num_steps=args.steps, num_samples=1)
    known = sampling.known_mask("top_half", sampler.grid_hw, sampler.ordering)
    generated = int((~known).sum())
    images = jax.random.uniform(jax.random.PRNGKey(b), (b, *image_shape), minval=-1, maxval=1)
    first, t = timed(sampler, params, images, known, jax.random.PRNGKey(0),
                     repeats=args.repeats)
    back, dec = image_flops(model, sampler, generated, args.steps)
    rows.append(dict(batch=b, compile=max(first - t, 0.0), seconds=t, img_s=b / t,
                     tflops=b * (back + dec) / t / 1e12, mfu=b * (back + dec) / t / PEAK_FLOPS))
    print(f"  batch {b}: {t:.3f} s per batch, {b / t:.2f} images/s", flush=True)

  bb = model.backbone
  print(f"\nDARL sampling: {'tiny (mu/8, 32x32)' if args.tiny else 'ViT-L/8 at 64x64'}, "
        f"backbone width {bb.width} depth {bb.depth}, {model.decoder.kind} decoder depth "
        f"{model.decoder.depth} width {model.decoder.width}, T = {args.steps}, "
        f"{args.dtype}, top half given ({generated} of {sampler.num_patches} patches "
        f"generated); jax {jax.__version__} on {jax.devices()[0].device_kind}")
  print(f"analytic FLOPs per image: backbone {back / 1e9:.4g} G, decoder {dec / 1e9:.4g} G "
        f"({dec / (generated * args.steps) / 1e6:.4g} M per pass), total "
        f"{(back + dec) / 1e12:.4g} T\n")
  print("| batch | compile s | s / batch | images/s | TFLOP/s | MFU |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['batch']} | {r['compile']:.1f} | {r['seconds']:.4g} | {r['img_s']:.4g} | "
          f"{r['tflops']:.3g} | {100 * r['mfu']:.3g}% |")

  one = jax.random.uniform(jax.random.PRNGKey(0), (1, *image_shape), minval=-1, maxval=1)
  t_back, t_dec, gen = breakdown(model, params, sampler, one, known, args.repeats)
  full = next((r["seconds"] for r in rows if r["batch"] == 1), None)
  print(f"\nbatch 1, seconds per image: backbone alone {t_back:.3f} "
        f"({gen} cached decoding steps after the prefill, {1e3 * t_back / gen:.2f} ms each), "
        f"decoder alone {t_dec:.3f} ({gen} x {args.steps} passes, "
        f"{1e3 * t_dec / (gen * args.steps):.3f} ms each)"
        + (f", full sampler {full:.3f}" if full is not None else ""))


if __name__ == "__main__":
  main()
