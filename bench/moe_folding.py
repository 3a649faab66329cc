"""MoE parallel folding against experts split over tp, under Megatron-LM's runtime.

    python bench/moe_folding.py

Megatron-Core lays out the experts' groups apart from attention's (Liu et al. 2025,
"MoE Parallel Folding"; megatron-core parallel_state's expert RankGenerator): attention
takes tp while the experts stay whole (--expert-tensor-parallel-size 1) and the ep group
takes ranks from tp, cp and dp. Each MoE model is planned twice on the same cluster and
batch: with the megatron profile as it is (moe_folding true: the search chooses etp 1 or
tp), and with folding off (experts split over tp, ep inside dp). The table prints both
best plans and their step times; the ratio says what folding is worth where the search
is free to take it. Nothing here is measured: it shows what the cost model prefers and
why (the TP and EP time of each plan).
Writes bench/results/moe_folding.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from costmodel.specs.loading import load_runtime
from planner.api import plan
from planner.plan_file import strategy_of
from planner.search.space import describe

RESULTS = Path(__file__).resolve().parent / "results"
MEGATRON = Path(__file__).resolve().parents[1] / "configs" / "runtimes" / "megatron.yaml"

# (model, cluster, GPUs, global batch, sequence length, precision, --fix): the issue's
# scales, free, and with tp pinned where a user's recipe takes it (long sequences, or
# attention too large for one GPU), which is where folding matters.
CASES = [
    ("mixtral-8x7b", "dgx-h100", 16, 256, 4096, "bf16", None),
    ("qwen3-30b-a3b", "dgx-h100", 64, 512, 4096, "bf16", None),
    ("qwen3-235b-a22b", "dgx-h100", 256, 1024, 4096, "bf16", None),
    ("qwen3-235b-a22b", "dgx-h100", 256, 1024, 4096, "bf16", "tp=4"),
    ("deepseek-v3", "dgx-h100", 1024, 4096, 4096, "fp8", None),
    ("deepseek-v3", "dgx-h100", 1024, 4096, 4096, "fp8", "tp=2"),
]


def best(model: str, cluster: str, gpus: int, batch: int, seq: int, precision: str, fix: str | None,
         runtime: str | Path) -> dict:
    start = time.perf_counter()
    doc = plan(model, cluster, batch, gpus=gpus, seq_len=seq, precision=precision, runtime=str(runtime), top=1,
               fix=fix)
    seconds = time.perf_counter() - start
    t = doc["estimate"]["time"]
    return {"strategy": describe(strategy_of(doc)), "step_time_s": doc["estimate"]["step_time_s"],
            "tp_comm_s": t["tp_comm_s"], "ep_comm_s": t["ep_comm_s"], "plan_s": seconds}


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    # The megatron profile with folding off: experts split over tp, ep inside dp.
    split_runtime = RESULTS / ".megatron-no-folding.yaml"
    split_runtime.write_text(MEGATRON.read_text().replace("\nmoe_folding: true", "\nmoe_folding: false"))
    assert not load_runtime(split_runtime).moe_folding
    rows = []
    for model, cluster, gpus, batch, seq, precision, fix in CASES:
        row = {"model": model, "job": f"{gpus} x {cluster}, batch {batch} x {seq}, {precision}"
                                      + (f", --fix {fix}" if fix else "")}
        row["folded"] = best(model, cluster, gpus, batch, seq, precision, fix, "megatron")
        row["split"] = best(model, cluster, gpus, batch, seq, precision, fix, split_runtime)
        row["speedup"] = row["split"]["step_time_s"] / row["folded"]["step_time_s"]
        rows.append(row)
    split_runtime.unlink()
    print(f"{'model':16s} {'folding':8s} {'step s':>8s} {'TP s':>7s} {'EP s':>7s} {'plan s':>7s}  plan")
    for r in rows:
        for key in ("folded", "split"):
            b = r[key]
            print(f"{r['model'] if key == 'folded' else '':16s} {'on' if key == 'folded' else 'off':8s} "
                  f"{b['step_time_s']:8.3f} {b['tp_comm_s']:7.3f} {b['ep_comm_s']:7.3f} {b['plan_s']:7.2f}  "
                  f"{b['strategy']}")
        print(f"{'':16s} off / on: {r['speedup']:.3f}x  ({r['job']})")
    (RESULTS / "moe_folding.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
