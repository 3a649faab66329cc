"""Loss parity: every parallel layout trains the tiny models exactly as one process
does. Five AdamW steps in fp32 on fixed synthetic data; per-step losses equal the
single-process run within 1e-5 relative and the gathered weights equal its weights."""

import pytest

from costmodel.strategy import Stage
from executor_test_helpers import assert_matches_reference, parallel_run, reference_run, run_ranks, strategy

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

_references = {}


def reference(model):
    if model not in _references:
        _references[model] = reference_run(model)
    return _references[model]


def check_parity(model, strat):
    ref_losses, ref_params = reference(model)
    assert_matches_reference(run_ranks(parallel_run, strat.num_gpus, model, strat), ref_losses, ref_params)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_gpt_parity(plan):
    check_parity("tiny-gpt", PLANS[plan])


@pytest.mark.parametrize("plan", LLAMA_PLANS)
def test_llama_parity(plan):
    check_parity("tiny-llama", PLANS[plan])


@pytest.mark.parametrize("plan", sorted(MOE_PLANS))
def test_moe_parity(plan):
    check_parity("tiny-moe", MOE_PLANS[plan])
