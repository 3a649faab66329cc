"""Cost and energy per step (costmodel.estimate.energy) against hand-computed values, and the
price and power fields of the specs."""

from dataclasses import replace

import pytest
import yaml

from costmodel.estimate import Estimate, estimate
from costmodel.estimate.breakdown import MemoryBreakdown, TimeBreakdown
from costmodel.estimate.energy import cost_energy, rank_busy_s
from costmodel.problem import Problem
from costmodel.specs.loading import (
    SpecError,
    configs_dir,
    load_cluster,
    load_model,
    make_training,
)
from costmodel.strategy import Strategy, even_stages


def _estimate(step, rank_times, bubble, bottleneck=0):
    time = TimeBreakdown(compute_s=0.0, recompute_s=0.0, tp_comm_s=0.0, ep_comm_s=0.0, pp_comm_s=0.0,
                         dp_comm_s=0.0, bubble_s=bubble, optimizer_s=0.0)
    memory = MemoryBreakdown(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    return Estimate(step_time_s=step, tokens_per_s=1.0, tflops_per_gpu=1.0, mfu=0.5, hfu=0.5,
                    peak_memory_bytes=0.0, peak_memory_rank=0, bottleneck_rank=bottleneck, time=time,
                    memory=memory, rank_time_s=tuple(rank_times), rank_memory_bytes=(0.0,) * len(rank_times))


def _priced(cluster, busy=400.0, idle=100.0, price=3.6):
    return replace(cluster, gpu=replace(cluster.gpu, busy_power_w=busy, idle_power_w=idle), gpu_hour_price_usd=price)


def test_cost_and_energy_match_hand_computed_values():
    # dp 2 x pp 2 = 4 GPUs, 4 micro-batches; rank 0 takes 2 s a micro-batch, rank 1 1.5 s;
    # step 10 s with a 1 s bubble, so the tail (DP sync + optimizer) is 10 - 4*2 - 1 = 1 s.
    strategy = Strategy(dp=2, tp=1, pp=2, micro_batch_size=1, num_microbatches=4)
    cluster = _priced(load_cluster("cpu", gpus=4))
    figures = cost_energy(cluster, strategy, _estimate(10.0, (2.0, 1.5), bubble=1.0))
    assert figures.rank_busy_s == pytest.approx((9.0, 7.0))        # 4*2 + 1, 4*1.5 + 1
    assert figures.cost_per_step_usd == pytest.approx(0.04)        # 10 s * 4 GPUs * 3.6 USD / 3600
    # per device: rank 0 9*400 + 1*100 = 3700 J, rank 1 7*400 + 3*100 = 3100 J; 2 devices each
    assert figures.energy_per_step_j == pytest.approx(13600.0)
    assert figures.average_power_w == pytest.approx(340.0)         # 13600 J / (4 GPUs * 10 s)
    assert figures.max_device_power_w == pytest.approx(370.0)      # 3700 J / 10 s


def test_figures_without_the_fields_are_none_and_leave_plans_alone():
    strategy = Strategy(dp=1, tp=1, pp=1, micro_batch_size=1, num_microbatches=1)
    figures = cost_energy(load_cluster("cpu"), strategy, _estimate(1.0, (1.0,), bubble=0.0))
    assert figures.cost_per_step_usd is None and figures.energy_per_step_j is None
    assert figures.as_dict() == {}
    only_price = replace(load_cluster("cpu"), gpu_hour_price_usd=7.2)
    assert cost_energy(only_price, strategy, _estimate(1.0, (1.0,), 0.0)).as_dict() == {
        "cost_per_step_usd": pytest.approx(7.2 / 3600), "rank_busy_s": [1.0]}


def test_busy_time_of_a_real_estimate_is_the_step_less_the_bubble_on_the_slowest_rank():
    spec, cluster = load_model("tiny-gpt"), _priced(load_cluster("cpu", gpus=4), busy=100.0, idle=20.0)
    problem = Problem(spec, cluster, make_training(spec, cluster, 8, 32))
    strategy = Strategy(dp=1, tp=1, pp=4, micro_batch_size=1, num_microbatches=8, schedule="1f1b")
    strategy = strategy.with_stages(even_stages(spec.num_hidden_layers, 4))
    e = estimate(problem, strategy)
    busy = rank_busy_s(e, strategy)
    assert busy[e.bottleneck_rank] == pytest.approx(e.step_time_s - e.time.bubble_s)
    assert all(0 < b <= e.step_time_s for b in busy)
    figures = cost_energy(cluster, strategy, e)
    assert 4 * 20.0 * e.step_time_s < figures.energy_per_step_j < 4 * 100.0 * e.step_time_s
    assert figures.energy_per_step_j == pytest.approx(sum(b * 100.0 + (e.step_time_s - b) * 20.0 for b in busy))


def test_built_in_specs_carry_cited_figures():
    a100 = load_cluster("dgx-a100-80gb")
    assert (a100.gpu.busy_power_w, a100.gpu.idle_power_w, a100.gpu_hour_price_usd) == (400.0, 50.0, 5.12)
    assert load_cluster("dgx-h100").gpu.busy_power_w == 700.0
    assert load_cluster("dgx-v100").gpu.busy_power_w == 300.0
    cpu = load_cluster("cpu")
    assert (cpu.gpu.busy_power_w, cpu.gpu.idle_power_w, cpu.gpu_hour_price_usd) == (None, None, None)


@pytest.mark.parametrize("gpu_extra, cluster_extra, field", [
    ({}, {"gpu_hour_price_usd": -1}, "cluster.gpu_hour_price_usd"),
    ({}, {"gpu_hour_price_usd": "cheap"}, "cluster.gpu_hour_price_usd"),
    ({"busy_power_w": 0}, {}, "cluster.gpu.busy_power_w"),
    ({"busy_power_w": 300, "idle_power_w": 400}, {}, "cluster.gpu.idle_power_w"),
    ({"idle_power_w": -5}, {}, "cluster.gpu.idle_power_w"),
])
def test_bad_price_or_power_names_the_field(tmp_path, gpu_extra, cluster_extra, field):
    data = yaml.safe_load((configs_dir("clusters") / "cpu.yaml").read_text())
    data["gpu"] = {**yaml.safe_load((configs_dir("hardware") / "cpu.yaml").read_text()), **gpu_extra}
    data.update(cluster_extra)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as err:
        load_cluster(path)
    assert err.value.field == field
