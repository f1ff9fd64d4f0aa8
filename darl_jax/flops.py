"""Analytic model FLOPs (MaxText's convention) and MFU.

Convention: count the matmuls (2 FLOPs per multiply-add) and the two attention
products (Q K^T and A V); the attention products are halved under a causal
mask (half the logits are masked); elementwise work (norms, softmax, GELU,
RoPE) is not counted; a training step is 3x the forward pass (forward +
backward through activations and weights); recomputation from remat is not
counted. MFU = counted FLOPs per second / peak.

Per example, for a ViT of width D, depth L, MLP width F over T tokens:

    per layer:  qkv 2*T*D*3D + out 2*T*D*D + mlp 2*T*D*F*2     (matmuls)
                + attention 2 * 2*T*T*D  (x 1/2 if causal)
    embed:      2*T_in*P*D            (patch embedding, P = p*p*C)

DARL adds the patch decoder over N = T predicted patches:

    linear (MSE)            2*N*D*P
    linear (diffusion)      2*N*(D + P + g)*P               (g = 1 with gamma conditioning)
    mlp, depth d            2*N*(D*W + (P+g)*W + d*2*W*4W + W*P)
    transformer, depth d    2*N*(D*W + (P+g)*W) + (d-1) * layer(T=2, W, 4W, full) * N
                            + readout_layer(T=2, W, 4W) * N + 2*N*W*P

(the transformer decoder's last block computes the output of the token it
reads alone: ``readout_layer`` counts one query, the keys and values of
both tokens, and one token's output projection and MLP; the read-out mode of models/vit.Block)

times ``noise_samples`` for everything that follows the backbone.
"""

from __future__ import annotations

H100_BF16_PEAK = 989e12   # dense bf16 TFLOP/s of an H100/H200 SXM (datasheet)


def layer_flops(tokens: int, width: int, mlp_dim: int, *, causal: bool) -> float:
  """Forward FLOPs of one Transformer block over ``tokens`` tokens (one example)."""
  t, d, f = tokens, width, mlp_dim
  matmuls = 2 * t * d * 3 * d + 2 * t * d * d + 2 * 2 * t * d * f
  attention = 2 * (2 * t * t * d)
  if causal:
    attention /= 2
  return matmuls + attention


def readout_layer_flops(tokens: int, width: int, mlp_dim: int) -> float:
  """Forward FLOPs of one full-attention block that computes one token's
  output (vit.Block's read-out mode): every token's key and value, that token's
  query, its attention over ``tokens`` keys, output projection and MLP."""
  t, d, f = tokens, width, mlp_dim
  matmuls = 2 * d * d + 2 * t * d * 2 * d + 2 * d * d + 2 * 2 * d * f
  attention = 2 * (2 * t * d)
  return matmuls + attention


def backbone_forward_flops(backbone, tokens: int, patch_dim: int) -> float:
  """Forward FLOPs of the ViT backbone per example (``tokens`` includes SOS)."""
  layers = backbone.depth * layer_flops(tokens, backbone.width, backbone.mlp_dim,
                                        causal=backbone.causal)
  embed = 2 * (tokens - 1) * patch_dim * backbone.width
  return layers + embed


def decoder_forward_flops(decoder, num_patches: int, backbone_width: int,
                          diffusion: bool) -> float:
  """Forward FLOPs of the patch decoder for ``num_patches`` predictions."""
  n, d, p, w = num_patches, backbone_width, decoder.patch_dim, decoder.width
  noisy_in = (p + int(decoder.gamma_conditioning)) if diffusion else 0
  if decoder.kind == "linear" or decoder.depth == 0:
    return 2 * n * (d + noisy_in) * p
  embed = 2 * n * d * w + (2 * n * noisy_in * w if diffusion else 0)
  head = 2 * n * w * p
  if decoder.kind == "mlp":
    return embed + decoder.depth * 2 * n * 2 * w * w * decoder.mlp_ratio + head
  f = w * decoder.mlp_ratio
  per_pair = ((decoder.depth - 1) * layer_flops(2, w, f, causal=False)
              + readout_layer_flops(2, w, f))
  return embed + n * per_pair + head


def darl_train_flops(model, image_hw: tuple[int, int]) -> float:
  """Training FLOPs per example of a ``DARL`` module: 3 x forward."""
  p = model.patch_size
  n = (image_hw[0] // p) * (image_hw[1] // p)
  patch_dim = model.decoder.patch_dim
  backbone = backbone_forward_flops(model.backbone, n, patch_dim)  # SOS + N-1 patches
  diffusion = model.loss == "diffusion"
  k = model.noise_samples if diffusion else 1
  decoder = k * decoder_forward_flops(model.decoder, n, model.backbone.width, diffusion)
  return 3.0 * (backbone + decoder)


def classifier_train_flops(backbone, num_tokens: int, patch_dim: int,
                           num_classes: int) -> float:
  """Training FLOPs per example of a ViT classifier (``num_tokens`` includes any
  extra token such as SOS/CLS)."""
  return 3.0 * (backbone_forward_flops(backbone, num_tokens, patch_dim)
                + 2 * backbone.width * num_classes)


def mfu(flops_per_example: float, examples_per_sec: float,
        peak: float = H100_BF16_PEAK) -> float:
  return flops_per_example * examples_per_sec / peak
