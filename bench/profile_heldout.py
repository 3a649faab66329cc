"""Measured times against held-out shapes: `shardwise profile --model` takes a profile
on this machine (one CPU thread per rank, fp32) of two small models sized so a layer
takes milliseconds, at micro-batch sizes 1, 2, 4, 8 and tp widths 1 and 4; then, for
each layer kind (transformer layer, embedding, head + loss), the forward + backward time
at three shapes the profile does not hold (micro-batch 3 at tp 1, 6 at tp 4, 5 at tp 2,
inside the measured range) is measured the same way (executor.measure.measure_layer) and set against the
cost model's prediction with the profile (`unit_costs` on a Problem carrying it) and
without it (the analytic model on the built-in `cpu` cluster). Prints the table, the
median |error| of each and the profiler's run time; writes
bench/results/profile_heldout.json and .txt.

    python bench/profile_heldout.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from costmodel.estimate.uniform import unit_costs
from costmodel.measured import load_measured_times
from costmodel.problem import Problem
from costmodel.specs.loading import (
    load_cluster,
    load_model,
    make_training,
    parse_overrides,
)
from costmodel.strategy import Strategy
from executor.measure import measure_layer

REPO = Path(__file__).resolve().parents[1]
SEQ = 128
PROFILED_MBS, PROFILED_TP = "1,2,4,8", "1,4"
HELD_OUT = [(3, 1), (6, 4), (5, 2)]            # (micro-batch size, tp), not in the profile
MODELS = {
    "tiny-llama": "hidden_size=256,intermediate_size=704,num_attention_heads=8,num_key_value_heads=4,vocab_size=4096",
    "tiny-gpt": "hidden_size=256,intermediate_size=1024,num_attention_heads=8,num_key_value_heads=8,vocab_size=4096",
}
TARGET = 0.15


def take_profile(path: Path) -> list[dict]:
    """Profile both models into one file (the second with --extend); wall seconds of each command."""
    runs = []
    for i, (name, overrides) in enumerate(MODELS.items()):
        command = [sys.executable, "-m", "planner.console.cli", "profile", "--device", "cpu", "--nproc", "2",
                   "--precision", "fp32", "--model", name, "--set", overrides, "--seq", str(SEQ),
                   "--micro-batch-sizes", PROFILED_MBS, "--tp", PROFILED_TP, "-o", str(path)]
        if i:
            command.append("--extend")
        start = time.perf_counter()
        layers_from = None
        with subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True) as proc:
            for line in proc.stderr:   # the progress lines, timed as they arrive
                sys.stderr.write(line)
                if layers_from is None and "layer kinds" in line:
                    layers_from = time.perf_counter()
        if proc.returncode:
            raise SystemExit(f"shardwise profile failed ({proc.returncode})")
        end = time.perf_counter()
        runs.append({"model": name, "seconds": end - start, "layer_kinds_seconds": end - (layers_from or end)})
    return runs


def compute_s(problem: Problem, b: int, tp: int) -> dict[str, float]:
    """Forward + backward compute seconds of each layer kind, as the estimate charges them."""
    units = unit_costs(problem, Strategy(dp=1, tp=tp, pp=1, micro_batch_size=b, num_microbatches=1))
    return {"layer": units.layer_work["none"].compute_s, "embedding": units.first_work.compute_s,
            "head": units.last_work.compute_s}


def main() -> None:
    torch.set_num_threads(1)   # one rank per core, as the profiler and the executor run here
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        runs = take_profile(path)
        rows = []
        for name, overrides in MODELS.items():
            model = load_model(name, parse_overrides(overrides))
            cluster = load_cluster("cpu", gpus=4)
            training = make_training(model, cluster, 8, SEQ, "fp32")
            profiled = Problem(model, cluster, training, load_measured_times(path, model, training))
            analytic = Problem(model, cluster, training)
            for b, tp in HELD_OUT:
                with_profile, without = compute_s(profiled, b, tp), compute_s(analytic, b, tp)
                for kind in ("layer", "embedding", "head"):
                    fwd, bwd = measure_layer(model, kind, SEQ, b, tp, torch.device("cpu"), torch.float32, True)
                    measured = fwd + bwd
                    rows.append({"model": name, "kind": kind, "micro_batch_size": b, "tp": tp,
                                 "measured_s": measured, "profiled_s": with_profile[kind],
                                 "analytic_s": without[kind],
                                 "profiled_error": with_profile[kind] / measured - 1,
                                 "analytic_error": without[kind] / measured - 1})
    profiled_median = statistics.median(abs(r["profiled_error"]) for r in rows)
    analytic_median = statistics.median(abs(r["analytic_error"]) for r in rows)
    layer_rows = [r for r in rows if r["kind"] != "embedding"]
    lines = [f"Held-out shapes, fwd+bwd of one TP shard, fp32, 1 CPU thread, seq {SEQ}; "
             f"profile at micro-batch {PROFILED_MBS}, tp {PROFILED_TP}",
             f"{'model':<11} {'kind':<10} {'mbs':>3} {'tp':>3} {'measured ms':>12} {'profiled ms':>12} "
             f"{'error':>8} {'analytic ms':>12} {'error':>8}"]
    for r in rows:
        lines.append(f"{r['model']:<11} {r['kind']:<10} {r['micro_batch_size']:>3} {r['tp']:>3} "
                     f"{r['measured_s'] * 1e3:>12.3f} {r['profiled_s'] * 1e3:>12.3f} {r['profiled_error']:>+8.1%} "
                     f"{r['analytic_s'] * 1e3:>12.3f} {r['analytic_error']:>+8.1%}")
    lines += [f"median |error| with the profile: {profiled_median:.1%} (target <= {TARGET:.0%}); "
              f"analytic (cpu cluster, no profile): {analytic_median:.1%}",
              f"layer and head only (the millisecond kinds): with the profile "
              f"{statistics.median(abs(r['profiled_error']) for r in layer_rows):.1%}, analytic "
              f"{statistics.median(abs(r['analytic_error']) for r in layer_rows):.1%}",
              "profiler run time (one `shardwise profile` command each: GEMMs, elementwise, collectives on 2 "
              "processes, then the layer kinds at 8 shapes): "
              + ", ".join(f"{r['model']} {r['seconds']:.1f} s ({r['layer_kinds_seconds']:.1f} s of it layer kinds)"
                          for r in runs)]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "profile_heldout.txt").write_text(text)
    (out / "profile_heldout.json").write_text(json.dumps(
        {"seq_len": SEQ, "profiled_micro_batch_sizes": PROFILED_MBS, "profiled_tp": PROFILED_TP,
         "held_out": HELD_OUT, "models": MODELS, "rows": rows, "median_abs_error_profiled": profiled_median,
         "median_abs_error_analytic": analytic_median, "profiler_runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
