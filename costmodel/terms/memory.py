"""Memory per device: model states (weights, gradients, optimizer states) under ZeRO,
activations per layer and recomputation mode, the micro-batches each schedule keeps in
flight, and communication buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.specs import ModelSpec, TrainingSpec
from costmodel.terms.compute import activation_bytes_per_value
from costmodel.units import GIB

# CUDA context, cuBLAS/NCCL workspaces and allocator fragmentation: ~1 GiB is what
# PyTorch jobs on A100/H100 report as reserved-but-not-allocated plus context at start
# (torch.cuda.memory_reserved vs nvidia-smi); kept free on every device.
RUNTIME_RESERVE_BYTES = GIB
# PyTorch DDP gradient bucket (bucket_cap_mb default 25 MiB), two in flight.
DDP_BUCKET_BYTES = 25 << 20


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state before ZeRO sharding."""

    weights: int
    gradients: int
    optimizer: int


def state_bytes(training: TrainingSpec) -> StateBytes:
    """Rajbhandari et al. 2020 (ZeRO) §3.1: mixed-precision Adam keeps 2 + 2 bytes of
    fp16/bf16 weights and gradients and K = 12 bytes of fp32 master weights, momentum
    and variance. SGD with momentum keeps master weights and momentum (8). In fp32 the
    master copy is the weights themselves."""
    adam = training.optimizer in ("adam", "adamw")
    if training.precision == "fp32":
        return StateBytes(4, 4, 8 if adam else 4)
    return StateBytes(2, 2, 12 if adam else 8)


def sharded_state_bytes(parameters: float, training: TrainingSpec, zero_stage: int, shard: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes for `parameters` replicated over a data
    parallel group of `shard` ranks. ZeRO stage 1 shards optimizer states, stage 2 also
    gradients, stage 3 also weights (ZeRO §5, Figure 1)."""
    per = state_bytes(training)
    return (
        parameters * per.weights / (shard if zero_stage >= 3 else 1),
        parameters * per.gradients / (shard if zero_stage >= 2 else 1),
        parameters * per.optimizer / (shard if zero_stage >= 1 else 1),
    )


@dataclass(frozen=True)
class SavedTensors:
    """What the modules of one layer keep for backward beyond Korthikanti et al.'s
    count, which is Megatron-LM's: fused norms that keep their input only, a fused
    SwiGLU keeping its two inputs and the product, dropout after attention and MLP in
    GPT models, and an attention output that is the projection's input."""

    norm_extra_values: int      # h-wide values per RMSNorm beyond its input
    gated_mlp_tensors: int      # f-wide tensors a SwiGLU MLP keeps
    head_major_output_copy: bool  # SDPA's output and the projection's input are two tensors under RoPE
    dropout: bool               # GPT models' dropout masks (and dropout outputs of the scores)


# Korthikanti et al. 2022 §4.1, Table 2 (Megatron-LM, 16-bit values).
MEGATRON = SavedTensors(norm_extra_values=0, gated_mlp_tensors=3, head_major_output_copy=False, dropout=True)
# PyTorch eager modules, as executor.models and transformers write them; measured with
# torch.autograd.graph.saved_tensors_hooks and FSDPMemTracker under FakeTensorMode
# (bench/memory_tracker.py: llama2-7b 21.75 sbh per layer in fp32, gpt3-6.7b 16 sbh):
# RMSNorm `x * rsqrt(mean(x^2) + eps) * w` keeps x * rsqrt(...) beside its input; SiLU's
# output is kept for the product beside the gate and up outputs; with RoPE the query
# is head-major, so SDPA's output (kept for its backward, Dao et al. 2022 §3.1) is
# copied by `transpose(1, 2).reshape` into the projection's input; executor.models has
# no dropout (transformers' Llama has attention dropout 0).
EAGER = SavedTensors(norm_extra_values=1, gated_mlp_tensors=4, head_major_output_copy=True, dropout=False)


def saved_tensors(training: TrainingSpec) -> SavedTensors:
    """Mixed-precision (bf16/fp16) training is Megatron-LM's recipe, the one Korthikanti
    et al. measured; full fp32 is what runs on PyTorch's eager modules (the executor
    trains in fp32 on CPU ranks, and Hugging Face models run eager)."""
    return EAGER if training.precision == "fp32" else MEGATRON


def layer_activation_bytes(model: ModelSpec, training: TrainingSpec, micro_batch_size: int,
                           tp: int, sequence_parallel: bool, recompute: str) -> float:
    """Activations one layer keeps for backward, one micro-batch, one rank.

    Korthikanti et al. 2022 §4.1 (Table 2) with 16-bit values: sbh(34 + 5as/h) without
    parallelism; 10 of the 34 are not split by tensor parallelism unless sequence
    parallelism splits them; selective recompute drops the 5as/h attention-score term;
    full recompute keeps the layer input only (2sbh). Generalised here term by term:
    K and V scale with num_key_value_heads (GQA), the MLP with intermediate_size and its
    matrices (GELU: 2 tensors of f, SwiGLU: 3), MoE MLP tensors by the k experts each
    token visits, dropout masks only in GPT models, and FlashAttention keeps its output
    instead of the s x s scores (Dao et al. 2022 §3.1). `saved_tensors` adds what eager
    PyTorch modules keep beyond Megatron-LM's fused kernels.
    """
    b, s, h, f = micro_batch_size, training.seq_len, model.hidden_size, model.intermediate_size
    v = activation_bytes_per_value(training)
    saved = saved_tensors(training)
    seq_split = tp if sequence_parallel else 1
    tokens_h = b * s * h
    if recompute == "full":
        return v * tokens_h / seq_split
    dropout_mask = 1 if model.is_gpt and saved.dropout else 0
    rms_norm_extra = 0 if model.is_gpt else saved.norm_extra_values
    # Not split by tp without SP: two norm inputs, QKV input, MLP input, dropout masks.
    replicated = ((4 + 2 * rms_norm_extra) * v + 2 * dropout_mask) * tokens_h
    kv_ratio = model.num_key_value_heads / model.num_attention_heads
    attention = (v * (1 + 2 * kv_ratio) + v) * tokens_h  # Q, K, V and the projection input
    if training.flash_attention and not model.is_gpt and saved.head_major_output_copy:
        attention += v * tokens_h
    mlp_tensors = 2 if model.is_gpt else saved.gated_mlp_tensors
    mlp = v * mlp_tensors * f * b * s * model.num_experts_per_tok
    router = 4 * b * s * model.num_local_experts if model.is_moe else 0
    split = (attention + mlp) / tp + replicated / seq_split + router
    scores = 0.0
    if not training.flash_attention and recompute != "selective":
        # softmax output (v), dropout mask (1) and dropout output (v) per score element.
        per_score = v + (1 + v) * dropout_mask
        scores = per_score * b * model.num_attention_heads * s * s / tp
    return split + scores


def in_flight_microbatches(schedule: str, pp: int, pp_rank: int, num_microbatches: int, vpp: int = 1) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, counted in
    whole-rank units (all of the rank's layers).

    gpipe: all m (Huang et al. 2019, GPipe §2.2). 1f1b: min(m, pp - rank) (Narayanan et
    al. 2021, PipeDream-flush, §2.2). interleaved: Megatron-LM's warm-up of
    2(pp - rank - 1) + (vpp - 1)pp + 1 model chunks, i.e. pp + (pp - 1)/vpp on rank 0,
    Korthikanti et al. 2022 eq. 5.
    """
    m = num_microbatches
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved" and vpp > 1:
        chunks = min(m * vpp, 2 * (pp - pp_rank - 1) + (vpp - 1) * pp + 1)
        return chunks / vpp
    return float(min(m, pp - pp_rank))


def logits_bytes(model: ModelSpec, training: TrainingSpec, micro_batch_size: int, tp: int) -> float:
    """fp32 logits the vocab-parallel cross-entropy keeps for backward, per micro-batch
    (Korthikanti et al. 2022 §4.3: 4sbv/t)."""
    return 4.0 * micro_batch_size * training.seq_len * model.vocab_size / tp
