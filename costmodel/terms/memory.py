"""Memory per device: model states (weights, gradients, optimizer states) under ZeRO,
activations per layer and recomputation mode, the micro-batches each schedule keeps in
flight, and communication buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.specs import ModelSpec, TrainingSpec
from costmodel.strategy import ZERO_BUBBLE_SCHEDULES
from costmodel.terms.compute import activation_bytes_per_value
from costmodel.terms.recompute import op_level_split
from costmodel.units import GIB

# CUDA context, cuBLAS/NCCL workspaces and allocator fragmentation: ~1 GiB is what
# PyTorch jobs on A100/H100 report as reserved-but-not-allocated plus context at start
# (torch.cuda.memory_reserved vs nvidia-smi); kept free on every device.
RUNTIME_RESERVE_BYTES = GIB


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


def held_state_bytes(training: TrainingSpec) -> StateBytes:
    """Bytes per parameter of the states PyTorch keeps between steps. Mixed precision
    in PyTorch keeps fp32 weights and fp32 gradients: torch.autocast casts the fp32
    weights per matmul (executor/step.py), FSDP2's MixedPrecisionPolicy gathers bf16
    copies of fp32 sharded parameters and reduce-scatters fp32 gradients
    (reduce_dtype=fp32, as torchtitan); AdamW adds exp_avg and exp_avg_sq in fp32, SGD
    momentum one fp32 buffer. Measured: FSDPMemTracker, bench/memory_tracker.py, bf16
    cases (sharded params + sharded grads + optimizer = 16 bytes per parameter / dp).
    Same total as ZeRO's 2 + 2 + 12 without sharding, split differently under ZeRO-1/2."""
    if training.precision != "fp32" and training.mixed_precision == "megatron":
        return state_bytes(training)
    adam = training.optimizer in ("adam", "adamw")
    return StateBytes(4, 4, 8 if adam else 4)


def compute_copy_bytes(training: TrainingSpec) -> int:
    """Bytes per parameter of a gathered (FSDP2 unsharded) weight: the compute dtype
    under param_dtype, the fp32 weight itself under autocast and in fp32."""
    if training.precision != "fp32" and training.mixed_precision != "autocast":
        return 2
    return 4


def comm_state_bytes(training: TrainingSpec) -> StateBytes:
    """Bytes per parameter the data-parallel collectives move: weights gathered in the
    dtype FSDP2 gathers (`compute_copy_bytes`: bf16 under MixedPrecisionPolicy's
    param_dtype, the fp32 weights themselves under autocast) and gradients reduced in
    the dtype they are held in (fp32 in PyTorch's mixed precision: FSDP2's reduce_dtype
    as torchtitan sets it, DDP over fp32 parameters; 16-bit in Megatron-LM's recipe).
    The optimizer states never travel (0)."""
    return StateBytes(compute_copy_bytes(training), held_state_bytes(training).gradients, 0)


def sharded_state_bytes(parameters: float, training: TrainingSpec, zero_stage: int, shard: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes for `parameters` replicated over a data
    parallel group of `shard` ranks, as PyTorch holds them (`held_state_bytes`). ZeRO
    stage 1 shards optimizer states, stage 2 also gradients, stage 3 also weights
    (ZeRO §5, Figure 1)."""
    per = held_state_bytes(training)
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
    # K and V repeated to every query head before SDPA (grouped-query attention), SDPA's
    # per-head fp32 log-sum-exp and the norms' per-token fp32 statistics: what eager
    # modules keep and a fused kernel's count leaves out.
    eager_attention_and_norm_stats: bool = False


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
# With grouped-query attention, executor.models.attention_core's repeat_interleave makes
# the K and V SDPA keeps q wide, and SDPA keeps an fp32 log-sum-exp per head, each norm an
# fp32 rsqrt (RMSNorm) or mean and rstd (LayerNorm) per token (measured: tiny-llama, 4
# heads over 2 KV heads, 280 bytes per token beyond the count without them; 24 with 4 KV
# heads; tests/costmodel/terms/test_memory_tracker.py).
EAGER = SavedTensors(norm_extra_values=1, gated_mlp_tensors=4, head_major_output_copy=True, dropout=False,
                     eager_attention_and_norm_stats=True)


def saved_tensors(training: TrainingSpec) -> SavedTensors:
    """Megatron-LM's mixed precision is the recipe Korthikanti et al. measured; full fp32
    is what runs on PyTorch's eager modules (the executor trains in fp32 on CPU ranks,
    and Hugging Face models run eager). PyTorch's 16-bit training is counted tensor by
    tensor in `pytorch_layer_activation_bytes`."""
    return EAGER if training.precision == "fp32" else MEGATRON


def norm_saved_bytes(model: ModelSpec, training: TrainingSpec, consumers: int) -> tuple[float, float]:
    """(bytes per token per hidden value, bytes per token) one pre-norm keeps for
    backward in 16-bit PyTorch training, `consumers` matmuls reading its output.

    autocast (fp32 residual stream; executor.models.RMSNorm `x * rsqrt(mean(x^2)) * w`
    and nn.LayerNorm run in fp32): the fp32 input, the fp32 `x * rsqrt` (RMSNorm) and a
    bf16 cast of the output per consumer (autocast casts activations afresh for each
    matmul). param_dtype (bf16 residual; Hugging Face LlamaRMSNorm upcasts to fp32):
    the fp32 upcast, the bf16 normalised value the weight multiplies, the bf16 output
    once; Gemma's `x * (1 + w)` multiplies in fp32 (4 in place of 2); a bf16
    nn.LayerNorm keeps its input and its output. Per token: fp32 rsqrt / mean and rstd.
    Measured with saved_tensors_hooks under FakeTensorMode (`python bench/memory_tracker.py
    saved`): Llama-2-7B 16, Gemma-2B 20, Llama executor 16 + 12 bytes per s*h of norms."""
    if training.mixed_precision == "param_dtype":
        per_h = {"rmsnorm": 8.0, "rmsnorm_unit_offset": 10.0, "layernorm": 4.0}[model.norm]
    else:
        per_h = (8.0 if model.norm != "layernorm" else 4.0) + 2.0 * consumers
    return per_h, 8.0 if model.norm == "layernorm" else 4.0


def expert_rows_held_per_token(model: ModelSpec, ep: int) -> float:
    """Expert rows a rank's activations hold per local token. Balanced routing gives
    `routed_rows_per_token`. Under expert parallelism a capacity factor c bounds the
    busiest case: the rank's E/ep experts take at most c x their balanced share from each
    of the ep ranks, c x k rows per local token (never more than all ep ranks' rows), and
    memory is priced at that bound, since a low figure runs a plan out of memory. With
    every expert on the rank (ep 1) the rows are the routed rows whatever the routing.
    Dropless routing under ep has no bound: it is priced at the model's
    `moe_load_imbalance` (ModelSpec.busiest_rank_rows_per_token; 1, balanced, unless set)."""
    c = model.moe_capacity_factor
    if c is None or ep == 1:
        return model.busiest_rank_rows_per_token(ep)
    return model.num_experts_per_tok * min(c, ep)


def moe_rows_saved_bytes(model: ModelSpec, ep: int, value_bytes: float) -> float:
    """Per local token, what an MoE layer keeps beyond its experts' MLP tensors
    (executor.models.MoE, measured: `tests/costmodel/terms/test_memory.py` counts its
    saved tensors): the experts' input rows, for their weight gradients, where the
    experts run (`expert_rows_held_per_token`); on the token's rank the rows that come
    back, which the router weights multiply, and that product, which the combine's
    index_add keeps; four int64 index vectors of k entries (the top-k choices, the sort
    order, the gather and the combine) and the routing weights twice: the softmax over
    the k chosen logits keeps its output, where unnormalised routing (norm_topk_prob
    False) keeps its fp32 softmax over every expert instead (measured: 4E - 2k bytes a
    token more under autocast, 4E - 4k in fp32)."""
    if not model.is_moe:
        return 0.0
    h, k = model.hidden_size, model.num_experts_per_tok
    rows = value_bytes * h * (expert_rows_held_per_token(model, ep) + 2 * model.routed_rows_per_token)
    softmax = value_bytes * k if model.norm_topk_prob else 4.0 * model.num_local_experts
    return rows + 4 * 8.0 * k + value_bytes * k + softmax


# gpt-oss's clamped SwiGLU, gate.clamp * sigmoid(1.702 gate) * (up.clamp + 1), keeps 7
# tensors of the expert width where SwiGLU keeps 4 (measured with saved_tensors_hooks on
# transformers' GptOssExperts._apply_gate: 6 values a gate/up pair, and the product).
CLAMPED_SWIGLU_EXTRA_TENSORS = 3


def shared_gate_saved_bytes(model: ModelSpec, value_bytes: float) -> float:
    """Per token, what Qwen2-MoE's shared-expert gate keeps (executor.models.MoE:
    sigmoid(gate(x)) * shared(x)): the product keeps the shared expert's output and the
    sigmoid's, and the sigmoid its output (the same tensor, once)."""
    if not model.shared_expert_gate:
        return 0.0
    return value_bytes * (model.hidden_size + 1)


def _mlp_input_gathered(model: ModelSpec, fold: int) -> bool:
    """Whether tensor parallelism gathers the MLP block's input: a dense MLP's and a
    shared expert's, and the experts' when they are split over tp; whole experts under
    tp (`fold` > 1) route the rank's sequence shard as it is."""
    return not model.is_moe or model.has_shared_expert or fold == 1


def gathered_inputs_saved_bytes(model: ModelSpec, training: TrainingSpec, attention_consumers: int,
                                fold: int = 1) -> float:
    """Bytes per token per hidden value that the matmuls reading a block's gathered input
    keep, in 16-bit PyTorch training: under autocast a bf16 cast per matmul (the
    attention's `attention_consumers`; the MLP's gate and up, or up), under param_dtype
    the one bf16 input. Under sequence parallelism these are whole-sequence tensors
    (the gather runs before the matmuls), counted by norm_saved_bytes as the norm's."""
    autocast = training.mixed_precision != "param_dtype"
    mlp = (2 if model.gated_mlp else 1) if autocast else 1
    return 2.0 * ((attention_consumers if autocast else 1) + (mlp if _mlp_input_gathered(model, fold) else 0))


def pytorch_layer_activation_bytes(model: ModelSpec, training: TrainingSpec, micro_batch_size: int,
                                   tp: int, sequence_parallel: bool, recompute: str, ep: int = 1,
                                   cp: int = 1, fold: int = 1) -> float:
    """Activations one layer keeps for backward in 16-bit PyTorch training (eager
    modules: executor.models under torch.autocast, or Hugging Face modules under FSDP2's
    param_dtype), one micro-batch, one rank. Every tensor autograd saves, by width:

    - norms (`norm_saved_bytes`), not split by tp unless sequence parallelism splits them;
    - attention, split by tp: the rotated Q and K and V (2 bytes x their widths), SDPA's
      output (the output projection's input is a view of it; Dao et al. 2022 §3.1 keeps
      the output and a per-row fp32 log-sum-exp), per-head q/k RMSNorm (Qwen3: the fp32
      upcast and the bf16 normalised value, 6 bytes per value); under autocast the RoPE
      tables cast to bf16 per use (4 x head_dim bytes per token);
    - MLP, split by tp: GeGLU / SwiGLU keep the gate output, its activation, the up
      output and the product (4 tensors of intermediate_size); GELU keeps the first
      matrix's output and the activation (2);
    - under autocast, each matmul's bf16 weight copy (2 bytes per weight; the cast's
      cache is off in executor/step.py, so each forward saves its own copy).

    Measured: saved_tensors_hooks under FakeTensorMode, bf16, seq 1024 (bf16
    bytes per s*h per layer): Hugging Face Llama-2-7B 45.5, Llama-3-8B 49.0, Qwen3-1.7B
    55.1, Gemma-2B 88.5 under param_dtype; the executor's Llama-2-7B 57.7 + weight copies
    under autocast (`python bench/memory_tracker.py saved` prints each family beside
    this count); checked against FSDPMemTracker in bench/memory_tracker.py.
    Full recompute keeps the layer input only (the residual stream: fp32 under autocast).
    Under context parallelism a rank holds s / cp of each sequence's tokens but SDPA
    keeps the K and V gathered over the whole sequence (`gathered_kv_factor`). Under
    sequence parallelism the norms keep their shard, but each matmul reading a gathered
    block input keeps the gathered tensor (`gathered_inputs_saved_bytes`).
    """
    b, s, h, f = micro_batch_size, training.seq_len, model.hidden_size, model.intermediate_size
    tokens = b * s / cp
    seq_split = tp if sequence_parallel else 1
    autocast = training.mixed_precision != "param_dtype"
    residual = 4.0 if autocast else 2.0
    if recompute == "full":
        return residual * tokens * h / seq_split
    v, q, kv, hd = 2.0, model.q_size, model.kv_size, model.head_dim
    gated = model.gated_mlp
    attention_consumers = (2 if model.is_mla else 3) if autocast else 1
    # An MoE layer's norm output feeds the router; its experts cast the rows they take
    # (moe_rows_saved_bytes).
    mlp_consumers = (1 if model.is_moe else 2 if gated else 1) if autocast else 1
    if model.has_shared_expert and autocast:
        # The shared expert's gate and up (or up alone) and its gate's linear cast it too.
        mlp_consumers += (2 if gated else 1) + (1 if model.shared_expert_gate else 0)
    if model.norms_per_layer == 1:
        # One norm feeds attention and MLP (Phi, GPT-J).
        norm_h, norm_t = norm_saved_bytes(model, training, attention_consumers + mlp_consumers)
    else:
        a_h, a_t = norm_saved_bytes(model, training, attention_consumers)
        m_h, m_t = norm_saved_bytes(model, training, mlp_consumers)
        norm_h, norm_t = a_h + m_h, a_t + m_t
        if model.norms_per_layer == 4:
            # Gemma's post-attention and post-feedforward norms, whose outputs feed the
            # residual adds (no matmul casts them).
            p_h, p_t = norm_saved_bytes(model, training, 0)
            norm_h, norm_t = norm_h + 2 * p_h, norm_t + 2 * p_t
    # Dropout on the attention and MLP outputs keeps a mask each (in the activations'
    # dtype on CPU; measured: Phi-2, resid_pdrop 0.1).
    dropout_masks = 2 * v if model.resid_dropout > 0 else 0.0
    replicated = ((norm_h + dropout_masks) * h + norm_t) * tokens
    # The rotated Q, SDPA's output and fp32 log-sum-exp per head; K and V below.
    attention = v * q + v * q + 4.0 * model.num_attention_heads
    keys = v * 2 * kv
    if autocast:
        # executor.models.attention_core repeats K and V to every query head
        # (grouped-query attention): the repeated copies are saved in their place
        # (measured: the executor's Llama-3-8B, 3 bytes per s*h more than its MHA count).
        # Not counted: on CPU, SDPA's output is head-major, so the executor's
        # `out.transpose(1, 2).reshape(b, t, -1)` copies it (one q-wide tensor more:
        # 57.65 bytes per s*h for Llama-2-7B under FakeTensorMode); CUDA's flash kernels
        # write it token-major and the reshape is a view (the H200 runs of
        # executor_runs.json are 2-10% over the estimate with it counted).
        keys += 2 * v * (q - kv)
    attention += keys * gathered_kv_factor(cp)
    latents = 0.0
    if model.is_mla:
        # The latents' norms are eager modules too (the same upcasts as the hidden norms),
        # each read by one up projection.
        attention, latents = mla_saved_bytes(model, v, cp, norm_saved_bytes(model, training, 1))
    if model.qk_norm:
        attention += 6.0 * (q + kv) + 4.0 * (model.num_attention_heads + model.num_key_value_heads)
    if model.sliding_window is not None and s >= model.sliding_window and not autocast:
        # With a mask (Mistral's sliding window) transformers repeats K and V to every
        # head before SDPA (repeat_kv: GQA kernels take no mask) and SDPA's output is
        # copied: 6q - 4kv bytes per token more (measured: Mistral-7B at seq 4096,
        # 54.03 against 49.03 bytes per s*h at seq 1024).
        attention += 6.0 * q - 4.0 * kv
    if model.fused_qkv and model.position_embedding == "rope" and not autocast:
        # GPT-NeoX's query_key_value output stays whole through V's view while RoPE
        # makes Q and K anew: 2(q + kv) bytes per token more (measured: Pythia-1.4B,
        # 36.04 against 32.04 bytes per s*h).
        attention += v * (q + kv)
    rope_tables = 4.0 * hd if autocast and model.position_embedding == "rope" else 0.0
    mlp_tensors = 4 if gated else 2
    if model.swiglu_limit is not None:
        mlp_tensors += CLAMPED_SWIGLU_EXTRA_TENSORS
    if model.hidden_act == "gelu_new":
        # transformers' NewGELUActivation is an elementwise formula: the tanh, 0.5 x and
        # 1 + tanh are kept beside its input (measured: Phi-2, 5 tensors of f).
        mlp_tensors += 3
    mlp = v * mlp_tensors * (f * expert_rows_held_per_token(model, ep) + model.shared_expert_intermediate_size)
    split = (attention + mlp) * tokens / tp + (rope_tables + latents) * tokens
    router = (moe_rows_saved_bytes(model, ep, v) + shared_gate_saved_bytes(model, v)) * tokens
    weight_copies = 0.0
    if autocast:
        from costmodel.terms.counts import (
            attention_parameters,
            expert_parameters,
            shared_expert_parameters,
        )
        experts = model.num_local_experts if model.is_moe else 1
        router_weights = model.hidden_size * model.num_local_experts if model.is_moe else 0
        matmuls = (attention_parameters(model) + expert_parameters(model) * experts + router_weights
                   + shared_expert_parameters(model))
        if training.fp8:
            # torchao's Float8Linear saves its weight as it is held (the fp32 parameter)
            # and casts it to fp8 per GEMM: no bf16 copy for the linears FP8 converts
            # (attention, dense MLPs).
            matmuls -= attention_parameters(model) + (0 if model.is_moe else expert_parameters(model))
        weight_copies = 2.0 * matmuls / tp
    scores = 0.0
    if not training.flash_attention and recompute != "selective":
        # Eager attention: the softmax output (fp32 in Hugging Face, upcast) and its
        # bf16 cast per score element.
        scores = (4.0 + v) * b * model.num_attention_heads * s * s / (cp * tp)
    # Under cp the gather's reordering keeps an int64 index of the sequence's positions
    # (executor.models.ContextShard.gather; measured with saved_tensors_hooks).
    gather_index = 8.0 * s if cp > 1 else 0.0
    gathered = gathered_inputs_saved_bytes(model, training, attention_consumers, fold) * tokens * h
    kept_whole = gathered * (1 - 1 / seq_split)   # counted in `replicated` as a shard
    return split + replicated / seq_split + kept_whole + router + weight_copies + scores + gather_index


def mla_saved_bytes(model: ModelSpec, value_bytes: float, cp: int,
                    norm_bytes: tuple[float, float] | None = None) -> tuple[float, float]:
    """(bytes split by tp, bytes every tp rank holds whole) that multi-head latent
    attention keeps for backward per local token (DeepSeek-V2 §2.1.2, the tensors of
    transformers' DeepseekV3Attention): SDPA's query, key, value, output and fp32
    log-sum-exp per head (a flash or memory-efficient kernel's; on CPU, SDPA's math
    fallback for 192-wide keys and 128-wide values keeps fp32 copies and the fp32
    probabilities instead); the query latent's and the kv latent's RMSNorm, replicated
    over tp as the down projections are: `norm_bytes` (bytes per latent value, per
    token: `norm_saved_bytes`), or a fused norm's input and output and fp32 inverse RMS.
    RoPE saves its tables, not its inputs. Under context parallelism the kv latent and
    the shared rotary key are gathered (`ModelSpec.kv_values_per_token`), so the keys and
    values made from them, and the latent's norm, hold the whole sequence
    (`gathered_kv_factor`). Measured (`python bench/memory_tracker.py saved`, a dense
    DeepSeek-V3 layer under param_dtype less SDPA's math-path tensors): 43.43 bytes per
    s*h, counted 43.43."""
    per_value, per_token = norm_bytes or (2 * value_bytes, 4.0)
    gathered = gathered_kv_factor(cp)
    per_head = value_bytes * (model.q_size + model.out_size) * (1 + gathered) + 4.0 * model.num_attention_heads
    latent_norm = per_value * model.kv_lora_rank + per_token
    query_norm = per_value * model.q_lora_rank + per_token if model.q_lora_rank else 0.0
    return per_head, query_norm + latent_norm * gathered


def gathered_kv_factor(cp: int) -> float:
    """K and V bytes SDPA keeps per local token, over their bytes without context
    parallelism: the whole sequence's, gathered over the cp ranks (executor.models'
    all-gather attention; Llama 3, Dubey et al. 2024 §3.3.2), so cp times a rank's own."""
    return float(cp)


def op_level_activation_bytes(model: ModelSpec, training: TrainingSpec, micro_batch_size: int,
                              tp: int, sequence_parallel: bool, ep: int = 1, cp: int = 1) -> float:
    """Activations one layer keeps under op-level selective recompute (torchtitan's
    per-op SAC, costmodel.terms.recompute), one micro-batch, one rank: the layer's input
    (kept by the checkpoint: the residual stream, fp32 under autocast), the output of
    every second matmul, SDPA's output and fp32 log-sum-exp (flash attention only:
    math attention is recomputed) and, with sequence parallelism, the outputs of the
    two reduce-scatters. Everything else is made again in backward. Under context
    parallelism the gathered K and V are counted as kept (a conservative bound: the
    recompute gathers them again)."""
    tokens = micro_batch_size * training.seq_len / cp
    seq_split = tp if sequence_parallel else 1
    v = float(activation_bytes_per_value(training))
    autocast = training.precision != "fp32" and training.mixed_precision == "autocast"
    residual = 4.0 if autocast else v
    kept_matmuls, _ = op_level_split(model, tp, ep)
    saved = residual * tokens * model.hidden_size / seq_split
    saved += v * sum(m.output_values(tokens) for m in kept_matmuls)
    if training.flash_attention:
        saved += (v * model.out_size + 4.0 * model.num_attention_heads) * tokens / tp
    if tp > 1 and sequence_parallel:
        saved += 2 * v * tokens * model.hidden_size / tp
    if cp > 1:
        keys_values = model.q_size + model.out_size if model.is_mla else 2 * model.kv_size
        saved += v * keys_values * tokens * gathered_kv_factor(cp) / tp
    return saved


def layer_activation_bytes(model: ModelSpec, training: TrainingSpec, micro_batch_size: int,
                           tp: int, sequence_parallel: bool, recompute: str,
                           selective_policy: str = "attention-core", ep: int = 1, cp: int = 1,
                           fold: int = 1, keeps_gathered: bool = False) -> float:
    """Activations one layer keeps for backward, one micro-batch, one rank.

    Korthikanti et al. 2022 §4.1 (Table 2) with 16-bit values: sbh(34 + 5as/h) without
    parallelism; 10 of the 34 are not split by tensor parallelism unless sequence
    parallelism splits them; selective recompute drops the 5as/h attention-score term;
    full recompute keeps the layer input only (2sbh). Generalised here term by term:
    K and V scale with num_key_value_heads (GQA), the MLP with intermediate_size and its
    matrices (GELU: 2 tensors of f, SwiGLU: 3), MoE MLP tensors by the k experts each
    token visits (`expert_rows_held_per_token`) and the routing's rows
    (`moe_rows_saved_bytes`), dropout masks only in GPT models, and FlashAttention keeps its output
    instead of the s x s scores (Dao et al. 2022 §3.1). `saved_tensors` adds what eager
    PyTorch modules keep beyond Megatron-LM's fused kernels. Under the op-level
    selective policy (`selective_policy`, the runtime's) see `op_level_activation_bytes`.
    Under context parallelism (`cp`) every term counts the rank's s / cp tokens but K
    and V, gathered over the sequence (`gathered_kv_factor`), and the scores, s / cp
    queries by s keys. `fold` (Strategy.fold): whole experts under tp route each tp
    rank's sequence shard, so the routing's rows are split tp ways (else every tp rank
    holds the rows of all its tokens for its share of each expert). `keeps_gathered`
    (a runtime that does not gather a block's input again in backward,
    RuntimeSpec.sp_regathers_inputs false: PyTorch's tensor parallelism): under sequence
    parallelism each block keeps its gathered input whole (measured on the executor at
    tp 2: tests/costmodel/terms/test_memory.py); Megatron-LM keeps the shard.
    """
    if recompute == "selective" and selective_policy == "op-level":
        return op_level_activation_bytes(model, training, micro_batch_size, tp, sequence_parallel, ep, cp)
    if training.precision != "fp32" and training.mixed_precision != "megatron":
        return pytorch_layer_activation_bytes(model, training, micro_batch_size, tp, sequence_parallel, recompute,
                                              ep, cp, fold)
    b, f = micro_batch_size, model.intermediate_size
    s, h = training.seq_len / cp, model.hidden_size
    v = activation_bytes_per_value(training)
    saved = saved_tensors(training)
    seq_split = tp if sequence_parallel else 1
    tokens_h = b * s * h
    if recompute == "full":
        return v * tokens_h / seq_split
    dropout_mask = 1 if model.is_gpt and saved.dropout else 0
    rms_norm_extra = 0 if model.norm == "layernorm" else saved.norm_extra_values
    # Not split by tp without SP: two norm inputs, QKV input, MLP input, dropout masks.
    # Gemma's two post-norms (norms_per_layer 4) keep their inputs and extras as well.
    post_norms = 2 * (1 + rms_norm_extra) if model.norms_per_layer == 4 else 0
    replicated = ((4 + 2 * rms_norm_extra + post_norms) * v + 2 * dropout_mask) * tokens_h
    tokens_q, tokens_kv = b * s * model.q_size, b * s * model.kv_size * gathered_kv_factor(cp)
    attention = v * (2 * tokens_q + 2 * tokens_kv)   # Q, K, V and the projection input
    latents = 0.0
    if model.is_mla:
        per_head, per_token = mla_saved_bytes(model, v, cp)
        attention, latents = per_head * b * s, per_token * b * s
    if training.flash_attention and model.position_embedding == "rope" and saved.head_major_output_copy:
        attention += v * tokens_q
    per_token = 0.0
    if saved.eager_attention_and_norm_stats:
        attention += v * 2 * b * s * (model.q_size - model.kv_size) * gathered_kv_factor(cp)
        if training.flash_attention:
            attention += 4.0 * model.num_attention_heads * b * s
        per_token = model.norms_per_layer * norm_saved_bytes(model, training, 1)[1] * b * s
    mlp_tensors = (saved.gated_mlp_tensors if model.gated_mlp else 2) + (
        CLAMPED_SWIGLU_EXTRA_TENSORS if model.swiglu_limit is not None else 0)
    mlp = v * mlp_tensors * (f * expert_rows_held_per_token(model, ep) + model.shared_expert_intermediate_size) * b * s
    router = (moe_rows_saved_bytes(model, ep, v) + shared_gate_saved_bytes(model, v)) * b * s
    split = (attention + mlp) / tp + (replicated + per_token) / seq_split + router / fold + latents
    if keeps_gathered and seq_split > 1:
        # The QKV and MLP inputs, counted in `replicated` as shards, are kept whole.
        blocks = 1 + (1 if _mlp_input_gathered(model, fold) else 0)
        split += blocks * v * tokens_h * (1 - 1 / seq_split)
    scores = 0.0
    if not training.flash_attention and recompute != "selective":
        # softmax output (v), dropout mask (1) and dropout output (v) per score element.
        per_score = v + (1 + v) * dropout_mask
        scores = per_score * b * model.num_attention_heads * s * training.seq_len / tp
    return split + scores


def in_flight_microbatches(schedule: str, pp: int, pp_rank: int, num_microbatches: int, vpp: int = 1) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, counted in
    whole-rank units (all of the rank's layers).

    gpipe: all m (Huang et al. 2019, GPipe §2.2). 1f1b: min(m, pp - rank) (Narayanan et
    al. 2021, PipeDream-flush, §2.2). interleaved: Megatron-LM's warm-up of
    2(pp - rank - 1) + (vpp - 1)pp + 1 model chunks, i.e. pp + (pp - 1)/vpp on rank 0,
    Korthikanti et al. 2022 eq. 5. zb-interleaved, zbv and dualpipev: min(m, 2 pp) on every rank:
    up to pp micro-batches awaiting their input gradient (1F1B's rank-0 count; Qi et al.
    2024 keep ZB-H1's peak over ranks at 1F1B's, not each rank's) and up to pp more whose
    deferred weight gradient keeps the linear layers' inputs and output gradients.
    Measured on CPU (bench/pipeline_memory.py, torch 2.13, the executor's tiny-llama):
    at pp 4, m 8 the ranks of ScheduleInterleavedZeroBubble held 4.1, 5.3, 5.9 and 7.3
    micro-batches where Schedule1F1B's held 4, 3, 2 and 1, zbv's 4.9 to 5.6 and
    dualpipev's 4.8 to 5.4 (bench/results/pipeline_memory.txt).
    """
    m = num_microbatches
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule in ZERO_BUBBLE_SCHEDULES:
        return float(min(m, 2 * pp))
    if schedule == "interleaved" and vpp > 1:
        chunks = min(m * vpp, 2 * (pp - pp_rank - 1) + (vpp - 1) * pp + 1)
        return chunks / vpp
    return float(min(m, pp - pp_rank))


def loss_microbatches_held(schedule: str, pp: int, num_microbatches: int) -> float:
    """Micro-batches whose loss (logits_bytes: the logits, or their gradient, which the
    LM head's weight gradient reads) the head's rank holds at its peak: from the last
    stage's forward to its weight gradient. gpipe: all m. zb-interleaved: min(m, pp), the
    last stage's weight gradients deferred as every stage's are. 1f1b, interleaved, zbv
    and dualpipev: 1, the last stage's backward following its forward (zbv and dualpipev
    put it on rank 0 and run it whole). Counted off torch's action lists
    (tests/costmodel/terms/test_pipeline.py)."""
    m = num_microbatches
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "zb-interleaved":
        return float(min(m, pp))
    return 1.0


# fp32 bytes of one chunk of the executor's chunked cross-entropy's rows (a few such
# tensors live at once; executor.models.ChunkedCrossEntropy): small beside the logits,
# large enough that each chunk is a long kernel.
LOSS_CHUNK_BYTES = 256 << 20


def logits_bytes(model: ModelSpec, training: TrainingSpec, micro_batch_size: int, tp: int,
                 chunked: bool = False, cp: int = 1) -> float:
    """What the loss keeps for backward, per micro-batch: what stays alive while later
    micro-batches and layers run. fp32 logits for the vocab-parallel cross-entropy
    (Korthikanti et al. 2022 §4.3: 4sbv/t); the chunked cross-entropy's gradient buffer
    in the logits' dtype (executor.models.ChunkedCrossEntropy)."""
    per_logit = activation_bytes_per_value(training) if chunked else 4.0
    return per_logit * micro_batch_size * training.seq_len / cp * model.vocab_size / tp


def loss_peak_bytes(model: ModelSpec, training: TrainingSpec, micro_batch_size: int, tp: int,
                    chunked: bool = False, cp: int = 1) -> float:
    """The head's and loss's own peak, per micro-batch, on top of every layer's saved
    activations: F.cross_entropy upcasts the logits to fp32 (under autocast and in
    Hugging Face's loss alike) and keeps log_softmax's fp32 output; its backward makes
    the fp32 gradient of the loss and of log_softmax beside that output: 12 bytes per
    logit (3 fp32 tensors of b*s*V/tp); the forward peak, the bf16 logits with their
    fp32 copy and log_softmax's output, is 10. In fp32: the same three tensors. Exact
    for Hugging Face Llama-2-7B, Llama-3-8B and Qwen2-7B under FSDPMemTracker (the
    logits' activations and temporaries at the peak).
    Measured: the H200 run of executor_runs.json (Llama-3-8B, 4 layers, seq 8192, mbs 8)
    ran out of memory asking 31.31 GiB = 4 x 8 x 8192 x 128256 bytes in cross-entropy;
    FSDPMemTracker, bench/memory_tracker.py (Temp + logits at the loss's peak).
    `chunked`: the executor's chunked cross-entropy, below."""
    if training.precision != "fp32" and training.mixed_precision == "megatron":
        # Megatron-LM's vocab-parallel cross-entropy works in place on its fp32 logits.
        return logits_bytes(model, training, micro_batch_size, tp, cp=cp)
    tokens = micro_batch_size * training.seq_len / cp
    if chunked:
        # executor.models.ChunkedCrossEntropy: the logits and the gradient buffer in the
        # logits' dtype, and one chunk's fp32 rows with logsumexp's two temporaries.
        logits = tokens * model.vocab_size / tp
        return 2 * activation_bytes_per_value(training) * logits + 3 * min(LOSS_CHUNK_BYTES, 4.0 * logits)
    # Under autocast on CPU (FakeTensorMode) the bf16 logits stay alive to the end of
    # cross-entropy's backward (2 bytes per logit more); on the H200 they do not (the
    # runs of executor_runs.json are 4-7% over the estimate with them counted).
    return 12.0 * tokens * model.vocab_size / tp


def final_norm_bytes(model: ModelSpec, training: TrainingSpec, micro_batch_size: int, tp: int,
                     sequence_parallel: bool, cp: int = 1) -> float:
    """The final norm's saved tensors and the LM head's input (one consumer)."""
    tokens = micro_batch_size * training.seq_len / cp
    if training.precision == "fp32" or training.mixed_precision == "megatron":
        return 0.0   # counted in their layer formulas' norm terms
    per_h, per_token = norm_saved_bytes(model, training, 1)
    return (per_h * model.hidden_size + per_token) * tokens / (tp if sequence_parallel else 1)
