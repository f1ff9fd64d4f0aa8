"""darl_jax: Denoising Autoregressive Representation Learning in JAX/Flax."""

from setuptools import find_packages, setup

# Compatible ranges; constraints.txt pins the exact versions CI tested.
INSTALL_REQUIRES = [
    "jax>=0.10,<0.12",
    "flax>=0.12,<0.13",
    "optax>=0.2.6,<0.3",
    "orbax-checkpoint>=0.11.30,<0.13",
    "chex>=0.1.90",
    "ml-collections>=1.0",
    "clu>=0.0.12",
    "absl-py>=2.1",
    "numpy>=1.26",
    "scipy>=1.11",
    "pillow>=10",
    "matplotlib>=3.8",
    "etils[epath]>=1.7",
    "safetensors>=0.4",   # darl_jax.export writes numpy arrays, no torch needed
    "grain>=0.2.16",      # the input pipeline (darl_jax/data/pipeline.py)
]

EXTRAS = {
    # The TFDS / tf.data input path (ImageNet, VTAB). Host-side only; the GPU
    # and TPU code never needs TensorFlow.
    "tfds": ["tensorflow-cpu>=2.16,<2.22", "tensorflow-datasets>=4.9.6,<4.10",
             "tensorboard>=2.16", "importlib_resources>=6"],
    "test": ["pytest>=8", "pytest-xdist>=3.5", "scikit-learn>=1.3", "torch>=2.1"],
    # libtpu for compiling ahead of time for TPU topologies on any host
    # (python -m darl_jax.compile); on a TPU VM it is also the runtime.
    "tpu": ["libtpu==0.0.42.1"],
    "launch": ["xmanager==0.8.5.post1"],  # exact: xm_launch sets its Vertex machine types
    "hf": ["datasets==5.2.0"],  # data.name=hf_disk: datasets saved with save_to_disk
}

setup(
    name="darl_jax",
    version="0.1.0",
    description="DARL: Denoising Autoregressive Representation Learning (JAX/Flax)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["darl_jax", "darl_jax.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
