"""The collectives one rank issues in a training step, as the cost model charges them:
kind, group, bytes per call (the convention of `costmodel.terms.comm.collective_time_s`)
and calls per step. `uniform.unit_costs` and `uniform.dp_sync_s` price exactly these; this listing
names them one by one so that a run can be checked against it (the executor's
`CommCounter`, tests/executor/test_collective_log.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.estimate.uniform import (
    cross_entropy_bytes,
    p2p_sends,
    rank_parameters,
    tp_summed_gradients,
    unit_costs,
)
from costmodel.problem import Problem
from costmodel.strategy import Strategy
from costmodel.terms import compute, memory
from costmodel.terms.comm import tp_pairs

# The global gradient norm for clipping: one fp64 scalar summed over every rank.
GRAD_NORM_BYTES = 8


@dataclass(frozen=True)
class Collective:
    kind: str     # all_reduce | all_gather | reduce_scatter | all_to_all | p2p
    group: str    # tp | cp | dp | ep | expert_dp | pp | pp_ends | world
    bytes: float  # per call
    calls: int    # per step
    what: str


def group_sizes(strategy: Strategy) -> dict[str, int]:
    s = strategy
    # "dp" reduces gradients over every rank holding the same weights: dp x cp.
    return {"tp": s.tp, "cp": s.cp, "dp": s.dp_cp, "ep": s.ep, "expert_dp": s.edp, "pp": s.pp,
            "pp_ends": 2 if s.pp > 1 else 1, "world": s.num_gpus}


def step_collectives(problem: Problem, strategy: Strategy, pp_rank: int) -> tuple[Collective, ...]:
    """Every collective rank `pp_rank` (any of its dp and tp ranks) issues in one step;
    groups of one rank are left out."""
    model, training, s = problem.model, problem.training, strategy
    units = unit_costs(problem, s)
    states = memory.comm_state_bytes(training)
    b, m = s.micro_batch_size, s.num_microbatches
    value = compute.activation_bytes_per_value(training)
    local_seq = training.seq_len // s.cp
    message = value * b * local_seq * model.hidden_size
    stream = compute.residual_bytes_per_value(training) * b * local_seq * model.hidden_size
    stages = s.rank_stages(pp_rank)
    layers = sum(st.num_layers for st in stages)
    full = sum(st.full_recompute_layers for st in stages)
    by_mode = [entry for st in stages for entry in st.layers_by_mode(model.dense_upto)]
    dense_layers = sum(dense for _, dense, _ in by_mode)
    dense_full = sum(dense for mode, dense, _ in by_mode if mode == "full")
    selective = sum(st.selective_recompute_layers for st in stages)
    dense_selective = sum(dense for mode, dense, _ in by_mode if mode == "selective")
    # Op-level selective recompute gathers a block's input again where the runtime kept
    # it (unit_costs: its policy saves no all-gather output).
    op_level = problem.runtime.selective_recompute == "op-level" and not problem.runtime.sp_regathers_inputs
    first = any(st.index == 0 for st in stages)
    last = any(st.index == s.num_virtual_stages - 1 for st in stages)
    # Calls by (kind, group, bytes, what): one line per collective, whichever kinds of
    # layer issue it.
    out: dict[tuple[str, str, float, str], int] = {}

    def add(kind, group, nbytes, calls, what):
        if calls and nbytes > 0 and group_sizes(s)[group] > 1:
            key = (kind, group, float(nbytes), what)
            out[key] = out.get(key, 0) + int(calls)

    kv_bytes = value * b * training.seq_len * compute.cp_gathered_values_per_token(model, s.tp)
    add("all_gather", "cp", kv_bytes, m * (layers + full), "context-parallel K and V")
    add("reduce_scatter", "cp", kv_bytes, m * layers, "context-parallel K and V gradients")
    # Each kind of layer (a model's dense-MLP layers among its expert ones: units.dense)
    # with its own weights: (its model, unit costs, layers, fully recomputed layers).
    kinds = [(model, units, layers - dense_layers, full - dense_full, selective - dense_selective)]
    if dense_layers:
        kinds.append((model.dense_layer(), units.dense, dense_layers, dense_full, dense_selective))
    for kind_model, kind, count, count_full, count_selective in kinds:
        # Per micro-batch, as unit_costs charges each layer: forward gathers a block's
        # input (the residual stream's bytes) and reduces its output, backward the
        # reverse; full recompute repeats the forward's; Megatron-LM's sequence
        # parallelism gathers a block's input again in backward.
        for scale, pairs in tp_pairs(kind_model, s):
            forward, backward = m * pairs * (count + count_full), m * pairs * count
            block_in, block_out = (stream, message) if scale == 1.0 else (message * scale, message * scale)
            if s.sequence_parallel:
                again = 0
                if scale == 1.0:
                    again = backward if problem.runtime.sp_regathers_inputs else m * pairs * count_selective * op_level
                add("all_gather", "tp", block_in, forward + again, "layer TP (SP)")
                add("reduce_scatter", "tp", block_out, forward, "layer TP (SP)")
                add("all_gather", "tp", block_out, backward, "layer TP (SP)")
                add("reduce_scatter", "tp", block_in, backward, "layer TP (SP)")
            else:
                add("all_reduce", "tp", block_out, forward, "layer TP")
                add("all_reduce", "tp", block_in, backward, "layer TP")
        if kind_model.is_moe:
            add("all_to_all", "ep", message * kind_model.busiest_rank_rows_per_token(s.ep) / s.tp,
                m * (2 * (count + count_full) + 2 * count), "MoE dispatch and combine")
        if s.zero_stage == 3:
            dense, experts = kind.layer_dense_parameters, kind.layer_expert_parameters
            # Tensorwise FP8 gathers the converted linears' weights at 1 byte (unit_costs).
            fp8_weights = (sum(k * n for k, n in compute.fp8_linears(kind_model, s.tp))
                           if training.fp8 == "tensorwise" else 0.0)
            add("all_gather", "dp", (dense - fp8_weights) * states.weights + fp8_weights, m * 2 * count,
                "ZeRO-3 layer weights")
            add("reduce_scatter", "dp", dense * states.gradients, m * count, "ZeRO-3 layer gradients")
            add("all_gather", "expert_dp", experts * states.weights, m * 2 * count, "ZeRO-3 expert weights")
            add("reduce_scatter", "expert_dp", experts * states.gradients, m * count, "ZeRO-3 expert gradients")
    for end, present, local in (("embedding", first, units.first_parameters), ("head", last, units.last_parameters)):
        if not present:
            continue
        if s.sequence_parallel:
            add("all_gather", "tp", stream, m, f"{end} TP (SP)")
            add("reduce_scatter", "tp", stream, m, f"{end} TP (SP)")
        else:
            add("all_reduce", "tp", stream, m, f"{end} TP")
        if s.zero_stage == 3:
            add("all_gather", "dp", local * states.weights, 2 * m, f"ZeRO-3 {end} weights")
            add("reduce_scatter", "dp", local * states.gradients, m, f"ZeRO-3 {end} gradients")
    if last:
        add("all_reduce", "tp", cross_entropy_bytes(b, local_seq), 3 * m, "vocab-parallel cross-entropy")
    add("p2p", "pp", units.p2p_bytes, m * p2p_sends(s, pp_rank), "pipeline activations and gradients")

    # Per step (dp_sync_s).
    dense, experts = rank_parameters(units, s, pp_rank)
    if s.zero_stage == 0:
        add("all_reduce", "dp", dense * states.gradients, 1, "DDP gradients")
        add("all_reduce", "expert_dp", experts * states.gradients, 1, "expert gradients")
    elif s.zero_stage in (1, 2):
        # The same volume as one all-reduce, issued per unit as FSDP2 does (each layer,
        # the embedding, the head); dp_sync_s prices the sum.
        units_of = [(units.layer_dense_parameters, layers, "layer")]
        units_of += [(units.first_parameters, 1, "embedding")] if first else []
        units_of += [(units.last_parameters, 1, "head")] if last else []
        for params, calls, what in units_of:
            add("reduce_scatter", "dp", params * states.gradients, calls, f"ZeRO {what} gradients")
            add("all_gather", "dp", params * states.weights, calls, f"ZeRO {what} updated weights")
    for params, calls in tp_summed_gradients(problem, units, s, pp_rank):
        add("all_reduce", "tp", params * states.gradients, calls, "replicated weights' gradients summed over tp")
    if model.tie_word_embeddings and s.pp > 1 and (first or last):
        add("all_reduce", "pp_ends", model.vocab_size * model.hidden_size / s.tp * states.gradients, 1,
            "tied embedding gradient")
    add("all_reduce", "world", GRAD_NORM_BYTES, 1, "gradient norm")
    return tuple(Collective(kind, group, nbytes, calls, what) for (kind, group, nbytes, what), calls in out.items())
