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
from costmodel.specs.training import FP8_SCALE_BYTES_PER_VALUE
from costmodel.terms.recompute import attention_matmuls, op_level_split

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
# Keys in one tile of FlashAttention-2's inner loop (Dao 2023 §3.1; B_c = 128 at head dims
# up to 128 in its forward kernel): a windowed kernel computes the tiles a band touches.
FLASH_BLOCK_KEYS = 128
# Backward of a matmul is two matmuls of the forward's size (input and weight
# gradients); backward of an elementwise op reads the saved input and the output
# gradient and writes the input gradient: about twice the forward traffic.
BACKWARD_FACTOR = 2.0
# FP8 training (TrainingSpec.fp8; torchao.float8 0.18, float8_linear.py
# matmul_with_hp_or_float8_args): every cast to fp8 is a dynamic-scaling pass, an amax
# read of the high-precision tensor then a scaling read and a 1-byte write. Forward casts
# the input and the weight; it saves both in high precision, so backward casts the
# weight and the input again and the output gradient twice (once per backward GEMM).
FP8_CAST_WRITE_BYTES = 1.0
# Eager torchao makes each cast five passes where a compiled graph makes the two above
# (float8_utils.tensor_to_amax: abs, then max; to_fp8_saturated: upcast, scale, clamp,
# downcast): 25 bytes a bf16 value against 5.
FP8_EAGER_CAST_FACTOR = 5.0
# Share of a GPU's SMs that communication kernels hold while they run beside computation:
# DeepSeek-V3's dispatch and combine keep InfiniBand and NVLink busy with 20 of an H800's
# 132 SMs (DeepSeek-AI 2024 §3.2.2), so the computation they hide behind runs on the rest.
COMM_SM_FRACTION = 20 / 132


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
    # FP8 training's casts (fp8_cast_s), in forward (input and weight) and in backward
    # (weight, input, output gradient twice): not in proportion to the rest, so apart.
    cast_forward_s: float = 0.0
    cast_backward_s: float = 0.0

    @property
    def forward_s(self) -> float:
        return self.gemm_s + self.attention_core_s + self.elementwise_s + self.cast_forward_s

    @property
    def backward_s(self) -> float:
        """Backward: two GEMMs per forward GEMM and twice the elementwise traffic
        (BACKWARD_FACTOR), and the backward FP8 casts."""
        return BACKWARD_FACTOR * (self.forward_s - self.cast_forward_s) + self.cast_backward_s


def cp_gathered_values_per_token(model: ModelSpec, tp: int) -> float:
    """Values a rank gathers per token of the sequence under context parallelism (Llama
    3, Dubey et al. 2024 §3.3.2: K and V all-gathered before attention): its tp share of
    the heads' K and V, or under MLA the latent and the shared rotary key
    (`ModelSpec.kv_values_per_token`), whole on every tp rank as the down projection is
    replicated, from which each rank makes its heads' keys and values."""
    if model.is_mla:
        return float(model.kv_values_per_token)
    return model.kv_values_per_token / tp


def activation_bytes_per_value(training: TrainingSpec) -> int:
    return 4 if training.precision == "fp32" else 2


def residual_bytes_per_value(training: TrainingSpec) -> int:
    """Bytes of a residual-stream value: fp32 under autocast, whose parameters, norms and
    residual adds stay in fp32 (the executor), so what tensor parallelism gathers into a
    block and scatters out of the embedding is fp32 (measured: tests/executor/
    test_collective_log.py, tp2 with sequence parallelism under bf16); 16-bit under
    Megatron-LM's recipe and FSDP2's param_dtype."""
    return 4 if training.precision == "fp32" or training.mixed_precision == "autocast" else 2


def _kernel_factors(runtime: RuntimeSpec | None) -> tuple[float, float]:
    """(GEMM efficiency scale, elementwise traffic factor) of the runtime."""
    if runtime is None:
        return 1.0, 1.0
    return runtime.gemm_efficiency_scale, runtime.elementwise_factor


def layer_compute(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                  micro_batch_size: int, tp: int, sequence_parallel: bool, ep: int = 1,
                  runtime: RuntimeSpec | None = None, cp: int = 1, etp: int | None = None) -> LayerCompute:
    """One layer's forward on one rank. Under context parallelism the rank runs s / cp of
    each sequence's tokens, and its queries attend the whole gathered sequence's keys.
    `etp`: the ranks each routed expert's matrices are split over (Strategy.expert_tp;
    None: tp)."""
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

    # FP8 training runs the layers' linear GEMMs at the FP8 peak; the experts' too where
    # the runtime converts them (RuntimeSpec.fp8_experts), else they and the router stay
    # in bf16 (executor.parallelize converts attention and dense MLPs only).
    linear_peak = cluster.gpu.peak_for("fp8") * gemm_scale if training.fp8 else peak
    experts_fp8 = bool(training.fp8) and runtime is not None and runtime.fp8_experts
    expert_peak = linear_peak if experts_fp8 else peak

    def expert_s(m: float, n: float, k: float) -> float:
        return gemm_time_s(m, n, k, expert_peak, 1.0, cluster.gpu)

    def linear_s(m: float, n: float, k: float) -> float:
        return gemm_time_s(m, n, k, linear_peak, 1.0, cluster.gpu)

    if model.is_mla:
        gemm = sum(linear_s(tokens, m.out_width, m.in_width) for m in attention_matmuls(model, tp))
    else:
        gemm = linear_s(tokens, qkv_width, h) + linear_s(tokens, h, model.q_size / tp)
    if model.is_moe:
        # Each rank's experts see tokens * k * ep / E tokens each under balanced routing
        # (the all-to-all gathers them from the ep group), E / ep experts per rank; a
        # capacity factor below 1 drops the rest, and the busiest rank, whose time the
        # others wait for, takes `moe_load_imbalance` times the mean
        # (ModelSpec.busiest_rank_rows_per_token).
        # Whole experts under tp (MoE parallel folding, etp 1) take each tp rank's
        # sequence shard: tp times fewer rows, tp times wider GEMMs.
        etp = tp if etp is None else etp
        local_experts = model.num_local_experts / ep
        tokens_per_expert = (tokens * etp / tp) * model.busiest_rank_rows_per_token(ep) * ep / model.num_local_experts
        per_expert = expert_s(tokens_per_expert, 2 * f / etp, h) + expert_s(tokens_per_expert, h, f / etp)
        gemm += local_experts * per_expert + gemm_s(tokens, model.num_local_experts, h)
        if model.has_shared_expert:
            # The shared expert: a dense MLP over every local token, split by tp as a dense
            # MLP is (Megatron-LM's SharedExpertMLP), and its gate's one output per token.
            f_shared = model.shared_expert_intermediate_size
            up = 2 if model.gated_mlp else 1
            gemm += expert_s(tokens, up * f_shared / tp, h) + expert_s(tokens, h, f_shared / tp)
            if model.shared_expert_gate:
                gemm += gemm_s(tokens, 1, h)
    elif not model.gated_mlp:
        gemm += linear_s(tokens, f / tp, h) + linear_s(tokens, h, f / tp)
    else:
        gemm += linear_s(tokens, 2 * f / tp, h) + linear_s(tokens, h, f / tp)

    # Attention core: b * heads_local batched (q x hd) @ (hd x s) and (q x s) @ (s x hd),
    # q = s / cp queries. Under cp, the load-balanced split (chunks i and 2cp - 1 - i of
    # 2cp) gives every rank half of its (q x s) block below the diagonal, as without cp
    # (Llama 3, Dubey et al. 2024 §3.3.2).
    batch = b * heads_local
    # QK^T over the query width, AV over the value width (MLA: 192 and 128 a head).
    qk, vd = model.query_head_dim, model.value_head_dim
    core = gemm_s(queries, s, qk, batch) + gemm_s(queries, vd, s, batch)
    if training.flash_attention:
        core *= FLASH_CAUSAL_FRACTION
    else:
        core += memory_bound_time_s(SCORE_BYTES_PER_ELEMENT * batch * queries * s, cluster)
    if model.windowed_layers and training.flash_attention:
        # Windowed layers (gpt-oss's sliding band, Llama 4's chunks) compute their share of
        # the s x s scores (ModelSpec.windowed_attention_fraction), a sliding band in whole
        # tiles of FLASH_BLOCK_KEYS keys (a query tile's band spans one tile more than the
        # window), on the GEMM curve of the keys a query sees; averaged with the full
        # layers (the layers stay alike, so a pipeline stage with an odd number of them is
        # off by half their difference). Eager attention computes the whole masked matrix.
        keys = min(model.attention_window + (0 if model.chunked_attention else FLASH_BLOCK_KEYS), s)
        fraction = model.windowed_attention_fraction(s, FLASH_BLOCK_KEYS) * s / keys
        band = fraction * (gemm_s(queries, keys, qk, batch) + gemm_s(queries, vd, keys, batch))
        windowed = model.windowed_layers / model.num_hidden_layers
        core = (1 - windowed) * core + windowed * band

    # Elementwise bytes per token-and-hidden element (Korthikanti et al. 2022 §4.1 lists
    # the same tensors for activation memory): each of the two norms reads and writes
    # (2 * 2 values); each residual add reads two tensors and writes one (2 * 3 values),
    # in GPT fused with bias and dropout, which adds a 1-byte mask (Megatron-LM's fused
    # bias-dropout-add). With sequence parallelism these run on s/tp tokens.
    value = activation_bytes_per_value(training)
    norms = 4 if model.norms_per_layer == 4 else 2   # Gemma's post-norms read and write too
    per_h = norms * (2 * value) + 2 * (3 * value) + (2 if model.is_gpt else 0)
    replicated = per_h * tokens * h / (tp if sequence_parallel else 1)
    # MLA's two latent RMSNorms read and write their latents on every rank (the down
    # projections are replicated over tp).
    replicated += 2 * (2 * value) * (model.q_lora_rank + model.kv_lora_rank) * tokens
    # GELU reads and writes f values; SwiGLU reads two and writes one; sharded by tp.
    act_values = (3 if model.gated_mlp else 2) * (f * model.busiest_rank_rows_per_token(ep)
                                                 + model.shared_expert_intermediate_size)
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
    if not training.fp8:
        return LayerCompute(gemm, core, elementwise)
    # The activations' casts (the weights' are the step's: fp8_weight_cast_s).
    inputs, outputs = fp8_cast_values(model, tp, sequence_parallel, training.fp8, fused_fp8_casts(runtime),
                                      ep, experts_fp8, etp)
    factor = fp8_cast_factor(runtime)
    return LayerCompute(gemm, core, elementwise,
                        memory_bound_time_s(factor * fp8_cast_bytes(2.0, inputs * tokens, training.fp8), cluster),
                        memory_bound_time_s(factor * fp8_cast_bytes(2.0, (inputs + outputs) * tokens, training.fp8),
                                            cluster))


def fp8_linears(model: ModelSpec, tp: int) -> list[tuple[float, float]]:
    """(in, out) widths of a rank's linear layers FP8 training converts, one module each
    as the executor and torchtitan write them (wq, wk, wv, wo; w1, w3, w2), each casting
    its own input; an MoE layer's router stays in bf16, its experts unless the runtime
    converts them (fp8_expert_linears)."""
    h, q, kv, f = model.hidden_size, model.q_size / tp, model.kv_size / tp, model.intermediate_size / tp
    if model.is_mla:
        linears = [(m.in_width, m.out_width) for m in attention_matmuls(model, tp)]
    else:
        linears = [(h, q), (h, kv), (h, kv), (q, h)]
    if not model.is_moe:
        linears += [(h, f)] * (2 if model.gated_mlp else 1) + [(f, h)]
    return linears


def fp8_expert_linears(model: ModelSpec, tp: int, ep: int,
                       etp: int | None = None) -> tuple[float, list[tuple[float, float, float, int]]]:
    """A rank's FP8 expert GEMMs where the runtime converts them (RuntimeSpec.fp8_experts:
    Megatron-LM's Transformer Engine grouped linear layers under --fp8-format; torchao's
    scaled grouped GEMM, torchtitan's quantize.grouped_mm.float8): (weights held, [(rows a
    local token, in, out, GEMMs on that one input)]): the routed experts' up (gated: gate
    and up, one input) and down GEMMs on the busiest rank's rows
    (ModelSpec.busiest_rank_rows_per_token), the shared expert's on every token, split by
    tp as their weights are; whole routed experts (`etp` 1 under tp) take the rank's
    sequence shard of the tokens."""
    if not model.is_moe:
        return 0.0, []
    etp = tp if etp is None else etp
    h, f, up = model.hidden_size, model.intermediate_size / etp, 2 if model.gated_mlp else 1
    rows = model.busiest_rank_rows_per_token(ep) * etp / tp
    weights = model.num_local_experts / ep * (up + 1) * h * f
    gemms = [(rows, h, f, up), (rows, f, h, 1)]
    if model.has_shared_expert:
        shared = model.shared_expert_intermediate_size / tp
        weights += (up + 1) * h * shared
        gemms += [(1.0, h, shared, up), (1.0, shared, h, 1)]
    return weights, gemms


def fp8_cast_values(model: ModelSpec, tp: int, sequence_parallel: bool, recipe: str,
                    compiled: bool, ep: int = 1, experts: bool = False, etp: int | None = None) -> tuple[float, float]:
    """(input values cast in forward, output-gradient values cast in backward) per token of
    one layer's FP8 linears; backward casts the inputs again as well (torchao saves them in
    high precision). Eager, every Float8Linear casts its own input, and its output
    gradient twice, once per backward GEMM. Compiled (inductor), casts of one tensor with
    one scale are one kernel: wq, wk and wv share their input's cast, w1 and w3 theirs, and
    a tensorwise output gradient's two casts are one. Tensorwise with tensor parallelism
    (torchao's Float8ColwiseParallel and PrepareFloat8ModuleInput, as torchtitan applies
    them) casts each block's input once before its all-gather, on the rank's sequence
    shard under sequence parallelism. `compiled`: fused casts (inductor, or Transformer
    Engine's). `experts`: the experts' GEMMs are FP8 too (fp8_expert_linears), each
    routed row cast on its rank; fused, the up GEMMs share their input's cast."""
    linears = fp8_linears(model, tp)
    _, gemms = fp8_expert_linears(model, tp, ep, etp) if experts else (0.0, [])
    expert_outputs = sum(rows * n * count for rows, _, n, count in gemms)
    if not compiled:
        return (sum(k for k, _ in linears) + sum(rows * k * count for rows, k, _, count in gemms),
                2 * (sum(n for _, n in linears) + expert_outputs))
    h = model.hidden_size
    shared = h / (tp if recipe == "tensorwise" and tp > 1 and sequence_parallel else 1)
    # One shared input per block (attention, and a dense MLP), then wo's and w2's own.
    blocks = 1 if model.is_moe else 2
    own = [model.out_size / tp] + ([] if model.is_moe else [model.intermediate_size / tp])
    if model.is_mla:
        # The up projections' inputs: the query and kv latents (each rank's whole).
        own += [model.q_lora_rank, model.kv_lora_rank] if model.q_lora_rank else [model.kv_lora_rank]
    # The experts' gate and up GEMMs share one cast of their rows, the down GEMM casts its own.
    expert_inputs = sum(rows * k for rows, k, _, _ in gemms)
    casts_per_gradient = 1 if recipe == "tensorwise" else 2
    return (blocks * shared + sum(own) + expert_inputs,
            casts_per_gradient * (sum(n for _, n in linears) + expert_outputs))


def fp8_cast_bytes(value_bytes: float, values: float, recipe: str | None = None) -> float:
    """HBM bytes of casting `values` held in `value_bytes` each to fp8: an amax read, a
    scaling read and a 1-byte write (FP8_CAST_WRITE_BYTES). Rowwise scaling reads and
    writes the same, one scale a row; blockwise and MX scales add their bytes
    (FP8_SCALE_BYTES_PER_VALUE)."""
    scales = FP8_SCALE_BYTES_PER_VALUE.get(recipe, 0.0)
    return (2 * value_bytes + FP8_CAST_WRITE_BYTES + scales) * values


def fused_fp8_casts(runtime: RuntimeSpec | None) -> bool:
    """Whether the runtime's FP8 casts are fused kernels: compiled (inductor), or an
    engine's own (RuntimeSpec.fused_fp8_casts: Transformer Engine's cast and
    cast-transpose kernels compute the amax as they cast)."""
    return runtime is not None and (runtime.torch_compile or runtime.fused_fp8_casts)


def fp8_cast_factor(runtime: RuntimeSpec | None) -> float:
    """Passes over a cast's bytes: 1 fused (fused_fp8_casts), FP8_EAGER_CAST_FACTOR eager."""
    return 1.0 if fused_fp8_casts(runtime) else FP8_EAGER_CAST_FACTOR


def fp8_weight_cast_s(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, tp: int, shard: int,
                      runtime: RuntimeSpec | None = None, ep: int = 1, etp: int | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's weight casts to fp8 per micro-batch: each
    converted weight cast once in forward and once in backward, from its held dtype (fp32
    under autocast, bf16 under param_dtype), over `shard` of it: 1, or dp x cp under
    ZeRO-3 with tensorwise scaling, where FSDP2 casts the shard before its float8
    all-gather and the GEMMs take the gathered fp8 weight as it is (torchao
    fsdp_utils, torchtitan's enable_fsdp_float8_all_gather). The rank's experts too where
    the runtime converts them (fp8_expert_linears), each cast whole."""
    if not training.fp8:
        return 0.0, 0.0
    held = 4.0 if training.mixed_precision == "autocast" else 2.0
    weights = sum(k * n for k, n in fp8_linears(model, tp)) / shard
    if runtime is not None and runtime.fp8_experts:
        weights += fp8_expert_linears(model, tp, ep, etp)[0]
    seconds = memory_bound_time_s(fp8_cast_factor(runtime) * fp8_cast_bytes(held, weights, training.fp8), cluster)
    return seconds, seconds


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
