"""The search for traced models (`costmodel.estimate.traced`): every dp x pp split of the
cluster (tp 1: a traced node's linears are named, not known to be splittable as a
pair), micro-batch size, schedule and ZeRO stage the rules admit, and for each the
stage partition.

The partition is the linear partition problem over the nodes in execution order (a
topological order, so every stage only feeds later ones): cut the sequence into pp
contiguous stages minimising the slowest stage, solved exactly by dynamic programming
over prefixes (Bokhari 1988, "Partitioning problems in parallel, pipelined and
distributed computing", §3), each stage recomputing the fewest of its first nodes that
make it fit in memory. The pipeline's time is (m - 1) x slowest + sum of the stages
(`costmodel.terms.pipeline`), and the sum hardly moves with the cuts, so the slowest stage is
what the cuts decide. Candidates are taken in order of a lower bound (perfectly
balanced stages) and the search stops once the bound cannot beat the K-th best plan.
"""

from __future__ import annotations

import time

from costmodel.estimate import Estimate, estimate
from costmodel.estimate.traced import (
    TracedUnits,
    optimizer_step_s,
    stage_memory,
    stage_work,
    traced_units,
)
from costmodel.problem import TracedProblem
from costmodel.specs.loading import SpecError
from costmodel.strategy import Stage, Strategy
from costmodel.terms.pipeline import pipeline_coefficients
from costmodel.units import GIB
from planner.rules import Rules
from planner.search.partition import memory_limits, usable_memory_bytes
from planner.search.result import Candidate, Infeasible, SearchResult, SearchStats
from planner.search.space import describe, enumerate_traced

UNSUPPORTED = {"tp": 1, "vpp": 1, "ep": 1, "sp": False, "cp": 1}


def check_fix_traced(problem: TracedProblem, fix: dict) -> None:
    """Pins a traced model cannot take (exit code 2)."""
    for knob, value in UNSUPPORTED.items():
        if knob in fix and fix[knob] != value:
            raise SpecError(f"fix {knob}", f"a traced module is planned over dp and pp only; {knob} must be "
                                           f"{value} (tensor and expert parallelism need a model spec: a "
                                           f"built-in model or a Hugging Face config)")
    if fix.get("schedule") not in (None, "gpipe", "1f1b"):
        raise SpecError("fix schedule", "a traced module runs one stage per pipeline rank: gpipe or 1f1b")
    n = problem.cluster.num_gpus
    if "pp" in fix and fix["pp"] > problem.model.num_nodes:
        raise SpecError("fix pp", f"{fix['pp']} stages for the {problem.model.num_nodes} blocks of the module")
    for knob in ("dp", "pp"):
        if knob in fix and n % fix[knob]:
            raise SpecError(f"fix {knob}", f"{fix[knob]} does not divide the {n} GPUs of the cluster")


def _lower_bound_s(problem: TracedProblem, units: TracedUnits, strategy: Strategy) -> float:
    """Step time if the stages were perfectly balanced, with no recompute, no sends and
    no exposed gradient sync."""
    whole = Stage(0, 0, 0, problem.model.num_nodes)
    work = stage_work(units, whole)
    total = work.compute_s + work.dp_comm_s
    a, c = pipeline_coefficients(strategy.schedule, strategy.num_microbatches)
    return (a / strategy.pp + c) * total + optimizer_step_s(problem, units, strategy, whole) / strategy.pp


def _recompute_counts(rules: Rules, num_nodes: int) -> tuple[int, int] | None:
    """The range of how many of a stage's first nodes may recompute."""
    none, full = rules.permits("recompute", "none"), rules.permits("recompute", "full")
    if not (none or full):
        return None
    return (0 if none else num_nodes, num_nodes if full else 0)


def _fit_stage(problem, units, strategy, rules, usable, pp_rank, first, end) -> Stage | None:
    """The stage of nodes [first, end) that fits with the fewest recomputed nodes
    (recomputing more only adds time), by bisection: each recomputed node trades its
    saved tensors for its inputs, so memory falls as more of them recompute."""
    counts = _recompute_counts(rules, end - first)
    if counts is None:
        return None

    def fits(full: int) -> bool:
        stage = Stage(pp_rank, pp_rank, first, end - first, full)
        return stage_memory(problem, units, strategy, stage).total_bytes <= usable

    low, high = counts
    if not fits(high):
        return None
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return Stage(pp_rank, pp_rank, first, end - first, high)


def partition(problem: TracedProblem, units: TracedUnits, strategy: Strategy, rules: Rules,
              usable: float) -> tuple[Stage, ...] | None:
    """Stages minimising (slowest stage, sum of stages) by dynamic programming over
    prefixes: best[r][j] is the best way to put nodes [0, j) on ranks 0 .. r-1. For each
    end the starts are tried nearest first; a stage only grows slower as its start moves
    back, so the loop stops once the stage alone is slower than the best found."""
    n, pp = problem.model.num_nodes, strategy.pp
    best: list[dict[int, tuple[float, float, tuple[Stage, ...]]]] = [{0: (0.0, 0.0, ())}]
    for r in range(pp):
        row: dict[int, tuple[float, float, tuple[Stage, ...]]] = {}
        ends = [n] if r == pp - 1 else range(r + 1, n - (pp - r - 1) + 1)
        for end in ends:
            for first in range(end - 1, -1, -1):
                plain = stage_work(units, Stage(r, r, first, end - first)).total_s
                if end in row and plain > row[end][0]:
                    break
                if first not in best[r]:
                    continue
                slowest, total, stages = best[r][first]
                stage = _fit_stage(problem, units, strategy, rules, usable, r, first, end)
                if stage is None:
                    continue
                t = stage_work(units, stage).total_s
                value = (max(slowest, t), total + t, stages + (stage,))
                if end not in row or value[:2] < row[end][:2]:
                    row[end] = value
        best.append(row)
    final = best[pp].get(n)
    return final[2] if final else None


def search_traced(problem: TracedProblem, rules: Rules, top: int = 3) -> SearchResult:
    """The best plan for a traced model and up to `top - 1` alternatives; raises Infeasible."""
    started = time.perf_counter()
    space, why = enumerate_traced(problem, rules)
    if not space:
        raise Infeasible(f"no strategy satisfies the rules and the cluster ({why.summary()})")
    usable = usable_memory_bytes(problem, rules)
    scored = []
    for strategy in space:
        units = traced_units(problem, strategy)
        scored.append((_lower_bound_s(problem, units, strategy), describe(strategy), strategy, units))
    scored.sort(key=lambda item: item[:2])

    found: list[tuple[tuple, Candidate]] = []
    solves = infeasible = 0
    for bound, label, strategy, units in scored:
        if len(found) >= top and rules.objective == "time" and bound >= found[top - 1][1].estimate.step_time_s:
            break
        solves += 1
        stages = partition(problem, units, strategy, rules, usable)
        if stages is None:
            infeasible += 1
            continue
        chosen = strategy.with_stages(stages)
        e: Estimate = estimate(problem, chosen, units)
        primary = (e.step_time_s, e.peak_memory_bytes)
        if rules.objective == "memory":
            primary = primary[::-1]
        found.append(((*primary, label), Candidate(chosen, e, 0.0)))
        found.sort(key=lambda item: item[0])
        del found[top:]
    if not found:
        # The split that spreads the states thinnest: most stages, then ZeRO 3.
        thinnest = max(space, key=lambda st: (st.pp * (st.dp if st.zero_stage == 3 else 1), st.zero_stage))
        raise Infeasible(_memory_reason(problem, rules, thinnest), thinnest)
    stats = SearchStats(candidates=len(space), pruned_memory=infeasible, pruned_bound=len(space) - solves,
                        ilp_solves=solves, ilp_infeasible=infeasible, gap=0.0,
                        seconds=time.perf_counter() - started)
    return SearchResult(found[0][1], tuple(c for _, c in found[1:]), stats)


def _memory_reason(problem: TracedProblem, rules: Rules, strategy: Strategy) -> str:
    """The binding memory constraint, with the numbers of the split that spreads the
    module thinnest, its nodes spread evenly and all recomputed where allowed."""
    units = traced_units(problem, strategy)
    n, pp = problem.model.num_nodes, strategy.pp
    size, extra = divmod(n, pp)
    need = 0.0
    first = 0
    for r in range(pp):
        count = size + (r < extra)
        full = count if rules.permits("recompute", "full") else 0
        need = max(need, stage_memory(problem, units, strategy, Stage(r, r, first, count, full)).total_bytes)
        first += count
    gpu, usable = problem.cluster.gpu, usable_memory_bytes(problem, rules)
    return (f"memory binds: {describe(strategy)} needs {need / GIB:.2f} GiB on its fullest stage, {gpu.name} "
            f"has {gpu.memory_bytes / GIB:.1f} GiB ({usable / GIB:.2f} GiB usable with "
            f"{memory_limits(problem, rules)}); more GPUs, or devices with more memory, would relax it")
