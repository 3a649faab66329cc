"""Optimality of the pruned search: for small model/cluster pairs, solve the partition
program for every candidate of the space (no bounds, no pruning) and compare the best
with what `planner.search` returns. The partition program itself is checked against
enumeration of every layer split in tests/planner. Writes bench/results/optimality.json."""

import json
from pathlib import Path

from costmodel.estimate import estimate
from costmodel.estimate.uniform import unit_costs
from costmodel.problem import Problem
from costmodel.specs.loading import load_cluster, load_model, make_training
from planner.rules import load_rules
from planner.search import search
from planner.search.partition import solve_partition
from planner.search.space import describe, enumerate_space, recompute_modes

PAIRS = [("gpt3-1.3b", "dgx-a100-40gb", 8, 64, 2048), ("gpt3-2.7b", "dgx-a100-80gb", 4, 32, 2048),
         ("llama2-7b", "dgx-a100-40gb", 8, 32, 4096), ("gpt3-6.7b", "dgx-a100-80gb", 16, 64, 2048),
         ("llama3-8b", "dgx-h100", 8, 64, 8192), ("mixtral-8x7b", "dgx-h100", 16, 32, 4096)]


def main() -> None:
    rows, rules = [], load_rules()
    for model, cluster, gpus, batch, seq in PAIRS:
        m, c = load_model(model), load_cluster(cluster, gpus=gpus)
        p = Problem(m, c, make_training(m, c, batch, seq))
        modes = recompute_modes(p, rules)
        space, _ = enumerate_space(p, rules)
        best = None
        for s in space:
            units = unit_costs(p, s)
            sol = solve_partition(p, units, s, modes, rules.memory_headroom, rules.max_stage_imbalance)
            if sol is not None:
                e = estimate(p, sol.strategy, units)
                if best is None or e.step_time_s < best[0]:
                    best = (e.step_time_s, describe(sol.strategy))
        found = search(p, rules, top=1)
        ratio = found.best.estimate.step_time_s / best[0]
        rows.append({"model": model, "gpus": gpus, "candidates": len(space), "exhaustive_s": best[0],
                     "search_s": found.best.estimate.step_time_s, "ratio": ratio,
                     "exhaustive_best": best[1], "search_best": describe(found.best.strategy)})
        print(f"{model:13s} {gpus:3d} GPUs {len(space):5d} candidates  exhaustive {best[0]:.4f} s  "
              f"search {found.best.estimate.step_time_s:.4f} s  ratio {ratio:.5f}")
    print(f"worst ratio {max(r['ratio'] for r in rows):.5f} (target <= 1.01)")
    Path(__file__).with_name("results").mkdir(exist_ok=True)
    (Path(__file__).parent / "results" / "optimality.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
