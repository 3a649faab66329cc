"""Estimates for traced layer graphs (`costmodel.trace`): any nn.Module, planned over
data and pipeline parallelism, ZeRO stages, micro-batching and full recomputation of
nodes. Transformers the specs describe go through `costmodel.estimate.uniform` instead, whose
terms know their layers; here nothing is known of a node but what its trace measured.

A node is one block of the module (`trace.blocks`); a pipeline stage is a contiguous
run of nodes in the trace's execution order, which is a topological order of the
graph, so skip connections and encoder-decoder links only ever point forward. A stage
holds `Stage.first_layer .. + num_layers` counted in nodes, and recomputes its first
`full_recompute_layers` of them.

Per node and sample the trace gives forward and backward FLOPs, parameters, bytes
saved for backward and bytes handed on along each edge. From them:

- compute: as `costmodel.terms.compute` splits a transformer layer, the FLOPs of the ops
  FlopCounterMode has a formula for (matmuls, convolutions, attention) at the
  device's best GEMM efficiency, plus the bytes the other ops read and write
  (`elementwise_bytes`: norms, activations, softmax, copies) at achieved memory
  bandwidth; they run one after the other, so the times add. Backward is the traced
  backward FLOPs and BACKWARD_FACTOR times the forward bytes. The node's shapes are
  not kept, so small GEMMs are not slowed by the efficiency curve;
- pipeline sends: every edge crossing a stage boundary is sent forward and its
  gradient back, through each stage in between (torch.distributed.pipelining passes
  activations only to the next stage);
- data parallelism, ZeRO, optimizer, in-flight micro-batches and buffers: the same
  terms as `costmodel.estimate.uniform`, summed over the rank's nodes instead of its layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.estimate.breakdown import Estimate, MemoryBreakdown, Work, step_estimate
from costmodel.problem import TracedProblem
from costmodel.specs.runtime import DDP_BUCKET_MB
from costmodel.strategy import Stage, Strategy
from costmodel.terms import compute, memory
from costmodel.terms.comm import collective_time_s, groups, sharded_collective_s
from costmodel.terms.pipeline import pipeline_time_s
from costmodel.units import MIB


def _scale(problem: TracedProblem, samples: int) -> float:
    """Traced activation bytes to bytes of `samples` samples in the training precision."""
    model = problem.model
    return compute.activation_bytes_per_value(problem.training) / model.traced_value_bytes * samples / model.traced_batch


def _compute_s(problem: TracedProblem, flops: float, traffic_bytes: float) -> float:
    gpu = problem.cluster.gpu
    best = compute.GEMM_EFFICIENCY_MAX if gpu.gemm_efficiency_max is None else gpu.gemm_efficiency_max
    return (flops / (gpu.peak_for(problem.training.precision) * best)
            + compute.memory_bound_time_s(traffic_bytes, problem.cluster))


def _prefix(values) -> tuple[float, ...]:
    out, total = [0.0], 0.0
    for v in values:
        total += v
        out.append(total)
    return tuple(out)


@dataclass(frozen=True)
class TracedUnits:
    """Per-node costs of one micro-batch under a strategy without stages, as prefix sums
    (entry i covers nodes 0 .. i-1), so any stage's totals are two lookups: what
    `costmodel.estimate.uniform.UnitCosts` is for a transformer's identical layers."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    zero3_s: tuple[float, ...]          # exposed ZeRO-3 gathers and reduce-scatters
    saved_bytes: tuple[float, ...]      # per micro-batch, training precision
    input_bytes: tuple[float, ...]
    parameters: tuple[float, ...]
    node_saved_bytes: tuple[float, ...]  # per node, for the live set of a recomputation
    node_parameters: tuple[float, ...]
    cut_bytes: tuple[float, ...]        # per micro-batch, training precision
    p2p_s: tuple[float, ...]            # one send across each cut


def traced_units(problem: TracedProblem, strategy: Strategy) -> TracedUnits:
    cluster, b = problem.cluster, strategy.micro_batch_size
    states, where, hide = memory.comm_state_bytes(problem.training), groups(problem, strategy), cluster.comm_overlap
    scale, per_sample = _scale(problem, b), b / problem.model.traced_batch
    forward, backward, zero3 = [], [], []
    for node in problem.model.nodes:
        traffic = scale * node.elementwise_bytes
        fwd = _compute_s(problem, per_sample * node.forward_flops, traffic)
        bwd = _compute_s(problem, per_sample * node.backward_flops, compute.BACKWARD_FACTOR * traffic)
        exposed = 0.0
        if strategy.zero_stage == 3:
            # FSDP units are the nodes: gathered forward and backward, gradients
            # reduce-scattered, prefetched behind the node's own compute (FSDP §3.3).
            gather = sharded_collective_s("all_gather", node.parameters * states.weights, where["dp"], cluster)
            scatter = sharded_collective_s("reduce_scatter", node.parameters * states.gradients, where["dp"], cluster)
            exposed = max(0.0, gather - hide * fwd) + max(0.0, gather + scatter - hide * bwd)
        forward.append(fwd)
        backward.append(bwd)
        zero3.append(exposed)
    nodes = problem.model.nodes
    params = [float(n.parameters) for n in nodes]
    params[0] += problem.model.glue_parameters
    cuts = tuple(scale * c for c in problem.model.cut_bytes)
    p2p = tuple(collective_time_s("p2p", c, where["pp"], cluster) if strategy.pp > 1 else 0.0 for c in cuts)
    return TracedUnits(
        forward_s=_prefix(forward), backward_s=_prefix(backward), zero3_s=_prefix(zero3),
        saved_bytes=_prefix(scale * n.saved_bytes for n in nodes),
        input_bytes=_prefix(scale * n.input_bytes for n in nodes),
        parameters=_prefix(params), node_saved_bytes=tuple(scale * n.saved_bytes for n in nodes),
        node_parameters=tuple(params), cut_bytes=cuts, p2p_s=p2p,
    )


def _span(prefix: tuple[float, ...], first: int, end: int) -> float:
    return prefix[end] - prefix[first]


def _boundaries(units: TracedUnits, stage: Stage) -> list[int]:
    """The cuts a stage sends across: before its first node and after its last."""
    end = stage.first_layer + stage.num_layers
    return ([stage.first_layer - 1] if stage.first_layer > 0 else []) + \
        ([end - 1] if end - 1 < len(units.cut_bytes) else [])


def stage_work(units: TracedUnits, stage: Stage) -> Work:
    """Forward, backward, recompute, ZeRO-3 and pipeline sends of one stage, one
    micro-batch: its output goes forward and its input's gradient back."""
    first, end = stage.first_layer, stage.first_layer + stage.num_layers
    return Work(compute_s=_span(units.forward_s, first, end) + _span(units.backward_s, first, end),
                recompute_s=_span(units.forward_s, first, first + stage.full_recompute_layers),
                dp_comm_s=_span(units.zero3_s, first, end),
                pp_comm_s=sum(units.p2p_s[c] for c in _boundaries(units, stage)))


def stage_parameters(units: TracedUnits, stage: Stage) -> float:
    return _span(units.parameters, stage.first_layer, stage.first_layer + stage.num_layers)


def stage_memory(problem: TracedProblem, units: TracedUnits, strategy: Strategy, stage: Stage) -> MemoryBreakdown:
    training, dp, zero = problem.training, strategy.dp, strategy.zero_stage
    first, end = stage.first_layer, stage.first_layer + stage.num_layers
    split = first + stage.full_recompute_layers
    weights, gradients, optimizer = memory.sharded_state_bytes(stage_parameters(units, stage), training, zero, dp)
    in_flight = memory.in_flight_microbatches(strategy.schedule, strategy.pp, stage.pp_rank,
                                              strategy.num_microbatches)
    # A recomputed node keeps only its inputs; while it recomputes, its saved tensors
    # are live again (Chen et al. 2016, "Training deep nets with sublinear memory
    # cost", §3).
    kept = _span(units.input_bytes, first, split) + _span(units.saved_bytes, split, end)
    activations = in_flight * kept + max(units.node_saved_bytes[first:split], default=0.0)
    states = memory.comm_state_bytes(training)
    buffers = 0.0
    if zero == 3 and dp > 1:
        buffers += 2 * max(units.node_parameters[first:end], default=0.0) * states.weights
    elif dp > 1:
        # DDP at its default bucket size (a traced problem has no runtime profile).
        buffers += 2 * DDP_BUCKET_MB * MIB
    if strategy.pp > 1:
        buffers += 2 * max((units.cut_bytes[c] for c in _boundaries(units, stage)), default=0.0)
    return MemoryBreakdown(weights, gradients, optimizer, activations, buffers, float(memory.RUNTIME_RESERVE_BYTES))


def dp_sync_s(problem: TracedProblem, units: TracedUnits, strategy: Strategy, stage: Stage) -> float:
    """End-of-step gradient synchronisation of one stage, as `costmodel.estimate.uniform.dp_sync_s`:
    all-reduce under ZeRO 0, reduce-scatter then all-gather under ZeRO 1/2, none under
    ZeRO 3 (it reduces per node during backward)."""
    if strategy.zero_stage == 3:
        return 0.0
    states, group, cluster = memory.comm_state_bytes(problem.training), groups(problem, strategy)["dp"], problem.cluster
    params = stage_parameters(units, stage)
    if strategy.zero_stage == 0:
        return collective_time_s("all_reduce", params * states.gradients, group, cluster)
    return (collective_time_s("reduce_scatter", params * states.gradients, group, cluster)
            + collective_time_s("all_gather", params * states.weights, group, cluster))


def optimizer_step_s(problem: TracedProblem, units: TracedUnits, strategy: Strategy, stage: Stage) -> float:
    params = stage_parameters(units, stage) / (strategy.dp if strategy.zero_stage >= 1 else 1)
    return compute.memory_bound_time_s(params * compute.OPTIMIZER_BYTES_PER_PARAMETER[problem.training.optimizer],
                                       problem.cluster)


def exposed_dp_s(problem: TracedProblem, units: TracedUnits, strategy: Strategy, stage: Stage) -> float:
    """Gradient sync left after overlapping the last micro-batch's backward (DDP
    bucketing, Li et al. 2020 §3.2.3), where collectives run beside compute."""
    window = problem.cluster.comm_overlap * _span(units.backward_s, stage.first_layer,
                                                  stage.first_layer + stage.num_layers)
    return max(0.0, dp_sync_s(problem, units, strategy, stage) - window)


def estimate_traced(problem: TracedProblem, strategy: Strategy, units: TracedUnits | None = None) -> Estimate:
    """Predicted step of `strategy` (one stage per pipeline rank, tp 1) on a traced model."""
    if len(strategy.stages) != strategy.pp or strategy.tp != 1 or strategy.vpp != 1:
        raise ValueError("traced models plan one stage per pipeline rank, with tp 1")
    units = units or traced_units(problem, strategy)
    stages = sorted(strategy.stages, key=lambda s: s.pp_rank)
    m = strategy.num_microbatches
    works = [stage_work(units, s) for s in stages]
    rank_times = [w.total_s for w in works]
    pipelined = pipeline_time_s(strategy.schedule, rank_times, m)
    dp_exposed = max(exposed_dp_s(problem, units, strategy, s) for s in stages)
    optimizer_s = max(optimizer_step_s(problem, units, strategy, s) for s in stages)
    memories = [stage_memory(problem, units, strategy, s) for s in stages]
    nodes, samples = problem.model.nodes, problem.training.global_batch / problem.model.traced_batch
    model_flops = samples * sum(n.forward_flops + n.backward_flops for n in nodes)
    recomputed = sum(n.forward_flops for s in stages for n in nodes[s.first_layer:s.first_layer + s.full_recompute_layers])
    return step_estimate(problem, strategy, works, pipelined, dp_exposed, optimizer_s, memories,
                         model_flops, model_flops + samples * recomputed)
