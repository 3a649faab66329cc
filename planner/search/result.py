"""What every search shares: the candidates it solves (`Candidate`), what it returns
(`SearchResult`, `SearchStats`), `Infeasible`, and how candidates are scored against the
rules' objective and budgets, kept (`Kept`: the best K, the Pareto front) and pruned.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from costmodel.estimate import Estimate
from costmodel.estimate.energy import (
    SECONDS_PER_HOUR,
    CostEnergy,
    cost_energy,
    energy_lower_bound_j,
    require,
)
from costmodel.problem import Problem
from costmodel.specs import MixedClusterSpec
from costmodel.strategy import Strategy
from planner.rules import BUDGETS, Rules
from planner.search import partition
from planner.search.partition import Solution, TimedOut
from planner.search.space import describe


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy     # with stages
    estimate: Estimate
    gap: float             # the partition program's proven gap
    timed_out: bool = False   # the solver's time limit ended its partition program



def as_candidate(solution: Solution | TimedOut | None,
                 cost: Callable[[Strategy], Estimate]) -> Candidate | TimedOut | None:
    """A partition program's answer as a search candidate, its strategy costed in full
    by `cost`."""
    if solution is None or isinstance(solution, TimedOut):
        return solution
    return Candidate(solution.strategy, cost(solution.strategy), solution.gap, solution.timed_out)


@dataclass(frozen=True)
class SearchStats:
    candidates: int        # strategies in the space
    pruned_memory: int     # dropped by the memory bound
    pruned_bound: int      # never solved: their time bound could not beat the K-th best
    ilp_solves: int
    ilp_infeasible: int    # solved, but no partition fits
    gap: float             # proven gap of the best plan to the best of the whole space
    seconds: float         # wall time; shown on the console, kept out of plan files
    solver_timeouts: int = 0   # partition programs the solver's time limit ended



@dataclass(frozen=True)
class SearchResult:
    best: Candidate
    alternatives: tuple[Candidate, ...]
    stats: SearchStats
    pareto: tuple[Candidate, ...] = ()   # with search(pareto=True): the front, by step time



class Infeasible(Exception):
    """No strategy fits. `reason` names the binding constraint with its numbers;
    `closest` is the candidate that came nearest (if any) for the relaxation search;
    `solver_limited` when the solver's time limit, not the space, left no plan (a larger
    cluster would not help: its programs are no easier)."""

    def __init__(self, reason: str, closest: Strategy | None = None, relaxation: str | None = None,
                 solver_limited: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.closest = closest
        self.relaxation = relaxation   # set when a budget binds: what would relax it
        self.solver_limited = solver_limited



def order_key(strategy: Strategy) -> tuple:
    s = strategy
    return (s.tp, s.pp, s.dp, s.ep, -s.expert_tp, s.micro_batch_size, s.schedule, s.vpp, s.zero_stage, s.sequence_parallel, s.cp)



def metric(problem: Problem, candidate: Candidate, objective: str) -> float:
    """The objective's figure of a candidate: seconds, bytes, USD or J per step."""
    e = candidate.estimate
    if objective == "memory":
        return e.peak_memory_bytes
    if objective == "time":
        return e.step_time_s
    figures = cost_energy(problem.cluster, candidate.strategy, e)
    return figures.cost_per_step_usd if objective == "cost" else figures.energy_per_step_j



def score(problem: Problem, candidate: Candidate, objective: str) -> tuple:
    e = candidate.estimate
    if objective == "memory":
        return (e.peak_memory_bytes, e.step_time_s, order_key(candidate.strategy))
    if objective == "time":
        return (e.step_time_s, e.peak_memory_bytes, order_key(candidate.strategy))
    return (metric(problem, candidate, objective), e.step_time_s, e.peak_memory_bytes,
            order_key(candidate.strategy))



def time_bound_scale(problem: Problem, strategy: Strategy, objective: str) -> float:
    """k such that k * (a lower bound of the step time) is a lower bound of the objective,
    for every partition of `strategy`, so the time bounds prune cost and energy too.
    Cost is step_time * gpus * price / 3600 (costmodel.estimate.energy), exactly proportional.
    Energy is not proportional to the step time (the busy share varies with the
    partition and recomputation), but every device draws at least idle power for the
    whole step, so gpus * idle_power_w is a valid, if loose, factor
    (costmodel.estimate.energy.energy_lower_bound_j). A zero factor prunes nothing. On
    a mixed cluster: the placement's price per second exactly, or its devices' least
    idle power."""
    cluster = problem.cluster
    if isinstance(cluster, MixedClusterSpec):
        s = strategy
        groups = s.stage_groups or s.replica_groups
        if objective == "cost":
            per_set = s.dp * s.tp if s.stage_groups else s.tp
            return sum(per_set * cluster.group(n).gpu_hour_price_usd for n in groups) / SECONDS_PER_HOUR
        if objective == "energy":
            return s.num_gpus * min(cluster.group(n).gpu.idle_power_w for n in groups)
        return 1.0
    if objective == "cost":
        return strategy.num_gpus * problem.cluster.gpu_hour_price_usd / SECONDS_PER_HOUR
    if objective == "energy":
        return energy_lower_bound_j(problem.cluster, strategy.num_gpus, 1.0)
    return 1.0



def check_specs(problem: Problem, rules: Rules, pareto: bool) -> None:
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
        alone = [(getattr(f, figure), order_key(s), s) for over, f, s in dropped if over == (key,)]
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
    return metric(problem, found[top - 1], objective)



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
    front.sort(key=lambda pc: (*pc[0], order_key(pc[1].strategy)))
    return tuple(c for _, c in front)


@dataclass(frozen=True)
class Solved:
    """What the bound-ordered loop did: solves, those that proved no partition fits,
    those the solver's time limit ended, the first strategy that did not solve, and the
    least proven lower bound of the objective among the candidates it could not settle
    (solved with a gap, or timed out; inf when it settled every one)."""

    solves: int
    infeasible: int
    timeouts: int
    unsolved: Strategy | None
    least_bound: float


def solve_in_bound_order(problem: Problem, rules: Rules, scored: list[tuple[float, tuple, Strategy]], kept: Kept,
                         top: int, pareto: bool,
                         refine: Callable[[Strategy], float],
                         solve: Callable[[Strategy, float | None], Candidate | TimedOut | None],
                         progress: Callable[[int, int], None] | None) -> Solved:
    """The loop every search runs: solve the candidates in order of their bound
    (`scored`: (bound of the objective, order key, strategy), sorted) and keep the best,
    until no bound can beat the K-th best kept. `time_bound_scale` turns a step-time
    bound into a bound of the objective; `refine(s)` is a tighter step-time bound, tried
    before solving once there are K plans; `solve(s, cutoff_s)` is the candidate, None
    when no partition fits (or none runs faster than `cutoff_s`: a partition slower than
    kth / scale has an objective of at least kth), or TimedOut.

    Every candidate skipped has a bound no better than the K-th best, so the best kept
    is the best of the space up to the candidates the solver did not settle; their
    bounds make the gap that `finish` reports."""
    objective = rules.objective
    solves = infeasible = timeouts = 0
    unsolved = None
    least_bound = math.inf
    for done, (primary, _, s) in enumerate(scored):
        if progress:
            progress(done, len(scored))
        kth = kth_best(problem, kept.found, top, pareto, objective)
        prune = kth is not None
        if prune and primary >= kth:
            break
        k = time_bound_scale(problem, s, objective) if objective != "memory" else 1.0
        if prune and objective != "memory" and k > 0 and refine(s) * k >= kth:
            continue
        solves += 1
        cutoff = kth / k if prune and objective != "memory" and k > 0 else None
        candidate = solve(s, cutoff)
        if isinstance(candidate, TimedOut):
            timeouts += 1
            unsolved = unsolved or s
            if objective != "memory":
                least_bound = min(least_bound, k * max(candidate.bound_s, refine(s)))
            continue
        if candidate is None:
            infeasible += cutoff is None
            unsolved = unsolved or s
            continue
        timeouts += candidate.timed_out
        if candidate.gap > 0 and objective != "memory":
            least_bound = min(least_bound, metric(problem, candidate, objective) * (1 - candidate.gap))
        kept.add(problem, rules, candidate)
    if progress:
        progress(len(scored), len(scored))
    return Solved(solves, infeasible, timeouts, unsolved, least_bound)


def check_timeouts(kept: Kept, solved: Solved) -> None:
    """Infeasible saying so when no plan was found and the solver's time limit ended a
    program: a plan may exist; that is not the memory or the rules binding."""
    if not kept.found and solved.timeouts:
        raise Infeasible(f"the solver's time limit ({partition.DETERMINISTIC_TIME_LIMIT:g} deterministic s per partition "
                         f"program) ended {solved.timeouts} of {solved.solves} programs before any found a plan; "
                         f"narrow the space with --fix", solved.unsolved, solver_limited=True)


def finish(problem: Problem, rules: Rules, kept: Kept, pareto: bool, candidates: int, pruned_memory: int,
           bounded: int, solved: Solved, started_s: float) -> SearchResult:
    """The result of a bound-ordered search: the best plan kept, the runners-up, the
    counts (`bounded` candidates passed the memory bound; those not solved were pruned
    by the time bound), the gap of the best plan to the best of the whole space, and,
    on request, the Pareto front of all evaluated. Under the memory objective the gap
    is the best plan's own partition gap."""
    found = kept.found
    best = found[0]
    gap = best.gap
    if rules.objective != "memory":
        value = metric(problem, best, rules.objective)
        lower = min(value * (1 - best.gap), solved.least_bound)
        gap = max(0.0, (value - lower) / value) if value > 0 else 0.0
    stats = SearchStats(candidates=candidates, pruned_memory=pruned_memory, pruned_bound=bounded - solved.solves,
                        ilp_solves=solved.solves, ilp_infeasible=solved.infeasible, gap=gap,
                        seconds=time.perf_counter() - started_s, solver_timeouts=solved.timeouts)
    front = pareto_front(problem, kept.evaluated) if pareto else ()
    return SearchResult(found[0], tuple(found[1:]), stats, front)
