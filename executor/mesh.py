"""The one place a strategy becomes ranks: the job's DeviceMesh, this rank's coordinates
in it, and the process groups built beside it.

Mesh dims ("pp", "edp", "ep", "cp", "tp"), tp innermost, so global rank = tp_rank + tp *
(cp_rank + cp * (dp_rank + dp * pp_rank)) as in costmodel.strategy, with the data-parallel
rank split as edp_rank * ep + ep_rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from costmodel.strategy import Strategy

MESH_DIMS = ("pp", "edp", "ep", "cp", "tp")


@dataclass(frozen=True)
class RankMesh:
    """The (pp, edp, ep, cp, tp) mesh of the whole job, its dp = edp x ep sub-mesh, the
    mesh of the ranks holding the same weights (`dp_cp_mesh`: dp x cp flattened, over
    which gradients are reduced and ZeRO shards; the dp mesh itself when cp is 1), and
    where this rank sits: `mesh["tp"]` is this rank's tp sub-mesh, `mesh["cp"]` its
    context-parallel one. `dp_rank` is the data rank: the cp ranks of one replica read
    the same sequences, each its share of their tokens."""

    device_mesh: DeviceMesh
    dp_mesh: DeviceMesh
    dp_cp_mesh: DeviceMesh
    pp_rank: int
    dp_rank: int
    cp_rank: int = 0

    def __getitem__(self, dim: str) -> DeviceMesh:
        return self.device_mesh[dim]


def build_mesh(strategy: Strategy, device_type: str) -> RankMesh:
    """The job's mesh for `strategy`; every rank must call it."""
    shape = (strategy.pp, strategy.dp // strategy.ep, strategy.ep, strategy.cp, strategy.tp)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    dp_mesh = mesh["edp", "ep"]._flatten("dp")
    # No group of its own at cp 1: the ranks holding the same weights are the dp ranks.
    dp_cp_mesh = mesh["edp", "ep", "cp"]._flatten("dp_cp") if strategy.cp > 1 else dp_mesh
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    return RankMesh(mesh, dp_mesh, dp_cp_mesh, pp_rank=coords["pp"], dp_rank=dp_mesh.get_local_rank(),
                    cp_rank=coords["cp"])


def tied_ends_group(mesh: RankMesh) -> dist.ProcessGroup | None:
    """This rank's group of the ranks holding the embedding and the head's copy of it
    (first and last pipeline stage, same dp, cp and tp coordinate), whose gradients are
    summed (Megatron-LM); None on the ranks between. Every rank must call it."""
    ranks = mesh.device_mesh.mesh   # [pp, edp, ep, cp, tp] global ranks
    mine = None
    inner = ranks.shape[1:]
    for index in torch.cartesian_prod(*(torch.arange(n) for n in inner)).view(-1, len(inner)).tolist():
        pair = [int(ranks[0][tuple(index)]), int(ranks[-1][tuple(index)])]
        group = dist.new_group(pair)   # every rank creates every group, in the same order
        if dist.get_rank() in pair:
            mine = group
    return mine
