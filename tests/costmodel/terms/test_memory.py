"""costmodel.terms.memory: ZeRO model-state bytes (Rajbhandari et al. 2020 §3.1, §5), per-layer
activation bytes (Korthikanti et al. 2022 Table 2, generalised), in-flight micro-batches
per schedule, logits."""

from __future__ import annotations

import pytest

from costmodel.specs.loading import load_cluster, load_model, make_training
from costmodel.terms import memory
from costmodel.terms.memory import (
    in_flight_microbatches,
    layer_activation_bytes,
    logits_bytes,
    sharded_state_bytes,
    state_bytes,
)


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
    assert layer_activation_bytes(m, t, b, 1, False, "none") == pytest.approx(per_sbh * s * b * h + scores, rel=1e-12)
    assert layer_activation_bytes(m, t, b, 1, False, "full") == 4 * s * b * h


def test_fp32_llama_activations_are_the_eager_modules(dgx):
    # Measured with saved_tensors_hooks and FSDPMemTracker (bench/memory_tracker.py):
    # 21.75 sbh per llama2-7b layer in fp32 with SDPA: 3 per RMSNorm (input, x * rsqrt,
    # output), Q, K, V, SDPA's output and the projection's copy of it, 4 f-wide MLP tensors.
    m = load_model("llama2-7b")
    t = training(m, dgx, flash=True, precision="fp32", seq=1024)
    s, h, f = 1024, 4096, 11008
    expected = 4 * (6 * s * h + 5 * s * h + 4 * s * f)
    assert expected == 21.75 * 4 * s * h
    assert layer_activation_bytes(m, t, 1, 1, False, "none") == pytest.approx(expected, rel=1e-12)
    # Megatron-LM's fused kernels in 16-bit (Korthikanti et al. Table 2) keep less.
    bf16 = training(m, dgx, flash=True, seq=1024)
    assert layer_activation_bytes(m, bf16, 1, 1, False, "none") == pytest.approx(2 * (8 * s * h + 3 * s * f), rel=1e-12)


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
    s, b, h, f, k, E = 4096, 1, 4096, 14336, 2, 8
    replicated = 8 * s * b * h
    attention = 2 * (1 + 2 * 8 / 32) * s * b * h + 2 * s * b * h
    mlp = 2 * 3 * f * s * b * k       # each token's k experts keep their tensors
    router = 4 * s * b * E            # fp32 router logits
    assert layer_activation_bytes(m, t, b, 1, False, "none") == pytest.approx(
        replicated + attention + mlp + router, rel=1e-12)


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
    assert memory.DDP_BUCKET_BYTES == 25 * 1024**2
