"""planner.search (uniform problems): the best plan is the best of the space under pins,
and the same request gives the same plan."""

import dataclasses
import json

import pytest

from costmodel.problem import Problem
from costmodel.specs.loading import SpecError, load_cluster, load_model, load_runtime, make_training
from planner.api import plan
from planner.rules import load_rules
from planner.search import check_fix, search
from planner.search.space import enumerate_space


def problem(model="gpt3-1.3b", cluster="dgx-a100-40gb", gpus=8, batch=32, seq=2048):
    m, c = load_model(model), load_cluster(cluster, gpus=gpus)
    return Problem(m, c, make_training(m, c, batch, seq))


def test_plan_is_deterministic():
    a = plan("llama2-7b", "dgx-h100", 64, nodes=1, seq_len=4096)
    b = plan("llama2-7b", "dgx-h100", 64, nodes=1, seq_len=4096)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_search_best_is_best_of_space_under_pins():
    p = problem()
    rules = load_rules().with_fix({"tp": 2, "pp": 2, "mbs": 2})
    result = search(p, rules, top=2)
    assert result.best.estimate.step_time_s <= result.alternatives[0].estimate.step_time_s




def test_long_context_plans_split_the_sequence():
    # Llama 3 8B at 128K tokens on one H100 node: without context parallelism the best is
    # tp 8 recomputing most layers; with it the search picks cp > 1, faster.
    best = plan("llama3-8b", "dgx-h100", 8, nodes=1, seq_len=131072)
    without = plan("llama3-8b", "dgx-h100", 8, nodes=1, seq_len=131072, fix={"cp": 1})
    assert best["strategy"]["cp"] > 1 and "cp" not in without["strategy"]
    assert best["estimate"]["step_time_s"] < without["estimate"]["step_time_s"]
    assert best["estimate"]["time"]["cp_comm_s"] > 0


def test_context_parallel_is_offered_only_where_memory_needs_it():
    # At 2K tokens the smallest micro-batch fits without recomputing at every tp, pp and
    # ZeRO stage whose states fit: no cp > 1 candidate is even priced.
    p = problem()
    result = search(p, load_rules())
    assert result.stats.candidates == len(enumerate_space(p, load_rules(), context_parallel=False)[0])
    # Pinned, it is searched whole: every candidate splits the sequence in two.
    pinned = search(p, load_rules().with_fix({"cp": 2}), top=3)
    assert all(c.strategy.cp == 2 for c in [pinned.best, *pinned.alternatives])


@pytest.mark.parametrize("fix, field", [({"cp": 3}, "--fix cp"), ({"cp": 2, "dp": 8}, "--fix")])
def test_context_parallel_pins_that_cannot_be(fix, field):
    with pytest.raises(SpecError) as err:
        check_fix(problem(), fix)
    assert err.value.field == field
    with pytest.raises(SpecError, match="2 x cp = 8 equal chunks"):
        check_fix(problem(seq=2052), {"cp": 4})
    # DeepSpeed keeps its expert groups inside dp: no cp beside them (a folding runtime
    # lays ep over cp; the executor's does).
    moe = problem("tiny-moe", cluster="cpu", gpus=4, batch=8, seq=64)
    check_fix(moe, {"cp": 2, "ep": 2})
    with pytest.raises(SpecError, match="the deepspeed-zero runtime runs context parallelism without expert"):
        check_fix(dataclasses.replace(moe, runtime=load_runtime("deepspeed-zero")), {"cp": 2, "ep": 2})
