"""planner.search.bounds: the bounds never exceed the full estimate. The search skips a
candidate whose bound cannot beat the best kept (or cannot fit), so a bound above the
estimate of any partition that fits would prune a plan that is better or that fits."""

from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.estimate.uniform import unit_costs
from costmodel.problem import Problem
from costmodel.specs.loading import load_cluster, load_model, make_training
from costmodel.strategy import even_stages
from planner.rules import load_rules
from planner.search import bounds
from planner.search.partition import usable_memory_bytes
from planner.search.space import enumerate_space, recompute_modes

# Chosen so that memory binds in different ways: one micro-batch per step (gradients and
# activations do not coexist), ZeRO-3 with full recompute, interleaved pipelines, MoE,
# two kinds of layer.
CASES = {
    "gpt3-16l-megatron": ("gpt3-175b", 16, "dgx-a100-80gb", 32, 64, 2048, "megatron"),
    "llama2-70b-40l-fsdp": ("llama2-70b", 40, "dgx-a100-80gb", 8, 32, 4096, "fsdp"),
    "llama2-7b-default": ("llama2-7b", 32, "dgx-a100-40gb", 8, 32, 4096, "default"),
    "mixtral-8l-default": ("mixtral-8x7b", 8, "dgx-h100", 16, 32, 4096, "default"),
    # Dense first layers (3 of 8) beside the mixture-of-experts ones, and an MTP module.
    "deepseek-v3-8l-default": ("deepseek-v3", 8, "dgx-h100", 32, 64, 4096, "default"),
    # Every other layer dense.
    "llama4-maverick-8l-default": ("llama4-maverick", 8, "dgx-h100", 32, 64, 4096, "default"),
}


def case(name):
    model, layers, cluster, gpus, batch, seq, rules = CASES[name]
    m = replace(load_model(model), num_hidden_layers=layers)
    c = load_cluster(cluster, gpus=gpus)
    return Problem(m, c, make_training(m, c, batch, seq)), load_rules(rules)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bounds_never_exceed_the_estimate(name):
    problem, rules = case(name)
    modes = recompute_modes(problem, rules)
    usable = usable_memory_bytes(problem, rules)
    space, _ = enumerate_space(problem, rules)
    checked = 0
    for strategy in space[::max(1, len(space) // 60)]:
        units = unit_costs(problem, strategy)
        quick = bounds.quick(problem, units, strategy, modes, usable)
        balanced = bounds.balanced(problem, units, strategy, modes, usable)
        for mode in modes:
            staged = strategy.with_stages(even_stages(problem.model.num_hidden_layers, strategy.pp,
                                                      strategy.vpp, mode, strategy.schedule))
            e = estimate(problem, staged, units)
            assert quick.memory_bytes <= e.peak_memory_bytes * (1 + 1e-9), (strategy, mode)
            if e.peak_memory_bytes <= usable:
                assert quick.time_s <= e.step_time_s * (1 + 1e-9), (strategy, mode)
                assert balanced <= e.step_time_s * (1 + 1e-6), (strategy, mode)
            checked += 1
    assert checked >= 3 * min(len(space), 60) // 2
