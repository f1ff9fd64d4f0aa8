"""Reference numbers of the pretraining model, written by the code as it was
before the ops-layer redesign (commit c35dc77) and read by
tests/test_model_golden.py, which checks that today's code has the same
parameter trees and the same loss and gradients on the same batch.

Regenerate (only when a change of numbers is intended, and say so in the
commit): ``python tests/golden/model_golden.py``. Each case records the
parameter tree (path -> shape), the loss, and per parameter leaf the sum, the
L2 norm and a fixed random projection of its gradient; for the diffusion
cases also the noise levels and noise (and for random orderings the
permutation) that the model drew, so a new code path can be fed the same draws.
"""

import json
import os
import sys

import jax
import ml_collections
import numpy as np

PATH = os.path.join(os.path.dirname(__file__), "model_golden.json")

BASE = {
    "seed": 0,
    "model": dict(variant="mu/4", image_size=16, channels=1, posenc="rope2d",
                  rope_max_wavelength=100.0, causal=True, dtype="float32", drop_path=0.0,
                  scan_layers=False, remat="none", ordering="raster", ordering_block=2,
                  reference_image_size=0, two_stream=False),
    "decoder": dict(kind="linear", depth=1, width=32, num_heads=2, gamma_conditioning=False),
    "loss": dict(kind="mse", norm_pix=False, noise_a=1.0, noise_b=1.0, predict="x0",
                 noise_samples=1, gamma_bins=4),
}

# name -> overrides; every model variant whose parameter tree or numbers the
# redesign could change.
CASES = {
    "mse_linear": {},
    "mse_rope1d_norm_pix": {"model.posenc": "rope1d", "loss.norm_pix": True},
    "mse_learned_full_attention": {"model.posenc": "learned", "model.causal": False},
    "mse_sincos_mlp_decoder": {"model.posenc": "sincos2d", "decoder.kind": "mlp",
                               "decoder.depth": 2},
    "mse_scan_remat": {"model.scan_layers": True, "model.remat": "full"},
    "mse_two_stream_random": {"model.two_stream": True, "model.ordering": "random"},
    "diffusion_transformer": {"loss.kind": "diffusion", "decoder.kind": "transformer",
                              "decoder.depth": 2, "decoder.gamma_conditioning": True,
                              "loss.noise_samples": 2},
    "diffusion_mlp_eps": {"loss.kind": "diffusion", "decoder.kind": "mlp",
                          "decoder.depth": 2, "loss.predict": "eps"},
    "diffusion_linear": {"loss.kind": "diffusion", "decoder.kind": "linear"},
}


def config(name):
  c = ml_collections.ConfigDict(BASE)
  for k, v in CASES[name].items():
    section, key = k.split(".")
    c[section][key] = v
  return c


def images():
  return jax.random.uniform(jax.random.PRNGKey(0), (2, 16, 16, 1), minval=-1, maxval=1)


def leaf_stats(tree):
  """path -> [sum, l2, projection] of each leaf (the projection's weights
  are a fixed function of the leaf's size)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    a = np.asarray(leaf, np.float64).ravel()
    w = np.random.default_rng(a.size).standard_normal(a.size)
    out[jax.tree_util.keystr(path)] = [float(a.sum()), float(np.sqrt((a * a).sum())),
                                      float(a @ w)]
  return out


def tree_shapes(tree):
  return {jax.tree_util.keystr(p): list(np.shape(l))
          for p, l in jax.tree_util.tree_flatten_with_path(tree)[0]}


def init_params(model, x):
  rngs = {"params": jax.random.PRNGKey(0), "noise": jax.random.PRNGKey(1)}
  return model.init(rngs, x, train=False)["params"]


def main():
  """Runs the pre-redesign model eagerly, recording its noise draws."""
  from darl_jax import diffusion
  from darl_jax import patches as patches_lib
  from darl_jax.models import darl as darl_lib
  results = {}
  for name in CASES:
    model = darl_lib.darl_from_config(config(name))
    x = images()
    params = init_params(model, x)
    draws = {}
    corrupt, permutations = diffusion.corrupt, patches_lib.random_permutations

    def recording_corrupt(x0, gamma, noise):
      draws["gamma"], draws["eps"] = gamma, noise
      return corrupt(x0, gamma, noise)

    def recording_permutations(*a):
      draws["perm"] = permutations(*a)
      return draws["perm"]

    diffusion.corrupt, patches_lib.random_permutations = (recording_corrupt,
                                                          recording_permutations)
    try:
      def loss_fn(p):
        return model.apply({"params": p}, x, train=True,
                           rngs={"noise": jax.random.PRNGKey(3),
                                 "dropout": jax.random.PRNGKey(4)})[0]
      with jax.disable_jit():
        loss, grads = jax.value_and_grad(loss_fn)(params)
    finally:
      diffusion.corrupt, patches_lib.random_permutations = corrupt, permutations
    results[name] = {
        "params": tree_shapes(params),
        "loss": float(loss),
        "grads": leaf_stats(grads),
        "draws": {k: np.asarray(jax.lax.stop_gradient(v)).tolist() for k, v in draws.items()},
    }
    print(name, float(loss), file=sys.stderr)
  with open(PATH, "w") as f:
    json.dump(results, f, indent=0, sort_keys=True)


if __name__ == "__main__":
  main()
