"""planner.search.space: the strategies the cluster, the batch and the rules admit.
"""

from __future__ import annotations

import dataclasses

from costmodel.problem import Problem
from costmodel.specs.loading import load_cluster, load_model, load_runtime, make_training
from planner.rules import load_rules
from planner.search.space import _zero_bubble_refusal, enumerate_space


def problem(model="gpt3-1.3b", cluster="dgx-a100-40gb", gpus=8, batch=32, seq=2048):
    m, c = load_model(model), load_cluster(cluster, gpus=gpus)
    return Problem(m, c, make_training(m, c, batch, seq))


def test_space_obeys_rules():
    p = problem()
    rules = load_rules("megatron").with_fix({"tp": 2})
    space, _ = enumerate_space(p, rules)
    assert space and all(s.tp == 2 and s.zero_stage <= 1 and s.schedule != "gpipe" for s in space)
    assert all(s.dp * s.micro_batch_size * s.num_microbatches == 32 for s in space)
    assert all(s.dp * s.cp * s.tp * s.pp == 8 for s in space)



def test_space_offers_1f1b_only_with_a_micro_batch_per_stage():
    spec = load_model("tiny-gpt")
    cluster = load_cluster("cpu", gpus=4)
    p = Problem(spec, cluster, make_training(spec, cluster, 2, 16))
    space, why = enumerate_space(p, load_rules())
    pipelined = [s for s in space if s.pp > 1]
    assert pipelined and all(s.schedule == "gpipe" or s.num_microbatches >= s.pp for s in pipelined)
    assert any(s.schedule == "gpipe" and s.num_microbatches < s.pp for s in pipelined)



def test_space_offers_sequence_parallelism_only_when_tp_divides_the_sequence():
    spec = load_model("tiny-gpt")
    cluster = load_cluster("cpu", gpus=2)
    odd = enumerate_space(Problem(spec, cluster, make_training(spec, cluster, 8, 15)), load_rules())[0]
    even = enumerate_space(Problem(spec, cluster, make_training(spec, cluster, 8, 16)), load_rules())[0]
    assert not any(s.sequence_parallel for s in odd) and any(s.sequence_parallel for s in even)


def zero_bubble_problem(runtime=None):
    spec = load_model("tiny-gpt")
    cluster = load_cluster("cpu", gpus=2)
    p = Problem(spec, cluster, make_training(spec, cluster, 8, 16))
    return p if runtime is None else dataclasses.replace(p, runtime=runtime)


def test_space_offers_zero_bubble_schedules_beside_the_others():
    """zb-interleaved (vpp 1 and more), zbv and dualpipev (vpp 2) beside gpipe, 1f1b and
    interleaved: they hold more activations (deferred weight gradients), so none rules
    out another. dualpipev needs 2 pp micro-batches."""
    space, _ = enumerate_space(zero_bubble_problem(), load_rules())
    pipelined = {(s.schedule, s.vpp) for s in space if s.pp > 1}
    assert {("zb-interleaved", 1), ("zb-interleaved", 2), ("zbv", 2), ("dualpipev", 2), ("1f1b", 1),
            ("interleaved", 2)} <= pipelined
    assert all(s.vpp == 2 for s in space if s.schedule in ("zbv", "dualpipev"))
    assert all(s.num_microbatches >= 2 * s.pp for s in space if s.schedule == "dualpipev")


def test_space_keeps_zero_bubble_schedules_from_runtimes_that_do_not_run_them():
    megatron = enumerate_space(zero_bubble_problem(load_runtime("megatron")), load_rules())
    compiled = enumerate_space(zero_bubble_problem(dataclasses.replace(load_runtime(), torch_compile=True)),
                               load_rules())
    for space, _ in (megatron, compiled):
        schedules = {s.schedule for s in space if s.pp > 1}
        assert schedules and not schedules & {"zb-interleaved", "zbv"}
        assert {"1f1b", "interleaved"} <= schedules
    assert "megatron runtime does not run zero-bubble" in _zero_bubble_refusal(load_runtime("megatron"), "zbv")
    assert "compiled blocks" in _zero_bubble_refusal(dataclasses.replace(load_runtime(), torch_compile=True), "zbv")
    assert _zero_bubble_refusal(load_runtime(), "zbv") is None


def test_space_folds_experts_only_where_the_runtime_does():
    """MoE parallel folding (RuntimeSpec.moe_folding: Megatron-Core, the executor): whole
    experts under tp (etp 1) with ep over dp x cp x tp, sequence parallelism on; the
    executor's runtime never splits experts over tp; DeepSpeed's keeps ep inside dp."""
    model, cluster = load_model("tiny-moe"), load_cluster("dgx-h100", gpus=8)
    training = make_training(model, cluster, 32, 64)
    rules = load_rules(None)
    folded, _ = enumerate_space(Problem(model, cluster, training, runtime=load_runtime("megatron")), rules)
    whole = [s for s in folded if s.etp == 1]
    assert whole and all(s.tp > 1 and s.sequence_parallel for s in whole)
    assert any(s.ep > s.dp for s in whole)   # ep takes tp ranks
    assert all((s.dp * s.cp * s.tp) % (s.ep * s.expert_tp) == 0 for s in folded)
    native, _ = enumerate_space(Problem(model, cluster, training, runtime=load_runtime()), rules)
    assert any(s.ep > s.dp for s in native) and all(s.tp == 1 or s.etp == 1 for s in native)
    deepspeed = load_runtime("deepspeed-zero")
    inside, _ = enumerate_space(Problem(model, cluster, training, runtime=deepspeed), rules)
    assert inside and all(s.etp is None and s.dp % s.ep == 0 for s in inside)
    two = load_cluster("dgx-h100", gpus=2)
    neither = dataclasses.replace(deepspeed, expert_tensor_parallel=False)
    _, why = enumerate_space(Problem(model, two, make_training(model, two, 32, 64), runtime=neither), rules)
    assert "neither splits experts over tp nor keeps them whole" in why.reasons["tp"]
