"""`shardwise profile` on this machine: a quick profile of two CPU ranks fits into a
cluster spec the planner loads, and --extend merges measurements by shape."""

import json

import yaml
from click.testing import CliRunner

from costmodel.loading import load_cluster
from executor.profile import extend
from planner.cli import main as cli


def test_quick_profile_fits_a_loadable_cluster(tmp_path):
    out, spec = tmp_path / "cpu.json", tmp_path / "mine.yaml"
    result = CliRunner().invoke(cli, ["profile", "--device", "cpu", "--nproc", "2", "-o", str(out),
                                      "--spec-out", str(spec), "--quick"])
    assert result.exit_code == 0, result.output
    profile = json.loads(out.read_text())
    assert profile["schema_version"] == 1 and profile["ranks"] == 2
    assert {"all_reduce", "all_gather", "reduce_scatter", "p2p"} == set(profile["collectives"])
    assert all(p["seconds"] > 0 for pts in profile["collectives"].values() for p in pts)
    cluster = load_cluster(str(spec))
    assert cluster.gpus_per_node == 2 and cluster.comm_overlap == 0.0
    assert 1e9 < cluster.gpu.peak_for("fp32") < 1e13   # a CPU core, within reason
    assert "&id" not in spec.read_text()               # plain YAML, no anchors


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
