"""The hardware a plan runs on: a GPU, the links between GPUs, a cluster of one GPU type
and a mixed cluster of several.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HostOverheads:
    """Host seconds PyTorch's parallel wrappers add to a step beyond the compute and the
    collectives priced elsewhere, where nothing hides them: on CPU ranks the host is the
    device. Measured by `shardwise profile` on CPU (executor.measure.measure_host_overheads:
    the calling thread's CPU time of a wrapped layer over its plain shard's, less the
    bare collectives'). On a GPU the host runs ahead of the kernels, so GPU specs carry
    none; the runtime's `layer_launch_s` prices the launch floor there."""

    # DTensor TP (executor.parallelize.apply_tensor_parallel): one layer's forward and
    # backward per micro-batch, a fixed part and its growth with the layer's b*s*h
    # activation bytes (the redistributions' copies).
    tp_layer_s: float = 0.0
    tp_layer_s_per_byte: float = 0.0
    sp_layer_s: float = 0.0               # what sequence parallelism adds to a layer
    # FSDP2 (fully_shard): per byte of the unsharded unit, each all-gather's copy-in and
    # copy-out (split_with_sizes_copy into fresh buffers) and each reduce-scatter's
    # torch._chunk_cat of the gradients.
    fsdp_gather_s_per_byte: float = 0.0
    fsdp_reduce_s_per_byte: float = 0.0

    def tp_layer_time_s(self, activation_bytes: float, sequence_parallel: bool) -> float:
        """DTensor's host time for one layer's forward + backward at this activation."""
        return (self.tp_layer_s + self.tp_layer_s_per_byte * activation_bytes
                + (self.sp_layer_s if sequence_parallel else 0.0))


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_flops_per_s: dict[str, float]
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    # GEMM efficiency curve (costmodel.terms.compute.gemm_efficiency); None keeps the
    # constants fitted on A100 tensor cores.
    gemm_efficiency_max: float | None = None
    gemm_half_dim: float | None = None
    # Board power in watts while running kernels and while idle (costmodel.estimate.energy);
    # None where the hardware file cites no figure. Busy is the vendor TDP.
    busy_power_w: float | None = None
    idle_power_w: float | None = None
    host_overheads: HostOverheads | None = None   # measured on CPU ranks; None on GPUs

    def peak_for(self, precision: str) -> float:
        return self.peak_flops_per_s[precision]


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link, per GPU.

    `efficiency` is the achieved fraction of `bandwidth_bytes_per_s` for large
    collectives (nccl-tests "busbw" over peak); the cluster file says where it came from.
    """

    bandwidth_bytes_per_s: float
    latency_s: float
    efficiency: float = 1.0
    # Measured figures for collectives that differ from the link's (kind -> achieved
    # bandwidth, latency): gloo's all-gather and reduce-scatter run at a fraction of
    # its all-reduce, for instance.
    collectives: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.bandwidth_bytes_per_s * self.efficiency

    def for_kind(self, kind: str) -> LinkSpec:
        """The link as one collective kind sees it."""
        if kind not in self.collectives:
            return self
        bandwidth, latency = self.collectives[kind]
        return LinkSpec(bandwidth, latency)


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    gpu: GPUSpec
    gpus_per_node: int
    num_nodes: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    # Fraction of computation a collective can hide behind: 1 where collectives run on
    # their own engine (NCCL kernels on their own stream), 0 where they share the
    # rank's only core with the computation (gloo on one CPU core per rank).
    comm_overlap: float = 1.0
    # On-demand price of one GPU for one hour, USD (costmodel.estimate.energy); None: unpriced.
    gpu_hour_price_usd: float | None = None
    # GPUs that share one NVLink domain where it spans hosts (GB200 NVL72: 72 GPUs over
    # 18 hosts of 4); None: the domain is the node. `intra_node` is the domain's link.
    nvlink_domain_gpus: int | None = None

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.num_nodes

    @property
    def fast_domain_gpus(self) -> int:
        """GPUs reached over `intra_node`: the NVLink domain, at most the cluster. Process
        groups within it are priced on `intra_node`, those across it on `inter_node`."""
        return min(self.nvlink_domain_gpus or self.gpus_per_node, self.num_gpus)


@dataclass(frozen=True)
class MixedClusterSpec:
    """Groups of nodes of different GPU types and links. Each group is a homogeneous
    cluster (its `name` the group's name); `inter_group` is the link between nodes of
    different groups, per GPU and one direction. Global ranks run over the groups in
    this order, so node ranks follow it (group 0's nodes first)."""

    name: str
    groups: tuple[ClusterSpec, ...]
    inter_group: LinkSpec

    @property
    def num_gpus(self) -> int:
        return sum(g.num_gpus for g in self.groups)

    def group(self, name: str) -> ClusterSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)
