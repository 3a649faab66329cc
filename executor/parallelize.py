"""Shardwise's own Transformer split by a strategy: the recipes, each applied to one
rank's part (the refusal of what cannot be built, the pipeline stage a rank holds,
activation checkpointing, expert parallelism, context parallelism, FP8 linear layers
(torchao.float8, before the splits that shard their weights), tensor and sequence
parallelism with DTensor, data parallelism by ZeRO stage over the ranks holding the same
weights (dp x cp): DDP, `replicate`, FSDP2), and `BuiltinModel`,
which applies them in order to build this rank's parts, says what the step needs to run
them (executor.step.ModelParts) and names their weights as the unsplit model does. The
mesh comes from executor.mesh; executor.auto's Hugging Face split shares `wrap_ddp`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from costmodel.specs import ModelSpec, RuntimeSpec, TrainingSpec
from costmodel.specs.runtime import DDP_BUCKET_MB
from costmodel.strategy import ZERO_BUBBLE_SCHEDULES, Stage, Strategy, ends_apart
from executor.launch import FP8_GEMM_MULTIPLE, check_supported
from executor.mesh import RankMesh, tied_ends_group
from executor.models import (
    ContextShard,
    MoE,
    Transformer,
    build_model,
    canonical_name,
    cross_entropy,
    materialize,
)
from executor.step import Accumulation, ModelParts, StageShapes, TiedEmbedding


@dataclass(frozen=True)
class Overlap:
    """The runtime settings of a plan that this executor applies (the plan's runtime
    profile, costmodel.specs.RuntimeSpec, says which are on; the cost model prices the
    same fields): FSDP2 units gathered ahead and the units kept gathered after forward,
    DDP's bucket size, and async TP (inductor's micro-pipelined TP over symmetric memory:
    CUDA with compiled blocks only, synchronous elsewhere, and the run says so)."""

    fsdp_prefetch: int = 1
    fsdp_kept_gathered: str = "none"
    ddp_bucket_mb: float = DDP_BUCKET_MB
    async_tp: bool = False

    @classmethod
    def of(cls, runtime: RuntimeSpec) -> Overlap:
        return cls(runtime.fsdp_prefetch, runtime.fsdp_kept_gathered, runtime.ddp_bucket_mb, runtime.async_tp)


def stage_module(spec: ModelSpec, seq_len: int, stage: Stage | None, num_stages: int,
                 dtype: torch.dtype = torch.float32) -> Transformer:
    """The model on the meta device, keeping only what `stage` holds (all of it when None)."""
    model = build_model(spec, seq_len, dtype=dtype)
    if stage is None:
        return model
    model.untie()   # the ends sit on different ranks
    if stage.index != 0:
        model.tok_embeddings = None
        model.pos_embeddings = None
    if stage.index != num_stages - 1:
        model.norm = None
        model.output = None
    owned = {str(i) for i in range(stage.first_layer, stage.first_layer + stage.num_layers)}
    for key in list(model.layers.keys()):
        if key not in owned:
            del model.layers[key]
    return model


def apply_recompute(model: Transformer, stage: Stage | None, strategy: Strategy) -> None:
    """The stage's first `full_recompute_layers` layers recompute whole, the next
    `selective_recompute_layers` by the op-level policy (executor.models.op_level_context;
    costmodel.strategy.Stage)."""
    layers = list(model.layers.values())
    if stage is None:   # pp = 1: one stage holding every layer
        stage = strategy.stages[0]
    full, selective = stage.full_recompute_layers, stage.selective_recompute_layers
    for i, layer in enumerate(layers):
        layer.set_recompute("full" if i < full else "selective" if i < full + selective else "none")


def apply_compile(model: Transformer, backend: str, micro_pipeline_tp: bool = False) -> None:
    """torch.compile each transformer block in place (nn.Module.compile: the parameter
    names stay), after tensor parallelism and recompute and before FSDP, the order
    torchtitan applies them in: the graphs fuse a block's norms, rotary embedding,
    activation and residuals; the collectives between blocks stay eager.
    `micro_pipeline_tp`: inductor splits each TP all-gather / reduce-scatter and its
    matmul into overlapped pieces (async TP; its config given per compile, not set
    globally)."""
    options = {"_micro_pipeline_tp": True} if micro_pipeline_tp else None
    for layer in model.layers.values():
        layer.compile(backend=backend, options=options)


def async_tp_supported(device: torch.device, compile_backend: str | None) -> bool:
    """Async TP runs where inductor compiles the blocks over CUDA symmetric memory
    (torch.distributed._symmetric_memory; torchtitan requires compile for it too)."""
    return device.type == "cuda" and compile_backend == "inductor"


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Symmetric memory for the TP group, which the micro-pipelined collectives use."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


# The linear layers FP8 training converts, by the layer part that holds them; the router
# (an MoE's), the embedding, the LM head, norms and the attention core stay in bf16.
FP8_LINEARS = {"attention": ("wq", "wk", "wv", "wo"), "feed_forward": ("w1", "w2", "w3")}
# Those tensor parallelism splits by their input features (row-wise); the rest are split
# by their output features (column-wise).
ROW_SPLIT_LINEARS = ("wo", "w2")


def fp8_config(recipe: str, device: torch.device, fsdp_float8_all_gather: bool):
    """torchao's Float8LinearConfig of `recipe` ("tensorwise" or "rowwise" dynamic
    scaling): its FP8 GEMMs emulated (FP8 values, scales and roundings, the products
    taken in high precision) where torch._scaled_mm cannot run, off CUDA; under FSDP2 a
    tensorwise weight is cast to FP8 before its all-gather (half the bytes of bf16; the
    rowwise recipe gathers in high precision)."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return replace(config, emulate=device.type != "cuda",
                   enable_fsdp_float8_all_gather=fsdp_float8_all_gather and recipe == "tensorwise")


def fp8_gemm_fits(linear: nn.Linear, name: str, tp: int) -> bool:
    """Whether a linear layer's GEMMs can run in FP8: torch._scaled_mm takes weights whose
    both dimensions are multiples of 16, here this rank's shard of them under tensor
    parallelism (the output features of a column-wise split divided by tp, the input
    features of a row-wise one). One that cannot stays bf16."""
    out_features, in_features = linear.out_features, linear.in_features
    if name in ROW_SPLIT_LINEARS:
        in_features //= tp
    else:
        out_features //= tp
    return out_features % FP8_GEMM_MULTIPLE == 0 and in_features % FP8_GEMM_MULTIPLE == 0


def apply_fp8(model: Transformer, config, tp: int) -> None:
    """FP8 training (torchao.float8's Float8Linear, dynamic scaling as `config` says): the
    layers' attention projections and MLP matrices whose shapes FP8 GEMMs take
    (`fp8_gemm_fits`) become Float8Linear, before tensor parallelism and FSDP are
    applied (torchtitan's order: a Float8Linear's weight is what they shard). An MoE's
    experts are not linear layers (check_supported refuses FP8 there)."""
    from torchao.float8 import convert_to_float8_training

    for layer in model.layers.values():
        for part_name, names in FP8_LINEARS.items():
            part = getattr(layer, part_name)
            if isinstance(part, MoE):
                continue
            convert_to_float8_training(part, config=config,
                                       module_filter_fn=lambda m, fqn, names=names: fqn in names
                                       and fp8_gemm_fits(m, fqn, tp))


def fp8_linears(model: nn.Module) -> list[nn.Module]:
    """The model's torchao Float8Linear layers (none when torchao was never imported)."""
    import sys

    if "torchao.float8" not in sys.modules:
        return []
    from torchao.float8.float8_linear import Float8Linear

    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def _input_to_autocast_dtype(module: nn.Module, args: tuple) -> tuple:
    """Float8Linear's forward casts its input to CUDA's autocast dtype; this does the same
    for the input's own device (CPU autocast included; a no-op after Float8Linear's own
    cast on CUDA), so the layer takes, casts and saves for backward a bf16 input there as
    on a GPU, not the fp32 residual stream."""
    x, *rest = args
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return (x.to(torch.get_autocast_dtype(device_type)), *rest)
    return args


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool,
                          fp8_tensorwise: bool = False) -> None:
    """Megatron-LM's split (Shoeybi et al. 2019 §3): Q/K/V and the first MLP matrices
    column-wise, the output projections row-wise, the embedding and LM head over the
    vocabulary. Each block's input becomes one DTensor before the column-wise layers, so
    its gradient is reduced once, not once per projection. With sequence parallelism
    (Korthikanti et al. 2022 §4.2.2) norms and residuals hold a sequence shard and the
    all-reduces become all-gathers and reduce-scatters. `fp8_tensorwise`: the
    Float8Linear layers (apply_fp8) take torchao's float8 styles, as torchtitan does for
    the tensorwise recipe: a block's input is cast to FP8 before it is gathered (once for
    Q, K and V; its scale from the amax over every shard: a DTensor's amax is reduced over
    the mesh), and the gradients entering a row-wise layer are cast after their reduction.
    The rowwise recipe takes the plain styles (torchao has no float8 styles for it), and
    so does tensorwise under sequence parallelism off CUDA (below)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    # The float8 styles gather FP8 tensors under sequence parallelism, which gloo cannot
    # (it has no float8 dtypes: "Invalid scalar type"): on CPU the inputs are gathered in
    # high precision and cast after, with the same global scale, so the same FP8 values.
    fp8_gathers = fp8_tensorwise and (tp_mesh.device_type == "cuda" or not sequence_parallel)
    float8 = {id(m) for m in fp8_linears(model)} if fp8_gathers else set()
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )
    for layer in model.layers.values():

        def colwise(name: str):
            return Float8ColwiseParallel() if id(layer.get_submodule(name)) in float8 else ColwiseParallel()

        def rowwise(name: str, **kwargs):
            return Float8RowwiseParallel(**kwargs) if id(layer.get_submodule(name)) in float8 else RowwiseParallel(**kwargs)

        def prepare(part: str, readers: tuple[str, ...], **layouts):
            # The input is cast to FP8 before its all-gather only when every layer
            # reading it takes FP8 (a bf16 layer cannot read a float8 tensor).
            part_module = layer.get_submodule(part)
            if all(id(getattr(part_module, r)) in float8 for r in readers if getattr(part_module, r) is not None):
                return PrepareFloat8ModuleInput(**layouts)
            return PrepareModuleInput(**layouts)

        moe = isinstance(layer.feed_forward, MoE)
        gated = layer.feed_forward.w3 is not None
        plan = {
            # (x, cos, sin): the RoPE rows are plain tensors.
            "attention": prepare("attention", ("wq", "wk", "wv"), input_layouts=(seq, None, None),
                                 desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": colwise("attention.wq"),
            "attention.wk": colwise("attention.wk"),
            "attention.wv": colwise("attention.wv"),
            "attention.wo": rowwise("attention.wo", output_layouts=seq),
        }
        if moe:
            plan.update(_moe_tensor_parallel_plan(layer.feed_forward))
        else:
            plan.update({
                "feed_forward": prepare("feed_forward", ("w1", "w3"), input_layouts=(seq,),
                                        desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": colwise("feed_forward.w1"),
                "feed_forward.w2": rowwise("feed_forward.w2", output_layouts=seq),
            })
            if gated:
                plan["feed_forward.w3"] = colwise("feed_forward.w3")
        if layer.attention.q_norm is not None:
            # Per-head q/k norms (Qwen3) see this rank's heads: their weights are
            # replicated and their gradients summed over tp, as SequenceParallel does
            # over the head dimension of [B, heads, T, head_dim].
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            if layer.ffn_norm is not None:
                plan["ffn_norm"] = SequenceParallel()
        parallelize_module(layer, tp_mesh, plan)
    ends = {}
    if model.tok_embeddings is not None:
        ends["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.output is not None:
        if sequence_parallel:
            ends["norm"] = SequenceParallel()
        # Logits stay sharded over the vocabulary; the loss runs under loss_parallel
        # (Megatron-LM's vocab-parallel cross-entropy).
        ends["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    if ends:
        parallelize_module(model, tp_mesh, ends)
    if sequence_parallel:
        model.sequence_shard = (tp_mesh.get_local_rank(), tp_mesh.size())


def _moe_tensor_parallel_plan(moe: MoE) -> dict:
    """An MoE block under tp with whole experts (MoE parallel folding, Strategy.etp 1;
    check_supported asks for sequence parallelism): the block takes the rank's sequence
    shard as it is, routes it with the replicated router (its gradient summed over tp by
    the step) to experts sharded over an ep group that spans the tp ranks; the shared
    expert is split over tp as a dense MLP is (Megatron-LM's SharedExpertMLP), its rows
    gathered before and reduce-scattered after (dim 0: the block's flattened tokens)."""
    plan = {"feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                               use_local_output=True)}
    if moe.shared_expert is not None:
        plan["feed_forward.shared_expert"] = PrepareModuleInput(input_layouts=(Shard(0),),
                                                                desired_input_layouts=(Replicate(),))
        plan["feed_forward.shared_expert.w1"] = ColwiseParallel()
        plan["feed_forward.shared_expert.w2"] = RowwiseParallel(output_layouts=Shard(0))
        if moe.shared_expert.w3 is not None:
            plan["feed_forward.shared_expert.w3"] = ColwiseParallel()
    return plan


def apply_context_parallel(model: Transformer, cp_mesh: DeviceMesh) -> None:
    """Context parallelism (Llama 3's all-gather CP, Dubey et al. 2024 §3.3.2): the
    model takes this rank's tokens of each sequence (executor.data.context_shard), embeds
    and rotates them at their global positions, and each attention gathers K and V over
    the cp group (executor.models.ContextShard)."""
    shard = ContextShard(cp_mesh.get_local_rank(), cp_mesh.size(), cp_mesh.get_group())
    shard.prepare(model.seq_len)
    model.context_shard = shard
    for layer in model.layers.values():
        layer.attention.context_shard = shard


@dataclass
class ExpertDispatch:
    """Expert parallelism (Lepikhin et al. 2020, GShard §2.2): each rank of the ep group
    holds num_experts / ep experts; rows go to the rank of their expert by an
    all-to-all and come back by a second one, both differentiable."""

    group: dist.ProcessGroup
    ep: int

    def __call__(self, moe: MoE, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        local = moe.num_experts // self.ep
        # counts[e] rows for global expert e; send_counts[r, j]: rows for rank r's j-th expert.
        # On the rows' device: NCCL exchanges device tensors only.
        send_counts = torch.tensor(counts, dtype=torch.int64, device=rows.device).view(self.ep, local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits = send_counts.sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = all_to_all_single_autograd(rows, recv_splits, send_splits, self.group)
        # Received rows are grouped by source rank, then by local expert: regroup by expert.
        source_of = torch.repeat_interleave(torch.arange(self.ep * local, device=rows.device), recv_counts.flatten())
        expert_major = (source_of % local) * self.ep + source_of // local
        order = expert_major.argsort(stable=True)
        by_expert = recv_counts.sum(0).tolist()
        out_sorted = moe.experts(received[order], by_expert)
        # The experts' dtype (bf16 under autocast), not the received rows'.
        out = out_sorted.new_empty(out_sorted.shape).index_copy(0, order, out_sorted)
        return all_to_all_single_autograd(out, send_splits, recv_splits, self.group)


def apply_expert_parallel(model: Transformer, ep_mesh: DeviceMesh) -> None:
    """Shard the experts over the ep group (dim 0, as DTensors: DCP saves every rank's
    experts and reshards them to another ep, `full_tensor` gathers them) and route rows
    to the rank holding their expert."""
    dispatch = ExpertDispatch(ep_mesh.get_group(), ep_mesh.size())
    for layer in model.layers.values():
        moe = layer.feed_forward
        if not isinstance(moe, MoE):
            continue   # a dense-MLP layer (the spec's mlp_only_layers): replicated over ep
        for name in ("w1", "w2", "w3"):
            full = getattr(moe, name)
            setattr(moe, name, nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)], src_data_rank=None)))
        moe.dispatch = dispatch


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters sharded over the ep group; every other parameter is replicated over dp."""
    return [(f"{name}.{leaf}", getattr(module, leaf)) for name, module in model.named_modules()
            if isinstance(module, MoE) and module.dispatch is not None for leaf in ("w1", "w2", "w3")]


def data_parallel_kind(strategy: Strategy) -> str:
    """How the ranks holding the same weights (dp x cp: the cp ranks of a replica see
    other tokens of the same sequences) are kept in step: "none", "ddp" (ZeRO-0, and ZeRO-1 with
    ZeroRedundancyOptimizer, Rajbhandari et al. 2020 §5.1), "replicate" (ZeRO-0 over
    tensor-parallel weights) or "fsdp" (ZeRO-2 and 3; ZeRO-1 over tensor-parallel or
    expert-parallel weights runs as ZeRO-2: the same traffic per step, less memory than
    planned; ZeroRedundancyOptimizer would broadcast one rank's experts to all)."""
    if strategy.dp_cp == 1:
        return "none"
    # A zero-bubble schedule computes weight gradients apart from the backward that DDP's
    # hooks follow (its losses then left one process's); torch.distributed.pipelining
    # reduces FSDP2's and `replicate`'s itself once every weight gradient is in.
    zero_bubble = strategy.pp > 1 and strategy.schedule in ZERO_BUBBLE_SCHEDULES
    if strategy.zero_stage >= 2 or (strategy.zero_stage == 1 and (strategy.tp > 1 or strategy.ep > 1 or zero_bubble)):
        return "fsdp"
    return "replicate" if strategy.tp > 1 or zero_bubble else "ddp"


def apply_replicate(model: Transformer, dp_mesh: DeviceMesh, ignored: set[nn.Parameter]) -> None:
    """ZeRO-0 over DTensor (tensor-parallel) weights: PyTorch's FSDP-based `replicate`,
    DDP's all-reduce of gradients per layer (Li et al. 2020 §3.2), which composes with
    DTensor where DistributedDataParallel does not."""
    for layer in model.layers.values():
        replicate(layer, mesh=dp_mesh, ignored_params=ignored or None)
    replicate(model, mesh=dp_mesh, ignored_params=ignored or None)


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, zero_stage: int, ignored: set[nn.Parameter],
               overlap: Overlap = Overlap()) -> None:
    """ZeRO-3 (Rajbhandari et al. 2020 §5.3) as FSDP2: each layer, the embedding and the
    head are units gathered before use and freed after, forward and backward. ZeRO-2
    keeps each unit gathered from forward to backward (`reshard_after_forward=False`),
    so a step gathers the weights once and reduce-scatters the gradients once.
    `overlap`: how many units ahead each gathers (forward and backward prefetch), and
    which it keeps gathered after forward as torchtitan does ("head": the final norm and
    head unit; "root": the embedding, norm and head in the root unit, which FSDP2 never
    reshards after forward, and the last layer)."""
    reshard = zero_stage == 3
    kept = overlap.fsdp_kept_gathered
    layers = list(model.layers.values())
    for i, layer in enumerate(layers):
        keep = kept == "root" and i == len(layers) - 1
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard and not keep, ignored_params=ignored or None)
    units: list[nn.Module] = list(layers)
    # The embedding (with the learned positions) and the head (with the final norm) are
    # units of their own, as the cost model counts them; a tied embedding and head share
    # one parameter, so the root unit holds both (and "root" keeps them all there).
    if not model.tied and kept != "root":
        first = [m for m in (model.tok_embeddings, model.pos_embeddings) if m is not None]
        last = [m for m in (model.norm, model.output) if m is not None]
        if first:
            fully_shard(first, mesh=dp_mesh, reshard_after_forward=reshard)
            units.insert(0, first[0])
        if last:
            fully_shard(last, mesh=dp_mesh, reshard_after_forward=reshard and kept != "head")
            units.append(last[0])
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored or None)
    ahead = overlap.fsdp_prefetch
    if ahead == 1:
        return   # FSDP2's own: one unit ahead in backward (measured: bench/memory_tracker.py)
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + ahead])
        unit.set_modules_to_backward_prefetch(units[max(0, i - ahead):i][::-1])


def apply_expert_fsdp(model: Transformer, edp_mesh: DeviceMesh, dp_mesh: DeviceMesh, zero_stage: int) -> None:
    """ZeRO over expert weights, as torchtitan shards them: each MoE's experts (already
    sharded over ep) are an FSDP2 unit over the edp group (the ranks holding the same
    experts) and its router, with the shared expert and its gate where the model has
    them, a unit over `dp_mesh` (dp x cp), before the layers become units (a unit leaves
    out what its sub-units hold). FSDP2 averages expert gradients over edp; the step
    scales them to the dp x cp mean (executor.step.TrainStep.synchronize_gradients). The
    cost model shards expert states over edp (costmodel.strategy.Strategy.edp)."""
    reshard = zero_stage == 3
    for layer in model.layers.values():
        moe = layer.feed_forward
        if not isinstance(moe, MoE):
            continue   # a dense-MLP layer: sharded over dp with the rest of its layer
        dense = [m for m in (moe.router, moe.shared_expert, moe.shared_gate) if m is not None]
        fully_shard(dense, mesh=dp_mesh, reshard_after_forward=reshard)
        fully_shard(moe, mesh=edp_mesh, reshard_after_forward=reshard)


# DDP's switch for not broadcasting buffers each forward: `forward_sync_buffers` in
# recent PyTorch, `broadcast_buffers` (deprecated there) before.
NO_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                  else {"broadcast_buffers": False})


def wrap_ddp(model: nn.Module, dp_mesh: DeviceMesh, ignored: list[str], bucket_mb: float = DDP_BUCKET_MB) -> DDP:
    """ZeRO-0 over plain weights: DistributedDataParallel over the dp (x cp) group,
    leaving out the parameters named in `ignored` (expert weights, reduced over edp by the
    step), all-reducing gradients in buckets of `bucket_mb` MiB during backward. Buffers (the
    RoPE tables, a Hugging Face model's position ids) are computed identically on every
    rank: no per-step broadcast."""
    DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return DDP(model, process_group=dp_mesh.get_group(), bucket_cap_mb=bucket_mb, **NO_BUFFER_SYNC)


class BuiltinModel:
    """This rank's pipeline stages of `spec`'s Transformer for `strategy`, weights in
    `dtype` drawn from `seed`."""

    def __init__(self, spec: ModelSpec, training: TrainingSpec, strategy: Strategy, mesh: RankMesh,
                 dtype: torch.dtype, seed: int, device: torch.device, compile_backend: str | None = None,
                 overlap: Overlap = Overlap()):
        check_supported(spec, strategy, training.seq_len, training.precision, training.fp8)
        self.spec, self.training, self.strategy, self.mesh = spec, training, strategy, mesh
        self.dtype, self.seed, self.device = dtype, seed, device
        self.compile_backend = compile_backend
        # What a pipeline stage keeps is not priced (costmodel.estimate.uniform.fsdp_units):
        # its units are all resharded; async TP needs CUDA and compiled blocks.
        self.overlap = replace(overlap, fsdp_kept_gathered=overlap.fsdp_kept_gathered if strategy.pp == 1 else "none",
                               async_tp=overlap.async_tp and strategy.tp > 1
                               and async_tp_supported(device, compile_backend))
        # A tied embedding whose two copies sit on the pipeline's ends sums over this group.
        ends_group = tied_ends_group(mesh) if spec.tie_word_embeddings and ends_apart(strategy) else None
        self.data_parallel = data_parallel_kind(strategy)
        zero_2 = self.data_parallel == "fsdp" and strategy.zero_stage < 3
        # FP8 training's torchao config: FSDP2 gathers tensorwise weights in FP8.
        self.fp8 = (fp8_config(training.fp8, device, fsdp_float8_all_gather=self.data_parallel == "fsdp")
                    if training.fp8 else None)
        # ZeRO over experts needs two ranks holding them (edp > 1): on one there is
        # nothing to shard, and the step reduces them as under DDP.
        self.experts_sharded = self.data_parallel == "fsdp" and strategy.ep > 1 and strategy.edp > 1
        stages = [None] if strategy.pp == 1 else list(strategy.rank_stages(mesh.pp_rank))
        self.modules = [self._build(stage) for stage in stages]   # as the step runs them
        # This rank's Transformers, without their DDP wrappers.
        self.stages = [m.module if isinstance(m, DDP) else m for m in self.modules]
        self.parts = ModelParts(
            modules=tuple(self.modules),
            stage_indices=tuple(0 if stage is None else stage.index for stage in stages),
            loss_fn=cross_entropy,
            vocab_parallel_loss=strategy.tp > 1,
            # ZeRO-2 gathers each weight once and reduce-scatters once per step; ZeRO-3
            # gathers and reduce-scatters in every micro-batch, as the cost model counts.
            accumulation=Accumulation(defer_sync=self.data_parallel == "replicate" or zero_2,
                                      keep_gathered=zero_2),
            shapes=self._stage_shapes(),
            tied=self._tied_embedding(ends_group),
            expert_parameters=tuple(p for inner in self.stages for _, p in expert_parameters(inner)),
            experts_reduced_by_fsdp=self.experts_sharded,
            summed_over_tp=self._summed_over_tp(),
            after_update=self._fp8_scales_for_fsdp())
        self.tied_names = ("tok_embeddings.weight", "output.weight") if spec.tie_word_embeddings else None
        self._precompute_fp8_scales()

    def _build(self, stage) -> nn.Module:
        s = self.strategy
        model = stage_module(self.spec, self.training.seq_len, stage, s.num_virtual_stages, self.dtype)
        if s.tp > 1:
            model.untie()
        apply_recompute(model, stage, s)
        for layer in model.layers.values():
            layer.attention.flash = self.training.flash_attention
        if s.ep > 1:
            apply_expert_parallel(model, self.mesh["ep"])
        if s.cp > 1:
            apply_context_parallel(model, self.mesh["cp"])
        if self.fp8 is not None:
            apply_fp8(model, self.fp8, s.tp)
        if s.tp > 1:
            apply_tensor_parallel(model, self.mesh["tp"], s.sequence_parallel,
                                  fp8_tensorwise=self.training.fp8 == "tensorwise")
            if self.overlap.async_tp:
                enable_async_tp(self.mesh["tp"])
        # After tensor parallelism's input hooks, as Float8Linear's own cast runs in its
        # forward on CUDA.
        for linear in fp8_linears(model):
            linear.register_forward_pre_hook(_input_to_autocast_dtype)
        if self.compile_backend:
            apply_compile(model, self.compile_backend, micro_pipeline_tp=self.overlap.async_tp)
        experts = {p for _, p in expert_parameters(model)}
        if self.data_parallel == "fsdp":
            if self.experts_sharded:
                apply_expert_fsdp(model, self.mesh["edp"], self.mesh.dp_cp_mesh, max(2, s.zero_stage))
                experts = set()
            apply_fsdp(model, self.mesh.dp_cp_mesh, max(2, s.zero_stage), experts, self.overlap)
        elif self.data_parallel == "replicate":
            apply_replicate(model, self.mesh.dp_cp_mesh, experts)
        materialize(model, self.device, self.seed)
        if self.data_parallel == "ddp":
            return wrap_ddp(model, self.mesh.dp_cp_mesh, [n for n, _ in expert_parameters(model)],
                            self.overlap.ddp_bucket_mb)
        return model

    def _stage_shapes(self) -> StageShapes:
        # Each rank holds seq_len / cp tokens of a sequence under context parallelism.
        s, t = self.strategy, self.training.seq_len // self.strategy.cp
        # Stages exchange the residual stream, in the weights' dtype (under autocast the
        # matmuls run lower, but each residual add is in this dtype); logits stay
        # sharded over the vocabulary under tensor parallelism.
        return StageShapes(seq_len=t, hidden_seq_len=t // s.tp if s.sequence_parallel else t,
                           hidden_size=self.spec.hidden_size, logits_width=self.spec.vocab_size // s.tp,
                           dtype=self.dtype)

    def _tied_embedding(self, ends_group) -> TiedEmbedding | None:
        """The embedding and the head's copy of it here, when they are two parameters."""
        s = self.strategy
        if not self.spec.tie_word_embeddings or (s.pp == 1 and s.tp == 1):
            return None
        embedding = next((m.tok_embeddings.weight for m in self.stages if m.tok_embeddings is not None), None)
        head = next((m.output.weight for m in self.stages if m.output is not None), None)
        return TiedEmbedding(embedding, head, ends_group)

    def _fp8_scales_for_fsdp(self) -> tuple:
        """torchtitan's step under FSDP2's float8 all-gather: after each update every FP8
        weight's scale is computed at once (one all-reduce of their amaxes over the
        shards), not one all-reduce per weight in its all-gather."""
        if self.fp8 is None or not self.fp8.enable_fsdp_float8_all_gather:
            return ()
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        return tuple(partial(precompute_float8_dynamic_scale_for_fsdp, module) for module in self.stages)

    def _summed_over_tp(self) -> tuple[nn.Parameter, ...]:
        # Under sequence parallelism each tp rank adds only its slice of the learned
        # positions, and routes only its share of the tokens through an MoE block's
        # router and shared-expert gate (and, without expert parallelism, its experts),
        # so these replicated weights' gradients are the sums over the tp ranks. (Under
        # ep the experts' groups span the tp ranks: the step reduces them over edp.)
        if not (self.strategy.sequence_parallel and self.strategy.tp > 1):
            return ()
        positions = [m.pos_embeddings.weight for m in self.stages if m.pos_embeddings is not None]
        moes = [layer.feed_forward for m in self.stages for layer in m.layers.values()
                if isinstance(layer.feed_forward, MoE)]
        routers = [p for moe in moes for gate in (moe.router, moe.shared_gate) if gate is not None
                   for p in gate.parameters()]
        experts = [getattr(moe, name) for moe in moes for name in ("w1", "w2", "w3")] if self.strategy.ep == 1 else []
        return tuple(positions + routers + experts)

    def parameters(self) -> list[nn.Parameter]:
        return self.parts.parameters()

    # -- weights --------------------------------------------------------------------

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights of this rank's pipeline stages, by their names in the unsplit
        model (gathered over tp, dp and ep; every rank of the stage gets them)."""
        out = {}
        for inner in self.stages:
            for name, p in inner.named_parameters():
                value = p.full_tensor() if isinstance(p, DTensor) else p.detach()
                # An FP8 weight under FSDP2's float8 all-gather wraps the plain tensor.
                value = getattr(value, "_tensor", value)
                out[canonical_name(name)] = value.cpu().clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full, unsharded weights (the model's own names); each rank keeps its shards."""
        full = {k: v.to(self.device) for k, v in state.items()}
        for module in self.stages:
            set_model_state_dict(module, full, options=StateDictOptions(full_state_dict=True, strict=False))
        self._precompute_fp8_scales()

    def _precompute_fp8_scales(self) -> None:
        """The FP8 weights' scales for FSDP2's float8 all-gather, from the weights as they
        are now. Needed before the first step too: without a precomputed scale torchao
        takes the amax over the FSDP mesh only, so under FSDP x TP each tp shard of a
        weight got a scale of its own (tiny-llama, zero3-tp2: the first loss 3e-5 off
        one process's)."""
        for update in self.parts.after_update:
            update()
