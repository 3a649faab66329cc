"""`shardwise run`: a plan file trained under torchrun gives the single-process losses,
writes its metrics, and every bad input is refused before any process trains."""

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from executor.launch import plan_launch, torchrun_command
from executor.run import main as worker_main
from executor_test_helpers import CONFIG, STEPS, loss_rtol, reference_run
from planner.cli import main as cli


def run_cli(*args):
    result = CliRunner().invoke(cli, ["run", *map(str, args)])
    return result.exit_code, result.output


def test_corrupt_plan_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "model": ')
    code, out = run_cli(bad)
    assert code == 2 and "plan: " in out and "not valid JSON" in out
    assert len(out.strip().splitlines()) == 1


def test_tampered_plan_is_refused(plan_file, tmp_path):
    doc = json.loads(plan_file.read_text())
    doc["model"]["hidden_size"] = 128    # the fingerprint no longer matches
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(doc))
    code, out = run_cli(tampered)
    assert code == 2 and "plan.model_fingerprint" in out


def test_plan_for_another_model_is_refused(plan_file):
    code, out = run_cli(plan_file, "--model", "tiny-llama")
    assert code == 2 and out.startswith("error: --model: tiny-llama is not the model this plan was made for")


def test_world_size_mismatch_is_refused(plan_file, monkeypatch):
    code, out = run_cli(plan_file, "--nproc-per-node", "3")
    assert code == 2 and "--nproc-per-node: the plan needs 2 processes" in out
    # The worker checks again, before it joins a process group.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert worker_main([str(plan_file), "--steps", "1"]) == 2


def test_torchrun_command_for_nodes():
    one = torchrun_command(plan_launch(8, None, 1, 0, None), ["p.json"])
    assert one[one.index("--nproc-per-node") + 1] == "8" and "--standalone" in one
    two = torchrun_command(plan_launch(16, None, 2, 1, "node0:29500"), ["p.json"])
    assert two[two.index("--nproc-per-node") + 1] == "8"
    assert two[two.index("--node-rank") + 1] == "1" and two[two.index("--rdzv-endpoint") + 1] == "node0:29500"
    assert two[-3:] == ["-m", "executor.run", "p.json"]


def test_run_trains_like_one_process(plan_file, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    cmd = [sys.executable, "-m", "planner.cli", "run", str(plan_file), "--steps", str(STEPS), "--lr", str(CONFIG.lr),
           "--metrics-out", str(metrics)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps, summary = lines[:-1], lines[-1]["summary"]
    assert [s["step"] for s in steps] == list(range(STEPS))
    ref_losses, _ = reference_run("tiny-gpt")
    assert [s["loss"] for s in steps] == pytest.approx(ref_losses, rel=loss_rtol(CONFIG.dtype))
    assert all(s["step_time_s"] > 0 and s["peak_memory_bytes"] > 0 for s in steps)
    assert summary["steps"] == STEPS and summary["estimated_step_time_s"] > 0
    # The workers inherit this process's setting (.ci/settings.py turns it on in every process).
    assert summary["numerics"] == {"dtype": "float32", "autocast": "none",
                                   "deterministic": torch.are_deterministic_algorithms_enabled()}
    assert "Run against the plan" in done.stdout


def test_plans_the_executor_cannot_build_are_refused(plan_file, tmp_path):
    doc = json.loads(plan_file.read_text())
    for change, field in (({"vpp": 2, "schedule": "1f1b"}, "strategy.vpp"),
                          ({"tp": 2, "dp": 1, "micro_batch_size": 8, "sequence_parallel": True}, None)):
        bad = json.loads(json.dumps(doc))
        bad["strategy"].update(change)
        if field is None:   # SP over a sequence tp does not divide
            bad["training"]["seq_len"] = 15
            field = "strategy.sequence_parallel"
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        code, out = run_cli(path)
        assert code == 2 and field in out, out
