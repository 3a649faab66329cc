"""The estimate of a transformer the specs describe on one kind of GPU: step time,
throughput, MFU/HFU and peak memory of a strategy, with breakdowns, from the terms of
`costmodel.terms`. Mixed clusters price each group with these functions
(`costmodel.estimate.mixed`). Per-layer unit costs (`unit_costs`) are shared with the planner's partition
solver, so the solver optimises exactly the figures reported here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from costmodel.estimate.breakdown import Estimate, MemoryBreakdown, Work, step_estimate
from costmodel.measured import profiled_layer
from costmodel.problem import Problem
from costmodel.strategy import RECOMPUTE_MODES, Stage, Strategy, ends_apart
from costmodel.terms import compute, memory
from costmodel.terms.comm import (
    collective_time_s,
    expert_exchange_s,
    fsdp_copies_s,
    groups,
    sharded_collective_s,
    tp_pairs,
)
from costmodel.terms.counts import (
    embedding_parameters,
    head_parameters,
    layer_forward_flops,
    layer_parameters,
    model_flops_per_step,
    mtp_projection_parameters,
)
from costmodel.terms.pipeline import FORWARD_SHARE, paired_share, pipeline_time_s


@dataclass(frozen=True)
class UnitCosts:
    """Costs that do not depend on the partition, for one micro-batch on one rank."""

    layer_work: dict[str, Work]            # forward + backward of one layer, by recompute mode
    layer_backward_s: float                # the DP overlap window: backward without recompute x comm_overlap
    layer_activation_bytes: dict[str, float]
    layer_working_bytes: float             # one layer's full activations, live while recomputing
    layer_dense_parameters: float          # per rank, after tp
    layer_expert_parameters: float         # per rank, after tp and ep
    first_work: Work                       # embedding, on virtual stage 0
    last_work: Work                        # final norm, LM head, loss, on the last virtual stage
    first_parameters: float
    last_parameters: float
    logits_bytes: float
    loss_peak_bytes: float                 # the head and loss's own peak (memory.loss_peak_bytes + final norm)
    p2p_s: float                           # one activation (or gradient) send between stages
    p2p_bytes: float
    tied_sync_s: float = 0.0               # all-reduce of the tied embedding's gradient, first and last stage
    # One layer's weight-gradient GEMMs, which zero-bubble schedules run in the bubble:
    # the forward GEMMs' size (backward is an input-gradient and a weight-gradient GEMM
    # per forward GEMM, Narayanan et al. 2021 §3.5).
    layer_weight_grad_s: float = 0.0
    layer_forward_s: float = 0.0           # one layer's forward pass: compute and its collectives
    # A model with dense-MLP layers among its mixture-of-experts ones (ModelSpec.layer_kinds):
    # those layers' own unit costs (only their layer fields are read), and how many of them
    # the first i layers hold (ModelSpec.dense_upto).
    dense: UnitCosts | None = None
    dense_upto: tuple[int, ...] = ()
    # Multi-token prediction modules on the last virtual stage: that many more plain
    # layers, and their projections and norms (per rank, dense).
    mtp_layers: int = 0
    mtp_parameters: float = 0.0

    @property
    def dense_layers(self) -> int:
        return self.dense_upto[-1] if self.dense_upto else 0

    @property
    def forward_share(self) -> float:
        """The forward share of a plain layer's time (costmodel.terms.pipeline's f)."""
        total = self.layer_work["none"].total_s
        return self.layer_forward_s / total if total > 0 else FORWARD_SHARE

    @property
    def weight_grad_share(self) -> float:
        """The weight-gradient share of a plain layer's time: the most of any rank's time
        (recompute, the embedding, the head and sends add time without weight gradients),
        so the partition solver's bubble from it is the least."""
        total = self.layer_work["none"].total_s
        return self.layer_weight_grad_s / total if total > 0 else 0.0


def unit_costs(problem: Problem, strategy: Strategy) -> UnitCosts:
    """The unit costs of `strategy` on `problem`; a model with dense first layers gets
    theirs beside (UnitCosts.dense)."""
    units = _unit_costs(problem, strategy)
    dense = problem.model.dense_layer()
    if dense is None:
        return units
    return replace(units, dense=_unit_costs(replace(problem, model=dense), strategy),
                   dense_upto=problem.model.dense_upto)


def _unit_costs(problem: Problem, strategy: Strategy) -> UnitCosts:
    model, cluster, training = problem.model, problem.cluster, problem.training
    b, tp, sp, ep, cp = strategy.micro_batch_size, strategy.tp, strategy.sequence_parallel, strategy.ep, strategy.cp
    where = groups(problem, strategy)
    runtime = problem.runtime

    def coll(kind: str, num_bytes: float, group) -> float:
        return collective_time_s(kind, num_bytes, group, cluster, runtime)

    value = compute.activation_bytes_per_value(training)
    states = memory.comm_state_bytes(training)
    # One activation of the rank's tokens: s / cp of each sequence under context parallelism.
    message = value * b * training.seq_len / cp * model.hidden_size

    etp = strategy.expert_tp
    layer = compute.layer_compute(model, cluster, training, b, tp, sp, ep, runtime, cp, etp)
    layer_backward = layer.backward_s
    # Measured times (costmodel.measured, `--profile`) replace the analytic layer where
    # the profile covers this micro-batch size and TP width (its layers ran whole
    # sequences: not under context parallelism).
    measured = (profiled_layer(problem.measured_times, model, cluster, training, b, tp, sp, ep)
                if problem.measured_times and cp == 1 else None)
    if measured is not None:
        layer, layer_backward = measured
    # Tensor parallelism per layer (Shoeybi et al. 2019 §3; Korthikanti et al. 2022 §4.2.2):
    # two all-reduces forward and two backward, or with sequence parallelism an all-gather
    # and a reduce-scatter in their place, each of the full b*s*h activation: one pair
    # around attention, one around the MLP (costmodel.terms.comm.tp_pairs says which an
    # MoE block has). A block's input is the residual stream's (`stream`: fp32 under
    # autocast), its output projection's the matmul's: forward gathers the input and
    # reduces the output (without sequence parallelism: all-reduces the output), backward
    # the reverse.
    stream = compute.residual_bytes_per_value(training) * b * training.seq_len / cp * model.hidden_size

    def tp_pair(in_bytes: float, out_bytes: float) -> tuple[float, float]:
        if sp:
            both = coll("all_gather", in_bytes, where["tp"]) + coll("reduce_scatter", out_bytes, where["tp"])
            return both, both
        return coll("all_reduce", out_bytes, where["tp"]), coll("all_reduce", in_bytes, where["tp"])

    pairs = tp_pairs(model, strategy)
    block_pairs = [(count, tp_pair(stream, message) if scale == 1.0 else tp_pair(message * scale, message * scale))
                   for scale, count in pairs]
    tp_one_way = sum(count * fwd for count, (fwd, _) in block_pairs)
    tp_back_way = sum(count * bwd for count, (_, bwd) in block_pairs)
    hide = cluster.comm_overlap   # the fraction of compute a collective can run behind
    # Async TP (micro-pipelined all-gather/reduce-scatter matmuls, PyTorch's
    # torch.distributed._symmetric_memory; Wang et al. 2023 "Overlap communication with
    # dependent computation via decomposition"): the runtime hides `async_tp_overlap` of
    # the forward TP collectives behind the GEMMs they feed.
    async_hide = runtime.async_tp_overlap * hide if runtime.async_tp else 0.0

    def async_exposed(comm_s: float) -> float:
        return max(comm_s * (1.0 - async_hide), comm_s - async_hide * layer.gemm_s)

    # DTensor's host time where the host is the device (HostOverheads, measured by the
    # profile on CPU ranks): a third in forward, as the launches below.
    host = cluster.gpu.host_overheads
    tp_host = host.tp_layer_time_s(message, sp) if host is not None and tp > 1 else 0.0
    tp_forward = async_exposed(tp_one_way) + tp_host / 3
    # Backward TP collectives overlap the weight-gradient GEMMs (Megatron-LM's
    # asynchronous tensor-parallel all-reduce / all-gather, Korthikanti et al. §4.2.2),
    # as far as the runtime's `tp_overlap` says.
    tp_backward = max(0.0, tp_back_way - runtime.tp_overlap * hide * layer.gemm_s) + 2 * tp_host / 3
    # Megatron-LM's sequence parallelism stores the sharded input of each linear block
    # and gathers it again in backward before the weight-gradient GEMM can start
    # (Korthikanti et al. §4.2.2): two more all-gathers, exposed (but for async TP).
    # PyTorch's keeps the gathered input (RuntimeSpec.sp_regathers_inputs) unless op-level
    # selective recompute drops it: its policy saves reduce-scatter outputs, not
    # all-gather ones (torchtitan's _save_list), so the recomputed forward gathers again.
    regather = (async_exposed(sum(count for scale, count in pairs if scale == 1.0)
                              * coll("all_gather", stream, where["tp"])) if sp else 0.0)
    if runtime.sp_regathers_inputs:
        tp_backward += regather
    # Context parallelism (Llama 3, Dubey et al. 2024 §3.3.2, the executor's attention):
    # K and V all-gathered over the cp ranks before attention, their gradients
    # reduce-scattered in backward, one collective each way of the whole sequence's K and
    # V of the rank's heads. Exposed: the attention waits for its keys, and backward's
    # reduce-scatter for it.
    cp_forward = cp_backward = 0.0
    if cp > 1:
        kv_bytes = value * b * training.seq_len * compute.cp_gathered_values_per_token(model, tp)
        cp_forward = coll("all_gather", kv_bytes, where["cp"])
        cp_backward = coll("reduce_scatter", kv_bytes, where["cp"])
    # MoE: dispatch and combine forward, the same two backward (costmodel.terms.comm
    # expert_exchange_s), of the rank's tokens (split over tp as sequence parallelism splits them).
    ep_one_way = (expert_exchange_s(model, message / tp, ep, where["ep"], cluster, runtime, value,
                                    training.fp8 is not None) if model.is_moe else 0.0)

    dense, experts = layer_parameters(model)
    dense_local, expert_local = dense / tp, experts / (etp * ep)
    # ZeRO-3 gathers each layer's weights forward and backward and reduce-scatters its
    # gradients, prefetched one layer ahead so only the excess over compute is exposed
    # (Zhao et al. 2023, PyTorch FSDP §3.3 prefetching), as far as the runtime's
    # `zero3_overlap` says.
    zero3_fwd = zero3_bwd = 0.0
    if strategy.zero_stage == 3:
        # Tensorwise FP8 gathers the converted linears' weights in fp8, 1 byte each
        # (FSDP2's float8 all-gather: torchao fsdp_utils, torchtitan's
        # enable_fsdp_float8_all_gather), the layer's other weights as they are held.
        fp8_weights = sum(k * n for k, n in compute.fp8_linears(model, tp)) if training.fp8 == "tensorwise" else 0.0
        gathered_bytes = (dense_local - fp8_weights) * states.weights + fp8_weights
        gather = (sharded_collective_s("all_gather", gathered_bytes, where["dp"], cluster, runtime)
                  + sharded_collective_s("all_gather", expert_local * states.weights, where["expert_dp"], cluster,
                                         runtime))
        scatter = (sharded_collective_s("reduce_scatter", dense_local * states.gradients, where["dp"], cluster,
                                        runtime)
                   + sharded_collective_s("reduce_scatter", expert_local * states.gradients, where["expert_dp"],
                                          cluster, runtime))
        zero3_hide = runtime.zero3_overlap * hide
        zero3_fwd = max(0.0, gather - zero3_hide * layer.forward_s)
        zero3_bwd = max(0.0, gather + scatter - zero3_hide * layer_backward)

    # The runtime's per-layer launch time, a third of it in forward (one forward kernel
    # for two in backward, as the GEMMs); measured layer times hold their own.
    launch = runtime.layer_launch_s if measured is None else 0.0
    # FP8 training casts each weight per micro-batch, or its shard per gather under ZeRO-3
    # with tensorwise scaling (FSDP2's float8 all-gather).
    fp8_gathered = strategy.zero_stage == 3 and training.fp8 == "tensorwise"
    weight_cast_fwd, weight_cast_bwd = compute.fp8_weight_cast_s(model, cluster, training, tp,
                                                                 strategy.dp_cp if fp8_gathered else 1, runtime, ep,
                                                                 etp)
    fwd_compute = layer.forward_s + launch / 3 + weight_cast_fwd
    bwd_compute = layer_backward + 2 * launch / 3 + weight_cast_bwd
    # A schedule that runs one micro-batch's forward beside another's backward hides the
    # expert exchange of each behind the other's computation where the runtime overlaps
    # them (RuntimeSpec.ep_overlap; DeepSeek-AI 2024 §3.2.1): in the paired share of the
    # chunks, the exchange beyond what the pair computes stays exposed.
    # While hidden, the exchange's kernels hold SMs the computation then runs without
    # (compute.COMM_SM_FRACTION): the pair takes that share of the hidden time longer.
    paired = paired_share(strategy.schedule, strategy.pp, strategy.num_microbatches) * runtime.ep_overlap * hide

    def ep_exposed(exchange_s: float, compute_s: float) -> float:
        return exchange_s - (1.0 - compute.COMM_SM_FRACTION) * paired * min(exchange_s, compute_s)

    ep_base = ep_exposed(2 * ep_one_way, fwd_compute + bwd_compute)
    base = Work(compute_s=fwd_compute + bwd_compute, tp_comm_s=tp_forward + tp_backward,
                ep_comm_s=ep_base, dp_comm_s=zero3_fwd + zero3_bwd, cp_comm_s=cp_forward + cp_backward)
    # The runtime's selective recompute (costmodel.terms.recompute): the attention core
    # (Korthikanti et al. §4.3), which FlashAttention already recomputes in its own
    # backward, leaving nothing to repeat (Dao et al. 2022 §3.1); or op-level, which
    # repeats every second matmul and all the elementwise ops, and the attention core
    # where SDPA's output is not kept (math attention).
    selective_regather = 0.0
    if runtime.selective_recompute == "op-level":
        selective_regather = 0.0 if runtime.sp_regathers_inputs else regather
        fraction = compute.op_level_gemm_fraction(model, cluster, training, b, tp, ep, cp)
        selective = fraction * layer.gemm_s + layer.elementwise_s + (0.0 if training.flash_attention
                                                                     else layer.attention_core_s)
    else:
        selective = 0.0 if training.flash_attention else layer.attention_core_s
    layer_work = {
        "none": base,
        "selective": (base + Work(recompute_s=selective, tp_comm_s=selective_regather)
                      if selective or selective_regather else base),
        # Full recompute repeats the forward's TP and EP collectives, but not ZeRO-3's
        # gather: the recomputed forward runs inside backward, on the weights already
        # gathered for it (FSDP2's pre-backward unshard; counted in the executor).
        "full": base + Work(recompute_s=fwd_compute, tp_comm_s=tp_forward,
                            ep_comm_s=ep_exposed(3 * ep_one_way, 2 * fwd_compute + bwd_compute) - ep_base,
                            cp_comm_s=cp_forward),  # launches too
    }
    # The runtime's chunked cross-entropy runs on whole-vocabulary logits; vocabulary-
    # parallel ones take the plain loss (executor.models.cross_entropy).
    chunked_loss = runtime.chunked_loss and tp == 1
    activation = {mode: memory.layer_activation_bytes(model, training, b, tp, sp, mode, runtime.selective_recompute,
                                                      ep, cp, strategy.fold,
                                                      keeps_gathered=not runtime.sp_regathers_inputs)
                  for mode in RECOMPUTE_MODES}

    # Embedding and LM head, both split over the vocabulary (Shoeybi et al. 2019 §3).
    # The embedding's output is all-reduced (with SP reduce-scattered forward and its
    # gradient all-gathered backward); the head's input gradient is all-reduced backward
    # (with SP its input all-gathered forward and the gradient reduce-scattered back).
    # Counted from the executor's collectives (tests/executor/test_collective_log.py).
    emb_fwd = compute.embedding_compute_s(model, cluster, training, b, runtime, cp)
    head_fwd = compute.head_compute_s(model, cluster, training, b, tp, runtime, cp)
    emb_bwd, head_bwd = compute.BACKWARD_FACTOR * emb_fwd, compute.BACKWARD_FACTOR * head_fwd
    emb_launch = head_launch = runtime.layer_launch_s
    if problem.measured_times is not None and cp == 1:
        emb_measured = problem.measured_times.times("embedding", b, tp)
        head_measured = problem.measured_times.times("head", b, tp)
        emb_fwd, emb_bwd = emb_measured or (emb_fwd, emb_bwd)
        head_fwd, head_bwd = head_measured or (head_fwd, head_bwd)
        emb_launch = 0.0 if emb_measured else emb_launch
        head_launch = 0.0 if head_measured else head_launch
    # The embedding's output and the head's input are the residual stream's.
    if sp:
        boundary = coll("reduce_scatter", stream, where["tp"]) + coll("all_gather", stream, where["tp"])
        emb_comm = head_comm = boundary
    else:
        emb_comm = head_comm = coll("all_reduce", stream, where["tp"])
    # Vocabulary-parallel cross-entropy all-reduces three fp32 values per token (the
    # max logit, the target's logit, the sum of exponentials; Megatron-LM
    # `_VocabParallelCrossEntropy`, PyTorch `loss_parallel`).
    head_comm += 3 * coll("all_reduce", cross_entropy_bytes(b, training.seq_len // cp), where["tp"])

    last_parameters = head_parameters(model)
    if model.tie_word_embeddings and strategy.pp > 1:
        # The last stage holds its own copy of the tied embedding (Megatron-LM).
        last_parameters += model.vocab_size * model.hidden_size
    first_local, last_local = embedding_parameters(model) / tp, last_parameters / tp

    def zero3_ends_s(local_parameters: float) -> float:
        # ZeRO-3 gathers the embedding (or head) weights forward and backward and
        # reduce-scatters their gradients like any layer's (FSDP §3.3), with no earlier
        # layer to hide behind: charged in full.
        if strategy.zero_stage != 3:
            return 0.0
        return (2 * sharded_collective_s("all_gather", local_parameters * states.weights, where["dp"], cluster, runtime)
                + sharded_collective_s("reduce_scatter", local_parameters * states.gradients, where["dp"], cluster,
                                       runtime))

    first_work = Work(compute_s=emb_fwd + emb_bwd + emb_launch, tp_comm_s=emb_comm,
                      dp_comm_s=zero3_ends_s(first_local))
    last_work = Work(compute_s=head_fwd + head_bwd + head_launch, tp_comm_s=head_comm,
                     dp_comm_s=zero3_ends_s(last_local))
    # Multi-token prediction (DeepSeek-V3 §2.2): each module projects the normed hidden
    # state and the next token's embedding (2h to h, replicated over tp as MLA's down
    # projections), runs one more layer (its layer is in `mtp_layers`) and the shared
    # head and loss again; its loss's logits are held as the main loss's.
    mtp = model.num_nextn_predict_layers
    mtp_parameters = 0.0
    if mtp:
        tokens = b * training.seq_len / cp
        projection_s = compute.gemm_time_s(tokens, model.hidden_size, 2 * model.hidden_size,
                                           cluster.gpu.peak_for(training.precision), device=cluster.gpu)
        last_work = last_work + Work(compute_s=head_fwd + head_bwd + head_launch
                                     + (1 + compute.BACKWARD_FACTOR) * projection_s,
                                     tp_comm_s=head_comm).scaled(mtp)
        mtp_parameters = mtp * mtp_projection_parameters(model)
    # With tp > 1 the activation is scattered over the tp ranks before the send and
    # gathered after (Narayanan et al. 2021 §4.1, scatter/gather optimisation).
    p2p_bytes = message / tp
    # The runtime hides `pp_overlap` of each send behind compute (batched isend/irecv).
    p2p_s = coll("p2p", p2p_bytes, where["pp"]) * (1.0 - runtime.pp_overlap * hide) if strategy.pp > 1 else 0.0
    tied_sync_s = 0.0
    if model.tie_word_embeddings and ends_apart(strategy):
        # Tied embeddings with the pipeline's ends on two ranks: the first and last stage
        # all-reduce the embedding's gradient (Megatron-LM); zbv's V sums them on rank 0.
        tied_sync_s = coll("all_reduce", model.vocab_size * model.hidden_size / tp * states.gradients,
                           where["pp_ends"])
    return UnitCosts(
        layer_work=layer_work,
        layer_backward_s=runtime.dp_overlap * hide * (bwd_compute + tp_backward),
        layer_activation_bytes=activation,
        layer_working_bytes=activation["none"],
        layer_dense_parameters=dense_local,
        layer_expert_parameters=expert_local,
        first_work=first_work,
        last_work=last_work,
        first_parameters=first_local,
        last_parameters=last_local,
        logits_bytes=(1 + mtp) * memory.logits_bytes(model, training, b, tp, chunked_loss, cp),
        loss_peak_bytes=(memory.loss_peak_bytes(model, training, b, tp, chunked_loss, cp)
                         + memory.final_norm_bytes(model, training, b, tp, sp, cp)),
        p2p_s=p2p_s,
        p2p_bytes=p2p_bytes,
        tied_sync_s=tied_sync_s,
        layer_weight_grad_s=layer.gemm_s,
        layer_forward_s=fwd_compute + tp_forward + ep_one_way + zero3_fwd + cp_forward,
        mtp_layers=mtp,
        mtp_parameters=mtp_parameters,
    )


def cross_entropy_bytes(micro_batch_size: int, seq_len: int) -> int:
    """One fp32 value per token of a micro-batch: each all-reduce of the vocabulary-parallel loss."""
    return 4 * micro_batch_size * seq_len


def stage_layers(units: UnitCosts, stage: Stage, last_index: int | None = None) -> list[tuple[UnitCosts, str, int]]:
    """The layers of `stage` as (unit costs of their kind, recompute mode, how many): the
    model's dense-MLP layers priced by `units.dense`, the rest by `units`; on the last
    virtual stage (`last_index`) the multi-token prediction modules' layers too, plain."""
    upto = units.dense_upto
    if not upto or upto[stage.first_layer + stage.num_layers] == upto[stage.first_layer]:
        # No dense-MLP layer here (the usual case, kept quick).
        out = [(units, mode, count) for mode, count in stage.counts_by_mode if count]
    else:
        out = []
        for mode, dense, rest in stage.layers_by_mode(upto):
            if dense:
                out.append((units.dense, mode, dense))
            if rest:
                out.append((units, mode, rest))
    if stage.index == last_index and units.mtp_layers:
        out.append((units, "none", units.mtp_layers))
    return out


def rank_layers(units: UnitCosts, strategy: Strategy, pp_rank: int) -> list[tuple[UnitCosts, str, int]]:
    """`stage_layers` of every stage rank `pp_rank` holds."""
    last_index = strategy.num_virtual_stages - 1
    return [entry for stage in strategy.rank_stages(pp_rank) for entry in stage_layers(units, stage, last_index)]


def stage_work(units: UnitCosts, stage: Stage, last_index: int | None = None) -> Work:
    work = Work()
    for kind, mode, count in stage_layers(units, stage, last_index):
        work = work + kind.layer_work[mode].scaled(count)
    return work


def backward_window_s(units: UnitCosts, strategy: Strategy, pp_rank: int) -> float:
    """The backward time of rank `pp_rank`'s layers behind which gradient sync can run
    (UnitCosts.layer_backward_s of each)."""
    return sum(count * kind.layer_backward_s for kind, _, count in rank_layers(units, strategy, pp_rank))


def p2p_sends(strategy: Strategy, pp_rank: int) -> int:
    """Sends per micro-batch on a rank: each virtual stage sends its output forward and
    its input gradient backward, except at the two ends of the pipeline."""
    if strategy.pp == 1:
        return 0
    return 2 * strategy.vpp - (pp_rank == 0) - (pp_rank == strategy.pp - 1)


def rank_work(units: UnitCosts, strategy: Strategy, pp_rank: int) -> Work:
    work = Work(pp_comm_s=p2p_sends(strategy, pp_rank) * units.p2p_s)
    last_index = strategy.num_virtual_stages - 1
    for stage in strategy.rank_stages(pp_rank):
        work = work + stage_work(units, stage, last_index)
        if stage.index == 0:
            work = work + units.first_work
        if stage.index == last_index:
            work = work + units.last_work
    return work


def rank_parameters(units: UnitCosts, strategy: Strategy, pp_rank: int) -> tuple[float, float]:
    """(dense, expert) parameters held by one rank of pipeline rank `pp_rank`."""
    dense = experts = 0.0
    last_index = strategy.num_virtual_stages - 1
    for stage in strategy.rank_stages(pp_rank):
        for kind, _, count in stage_layers(units, stage, last_index):
            dense += count * kind.layer_dense_parameters
            experts += count * kind.layer_expert_parameters
        if stage.index == 0:
            dense += units.first_parameters
        if stage.index == last_index:
            dense += units.last_parameters + units.mtp_parameters
    return dense, experts


@dataclass(frozen=True)
class FsdpUnits:
    """How FSDP2 (ZeRO-3 over more than one rank) holds one rank's units, in parameters:
    the largest unit that is gathered and freed around each use, the parameters kept
    gathered through the whole backward (a root unit) with the gradient they hold
    through it, and the parameters gathered at the loss."""

    largest_cycled: float
    held: float
    held_gradient: float
    at_loss: float


def fsdp_units(problem: Problem, units: UnitCosts, strategy: Strategy) -> FsdpUnits:
    """The units of `FsdpUnits` under the runtime's FSDP2 wrapping (RuntimeSpec.fsdp_kept_gathered)."""
    layer = max(u.layer_dense_parameters + u.layer_expert_parameters for u in (units, units.dense) if u is not None)
    first, last = units.first_parameters, units.last_parameters
    kept = problem.runtime.fsdp_kept_gathered if strategy.pp == 1 else "none"
    if kept == "root":
        # The root unit (embedding, final norm, head) is gathered from the first forward
        # to the end of backward, the head's gradient with it (FSDP2 reduces a unit's
        # gradients in its post-backward, after the embedding's backward here); the last
        # layer, kept too, is gathered at the loss.
        head_weight = first if problem.model.tie_word_embeddings else last
        return FsdpUnits(layer, first + last, head_weight, first + last + layer)
    if problem.model.tie_word_embeddings and strategy.tp == strategy.pp == 1:
        # A tied embedding and head (kept tied when tp = pp = 1) form the root unit
        # (executor.parallelize.apply_fsdp), gathered with its gradient from the head's
        # backward to the embedding's (FSDPMemTracker, bench/memory_tracker.py bf16
        # cases: one copy of the embedding at the peak).
        return FsdpUnits(max(layer, last), first, first, first)
    # The head's unit is resharded after its forward and gathered again after the loss's
    # backward (FSDPMemTracker, bench/memory_tracker.py bf16 cases: comm buffers 0 at the
    # peak, untied), unless kept: then it is gathered at the loss.
    return FsdpUnits(max(layer, first, last), 0.0, 0.0, last if kept == "head" else 0.0)


def fsdp_stream_pool_bytes(problem: Problem, units: UnitCosts, strategy: Strategy, pp_rank: int) -> float:
    """What the CUDA caching allocator reserves for FSDP2's own streams beyond the allocated
    peak of `rank_memory`: the caching allocator keeps one pool of blocks per stream, and
    FSDP2 allocates the reduce-scatter outputs, which stay as the sharded gradients'
    storage, on the reduce-scatter stream and the all-gather outputs on the copy-in
    stream (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce and
    foreach_all_gather). So the compute stream cannot reuse them, and
    torch.cuda.max_memory_reserved (what torchtitan logs as `memory`) counts every
    gradient and two gathered units (a unit in use and the one prefetched; a held root
    unit and a layer) on top of the compute stream's peak. Not needed to run (the
    allocator frees whole cached segments before it runs out); for comparing with
    reserved figures. 0 without ZeRO-3 over more than one rank."""
    if strategy.zero_stage != 3 or strategy.dp_cp == 1:
        return 0.0
    dense, experts = rank_parameters(units, strategy, pp_rank)
    gradients = (memory.sharded_state_bytes(dense, problem.training, 3, strategy.dp_cp)[1]
                 + memory.sharded_state_bytes(experts, problem.training, 3, strategy.edp)[1])
    fsdp = fsdp_units(problem, units, strategy)
    gathered = max(problem.runtime.fsdp_gathered_units * fsdp.largest_cycled, fsdp.held + fsdp.largest_cycled)
    return gradients + gathered * memory.compute_copy_bytes(problem.training)


def rank_memory(problem: Problem, units: UnitCosts, strategy: Strategy, pp_rank: int) -> MemoryBreakdown:
    """Memory of one rank at its peak, by kind."""
    training, model = problem.training, problem.model
    # ZeRO shards over every rank holding the same weights: dp x cp.
    dp, zero = strategy.dp_cp, strategy.zero_stage
    dense, experts = rank_parameters(units, strategy, pp_rank)
    stages = strategy.rank_stages(pp_rank)
    holds_head = any(s.index == strategy.num_virtual_stages - 1 for s in stages)
    if model.tie_word_embeddings and strategy.tp > 1 and strategy.pp == 1:
        # Under tp the executor gives the head its own copy of the tied embedding
        # (executor.models.Transformer.untie; measured: gpt3-6.7b tp8 parameters).
        dense += model.vocab_size * model.hidden_size / strategy.tp
    w1, g1, o1 = memory.sharded_state_bytes(dense, training, zero, dp)
    w2, g2, o2 = memory.sharded_state_bytes(experts, training, zero, strategy.edp)
    in_flight = memory.in_flight_microbatches(strategy.schedule, strategy.pp, pp_rank,
                                              strategy.num_microbatches, strategy.vpp)
    layers = rank_layers(units, strategy, pp_rank)
    all_activations = in_flight * sum(count * kind.layer_activation_bytes[mode] for kind, mode, count in layers)
    losses_held = memory.loss_microbatches_held(strategy.schedule, strategy.pp, strategy.num_microbatches)
    if holds_head and units.mtp_layers:
        # The multi-token prediction modules run beside the head on the last stage, from
        # its forward to its backward: held as the loss is, not as the rank's layers
        # (under a V the rank's first stage holds many more micro-batches than its last).
        all_activations -= (in_flight - losses_held) * units.mtp_layers * units.layer_activation_bytes["none"]
    activations = all_activations
    gradients = g1 + g2
    head_in_backward = holds_head
    if strategy.num_microbatches == 1:
        # One forward and backward per step: backward frees each layer's activations as
        # it makes the layer's gradients, so at the peak a layer holds the larger of the
        # two (FSDPMemTracker / MemTracker, bench/memory_tracker.py: the peak of
        # llama2-7b zero3 dp8 and tp8 comes early in backward, with the layers'
        # gradients not yet made). With micro-batches the gradients persist from the
        # first backward to the optimizer step beside the next micro-batch's activations.
        def layer_gradients(kind: UnitCosts) -> float:
            return (memory.sharded_state_bytes(kind.layer_dense_parameters, training, zero, dp)[1]
                    + memory.sharded_state_bytes(kind.layer_expert_parameters, training, zero, strategy.edp)[1])

        for kind, mode, count in layers:
            activation = kind.layer_activation_bytes[mode]
            if activation >= layer_gradients(kind):
                gradients -= count * layer_gradients(kind)
            else:
                activations -= in_flight * count * activation
        modes = {mode for _, mode, _ in layers}
        last_mode = next((m for m in ("none", "selective", "full") if m in modes), None)
        last_kind = next((kind for kind, mode, _ in reversed(layers) if mode == last_mode), units)
        if (zero == 3 and dp > 1 and sum(count for _, _, count in layers) > 1
                and last_kind.layer_activation_bytes[last_mode] >= layer_gradients(last_kind)):
            # FSDP2's peak comes at the end of a layer's backward, its unsharded
            # gradients whole and the previous layer's reduce-scatter input still held:
            # the logits and the last layer's activations are freed by then (measured:
            # llama2-7b zero3 dp8 peaks in layer 30 of 32 holding 30.9 layers).
            activations -= in_flight * last_kind.layer_activation_bytes[last_mode]
            head_in_backward = False
    if head_in_backward:
        activations += losses_held * units.logits_bytes
    rebuilds_selective = problem.runtime.selective_rebuilds_layer
    rebuilt = [kind.layer_working_bytes for kind, mode, _ in layers
               if mode == "full" or (mode == "selective" and rebuilds_selective)]
    if rebuilt:
        # A recomputed layer's activations are made whole again for its backward.
        activations += max(rebuilt)
    buffers = temporaries = loss_buffers = 0.0
    copy, reduce_bytes = memory.compute_copy_bytes(training), memory.held_state_bytes(training).gradients
    if zero == 3 and dp > 1:
        # FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py): the unsharded
        # weights of the unit in use, the all-gather outputs kept for it (forward,
        # all_gather_state) or of the units prefetched (RuntimeSpec.fsdp_gathered_units),
        # and the reduce-scatter input of the previous unit, kept until the next
        # reduce-scatter (reduce_scatter_state); the unit's unsharded gradients live until that
        # reduce-scatter. Gathered in the compute dtype under MixedPrecisionPolicy
        # (param_dtype), in fp32 under autocast; reduced in fp32 (reduce_dtype).
        # Measured: 3 x 772 MiB of buffers for llama2-7b zero3 dp8 in fp32
        # (bench/memory_tracker.py). A unit is a layer, or the embedding or head when larger;
        # a unit the engine keeps gathered is held beside them (fsdp_units).
        fsdp = fsdp_units(problem, units, strategy)
        gathered = problem.runtime.fsdp_gathered_units
        buffers += fsdp.largest_cycled * (gathered * copy + reduce_bytes) + fsdp.held * copy
        temporaries += (fsdp.largest_cycled + fsdp.held_gradient) * copy
        loss_buffers = fsdp.at_loss * copy
    elif dp > 1:
        buffers += 2 * problem.runtime.ddp_bucket_bytes
        loss_buffers = buffers
    if strategy.pp > 1:
        buffers += 2 * units.p2p_bytes
        loss_buffers += 2 * units.p2p_bytes
    reserve = float(memory.RUNTIME_RESERVE_BYTES)
    backward_peak = MemoryBreakdown(w1 + w2, gradients, o1 + o2, activations, buffers, reserve, temporaries)
    if not holds_head:
        return backward_peak
    # The loss's own peak (memory.loss_peak_bytes): every layer's activations of the
    # micro-batch at the loss are still held, and no gradient exists yet in a step of one
    # micro-batch (the optimizer sets them to None). Measured: the H200 run of
    # executor_runs.json ran out of memory there; FSDPMemTracker peaks there in bf16
    # for large vocabularies (bench/memory_tracker.py).
    loss_gradients = 0.0 if strategy.num_microbatches == 1 else g1 + g2
    loss_activations = all_activations + (losses_held - 1) * units.logits_bytes + units.loss_peak_bytes
    loss_peak = MemoryBreakdown(w1 + w2, loss_gradients, o1 + o2, loss_activations, loss_buffers, reserve,
                                0.0 if zero == 3 and dp > 1 else temporaries)
    return loss_peak if loss_peak.total_bytes > backward_peak.total_bytes else backward_peak


def tp_summed_gradients(problem: Problem, units: UnitCosts, strategy: Strategy,
                        pp_rank: int) -> tuple[tuple[float, int], ...]:
    """(values, all-reduces over tp per step) of the weights replicated over tp whose
    gradients each tp rank makes from its own share and the step sums, one all-reduce
    per weight (executor.step synchronize_gradients; Megatron-LM coalesces them into one):
    under sequence parallelism the norms, each rank normalising its sequence shard, and
    GPT's learned positions; per-head q/k norms, each rank holding its heads; with whole
    experts under tp (Strategy.fold) the router and shared-expert gate, each rank
    routing its sequence shard. Where ZeRO shards the rank's weights over dp x cp
    (FSDP2 over tp weights), each sums its dim-0 shard, padded to a whole share."""
    model, s = problem.model, strategy
    if s.tp == 1:
        return ()
    stages = s.rank_stages(pp_rank)
    layers = sum(st.num_layers for st in stages)
    h = model.hidden_size
    shard = s.dp_cp if s.zero_stage >= 1 and s.dp_cp > 1 else 1

    def local(rows: int, width: int = 1) -> float:
        return -(-rows // shard) * width

    out: list[tuple[float, int]] = []
    if s.sequence_parallel:
        tensors = 2 if model.norm == "layernorm" else 1   # weight (and bias)
        last = any(st.index == s.num_virtual_stages - 1 for st in stages)
        out.append((local(h), tensors * (model.norms_per_layer * layers + (1 if last else 0))))
        if model.position_embedding == "learned" and any(st.index == 0 for st in stages):
            out.append((local(model.max_position_embeddings, h), 1))
    if model.qk_norm:
        out.append((local(model.head_dim), 2 * layers))
    if model.is_moe and s.fold > 1:
        upto = units.dense_upto   # the dense-MLP layers among the first i (none: empty)
        sparse = layers - sum(upto[st.first_layer + st.num_layers] - upto[st.first_layer] for st in stages
                              if upto)
        out.append((local(model.num_local_experts, h + (1 if model.router_bias else 0)), sparse))
        if model.shared_expert_gate:
            out.append((local(1, h), sparse))
    return tuple((values, calls) for values, calls in out if calls)


def dp_sync_s(problem: Problem, units: UnitCosts, strategy: Strategy, pp_rank: int) -> float:
    """Gradient synchronisation at the end of the step on one rank, before overlap.

    ZeRO 0: all-reduce of the gradients (Li et al. 2020, PyTorch DDP §3.2); ZeRO 1/2:
    reduce-scatter of gradients, then all-gather of the updated weights (ZeRO §5.1-5.2,
    same volume as one all-reduce); ZeRO 3 reduces per layer during backward instead.
    Tied embeddings over pp > 1 add an all-reduce of the embedding gradient between the
    first and last stage (Megatron-LM).
    """
    cluster, states, runtime = problem.cluster, memory.comm_state_bytes(problem.training), problem.runtime
    where = groups(problem, strategy)
    dense, experts = rank_parameters(units, strategy, pp_rank)
    total = 0.0
    if strategy.zero_stage < 3:
        for params, group in ((dense, where["dp"]), (experts, where["expert_dp"])):
            if strategy.zero_stage == 0:
                total += collective_time_s("all_reduce", params * states.gradients, group, cluster, runtime)
            else:
                total += (collective_time_s("reduce_scatter", params * states.gradients, group, cluster, runtime)
                          + collective_time_s("all_gather", params * states.weights, group, cluster, runtime))
                if cluster.gpu.host_overheads is not None and group.size > 1 and (
                        strategy.zero_stage == 2 or strategy.tp > 1):
                    # Host overheads are measured on the executor's CPU ranks, whose
                    # ZeRO-2 (and ZeRO-1 over TP weights) is FSDP2: its copies, once a step
                    # (the rule of executor.parallelize.data_parallel_kind, which this
                    # layer cannot import).
                    total += (fsdp_copies_s("reduce_scatter", params * states.gradients, group.size, cluster)
                              + fsdp_copies_s("all_gather", params * states.weights, group.size, cluster))
    if pp_rank in (0, strategy.pp - 1):
        total += units.tied_sync_s
    for params, calls in tp_summed_gradients(problem, units, strategy, pp_rank):
        total += calls * collective_time_s("all_reduce", params * states.gradients, where["tp"], cluster, runtime)
    return total


def optimizer_step_s(problem: Problem, units: UnitCosts, strategy: Strategy, pp_rank: int) -> float:
    """The optimizer update is memory-bound: bytes moved per local parameter over HBM."""
    dense, experts = rank_parameters(units, strategy, pp_rank)
    if strategy.zero_stage >= 1:
        dense, experts = dense / strategy.dp_cp, experts / (strategy.edp)
    per_parameter = compute.OPTIMIZER_BYTES_PER_PARAMETER[problem.training.optimizer]
    return compute.memory_bound_time_s((dense + experts) * per_parameter, problem.cluster)


def recompute_flops(problem: Problem, strategy: Strategy) -> float:
    """Extra hardware FLOPs per step from recomputation (Korthikanti et al. eq. 8):
    full recompute repeats each layer's forward, selective the attention scores."""
    model, training = problem.model, problem.training
    sequences = training.global_batch
    dense_model, dense_upto = model.dense_layer() or model, model.dense_upto
    per_layer = (layer_forward_flops(dense_model, training.seq_len), layer_forward_flops(model, training.seq_len))
    full = sum(dense * per_layer[0] + rest * per_layer[1] for s in strategy.stages
               for mode, dense, rest in s.layers_by_mode(dense_upto) if mode == "full")
    selective = 0 if training.flash_attention else sum(s.selective_recompute_layers for s in strategy.stages)
    # Eq. 8 adds 72BLsh^2 * s/(6h) = 12 s^2 h per selectively recomputed layer and
    # sequence (its HFU convention: 22B HFU/MFU 43.7/41.5 in Table 5), three times the
    # 4 s^2 h of one extra forward of the attention core.
    scores = 12.0 * training.seq_len ** 2 * model.hidden_size
    return sequences * (full + selective * scores)


def pass_shares(strategy: Strategy, rank_costs: list[tuple[Problem, UnitCosts]],
                rank_times_s: list[float]) -> tuple[float, float]:
    """(w, f) of costmodel.terms.pipeline: the weight-gradient and forward shares of the
    pipeline's time, every rank's layers' weight-gradient GEMMs and forward passes over
    the sum of the rank times. The embedding's and the head's forward are left out;
    recomputation counts as backward, where the runtime runs it."""
    total = sum(rank_times_s)
    if total <= 0:
        return 0.0, FORWARD_SHARE
    layers = [rank_layers(u, strategy, r) for r, (_, u) in enumerate(rank_costs)]
    weight_s = sum(n * kind.layer_weight_grad_s for rank in layers for kind, _, n in rank)
    forward_s = sum(n * kind.layer_forward_s for rank in layers for kind, _, n in rank)
    return weight_s / total, forward_s / total


def estimate_uniform(problem: Problem, strategy: Strategy, units: UnitCosts | None = None) -> Estimate:
    """Predicted step of `strategy` on a transformer on one kind of GPU."""
    units = units or unit_costs(problem, strategy)
    return estimate_ranks(problem, strategy, [(problem, units)] * strategy.pp)


def estimate_ranks(problem: Problem, strategy: Strategy, rank_costs: list[tuple[Problem, UnitCosts]]) -> Estimate:
    """The estimate with each pipeline rank priced by its own (problem, unit costs): the
    same pair for every rank on one cluster, its group's on a mixed cluster."""
    pp, m = strategy.pp, strategy.num_microbatches
    works = [rank_work(u, strategy, r) for r, (_, u) in enumerate(rank_costs)]
    rank_times = [w.total_s for w in works]
    pipelined = pipeline_time_s(strategy.schedule, rank_times, m, strategy.vpp,
                                *pass_shares(strategy, rank_costs, rank_times))
    # Gradient sync overlaps the last micro-batch's backward on each rank (DDP bucketing,
    # Li et al. 2020 §3.2.3); the rest is exposed. The ZeRO-1/2 weight all-gather is
    # counted in the sync (it follows the optimizer step).
    dp_exposed = 0.0
    for r, (p, u) in enumerate(rank_costs):
        window = backward_window_s(u, strategy, r)
        dp_exposed = max(dp_exposed, max(0.0, dp_sync_s(p, u, strategy, r) - window))
    optimizer_s = max(optimizer_step_s(p, u, strategy, r) for r, (p, u) in enumerate(rank_costs))
    memories = [rank_memory(p, u, strategy, r) for r, (p, u) in enumerate(rank_costs)]
    model_flops = model_flops_per_step(problem.model, problem.training.global_batch, problem.training.seq_len)
    peaks = [p.cluster.gpu.peak_for(problem.training.precision) for p, _ in rank_costs]
    peak = peaks[0] if len(set(peaks)) == 1 else sum(peaks) / pp   # the mean device's, on a mixed cluster
    return step_estimate(problem, strategy, works, pipelined, dp_exposed, optimizer_s, memories,
                         model_flops, model_flops + recompute_flops(problem, strategy), peak,
                         fixed_s=problem.runtime.step_overhead_s)


