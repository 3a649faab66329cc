"""Plausibility: the best plan's MFU for three well-known jobs, beside the best published
MFU for that hardware class, under each runtime profile that applies. A plan claiming
more than the published figure gets its reason printed (its time breakdown), so a reader
can judge whether the cost model or the published run leaves something on the table.

Published figures (model FLOPs utilisation, bf16, dense peak):
- GPT-3 175B on A100 80GB: 51.4% (Korthikanti et al. 2022, Table 5 "Present Work", tp 8 pp 8 on 64 A100 80GB,
  Megatron-LM; also the Megatron-LM README, 175B 51.4% MFU / 52.8% HFU). Narayanan et al. 2021 report 163
  TFLOP/s per GPU (52% of 312, HFU with full recompute) on 1536 A100s for 175B.
- Llama 3 70B on H100: torchtitan's Llama 3.1 70B, FSDP 32 x TP 8, async TP, compiled, bf16 on 256 H100
  (torchtitan_h100_runs.json tt_70b_256gpu_tp8_bf16_asynctp: 652.4 tokens/s per GPU; MFU derived below with
  the cost model's FLOP count against 989 TFLOP/s, on 500 W parts); Llama 3 405B's own 38-43% (next line) is
  the best H100 bf16 figure we know for a dense model of this class.
- Llama 3 405B on H100: 38-43% BF16 MFU on 8,192-16,384 H100s (Dubey et al. 2024, "The Llama 3 Herd of
  Models", Table 4: 43% at 8,192 GPUs, tp 8 cp 1 pp 16 dp 64; 41% at 16,384 with cp 1, 38% with cp 16).

    PYTHONPATH=. python bench/plausibility.py
Writes bench/results/plausibility.{json,txt}.
"""

from __future__ import annotations

import json
from pathlib import Path

from costmodel.specs.loading import load_model
from costmodel.terms.counts import model_flops_per_step
from planner.api import plan

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO.parent / "shared" / "reference"


def torchtitan_70b_mfu() -> float:
    """MFU of tt_70b_256gpu_tp8_bf16_asynctp, derived with the cost model's FLOPs (eq. 7 style:
    6 N per token plus attention) against the 989 TFLOP/s the source reports MFU against."""
    rows = {r["id"]: r for r in json.loads((REFERENCE / "torchtitan_h100_runs.json").read_text())["runs"]}
    row = rows["tt_70b_256gpu_tp8_bf16_asynctp"]
    seq = row["strategy"]["seq_len"]
    per_token = model_flops_per_step(load_model("llama3-70b"), 1, seq) / seq
    return row["measured"]["tokens_per_s_per_gpu"] * per_token / 9.89e14


JOBS = [
    # (label, model, cluster, gpus, global batch, seq, runtimes, published MFU, its source)
    ("GPT-3 175B on 128 A100 80GB", "gpt3-175b", "dgx-a100-80gb", 128, 1536, 2048, ("pytorch-native", "megatron"),
     0.514, "Korthikanti et al. 2022 Table 5 (Megatron-LM, 64 A100 80GB)"),
    ("Llama 3 70B on 64 H100", "llama3-70b", "dgx-h100", 64, 1024, 8192, ("pytorch-native", "megatron"),
     None, "torchtitan 70B bf16 async TP, 256 H100 500 W (derived); Dubey et al. 2024 Table 4: 38-43% (405B)"),
    ("Llama 3 405B on 1024 H100", "llama3-405b", "dgx-h100", 1024, 2048, 8192, ("pytorch-native", "megatron"),
     0.43, "Dubey et al. 2024 Table 4 (Llama 3 405B, 8,192 H100, bf16)"),
]


# Why a plan may claim more than the published run, job by job (read from the printed breakdowns).
WHY = {
    "GPT-3 175B on 128 A100 80GB": (
        "the published 51.4% ran global batch 64 (pipeline bubble (p-1)/(v m) = 7/192 of compute plus selective "
        "recompute); at batch 1536 the bubble all but vanishes and the plan recomputes only some layers (mixed), "
        "so ~90% of the step is compute at the GEMM curve's efficiency for tp 2-4 shards, which the curve "
        "extrapolates from Korthikanti's tp-8 layer (no published A100 layer measures it there)"),
    "Llama 3 70B on 64 H100": (
        "torchtitan's 31.8% ran on 500 W H100s (a GEMM ceiling of 0.72 against the SXM's 0.80 here) with full "
        "recompute (a third more compute); Meta's 38-43% is 405B at 8-16k GPUs. The plan recomputes only some "
        "layers on 700 W SXM parts"),
    "Llama 3 405B on 1024 H100": (
        "Meta's 43% is at 8,192 GPUs (dp 64, more DP traffic and stragglers over a 54-day run); at 1,024 GPUs "
        "the same tp 8 pp 8 plan pays less data-parallel time; under pytorch-native the excess is a few points, "
        "inside the profile's cross-validated error"),
}


def main() -> None:
    rows, lines = [], []
    tt70 = torchtitan_70b_mfu() if (REFERENCE / "torchtitan_h100_runs.json").exists() else None
    header = f"{'job':<28} {'runtime':<15} {'best plan':<58} {'MFU':>6} {'published':>9}  source"
    lines.append(header)
    for label, model, cluster, gpus, batch, seq, runtimes, published, source in JOBS:
        if published is None:
            published = max(tt70 or 0.0, 0.43)   # the best of the two H100 figures we cite
            source = f"{source}; torchtitan 70B derived {tt70:.1%}" if tt70 else source
        for runtime in runtimes:
            doc = plan(model, cluster, batch, gpus=gpus, seq_len=seq, top=1, runtime=runtime)
            s, e = doc["strategy"], doc["estimate"]
            what = (f"dp {s['dp']} tp {s['tp']} pp {s['pp']} vpp {s['vpp']} mbs {s['micro_batch_size']} "
                    f"zero {s['zero_stage']} {s['recompute']}{' sp' if s['sequence_parallel'] else ''} "
                    f"{s['schedule']}")
            row = {"job": label, "runtime": runtime, "strategy": what, "mfu": e["mfu"], "step_time_s": e["step_time_s"],
                   "published_mfu": published, "published_source": source, "time": e["time"]}
            rows.append(row)
            lines.append(f"{label:<28} {runtime:<15} {what:<58} {e['mfu']:6.1%} {published:9.1%}  {source}")
            if e["mfu"] > published:
                t, step = e["time"], e["step_time_s"]
                parts = ", ".join(f"{k.removesuffix('_s')} {v / step:.1%}" for k, v in sorted(t.items(), key=lambda kv: -kv[1])
                                  if v / step >= 0.005)
                lines.append(f"{'':<28} claims {e['mfu'] - published:+.1%} over the published figure; step "
                             f"{step:.2f} s = {parts}")
                row["why"] = WHY[label]
        lines.append(f"{'':<28} why more: {WHY[label]}")
        lines.append(f"{'':<28} megatron row: the megatron profile is fitted on A100 runs only (Korthikanti 2022); "
                     "on H100 it keeps fused kernels at the full GEMM curve, with no H100 Megatron run to check it")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "plausibility.txt").write_text(text)
    (out / "plausibility.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
