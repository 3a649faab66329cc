"""costmodel.terms.comm: group placement and alpha-beta ring collective times (Thakur et al.
2005), hierarchical over nodes, all-to-all and point-to-point."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from costmodel_test_helpers import (
    IB_BW,
    IB_LAT,
    NEUTRAL,
    NVLINK_BW,
    NVLINK_LAT,
    problem,
    ring_all_reduce,
    ring_gather,
    strategy,
)

from costmodel.specs import LinkSpec
from costmodel.specs.loading import SpecError, load_cluster, load_model, load_runtime
from costmodel.terms.comm import (
    Placement,
    collective_time_s,
    expert_exchange_s,
    groups,
    placement,
)

MB = 1e6


@pytest.fixture(scope="module")
def dgx():
    return load_cluster("dgx-a100-80gb", gpus=64)


def test_link_achieved_bandwidth():
    assert LinkSpec(3.0e11, 5e-6, 0.62).achieved_bytes_per_s == pytest.approx(1.86e11)
    assert LinkSpec(1e9, 0.0).achieved_bytes_per_s == 1e9


# ------------------------------------------------------------------ placement
@pytest.mark.parametrize("size, stride, gpn, expected", [
    (1, 1, 8, (1, 1, 1)),
    (8, 1, 8, (8, 8, 1)),     # tp 8 fills a node
    (16, 1, 8, (16, 8, 2)),   # tp 16 spans two nodes
    (4, 2, 8, (4, 4, 1)),     # dp 4 over tp 2: ranks 0,2,4,6 share a node
    (8, 2, 8, (8, 4, 2)),     # dp 8 over tp 2: 4 per node, 2 nodes
    (4, 4, 8, (4, 2, 2)),
    (4, 8, 8, (4, 1, 4)),     # dp over tp 8: one member per node
    (3, 16, 8, (3, 1, 3)),
    (5, 1, 2, (5, 2, 3)),     # ceil(5 / 2) nodes
])
def test_placement(size, stride, gpn, expected):
    p = placement(size, stride, gpn)
    assert (p.size, p.per_node, p.nodes) == expected


# ------------------------------------------------------------------ ring collectives on one node
def test_all_reduce_on_one_node_is_the_ring_formula(dgx):
    B, n = 100 * MB, 8
    expected = 2 * (n - 1) / n * B / NVLINK_BW + 2 * (n - 1) * NVLINK_LAT
    assert collective_time_s("all_reduce", B, Placement(8, 8, 1), dgx) == pytest.approx(expected, rel=1e-12)
    # 2 * 7/8 * 1e8 / 1.86e11 = 0.9409 ms, plus 14 * 5 us = 70 us
    assert expected == pytest.approx(1.0109e-3, rel=1e-3)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_all_gather_and_reduce_scatter_on_one_node(dgx, kind):
    B, n = 64 * MB, 4
    expected = (n - 1) / n * B / NVLINK_BW + (n - 1) * NVLINK_LAT
    assert collective_time_s(kind, B, Placement(4, 4, 1), dgx) == pytest.approx(expected, rel=1e-12)


def test_reduce_scatter_plus_all_gather_equals_all_reduce_on_one_node(dgx):
    g, B = Placement(8, 8, 1), 10 * MB
    rs_ag = collective_time_s("reduce_scatter", B, g, dgx) + collective_time_s("all_gather", B, g, dgx)
    assert rs_ag == pytest.approx(collective_time_s("all_reduce", B, g, dgx), rel=1e-12)


def test_two_rank_collectives_on_cpu_cluster():
    # gloo fits (configs/clusters/cpu.yaml): all-reduce 2.3e9 B/s with 120 us per ring
    # step, all-gather 1.1e9 / 180 us, reduce-scatter 6.5e8 / 280 us, p2p 5.3e9 / 42 us.
    cpu = load_cluster("cpu")
    B, pair = 4 * MB, placement(2, 1, 2)
    assert collective_time_s("all_reduce", B, pair, cpu) == pytest.approx(B / 2.3e9 + 2 * 1.2e-4, rel=1e-12)
    assert collective_time_s("all_gather", B, pair, cpu) == pytest.approx(B / 2 / 1.1e9 + 1.8e-4, rel=1e-12)
    assert collective_time_s("reduce_scatter", B, pair, cpu) == pytest.approx(B / 2 / 6.5e8 + 2.8e-4, rel=1e-12)
    assert collective_time_s("p2p", B, pair, cpu) == pytest.approx(4.2e-5 + B / 5.3e9, rel=1e-12)
    # all-to-all has no fit of its own: the link's figures.
    assert collective_time_s("all_to_all", B, pair, cpu) == pytest.approx(B / 2 / 2.3e9 + 1.2e-4, rel=1e-12)


def test_per_collective_figures_are_validated(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("name: x\ngpu: cpu\ngpus_per_node: 2\nintra_node:\n  bandwidth_bytes_per_s: 1e9\n"
                   "  latency_s: 1e-4\n  collectives:\n    broadcast: {bandwidth_bytes_per_s: 1e9, latency_s: 0}\n")
    with pytest.raises(SpecError, match="cluster.intra_node.collectives.broadcast: unknown collective"):
        load_cluster(str(bad))


def test_trivial_groups_and_empty_buffers_cost_nothing(dgx):
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
        assert collective_time_s(kind, 1e9, Placement(1, 1, 1), dgx) == 0.0
        assert collective_time_s(kind, 0.0, Placement(8, 8, 1), dgx) == 0.0


def test_unknown_kind_raises(dgx):
    with pytest.raises(ValueError):
        collective_time_s("broadcast", 1e6, Placement(8, 8, 1), dgx)


# ------------------------------------------------------------------ hierarchical
def test_hierarchical_all_reduce(dgx):
    # 16 ranks, 8 per node, 2 nodes: NVLink all-reduce of B over 8, then each of the 8
    # drives its own NIC with B/8 in a 2-node ring.
    B = 200 * MB
    intra = ring_all_reduce(B, 8, NVLINK_BW, NVLINK_LAT)
    inter = 2 * (2 - 1) / 2 * (B / 8) / IB_BW + 2 * (2 - 1) * IB_LAT
    got = collective_time_s("all_reduce", B, Placement(16, 8, 2), dgx)
    assert got == pytest.approx(intra + inter, rel=1e-12)


def test_one_member_per_node_is_a_plain_network_ring(dgx):
    # dp 4 over tp 8: no NVLink phase (k = 1), a 4-node ring on the full buffer.
    B = 50 * MB
    expected = 2 * 3 / 4 * B / IB_BW + 2 * 3 * IB_LAT
    assert collective_time_s("all_reduce", B, Placement(4, 1, 4), dgx) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_hierarchical_gather(dgx, kind):
    B = 80 * MB  # 8 ranks, 4 per node, 2 nodes
    expected = ring_gather(B, 4, NVLINK_BW, NVLINK_LAT) + ring_gather(B / 4, 2, IB_BW, IB_LAT)
    assert collective_time_s(kind, B, Placement(8, 4, 2), dgx) == pytest.approx(expected, rel=1e-12)


def test_crossing_nodes_costs_more(dgx):
    B = 100 * MB
    assert collective_time_s("all_reduce", B, Placement(16, 8, 2), dgx) > collective_time_s(
        "all_reduce", B, Placement(8, 8, 1), dgx)


def test_groups_inside_an_nvlink_domain_that_spans_hosts_are_priced_on_nvlink():
    # GB200 NVL72: 72 GPUs in one NVLink domain over trays of 4. tp 16 x dp 4 sits in the
    # domain: tp is one NVLink ring, dp (stride 16) 4 members in it; pp 2 crosses to a
    # second rack. Without the domain the same ranks span 4 trays over the network.
    nvl72 = load_cluster("gb200-nvl72", nodes=32)
    prob = problem("llama3-70b", nvl72, global_batch=64, seq_len=4096)
    placed = groups(prob, strategy(prob, dp=4, tp=16, pp=2))
    assert (placed["tp"], placed["dp"], placed["pp"]) == (Placement(16, 16, 1), Placement(4, 4, 1), Placement(2, 1, 2))
    B = 100 * MB
    link = nvl72.intra_node
    assert collective_time_s("all_reduce", B, placed["tp"], nvl72) == pytest.approx(
        ring_all_reduce(B, 16, link.bandwidth_bytes_per_s * link.efficiency, link.latency_s), rel=1e-12)
    trays = replace(nvl72, nvlink_domain_gpus=None)
    split = groups(problem("llama3-70b", trays, global_batch=64, seq_len=4096), strategy(prob, dp=4, tp=16, pp=2))
    assert split["tp"] == Placement(16, 4, 4)
    ib = trays.inter_node
    over_trays = (ring_all_reduce(B, 4, link.bandwidth_bytes_per_s * link.efficiency, link.latency_s)
                  + ring_all_reduce(B / 4, 4, ib.bandwidth_bytes_per_s * ib.efficiency, ib.latency_s))
    assert collective_time_s("all_reduce", B, split["tp"], trays) == pytest.approx(over_trays, rel=1e-12)


# ------------------------------------------------------------------ p2p and all-to-all
def test_p2p(dgx):
    B = 25 * MB
    assert collective_time_s("p2p", B, Placement(2, 2, 1), dgx) == pytest.approx(NVLINK_LAT + B / NVLINK_BW, rel=1e-12)
    assert collective_time_s("p2p", B, Placement(2, 1, 2), dgx) == pytest.approx(IB_LAT + B / IB_BW, rel=1e-12)


def test_all_to_all_on_one_node(dgx):
    B, n = 32 * MB, 8  # B = what one rank sends in all; it keeps 1/n for itself
    expected = (n - 1) / n * B / NVLINK_BW + (n - 1) * NVLINK_LAT
    assert collective_time_s("all_to_all", B, Placement(8, 8, 1), dgx) == pytest.approx(expected, rel=1e-12)


def test_all_to_all_across_nodes(dgx):
    # The NVLink and network parts run at once (grouped send/recv): the longer one paces it.
    B, n, k = 32 * MB, 16, 8
    on_node = (k - 1) / n * B / NVLINK_BW + (k - 1) * NVLINK_LAT
    off_node = (n - k) / n * B / IB_BW + (n - k) * IB_LAT
    assert off_node > on_node
    assert collective_time_s("all_to_all", B, Placement(16, 8, 2), dgx) == pytest.approx(off_node, rel=1e-12)


# ------------------------------------------------------------------ expert exchange
def test_routed_nodes_per_token_by_hand():
    mixtral = load_model("mixtral-8x7b")   # 8 experts, top 2
    assert mixtral.routed_nodes_per_token(1) == 1.0
    # No node holds either of the two experts with chance C(6,2)/C(8,2) (2 experts a node of 4).
    assert mixtral.routed_nodes_per_token(4) == pytest.approx(4 * (1 - math.comb(6, 2) / math.comb(8, 2)), rel=1e-12)
    assert mixtral.routed_nodes_per_token(8) == pytest.approx(2.0, rel=1e-12)   # one expert a node
    deepseek = load_model("deepseek-v3")   # 256 experts, top 8 within the best 4 of 8 groups
    ungrouped = 8 * (1 - math.comb(224, 8) / math.comb(256, 8))
    grouped = 4 * (1 - math.comb(96, 8) / math.comb(128, 8))
    assert grouped < 4 < ungrouped
    assert deepseek.routed_nodes_per_token(8) == pytest.approx(grouped, rel=1e-12)
    # 16 nodes: each group straddles two, priced as ungrouped routing.
    assert deepseek.routed_nodes_per_token(16) == pytest.approx(16 * (1 - math.comb(240, 8) / math.comb(256, 8)),
                                                                rel=1e-12)


def test_routed_nodes_per_token_against_sampled_group_limited_routing():
    # A group a node: pick 4 of the 8 groups, then 8 distinct experts among their 128.
    rng = random.Random(0)
    draws = 20000
    reached = sum(len({e // 32 for e in rng.sample([g * 32 + i for g in rng.sample(range(8), 4) for i in range(32)], 8)})
                  for _ in range(draws)) / draws
    assert load_model("deepseek-v3").routed_nodes_per_token(8) == pytest.approx(reached, rel=0.01)


def test_expert_exchange_by_hand(dgx):
    model = load_model("deepseek-v3")
    ep, tokens_bytes = 64, 4096 * 7168 * 2.0   # bf16 hidden vectors of one 4096-token micro-batch
    group = Placement(64, 8, 8)
    plain = load_runtime("pytorch-native")
    # All-to-all: k = 8 copies a token spread over the 64 ranks, each per-peer message at
    # the runtime's message-size efficiency; the network part paces it.
    peer = tokens_bytes * 8 / 64
    eff = peer / (peer + plain.collective_half_bytes)
    on = 7 * peer / (NVLINK_BW * eff) + 7 * NVLINK_LAT
    off = 56 * peer / (IB_BW * eff) + 56 * IB_LAT
    assert off > on
    assert expert_exchange_s(model, tokens_bytes, ep, group, dgx, plain, 2) == pytest.approx(2 * off, rel=1e-12)
    # DeepEP: once over the network to each other node reached, then 7/8 of the 8 rows over NVLink; no curve.
    deepep = replace(plain, moe_dispatch="deepep")
    crossings = model.routed_nodes_per_token(8) * 7 / 8
    on = tokens_bytes * 8 * 7 / 8 / NVLINK_BW + 7 * NVLINK_LAT
    off = tokens_bytes * crossings / IB_BW + 7 * IB_LAT
    assert off > on
    assert expert_exchange_s(model, tokens_bytes, ep, group, dgx, deepep, 2) == pytest.approx(2 * off, rel=1e-12)
    # FP8 training dispatches FP8 values with a float32 scale per 128; the combine stays 16-bit.
    fp8_off = tokens_bytes * crossings * (1 + 4 / 128) / 2 / IB_BW + 7 * IB_LAT
    assert expert_exchange_s(model, tokens_bytes, ep, group, dgx, deepep, 2, fp8=True) == pytest.approx(
        fp8_off + off, rel=1e-12)
    # Within one node DeepEP moves what the all-to-all moves.
    node = Placement(8, 8, 1)
    assert expert_exchange_s(model, tokens_bytes, 8, node, dgx, deepep, 2) == pytest.approx(
        expert_exchange_s(model, tokens_bytes, 8, node, dgx, replace(plain, collective_half_bytes=0.0), 2), rel=1e-12)
    assert expert_exchange_s(model, tokens_bytes, 1, Placement(1, 1, 1), dgx, deepep, 2) == 0.0


def test_expert_groups_fold_over_tp_cp_and_dp_where_the_runtime_folds():
    """Megatron-Core lays the experts' ranks etp innermost, then ep, then expert data
    parallelism over a stage's dp x cp x tp ranks; DeepSpeed and the executor keep ep
    inside dp, its members tp x cp apart."""
    from costmodel.strategy import Strategy

    prob = problem("mixtral-8x7b", cluster="dgx-h100", global_batch=16, seq_len=4096, gpus=16,
                   runtime=replace(NEUTRAL, moe_folding=True))
    whole = Strategy(dp=4, tp=2, cp=2, pp=1, micro_batch_size=1, num_microbatches=4, ep=8, etp=1,
                     sequence_parallel=True)
    where = groups(prob, whole)
    assert (where["ep"], where["expert_dp"]) == (placement(8, 1, 8), placement(2, 8, 8))   # ep in a node
    inside = groups(replace(prob, runtime=NEUTRAL), Strategy(dp=4, tp=2, cp=2, pp=1, micro_batch_size=1,
                                                             num_microbatches=4, ep=4))
    assert (inside["ep"], inside["expert_dp"]) == (placement(4, 4, 8), placement(2, 8, 8))
