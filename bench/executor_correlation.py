"""Does the cost model rank plans as the machine does? Twelve plans of one model on two
gloo ranks here: the step time `costmodel.estimate` predicts with the local `cpu`
cluster spec against the median measured step of the executor, and their Spearman
rank correlation (target: at least 0.8). Prints the table and writes
bench/results/executor_correlation.json."""

import json
import statistics
import time
from pathlib import Path

import numpy as np

from costmodel.estimate import estimate
from costmodel.problem import Problem
from costmodel.specs import TrainingSpec
from costmodel.specs.loading import load_cluster, load_model
from costmodel.strategy import Strategy, even_stages
from executor.data import SyntheticTokens
from executor.launch import run_local
from executor.train import TrainConfig, Trainer
from planner.search.space import describe

MODEL = {"hidden_size": "512", "num_hidden_layers": "4", "intermediate_size": "2048",
         "max_position_embeddings": "128", "num_attention_heads": "8", "num_key_value_heads": "8"}
SEQ, BATCH, ROUNDS, STEPS = 128, 8, 5, 2
PLANS = [  # dp, tp, pp, m, extra
    (2, 1, 1, 1, {}), (2, 1, 1, 2, {}), (2, 1, 1, 1, {"zero_stage": 2}), (2, 1, 1, 1, {"zero_stage": 3}),
    (2, 1, 1, 1, {"recompute": "full"}), (2, 1, 1, 2, {"zero_stage": 3, "recompute": "full"}),
    (1, 2, 1, 1, {}), (1, 2, 1, 1, {"sequence_parallel": True}), (1, 2, 1, 2, {"recompute": "full"}),
    (1, 1, 2, 2, {"schedule": "gpipe"}), (1, 1, 2, 4, {"schedule": "1f1b"}),
    (1, 1, 2, 4, {"schedule": "interleaved", "vpp": 2}),
]


def strategies(layers):
    out = []
    for dp, tp, pp, m, extra in PLANS:
        s = Strategy(dp=dp, tp=tp, pp=pp, micro_batch_size=BATCH // (dp * m), num_microbatches=m,
                     **{k: v for k, v in extra.items() if k != "recompute"})
        out.append(s.with_stages(even_stages(layers, pp, s.vpp, extra.get("recompute", "none"))))
    return out


def measure(rank, world):
    """Median step of each plan; the plans take turns in rounds so that the machine's
    drift touches all of them alike."""
    spec = load_model("tiny-gpt", MODEL)
    training = TrainingSpec(BATCH, SEQ, precision="fp32", optimizer="adamw")
    source = SyntheticTokens(spec.vocab_size)
    total = 1 + ROUNDS * STEPS
    trainers = [Trainer(spec, training, s, TrainConfig(total_steps=total), "cpu")
                for s in strategies(spec.num_hidden_layers)]
    times = [[] for _ in trainers]
    for trainer in trainers:   # warm-up step, not timed
        trainer.step(*source.global_batch(0, BATCH, SEQ))
    for r in range(ROUNDS):
        for trainer, timed in zip(trainers, times):
            for i in range(STEPS):
                x, y = source.global_batch(1 + r * STEPS + i, BATCH, SEQ)
                start = time.perf_counter()
                trainer.step(x, y)
                timed.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def main() -> None:
    spec = load_model("tiny-gpt", MODEL)
    problem = Problem(spec, load_cluster("cpu", gpus=2), TrainingSpec(BATCH, SEQ, precision="fp32"))
    plans = strategies(spec.num_hidden_layers)
    predicted = [estimate(problem, s).step_time_s for s in plans]
    measured = run_local(measure, 2)[0]
    rho = spearman(predicted, measured)
    rows = [{"plan": f"{describe(s)} recompute={s.recompute}", "predicted_step_s": p, "measured_step_s": m}
            for s, p, m in zip(plans, predicted, measured)]
    print(f"{'plan':70s} {'predicted ms':>12s} {'measured ms':>12s}")
    for r in rows:
        print(f"{r['plan']:70s} {r['predicted_step_s'] * 1e3:12.1f} {r['measured_step_s'] * 1e3:12.1f}")
    print(f"Spearman rank correlation over {len(rows)} plans: {rho:.3f} (target >= 0.8)")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "executor_correlation.json").write_text(json.dumps({"spearman": rho, "plans": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
