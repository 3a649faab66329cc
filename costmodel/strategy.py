"""The strategy: parallel degrees, micro-batching, schedule, ZeRO stage, recomputation
and the stage partition. A frozen value; the planner builds them, the cost model and
the executor read them.

Rank order is Megatron's: tp innermost, then cp, then dp (expert groups inside dp),
then pp outermost, so global rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-interleaved", "zbv", "dualpipev")
# Zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): backward
# split into input and weight gradients, the weight gradients filling the bubble.
# torch.distributed.pipelining's ScheduleInterleavedZeroBubble (ZB1P, vpp chunks per rank
# placed round-robin), ScheduleZBVZeroBubble (two chunks per rank in a V) and
# ScheduleDualPipeV (DeepSeek's DualPipe cut in half: the same V, a forward of one chunk
# paired with a backward of the other; DeepSeek-V3 report 2024 §3.2.1).
ZERO_BUBBLE_SCHEDULES = ("zb-interleaved", "zbv", "dualpipev")
# Two chunks per rank in a V (torch's "v" placement): rank r holds stages r and 2pp - 1 - r.
V_SCHEDULES = ("zbv", "dualpipev")
RECOMPUTE_MODES = ("none", "selective", "full")


def schedule_vpp_error(schedule: str, vpp: int, pp: int) -> str | None:
    """Why `schedule` cannot run `vpp` model chunks per rank on `pp` ranks (None if it
    can): interleaved needs two or more chunks, zbv and dualpipev exactly two, gpipe and
    1f1b one; each chunked schedule needs a pipeline."""
    if schedule == "interleaved" and vpp < 2:
        return "interleaved needs vpp of 2 or more"
    if schedule in V_SCHEDULES and vpp != 2:
        return f"{schedule} runs two model chunks per rank in a V: vpp 2, not {vpp}"
    if schedule in ("gpipe", "1f1b") and vpp > 1:
        return f"vpp {vpp} needs schedule interleaved, zb-interleaved, zbv or dualpipev, not {schedule}"
    if schedule in ("interleaved", *V_SCHEDULES) and pp < 2:
        return f"{schedule} needs pp of 2 or more"
    return None


def schedule_microbatch_error(schedule: str, pp: int, num_microbatches: int) -> str | None:
    """Why `schedule` cannot run `num_microbatches` micro-batches on `pp` ranks (None if
    it can). torch.distributed.pipelining's 1F1B-family schedules need one per stage;
    Megatron-LM's interleaved schedule whole rounds of pp; ScheduleInterleavedZeroBubble
    runs rounds of m // pp and refuses a count that is not a whole number of them;
    ScheduleDualPipeV needs one per virtual stage, 2 pp."""
    m = num_microbatches
    if pp == 1 or schedule == "gpipe":
        return None
    if schedule == "dualpipev" and m < 2 * pp:
        return f"dualpipev needs at least 2 x pp = {2 * pp} micro-batches, there are {m}"
    if m < pp:
        return f"{schedule} needs at least pp {pp} micro-batches, there are {m}"
    if schedule == "interleaved" and m % pp:
        return f"interleaved needs the {m} micro-batches to be a multiple of pp {pp}"
    rounds = m // pp
    if schedule == "zb-interleaved" and m % rounds:
        return f"zb-interleaved runs {rounds} rounds of micro-batches (m // pp), which do not divide the {m} micro-batches"
    return None


def schedule_zero_error(schedule: str, pp: int, dp: int, zero_stage: int) -> str | None:
    """Why `schedule` cannot run with this ZeRO stage (None if it can). Measured on CPU
    with torch 2.13 (tests/executor/test_step.py): under ZeRO-3, FSDP2 units that
    reshard after forward, torch.distributed.pipelining's zero-bubble schedules leave
    the last stage's weight gradients unreduced (None), and the step hangs."""
    if pp > 1 and dp > 1 and zero_stage == 3 and schedule in ZERO_BUBBLE_SCHEDULES:
        return (f"{schedule} with ZeRO-3 leaves the last stage's weight gradients unreduced in "
                f"torch.distributed.pipelining; plan ZeRO-2 or another schedule")
    return None


def context_parallel_error(cp: int, seq_len: int) -> str | None:
    """Why `cp` ranks cannot split sequences of `seq_len` tokens (None if they can): the
    load-balanced causal split cuts each sequence into 2 cp equal chunks."""
    if cp > 1 and seq_len % (2 * cp):
        return f"cp {cp} splits each sequence into 2 x cp = {2 * cp} equal chunks, which seq {seq_len} is not a multiple of"
    return None


def stage_rank(index: int, pp: int, schedule: str) -> int:
    """The pipeline rank of virtual stage `index`: round-robin (Megatron's interleaved
    layout, torch's "loop" style), or for zbv and dualpipev a V, rank r holding stages r
    and 2pp - 1 - r (torch.distributed.pipelining's "v" style), so the first and last
    stages share rank 0."""
    if schedule in V_SCHEDULES:
        return index if index < pp else 2 * pp - 1 - index
    return index % pp


@dataclass(frozen=True)
class Stage:
    """One virtual pipeline stage: layers [first_layer, first_layer + num_layers),
    held by pipeline rank `pp_rank`. Of its layers, the first `full_recompute_layers`
    recompute the whole layer and the next `selective_recompute_layers` recompute the
    attention core only."""

    index: int
    pp_rank: int
    first_layer: int
    num_layers: int
    full_recompute_layers: int = 0
    selective_recompute_layers: int = 0

    @property
    def last_layer(self) -> int:
        return self.first_layer + self.num_layers - 1

    @property
    def plain_layers(self) -> int:
        return self.num_layers - self.full_recompute_layers - self.selective_recompute_layers

    @property
    def counts_by_mode(self) -> tuple[tuple[str, int], ...]:
        """(recompute mode, layers) in layer order: full, selective, then plain."""
        return (("full", self.full_recompute_layers), ("selective", self.selective_recompute_layers),
                ("none", self.plain_layers))

    def layers_by_mode(self, dense_upto: tuple[int, ...] = ()) -> tuple[tuple[str, int, int], ...]:
        """(recompute mode, dense-MLP layers, other layers) of this stage, in layer order
        (`counts_by_mode`). `dense_upto[i]`: the model's dense-MLP layers among its first i
        (ModelSpec.dense_upto; empty: none)."""
        out, start = [], self.first_layer
        for mode, count in self.counts_by_mode:
            dense = dense_upto[start + count] - dense_upto[start] if dense_upto else 0
            out.append((mode, dense, count - dense))
            start += count
        return tuple(out)


@dataclass(frozen=True)
class Strategy:
    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int
    vpp: int = 1
    ep: int = 1
    # Context parallelism: the cp ranks of a data-parallel replica split each sequence
    # (2 cp load-balanced chunks, rank i holding chunks i and 2cp - 1 - i) and gather K
    # and V in each attention (Llama 3, Dubey et al. 2024 §3.3.2). They hold the same
    # weights, so gradients are reduced, and ZeRO shards, over dp x cp.
    cp: int = 1
    # Expert tensor parallelism: None, each expert's matrices split over the tp ranks as
    # the dense MLP's are (Megatron-LM's default, expert_tensor_parallel_size = tp); 1,
    # experts kept whole while attention takes tp (MoE parallel folding, Liu et al. 2025,
    # Megatron-Core; torchtitan's etp 1): each tp rank routes its sequence-parallel share
    # of the tokens, and the ep group takes ranks from tp, cp and dp alike. Set only
    # where tp > 1 (at tp 1 the two are the same).
    etp: int | None = None
    schedule: str = "1f1b"
    zero_stage: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    stages: tuple[Stage, ...] = ()
    # On a mixed cluster (costmodel.estimate.mixed), at most one of these is set. stage_groups:
    # the group holding each pipeline rank (all its dp x tp ranks). replica_groups (pp
    # 1 only): the group holding each data-parallel replica, and replica_microbatches
    # the micro-batches each replica runs per step, so faster replicas take a larger
    # share of the global batch (mbs x sum(replica_microbatches) sequences).
    stage_groups: tuple[str, ...] = ()
    replica_groups: tuple[str, ...] = ()
    replica_microbatches: tuple[int, ...] = ()

    @property
    def is_mixed(self) -> bool:
        return bool(self.stage_groups or self.replica_groups)

    def replica_share(self, dp_rank: int) -> tuple[int, int]:
        """(first micro-batch, micro-batches) of data-parallel replica `dp_rank` in the
        global batch's micro-batches."""
        if not self.replica_microbatches:
            return dp_rank * self.num_microbatches, self.num_microbatches
        counts = self.replica_microbatches
        return sum(counts[:dp_rank]), counts[dp_rank]

    @property
    def num_gpus(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same weights: the gradient-reduction and ZeRO group."""
        return self.dp * self.cp

    @property
    def expert_tp(self) -> int:
        """Ranks each expert's matrices are split over: tp, or 1 under MoE parallel folding."""
        return self.tp if self.etp is None else self.etp

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (expert data parallelism): of the dp x cp x tp
        ranks of a pipeline stage, those not splitting the experts over ep or etp. With
        the experts split over tp it is dp x cp / ep, the old dp // ep at cp 1."""
        return self.dp * self.cp * self.tp // (self.ep * self.expert_tp)

    @property
    def fold(self) -> int:
        """How many ways MoE parallel folding splits a tp group's tokens before routing
        them: tp when the experts are whole (etp 1), else 1 (the tp ranks route the
        same tokens, each with its share of every expert's matrices)."""
        return self.tp // self.expert_tp

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * self.vpp

    def with_stages(self, stages: tuple[Stage, ...]) -> Strategy:
        """The same strategy with a new partition; `recompute` summarises it."""
        return replace(self, stages=stages, recompute=summarize_recompute(stages))

    def rank_stages(self, pp_rank: int) -> tuple[Stage, ...]:
        return tuple(s for s in self.stages if s.pp_rank == pp_rank)

    def ranks(self, pp_rank: int) -> tuple[int, ...]:
        """Global ranks of pipeline rank `pp_rank` (all of its dp, cp and tp ranks)."""
        per_stage = self.dp * self.cp * self.tp
        return tuple(range(pp_rank * per_stage, (pp_rank + 1) * per_stage))


def summarize_recompute(stages: tuple[Stage, ...]) -> str:
    """"none", "selective" or "full" when every layer does the same, else "mixed"."""
    total = sum(s.num_layers for s in stages)
    full = sum(s.full_recompute_layers for s in stages)
    selective = sum(s.selective_recompute_layers for s in stages)
    if full == total:
        return "full"
    if selective == total:
        return "selective"
    if full == 0 and selective == 0:
        return "none"
    return "mixed"


def layout_error(strategy: Strategy) -> tuple[str, str] | None:
    """(field of the strategy, why) when its chunk count or a stage's rank is not what
    its schedule runs (None when both are): what every reader of a plan checks."""
    s = strategy
    if (s.pp > 1 or s.vpp > 1) and (why := schedule_vpp_error(s.schedule, s.vpp, s.pp)):
        return "vpp", why
    if s.pp > 1:
        for position, stage in enumerate(s.stages):
            rank = stage_rank(stage.index, s.pp, s.schedule)
            if stage.pp_rank != rank:
                return (f"stages[{position}].pp_rank",
                        f"virtual stage {stage.index} is not on the pipeline rank {s.schedule} runs it on ({rank})")
    return None


def expert_layout_error(strategy: Strategy, num_experts: int, folding: bool) -> tuple[str, str] | None:
    """(field, why) when the strategy's experts cannot be laid out as its runtime lays
    them (None when they can). `folding` (RuntimeSpec.moe_folding): the engine builds
    the experts' groups apart from attention's over the dp x cp x tp ranks of a stage,
    etp innermost, then ep, then edp (Megatron-Core's expert RankGenerator "tp-ep-dp-pp";
    torchtitan's sparse mesh; the executor's expert mesh); else ep lies inside dp
    (DeepSpeed's expert groups)."""
    s = strategy
    if s.etp is not None and (s.etp != 1 or s.tp == 1):
        return "etp", f"expected 1 (whole experts under tp > 1) or none (experts split over tp), got {s.etp}"
    if s.etp == 1 and not s.sequence_parallel:
        return "etp", "whole experts under tp route each tp rank's sequence-parallel share of the tokens: set sp on"
    if s.ep > 1 and num_experts % s.ep:
        return "ep", f"{s.ep} does not divide the {num_experts} experts"
    if folding and (s.dp * s.cp * s.tp) % (s.ep * s.expert_tp):
        return "ep", f"ep {s.ep} x etp {s.expert_tp} does not divide dp x cp x tp = {s.dp * s.cp * s.tp}"
    if not folding and s.etp == 1:
        return "etp", "this runtime splits experts over tp (etp 1 needs MoE parallel folding: --runtime pytorch-native or megatron)"
    if not folding and s.dp % s.ep:
        return "ep", f"{s.ep} does not divide dp {s.dp}: this runtime's expert groups lie inside dp"
    return None


def ends_apart(strategy: Strategy) -> bool:
    """Whether the first and the last virtual stage are on different pipeline ranks (a
    tied embedding's two copies then sum their gradients over the network)."""
    last = strategy.num_virtual_stages - 1
    return stage_rank(0, strategy.pp, strategy.schedule) != stage_rank(last, strategy.pp, strategy.schedule)


def rank_stage_indices(pp_rank: int, pp: int, vpp: int, schedule: str) -> tuple[int, ...]:
    """The virtual stages rank `pp_rank` holds, in the order it first runs them."""
    return tuple(sorted(i for i in range(pp * vpp) if stage_rank(i, pp, schedule) == pp_rank))


def even_stages(num_layers: int, pp: int, vpp: int = 1, recompute: str = "none",
                schedule: str = "1f1b") -> tuple[Stage, ...]:
    """Layers spread as evenly as possible over pp * vpp virtual stages (earlier stages
    take the remainder), virtual stage i on the rank `stage_rank` gives it, every layer
    recomputed as `recompute` says."""
    count = pp * vpp
    base, extra = divmod(num_layers, count)
    stages, first = [], 0
    for i in range(count):
        n = base + (1 if i < extra else 0)
        full = n if recompute == "full" else 0
        selective = n if recompute == "selective" else 0
        stages.append(Stage(i, stage_rank(i, pp, schedule), first, n, full, selective))
        first += n
    return tuple(stages)
