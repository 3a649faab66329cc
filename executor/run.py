"""The training worker: what every process of `shardwise run` executes under torchrun.

    torchrun --standalone --nproc-per-node 2 -m executor.run plan.json --steps 5

Reads and checks the plan before any process group exists, joins the group (NCCL on
CUDA, gloo on CPU), builds this rank's trainer, trains, and on rank 0 writes the
metrics and prints progress and the summary. Exit code 2 on a bad plan or a plan that
does not fit the processes started.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from costmodel.loading import SpecError, load_model
from costmodel.specs import ModelSpec, TrainingSpec
from costmodel.strategy import Strategy
from executor.data import make_source
from executor.metrics import MetricsWriter, StepMetrics, peak_memory_bytes, print_summary, record, summarize
from executor.parallelize import UnsupportedPlan, check_supported
from executor.train import TrainConfig, Trainer
from planner.plan import fingerprint, is_traced, read_plan, strategy_of

EXIT_BAD_INPUT = 2


@dataclass(frozen=True)
class RunJob:
    """A plan file read, checked and turned into what a trainer needs."""

    plan: dict
    model: ModelSpec
    training: TrainingSpec
    strategy: Strategy


def load_job(plan_path: str, model_name: str | None = None, world_size: int | None = None) -> RunJob:
    """Read and check a plan for running; raises SpecError naming the field."""
    doc = read_plan(plan_path)
    if is_traced(doc):
        raise SpecError("plan.model", f"a plan of the traced module {doc['model']['name']}: shardwise run trains "
                                      f"models given by a spec (built-in, YAML or a config.json)")
    model = ModelSpec(**doc["model"])
    if model_name is not None:
        given = load_model(model_name)
        if fingerprint(given) != doc["model_fingerprint"]:
            raise SpecError("--model", f"{model_name} is not the model this plan was made for ({model.name}; "
                                       f"fingerprints {fingerprint(given)[:19]} vs {doc['model_fingerprint'][:19]})")
    try:
        training = TrainingSpec(**doc["training"])
    except TypeError as err:
        raise SpecError("plan.training", str(err)) from None
    strategy = strategy_of(doc)
    if world_size is not None and world_size != strategy.num_gpus:
        raise SpecError("--nproc-per-node", f"the plan needs {strategy.num_gpus} processes "
                                            f"(dp {strategy.dp} x tp {strategy.tp} x pp {strategy.pp}), "
                                            f"{world_size} would be started")
    if strategy.dp * strategy.micro_batch_size * strategy.num_microbatches != training.global_batch:
        raise SpecError("plan.strategy", "dp x micro_batch_size x num_microbatches does not equal the global batch")
    try:
        check_supported(model, strategy, training.seq_len)
    except UnsupportedPlan as err:
        raise SpecError(*str(err).split(": ", 1)) from None
    return RunJob(doc, model, training, strategy)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="executor.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("plan")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", default=None, help="Check the plan against this model.")
    parser.add_argument("--data", default="synthetic", help="synthetic | corpus | path to a .txt file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--warmup-steps", type=int, default=TrainConfig.warmup_steps)
    parser.add_argument("--grad-clip", type=float, default=TrainConfig.grad_clip)
    parser.add_argument("--metrics-out", default=None)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="Collective timeout (a hung peer fails).")
    return parser.parse_args(argv)


def device_for_rank() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        job = load_job(args.plan, args.model, world)
        if args.steps < 1:
            raise SpecError("--steps", "must be at least 1")
        source = make_source(args.data, job.model.vocab_size, args.seed)
    except (SpecError, ValueError) as err:
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    device = device_for_rank()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        train(job, args, source, device, rank)
    finally:
        dist.barrier()   # ranks leave together: avoids gloo's abort at shutdown
        dist.destroy_process_group()
    return 0


def train(job: RunJob, args: argparse.Namespace, source, device: torch.device, rank: int) -> None:
    training = job.training
    if device.type == "cpu" and training.precision != "fp32":
        training = TrainingSpec(**{**job.plan["training"], "precision": "fp32"})   # CPU runs in fp32
    config = TrainConfig(lr=args.lr, warmup_steps=args.warmup_steps, total_steps=args.steps,
                         grad_clip=args.grad_clip, seed=args.seed)
    trainer = Trainer(job.model, training, job.strategy, config, device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16 if training.precision == "bf16" else torch.float16)
                if device.type == "cuda" and training.precision != "fp32" else nullcontext())
    writer = MetricsWriter(args.metrics_out if rank == 0 else None)
    tokens = training.global_batch * training.seq_len
    steps = []
    for step in range(args.steps):
        inputs, targets = source.global_batch(step, training.global_batch, training.seq_len)
        lr = trainer.scheduler.get_last_lr()[0]
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast:
            loss = trainer.step(inputs, targets)   # ends in an all-reduce: every rank is done
        elapsed = time.perf_counter() - start
        peak = torch.tensor(peak_memory_bytes(device), dtype=torch.int64, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        metrics = StepMetrics(step, loss, elapsed, tokens / elapsed, int(peak), lr)
        steps.append(metrics)
        writer.write(record(metrics))
        if rank == 0:
            print(f"step {step + 1}/{args.steps}  loss {loss:.4f}  {elapsed:.3f} s  {tokens / elapsed:,.0f} tok/s",
                  flush=True)
    summary = summarize(steps, job.plan["estimate"], device)
    writer.write({"summary": summary})
    writer.close()
    if rank == 0:
        print_summary(summary)


if __name__ == "__main__":
    sys.exit(main())
