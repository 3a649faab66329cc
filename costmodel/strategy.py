"""The strategy: parallel degrees, micro-batching, schedule, ZeRO stage, recomputation
and the stage partition. A frozen value; the planner builds them, the cost model and
the executor read them.

Rank order is Megatron's: tp innermost, then dp (expert groups inside dp), then pp
outermost, so global rank = tp_rank + tp * (dp_rank + dp * pp_rank).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE_MODES = ("none", "selective", "full")


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


@dataclass(frozen=True)
class Strategy:
    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int
    vpp: int = 1
    ep: int = 1
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
        return self.dp * self.tp * self.pp

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * self.vpp

    def with_stages(self, stages: tuple[Stage, ...]) -> Strategy:
        """The same strategy with a new partition; `recompute` summarises it."""
        return replace(self, stages=stages, recompute=summarize_recompute(stages))

    def rank_stages(self, pp_rank: int) -> tuple[Stage, ...]:
        return tuple(s for s in self.stages if s.pp_rank == pp_rank)

    def ranks(self, pp_rank: int) -> tuple[int, ...]:
        """Global ranks of pipeline rank `pp_rank` (all of its dp and tp ranks)."""
        base = pp_rank * self.dp * self.tp
        return tuple(range(base, base + self.dp * self.tp))


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


def even_stages(num_layers: int, pp: int, vpp: int = 1, recompute: str = "none") -> tuple[Stage, ...]:
    """Layers spread as evenly as possible over pp * vpp virtual stages (earlier stages
    take the remainder), virtual stage i on pipeline rank i mod pp (Megatron's
    interleaved layout), every layer recomputed as `recompute` says."""
    count = pp * vpp
    base, extra = divmod(num_layers, count)
    stages, first = [], 0
    for i in range(count):
        n = base + (1 if i < extra else 0)
        full = n if recompute == "full" else 0
        selective = n if recompute == "selective" else 0
        stages.append(Stage(i, i % pp, first, n, full, selective))
        first += n
    return tuple(stages)
