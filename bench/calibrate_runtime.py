"""Calibration as code: fit the runtime profiles' few physical coefficients on measured
runs, print every row's time and memory error, and cross-validate (fit on one group,
predict the other, both directions).

Rows (../shared/reference/):
- torchtitan: torchtitan_h100_runs.json, Llama 3.1 8B / 70B on 8-256 H100 96 GB HBM2e at
  500 W (configs/clusters/grand-teton-h100.yaml), FSDP2, FSDP2 + TP (async or not),
  eager or compiled; pytorch-native runtime. Float8 rows are held out of every fit:
  bench/fp8.py prices them as a check of the FP8 terms (both 405B PP rows and the two
  H200 rows are left out too).
- h200: h200/executor_runs.json, Shardwise's executor on one H200 (eager), and its layer
  profile h200/llama3-8b_layers_profile.json (layer and LM head + loss at TP shards 1-8);
  pytorch-native. The planner's own first plan ran out of memory: printed with the
  estimate's peak.
- korthikanti: calibration_runs.json, Megatron-LM on DGX A100 80GB; megatron runtime.

Fitted coefficients (everything else stays at the value its runtime file documents):
- pytorch-native: gemm_efficiency_scale, elementwise_traffic_factor (eager),
  loss_traffic_factor, compiled_elementwise_traffic_factor, zero3_overlap,
  collective_half_bytes, async_tp_overlap, and the Hopper GPUs' GEMM curve half
  dimension (hardware: configs/hardware/h100-sxm, h200, h100-hbm2e-500w). The h200 group
  alone (one eager GPU) determines only the kernel ones.
- megatron: gemm_efficiency_scale, pp_overlap.

The fit minimises the sum of squared log errors of step time (a deterministic coordinate
search over multiplicative steps), never a per-row knob. Cross-validation: torchtitan <->
h200 for pytorch-native (what one group cannot determine keeps its documented default),
and {22B, 175B} <-> {530B, 1T} for megatron.

    PYTHONPATH=. python bench/calibrate_runtime.py

The full-data fit ("Fit on all rows") is copied into configs/runtimes/{pytorch-native,
megatron}.yaml by hand, rounded, with the rows in each coefficient's `fitted_on`; the
"Checked-in" table prices every row with those files as the planner does. Memory errors
are printed for the rows that publish a peak; the memory model is not fitted here.
torchtitan's `memory` is torch.cuda.max_memory_reserved (components/metrics.py logs
max_reserved_gib): those rows compare with the estimate's peak plus what the caching
allocator reserves for FSDP2's own streams (costmodel.estimate.uniform.fsdp_stream_pool_bytes);
the H200 rows are max_memory_allocated. The band's memory ratio takes the allocated rows
only: allocation, not reservation, is what runs out of memory.
Results go to bench/results/calibrate_runtime.{json,txt}.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from costmodel.estimate import estimate
from costmodel.estimate.uniform import fsdp_stream_pool_bytes, unit_costs
from costmodel.problem import Problem
from costmodel.specs.loading import (
    load_cluster,
    load_model,
    load_runtime,
    make_training,
)
from costmodel.specs.runtime import RuntimeSpec
from costmodel.strategy import Strategy, even_stages
from costmodel.units import GIB

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO.parent / "shared" / "reference"
TIME_TARGET = 0.10

TORCHTITAN_MODELS = {"Llama 3.1 8B": "llama3-8b", "Llama 3.1 70B": "llama3-70b", "Llama 3.1 405B": "llama3-405b"}
KORTHIKANTI_MODELS = {"22B": "gpt-22b", "175B (GPT-3)": "gpt3-175b", "530B (MT-NLG)": "gpt-530b", "1T": "gpt-1t"}

# gemm_half_dim is the Hopper GPUs' (H100 SXM, H100 HBM2e 500 W, H200: one GH100 die)
# GEMM curve, a hardware coefficient fitted beside the runtime's on the same rows.
PYTORCH_FREE = ("gemm_efficiency_scale", "gemm_half_dim", "elementwise_traffic_factor", "loss_traffic_factor",
                "layer_launch_s", "compiled_elementwise_traffic_factor", "zero3_overlap", "collective_half_bytes",
                "async_tp_overlap")
# What the torchtitan group alone determines: large layers (no launch-bound kernels), the
# loss a small share of the step, no narrow-shard profile; the rest stays neutral.
TITAN_FREE = ("gemm_efficiency_scale", "elementwise_traffic_factor", "compiled_elementwise_traffic_factor",
              "zero3_overlap", "collective_half_bytes", "async_tp_overlap")
# What one eager GPU without collectives can determine (the h200 group alone).
KERNEL_FREE = ("gemm_efficiency_scale", "gemm_half_dim", "elementwise_traffic_factor", "loss_traffic_factor",
               "layer_launch_s")
HOPPER = ("H100-SXM", "H200", "H100-HBM2e-500W")
# Megatron-LM's elementwise kernels are fused: its traffic factor is 1 by definition (the
# one-pass count of costmodel.terms.compute was fitted on its 22B layer), not fitted.
MEGATRON_FREE = ("gemm_efficiency_scale", "pp_overlap")
# Bounds of each coefficient (physical: fractions in [0, 1], factors and scales positive).
# The traffic factors are at least 1: no kernel makes fewer passes than the one-pass count.
BOUNDS = {"gemm_efficiency_scale": (0.3, 1.3), "elementwise_traffic_factor": (1.0, 20.0),
          "gemm_half_dim": (16.0, 2048.0), "loss_traffic_factor": (1.0, 20.0), "layer_launch_s": (0.0, 0.05),
          "compiled_elementwise_traffic_factor": (1.0, 20.0), "zero3_overlap": (0.0, 1.0),
          "collective_half_bytes": (0.0, 64e6), "async_tp_overlap": (0.0, 1.0), "step_overhead_s": (0.0, 2.0),
          "pp_overlap": (0.0, 1.0)}
# Where a coefficient is zero, the search steps to this value first.
FLOOR = {"layer_launch_s": 1e-4, "pp_overlap": 0.05, "collective_half_bytes": 1e5, "step_overhead_s": 1e-3, "zero3_overlap": 0.05, "async_tp_overlap": 0.05}


@dataclass(frozen=True)
class Row:
    id: str
    group: str
    runtime_name: str
    problem: Problem           # its runtime is the group's base runtime, before the row's engine settings
    strategy: Strategy
    settings: tuple            # the run's engine settings: (field, value) set on the runtime (compile, async TP, SAC policy)
    measured_step_s: float | None
    measured_memory_gib: float | None
    note: str = ""
    kind: str | None = None    # a layer kind of a layer profile (its measured_step_s: forward + backward)
    reserved: bool = False     # the measured memory is torch.cuda.max_memory_reserved (torchtitan's `memory`)


@dataclass(frozen=True)
class Fit:
    """What a fit moves: the runtime profile and the Hopper GEMM curve's half dimension."""

    runtime: RuntimeSpec
    hopper_half_dim: float = 128.0

    def get(self, name: str) -> float:
        return self.hopper_half_dim if name == "gemm_half_dim" else getattr(self.runtime, name)

    def set(self, name: str, value: float) -> Fit:
        if name == "gemm_half_dim":
            return replace(self, hopper_half_dim=value)
        return replace(self, runtime=replace(self.runtime, **{name: value}))


def torchtitan_rows(float8: bool = False) -> tuple[list[Row], list[str]]:
    """The torchtitan H100 runs as rows: the bf16 ones, or with `float8` the float8 ones,
    which no fit sees (bench/fp8.py holds them out to check FP8 pricing)."""
    data = json.loads((REFERENCE / "torchtitan_h100_runs.json").read_text())
    rows, left_out = [], []
    for run in data["runs"]:
        if bool(run["runtime"]["float8"]) != float8:
            left_out.append(f"{run['id']} (float8: held out, bench/fp8.py)" if not float8 else run["id"])
            continue
        s, gpus = run["strategy"], run["gpus"]
        model = load_model(TORCHTITAN_MODELS[run["model"]["name"]])
        cluster = load_cluster("grand-teton-h100", gpus=gpus)
        # torchtitan shards with FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
        # (torchtitan/distributed/utils.py), which gathers 16-bit weights: "param_dtype".
        # "tensorwise", "rowwise", or "tensorwise (FSDP float8 all-gather, precomputed scales)".
        recipe = (run["runtime"]["float8"] or "").split(" ")[0]
        precision = "bf16" if not recipe else "fp8" if recipe == "tensorwise" else f"fp8-{recipe}"
        training = make_training(model, cluster, s["global_batch_size"], s["seq_len"], precision, "adamw", True,
                                 "param_dtype")
        recompute = "full" if s["activation_checkpointing"] == "full" else "selective"
        if s["pp"] > 1 and float8:
            left_out.append(f"{run['id']} (pipelined: its schedule is not mapped)")
            continue
        if "H200" in run["hardware"]["gpu"]:
            left_out.append(f"{run['id']} (H200, not the Grand Teton H100s)")
            continue
        if s["pp"] > 1:
            raise SystemExit(f"{run['id']}: a bf16 PP row; map its schedule before using it")
        strategy = Strategy(dp=s["fsdp"], tp=s["tp"], pp=1, micro_batch_size=s["local_batch_size"], num_microbatches=1,
                            zero_stage=3, recompute=recompute, sequence_parallel=s["tp"] > 1,
                            stages=even_stages(model.num_hidden_layers, 1, 1, recompute))
        settings = (("torch_compile", bool(run["runtime"]["torch_compile"])), ("async_tp", bool(s["async_tp"])),
                    # torchtitan's op-level SAC (distributed/activation_checkpoint.py _save_list
                    # policy): a documented engine setting of these runs, not a fitted figure.
                    ("selective_recompute", "op-level"),
                    # torchtitan's loss: F.cross_entropy over the upcast logits.
                    ("chunked_loss", False),
                    # torchtitan 9dec370's apply_fsdp: the embedding, norm and head in the
                    # root unit, the last layer not resharded after forward.
                    ("fsdp_kept_gathered", "root"))
        step = s["global_batch_size"] * s["seq_len"] / (run["measured"]["tokens_per_s_per_gpu"] * gpus)
        rows.append(Row(run["id"], "torchtitan", "pytorch-native", Problem(model, cluster, training, runtime=load_runtime()),
                        strategy, settings, step, run["measured"].get("peak_memory_gib"), reserved=True))
    return rows, left_out


# The H200 runs measured the executor before its chunked cross-entropy (main at 613d290:
# F.cross_entropy over the upcast logits).
H200_SETTINGS = (("chunked_loss", False),)


def h200_rows() -> list[Row]:
    data = json.loads((REFERENCE / "h200" / "executor_runs.json").read_text())
    rows = []
    for i, run in enumerate(data["runs"]):
        words = run["request"].split(": ", 1)[1].split()
        name, args = words[0], dict(zip(words[1::2], words[2::2]))
        overrides = dict(kv.split("=") for kv in args["--set"].split(",")) if "--set" in args else None
        model = load_model(name, overrides)
        cluster = load_cluster("dgx-h200", gpus=1)
        training = make_training(model, cluster, args["--global-batch"], args["--seq"], "bf16", "adamw", True)
        st = run["strategy"]
        strategy = Strategy(dp=1, tp=1, pp=1, micro_batch_size=st["micro_batch_size"],
                            num_microbatches=st["num_microbatches"], recompute=st["recompute"],
                            stages=even_stages(model.num_hidden_layers, 1, 1, st["recompute"]))
        step = run.get("measured_step_time_s")
        memory = run.get("measured_peak_memory_allocated_bytes")
        shape = "_".join(k.strip("-") + v for k, v in args.items() if k != "--set")
        rows.append(Row(f"h200_{i + 1}_{name}_{shape}",
                        "h200", "pytorch-native", Problem(model, cluster, training, runtime=load_runtime()), strategy,
                        H200_SETTINGS, step, None if memory is None else memory / GIB, run.get("outcome", "")))
    return rows


def h200_layer_rows() -> list[Row]:
    """h200/llama3-8b_layers_profile.json: the executor's Llama-3-8B transformer layer and
    LM head + loss at seq 8192, micro-batch 1 and 2, TP shards 1-8, forward + backward on
    one H200 (eager). The embedding (1-2 ms, launch-bound) is left out."""
    data = json.loads((REFERENCE / "h200" / "llama3-8b_layers_profile.json").read_text())
    model = load_model("llama3-8b")
    cluster = load_cluster("dgx-h200", gpus=8)
    rows = []
    for entry in data["layers"]:
        if entry["kind"] == "embedding":
            continue
        b, tp, seq = entry["micro_batch_size"], entry["tp"], entry["seq_len"]
        training = make_training(model, cluster, 8 * b, seq, "bf16", "adamw", entry["attention"] == "flash")
        strategy = Strategy(dp=1, tp=tp, pp=1, micro_batch_size=b, num_microbatches=1)
        rows.append(Row(f"h200_profile_{entry['kind']}_mbs{b}_tp{tp}", "h200", "pytorch-native",
                        Problem(model, cluster, training, runtime=load_runtime()), strategy, H200_SETTINGS,
                        entry["forward_s"] + entry["backward_s"], None, kind=entry["kind"]))
    return rows


def korthikanti_rows() -> list[Row]:
    rows = []
    for run in json.loads((REFERENCE / "calibration_runs.json").read_text()):
        chunks = run["interleaved_pipeline"].get("model_chunks_per_rank", 1) if run["interleaved_pipeline"]["used"] else 1
        model = load_model(KORTHIKANTI_MODELS[run["model"]["name"]])
        cluster = load_cluster("dgx-a100-80gb", gpus=run["gpus"])
        # Megatron-LM's 16-bit recipe (its runtime's mixed_precision): 16-bit weights,
        # gradients and residual stream beside fp32 master weights.
        megatron = load_runtime("megatron")
        training = make_training(model, cluster, run["global_batch"], run["seq_len"], "bf16", "adamw", False,
                                 mixed_precision=megatron.mixed_precision)
        recompute = run["activation_recompute"]
        strategy = Strategy(dp=1, tp=run["tp"], pp=run["pp"], micro_batch_size=run["micro_batch"],
                            num_microbatches=run["global_batch"] // run["micro_batch"], vpp=chunks,
                            schedule="interleaved" if chunks > 1 else "1f1b", recompute=recompute,
                            sequence_parallel=run["sequence_parallel"],
                            stages=even_stages(model.num_hidden_layers, run["pp"], chunks, recompute))
        group = "korthikanti-small" if run["model"]["name"] in ("22B", "175B (GPT-3)") else "korthikanti-large"
        rows.append(Row(run["id"], group, "megatron", Problem(model, cluster, training, runtime=megatron),
                        strategy, (), run["measured"]["iteration_time_s"], None))
    return rows


def with_fit(row: Row, state: Fit) -> Problem:
    cluster = row.problem.cluster
    if cluster.gpu.name in HOPPER:
        cluster = replace(cluster, gpu=replace(cluster.gpu, gemm_half_dim=state.hopper_half_dim))
    return replace(row.problem, cluster=cluster, runtime=replace(state.runtime, **dict(row.settings)))


def predict(row: Row, state: Fit) -> tuple[float, float | None]:
    """(seconds, peak GiB or None): a step, or a layer kind's forward + backward compute."""
    problem = with_fit(row, state)
    if row.kind is not None:
        units = unit_costs(problem, row.strategy)
        work = {"layer": units.layer_work["none"], "head": units.last_work}[row.kind]
        return work.compute_s, None
    e = estimate(problem, row.strategy)
    peak = e.peak_memory_bytes
    if row.reserved:
        peak += fsdp_stream_pool_bytes(problem, unit_costs(problem, row.strategy), row.strategy, e.peak_memory_rank)
    return e.step_time_s, peak / GIB


def log_error(row: Row, state: Fit) -> float:
    return math.log(predict(row, state)[0] / row.measured_step_s)


def fit(rows: list[Row], base: Fit, free: tuple[str, ...]) -> Fit:
    """Coordinate search over multiplicative steps (halving them when no step helps),
    minimising the sum of squared log errors of time. Deterministic."""
    timed = [r for r in rows if r.measured_step_s]

    def loss(state: Fit) -> float:
        return sum(log_error(r, state) ** 2 for r in timed)

    current, best = base, loss(base)
    step = 0.5
    while step > 0.005:
        improved = False
        for name in free:
            low, high = BOUNDS[name]
            value = current.get(name)
            for candidate in ((value or FLOOR.get(name, 0.0)) * (1 + step), value * (1 - step) if value else 0.0,
                              value * (1 + step)):
                candidate = min(max(candidate, low), high)
                if candidate == value:
                    continue
                trial = current.set(name, candidate)
                score = loss(trial)
                if score < best - 1e-12:
                    current, best, improved = trial, score, True
                    value = candidate
        if not improved:
            step /= 2
    if "compiled_elementwise_traffic_factor" not in free and "elementwise_traffic_factor" in free:
        # Rows without a compiled run cannot tell what compiling saves: a compiled run is
        # priced as the eager one (no effect assumed, the slow side), not as fully fused.
        current = current.set("compiled_elementwise_traffic_factor", current.get("elementwise_traffic_factor"))
    return current


def table(rows: list[Row], runtimes: dict[str, Fit], label: str) -> tuple[list[str], list[dict]]:
    lines = [f"{label}",
             f"  {'row':<44} {'group':<18} {'measured s':>10} {'predicted s':>11} {'time err':>9} "
             f"{'meas GiB':>9} {'pred GiB':>9} {'mem err':>8}"]
    out = []
    for r in rows:
        seconds, pred_gib = predict(r, runtimes[r.runtime_name])
        t_err = None if not r.measured_step_s else seconds / r.measured_step_s - 1
        m_err = None if not r.measured_memory_gib else pred_gib / r.measured_memory_gib - 1
        out.append({"id": r.id, "group": r.group, "runtime": r.runtime_name, "measured_s": r.measured_step_s,
                    "predicted_s": seconds, "time_error": t_err, "measured_memory_gib": r.measured_memory_gib,
                    "predicted_memory_gib": pred_gib, "memory_error": m_err, "reserved": r.reserved,
                    "note": r.note})
        fmt = lambda x, f: "-" if x is None else format(x, f)
        lines.append(f"  {r.id[:44]:<44} {r.group:<18} {fmt(r.measured_step_s, '10.4f')} {seconds:11.4f} "
                     f"{fmt(t_err, '+9.1%')} {fmt(r.measured_memory_gib, '9.1f')} {fmt(pred_gib, '9.1f')} "
                     f"{fmt(m_err, '+8.1%')}" + (" reserved" if r.reserved and r.measured_memory_gib else "")
                     + (f"  [{r.note[:60]}]" if r.note else ""))
    timed = [abs(o["time_error"]) for o in out if o["time_error"] is not None]
    within = sum(t <= TIME_TARGET for t in timed)
    lines.append(f"  time: median |error| {statistics.median(timed):.1%}, max {max(timed):.1%}, "
                 f"{within}/{len(timed)} within {TIME_TARGET:.0%}")
    mem = [abs(o["memory_error"]) for o in out if o["memory_error"] is not None]
    if mem:
        lines.append(f"  memory (the memory model as it is, not fitted here): median |error| {statistics.median(mem):.1%}, "
                     f"max {max(mem):.1%}")
    return lines, out


def _median(rows: list[dict]) -> float:
    return statistics.median(abs(r["time_error"]) for r in rows if r["time_error"] is not None)


def _max(rows: list[dict]) -> float:
    return max(abs(r["time_error"]) for r in rows if r["time_error"] is not None)


def coefficients(state: Fit, free: tuple[str, ...]) -> str:
    return ", ".join(f"{n} {state.get(n):.4g}" for n in free)


def bands(results: dict) -> dict[str, dict[str, float]]:
    """Each runtime's band: step time from the whole-step rows each cross-validation held
    out (the per-layer profile rows are not steps), peak memory from every row that
    measured it under the checked-in profiles (memory is counted, not fitted, so every
    row is held out). Ratios are measured over predicted, 1 where no row measured."""
    out = {}
    for runtime in ("pytorch-native", "megatron"):
        held = [r for name, cv in results["cross_validation"].items() if name.startswith(runtime)
                for r in cv["held_out"] if r["time_error"] is not None and "_profile_" not in r["id"]]
        time_ratios = [1 / (1 + r["time_error"]) for r in held]
        memory_ratios = [1 / (1 + r["memory_error"]) for r in results["checked_in"]
                         if r["runtime"] == runtime and r["memory_error"] is not None and not r["reserved"]]
        out[runtime] = {"step_time_low_ratio": min([1.0, *time_ratios]),
                        "step_time_high_ratio": max([1.0, *time_ratios]),
                        "memory_high_ratio": max([1.0, *memory_ratios])}
    return out


def main() -> None:
    if not REFERENCE.exists():
        sys.exit(f"reference runs not found at {REFERENCE}")
    titan, left_out = torchtitan_rows()
    h200, korth = h200_rows() + h200_layer_rows(), korthikanti_rows()
    # The checked-in profiles and Hopper curve (configs/hardware/h200.yaml, the same in h100-sxm.yaml
    # and h100-hbm2e-500w.yaml), as the planner uses them.
    checked_half = load_cluster("dgx-h200").gpu.gemm_half_dim or 128.0
    native0 = Fit(load_runtime("pytorch-native"), checked_half)
    megatron0 = Fit(load_runtime("megatron"))
    # Start from neutral coefficients (and the A100-fitted curve, half dimension 128), so
    # the fit does not start at its own answer.
    neutral = dict(gemm_efficiency_scale=1.0, elementwise_traffic_factor=1.0, compiled_elementwise_traffic_factor=1.0,
                   loss_traffic_factor=1.0, layer_launch_s=0.0, zero3_overlap=1.0, collective_half_bytes=0.0, async_tp_overlap=0.0,
                   step_overhead_s=0.0)
    native_start = Fit(replace(native0.runtime, **neutral), 128.0)
    megatron_start = Fit(replace(megatron0.runtime, gemm_efficiency_scale=1.0, pp_overlap=0.0))
    report: list[str] = ["Left out: " + "; ".join(left_out), ""]
    results: dict = {"left_out": left_out}

    lines, out = table(titan + h200 + korth, {"pytorch-native": native_start, "megatron": megatron_start},
                       "Neutral coefficients (no runtime effects), all rows")
    report += lines + [""]
    results["neutral"] = out

    native = fit(titan + h200, native_start, PYTORCH_FREE)
    megatron = fit(korth, megatron_start, MEGATRON_FREE)
    report.append(f"Fit on all rows: pytorch-native: {coefficients(native, PYTORCH_FREE)}")
    report.append(f"                 megatron: {coefficients(megatron, MEGATRON_FREE)}")
    lines, out = table(titan + h200 + korth, {"pytorch-native": native, "megatron": megatron}, "Fit rows (fitted on all)")
    report += lines + [""]
    results["fit"] = {"pytorch-native": {n: native.get(n) for n in PYTORCH_FREE},
                      "megatron": {n: megatron.get(n) for n in MEGATRON_FREE}, "rows": out}

    # Checked-in profiles, as the planner uses them.
    lines, out = table(titan + h200 + korth, {"pytorch-native": native0, "megatron": megatron0},
                       "Checked-in configs/runtimes (what the planner uses)")
    report += lines + [""]
    results["checked_in"] = out

    results["cross_validation"] = {}
    summary = ["Cross-validation summary (time):"]
    for fit_rows, held, base, free, name in (
            (titan, h200, native_start, TITAN_FREE, "pytorch-native: fit torchtitan, predict h200"),
            (h200, titan, native_start, KERNEL_FREE, "pytorch-native: fit h200 (kernels only), predict torchtitan"),
            ([r for r in korth if r.group == "korthikanti-small"], [r for r in korth if r.group == "korthikanti-large"],
             megatron_start, MEGATRON_FREE, "megatron: fit 22B+175B, predict 530B+1T"),
            ([r for r in korth if r.group == "korthikanti-large"], [r for r in korth if r.group == "korthikanti-small"],
             megatron_start, MEGATRON_FREE, "megatron: fit 530B+1T, predict 22B+175B")):
        rt = fit(fit_rows, base, free)
        report.append(f"Cross-validation, {name}: {coefficients(rt, free)}")
        lines, fit_out = table(fit_rows, {rt.runtime.name: rt}, "  fitted rows")
        report += lines
        lines, held_out = table(held, {rt.runtime.name: rt}, "  held-out rows")
        report += lines + [""]
        results["cross_validation"][name] = {"coefficients": {n: rt.get(n) for n in free}, "fit": fit_out,
                                             "held_out": held_out}
        summary.append(f"  {name}: fit median |error| {_median(fit_out):.1%}, held-out median |error| "
                       f"{_median(held_out):.1%} (max {_max(held_out):.1%})")
    report += summary
    results["band"] = bands(results)
    report += ["", "Band (measured over predicted; copied into configs/runtimes/*.yaml):"]
    report += [f"  {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in b.items()) for name, b in results["band"].items()]
    text = "\n".join(report) + "\n"
    print(text, end="")
    out_dir = REPO / "bench" / "results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "calibrate_runtime.txt").write_text(text)
    (out_dir / "calibrate_runtime.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
