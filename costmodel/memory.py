"""Memory per device: model states (weights, gradients, optimizer states) under ZeRO,
activations per layer and recomputation mode, the micro-batches each schedule keeps in
flight, and communication buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.compute import activation_bytes_per_value
from costmodel.specs import ModelSpec, TrainingSpec

# CUDA context, cuBLAS/NCCL workspaces and allocator fragmentation: ~1 GiB is what
# PyTorch jobs on A100/H100 report as reserved-but-not-allocated plus context at start
# (torch.cuda.memory_reserved vs nvidia-smi); kept free on every device.
RUNTIME_RESERVE_BYTES = 1 << 30
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
    instead of the s x s scores (Dao et al. 2022 §3.1).
    """
    b, s, h, f = micro_batch_size, training.seq_len, model.hidden_size, model.intermediate_size
    v = activation_bytes_per_value(training)
    seq_split = tp if sequence_parallel else 1
    tokens_h = b * s * h
    if recompute == "full":
        return v * tokens_h / seq_split
    dropout_mask = 1 if model.is_gpt else 0
    # Not split by tp without SP: two norm inputs, QKV input, MLP input, dropout masks.
    replicated = (4 * v + 2 * dropout_mask) * tokens_h
    kv_ratio = model.num_key_value_heads / model.num_attention_heads
    attention = (v * (1 + 2 * kv_ratio) + v) * tokens_h  # Q, K, V and the projection input
    mlp_tensors = 2 if model.is_gpt else 3
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
