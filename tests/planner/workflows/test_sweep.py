"""Capacity planning (`shardwise sweep`): each size's plan is the plan `shardwise plan
--gpus N` makes; scaling efficiency, time, cost and energy to train equal their hand
formulas; a size that cannot be built or where nothing fits is a row saying why; bad
sizes exit 2 naming --gpus, no size planning exits 3; the PNG is read back; the
progress bar writes to its console only when that is a terminal."""

from __future__ import annotations

import io
import json

import pytest
from click.testing import CliRunner
from matplotlib.image import imread
from rich.console import Console

from costmodel.specs.loading import SpecError
from planner.api import plan
from planner.console.cli import main
from planner.console.plots import (
    FIGURE_DPI,
    SECONDS_PER_DAY,
    SWEEP_COLOURS,
    SWEEP_FIGURE_SIZE_IN,
    sweep_figure,
)
from planner.console.progress import progress_bar
from planner.plan_file import dumps, strategy_of
from planner.search.space import describe
from planner.workflows.sweep import IMPOSSIBLE, INFEASIBLE, OK, parse_sizes, sweep

JOB = dict(global_batch=64, seq_len=2048)       # llama2-7b, small enough to plan in a fraction of a second
SIZES = (8, 16, 32)
TOKENS = 300e9
A100_PRICE_USD_PER_GPU_HOUR = 5.12              # configs/clusters/dgx-a100-80gb.yaml
CLI_JOB = ["--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--global-batch", "64", "--seq", "2048"]


@pytest.fixture(scope="module")
def rows():
    return sweep("llama2-7b", "dgx-a100-80gb", SIZES, JOB["global_batch"], seq_len=JOB["seq_len"], tokens=TOKENS)


@pytest.fixture(scope="module")
def docs():
    return {n: plan("llama2-7b", "dgx-a100-80gb", JOB["global_batch"], gpus=n, seq_len=JOB["seq_len"])
            for n in SIZES}


def test_size_ranges_read_as_documented():
    assert parse_sizes("8..1024") == (8, 16, 32, 64, 128, 256, 512, 1024)
    assert parse_sizes("8,16,48") == (8, 16, 48)
    assert parse_sizes("8..64, 96,8") == (8, 16, 32, 64, 96)
    assert parse_sizes("12..48") == (12, 24, 48)
    for bad in ("", "8..", "a..b", "0", "-8", "8.5", "8..1000", "64..8", "8,,16"):
        with pytest.raises(SpecError) as err:
            parse_sizes(bad)
        assert err.value.field == "--gpus", bad


def test_each_size_is_the_plan_a_single_plan_call_makes(rows, docs):
    assert [r.gpus for r in rows] == list(SIZES) and all(r.status == OK for r in rows)
    for r in rows:
        doc = docs[r.gpus]
        assert dumps(r.plan) == dumps(doc)
        s = strategy_of(doc)
        assert r.strategy == f"{describe(s)} recompute={s.recompute}"
        e = doc["estimate"]   # plan files round to 6 digits
        assert r.step_time_s == pytest.approx(e["step_time_s"], rel=1e-5)
        assert r.tokens_per_s == pytest.approx(e["tokens_per_s"], rel=1e-5)
        assert r.tokens_per_s_per_gpu == pytest.approx(e["tokens_per_s"] / r.gpus, rel=1e-5)
        assert r.mfu == pytest.approx(e["mfu"], rel=1e-5)
        assert r.peak_memory_bytes == pytest.approx(e["peak_memory_bytes"], rel=1e-5)
    # The CLI's plan, byte for byte.
    out = CliRunner().invoke(main, ["plan", *CLI_JOB, "--gpus", "16", "--format", "json"])
    assert out.exit_code == 0, out.output
    assert out.stdout == dumps(rows[1].plan)


def test_scaling_efficiency_is_per_gpu_throughput_against_the_smallest_size(rows, docs):
    base = docs[8]["estimate"]["tokens_per_s"] / 8
    assert rows[0].scaling_efficiency == 1.0
    for r in rows[1:]:
        assert r.scaling_efficiency == pytest.approx(docs[r.gpus]["estimate"]["tokens_per_s"] / r.gpus / base,
                                                     rel=1e-5)
    # No direction asserted: 8 GPUs may need recompute that 32 do not (PyTorch's 16-bit
    # activations), which makes 32 GPUs more efficient per GPU.


def test_time_cost_and_energy_to_train_equal_the_per_step_figures(rows, docs):
    for r in rows:
        doc = docs[r.gpus]
        steps = TOKENS / (64 * 2048)
        step_s = doc["estimate"]["step_time_s"]
        assert r.train_steps == pytest.approx(steps, rel=1e-12)
        assert r.train_time_s == pytest.approx(TOKENS / doc["estimate"]["tokens_per_s"], rel=1e-5)
        assert r.train_time_s == pytest.approx(steps * step_s, rel=1e-5)
        # USD: every GPU rented for every step (costmodel.estimate.energy).
        assert r.train_cost_usd == pytest.approx(steps * step_s * r.gpus * A100_PRICE_USD_PER_GPU_HOUR / 3600,
                                                 rel=1e-5)
        assert r.train_energy_j == pytest.approx(steps * doc["cost_energy"]["energy_per_step_j"], rel=1e-5)


def test_figures_a_cluster_lacks_are_none_and_no_budget_gives_none():
    h200 = sweep("llama2-7b", "dgx-h200", (8,), 64, seq_len=2048, tokens=TOKENS)[0]   # power figures, no price
    assert h200.train_cost_usd is None and h200.train_energy_j > 0 and h200.train_time_s > 0
    plain = sweep("llama2-7b", "dgx-a100-80gb", (8,), 64, seq_len=2048)[0]
    assert (plain.train_steps, plain.train_time_s, plain.train_cost_usd, plain.train_energy_j) == (None,) * 4


@pytest.fixture(scope="module")
def mixed_rows():
    """llama3-70b: 8 H100s hold no plan of it, 12 is no whole number of nodes, 16 plans."""
    return sweep("llama3-70b", "dgx-h100", "8,12,16", 16, seq_len=2048)


def test_sizes_without_a_plan_are_rows_that_say_why(mixed_rows):
    eight, twelve, sixteen = mixed_rows
    assert eight.status == INFEASIBLE and eight.plan is None and eight.tokens_per_s is None
    assert eight.reason.startswith("stage ") and "H100-SXM has 80 GiB" in eight.reason
    assert twelve.status == IMPOSSIBLE and twelve.reason == "--gpus: 12 is not a whole number of 8-GPU nodes"
    # The smallest size that plans is the base of the efficiency.
    assert sixteen.status == OK and sixteen.scaling_efficiency == 1.0


def test_cli_table_json_and_output_file(tmp_path):
    out = CliRunner().invoke(main, ["sweep", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "8,12,16",
                                    "--global-batch", "16", "--seq", "2048", "--tokens", "1e9"])
    assert out.exit_code == 0, out.output
    assert "infeasible" in out.stdout and "impossible" in out.stdout   # the no-plan rows (wrapped at 80 columns)
    assert "12 GPUs: --gpus: 12 is not a whole number of 8-GPU nodes" in out.stdout
    assert "Training 1e+09 tokens" in out.stdout
    path = tmp_path / "sweep.json"
    js = CliRunner().invoke(main, ["sweep", *CLI_JOB, "--gpus", "8,16", "--tokens", "300e9", "--format", "json",
                                   "-o", str(path)])
    assert js.exit_code == 0, js.output
    doc = json.loads(js.stdout)
    assert path.read_text() == js.stdout and js.stderr == f"sweep written to {path}\n"
    assert (doc["model"], doc["cluster"], doc["tokens"]) == ("llama2-7b", "dgx-a100-80gb", 300e9)
    assert [r["gpus"] for r in doc["rows"]] == [8, 16] and doc["rows"][0]["scaling_efficiency"] == 1.0
    assert "plan" not in doc["rows"][0]


@pytest.mark.parametrize("gpus, message", [
    ("8..1000", "error: --gpus: 8..1000: 1000 is not 8 times a power of two (try 8..512 or 8..1024)"),
    ("x", "error: --gpus: expected an integer, got 'x'"),
    ("64..8", "error: --gpus: 64..8: the range ends below its start"),
    ("12,20", "error: --gpus: 12 is not a whole number of 8-GPU nodes"),   # no size can be built
])
def test_bad_sizes_exit_2_naming_gpus(gpus, message):
    out = CliRunner().invoke(main, ["sweep", *CLI_JOB, "--gpus", gpus])
    assert out.exit_code == 2 and out.stderr == message + "\n" and out.stdout == ""


@pytest.mark.parametrize("extra, field", [(["--tokens", "-1"], "--tokens"), (["--fix", "mbs=3"], "--fix mbs"),
                                          (["--objective", "speed"], "--objective"),
                                          (["--plot", "/no/such/dir/x.png"], "--plot")])
def test_other_bad_input_exits_2_naming_the_field(extra, field):
    out = CliRunner().invoke(main, ["sweep", *CLI_JOB, "--gpus", "8,16", *extra])
    assert out.exit_code == 2 and out.stderr.startswith(f"error: {field}: ") and out.stderr.count("\n") == 1


def test_no_size_planning_exits_3_with_the_reasons():
    out = CliRunner().invoke(main, ["sweep", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "4,8",
                                    "--global-batch", "16", "--seq", "2048"])
    assert out.exit_code == 3
    assert out.stderr.startswith("error: no size plans: 4 GPUs: stage ") and "; 8 GPUs: stage " in out.stderr
    assert out.stderr.count("\n") == 1


def test_the_figure_draws_the_rows_and_the_ideal_line(mixed_rows):
    rows = sweep("llama2-7b", "dgx-a100-80gb", "4,8,12,16", 64, seq_len=2048, tokens=TOKENS)
    planned = [r for r in rows if r.status == OK]
    fig = sweep_figure(rows, "t", TOKENS)
    throughput, efficiency, days = fig.axes
    assert throughput.get_xscale() == "log" and throughput.xaxis.get_transform().base == 2
    measured, ideal = throughput.get_lines()[:2]
    assert list(measured.get_xdata()) == [4, 8, 16]
    assert list(measured.get_ydata()) == [r.tokens_per_s for r in planned]
    assert list(ideal.get_ydata()) == pytest.approx([planned[0].tokens_per_s * n / 4 for n in (4, 8, 16)], rel=1e-12)
    assert list(efficiency.get_lines()[0].get_ydata()) == [r.scaling_efficiency for r in planned]
    assert list(days.get_lines()[0].get_ydata()) == [r.train_time_s / SECONDS_PER_DAY for r in planned]
    # The size without a plan (12) is a dotted line on every panel.
    for ax in fig.axes:
        marks = [line for line in ax.get_lines() if line.get_color() == SWEEP_COLOURS["no_plan"]]
        assert [list(line.get_xdata()) for line in marks] == [[12, 12]]
    assert len(sweep_figure(rows, "t").axes) == 2   # no budget: no time-to-train panel


def test_cli_plot_reads_back_at_its_size_and_is_the_same_bytes_twice(tmp_path):
    paths = [tmp_path / "a.png", tmp_path / "b.png"]
    for path in paths:
        out = CliRunner().invoke(main, ["sweep", *CLI_JOB, "--gpus", "8..32", "--tokens", "300e9",
                                        "--plot", str(path)])
        assert out.exit_code == 0, out.output
        assert f"plot written to {path}" in out.stdout
    data = paths[0].read_bytes()
    assert data == paths[1].read_bytes() and b"Matplotlib" not in data
    width, height = (round(side * FIGURE_DPI) for side in SWEEP_FIGURE_SIZE_IN)
    assert imread(io.BytesIO(data), format="png").shape[:2] == (height, width)


def test_progress_bar_draws_only_on_a_terminal_and_never_on_stdout(capsys):
    terminal = Console(file=io.StringIO(), force_terminal=True, width=80)
    with progress_bar("sweep", terminal) as update:
        update(1, 3, "planning 16 GPUs")
    drawn = terminal.file.getvalue()
    assert "planning 16 GPUs" in drawn and "1/3" in drawn   # the last frame, relabelled
    assert drawn.endswith("\x1b[2K")                       # transient: the bar erases itself
    piped = Console(file=io.StringIO(), force_terminal=False)
    with progress_bar("sweep", piped) as update:
        update(1, 3, "planning 16 GPUs")
    assert piped.file.getvalue() == ""
    assert capsys.readouterr().out == ""
