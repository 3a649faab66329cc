"""The search on a mixed cluster (costmodel.estimate.mixed): which groups to use, how to place
ranks on them, and the rest of the strategy.

For every non-empty set of groups (in the cluster file's order) the homogeneous space
(`planner.search.space`) is enumerated on a stand-in cluster of the set's GPUs, and each mesh
shape is placed on the groups two ways:

- stage groups: every group holds whole pipeline ranks, n_g / (dp x tp) of them, in
  each order of the groups along the pipeline; the partition program
  (`planner.search.partition`) then gives each rank layers by its group's speed and memory.
- replica groups (pp 1, ZeRO <= 2, no experts, two groups or more): every group holds
  n_g / tp data-parallel replicas; the micro-batches are shared so replicas finish
  together (`costmodel.estimate.mixed.replica_shares`), and the fewest layers recompute that let
  every group fit (time grows and memory shrinks with each recomputed layer, so the
  least that fits is the fastest).

Every group of a set is used whole. A set of one group is the homogeneous search on
that group, so the result is never worse than the best plan on its fastest group alone.
Candidates are ranked and pruned as on one GPU type (`planner.search.result`: objective,
budgets, Pareto front, `solve_in_bound_order`): in order of a lower bound, stopping at the first bound no
better than the K-th best plan. The bound is `planner.search.bounds.quick` on unit costs that
take, term by term, the cheapest of the groups a placement uses (`fastest_units`), and
on the largest of their memories; no rank of any placement can do better than that.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import fields, replace

from costmodel.estimate.breakdown import Work
from costmodel.estimate.mixed import (
    estimate_replicas,
    group_units,
    replica_microbatch_s,
    replica_shares,
    stage_rank_costs,
)
from costmodel.estimate.uniform import UnitCosts, estimate_ranks
from costmodel.problem import Problem
from costmodel.specs import ClusterSpec, MixedClusterSpec
from costmodel.strategy import Strategy, even_stages
from planner.rules import BUDGETS, Rules
from planner.search import bounds
from planner.search.partition import (
    TimedOut,
    memory_limits,
    solve_partition,
    usable_memory_bytes,
)
from planner.search.result import (
    Candidate,
    Infeasible,
    Kept,
    SearchResult,
    as_candidate,
    check_specs,
    check_timeouts,
    finish,
    order_key,
    score,
    solve_in_bound_order,
    time_bound_scale,
)
from planner.search.space import (
    Exclusions,
    _tp_options,
    divisors,
    enumerate_space,
    recompute_modes,
)


def stand_in(groups: tuple[ClusterSpec, ...]) -> ClusterSpec:
    """One homogeneous cluster with the groups' GPUs, nodes no larger than the smallest
    group's: what the space enumerates mesh shapes on (its devices are never priced)."""
    per_node = min(g.gpus_per_node for g in groups)
    total = sum(g.num_gpus for g in groups)
    return replace(groups[0], name="+".join(g.name for g in groups), gpus_per_node=per_node,
                   num_nodes=total // per_node, nvlink_domain_gpus=None)


def group_sets(cluster: MixedClusterSpec) -> list[tuple[ClusterSpec, ...]]:
    """Non-empty sets of groups, in file order, whose GPUs fill whole stand-in nodes."""
    out = []
    for size in range(1, len(cluster.groups) + 1):
        for combo in itertools.combinations(cluster.groups, size):
            per_node = min(g.gpus_per_node for g in combo)
            if all(g.num_gpus % per_node == 0 for g in combo):
                out.append(combo)
    return out


def stage_placements(groups: tuple[ClusterSpec, ...], s: Strategy) -> list[tuple[str, ...]]:
    """Each order of the groups along the pipeline, every group holding whole pipeline ranks."""
    ranks_per = s.dp * s.tp
    if any(g.num_gpus % ranks_per or s.tp > g.gpus_per_node for g in groups):
        return []
    out = []
    for order in itertools.permutations(groups):
        names = tuple(n for g in order for n in [g.name] * (g.num_gpus // ranks_per))
        if names not in out:
            out.append(names)
    return out


def replica_space(problem: Problem, rules: Rules, groups: tuple[ClusterSpec, ...]) -> list[Strategy]:
    """Replica-group strategies on `groups` (two or more): pp 1, every group holding
    n_g / tp replicas in file order, ZeRO <= 2, no expert parallelism. Unlike the
    homogeneous space, dp need not divide the batch: the shares only need a micro-batch
    for every replica. The shares are placeholders (an even split) until
    `solve_replicas` sets them from the groups' speeds."""
    if len(groups) < 2 or not rules.permits("pp", 1) or not rules.permits("vpp", 1):
        return []
    stand = replace(problem, cluster=stand_in(groups))
    batch, why = problem.training.global_batch, Exclusions()
    schedules = [name for name in ("1f1b", "gpipe") if rules.permits("schedule", name)]
    modes = recompute_modes(problem, rules)
    if not schedules or not modes or problem.model.is_moe:
        return []
    out = []
    for tp in _tp_options(stand, rules, divisors(min(g.gpus_per_node for g in groups)), why):
        if any(g.num_gpus % tp for g in groups):
            continue
        names = tuple(n for g in groups for n in [g.name] * (g.num_gpus // tp))
        dp = len(names)
        if not rules.permits("dp", dp):
            continue
        for mbs in range(rules.micro_batch_min, rules.micro_batch_max + 1):
            if batch % mbs or batch // mbs < dp or not rules.permits("mbs", mbs):
                continue
            even = replica_shares([1.0] * dp, batch // mbs)
            for zero in (z for z in range(3) if rules.permits("zero", z)):
                sp_options = (False, True) if tp > 1 and problem.training.seq_len % tp == 0 else (False,)
                for sp in (x for x in sp_options if rules.permits("sp", x)):
                    out.append(Strategy(dp=dp, tp=tp, pp=1, micro_batch_size=mbs, num_microbatches=max(even),
                                        schedule=schedules[0], zero_stage=zero,
                                        recompute=modes[0] if len(modes) == 1 else "none", sequence_parallel=sp,
                                        replica_groups=names, replica_microbatches=even))
    return out


def fastest_units(units: list[UnitCosts]) -> UnitCosts:
    """Unit costs that are, term by term, the least of `units` (a bound on every group)."""
    def least(values):
        first = values[0]
        if first is None:
            return None
        if isinstance(first, UnitCosts):
            return fastest_units(values)
        if isinstance(first, Work):
            return Work(*(min(getattr(v, f.name) for v in values) for f in fields(Work)))
        if isinstance(first, dict):
            return {k: least([v[k] for v in values]) for k in first}
        return min(values)
    return UnitCosts(**{f.name: least([getattr(u, f.name) for u in units]) for f in fields(UnitCosts)})


def _relaxed(problem: Problem, rules: Rules, s: Strategy, cache: dict) -> tuple[UnitCosts, float]:
    """The placement relaxed to one device: the termwise least unit costs of its groups
    and the largest usable memory among them. Every bound of `planner.search.bounds` on it is
    a bound of the placement (no rank is faster or holds more)."""
    cluster: MixedClusterSpec = problem.cluster
    groups = [cluster.group(n) for n in dict.fromkeys(s.stage_groups or s.replica_groups)]
    units = fastest_units([group_units(problem, g, s, cache)[1] for g in groups])
    usable = max(usable_memory_bytes(replace(problem, cluster=g), rules) for g in groups)
    return units, usable


def _bound_s(problem: Problem, rules: Rules, s: Strategy, modes: tuple[str, ...], cache: dict) -> tuple[float, float]:
    """(lower bound of the step time, of the fullest rank's memory minus the largest
    usable memory of the groups) of a placed strategy; memory > 0 cannot fit."""
    units, usable = _relaxed(problem, rules, s, cache)
    b = bounds.quick(problem, units, s, modes, usable)
    return b.time_s, b.memory_bytes - usable


def _fits(problem: Problem, rules: Rules, memory: list[tuple[str, float]]) -> bool:
    cluster: MixedClusterSpec = problem.cluster
    return all(mem <= usable_memory_bytes(replace(problem, cluster=cluster.group(name)), rules)
               for name, mem in memory)


def solve_replicas(problem: Problem, rules: Rules, strategy: Strategy, modes: tuple[str, ...]) -> Candidate | None:
    """A replica-group strategy with its shares and the fewest fully recomputed layers
    that fit every group (selective recompute is not offered here); None if none fits."""
    layers = problem.model.num_hidden_layers
    total = sum(strategy.replica_microbatches)
    times = replica_microbatch_s(problem, replace(strategy, stages=even_stages(layers, 1)))
    shares = replica_shares([times[n] for n in strategy.replica_groups], total)
    s = replace(strategy, replica_microbatches=shares, num_microbatches=max(shares))
    low = 0 if "none" in modes else layers
    high = layers if "full" in modes else low

    def attempt(full: int):
        staged = s.with_stages(even_stages(layers, 1)) if full == 0 else s.with_stages(
            (replace(even_stages(layers, 1)[0], full_recompute_layers=full),))
        e, memory = estimate_replicas(problem, staged)
        return (staged, e) if _fits(problem, rules, memory) else None

    if attempt(high) is None:
        return None
    while low < high:   # memory falls with each recomputed layer: bisect the least that fits
        mid = (low + high) // 2
        if attempt(mid) is None:
            low = mid + 1
        else:
            high = mid
    staged, e = attempt(low)
    return Candidate(staged, e, 0.0)


def _key(strategy: Strategy) -> tuple:
    return (order_key(strategy), strategy.stage_groups, strategy.replica_groups)


def search_mixed(problem: Problem, rules: Rules, top: int = 3,
                 progress: Callable[[int, int], None] | None = None, pareto: bool = False,
                 every_group: bool = False) -> SearchResult:
    """The best plans on a mixed cluster (module docstring); as `planner.search.search`.
    `every_group`: only plans that use all the groups."""
    started = time.perf_counter()
    check_specs(problem, rules, pareto)
    cluster: MixedClusterSpec = problem.cluster
    modes = recompute_modes(problem, rules)
    budgeted = any(getattr(rules, key) is not None for key in BUDGETS)
    placed: list[Strategy] = []
    last_why = None
    for groups in group_sets(cluster):
        if every_group and len(groups) < len(cluster.groups):
            continue
        # Mixed clusters are priced per group on whole sequences: cp 1.
        space, why = enumerate_space(replace(problem, cluster=stand_in(groups)), rules, context_parallel=False)
        last_why = why
        for s in space:
            placed += [replace(s, stage_groups=names) for names in stage_placements(groups, s)]
        placed += replica_space(problem, rules, groups)
    if not placed:
        raise Infeasible(f"no strategy fits the groups of {cluster.name} whole and satisfies the rules"
                         f" ({last_why.summary() if last_why else 'no group set'})")
    objective = rules.objective
    cache: dict = {}
    scored, pruned_memory = [], 0
    for s in placed:
        time_s, over_bytes = _bound_s(problem, rules, s, modes, cache)
        if over_bytes > 0:
            pruned_memory += 1
            continue
        primary = 0.0 if objective == "memory" else time_s * time_bound_scale(problem, s, objective)
        scored.append((primary, _key(s), s))
    scored.sort(key=lambda item: item[:2])
    kept = Kept(top, lambda c: (*score(problem, c, objective), _key(c.strategy)), budgeted or pareto)
    found = kept.found

    def refine(s: Strategy) -> float:
        # The tighter bound that balances layers under memory, as on one GPU type.
        units, usable = _relaxed(problem, rules, s, cache)
        return bounds.balanced(problem, units, s, modes, usable)

    def solve(s: Strategy, cutoff_s: float | None) -> Candidate | TimedOut | None:
        if s.replica_groups:
            return solve_replicas(problem, rules, s, modes)
        rank_costs = stage_rank_costs(problem, s, cache)
        solution = solve_partition(problem, rank_costs[0][1], s, modes, rules, "memory" if objective == "memory" else "time",
                                   cutoff_s, rank_costs)
        return as_candidate(solution, lambda staged: estimate_ranks(problem, staged, rank_costs))

    solved = solve_in_bound_order(problem, rules, scored, kept, top, pareto,
                                  refine=refine, solve=solve, progress=progress)
    kept.check_budgets(rules)
    check_timeouts(kept, solved)
    if not found:
        raise Infeasible(f"no placement of {len(placed)} strategies on the groups of {cluster.name} fits "
                         f"device memory ({memory_limits(problem, rules)}) and the rules")
    return finish(problem, rules, kept, pareto, len(placed), pruned_memory, len(scored), solved, started)
