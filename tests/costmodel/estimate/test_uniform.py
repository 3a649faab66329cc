"""costmodel.estimate: the consistency of the breakdowns, throughput and utilisation,
hand-computed communication, memory and step-time terms, the structural claims
(1F1B/GPipe memory, ZeRO order, sequence parallelism, zero comm at degree 1) and the
calibration against Korthikanti et al. 2022 Tables 4 and 5."""

from __future__ import annotations

import dataclasses
import math

import pytest
from costmodel_test_helpers import (
    A100_HBM,
    A100_PEAK_BF16,
    CALIBRATION_FILE,
    IB_BW,
    IB_LAT,
    NEUTRAL,
    NVLINK_BW,
    NVLINK_LAT,
    load_calibration_runs,
    problem,
    ring_all_reduce,
    ring_gather,
    run,
    strategy,
)

from costmodel.estimate import estimate
from costmodel.estimate.breakdown import Work
from costmodel.estimate.uniform import (
    FsdpUnits,
    dp_sync_s,
    fsdp_stream_pool_bytes,
    fsdp_units,
    optimizer_step_s,
    p2p_sends,
    rank_memory,
    rank_parameters,
    recompute_flops,
    unit_costs,
)
from costmodel.problem import Problem
from costmodel.specs import HostOverheads
from costmodel.specs.loading import (
    load_cluster,
    load_model,
    load_runtime,
    make_training,
)
from costmodel.strategy import Strategy, even_stages
from costmodel.terms import compute
from costmodel.terms.comm import groups
from costmodel.terms.compute import OPTIMIZER_BYTES_PER_PARAMETER, layer_compute
from costmodel.terms.counts import (
    layer_parameters,
    model_flops_per_step,
    total_parameters,
)
from costmodel.terms.memory import layer_activation_bytes
from costmodel.units import GIB

MIB = 1 << 20

# (problem kwargs, strategy kwargs): a spread of shapes for the consistency checks.
CASES = {
    "tiny-gpt": (dict(model="tiny-gpt", global_batch=8), dict(micro_batch_size=2)),
    "llama2-7b-dp8-zero1": (dict(model="llama2-7b", global_batch=32), dict(dp=8, zero_stage=1)),
    "gpt3-13b-3d-sp": (dict(model="gpt3-13b", global_batch=32, gpus=16),
                       dict(dp=2, tp=4, pp=2, sequence_parallel=True, recompute="selective")),
    "gpt3-13b-interleaved": (dict(model="gpt3-13b", global_batch=32, flash_attention=False),
                             dict(tp=2, pp=4, vpp=2, recompute="selective")),
    "llama3-8b-gpipe": (dict(model="llama3-8b", global_batch=16, gpus=4), dict(pp=4, schedule="gpipe")),
    "gpt-22b-full": (dict(model="gpt-22b", global_batch=8, flash_attention=False),
                     dict(tp=8, micro_batch_size=4, recompute="full")),
    "mixtral-ep-zero3": (dict(model="mixtral-8x7b", global_batch=16, seq_len=4096, gpus=16),
                         dict(dp=4, tp=2, pp=2, ep=4, zero_stage=3)),
    "llama2-7b-zero2-2nodes": (dict(model="llama2-7b", global_batch=64, gpus=16), dict(dp=16, zero_stage=2)),
    "llama3-8b-cp2-tp2-zero3": (dict(model="llama3-8b", global_batch=8, seq_len=16384),
                                dict(dp=2, cp=2, tp=2, zero_stage=3, sequence_parallel=True)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    prob_kw, strat_kw = CASES[request.param]
    prob = problem(**prob_kw)
    s = strategy(prob, **strat_kw)
    return prob, s, estimate(prob, s)


# ------------------------------------------------------------------ consistency
def test_time_breakdown_sums_to_step_time(case):
    _, _, e = case
    parts = dataclasses.astuple(e.time)
    assert sum(parts) == pytest.approx(e.step_time_s, rel=1e-12)
    assert all(p >= 0 for p in parts)


def test_memory_breakdown_is_the_peak(case):
    _, s, e = case
    assert e.memory.total_bytes == pytest.approx(e.peak_memory_bytes, rel=1e-12)
    assert sum(dataclasses.astuple(e.memory)) == pytest.approx(e.peak_memory_bytes, rel=1e-12)
    assert e.peak_memory_bytes == max(e.rank_memory_bytes) == e.rank_memory_bytes[e.peak_memory_rank]
    assert len(e.rank_memory_bytes) == len(e.rank_time_s) == s.pp
    assert e.memory.runtime_reserve_bytes == GIB


def test_bottleneck_is_the_slowest_rank(case):
    _, _, e = case
    assert e.rank_time_s[e.bottleneck_rank] == max(e.rank_time_s)


def test_throughput_and_utilisation(case):
    prob, s, e = case
    t, m = prob.training, prob.model
    assert e.tokens_per_s == pytest.approx(t.global_batch * t.seq_len / e.step_time_s, rel=1e-12)
    if m.is_gpt:  # Korthikanti eq. 7, by hand
        B, sq, L, h, V = t.global_batch, t.seq_len, m.num_hidden_layers, m.hidden_size, m.vocab_size
        flops = 72 * B * sq * L * h**2 * (1 + sq / (6 * h) + V / (12 * h * L))
    else:
        flops = model_flops_per_step(m, t.global_batch, t.seq_len)
    gpus = s.dp * s.cp * s.tp * s.pp
    assert e.mfu == pytest.approx(flops / e.step_time_s / gpus / A100_PEAK_BF16, rel=1e-9)
    assert e.tflops_per_gpu == pytest.approx(flops / e.step_time_s / gpus / 1e12, rel=1e-9)
    assert 0 < e.mfu < 1
    if all(st.full_recompute_layers == 0 for st in s.stages) and (
            t.flash_attention or all(st.selective_recompute_layers == 0 for st in s.stages)):
        assert e.hfu == e.mfu
    else:
        assert e.hfu > e.mfu


def test_estimate_needs_stages():
    prob = problem()
    with pytest.raises(ValueError, match="stages"):
        estimate(prob, Strategy(dp=1, tp=1, pp=1, micro_batch_size=1, num_microbatches=8))


def test_units_can_be_passed_in():
    prob = problem("gpt3-13b", global_batch=16)
    s = strategy(prob, tp=2, pp=2)
    assert estimate(prob, s, unit_costs(prob, s)) == estimate(prob, s)


# ------------------------------------------------------------------ HFU
def test_full_recompute_hfu_is_narayanan_eq3():
    prob = problem("gpt-22b", global_batch=4, flash_attention=False)
    e, _, _ = run(prob, tp=8, micro_batch_size=4, recompute="full")
    B, s, L, h, V = 4, 2048, 48, 6144, 51200
    eq7 = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L))
    eq3 = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * h * L))  # Narayanan et al. 2021 eq. 3
    assert e.hfu / e.mfu == pytest.approx(eq3 / eq7, rel=1e-9)


def test_selective_recompute_hfu_adds_one_attention_forward():
    # Korthikanti eq. 8: 12 s^2 h per selectively recomputed layer and sequence, s/(6h)
    # in eq. 7's units.
    prob = problem("gpt-22b", global_batch=4, flash_attention=False)
    e, _, s = run(prob, tp=8, micro_batch_size=4, recompute="selective", sequence_parallel=True)
    B, sq, L, h, V = 4, 2048, 48, 6144, 51200
    eq7 = 72 * B * sq * L * h**2 * (1 + sq / (6 * h) + V / (12 * h * L))
    extra = B * L * 12 * sq * sq * h
    assert recompute_flops(prob, s) == extra
    assert e.hfu / e.mfu == pytest.approx((eq7 + extra) / eq7, rel=1e-9)
    assert e.hfu / e.mfu == pytest.approx(
        (1 + sq / (6 * h) + sq / (6 * h) + V / (12 * h * L)) / (1 + sq / (6 * h) + V / (12 * h * L)), rel=1e-9)


def test_selective_recompute_hfu_is_korthikanti_eq8():
    prob = problem("gpt-22b", global_batch=4, flash_attention=False)
    e, _, _ = run(prob, tp=8, micro_batch_size=4, recompute="selective", sequence_parallel=True)
    s, L, h, V = 2048, 48, 6144, 51200
    eq8_over_eq7 = (1 + s / (3 * h) + V / (12 * h * L)) / (1 + s / (6 * h) + V / (12 * h * L))
    assert eq8_over_eq7 == pytest.approx(43.7 / 41.5, rel=2e-3)  # the published HFU / MFU of Table 5
    assert e.hfu / e.mfu == pytest.approx(eq8_over_eq7, rel=1e-3)


def test_selective_recompute_with_flash_is_free():
    prob = problem("gpt-22b", global_batch=4, flash_attention=True)
    e, u, s = run(prob, tp=8, micro_batch_size=4, recompute="selective")
    assert recompute_flops(prob, s) == 0 and e.hfu == e.mfu
    assert u.layer_work["selective"] == u.layer_work["none"]


# ------------------------------------------------------------------ unit costs by hand
def test_tensor_parallel_collectives_of_a_22b_layer():
    prob = problem("gpt-22b", global_batch=4, flash_attention=False)
    u = unit_costs(prob, strategy(prob, tp=8, micro_batch_size=4))
    u_sp = unit_costs(prob, strategy(prob, tp=8, micro_batch_size=4, sequence_parallel=True))
    gemm = layer_compute(prob.model, prob.cluster, prob.training, 4, 8, False).gemm_s
    message = 2 * 4 * 2048 * 6144  # b*s*h 16-bit values
    ar = ring_all_reduce(message, 8, NVLINK_BW, NVLINK_LAT)
    ag = ring_gather(message, 8, NVLINK_BW, NVLINK_LAT)
    # two all-reduces forward, two backward overlapped with the weight-gradient GEMMs
    assert u.layer_work["none"].tp_comm_s == pytest.approx(2 * ar + max(0.0, 2 * ar - gemm), rel=1e-12)
    # SP: all-gather + reduce-scatter twice each way, plus two exposed re-gathers in backward
    assert u_sp.layer_work["none"].tp_comm_s == pytest.approx(
        2 * (ag + ag) + max(0.0, 2 * (ag + ag) - gemm) + 2 * ag, rel=1e-12)
    assert u.layer_backward_s == pytest.approx(u.layer_work["none"].compute_s * 2 / 3 + max(0.0, 2 * ar - gemm))


def test_context_parallel_collectives_and_states_of_a_llama_layer():
    # cp 2 over tp 2 on one DGX node: each layer all-gathers K and V of the whole
    # sequence (b*s*2kv/tp 16-bit values, one collective) forward and reduce-scatters their
    # gradients backward, exposed; full recompute gathers them again. ZeRO-3 shards over
    # dp x cp.
    prob = problem("llama3-8b", global_batch=8, seq_len=16384)
    s = strategy(prob, dp=2, cp=2, tp=2, zero_stage=3)
    u = unit_costs(prob, s)
    kv_bytes = 2 * 1 * 16384 * 2 * 1024 / 2
    gather = ring_gather(kv_bytes, 2, NVLINK_BW, NVLINK_LAT)   # a reduce-scatter costs the same
    assert u.layer_work["none"].cp_comm_s == pytest.approx(2 * gather, rel=1e-12)
    assert u.layer_work["full"].cp_comm_s == pytest.approx(3 * gather, rel=1e-12)
    # Every other per-token figure is the rank's 8192 tokens: the TP all-reduce of b*s/cp*h.
    plain = unit_costs(prob, strategy(prob, dp=4, tp=2, zero_stage=3))
    assert u.p2p_bytes == plain.p2p_bytes / 2
    assert groups(prob, s)["dp"].size == 4 and groups(prob, s)["cp"].size == 2
    e, e_dp = estimate(prob, s), estimate(prob, strategy(prob, dp=4, tp=2, zero_stage=3))
    # Same weight replicas (dp x cp = 4): the same sharded states per rank.
    assert (e.memory.weights_bytes, e.memory.optimizer_bytes) == (e_dp.memory.weights_bytes, e_dp.memory.optimizer_bytes)
    assert e.time.cp_comm_s == pytest.approx(u.layer_work["none"].cp_comm_s * 32 * s.num_microbatches, rel=1e-9)


def test_layer_work_by_recompute_mode():
    prob = problem("gpt-22b", global_batch=4, flash_attention=False)
    lc = layer_compute(prob.model, prob.cluster, prob.training, 4, 8, False)
    u = unit_costs(prob, strategy(prob, tp=8, micro_batch_size=4))
    none, sel, full = u.layer_work["none"], u.layer_work["selective"], u.layer_work["full"]
    assert none.compute_s == pytest.approx(3 * lc.forward_s, rel=1e-12)  # backward = 2x forward
    assert sel == none + Work(recompute_s=lc.attention_core_s)
    tp_fwd = 2 * ring_all_reduce(2 * 4 * 2048 * 6144, 8, NVLINK_BW, NVLINK_LAT)
    assert full.recompute_s == pytest.approx(lc.forward_s, rel=1e-12)
    assert full.tp_comm_s == pytest.approx(none.tp_comm_s + tp_fwd, rel=1e-12)
    assert u.layer_activation_bytes["none"] == layer_activation_bytes(prob.model, prob.training, 4, 8, False, "none")


def test_work_arithmetic():
    a = Work(1, 2, 3, 4, 5, 6)
    assert a.total_s == 21
    assert a + a == a.scaled(2) == Work(2, 4, 6, 8, 10, 12)


def test_groups_placement():
    prob = problem("llama2-7b", global_batch=64, gpus=64)
    g = groups(prob, Strategy(dp=4, tp=4, pp=4, ep=2, micro_batch_size=1, num_microbatches=16))
    assert (g["tp"].size, g["tp"].per_node, g["tp"].nodes) == (4, 4, 1)
    assert (g["dp"].size, g["dp"].per_node, g["dp"].nodes) == (4, 2, 2)        # stride 4 on 8-GPU nodes
    assert (g["ep"].size, g["ep"].per_node) == (2, 2)
    assert (g["expert_dp"].size, g["expert_dp"].per_node, g["expert_dp"].nodes) == (2, 1, 2)  # stride 8
    assert (g["pp"].size, g["pp"].per_node, g["pp"].nodes) == (4, 1, 4)        # stride tp*dp = 16
    assert (g["pp_ends"].size, g["pp_ends"].nodes) == (2, 2)
    assert groups(prob, Strategy(dp=1, tp=1, pp=1, micro_batch_size=1, num_microbatches=1))["pp"].size == 1


def test_p2p_sends_and_pipeline_comm():
    prob = problem("gpt3-13b", global_batch=32, gpus=16)
    s = strategy(prob, tp=2, pp=8, vpp=2)
    assert [p2p_sends(s, r) for r in range(8)] == [3, 4, 4, 4, 4, 4, 4, 3]  # 2*vpp minus the two pipeline ends
    assert p2p_sends(strategy(prob, tp=2), 0) == 0
    u = unit_costs(prob, s)
    p2p_bytes = 2 * 1 * 2048 * 5120 / 2  # b*s*h 16-bit values, scattered over tp
    assert u.p2p_bytes == p2p_bytes
    # the 8-stage pipeline spans both nodes: the boundary over InfiniBand paces the sends
    assert u.p2p_s == pytest.approx(IB_LAT + p2p_bytes / IB_BW, rel=1e-12)
    one_node = unit_costs(problem("gpt3-13b", global_batch=32, gpus=8), strategy(problem("gpt3-13b", global_batch=32, gpus=8), tp=2, pp=4))
    assert one_node.p2p_s == pytest.approx(NVLINK_LAT + p2p_bytes / NVLINK_BW, rel=1e-12)
    e = estimate(prob, s)
    assert e.time.pp_comm_s == pytest.approx(32 * p2p_sends(s, e.bottleneck_rank) * u.p2p_s, rel=1e-12)


def test_inter_node_p2p_when_tp_fills_the_node():
    prob = problem("gpt3-13b", global_batch=32, gpus=16)
    u = unit_costs(prob, strategy(prob, tp=8, pp=2))
    p2p_bytes = 2 * 2048 * 5120 / 8
    assert u.p2p_s == pytest.approx(IB_LAT + p2p_bytes / IB_BW, rel=1e-12)


def test_rank_work_adds_embedding_and_head_to_the_end_ranks():
    prob = problem("gpt3-13b", global_batch=16)
    s = strategy(prob, pp=4)
    u = unit_costs(prob, s)
    e = estimate(prob, s)
    layers = 10 * u.layer_work["none"].total_s
    p2p = u.p2p_s
    assert e.rank_time_s[0] == pytest.approx(layers + u.first_work.total_s + 1 * p2p, rel=1e-12)
    assert e.rank_time_s[1] == pytest.approx(layers + 2 * p2p, rel=1e-12)
    assert e.rank_time_s[3] == pytest.approx(layers + u.last_work.total_s + 1 * p2p, rel=1e-12)


# ------------------------------------------------------------------ step time by hand
def test_ddp_step_time_by_hand():
    prob = problem("llama2-7b", global_batch=32)
    e, u, s = run(prob, dp=8, micro_batch_size=1)  # m = 32 / 8 = 4
    P = 6_738_415_616
    sync = ring_all_reduce(2 * P, 8, NVLINK_BW, NVLINK_LAT)  # bf16 gradients, ring over NVLink
    assert dp_sync_s(prob, u, s, 0) == pytest.approx(sync, rel=1e-9)
    optimizer = P * (28 + 16) / (A100_HBM * 0.8)
    assert optimizer_step_s(prob, u, s, 0) == pytest.approx(optimizer, rel=1e-9)
    rank = 32 * u.layer_work["none"].total_s + u.first_work.total_s + u.last_work.total_s
    assert e.rank_time_s[0] == pytest.approx(rank, rel=1e-12)
    exposed = max(0.0, sync - 32 * u.layer_backward_s)
    assert e.step_time_s == pytest.approx(4 * rank + exposed + optimizer, rel=1e-9)
    assert e.time.optimizer_s == pytest.approx(optimizer, rel=1e-9)
    assert e.time.bubble_s == pytest.approx(0.0, abs=1e-12)


def test_ddp_all_reduce_across_two_nodes():
    prob = problem("llama2-7b", global_batch=64, gpus=16)
    e, u, s = run(prob, dp=16)
    B = 2 * 6_738_415_616
    expected = ring_all_reduce(B, 8, NVLINK_BW, NVLINK_LAT) + ring_all_reduce(B / 8, 2, IB_BW, IB_LAT)
    assert dp_sync_s(prob, u, s, 0) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero12_sync_is_reduce_scatter_plus_all_gather(zero):
    prob = problem("llama2-7b", global_batch=32)
    e, u, s = run(prob, dp=8, zero_stage=zero)
    B = 2 * 6_738_415_616
    rs_ag = 2 * ring_gather(B, 8, NVLINK_BW, NVLINK_LAT)
    assert dp_sync_s(prob, u, s, 0) == pytest.approx(rs_ag, rel=1e-9)
    assert rs_ag == pytest.approx(ring_all_reduce(B, 8, NVLINK_BW, NVLINK_LAT), rel=1e-12)  # same volume
    assert optimizer_step_s(prob, u, s, 0) == pytest.approx(6_738_415_616 / 8 * 44 / (A100_HBM * 0.8), rel=1e-9)


def test_optimizer_bytes_constants():
    assert OPTIMIZER_BYTES_PER_PARAMETER == {"adam": 44, "adamw": 44, "sgd": 36}


def test_tied_embedding_sync_over_pp_counts_as_dp_comm():
    # With pp > 1 a tied embedding's gradient is all-reduced between the first and last
    # stage (Megatron-LM); the code books it under dp comm even at dp = 1.
    prob = problem("gpt3-13b", global_batch=16)
    e, u, s = run(prob, tp=2, pp=4)
    emb = 2 * 51200 * 5120 / 2
    expected = ring_all_reduce(emb, 2, NVLINK_BW, NVLINK_LAT)  # tp*dp = 2: both ends on one node
    assert dp_sync_s(prob, u, s, 0) == pytest.approx(expected, rel=1e-12)
    assert dp_sync_s(prob, u, s, 3) == pytest.approx(expected, rel=1e-12)
    assert dp_sync_s(prob, u, s, 1) == 0.0
    untied = problem("gpt3-13b", global_batch=16, overrides={"tie_word_embeddings": "false"})
    e2, u2, s2 = run(untied, tp=2, pp=4)
    assert dp_sync_s(untied, u2, s2, 0) == 0.0


def test_bubble_1f1b_and_interleaved():
    prob = problem("gpt3-13b", global_batch=32, flash_attention=False)
    e1, _, _ = run(prob, tp=2, pp=4)
    t = e1.rank_time_s
    assert e1.time.bubble_s == pytest.approx(sum(t) - max(t), rel=1e-9)
    e2, _, _ = run(prob, tp=2, pp=4, vpp=2)
    t2 = e2.rank_time_s
    assert e2.time.bubble_s == pytest.approx((sum(t2) - max(t2)) / 2, rel=1e-9)
    assert e2.time.bubble_s < e1.time.bubble_s


def test_zero_bubble_fills_the_bubble_with_weight_gradients():
    """The zero-bubble schedules (costmodel.terms.pipeline): the 1F1B bubble times a
    function of the forward and weight-gradient shares f and w of the rank times, w the
    layers' weight-gradient GEMMs (one per forward GEMM, the forward's size) and f their
    forward passes, rounded up to 1/64 (over vpp for zb-interleaved)."""
    prob = problem("gpt3-13b", global_batch=32, flash_attention=False)
    layer = layer_compute(prob.model, prob.cluster, prob.training, 1, 2, False)
    formulas = {"zb-interleaved": lambda f, b, w: max(f + b - w, b, f),
                "zbv": lambda f, b, w: max(b - w, b / 2, f - b / 2),
                "dualpipev": lambda f, b, w: max((f + 2 * b - w) / 2, f + (b - w) / 2, f)}
    for schedule, vpp in (("zb-interleaved", 1), ("zb-interleaved", 2), ("zbv", 2), ("dualpipev", 2)):
        e, _, s = run(prob, tp=2, pp=4, vpp=vpp, schedule=schedule)
        units = unit_costs(prob, s)
        t = e.rank_time_s
        layers = prob.model.num_hidden_layers
        w = layers * layer.gemm_s / sum(t)
        f = layers * units.layer_forward_s / sum(t)
        assert 0.15 < w < f < 0.4   # GEMMs are most of a layer; its backward is twice its forward
        # The forward pass: its compute and its collectives, under half of a layer.
        assert layer.forward_s < units.layer_forward_s < units.layer_work["none"].total_s / 2
        chunks = vpp if schedule == "zb-interleaved" else 1
        beta = math.ceil(formulas[schedule](f, 1 - f - w, w) / chunks * 64 - 1e-9) / 64
        assert e.time.bubble_s == pytest.approx(beta * (sum(t) - max(t)), rel=1e-9), schedule
    one, _, _ = run(prob, tp=2, pp=4)
    zb, _, _ = run(prob, tp=2, pp=4, schedule="zb-interleaved")
    assert zb.rank_time_s == one.rank_time_s
    # Deferred weight gradients hold activations longer (costmodel.terms.memory.in_flight_microbatches).
    assert all(z > o for z, o in zip(zb.rank_memory_bytes, one.rank_memory_bytes))
    assert zb.time.bubble_s < one.time.bubble_s


# ------------------------------------------------------------------ memory by hand
def test_tiny_gpt_memory_by_hand():
    prob = problem("tiny-gpt", global_batch=8)  # s 64, h 64, V 512, 4 layers, flash on
    e, _, _ = run(prob, micro_batch_size=2)
    P = total_parameters(prob.model)
    s, b, h, V, L = 64, 2, 64, 512, 4
    activations = L * s * b * h * (10 + 24) + 4 * s * b * V  # Table 2 without scores, fp32 logits
    mem = e.memory
    assert (mem.weights_bytes, mem.gradients_bytes, mem.optimizer_bytes) == (2 * P, 2 * P, 12 * P)
    assert mem.activations_bytes == pytest.approx(activations, rel=1e-12)
    assert mem.comm_buffer_bytes == 0.0
    assert e.peak_memory_bytes == pytest.approx(16 * P + activations + GIB, rel=1e-12)


def test_pipeline_rank_memory_by_hand():
    prob = problem("gpt3-13b", global_batch=16, gpus=4)  # 40 layers, h 5120, flash on
    e, u, s = run(prob, pp=4)
    sbh = 2048 * 1 * 5120
    layer_act = 34 * sbh
    dense, _ = layer_parameters(prob.model)
    emb = 51200 * 5120 + 2048 * 5120
    head = 2 * 5120 + 51200 * 5120  # final LayerNorm + the last stage's copy of the tied embedding
    buffers = 2 * (2 * sbh)          # two p2p activation buffers
    first = 16 * (10 * dense + emb) + 4 * 10 * layer_act + buffers + GIB
    last = 16 * (10 * dense + head) + 1 * (10 * layer_act + 4 * 2048 * 51200) + buffers + GIB
    middle = 16 * 10 * dense + 3 * 10 * layer_act + buffers + GIB
    assert e.rank_memory_bytes[0] == pytest.approx(first, rel=1e-12)
    assert e.rank_memory_bytes[1] == pytest.approx(middle, rel=1e-12)
    assert e.rank_memory_bytes[3] == pytest.approx(last, rel=1e-12)


def test_interleaved_rank0_memory_follows_eq5():
    prob = problem("gpt3-13b", global_batch=64, flash_attention=False)
    e, u, s = run(prob, tp=2, pp=4, vpp=5, recompute="selective")  # 20 chunks of 2 layers
    per_layer = u.layer_activation_bytes["selective"]
    in_flight = 4 + (4 - 1) / 5  # pp + (pp-1)/vpp = pp * (1 + (pp-1)/(pp*vpp))
    assert [st.index for st in s.rank_stages(0)] == [0, 4, 8, 12, 16]
    rank0 = rank_memory(prob, u, s, 0)
    assert rank0.activations_bytes == pytest.approx(in_flight * 10 * per_layer, rel=1e-12)
    assert e.peak_memory_rank == 0 and e.memory == rank0


def test_full_recompute_memory_adds_one_layer_working_set():
    # Two micro-batches: the gradients persist beside the activations (with one, the
    # peak holds a layer's larger of the two; costmodel.estimate.uniform.rank_memory).
    prob = problem("gpt-22b", global_batch=8, flash_attention=False)
    e, u, _ = run(prob, tp=8, micro_batch_size=4, recompute="full")
    sbh = 2048 * 4 * 6144
    working = sbh * (10 + 24 / 8 + 5 * 64 * 2048 / (6144 * 8))  # one layer's full activations
    logits = 4 * 2048 * 4 * 51200 / 8
    assert e.memory.activations_bytes == pytest.approx(48 * 2 * sbh + logits + working, rel=1e-12)


@pytest.mark.parametrize("model, gpus, tp", [("gpt3-13b", 4, 1), ("llama2-7b", 4, 1), ("llama3-8b", 4, 1),
                                             ("gpt3-175b", 64, 8), ("tiny-gpt", 4, 1), ("tiny-llama", 4, 1)])
def test_1f1b_first_rank_holds_the_peak(model, gpus, tp):
    prob = problem(model, global_batch=32, gpus=gpus)
    pp = gpus // tp
    e, _, _ = run(prob, tp=tp, pp=pp)
    assert e.peak_memory_rank == 0
    assert e.rank_memory_bytes[0] == max(e.rank_memory_bytes)


def test_gpipe_holds_more_than_1f1b():
    prob = problem("gpt3-13b", global_batch=32, gpus=4)
    e1, u, s1 = run(prob, pp=4)
    eg, _, _ = run(prob, pp=4, schedule="gpipe")
    assert all(g >= o for g, o in zip(eg.rank_memory_bytes, e1.rank_memory_bytes))
    assert eg.peak_memory_bytes > e1.peak_memory_bytes
    # rank 1 holds m = 32 micro-batches under GPipe, pp - 1 = 3 under 1F1B
    extra = (32 - 3) * 10 * u.layer_activation_bytes["none"]
    assert eg.rank_memory_bytes[1] - e1.rank_memory_bytes[1] == pytest.approx(extra, rel=1e-9)
    assert eg.step_time_s == pytest.approx(e1.step_time_s, rel=1e-12)  # same time formula


def test_zero_stages_strictly_reduce_memory():
    prob = problem("llama2-7b", global_batch=32)
    es = [run(prob, dp=8, zero_stage=z)[0] for z in range(4)]
    peaks = [e.peak_memory_bytes for e in es]
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3]
    P, dp = 6_738_415_616, 8
    layer = layer_parameters(prob.model)[0]
    assert peaks[0] - peaks[1] == pytest.approx(12 * P * (1 - 1 / dp), rel=1e-9)
    assert peaks[1] - peaks[2] == pytest.approx(2 * P * (1 - 1 / dp), rel=1e-9)
    # ZeRO-3 shards the weights but holds FSDP2's buffers instead of two DDP buckets: a
    # layer's unsharded weights, an all-gather output and a reduce-scatter input, and the
    # layer's unsharded gradients (costmodel.estimate.uniform.rank_memory)
    assert peaks[2] - peaks[3] == pytest.approx(2 * P * (1 - 1 / dp) - (4 * 2 * layer - 2 * 25 * MIB), rel=1e-9)
    assert es[3].memory.comm_buffer_bytes == 3 * 2 * layer
    assert es[3].memory.temporary_bytes == 2 * layer
    assert es[0].memory.comm_buffer_bytes == 2 * 25 * MIB


def test_zero3_can_cost_memory_with_one_layer_per_rank():
    # Documented behaviour, not a claim of the paper: with one layer per pipeline rank
    # FSDP2's buffers outweigh the sharded weights (4*2*layer > 2*layer*(1 - 1/dp)).
    prob = problem("gpt3-13b", global_batch=80, gpus=80)  # 10 nodes of 8
    e2, u, _ = run(prob, dp=2, pp=40, zero_stage=2)
    e3, _, _ = run(prob, dp=2, pp=40, zero_stage=3)
    layer = u.layer_dense_parameters
    r = 20  # a middle rank: one layer, no embedding
    assert e3.rank_memory_bytes[r] - e2.rank_memory_bytes[r] == pytest.approx(
        4 * 2 * layer - 2 * 25 * MIB - 2 * layer * (1 - 1 / 2), rel=1e-9)
    assert e3.rank_memory_bytes[r] > e2.rank_memory_bytes[r]


def test_sequence_parallel_reduces_activation_memory():
    prob = problem("gpt3-13b", global_batch=8)
    off, _, _ = run(prob, tp=4)
    on, _, _ = run(prob, tp=4, sequence_parallel=True)
    sbh = 2048 * 5120
    # per layer sbh(10 + 24/4) -> sbh(34/4), 40 layers; logits unchanged
    assert off.memory.activations_bytes - on.memory.activations_bytes == pytest.approx(
        40 * sbh * (10 + 24 / 4 - 34 / 4), rel=1e-9)
    assert on.peak_memory_bytes < off.peak_memory_bytes


# ------------------------------------------------------------------ zero comm at degree 1
@pytest.mark.parametrize("model, seq", [("tiny-gpt", 64), ("llama2-7b", 2048), ("mixtral-8x7b", 2048)])
def test_no_tp_comm_at_tp1(model, seq):
    prob = problem(model, global_batch=8, seq_len=seq, gpus=4)
    e, u, _ = run(prob, pp=2, dp=2, sequence_parallel=True)
    assert e.time.tp_comm_s == 0.0
    assert all(w.tp_comm_s == 0.0 for w in u.layer_work.values())
    assert u.first_work.tp_comm_s == u.last_work.tp_comm_s == 0.0


def test_no_pp_comm_at_pp1():
    prob = problem("gpt3-13b", global_batch=8)
    e, u, _ = run(prob, tp=8, dp=1)
    assert e.time.pp_comm_s == 0.0 and u.p2p_s == 0.0
    assert e.memory.comm_buffer_bytes == 0.0


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_no_dp_comm_at_dp1(zero):
    prob = problem("llama2-7b", global_batch=8)
    e, u, s = run(prob, tp=8, zero_stage=zero)
    assert e.time.dp_comm_s == 0.0 and dp_sync_s(prob, u, s, 0) == 0.0
    assert all(w.dp_comm_s == 0.0 for w in u.layer_work.values())


def test_moe_all_to_all_by_hand():
    prob = problem("mixtral-8x7b", global_batch=8, seq_len=4096)
    u = unit_costs(prob, strategy(prob, dp=8, ep=8, micro_batch_size=1))
    message = 2 * 1 * 4096 * 4096 * 2  # b*s*h 16-bit values, k = 2 copies
    a2a = (8 - 1) / 8 * message / NVLINK_BW + 7 * NVLINK_LAT
    assert u.layer_work["none"].ep_comm_s == pytest.approx(2 * (2 * a2a), rel=1e-12)  # dispatch+combine, fwd+bwd
    assert u.layer_expert_parameters == 8 * 3 * 4096 * 14336 / 8
    assert unit_costs(prob, strategy(prob, dp=8, ep=1)).layer_work["none"].ep_comm_s == 0.0


def test_paired_chunks_hide_the_expert_exchange():
    # dualpipev pairs one micro-batch's forward with another's backward: where the runtime
    # overlaps them, the pair's computation hides the exchange in the paired share of chunks.
    prob = problem("mixtral-8x7b", global_batch=64, seq_len=4096, gpus=16)
    s = strategy(prob, dp=8, pp=2, vpp=2, ep=8, schedule="dualpipev", recompute="full")
    exposed = unit_costs(prob, s).layer_work
    hidden = unit_costs(dataclasses.replace(prob, runtime=dataclasses.replace(prob.runtime, ep_overlap=1.0)),
                        s).layer_work
    share = (2 * 8 - 3 * 2 + 1) / (2 * 8)   # rank 0's OVERLAP_F_B actions of its 16 forward chunks
    # What hides costs the SMs the exchange holds meanwhile: 20 of 132 (DeepSeek-V3 §3.2.2).
    kept = 1 - 20 / 132
    two, compute_s = exposed["none"].ep_comm_s, exposed["none"].compute_s
    assert hidden["none"].ep_comm_s == pytest.approx(two - kept * share * min(two, compute_s), rel=1e-12)
    three, forward_s = 1.5 * two, exposed["full"].recompute_s
    assert hidden["full"].ep_comm_s == pytest.approx(three - kept * share * min(three, compute_s + forward_s),
                                                     rel=1e-12)
    assert hidden["none"].compute_s == compute_s
    one_f_one_b = strategy(prob, dp=8, pp=2, ep=8)
    assert unit_costs(dataclasses.replace(prob, runtime=dataclasses.replace(prob.runtime, ep_overlap=1.0)),
                      one_f_one_b).layer_work["none"].ep_comm_s == pytest.approx(two, rel=1e-12)


def test_the_loss_and_mtp_modules_are_held_as_the_last_stage_runs_them():
    # dualpipev puts the last stage on rank 0 beside the first and runs its backward right
    # after its forward (memory.loss_microbatches_held: 1), while rank 0's first stage
    # holds min(m, 2 pp) = 4 micro-batches: an MTP module adds one plain layer's
    # activations and one more head's logits, once.
    def rank0(mtp: str):
        prob = problem("tiny-deepseek", cluster="dgx-h100", global_batch=32, seq_len=64, gpus=8,
                       overrides={"num_nextn_predict_layers": mtp})
        s = strategy(prob, dp=4, pp=2, vpp=2, ep=4, schedule="dualpipev")
        u = unit_costs(prob, s)
        return rank_memory(prob, u, s, 0).activations_bytes, u

    (without, u0), (with_mtp, u1) = rank0("0"), rank0("1")
    assert u1.logits_bytes == 2 * u0.logits_bytes
    assert with_mtp - without == pytest.approx(u1.layer_activation_bytes["none"] + u0.logits_bytes, rel=1e-12)


# ------------------------------------------------------------------ calibration
TABLE4 = {  # Korthikanti et al. 2022 Table 4: one 22B layer, mbs 4, tp 8, total ms
    ("none", False): 19.6, ("none", True): 19.0, ("full", False): 27.2,
    ("selective", False): 20.9, ("selective", True): 20.3,
}


@pytest.mark.parametrize("mode, sp", sorted(TABLE4))
def test_korthikanti_table4_one_layer(mode, sp):
    # Megatron-LM ran Table 4: priced under its runtime profile
    prob = problem("gpt-22b", global_batch=4, seq_len=2048, flash_attention=False, runtime="megatron")
    u = unit_costs(prob, strategy(prob, tp=8, micro_batch_size=4, sequence_parallel=sp))
    ms = u.layer_work[mode].total_s * 1e3
    assert ms == pytest.approx(TABLE4[(mode, sp)], rel=0.10)


def test_korthikanti_table4_baseline_is_19_6_ms():
    mm = load_model("gpt-22b")
    cc = load_cluster("dgx-a100-80gb")
    tt = make_training(mm, cc, 4, 2048, flash_attention=False)
    s = Strategy(dp=1, tp=8, pp=1, micro_batch_size=4, num_microbatches=1)
    total = unit_costs(Problem(mm, cc, tt, runtime=load_runtime("megatron")), s).layer_work["none"].total_s
    assert total == pytest.approx(19.6e-3, rel=0.10)


CALIBRATION_NAMES = {"22B": "gpt-22b", "175B (GPT-3)": "gpt3-175b", "530B (MT-NLG)": "gpt-530b", "1T": "gpt-1t"}


def calibration_rows():
    if not CALIBRATION_FILE.exists():
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"{CALIBRATION_FILE} not present (clean clone)"))]
    return [pytest.param(r, id=r["id"]) for r in load_calibration_runs()]


def calibration_estimate(r):
    mm = load_model(CALIBRATION_NAMES[r["model"]["name"]])
    cc = load_cluster("dgx-a100-80gb", gpus=r["gpus"])
    tt = make_training(mm, cc, r["global_batch"], 2048, flash_attention=False)
    v = r["interleaved_pipeline"].get("model_chunks_per_rank", 1) if r["interleaved_pipeline"]["used"] else 1
    s = Strategy(dp=1, tp=8, pp=r["pp"], vpp=v, micro_batch_size=r["micro_batch"],
                 num_microbatches=r["num_microbatches"], schedule="interleaved" if v > 1 else "1f1b",
                 sequence_parallel=r["sequence_parallel"])
    s = s.with_stages(even_stages(mm.num_hidden_layers, r["pp"], v, r["activation_recompute"]))
    prob = Problem(mm, cc, tt, runtime=load_runtime("megatron"))   # Megatron-LM ran Table 5
    return prob, s, estimate(prob, s)


def test_calibration_file_has_eight_rows():
    if not CALIBRATION_FILE.exists():
        pytest.skip(f"{CALIBRATION_FILE} not present (clean clone)")
    runs = load_calibration_runs()
    assert len(runs) == 8
    assert {r["model"]["name"] for r in runs} == set(CALIBRATION_NAMES)


@pytest.mark.parametrize("row", calibration_rows())
def test_korthikanti_table5_iteration_time_within_10_percent(row):
    prob, s, e = calibration_estimate(row)
    assert s.num_gpus == row["gpus"] and s.dp * s.micro_batch_size * s.num_microbatches == row["global_batch"]
    assert e.step_time_s == pytest.approx(row["measured"]["iteration_time_s"], rel=0.10)
    if row["mfu"] is not None:
        assert e.mfu == pytest.approx(row["mfu"], rel=0.10)


@pytest.mark.parametrize("row", calibration_rows())
def test_model_flops_match_the_papers_derived_tflops(row):
    # eq. 7 over the measured time reproduces the file's derived model TFLOP/s per GPU (1 decimal)
    m = load_model(CALIBRATION_NAMES[row["model"]["name"]])
    flops = model_flops_per_step(m, row["global_batch"], row["seq_len"])
    tflops = flops / (row["gpus"] * row["measured"]["iteration_time_s"]) / 1e12
    assert tflops == pytest.approx(row["derived_not_published"]["model_tflops_per_gpu"], abs=0.051)


# ------------------------------------------------------------------ known problems (strict xfail)
def test_zero3_dp_comm_grows_with_the_vocabulary():
    def dp_comm(zero, vocab):
        prob = problem("llama2-7b", global_batch=64, seq_len=4096, gpus=64,
                       overrides={"vocab_size": str(vocab)})
        return run(prob, dp=8, tp=8, zero_stage=zero)[0].time.dp_comm_s
    # positive control: ZeRO-2 syncs the embedding and head gradients, so its dp comm grows
    assert dp_comm(2, 256000) > dp_comm(2, 32000)
    assert dp_comm(3, 256000) > dp_comm(3, 32000)


def test_pipeline_across_nodes_uses_the_inter_node_link():
    base = load_cluster("dgx-a100-80gb", gpus=16)
    slow = dataclasses.replace(base, inter_node=dataclasses.replace(base.inter_node, bandwidth_bytes_per_s=1e9))
    times = []
    for cluster in (base, slow):
        prob = problem("gpt3-13b", cluster=cluster, global_batch=16)
        times.append(run(prob, tp=4, pp=4)[0].step_time_s)  # dp 1: the only off-node traffic is p2p
    assert times[1] > times[0]


def test_cpu_ranks_hide_no_communication_and_zero3_pays_fsdp_copies():
    # configs/clusters/cpu.yaml: comm_overlap 0; all-gather 1.1e9 B/s + 180 us,
    # reduce-scatter 6.5e8 B/s + 280 us (2 ranks); hardware: FSDP2's measured host time,
    # 2.6e-10 s per unit byte a gather and 6.1e-10 a reduce-scatter.
    spec = load_model("tiny-llama")
    cpu = load_cluster("cpu", gpus=2)
    prob = Problem(spec, cpu, make_training(spec, cpu, 8, 16, precision="fp32"))
    zero3 = Strategy(dp=2, tp=1, pp=1, micro_batch_size=4, num_microbatches=1, zero_stage=3,
                     stages=even_stages(4, 1))
    u = unit_costs(prob, zero3)
    full = layer_parameters(spec)[0] * 4
    gather = full / 2 / 1.1e9 + 1.8e-4 + 2.6e-10 * full
    scatter = full / 2 / 6.5e8 + 2.8e-4 + 6.1e-10 * full
    assert u.layer_work["none"].dp_comm_s == pytest.approx(2 * gather + scatter, rel=1e-9)
    assert u.layer_backward_s == 0.0   # no window for DDP's all-reduce to hide in
    ddp = dataclasses.replace(zero3, zero_stage=0)
    e = estimate(prob, ddp)
    assert e.time.dp_comm_s == pytest.approx(dp_sync_s(prob, unit_costs(prob, ddp), ddp, 0), rel=1e-12)


HOST = HostOverheads(tp_layer_s=5e-3, tp_layer_s_per_byte=2e-9, sp_layer_s=1e-3,
                     fsdp_gather_s_per_byte=0.5e-9, fsdp_reduce_s_per_byte=0.25e-9)


def with_host(prob: Problem, host: HostOverheads | None = HOST) -> Problem:
    """The problem on the same cluster with these host overheads (None: a GPU's)."""
    gpu = dataclasses.replace(prob.cluster.gpu, host_overheads=host)
    return dataclasses.replace(prob, cluster=dataclasses.replace(prob.cluster, gpu=gpu))


@pytest.mark.parametrize("sp", [False, True])
def test_dtensor_host_time_per_layer(sp):
    prob = with_host(problem("tiny-gpt", cluster="cpu", global_batch=8, precision="fp32", gpus=2), None)
    s = strategy(prob, tp=2, micro_batch_size=8, sequence_parallel=sp)
    plain, host = unit_costs(prob, s), unit_costs(with_host(prob), s)
    message = 4 * 8 * prob.training.seq_len * prob.model.hidden_size   # b*s*h fp32 values
    layer = 5e-3 + 2e-9 * message + (1e-3 if sp else 0.0)
    assert host.layer_work["none"].tp_comm_s - plain.layer_work["none"].tp_comm_s == pytest.approx(layer, rel=1e-9)
    # Full recompute repeats the forward's third.
    assert (host.layer_work["full"].tp_comm_s - plain.layer_work["full"].tp_comm_s
            == pytest.approx(layer * 4 / 3, rel=1e-9))
    # Nothing without tensor parallelism.
    dp = strategy(prob, dp=2, micro_batch_size=4)
    assert unit_costs(with_host(prob), dp).layer_work == unit_costs(prob, dp).layer_work


def test_fsdp_host_time_replaces_the_modelled_copies():
    prob = with_host(problem("tiny-gpt", cluster="cpu", global_batch=8, precision="fp32", gpus=2), None)
    layer_bytes = 4 * layer_parameters(prob.model)[0]
    z3 = strategy(prob, dp=2, micro_batch_size=4, zero_stage=3)
    plain, host = unit_costs(prob, z3), unit_costs(with_host(prob), z3)
    modelled_copy = compute.memory_bound_time_s(2 * layer_bytes * 1.5, prob.cluster)
    # Per layer: a gather forward, a gather and a reduce-scatter backward.
    assert (host.layer_work["none"].dp_comm_s - plain.layer_work["none"].dp_comm_s
            == pytest.approx(3 * (-modelled_copy) + 2 * 0.5e-9 * layer_bytes + 0.25e-9 * layer_bytes, rel=1e-9))
    # ZeRO-2 is FSDP2 in the executor: the copies once a step, with the end-of-step sync.
    z2 = strategy(prob, dp=2, micro_batch_size=4, zero_stage=2)
    params = sum(rank_parameters(unit_costs(prob, z2), z2, 0))
    assert (dp_sync_s(with_host(prob), unit_costs(with_host(prob), z2), z2, 0) - dp_sync_s(prob, unit_costs(prob, z2), z2, 0)
            == pytest.approx(0.75e-9 * 4 * params, rel=1e-9))


@pytest.mark.parametrize("kept", ["none", "head", "root"])
def test_fsdp_units_kept_gathered_after_forward(kept):
    # torchtitan keeps its head unit ("head", 0.3 under fsdp_reshard_after_forward
    # "default") or its root unit with the last layer ("root", 2024) gathered after
    # forward: at the loss, which is this plan's peak (F.cross_entropy over upcast
    # logits), their 16-bit copies are held beside the activations.
    runtime = dataclasses.replace(load_runtime(), chunked_loss=False, fsdp_kept_gathered=kept)
    prob = problem("llama3-8b", cluster="dgx-h100", global_batch=16, seq_len=8192, gpus=8,
                   mixed_precision="param_dtype", runtime=runtime)
    s = strategy(prob, dp=8, micro_batch_size=2, zero_stage=3, recompute="selective")
    u = unit_costs(prob, s)
    layer, first, last = u.layer_dense_parameters, u.first_parameters, u.last_parameters
    fsdp = fsdp_units(prob, u, s)
    expected = {"none": FsdpUnits(max(layer, first, last), 0.0, 0.0, 0.0),
                "head": FsdpUnits(max(layer, first, last), 0.0, 0.0, last),
                "root": FsdpUnits(layer, first + last, last, first + last + layer)}[kept]
    assert fsdp == expected
    peak = rank_memory(prob, u, s, 0)
    assert peak.comm_buffer_bytes == 2 * expected.at_loss          # bf16 copies (param_dtype)
    assert peak.activations_bytes > 32 * u.layer_activation_bytes["selective"]   # the loss's peak
    # The reserved pools of FSDP2's streams: the fp32 sharded gradients, and the bf16
    # all-gather outputs of two cycled units or of the root unit and a layer.
    assert fsdp_stream_pool_bytes(prob, u, s, 0) == pytest.approx(
        total_parameters(prob.model) * 4 / 8 + 2 * max(2 * fsdp.largest_cycled, fsdp.held + fsdp.largest_cycled))


def test_fsdp_units_of_a_pipeline_rank_are_cycled():
    runtime = dataclasses.replace(load_runtime(), fsdp_kept_gathered="root")
    prob = problem("llama3-8b", cluster="dgx-h100", global_batch=16, seq_len=8192, gpus=16,
                   mixed_precision="param_dtype", runtime=runtime)
    s = strategy(prob, dp=8, pp=2, micro_batch_size=1, num_microbatches=2, zero_stage=3)
    u = unit_costs(prob, s)
    assert fsdp_units(prob, u, s).held == fsdp_units(prob, u, s).at_loss == 0.0


def test_fsdp_prefetch_and_ddp_buckets_are_the_runtimes():
    # Each FSDP2 unit gathered ahead holds its all-gather output (16-bit under
    # param_dtype); DDP holds two buckets of the runtime's size.
    base = load_runtime()
    prob = problem("llama2-7b", global_batch=64, seq_len=4096, gpus=8, mixed_precision="param_dtype", runtime=base)
    deeper = dataclasses.replace(prob, runtime=dataclasses.replace(base, fsdp_prefetch=3))
    s = strategy(prob, dp=8, micro_batch_size=1, zero_stage=3, recompute="full")
    u = unit_costs(prob, s)
    largest = fsdp_units(prob, u, s).largest_cycled
    assert (rank_memory(deeper, u, s, 0).comm_buffer_bytes - rank_memory(prob, u, s, 0).comm_buffer_bytes
            == pytest.approx(2 * 2 * largest, rel=1e-12))
    ddp = strategy(prob, dp=8, micro_batch_size=1, recompute="full")
    wide = dataclasses.replace(prob, runtime=dataclasses.replace(base, ddp_bucket_mb=100))
    assert rank_memory(prob, unit_costs(prob, ddp), ddp, 0).comm_buffer_bytes == 2 * 25 * MIB
    assert rank_memory(wide, unit_costs(wide, ddp), ddp, 0).comm_buffer_bytes == 2 * 100 * MIB


def test_dense_first_layers_and_mtp_are_held_where_the_stages_put_them():
    """tiny-deepseek (2 dense first layers of 6, one MTP module) over pp 2, three layers a
    stage: rank 0 holds both dense layers and one sparse layer, rank 1 three sparse layers,
    the MTP module's sparse layer and projection, and the head. Parameters and activations
    by kind of layer; the recomputed dense layers repeat the dense layer's forward FLOPs."""
    from costmodel.terms.counts import layer_forward_flops, mtp_projection_parameters

    m = load_model("tiny-deepseek")
    c = load_cluster("dgx-a100-80gb", gpus=4)
    p = Problem(m, c, make_training(m, c, 8, 64))
    s = Strategy(dp=2, tp=1, pp=2, micro_batch_size=1, num_microbatches=4, ep=2, zero_stage=1,
                 recompute="full").with_stages(even_stages(6, 2, 1, "full"))
    units = unit_costs(p, s)
    dense_layer = sum(layer_parameters(m.dense_layer()))
    sparse_dense, experts = layer_parameters(m)
    embedding, head = 512 * 64, 64 + 512 * 64
    assert rank_parameters(units, s, 0) == (2 * dense_layer + sparse_dense + embedding, experts / 2)
    assert rank_parameters(units, s, 1) == (4 * sparse_dense + head + mtp_projection_parameters(m), 4 * experts / 2)
    assert units.dense.layer_activation_bytes["full"] == units.layer_activation_bytes["full"]   # the input alone
    assert units.dense.layer_activation_bytes["none"] != units.layer_activation_bytes["none"]
    flops = 8 * (2 * layer_forward_flops(m.dense_layer(), 64) + 4 * layer_forward_flops(m, 64))
    assert recompute_flops(p, s) == pytest.approx(flops, rel=1e-12)


def test_moe_parallel_folding_by_hand():
    # Whole experts under tp (Strategy.etp 1, MoE parallel folding): the ep group takes
    # tp ranks, the experts are split over ep only, each tp rank routes its sequence shard
    # (no TP pair around the MoE block of a model without a shared expert), and the
    # routing's saved rows are split tp ways.
    from costmodel.estimate.step_collectives import step_collectives
    from costmodel.terms.memory import layer_activation_bytes, moe_rows_saved_bytes

    prob = problem("mixtral-8x7b", global_batch=2, seq_len=4096, gpus=8,
                   runtime=dataclasses.replace(NEUTRAL, moe_folding=True))
    whole = strategy(prob, dp=2, tp=4, ep=4, etp=1, sequence_parallel=True)
    split = strategy(prob, dp=2, tp=4, ep=2, sequence_parallel=True)
    assert (whole.edp, split.edp) == (2, 1)
    h, f, layers = 4096, 14336, 32
    assert unit_costs(prob, whole).layer_expert_parameters == 8 * 3 * h * f / 4
    assert unit_costs(prob, split).layer_expert_parameters == 8 * 3 * h * f / (4 * 2)
    message = 2 * 4096 * h   # mbs 1 x s x h, 16-bit
    tp_calls = lambda s: {(c.kind, c.bytes, c.calls) for c in step_collectives(prob, s, 0) if c.group == "tp"
                          and c.what == "layer TP (SP)"}
    # Attention's pair each way and its input gathered again in backward.
    assert tp_calls(whole) == {("all_gather", message, 3 * layers), ("reduce_scatter", message, 2 * layers)}
    # Experts split over tp 4 gather the k = 2 rows a token each rank's experts receive
    # (Megatron-Core's alltoall dispatcher over the expert tp group): 2 x message.
    assert tp_calls(split) == {("all_gather", message, 3 * layers), ("reduce_scatter", message, 2 * layers),
                               ("all_gather", 2 * message, 2 * layers), ("reduce_scatter", 2 * message, 2 * layers)}
    assert unit_costs(prob, whole).layer_work["none"].tp_comm_s < unit_costs(prob, split).layer_work["none"].tp_comm_s
    kept = {fold: layer_activation_bytes(prob.model, prob.training, 1, 4, True, "none", ep=4, fold=fold)
            for fold in (1, 4)}
    assert kept[1] - kept[4] == pytest.approx(0.75 * moe_rows_saved_bytes(prob.model, 4, 2) * 4096, rel=1e-12)
