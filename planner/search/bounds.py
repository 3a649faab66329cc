"""Lower bounds on a candidate's step time and peak memory, valid for every partition
and recompute choice, so the search can skip the integer program for candidates that
cannot win or cannot fit.

With t_r the micro-batch time of pipeline rank r and (a, c) the schedule's coefficients
(`costmodel.terms.pipeline`), the pipelined time is a * max_r t_r + c * sum_r t_r; gradient
sync and optimizer time are at least zero. Both parts are bounded separately:

- `quick`: sum_r t_r is at least every layer at its fastest allowed mode plus the
  embedding, head and p2p work, plus the recomputation memory forces (below), and
  max_r t_r is at least the mean. Memory: the fullest rank holds at least the mean of
  the model states and of one micro-batch of activations at the most frugal mode.
- `balanced`: max_r t_r is at least T*, the optimum of the continuous relaxation of
  "place L layers on pp ranks, each within its memory, minimising the slowest", where
  rank r holding N layers with in_flight_r micro-batches must recompute enough to fit.

Recomputation is relaxed to its best price: every byte of activations saved below the
fastest mode costs at least the cheapest seconds-per-byte a slower mode offers.

The memory counted is what `costmodel.estimate.uniform.rank_memory` counts at the least:
model states and activations, less what it frees. With one micro-batch per step a
layer holds the larger of its activations and its gradients at the peak, so a layer
adds max(activations - gradients, 0) beyond its states, and under ZeRO-3 one more
layer's activations are gone by FSDP2's peak. Other terms (logits, buffers, working
activations) only add, so leaving them out keeps the bounds low. tests/planner/search/
test_bounds.py checks both bounds against the full estimate of every candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from costmodel.estimate.uniform import UnitCosts, p2p_sends
from costmodel.problem import Problem
from costmodel.strategy import Strategy, stage_rank
from costmodel.terms import memory
from costmodel.terms.pipeline import pipeline_coefficients

BISECTION_STEPS = 16


@dataclass(frozen=True)
class Bounds:
    time_s: float
    memory_bytes: float


@dataclass(frozen=True)
class _Terms:
    """Per-layer quantities of one candidate, at the fastest allowed mode: the least over
    the model's kinds of layer (a bound on any rank's layers), and their sums over every
    layer (ModelSpec.layer_kinds: DeepSeek-V3's dense-MLP layers beside its mixture-of-
    experts ones)."""

    layer_s: float            # one layer, one micro-batch
    layer_states_bytes: float
    layer_act_bytes: float    # per micro-batch in flight
    min_act_bytes: float      # at the most frugal mode
    s_per_byte: float         # cheapest recompute price; inf when nothing can be saved
    states_bytes: float       # all model states on all ranks of one pp column
    rank_s: tuple[float, ...]  # fixed work per rank: embedding, head, p2p
    in_flight: tuple[float, ...]
    rank_credit_bytes: float  # activations a rank may free beyond its layers' count (ZeRO-3, one micro-batch)
    layers_s: float = 0.0            # every layer at its fastest mode
    layers_act_bytes: float = 0.0    # every layer's activations at its fastest mode
    layers_min_act_bytes: float = 0.0   # every layer's at the most frugal mode


@dataclass(frozen=True)
class _Layer:
    """One kind of layer's quantities (as _Terms)."""

    seconds: float
    states_bytes: float
    act_bytes: float
    min_act_bytes: float
    s_per_byte: float
    credit_bytes: float


def _layer(problem: Problem, units: UnitCosts, strategy: Strategy, modes: tuple[str, ...]) -> _Layer:
    training, dp, zero = problem.training, strategy.dp_cp, strategy.zero_stage   # ZeRO shards over dp x cp
    dense_layer, expert_layer = units.layer_dense_parameters, units.layer_expert_parameters
    layer_states = (sum(memory.sharded_state_bytes(dense_layer, training, zero, dp))
                    + sum(memory.sharded_state_bytes(expert_layer, training, zero, strategy.edp)))
    act = {mode: units.layer_activation_bytes[mode] for mode in modes}
    credit = 0.0
    if strategy.num_microbatches == 1:
        # rank_memory: a layer's activations and gradients do not coexist at the peak.
        layer_gradients = (memory.sharded_state_bytes(dense_layer, training, zero, dp)[1]
                           + memory.sharded_state_bytes(expert_layer, training, zero, strategy.edp)[1])
        if zero == 3 and dp > 1:
            credit = max(act.values())
        act = {mode: max(a - layer_gradients, 0.0) for mode, a in act.items()}
    work = {mode: units.layer_work[mode].total_s for mode in modes}
    fastest = min(modes, key=lambda m: (work[m], act[m]))
    prices = [(work[m] - work[fastest]) / (act[fastest] - act[m]) for m in modes if act[m] < act[fastest]]
    return _Layer(work[fastest], layer_states, act[fastest], min(act[m] for m in modes),
                  min(prices) if prices else float("inf"), credit)


def _terms(problem: Problem, units: UnitCosts, strategy: Strategy, modes: tuple[str, ...]) -> _Terms:
    pp, training, dp, zero = strategy.pp, problem.training, strategy.dp_cp, strategy.zero_stage
    kinds = [(_layer(problem, units, strategy, modes), problem.model.num_hidden_layers - units.dense_layers)]
    if units.dense_layers:
        kinds.append((_layer(problem, units.dense, strategy, modes), units.dense_layers))
    ends = sum(memory.sharded_state_bytes(units.first_parameters + units.last_parameters, training, zero, dp))
    rank_s = [p2p_sends(strategy, r) * units.p2p_s for r in range(pp)]
    rank_s[0] += units.first_work.total_s
    # The last stage's rank: the last one, or rank 0 under a V (zbv, dualpipev).
    rank_s[stage_rank(strategy.num_virtual_stages - 1, pp, strategy.schedule)] += units.last_work.total_s
    in_flight = tuple(memory.in_flight_microbatches(strategy.schedule, pp, r, strategy.num_microbatches,
                                                    strategy.vpp) for r in range(pp))

    def least(name: str) -> float:
        return min(getattr(k, name) for k, _ in kinds)

    def total(name: str) -> float:
        return sum(n * getattr(k, name) for k, n in kinds)

    return _Terms(least("seconds"), least("states_bytes"), least("act_bytes"), least("min_act_bytes"),
                  least("s_per_byte"), total("states_bytes") + ends, tuple(rank_s), in_flight,
                  max(k.credit_bytes for k, _ in kinds), total("seconds"), total("act_bytes"),
                  total("min_act_bytes"))


def states_memory_bytes(problem: Problem, units: UnitCosts, strategy: Strategy) -> float:
    """A lower bound on the fullest rank's memory from its model states alone: their
    mean over the pipeline ranks, and the runtime's reserve."""
    x = _terms(problem, units, strategy, ("none",))
    return memory.RUNTIME_RESERVE_BYTES + x.states_bytes / strategy.pp


def quick(problem: Problem, units: UnitCosts, strategy: Strategy, modes: tuple[str, ...],
          usable_bytes: float) -> Bounds:
    pp = strategy.pp
    x = _terms(problem, units, strategy, modes)
    # Every rank holds at least the fewest in-flight micro-batches of any rank (1 for
    # 1F1B's last rank; min(m, 2 pp) everywhere under the zero-bubble schedules).
    held = min(x.in_flight)
    memory_bytes = (memory.RUNTIME_RESERVE_BYTES
                    + max(x.states_bytes + held * x.layers_min_act_bytes - pp * x.rank_credit_bytes, 0.0) / pp)
    a, c = pipeline_coefficients(strategy.schedule, strategy.num_microbatches, strategy.vpp,
                                 units.weight_grad_share, units.forward_share)
    return Bounds((a + c * pp) * _total_s(x, pp, usable_bytes) / pp, memory_bytes)


def _total_s(x: _Terms, pp: int, usable_bytes: float) -> float:
    """Lower bound on sum_r t_r. Summed over ranks, states and the fewest in-flight
    micro-batches of activations must fit pp devices; the excess is recomputed at the
    best price."""
    held = min(x.in_flight)
    excess = (x.states_bytes + held * x.layers_act_bytes
              - pp * (usable_bytes - memory.RUNTIME_RESERVE_BYTES + x.rank_credit_bytes))
    # A byte of a micro-batch's activations recomputed frees `held` bytes of memory.
    extra_s = excess * x.s_per_byte / held if excess > 0 else 0.0
    return x.layers_s + extra_s + sum(x.rank_s)


def _max_layers(x: _Terms, rank: int, time_s: float, free_bytes: float) -> float:
    """Most layers (continuous) rank `rank` can hold within `time_s` and its memory."""
    f = x.in_flight[rank]
    budget_s = time_s - x.rank_s[rank]
    if budget_s <= 0:
        return 0.0
    fits = free_bytes / (x.layer_states_bytes + f * x.min_act_bytes)
    per_layer_bytes = x.layer_states_bytes + f * x.layer_act_bytes
    plain = min(budget_s / x.layer_s, free_bytes / per_layer_bytes)
    if budget_s / x.layer_s <= plain or x.s_per_byte == float("inf"):
        return min(plain, fits)
    # Beyond `plain` layers every extra layer's bytes are saved by recomputation.
    price = x.s_per_byte / f   # seconds per byte of rank memory
    slope = x.layer_s + per_layer_bytes * price
    n = (budget_s + free_bytes * price) / slope
    return min(max(n, plain), fits)


def balanced(problem: Problem, units: UnitCosts, strategy: Strategy, modes: tuple[str, ...],
             usable_bytes: float) -> float:
    """A lower bound on the step time (inf when no partition can fit). Rank r holds a
    whole number of layers, at most floor(N_r(T)) within time T, so T* is the least T
    with sum_r floor(N_r(T)) >= L."""
    layers, pp = problem.model.num_hidden_layers, strategy.pp
    x = _terms(problem, units, strategy, modes)
    free = usable_bytes - memory.RUNTIME_RESERVE_BYTES + x.rank_credit_bytes
    total_s = _total_s(x, pp, usable_bytes)

    def holds(time_s: float) -> bool:
        return sum(math.floor(_max_layers(x, r, time_s, free) + 1e-9) for r in range(pp)) >= layers

    mean_s = total_s / pp        # the slowest rank is at least the mean
    low, high = mean_s, 1.25 * mean_s
    while not holds(high):
        if high > 1e6 * mean_s:  # no time is enough: the layers cannot fit memory
            return float("inf")
        low, high = high, 2 * high
    for _ in range(BISECTION_STEPS):
        mid = (low + high) / 2
        low, high = (low, mid) if holds(mid) else (mid, high)
    a, c = pipeline_coefficients(strategy.schedule, strategy.num_microbatches, strategy.vpp,
                                 units.weight_grad_share, units.forward_share)
    return a * low + c * total_s
