"""Communication: where a process group sits on the cluster and how long one collective
takes on it. `collective_time_s` is the only place a collective is costed.

Model: alpha-beta ring collectives (Thakur, Rabenseifner & Gropp 2005, "Optimization of
Collective Communication Operations in MPICH", §4), hierarchical when a group spans
nodes: an intra-node phase over NVLink and an inter-node phase where each of the k
group members in a node drives its own NIC on 1/k of the data (the NCCL tree/ring
layout on DGX nodes, one HCA per GPU).

The runtime profile (costmodel.specs.runtime) scales the bandwidth by message size: a
collective moving m bytes per rank reaches m / (m + collective_half_bytes) of the link's
large-message bandwidth (the knee of nccl-tests' busbw curves; small messages are
latency and protocol bound, e.g. ZeRO-3's per-layer gathers at large dp), except on
links whose collectives were measured and fitted as alpha-beta lines.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.problem import Problem
from costmodel.specs import ClusterSpec, LinkSpec, RuntimeSpec
from costmodel.specs.training import FP8_SCALE_BYTES_PER_VALUE
from costmodel.strategy import Strategy
from costmodel.terms import compute


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


def _ring_time_s(kind: str, total_bytes: float, n: int, link: LinkSpec, size_efficiency: float = 1.0) -> float:
    """Ring collective of `total_bytes` (the full, unsharded buffer) over n ranks, at
    `size_efficiency` of the link's achieved bandwidth."""
    if n <= 1 or total_bytes <= 0:
        return 0.0
    link = link.for_kind(kind)
    bw = link.achieved_bytes_per_s * size_efficiency
    if kind == "all_reduce":  # reduce-scatter + all-gather: 2(n-1)/n of the buffer
        return 2 * (n - 1) / n * total_bytes / bw + 2 * (n - 1) * link.latency_s
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * total_bytes / bw + (n - 1) * link.latency_s
    raise ValueError(kind)


def collective_time_s(kind: str, total_bytes: float, group: Placement, cluster: ClusterSpec,
                      runtime: RuntimeSpec | None = None) -> float:
    """Seconds for one collective.

    kind: all_reduce | all_gather | reduce_scatter (total_bytes = the full buffer),
    all_to_all (total_bytes = what one rank sends in all), p2p (bytes sent one way;
    the group is the sender and receiver pair). `runtime`: the engine's bandwidth by
    message size (None: every message at the link's large-message bandwidth).
    """
    intra, inter = cluster.intra_node, cluster.inter_node
    if total_bytes <= 0 or group.size <= 1:
        return 0.0
    # Bytes one rank moves per step of the collective: the whole message for p2p, a
    # 1/n chunk of the buffer for the ring and all-to-all collectives.
    per_rank = total_bytes if kind == "p2p" else total_bytes / group.size
    # A cluster whose links carry measured per-collective fits (`collectives`: alpha-beta
    # lines fitted over message sizes by costmodel.calibrate, e.g. the cpu cluster's
    # gloo) already prices small messages through its latency: no curve on top.
    measured = bool(intra.collectives or inter.collectives)
    size_eff = 1.0 if runtime is None or measured else runtime.message_efficiency(per_rank)
    if kind == "p2p":
        link = (inter if group.nodes > 1 else intra).for_kind(kind)
        return link.latency_s + total_bytes / (link.achieved_bytes_per_s * size_eff)
    if kind == "all_to_all":
        n, k = group.size, group.per_node
        return all_to_all_s((k - 1) / n * total_bytes, k - 1, (n - k) / n * total_bytes, n - k, cluster, runtime)
    if group.nodes == 1:
        return _ring_time_s(kind, total_bytes, group.size, intra, size_eff)
    # Hierarchical: the k members of a node split the buffer, each crosses the network
    # with 1/k of it, and the node-local phases move the rest over NVLink.
    k = group.per_node
    inter_part = _ring_time_s(kind, total_bytes / k, group.nodes, inter, size_eff)
    intra_part = _ring_time_s("all_reduce" if kind == "all_reduce" else kind, total_bytes, k, intra, size_eff)
    return inter_part + intra_part


def all_to_all_s(on_node_bytes: float, on_node_peers: int, off_node_bytes: float, off_node_peers: int,
                 cluster: ClusterSpec, runtime: RuntimeSpec | None = None) -> float:
    """Seconds for an all-to-all in which a rank sends `on_node_bytes` to `on_node_peers`
    ranks of its own node and `off_node_bytes` to `off_node_peers` ranks (or nodes)
    beyond it, and receives as much. NCCL's all-to-all posts every peer's send and receive
    at once (grouped ncclSend/ncclRecv: nccl-tests src/alltoall.cu), so the NVLink part
    and the network part run at the same time on their own links and the longer one
    paces the exchange; each part reaches the bandwidth of its per-peer message size."""
    intra, inter = cluster.intra_node.for_kind("all_to_all"), cluster.inter_node.for_kind("all_to_all")
    measured = bool(cluster.intra_node.collectives or cluster.inter_node.collectives)

    def part_s(num_bytes: float, peers: int, link: LinkSpec) -> float:
        if peers <= 0 or num_bytes <= 0:
            return 0.0
        size_eff = 1.0 if runtime is None or measured else runtime.message_efficiency(num_bytes / peers)
        return num_bytes / (link.achieved_bytes_per_s * size_eff) + peers * link.latency_s

    return max(part_s(on_node_bytes, on_node_peers, intra), part_s(off_node_bytes, off_node_peers, inter))


def expert_exchange_s(model, tokens_bytes: float, ep: int, group: Placement, cluster: ClusterSpec,
                      runtime: RuntimeSpec, value_bytes: float, fp8: bool = False) -> float:
    """Seconds for one pass of a mixture-of-experts layer's token exchange: dispatch to
    the experts and combine back (forward; backward moves the gradients the same two
    ways: Lepikhin et al. 2020, GShard §2.2). `tokens_bytes`: one hidden vector of each of
    the rank's tokens, in `value_bytes` a value. The busiest rank receives
    `busiest_rank_rows_per_token` rows a token (load imbalance) and the exchange waits for it.

    runtime.moe_dispatch "all-to-all": each routed row travels on its own, spread evenly
    over the ep ranks. "deepep" (DeepSeek-AI 2024 §3.2.2; DeepEP's internode kernels): a
    token crosses the network once to each other node its experts lie on
    (ModelSpec.routed_nodes_per_token), to the GPU of the same local index, which
    forwards it over NVLink to the node's GPUs holding its experts; under FP8 training
    the dispatch carries FP8 values and a float32 scale per 128 (1x128 tiles, §3.3.2 and
    §3.3.4), the combine stays 16-bit. Its kernels stream every token through a fixed set
    of NVLink and RDMA channels rather than one NCCL message a peer, and DeepEP's published
    normal-kernel figures (H800, 4096 tokens a rank, hidden 7168, top-8 of 4 groups) run
    near the RDMA and NVLink line rates: priced at the links' achieved bandwidth, without
    the runtime's message-size curve."""
    if ep <= 1 or tokens_bytes <= 0:
        return 0.0
    rows = model.busiest_rank_rows_per_token(ep)
    n, k, nodes = group.size, group.per_node, group.nodes
    deepep = runtime.moe_dispatch == "deepep"
    if deepep and nodes > 1:
        crossings = model.routed_nodes_per_token(nodes) * (nodes - 1) / nodes * rows / model.num_experts_per_tok
        on_node, on_peers = tokens_bytes * rows * (k - 1) / k, k - 1
        off_node, off_peers = tokens_bytes * crossings, nodes - 1
    else:
        on_node, on_peers = tokens_bytes * rows * (k - 1) / n, k - 1
        off_node, off_peers = tokens_bytes * rows * (n - k) / n, n - k
    # FP8 values and their 1x128 tiles' scales (the blockwise recipe's bytes a value).
    fp8_bytes = compute.FP8_CAST_WRITE_BYTES + FP8_SCALE_BYTES_PER_VALUE["blockwise"]
    dispatch_ratio = fp8_bytes / value_bytes if fp8 and deepep else 1.0
    curve = None if deepep else runtime
    dispatch = all_to_all_s(on_node * dispatch_ratio, on_peers, off_node * dispatch_ratio, off_peers, cluster, curve)
    return dispatch + all_to_all_s(on_node, on_peers, off_node, off_peers, cluster, curve)


def sharded_collective_s(kind: str, total_bytes: float, group: Placement, cluster,
                         runtime: RuntimeSpec | None = None) -> float:
    """A ZeRO-3 all-gather or reduce-scatter of one unit, with the copies around it:
    FSDP2 copies the shard into the all-gather buffer and the gathered buffer out into
    the weights, and the gradients into the reduce-scatter buffer and the shard out
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: foreach_all_gather,
    foreach_all_gather_copy_out, foreach_reduce_scatter_copy_in), each a read and a
    write of the full buffer and of the shard, memory-bound. On GPUs they hide behind
    the layer's compute with the collective; on CPU ranks (bench/executor_correlation.py)
    they take as long as the collective. ZeRO-1/2 engines keep gradients and weights in
    flat buffers the collectives use in place, so they are charged none."""
    if group.size <= 1 or total_bytes <= 0:
        return 0.0
    return (collective_time_s(kind, total_bytes, group, cluster, runtime)
            + fsdp_copies_s(kind, total_bytes, group.size, cluster))


def fsdp_copies_s(kind: str, total_bytes: float, group_size: int, cluster) -> float:
    """FSDP2's copies around one all-gather or reduce-scatter of `total_bytes` (the
    unsharded unit): a read and a write of the full buffer and of the shard, memory-bound;
    where the device measured its host overheads (CPU ranks, HostOverheads), the measured
    seconds per byte instead, which also hold the hooks' time and fresh buffers' page
    faults (CPU tensors get no caching allocator)."""
    host = cluster.gpu.host_overheads
    if host is not None:
        per_byte = host.fsdp_gather_s_per_byte if kind == "all_gather" else host.fsdp_reduce_s_per_byte
        return per_byte * total_bytes
    return compute.memory_bound_time_s(2 * total_bytes * (1 + 1 / group_size), cluster)



def tp_pairs(model, strategy: Strategy) -> tuple[tuple[float, int], ...]:
    """One layer's tensor-parallel collective pairs (an all-gather and a reduce-scatter
    under sequence parallelism, else an all-reduce), each way: (bytes as a multiple of
    the rank's b x s x h activation, pairs of that size). Attention has one pair, a dense
    MLP one (Shoeybi et al. 2019 §3). In an MoE block the shared expert is split over tp
    as a dense MLP is; routed experts split over etp ranks gather the rows each rank's
    experts receive from the etp group and reduce-scatter their outputs
    (Megatron-Core's MoEAlltoAllTokenDispatcher: gather_from_sequence_parallel_region
    over the expert tensor-parallel group after the ep all-to-all), the busiest rank's
    rows a token x etp / tp; whole experts under tp (MoE parallel folding, etp 1)
    route each rank's sequence shard as it is, with no pair."""
    if not model.is_moe:
        return ((1.0, 2),)
    out = [(1.0, 2 if model.has_shared_expert else 1)]
    etp = strategy.expert_tp
    if etp > 1:
        out.append((model.busiest_rank_rows_per_token(strategy.ep) * etp / strategy.tp, 1))
    return tuple(out)


def groups(problem: Problem, strategy: Strategy) -> dict[str, Placement]:
    """Where each kind of process group sits (rank order tp, cp, dp, pp). "dp" is the
    group that reduces gradients and shards ZeRO states: every rank that holds the same
    weights, dp x cp of them (Megatron-LM's data-parallel group with context
    parallelism). The experts' groups: under MoE parallel folding
    (RuntimeSpec.moe_folding) laid over a stage's dp x cp x tp ranks etp innermost, then
    ep, then expert data parallelism (Megatron-Core's expert RankGenerator); else ep
    inside dp, its members tp x cp apart."""
    g = problem.cluster.fast_domain_gpus
    tp, cp, dp = strategy.tp, strategy.cp, strategy.dp
    runtime = getattr(problem, "runtime", None)   # a traced module (TracedProblem) has no experts
    if runtime is not None and runtime.moe_folding:
        ep_group = placement(strategy.ep, strategy.expert_tp, g)
        expert_dp = placement(strategy.edp, strategy.expert_tp * strategy.ep, g)
    else:
        ep_group = placement(strategy.ep, tp * cp, g)
        expert_dp = placement(strategy.edp, tp * strategy.ep, g)
    return {
        "tp": placement(tp, 1, g),
        "cp": placement(cp, tp, g),
        "dp": placement(dp * cp, tp, g),
        "ep": ep_group,
        "expert_dp": expert_dp,
        # The whole pipeline: once it spans nodes, some stage boundary crosses the
        # network, and in the 1F1B steady state the slowest boundary paces every send.
        "pp": placement(strategy.pp, tp * cp * dp, g),
        # First and last stage (the tied-embedding gradient all-reduce): on one node
        # only when the whole pipeline is.
        "pp_ends": (Placement(1, 1, 1) if strategy.pp == 1
                    else Placement(2, 2, 1) if strategy.num_gpus <= g else Placement(2, 1, 2)),
    }
