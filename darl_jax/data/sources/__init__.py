"""The data sources, one module per source (plus the shared readers they build on).

Each module is imported by name from the registry's table (data/registry.py) on first
use, so that only the TFDS sources import TensorFlow; this package imports nothing.
"""
