"""Shardwise cost model: specs, the layer graph, and the compute / communication /
memory / pipeline terms that `estimate()` combines into step time and peak memory.

The bottom layer of Shardwise: pure Python, no solver, no torch.distributed.
"""

from costmodel.estimate import Estimate, estimate
from costmodel.specs import ClusterSpec, GPUSpec, LinkSpec, ModelSpec, TrainingSpec
from costmodel.strategy import Stage, Strategy

__all__ = [
    "ClusterSpec",
    "Estimate",
    "GPUSpec",
    "LinkSpec",
    "ModelSpec",
    "Stage",
    "Strategy",
    "TrainingSpec",
    "estimate",
]
