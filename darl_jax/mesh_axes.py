"""The names of the device mesh's axes.

A module of its own because two layers read them: the sharding rules
(sharding.py: the mesh, the batch's split) and the ops that run the Pallas
kernels per device on the batch's rows (ops.py -> kernels/per_shard.py).
sharding.py imports ops.py (it resolves the kernel choice for its warning),
so ops.py cannot take them from sharding.py without a circle.
"""

MESH_AXES = ("data", "fsdp", "tensor")
# The axes the batch is split over (sharding.batch_sharding; the kernels'
# per-device split).
BATCH_AXES = ("data", "fsdp")
