"""Objectives time / cost / energy, the cost and energy budgets and the Pareto front,
against a brute-force evaluation of every candidate of a small space (tiny-gpt on 4 CPU
ranks given a price and power figures)."""

import json
from dataclasses import replace

import pytest
import yaml
from click.testing import CliRunner

from costmodel.estimate import estimate
from costmodel.estimate.energy import cost_energy
from costmodel.estimate.uniform import unit_costs
from costmodel.problem import Problem
from costmodel.specs.loading import (
    SpecError,
    configs_dir,
    load_cluster,
    load_model,
    make_training,
)
from costmodel.strategy import even_stages
from planner.console.cli import main
from planner.plan_file import plan_document
from planner.rules import load_rules, rules_from_dict
from planner.search import search
from planner.search.partition import TimedOut, solve_partition
from planner.search.result import (
    Candidate,
    Kept,
    finish,
    order_key,
    score,
    solve_in_bound_order,
)
from planner.search.space import enumerate_space, recompute_modes

BUSY_W, IDLE_W, PRICE = 100.0, 20.0, 1.0
ARGS = ["--model", "tiny-gpt", "--gpus", "4", "--global-batch", "8", "--seq", "32"]


@pytest.fixture(scope="module")
def cluster_file(tmp_path_factory):
    data = yaml.safe_load((configs_dir("clusters") / "cpu.yaml").read_text())
    data["gpu"] = {**yaml.safe_load((configs_dir("hardware") / "cpu.yaml").read_text()),
                   "busy_power_w": BUSY_W, "idle_power_w": IDLE_W}
    data["gpu_hour_price_usd"] = PRICE
    path = tmp_path_factory.mktemp("clusters") / "priced-cpu.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def problem(cluster_file):
    spec, cluster = load_model("tiny-gpt"), load_cluster(cluster_file, gpus=4)
    return Problem(spec, cluster, make_training(spec, cluster, 8, 32))


@pytest.fixture(scope="module")
def brute(problem):
    """Every candidate of the space at its time-optimal partition: (time, cost, energy, strategy)."""
    rules = load_rules()
    space, _ = enumerate_space(problem, rules)
    modes = recompute_modes(problem, rules)
    rows = []
    for s in space:
        units = unit_costs(problem, s)
        solution = solve_partition(problem, units, s, modes, rules)
        if solution is None:
            continue
        e = estimate(problem, solution.strategy, units)
        f = cost_energy(problem.cluster, solution.strategy, e)
        rows.append((e.step_time_s, f.cost_per_step_usd, f.energy_per_step_j, solution.strategy))
    assert len(rows) > 20
    return rows


def _shape(strategy):
    """A strategy without its partition (ties between equally good partitions may go
    either way once the search passes the program a cutoff)."""
    return replace(strategy, stages=(), recompute="none")


def _argmin(rows, i):
    best = min(r[i] for r in rows)
    return best, {_shape(r[3]) for r in rows if r[i] == best}


@pytest.mark.parametrize("objective, column", [("time", 0), ("cost", 1), ("energy", 2)])
def test_each_objective_picks_the_brute_force_minimum(problem, brute, objective, column):
    result = search(problem, replace(load_rules(), objective=objective), top=1)
    best, winners = _argmin(brute, column)
    figures = cost_energy(problem.cluster, result.best.strategy, result.best.estimate)
    got = (result.best.estimate.step_time_s, figures.cost_per_step_usd, figures.energy_per_step_j)[column]
    assert got == pytest.approx(best, rel=1e-12)
    assert _shape(result.best.strategy) in winners


def test_energy_objective_changes_the_plan_where_the_numbers_say_so(problem, brute):
    # Brute force: the fastest plans are not the most frugal ones here (pipeline bubbles
    # idle at 20 W instead of 100 W), so the energy objective must choose differently.
    assert not (_argmin(brute, 0)[1] & _argmin(brute, 2)[1])
    fastest = search(problem, load_rules(), top=1).best.strategy
    frugal = search(problem, replace(load_rules(), objective="energy"), top=1).best.strategy
    assert _shape(fastest) != _shape(frugal)
    # Cost is proportional to time at a fixed GPU count: the same plan.
    assert search(problem, replace(load_rules(), objective="cost"), top=1).best.strategy == fastest


def test_pareto_front_equals_brute_force(problem, brute):
    points = [(t, c, e) for t, c, e, _ in brute]
    expected = {s for (t, c, e, s) in brute
                if not any(q[0] <= t and q[1] <= c and q[2] <= e and q != (t, c, e) for q in points)}
    result = search(problem, load_rules(), top=3, pareto=True)
    assert {c.strategy for c in result.pareto} == expected
    times = [c.estimate.step_time_s for c in result.pareto]
    assert times == sorted(times)
    doc = plan_document(problem, "default", result)
    assert len(doc["pareto"]) == len(expected) and all("cost_energy" in c for c in doc["pareto"])


def test_energy_budget_keeps_the_fastest_plan_within_it(problem, brute):
    energies = sorted(r[2] for r in brute)
    budget = energies[len(energies) // 4]
    within = [r for r in brute if r[2] <= budget]
    result = search(problem, replace(load_rules(), energy_budget_j=budget), top=1)
    assert result.best.estimate.step_time_s == pytest.approx(min(r[0] for r in within), rel=1e-12)
    assert cost_energy(problem.cluster, result.best.strategy, result.best.estimate).energy_per_step_j <= budget


@pytest.mark.parametrize("option, value, text", [
    ("--energy-budget", "1e-9", "raise --energy-budget to"),
    ("--max-cost-per-step", "1e-12", "raise --max-cost-per-step to"),
    ("--power-cap", "10", "raise --power-cap to"),        # below the 20 W idle draw
])
def test_budgets_nothing_meets_exit_3_naming_the_budget(cluster_file, brute, option, value, text):
    out = CliRunner().invoke(main, ["plan", "--cluster", str(cluster_file), *ARGS, option, value])
    assert out.exit_code == 3, out.output
    assert f"{option} {float(value):g}" in out.output and text in out.output
    # The relaxation names the least value a plan meets (the brute-force minimum), rounded up.
    column = {"--energy-budget": 2, "--max-cost-per-step": 1}.get(option)
    if column is not None:
        least = min(r[column] for r in brute)
        suggested = float(out.output.split(f"raise {option} to ")[1].split()[0])
        assert least <= suggested <= least * (1 + 1e-5)


def test_cli_objective_and_pareto_in_json(cluster_file, brute):
    out = CliRunner().invoke(main, ["plan", "--cluster", str(cluster_file), *ARGS, "--objective", "energy",
                                    "--pareto", "--format", "json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["cost_energy"]["energy_per_step_j"] == pytest.approx(_argmin(brute, 2)[0], rel=1e-5)
    assert doc["pareto"] and doc["cluster"]["gpu_hour_price_usd"] == PRICE
    table = CliRunner().invoke(main, ["plan", "--cluster", str(cluster_file), *ARGS, "--pareto"])
    assert table.exit_code == 0 and "Pareto front" in table.output and "kJ per step" in table.output


@pytest.mark.parametrize("cluster, extra, field", [
    ("cpu", ["--objective", "cost"], "cluster.gpu_hour_price_usd"),
    ("cpu", ["--objective", "energy"], "cluster.gpu.busy_power_w"),
    ("cpu", ["--power-cap", "300"], "cluster.gpu.busy_power_w"),
    ("cpu", ["--pareto"], "cluster.gpu_hour_price_usd"),
    ("cpu", ["--objective", "speed"], "--objective"),
    ("cpu", ["--energy-budget", "lots"], "--energy-budget"),
])
def test_missing_fields_and_bad_options_exit_2_naming_the_field(cluster, extra, field):
    out = CliRunner().invoke(main, ["plan", "--cluster", cluster, *ARGS, *extra])
    assert out.exit_code == 2, out.output
    assert out.output.startswith(f"error: {field}") and out.output.count("\n") == 1


def test_rules_files_take_objectives_and_budgets():
    rules = rules_from_dict({"objective": "energy", "power_cap_w": 350, "energy_budget_j": 1e6}, "x")
    assert (rules.objective, rules.power_cap_w, rules.energy_budget_j) == ("energy", 350.0, 1e6)
    with pytest.raises(SpecError) as err:
        rules_from_dict({"max_cost_per_step_usd": 0}, "x")
    assert err.value.field == "rules.max_cost_per_step_usd"


def test_the_gap_covers_every_candidate_the_solver_did_not_settle():
    """Three candidates: one solved optimally at 1.0 s, one timed out with a solution at
    1.2 s and a 25% gap (its partitions may run in 0.9 s), one timed out without a
    solution whose bound is 0.95 s. The best kept is 1.0 s, and the gap is what the
    unsettled bounds leave: (1.0 - 0.9) / 1.0."""
    p = Problem(load_model("gpt3-1.3b"), load_cluster("dgx-a100-40gb", gpus=8),
                make_training(load_model("gpt3-1.3b"), load_cluster("dgx-a100-40gb", gpus=8), 32, 2048))
    rules = load_rules()
    space, _ = enumerate_space(p, rules)
    a, b, c = space[:3]
    base = estimate(p, a.with_stages(even_stages(24, a.pp, a.vpp)))
    answers = {a: Candidate(a, replace(base, step_time_s=1.0), 0.0),
               b: Candidate(b, replace(base, step_time_s=1.2), 0.25, timed_out=True),
               c: TimedOut(0.95)}
    kept = Kept(1, lambda cand: score(p, cand, "time"), False)
    scored = [(0.5, order_key(s), s) for s in (a, b, c)]
    solved = solve_in_bound_order(p, rules, scored, kept, 1, False, refine=lambda s: 0.5,
                                  solve=lambda s, cutoff: answers[s], progress=None)
    assert (solved.solves, solved.timeouts, solved.unsolved) == (3, 2, c)
    assert solved.least_bound == pytest.approx(0.9)
    result = finish(p, rules, kept, False, 3, 0, 3, solved, 0.0)
    assert result.best.strategy == a
    assert result.stats.gap == pytest.approx(0.1)
    assert result.stats.solver_timeouts == 2
