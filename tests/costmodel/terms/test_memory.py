"""costmodel.terms.memory: ZeRO model-state bytes (Rajbhandari et al. 2020 §3.1, §5), per-layer
activation bytes (Korthikanti et al. 2022 Table 2, generalised), in-flight micro-batches
per schedule, logits."""

from __future__ import annotations

import dataclasses

import pytest
from costmodel_test_helpers import HF_DIR

from costmodel.specs.loading import SpecError, load_cluster, load_model, make_training
from costmodel.terms import memory
from costmodel.terms.memory import (
    held_state_bytes,
    in_flight_microbatches,
    layer_activation_bytes,
    logits_bytes,
    loss_peak_bytes,
    pytorch_layer_activation_bytes,
    sharded_state_bytes,
    state_bytes,
)
from costmodel.units import GIB


@pytest.fixture(scope="module")
def dgx():
    return load_cluster("dgx-a100-80gb")


def training(model, cluster, flash=False, precision="bf16", optimizer="adamw", seq=None, mixed_precision="megatron"):
    """Korthikanti et al.'s and ZeRO's counts are Megatron-LM's recipe ("megatron");
    PyTorch's own 16-bit training is tested below with "autocast" / "param_dtype"."""
    return make_training(model, cluster, 8, seq, precision=precision, optimizer=optimizer, flash_attention=flash,
                         mixed_precision=mixed_precision)


# ------------------------------------------------------------------ model states
@pytest.mark.parametrize("precision, optimizer, expected", [
    ("bf16", "adamw", (2, 2, 12)),   # ZeRO §3.1: 2 + 2 + K=12 bytes per parameter
    ("fp16", "adam", (2, 2, 12)),
    ("bf16", "sgd", (2, 2, 8)),      # fp32 master + momentum
    ("fp32", "adam", (4, 4, 8)),     # momentum + variance; weights are the master copy
    ("fp32", "sgd", (4, 4, 4)),
])
def test_state_bytes(dgx, precision, optimizer, expected):
    t = training(load_model("tiny-gpt"), dgx, precision=precision, optimizer=optimizer)
    s = state_bytes(t)
    assert (s.weights, s.gradients, s.optimizer) == expected


def test_zero_paper_figure_1_example(dgx):
    # ZeRO Figure 1: Psi = 7.5B parameters, N_d = 64, K = 12.
    t = training(load_model("tiny-gpt"), dgx)
    psi, nd = 7.5e9, 64
    per_stage = [sum(sharded_state_bytes(psi, t, z, nd)) for z in range(4)]
    assert per_stage[0] == pytest.approx((2 + 2 + 12) * psi)                # 120 GB
    assert per_stage[1] == pytest.approx(2 * psi + 2 * psi + 12 * psi / nd)  # 31.4 GB
    assert per_stage[2] == pytest.approx(2 * psi + (2 + 12) * psi / nd)      # 16.6 GB
    assert per_stage[3] == pytest.approx((2 + 2 + 12) * psi / nd)            # 1.9 GB
    assert [round(x / 1e9, 1) for x in per_stage] == [120.0, 31.4, 16.6, 1.9]


def test_sharded_state_bytes_components(dgx):
    t = training(load_model("tiny-gpt"), dgx)
    P, dp = 1e9, 8
    assert sharded_state_bytes(P, t, 0, dp) == (2 * P, 2 * P, 12 * P)
    assert sharded_state_bytes(P, t, 1, dp) == (2 * P, 2 * P, 12 * P / dp)
    assert sharded_state_bytes(P, t, 2, dp) == (2 * P, 2 * P / dp, 12 * P / dp)
    assert sharded_state_bytes(P, t, 3, dp) == (2 * P / dp, 2 * P / dp, 12 * P / dp)
    assert sharded_state_bytes(P, t, 3, 1) == (2 * P, 2 * P, 12 * P)


# ------------------------------------------------------------------ Korthikanti Table 2
GPT = dict(s=2048, b=4, h=6144, a=64)  # the 22B model, flash attention off, 16-bit


def sbh():
    return GPT["s"] * GPT["b"] * GPT["h"]


def score_ratio():
    return GPT["a"] * GPT["s"] / GPT["h"]  # as/h


@pytest.fixture(scope="module")
def gpt22(dgx):
    m = load_model("gpt-22b")
    return m, training(m, dgx, flash=False)


def test_table2_no_parallelism(gpt22):
    m, t = gpt22
    expected = sbh() * (34 + 5 * score_ratio())
    assert layer_activation_bytes(m, t, 4, 1, False, "none") == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_table2_tensor_parallel(gpt22, tp):
    m, t = gpt22
    expected = sbh() * (10 + 24 / tp + 5 * score_ratio() / tp)
    assert layer_activation_bytes(m, t, 4, tp, False, "none") == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("tp", [2, 8])
def test_table2_tensor_and_sequence_parallel(gpt22, tp):
    m, t = gpt22
    expected = sbh() * (34 / tp + 5 * score_ratio() / tp)
    assert layer_activation_bytes(m, t, 4, tp, True, "none") == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("tp", [1, 8])
def test_table2_selective_recompute(gpt22, tp):
    m, t = gpt22
    assert layer_activation_bytes(m, t, 4, tp, False, "selective") == pytest.approx(sbh() * (10 + 24 / tp), rel=1e-12)
    assert layer_activation_bytes(m, t, 4, tp, True, "selective") == pytest.approx(sbh() * 34 / tp, rel=1e-12)


def test_table2_full_recompute(gpt22):
    m, t = gpt22
    assert layer_activation_bytes(m, t, 4, 8, False, "full") == pytest.approx(2 * sbh(), rel=1e-12)
    # With sequence parallelism the stored layer input is itself split over tp
    # (Korthikanti §4.2.3 / §5: 2sbh/t), the code's documented generalisation.
    assert layer_activation_bytes(m, t, 4, 8, True, "full") == pytest.approx(2 * sbh() / 8, rel=1e-12)


def test_flash_attention_drops_the_score_term(dgx):
    m = load_model("gpt-22b")
    t = training(m, dgx, flash=True)
    for tp, sp in ((1, False), (8, False), (8, True)):
        none = layer_activation_bytes(m, t, 4, tp, sp, "none")
        assert none == layer_activation_bytes(m, t, 4, tp, sp, "selective")
        expected = sbh() * (34 / tp if sp else 10 + 24 / tp)
        assert none == pytest.approx(expected, rel=1e-12)


def test_fp32_activations(dgx):
    # fp32 runs on PyTorch's eager modules (memory.EAGER): the executor's GPT has no dropout.
    m = load_model("gpt-22b")
    t = training(m, dgx, precision="fp32")
    s, b, h, a = 2048, 1, 6144, 64
    # 4-byte values: norms/QKV/MLP inputs 4*4, attention 4*4, MLP 2 * 4h * 4
    per_sbh = 16 + 16 + 32
    scores = 4 * a * s * s * b  # the softmax output
    norm_stats = 2 * 8 * s * b  # each LayerNorm's fp32 mean and rstd per token
    assert layer_activation_bytes(m, t, b, 1, False, "none") == pytest.approx(
        per_sbh * s * b * h + scores + norm_stats, rel=1e-12)
    assert layer_activation_bytes(m, t, b, 1, False, "full") == 4 * s * b * h


def test_fp32_llama_activations_are_the_eager_modules(dgx):
    # Measured with saved_tensors_hooks and FSDPMemTracker (bench/memory_tracker.py):
    # 21.75 sbh per llama2-7b layer in fp32 with SDPA: 3 per RMSNorm (input, x * rsqrt,
    # output), Q, K, V, SDPA's output and the projection's copy of it, 4 f-wide MLP tensors;
    # per token SDPA's fp32 log-sum-exp per head and each RMSNorm's fp32 rsqrt.
    m = load_model("llama2-7b")
    t = training(m, dgx, flash=True, precision="fp32", seq=1024)
    s, h, f = 1024, 4096, 11008
    assert 4 * (6 * s * h + 5 * s * h + 4 * s * f) == 21.75 * 4 * s * h
    expected = 21.75 * 4 * s * h + (4 * 32 + 2 * 4) * s
    assert layer_activation_bytes(m, t, 1, 1, False, "none") == pytest.approx(expected, rel=1e-12)
    # Megatron-LM's fused kernels in 16-bit (Korthikanti et al. Table 2) keep less.
    bf16 = training(m, dgx, flash=True, seq=1024)
    assert layer_activation_bytes(m, bf16, 1, 1, False, "none") == pytest.approx(2 * (8 * s * h + 3 * s * f), rel=1e-12)


def test_fp32_gqa_keeps_k_and_v_repeated_to_every_head(dgx):
    """executor.models.attention_core repeats K and V to the query heads before SDPA,
    which keeps the repeated copies: in fp32 (eager modules) Llama-3-8B's K and V are
    saved 4096 wide, not 1024 (measured on tiny-llama: test_memory_tracker.py)."""
    gqa = load_model("llama3-8b")
    mha = dataclasses.replace(gqa, num_key_value_heads=32)
    t = training(gqa, dgx, flash=True, precision="fp32", seq=1024)
    assert layer_activation_bytes(gqa, t, 1, 1, False, "none") == pytest.approx(
        layer_activation_bytes(mha, t, 1, 1, False, "none"), rel=1e-12)


def test_llama_gqa_activations(dgx):
    m = load_model("llama2-70b")  # 64 heads, 8 kv heads, f 28672, no dropout
    t = training(m, dgx, flash=True)
    s, b, h, f, tp = 4096, 1, 8192, 28672, 8
    replicated = 4 * 2 * s * b * h               # two norm inputs, QKV input, MLP input
    attention = 2 * (1 + 2 * 8 / 64) * s * b * h + 2 * s * b * h  # Q, K, V (GQA) and projection input
    mlp = 2 * 3 * f * s * b                      # SwiGLU: gate out, up out, product
    assert layer_activation_bytes(m, t, b, tp, False, "none") == pytest.approx(
        (attention + mlp) / tp + replicated, rel=1e-12)
    assert layer_activation_bytes(m, t, b, tp, True, "none") == pytest.approx(
        (attention + mlp + replicated) / tp, rel=1e-12)


def test_moe_activations(dgx):
    m = load_model("mixtral-8x7b")
    t = training(m, dgx, flash=True, seq=4096)
    s, b, h, f, k = 4096, 1, 4096, 14336, 2
    replicated = 8 * s * b * h
    attention = 2 * (1 + 2 * 8 / 32) * s * b * h + 2 * s * b * h
    mlp = 2 * 3 * f * s * b * k       # each token's k experts keep their tensors
    # The experts' input rows, the rows that come back and their weighted copy (k each),
    # four int64 index vectors and two bf16 weight vectors of k entries
    # (costmodel.terms.memory.moe_rows_saved_bytes, measured in test_memory_tracker.py).
    routing = (2 * h * 3 * k + 4 * 8 * k + 2 * 2 * k) * s * b
    assert layer_activation_bytes(m, t, b, 1, False, "none") == pytest.approx(
        replicated + attention + mlp + routing, rel=1e-12)


def assert_mixtral_layer_holds(dgx, m, ep, rows_per_token):
    """A Mixtral-8x7B layer (seq 4096, micro-batch 1) whose experts hold
    `rows_per_token` rows per local token: its activation bytes by hand."""
    capacity_factor = m.moe_capacity_factor
    t = training(m, dgx, flash=True, seq=4096)
    s, b, h, f = 4096, 1, 4096, 14336
    replicated = 8 * s * b * h
    attention = 2 * (1 + 2 * 8 / 32) * s * b * h + 2 * s * b * h
    mlp = 2 * 3 * f * s * b * rows_per_token
    routed = 2 * min(1.0, capacity_factor or 1.0)   # rows a token sends: k x min(1, c)
    routing = (2 * h * (rows_per_token + 2 * routed) + 4 * 8 * 2 + 2 * 2 * 2) * s * b
    assert memory.expert_rows_held_per_token(m, ep) == rows_per_token
    assert layer_activation_bytes(m, t, b, 1, False, "none", ep=ep) == pytest.approx(
        replicated + attention + mlp + routing, rel=1e-12)


@pytest.mark.parametrize("capacity_factor, ep, rows_per_token", [
    (None, 1, 2), (None, 4, 2),        # dropless: balanced, k rows
    (0.5, 1, 1), (0.5, 4, 1),          # every expert capped at half its share: k / 2
    (1.25, 1, 2),                      # one rank holds every row whatever the routing
    (1.25, 4, 2.5),                    # the rank's experts full from every ep rank: c x k
    (8.0, 2, 4),                       # never more than the ep group's rows: ep x k
])
def test_moe_capacity_bounds_the_rows_the_experts_hold(dgx, capacity_factor, ep, rows_per_token):
    m = dataclasses.replace(load_model("mixtral-8x7b"), moe_capacity_factor=capacity_factor)
    assert_mixtral_layer_holds(dgx, m, ep, rows_per_token)


@pytest.mark.parametrize("imbalance, capacity_factor, ep, rows_per_token", [
    (1.5, None, 4, 3.0),     # dropless: the busiest rank holds 1.5 x k
    (6.0, None, 4, 8.0),     # at most the ep group's rows: ep x k
    (1.5, None, 1, 2.0),     # one rank holds every row whatever the routing
    (1.1, 1.25, 4, 2.5),     # a capacity factor is a bound: memory is priced at it
])
def test_moe_load_imbalance_sets_the_rows_dropless_experts_hold(dgx, imbalance, capacity_factor, ep, rows_per_token):
    m = dataclasses.replace(load_model("mixtral-8x7b"), moe_load_imbalance=imbalance,
                            moe_capacity_factor=capacity_factor)
    assert_mixtral_layer_holds(dgx, m, ep, rows_per_token)


def test_recompute_modes_are_ordered(gpt22):
    m, t = gpt22
    for tp, sp in ((1, False), (8, False), (8, True)):
        full, sel, none = (layer_activation_bytes(m, t, 4, tp, sp, r) for r in ("full", "selective", "none"))
        assert full < sel < none


# ------------------------------------------------------------------ in-flight micro-batches
def test_gpipe_holds_all_microbatches():
    assert [in_flight_microbatches("gpipe", 4, r, 16) for r in range(4)] == [16.0] * 4


def test_1f1b_holds_pp_minus_rank():
    assert [in_flight_microbatches("1f1b", 4, r, 16) for r in range(4)] == [4.0, 3.0, 2.0, 1.0]
    assert [in_flight_microbatches("1f1b", 8, r, 3) for r in range(8)] == [3, 3, 3, 3, 3, 3, 2, 1]  # min(m, pp-r)


def test_pp1_holds_one_microbatch():
    for schedule in ("gpipe", "1f1b", "interleaved"):
        assert in_flight_microbatches(schedule, 1, 0, 32, vpp=2) == 1.0


def test_interleaved_warmup_formula():
    pp, vpp, m = 8, 3, 64
    for r in range(pp):
        chunks = 2 * (pp - r - 1) + (vpp - 1) * pp + 1   # Megatron-LM warm-up + 1
        assert in_flight_microbatches("interleaved", pp, r, m, vpp) == pytest.approx(chunks / vpp, rel=1e-12)
    # rank 0: pp + (pp - 1)/vpp = pp * (1 + (pp - 1)/(pp * vpp)), Korthikanti eq. 5
    r0 = in_flight_microbatches("interleaved", pp, 0, m, vpp)
    assert r0 == pytest.approx(8 + 7 / 3, rel=1e-12)
    assert r0 / pp == pytest.approx(1 + (pp - 1) / (pp * vpp), rel=1e-12)


def test_interleaved_is_capped_by_the_microbatches_and_degenerates_to_1f1b():
    assert in_flight_microbatches("interleaved", 8, 0, 2, vpp=3) == pytest.approx(2 * 3 / 3)  # min(m*vpp, ...)/vpp
    assert in_flight_microbatches("interleaved", 4, 1, 16, vpp=1) == in_flight_microbatches("1f1b", 4, 1, 16)


# ------------------------------------------------------------------ logits and constants
def test_logits_bytes_are_4sbv_over_t(dgx):
    m = load_model("gpt-22b")
    t = training(m, dgx)
    assert logits_bytes(m, t, 4, 8) == 4 * 2048 * 4 * 51200 / 8


def test_constants():
    assert memory.RUNTIME_RESERVE_BYTES == 1024**3


# ------------------------------------------------------------------ PyTorch's 16-bit training


@pytest.mark.parametrize("mixed, optimizer, expected", [
    ("autocast", "adamw", (4, 4, 8)),     # fp32 weights, fp32 gradients, exp_avg + exp_avg_sq
    ("param_dtype", "adamw", (4, 4, 8)),  # FSDP2 keeps fp32 shards, reduces in fp32
    ("autocast", "sgd", (4, 4, 4)),
    ("megatron", "adamw", (2, 2, 12)),    # ZeRO §3.1
])
def test_held_state_bytes(dgx, mixed, optimizer, expected):
    t = training(load_model("tiny-llama"), dgx, optimizer=optimizer, mixed_precision=mixed)
    s = held_state_bytes(t)
    assert (s.weights, s.gradients, s.optimizer) == expected


# Bytes per s*h one layer saves, measured with saved_tensors_hooks under FakeTensorMode
# (bf16, seq 1024, micro-batch 1; Hugging Face modules with SDPA under param_dtype).
@pytest.mark.parametrize("name, per_sh", [
    ("llama-2-7b.json", 45.533203125),   # 2 RMSNorms x 8, q k v out 8, SwiGLU 8f
    ("llama-3-8b.json", 49.033203125),   # GQA: k and v a quarter wide
    ("mistral-7b.json", 49.033203125),   # below its sliding window: no mask
    ("qwen3-1.7b.json", 55.08203125),    # q/k RMSNorm: fp32 upcast + normalised value
])
def test_hf_layer_activations_are_the_saved_tensors(dgx, name, per_sh):
    spec = load_model(str(HF_DIR / name))
    t = training(spec, dgx, flash=True, seq=1024, mixed_precision="param_dtype")
    got = pytorch_layer_activation_bytes(spec, t, 1, 1, False, "none")
    assert got == per_sh * 1024 * spec.hidden_size


def test_gemma_and_sliding_window_activations(dgx):
    gemma = load_model(str(HF_DIR / "gemma-2b.json"))
    t = training(gemma, dgx, flash=True, seq=1024, mixed_precision="param_dtype")
    # Measured 88.527: the hand count plus Gemma's per-layer (1 + w) in fp32 (16 bytes per token).
    assert pytorch_layer_activation_bytes(gemma, t, 1, 1, False, "none") == 88.51953125 * 1024 * 2048
    mistral = load_model(str(HF_DIR / "mistral-7b.json"))
    t = training(mistral, dgx, flash=True, seq=4096, mixed_precision="param_dtype")
    # The window's mask makes transformers repeat K and V: measured 54.033 at seq 4096.
    assert pytorch_layer_activation_bytes(mistral, t, 1, 1, False, "none") == 54.033203125 * 4096 * 4096


def test_executor_autocast_layer_activations(dgx):
    # executor.models under torch.autocast: fp32 norms (x, x * rsqrt), a bf16 cast per
    # matmul (3 + 2), K and V repeated to 32 heads, RoPE tables cast, and each matmul's
    # bf16 weight copy. Measured on CPU: 64.157 bytes per s*h + copies, of which 2 are
    # CPU's head-major SDPA output copy (not on CUDA).
    spec = load_model("llama3-8b")
    t = training(spec, dgx, flash=True, seq=1024, mixed_precision="autocast")
    h, q, f = 4096, 4096, 14336
    per_token = (2 * (8 * h + 4) + 2 * 5 * h) + (2 * (q + 2 * 1024) + 2 * q + 4 * 32 + 4 * (q - 1024)) + 4 * 128 + 8 * f
    from costmodel.terms.counts import attention_parameters, expert_parameters
    copies = 2 * (attention_parameters(spec) + expert_parameters(spec))
    assert pytorch_layer_activation_bytes(spec, t, 1, 1, False, "none") == per_token * 1024 + copies
    assert per_token / h == pytest.approx(64.154 - 2, abs=0.005)
    # Full recompute keeps the fp32 residual stream only.
    assert pytorch_layer_activation_bytes(spec, t, 1, 1, False, "full") == 4 * 1024 * h


def test_loss_peak_is_three_fp32_logit_tensors(dgx):
    # The H200 run that ran out of memory asked for 31.31 GiB = one fp32 tensor of
    # 8 x 8192 x 128256 logits inside cross-entropy.
    spec = load_model("llama3-8b")
    t = training(spec, dgx, flash=True, seq=8192, mixed_precision="autocast")
    one = 4 * 8 * 8192 * 128256
    assert one / GIB == pytest.approx(31.31, abs=0.01)
    assert loss_peak_bytes(spec, t, 8, 1) == 3 * one
    assert loss_peak_bytes(spec, t, 8, 4) == 3 * one / 4
    megatron = training(spec, dgx, flash=True, seq=8192)
    assert loss_peak_bytes(spec, megatron, 8, 1) == one   # Korthikanti §4.3: 4sbv


def test_mixed_precision_must_be_known(dgx):
    with pytest.raises(SpecError) as err:
        training(load_model("tiny-llama"), dgx, mixed_precision="amp")
    assert err.value.field == "mixed_precision"


def test_zero_bubble_schedules_hold_twice_1f1bs_rank_0_count_on_every_rank():
    """pp micro-batches awaiting their input gradient and pp more awaiting a deferred
    weight gradient, at most m (bench/pipeline_memory.py measured up to 6.8 of 8 on
    the third of 4 ranks)."""
    assert [in_flight_microbatches("zb-interleaved", 4, r, 16) for r in range(4)] == [8.0] * 4
    assert [in_flight_microbatches("zb-interleaved", 4, r, 6, 2) for r in range(4)] == [6.0] * 4
    assert [in_flight_microbatches("zbv", 4, r, 16, 2) for r in range(4)] == [8.0] * 4
    assert in_flight_microbatches("zbv", 1, 0, 16, 2) == 1.0


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_activations_keep_the_gathered_keys(dgx, cp):
    # executor.models under torch.autocast at cp: every per-token tensor is the rank's s / cp
    # tokens, but SDPA keeps K and V (repeated to every head) of the whole sequence.
    spec = load_model("llama3-8b")
    s = 1024
    t = training(spec, dgx, flash=True, seq=s, mixed_precision="autocast")
    h, q, kv, f = 4096, 4096, 1024, 14336
    local = s // cp
    per_local_token = (2 * (8 * h + 4) + 2 * 5 * h) + (2 * q + 2 * q + 4 * 32) + 4 * 128 + 8 * f
    keys_per_token = 2 * 2 * kv + 4 * (q - kv)   # K, V and their repeated copies, 2 bytes each
    from costmodel.terms.counts import attention_parameters, expert_parameters
    copies = 2 * (attention_parameters(spec) + expert_parameters(spec))
    expected = per_local_token * local + keys_per_token * s + copies + 8 * s   # + the gather's int64 index
    assert pytorch_layer_activation_bytes(spec, t, 1, 1, False, "none", cp=cp) == expected
    assert pytorch_layer_activation_bytes(spec, t, 1, 1, False, "full", cp=cp) == 4 * local * h


def test_context_parallel_megatron_activations(gpt22):
    # Korthikanti et al.'s count with s / cp tokens, but K and V (2 of the 4 s*b*h attention
    # values: GPT's kv is h wide) over the whole sequence, and s / cp x s scores.
    m, t = gpt22
    b, s, h, a, cp = 1, t.seq_len, m.hidden_size, m.num_attention_heads, 2
    plain = layer_activation_bytes(m, t, b, 1, False, "none")
    split = layer_activation_bytes(m, t, b, 1, False, "none", cp=cp)
    # Without cp: sbh(34 + 5as/h). At cp 2: half of every term but K and V (4 sbh, kept
    # whole), and half the scores.
    assert plain == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=1e-12)
    assert split == pytest.approx(s * b * h * (34 - 4) / cp + 4 * s * b * h + 5 * a * s * s * b / cp, rel=1e-12)


def test_context_parallel_logits_are_the_local_tokens(dgx):
    spec = load_model("llama3-8b")
    t = training(spec, dgx, seq=4096)
    assert memory.logits_bytes(spec, t, 1, 1, cp=4) == memory.logits_bytes(spec, t, 1, 1) / 4


def test_fp8_linears_save_no_bf16_weight_copy(dgx):
    # Under autocast each bf16 matmul saves its bf16 weight copy; torchao's Float8Linear
    # saves the fp32 parameter itself and casts it per GEMM, so FP8 training drops the
    # copies of q/k/v/o and the MLP (2 bytes a weight).
    from costmodel.specs.loading import load_cluster as cluster_of
    from costmodel.terms.counts import attention_parameters, expert_parameters
    h100 = cluster_of("dgx-h100", gpus=1)
    spec = load_model("llama3-8b")
    bf16 = make_training(spec, h100, 8, 1024, precision="bf16", mixed_precision="autocast")
    fp8 = make_training(spec, h100, 8, 1024, precision="fp8", mixed_precision="autocast")
    dropped = 2 * (attention_parameters(spec) + expert_parameters(spec))
    assert (pytorch_layer_activation_bytes(spec, bf16, 1, 1, False, "none")
            - pytorch_layer_activation_bytes(spec, fp8, 1, 1, False, "none")) == dropped


@pytest.mark.parametrize("cp", [1, 2])
def test_mla_activations_keep_the_heads_and_the_latents(dgx, cp):
    """DeepSeek-V3's dense layer, Megatron-LM's recipe, tp 8: SDPA's query, key, value and
    output of 128 heads (192-wide queries and keys, 128-wide values) and fp32 log-sum-exp,
    split by tp; the two latents' RMSNorm inputs and outputs and fp32 inverse RMS, whole on
    every rank (the down projections are replicated). Under cp the keys, values and kv
    latent made from the gathered latent hold the whole sequence."""
    m = load_model("deepseek-v3").dense_layer()
    t = training(m, dgx, flash=True, seq=4096)
    s, b, h, f, tp = 4096, 1, 7168, 18432, 8
    tokens = s * b / cp
    replicated = 4 * 2 * tokens * h              # two norm inputs, the attention's input, MLP input
    heads = 2 * (128 * 192 + 128 * 128) * (1 + cp) + 4 * 128
    latents = (2 * 2 * 1536 + 4) + (2 * 2 * 512 + 4) * cp
    mlp = 2 * 3 * f
    assert layer_activation_bytes(m, t, b, tp, False, "none", cp=cp) == pytest.approx(
        (heads + mlp) * tokens / tp + latents * tokens + replicated, rel=1e-12)


def test_mla_context_parallel_gathers_the_latent(dgx):
    """Context parallelism gathers MLA's kv latent and shared rotary key (512 + 64 values a
    token), whole on every tp rank, in place of every head's K and V."""
    from costmodel.terms.compute import cp_gathered_values_per_token

    m = load_model("deepseek-v3")
    assert cp_gathered_values_per_token(m, 8) == 576 == m.kv_lora_rank + m.qk_rope_head_dim
    llama = load_model("llama3-70b")
    assert cp_gathered_values_per_token(llama, 8) == 2 * 8 * 128 / 8
