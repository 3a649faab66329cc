"""The results of an estimate, as frozen breakdowns: `Work` (seconds of one micro-batch by
kind), `TimeBreakdown`, `MemoryBreakdown` and `Estimate`, and `step_estimate`, which
assembles an Estimate from per-rank parts (every kind of problem ends there)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from costmodel.strategy import Strategy


@dataclass(frozen=True)
class Work:
    """Seconds one rank spends on one micro-batch (or a step), by kind."""

    compute_s: float = 0.0
    recompute_s: float = 0.0
    tp_comm_s: float = 0.0
    ep_comm_s: float = 0.0
    dp_comm_s: float = 0.0
    pp_comm_s: float = 0.0
    cp_comm_s: float = 0.0     # context parallelism's K/V all-gathers and their gradients' reduce-scatters

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.recompute_s + self.tp_comm_s + self.ep_comm_s
                + self.dp_comm_s + self.pp_comm_s + self.cp_comm_s)

    # Spelled out rather than looped over dataclasses.fields: the planner adds Work
    # values millions of times.
    def __add__(self, other: Work) -> Work:
        return Work(self.compute_s + other.compute_s, self.recompute_s + other.recompute_s,
                    self.tp_comm_s + other.tp_comm_s, self.ep_comm_s + other.ep_comm_s,
                    self.dp_comm_s + other.dp_comm_s, self.pp_comm_s + other.pp_comm_s,
                    self.cp_comm_s + other.cp_comm_s)

    def scaled(self, factor: float) -> Work:
        return Work(self.compute_s * factor, self.recompute_s * factor, self.tp_comm_s * factor,
                    self.ep_comm_s * factor, self.dp_comm_s * factor, self.pp_comm_s * factor,
                    self.cp_comm_s * factor)



@dataclass(frozen=True)
class TimeBreakdown:
    compute_s: float
    recompute_s: float
    tp_comm_s: float
    ep_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    bubble_s: float
    optimizer_s: float
    fixed_s: float = 0.0      # the runtime's per-step fixed cost (costmodel.specs.runtime)
    cp_comm_s: float = 0.0    # context parallelism's K/V exchange (plans carry it only when set)



@dataclass(frozen=True)
class MemoryBreakdown:
    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    comm_buffer_bytes: float
    runtime_reserve_bytes: float
    temporary_bytes: float = 0.0    # made in backward and freed in it (ZeRO-3's unsharded gradients)

    @property
    def total_bytes(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))



@dataclass(frozen=True)
class Estimate:
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    hfu: float
    peak_memory_bytes: float
    peak_memory_rank: int            # pipeline rank holding the peak
    bottleneck_rank: int             # pipeline rank with the longest micro-batch
    time: TimeBreakdown
    memory: MemoryBreakdown          # of the peak rank
    rank_time_s: tuple[float, ...]   # per pipeline rank, one micro-batch
    rank_memory_bytes: tuple[float, ...]
    # Mixed clusters with replica groups (costmodel.estimate.mixed): per data-parallel replica,
    # its micro-batches' seconds in one step; empty otherwise.
    replica_time_s: tuple[float, ...] = ()



def step_estimate(problem, strategy: Strategy, works: list[Work], pipelined_s: float, dp_exposed_s: float,
                  optimizer_s: float, memories: list[MemoryBreakdown], model_flops: float,
                  hardware_flops: float, peak_flops_per_gpu: float | None = None, fixed_s: float = 0.0) -> Estimate:
    """The Estimate of a step from its parts: each pipeline rank's micro-batch work and
    memory, the pipelined time, the exposed gradient sync and the optimizer step. The
    time breakdown is the slowest rank's, over all micro-batches, the rest of the
    pipelined time its bubble. `peak_flops_per_gpu`: the mean peak of the devices (MFU's
    denominator), by default the cluster's GPU's. Shared by costmodel.estimate.traced."""
    pp, m = strategy.pp, strategy.num_microbatches
    rank_times = [w.total_s for w in works]
    bottleneck = max(range(pp), key=lambda r: (rank_times[r], -r))
    step = pipelined_s + dp_exposed_s + optimizer_s + fixed_s
    busy = works[bottleneck].scaled(m)
    time = TimeBreakdown(
        compute_s=busy.compute_s, recompute_s=busy.recompute_s, tp_comm_s=busy.tp_comm_s,
        ep_comm_s=busy.ep_comm_s, pp_comm_s=busy.pp_comm_s, dp_comm_s=busy.dp_comm_s + dp_exposed_s,
        bubble_s=pipelined_s - busy.total_s, optimizer_s=optimizer_s, fixed_s=fixed_s, cp_comm_s=busy.cp_comm_s,
    )
    totals = [mem.total_bytes for mem in memories]
    peak_rank = max(range(pp), key=lambda r: (totals[r], -r))
    gpus = strategy.num_gpus
    peak = peak_flops_per_gpu or problem.cluster.gpu.peak_for(problem.training.precision)
    return Estimate(
        step_time_s=step,
        tokens_per_s=problem.training.tokens_per_step / step,
        tflops_per_gpu=model_flops / step / gpus / 1e12,
        mfu=model_flops / step / gpus / peak,
        hfu=hardware_flops / step / gpus / peak,
        peak_memory_bytes=totals[peak_rank],
        peak_memory_rank=peak_rank,
        bottleneck_rank=bottleneck,
        time=time,
        memory=memories[peak_rank],
        rank_time_s=tuple(rank_times),
        rank_memory_bytes=tuple(totals),
    )
