"""The search on mixed clusters: stage groups balanced to each group's speed and memory,
replica shares, plan files, the CLI, and never worse than the fastest group alone."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from costmodel.estimate import estimate
from costmodel.specs.loading import load_cluster
from costmodel.units import GIB
from planner.api import make_problem
from planner.console.cli import main
from planner.plan_file import dumps, plan_document, read_plan, strategy_of, write_plan
from planner.rules import load_rules
from planner.search import search
from planner.search.mixed import search_mixed


def write_fast_slow(tmp_path, slow_memory_gib=80) -> str:
    """A DGX A100 node beside a node of the same boards at half the peak and HBM rate."""
    (tmp_path / "half.yaml").write_text(
        "name: half\ngpu: {name: A100-half, peak_flops_per_s: {bf16: 1.56e+14, fp32: 9.75e+12}, "
        f"memory_bytes: {slow_memory_gib * GIB}, hbm_bandwidth_bytes_per_s: 1.0195e+12, busy_power_w: 250, "
        "idle_power_w: 40}\ngpus_per_node: 8\n"
        "intra_node: {bandwidth_bytes_per_s: 3.0e+11, latency_s: 5.0e-06, efficiency: 0.62}\n"
        "inter_node: {bandwidth_bytes_per_s: 2.5e+10, latency_s: 1.0e-05, efficiency: 0.8}\n"
        "gpu_hour_price_usd: 2.0\n")
    path = tmp_path / "mixed.yaml"
    path.write_text(
        "name: fast-slow\ngroups:\n  - {name: fast, cluster: dgx-a100-80gb, num_nodes: 1}\n"
        f"  - {{name: slow, cluster: {tmp_path / 'half.yaml'}, num_nodes: 1}}\n"
        "inter_group: {bandwidth_bytes_per_s: 2.5e+10, latency_s: 1.0e-05, efficiency: 0.8}\n")
    return str(path)


def test_slower_group_takes_fewer_layers(tmp_path):
    p = make_problem("llama2-13b", write_fast_slow(tmp_path), 64, seq_len=4096)
    best = search(p, load_rules(None).with_fix({"pp": 2, "tp": 8}), top=1).best
    s, e = best.strategy, best.estimate
    layers = {name: sum(st.num_layers for st in s.stages if st.pp_rank == r) for r, name in enumerate(s.stage_groups)}
    assert sorted(s.stage_groups) == ["fast", "slow"] and sum(layers.values()) == 40
    # Half the peak: about half the layers (the head and embedding shift it a little).
    assert 1.6 <= layers["fast"] / layers["slow"] <= 2.6
    assert max(e.rank_time_s) / min(e.rank_time_s) < 1.3


def test_smaller_memory_group_holds_within_its_own_capacity(tmp_path):
    p = make_problem("llama2-13b", write_fast_slow(tmp_path, slow_memory_gib=16), 64, seq_len=4096)
    rules = load_rules(None).with_fix({"pp": 2, "tp": 8})
    best = search(p, rules, top=1).best
    s, e = best.strategy, best.estimate
    slow_rank = s.stage_groups.index("slow")
    assert e.rank_memory_bytes[slow_rank] <= 16 * GIB * (1 - rules.memory_headroom)
    assert e.rank_memory_bytes[1 - slow_rank] > 16 * GIB   # the fast group is not held to the small one


def test_never_worse_than_the_fastest_group_alone(tmp_path):
    path = write_fast_slow(tmp_path)
    p = make_problem("llama2-7b", path, 64, seq_len=2048)
    rules = load_rules(None).with_fix({"mbs": 1, "zero": 1})   # a smaller space: seconds, not tens
    mixed = search(p, rules, top=1).best.estimate.tokens_per_s
    fast = search(replace(p, cluster=p.cluster.group("fast")), rules, top=1).best.estimate.tokens_per_s
    every = search_mixed(p, rules, top=1, every_group=True).best.estimate.tokens_per_s
    assert mixed >= fast and mixed == max(fast, every)
    assert every > 1.2 * fast   # 8 more GPUs at half speed: about 1.5x the work per second


def test_replica_shares_follow_the_speeds(tmp_path):
    p = make_problem("gpt3-1.3b", write_fast_slow(tmp_path), 96, seq_len=2048)
    best = search(p, load_rules(None).with_fix({"pp": 1, "tp": 1, "mbs": 1}), top=1).best
    s, e = best.strategy, best.estimate
    assert s.replica_groups == ("fast",) * 8 + ("slow",) * 8
    fast, slow = s.replica_microbatches[0], s.replica_microbatches[-1]
    assert sum(s.replica_microbatches) == 96 and fast > slow
    # Shares finish together: no replica could take one micro-batch off the slowest and finish sooner.
    per_mb = {n: t / m for n, m, t in zip(s.replica_groups, s.replica_microbatches, e.replica_time_s)}
    assert max(e.replica_time_s) <= min((m + 1) * per_mb[n] for n, m in zip(s.replica_groups, s.replica_microbatches))


def test_mixed_plan_file_round_trips_and_is_deterministic(tmp_path):
    path = write_fast_slow(tmp_path)
    docs = []
    for _ in range(2):
        p = make_problem("llama2-7b", path, 64, seq_len=2048)
        docs.append(dumps(plan_document(p, "default", search(p, load_rules(None).with_fix({"mbs": 1, "zero": 1}),
                                                             top=2))))
    assert docs[0] == docs[1]
    out = tmp_path / "plan.json"
    write_plan(json.loads(docs[0]), out)
    doc = read_plan(out)
    s = strategy_of(doc)
    assert s.is_mixed and doc["cluster"]["groups"][1]["gpu"]["name"] == "A100-half"
    from planner.plan_file import cluster_of
    again = estimate(replace(p, cluster=cluster_of(doc)), s)
    assert again.step_time_s == pytest.approx(doc["estimate"]["step_time_s"], rel=1e-5)


def test_plan_file_with_a_group_not_in_its_cluster_is_refused(tmp_path):
    path = write_fast_slow(tmp_path)
    p = make_problem("llama2-7b", path, 64, seq_len=2048)
    doc = json.loads(dumps(plan_document(p, "default", search(p, load_rules(None).with_fix({"pp": 2}), top=1))))
    doc["strategy"]["stage_groups"] = ["fast", "nowhere"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    result = CliRunner().invoke(main, ["explain", str(bad)])
    assert result.exit_code == 2 and "plan.strategy.stage_groups" in result.output


def test_cli_plans_a_builtin_mixed_cluster_and_refuses_resizing():
    runner = CliRunner()
    ok = runner.invoke(main, ["plan", "--model", "llama2-13b", "--cluster", "mixed-h200-a100-40gb",
                              "--global-batch", "256", "--seq", "4096", "--format", "json"])
    assert ok.exit_code == 0, ok.output
    doc = json.loads(ok.output)
    s = strategy_of(doc)
    assert set(s.stage_groups or s.replica_groups) == {"h200", "a100-40gb"}
    # Every group stays under its own device memory (the A100s under 40 GiB).
    cluster = load_cluster("mixed-h200-a100-40gb")
    if s.stage_groups:
        memory = list(zip(s.stage_groups, doc["estimate"]["rank_memory_bytes"]))
    else:
        from costmodel.estimate.mixed import estimate_replicas
        memory = estimate_replicas(make_problem("llama2-13b", "mixed-h200-a100-40gb", 256, seq_len=4096), s)[1]
    assert {name for name, _ in memory} == {"h200", "a100-40gb"}
    for name, used in memory:
        assert used <= cluster.group(name).gpu.memory_bytes * (1 - load_rules(None).memory_headroom)
    bad = runner.invoke(main, ["plan", "--model", "llama2-13b", "--cluster", "mixed-h200-a100-40gb",
                               "--gpus", "16", "--global-batch", "256"])
    assert bad.exit_code == 2 and "--gpus" in bad.output and "Traceback" not in bad.output


def test_cost_objective_on_a_mixed_cluster(tmp_path):
    p = make_problem("llama2-7b", write_fast_slow(tmp_path), 64, seq_len=2048)
    rules = replace(load_rules(None).with_fix({"tp": 4, "mbs": 1, "zero": 1}), objective="cost")
    result = search(p, rules, top=1, pareto=True)
    from costmodel.estimate.energy import cost_energy
    costs = [cost_energy(p.cluster, c.strategy, c.estimate).cost_per_step_usd for c in result.pareto]
    best = cost_energy(p.cluster, result.best.strategy, result.best.estimate).cost_per_step_usd
    assert best == pytest.approx(min(costs))


def test_mixed_plans_elsewhere_in_the_cli(tmp_path):
    """export says what the engine cannot hold; replan cannot resize a mixed cluster;
    evaluate refuses one (a configuration does not place ranks on groups)."""
    runner = CliRunner()
    plan_file = tmp_path / "plan.json"
    ok = runner.invoke(main, ["plan", "--model", "llama2-7b", "--cluster", write_fast_slow(tmp_path),
                              "--global-batch", "64", "--seq", "2048", "--fix", "pp=2,schedule=1f1b", "-o", str(plan_file)])
    assert ok.exit_code == 0, ok.output
    exported = runner.invoke(main, ["export", str(plan_file), "--to", "megatron"])
    assert exported.exit_code == 0 and "megatron has no device groups" in exported.output
    assert "pipeline ranks 0 on" in exported.output
    resize = runner.invoke(main, ["replan", str(plan_file), "--gpus", "32"])
    assert resize.exit_code == 2 and "--gpus" in resize.output and "mixed cluster" in resize.output
    config = tmp_path / "ds.json"
    config.write_text('{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1}')
    refused = runner.invoke(main, ["evaluate", "--from", "deepspeed", str(config), "--model", "llama2-7b",
                                   "--cluster", "mixed-h100-a100", "--seq", "2048"])
    assert refused.exit_code == 2 and "--cluster" in refused.output and "Traceback" not in refused.output
