"""The executor's DP-only plan against a hand-written DistributedDataParallel loop on
the same model, data and optimizer (target: at least 0.95 of its throughput). Two gloo
ranks on this machine, fp32; the two loops alternate in rounds inside one launch and
the ratio is of the median step times. Prints a line and writes
bench/results/executor_ddp.json."""

import json
import statistics
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from costmodel.specs import TrainingSpec
from costmodel.specs.loading import load_model
from costmodel.strategy import Strategy, even_stages
from executor.data import SyntheticTokens, dp_shard
from executor.launch import run_local
from executor.models import build_model, cross_entropy, materialize
from executor.train import TrainConfig, Trainer, lr_factor

MODEL = {"hidden_size": "256", "num_hidden_layers": "4", "intermediate_size": "1024",
         "max_position_embeddings": "128", "num_attention_heads": "8", "num_key_value_heads": "8"}
SEQ, BATCH, ROUNDS, STEPS = 128, 8, 5, 6


def bench(rank, world):
    spec = load_model("tiny-gpt", MODEL)
    training = TrainingSpec(BATCH, SEQ, precision="fp32", optimizer="adamw")
    config = TrainConfig(total_steps=ROUNDS * STEPS)
    strategy = Strategy(dp=world, tp=1, pp=1, micro_batch_size=BATCH // world, num_microbatches=1,
                        stages=even_stages(spec.num_hidden_layers, 1))
    trainer = Trainer(spec, training, strategy, config, "cpu")
    plain = DDP(materialize(build_model(spec, SEQ), "cpu", config.seed))
    opt = torch.optim.AdamW(plain.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(config, s))
    source = SyntheticTokens(spec.vocab_size)

    def plain_step(x, y):
        x, y = dp_shard(x, y, rank, world)
        loss = cross_entropy(plain(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), config.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        torch.distributed.all_reduce(value)   # the same loss report the executor makes
        return float(value) / world

    times = {"executor": [], "ddp": []}
    for r in range(ROUNDS):
        for name, step in (("executor", trainer.step), ("ddp", plain_step)):
            for i in range(STEPS):
                x, y = source.global_batch(r * STEPS + i, BATCH, SEQ)
                start = time.perf_counter()
                step(x, y)
                times[name].append(time.perf_counter() - start)
    return {k: v[1:] for k, v in times.items()}   # the first step warms up


def main() -> None:
    times = run_local(bench, 2)[0]
    executor, ddp = statistics.median(times["executor"]), statistics.median(times["ddp"])
    ratio = ddp / executor
    tokens = BATCH * SEQ
    print(f"DP-only plan, 2 gloo ranks: executor {executor * 1e3:.1f} ms/step ({tokens / executor:,.0f} tok/s), "
          f"plain DDP {ddp * 1e3:.1f} ms/step ({tokens / ddp:,.0f} tok/s); throughput ratio {ratio:.3f} (target >= 0.95)")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "executor_ddp.json").write_text(json.dumps(
        {"executor_step_s": executor, "ddp_step_s": ddp, "throughput_ratio": ratio, "rounds": ROUNDS,
         "steps_per_round": STEPS, "model": MODEL, "seq_len": SEQ, "global_batch": BATCH}, indent=2) + "\n")


if __name__ == "__main__":
    main()
