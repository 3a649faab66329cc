"""Communication: where a process group sits on the cluster and how long one collective
takes on it. `collective_time_s` is the only place a collective is costed.

Model: alpha-beta ring collectives (Thakur, Rabenseifner & Gropp 2005, "Optimization of
Collective Communication Operations in MPICH", §4), hierarchical when a group spans
nodes: an intra-node phase over NVLink and an inter-node phase where each of the k
group members in a node drives its own NIC on 1/k of the data (the NCCL tree/ring
layout on DGX nodes, one HCA per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.specs import ClusterSpec, LinkSpec


@dataclass(frozen=True)
class Placement:
    """A process group of `size` ranks: `per_node` of them share a node, over `nodes` nodes."""

    size: int
    per_node: int
    nodes: int


def placement(size: int, stride: int, gpus_per_node: int) -> Placement:
    """Group of `size` ranks whose members are `stride` global ranks apart (tp: stride 1,
    dp: stride tp, pp: stride tp*dp; see costmodel.strategy for the rank order)."""
    if size <= 1:
        return Placement(1, 1, 1)
    per_node = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
    return Placement(size, per_node, -(-size // per_node))


def _ring_time_s(kind: str, total_bytes: float, n: int, link: LinkSpec) -> float:
    """Ring collective of `total_bytes` (the full, unsharded buffer) over n ranks."""
    if n <= 1 or total_bytes <= 0:
        return 0.0
    link = link.for_kind(kind)
    bw = link.achieved_bytes_per_s
    if kind == "all_reduce":  # reduce-scatter + all-gather: 2(n-1)/n of the buffer
        return 2 * (n - 1) / n * total_bytes / bw + 2 * (n - 1) * link.latency_s
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * total_bytes / bw + (n - 1) * link.latency_s
    raise ValueError(kind)


def collective_time_s(kind: str, total_bytes: float, group: Placement, cluster: ClusterSpec) -> float:
    """Seconds for one collective.

    kind: all_reduce | all_gather | reduce_scatter (total_bytes = the full buffer),
    all_to_all (total_bytes = what one rank sends in all), p2p (bytes sent one way;
    the group is the sender and receiver pair).
    """
    intra, inter = cluster.intra_node, cluster.inter_node
    if total_bytes <= 0 or group.size <= 1:
        return 0.0
    if kind == "p2p":
        link = (inter if group.nodes > 1 else intra).for_kind(kind)
        return link.latency_s + total_bytes / link.achieved_bytes_per_s
    if kind == "all_to_all":
        intra, inter = intra.for_kind(kind), inter.for_kind(kind)
        n, k = group.size, group.per_node
        on_node = (k - 1) / n * total_bytes / intra.achieved_bytes_per_s
        off_node = (n - k) / n * total_bytes / inter.achieved_bytes_per_s
        latency = (k - 1) * intra.latency_s + (n - k) * inter.latency_s
        return on_node + off_node + latency
    if group.nodes == 1:
        return _ring_time_s(kind, total_bytes, group.size, intra)
    # Hierarchical: the k members of a node split the buffer, each crosses the network
    # with 1/k of it, and the node-local phases move the rest over NVLink.
    k = group.per_node
    inter_part = _ring_time_s(kind, total_bytes / k, group.nodes, inter)
    intra_part = _ring_time_s("all_reduce" if kind == "all_reduce" else kind, total_bytes, k, intra)
    return inter_part + intra_part
