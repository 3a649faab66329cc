"""Measured times (costmodel.measured): the interpolation between measured shapes, the
estimate taking the measured layer, embedding and head times, and `plan --profile`
refusing a profile of something else."""

import json

import pytest
from click.testing import CliRunner

from costmodel.estimate.uniform import unit_costs
from costmodel.measured import (
    LayerPoint,
    MeasuredTimes,
    interpolate,
    measured_times,
    model_dims,
    read_profile,
)
from costmodel.problem import Problem
from costmodel.specs.loading import (
    SpecError,
    load_cluster,
    load_model,
    load_runtime,
    make_training,
)
from costmodel.strategy import Strategy
from costmodel.terms import compute
from planner.api import make_problem
from planner.console.cli import main as cli

POINTS = (LayerPoint(2, 1, 3.0, 5.0), LayerPoint(4, 1, 5.0, 9.0), LayerPoint(2, 4, 1.5, 2.5), LayerPoint(4, 4, 2.5, 4.5))


def test_measured_shapes_give_their_measured_times():
    for p in POINTS:
        assert interpolate(POINTS, p.micro_batch_size, p.tp) == (p.forward_s, p.backward_s)


def test_between_two_micro_batch_sizes_the_line_through_them():
    # b = 3 halfway between (2, 3.0 / 5.0) and (4, 5.0 / 9.0).
    assert interpolate(POINTS, 3, 1) == pytest.approx((4.0, 7.0))


def test_between_two_tp_widths_affine_in_one_over_tp():
    # tp 2: 1/2 is a third of the way from 1/4 to 1: 1.5 + (3.0 - 1.5) / 3 = 2.0; 2.5 + (5.0 - 2.5) / 3.
    assert interpolate(POINTS, 2, 2) == pytest.approx((2.0, 2.5 + 2.5 / 3))
    # Both axes: at b = 3, tp 1 gives (4.0, 7.0), tp 4 gives (2.0, 3.5).
    assert interpolate(POINTS, 3, 2) == pytest.approx((2.0 + 2.0 / 3, 3.5 + 3.5 / 3))


def test_extrapolation_follows_the_nearest_two_within_bounds():
    assert interpolate(POINTS, 8, 1) == pytest.approx((9.0, 17.0))    # the line; below 5 * 8/4 and 9 * 8/4
    assert interpolate(POINTS, 1, 1) == pytest.approx((2.0, 3.0))     # the line; above 3 * 1/2 and 5 * 1/2
    steep = (LayerPoint(2, 1, 1.0, 1.0), LayerPoint(4, 1, 4.0, 4.0))
    assert interpolate(steep, 8, 1) == pytest.approx((8.0, 8.0))      # never slower than proportional: 4 * 8/4
    assert interpolate(steep, 1, 1) == pytest.approx((0.5, 0.5))      # never faster than proportional: 1 * 1/2


def test_outside_the_measured_tp_widths_or_a_lone_point_is_not_covered():
    assert interpolate(POINTS, 2, 8) is None
    assert interpolate((LayerPoint(2, 1, 1.0, 2.0),), 4, 1) is None


def tiny_problem(profile=None, seq=64):
    model = load_model("tiny-llama")
    cluster = load_cluster("cpu", gpus=2)
    return Problem(model, cluster, make_training(model, cluster, 8, seq, "fp32"), profile)


def measured(points_by_kind):
    return MeasuredTimes("test", "CPU", "tiny-llama", 64, "fp32", "flash", points_by_kind)


def test_the_estimate_uses_the_measured_layer_embedding_and_head():
    profile = measured({"layer": (LayerPoint(2, 1, 0.004, 0.007),), "embedding": (LayerPoint(2, 1, 0.0001, 0.0002),),
                        "head": (LayerPoint(2, 1, 0.003, 0.005),)})
    units = unit_costs(tiny_problem(profile), Strategy(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=2))
    assert units.layer_work["none"].compute_s == pytest.approx(0.011)
    assert units.layer_work["full"].recompute_s == pytest.approx(0.004)   # full recompute repeats the measured forward
    assert units.first_work.compute_s == pytest.approx(0.0003)
    assert units.last_work.compute_s == pytest.approx(0.008)


def test_sequence_parallel_adds_the_analytic_difference_of_the_norms():
    profile = measured({"layer": (LayerPoint(2, 2, 0.004, 0.007),)})
    problem = tiny_problem(profile)
    units = unit_costs(problem, Strategy(dp=1, tp=2, pp=1, micro_batch_size=2, num_microbatches=4,
                                         sequence_parallel=True))
    args = (problem.model, problem.cluster, problem.training, 2, 2)
    delta = compute.layer_compute(*args, True).elementwise_s - compute.layer_compute(*args, False).elementwise_s
    assert delta < 0
    assert units.layer_work["none"].compute_s == pytest.approx(0.011 + (1 + compute.BACKWARD_FACTOR) * delta)


def test_shapes_the_profile_does_not_cover_stay_analytic():
    profile = measured({"layer": (LayerPoint(2, 1, 0.004, 0.007),)})
    strategy = Strategy(dp=1, tp=2, pp=1, micro_batch_size=2, num_microbatches=4)
    assert unit_costs(tiny_problem(profile), strategy) == unit_costs(tiny_problem(), strategy)
    assert profile.uncovered(2, 2) == ["embedding", "layer", "head"]


def entry(kind="layer", b=2, tp=1, **changes):
    model = load_model("tiny-llama")
    e = {"kind": kind, "model": model_dims(model), "model_name": "tiny-llama", "seq_len": 64, "precision": "fp32",
         "attention": "flash", "micro_batch_size": b, "tp": tp, "forward_s": 0.004, "backward_s": 0.007}
    return e | changes


def write_profile(path, entries):
    path.write_text(json.dumps({"schema_version": 2, "device": "cpu", "device_name": "CPU", "precision": "fp32",
                                "ranks": 2, "gemm": [], "elementwise": [], "collectives": {}, "layers": entries}))
    return path


@pytest.mark.parametrize("change,field", [
    ({"model": model_dims(load_model("tiny-gpt"))}, "profile.model.model_type"),
    # A layer with a shared expert is not the model's (fields written only when set).
    ({"model": {**model_dims(load_model("tiny-llama")), "shared_expert_intermediate_size": 64}},
     "profile.model.shared_expert_intermediate_size"),
    ({"model": {**model_dims(load_model("tiny-llama")), "windowed_layers": 2, "attention_window": 16}},
     "profile.model.windowed_layers"),
    ({"precision": "bf16"}, "profile.precision"),
    ({"seq_len": 32}, "profile.seq_len"),
    ({"attention": "eager"}, "profile.attention"),
])
def test_a_profile_of_something_else_is_refused_naming_the_field(tmp_path, change, field):
    doc = read_profile(write_profile(tmp_path / "p.json", [entry(**change)]))
    problem = tiny_problem()
    with pytest.raises(SpecError) as err:
        measured_times(doc, problem.model, problem.training)
    assert err.value.field == field


@pytest.mark.parametrize("change,field", [({"forward_s": -1.0}, "profile.layers[0].forward_s"),
                                          ({"kind": "mlp"}, "profile.layers[0].kind"),
                                          ({"tp": 0}, "profile.layers[0].tp"),
                                          ({"model": {**model_dims(load_model("tiny-llama")), "shared_expert_gate": 1}},
                                           "profile.layers[0].model.shared_expert_gate")])
def test_a_malformed_entry_names_its_field(tmp_path, change, field):
    with pytest.raises(SpecError) as err:
        read_profile(write_profile(tmp_path / "p.json", [entry(**change)]))
    assert err.value.field == field


def test_make_problem_loads_the_profile(tmp_path):
    path = write_profile(tmp_path / "p.json", [entry(b=2), entry(b=4, forward_s=0.006, backward_s=0.011)])
    problem = make_problem("tiny-llama", "cpu", 8, gpus=2, seq_len=64, precision="fp32", profile=str(path))
    assert problem.measured_times.times("layer", 3, 1) == pytest.approx((0.005, 0.009))


PLAN = ["plan", "--model", "tiny-llama", "--cluster", "cpu", "--gpus", "2", "--global-batch", "8", "--seq", "64",
        "--precision", "fp32", "--fix", "dp=2,tp=1,pp=1,mbs=4", "--format", "json"]


def test_plan_with_a_profile_prices_the_measured_layers(tmp_path):
    # Layers ten times slower than the analytic model says: the step time follows them.
    layers = [entry(b=b, forward_s=0.01 * b, backward_s=0.02 * b) for b in (1, 2, 4, 8)]
    path = write_profile(tmp_path / "p.json", layers)
    plain = CliRunner().invoke(cli, PLAN)
    first = CliRunner().invoke(cli, PLAN + ["--profile", str(path)])
    again = CliRunner().invoke(cli, PLAN + ["--profile", str(path)])
    assert plain.exit_code == 0 and first.exit_code == 0, first.output
    analytic, profiled = json.loads(plain.stdout), json.loads(first.stdout)
    # Four layers of (0.04 + 0.08) s at mbs 4, one micro-batch per rank, no pipeline.
    assert profiled["estimate"]["time"]["compute_s"] == pytest.approx(
        4 * 0.12 + analytic["estimate"]["time"]["compute_s"] - 4 * _analytic_layer_s(4), rel=1e-5)
    assert profiled["estimate"]["step_time_s"] > 10 * analytic["estimate"]["step_time_s"]
    assert first.stdout == again.stdout                      # same inputs, same plan bytes
    # The plan carries the measurements that priced it.
    assert "profile" not in analytic
    assert [p["forward_s"] for p in profiled["profile"]["points"]["layer"]] == [0.01, 0.02, 0.04, 0.08]
    assert "no measured embedding, head at micro-batch 4, tp 1 (the best plan's shape): priced by the analytic model" \
        in first.stderr


def _analytic_layer_s(b):
    p = tiny_problem()
    # `shardwise plan` prices under the default runtime, pytorch-native: its kernel factors
    forward = compute.layer_compute(p.model, p.cluster, p.training, b, 1, False, 1, load_runtime()).forward_s
    # and its per-layer launch time, which a measured layer holds already
    return forward * (1 + compute.BACKWARD_FACTOR) + load_runtime().layer_launch_s


def test_plan_refuses_a_profile_of_another_seq_with_exit_2(tmp_path):
    path = write_profile(tmp_path / "p.json", [entry(seq_len=128)])
    result = CliRunner().invoke(cli, PLAN + ["--profile", str(path)])
    assert result.exit_code == 2
    assert result.output.strip() == "error: profile.seq_len: the profile measured 128, the plan uses 64"
