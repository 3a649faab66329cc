"""Checkpoint cost: executor.checkpoint (DCP, sharded) against torch.save of the full
unsharded state.

For tiny-gpt and a ~83M-parameter GPT (gpt3-1.3b cut to 4 layers of width 1024, vocab
32000), on 2 gloo ranks (run_local) under dp2 ZeRO-0 (DDP) and dp2 ZeRO-3 (FSDP), fp32,
AdamW, after one train step (so the optimizer states exist):

- DCP save: checkpoint.save into a fresh directory, timed on rank 0 between barriers
  (it includes the sha256 manifest and the rename);
- DCP load: checkpoint.load into a freshly built Trainer (the build is not timed; the
  load includes checkpoint.verify, which hashes every file on every rank);
- DCP size: all files of the step directory.

Baseline, on rank 0 while rank 1 waits: a single-process plain model of the same spec
with one AdamW step; torch.save of {model.state_dict(), optimizer.state_dict()} into a
fresh file followed by os.fsync (DCP's writer fsyncs its files too), and
torch.load(weights_only=True). Each figure is the median of REPEATS; the DCP and
baseline repeats alternate so that noise falls on both. The first DCP load is checked
against the saved trainer's weights. Prints a table and writes
bench/results/checkpoint.json and bench/results/checkpoint.txt.
"""

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from costmodel.specs import TrainingSpec
from costmodel.specs.loading import load_model
from costmodel.strategy import Strategy, even_stages
from executor import checkpoint
from executor.data import SyntheticTokens
from executor.launch import run_local
from executor.models import build_model, cross_entropy, materialize
from executor.train import TrainConfig, Trainer

MODELS = {
    "tiny-gpt": ("tiny-gpt", None),
    "gpt-83m": ("gpt3-1.3b", {"num_hidden_layers": "4", "hidden_size": "1024", "num_attention_heads": "16",
                              "intermediate_size": "4096", "vocab_size": "32000", "max_position_embeddings": "256"}),
}
ZERO = {"dp2-zero0": 0, "dp2-zero3": 3}
SEQ, BATCH, REPEATS = 16, 4, 3
CONFIG = TrainConfig(total_steps=10)
PLAN = {"model_fingerprint": "sha256:bench"}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def baseline_state(spec):
    """{model, optimizer} state of a single-process plain model after one AdamW step."""
    model = materialize(build_model(spec, SEQ), "cpu", CONFIG.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=CONFIG.lr, betas=CONFIG.betas, weight_decay=CONFIG.weight_decay)
    x, y = SyntheticTokens(spec.vocab_size).global_batch(0, BATCH, SEQ)
    cross_entropy(model(x), y).backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def torch_save(state, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def bench(rank, world, model_name, overrides, zero, tmp):
    spec = load_model(model_name, overrides)
    training = TrainingSpec(BATCH, SEQ, precision="fp32", optimizer="adamw")
    strategy = Strategy(dp=world, tp=1, pp=1, micro_batch_size=BATCH // world, num_microbatches=1,
                        zero_stage=zero, stages=even_stages(spec.num_hidden_layers, 1))
    plan = {**PLAN, "strategy": {"dp": world, "zero": zero}}
    trainer = Trainer(spec, training, strategy, CONFIG, "cpu")
    trainer.step(*SyntheticTokens(spec.vocab_size).global_batch(0, BATCH, SEQ))
    expected = trainer.full_state_dict()
    base = baseline_state(spec) if rank == 0 else None
    t = {k: [] for k in ("save", "load", "base_save", "base_load")}
    out = {"matches": True}
    tmp = Path(tmp)   # shared by the ranks
    for r in range(REPEATS):
        root = tmp / f"dcp{r}"   # fresh every repeat (rank 0 creates it)
        t["save"].append(timed(lambda: checkpoint.save(trainer, 1, root, plan)))
        path = checkpoint.step_dir(root, 1)
        fresh = Trainer(spec, training, strategy, CONFIG, "cpu")
        t["load"].append(timed(lambda: checkpoint.load(fresh, path, plan)))
        if r == 0:
            loaded = fresh.full_state_dict()
            out["matches"] = all(torch.equal(loaded[k], v) for k, v in expected.items())
            out["size"] = dir_bytes(path)
        del fresh
        if rank == 0:
            file = tmp / f"base{r}.pt"
            start = time.perf_counter()
            torch_save(base, file)
            t["base_save"].append(time.perf_counter() - start)
            start = time.perf_counter()
            torch.load(file, weights_only=True)
            t["base_load"].append(time.perf_counter() - start)
            out["base_size"] = file.stat().st_size
        dist.barrier()
    out.update({k: statistics.median(v) for k, v in t.items() if v})
    out["params"] = sum(v.numel() for v in expected.values())
    return out


def main() -> None:
    rows = []
    for label, (name, overrides) in MODELS.items():
        for strat, zero in ZERO.items():
            with tempfile.TemporaryDirectory() as tmp:
                res = run_local(bench, 2, name, overrides, zero, tmp)
            r0 = res[0]
            rows.append({"model": label, "params": r0["params"], "strategy": strat,
                         "save_s": r0["save"], "load_s": r0["load"], "size_mb": r0["size"] / 1e6,
                         "base_save_s": r0["base_save"], "base_load_s": r0["base_load"],
                         "base_size_mb": r0["base_size"] / 1e6,
                         "save_ratio": r0["save"] / r0["base_save"], "load_ratio": r0["load"] / r0["base_load"],
                         "size_ratio": r0["size"] / r0["base_size"],
                         "load_matches": all(bool(x["matches"]) for x in res)})
    head = (f"{'model':10} {'params':>10} {'strategy':10} {'save s':>8} {'load s':>8} {'size MB':>8} | "
            f"{'base save':>9} {'base load':>9} {'base MB':>8} | {'save x':>6} {'load x':>6} {'size x':>6}  ok")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:10} {r['params']:>10,} {r['strategy']:10} {r['save_s']:8.3f} {r['load_s']:8.3f} "
                     f"{r['size_mb']:8.2f} | {r['base_save_s']:9.3f} {r['base_load_s']:9.3f} {r['base_size_mb']:8.2f} | "
                     f"{r['save_ratio']:6.2f} {r['load_ratio']:6.2f} {r['size_ratio']:6.2f}  {r['load_matches']}")
    note = (f"2 gloo ranks, fp32 AdamW after one step; medians of {REPEATS}; ratios are DCP / torch.save "
            f"(+fsync) of the full state; ok = loaded weights equal the saved trainer's")
    text = "\n".join(lines + [note]) + "\n"
    print(text, end="")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "checkpoint.txt").write_text(text)
    (out / "checkpoint.json").write_text(json.dumps(
        {"rows": rows, "repeats": REPEATS, "seq_len": SEQ, "global_batch": BATCH, "ranks": 2,
         "models": {k: {"base": n, "overrides": o} for k, (n, o) in MODELS.items()}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
