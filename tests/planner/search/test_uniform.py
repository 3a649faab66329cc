"""planner.search (uniform problems): the best plan is the best of the space under pins,
and the same request gives the same plan."""

import json

from costmodel.problem import Problem
from costmodel.specs.loading import load_cluster, load_model, make_training
from planner.api import plan
from planner.rules import load_rules
from planner.search import search


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


