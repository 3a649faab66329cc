"""Memory a pipeline schedule holds, measured: peak RSS per pipeline rank of a training
step of the executor (tiny-llama, 8 layers, fp32, CPU ranks, gloo) under Schedule1F1B
and the zero-bubble schedules, against the cost model (costmodel.terms.memory.
in_flight_microbatches and the rank memory of costmodel.estimate).

Each rank's peak is the process's maximum resident set (large tensors are their own
mappings on CPU, so RSS follows what is alive: the script pins glibc's mmap threshold,
MALLOC_ENV, so that freed blocks leave the RSS). Printed per rank: the excess over the
same rank under 1f1b, measured and estimated (MiB), and the measured excess as
micro-batches of the rank's layers' activations plus the 1f1b count (what the schedule
held, "held") beside the count the cost model uses. The estimated excess must not be
lower than the measured one: a low memory figure is the dangerous side. zbv and
dualpipev move the LM head and loss to rank 0 (their V), which their excess includes.

    python bench/pipeline_memory.py        # about 2 minutes on 2 cores

prints the table and writes it to bench/results/pipeline_memory.txt.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from costmodel.estimate import estimate  # noqa: E402
from costmodel.estimate.uniform import unit_costs  # noqa: E402
from costmodel.problem import Problem  # noqa: E402
from costmodel.specs import TrainingSpec  # noqa: E402
from costmodel.specs.loading import load_cluster, load_model, make_training  # noqa: E402
from costmodel.strategy import Strategy, even_stages  # noqa: E402
from costmodel.terms.memory import in_flight_microbatches  # noqa: E402
from executor.data import SyntheticTokens  # noqa: E402
from executor.launch import run_local  # noqa: E402
from executor.train import TrainConfig, Trainer  # noqa: E402

LAYERS, SEQ = 8, 1024
CASES = [(2, 4, 8), (2, 2, 16), (4, 4, 8)]   # pp, micro-batch size, micro-batches
SCHEDULES = [("1f1b", 1), ("zb-interleaved", 1), ("zbv", 2), ("dualpipev", 2)]


def spec():
    return load_model("tiny-llama", overrides={"num_hidden_layers": str(LAYERS), "max_position_embeddings": str(SEQ)})


def strategy(pp: int, mbs: int, m: int, schedule: str, vpp: int) -> Strategy:
    return Strategy(dp=1, tp=1, pp=pp, micro_batch_size=mbs, num_microbatches=m, vpp=vpp, schedule=schedule,
                    stages=even_stages(LAYERS, pp, vpp, "none", schedule))


def rank_peak_bytes(rank: int, world: int, pp: int, mbs: int, m: int, schedule: str, vpp: int) -> float:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model = spec()
    trainer = Trainer(model, TrainingSpec(global_batch=mbs * m, seq_len=SEQ, precision="fp32"),
                      strategy(pp, mbs, m, schedule, vpp), TrainConfig(), "cpu")
    x, y = SyntheticTokens(model.vocab_size, seed=0).global_batch(0, mbs * m, SEQ)
    for _ in range(2):
        trainer.step(x, y)
        gc.collect()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


RESULTS = Path(__file__).resolve().parent / "results" / "pipeline_memory.txt"


# glibc's malloc raises its mmap threshold to the size of each mmapped block it frees, so
# later blocks up to that size come from the heap and stay in the RSS after they are
# freed: a peak that follows the allocation order, not what is alive (dualpipev's rank 0
# measured 84, 155 and 260 MiB over 1F1B at m 8, 16 and 32 with it, 45 and 84 MiB at m
# 8 and 32 without). The threshold is pinned at its default, 128 KiB.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def main() -> None:
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):   # glibc reads it at start-up
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    model = spec()
    cluster = load_cluster("cpu", gpus=2)
    say(f"tiny-llama, {LAYERS} layers, seq {SEQ}, fp32: per rank, excess over 1f1b measured / estimated MiB, "
          f"micro-batches held (counted)")
    for pp, mbs, m in CASES:
        problem = Problem(model, cluster, make_training(model, cluster, mbs * m, SEQ, precision="fp32"))
        per_layer = unit_costs(problem, strategy(pp, mbs, m, "1f1b", 1)).layer_activation_bytes["none"]
        per_microbatch = per_layer * LAYERS / pp
        estimated = {(s, v): estimate(problem, strategy(pp, mbs, m, s, v)).rank_memory_bytes for s, v in SCHEDULES}
        peaks = {(s, v): run_local(rank_peak_bytes, pp, pp, mbs, m, s, v) for s, v in SCHEDULES}
        base, base_estimate = peaks[("1f1b", 1)], estimated[("1f1b", 1)]
        say(f"pp {pp}, micro-batch {mbs}, {m} micro-batches ({per_microbatch / 2**20:.0f} MiB of activations "
              f"per micro-batch and rank)")
        for (schedule, vpp), rss in peaks.items():
            if schedule == "1f1b":
                continue
            cells = []
            for r in range(pp):
                measured = rss[r] - base[r]
                model_excess = estimated[(schedule, vpp)][r] - base_estimate[r]
                held = in_flight_microbatches("1f1b", pp, r, m) + measured / per_microbatch
                flag = "" if model_excess >= measured else " LOW"
                cells.append(f"r{r} {measured / 2**20:+6.0f} / {model_excess / 2**20:+6.0f}{flag}, "
                             f"{held:3.1f} ({in_flight_microbatches(schedule, pp, r, m, vpp):.0f})")
            say(f"  {schedule:15s} " + "   ".join(cells))
    RESULTS.write_text("\n".join(lines) + "\n")

if __name__ == "__main__":
    main()
