"""Frozen specs: the model, the hardware (GPU, links, cluster, mixed cluster) and the
training run, and the runtime profile (the engine). `costmodel.specs.loading` reads and validates them from YAML, JSON and
Hugging Face configs; `costmodel.specs.hf` checks a config against the model
transformers builds from it.
"""

from costmodel.specs.hardware import ClusterSpec, GPUSpec, HostOverheads, LinkSpec, MixedClusterSpec
from costmodel.specs.model import FAMILIES, ModelSpec
from costmodel.specs.runtime import DEFAULT_RUNTIME, RuntimeSpec
from costmodel.specs.training import OPTIMIZERS, PRECISIONS, TrainingSpec

__all__ = [
           "DEFAULT_RUNTIME",
           "FAMILIES",
           "OPTIMIZERS",
           "PRECISIONS",
           "ClusterSpec",
           "GPUSpec",
           "HostOverheads",
           "LinkSpec",
           "MixedClusterSpec",
           "ModelSpec",
           "RuntimeSpec",
           "TrainingSpec",
]
