"""Does the cost model rank plans as the machine does? Twelve plans of one model on two
gloo ranks here, as a user would meet them: first `shardwise profile` measures this
machine (GEMMs with the roofline sweep, elementwise passes, gloo collectives) and the
model's layer kinds, then `costmodel.estimate` predicts each plan's step three ways:
with the built-in `cpu` cluster spec (fitted once, on another machine), with the spec
fitted to this machine's profile, and with that spec plus the measured layer times
(`plan --profile`). Each is compared with the median measured step of the executor by
Spearman rank correlation (target: at least 0.9 with the fitted spec). Prints the table
and writes bench/results/executor_correlation.json.

    python bench/executor_correlation.py
"""

import json
import statistics
import time
from pathlib import Path

import numpy as np

from costmodel.estimate import estimate
from costmodel.specs import TrainingSpec
from costmodel.specs.loading import load_model
from costmodel.strategy import Strategy, even_stages
from executor.data import SyntheticTokens
from executor.launch import run_local
from executor.train import TrainConfig, Trainer
from planner.api import make_problem
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


def profile_this_machine(folder: Path) -> tuple[Path, Path]:
    """What a user runs first: the machine's profile with the model's layer kinds, and
    the cluster spec fitted to it (`shardwise profile ... --spec-out`)."""
    import yaml

    from costmodel.calibrate import cluster_spec, roofline_notes
    from executor.measure import profile

    spec = load_model("tiny-gpt", MODEL)
    measured = profile("cpu", 2, "fp32", model=spec, seq_len=SEQ, micro_batch_sizes=(1, 2, 4, 8),
                       tp_widths=(1, 2), progress=lambda line: print(f"measuring {line}", flush=True))
    for note in roofline_notes(measured):
        print(f"note: {note}")
    profile_file, spec_file = folder / "profile.json", folder / "fitted.yaml"
    profile_file.write_text(json.dumps(measured, indent=1))
    spec_file.write_text(yaml.safe_dump(json.loads(json.dumps(cluster_spec(measured, "fitted-here"))), sort_keys=False))
    return profile_file, spec_file


def main() -> None:
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    # The machine's profile and fitted spec are kept beside the results, so the
    # predictions can be made again from them.
    folder = out / "executor_correlation_machine"
    folder.mkdir(exist_ok=True)
    profile_file, spec_file = profile_this_machine(folder)
    built_in = make_problem("tiny-gpt", "cpu", BATCH, gpus=2, seq_len=SEQ, precision="fp32", overrides=MODEL)
    fitted = make_problem("tiny-gpt", str(spec_file), BATCH, gpus=2, seq_len=SEQ, precision="fp32",
                          overrides=MODEL)
    layers = make_problem("tiny-gpt", str(spec_file), BATCH, gpus=2, seq_len=SEQ, precision="fp32",
                          overrides=MODEL, profile=profile_file)
    plans = strategies(built_in.model.num_hidden_layers)
    ways = {"built-in cpu spec": built_in, "fitted spec": fitted, "fitted spec + layer profile": layers}
    predicted = {name: [estimate(problem, s).step_time_s for s in plans] for name, problem in ways.items()}
    measured = run_local(measure, 2)[0]
    rho = {name: spearman(p, measured) for name, p in predicted.items()}
    rows = [{"plan": f"{describe(s)} recompute={s.recompute}", "measured_step_s": m,
             **{f"predicted_step_s ({name})": predicted[name][i] for name in ways}}
            for i, (s, m) in enumerate(zip(plans, measured))]
    print(f"{'plan':56s} {'measured ms':>11s} " + " ".join(f"{name:>27s}" for name in ways))
    for i, r in enumerate(rows):
        print(f"{r['plan'][:56]:56s} {r['measured_step_s'] * 1e3:11.1f} "
              + " ".join(f"{predicted[name][i] * 1e3:27.1f}" for name in ways))
    for name in ways:
        error = statistics.median(abs(p / m - 1) for p, m in zip(predicted[name], measured))
        print(f"{name:28s} Spearman {rho[name]:.3f}, median |error| {error:.1%}")
    print("target: Spearman >= 0.9 with the fitted spec")
    (out / "executor_correlation.json").write_text(json.dumps({"spearman": rho, "plans": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
