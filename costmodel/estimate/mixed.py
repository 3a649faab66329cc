"""Mixed clusters: pricing a strategy whose ranks sit on groups of different GPUs and links.

A plan on a `MixedClusterSpec` places its ranks on the groups one of two ways
(`costmodel.strategy.Strategy`):

- stage groups: each pipeline rank (all of its dp x tp ranks) on one group. Each rank is
  priced with its group's unit costs (`costmodel.estimate.uniform.unit_costs` on the group as a
  cluster of its own), so a slower group's stages take fewer layers and a smaller
  memory's fewer activations (the partition program balances them). A send between
  stages of different groups crosses the inter-group link; as on one cluster, the
  slowest boundary paces every send of the 1F1B steady state (costmodel.terms.comm.groups).
- replica groups (pp 1): each data-parallel replica on one group, running its own number
  of micro-batches, so replicas of different speed finish together
  (`replica_microbatches`). The step is the slowest replica's micro-batches, then the
  gradient all-reduce, whose ring crosses the inter-group link and is paced by the
  slowest link it uses (Thakur et al. 2005 §4: a ring runs at its slowest hop).
"""

from __future__ import annotations

from dataclasses import replace

from costmodel.estimate.breakdown import Estimate, MemoryBreakdown, step_estimate
from costmodel.estimate.uniform import (
    UnitCosts,
    backward_window_s,
    dp_sync_s,
    estimate_ranks,
    optimizer_step_s,
    rank_memory,
    rank_work,
    recompute_flops,
    unit_costs,
)
from costmodel.problem import Problem
from costmodel.specs import ClusterSpec, LinkSpec, MixedClusterSpec
from costmodel.strategy import Strategy
from costmodel.terms import memory
from costmodel.terms.comm import Placement, collective_time_s
from costmodel.terms.counts import model_flops_per_step
from costmodel.terms.pipeline import pipeline_time_s

# Two ranks on two nodes: a transfer that leaves its node.
_CROSSING = Placement(2, 1, 2)


def slower(a: LinkSpec, b: LinkSpec) -> LinkSpec:
    """The link with the lower achieved bandwidth (the one a transfer over both waits on)."""
    return a if (a.achieved_bytes_per_s, -a.latency_s) <= (b.achieved_bytes_per_s, -b.latency_s) else b


def leaving(cluster: MixedClusterSpec, group: ClusterSpec) -> ClusterSpec:
    """`group` as a transfer that leaves it for another group sees the network."""
    return replace(group, inter_node=slower(group.inter_node, cluster.inter_group))


def group_problem(problem: Problem, group: ClusterSpec) -> Problem:
    return replace(problem, cluster=group)


def plain(strategy: Strategy) -> Strategy:
    """The strategy without its group fields, as one group prices it."""
    return replace(strategy, stage_groups=(), replica_groups=(), replica_microbatches=())


def group_units(problem: Problem, group: ClusterSpec, strategy: Strategy,
                cache: dict | None = None) -> tuple[Problem, UnitCosts]:
    """`group`'s problem and the strategy's unit costs on it, kept in `cache` by what
    `unit_costs` depends on (not vpp, nor the schedule but whether dualpipev pairs chunks:
    planner.search.uniform.unit_key)."""
    s = plain(strategy)
    key = (group.name, s.dp, s.tp, s.pp, s.micro_batch_size, s.ep, s.expert_tp, s.zero_stage, s.sequence_parallel,
           s.schedule == "dualpipev")
    if cache is None or key not in cache:
        p = group_problem(problem, group)
        pair = (p, unit_costs(p, s))
        if cache is None:
            return pair
        cache[key] = pair
    return cache[key]


def stage_rank_costs(problem: Problem, strategy: Strategy,
                     cache: dict | None = None) -> list[tuple[Problem, UnitCosts]]:
    """(problem, unit costs) of each pipeline rank of a stage-group strategy."""
    cluster: MixedClusterSpec = problem.cluster
    groups = [cluster.group(name) for name in strategy.stage_groups]
    pairs = [group_units(problem, g, strategy, cache) for g in groups]
    p2p_s = max(u.p2p_s for _, u in pairs)
    for r in range(strategy.pp - 1):
        if groups[r].name != groups[r + 1].name:
            link = leaving(cluster, groups[r])
            # As within a group (uniform.unit_costs): the runtime's bandwidth by message
            # size, and the share of the send it hides behind compute.
            crossing = collective_time_s("p2p", pairs[r][1].p2p_bytes, _CROSSING, link, problem.runtime)
            p2p_s = max(p2p_s, crossing * (1.0 - problem.runtime.pp_overlap * link.comm_overlap))
    tied_sync_s = pairs[0][1].tied_sync_s
    if pairs[0][1].tied_sync_s > 0 and groups[0].name != groups[-1].name:
        # The tied embedding's gradient all-reduce joins the first and last stage
        # across the groups (Megatron-LM; costmodel.estimate.uniform.unit_costs).
        model, states = problem.model, memory.comm_state_bytes(problem.training)
        tied_sync_s = collective_time_s("all_reduce", model.vocab_size * model.hidden_size / strategy.tp
                                        * states.gradients, _CROSSING, leaving(cluster, groups[0]), problem.runtime)
    return [(p, replace(u, p2p_s=p2p_s, tied_sync_s=tied_sync_s)) for p, u in pairs]


def replica_sync_problem(problem: Problem, strategy: Strategy, group: ClusterSpec) -> Problem:
    """The problem a replica's gradient all-reduce is priced on: its group, seen from a
    ring that spans the groups. The ring leaves each group at least once, so its
    members are counted as spread over nodes no fuller than the group with the fewest
    replicas, and the network link is the slowest of every group's and the inter-group one."""
    cluster: MixedClusterSpec = problem.cluster
    names = strategy.replica_groups
    if len(set(names)) == 1:
        return group_problem(problem, group)
    fewest = min(names.count(n) for n in set(names))
    link = cluster.inter_group
    for name in set(names):
        link = slower(link, cluster.group(name).inter_node)
    per_node = min(group.gpus_per_node, strategy.tp * fewest)
    return group_problem(problem, replace(group, inter_node=link, gpus_per_node=per_node, nvlink_domain_gpus=None))


def replica_microbatch_s(problem: Problem, strategy: Strategy) -> dict[str, float]:
    """Seconds of one micro-batch on a replica of each group a replica-group strategy uses."""
    cluster: MixedClusterSpec = problem.cluster
    base = plain(strategy)
    out = {}
    for name in dict.fromkeys(strategy.replica_groups):
        p = group_problem(problem, cluster.group(name))
        out[name] = rank_work(unit_costs(p, base), base, 0).total_s
    return out


def replica_shares(microbatch_s: list[float], total: int) -> tuple[int, ...]:
    """Micro-batches per replica, at least one each, minimising the slowest replica's
    time: each next micro-batch goes to the replica that would finish it first. For
    identical jobs on machines of different speed this greedy rule is optimal (the
    makespan of unit jobs on uniform machines; Graham 1969, Dessouky et al. 1990)."""
    n = len(microbatch_s)
    if total < n:
        raise ValueError(f"{total} micro-batches cannot give each of {n} replicas one")
    counts = [1] * n
    for _ in range(total - n):
        d = min(range(n), key=lambda i: ((counts[i] + 1) * microbatch_s[i], i))
        counts[d] += 1
    return tuple(counts)


def estimate_replicas(problem: Problem, strategy: Strategy) -> tuple[Estimate, list[tuple[str, float]]]:
    """The estimate of a replica-group strategy and each group's peak memory (bytes)."""
    cluster: MixedClusterSpec = problem.cluster
    base = plain(strategy)
    per_group = {}
    for name in dict.fromkeys(strategy.replica_groups):
        p = group_problem(problem, cluster.group(name))
        per_group[name] = (p, unit_costs(p, base))
    busy, works, memories = [], [], {}
    for d, (name, m) in enumerate(zip(strategy.replica_groups, strategy.replica_microbatches)):
        p, u = per_group[name]
        s = replace(base, num_microbatches=m)
        work = rank_work(u, s, 0)
        works.append(work)
        busy.append(pipeline_time_s(s.schedule, [work.total_s], m))
        mem = rank_memory(p, u, s, 0)
        if name not in memories or mem.total_bytes > memories[name].total_bytes:
            memories[name] = mem
    slowest = max(range(len(busy)), key=lambda d: (busy[d], -d))
    name = strategy.replica_groups[slowest]
    p, u = per_group[name]
    s = replace(base, num_microbatches=strategy.replica_microbatches[slowest])
    # The all-reduce can start its last buckets only when the slowest replica's last
    # backward makes them (DDP bucketing, Li et al. 2020 §3.2.3): its window hides the rest.
    window = backward_window_s(u, s, 0)
    exposed = max(0.0, dp_sync_s(replica_sync_problem(problem, strategy, cluster.group(name)), u, s, 0) - window)
    optimizer_s = max(optimizer_step_s(pg, ug, base, 0) for pg, ug in per_group.values())
    peak = max(memories.values(), key=lambda mem: mem.total_bytes)
    model_flops = model_flops_per_step(problem.model, problem.training.global_batch, problem.training.seq_len)
    precision = problem.training.precision
    mean_peak = sum(cluster.group(n).gpu.peak_for(precision) for n in strategy.replica_groups) / strategy.dp
    e = step_estimate(problem, s, [works[slowest]], busy[slowest], exposed, optimizer_s, [peak],
                      model_flops, model_flops + recompute_flops(problem, s), mean_peak)
    return replace(e, replica_time_s=tuple(busy)), [(n, m.total_bytes) for n, m in memories.items()]


def estimate_mixed(problem: Problem, strategy: Strategy) -> Estimate:
    """The estimate of a strategy on a mixed cluster (module docstring)."""
    if strategy.stage_groups:
        return estimate_ranks(problem, strategy, stage_rank_costs(problem, strategy))
    if strategy.replica_groups:
        return estimate_replicas(problem, strategy)[0]
    raise ValueError("a strategy on a mixed cluster needs stage_groups or replica_groups")


def mixed_rank_memories(problem: Problem, strategy: Strategy) -> list[MemoryBreakdown]:
    """Each pipeline rank's memory at its peak, by kind, on any cluster (for replica
    groups, the fullest group's)."""
    if not isinstance(problem.cluster, MixedClusterSpec):
        units = unit_costs(problem, strategy)
        return [rank_memory(problem, units, strategy, r) for r in range(strategy.pp)]
    if strategy.stage_groups:
        return [rank_memory(p, u, strategy, r) for r, (p, u) in enumerate(stage_rank_costs(problem, strategy))]
    cluster: MixedClusterSpec = problem.cluster
    out = []
    for name, m in zip(strategy.replica_groups, strategy.replica_microbatches):
        p = group_problem(problem, cluster.group(name))
        s = replace(plain(strategy), num_microbatches=m)
        out.append(rank_memory(p, unit_costs(p, s), s, 0))
    return [max(out, key=lambda mem: mem.total_bytes)]


def rank_capacity_bytes(cluster, strategy: Strategy) -> tuple[int, ...]:
    """The device memory of each pipeline rank (of the smallest group for replica groups)."""
    if not isinstance(cluster, MixedClusterSpec):
        return (cluster.gpu.memory_bytes,) * strategy.pp
    if strategy.stage_groups:
        return tuple(cluster.group(n).gpu.memory_bytes for n in strategy.stage_groups)
    return (min(cluster.group(n).gpu.memory_bytes for n in strategy.replica_groups),)


def device_groups(cluster, strategy: Strategy, estimate: Estimate) -> list[tuple[ClusterSpec, int, float]]:
    """(group, devices, busy seconds per device) for every set of devices that share a
    group and a busy time: a pipeline rank's dp x tp devices, or a replica's tp devices.
    The busy time is the rank's (or replica's) micro-batches plus the step's tail
    (exposed DP sync and optimizer), capped at the step (costmodel.estimate.energy)."""
    step, m = estimate.step_time_s, strategy.num_microbatches
    if isinstance(cluster, MixedClusterSpec) and strategy.replica_groups:
        tail = max(0.0, step - max(estimate.replica_time_s))
        return [(cluster.group(n), strategy.tp, min(step, t + tail))
                for n, t in zip(strategy.replica_groups, estimate.replica_time_s)]
    slowest = estimate.rank_time_s[estimate.bottleneck_rank]
    # step = pipelined + exposed DP sync + optimizer, pipelined = m * slowest + bubble
    # (costmodel.estimate.estimate), so the tail is what is left of the step.
    tail = max(0.0, step - m * slowest - estimate.time.bubble_s)
    groups = ([cluster.group(n) for n in strategy.stage_groups] if isinstance(cluster, MixedClusterSpec)
              else [cluster] * strategy.pp)
    per_rank = strategy.num_gpus // strategy.pp
    return [(g, per_rank, min(step, m * t + tail)) for g, t in zip(groups, estimate.rank_time_s)]
