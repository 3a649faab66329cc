"""Mixed clusters: the executor runs a plan whose ranks sit on groups of different
hardware. Replica groups, whose dp replicas run their own number of micro-batches,
and stage groups, whose pipeline ranks hold uneven stages, train the tiny models as
one process does (test_step.py's tolerances); `shardwise run` reports each
rank in the group the plan declares; bad group fields are refused by name.

On CPU every group is CPU hardware, declared as different types: configs/hardware/
cpu.yaml and a copy at half its peak named "cpu-slow", each behind a cluster file of
its own."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from click.testing import CliRunner
from executor_test_helpers import (
    CONFIG,
    PARITY,
    batches,
    cached_reference,
    check_parity,
    loss_rtol,
    training,
)

from costmodel.estimate import estimate
from costmodel.specs.loading import load_cluster, load_model
from costmodel.strategy import Stage, Strategy, even_stages
from executor.collective_log import CommCounter
from executor.data import SyntheticTokens, replica_shard
from executor.launch import (
    UnsupportedPlan,
    check_supported,
    is_cpu_hardware,
    rank_group,
    run_local,
)
from executor.train import Trainer
from planner.api import plan
from planner.console.cli import main as cli
from planner.plan_file import (
    candidate_dict,
    cluster_dict,
    problem_of,
    strategy_dict,
    write_plan,
)
from planner.search import Candidate

STEPS = 3
BATCH = 4          # replica shares 3 + 1 micro-batches of one sequence
LAYERS = 4
CPU_YAML = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "hardware", "cpu.yaml")


def replicas(dp=2, tp=1, zero=0, shares=(3, 1), groups=("fast", "slow")) -> Strategy:
    return Strategy(dp=dp, tp=tp, pp=1, micro_batch_size=BATCH // sum(shares), num_microbatches=max(shares),
                    zero_stage=zero, stages=even_stages(LAYERS, 1), replica_groups=groups[:dp],
                    replica_microbatches=shares)


# Three layers on the first pipeline rank, one on the second (a slow second group).
UNEVEN = (Stage(0, 0, 0, 3), Stage(1, 1, 3, 1))


def staged(dp=1, groups=("fast", "slow"), schedule="1f1b") -> Strategy:
    return Strategy(dp=dp, tp=1, pp=2, micro_batch_size=BATCH // (2 * dp), num_microbatches=2, schedule=schedule,
                    stages=UNEVEN, stage_groups=groups)


REPLICA_PLANS = {
    "ddp": replicas(),                           # ZeRO-0: DDP, all-reduce on the last micro-batch
    "ddp-zero1": replicas(zero=1),               # DDP + ZeroRedundancyOptimizer
    "fsdp-zero2": replicas(zero=2),              # fully_shard kept gathered until the last micro-batch
    "replicate-tp2": replicas(tp=2),             # ZeRO-0 over DTensor weights: replicate
    "fsdp-zero1-tp2": replicas(tp=2, zero=1),    # ZeRO-1 over TP runs as ZeRO-2's FSDP
    "shares-1-3": replicas(shares=(1, 3)),       # the larger share on the second replica
}
STAGE_PLANS = {"pp2-3+1": staged(), "pp2-3+1-gpipe": staged(schedule="gpipe"), "dp2-pp2-3+1": staged(dp=2)}

@pytest.mark.parametrize("plan_name", sorted(REPLICA_PLANS))
def test_replica_shares_train_as_one_process(plan_name):
    check_parity("tiny-gpt", REPLICA_PLANS[plan_name], STEPS, BATCH)


def test_each_replica_takes_its_share_of_the_global_batch():
    x, y = SyntheticTokens(512).global_batch(0, BATCH, 16)
    shares = [replica_shard(x, y, replicas(), d) for d in range(2)]
    assert torch.equal(shares[0][0], x[:3]) and torch.equal(shares[1][1], y[3:])
    assert [sx.shape[0] for sx, _ in (replica_shard(x, y, replicas(shares=(1, 3)), d) for d in range(2))] == [1, 3]
    with pytest.raises(ValueError, match=r"shares \[3, 1\] of dp=2 ranks do not split a global batch of 8"):
        replica_shard(*SyntheticTokens(512).global_batch(0, 8, 16), replicas(), 0)


def issued_in_order(rank, world, strat):
    """The collectives of one step (after two that settle DDP's buckets), in order."""
    trainer = Trainer(load_model("tiny-gpt"), training(global_batch=BATCH), strat, CONFIG, "cpu")
    *warm, measured = batches(trainer.spec, 3, BATCH)
    for x, y in warm:
        trainer.step(x, y)
    with CommCounter() as counter:
        trainer.train_step(*measured)
    return [(c.kind, c.group_size, c.bytes) for c in counter.issued]


@pytest.mark.parametrize("plan_name", ["ddp", "ddp-zero1", "fsdp-zero2"])
def test_replicas_of_unequal_shares_issue_the_same_collectives(plan_name):
    # Three micro-batches on one replica, one on the other: gradients are reduced once,
    # on each replica's last micro-batch, and ZeRO-2 gathers each weight once, on its first.
    fast, slow = run_local(issued_in_order, 2, REPLICA_PLANS[plan_name])
    assert fast == slow and len(fast) > 1   # the gradients' reduction, besides the norm's all-reduce


def test_replica_shares_train_a_llama_as_one_process():
    check_parity("tiny-llama", REPLICA_PLANS["ddp"], STEPS, BATCH)


@pytest.mark.parametrize("plan_name", sorted(STAGE_PLANS))
def test_uneven_stage_groups_train_as_one_process(plan_name):
    check_parity("tiny-gpt", STAGE_PLANS[plan_name], STEPS, BATCH)


def test_uneven_stage_groups_train_a_llama_as_one_process():
    check_parity("tiny-llama", STAGE_PLANS["pp2-3+1"], STEPS, BATCH)


def test_a_share_the_executor_cannot_run_is_refused_by_name():
    spec = load_model("tiny-moe")
    for strat, words in ((replicas(zero=3), "ZeRO-3"),
                         (Strategy(**{**_fields(replicas()), "ep": 2}), "expert parallelism"),
                         (Strategy(**{**_fields(replicas()), "pp": 2, "stages": UNEVEN}), "pp 1"),
                         (Strategy(**{**_fields(replicas()), "replica_microbatches": (3,)}), "2 positive")):
        with pytest.raises(UnsupportedPlan, match="plan.strategy.replica_") as err:
            check_supported(spec, strat, 16)
        assert words in str(err.value)


def _fields(strat: Strategy) -> dict:
    return {k: getattr(strat, k) for k in strat.__dataclass_fields__}


# -- plans of a mixed cluster, run by `shardwise run` ---------------------------------


def write_yaml(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def mixed_cluster_file(tmp_path_factory):
    """Two one-rank groups: "fast" on cpu.yaml, "slow" on a copy at half its peak."""
    root = tmp_path_factory.mktemp("mixed")
    slow = yaml.safe_load(open(CPU_YAML))
    slow["name"] = "cpu-slow"
    slow["peak_flops_per_s"] = {k: v / 2 for k, v in slow["peak_flops_per_s"].items()}
    slow_hw = write_yaml(root / "cpu-slow.yaml", slow)
    link = {"bandwidth_bytes_per_s": 2.3e9, "latency_s": 1.2e-4}
    files = {name: write_yaml(root / f"{name}.yaml", {"name": name, "gpu": gpu, "gpus_per_node": 1,
                                                       "num_nodes": 1, "intra_node": link})
             for name, gpu in (("fast", "cpu"), ("slow", str(slow_hw)))}
    mixed = write_yaml(root / "mixed-cpu.yaml", {
        "name": "mixed-cpu", "inter_group": link,
        "groups": [{"name": "fast", "cluster": str(files["fast"]), "num_nodes": 1},
                   {"name": "slow", "cluster": str(files["slow"]), "num_nodes": 1}]})
    return mixed


@pytest.fixture(scope="module")
def mixed_cluster(mixed_cluster_file):
    return load_cluster(mixed_cluster_file)


@pytest.fixture(scope="module")
def cpu_plan():
    """What `shardwise plan` writes for tiny-gpt on two CPU ranks (dp 2, mbs 1)."""
    return plan("tiny-gpt", "cpu", BATCH, gpus=2, seq_len=16, precision="fp32", fix={"dp": 2, "tp": 1, "mbs": 1})


def mixed_plan(cpu_plan, cluster, strat: Strategy, path):
    """The CPU plan moved onto the mixed cluster with `strat`'s group fields, and the
    estimate of that strategy there (a plan's per-rank figures must match its pp)."""
    doc = json.loads(json.dumps(cpu_plan))
    doc["cluster"] = cluster_dict(cluster)
    doc["strategy"] = strategy_dict(strat)
    doc["estimate"] = candidate_dict(Candidate(strat, estimate(problem_of(doc), strat), 0.0))["estimate"]
    write_plan(doc, path)
    return path


def run_cli(*args):
    result = CliRunner().invoke(cli, ["run", *map(str, args)])
    return result.exit_code, result.output


def run_plan_file(path, tmp_path):
    """`shardwise run --fp64 --deterministic` of a plan file in a fresh process: its
    result and metrics lines (float64, so the losses compare with the parity tolerance)."""
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "planner.console.cli", "run", str(path), "--steps", str(STEPS), "--lr", str(PARITY.lr),
           "--metrics-out", str(metrics), "--fp64", "--deterministic"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", **os.environ}, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert lines[-1]["summary"]["numerics"] == {"dtype": "float64", "autocast": "none", "deterministic": True,
                                                   "compile": "none",
                                                   "overlap": {"fsdp_prefetch": 1, "fsdp_kept_gathered": "none",
                                                               "ddp_bucket_mb": 25.0, "async_tp": False}}
    return done, lines


@pytest.mark.parametrize("mode", ["replica", "stage"])
def test_run_reports_each_rank_in_its_declared_group(mode, cpu_plan, mixed_cluster, tmp_path):
    # Stage groups in the order opposite to the cluster file's: rank 0 (pipeline rank 0)
    # runs in the slow group, as the plan says.
    strat = replicas() if mode == "replica" else staged(groups=("slow", "fast"))
    path = mixed_plan(cpu_plan, mixed_cluster, strat, tmp_path / "plan.json")
    done, lines = run_plan_file(path, tmp_path)
    summary = lines[-1]["summary"]
    declared = ["fast", "slow"] if mode == "replica" else ["slow", "fast"]
    gpu = {"fast": "CPU", "slow": "cpu-slow"}
    assert summary["ranks"] == [{"rank": r, "group": g, "gpu": gpu[g], "device": "cpu"} for r, g in enumerate(declared)]
    reference_losses = cached_reference("tiny-gpt", STEPS, BATCH)[0]
    assert [s["loss"] for s in lines[:-1]] == pytest.approx(reference_losses, rel=loss_rtol(PARITY.dtype))
    assert "groups: " in done.stdout


def test_rank_groups_follow_the_mesh(cpu_plan, mixed_cluster, tmp_path):
    doc = json.loads(json.dumps(cpu_plan))
    doc["cluster"] = cluster_dict(mixed_cluster)
    # Replicas: dp rank (rank // tp) % dp; tp ranks of one replica share its group.
    doc["strategy"] = strategy_dict(replicas(tp=2))
    assert [rank_group(doc, r).group for r in range(4)] == ["fast", "fast", "slow", "slow"]
    # Stages: pipeline rank rank // (dp x tp).
    doc["strategy"] = strategy_dict(staged(dp=2))
    assert [rank_group(doc, r).group for r in range(4)] == ["fast", "fast", "slow", "slow"]
    assert {rank_group(doc, r).gpu for r in range(4)} == {"CPU", "cpu-slow"}
    assert rank_group(cpu_plan, 1).group == "cpu" and rank_group(cpu_plan, 1).device_type == "cpu"
    assert is_cpu_hardware("CPU") and is_cpu_hardware("cpu-slow") and not is_cpu_hardware("A100-SXM4-80GB")


def test_bad_group_fields_are_refused_by_name(cpu_plan, mixed_cluster, tmp_path):
    good = json.loads(mixed_plan(cpu_plan, mixed_cluster, replicas(), tmp_path / "good.json").read_text())
    cases = (
        ({"replica_microbatches": [3, 2]}, "plan.strategy.replica_microbatches"),   # 5 sequences, not 4
        ({"replica_microbatches": [4]}, "plan.strategy.replica_microbatches"),
        ({"replica_groups": ["fast", "medium"]}, "plan.strategy.replica_groups"),
        ({"zero_stage": 3}, "plan.strategy.replica_groups"),
        ({"micro_batch_size": 2}, "plan.strategy.replica_microbatches"),
    )
    for change, field in cases:
        bad = json.loads(json.dumps(good))
        bad["strategy"].update(change)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        code, out = run_cli(path)
        assert code == 2 and out.startswith(f"error: {field}: "), (change, out)
        assert len(out.strip().splitlines()) == 1


def test_a_plan_mixing_cpu_and_gpu_groups_is_refused(cpu_plan, mixed_cluster, tmp_path):
    cluster = cluster_dict(mixed_cluster)
    a100 = cluster_dict(load_cluster("dgx-a100-80gb", nodes=1))
    cluster["groups"][1] = {**a100, "name": "slow"}
    doc = json.loads(json.dumps(cpu_plan))
    doc["cluster"] = cluster
    doc["strategy"] = strategy_dict(replicas())
    path = tmp_path / "cpu-gpu.json"
    write_plan(doc, path)
    code, out = run_cli(path)
    assert code == 2 and out.startswith("error: plan.cluster.groups: group fast (CPU) runs on CPU and group slow")
    assert len(out.strip().splitlines()) == 1


# dp 2 pinned: on gloo the gradient all-reduce costs this small model more than the slow
# rank saves, so the planner would otherwise keep to the fast group alone.
@pytest.mark.parametrize("fix", [{"dp": 2, "pp": 1, "tp": 1, "mbs": 1, "zero": 0}, {"pp": 2, "schedule": "gpipe"}])
def test_a_plan_the_planner_made_for_a_mixed_cluster_runs_as_one_process(fix, mixed_cluster_file, tmp_path):
    """`shardwise plan` on the mixed CPU cluster, then `shardwise run` of its plan file:
    the shares (or stages) the planner chose train as one process does."""
    doc = plan("tiny-gpt", str(mixed_cluster_file), BATCH, seq_len=16, precision="fp32", fix=fix)
    s = doc["strategy"]
    if fix["pp"] == 1:
        # The fast replica takes at least the slow one's share of the 4 micro-batches (on
        # layers this small the runtime's per-layer launch cost can outweigh the slow
        # group's half-speed compute and even the shares; uneven shares run in
        # test_replica_shares_train_as_one_process).
        assert s["replica_groups"] == ["fast", "slow"] and s["replica_microbatches"][0] >= s["replica_microbatches"][1]
        assert sum(s["replica_microbatches"]) == BATCH
    else:
        assert sorted(s["stage_groups"]) == ["fast", "slow"]
    path = tmp_path / "plan.json"
    write_plan(doc, path)
    done, lines = run_plan_file(path, tmp_path)
    reference_losses = cached_reference("tiny-gpt", STEPS, BATCH)[0]
    assert [s["loss"] for s in lines[:-1]] == pytest.approx(reference_losses, rel=loss_rtol(PARITY.dtype))
