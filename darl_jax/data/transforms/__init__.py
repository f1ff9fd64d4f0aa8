"""Host-side image transforms applied by the sources: the spatial crop and flip
(augment.py) and RandAugment (randaugment.py)."""
