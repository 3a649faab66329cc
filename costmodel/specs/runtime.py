"""The runtime profile: what a plan costs because of the engine that runs it, not the
hardware. Overlap of each collective class with compute, achieved bandwidth by message
size, kernel efficiency (eager or compiled), the fixed costs of a step. A named,
versioned spec in `configs/runtimes/` (pytorch-native, megatron, deepspeed-zero), read by
`costmodel.specs.loading.load_runtime`, carried by `costmodel.problem.Problem` and used by
the estimate's time terms (`costmodel.estimate.uniform`, `costmodel.terms.comm`,
`costmodel.terms.compute`). Every coefficient's file names the measurements it was fitted
on (`fitted_on`); `bench/calibrate_runtime.py` fits them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from costmodel.units import MIB

DEFAULT_RUNTIME = "pytorch-native"
# PyTorch DistributedDataParallel's bucket_cap_mb default (MiB).
DDP_BUCKET_MB = 25.0


@dataclass(frozen=True)
class RuntimeSpec:
    name: str
    version: int
    # Fraction of the last micro-batch's backward that the DP gradient all-reduce
    # (ZeRO 0) or reduce-scatter (ZeRO 1/2) hides behind (bucketed, on its own stream).
    dp_overlap: float = 1.0
    # Fraction of a layer's compute that ZeRO-3 / FSDP's all-gather and reduce-scatter of
    # the next layer hide behind (prefetch one layer ahead).
    zero3_overlap: float = 1.0
    # Fraction of the weight-gradient GEMMs that the backward TP collectives hide behind.
    tp_overlap: float = 1.0
    # Async (micro-pipelined) TP: the fraction of the forward TP collectives hidden
    # behind the GEMMs they feed, applied when `async_tp` is on.
    async_tp: bool = False
    async_tp_overlap: float = 0.0
    # Fraction of a pipeline p2p send hidden behind compute (batched isend/irecv).
    pp_overlap: float = 0.0
    # Per-rank message size (bytes) at which a collective reaches half the link's
    # achieved bandwidth: bandwidth(m) = achieved * m / (m + collective_half_bytes).
    # Small messages are latency/protocol bound (ZeRO-3 per-layer gathers at large dp).
    collective_half_bytes: float = 0.0
    # Fraction of the hardware's GEMM efficiency curve the engine's layer GEMMs reach.
    gemm_efficiency_scale: float = 1.0
    # HBM traffic of the elementwise work (norms, activations, residuals, the loss)
    # over the one-pass count of costmodel.terms.compute: eager kernels read and write
    # each intermediate; a compiled graph fuses them.
    elementwise_traffic_factor: float = 1.0
    compiled_elementwise_traffic_factor: float = 1.0
    torch_compile: bool = False
    # HBM traffic of the cross-entropy over the fp32 logits over the one-pass count of
    # costmodel.terms.compute.head_compute_s: eager PyTorch upcasts the logits, then
    # log-softmaxes them, each a pass of its own (a fused vocab-parallel kernel: 1).
    loss_traffic_factor: float = 1.0
    # What the engine's selective recompute keeps and repeats (costmodel.terms.recompute):
    # "attention-core" (Korthikanti et al. 2022 §4.3, Megatron-LM) or "op-level"
    # (torchtitan's per-op SAC, which the executor runs too: every second matmul and the
    # elementwise ops are repeated, SDPA's output is kept).
    selective_recompute: str = "attention-core"
    # The loss runs chunked over tokens (executor.models.ChunkedCrossEntropy: no fp32
    # copy of the whole micro-batch's logits) where the logits are not vocabulary-
    # parallel; false: F.cross_entropy over upcast logits (torchtitan, Hugging Face).
    chunked_loss: bool = False
    # Which FSDP2 units (ZeRO-3, pp = 1) the engine keeps gathered from their forward to
    # their backward instead of resharding after forward (costmodel.estimate.uniform
    # fsdp_units): "none" (the executor: executor.parallelize.apply_fsdp reshards every
    # unit); "head" (torchtitan 0.3 under fsdp_reshard_after_forward "default": the final
    # norm and LM head unit, not resharded as FSDP2 would gather it at once for backward);
    # "root" (torchtitan of 2024: the embedding, final norm and head stay in the root
    # unit, which FSDP2 never reshards after forward (torch _fsdp_state._lazy_init),
    # gathered until the end of backward, and the last layer is kept).
    fsdp_kept_gathered: str = "none"
    # FSDP2 units gathered ahead of the one in use, forward and backward, at least 1
    # (FSDPModule.set_modules_to_forward_prefetch / set_modules_to_backward_prefetch;
    # FSDP2 by itself prefetches one unit in backward, and an empty list keeps that).
    # Each unit ahead holds its all-gather output (costmodel.estimate.uniform rank_memory);
    # the time the gathers hide is zero3_overlap's, fitted at 1.
    fsdp_prefetch: int = 1
    # DDP's gradient bucket (DistributedDataParallel bucket_cap_mb, MiB): two in flight.
    ddp_bucket_mb: float = DDP_BUCKET_MB
    # Seconds of one layer's forward + backward that no shape changes: eager PyTorch
    # dispatches and launches each of a layer's ~100 kernels from the host (a few
    # microseconds each), visible where the kernels are short (narrow TP shards, small
    # micro-batches, the embedding). Charged to each layer, the embedding and the head.
    layer_launch_s: float = 0.0
    # Seconds per step outside the layers: launch, optimizer bookkeeping, host sync.
    step_overhead_s: float = 0.0
    # How the engine holds a 16-bit run's weights (costmodel.specs.training.MIXED_PRECISION):
    # what the memory terms count. The executor casts under torch.autocast; Megatron-LM
    # and DeepSpeed keep 16-bit weights and gradients beside an fp32 master copy.
    mixed_precision: str = "autocast"
    # The band an estimate under this runtime carries: measured over predicted, at its
    # least and most, over the rows that `bench/calibrate_runtime.py` held out of the
    # fit (step time) or that PyTorch's own accounting and real runs give (peak memory,
    # which is counted, not fitted). 1.0 where nothing was measured.
    step_time_low_ratio: float = 1.0
    step_time_high_ratio: float = 1.0
    memory_high_ratio: float = 1.0
    # Whether the engine splits each expert's matrices over tp (Megatron-LM's expert
    # tensor parallelism). The executor keeps experts whole (executor/launch.py
    # check_supported), so under its runtime MoE models plan with etp 1 wherever tp > 1.
    expert_tensor_parallel: bool = True
    # Whether the engine lays out the experts' process groups apart from attention's over
    # a pipeline stage's dp x cp x tp ranks, etp innermost, then ep, then expert data
    # parallelism (MoE parallel folding: Liu et al. 2025; Megatron-Core's expert
    # RankGenerator "tp-ep-dp-pp", torchtitan's sparse mesh), so that an ep group may
    # span tp, cp and dp ranks and experts may stay whole under tp (Strategy.etp 1; the
    # executor's expert mesh, executor/mesh.py). Else ep lies inside dp (DeepSpeed's
    # expert groups).
    moe_folding: bool = False
    # Whether sequence parallelism gathers each linear block's input again in backward:
    # Megatron-LM saves the sharded input and re-gathers it for the weight gradient
    # (megatron-core tensor_parallel/layers.py, LinearWithGradAccumulationAndAsyncCommunication;
    # Korthikanti et al. 2022 §4.2.2); PyTorch's tensor parallelism keeps the gathered
    # input autograd saved (measured: tests/executor/test_collective_log.py).
    sp_regathers_inputs: bool = True
    # Whether the engine runs zero-bubble pipeline schedules (zb-interleaved, zbv, dualpipev:
    # torch.distributed.pipelining's, as the executor and torchtitan do; Megatron-LM's
    # and DeepSpeed's pipelines run 1F1B and interleaved 1F1B only). They also need eager
    # blocks: torch splits their backward outside torch.compile.
    zero_bubble_schedules: bool = True
    # How a mixture-of-experts layer moves tokens to their experts and back
    # (costmodel.terms.comm expert_exchange_s): "all-to-all", one copy of a token's
    # hidden vector per routed expert over NCCL's all-to-all (the executor, torchtitan,
    # Megatron-LM's alltoall dispatcher); "deepep", one copy per destination node over the
    # network, fanned out to the node's GPUs over NVLink, FP8 dispatch under FP8 training
    # (DeepEP; Megatron-LM's flex dispatcher; DeepSeek-AI 2024 §3.2.2, §3.3.4).
    moe_dispatch: str = "all-to-all"
    # Fraction of the expert all-to-all that a schedule pairing one micro-batch's forward
    # chunk with another's backward (dualpipev's overlapped F&B actions) hides behind the
    # pair's computation (DeepSeek-AI 2024 §3.2.1, Figure 4). torch's pipelining runs an
    # OVERLAP_F_B action's forward and backward one after the other unless a custom
    # function is registered (torch/distributed/pipelining/schedules.py, _PipelineScheduleRuntime):
    # 0 there, as the executor runs it; torchtitan 0.2.2 registers one that runs the pair on
    # two threads meeting at dispatch and combine (distributed/dual_pipe_v.py): 1.
    ep_overlap: float = 0.0
    # Whether FP8 training converts the MoE experts' GEMMs, routed and shared, as well as
    # the attention and dense MLP linears (costmodel.terms.compute fp8_expert_linears):
    # Megatron-LM runs Transformer Engine's grouped linear layers in FP8 under
    # --fp8-format; torchtitan with its quantize.grouped_mm.float8 converter; the
    # executor converts attention and dense MLPs only.
    fp8_experts: bool = False
    # Whether the engine's FP8 casts are fused kernels that compute the amax as they
    # cast (Transformer Engine's cast and cast-transpose), one pass where eager torchao
    # makes five (costmodel.terms.compute FP8_EAGER_CAST_FACTOR); compiled blocks fuse
    # them too (torch_compile).
    fused_fp8_casts: bool = False
    # coefficient -> the measurements it was fitted on (or the source it was read from).
    fitted_on: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def ddp_bucket_bytes(self) -> float:
        return self.ddp_bucket_mb * MIB

    @property
    def fsdp_gathered_units(self) -> int:
        """FSDP2 units whose weights are gathered at once: the one in use and those
        prefetched (measured at 1 ahead: 3 x 772 MiB with the reduce-scatter input,
        llama2-7b zero3 dp8 fp32, bench/memory_tracker.py)."""
        return 1 + self.fsdp_prefetch

    @property
    def selective_rebuilds_layer(self) -> bool:
        """Whether a selectively recomputed layer is made whole again in its backward
        (op-level: every op but the kept ones is rerun), as a fully recomputed one is."""
        return self.selective_recompute == "op-level"

    @property
    def elementwise_factor(self) -> float:
        return self.compiled_elementwise_traffic_factor if self.torch_compile else self.elementwise_traffic_factor

    def message_efficiency(self, per_rank_bytes: float) -> float:
        """Fraction of the link's large-message bandwidth a collective moving
        `per_rank_bytes` per rank reaches."""
        if self.collective_half_bytes <= 0 or per_rank_bytes <= 0:
            return 1.0
        return per_rank_bytes / (per_rank_bytes + self.collective_half_bytes)


# Fields a runtime file gives as numbers in [0, 1] (fractions), other numbers, flags.
# Selective recompute policies an engine runs (costmodel.terms.recompute).
SELECTIVE_POLICIES = ("attention-core", "op-level")
# What an engine's FSDP2 wrapping keeps gathered after forward (RuntimeSpec.fsdp_kept_gathered).
FSDP_KEPT_GATHERED = ("none", "head", "root")
# How an engine moves tokens to their experts (RuntimeSpec.moe_dispatch).
MOE_DISPATCHES = ("all-to-all", "deepep")
FRACTION_FIELDS = ("dp_overlap", "zero3_overlap", "tp_overlap", "async_tp_overlap", "pp_overlap", "ep_overlap")
# The band's ratios: the low one at most 1, the high ones at least 1.
BAND_FIELDS = ("step_time_low_ratio", "step_time_high_ratio", "memory_high_ratio")
NUMBER_FIELDS = ("collective_half_bytes", "gemm_efficiency_scale", "elementwise_traffic_factor",
                 "compiled_elementwise_traffic_factor", "loss_traffic_factor", "layer_launch_s", "step_overhead_s",
                 "ddp_bucket_mb")
# Whole-number fields.
INT_FIELDS = ("fsdp_prefetch",)
# What an engine is told to do, as opposed to the coefficients fitted to its measurements:
# `plan --runtime-set` changes these (a runtime file changes anything).
SETTING_FIELDS = ("torch_compile", "async_tp", "chunked_loss", "selective_recompute", "fsdp_kept_gathered",
                  "fsdp_prefetch", "ddp_bucket_mb", "moe_dispatch", "ep_overlap", "fp8_experts")
FLAG_FIELDS = ("async_tp", "torch_compile", "chunked_loss", "expert_tensor_parallel", "moe_folding",
               "sp_regathers_inputs",
               "zero_bubble_schedules",
               "fp8_experts", "fused_fp8_casts")
