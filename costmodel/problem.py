"""What a strategy is judged against: a `Problem` (a transformer the specs describe on a
cluster, with optional measured layer times) or a `TracedProblem` (any nn.Module, as
`costmodel.trace` measured it)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from costmodel.measured import MeasuredTimes
from costmodel.specs import (
    ClusterSpec,
    MixedClusterSpec,
    ModelSpec,
    RuntimeSpec,
    TrainingSpec,
)
from costmodel.specs.loading import load_runtime

if TYPE_CHECKING:   # networkx is imported by who builds a graph: not on the planning path
    import networkx as nx


@dataclass(frozen=True)
class Problem:
    """Everything a strategy is judged against."""

    model: ModelSpec
    cluster: ClusterSpec | MixedClusterSpec
    training: TrainingSpec
    # Measured layer times (`shardwise plan --profile`); None prices every layer analytically.
    measured_times: MeasuredTimes | None = None
    # The engine that runs the plan (costmodel.specs.runtime); by default pytorch-native,
    # as Shardwise's executor and torchtitan run it.
    runtime: RuntimeSpec = field(default_factory=load_runtime)


@dataclass(frozen=True)
class NodeCost:
    """One traced block on the traced batch; bytes in the dtype the trace ran in.
    Whole counts, so a plan file holds them exactly."""

    name: str
    forward_flops: int
    backward_flops: int
    parameters: int
    saved_bytes: int
    output_bytes: int
    input_bytes: int          # what the earlier nodes and the model's inputs hand it
    elementwise_bytes: int    # read and written in forward by the ops without FLOPs



@dataclass(frozen=True)
class TracedModel:
    """A module's layer graph reduced to what planning needs, nodes in execution order,
    traced on `traced_batch` samples (FLOPs and activations are linear in the batch for
    the layers models are made of). `cut_bytes[i]` is what crosses a stage boundary
    after node i."""

    name: str
    nodes: tuple[NodeCost, ...]
    cut_bytes: tuple[int, ...]
    glue_parameters: int      # the root's own weights: held by the first stage
    traced_batch: int
    traced_value_bytes: int   # element size of the traced activations
    tokens_per_sample: int = 1

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def parameters(self) -> int:
        return self.glue_parameters + sum(n.parameters for n in self.nodes)



@dataclass(frozen=True)
class TracedProblem:
    """A traced model, a cluster and a training run; `training.seq_len` is the tokens
    per sample (1 for models that are not language models), so tokens/s is samples/s
    times it."""

    model: TracedModel
    cluster: ClusterSpec
    training: TrainingSpec



def traced_model(graph: nx.DiGraph, batch: int, tokens_per_sample: int = 1, value_bytes: int = 4) -> TracedModel:
    """The planning view of a graph traced on `batch` samples."""
    order = graph.graph["order"]
    from_inputs = graph.graph.get("input_bytes", {})
    nodes = []
    for name in order:
        data = graph.nodes[name]
        incoming = sum(graph.edges[u, name]["bytes"] for u in graph.predecessors(name)) + from_inputs.get(name, 0)
        nodes.append(NodeCost(name, int(data["forward_flops"]), int(data["backward_flops"]),
                              int(data["parameters"]), int(data["saved_bytes"]),
                              int(data.get("output_bytes", 0)), int(incoming), int(data["elementwise_bytes"])))
    cuts = [0] * max(len(order) - 1, 0)
    for first_cut, end_cut, num_bytes in graph.graph["flows"]:
        for cut in range(first_cut, end_cut):
            cuts[cut] += num_bytes
    return TracedModel(graph.graph.get("name", "module"), tuple(nodes), tuple(cuts),
                       int(graph.graph["glue_parameters"]), batch, value_bytes, tokens_per_sample)



def fingerprint(model: TracedModel) -> str:
    """sha256 of the traced model's canonical JSON."""
    text = json.dumps(asdict(model), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
