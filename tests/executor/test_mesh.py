"""The mesh (executor.mesh): each rank sits where costmodel.strategy numbers it (global
rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))), the ranks holding the
same weights (dp x cp) form one mesh, and the tied embedding's group pairs the first and
last pipeline stage of each dp, cp and tp coordinate."""

import pytest
import torch.distributed as dist
from executor_test_helpers import strategy

from executor.launch import run_local
from executor.mesh import build_mesh, tied_ends_group


def coordinates(rank, world, strat):
    mesh = build_mesh(strat, "cpu")
    group = tied_ends_group(mesh) if strat.pp > 1 else None   # the executor asks for it only then
    return {"pp_rank": mesh.pp_rank, "dp_rank": mesh.dp_rank, "cp_rank": mesh.cp_rank,
            "tp_rank": mesh["tp"].get_local_rank(), "cp_group": dist.get_process_group_ranks(mesh["cp"].get_group()),
            "weight_group": dist.get_process_group_ranks(mesh.dp_cp_mesh.get_group()),
            "tied_ends": dist.get_process_group_ranks(group) if group is not None else []}


@pytest.mark.parametrize("dp,cp,tp,pp", [(2, 1, 1, 2), (2, 1, 2, 1), (1, 1, 2, 2), (2, 2, 1, 1), (1, 2, 1, 2),
                                         (1, 2, 2, 1)])
def test_ranks_sit_where_the_cost_model_numbers_them(dp, cp, tp, pp):
    strat = strategy(dp=dp, tp=tp, pp=pp, cp=cp)
    results = run_local(coordinates, strat.num_gpus, strat)
    for rank, got in enumerate(results):
        assert rank == got["tp_rank"] + tp * (got["cp_rank"] + cp * (got["dp_rank"] + dp * got["pp_rank"]))
        same_stage_and_tp = [r for r, other in enumerate(results)
                             if (other["pp_rank"], other["tp_rank"]) == (got["pp_rank"], got["tp_rank"])]
        assert got["weight_group"] == same_stage_and_tp   # every dp and cp rank of the stage's tp shard
        assert got["cp_group"] == [r for r in same_stage_and_tp if results[r]["dp_rank"] == got["dp_rank"]]
        if pp > 1:
            partner = rank + dp * cp * tp * (pp - 1) if got["pp_rank"] == 0 else rank - dp * cp * tp * (pp - 1)
            assert got["tied_ends"] == sorted([rank, partner])


def expert_groups(rank, world, strat):
    mesh = build_mesh(strat, "cpu")
    return (dist.get_process_group_ranks(mesh["ep"].get_group()), dist.get_process_group_ranks(mesh["edp"].get_group()))


@pytest.mark.parametrize("dp,cp,tp,pp,ep", [(2, 1, 2, 1, 4), (2, 1, 2, 1, 2), (1, 2, 1, 2, 2), (2, 2, 1, 1, 2)])
def test_expert_groups_fold_over_tp_cp_and_dp(dp, cp, tp, pp, ep):
    """The experts' groups fold apart from attention's (Megatron-Core's expert rank
    generator with expert tp 1): ep consecutive ranks of a stage, tp first, then cp and
    dp; edp the ranks ep apart, as costmodel.terms.comm.groups places them."""
    strat = strategy(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=1 if tp > 1 else None, sp=tp > 1)
    stage = dp * cp * tp
    for rank, (ep_group, edp_group) in enumerate(run_local(expert_groups, strat.num_gpus, strat)):
        first = rank - rank % ep
        assert ep_group == list(range(first, first + ep))
        base = rank - rank % stage
        assert edp_group == [base + rank % ep + i * ep for i in range(stage // ep)]
