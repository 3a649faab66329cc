"""The search for a transformer on one kind of GPU: enumerate the space, bound every candidate (`planner.search.bounds`), and solve
the partition program (`planner.search.partition`) only for candidates whose bound can still
beat the K-th best plan found. Candidates are taken in order of their quick bound, so
the search stops at the first quick bound no better than the K-th best; on the way, a
tighter bound that balances layers under memory skips the program for more of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from costmodel.estimate import estimate
from costmodel.estimate.uniform import UnitCosts, unit_costs
from costmodel.problem import Problem
from costmodel.strategy import Strategy, even_stages
from costmodel.units import GIB
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
from planner.search.space import Exclusions, describe, enumerate_space, recompute_modes


def unit_key(strategy: Strategy) -> tuple:
    """What `unit_costs` depends on: not vpp, nor the schedule but whether it pairs
    forward and backward chunks (dualpipev: the expert exchange hidden behind the pair,
    costmodel.terms.pipeline.paired_share of the micro-batches, which dp and mbs fix)."""
    s = strategy
    return (s.dp, s.tp, s.pp, s.micro_batch_size, s.ep, s.expert_tp, s.zero_stage, s.sequence_parallel,
            s.schedule == "dualpipev")


def context_parallel_wanted(problem: Problem, space: list[Strategy], units_of: Callable[[Strategy], UnitCosts],
                            usable_bytes: float, smallest_mbs: int) -> Callable[[int, int, int, int], bool]:
    """Whether the search offers context parallelism at a (tp, pp, ZeRO stage, micro-batch
    size).

    cp > 1 buys activation memory (a rank holds s / cp of each sequence) and pays with
    the K/V exchange and GEMMs cp times shorter; its twin without cp (cp folded into dp:
    the same GPUs, the same model states per rank) wins wherever that memory is not
    needed. So cp is offered at a (tp, pp, ZeRO) of `space` (the cp 1 candidates) where
    the smallest micro-batch does not fit without recomputing but the model states do,
    and at every (tp, pp, ZeRO) that has no cp 1 candidate (a batch too small for the
    replicas); and only at the smallest micro-batch, since cp is there to split what the
    smallest micro-batch holds (a larger one under cp holds what a smaller cp would).
    Not chased: the smaller pipeline bubble of the cp plan's cp times more micro-batches."""
    wanted: set[tuple] = set()
    seen: set[tuple] = set()
    for strategy in space:
        key = (strategy.tp, strategy.pp, strategy.zero_stage)
        if strategy.micro_batch_size != smallest_mbs or key in seen:
            continue
        seen.add(key)
        units = units_of(strategy)
        plain = bounds.quick(problem, units, strategy, ("none",), usable_bytes).memory_bytes
        if plain > usable_bytes and bounds.states_memory_bytes(problem, units, strategy) <= usable_bytes:
            wanted.add(key)
    def offered(tp: int, pp: int, zero: int, mbs: int) -> bool:
        key = (tp, pp, zero)
        return mbs == smallest_mbs and (key in wanted or key not in seen)

    return offered


def searched_space(problem: Problem, rules: Rules,
                   units_of: Callable[[Strategy], UnitCosts]) -> tuple[list[Strategy], Exclusions]:
    """The candidates the search considers and why others were left out: the space
    without context parallelism, and the cp > 1 strategies `context_parallel_wanted`
    offers (all of them when the rules pin cp or forbid cp 1)."""
    space, why = enumerate_space(problem, rules, context_parallel=False)
    if "cp" in rules.pinned or not rules.permits("cp", 1):
        def wanted(tp: int, pp: int, zero: int, mbs: int) -> bool:
            return True   # every degree the rules admit
    else:
        wanted = context_parallel_wanted(problem, space, units_of, usable_memory_bytes(problem, rules),
                                         rules.micro_batch_min)
    with_cp, cp_why = enumerate_space(problem, rules, cp_wanted=wanted)
    why.reasons.update(cp_why.reasons)
    why.rule_reasons.update(cp_why.rule_reasons)
    return space + with_cp, why


def search_uniform(problem: Problem, rules: Rules, top: int = 3,
                   progress: Callable[[int, int], None] | None = None, pareto: bool = False) -> SearchResult:
    """The best plans for a transformer on one kind of GPU; as `planner.search.search`."""
    started = time.perf_counter()
    check_specs(problem, rules, pareto)
    modes = recompute_modes(problem, rules)
    usable = usable_memory_bytes(problem, rules)
    objective = rules.objective
    budgeted = any(getattr(rules, key) is not None for key in BUDGETS)
    cache: dict[tuple, UnitCosts] = {}

    def units_of(strategy: Strategy) -> UnitCosts:
        key = unit_key(strategy)
        if key not in cache:
            cache[key] = unit_costs(problem, strategy)
        return cache[key]

    space, why = searched_space(problem, rules, units_of)
    if not space:
        raise Infeasible(f"no strategy satisfies the rules and the cluster ({why.summary()})")

    scored = []
    pruned_memory = 0
    closest: tuple[float, Strategy] | None = None
    for strategy in space:
        bound = bounds.quick(problem, units_of(strategy), strategy, modes, usable)
        if bound.memory_bytes > usable:
            pruned_memory += 1
            if closest is None or bound.memory_bytes < closest[0]:
                closest = (bound.memory_bytes, strategy)
            continue
        primary = (bound.memory_bytes if objective == "memory"
                   else bound.time_s * time_bound_scale(problem, strategy, objective))
        scored.append((primary, order_key(strategy), strategy))
    scored.sort(key=lambda item: item[:2])

    kept = Kept(top, lambda c: score(problem, c, objective), budgeted or pareto)
    found = kept.found

    def solve(strategy: Strategy, cutoff_s: float | None) -> Candidate | TimedOut | None:
        units = cache[unit_key(strategy)]
        solution = solve_partition(problem, units, strategy, modes, rules, "memory" if objective == "memory" else "time",
                                   cutoff_s)
        return as_candidate(solution, lambda s: estimate(problem, s, units))

    solved = solve_in_bound_order(
        problem, rules, scored, kept, top, pareto,
        refine=lambda s: bounds.balanced(problem, cache[unit_key(s)], s, modes, usable),
        solve=solve, progress=progress)
    if solved.unsolved is not None:
        # It passed the memory bound, so it came nearer than any candidate pruned by it.
        closest = (0.0, solved.unsolved)
    kept.check_budgets(rules)
    check_timeouts(kept, solved)
    if not found:
        raise Infeasible(_memory_reason(problem, rules, closest[1] if closest else space[0], modes),
                         closest[1] if closest else space[0])
    return finish(problem, rules, kept, pareto, len(space), pruned_memory, len(scored), solved, started)


def _memory_reason(problem: Problem, rules: Rules, strategy: Strategy, modes: tuple[str, ...]) -> str:
    """The binding memory constraint of the closest candidate, with its numbers: its
    even partition at the most frugal allowed recompute mode."""
    frugal = "full" if "full" in modes else ("selective" if "selective" in modes else "none")
    layers = problem.model.num_hidden_layers
    s = strategy.with_stages(even_stages(layers, strategy.pp, strategy.vpp, frugal, strategy.schedule))
    e = estimate(problem, s)
    gpu = problem.cluster.gpu
    usable = usable_memory_bytes(problem, rules)
    need = e.peak_memory_bytes
    if need <= usable:
        return (f"max_stage_imbalance {rules.max_stage_imbalance:g} binds: no partition of {layers} layers "
                f"over pp {strategy.pp} keeps the slowest stage that close to the mean")
    return (f"stage {e.peak_memory_rank} needs {need / GIB:.1f} GiB, {gpu.name} has "
            f"{gpu.memory_bytes / GIB:.0f} GiB ({usable / GIB:.1f} GiB usable with "
            f"{memory_limits(problem, rules)}); closest: {describe(s)} recompute={frugal}")
