"""The collectives the executor issues in a step equal, kind by kind, in calls and in
bytes, the ones the cost model charges for the same plan (costmodel.estimate.step_collectives)."""

from collections import Counter

import pytest
from executor_test_helpers import CONFIG, batches, strategy, training

from costmodel.estimate.step_collectives import group_sizes, step_collectives
from costmodel.problem import Problem
from costmodel.specs.loading import load_cluster, load_model
from executor.collective_log import CommCounter
from executor.launch import run_local
from executor.train import Trainer

PLANS = {
    "dp2": ("tiny-llama", strategy(dp=2)),
    "dp2-gpt": ("tiny-gpt", strategy(dp=2, m=2)),
    "tp2": ("tiny-llama", strategy(tp=2)),
    "tp2-gpt": ("tiny-gpt", strategy(tp=2, m=2)),
    # Sequence parallelism: the block inputs gathered once (autograd keeps them), the
    # norms' (and GPT's learned positions') gradients summed over tp.
    "tp2-sp": ("tiny-llama", strategy(tp=2, sp=True)),
    "tp2-sp-gpt": ("tiny-gpt", strategy(tp=2, sp=True, m=2)),
    # Op-level selective recompute saves no all-gather output: the recomputed forward
    # gathers each block's input again.
    "tp2-sp-selective": ("tiny-llama", strategy(tp=2, sp=True, recompute="selective")),
    "pp2": ("tiny-llama", strategy(pp=2, m=4)),
    "pp2-tied": ("tiny-gpt", strategy(pp=2)),
    "pp2-interleaved": ("tiny-llama", strategy(pp=2, vpp=2, schedule="interleaved")),
    "zero2": ("tiny-llama", strategy(dp=2, zero=2, m=2)),
    "zero3": ("tiny-llama", strategy(dp=2, zero=3, m=2)),
    "zero3-recompute": ("tiny-llama", strategy(dp=2, zero=3, recompute="full")),
    "ep2": ("tiny-moe", strategy(dp=2, ep=2)),
    # Whole experts under tp: the ep group spans the tp ranks, each routing its sequence
    # shard; the router's gradient summed over tp, a shared expert split over tp.
    "ep2-tp2": ("tiny-moe", strategy(tp=2, ep=2, etp=1, sp=True)),
    "ep2-tp2-shared": ("tiny-moe-shared", strategy(tp=2, ep=2, etp=1, sp=True)),
    # Dense-MLP layers among the expert ones: no all-to-all there, their own ZeRO-3 units.
    "ep2-dense-layers": ("tiny-qwen3-moe", strategy(dp=2, ep=2)),
    "ep2-dense-layers-zero3": ("tiny-qwen3-moe", strategy(dp=2, ep=2, zero=3, m=2)),
    "cp2": ("tiny-llama", strategy(cp=2)),
    "cp2-recompute": ("tiny-llama", strategy(cp=2, recompute="full")),
    "cp2-zero3": ("tiny-llama", strategy(cp=2, zero=3, m=2)),
}


def issued(rank, world, model, strat, precision="fp32"):
    """(kind, group size, bytes) -> calls for one step after two warm-up steps (DDP
    settles its gradient buckets on the second)."""
    trainer = Trainer(load_model(model), training(precision=precision), strat, CONFIG, "cpu")
    warm, warm_again, measured = batches(trainer.spec, 3)
    trainer.step(*warm)
    trainer.step(*warm_again)
    with CommCounter() as counter:
        trainer.train_step(*measured)
    return {(c.kind, c.group_size, c.bytes): n for c, n in Counter(counter.issued).items()}, trainer.mesh.pp_rank


def charged(model, strat, pp_rank, precision="fp32"):
    problem = Problem(load_model(model), load_cluster("cpu", gpus=strat.num_gpus), training(precision=precision))
    sizes = group_sizes(strat)
    out = Counter()
    for c in step_collectives(problem, strat, pp_rank):
        out[(c.kind, sizes[c.group], int(c.bytes))] += c.calls
    return dict(out)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_collectives_match_cost_model(plan):
    model, strat = PLANS[plan]
    spec = load_model(model)
    routed_measured = routed_charged = 0
    for measured, pp_rank in run_local(issued, strat.num_gpus, model, strat):
        charge = charged(model, strat, pp_rank)
        if strat.ep > 1:
            # Each MoE layer first exchanges its per-expert row counts (ep x local experts
            # int64), which the cost model does not charge.
            counts = ("all_to_all", strat.ep, 8 * spec.num_local_experts)
            sparse_layers = spec.num_hidden_layers - len(spec.mlp_only_layers)
            assert measured.pop(counts) == sparse_layers * strat.num_microbatches
            # The rows a rank sends back depend on the routing; over the ranks they add
            # up to what the cost model charges each rank on average.
            routed_measured += sum(k[2] * n for k, n in measured.items() if k[0] == "all_to_all")
            routed_charged += sum(k[2] * n for k, n in charge.items() if k[0] == "all_to_all")
            count = sum(n for k, n in measured.items() if k[0] == "all_to_all")
            assert count == sum(n for k, n in charge.items() if k[0] == "all_to_all")
            measured = {k: n for k, n in measured.items() if k[0] != "all_to_all"}
            charge = {k: n for k, n in charge.items() if k[0] != "all_to_all"}
        assert measured == charge, f"pipeline rank {pp_rank}"
    assert routed_measured == routed_charged


@pytest.mark.parametrize("plan", ["dp2", "zero2", "zero3", "tp2", "tp2-sp"])
def test_bf16_data_parallel_collectives_move_fp32(plan):
    # Under bf16 autocast the executor keeps fp32 weights and gradients: DDP all-reduces
    # and FSDP2 gathers and reduce-scatters 4 bytes per parameter, as charged
    # (costmodel.terms.memory.comm_state_bytes). Its residual stream is fp32 too: tensor
    # parallelism gathers a block's input and scatters the embedding's output in fp32,
    # and reduces the bf16 matmuls' outputs in bf16 (compute.residual_bytes_per_value).
    model, strat = PLANS[plan]
    for measured, pp_rank in run_local(issued, strat.num_gpus, model, strat, "bf16"):
        assert measured == charged(model, strat, pp_rank, "bf16")
