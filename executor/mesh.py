"""The one place a strategy becomes ranks: the job's DeviceMesh, this rank's coordinates
in it, and the process groups built beside it.

Mesh dims ("pp", "dp", "cp", "tp"), tp innermost, so global rank = tp_rank + tp *
(cp_rank + cp * (dp_rank + dp * pp_rank)) as in costmodel.strategy. The experts' mesh
("pp", "edp", "ep") lies over the same ranks with the experts' groups folded apart from
attention's (MoE parallel folding, Megatron-Core's expert RankGenerator with expert tp 1;
torchtitan's sparse mesh): a stage's dp x cp x tp ranks, in that order, split into edp
groups of ep consecutive ranks, so the ep group takes tp ranks first, then cp, then dp
(costmodel.terms.comm.groups under RuntimeSpec.moe_folding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from costmodel.strategy import Strategy

MESH_DIMS = ("pp", "dp", "cp", "tp")
EXPERT_DIMS = ("pp", "edp", "ep")


@dataclass(frozen=True)
class RankMesh:
    """The (pp, dp, cp, tp) mesh of the whole job, the mesh of the ranks holding the same
    weights (`dp_cp_mesh`: dp x cp flattened, over which gradients are reduced and ZeRO
    shards; the dp mesh itself when cp is 1), the experts' (pp, edp, ep) mesh under
    expert parallelism, and where this rank sits: `mesh["tp"]` is this rank's tp
    sub-mesh, `mesh["cp"]` its context-parallel one, `mesh["ep"]` and `mesh["edp"]` its
    expert groups. `dp_rank` is the data rank: the cp ranks of one replica read the same
    sequences, each its share of their tokens."""

    device_mesh: DeviceMesh
    dp_cp_mesh: DeviceMesh
    pp_rank: int
    dp_rank: int
    cp_rank: int = 0
    expert_mesh: DeviceMesh | None = None

    def __getitem__(self, dim: str) -> DeviceMesh:
        if dim in ("ep", "edp"):
            if self.expert_mesh is None:
                raise KeyError(f"no {dim} mesh: the strategy has ep 1")
            return self.expert_mesh[dim]
        return self.device_mesh[dim]


def build_mesh(strategy: Strategy, device_type: str) -> RankMesh:
    """The job's mesh for `strategy`; every rank must call it."""
    s = strategy
    mesh = init_device_mesh(device_type, (s.pp, s.dp, s.cp, s.tp), mesh_dim_names=MESH_DIMS)
    # No group of its own at cp 1: the ranks holding the same weights are the dp ranks.
    dp_cp_mesh = mesh["dp", "cp"]._flatten("dp_cp") if s.cp > 1 else mesh["dp"]
    # Every rank builds the experts' groups, in the same order, from the same rank table.
    expert_mesh = (DeviceMesh(device_type, mesh.mesh.reshape(s.pp, s.edp, s.ep), mesh_dim_names=EXPERT_DIMS)
                   if s.ep > 1 else None)
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    return RankMesh(mesh, dp_cp_mesh, pp_rank=coords["pp"], dp_rank=coords["dp"], cp_rank=coords["cp"],
                    expert_mesh=expert_mesh)


def tied_ends_group(mesh: RankMesh) -> dist.ProcessGroup | None:
    """This rank's group of the ranks holding the embedding and the head's copy of it
    (first and last pipeline stage, same dp, cp and tp coordinate), whose gradients are
    summed (Megatron-LM); None on the ranks between. Every rank must call it."""
    ranks = mesh.device_mesh.mesh   # [pp, dp, cp, tp] global ranks
    mine = None
    inner = ranks.shape[1:]
    for index in torch.cartesian_prod(*(torch.arange(n) for n in inner)).view(-1, len(inner)).tolist():
        pair = [int(ranks[0][tuple(index)]), int(ranks[-1][tuple(index)])]
        group = dist.new_group(pair)   # every rank creates every group, in the same order
        if dist.get_rank() in pair:
            mine = group
    return mine
