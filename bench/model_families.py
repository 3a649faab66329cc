"""The 2026 model families (issue 22): for each, the parameters Shardwise counts from its
released config.json against the published figure, and the time to plan it at the
issue's scale. A family Shardwise does not read yet is listed with the field it refuses.

    python bench/model_families.py

Prints a table and writes bench/results/model_families.json. Published figures: the
model cards (Mixtral: Jiang et al. 2024 §2; Qwen1.5-MoE-A2.7B: its model card; Qwen3:
the Qwen3 technical report, table 1;
DeepSeek-V3: DeepSeek-AI 2024 §4.2; gpt-oss: OpenAI's model card 2025, table 1, whose
active counts leave out the unembedding, which Shardwise's active_params counts; Llama 4:
Meta's model card, whose 109B (Scout) counts the vision encoder Shardwise does not plan; Gemma 3:
the Gemma 3 technical report, table 1).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from costmodel.specs.loading import SpecError, load_model
from costmodel.terms.counts import active_parameters, total_parameters
from planner.api import plan
from planner.search import Infeasible

RESULTS = Path(__file__).parent / "results"

# name, the built-in (None: not read yet), published total and active (billions), what
# to plan (cluster, GPUs, global batch, sequence, precision).
FAMILIES = [
    ("Mixtral-8x7B", "mixtral-8x7b", 46.7, 12.9, ("dgx-h100", 16, 256, 4096, "bf16")),
    ("Qwen1.5-MoE-A2.7B", "qwen1.5-moe-a2.7b", 14.3, 2.7, ("dgx-h100", 16, 256, 4096, "bf16")),
    ("Qwen3-30B-A3B", "qwen3-30b-a3b", 30.5, 3.3, ("dgx-h100", 64, 512, 4096, "bf16")),
    ("Qwen3-235B-A22B", "qwen3-235b-a22b", 235.0, 22.0, ("dgx-h100", 256, 1024, 4096, "bf16")),
    ("DeepSeek-V3", "deepseek-v3", 671.0, 37.0, ("dgx-h100", 1024, 4096, 4096, "bf16")),
    ("Llama 4 Scout", "llama4-scout", 109.0, 17.0, ("dgx-h100", 64, 512, 8192, "bf16")),
    ("Llama 4 Maverick", "llama4-maverick", 400.0, 17.0, ("dgx-h100", 512, 1024, 8192, "bf16")),
    ("Gemma 3 1B", "gemma3-1b", 1.0, 1.0, ("dgx-h100", 8, 512, 8192, "bf16")),
    ("gpt-oss-20b", "gpt-oss-20b", 20.9, 3.6, ("dgx-h100", 16, 256, 4096, "bf16")),
    ("gpt-oss-120b", "gpt-oss-120b", 116.8, 5.1, ("dgx-h100", 64, 512, 4096, "bf16")),
]


def main() -> None:
    rows = []
    for label, builtin, total_b, active_b, (cluster, gpus, batch, seq, precision) in FAMILIES:
        row = {"family": label, "published_total_b": total_b, "published_active_b": active_b,
               "plan": f"{gpus} x {cluster}, batch {batch} x {seq}, {precision}"}
        if builtin is None:
            row["status"] = "not read yet"
            rows.append(row)
            continue
        try:
            model = load_model(builtin)
        except SpecError as err:
            row["status"] = f"refused: {err}"
            rows.append(row)
            continue
        row["total_b"] = total_parameters(model) / 1e9
        row["active_b"] = active_parameters(model) / 1e9
        start = time.perf_counter()
        try:
            doc = plan(builtin, cluster, batch, gpus=gpus, seq_len=seq, precision=precision)
            s = doc["strategy"]
            row["status"] = (f"dp {s['dp']} tp {s['tp']} pp {s['pp']} ep {s['ep']} zero {s['zero_stage']}, "
                             f"{doc['estimate']['step_time_s']:.2f} s/step")
        except Infeasible as err:
            row["status"] = f"infeasible: {str(err)[:80]}"
        row["plan_s"] = time.perf_counter() - start
        rows.append(row)
    print(f"{'family':17s} {'total B':>9s} {'published':>9s} {'active B':>9s} {'published':>9s} {'plan s':>7s}  plan")
    for r in rows:
        counted = (f"{r['total_b']:9.2f} {r['published_total_b']:9.1f} {r['active_b']:9.2f} "
                   f"{r['published_active_b']:9.1f} {r['plan_s']:7.2f}" if "total_b" in r else
                   f"{'-':>9s} {r['published_total_b']:9.1f} {'-':>9s} {r['published_active_b']:9.1f} {'-':>7s}")
        print(f"{r['family']:17s} {counted}  {r['plan']}: {r['status']}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "model_families.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
