"""Every plan the search returns, the executor runs: random small problems (dense,
MoE, mixed clusters, each rule set) planned by planner.api and read back by `shardwise
run`'s own check (executor.launch.load_job: the plan file, the model, the strategy against
what executor.parallelize builds, one backend for every rank); and each kind of plan the
search makes for the executor's models is one that tests/executor/test_step.py trains."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor.launch import load_job
from executor.parallelize import data_parallel_kind
from planner.api import plan
from planner.plan_file import strategy_of, write_plan
from planner.search import Infeasible

TINY = ["tiny-gpt", "tiny-llama", "tiny-moe", "tiny-moe-shared", "tiny-qwen3-moe", "tiny-dense"]
CLUSTERS = ["cpu", "dgx-a100-80gb", "dgx-h100", "mixed-h100-a100", "mixed-a100-v100"]
PRECISION = {"cpu": "fp32", "mixed-a100-v100": "fp16"}   # V100 has no bf16


def plans_of(doc: dict) -> list[dict]:
    """The best plan and each alternative, as whole plan documents."""
    base = {k: v for k, v in doc.items() if k != "alternatives"}
    return [base] + [{**base, **alternative} for alternative in doc["alternatives"]]


def searched(model: str, cluster: str, gpus: int, batch: int, seq: int, rules: str) -> list[dict]:
    try:
        doc = plan(model, cluster, batch, gpus=None if cluster.startswith("mixed") else gpus, seq_len=seq, precision=PRECISION.get(cluster, "bf16"),
                   rules=rules, top=4)
    except Infeasible:
        return []
    return plans_of(doc)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=st.sampled_from(TINY), cluster=st.sampled_from(CLUSTERS), gpus=st.sampled_from([1, 2, 4, 8, 16]),
       batch=st.sampled_from([4, 8, 16, 32]), seq=st.sampled_from([16, 32, 64]),
       rules=st.sampled_from(["default", "megatron", "fsdp"]))
def test_every_plan_the_search_returns_passes_the_executors_check(tmp_path, model, cluster, gpus, batch, seq, rules):
    for i, doc in enumerate(searched(model, cluster, gpus, batch, seq, rules)):
        path = tmp_path / f"plan{i}.json"
        write_plan(doc, path)
        job = load_job(str(path))   # SpecError (the executor's refusal) fails the test
        assert job.strategy == strategy_of(doc)


def test_the_best_mixtral_plan_on_16_h100s_runs():
    """The plan the issue found refused (ep 8 with ZeRO 2): every one offered now passes."""
    docs = searched("mixtral-8x7b", "dgx-h100", 16, 256, 4096, "default")
    assert docs
    for doc in docs:
        s = strategy_of(doc)
        assert s.tp == 1 or s.etp == 1   # the executor keeps experts whole: the pytorch-native runtime says so
        from executor.launch import check_supported
        from planner.plan_file import model_of, training_of

        check_supported(model_of(doc), s, training_of(doc).seq_len)


@pytest.mark.parametrize("model, gpus, batch", [("llama3-8b", 8, 8), ("llama3-70b", 64, 32)])
def test_long_context_plans_pass_the_executors_check(tmp_path, model, gpus, batch):
    """At 128K tokens the search splits sequences (cp > 1): every plan it offers is one
    `run` accepts."""
    docs = searched(model, "dgx-h100", gpus, batch, 131072, "default")
    assert any(strategy_of(d).cp > 1 for d in docs)
    for i, doc in enumerate(docs):
        path = tmp_path / f"plan{i}.json"
        write_plan(doc, path)
        assert load_job(str(path)).strategy == strategy_of(doc)


def kind(strategy) -> tuple:
    """What tells the executor's code paths apart: how dp replicas are kept, whether tp,
    pp, ep, cp and sequence parallelism are on, and the schedule when pp > 1."""
    return (data_parallel_kind(strategy), strategy.tp > 1, strategy.pp > 1, strategy.ep > 1,
            strategy.sequence_parallel, strategy.schedule if strategy.pp > 1 else None, strategy.cp > 1)


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-moe"])
def test_each_kind_of_plan_the_search_makes_is_one_the_step_tests_train(model):
    """The search over 2 and 4 CPU ranks, its best 40 plans: each (dp kind, tp, pp, ep,
    sp, schedule) is among test_step.py's parity plans, which train against one process."""
    import test_step

    trained = {kind(s) for s in [*test_step.PLANS.values(), *test_step.MOE_PLANS.values()]}
    made = set()
    for gpus in (2, 4):
        for rules in ("default", "megatron", "fsdp"):
            try:
                doc = plan(model, "cpu", 16, gpus=gpus, seq_len=32, precision="fp32", rules=rules, top=40)
            except Infeasible:
                continue
            made |= {kind(strategy_of(d)) for d in plans_of(doc)}
    assert made and made <= trained, sorted(made - trained)
