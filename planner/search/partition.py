"""The integer program: for one stage-less strategy, place the layers on pipeline ranks
and choose how many of each rank's layers recompute, minimising predicted step time
under per-device memory and the stage-imbalance rule. OR-tools CP-SAT.

The program reads the cost model rather than restating it: each rank's micro-batch
time, memory, gradient-sync and optimizer time are affine in its layer counts (N layers,
F of them fully recomputed, S selectively) plus one indicator (a rank that recomputes
keeps one layer's working activations), so their coefficients come from evaluating
`costmodel.estimate`'s own per-rank functions at a few layer counts. With t_r the rank
times and (a, c) the schedule's coefficients (`costmodel.terms.pipeline`):

    minimise  a * max_r t_r + c * sum_r t_r + max_r dp_exposed_r + max_r optimizer_r
    subject to  memory_r <= capacity * (1 - headroom) / (1 + margin)   for every rank r
                pp * max_r t_r <= (1 + max_stage_imbalance) * sum_r t_r
                sum_r N_r = L,  N_r >= vpp,  F_r + S_r <= N_r

A mixture-of-experts model with dense-MLP layers among its sparse ones (DeepSeek-V3's
first three, Llama 4 Maverick's every other) gives each rank one more count, D_r of those
layers, which the layer counts fix: the virtual stages take layers in order, so stage i
holds the dense layers between its two boundaries (`_place_dense`; other layouts than
dense first layers price each layer's time at the mean of the kinds and its memory at the
larger kind's instead). D enters the affine forms as the others do, its coefficients read as a dense
layer in place of a sparse one, the rank's dense layers evaluated first in its chunks; the
full check after the solve costs the real layout.

Rank r's layers are split as evenly as possible over its vpp model chunks afterwards;
the cost model charges a rank by its totals, so this loses nothing.

The affine memory is a relaxation: the cost model's memory is affine in the counts
except where it frees a layer's activations at the peak, which the finite differences
read at their largest (tests/planner/search/test_partition.py checks that the affine
memory never exceeds the full one), and coefficients are rounded down. So the program
keeps every partition that fits, and its bound is a bound of every partition; a
partition it returns is then costed in full, and one that does not fit is cut off and
the program solved again. A plan therefore never needs more than the usable memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from costmodel.estimate.uniform import (
    UnitCosts,
    backward_window_s,
    dp_sync_s,
    optimizer_step_s,
    rank_memory,
    rank_work,
)
from costmodel.problem import Problem, TracedProblem
from costmodel.specs.loading import load_runtime
from costmodel.strategy import Stage, Strategy, rank_stage_indices, stage_rank
from costmodel.terms.pipeline import coefficient_scale, pipeline_coefficients
from costmodel.units import MIB
from planner.rules import Rules

# Integer scales: time in units of 1/TIME_RESOLUTION of one plain layer's micro-batch
# time, memory in MiB (rounded down, so the program drops no partition that fits; the
# full check after the solve drops those that do not). Coarse units keep CP-SAT's
# coefficients small, which makes it 10-100x faster on memory-bound candidates than
# with KiB; the chosen partition is re-costed exactly by `costmodel.estimate`.
TIME_RESOLUTION = 1_000
MEMORY_UNIT_BYTES = MIB
# CP-SAT effort per solve in deterministic seconds (reproducible, unlike wall time).
DETERMINISTIC_TIME_LIMIT = 5.0
# Partitions cut off after the full memory check before the program stops on a
# candidate and reports it unsettled, with its bound (each cut removes one rank's layer
# counts; a handful is the usual need).
MAX_MEMORY_CUTS = 64


@dataclass(frozen=True)
class Affine:
    """value = const + per_layer * N + per_full * F + per_selective * S + per_dense * D (+ indicator)."""

    const: float
    per_layer: float
    per_full: float = 0.0
    per_selective: float = 0.0
    if_recompute: float = 0.0   # added once when the rank rebuilds any layer in backward
    per_dense: float = 0.0      # per dense first layer among the N (ModelSpec.layer_kinds): D


@dataclass(frozen=True)
class RankModel:
    time: Affine        # one micro-batch, seconds
    memory: Affine      # peak bytes
    dp_exposed: Affine  # gradient sync minus the backward window, seconds
    optimizer: Affine   # seconds
    # The runtime's selective recompute rebuilds the layer in backward too (op-level),
    # so a selective layer also turns on the memory's if_recompute.
    selective_rebuilds: bool = False


@dataclass(frozen=True)
class Solution:
    strategy: Strategy   # with stages
    objective_s: float   # the program's objective, seconds
    gap: float           # proven relative gap of the objective (0 when optimal)
    timed_out: bool = False   # the solver's time limit ended the search (gap > 0 then)


@dataclass(frozen=True)
class TimedOut:
    """The solver's time limit passed before it found a partition or proved that none
    fits (or, rarely, MAX_MEMORY_CUTS did); `bound_s` is its proven lower bound on the
    objective (0 when it has none)."""

    bound_s: float


def _rank_stages(strategy: Strategy, pp_rank: int, layers: int, full: int, selective: int, dense: int = 0,
                 prefix: int = 0) -> tuple[Stage, ...]:
    """Rank `pp_rank`'s chunks with `layers` layers, `dense` of them dense-MLP layers,
    filling the rank's first chunks first, as `layout` lays the chunks out. Layer offsets
    are placeholders for a model whose first `prefix` layers are its dense ones
    (`_prefix_units`), so that each chunk holds its dense layers: the cost model counts a
    rank's layers by kind and mode."""
    counts = _split(layers, strategy.vpp)
    fulls = _fill(full, counts)
    selectives = _fill(selective, [c - f for c, f in zip(counts, fulls)])
    denses = _fill(dense, counts)
    indices = rank_stage_indices(pp_rank, strategy.pp, strategy.vpp, strategy.schedule)
    return tuple(Stage(index, pp_rank, prefix - d, c, f, s)
                 for index, c, f, s, d in zip(indices, counts, fulls, selectives, denses))


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _fill(amount: int, capacities: list[int]) -> list[int]:
    """`amount` spread over chunks, filling the first chunks first."""
    out = []
    for cap in capacities:
        take = min(cap, amount)
        out.append(take)
        amount -= take
    return out


def _prefix_units(units: UnitCosts, layers: int) -> UnitCosts:
    """`units` for a model of the same kinds whose dense-MLP layers come first: what
    `_rank_stages`' placeholder offsets stand for (tables long enough for any of them)."""
    dense = units.dense_layers
    return replace(units, dense_upto=tuple(min(i, dense) for i in range(dense + layers + 1)))


def rank_model(problem: Problem, units: UnitCosts, strategy: Strategy, pp_rank: int) -> RankModel:
    """Affine coefficients of rank `pp_rank`, read off the cost model by finite differences."""
    v = strategy.vpp
    dense = units.dense_layers
    placed = _prefix_units(units, problem.model.num_hidden_layers) if dense else units

    def at(layers: int, full: int = 0, selective: int = 0, dense_layers: int = 0):
        s = rank_strategy(strategy, pp_rank, (layers, full, selective, dense_layers), dense)
        window = backward_window_s(placed, s, pp_rank)
        return (rank_work(placed, s, pp_rank).total_s,
                rank_memory(problem, placed, s, pp_rank).total_bytes,
                dp_sync_s(problem, placed, s, pp_rank) - window,
                optimizer_step_s(problem, placed, s, pp_rank))

    base, more = at(v + 2), at(v + 3)
    one_full, two_full = at(v + 2, full=1), at(v + 2, full=2)
    one_sel, two_sel = at(v + 2, selective=1), at(v + 2, selective=2)
    per_layer = [b - a for a, b in zip(base, more)]
    per_full = [b - a for a, b in zip(one_full, two_full)]
    indicator = [o - b - f for o, b, f in zip(one_full, base, per_full)]
    per_sel = [b - a for a, b in zip(one_sel, two_sel)]
    sel_indicator = [o - b - s for o, b, s in zip(one_sel, base, per_sel)]
    # A dense-MLP layer in place of a mixture-of-experts one (ModelSpec.layer_kinds).
    per_dense = [b - a for a, b in zip(base, at(v + 2, dense_layers=1))] if dense else [0.0] * 4
    # Where selective recompute rebuilds the layer too, both indicators stand for the one
    # rebuilt layer's activations: one z, at the smaller of the two, keeps the program's
    # memory a relaxation.
    rebuilds = problem.runtime.selective_rebuilds_layer
    if rebuilds:
        indicator = [min(a, b) for a, b in zip(indicator, sel_indicator)]
    affines = [Affine(base[i] - (v + 2) * per_layer[i], per_layer[i], per_full[i], per_sel[i], indicator[i],
                      per_dense[i]) for i in range(4)]
    return RankModel(*affines, selective_rebuilds=rebuilds)


def memory_margin(problem: Problem | TracedProblem, rules: Rules) -> float:
    """The rules' memory margin, or by default the high side of the runtime profile's
    memory band (costmodel.estimate.band): a plan is checked at the memory it may
    really need, not at its estimate."""
    if rules.memory_margin is not None:
        return rules.memory_margin
    runtime = problem.runtime if isinstance(problem, Problem) else load_runtime()
    return runtime.memory_high_ratio - 1.0


def memory_limits(problem: Problem | TracedProblem, rules: Rules) -> str:
    """The two rules behind the usable memory, for messages."""
    return f"memory_headroom {rules.memory_headroom:g}, memory_margin {memory_margin(problem, rules):.3g}"


def usable_memory_bytes(problem: Problem | TracedProblem, rules: Rules) -> float:
    """What an estimate's peak may reach on one device: its memory less the rules'
    headroom, over 1 + the memory margin."""
    return problem.cluster.gpu.memory_bytes * (1.0 - rules.memory_headroom) / (1.0 + memory_margin(problem, rules))


def solve_partition(problem: Problem, units: UnitCosts, strategy: Strategy, modes: tuple[str, ...],
                    rules: Rules, objective: str = "time",
                    cutoff_s: float | None = None,
                    rank_costs: list[tuple[Problem, UnitCosts]] | None = None) -> Solution | TimedOut | None:
    """The best partition of `strategy`, or None when no partition fits memory and the
    imbalance rule (or, given `cutoff_s`, none is faster than that), or TimedOut when
    the solver's time limit passed before it found one or proved so. `modes` are the
    recompute modes layers may use. `rank_costs`: each pipeline rank's own (problem,
    unit costs), on a mixed cluster (costmodel.estimate.mixed): each rank's time, memory and
    device capacity are then its group's, so a slower or smaller group takes fewer layers."""
    pp, vpp, layers = strategy.pp, strategy.vpp, problem.model.num_hidden_layers
    m = strategy.num_microbatches
    rank_costs = rank_costs or [(problem, units)] * pp
    ranks = [rank_model(p, u, strategy, r) for r, (p, u) in enumerate(rank_costs)]
    upto = units.dense_upto
    if upto and upto[upto[-1]] != upto[-1]:
        # Dense-MLP layers not first (Llama 4 Maverick's every other): each layer's time at
        # the mean of the kinds (a run of N layers holds N x dense / L of them, within one
        # for an alternation) and its memory at the larger kind's, so that every partition
        # the program keeps fits as laid out; the layout is costed in full after the solve.
        # (An exact chain of lookups, as `_place_dense`, left CP-SAT at its time limit.)
        share = upto[-1] / layers
        ranks = [replace(rm, time=_mean_layer(rm.time, share), dp_exposed=_mean_layer(rm.dp_exposed, share),
                         optimizer=_mean_layer(rm.optimizer, share), memory=_larger_layer(rm.memory))
                 for rm in ranks]
        upto = ()
    time_unit = units.layer_work["none"].total_s / TIME_RESOLUTION

    def t(x: float) -> int:
        return round(x / time_unit)

    def b(x: float) -> int:
        return math.floor(x / MEMORY_UNIT_BYTES)

    from ortools.sat.python import (
        cp_model,  # imported on first solve: it takes pandas with it
    )

    model = cp_model.CpModel()
    # A safe upper bound for every time variable, with slack for per-term rounding.
    big_t = 2 * t(sum(abs(r.time.const) + abs(r.optimizer.const) + abs(r.dp_exposed.const)
                      + layers * (abs(r.time.per_layer) + abs(r.time.per_full) + abs(r.time.per_selective)
                                  + abs(r.optimizer.per_layer) + abs(r.dp_exposed.per_layer))
                      for r in ranks)) + 1000 * (layers + pp)
    n_vars, t_vars, z_vars = [], [], []
    dense_layers = units.dense_layers if upto else 0
    usable = [usable_memory_bytes(p, rules) for p, _ in rank_costs]
    caps = [math.floor(u / MEMORY_UNIT_BYTES) for u in usable]
    mem_cap = max(caps)
    exposed = model.NewIntVar(0, big_t, "dp_exposed")
    opt = model.NewIntVar(0, big_t, "optimizer")
    peak_t = model.NewIntVar(0, big_t, "max_t")
    peak_mem = model.NewIntVar(0, mem_cap, "max_mem")
    for r, rm in enumerate(ranks):
        n = model.NewIntVar(vpp, layers, f"n{r}")
        f = model.NewIntVar(0, layers if "full" in modes else 0, f"f{r}")
        s = model.NewIntVar(0, layers if "selective" in modes else 0, f"s{r}")
        d = model.NewIntVar(0, dense_layers, f"d{r}")
        model.Add(f + s <= n)
        if "none" not in modes:
            model.Add(f + s == n)
        z = model.NewBoolVar(f"z{r}")
        model.Add(f <= layers * z)
        if rm.selective_rebuilds:
            model.Add(s <= layers * z)
        tr = model.NewIntVar(0, big_t, f"t{r}")
        model.Add(tr == t(rm.time.const) + t(rm.time.per_layer) * n + t(rm.time.per_full) * f
                  + t(rm.time.per_selective) * s + t(rm.time.per_dense) * d)
        model.Add(peak_t >= tr)
        mem = (b(rm.memory.const) + b(rm.memory.per_layer) * n + b(rm.memory.per_full) * f
               + b(rm.memory.per_selective) * s + b(rm.memory.if_recompute) * z + b(rm.memory.per_dense) * d)
        model.Add(mem <= peak_mem)
        if caps[r] < mem_cap:
            model.Add(mem <= caps[r])
        model.Add(exposed >= t(rm.dp_exposed.const) + t(rm.dp_exposed.per_layer) * n
                  + t(rm.dp_exposed.per_dense) * d)
        model.Add(opt >= t(rm.optimizer.const) + t(rm.optimizer.per_layer) * n + t(rm.optimizer.per_dense) * d)
        n_vars.append((n, f, s, d))
        t_vars.append(tr)
        z_vars.append(z)
    model.Add(sum(n for n, *_ in n_vars) == layers)
    _place_dense(model, strategy, n_vars, upto)
    if pp > 1:
        # Imbalance as a ratio of integers: pp * max <= (1 + imb) * sum, in thousandths.
        model.Add(1000 * pp * peak_t <= round(1000 * (1 + rules.max_stage_imbalance)) * sum(t_vars))

    # Zero-bubble schedules: the weight-gradient and forward shares of a plain layer (of
    # the group where the weight-gradient share is largest): recompute, the embedding and
    # the head add time without weight gradients, so a partition's shares are at most these.
    plain = max((u for _, u in rank_costs), key=lambda u: u.weight_grad_share)
    a, c = pipeline_coefficients(strategy.schedule, m, vpp, plain.weight_grad_share, plain.forward_share)
    # Scaled so the coefficients (e.g. interleaved's m - 1/vpp, 1/vpp) become integers.
    scale = coefficient_scale(strategy.schedule, vpp)
    a_int, c_int = round(a * scale), round(c * scale)
    time_objective = a_int * peak_t + c_int * sum(t_vars) + scale * (exposed + opt)

    if cutoff_s is not None and objective == "time":
        # Only partitions that beat the plans already found are of interest; the bound
        # lets CP-SAT discard most candidates without searching.
        model.Add(time_objective <= math.floor(cutoff_s * scale / time_unit))

    # Each rank time's rounding error is at most half a unit per term, so the program's
    # bound, less this, bounds the objective of the unrounded times.
    rounding = (a_int + c_int * pp + 2 * scale) * (1 + 3 * layers + dense_layers) / 2

    def seconds(units_: float) -> float:
        return units_ * time_unit / scale

    # CP-SAT proves optimality far sooner from a good first solution (5-15x on GPT-1T's
    # 1F1B programs): a greedy split, each rank recomputing as little as fits.
    hint = greedy_hint(ranks, layers, vpp, caps, modes, t, b)
    if hint is not None:
        for (n, f, s, _), z, values in zip(n_vars, z_vars, hint):
            for var, value in zip((n, f, s, z), values):
                model.AddHint(var, value)

    for _ in range(MAX_MEMORY_CUTS):
        solved = _solve(model, n_vars, objective, peak_mem, time_objective)
        if isinstance(solved, str):
            return None if solved == "infeasible" else TimedOut(0.0)
        status, value, bound, counts = solved
        # The full check, on the layout itself (which layers each chunk holds).
        staged = strategy.with_stages(layout(strategy, [c[:3] for c in counts]))
        over = [r for r, (p, u) in enumerate(rank_costs) if rank_memory(p, u, staged, r).total_bytes > usable[r]]
        if not over:
            break
        for r in over:   # the affine memory under-counted this rank's layer counts
            model.AddForbiddenAssignments(list(n_vars[r]), [counts[r]])
    else:
        # Still a relaxation after the cuts, so its bound holds: unsettled, not infeasible.
        return TimedOut(seconds(max(0.0, bound - rounding)))
    timed_out = status != cp_model.OPTIMAL
    bound = max(0.0, bound - rounding)
    gap = 0.0 if not timed_out or value <= 0 else max(0.0, (value - bound) / value)
    return Solution(staged, seconds(value), gap, timed_out)


def _mean_layer(affine: Affine, share: float) -> Affine:
    """`affine` with a `share` of every layer dense: D folded into N."""
    return replace(affine, per_layer=affine.per_layer + share * affine.per_dense, per_dense=0.0)


def _larger_layer(affine: Affine) -> Affine:
    """`affine` with every layer of the kind that costs more."""
    return replace(affine, per_layer=affine.per_layer + max(0.0, affine.per_dense), per_dense=0.0)


def _place_dense(model, strategy: Strategy, n_vars: list, dense_upto: tuple[int, ...]) -> None:
    """Tie each rank's D (the dense-MLP layers it holds) to the layer counts N, for dense
    first layers (DeepSeek-V3's): the virtual stages take layers in order, rank r's chunk
    k holding N // vpp layers and one more while k < N % vpp (`_split`), so stage i holds
    dense_upto[b_i+1] - dense_upto[b_i] of them, b_i the layers before it."""
    if not dense_upto:
        return
    pp, vpp, layers = strategy.pp, strategy.vpp, len(dense_upto) - 1
    chunk_sizes = {}
    for r, (n, *_) in enumerate(n_vars):
        if vpp == 1:
            chunk_sizes[r] = [n]
            continue
        base = model.NewIntVar(0, layers, f"base{r}")
        extra = model.NewIntVar(0, vpp - 1, f"extra{r}")
        model.AddDivisionEquality(base, n, vpp)
        model.AddModuloEquality(extra, n, vpp)
        sizes = []
        for k in range(vpp):
            more = model.NewBoolVar(f"more{r}_{k}")
            model.Add(extra >= k + 1).OnlyEnforceIf(more)
            model.Add(extra <= k).OnlyEnforceIf(more.Not())
            sizes.append(base + more)
        chunk_sizes[r] = sizes
    held = {r: [] for r in range(pp)}
    boundary, dense_before = 0, 0
    for index in range(strategy.num_virtual_stages):
        r = stage_rank(index, pp, strategy.schedule)
        k = rank_stage_indices(r, pp, vpp, strategy.schedule).index(index)
        end = model.NewIntVar(0, layers, f"end{index}")
        model.Add(end == boundary + chunk_sizes[r][k])
        dense_to_end = model.NewIntVar(0, dense_upto[-1], f"dense_to{index}")
        model.AddElement(end, list(dense_upto), dense_to_end)
        held[r].append(dense_to_end - dense_before)
        boundary, dense_before = end, dense_to_end
    for r, (_, _, _, d) in enumerate(n_vars):
        model.Add(d == sum(held[r]))


def greedy_hint(ranks: list[RankModel], layers: int, vpp: int, caps: list[int], modes: tuple[str, ...],
                t: Callable[[float], int], b: Callable[[float], int]) -> list[tuple[int, int, int, int]] | None:
    """(layers, full, selective, recomputes) per rank for the program's solution hint:
    layers handed out one at a time to the rank whose time grows least, each rank taking
    the fastest recompute of one mode that fits its memory, in the program's own integer
    terms; None when no rank can take a layer the rest need."""

    def best(r: int, n: int) -> tuple[int, int, int, int] | None:
        rm, options = ranks[r], []
        for mode in modes:
            for k in ([0] if mode == "none" else range(1, n + 1)):
                if mode != "none" and "none" not in modes and k < n:
                    continue
                f, s = (k, 0) if mode == "full" else ((0, k) if mode == "selective" else (0, 0))
                z = int(f > 0 or (s > 0 and rm.selective_rebuilds))
                mem = (b(rm.memory.const) + b(rm.memory.per_layer) * n + b(rm.memory.per_full) * f
                       + b(rm.memory.per_selective) * s + b(rm.memory.if_recompute) * z)
                if mem <= caps[r]:
                    options.append((t(rm.time.const) + t(rm.time.per_layer) * n + t(rm.time.per_full) * f
                                    + t(rm.time.per_selective) * s, f, s, z))
                    break
        return min(options) if options else None

    counts = [vpp] * len(ranks)
    chosen = [best(r, vpp) for r in range(len(ranks))]
    grown = [best(r, vpp + 1) for r in range(len(ranks))]
    if None in chosen:
        return None
    for _ in range(layers - vpp * len(ranks)):
        open_ranks = [r for r in range(len(ranks)) if grown[r] is not None]
        if not open_ranks:
            return None
        r = min(open_ranks, key=lambda r: (grown[r][0], r))
        counts[r] += 1
        chosen[r], grown[r] = grown[r], best(r, counts[r] + 1)
    return [(n, f, s, z) for n, (_, f, s, z) in zip(counts, chosen)]


def _solve(model, n_vars: list, objective: str, peak_mem, time_objective):
    """(status, objective value, objective bound, per-rank counts) of one solve, or
    "infeasible" / "timeout". The memory objective first finds the least peak memory,
    then the fastest partition at it."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = DETERMINISTIC_TIME_LIMIT
    solver.parameters.optimize_with_lb_tree_search = True
    if objective == "memory":
        model.Minimize(peak_mem)
        status = solver.Solve(model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return "infeasible" if status == cp_model.INFEASIBLE else "timeout"
        # The cap holds only under an assumption, so a later solve (after a memory cut)
        # starts from the full program. Deleting the constraint instead needs the proto
        # API, which ortools 9.15 no longer has (ConstraintProto.Clear is gone).
        capped = model.NewBoolVar("peak_memory_capped")
        model.Add(peak_mem <= int(solver.Value(peak_mem))).OnlyEnforceIf(capped)
        model.AddAssumptions([capped])
    model.Minimize(time_objective)
    status = solver.Solve(model)
    model.ClearAssumptions()
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return "infeasible" if status == cp_model.INFEASIBLE else "timeout"
    counts = [tuple(solver.Value(x) for x in values) for values in n_vars]
    return status, solver.ObjectiveValue(), solver.BestObjectiveBound(), counts


def rank_strategy(strategy: Strategy, pp_rank: int, counts: tuple[int, ...], prefix: int = 0) -> Strategy:
    """`strategy` with only rank `pp_rank`'s stages, holding `counts` (layers, full,
    selective and, of a model with `prefix` dense first layers, how many of those): what
    the cost model's per-rank functions read."""
    return replace(strategy, stages=_rank_stages(strategy, pp_rank, *counts, prefix=prefix))


def rank_bytes(problem: Problem, units: UnitCosts, strategy: Strategy, pp_rank: int,
               counts: tuple[int, ...]) -> float:
    """The full cost model's peak memory of rank `pp_rank` holding `counts` (its dense-MLP
    layers first in its chunks, as the program evaluates them)."""
    dense = units.dense_layers
    placed = _prefix_units(units, problem.model.num_hidden_layers) if dense else units
    return rank_memory(problem, placed, rank_strategy(strategy, pp_rank, counts, dense), pp_rank).total_bytes


def layout(strategy: Strategy, counts: list[tuple[int, int, int]]) -> tuple[Stage, ...]:
    """Stages from per-rank (layers, full, selective): rank r's chunk k is its k-th
    virtual stage (costmodel.strategy.rank_stage_indices), layers numbered in
    virtual-stage order."""
    pp = strategy.pp
    chunks = {}
    for r, (layers, full, selective) in enumerate(counts):
        for stage in _rank_stages(strategy, r, layers, full, selective):
            chunks[stage.index] = stage
    stages, first = [], 0
    for index in range(strategy.num_virtual_stages):
        stage = replace(chunks[index], first_layer=first)
        stages.append(stage)
        first += stage.num_layers
    assert first == sum(c[0] for c in counts) and pp == len(counts)
    return tuple(stages)
