"""Mixed clusters: loading, per-group pricing, batch shares, cost and energy per group."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from costmodel_test_helpers import IB_BW, IB_LAT

from costmodel.estimate import estimate
from costmodel.estimate.energy import cost_energy
from costmodel.estimate.mixed import replica_shares
from costmodel.estimate.uniform import rank_work, unit_costs
from costmodel.problem import Problem
from costmodel.specs import MixedClusterSpec
from costmodel.specs.loading import (
    SpecError,
    load_cluster,
    load_model,
    load_runtime,
    make_training,
)
from costmodel.strategy import Strategy, even_stages


def twin(inter_bandwidth=2.5e10) -> MixedClusterSpec:
    """Two one-node DGX A100 groups, named apart, joined by HDR InfiniBand."""
    node = load_cluster("dgx-a100-80gb")
    link = replace(node.inter_node, bandwidth_bytes_per_s=inter_bandwidth)
    return MixedClusterSpec("twin", (replace(node, name="left"), replace(node, name="right")), link)


def mixed_problem(cluster, model="llama2-7b", batch=64, seq=2048, precision="bf16") -> Problem:
    m = load_model(model)
    return Problem(m, cluster, make_training(m, cluster, batch, seq, precision))


def test_two_copies_of_a_node_price_as_a_two_node_cluster():
    """Stage groups on two identical one-node groups are the homogeneous two-node
    cluster: every term equal, the stage boundary on the same InfiniBand link."""
    p = mixed_problem(twin())
    homogeneous = replace(p, cluster=load_cluster("dgx-a100-80gb", nodes=2))
    s = Strategy(dp=2, tp=4, pp=2, micro_batch_size=1, num_microbatches=32,
                 stages=even_stages(32, 2), zero_stage=1)
    mixed = estimate(p, replace(s, stage_groups=("left", "right")))
    plain = estimate(homogeneous, s)
    assert mixed.step_time_s == pytest.approx(plain.step_time_s, rel=1e-12)
    assert mixed.rank_memory_bytes == pytest.approx(plain.rank_memory_bytes, rel=1e-12)
    assert mixed.mfu == pytest.approx(plain.mfu, rel=1e-12)


def test_stage_boundary_between_groups_takes_the_inter_group_link():
    """The send between groups runs at the inter-group link (alpha-beta, Thakur et al.
    2005): latency + bytes / achieved bandwidth, one bf16 activation of b*s*h / tp."""
    slow = 2.5e9
    p = mixed_problem(twin(inter_bandwidth=slow))
    s = Strategy(dp=2, tp=4, pp=2, micro_batch_size=1, num_microbatches=32, stages=even_stages(32, 2),
                 stage_groups=("left", "right"))
    e = estimate(p, s)
    message = 2 * 1 * 2048 * 4096 / 4
    # Under the default runtime (pytorch-native): its bandwidth by message size, a 2 MiB
    # send at m / (m + collective_half_bytes) of the link's (configs/runtimes/pytorch-native.yaml)
    half = load_runtime().collective_half_bytes
    hand_p2p = IB_LAT + message / (slow * 0.8 * message / (message + half))
    group = replace(p, cluster=p.cluster.groups[0])
    base = rank_work(unit_costs(group, s), s, 0)
    # Rank 0 of two sends one activation per micro-batch (costmodel.estimate.uniform.p2p_sends).
    assert e.rank_time_s[0] == pytest.approx(base.total_s - base.pp_comm_s + hand_p2p, rel=1e-9)
    assert hand_p2p > IB_LAT + message / IB_BW   # slower than the group's own network


def fast_and_slow(tmp_path, inter_bandwidth="2.5e+10") -> MixedClusterSpec:
    """A group of A100s beside a group of the same boards at half the peak (a made-up GPU)."""
    (tmp_path / "half.yaml").write_text(
        "name: half\ngpu: {name: A100-half, peak_flops_per_s: {bf16: 1.56e+14, fp32: 9.75e+12}, "
        "memory_bytes: 85899345920, hbm_bandwidth_bytes_per_s: 1.0195e+12, busy_power_w: 250, idle_power_w: 40}\n"
        "gpus_per_node: 8\nintra_node: {bandwidth_bytes_per_s: 3.0e+11, latency_s: 5.0e-06, efficiency: 0.62}\n"
        "inter_node: {bandwidth_bytes_per_s: 2.5e+10, latency_s: 1.0e-05, efficiency: 0.8}\n"
        "gpu_hour_price_usd: 2.0\n")
    (tmp_path / "mixed.yaml").write_text(
        "name: fast-slow\ngroups:\n  - {name: fast, cluster: dgx-a100-80gb, num_nodes: 1}\n"
        f"  - {{name: slow, cluster: {tmp_path / 'half.yaml'}, num_nodes: 1}}\n"
        f"inter_group: {{bandwidth_bytes_per_s: {inter_bandwidth}, latency_s: 1.0e-05, efficiency: 0.8}}\n")
    return load_cluster(tmp_path / "mixed.yaml")


def test_mixed_cluster_file_loads_groups(tmp_path):
    c = fast_and_slow(tmp_path)
    assert [g.name for g in c.groups] == ["fast", "slow"] and c.num_gpus == 16
    assert c.group("slow").gpu.peak_for("bf16") == 1.56e14
    assert c.inter_group.achieved_bytes_per_s == 2.5e10 * 0.8


@pytest.mark.parametrize("text, field", [
    ("name: x\ngroups: []\ninter_group: {bandwidth_bytes_per_s: 1.0e+9, latency_s: 0}\n", "cluster.groups"),
    ("name: x\ngroups:\n  - {cluster: dgx-h100}\n  - {cluster: dgx-h100}\n"
     "inter_group: {bandwidth_bytes_per_s: 1.0e+9, latency_s: 0}\n", "cluster.groups"),
    ("name: x\ngroups:\n  - {cluster: dgx-h100, name: a}\n", "cluster.inter_group"),
    ("name: x\ngroups:\n  - {cluster: dgx-h100, nodes: 2}\ninter_group: {bandwidth_bytes_per_s: 1.0e+9, latency_s: 0}\n",
     "cluster.groups[0].nodes"),
])
def test_bad_mixed_cluster_files_name_the_field(tmp_path, text, field):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_cluster(path)
    assert err.value.field == field


def test_a_mixed_cluster_cannot_be_resized():
    with pytest.raises(SpecError) as err:
        load_cluster("mixed-h100-a100", gpus=16)
    assert err.value.field == "--gpus"


def test_replica_shares_minimise_the_slowest_replica():
    assert replica_shares([1.0, 3.0], 8) == (6, 2)          # 6 x 1 = 2 x 3
    assert replica_shares([1.0, 1.0, 1.0], 7) == (3, 2, 2)
    for times in ([1.0, 2.5], [0.7, 1.1, 3.0], [2.0, 2.0, 1.0]):
        for total in range(len(times), 13):
            got = replica_shares(times, total)
            best = min(max(m * t for m, t in zip(split, times))
                       for split in itertools.product(range(1, total + 1), repeat=len(times)) if sum(split) == total)
            assert sum(got) == total and max(m * t for m, t in zip(got, times)) == pytest.approx(best)


def test_replica_groups_step_is_the_slowest_replica_then_the_sync(tmp_path):
    # A slow link between the groups: the all-reduce outlasts the last backward.
    p = mixed_problem(fast_and_slow(tmp_path, inter_bandwidth="1.0e+9"), model="gpt3-1.3b", batch=48)
    names = ("fast",) * 8 + ("slow",) * 8
    shares = (4,) * 8 + (2,) * 8
    s = Strategy(dp=16, tp=1, pp=1, micro_batch_size=1, num_microbatches=4, stages=even_stages(24, 1),
                 zero_stage=1, replica_groups=names, replica_microbatches=shares)
    e = estimate(p, s)
    base = replace(s, replica_groups=(), replica_microbatches=())
    per_mb = {g.name: rank_work(unit_costs(replace(p, cluster=g), base), base, 0).total_s for g in p.cluster.groups}
    assert e.replica_time_s == pytest.approx(tuple(m * per_mb[n] for n, m in zip(names, shares)), rel=1e-12)
    assert per_mb["slow"] > 1.5 * per_mb["fast"]   # half the peak: the GEMMs take twice as long
    # ZeRO-1 has no per-micro-batch DP traffic: dp_comm is the exposed gradient sync alone.
    assert e.time.dp_comm_s > 0
    assert e.step_time_s == pytest.approx(max(e.replica_time_s) + e.time.optimizer_s + e.time.dp_comm_s, rel=1e-12)


def test_cost_and_energy_per_group_by_hand(tmp_path):
    """cost = step x sum over devices of their group's price / 3600; energy = sum over
    devices of busy x P_busy + (step - busy) x P_idle of their group (costmodel.estimate.energy)."""
    c = fast_and_slow(tmp_path)
    p = mixed_problem(c)
    s = Strategy(dp=2, tp=4, pp=2, micro_batch_size=1, num_microbatches=32, stages=even_stages(32, 2),
                 stage_groups=("fast", "slow"))
    e = estimate(p, s)
    f = cost_energy(c, s, e)
    step = e.step_time_s
    tail = step - 32 * max(e.rank_time_s) - e.time.bubble_s
    busy = [min(step, 32 * t + tail) for t in e.rank_time_s]
    assert f.rank_busy_s == pytest.approx(tuple(busy), rel=1e-12)
    assert f.cost_per_step_usd == pytest.approx(step * (8 * 5.12 + 8 * 2.0) / 3600, rel=1e-12)
    hand_j = 8 * (busy[0] * 400 + (step - busy[0]) * 50) + 8 * (busy[1] * 250 + (step - busy[1]) * 40)
    assert f.energy_per_step_j == pytest.approx(hand_j, rel=1e-12)
    assert f.max_device_power_w == pytest.approx(max(busy[0] * 400 + (step - busy[0]) * 50,
                                                     busy[1] * 250 + (step - busy[1]) * 40) / step, rel=1e-12)
