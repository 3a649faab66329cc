"""The executor's record of the collectives a rank really issues: a dispatch mode that
sees every c10d and functional collective (from DDP, FSDP, DTensor, pipelining and our
own calls) and records its kind, group size and bytes in the convention of
`costmodel.terms.comm.collective_time_s` (the full buffer for all-reduce, all-gather
and reduce-scatter; what one rank sends for all-to-all and point-to-point). The cost
model's own collective terms live in costmodel; this is what actually ran.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_c10d, _funcol = torch.ops.c10d, torch.ops._c10d_functional


@dataclass(frozen=True)
class Issued:
    kind: str
    group_size: int
    bytes: int


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def _pg_size(pg) -> int:
    return pg.size() if hasattr(pg, "size") else torch._C._distributed_c10d.ProcessGroup.unbox(pg).size()


def _describe(func, args) -> Issued | None:
    """(kind, group size, bytes) of a collective op call; None for anything else."""
    if func in (_c10d.allreduce_.default, _c10d.allreduce_coalesced_.default):
        return Issued("all_reduce", _pg_size(args[1]), _nbytes(args[0]))
    if func is _c10d._allgather_base_.default:
        return Issued("all_gather", _pg_size(args[2]), _nbytes(args[0]))
    if func is _c10d._reduce_scatter_base_.default:
        return Issued("reduce_scatter", _pg_size(args[2]), _nbytes(args[1]))
    if func is _c10d.alltoall_base_.default:
        return Issued("all_to_all", _pg_size(args[2]), _nbytes(args[1]))
    if func is _c10d.send.default:
        return Issued("p2p", 2, _nbytes(args[0]))
    if func is _c10d.broadcast_.default:
        return Issued("broadcast", _pg_size(args[1]), _nbytes(args[0]))
    if func is _funcol.all_reduce.default:
        return Issued("all_reduce", _resolve_process_group(args[2]).size(), _nbytes(args[0]))
    if func is _funcol.all_gather_into_tensor.default:
        return Issued("all_gather", args[1], _nbytes(args[0]) * args[1])
    if func is _funcol.reduce_scatter_tensor.default:
        return Issued("reduce_scatter", args[2], _nbytes(args[0]))
    if func is _funcol.all_to_all_single.default:
        return Issued("all_to_all", _resolve_process_group(args[3]).size(), _nbytes(args[0]))
    return None


class CommCounter(TorchDispatchMode):
    """`with CommCounter() as counter: ...`; then `counter.issued` lists every call."""

    def __init__(self):
        super().__init__()
        self.issued: list[Issued] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Let DTensor turn its ops into collectives first, then see those (as
        # torch.distributed.tensor.debug.CommDebugMode does).
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        issued = _describe(func, args)
        if issued is not None:
            self.issued.append(issued)
        return func(*args, **(kwargs or {}))

    def totals(self) -> dict[str, tuple[int, int]]:
        """{kind: (calls, bytes)} over everything issued."""
        calls, nbytes = Counter(), Counter()
        for c in self.issued:
            calls[c.kind] += 1
            nbytes[c.kind] += c.bytes
        return {k: (calls[k], nbytes[k]) for k in sorted(calls)}
