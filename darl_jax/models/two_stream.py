"""XLNet-style two-stream backbone for random-order pretraining.

Paper section "Random Ordering" and appendix "Two-Stream Architecture". With a
random patch order the plain causal model does not know *which* patch comes
next; the query stream tells it.

* Content stream: exactly the causal decoder-only ViT (same parameters, same
  names: ``patch_embed``, ``sos``, ``block_XX/...``, ``norm``) over
  ``[SOS, x_0 .. x_{N-2}]`` in the (possibly per-example) permuted order.
* Query stream: N learnable query tokens (one shared vector, ``query_token``)
  carrying, through 2D RoPE, the position of the patch to predict: query t
  sits where patch t of the order is. In every block the query stream gets an
  extra query projection (``attn/query_proj``) and attends to the content
  stream's keys and values of that block. Query t may see content positions
  0..t, i.e. SOS and x_0 .. x_{t-1}: in terms of patches this is the causal
  mask with its diagonal removed (content t+1 holds x_t itself), so the query
  for patch t never sees patch t's content. Keys, values, the output
  projection, the LayerNorms and the MLP are shared between the streams (the
  paper shares the feed-forward weights; sharing the rest follows XLNet).
  Queries attend to content only, not to earlier queries, as in XLNet.

The permuted sequence is fed directly and the attention masks stay the same
for every permutation (the appendix's choice); raster order is just the
identity permutation. Predictions come from the query stream.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from darl_jax.models import layers
from darl_jax.models import vit as vit_lib


class TwoStreamViT(vit_lib.ViT):
  """The backbone with a query stream. Same fields as ``ViT`` (causal only).

  Call like ``ViT`` with the content tokens (``prepend_sos=True``), plus the
  query positions ``query_rows``/``query_cols``/``query_index`` ``[B or 1,
  N]`` (the positions of the patches to predict). Returns ``features`` (the
  query stream after the final LayerNorm, ``[B, N, D]``), ``content`` (the
  content stream's, equal to the plain backbone's ``features``) and
  ``block_XX`` (content-stream block outputs).
  """

  @nn.compact
  def __call__(self, patches, rows, cols, index, grid_hw, *, query_rows=None,
               query_cols=None, query_index=None, prepend_sos: bool = True,
               train: bool = False):
    if not self.causal:
      raise ValueError("the two-stream model is causal by construction; set "
                       "model.causal=True (fine-tuning uses the plain backbone)")
    if self.scan_layers:
      raise ValueError("the two-stream model does not support model.scan_layers")
    h, rope_h = self.embed_tokens(patches, rows, cols, index, grid_hw, prepend_sos)
    b, n = h.shape[0], h.shape[1]
    query = self.param("query_token", nn.initializers.normal(0.02), (self.width,),
                       jnp.float32)
    g = jnp.broadcast_to(query.astype(h.dtype), (b, n, self.width))
    g = g + self.additive_positions(query_rows, query_cols, grid_hw, h.dtype)
    qr, qc, qi = self.scaled_positions(query_rows, query_cols, query_index, grid_hw)
    rope_g = self.rope_tables(qr, qc, qi)
    out = {}
    for i in range(self.depth):
      h, g = vit_lib.Block(**self._block_kwargs(i), name=f"block_{i:02d}").two_stream(
          h, g, rope_h, rope_g, not train)
      out[f"block_{i:02d}"] = h
    norm = layers.LayerNorm(self.dtype, name="norm")
    out["content"] = norm(h)
    out["features"] = norm(g)
    return out


def two_stream_from_vit(backbone: vit_lib.ViT) -> TwoStreamViT:
  fields = {f: getattr(backbone, f) for f in (
      "width", "depth", "num_heads", "mlp_dim", "posenc", "reference_grid",
      "rope_max_wavelength", "causal", "drop_path", "dtype", "scan_layers", "remat")}
  return TwoStreamViT(**fields)
