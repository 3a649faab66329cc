"""`search()`: the one entry point that finds the best strategies for a problem and the
next alternatives, for every kind of problem:

- a transformer the specs describe on one kind of GPU (`uniform`): enumerate the space
  (`space`), bound each candidate (`bounds`), place layers on stages with the partition
  program (`partition`) in order of bound, and stop once no bound can beat the K-th best;
- the same on a mixed cluster (`mixed`): the same loop over placements of stages or
  replicas on the groups;
- a traced nn.Module (`traced`): stages cut along the execution order.

All three score, keep and prune candidates the same way (`result`). `check_fix` and
`suggest_relaxation` dispatch the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from costmodel.problem import Problem, TracedProblem
from costmodel.specs import MixedClusterSpec
from costmodel.specs.loading import SpecError
from costmodel.units import GIB
from planner.rules import Rules
from planner.search.mixed import search_mixed
from planner.search.result import Candidate, Infeasible, SearchResult, SearchStats
from planner.search.space import check_fix_spec, describe
from planner.search.traced import check_fix_traced, search_traced
from planner.search.uniform import search_uniform

__all__ = ["Candidate", "Infeasible", "SearchResult", "SearchStats", "check_fix", "search", "suggest_relaxation"]


def search(problem: Problem | TracedProblem, rules: Rules, top: int = 3,
           progress: Callable[[int, int], None] | None = None, pareto: bool = False) -> SearchResult:
    """The best plan and up to `top - 1` alternatives; raises `Infeasible`, or SpecError
    when the objective, a budget or `pareto` needs a price or power figure the cluster
    lacks. With `pareto`, every candidate that fits is solved (no bound pruning) and
    the result carries the Pareto front of (step time, cost, energy)."""
    if isinstance(problem, TracedProblem):
        return search_traced(problem, rules, top)
    if isinstance(problem.cluster, MixedClusterSpec):
        return search_mixed(problem, rules, top, progress, pareto)
    return search_uniform(problem, rules, top, progress, pareto)


def check_fix(problem: Problem | TracedProblem, fix: dict) -> None:
    """Reject `--fix` pins that cannot work on this problem (SpecError, exit code 2)."""
    if isinstance(problem, TracedProblem):
        check_fix_traced(problem, fix)
        return
    if isinstance(problem.cluster, MixedClusterSpec) and fix.get("cp", 1) > 1:
        raise SpecError("--fix cp", f"{problem.cluster.name} is a mixed cluster, whose plans run cp 1")
    check_fix_spec(problem, fix)


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
        return f"{label}: {describe(found.best.strategy)} fits at {e.peak_memory_bytes / GIB:.1f} GiB"
    return None
