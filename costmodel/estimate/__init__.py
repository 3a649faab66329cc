"""`estimate()`: the one entry point that predicts a strategy's step time, throughput,
MFU/HFU and peak memory, with breakdowns, for every kind of problem:

- a transformer the specs describe on one kind of GPU (`uniform`),
- the same on a mixed cluster of several GPU kinds (`mixed`),
- a traced nn.Module (`traced`).

Each prices its ranks with the shared terms (`costmodel.terms`) and assembles the result
with `breakdown.step_estimate`. `energy` turns an estimate into cost and energy per step;
`step_collectives` lists the collectives a step issues as the estimate charges them.
"""

from __future__ import annotations

from costmodel.estimate.breakdown import Estimate, MemoryBreakdown
from costmodel.estimate.mixed import estimate_mixed, mixed_rank_memories
from costmodel.estimate.traced import (
    TracedUnits,
    estimate_traced,
    stage_memory,
    traced_units,
)
from costmodel.estimate.uniform import UnitCosts, estimate_uniform
from costmodel.problem import Problem, TracedProblem
from costmodel.specs import MixedClusterSpec
from costmodel.strategy import Strategy

__all__ = ["Estimate", "estimate", "rank_memories"]


def estimate(problem: Problem | TracedProblem, strategy: Strategy, units: UnitCosts | TracedUnits | None = None) -> Estimate:
    """Predicted step of `strategy` (which must carry its stages) on `problem`. `units`:
    the problem's unit costs, when the caller (the search) has them."""
    if not strategy.stages:
        raise ValueError("strategy has no stages; use costmodel.strategy.even_stages")
    if isinstance(problem, TracedProblem):
        return estimate_traced(problem, strategy, units)
    if isinstance(problem.cluster, MixedClusterSpec):
        return estimate_mixed(problem, strategy)
    return estimate_uniform(problem, strategy, units)


def rank_memories(problem: Problem | TracedProblem, strategy: Strategy) -> list[MemoryBreakdown]:
    """Each pipeline rank's memory at its peak, by kind (an Estimate keeps only the peak
    rank's breakdown); for replica groups on a mixed cluster, the fullest group's."""
    if isinstance(problem, TracedProblem):
        units = traced_units(problem, strategy)
        return [stage_memory(problem, units, strategy, s) for s in sorted(strategy.stages, key=lambda s: s.pp_rank)]
    return mixed_rank_memories(problem, strategy)
