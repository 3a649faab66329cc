"""Start-up cost of the `shardwise` command (issue 21's targets on a 2-core machine):

- `shardwise --help` within 3x of a bare `python -c "import click, numpy"`;
- `shardwise plan` for GPT-3 175B on 128 A100s within 1.5x of the same search run
  in-process (planner.search.search, warm: what bench/search_time.py times).

Each command runs REPEATS times as a fresh process, the three interleaved so that noise
falls on all; medians. Prints a table and writes bench/results/startup.json.
"""

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPEATS = 7
PLAN = ["plan", "--model", "gpt3-175b", "--cluster", "dgx-a100-80gb", "--nodes", "16", "--global-batch", "1536",
        "--format", "json"]
COMMANDS = {
    "bare: python -c 'import click, numpy'": [sys.executable, "-c", "import click, numpy"],
    "shardwise --help": [sys.executable, "-m", "planner.console.cli", "--help"],
    "shardwise plan gpt3-175b, 128 GPUs": [sys.executable, "-m", "planner.console.cli", *PLAN],
}


def wall_s(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def search_s() -> float:
    """The 175B search in this process, after a warm-up run (imports and caches paid)."""
    from costmodel.problem import Problem
    from costmodel.specs.loading import load_cluster, load_model, make_training
    from planner.rules import load_rules
    from planner.search import search

    m, c = load_model("gpt3-175b"), load_cluster("dgx-a100-80gb", nodes=16)
    problem = Problem(m, c, make_training(m, c, 1536, 2048))
    search(problem, load_rules())
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        search(problem, load_rules())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    samples = {name: [] for name in COMMANDS}
    for _ in range(REPEATS):
        for name, cmd in COMMANDS.items():
            samples[name].append(wall_s(cmd))
    wall = {name: statistics.median(times) for name, times in samples.items()}
    bare, help_s, plan_s = wall.values()
    in_process = search_s()
    rows = [
        {"what": "shardwise --help vs bare start", "seconds": help_s, "baseline_s": bare,
         "ratio": help_s / bare, "target_ratio": 3.0},
        {"what": "shardwise plan 175B vs in-process search", "seconds": plan_s, "baseline_s": in_process,
         "ratio": plan_s / in_process, "target_ratio": 1.5},
    ]
    for name, seconds in wall.items():
        print(f"{name:40s} {seconds:6.3f} s (median of {REPEATS})")
    print(f"{'in-process search, gpt3-175b 128 GPUs':40s} {in_process:6.3f} s")
    for r in rows:
        verdict = "meets" if r["ratio"] <= r["target_ratio"] else "misses"
        print(f"{r['what']:45s} {r['ratio']:.2f}x (target {r['target_ratio']:g}x: {verdict})")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "startup.json").write_text(json.dumps({"wall_s": wall, "in_process_search_s": in_process, "rows": rows},
                                                 indent=2) + "\n")


if __name__ == "__main__":
    main()
