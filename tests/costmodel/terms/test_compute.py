"""costmodel.terms.compute: the GEMM efficiency model, memory-bound kernels and the per-layer,
head and embedding compute times, checked term by term against hand arithmetic."""

from __future__ import annotations

import dataclasses

import pytest
from costmodel_test_helpers import A100_HBM, A100_PEAK_BF16, gemm_seconds, hbm_seconds

from costmodel.specs import RuntimeSpec
from costmodel.specs.loading import load_cluster, load_model, make_training
from costmodel.terms import compute
from costmodel.terms.compute import (
    LayerCompute,
    activation_bytes_per_value,
    embedding_compute_s,
    gemm_efficiency,
    gemm_time_s,
    head_compute_s,
    layer_compute,
    memory_bound_time_s,
)

PEAK = A100_PEAK_BF16


@pytest.fixture(scope="module")
def dgx():
    return load_cluster("dgx-a100-80gb")


def training(model, cluster, flash=True, precision="bf16"):
    return make_training(model, cluster, 8, precision=precision, flash_attention=flash)


# ------------------------------------------------------------------ primitives
def test_documented_constants():
    assert compute.GEMM_EFFICIENCY_MAX == 0.84
    assert compute.GEMM_DIM_HALF == 128
    assert compute.MEMORY_BOUND_EFFICIENCY == 0.8
    assert compute.FLASH_CAUSAL_FRACTION == 0.5
    assert compute.BACKWARD_FACTOR == 2.0


def test_gemm_efficiency():
    # a dimension of 128 halves its factor: 0.84 * (1/2)^3
    assert gemm_efficiency(128, 128, 128) == pytest.approx(0.84 / 8, rel=1e-12)
    assert gemm_efficiency(8192, 6144 * 3 / 8, 6144) == pytest.approx(
        0.84 * 8192 / 8320 * 2304 / 2432 * 6144 / 6272, rel=1e-12)
    assert gemm_efficiency(1e9, 1e9, 1e9) == pytest.approx(0.84, rel=1e-6)
    assert gemm_efficiency(1e9, 1e9, 1e9) < 0.84


def test_gemm_time():
    m, n, k = 8192, 2304, 6144
    expected = 2 * m * n * k / (PEAK * 0.84 * (m / (m + 128)) * (n / (n + 128)) * (k / (k + 128)))
    assert gemm_time_s(m, n, k, PEAK) == pytest.approx(expected, rel=1e-12)
    assert gemm_time_s(m, n, k, PEAK, batch=3) == pytest.approx(3 * expected, rel=1e-12)
    assert gemm_time_s(0, n, k, PEAK) == 0.0 and gemm_time_s(m, -1, k, PEAK) == 0.0


def test_memory_bound_time(dgx):
    assert memory_bound_time_s(1e9, dgx) == pytest.approx(1e9 / (2.039e12 * 0.8), rel=1e-12)


def test_activation_bytes_per_value(dgx):
    m = load_model("tiny-gpt")
    assert activation_bytes_per_value(training(m, dgx, precision="bf16")) == 2
    assert activation_bytes_per_value(training(m, dgx, precision="fp16")) == 2
    assert activation_bytes_per_value(training(m, dgx, precision="fp32")) == 4


def test_layer_compute_forward_is_the_sum():
    lc = LayerCompute(1.0, 2.0, 3.5)
    assert lc.forward_s == 6.5


# ------------------------------------------------------------------ one layer, by hand
@pytest.mark.parametrize("tp, sp, flash", [(1, False, True), (1, False, False), (2, False, True), (2, True, False), (4, True, True)])
def test_gpt_layer_compute_by_hand(dgx, tp, sp, flash):
    m = load_model("tiny-gpt")  # h 64, 4 heads of 16, f 256; s 64 (max positions)
    b, s, h, a, hd, f = 2, 64, 64, 4, 16, 256
    tokens = b * s
    gemm = (gemm_seconds(tokens, 3 * h / tp, h, PEAK)      # QKV
            + gemm_seconds(tokens, h, h / tp, PEAK)        # attention output projection
            + gemm_seconds(tokens, f / tp, h, PEAK)        # MLP up
            + gemm_seconds(tokens, h, f / tp, PEAK))       # MLP down
    heads = b * a / tp
    core = gemm_seconds(s, s, hd, PEAK, heads) + gemm_seconds(s, hd, s, PEAK, heads)  # QK^T, AV
    if flash:
        core *= 0.5  # causal FlashAttention skips half the blocks
    else:
        core += hbm_seconds(11 * heads * s * s)  # scale, mask, softmax, dropout on the scores
    # 2 norms * (read+write 2 bytes) + 2 residual adds * (2 reads + 1 write) + 1-byte dropout mask
    per_h = 2 * (2 * 2) + 2 * (3 * 2) + 2
    replicated = per_h * tokens * h / (tp if sp else 1)
    gelu = 2 * (2 * f) * tokens / tp  # GELU reads and writes f values of 2 bytes
    elementwise = hbm_seconds(replicated + gelu)

    lc = layer_compute(m, dgx, training(m, dgx, flash), b, tp, sp)
    assert lc.gemm_s == pytest.approx(gemm, rel=1e-12)
    assert lc.attention_core_s == pytest.approx(core, rel=1e-12)
    assert lc.elementwise_s == pytest.approx(elementwise, rel=1e-12)
    assert lc.forward_s == pytest.approx(gemm + core + elementwise, rel=1e-12)


@pytest.mark.parametrize("tp", [1, 2])
def test_llama_layer_compute_by_hand(dgx, tp):
    m = load_model("tiny-llama")  # h 64, 4 heads of 16, 2 kv heads (kv 32), f 176
    b, s, h, kv, f = 3, 64, 64, 32, 176
    tokens = b * s
    gemm = (gemm_seconds(tokens, (h + 2 * kv) / tp, h, PEAK)
            + gemm_seconds(tokens, h, h / tp, PEAK)
            + gemm_seconds(tokens, 2 * f / tp, h, PEAK)   # gate and up, fused
            + gemm_seconds(tokens, h, f / tp, PEAK))      # down
    heads = b * 4 / tp
    core = 0.5 * (gemm_seconds(s, s, 16, PEAK, heads) + gemm_seconds(s, 16, s, PEAK, heads))
    per_h = 2 * (2 * 2) + 2 * (3 * 2)       # no dropout mask in llama
    swiglu = 2 * (3 * f) * tokens / tp      # reads two f tensors, writes one
    lc = layer_compute(m, dgx, training(m, dgx), b, tp, False)
    assert lc.gemm_s == pytest.approx(gemm, rel=1e-12)
    assert lc.attention_core_s == pytest.approx(core, rel=1e-12)
    assert lc.elementwise_s == pytest.approx(hbm_seconds(per_h * tokens * h + swiglu), rel=1e-12)


def test_banded_layers_attend_their_window(dgx):
    """gpt-oss: half the layers attend the last 128 keys, a full band without the causal
    half; the attention core is the average of the two kinds of layer."""
    m = load_model("gpt-oss-20b")
    full = dataclasses.replace(m, attention_window=None, windowed_layers=0)
    b, s, hd, heads = 1, 4096, 64, 64
    # A band of 128 keys a query in whole tiles of 128: 256 keys, less the first queries' triangle.
    band = (1 - 256 / (2 * s)) * (gemm_seconds(s, 256, hd, PEAK, heads * b) + gemm_seconds(s, hd, 256, PEAK, heads * b))
    t = make_training(m, dgx, 8, s, flash_attention=True)
    full_core = layer_compute(full, dgx, t, b, 1, False).attention_core_s
    assert layer_compute(m, dgx, t, b, 1, False).attention_core_s == pytest.approx((full_core + band) / 2, rel=1e-12)
    # Within the window a banded layer is a full causal one.
    short = make_training(m, dgx, 8, 128, flash_attention=True)
    assert layer_compute(m, dgx, short, b, 1, False).attention_core_s == pytest.approx(
        layer_compute(full, dgx, short, b, 1, False).attention_core_s, rel=1e-12)


@pytest.mark.parametrize("seq", [4096, 8192, 16384])
def test_chunked_layers_are_causal_within_their_chunks(seq):
    """Llama 4's chunked layers: chunks of 8192 tokens, causal within each: half the
    square up to one chunk, then chunk / (2s) of it."""
    m = load_model("llama3-8b", {"attention_window": "8192", "windowed_layers": "24", "chunked_attention": "true"})
    assert m.windowed_attention_fraction(seq) == (0.5 if seq <= 8192 else 8192 / (2 * seq))


def test_a_partial_last_chunk_is_its_own_triangle():
    m = load_model("llama3-8b", {"attention_window": "8192", "windowed_layers": "24", "chunked_attention": "true"})
    assert m.windowed_attention_fraction(12288) == (8192 ** 2 + 4096 ** 2) / (2 * 12288 ** 2)


def test_eager_windowed_layers_compute_the_whole_masked_matrix(dgx):
    m = load_model("gpt-oss-20b")
    full = dataclasses.replace(m, attention_window=None, windowed_layers=0)
    t = make_training(m, dgx, 8, 4096, flash_attention=False)
    assert layer_compute(m, dgx, t, 1, 1, False).attention_core_s == layer_compute(full, dgx, t, 1, 1, False).attention_core_s


@pytest.mark.parametrize("tp", [1, 2])
def test_shared_expert_adds_a_dense_mlp_and_its_gate(dgx, tp):
    """The shared expert runs every token through a SwiGLU MLP split by tp, its gate one
    output per token; its activation reads and writes 3 f_shared values a token."""
    shared = load_model("tiny-moe-shared")
    routed = dataclasses.replace(shared, shared_expert_intermediate_size=0, shared_expert_gate=False)
    b, s, h, fs = 2, 64, 64, 128
    tokens = b * s
    added = (gemm_seconds(tokens, 2 * fs / tp, h, PEAK) + gemm_seconds(tokens, h, fs / tp, PEAK)
             + gemm_seconds(tokens, 1, h, PEAK))
    with_shared = layer_compute(shared, dgx, training(shared, dgx), b, tp, False)
    without = layer_compute(routed, dgx, training(routed, dgx), b, tp, False)
    assert with_shared.gemm_s - without.gemm_s == pytest.approx(added, rel=1e-12)
    assert with_shared.elementwise_s - without.elementwise_s == pytest.approx(
        hbm_seconds(2 * 3 * fs * tokens / tp), rel=1e-9)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_moe_layer_gemm_by_hand(dgx, ep):
    m = load_model("tiny-moe")  # h 64, kv 32, f 128, 4 experts, top-2
    b, s, h, kv, f, E, k, tp = 2, 64, 64, 32, 128, 4, 2, 1
    tokens = b * s
    attention = gemm_seconds(tokens, h + 2 * kv, h, PEAK) + gemm_seconds(tokens, h, h, PEAK)
    tokens_per_expert = tokens * k * ep / E          # balanced routing
    per_expert = gemm_seconds(tokens_per_expert, 2 * f, h, PEAK) + gemm_seconds(tokens_per_expert, h, f, PEAK)
    router = gemm_seconds(tokens, E, h, PEAK)
    lc = layer_compute(m, dgx, training(m, dgx), b, tp, False, ep=ep)
    assert lc.gemm_s == pytest.approx(attention + (E / ep) * per_expert + router, rel=1e-12)
    act = 2 * (3 * f * k) * tokens
    assert lc.elementwise_s == pytest.approx(hbm_seconds((2 * 4 + 2 * 6) * tokens * h + act), rel=1e-12)


@pytest.mark.parametrize("capacity_factor, kept", [(0.5, 0.5), (1.0, 1.0), (1.5, 1.0)])
def test_moe_capacity_below_one_drops_expert_rows(dgx, capacity_factor, kept):
    """Balanced routing fills each expert to its share: a capacity factor c < 1 keeps c
    of the rows, c >= 1 all of them."""
    m = dataclasses.replace(load_model("tiny-moe"), moe_capacity_factor=capacity_factor)
    b, s, h, kv, f, E, k, ep = 2, 64, 64, 32, 128, 4, 2, 2
    tokens = b * s
    attention = gemm_seconds(tokens, h + 2 * kv, h, PEAK) + gemm_seconds(tokens, h, h, PEAK)
    tokens_per_expert = tokens * k * kept * ep / E
    per_expert = gemm_seconds(tokens_per_expert, 2 * f, h, PEAK) + gemm_seconds(tokens_per_expert, h, f, PEAK)
    router = gemm_seconds(tokens, E, h, PEAK)
    lc = layer_compute(m, dgx, training(m, dgx), b, 1, False, ep=ep)
    assert lc.gemm_s == pytest.approx(attention + (E / ep) * per_expert + router, rel=1e-12)
    act = 2 * (3 * f * k * kept) * tokens
    assert lc.elementwise_s == pytest.approx(hbm_seconds((2 * 4 + 2 * 6) * tokens * h + act), rel=1e-12)


@pytest.mark.parametrize("imbalance, capacity_factor, ep, busiest", [
    (1.5, None, 2, 1.5),    # the busiest rank takes 1.5 x the mean
    (3.0, None, 2, 2.0),    # never more than every ep rank sends
    (3.0, 1.25, 4, 1.25),   # a capacity factor drops what goes beyond it
    (1.5, None, 1, 1.0),    # every expert on the rank: the rows are the routed rows
])
def test_moe_load_imbalance_prices_the_busiest_rank(dgx, imbalance, capacity_factor, ep, busiest):
    """The layer time is the busiest rank's: its experts compute `busiest` x k rows per
    local token (ModelSpec.busiest_rank_rows_per_token)."""
    m = dataclasses.replace(load_model("tiny-moe"), moe_load_imbalance=imbalance, moe_capacity_factor=capacity_factor)
    b, s, h, kv, f, E, k = 2, 64, 64, 32, 128, 4, 2
    tokens = b * s
    assert m.busiest_rank_rows_per_token(ep) == k * busiest
    attention = gemm_seconds(tokens, h + 2 * kv, h, PEAK) + gemm_seconds(tokens, h, h, PEAK)
    tokens_per_expert = tokens * k * busiest * ep / E
    per_expert = gemm_seconds(tokens_per_expert, 2 * f, h, PEAK) + gemm_seconds(tokens_per_expert, h, f, PEAK)
    router = gemm_seconds(tokens, E, h, PEAK)
    lc = layer_compute(m, dgx, training(m, dgx), b, 1, False, ep=ep)
    assert lc.gemm_s == pytest.approx(attention + (E / ep) * per_expert + router, rel=1e-12)
    act = 2 * (3 * f * k * busiest) * tokens
    assert lc.elementwise_s == pytest.approx(hbm_seconds((2 * 4 + 2 * 6) * tokens * h + act), rel=1e-12)


def test_flash_halves_the_attention_core_gemms(dgx):
    m = load_model("gpt-22b")
    b, tp = 4, 8
    with_flash = layer_compute(m, dgx, training(m, dgx, flash=True), b, tp, False)
    without = layer_compute(m, dgx, training(m, dgx, flash=False), b, tp, False)
    scores_traffic = hbm_seconds(11 * (4 * 64 / 8) * 2048 * 2048)
    assert without.attention_core_s == pytest.approx(2 * with_flash.attention_core_s + scores_traffic, rel=1e-12)
    assert with_flash.gemm_s == without.gemm_s


def test_sequence_parallel_only_shrinks_replicated_elementwise(dgx):
    m = load_model("gpt-22b")
    t = training(m, dgx, flash=False)
    a = layer_compute(m, dgx, t, 4, 8, False)
    b = layer_compute(m, dgx, t, 4, 8, True)
    tokens, h, f = 4 * 2048, 6144, 24576
    saved = hbm_seconds(22 * tokens * h * (1 - 1 / 8))
    assert a.gemm_s == b.gemm_s and a.attention_core_s == b.attention_core_s
    assert a.elementwise_s - b.elementwise_s == pytest.approx(saved, rel=1e-9)
    assert b.elementwise_s == pytest.approx(hbm_seconds(22 * tokens * h / 8 + 2 * 2 * f * tokens / 8), rel=1e-12)


def test_fp32_uses_the_fp32_peak(dgx):
    m = load_model("tiny-gpt")
    lc = layer_compute(m, dgx, training(m, dgx, precision="fp32"), 1, 1, False)
    expected = (gemm_seconds(64, 192, 64, 1.95e13) + gemm_seconds(64, 64, 64, 1.95e13)
                + gemm_seconds(64, 256, 64, 1.95e13) + gemm_seconds(64, 64, 256, 1.95e13))
    assert lc.gemm_s == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------ head and embedding
@pytest.mark.parametrize("tp", [1, 8])
def test_head_compute(dgx, tp):
    m = load_model("gpt-22b")
    b, s, h, V = 4, 2048, 6144, 51200
    tokens = b * s
    logits = gemm_seconds(tokens, V / tp, h, PEAK)
    loss = hbm_seconds(2 * 4 * tokens * V / tp)  # fp32 logits read and written
    assert head_compute_s(m, dgx, training(m, dgx), b, tp) == pytest.approx(logits + loss, rel=1e-12)


def test_embedding_compute(dgx):
    gpt, llama = load_model("gpt-22b"), load_model("llama2-7b")
    # GPT reads token and position rows and writes the sum; llama reads one row, writes one.
    assert embedding_compute_s(gpt, dgx, training(gpt, dgx), 4) == pytest.approx(
        (2 + 1) * 2 * 4 * 2048 * 6144 / (A100_HBM * 0.8), rel=1e-12)
    assert embedding_compute_s(llama, dgx, training(llama, dgx), 2) == pytest.approx(
        (1 + 1) * 2 * 2 * 4096 * 4096 / (A100_HBM * 0.8), rel=1e-12)


def test_device_gemm_curve_overrides_the_a100_fit():
    from costmodel.specs.loading import load_cluster
    cpu = load_cluster("cpu").gpu   # configs/hardware/cpu.yaml: max 1.0, half dimension 5
    assert gemm_efficiency(16, 16, 16, cpu) == pytest.approx((16 / 21) ** 3, rel=1e-12)
    assert gemm_efficiency(16, 16, 16) == pytest.approx(0.84 * (16 / 144) ** 3, rel=1e-12)
    assert gemm_time_s(16, 16, 16, 1e11, device=cpu) == pytest.approx(2 * 16 ** 3 / (1e11 * (16 / 21) ** 3), rel=1e-12)


@pytest.mark.parametrize("cp, flash", [(2, True), (4, False)])
def test_context_parallel_layer_runs_s_over_cp_queries_against_every_key(dgx, cp, flash):
    # Under cp a rank runs s / cp tokens through the GEMMs; its queries attend all s keys
    # (Llama 3's all-gather CP), half of them below the diagonal with load balancing.
    m = load_model("tiny-gpt")
    b, s, h, a, hd, f = 2, 64, 64, 4, 16, 256
    q = s / cp
    tokens = b * q
    gemm = (gemm_seconds(tokens, 3 * h, h, PEAK) + gemm_seconds(tokens, h, h, PEAK)
            + gemm_seconds(tokens, f, h, PEAK) + gemm_seconds(tokens, h, f, PEAK))
    heads = b * a
    core = gemm_seconds(q, s, hd, PEAK, heads) + gemm_seconds(q, hd, s, PEAK, heads)
    core = core * 0.5 if flash else core + hbm_seconds(11 * heads * q * s)
    elementwise = hbm_seconds((2 * (2 * 2) + 2 * (3 * 2) + 2) * tokens * h + 2 * (2 * f) * tokens)
    lc = layer_compute(m, dgx, training(m, dgx, flash), b, 1, False, cp=cp)
    assert lc.gemm_s == pytest.approx(gemm, rel=1e-12)
    assert lc.attention_core_s == pytest.approx(core, rel=1e-12)
    assert lc.elementwise_s == pytest.approx(elementwise, rel=1e-12)


def test_fp8_layer_runs_its_linears_at_the_fp8_peak_and_pays_their_casts():
    # Llama 3 8B on one H100, eager: q/k/v/o and the SwiGLU matrices at the FP8 peak on the
    # same GEMM curve, the attention core at bf16's; each Float8Linear casts its input in
    # forward (amax read, scaling read, 1-byte write: 5 bytes a bf16 value) and again in
    # backward, and its output gradient twice, five passes each eager (torchao's ops).
    from costmodel.specs.loading import load_cluster as cluster_of
    h100 = cluster_of("dgx-h100", gpus=1)
    m = load_model("llama3-8b")
    bf16 = layer_compute(m, h100, make_training(m, h100, 1, 4096, precision="bf16"), 1, 1, False)
    fp8_training = make_training(m, h100, 1, 4096, precision="fp8")
    fp8 = layer_compute(m, h100, fp8_training, 1, 1, False)
    h, q, kv, f, tokens = 4096, 4096, 1024, 14336, 4096
    fp8_peak = 1.979e15
    gemm = (gemm_time_s(tokens, q + 2 * kv, h, fp8_peak, device=h100.gpu) + gemm_time_s(tokens, h, q, fp8_peak, device=h100.gpu)
            + gemm_time_s(tokens, 2 * f, h, fp8_peak, device=h100.gpu) + gemm_time_s(tokens, h, f, fp8_peak, device=h100.gpu))
    assert fp8.gemm_s == pytest.approx(gemm, rel=1e-12) and fp8.gemm_s < bf16.gemm_s
    assert fp8.attention_core_s == bf16.attention_core_s and fp8.elementwise_s == bf16.elementwise_s
    inputs = 3 * h + q + 2 * h + f          # wq, wk, wv; wo; w1, w3; w2
    outputs = q + 2 * kv + h + 2 * f + h
    hbm = h100.gpu.hbm_bandwidth_bytes_per_s * compute.MEMORY_BOUND_EFFICIENCY
    assert fp8.cast_forward_s == pytest.approx(5 * 5 * inputs * tokens / hbm, rel=1e-12)
    assert fp8.cast_backward_s == pytest.approx(5 * 5 * (inputs + 2 * outputs) * tokens / hbm, rel=1e-12)
    assert fp8.backward_s == pytest.approx(2 * (fp8.forward_s - fp8.cast_forward_s) + fp8.cast_backward_s, rel=1e-12)


def test_compiled_fp8_casts_a_shared_input_once():
    # Inductor makes one cast of one tensor at one scale: q/k/v share their input's cast,
    # w1/w3 theirs, and a tensorwise output gradient's two casts are one; rowwise keeps two.
    m = load_model("llama3-8b")
    h, q, kv, f = 4096, 4096, 1024, 14336
    assert compute.fp8_cast_values(m, 1, False, "tensorwise", True) == (h + q + h + f, q + 2 * kv + h + 2 * f + h)
    assert compute.fp8_cast_values(m, 1, False, "rowwise", True)[1] == 2 * (q + 2 * kv + h + 2 * f + h)
    # Tensorwise TP casts each block's input once on the sequence shard, before the all-gather.
    assert compute.fp8_cast_values(m, 8, True, "tensorwise", True)[0] == 2 * h / 8 + q / 8 + f / 8


def test_fp8_experts_run_at_the_fp8_peak_where_the_runtime_converts_them():
    # Qwen1.5-MoE: 60 experts of width 1408, top 4, and a gated shared expert of 5632. A
    # runtime converting the experts (Megatron-LM's Transformer Engine grouped linears) runs
    # every local expert's GEMMs and the shared expert's at the FP8 peak; the router stays bf16.
    h100 = load_cluster("dgx-h100", gpus=8)
    m = load_model("qwen1.5-moe-a2.7b")
    training = make_training(m, h100, 1, 4096, precision="fp8-rowwise")
    neutral = RuntimeSpec(name="neutral", version=1)
    converted = dataclasses.replace(neutral, fp8_experts=True)
    ep, tokens, h, f, fs = 4, 4096, 2048, 1408, 5632
    rows = tokens * 4 * ep / 60   # each local expert's rows under balanced routing

    def experts_s(peak: float) -> float:
        def g(m_, n, k):
            return gemm_time_s(m_, n, k, peak, device=h100.gpu)
        return 60 / ep * (g(rows, 2 * f, h) + g(rows, h, f)) + g(tokens, 2 * fs, h) + g(tokens, h, fs)

    plain = layer_compute(m, h100, training, 1, 1, False, ep, neutral)
    fp8 = layer_compute(m, h100, training, 1, 1, False, ep, converted)
    saved = experts_s(h100.gpu.peak_for("bf16")) - experts_s(h100.gpu.peak_for("fp8"))
    assert saved > 0 and plain.gemm_s - fp8.gemm_s == pytest.approx(saved, rel=1e-9)
    # Each routed row is cast on its rank (gate and up: one input, fused), the shared
    # expert's every token; the output gradients of each GEMM.
    attention = compute.fp8_cast_values(m, 1, False, "rowwise", False)
    inputs, outputs = 4 * (2 * h + f) + (2 * h + fs), 2 * (4 * (2 * f + h) + (2 * fs + h))
    assert compute.fp8_cast_values(m, 1, False, "rowwise", False, ep, True) == (
        attention[0] + inputs, attention[1] + outputs)
    fused = compute.fp8_cast_values(m, 1, False, "rowwise", True)
    assert compute.fp8_cast_values(m, 1, False, "rowwise", True, ep, True) == (
        fused[0] + 4 * (h + f) + (h + fs), fused[1] + outputs)
    assert compute.fp8_expert_linears(m, 1, ep)[0] == 60 / ep * 3 * h * f + 3 * h * fs
    # Transformer Engine's casts are fused (one pass), eager torchao's five.
    assert compute.fp8_cast_factor(converted) == compute.FP8_EAGER_CAST_FACTOR == 5.0
    assert compute.fp8_cast_factor(dataclasses.replace(neutral, fused_fp8_casts=True)) == 1.0
    fused_casts = layer_compute(m, h100, training, 1, 1, False, ep,
                                dataclasses.replace(converted, fused_fp8_casts=True))
    assert fused_casts.cast_forward_s < fp8.cast_forward_s and fused_casts.gemm_s == fp8.gemm_s


@pytest.mark.parametrize("recipe, scale_bytes", [("rowwise", 0.0), ("blockwise", 4 / 128), ("mxfp8", 1 / 32)])
def test_block_scaled_fp8_casts_write_their_scales(recipe, scale_bytes):
    # A float32 scale per 1x128 tile (blockwise), an E8M0 byte per 32 values (MX): the
    # same GEMMs and cast passes as rowwise, and the scales' bytes beside each value.
    b200 = load_cluster("dgx-b200", gpus=8)
    m = load_model("llama3-8b")
    rowwise = layer_compute(m, b200, make_training(m, b200, 1, 4096, precision="fp8-rowwise"), 1, 1, False)
    precision = "mxfp8" if recipe == "mxfp8" else f"fp8-{recipe}"
    other = layer_compute(m, b200, make_training(m, b200, 1, 4096, precision=precision), 1, 1, False)
    assert compute.fp8_cast_bytes(2.0, 10.0, recipe) == (5.0 + scale_bytes) * 10.0
    assert other.gemm_s == rowwise.gemm_s
    assert other.cast_forward_s == pytest.approx(rowwise.cast_forward_s * (5.0 + scale_bytes) / 5.0, rel=1e-12)
    assert other.cast_backward_s == pytest.approx(rowwise.cast_backward_s * (5.0 + scale_bytes) / 5.0, rel=1e-12)
