"""The executor at speed on one GPU: plan a fixed set of single-GPU cases, run each with
`shardwise run`, and print measured beside estimated step time, MFU and peak memory.

Cases (bf16, one GPU; layer counts cut so each fits and runs in seconds):
- Llama-3-8B shape, 8 layers at seq 4096 and 4 layers at seq 8192, eager and compiled
  (torch.compile per block, `plan --compile`);
- GPT-3 1.3B at seq 2048 with selective (per-op) recompute;
- Mixtral-8x7B shape, 2 layers at seq 4096 (the experts as one grouped GEMM).
fp8 waits for an fp8 precision in the cost model.

MFU is model FLOPs per second over the data-sheet bf16 peak (the estimate's own
figure, scaled by estimated over measured step time for the run). Peak memory is
torch.cuda.max_memory_allocated against the estimate without its runtime reserve.
The whole script is meant to finish in under 8 minutes on one H100 or H200.

    python bench/gpu.py                  # on a GPU machine: plan, run, print, write JSON
    python bench/gpu.py --plan-only      # anywhere: the planning half (CI runs it)
    python bench/gpu.py --cluster dgx-h100 --steps 6 --out results.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from costmodel.units import GIB  # noqa: E402
from planner.api import plan  # noqa: E402
from planner.plan_file import write_plan  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    layers: int | None
    seq_len: int
    global_batch: int
    compile: bool = False
    fix: str | None = None


CASES = (
    Case("llama3-8b L8 s4096 eager", "llama3-8b", 8, 4096, 8),
    Case("llama3-8b L8 s4096 compiled", "llama3-8b", 8, 4096, 8, compile=True),
    Case("llama3-8b L4 s8192 eager", "llama3-8b", 4, 8192, 8),
    Case("llama3-8b L4 s8192 compiled", "llama3-8b", 4, 8192, 8, compile=True),
    Case("gpt3-1.3b s2048 selective", "gpt3-1.3b", None, 2048, 32, fix="recompute=selective"),
    Case("mixtral-8x7b L2 s4096", "mixtral-8x7b", 2, 4096, 8),
)


def cluster_of_this_gpu() -> str:
    import torch
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return "dgx-h100" if "H100" in name else "dgx-h200"


def plan_case(case: Case, cluster: str) -> dict:
    overrides = {"num_hidden_layers": str(case.layers)} if case.layers else None
    return plan(case.model, cluster, case.global_batch, gpus=1, seq_len=case.seq_len, precision="bf16",
                overrides=overrides, fix=case.fix, compile=case.compile, top=1)


def run_case(doc: dict, steps: int, timeout_s: float) -> dict:
    """`shardwise run` on the plan; its closing summary, or why it has none."""
    with tempfile.TemporaryDirectory() as folder:
        plan_file, metrics = Path(folder) / "plan.json", Path(folder) / "metrics.jsonl"
        write_plan(doc, plan_file)
        cmd = [sys.executable, "-m", "planner.console.cli", "run", str(plan_file), "--steps", str(steps),
               "--metrics-out", str(metrics)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"outcome": f"timed out after {timeout_s:.0f} s"}
        lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        if done.returncode != 0 or not lines or "summary" not in lines[-1]:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"outcome": f"exit {done.returncode}: " + " | ".join(tail)}
        return {"outcome": "ran", **lines[-1]["summary"]}


def row(case: Case, doc: dict, ran: dict | None) -> dict:
    e, s = doc["estimate"], doc["strategy"]
    out = {"case": case.name, "plan": f"mbs {s['micro_batch_size']} x {s['num_microbatches']} "
                                      f"recompute {doc['strategy'].get('recompute', '?')}",
           "estimated_step_s": e["step_time_s"], "estimated_mfu": e["mfu"],
           "estimated_peak_gib": (e["peak_memory_bytes"] - e["memory"]["runtime_reserve_bytes"]) / GIB}
    if ran is not None:
        out["outcome"] = ran["outcome"]
        if ran["outcome"] == "ran":
            measured = ran["measured_step_time_s"]
            out.update(measured_step_s=measured, measured_mfu=e["mfu"] * e["step_time_s"] / measured,
                       measured_peak_gib=ran["measured_peak_memory_bytes"] / GIB,
                       compile=ran.get("numerics", {}).get("compile"))
    return out


def table(rows: list[dict]) -> str:
    def fmt(value, spec):
        width = int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 0)
        return "-".rjust(width) if value is None else format(value, spec)

    lines = [f"{'case':30s} {'est s':>8s} {'meas s':>8s} {'ratio':>6s} {'est MFU':>8s} {'meas MFU':>8s} "
             f"{'est GiB':>8s} {'meas GiB':>8s} {'mem err':>8s}  outcome"]
    for r in rows:
        ratio = r["measured_step_s"] / r["estimated_step_s"] if "measured_step_s" in r else None
        mem_err = r["estimated_peak_gib"] / r["measured_peak_gib"] - 1 if "measured_peak_gib" in r else None
        lines.append(f"{r['case']:30s} {r['estimated_step_s']:8.3f} {fmt(r.get('measured_step_s'), '8.3f')} "
                     f"{fmt(ratio, '6.2f')} {r['estimated_mfu']:8.1%} {fmt(r.get('measured_mfu'), '8.1%')} "
                     f"{r['estimated_peak_gib']:8.1f} {fmt(r.get('measured_peak_gib'), '8.1f')} "
                     f"{fmt(mem_err, '+8.1%')}  {r.get('outcome', 'planned')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan-only", action="store_true", help="Plan the cases and print the estimates; no GPU.")
    parser.add_argument("--cluster", default=None, help="Cluster to plan for [default: this GPU's, else dgx-h200].")
    parser.add_argument("--steps", type=int, default=6, help="Steps per run (the first, warm-up, is not timed).")
    parser.add_argument("--case-timeout-s", type=float, default=150.0)
    parser.add_argument("--out", default=None, help="Write the rows as JSON here [default: bench/results/gpu.json "
                                                    "after runs, nothing with --plan-only].")
    args = parser.parse_args(argv)
    cluster = args.cluster or ("dgx-h200" if args.plan_only else cluster_of_this_gpu())
    rows, start = [], time.perf_counter()
    for case in CASES:
        doc = plan_case(case, cluster)
        ran = None if args.plan_only else run_case(doc, args.steps, args.case_timeout_s)
        rows.append(row(case, doc, ran))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\n{cluster}, {time.perf_counter() - start:.0f} s\n" + table(rows))
    out = args.out or (None if args.plan_only else str(ROOT / "bench" / "results" / "gpu.json"))
    if out:
        Path(out).write_text(json.dumps({"cluster": cluster, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
