"""The runtime profile in the plan file: recorded, read back, and defaulted for plans
written before runtime profiles."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from costmodel.specs.loading import load_runtime
from planner.api import plan
from planner.console.cli import main
from planner.plan_file import check_plan, problem_of, read_plan, runtime_of, write_plan

ARGS = {"model": "tiny-llama", "cluster": "dgx-a100-80gb", "global_batch": 8, "gpus": 8, "seq_len": 256, "top": 1}


def test_the_plan_records_its_runtime_and_reads_it_back(tmp_path):
    doc = plan(**ARGS, runtime="megatron")
    assert doc["runtime"]["name"] == "megatron" and doc["runtime"]["fitted_on"]
    path = tmp_path / "plan.json"
    write_plan(doc, path)
    assert problem_of(read_plan(path)).runtime == load_runtime("megatron")


def test_an_old_plan_without_a_runtime_loads_as_pytorch_native(tmp_path):
    doc = plan(**ARGS)
    assert doc["runtime"]["name"] == "pytorch-native"
    del doc["runtime"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    assert runtime_of(check_plan(json.loads(path.read_text()))) == load_runtime("pytorch-native")
    assert problem_of(read_plan(path)).runtime.name == "pytorch-native"


def test_a_bad_runtime_in_a_plan_is_named(tmp_path):
    doc = plan(**ARGS)
    doc["runtime"]["zero3_overlap"] = 2
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    out = CliRunner().invoke(main, ["explain", str(path)])
    assert out.exit_code == 2 and "plan.runtime.zero3_overlap" in out.output


def test_runtime_bogus_exits_2_naming_the_option():
    out = CliRunner().invoke(main, ["plan", "--model", "tiny-llama", "--cluster", "dgx-a100-80gb", "--gpus", "8",
                                    "--global-batch", "8", "--runtime", "bogus"])
    assert out.exit_code == 2
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --runtime: unknown runtime 'bogus'")


def _zero3_plan_args(mbs: int) -> list[str]:
    """`shardwise plan` of llama2-7b pinned to ZeRO-3 over 8 with full recompute, as JSON."""
    return ["plan", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--gpus", "8", "--global-batch", "16",
            "--seq", "4096", "--fix", f"dp=8,tp=1,pp=1,mbs={mbs},zero=3,recompute=full", "--format", "json"]


def test_runtime_changes_the_estimate_and_is_written(tmp_path):
    path = tmp_path / "plan.json"
    base = _zero3_plan_args(mbs=2)
    native = json.loads(CliRunner().invoke(main, base).stdout)
    megatron = CliRunner().invoke(main, base + ["--runtime", "megatron", "-o", str(path)])
    assert megatron.exit_code == 0
    assert json.loads(path.read_text())["runtime"]["name"] == "megatron"
    assert json.loads(megatron.stdout)["estimate"]["step_time_s"] < native["estimate"]["step_time_s"]


def test_runtime_set_prices_and_records_the_engine_settings(tmp_path):
    # Two FSDP2 units gathered ahead instead of one: one more 16-bit-or-fp32 copy of the
    # largest unit in the estimate's buffers, and the plan says so for `shardwise run`.
    path = tmp_path / "plan.json"
    base = _zero3_plan_args(mbs=1)
    one = json.loads(CliRunner().invoke(main, base).stdout)
    two = CliRunner().invoke(main, base + ["--runtime-set", "fsdp_prefetch=2,ddp_bucket_mb=50", "-o", str(path)])
    assert two.exit_code == 0
    written = json.loads(path.read_text())["runtime"]
    assert (written["fsdp_prefetch"], written["ddp_bucket_mb"]) == (2, 50.0)
    problem = problem_of(read_plan(path))
    assert problem.runtime == replace(load_runtime(), fsdp_prefetch=2, ddp_bucket_mb=50.0)
    # llama2-7b's largest unit is a layer (202.4M parameters), gathered in fp32 under autocast.
    layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    extra = (json.loads(two.stdout)["estimate"]["memory"]["comm_buffer_bytes"]
             - one["estimate"]["memory"]["comm_buffer_bytes"])
    assert extra == pytest.approx(4 * layer, rel=1e-5)   # the plan file keeps 6 digits


@pytest.mark.parametrize("setting, message", [
    ("fsdp_prefetch=0", "error: --runtime-set.fsdp_prefetch: must be at least 1, got 0"),
    ("fsdp_kept_gathered=all", "error: --runtime-set.fsdp_kept_gathered: unknown 'all' (known: none, head, root)"),
    ("gemm_efficiency_scale=2", "error: --runtime-set.gemm_efficiency_scale: not a setting"),
    ("prefetch", "error: --runtime-set: expected key=value, got 'prefetch'"),
])
def test_a_bad_runtime_setting_exits_2_naming_it(setting, message):
    out = CliRunner().invoke(main, ["plan", "--model", "tiny-llama", "--cluster", "dgx-a100-80gb", "--gpus", "8",
                                    "--global-batch", "8", "--runtime-set", setting])
    assert out.exit_code == 2
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message)
