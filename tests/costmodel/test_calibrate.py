"""Fitting a profile: the fitted spec reproduces the measurements it came from, through
the cost model's own formulas (costmodel.terms.compute, costmodel.terms.comm)."""

import math

import pytest
import yaml

from costmodel.calibrate import (
    MAX_PEAK_EXTRAPOLATION,
    cluster_spec,
    fit_bandwidth,
    fit_collective,
    fit_gemm_curve,
    fit_host_overheads,
    roofline_notes,
)
from costmodel.specs.loading import load_cluster
from costmodel.terms.comm import collective_time_s, placement
from costmodel.terms.compute import MEMORY_BOUND_EFFICIENCY, gemm_time_s

SHAPES = [(m, n, k) for m in (16, 64, 256, 1024, 4096) for n, k in ((256, 256), (1024, 1024), (4096, 1024))]


def gemm_points(peak=2e11, best=0.9, half=24.0):
    eff = lambda m, n, k: best * math.prod(d / (d + half) for d in (m, n, k))  # noqa: E731
    return [{"m": m, "n": n, "k": k, "seconds": 2 * m * n * k / (peak * eff(m, n, k))} for m, n, k in SHAPES]


def test_gemm_curve_is_recovered():
    fit = fit_gemm_curve(gemm_points())
    assert fit["gemm_half_dim"] == pytest.approx(24.0, rel=0.002)
    device = type("Device", (), {"gemm_efficiency_max": fit["gemm_efficiency_max"], "gemm_half_dim": fit["gemm_half_dim"]})
    for p in gemm_points():
        predicted = gemm_time_s(p["m"], p["n"], p["k"], fit["peak_flops_per_s"], device=device)
        assert predicted == pytest.approx(p["seconds"], rel=0.01)


@pytest.mark.parametrize("kind,steps,volume", [("all_reduce", 2 * 3, 2 * 3 / 4), ("all_gather", 3, 3 / 4),
                                               ("reduce_scatter", 3, 3 / 4), ("p2p", 1, 1.0)])
def test_alpha_beta_is_recovered(kind, steps, volume):
    bw, lat = 3e9, 5e-5
    points = [{"bytes": b, "seconds": steps * lat + volume * b / bw} for b in (1 << 16, 1 << 20, 1 << 24)]
    assert fit_collective(kind, points, ranks=4) == pytest.approx((bw, lat), rel=1e-9)


def test_fitted_cluster_spec_loads_and_reproduces_the_profile(tmp_path):
    ranks = 2
    truth = {"all_reduce": (2.3e9, 1.2e-4), "all_gather": (1.1e9, 1.8e-4), "reduce_scatter": (6.5e8, 2.8e-4),
             "p2p": (5.3e9, 4.2e-5)}
    shape = {"all_reduce": (2, 1.0), "all_gather": (1, 0.5), "reduce_scatter": (1, 0.5), "p2p": (1, 1.0)}
    collectives = {k: [{"bytes": b, "seconds": shape[k][0] * lat + shape[k][1] * b / bw} for b in (1 << 16, 1 << 20, 1 << 24)]
                   for k, (bw, lat) in truth.items()}
    profile = {"device": "cpu", "device_name": "CPU", "precision": "fp32", "ranks": ranks, "memory_bytes": 8 << 30,
               "gemm": gemm_points(), "elementwise": [{"bytes": 1 << 26, "seconds": (1 << 26) / 1.6e10}],
               "collectives": collectives}
    path = tmp_path / "fitted.yaml"
    path.write_text(yaml.safe_dump(cluster_spec(profile, "fitted")))
    cluster = load_cluster(str(path))
    assert cluster.comm_overlap == 0.0 and cluster.gpus_per_node == 2
    assert cluster.gpu.hbm_bandwidth_bytes_per_s == pytest.approx(1.6e10 / 0.8, rel=1e-3)
    pair = placement(2, 1, 2)
    for kind, points in collectives.items():
        for p in points:
            assert collective_time_s(kind, p["bytes"], pair, cluster) == pytest.approx(p["seconds"], rel=1e-3)


def test_a_fit_on_small_shapes_claims_no_peak_it_did_not_measure():
    """GEMMs of at most 256 on a chip whose curve has half = 500: the unconstrained fit
    would put the asymptote ~7x above the fastest measurement. The fitted spec stops at
    MAX_PEAK_EXTRAPOLATION times it."""
    small = [(m, n, k) for m in (16, 64, 256) for n, k in ((64, 64), (256, 256))]
    eff = lambda m, n, k: math.prod(d / (d + 500.0) for d in (m, n, k))  # noqa: E731
    points = [{"m": m, "n": n, "k": k, "seconds": 2 * m * n * k / (1e15 * eff(m, n, k))} for m, n, k in small]
    fastest = max(2 * p["m"] * p["n"] * p["k"] / p["seconds"] for p in points)
    fit = fit_gemm_curve(points)
    assert fit["peak_flops_per_s"] * fit["gemm_efficiency_max"] == pytest.approx(MAX_PEAK_EXTRAPOLATION * fastest)


def test_bandwidth_is_the_largest_pass():
    """A 4 MiB pass that ran from cache at 3x the rate of a 256 MiB one does not count."""
    points = [{"bytes": 4 << 20, "seconds": (4 << 20) / 3e10}, {"bytes": 256 << 20, "seconds": (256 << 20) / 1e10}]
    assert fit_bandwidth(points) == pytest.approx(1e10 / MEMORY_BOUND_EFFICIENCY)


def test_a_profile_whose_rates_had_not_settled_says_so():
    profile = {"gemm": [{"m": 512, "n": 512, "k": 512, "seconds": 1.0}, {"m": 16, "n": 256, "k": 256, "seconds": 1.0}],
               "elementwise": [{"bytes": 64 << 20, "seconds": 1.0}],
               "roofline": {"gemm_settled": False, "bandwidth_settled": True}}
    assert roofline_notes(profile) == ["the GEMM rate was still rising at 512^3: the fitted peak is a floor of "
                                       "the device's"]
    assert "predates the roofline sweep" in roofline_notes({"gemm": [], "elementwise": []})[0]


def host_measurements() -> dict:
    """A profile's "host_overheads" (executor.measure.measure_host_overheads) built from
    known overheads: DTensor TP 5 ms + 2 ns per activation byte a layer, SP 1 ms more,
    FSDP2 0.5 ns per unit byte a gather and 0.25 a reduce-scatter."""
    unit = 12_000_000
    rows = []
    for b in (1, 2, 4):
        act = b * 262_144
        shard = 0.010 * b
        ar, ag, rs = 1e-4, 2e-4, 3e-4
        tp = shard + 0.005 + 2e-9 * act + 4 * ar
        rows.append({"micro_batch_size": b, "activation_bytes": act, "tp_shard_s": shard, "tp_s": tp,
                     "tp_sp_s": tp + 0.001 + 4 * (ag + rs - ar), "all_reduce_s": ar, "all_gather_s": ag,
                     "reduce_scatter_s": rs})
    plain, unit_ag, unit_rs = 0.020, 1e-4, 3e-3
    keep = plain + 0.5e-9 * unit + 0.25e-9 * unit + unit_ag + unit_rs
    return {"tp": rows, "layer_bytes": unit, "plain_s": plain, "fsdp_keep_s": keep,
            "fsdp_reshard_s": keep + 0.5e-9 * unit, "unit_all_gather_s": unit_ag, "unit_reduce_scatter_s": unit_rs}


def test_host_overheads_are_the_wrapped_layers_excess():
    fit = fit_host_overheads(host_measurements())
    assert fit == pytest.approx({"tp_layer_s": 0.005, "tp_layer_s_per_byte": 2e-9, "sp_layer_s": 0.001,
                                 "fsdp_gather_s_per_byte": 0.5e-9, "fsdp_reduce_s_per_byte": 0.25e-9}, rel=1e-3)


def test_noise_never_makes_a_host_overhead_negative():
    measured = host_measurements()
    measured["fsdp_keep_s"] = measured["plain_s"]                     # keeping as fast as plain
    measured["fsdp_reshard_s"] = measured["fsdp_keep_s"] - 0.002      # and resharding faster still
    for row in measured["tp"]:
        row["tp_sp_s"] = row["tp_s"] - 0.001
    fit = fit_host_overheads(measured)
    assert fit["fsdp_gather_s_per_byte"] == 0.0 and fit["fsdp_reduce_s_per_byte"] == 0.0
    assert fit["sp_layer_s"] == 0.0


def test_a_cpu_profile_fits_host_overheads_into_the_spec(tmp_path):
    profile = {"device": "cpu", "device_name": "CPU", "precision": "fp32", "ranks": 2, "memory_bytes": 8 << 30,
               "gemm": gemm_points(), "elementwise": [{"bytes": 1 << 26, "seconds": (1 << 26) / 1.6e10}],
               "collectives": {"all_reduce": [{"bytes": 1 << 20, "seconds": 1e-3}, {"bytes": 1 << 24, "seconds": 1e-2}]},
               "host_overheads": host_measurements()}
    path = tmp_path / "fitted.yaml"
    path.write_text(yaml.safe_dump(cluster_spec(profile, "fitted")))
    host = load_cluster(str(path)).gpu.host_overheads
    assert host.tp_layer_s == pytest.approx(0.005, rel=1e-3)
    assert host.tp_layer_time_s(1e6, sequence_parallel=True) == pytest.approx(0.005 + 2e-9 * 1e6 + 0.001, rel=1e-3)
