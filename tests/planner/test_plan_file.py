"""planner.plan_file: the plan artifact round-trips and the one validation refuses a tampered
plan for every reader.
"""

from __future__ import annotations

import json

import pytest

from costmodel.specs.loading import SpecError, load_cluster
from planner.api import plan
from planner.plan_file import cluster_of, read_plan, strategy_of, write_plan
from planner.search import Infeasible


def test_returned_plan_fits_memory_and_round_trips(tmp_path):
    doc = plan("gpt3-13b", "dgx-a100-40gb", 256, nodes=2, seq_len=2048)
    assert doc["estimate"]["peak_memory_bytes"] <= 40 * 2**30 * 0.95 * 1.0001
    path = tmp_path / "plan.json"
    write_plan(doc, path)
    back = read_plan(path)
    assert back == doc
    s = strategy_of(back)
    assert s.dp * s.tp * s.pp == 16 and sum(st.num_layers for st in s.stages) == 40



def test_a_plan_keeps_the_nvlink_domain_its_tensor_parallel_group_spans(tmp_path):
    """tp 16 fits the 72-GPU NVLink domain of a GB200 NVL72 (trays of 4), not an 8-GPU
    DGX node; the plan file carries the domain, and plans of other clusters keep their bytes."""
    doc = plan("llama2-7b", "gb200-nvl72", 64, gpus=16, seq_len=4096, fix={"tp": 16})
    assert doc["strategy"]["tp"] == 16 and doc["cluster"]["nvlink_domain_gpus"] == 72
    path = tmp_path / "plan.json"
    write_plan(doc, path)
    assert cluster_of(read_plan(path)) == load_cluster("gb200-nvl72", gpus=16)
    with pytest.raises(Infeasible, match="tp_within_node: 16 is more than the 8 GPUs of a node"):
        plan("llama2-7b", "dgx-h100", 64, gpus=16, seq_len=4096, fix={"tp": 16})
    assert "nvlink_domain_gpus" not in plan("tiny-llama", "cpu", 8, gpus=2)["cluster"]


def test_tampered_plan_is_rejected(tmp_path):
    doc = plan("tiny-llama", "cpu", 8, gpus=2)
    doc["model"]["hidden_size"] += 1
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SpecError) as err:
        read_plan(path)
    assert err.value.field == "plan.model_fingerprint"


def test_run_reads_a_plan_model_block_as_a_model_file(tmp_path):
    """Found by bench/fuzz_cli.py: a model block without a field its model file may leave
    out (intermediate_size: 4h for GPT) passed every reader but run's, which built the
    spec field by field and raised TypeError."""
    from executor.launch import load_job

    doc = plan("tiny-gpt", "cpu", 8, gpus=2, seq_len=16, precision="fp32", fix={"pp": 2})
    whole = doc["model"]["intermediate_size"]
    del doc["model"]["intermediate_size"]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    assert load_job(str(path)).model.intermediate_size == whole == 4 * doc["model"]["hidden_size"]


@pytest.mark.parametrize("field, edit, message", [
    ("plan.strategy", lambda d: d["strategy"].update(num_microbatches=d["strategy"]["num_microbatches"] + 1),
     "dp x micro_batch_size x num_microbatches does not equal the global batch"),
    ("plan.training", lambda d: d["training"].update(warmup=3), "unexpected keyword argument 'warmup'"),
    ("plan.cluster.gpus_per_node", lambda d: d["cluster"].update(gpus_per_node=0), ""),
    ("plan.strategy.dp", lambda d: d["strategy"].update(dp="two"), "expected a non-negative integer"),
    # Found by bench/fuzz_cli.py: explain indexed the per-rank lists by stage.
    ("plan.estimate.rank_time_s", lambda d: d["estimate"].update(rank_time_s=[]),
     "expected one number per pipeline rank (1), got 0"),
    ("plan.estimate.peak_memory_rank", lambda d: d["estimate"].update(peak_memory_rank=1),
     "expected a pipeline rank, 0 to 0, got 1"),
    ("plan.strategy.cp", lambda d: d["strategy"].update(cp=0), "expected a positive integer, got 0"),
    ("plan.strategy", lambda d: d["strategy"].update(cp=2), "dp 2 x cp 2 x tp 1 x pp 1 = 4 ranks, but the plan's "
                                                           "cluster has 2 GPUs"),
])
def test_every_reader_refuses_a_hand_edited_plan_the_same_way(tmp_path, field, edit, message):
    """check_plan is the one validation: run, explain, replan and export refuse the same
    edit with the same one-line message (exit code 2)."""
    from click.testing import CliRunner

    from executor.launch import load_job
    from planner.console.cli import main

    doc = plan("tiny-llama", "cpu", 8, gpus=2, precision="fp32")
    edit(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SpecError) as err:
        load_job(str(path))
    assert err.value.field == field and message in str(err.value)
    expected = f"error: {err.value}"
    for argv in (["explain", str(path)], ["replan", str(path), "--gpus", "4"],
                 ["export", str(path), "--to", "megatron"]):
        out = CliRunner().invoke(main, argv)
        assert out.exit_code == 2, argv
        assert out.output.strip() == expected, argv


def test_a_plan_carries_cp_only_above_one(tmp_path):
    plain = plan("tiny-llama", "cpu", 8, gpus=4, seq_len=64)
    split = plan("tiny-llama", "cpu", 8, gpus=4, seq_len=64, fix={"cp": 2})
    assert "cp" not in plain["strategy"] and "cp_comm_s" not in plain["estimate"]["time"]
    assert split["strategy"]["cp"] == 2 and split["estimate"]["time"]["cp_comm_s"] > 0
    path = tmp_path / "plan.json"
    write_plan(split, path)
    assert strategy_of(read_plan(path)).cp == 2
    # Each cp rank holds chunks i and 2cp - 1 - i: the sequence must cut into 2 cp.
    split["training"]["seq_len"] = 62
    path.write_text(json.dumps(split))
    with pytest.raises(SpecError, match="plan.strategy.cp: cp 2 splits each sequence into 2 x cp = 4 equal chunks"):
        read_plan(path)


def test_a_stage_off_its_schedules_rank_is_refused_by_every_reader():
    """costmodel.strategy.layout_error, shared with `run`'s check: zbv runs stage 2 of
    pp 2 on rank 1 (its V), not where round-robin would put it."""
    doc = plan("tiny-gpt", "cpu", 8, gpus=2, seq_len=16, precision="fp32", fix="pp=2,schedule=zbv", top=1)
    assert [s["pp_rank"] for s in doc["strategy"]["stages"]] == [0, 1, 1, 0]
    doc["strategy"]["stages"][2]["pp_rank"] = 0
    with pytest.raises(SpecError, match=r"plan.strategy.stages\[2\].pp_rank: virtual stage 2 is not on the "
                                        r"pipeline rank zbv runs it on \(1\)"):
        strategy_of(doc)
    doc["strategy"]["stages"][2]["pp_rank"] = 1
    doc["strategy"]["vpp"] = 3
    with pytest.raises(SpecError, match="plan.strategy.vpp: zbv runs two model chunks per rank in a V"):
        strategy_of(doc)


def test_a_plan_carries_etp_only_when_the_experts_stay_whole(tmp_path):
    """Strategy.etp is written only when set (1: whole experts under tp), so plans
    written before it read back with their experts split over tp; a runtime that does
    not fold refuses it, and so does a dense model."""
    fix = "dp=2,tp=2,pp=1,ep=4,etp=1,mbs=1,zero=1,recompute=none,sp=on"
    doc = plan("tiny-moe", "dgx-h100", 32, gpus=4, seq_len=64, runtime="megatron", top=1, fix=fix)
    path = tmp_path / "plan.json"
    write_plan(doc, path)
    assert strategy_of(read_plan(path)).etp == 1
    split = plan("tiny-moe", "dgx-h100", 32, gpus=4, seq_len=64, runtime="megatron", top=1,
                 fix="dp=2,tp=2,pp=1,ep=2,etp=2,mbs=1,zero=1,recompute=none,sp=on")
    assert "etp" not in split["strategy"] and strategy_of(split).expert_tp == 2
    for edit, message in ((lambda d: d["strategy"].update(etp=2), "plan.strategy.etp: expected 1"),
                          (lambda d: d["runtime"].update(moe_folding=False),
                           "plan.strategy.etp: this runtime splits experts over tp"),
                          (lambda d: d["strategy"].update(sequence_parallel=False),
                           "plan.strategy.etp: whole experts under tp route each tp rank's sequence-parallel share")):
        bad = json.loads(json.dumps(doc))
        edit(bad)
        path.write_text(json.dumps(bad))
        with pytest.raises(SpecError, match=message):
            read_plan(path)
    with pytest.raises(SpecError, match="--fix etp: tiny-llama has no experts"):
        plan("tiny-llama", "dgx-h100", 32, gpus=8, seq_len=64, runtime="megatron", fix="etp=1")
    with pytest.raises(SpecError, match="--fix etp: the deepspeed-zero runtime has no MoE parallel folding"):
        plan("tiny-moe", "dgx-h100", 32, gpus=8, seq_len=64, runtime="deepspeed-zero", fix="tp=2,etp=1")
