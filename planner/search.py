"""The search: enumerate the space, bound every candidate (`planner.bounds`), and solve
the partition program (`planner.partition`) only for candidates whose bound can still
beat the K-th best plan found. Candidates are taken in order of their quick bound, so
the search stops at the first quick bound no better than the K-th best; on the way, a
tighter bound that balances layers under memory skips the program for more of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from costmodel.estimate import Estimate, UnitCosts, estimate, unit_costs
from costmodel.specs import Problem
from costmodel.strategy import Strategy, even_stages
from planner import bounds
from planner.partition import solve_partition, usable_memory_bytes
from planner.rules import Rules
from planner.space import describe, enumerate_space, recompute_modes


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy     # with stages
    estimate: Estimate
    gap: float             # the partition program's proven gap


@dataclass(frozen=True)
class SearchStats:
    candidates: int        # strategies in the space
    pruned_memory: int     # dropped by the memory bound
    pruned_bound: int      # never solved: their time bound could not beat the K-th best
    ilp_solves: int
    ilp_infeasible: int    # solved, but no partition fits
    gap: float             # proven gap of the best plan's partition program
    seconds: float         # wall time; shown on the console, kept out of plan files


@dataclass(frozen=True)
class SearchResult:
    best: Candidate
    alternatives: tuple[Candidate, ...]
    stats: SearchStats


class Infeasible(Exception):
    """No strategy fits. `reason` names the binding constraint with its numbers;
    `closest` is the candidate that came nearest (if any) for the relaxation search."""

    def __init__(self, reason: str, closest: Strategy | None = None):
        super().__init__(reason)
        self.reason = reason
        self.closest = closest


def unit_key(strategy: Strategy) -> tuple:
    """What `unit_costs` depends on (not the schedule, vpp or micro-batch count)."""
    s = strategy
    return (s.dp, s.tp, s.pp, s.micro_batch_size, s.ep, s.zero_stage, s.sequence_parallel)


def _order_key(strategy: Strategy) -> tuple:
    s = strategy
    return (s.tp, s.pp, s.dp, s.ep, s.micro_batch_size, s.schedule, s.vpp, s.zero_stage, s.sequence_parallel)


def _score(candidate: Candidate, objective: str) -> tuple:
    e = candidate.estimate
    primary = (e.peak_memory_bytes, e.step_time_s) if objective == "memory" else (e.step_time_s, e.peak_memory_bytes)
    return (*primary, _order_key(candidate.strategy))


def search(problem: Problem, rules: Rules, top: int = 3,
           progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """The best plan and up to `top - 1` alternatives; raises `Infeasible`."""
    started = time.perf_counter()
    space, why = enumerate_space(problem, rules)
    if not space:
        raise Infeasible(f"no strategy satisfies the rules and the cluster ({why.summary()})")
    modes = recompute_modes(problem, rules)
    usable = usable_memory_bytes(problem, rules.memory_headroom)

    cache: dict[tuple, UnitCosts] = {}
    scored = []
    pruned_memory = 0
    closest: tuple[float, Strategy] | None = None
    for strategy in space:
        key = unit_key(strategy)
        if key not in cache:
            cache[key] = unit_costs(problem, strategy)
        bound = bounds.quick(problem, cache[key], strategy, modes, usable)
        if bound.memory_bytes > usable:
            pruned_memory += 1
            if closest is None or bound.memory_bytes < closest[0]:
                closest = (bound.memory_bytes, strategy)
            continue
        primary = bound.memory_bytes if rules.objective == "memory" else bound.time_s
        scored.append((primary, _order_key(strategy), strategy))
    scored.sort(key=lambda item: item[:2])

    found: list[Candidate] = []
    solves = infeasible = refined = 0
    for done, (primary, _, strategy) in enumerate(scored):
        if progress:
            progress(done, len(scored))
        if len(found) >= top:
            kth = found[top - 1].estimate
            if primary >= (kth.peak_memory_bytes if rules.objective == "memory" else kth.step_time_s):
                break
        units = cache[unit_key(strategy)]
        if len(found) >= top and rules.objective == "time":
            if bounds.balanced(problem, units, strategy, modes, usable) >= found[top - 1].estimate.step_time_s:
                refined += 1
                continue
        solves += 1
        cutoff = found[top - 1].estimate.step_time_s if len(found) >= top else None
        solution = solve_partition(problem, units, strategy, modes, rules.memory_headroom,
                                   rules.max_stage_imbalance, rules.objective, cutoff)
        if solution is None:
            infeasible += cutoff is None
            if closest is None:
                closest = (float("inf"), strategy)
            continue
        found.append(Candidate(solution.strategy, estimate(problem, solution.strategy, units), solution.gap))
        found.sort(key=lambda c: _score(c, rules.objective))
        del found[top:]
    if progress:
        progress(len(scored), len(scored))
    if not found:
        raise Infeasible(_memory_reason(problem, rules, closest[1] if closest else space[0], modes),
                         closest[1] if closest else space[0])
    stats = SearchStats(
        candidates=len(space), pruned_memory=pruned_memory, pruned_bound=len(scored) - solves,
        ilp_solves=solves, ilp_infeasible=infeasible, gap=found[0].gap,
        seconds=time.perf_counter() - started,
    )
    return SearchResult(found[0], tuple(found[1:]), stats)


def _memory_reason(problem: Problem, rules: Rules, strategy: Strategy, modes: tuple[str, ...]) -> str:
    """The binding memory constraint of the closest candidate, with its numbers: its
    even partition at the most frugal allowed recompute mode."""
    gib = 1 << 30
    frugal = "full" if "full" in modes else ("selective" if "selective" in modes else "none")
    layers = problem.model.num_hidden_layers
    s = strategy.with_stages(even_stages(layers, strategy.pp, strategy.vpp, frugal))
    e = estimate(problem, s)
    gpu = problem.cluster.gpu
    usable = usable_memory_bytes(problem, rules.memory_headroom)
    need = e.peak_memory_bytes
    if need <= usable:
        return (f"max_stage_imbalance {rules.max_stage_imbalance:g} binds: no partition of {layers} layers "
                f"over pp {strategy.pp} keeps the slowest stage that close to the mean")
    return (f"stage {e.peak_memory_rank} needs {need / gib:.1f} GiB, {gpu.name} has "
            f"{gpu.memory_bytes / gib:.0f} GiB ({usable / gib:.1f} GiB usable with memory_headroom "
            f"{rules.memory_headroom:g}); closest: {describe(s)} recompute={frugal}")




def suggest_relaxation(problem: Problem, rules: Rules) -> str | None:
    """The first relaxation, in order of cost to the user, under which a plan exists:
    unpin recomputation, unpin the ZeRO stage, unpin the micro-batch size, or more GPUs
    (doubling up to 16x)."""
    pinned = dict(rules.pinned)
    tries = []
    for knob, label in (("recompute", "allow recompute (drop recompute={})"),
                        ("zero", "allow other ZeRO stages (drop zero={})"),
                        ("mbs", "allow other micro-batch sizes (drop mbs={})")):
        if knob in pinned:
            relaxed = replace(rules, pinned={k: v for k, v in pinned.items() if k != knob},
                              allowed={k: v for k, v in rules.allowed.items() if k != knob})
            tries.append((label.format(pinned[knob]), problem, relaxed))
    cluster = problem.cluster
    for factor in (2, 4, 8, 16):
        bigger = replace(problem, cluster=replace(cluster, num_nodes=cluster.num_nodes * factor))
        tries.append((f"use {cluster.num_gpus * factor} GPUs ({cluster.num_nodes * factor} nodes)", bigger, rules))
    for label, p, r in tries:
        try:
            found = search(p, r, top=1)
        except Infeasible:
            continue
        e = found.best.estimate
        return f"{label}: {describe(found.best.strategy)} fits at {e.peak_memory_bytes / (1 << 30):.1f} GiB"
    return None
