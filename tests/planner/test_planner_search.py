"""Planner: rules, the space, the partition program against exhaustive enumeration,
plan-file round trip and determinism, CLI exit codes."""

import itertools
import json

import pytest
from click.testing import CliRunner

from costmodel.estimate import estimate
from costmodel.estimate.uniform import rank_memory, unit_costs
from costmodel.specs.loading import SpecError, load_cluster, load_model, make_training
from costmodel.problem import Problem
from costmodel.strategy import Strategy
from planner.api import plan
from planner.console.cli import main
from planner.search.partition import layout, solve_partition, usable_memory_bytes
from planner.plan_file import read_plan, strategy_of, write_plan
from planner.rules import load_rules, parse_fix, rules_from_dict
from planner.search import search
from planner.search.space import enumerate_space


def problem(model="gpt3-1.3b", cluster="dgx-a100-40gb", gpus=8, batch=32, seq=2048):
    m, c = load_model(model), load_cluster(cluster, gpus=gpus)
    return Problem(m, c, make_training(m, c, batch, seq))


def test_rules_are_strict_and_name_the_field():
    with pytest.raises(SpecError) as err:
        rules_from_dict({"tp_within_nodes": True}, "x")
    assert err.value.field == "rules.tp_within_nodes"
    with pytest.raises(SpecError) as err:
        parse_fix("zero=4")
    assert err.value.field == "--fix zero"
    assert parse_fix("tp=8,sp=on,recompute=full") == {"tp": 8, "sp": True, "recompute": "full"}


def test_space_obeys_rules():
    p = problem()
    rules = load_rules("megatron").with_fix({"tp": 2})
    space, _ = enumerate_space(p, rules)
    assert space and all(s.tp == 2 and s.zero_stage <= 1 and s.schedule != "gpipe" for s in space)
    assert all(s.dp * s.micro_batch_size * s.num_microbatches == 32 for s in space)
    assert all(s.dp * s.tp * s.pp == 8 for s in space)


def test_space_offers_1f1b_only_with_a_micro_batch_per_stage():
    spec = load_model("tiny-gpt")
    cluster = load_cluster("cpu", gpus=4)
    p = Problem(spec, cluster, make_training(spec, cluster, 2, 16))
    space, why = enumerate_space(p, load_rules())
    pipelined = [s for s in space if s.pp > 1]
    assert pipelined and all(s.schedule == "gpipe" or s.num_microbatches >= s.pp for s in pipelined)
    assert any(s.schedule == "gpipe" and s.num_microbatches < s.pp for s in pipelined)


def test_space_offers_sequence_parallelism_only_when_tp_divides_the_sequence():
    spec = load_model("tiny-gpt")
    cluster = load_cluster("cpu", gpus=2)
    odd = enumerate_space(Problem(spec, cluster, make_training(spec, cluster, 8, 15)), load_rules())[0]
    even = enumerate_space(Problem(spec, cluster, make_training(spec, cluster, 8, 16)), load_rules())[0]
    assert not any(s.sequence_parallel for s in odd) and any(s.sequence_parallel for s in even)


@pytest.mark.parametrize("strategy", [
    Strategy(dp=1, tp=2, pp=4, micro_batch_size=4, num_microbatches=8, schedule="1f1b"),
    Strategy(dp=2, tp=1, pp=4, micro_batch_size=2, num_microbatches=8, schedule="1f1b", zero_stage=1),
])
def test_partition_matches_exhaustive_enumeration(strategy):
    """Every split of 24 layers over 4 ranks with per-rank full-recompute counts: the
    program's partition is the fastest that fits (1e-3 relative for integer rounding)."""
    p = problem(batch=32)
    units = unit_costs(p, strategy)
    usable = usable_memory_bytes(p, 0.05)
    sol = solve_partition(p, units, strategy, ("none", "full"), 0.05, 10.0)
    best = float("inf")
    layers = p.model.num_hidden_layers
    for split in itertools.product(range(1, layers), repeat=3):
        last = layers - sum(split)
        if last < 1:
            continue
        counts = list(split) + [last]
        # Fewest full-recompute layers per rank that fit: more only costs time.
        choice = []
        for r, n in enumerate(counts):
            for f in range(n + 1):
                trial = [(c, 0, 0) for c in counts]
                trial[r] = (n, f, 0)
                s = strategy.with_stages(layout(strategy, trial))
                if rank_memory(p, units, s, r).total_bytes <= usable:
                    choice.append(f)
                    break
            else:
                break
        if len(choice) < 4:
            continue
        s = strategy.with_stages(layout(strategy, [(n, f, 0) for n, f in zip(counts, choice)]))
        best = min(best, estimate(p, s, units).step_time_s)
    assert estimate(p, sol.strategy, units).step_time_s == pytest.approx(best, rel=1e-3)


def test_returned_plan_fits_memory_and_round_trips(tmp_path):
    doc = plan("gpt3-13b", "dgx-a100-40gb", 256, nodes=2, seq_len=2048)
    assert doc["estimate"]["peak_memory_bytes"] <= 40 * 2**30 * 0.95 * 1.0001
    path = tmp_path / "plan.json"
    write_plan(doc, path)
    back = read_plan(path)
    assert back == doc
    s = strategy_of(back)
    assert s.dp * s.tp * s.pp == 16 and sum(st.num_layers for st in s.stages) == 40


def test_plan_is_deterministic():
    a = plan("llama2-7b", "dgx-h100", 64, nodes=1, seq_len=4096)
    b = plan("llama2-7b", "dgx-h100", 64, nodes=1, seq_len=4096)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_search_best_is_best_of_space_under_pins():
    p = problem()
    rules = load_rules().with_fix({"tp": 2, "pp": 2, "mbs": 2})
    result = search(p, rules, top=2)
    assert result.best.estimate.step_time_s <= result.alternatives[0].estimate.step_time_s


def test_tampered_plan_is_rejected(tmp_path):
    doc = plan("tiny-llama", "cpu", 8, gpus=2)
    doc["model"]["hidden_size"] += 1
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SpecError) as err:
        read_plan(path)
    assert err.value.field == "plan.model_fingerprint"


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
