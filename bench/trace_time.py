"""Time of tracing and planning modules the specs do not describe, on a 2-core
machine (targets: a 70B Llama traced on the meta device under 30 s; a 100-block
residual MLP stack planned on 32 A100s with pp 4 under 20 s). Median of 3 runs.
Prints a table and writes bench/results/trace_time.json. The tests check what these
runs do (nodes, partitions, memory), never their seconds."""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from costmodel.specs.loading import load_model
from costmodel.trace import trace_module
from executor.models import build_model
from planner import plan_model

# The residual MLP stack the test plans, timed here.
sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "planner"))
from test_api import Residual  # noqa: E402

RUNS = 3


def trace_70b() -> dict:
    spec = load_model("llama3-70b")
    model = build_model(spec, 1024)
    graph = trace_module(model, (torch.randint(0, spec.vocab_size, (1, 1024), device="meta"),))
    return {"nodes": graph.number_of_nodes()}


def plan_residual() -> dict:
    with torch.device("meta"):
        model = Residual()
    inputs = (torch.randn(4, 128, 256, device="meta"),)
    doc = plan_model(model, inputs, cluster="dgx-a100-80gb", nodes=4, global_batch=256, fix={"pp": 4, "zero": 0})
    return {"partitions": doc["search"]["ilp_solves"], "candidates": doc["search"]["candidates"]}


CASES = [("trace llama3-70b (seq 1024, meta)", trace_70b, 30.0),
         ("plan 100-block residual stack, 32 A100, pp 4", plan_residual, 20.0)]


def main() -> None:
    rows = []
    for name, fn, target in CASES:
        times = []
        for _ in range(RUNS):
            start = time.perf_counter()
            counts = fn()
            times.append(time.perf_counter() - start)
        rows.append({"case": name, "seconds_median": statistics.median(times), "target_s": target, **counts})
        print(f"{name:46s} {rows[-1]['seconds_median']:6.2f} s (target {target:.0f} s)  {counts}", flush=True)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "trace_time.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
