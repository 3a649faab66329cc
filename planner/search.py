"""The search: enumerate the space, bound every candidate (`planner.bounds`), and solve
the partition program (`planner.partition`) only for candidates whose bound can still
beat the K-th best plan found. Candidates are taken in order of their quick bound, so
the search stops at the first quick bound no better than the K-th best; on the way, a
tighter bound that balances layers under memory skips the program for more of them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from costmodel.estimate.energy import SECONDS_PER_HOUR, CostEnergy, cost_energy, energy_lower_bound_j, require
from costmodel.estimate import Estimate, estimate
from costmodel.estimate.uniform import UnitCosts
from costmodel.estimate.uniform import unit_costs
from costmodel.specs import MixedClusterSpec
from costmodel.problem import Problem
from costmodel.strategy import Strategy, even_stages
from planner import bounds
from planner.partition import solve_partition, usable_memory_bytes
from planner.rules import BUDGETS, Rules
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
    pareto: tuple[Candidate, ...] = ()   # with search(pareto=True): the front, by step time


class Infeasible(Exception):
    """No strategy fits. `reason` names the binding constraint with its numbers;
    `closest` is the candidate that came nearest (if any) for the relaxation search."""

    def __init__(self, reason: str, closest: Strategy | None = None, relaxation: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.closest = closest
        self.relaxation = relaxation   # set when a budget binds: what would relax it


def unit_key(strategy: Strategy) -> tuple:
    """What `unit_costs` depends on (not the schedule, vpp or micro-batch count)."""
    s = strategy
    return (s.dp, s.tp, s.pp, s.micro_batch_size, s.ep, s.zero_stage, s.sequence_parallel)


def _order_key(strategy: Strategy) -> tuple:
    s = strategy
    return (s.tp, s.pp, s.dp, s.ep, s.micro_batch_size, s.schedule, s.vpp, s.zero_stage, s.sequence_parallel)


def _metric(problem: Problem, candidate: Candidate, objective: str) -> float:
    """The objective's figure of a candidate: seconds, bytes, USD or J per step."""
    e = candidate.estimate
    if objective == "memory":
        return e.peak_memory_bytes
    if objective == "time":
        return e.step_time_s
    figures = cost_energy(problem.cluster, candidate.strategy, e)
    return figures.cost_per_step_usd if objective == "cost" else figures.energy_per_step_j


def _score(problem: Problem, candidate: Candidate, objective: str) -> tuple:
    e = candidate.estimate
    if objective == "memory":
        return (e.peak_memory_bytes, e.step_time_s, _order_key(candidate.strategy))
    if objective == "time":
        return (e.step_time_s, e.peak_memory_bytes, _order_key(candidate.strategy))
    return (_metric(problem, candidate, objective), e.step_time_s, e.peak_memory_bytes,
            _order_key(candidate.strategy))


def _time_bound_scale(problem: Problem, strategy: Strategy, objective: str) -> float:
    """k such that k * (a lower bound of the step time) is a lower bound of the objective,
    for every partition of `strategy`, so the time bounds prune cost and energy too.
    Cost is step_time * gpus * price / 3600 (costmodel.energy), exactly proportional.
    Energy is not proportional to the step time (the busy share varies with the
    partition and recomputation), but every device draws at least idle power for the
    whole step, so gpus * idle_power_w is a valid, if loose, factor
    (costmodel.energy.energy_lower_bound_j). A zero factor prunes nothing."""
    if objective == "cost":
        return strategy.num_gpus * problem.cluster.gpu_hour_price_usd / SECONDS_PER_HOUR
    if objective == "energy":
        return energy_lower_bound_j(problem.cluster, strategy.num_gpus, 1.0)
    return 1.0


def _check_specs(problem: Problem, rules: Rules, pareto: bool) -> None:
    """SpecError naming the missing price or power field an objective, a budget or
    --pareto needs."""
    cluster = problem.cluster
    for needed, asks in ((rules.objective == "cost", "--objective cost"),
                         (rules.max_cost_per_step_usd is not None, "--max-cost-per-step"),
                         (pareto, "--pareto")):
        if needed:
            require(cluster, price=True, why=asks)
    for needed, asks in ((rules.objective == "energy", "--objective energy"),
                         (rules.power_cap_w is not None, "--power-cap"),
                         (rules.energy_budget_j is not None, "--energy-budget"),
                         (pareto, "--pareto")):
        if needed:
            require(cluster, power=True, why=asks)


# Budget -> (the CostEnergy figure it caps, unit).
_BUDGET_FIGURES = {
    "max_cost_per_step_usd": ("cost_per_step_usd", "USD per step"),
    "power_cap_w": ("max_device_power_w", "W on the busiest device"),
    "energy_budget_j": ("energy_per_step_j", "J per step"),
}


def _at_least(value: float) -> str:
    """`value` in 6 significant digits, rounded up (a relaxation to it must suffice)."""
    if value <= 0:
        return f"{value:g}"
    unit = 10.0 ** (math.floor(math.log10(value)) - 5)
    up = math.ceil(value / unit) * unit
    while float(f"{up:.6g}") < value:
        up += unit
    return f"{up:.6g}"


def _over_budget(rules: Rules, figures: CostEnergy) -> tuple[str, ...]:
    """The budgets (rules field names) a candidate breaks."""
    return tuple(key for key, (figure, _) in _BUDGET_FIGURES.items()
                 if getattr(rules, key) is not None and getattr(figures, figure) > getattr(rules, key))


def _budget_reason(rules: Rules, dropped: list[tuple[tuple[str, ...], CostEnergy, Strategy]]) -> tuple[str, str]:
    """The binding budget and its relaxation: for the first budget that some candidate
    breaks alone (meeting every other budget), the least it would have to be raised to."""
    for key, (figure, unit) in _BUDGET_FIGURES.items():
        alone = [(getattr(f, figure), _order_key(s), s) for over, f, s in dropped if over == (key,)]
        if alone:
            value, _, strategy = min(alone)
            option = BUDGETS[key]
            return (f"{option} {getattr(rules, key):g} binds: the best of {len(dropped)} plans that fit "
                    f"memory needs {_at_least(value)} {unit} ({describe(strategy)})",
                    f"raise {option} to {_at_least(value)}")
    keys = sorted({k for over, _, _ in dropped for k in over})
    return (f"no plan that fits memory meets {' and '.join(BUDGETS[k] for k in keys)} together "
            f"({len(dropped)} plans tried)", f"drop one of {', '.join(BUDGETS[k] for k in keys)}")


@dataclass
class Kept:
    """What a search keeps of the candidates it solves: the best `top` by `key`; with
    `track` (budgets apply, or the Pareto front is asked for) also every candidate
    within budget and, with the budgets they break, those over it."""

    top: int
    key: Callable[[Candidate], tuple]
    track: bool
    found: list[Candidate] = field(default_factory=list)
    evaluated: list[Candidate] = field(default_factory=list)
    dropped: list[tuple[tuple[str, ...], CostEnergy, Strategy]] = field(default_factory=list)

    def add(self, problem: Problem, rules: Rules, candidate: Candidate) -> None:
        if self.track:
            figures = cost_energy(problem.cluster, candidate.strategy, candidate.estimate)
            over = _over_budget(rules, figures)
            if over:
                self.dropped.append((over, figures, candidate.strategy))
                return
            self.evaluated.append(candidate)
        self.found.append(candidate)
        self.found.sort(key=self.key)
        del self.found[self.top:]

    def check_budgets(self, rules: Rules) -> None:
        """Infeasible naming the binding budget when every candidate that fit broke one."""
        if not self.found and self.dropped:
            reason, relaxation = _budget_reason(rules, self.dropped)
            raise Infeasible(reason, self.dropped[0][2], relaxation)


def kth_best(problem: Problem, found: list[Candidate], top: int, pareto: bool, objective: str) -> float | None:
    """The objective figure of the K-th best plan found so far, once there are K (and
    the search prunes: not when it gathers the Pareto front); None before."""
    if len(found) < top or pareto:
        return None
    return _metric(problem, found[top - 1], objective)


def pareto_front(problem: Problem, candidates: list[Candidate]) -> tuple[Candidate, ...]:
    """The candidates no other candidate beats on all of step time, cost and energy per
    step (at least as good on all three, better on one), by step time."""
    points = []
    for c in candidates:
        f = cost_energy(problem.cluster, c.strategy, c.estimate)
        points.append(((c.estimate.step_time_s, f.cost_per_step_usd, f.energy_per_step_j), c))

    def beaten(p):
        return any(all(a <= b for a, b in zip(q, p)) and q != p for q, _ in points)

    front = [(p, c) for p, c in points if not beaten(p)]
    front.sort(key=lambda pc: (*pc[0], _order_key(pc[1].strategy)))
    return tuple(c for _, c in front)


def search(problem: Problem, rules: Rules, top: int = 3,
           progress: Callable[[int, int], None] | None = None, pareto: bool = False) -> SearchResult:
    """The best plan and up to `top - 1` alternatives; raises `Infeasible`, or SpecError
    when the objective, a budget or `pareto` needs a price or power figure the cluster
    lacks. With `pareto`, every candidate that fits is solved (no bound pruning) and
    the result carries the Pareto front of (step time, cost, energy)."""
    if isinstance(problem.cluster, MixedClusterSpec):
        # Imported here: the mixed search ranks candidates with this module's functions.
        from planner.mixed_search import search_mixed
        return search_mixed(problem, rules, top, progress, pareto)
    started = time.perf_counter()
    _check_specs(problem, rules, pareto)
    space, why = enumerate_space(problem, rules)
    if not space:
        raise Infeasible(f"no strategy satisfies the rules and the cluster ({why.summary()})")
    modes = recompute_modes(problem, rules)
    usable = usable_memory_bytes(problem, rules.memory_headroom)
    objective = rules.objective
    budgeted = any(getattr(rules, key) is not None for key in BUDGETS)

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
        primary = (bound.memory_bytes if objective == "memory"
                   else bound.time_s * _time_bound_scale(problem, strategy, objective))
        scored.append((primary, _order_key(strategy), strategy))
    scored.sort(key=lambda item: item[:2])

    kept = Kept(top, lambda c: _score(problem, c, objective), budgeted or pareto)
    found = kept.found
    solves = infeasible = refined = 0
    for done, (primary, _, strategy) in enumerate(scored):
        if progress:
            progress(done, len(scored))
        kth = kth_best(problem, found, top, pareto, objective)
        prune = kth is not None
        if prune and primary >= kth:
            break
        units = cache[unit_key(strategy)]
        scale = 1.0 if objective == "memory" else _time_bound_scale(problem, strategy, objective)
        if prune and objective != "memory" and scale > 0:
            if bounds.balanced(problem, units, strategy, modes, usable) * scale >= kth:
                refined += 1
                continue
        solves += 1
        if not prune:
            cutoff = None
        elif objective == "memory":
            cutoff = found[top - 1].estimate.step_time_s   # unused by the memory program
        else:
            # A partition slower than kth / scale has an objective of at least kth.
            cutoff = kth / scale if scale > 0 else None
        solution = solve_partition(problem, units, strategy, modes, rules.memory_headroom,
                                   rules.max_stage_imbalance, "memory" if objective == "memory" else "time",
                                   cutoff)
        if solution is None:
            infeasible += cutoff is None
            if closest is None:
                closest = (float("inf"), strategy)
            continue
        kept.add(problem, rules, Candidate(solution.strategy, estimate(problem, solution.strategy, units),
                                           solution.gap))
    if progress:
        progress(len(scored), len(scored))
    kept.check_budgets(rules)
    if not found:
        raise Infeasible(_memory_reason(problem, rules, closest[1] if closest else space[0], modes),
                         closest[1] if closest else space[0])
    stats = SearchStats(
        candidates=len(space), pruned_memory=pruned_memory, pruned_bound=len(scored) - solves,
        ilp_solves=solves, ilp_infeasible=infeasible, gap=found[0].gap,
        seconds=time.perf_counter() - started,
    )
    front = pareto_front(problem, kept.evaluated) if pareto else ()
    return SearchResult(found[0], tuple(found[1:]), stats, front)


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
