"""planner.console.cli: exit codes and one-line messages.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from planner.console.cli import main
from planner.search import partition
from planner.search.partition import Solution


@pytest.mark.parametrize("args, code, text", [
    (["--model", "nope"], 2, "--model"),
    (["--fix", "tp=3"], 2, "--fix tp"),
    (["--global-batch", "-4"], 2, "--global-batch"),
    (["--fix", "mbs=3"], 2, "--fix mbs"),
])
def test_cli_bad_input_exits_2_with_one_line(args, code, text):
    base = {"--model": "llama2-7b", "--cluster": "dgx-h100", "--nodes": "1", "--global-batch": "64"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = ["plan"] + [x for kv in base.items() for x in kv]
    out = CliRunner().invoke(main, argv)
    assert out.exit_code == code
    assert text in out.output and "Traceback" not in out.output
    assert len(out.output.strip().splitlines()) == 1



def test_cli_infeasible_exits_3_naming_memory():
    out = CliRunner().invoke(main, ["plan", "--model", "gpt3-175b", "--cluster", "dgx-a100-80gb",
                                    "--nodes", "2", "--global-batch", "64", "--seq", "2048"])
    assert out.exit_code == 3
    assert "needs" in out.output and "GiB" in out.output and "would fit if you use" in out.output


# The two requests issue 19 found the search wrong on, priced as that issue priced them:
# Megatron-LM's runtime and 16-bit recipe, memory checked at the estimate itself.
ISSUE_19 = ["--runtime", "megatron", "--memory-margin", "0"]
GPT3_16_LAYERS = ["plan", "--model", "gpt3-175b", "--set", "num_hidden_layers=16", "--cluster", "dgx-a100-80gb",
                  "--gpus", "32", "--global-batch", "64", "--seq", "2048", "--rules", "megatron", "--format", "json",
                  *ISSUE_19]
LLAMA2_40_LAYERS = ["plan", "--model", "llama2-70b", "--set", "num_hidden_layers=40", "--cluster", "dgx-a100-80gb",
                    "--gpus", "8", "--global-batch", "32", "--seq", "4096", "--fix", "dp=8,mbs=4", *ISSUE_19]


def test_the_search_finds_the_plan_its_bounds_once_pruned():
    """dp 16, tp 2, mbs 4 (one micro-batch: activations and gradients never coexist)
    is the fastest; the bounds once pruned it and returned dp 8 tp 4, 3.5% slower."""
    best = json.loads(CliRunner().invoke(main, GPT3_16_LAYERS).output)
    pinned = json.loads(CliRunner().invoke(main, GPT3_16_LAYERS + ["--fix", "dp=16,tp=2,mbs=4"]).output)
    assert best["estimate"]["step_time_s"] == pinned["estimate"]["step_time_s"]
    assert (best["strategy"]["dp"], best["strategy"]["tp"], best["strategy"]["micro_batch_size"]) == (16, 2, 4)
    assert best["search"]["gap"] == 0.0 and best["search"]["solver_timeouts"] == 0


def test_a_plan_over_the_memory_limit_exits_3():
    """Its only fitting candidate, ZeRO-3 with every layer recomputed, needs 78.1 GiB in
    full where 76 GiB are usable: exit 3 naming both, not a plan."""
    out = CliRunner().invoke(main, LLAMA2_40_LAYERS)
    assert out.exit_code == 3
    assert "needs 78.1 GiB" in out.output and "76.0 GiB usable" in out.output and "zero3" in out.output


def test_a_solver_time_out_is_reported_in_the_plan_and_on_stderr(monkeypatch):
    """A partition program ended by the time limit: the plan records it with the gap it
    leaves, and stderr says so."""
    from planner.search import uniform

    real = uniform.solve_partition

    def timing_out(*args, **kwargs):
        solution = real(*args, **kwargs)
        return replace(solution, timed_out=True, gap=0.02) if isinstance(solution, Solution) else solution

    monkeypatch.setattr(uniform, "solve_partition", timing_out)
    out = CliRunner().invoke(main, GPT3_16_LAYERS)
    assert out.exit_code == 0
    doc = json.loads(out.stdout)
    assert 1 <= doc["search"]["solver_timeouts"] <= doc["search"]["ilp_solves"]
    assert doc["search"]["gap"] == pytest.approx(0.02)
    assert "time limit ended" in out.stderr


def test_no_plan_for_want_of_solver_time_says_so(monkeypatch):
    monkeypatch.setattr(partition, "DETERMINISTIC_TIME_LIMIT", 0.0)
    out = CliRunner().invoke(main, ["plan", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-40gb", "--gpus", "8",
                                    "--global-batch", "32", "--seq", "2048"])
    assert out.exit_code == 3
    assert "time limit" in out.output and "--fix" in out.output
    # A larger cluster's programs are no easier: no relaxation search, no claim about one.
    assert "relaxation" not in out.output


def test_plans_carry_the_runtime_band_and_check_memory_at_its_high_side():
    args = ["plan", "--model", "llama2-7b", "--cluster", "dgx-a100-40gb", "--gpus", "8", "--global-batch", "32",
            "--seq", "4096", "--top", "1", "--format", "json"]
    doc = json.loads(CliRunner().invoke(main, args).output)
    runtime, e, band = doc["runtime"], doc["estimate"], doc["band"]
    # Each figure is written with 6 significant digits (plan_file.FLOAT_DIGITS): a product
    # of two written figures agrees with the written band to 1e-5.
    assert band["step_time_low_s"] == pytest.approx(e["step_time_s"] * runtime["step_time_low_ratio"], rel=1e-5)
    assert band["step_time_high_s"] == pytest.approx(e["step_time_s"] * runtime["step_time_high_ratio"], rel=1e-5)
    assert band["peak_memory_high_bytes"] == pytest.approx(e["peak_memory_bytes"] * runtime["memory_high_ratio"],
                                                           rel=1e-5)
    assert band["peak_memory_high_bytes"] <= 40 * 2**30 * 0.95 * (1 + 1e-9)   # the high side fits
    # A margin so large that nothing fits: exit 3, the message naming both limits.
    out = CliRunner().invoke(main, args[:-2] + ["--memory-margin", "9"])
    assert out.exit_code == 3 and "memory_margin 9" in out.output


def test_a_bad_memory_margin_is_named():
    out = CliRunner().invoke(main, ["plan", "--model", "llama2-7b", "--cluster", "dgx-a100-40gb", "--gpus", "8",
                                    "--global-batch", "32", "--memory-margin", "-1"])
    assert out.exit_code == 2 and "--memory-margin" in out.output and "Traceback" not in out.output


# -- issue 21's holes: each is exit 2 (or a quick exit 3) with one line, nothing written ------

TINY = ["--model", "tiny-gpt", "--cluster", "cpu", "--gpus", "2", "--global-batch", "8", "--seq", "16",
        "--precision", "fp32"]


def _one_line(out, code, text):
    assert out.exit_code == code, out.output
    assert "Traceback" not in out.output and out.exception is None or isinstance(out.exception, SystemExit)
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], out.output


@pytest.mark.parametrize("extra, text", [
    (["--seq", "1e300"], "--seq: must be at most 9007199254740992, got 1e+300"),
    (["--global-batch", "nan"], "--global-batch"),
    (["--format", "yaml"], "--format: 'yaml' is not one of 'table', 'json'"),
    (["--bogus", "1"], "--bogus: No such option"),
])
def test_plan_odd_numbers_and_click_usage_errors_are_one_line(extra, text):
    _one_line(CliRunner().invoke(main, ["plan", *TINY, *extra]), 2, text)


def test_a_billion_nodes_answer_at_once():
    out = CliRunner().invoke(main, ["plan", "--model", "gpt3-175b", "--cluster", "dgx-a100-80gb",
                                    "--nodes", "1000000000", "--global-batch", "1536"])
    _one_line(out, 3, "does not divide --global-batch 1536")


@pytest.mark.parametrize("output", ["missing/p.json", "folder", "file/p.json", "n" * 300 + ".json"])
def test_an_unwritable_output_is_refused_before_the_work(tmp_path, monkeypatch, output):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("x")
    before = sorted(p.name for p in tmp_path.iterdir())
    _one_line(CliRunner().invoke(main, ["plan", *TINY, "-o", output]), 2, "-o: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _edited_plan(tmp_path, **strategy):
    plan = tmp_path / "p.json"
    assert CliRunner().invoke(main, ["plan", *TINY, "-o", str(plan)]).exit_code == 0
    doc = json.loads(plan.read_text())
    doc["strategy"].update(strategy)
    plan.write_text(json.dumps(doc))
    return str(plan)


@pytest.mark.parametrize("command", [["explain"], ["export", "--to", "megatron"], ["replan", "--gpus", "4"]])
def test_every_reader_refuses_a_hand_edited_plan(tmp_path, command):
    plan = _edited_plan(tmp_path, tp=3)
    out = CliRunner().invoke(main, [command[0], plan, *command[1:]])
    _one_line(out, 2, "plan.strategy: dp 2 x tp 3 x pp 1 = 6 ranks, but the plan's cluster has 2 GPUs")


def test_plot_must_be_png_and_version_prints(tmp_path):
    plan = _edited_plan(tmp_path)
    _one_line(CliRunner().invoke(main, ["explain", plan, "--plot", str(tmp_path / "x.jpg")]), 2,
              "--plot: ")
    assert not (tmp_path / "x.jpg").exists()
    out = CliRunner().invoke(main, ["--version"])
    assert out.exit_code == 0 and out.output.startswith("shardwise ")


@pytest.mark.parametrize("fix, text", [
    ("vpp=2,pp=1", "--fix vpp: vpp 2 needs pp > 1"),
    ("dp=2,dp=1", "--fix dp: given twice (2 and 1)"),
    ("mbs=2,micro_batch_size=4", "--fix micro_batch_size: pins mbs a second time"),
])
def test_contradictory_and_repeated_pins_are_bad_input(fix, text):
    _one_line(CliRunner().invoke(main, ["plan", *TINY, "--fix", fix]), 2, text)


def test_evaluate_refuses_a_zero_micro_batch_and_names_hardware_rightly(tmp_path):
    out = CliRunner().invoke(main, ["evaluate", "--from", "megatron", "--micro-batch-size 0 --global-batch-size 64",
                                    "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80gb", "--gpus", "8"])
    _one_line(out, 2, "--micro-batch-size: must be at least 1, got 0")
    cluster = tmp_path / "c.yaml"
    cluster.write_text("name: c\ngpu: no-such-gpu\ngpus_per_node: 8\nintra_node: nvlink3\ninter_node: ib-hdr\n")
    out = CliRunner().invoke(main, ["plan", "--model", "gpt3-1.3b", "--cluster", str(cluster), "--gpus", "8",
                                    "--global-batch", "64"])
    assert out.exit_code == 2 and "unknown GPU 'no-such-gpu'" in out.output, out.output


def test_models_and_clusters_list_the_built_ins_one_line_each():
    from costmodel.specs.loading import builtin_names

    out = CliRunner().invoke(main, ["models"])
    lines = out.output.strip().splitlines()
    assert out.exit_code == 0 and [line.split()[0] for line in lines] == builtin_names("models")
    assert any(line.startswith("gpt3-175b") and "174.62B" in line and "96 layers" in line for line in lines)
    assert any(line.startswith("mixtral-8x7b") and "8 experts top-2" in line for line in lines)
    out = CliRunner().invoke(main, ["clusters"])
    lines = out.output.strip().splitlines()
    assert out.exit_code == 0 and [line.split()[0] for line in lines] == builtin_names("clusters")
    assert any(line.startswith("dgx-h100") and "H100-SXM x 8/node, 80 GiB, 989 TFLOP/s bf16" in line for line in lines)
    assert any(line.startswith("gb200-nvl72") and "GB200 x 4/node (72-GPU NVLink domain), 173 GiB, 2500 TFLOP/s bf16, "
               "links 900 GB/s in domain" in line for line in lines)


def test_a_plan_file_is_a_model_spec(tmp_path):
    plan = _edited_plan(tmp_path)
    again = CliRunner().invoke(main, ["plan", *TINY[2:], "--model", plan, "--format", "json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.output)["model_fingerprint"] == json.loads(open(plan).read())["model_fingerprint"]


def test_compare_puts_plans_side_by_side_and_says_why_the_fastest_wins(tmp_path):
    paths = []
    for name, fix in (("tp2", "tp=2,dp=1"), ("dp2", "dp=2,tp=1")):
        path = tmp_path / f"{name}.json"
        assert CliRunner().invoke(main, ["plan", *TINY, "--fix", fix, "-o", str(path)]).exit_code == 0
        paths.append(str(path))
    docs = [json.loads(open(p).read()) for p in paths]
    out = CliRunner().invoke(main, ["compare", *paths], terminal_width=200)
    assert out.exit_code == 0, out.output
    assert "tp2 → dp2: dp 1→2, tp 2→1" in out.output
    fast, slow = sorted(range(2), key=lambda i: docs[i]["estimate"]["step_time_s"])
    gap = docs[slow]["estimate"]["step_time_s"] - docs[fast]["estimate"]["step_time_s"]
    names = ["tp2", "dp2"]
    assert f"{names[fast]} is {gap:.3f} s per step faster than {names[slow]}" in out.output
    for doc in docs:
        assert f"{doc['estimate']['step_time_s']:.3f}" in out.output
    _one_line(CliRunner().invoke(main, ["compare", paths[0]]), 2, "PLAN_FILES: give two plan files or more")


def test_profile_help_plans_on_the_fp32_only_spec_profile_writes(tmp_path):
    """`profile` measures fp32 by default, so the spec it writes has an fp32 peak only:
    the `plan` line its --help shows must ask for fp32, and a bf16 plan says what to pass."""
    from pathlib import Path

    import yaml

    import configs

    CONFIGS_DIR = Path(configs.__file__).parent
    cluster = yaml.safe_load((CONFIGS_DIR / "clusters" / "cpu.yaml").read_text())
    gpu = yaml.safe_load((CONFIGS_DIR / "hardware" / "cpu.yaml").read_text())
    gpu["peak_flops_per_s"] = {"fp32": gpu["peak_flops_per_s"]["fp32"]}
    (tmp_path / "my-cpu.yaml").write_text(yaml.safe_dump({**cluster, "name": "my-cpu", "gpu": gpu}))
    help_text = CliRunner().invoke(main, ["profile", "--help"]).output
    line = next(line.strip() for line in help_text.splitlines() if "plan" in line and "my-cpu.yaml" in line)
    argv = line.removeprefix("shardwise ").replace("my-cpu.yaml", str(tmp_path / "my-cpu.yaml")).split()
    out = CliRunner().invoke(main, argv)
    assert out.exit_code == 0, out.output
    bf16 = [arg for arg in argv if arg not in ("--precision", "fp32")]
    _one_line(CliRunner().invoke(main, bf16), 2, "--precision: CPU has no bf16 peak (has: fp32; pass one of those)")


def test_plan_top_k_shows_the_compare_table_of_the_k_best():
    args = ["plan", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-40gb", "--gpus", "8", "--global-batch", "64",
            "--top", "3"]
    doc = json.loads(CliRunner().invoke(main, [*args, "--format", "json"]).output)
    out = CliRunner().invoke(main, args, terminal_width=200).output
    docs = [doc] + [{**doc, **alt} for alt in doc["alternatives"]]
    assert len(docs) == 3 and "Plans, best first" in out and out.startswith("gpt3-1.3b (1.32B parameters) on ")
    h = 2048   # 24 GPT layers of 12h^2 + 13h, vocabulary 51200 and 2048 learned positions, the final norm
    assert doc["total_params"] == doc["active_params"] == 24 * (12 * h * h + 13 * h) + 51200 * h + 2048 * h + 2 * h
    header = next(line for line in out.splitlines() if "#1" in line)
    assert "#2" in header and "#3" in header
    step_row = next(line for line in out.splitlines() if line.startswith("│ step s "))
    assert [c.strip() for c in step_row.split("│")[2:-1]] == [f"{d['estimate']['step_time_s']:.3f}" for d in docs]
    assert "#1 → #2: " in out and "#1 is " in out and " per step faster than #2" in out


@pytest.mark.parametrize("model, field", [("gpt-oss-20b", "attention_window"), ("gemma3-1b", "attention_window"),
                                          ("tiny-deepseek", "num_nextn_predict_layers, kv_lora_rank, mlp_only_layers"),
                                          ("tiny-qwen3-moe", "mlp_only_layers")])
def test_profile_refuses_a_model_the_executor_does_not_build(tmp_path, model, field):
    """Its layers would be timed as the built-in block, which they are not."""
    out = CliRunner().invoke(main, ["profile", "--model", model, "-o", str(tmp_path / "p.json")])
    assert out.exit_code == 2
    assert f"--model: {model}: the executor's built-in model does not build its {field}" in out.output
    assert not (tmp_path / "p.json").exists()
