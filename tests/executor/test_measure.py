"""`shardwise profile` on this machine: a quick profile of two CPU ranks fits into a
cluster spec the planner loads, a quick layer profile measures a model's layer kinds
that `plan --profile` then uses, and --extend merges measurements by shape."""

import json
import os

import pytest
from click.testing import CliRunner

from costmodel.calibrate import fit_host_overheads
from costmodel.specs.hardware import HostOverheads
from costmodel.specs.loading import load_cluster
from executor.measure import extend
from planner.console.cli import main as cli


def test_quick_profile_fits_a_loadable_cluster(tmp_path):
    out, spec = tmp_path / "cpu.json", tmp_path / "mine.yaml"
    result = CliRunner().invoke(cli, ["profile", "--device", "cpu", "--nproc", "2", "-o", str(out),
                                      "--spec-out", str(spec), "--quick"])
    assert result.exit_code == 0, result.output
    profile = json.loads(out.read_text())
    assert profile["schema_version"] == 2 and profile["ranks"] == 2 and profile["layers"] == []
    assert {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"} == set(profile["collectives"])
    assert all(p["seconds"] > 0 for pts in profile["collectives"].values() for p in pts)
    cluster = load_cluster(str(spec))
    assert cluster.gpus_per_node == 2 and cluster.comm_overlap == 0.0
    assert "all_to_all" in cluster.intra_node.collectives
    assert 1e9 < cluster.gpu.peak_for("fp32") < 1e13   # a CPU core, within reason
    assert "&id" not in spec.read_text()               # plain YAML, no anchors
    # Two CPU ranks: DTensor's and FSDP2's host time is measured and fitted.
    host = profile["host_overheads"]
    assert [r["micro_batch_size"] for r in host["tp"]] == [1, 2]   # --quick: the two that fix the line
    keys = {"tp_s", "tp_sp_s", "tp_shard_s", "all_reduce_s", "all_gather_s", "reduce_scatter_s"}
    assert all(keys <= set(r) and all(r[k] > 0 for k in keys) for r in host["tp"])
    # The spec carries the fit of these very measurements (timings themselves are noise
    # here: which of two thread times is larger is not asserted).
    fitted = fit_host_overheads(host)
    assert cluster.gpu.host_overheads == HostOverheads(**fitted)
    assert all(v >= 0 for v in fitted.values())


def test_extend_replaces_same_shapes_and_keeps_the_rest():
    old = {"device": "cpu", "precision": "fp32", "ranks": 2,
           "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1.0}, {"m": 2, "n": 2, "k": 2, "seconds": 2.0}],
           "elementwise": [{"bytes": 8, "seconds": 1.0}], "collectives": {"p2p": [{"bytes": 4, "seconds": 1.0}]}}
    new = dict(old, gemm=[{"m": 2, "n": 2, "k": 2, "seconds": 0.5}], elementwise=[],
               collectives={"all_reduce": [{"bytes": 4, "seconds": 3.0}]})
    merged = extend(old, new)
    assert merged["gemm"] == [{"m": 1, "n": 1, "k": 1, "seconds": 1.0}, {"m": 2, "n": 2, "k": 2, "seconds": 0.5}]
    assert merged["elementwise"] == old["elementwise"]
    assert set(merged["collectives"]) == {"p2p", "all_reduce"}


def test_extend_refuses_another_device(tmp_path):
    out = tmp_path / "p.json"
    out.write_text(json.dumps({"schema_version": 1, "device": "cuda", "precision": "bf16", "ranks": 8}))
    result = CliRunner().invoke(cli, ["profile", "--device", "cpu", "-o", str(out), "--extend", "--quick"])
    assert result.exit_code == 2 and "same device" in result.output


def test_extend_refuses_a_damaged_profile_before_measuring(tmp_path):
    """A hand-edited profile (collectives a string) is named, exit 2, before any
    measurement runs (the CLI fuzzer found it as a traceback after the measurements)."""
    out = tmp_path / "p.json"
    doc = {"schema_version": 2, "device": "cpu", "precision": "fp32", "ranks": 1, "gemm": [], "elementwise": [],
           "collectives": "abc", "layers": []}
    out.write_text(json.dumps(doc))
    result = CliRunner().invoke(cli, ["profile", "--device", "cpu", "--nproc", "1", "-o", str(out), "--extend",
                                      "--quick"])
    assert result.exit_code == 2
    assert result.output.startswith(f"error: --extend {out}.collectives: expected a mapping")
    assert "measuring" not in result.output
    out.write_text(json.dumps(dict(doc, collectives={"p2p": [{"seconds": 1.0}]})))
    result = CliRunner().invoke(cli, ["profile", "--device", "cpu", "--nproc", "1", "-o", str(out), "--extend",
                                      "--quick"])
    assert result.exit_code == 2 and f"--extend {out}.collectives.p2p: expected a list" in result.output


def test_quick_layer_profile_writes_layer_kinds_that_plan_uses(tmp_path):
    out = tmp_path / "layers.json"
    result = CliRunner().invoke(cli, ["profile", "--device", "cpu", "--nproc", "1", "--model", "tiny-gpt", "--seq", "32",
                                      "--tp", "1,2", "-o", str(out), "--quick"])
    assert result.exit_code == 0, result.output
    assert "layer kinds of tiny-gpt at micro-batch 2, tp 2 (4/4)" in result.output   # progress
    layers = json.loads(out.read_text())["layers"]
    shapes = {(e["kind"], e["micro_batch_size"], e["tp"]) for e in layers}
    assert shapes == {(k, b, tp) for k in ("embedding", "layer", "head") for b in (1, 2) for tp in (1, 2)}
    assert all(e["seq_len"] == 32 and e["precision"] == "fp32" and e["forward_s"] > 0 and e["backward_s"] > 0
               for e in layers)
    layer = next(e for e in layers if (e["kind"], e["micro_batch_size"], e["tp"]) == ("layer", 2, 1))
    plan = CliRunner().invoke(cli, ["plan", "--model", "tiny-gpt", "--cluster", "cpu", "--gpus", "1",
                                    "--global-batch", "2", "--seq", "32", "--precision", "fp32",
                                    "--fix", "mbs=2", "--format", "json", "--profile", str(out)])
    assert plan.exit_code == 0, plan.output
    doc = json.loads(plan.stdout)
    head_and_embedding = sum(e["forward_s"] + e["backward_s"] for e in layers
                             if e["kind"] != "layer" and (e["micro_batch_size"], e["tp"]) == (2, 1))
    compute = 4 * (layer["forward_s"] + layer["backward_s"]) + head_and_embedding
    assert doc["estimate"]["time"]["compute_s"] == pytest.approx(compute, rel=1e-5)


def test_a_tp_that_does_not_shard_the_model_is_refused(tmp_path):
    result = CliRunner().invoke(cli, ["profile", "--nproc", "1", "--model", "tiny-llama", "--tp", "4",
                                      "-o", str(tmp_path / "p.json"), "--quick"])
    assert result.exit_code == 2 and "--tp: 4 does not divide num_key_value_heads 2" in result.output


def test_more_cpu_ranks_than_cores_are_refused(tmp_path, monkeypatch):
    """Found by bench/fuzz_cli.py: `--nproc 8` on two cores measured for 11 s, the ranks'
    contention for the cores rather than the machine."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    result = CliRunner().invoke(cli, ["profile", "--nproc", "3", "-o", str(tmp_path / "p.json"), "--quick"])
    assert result.exit_code == 2 and result.output.strip() == (
        "error: --nproc: 3 processes, one per CPU core, and this machine has 2 CPU cores; use --nproc 2 or fewer")
    assert not (tmp_path / "p.json").exists()


def test_extend_merges_layer_kinds_by_key():
    base = {"device": "cpu", "precision": "fp32", "ranks": 1, "gemm": [], "elementwise": [], "collectives": {}}
    point = {"kind": "layer", "model": {"hidden_size": 64}, "model_name": "m", "seq_len": 64, "precision": "fp32",
             "attention": "flash", "micro_batch_size": 1, "tp": 1, "forward_s": 1.0, "backward_s": 2.0}
    old = dict(base, layers=[point, dict(point, micro_batch_size=2)])
    new = dict(base, layers=[dict(point, forward_s=0.5), dict(point, seq_len=128)])
    merged = extend(old, new)["layers"]
    assert [(p["seq_len"], p["micro_batch_size"], p["forward_s"]) for p in merged] == [(64, 1, 0.5), (64, 2, 1.0),
                                                                                       (128, 1, 1.0)]
    assert extend(dict(base), dict(base, layers=[]))["layers"] == []   # a version 1 profile has none


def test_the_roofline_sweep_grows_until_its_time_limit():
    """With no time to spare the sweep measures one size of each and says neither
    settled; with time it grows the GEMM by doubling its side."""
    import torch

    from executor.measure import measure_roofline

    cpu = torch.device("cpu")
    gemm, passes, settled = measure_roofline(cpu, torch.float32, reps=1, max_seconds=0.0)
    assert [p["m"] for p in gemm] == [256] and len(passes) == 1
    assert settled == {"gemm_settled": False, "bandwidth_settled": False}
    gemm, _, _ = measure_roofline(cpu, torch.float32, reps=1, max_seconds=0.05)
    dims = [p["m"] for p in gemm]
    assert dims == [256 * 2 ** i for i in range(len(dims))] and all(p["m"] == p["n"] == p["k"] for p in gemm)
