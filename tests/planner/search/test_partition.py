"""planner.search.partition: the partition program against exhaustive enumeration.
"""

from __future__ import annotations

import itertools

import pytest

from costmodel.estimate import estimate
from costmodel.estimate.uniform import rank_memory, unit_costs
from costmodel.problem import Problem
from costmodel.specs.loading import load_cluster, load_model, make_training
from costmodel.strategy import Strategy
from planner.search.partition import layout, solve_partition, usable_memory_bytes


def problem(model="gpt3-1.3b", cluster="dgx-a100-40gb", gpus=8, batch=32, seq=2048):
    m, c = load_model(model), load_cluster(cluster, gpus=gpus)
    return Problem(m, c, make_training(m, c, batch, seq))


@pytest.mark.parametrize("strategy", [
    Strategy(dp=1, tp=2, pp=4, micro_batch_size=4, num_microbatches=8, schedule="1f1b"),
    Strategy(dp=2, tp=1, pp=4, micro_batch_size=2, num_microbatches=8, schedule="1f1b", zero_stage=1),
])
def test_partition_matches_exhaustive_enumeration(strategy):
    """Every split of 24 layers over 4 ranks with per-rank full-recompute counts: the
    program's partition is the fastest that fits (1e-3 relative for integer rounding)."""
    p = problem(batch=32)
    units = unit_costs(p, strategy)
    usable = usable_memory_bytes(p, 0.05)
    sol = solve_partition(p, units, strategy, ("none", "full"), 0.05, 10.0)
    best = float("inf")
    layers = p.model.num_hidden_layers
    for split in itertools.product(range(1, layers), repeat=3):
        last = layers - sum(split)
        if last < 1:
            continue
        counts = list(split) + [last]
        # Fewest full-recompute layers per rank that fit: more only costs time.
        choice = []
        for r, n in enumerate(counts):
            for f in range(n + 1):
                trial = [(c, 0, 0) for c in counts]
                trial[r] = (n, f, 0)
                s = strategy.with_stages(layout(strategy, trial))
                if rank_memory(p, units, s, r).total_bytes <= usable:
                    choice.append(f)
                    break
            else:
                break
        if len(choice) < 4:
            continue
        s = strategy.with_stages(layout(strategy, [(n, f, 0) for n, f in zip(counts, choice)]))
        best = min(best, estimate(p, s, units).step_time_s)
    assert estimate(p, sol.strategy, units).step_time_s == pytest.approx(best, rel=1e-3)
