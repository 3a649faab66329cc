"""From measurements to the cost model's parameters: a GEMM efficiency curve, the
memory bandwidth of elementwise passes, alpha-beta figures per collective and, on CPU
ranks, the host time of PyTorch's parallel wrappers (HostOverheads), fitted to
a profile (what `shardwise profile` measures), and written as a cluster spec a user can
keep (`--cluster that.yaml`). Pure arithmetic on the profile's numbers.

The curve and the collective formulas are the ones costmodel.terms.compute and costmodel.terms.comm
evaluate, so a fitted spec reproduces the measurements it came from.
"""

from __future__ import annotations

import math

from costmodel.measured import PROFILE_SCHEMA_VERSION  # noqa: F401  (the profile format's version, kept importable here)
from costmodel.terms.compute import MEMORY_BOUND_EFFICIENCY

# How far above the fastest GEMM measured a fitted curve's asymptote may reach. The
# curve extrapolates to the large GEMMs of big models, and at the roofline sweep's
# largest square (executor.measure.measure_roofline) its shape term prod(d / (d + half))
# is what separates the two: 1.10 admits half up to 0.032 d (66 at d = 2048, 262 at
# 8192; the built-in curves use 5 on CPU ranks and 128 on GPUs, costmodel.terms.compute).
# A fit that wants more rests on shapes too small to say where the rate stops.
MAX_PEAK_EXTRAPOLATION = 1.10


def fit_gemm_curve(points: list[dict]) -> dict:
    """Fit efficiency = best * prod(d / (d + half)) over measured GEMMs, each point
    {"m", "n", "k", "seconds"}, relative to the fastest measurement: `best` and `half`
    minimise the squared error of the efficiency, `half` searched on a log grid and
    `best` solved in closed form for each, at most MAX_PEAK_EXTRAPOLATION (then `half`
    is fitted again with `best` held there)."""
    rates = [2 * p["m"] * p["n"] * p["k"] / p["seconds"] for p in points]
    peak = max(rates)
    efficiency = [r / peak for r in rates]

    def fit(half: float, held: float | None = None) -> tuple[float, float, float]:
        shape = [math.prod(d / (d + half) for d in (p["m"], p["n"], p["k"])) for p in points]
        best = held or sum(e * s for e, s in zip(efficiency, shape)) / sum(s * s for s in shape)
        return sum((e - best * s) ** 2 for e, s in zip(efficiency, shape)), best, half

    def search(held: float | None = None) -> tuple[float, float, float]:
        # A log grid from 1 to 1000, then a finer one around its best point.
        coarse = min(fit(10 ** (step / 40), held) for step in range(121))
        return min(fit(coarse[2] * 10 ** (step / 4000), held) for step in range(-100, 101))

    _, best, half = search()
    if best > MAX_PEAK_EXTRAPOLATION:
        _, best, half = search(MAX_PEAK_EXTRAPOLATION)
    # Only peak x best matters; keep best a fraction (the fastest GEMM measured is
    # itself below the curve's asymptote).
    if best > 1.0:
        peak, best = peak * best, 1.0
    return {"peak_flops_per_s": peak, "gemm_efficiency_max": best, "gemm_half_dim": half}


def fit_bandwidth(points: list[dict]) -> float:
    """Achieved bytes/s of the largest elementwise pass ({"bytes", "seconds"}), as the
    `hbm_bandwidth_bytes_per_s` that costmodel.terms.compute derates by its efficiency.
    The largest: small passes are launch-bound on a GPU (a 4 MiB copy reaches an eighth
    of an H200's bandwidth) and cache-bound on a CPU, while a model's tensors are large."""
    largest = max(points, key=lambda p: p["bytes"])
    return largest["bytes"] / largest["seconds"] / MEMORY_BOUND_EFFICIENCY


def roofline_notes(profile: dict) -> list[str]:
    """What a fitted spec cannot vouch for: a GEMM or bandwidth rate still rising at the
    largest size measured (`executor.measure.measure_roofline` stopped at its time
    limit), so the spec's figure is what was measured, below the device's own."""
    roofline = profile.get("roofline")
    if roofline is None:
        return ["this profile predates the roofline sweep: its peak and bandwidth rest on small shapes only; "
                "measure again"]
    notes = []
    if not roofline["gemm_settled"]:
        dim = max(p["m"] for p in profile["gemm"] if p["m"] == p["n"] == p["k"])
        notes.append(f"the GEMM rate was still rising at {dim}^3: the fitted peak is a floor of the device's")
    if not roofline["bandwidth_settled"]:
        size = max(p["bytes"] for p in profile["elementwise"])
        notes.append(f"the elementwise rate was still changing at {size >> 20} MiB: the fitted bandwidth is "
                     f"that size's")
    return notes


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def fit_host_overheads(measured: dict) -> dict:
    """HostOverheads (costmodel.specs.hardware) from the profile's "host_overheads"
    (executor.measure.measure_host_overheads: calling-thread seconds of one reference block's
    forward + backward, bare and wrapped). DTensor TP's time per layer is the TP layer's
    over its plain shard's, less its four bare all-reduces (Megatron's two forward, two
    backward), fitted as a line in the activation bytes over the micro-batch sizes; sequence
    parallelism's is the mean excess of the SP layer over that, less its four all-gathers
    and four reduce-scatters' excess over the all-reduces. FSDP2's per byte of the unit:
    resharding after forward adds one all-gather (backward's), so its excess over keeping
    the unit gathered is one gather's host time; keeping it gathered over the plain layer,
    less one gather's and the bare reduce-scatter's and all-gather's, is one reduce-scatter's.
    Noise can only make a difference small, never negative: each is at least 0."""
    rows = measured["tp"]
    tp = [r["tp_s"] - r["tp_shard_s"] - 4 * r["all_reduce_s"] for r in rows]
    fixed, per_byte = _line([r["activation_bytes"] for r in rows], tp)
    if per_byte < 0:
        fixed, per_byte = sum(tp) / len(tp), 0.0
    sp = [r["tp_sp_s"] - r["tp_s"] - 4 * (r["all_gather_s"] + r["reduce_scatter_s"] - r["all_reduce_s"])
          for r in rows]
    unit = measured["layer_bytes"]
    gather = max(0.0, measured["fsdp_reshard_s"] - measured["fsdp_keep_s"])
    reduce = (measured["fsdp_keep_s"] - measured["plain_s"] - gather - measured["unit_all_gather_s"]
              - measured["unit_reduce_scatter_s"])
    return {"tp_layer_s": float(f"{max(0.0, fixed):.4g}"), "tp_layer_s_per_byte": float(f"{per_byte:.4g}"),
            "sp_layer_s": float(f"{max(0.0, sum(sp) / len(sp)):.4g}"),
            "fsdp_gather_s_per_byte": float(f"{gather / unit:.4g}"),
            "fsdp_reduce_s_per_byte": float(f"{max(0.0, reduce) / unit:.4g}")}


def fit_collective(kind: str, points: list[dict], ranks: int) -> tuple[float, float]:
    """(bandwidth_bytes_per_s, latency_s) of a ring collective over `ranks` ranks from
    points {"bytes", "seconds"}, bytes in costmodel.terms.comm's convention (the full buffer;
    one way for p2p): t = steps * latency + volume * bytes / bandwidth with all-reduce
    2(n-1) steps moving 2(n-1)/n of the buffer, all-gather and reduce-scatter (n-1)
    steps moving (n-1)/n, all-to-all (bytes: what one rank sends in all) n-1 exchanges
    moving (n-1)/n of it (comm.collective_time_s on one node), p2p one step moving all of
    it (comm._ring_time_s)."""
    n = ranks
    steps, volume = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n), "all_gather": (n - 1, (n - 1) / n),
                     "reduce_scatter": (n - 1, (n - 1) / n), "all_to_all": (n - 1, (n - 1) / n),
                     "p2p": (1, 1.0)}[kind]
    intercept, slope = _line([p["bytes"] for p in points], [p["seconds"] for p in points])
    if slope <= 0 or intercept < 0:
        # Too few or too noisy points for a line: the largest message's average rate,
        # latency folded in (pessimistic for small messages, never faster than measured).
        largest = max(points, key=lambda p: p["bytes"])
        return volume * largest["bytes"] / largest["seconds"], 0.0
    return volume / slope, intercept / steps


def cluster_spec(profile: dict, name: str) -> dict:
    """A cluster spec (the YAML's dict) of one node of the profiled device."""
    ranks = profile["ranks"]
    curve = fit_gemm_curve(profile["gemm"])
    peak = curve["peak_flops_per_s"]
    device = {
        "name": profile["device_name"],
        "peak_flops_per_s": {profile["precision"]: float(f"{peak:.4g}")},
        "memory_bytes": int(profile["memory_bytes"]),
        "hbm_bandwidth_bytes_per_s": float(f"{fit_bandwidth(profile['elementwise']):.4g}"),
        "gemm_efficiency_max": round(curve["gemm_efficiency_max"], 4),
        "gemm_half_dim": round(curve["gemm_half_dim"], 2),
    }
    if profile.get("host_overheads"):
        device["host_overheads"] = fit_host_overheads(profile["host_overheads"])
    fits = {kind: fit_collective(kind, pts, ranks) for kind, pts in sorted(profile["collectives"].items()) if pts}
    base_bw, base_lat = fits.get("all_reduce", next(iter(fits.values()), (1e9, 0.0)))
    link = {"bandwidth_bytes_per_s": float(f"{base_bw:.4g}"), "latency_s": float(f"{base_lat:.4g}")}
    others = {k: {"bandwidth_bytes_per_s": float(f"{bw:.4g}"), "latency_s": float(f"{lat:.4g}")}
              for k, (bw, lat) in fits.items() if k != "all_reduce"}
    if others:
        link["collectives"] = others
    return {
        "name": name,
        "gpu": device,
        "gpus_per_node": ranks,
        "num_nodes": 1,
        # Collectives hide behind compute only where they run on an engine of their own.
        "comm_overlap": 1.0 if profile["device"] == "cuda" else 0.0,
        "intra_node": link,
        "inter_node": dict(link),   # one node measured: the same figures
    }
