"""Mixed clusters: the best plan on the whole mixed cluster against the best plan on its
fastest group alone and against the best plan that treats every device as the slowest
type (a homogeneous cluster of the slowest group's GPUs and links, of the same size),
as ratios of predicted throughput. Also the best plan that is made to use every group.

    python bench/mixed_clusters.py            # prints a table, writes bench/results/mixed_clusters.json
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from planner.api import make_problem
from planner.rules import load_rules
from planner.search import search
from planner.search.mixed import search_mixed
from planner.search.space import describe

CASES = [   # cluster, model, global batch, sequence, precision (V100 has no bf16)
    ("mixed-a100-v100", "llama2-13b", 512, 4096, "fp16"),
    ("mixed-h100-a100", "llama3-70b", 512, 4096, "bf16"),
    ("mixed-h200-a100-40gb", "llama2-13b", 256, 4096, "bf16"),
]


def main() -> None:
    rules = load_rules(None)
    rows = []
    for cluster_name, model, batch, seq, precision in CASES:
        problem = make_problem(model, cluster_name, batch, seq_len=seq, precision=precision)
        cluster = problem.cluster
        by_speed = sorted(cluster.groups, key=lambda g: g.gpu.peak_for(precision))
        slowest, fastest = by_speed[0], by_speed[-1]
        started = time.perf_counter()
        mixed = search(problem, rules, top=1)
        seconds = time.perf_counter() - started
        every = search_mixed(problem, rules, top=1, every_group=True)
        fast_only = search(replace(problem, cluster=fastest), rules, top=1)
        all_slow = replace(slowest, num_nodes=cluster.num_gpus // slowest.gpus_per_node)
        slow = search(replace(problem, cluster=all_slow), rules, top=1)
        row = {
            "cluster": cluster_name, "model": model, "gpus": cluster.num_gpus,
            "mixed_tokens_per_s": mixed.best.estimate.tokens_per_s, "mixed": describe(mixed.best.strategy),
            "mixed_layers": [st.num_layers for st in mixed.best.strategy.stages],
            "every_group_tokens_per_s": every.best.estimate.tokens_per_s, "every_group": describe(every.best.strategy),
            "fastest_only_tokens_per_s": fast_only.best.estimate.tokens_per_s,
            "fastest_only": f"{fastest.num_gpus} x {fastest.gpu.name}: {describe(fast_only.best.strategy)}",
            "all_slowest_tokens_per_s": slow.best.estimate.tokens_per_s,
            "all_slowest": f"{all_slow.num_gpus} x {slowest.gpu.name}: {describe(slow.best.strategy)}",
            "search_s": seconds,
        }
        row["vs_fastest_only"] = row["mixed_tokens_per_s"] / row["fastest_only_tokens_per_s"]
        row["vs_all_slowest"] = row["mixed_tokens_per_s"] / row["all_slowest_tokens_per_s"]
        row["every_group_vs_fastest_only"] = row["every_group_tokens_per_s"] / row["fastest_only_tokens_per_s"]
        rows.append(row)
        print(f"{cluster_name} ({cluster.num_gpus} GPUs), {model}, batch {batch} x {seq}, {precision}: "
              f"search {seconds:.1f} s")
        print(f"  mixed best     {row['mixed_tokens_per_s']:>10,.0f} tok/s  {row['mixed']}  layers {row['mixed_layers']}")
        print(f"  every group    {row['every_group_tokens_per_s']:>10,.0f} tok/s  {row['every_group']}")
        print(f"  fastest only   {row['fastest_only_tokens_per_s']:>10,.0f} tok/s  {row['fastest_only']}")
        print(f"  all slowest    {row['all_slowest_tokens_per_s']:>10,.0f} tok/s  {row['all_slowest']}")
        print(f"  ratios: mixed / fastest-only {row['vs_fastest_only']:.3f}, mixed / all-slowest "
              f"{row['vs_all_slowest']:.3f}, every-group / fastest-only {row['every_group_vs_fastest_only']:.3f}")
    out = Path(__file__).parent / "results" / "mixed_clusters.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
