"""The mesh (executor.mesh): each rank sits where costmodel.strategy numbers it (global
rank = tp_rank + tp * (dp_rank + dp * pp_rank)), and the tied embedding's group pairs
the first and last pipeline stage of each dp and tp coordinate."""

import pytest
import torch.distributed as dist
from executor_test_helpers import strategy

from executor.launch import run_local
from executor.mesh import build_mesh, tied_ends_group


def coordinates(rank, world, strat):
    mesh = build_mesh(strat, "cpu")
    group = tied_ends_group(mesh) if strat.pp > 1 else None   # the executor asks for it only then
    return {"pp_rank": mesh.pp_rank, "dp_rank": mesh.dp_rank, "tp_rank": mesh["tp"].get_local_rank(),
            "tied_ends": dist.get_process_group_ranks(group) if group is not None else []}


@pytest.mark.parametrize("dp,tp,pp", [(2, 1, 2), (2, 2, 1), (1, 2, 2)])
def test_ranks_sit_where_the_cost_model_numbers_them(dp, tp, pp):
    for rank, got in enumerate(run_local(coordinates, dp * tp * pp, strategy(dp=dp, tp=tp, pp=pp))):
        assert rank == got["tp_rank"] + tp * (got["dp_rank"] + dp * got["pp_rank"])
        if pp > 1:
            partner = rank + dp * tp * (pp - 1) if got["pp_rank"] == 0 else rank - dp * tp * (pp - 1)
            assert got["tied_ends"] == sorted([rank, partner])
