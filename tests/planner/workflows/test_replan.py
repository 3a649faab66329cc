"""Elastic re-planning: `replan` on a new size gives byte for byte the plan a fresh
`plan` call makes for the same model, cluster, size and batch; the global batch is kept
when it can be and the notes say so; a size no dp of which divides the batch takes the
nearest batch that plans (ties: the larger); bad input exits 2 with one line naming the
field; a traced module's plan is refused; nothing plans: exit 3 with a relaxation."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from costmodel.specs.loading import SpecError
from planner.api import plan, plan_model
from planner.console.cli import main
from planner.plan_file import dumps, write_plan
from planner.rules import Rules
from planner.workflows.replan import nearest_batches, replan


@pytest.fixture(scope="module")
def gpt_plan():
    """gpt3-1.3b on 16 A100s, global batch 64 (about a second to plan)."""
    return plan("gpt3-1.3b", "dgx-a100-80gb", 64, gpus=16)


def _fsdp_plan(global_batch: int) -> dict:
    """tiny-gpt on the 2-rank CPU cluster under the fsdp rules (dp is every GPU)."""
    return plan("tiny-gpt", "cpu", global_batch, gpus=2, rules="fsdp")


def test_replan_is_byte_equal_to_a_fresh_plan_and_keeps_the_batch(gpt_plan):
    new, notes = replan(gpt_plan, gpus=8)
    assert dumps(new) == dumps(plan("gpt3-1.3b", "dgx-a100-80gb", 64, gpus=8))
    assert new["training"]["global_batch"] == 64
    assert notes[0] == "16 GPUs (2 nodes of 8 A100-80GB) → 8 GPUs (1 node of 8 A100-80GB)"
    assert "global batch 64 kept" in notes
    assert next(n for n in notes if n.startswith("strategy: ")).startswith("strategy: dp 16→8")


def test_cli_writes_the_same_bytes_as_plan(gpt_plan, tmp_path):
    old, new = tmp_path / "plan.json", tmp_path / "new.json"
    write_plan(gpt_plan, old)
    result = CliRunner().invoke(main, ["replan", str(old), "--nodes", "1", "-o", str(new)])
    assert result.exit_code == 0, result.output
    assert "global batch 64 kept" in result.output and "Plans, best first" in result.output
    assert new.read_text() == dumps(plan("gpt3-1.3b", "dgx-a100-80gb", 64, nodes=1))
    as_json = CliRunner().invoke(main, ["replan", str(old), "--nodes", "1", "--format", "json"])
    assert as_json.exit_code == 0 and json.loads(as_json.stdout) == json.loads(new.read_text())


def test_a_batch_no_dp_divides_takes_the_nearest_that_plans():
    # fsdp allows only dp = the GPU count. 6 on 4 GPUs: dp 4 divides neither; the
    # multiples 4 and 8 are both 2 away, and a tie goes to the larger: 8.
    new, notes = replan(_fsdp_plan(6), nodes=2)
    assert new["training"]["global_batch"] == 8 and new["strategy"]["dp"] == 4
    assert "global batch 6 cannot be kept on 4 GPUs: no dp the size and rules allow (4) divides it; " \
           "8 is the closest that plans" in notes
    assert new["rules"] == "fsdp"   # the plan's built-in rules are kept
    assert dumps(new) == dumps(plan("tiny-gpt", "cpu", 8, gpus=4, rules="fsdp"))
    # 8 on 6 GPUs: the multiples of 6 are 6 (2 away) and 12 (4 away): 6.
    new, notes = replan(_fsdp_plan(8), nodes=3)
    assert new["training"]["global_batch"] == 6 and new["strategy"]["dp"] == 6
    assert any(n.endswith("6 is the closest that plans") for n in notes)


def test_nearest_batches_come_nearest_first_ties_to_the_larger():
    assert nearest_batches(6, [4], Rules()) == [8, 4]
    assert nearest_batches(8, [6], Rules()) == [6, 12]
    # dp 1, 2, 4: 9 and 11 (1 away, 11 first), then 8 and 12 (from 2 and 4, twice each).
    assert nearest_batches(10, [1, 2, 4], Rules()) == [11, 9, 12, 8]
    # A pinned micro-batch size of 3 with dp 2: multiples of 6.
    assert nearest_batches(10, [2], Rules(pinned={"mbs": 3})) == [12, 6]


def test_replan_is_deterministic():
    first, second = replan(_fsdp_plan(6), nodes=2), replan(_fsdp_plan(6), nodes=2)
    assert dumps(first[0]) == dumps(second[0]) and first[1] == second[1]


def test_a_traced_modules_plan_is_refused(tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    doc = plan_model(module, (torch.randn(8, 16),), cluster="cpu", global_batch=8, gpus=2)
    with pytest.raises(SpecError) as err:
        replan(doc, gpus=1)
    assert err.value.field == "plan.model"
    write_plan(doc, tmp_path / "traced.json")
    result = CliRunner().invoke(main, ["replan", str(tmp_path / "traced.json"), "--gpus", "1"])
    assert result.exit_code == 2 and result.stderr.startswith("error: plan.model: ")


@pytest.mark.parametrize("args, field", [
    ([], "--gpus"),                                    # no new size
    (["--gpus", "3"], "--gpus"),                       # not whole 2-GPU nodes
    (["--gpus", "two"], "--gpus"),
    (["--gpus", "4", "--nodes", "2"], "--gpus"),
    (["--nodes", "0"], "--nodes"),
    (["--cluster", "no-such-cluster", "--gpus", "4"], "--cluster"),
    (["--gpus", "4", "--rules", "no-such-rules"], "--rules"),
    (["--gpus", "4", "--fix", "tp=3"], "--fix tp"),
    (["--gpus", "4", "--top", "0"], "--top"),
])
def test_bad_input_exits_2_naming_the_field(tmp_path, args, field):
    path = tmp_path / "plan.json"
    write_plan(_fsdp_plan(8), path)
    result = CliRunner().invoke(main, ["replan", str(path), *args])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)   # no traceback
    assert result.stderr.startswith(f"error: {field}: ") and result.stderr.count("\n") == 1


def test_a_broken_plan_file_exits_2(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    result = CliRunner().invoke(main, ["replan", str(path), "--gpus", "4"])
    assert result.exit_code == 2 and result.stderr.startswith("error: plan: ")


def test_nothing_plans_exits_3_with_a_relaxation(tmp_path):
    # llama2-7b's weights, gradients and AdamW states need about 100 GiB on one A100-80GB,
    # 105 GiB with its smallest activations.
    path = tmp_path / "plan.json"
    write_plan(plan("llama2-7b", "dgx-a100-80gb", 64, gpus=8, seq_len=4096), path)
    result = CliRunner().invoke(main, ["replan", str(path), "--gpus", "1"])
    assert result.exit_code == 3, result.output
    assert result.stderr.startswith("error: no feasible plan: global batch 64 on 1 GPUs: stage 0 needs 104.9 GiB")
    assert "would fit if you use 2 GPUs" in result.stderr
