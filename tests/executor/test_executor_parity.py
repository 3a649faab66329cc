"""Parity: every parallel layout trains the tiny models as one process does. Five
AdamW steps on fixed synthetic data in float64, where a layout's other summation order
cannot move a result past the tolerances executor_test_helpers derives (losses 2.8e-13
relative, weights 8.5e-8): per-step losses and the gathered weights equal the
single-process run's. The production paths keep a loss check each: float32 (its
summation-order bound) and bf16 autocast (its rounding bound)."""

import pytest
import torch

from costmodel.strategy import Stage
from executor_test_helpers import (
    CONFIG,
    GLOBAL_BATCH,
    PARITY,
    STEPS,
    assert_matches_reference,
    bf16_loss_rtol,
    loss_rtol,
    weight_atol,
    parallel_run,
    reference_run,
    run_ranks,
    strategy,
)

UNEVEN = (Stage(0, 0, 0, 1), Stage(1, 1, 1, 3))

PLANS = {
    "dp2": strategy(dp=2),
    "tp2": strategy(tp=2),
    "tp2-sp": strategy(tp=2, sp=True),
    "pp2-gpipe": strategy(pp=2, schedule="gpipe"),
    "pp2-1f1b": strategy(pp=2),
    "pp2-interleaved": strategy(pp=2, vpp=2, schedule="interleaved"),
    "dp2-tp2": strategy(dp=2, tp=2),
    "dp2-pp2": strategy(dp=2, pp=2),
    "tp2-pp2": strategy(tp=2, pp=2, sp=True),
    "zero1": strategy(dp=2, zero=1),
    "zero2": strategy(dp=2, zero=2, m=2),
    "zero3": strategy(dp=2, zero=3, m=2),
    "zero3-tp2": strategy(dp=2, tp=2, zero=3),
    "zero3-pp2": strategy(dp=2, pp=2, zero=3),
    "recompute-selective": strategy(dp=2, recompute="selective"),
    "recompute-full": strategy(pp=2, recompute="full"),
    "pp2-uneven": strategy(pp=2, stages=UNEVEN),
    "dp2-accumulate": strategy(dp=2, m=2),
}
# Llama-style: the layouts where GQA, RoPE and SwiGLU meet tensor and pipeline splits.
LLAMA_PLANS = ["tp2", "tp2-sp", "pp2-1f1b", "dp2-tp2", "zero3-tp2", "recompute-full", "pp2-uneven"]
MOE_PLANS = {"ep2": strategy(dp=2, ep=2), "ep2-zero3": strategy(dp=2, ep=2, zero=3), "ep2-pp2": strategy(dp=2, ep=2, pp=2)}

# The production dtypes' loss checks: one layout of each kind of split, and ZeRO with
# accumulation (where autocast's cache of weight casts once broke the gradients).
PRODUCTION_PLANS = ["dp2-tp2", "tp2-pp2", "pp2-interleaved", "zero3", "zero3-tp2"]

_references = {}


def reference(model, config=PARITY, precision="fp32"):
    key = (model, config.dtype, precision)
    if key not in _references:
        _references[key] = reference_run(model, config=config, precision=precision)
    return _references[key]


def check_parity(model, strat):
    ref_losses, ref_params = reference(model)
    results = run_ranks(parallel_run, strat.num_gpus, model, strat, "adamw", STEPS, GLOBAL_BATCH, PARITY)
    assert_matches_reference(results, ref_losses, ref_params)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_gpt_parity(plan):
    check_parity("tiny-gpt", PLANS[plan])


@pytest.mark.parametrize("plan", LLAMA_PLANS)
def test_llama_parity(plan):
    check_parity("tiny-llama", PLANS[plan])


@pytest.mark.parametrize("plan", sorted(MOE_PLANS))
def test_moe_parity(plan):
    check_parity("tiny-moe", MOE_PLANS[plan])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("plan", PRODUCTION_PLANS)
def test_production_precisions_keep_the_losses(plan, precision):
    """float32 weights, and bf16 autocast over them (the trainer's own autocast, as
    on a GPU): the losses of one process within the bound for that precision."""
    strat = PLANS[plan]
    ref_losses, _ = reference("tiny-gpt", CONFIG, precision)
    results = run_ranks(parallel_run, strat.num_gpus, "tiny-gpt", strat, "adamw", STEPS, GLOBAL_BATCH, CONFIG,
                        precision)
    rtol = bf16_loss_rtol() if precision == "bf16" else loss_rtol(torch.float32)
    for rank, (losses, params) in enumerate(results):
        assert losses == pytest.approx(ref_losses, rel=rtol), f"rank {rank}"
        assert all(p.dtype == torch.float32 for p in params.values())


def test_the_tolerances_are_the_bounds_their_derivations_state():
    """The figures the docstrings and the README quote, from the formulas."""
    assert loss_rtol(torch.float64) == pytest.approx(2.84e-13, rel=1e-2)
    assert weight_atol(torch.float64, PARITY.lr) == pytest.approx(8.53e-8, rel=1e-2)
    assert loss_rtol(torch.float32) == pytest.approx(1.53e-4, rel=1e-2)
    assert weight_atol(torch.float32, CONFIG.lr) == pytest.approx(45.8, rel=1e-2)
    assert bf16_loss_rtol() == pytest.approx(1.73e-3, rel=1e-2)
