"""Compute time of one transformer layer, the embedding and the LM head on one rank for
one micro-batch: GEMMs at a shape-dependent efficiency, the attention core, and the
memory-bound elementwise work (norms, activations, residuals, dropout, softmax).

Calibration: the constants below were fitted so that one layer of the 22B GPT
(h 6144, a 64, s 2048, micro-batch 4, TP 8, A100-80GB) reproduces Korthikanti et al.
2022 Table 4 (forward 7.7 ms, backward 11.9 ms, +1.3 ms for selective recompute) and
checked end to end against their Table 5 (bench/fidelity.py).

The runtime profile (costmodel.specs.runtime) scales two things the engine decides: the
fraction of the GEMM curve its layer GEMMs reach (`gemm_efficiency_scale`) and the HBM
traffic of the elementwise work (`elementwise_factor`: eager kernels make a pass per
op, a compiled graph fuses them). None keeps the Megatron-LM figures fitted above.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.specs import ClusterSpec, GPUSpec, ModelSpec, RuntimeSpec, TrainingSpec
from costmodel.terms.recompute import op_level_split

# Best fraction of peak a large bf16/fp16 GEMM reaches (cuBLAS on A100 sustains ~80-85%
# of the 312 TFLOP/s peak on large square GEMMs); fitted to Korthikanti Table 4.
GEMM_EFFICIENCY_MAX = 0.84
# A GEMM dimension of this size halves its efficiency factor d / (d + D_HALF): small
# micro-batches (M = b*s) and narrow TP shards (N or K divided by tp) underfill the
# tensor cores' 128-wide tiles (NVIDIA "Matrix Multiplication Background" guide, tile
# quantization and wave quantization).
GEMM_DIM_HALF = 128
# Achieved fraction of HBM bandwidth for elementwise kernels (STREAM-like copy on
# A100 reaches ~1.6-1.7 of 2.04 TB/s).
MEMORY_BOUND_EFFICIENCY = 0.8
# HBM bytes per attention score element for scale + mask + softmax + dropout (written
# and read back in 16-bit, plus a 1-byte mask) in the unfused attention core; fitted to
# the 1.3 ms that selective recompute adds to the 22B layer (Korthikanti Table 4).
SCORE_BYTES_PER_ELEMENT = 11.0
# Causal FlashAttention skips the blocks above the diagonal: about half the work
# (Dao 2023, FlashAttention-2, §3.1 "causal masking").
FLASH_CAUSAL_FRACTION = 0.5
# Backward of a matmul is two matmuls of the forward's size (input and weight
# gradients); backward of an elementwise op reads the saved input and the output
# gradient and writes the input gradient: about twice the forward traffic.
BACKWARD_FACTOR = 2.0


def gemm_efficiency(m: float, n: float, k: float, device: GPUSpec | None = None) -> float:
    """Fraction of peak for an (m x k) @ (k x n) GEMM; the device may carry its own
    measured curve (its `gemm_efficiency_max` and `gemm_half_dim`)."""
    best = GEMM_EFFICIENCY_MAX if device is None or device.gemm_efficiency_max is None else device.gemm_efficiency_max
    half = GEMM_DIM_HALF if device is None or device.gemm_half_dim is None else device.gemm_half_dim
    factor = 1.0
    for d in (m, n, k):
        factor *= d / (d + half)
    return best * factor


def gemm_time_s(m: float, n: float, k: float, peak_flops_per_s: float, batch: float = 1.0,
                device: GPUSpec | None = None) -> float:
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    return 2.0 * m * n * k * batch / (peak_flops_per_s * gemm_efficiency(m, n, k, device))


def memory_bound_time_s(num_bytes: float, cluster: ClusterSpec) -> float:
    return num_bytes / (cluster.gpu.hbm_bandwidth_bytes_per_s * MEMORY_BOUND_EFFICIENCY)


@dataclass(frozen=True)
class LayerCompute:
    """Forward seconds of one layer on one rank for one micro-batch, by kind."""

    gemm_s: float           # QKV, output projection, MLP or experts, router
    attention_core_s: float  # QK^T, softmax, AV (recomputed by selective recompute)
    elementwise_s: float     # norms, activation function, residuals, dropout

    @property
    def forward_s(self) -> float:
        return self.gemm_s + self.attention_core_s + self.elementwise_s


def activation_bytes_per_value(training: TrainingSpec) -> int:
    return 4 if training.precision == "fp32" else 2


def _kernel_factors(runtime: RuntimeSpec | None) -> tuple[float, float]:
    """(GEMM efficiency scale, elementwise traffic factor) of the runtime."""
    if runtime is None:
        return 1.0, 1.0
    return runtime.gemm_efficiency_scale, runtime.elementwise_factor


def layer_compute(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                  micro_batch_size: int, tp: int, sequence_parallel: bool, ep: int = 1,
                  runtime: RuntimeSpec | None = None, cp: int = 1) -> LayerCompute:
    """One layer's forward on one rank. Under context parallelism the rank runs s / cp of
    each sequence's tokens, and its queries attend the whole gathered sequence's keys."""
    gemm_scale, traffic = _kernel_factors(runtime)
    peak = cluster.gpu.peak_for(training.precision) * gemm_scale

    def gemm_s(m: float, n: float, k: float, batch: float = 1.0) -> float:
        return gemm_time_s(m, n, k, peak, batch, cluster.gpu)

    b, s, h, f = micro_batch_size, training.seq_len, model.hidden_size, model.intermediate_size
    queries = s / cp
    tokens = b * queries
    heads_local = model.num_attention_heads / tp
    hd = model.head_dim
    qkv_width = (model.num_attention_heads * hd + 2 * model.kv_size) / tp

    gemm = gemm_s(tokens, qkv_width, h) + gemm_s(tokens, h, model.q_size / tp)
    if model.is_moe:
        # Each rank's experts see tokens * k * ep / E tokens each under balanced routing
        # (the all-to-all gathers them from the ep group), E / ep experts per rank; a
        # capacity factor below 1 drops the rest, and the busiest rank, whose time the
        # others wait for, takes `moe_load_imbalance` times the mean
        # (ModelSpec.busiest_rank_rows_per_token).
        local_experts = model.num_local_experts / ep
        tokens_per_expert = tokens * model.busiest_rank_rows_per_token(ep) * ep / model.num_local_experts
        per_expert = gemm_s(tokens_per_expert, 2 * f / tp, h) + gemm_s(tokens_per_expert, h, f / tp)
        gemm += local_experts * per_expert + gemm_s(tokens, model.num_local_experts, h)
    elif not model.gated_mlp:
        gemm += gemm_s(tokens, f / tp, h) + gemm_s(tokens, h, f / tp)
    else:
        gemm += gemm_s(tokens, 2 * f / tp, h) + gemm_s(tokens, h, f / tp)

    # Attention core: b * heads_local batched (q x hd) @ (hd x s) and (q x s) @ (s x hd),
    # q = s / cp queries. Under cp, the load-balanced split (chunks i and 2cp - 1 - i of
    # 2cp) gives every rank half of its (q x s) block below the diagonal, as without cp
    # (Llama 3, Dubey et al. 2024 §3.3.2).
    batch = b * heads_local
    core = gemm_s(queries, s, hd, batch) + gemm_s(queries, hd, s, batch)
    if training.flash_attention:
        core *= FLASH_CAUSAL_FRACTION
    else:
        core += memory_bound_time_s(SCORE_BYTES_PER_ELEMENT * batch * queries * s, cluster)

    # Elementwise bytes per token-and-hidden element (Korthikanti et al. 2022 §4.1 lists
    # the same tensors for activation memory): each of the two norms reads and writes
    # (2 * 2 values); each residual add reads two tensors and writes one (2 * 3 values),
    # in GPT fused with bias and dropout, which adds a 1-byte mask (Megatron-LM's fused
    # bias-dropout-add). With sequence parallelism these run on s/tp tokens.
    value = activation_bytes_per_value(training)
    per_h = 2 * (2 * value) + 2 * (3 * value) + (2 if model.is_gpt else 0)
    replicated = per_h * tokens * h / (tp if sequence_parallel else 1)
    # GELU reads and writes f values; SwiGLU reads two and writes one; sharded by tp.
    act_values = (3 if model.gated_mlp else 2) * f * model.busiest_rank_rows_per_token(ep)
    activation = value * act_values * tokens / tp
    one_kernel_each = model.norm == "layernorm" and not model.gated_mlp and model.position_embedding == "learned"
    if one_kernel_each and not (runtime is not None and runtime.torch_compile):
        # The runtime's eager traffic factor counts the norms, rotary embedding and gated
        # activation that PyTorch code writes as several tensor ops (torchtitan's and the
        # executor's RMSNorm, apply_rope, silu(x) * y); LayerNorm and an ungated GELU with
        # learned positions (GPT) are one kernel each in eager PyTorch (nn.LayerNorm,
        # F.gelu) and are charged one pass.
        traffic = 1.0
    elementwise = memory_bound_time_s(traffic * (replicated + activation), cluster)
    return LayerCompute(gemm, core, elementwise)


def op_level_gemm_fraction(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                           micro_batch_size: int, tp: int, ep: int = 1, cp: int = 1) -> float:
    """Share of a layer's forward GEMM time that op-level selective recompute repeats
    (costmodel.terms.recompute.op_level_split), each matmul priced on the GEMM curve:
    Llama-3-8B repeats k, o and up, 37% of its GEMM FLOPs. A share, so that it applies
    to a measured layer's GEMM time as well."""
    peak = cluster.gpu.peak_for(training.precision)
    tokens = micro_batch_size * training.seq_len / cp

    def seconds(matmuls) -> float:
        return sum(gemm_time_s(tokens * m.tokens_fraction, m.out_width, m.in_width, peak, device=cluster.gpu)
                   for m in matmuls)

    kept, repeated = op_level_split(model, tp, ep)
    repeated_s = seconds(repeated)
    total = seconds(kept) + repeated_s
    return repeated_s / total if total > 0 else 0.0


def head_compute_s(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                   micro_batch_size: int, tp: int, runtime: RuntimeSpec | None = None, cp: int = 1) -> float:
    """Forward seconds of final norm, logits and cross-entropy on the last stage. The
    loss reads and writes fp32 logits (vocab-parallel cross-entropy, Megatron-LM), one
    pass per kernel the runtime runs over them (its loss traffic factor)."""
    gemm_scale = _kernel_factors(runtime)[0]
    traffic = 1.0 if runtime is None else runtime.loss_traffic_factor
    peak = cluster.gpu.peak_for(training.precision) * gemm_scale
    tokens = micro_batch_size * training.seq_len / cp
    logits = gemm_time_s(tokens, model.vocab_size / tp, model.hidden_size, peak, device=cluster.gpu)
    loss = memory_bound_time_s(traffic * 2 * 4 * tokens * model.vocab_size / tp, cluster)
    return logits + loss


def embedding_compute_s(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                        micro_batch_size: int, runtime: RuntimeSpec | None = None, cp: int = 1) -> float:
    """Forward seconds of the embedding lookup (and position add): writes b*s*h values
    (b*s/cp under context parallelism)."""
    traffic = _kernel_factors(runtime)[1]
    tokens = micro_batch_size * training.seq_len / cp
    reads = 2 if model.position_embedding == "learned" else 1
    return memory_bound_time_s(traffic * (reads + 1) * activation_bytes_per_value(training) * tokens
                               * model.hidden_size, cluster)


# HBM bytes the optimizer step moves per local parameter: Adam reads fp32 master
# weights, momentum, variance and the gradient and writes the three states and the
# 16-bit copy (4*3 + 2 + 4*3 + 2 = 28); SGD with momentum 4*2 + 2 + 4*2 + 2 = 20. The
# global gradient-norm, clipping and gradient zeroing passes add 4 + 2*4 + 4 = 16
# (fp32 main gradients, Megatron-LM's optimizer; calibrated with the non-layer time
# of the 22B rows of Korthikanti et al. 2022 Table 5).
OPTIMIZER_BYTES_PER_PARAMETER = {"adam": 28 + 16, "adamw": 28 + 16, "sgd": 20 + 16}
