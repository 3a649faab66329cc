"""planner.search.space: the strategies the cluster, the batch and the rules admit.
"""

from __future__ import annotations

from costmodel.problem import Problem
from costmodel.specs.loading import load_cluster, load_model, make_training
from planner.rules import load_rules
from planner.search.space import enumerate_space


def problem(model="gpt3-1.3b", cluster="dgx-a100-40gb", gpus=8, batch=32, seq=2048):
    m, c = load_model(model), load_cluster(cluster, gpus=gpus)
    return Problem(m, c, make_training(m, c, batch, seq))


def test_space_obeys_rules():
    p = problem()
    rules = load_rules("megatron").with_fix({"tp": 2})
    space, _ = enumerate_space(p, rules)
    assert space and all(s.tp == 2 and s.zero_stage <= 1 and s.schedule != "gpipe" for s in space)
    assert all(s.dp * s.micro_batch_size * s.num_microbatches == 32 for s in space)
    assert all(s.dp * s.tp * s.pp == 8 for s in space)



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
