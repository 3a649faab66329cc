"""Long-context plans: Llama 3 models at 128K tokens, planned with and without context
parallelism (cp), and the search time of each. Beside them, Llama 3 405B's own 128K
configuration (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4: 16,384 H100s,
tp 8, cp 16, pp 16 (so dp 8), 16M tokens a batch, 38% BF16 MFU) priced as pinned: a
held-out check of the context-parallel terms, which nothing was fitted to.

The Llama 3 405B case is planned in bf16 and in FP8 (tensorwise, --precision fp8; MFU
against the bf16 peak, as torchtitan reports it). MFU counts the whole s x s attention (the convention of Korthikanti et al. 2022 eq. 7,
as torchtitan's), so at 128K, where attention is most of the FLOPs, it reads above
the FLOPs a causal kernel runs.

    PYTHONPATH=. python bench/long_context.py
Writes bench/results/long_context.{json,txt}.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from costmodel.units import GIB
from planner.api import plan
from planner.search import Infeasible

REPO = Path(__file__).resolve().parents[1]
SEQ = 131072

# (model, cluster, nodes, global batch in sequences, pins, precision)
CASES = [
    ("llama3-8b", "dgx-h100", 1, 8, {}, "bf16"),
    ("llama3-70b", "dgx-h100", 8, 32, {}, "bf16"),
    ("llama3-405b", "dgx-h100", 128, 128, {}, "bf16"),
    ("llama3-405b", "dgx-h100", 128, 128, {}, "fp8"),
]
# Dubey et al. 2024 Table 4, the 128K row: 16M tokens = 128 sequences of 131,072.
PUBLISHED = ("llama3-405b", "dgx-h100", 2048, 128, {"tp": 8, "cp": 16, "pp": 16, "dp": 8, "mbs": 1}, 0.38)


def label(strategy: dict) -> str:
    s = strategy
    parts = [f"dp{s['dp']}", f"tp{s['tp']}", f"pp{s['pp']}", f"cp{s.get('cp', 1)}"]
    if s["vpp"] > 1:
        parts.append(f"vpp{s['vpp']}")
    return " ".join(parts + [f"mbs{s['micro_batch_size']}", s["schedule"], f"zero{s['zero_stage']}",
                             f"recompute {s['recompute']}"])


def row(model: str, cluster: str, nodes: int, batch: int, fix: dict, precision: str = "bf16") -> dict:
    start = time.perf_counter()
    try:
        doc = plan(model, cluster, batch, nodes=nodes, seq_len=SEQ, fix=fix or None, precision=precision)
    except Infeasible as err:
        return {"model": model, "precision": precision, "fix": fix, "seconds": time.perf_counter() - start,
                "infeasible": str(err)}
    e = doc["estimate"]
    return {"model": model, "precision": precision, "gpus": doc["cluster"]["gpus_per_node"] * nodes, "fix": fix,
            "seconds": time.perf_counter() - start, "strategy": label(doc["strategy"]),
            "step_time_s": e["step_time_s"], "mfu": e["mfu"], "tokens_per_s_per_gpu": e["tokens_per_s"] / (8 * nodes),
            "peak_memory_gib": e["peak_memory_bytes"] / GIB, "cp_comm_share": e["time"].get("cp_comm_s", 0.0)
            / e["step_time_s"], "recompute_share": e["time"]["recompute_s"] / e["step_time_s"]}


def line(r: dict) -> str:
    pins = r["precision"] + " " + (",".join(f"{k}={v}" for k, v in r["fix"].items()) or "searched")
    if "infeasible" in r:
        return f"{r['model']:12s} {pins:28s} {r['seconds']:6.2f} s  infeasible: {r['infeasible'][:90]}"
    return (f"{r['model']:12s} {pins:28s} {r['seconds']:6.2f} s  {r['strategy']:52s} MFU {r['mfu']:.1%}  "
            f"{r['peak_memory_gib']:.1f} GiB  cp comm {r['cp_comm_share']:.1%}  recompute {r['recompute_share']:.1%}")


def main() -> None:
    rows = []
    for model, cluster, nodes, batch, fix, precision in CASES:
        rows.append(row(model, cluster, nodes, batch, fix, precision))
        rows.append(row(model, cluster, nodes, batch, {**fix, "cp": 1}, precision))
    model, cluster, nodes, batch, fix, published = PUBLISHED
    held_out = row(model, cluster, nodes, batch, fix)
    held_out["published_mfu"] = published
    rows.append(held_out)
    lines = [f"Llama 3 at {SEQ} tokens (plan time on this machine, best plan, its MFU, peak memory, shares of the step)"]
    lines += [line(r) for r in rows]
    if "mfu" in held_out:
        lines.append(f"held out: Llama 3 405B 128K on 16,384 H100 as Dubey et al. 2024 Table 4 ran it: "
                     f"MFU {held_out['mfu']:.1%} against the published {published:.0%}")
    text = "\n".join(lines)
    print(text)
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "long_context.txt").write_text(text + "\n")
    (out / "long_context.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
