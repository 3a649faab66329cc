"""Search time of `planner.search` on three large problems (targets on a 2-core machine:
under 2 s up to 175B and 1024 GPUs, under 10 s for 1T on 3072 GPUs). Median of 3 runs.
Prints a table and writes bench/results/search_time.json."""

import json
import statistics
import time
from pathlib import Path

from costmodel.problem import Problem
from costmodel.specs.loading import load_cluster, load_model, make_training
from planner.rules import load_rules
from planner.search import search
from planner.search.space import describe

CASES = [("gpt3-175b", "dgx-a100-80gb", 16, 1536, 2048, 2.0),
         ("llama3-70b", "dgx-h100", 8, 1024, 8192, 2.0),
         ("gpt-1t", "dgx-a100-80gb", 384, 3072, 2048, 10.0)]


def main() -> None:
    rows = []
    for model, cluster, nodes, batch, seq, target in CASES:
        m, c = load_model(model), load_cluster(cluster, nodes=nodes)
        p = Problem(m, c, make_training(m, c, batch, seq))
        times = []
        for _ in range(3):
            start = time.perf_counter()
            result = search(p, load_rules())
            times.append(time.perf_counter() - start)
        st, e = result.stats, result.best.estimate
        rows.append({"model": model, "gpus": c.num_gpus, "seconds_median": statistics.median(times),
                     "target_s": target, "candidates": st.candidates, "ilp_solves": st.ilp_solves,
                     "best": describe(result.best.strategy), "mfu": e.mfu})
        r = rows[-1]
        print(f"{model:11s} {r['gpus']:5d} GPUs  {r['seconds_median']:.2f} s (target {target:.0f} s)  "
              f"{st.candidates} candidates, {st.ilp_solves} ILP solves  best: {r['best']} MFU {e.mfu:.1%}")
    Path(__file__).with_name("results").mkdir(exist_ok=True)
    (Path(__file__).parent / "results" / "search_time.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
