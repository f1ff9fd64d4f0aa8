"""The analytic FLOP count against hand counts."""

import pytest

from darl_jax import flops
from darl_jax.models import decoders, vit
from darl_jax.models import darl as darl_lib


def tiny(kind="linear", loss="mse", causal=True, depth=1, gamma=False, k=1):
  backbone = vit.ViT(width=4, depth=1, num_heads=1, mlp_dim=8, causal=causal)
  decoder = decoders.PatchDecoder(kind=kind, patch_dim=4, depth=depth, width=4,
                                  num_heads=1, gamma_conditioning=gamma)
  return darl_lib.DARL(backbone=backbone, decoder=decoder, patch_size=1, loss=loss,
                       noise_samples=k)


def test_causal_mse_step_by_hand():
  # Image 1x3 with patch 1 -> 3 patches of P = 4 values (patch_dim=4 declared by the
  # decoder), backbone input: SOS + 2 patches = 3 tokens, width 4, MLP 8.
  qkv = 2 * 3 * 4 * 12        # 288
  out = 2 * 3 * 4 * 4         # 96
  mlp = 2 * 2 * 3 * 4 * 8     # 384
  attn = 2 * 2 * 3 * 3 * 4 / 2  # 72, halved: causal
  embed = 2 * 2 * 4 * 4       # 64: two patches embedded
  decoder = 2 * 3 * 4 * 4     # 96: linear decoder on 3 outputs
  assert flops.darl_train_flops(tiny(), (1, 3)) == 3 * (qkv + out + mlp + attn + embed + decoder)


def test_full_attention_counts_all_logits():
  causal = flops.layer_flops(10, 8, 32, causal=True)
  full = flops.layer_flops(10, 8, 32, causal=False)
  assert full - causal == 2 * 2 * 10 * 10 * 8 / 2


@pytest.mark.parametrize("depth", [1, 3])
def test_transformer_decoder_by_hand(depth):
  model = tiny(kind="transformer", loss="diffusion", gamma=True, k=2, depth=depth)
  n, d, w, p = 3, 4, 4, 4
  embed = 2 * n * d * w + 2 * n * (p + 1) * w
  # both tokens: qkv, out, MLP (4w), 2x2 logits and the 2x2 weighted sums
  pair = 2 * 2 * w * 3 * w + 2 * 2 * w * w + 2 * 2 * 2 * w * 4 * w + 2 * 2 * 2 * 2 * w
  # the last block, the read-out token only: its q, both tokens' k and v,
  # its out and MLP, 1x2 logits and one weighted sum of 2 values
  readout = 2 * w * w + 2 * 2 * w * 2 * w + 2 * w * w + 2 * 2 * w * 4 * w + 2 * 2 * 1 * 2 * w
  head = 2 * n * w * p
  backbone = flops.backbone_forward_flops(model.backbone, 3, 4)
  expected = 3 * (backbone + 2 * (embed + n * ((depth - 1) * pair + readout) + head))
  assert flops.darl_train_flops(model, (1, 3)) == pytest.approx(expected)


def test_vit_l16_matches_the_usual_estimate():
  # ~ 6 * params * tokens for the matmuls; attention adds a few percent.
  backbone = vit.ViT(width=1024, depth=24, num_heads=16, mlp_dim=4096, causal=True)
  f = 3 * flops.backbone_forward_flops(backbone, 196, 768)
  approx = 6 * 303e6 * 196
  assert 1.0 < f / approx < 1.1


def test_mfu():
  assert flops.mfu(1e12, 989.0) == pytest.approx(1.0)
