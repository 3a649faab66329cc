"""What each rank holds of the model states, against the cost model: AdamW's two fp32
moments per parameter, sharded by ZeRO over dp for dense weights and over edp (the dp
ranks holding the same experts) for experts, as costmodel.estimate.uniform.rank_memory
prices them. Measured on the executor's own ranks (CPU, gloo) after a step."""

from __future__ import annotations

import pytest
import torch
from executor_test_helpers import (
    CONFIG,
    GLOBAL_BATCH,
    SEQ_LEN,
    batches,
    strategy,
    training,
)
from torch.distributed.tensor import DTensor

from costmodel.estimate import estimate
from costmodel.specs.loading import load_model
from executor.launch import run_local
from executor.train import Trainer
from planner.api import make_problem


def optimizer_state_bytes(rank, world, strat):
    """The bytes of this rank's AdamW moments (its shards: DTensor local parts;
    ZeroRedundancyOptimizer: its partition's) after one step."""
    spec = load_model("tiny-moe")
    trainer = Trainer(spec, training(), strat, CONFIG, "cpu")
    x, y = batches(spec, 1)[0]
    trainer.step(x, y)
    inner = getattr(trainer.optimizer, "optim", trainer.optimizer)
    total = 0
    for state in inner.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[key]
            local = value.to_local() if isinstance(value, DTensor) else value
            total += local.numel() * local.element_size()
    return torch.tensor(total)


@pytest.mark.parametrize("plan", [dict(dp=4, ep=2, zero=1), dict(dp=4, ep=2, zero=3), dict(dp=4, ep=2)])
def test_adamw_moments_per_rank_are_the_estimates(plan):
    strat = strategy(**plan)
    problem = make_problem("tiny-moe", "cpu", GLOBAL_BATCH, gpus=4, seq_len=SEQ_LEN, precision="fp32")
    predicted = estimate(problem, strat).memory.optimizer_bytes
    measured = run_local(optimizer_state_bytes, 4, strat)
    assert [int(m) for m in measured] == [predicted] * 4
