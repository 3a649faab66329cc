"""The training worker: what every process of `shardwise run` executes under torchrun.

    torchrun --standalone --nproc-per-node 2 -m executor.run plan.json --steps 5

Reads and checks the plan before any process group exists, joins the group (NCCL on
CUDA, gloo on CPU), builds this rank's trainer, trains, and on rank 0 writes the
metrics and prints progress and the summary. Exit code 2 on a bad plan or a plan that
does not fit the processes started.

Each rank's device follows the plan: the group of the cluster that holds the rank
(`rank_group`: on a mixed cluster the group of its pipeline rank or dp replica) and
that group's hardware, CPU for hardware named cpu (configs/hardware/cpu.yaml), CUDA
otherwise (CPU where no GPU is visible). A plan whose groups need both is refused:
one job runs one backend. The summary lists every rank's group.

Checkpoints (`executor.checkpoint`): with `--checkpoint-dir D` the worker saves every
`--checkpoint-every` steps and after the last, keeping the newest `--keep-last`, and
when D already holds a checkpoint it resumes from the newest good one: that is how a
job restarted after a rank died (`shardwise run --max-restarts`) carries on. `--resume PATH` starts from a
checkpoint written under any plan of the same model. A step whose loss or gradients are
not finite stops the run (exit 4) or, with `--on-nonfinite skip`, is skipped without an
update. A collective that fails or outlives `--timeout-s` ends the run with a line
naming the rank and the step (exit 5).

Metrics: one JSON line per step (flushed as it is written, so a crash loses nothing
before it), and a closing summary that puts the measured step time and memory beside
the plan's estimate, as a JSON line and a table; the JSON also lists each rank's group
of the cluster, hardware and device.

Fault injection, tests only (tests/executor/test_run.py, bench/chaos.py):
`SHARDWISE_TEST_CRASH_AT` holds one or more faults, comma-separated:

- `RANK:STEP`: that rank exits (code 1) as step STEP (0-based) begins;
- `hang:RANK:STEP`: that rank stops answering there (its peers time out);
- `save:STEP`: every rank dies once the checkpoint of STEP steps is written, before its
  publish;
- `POINT:RANK:STEP`: that rank is SIGKILLed at POINT of step STEP: `forward` (as the
  middle layer of its first stage starts its forward), `backward` (as the gradient
  reaches that layer's output, mid-backward), `optimizer` (once its optimizer has
  updated the weights in place, before the step ends), `save` (mid-save of the
  checkpoint of STEP steps done: once this rank's DCP files are written, before DCP
  gathers the ranks' results and before any manifest), `resume` (as it loads the
  checkpoint of STEP steps to resume from: its peers are loading).

Each fault fires on the first attempt, or on attempt N with an `@N` suffix
(`resume:0:3@1`): the attempt is `shardwise run --max-restarts`'s restart count
(SHARDWISE_RESTART) plus torchrun's own. The rank writes one line to stderr
(`SHARDWISE_TEST_CRASH: rank R killed at POINT, step S, attempt A`) before it dies.
Unset, nothing is parsed or hooked.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import multiprocessing
import os
import resource
import signal
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from costmodel.specs import TrainingSpec
from costmodel.specs.loading import SpecError
from costmodel.units import GIB
from executor import checkpoint
from executor.data import make_source
from executor.launch import RankGroup, RunJob, die_with_launcher, load_job, rank_group
from executor.parallelize import Overlap
from executor.train import TrainConfig, Trainer
from planner.plan_file import (
    runtime_of,
)

EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 4
EXIT_COLLECTIVE = 5


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
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop")
    parser.add_argument("--fp64", action="store_true", help="Weights, activations, gradients and optimizer "
                                                            "states in float64, no autocast.")
    parser.add_argument("--compile", dest="compile_blocks", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile each block with inductor [default: the plan's runtime torch_compile]")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True): the same run twice gives the same bits.")
    return parser.parse_args(argv)


def device_for_rank(device_type: str) -> torch.device:
    """This process's device for a rank the plan puts on `device_type`: its local GPU
    for "cuda" (CPU when none is visible), else the CPU."""
    if device_type == "cuda" and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_launcher()
    if multiprocessing.parent_process() is not None:
        # Forked by the launcher (executor.launch), whose torchrun agent turns SIGTERM and
        # SIGINT into exceptions: the rank takes the default, ending when told to.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        job = load_job(args.plan, args.model, world)
        if args.steps < 1:
            raise SpecError("--steps", "must be at least 1")
        source = make_source(args.data, job.model.vocab_size, args.seed)
        placement = rank_group(job.plan, rank)
        faults = fault_injector(rank)   # tests only: None unless SHARDWISE_TEST_CRASH_AT is set
    except (SpecError, ValueError) as err:
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        leave_exit_code(EXIT_BAD_INPUT, rank)
        return EXIT_BAD_INPUT
    if args.deterministic:
        # cuBLAS needs a fixed workspace for repeatable results (CUDA docs, "Results
        # reproducibility"); set before the first CUDA call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    device = device_for_rank(placement.device_type)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    code = 0
    try:
        train(job, args, source, device, rank, placement, faults)
    except NonFiniteStep as err:   # every rank sees the same global norm: they stop together
        print(f"error: rank {rank}: {err}", file=sys.stderr, flush=True)
        code = EXIT_NONFINITE
    except (SpecError, checkpoint.CheckpointError) as err:   # the same on every rank
        if rank == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        code = EXIT_BAD_INPUT
    except CollectiveFailed as err:
        print(f"error: rank {rank}: {err}", file=sys.stderr, flush=True)
        os._exit(EXIT_COLLECTIVE)   # the group is broken: no barrier to leave by
    except BaseException:
        # Anything else (torchrun's SIGTERM when a peer died, a bug) may have left the
        # peers behind: leave at once, without a barrier that would wait for them.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    leave_exit_code(code, rank)
    dist.barrier()   # ranks leave together: avoids gloo's abort at shutdown
    dist.destroy_process_group()
    return code


def leave_exit_code(code: int, rank: int) -> None:
    """Rank 0's exit code for `shardwise run`, which torchrun's own exit code hides."""
    if code and rank == 0 and os.environ.get("SHARDWISE_EXIT_FILE"):
        Path(os.environ["SHARDWISE_EXIT_FILE"]).write_text(str(code))


class NonFiniteStep(RuntimeError):
    """A step whose loss or gradients are not finite, under --on-nonfinite stop."""


class CollectiveFailed(RuntimeError):
    """A collective that failed or timed out (a peer died or hung)."""


def is_collective_failure(err: RuntimeError) -> bool:
    """gloo and NCCL report a dead or hung peer as a RuntimeError (DistError in recent
    PyTorch) from the collective's wait, its text naming the transport and the operation."""
    text = str(err)
    return isinstance(err, getattr(dist, "DistError", ())) or any(
        word in text for word in ("gloo", "NCCL", "Timed out", "Connection reset", "Connection closed"))


def resume(trainer: Trainer, job: RunJob, args: argparse.Namespace, rank: int,
           faults: FaultInjector | None = None) -> int:
    """The step to start from: the newest good checkpoint of --resume (required to
    exist) or of --checkpoint-dir (a restart), else 0."""
    log = print if rank == 0 else (lambda *a, **k: None)
    found = None
    if args.checkpoint_dir:
        found = checkpoint.latest(args.checkpoint_dir, log)
    if found is None and args.resume:
        found = checkpoint.latest(args.resume, log)
        if found is None:
            raise SpecError("--resume", f"no complete checkpoint at {args.resume}")
    if found is None:
        return 0
    if faults is not None:
        faults.fire("resume", found.step)
    step = checkpoint.load(trainer, found.path, job.plan)
    log(f"checkpoint: resumed from {found.path} (step {step})", flush=True)
    return step


# -- what a run reports ---------------------------------------------------------------

@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    peak_memory_bytes: int      # largest over ranks; see `peak_memory_bytes()`
    lr: float


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes of this rank: the CUDA caching allocator's counter on a GPU,
    the process's peak resident set on CPU (which includes the Python runtime)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    scale = 1 if sys.platform == "darwin" else 1024   # ru_maxrss is KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)


class MetricsWriter:
    """Appends JSON lines to `path` (or nowhere when None)."""

    def __init__(self, path: str | Path | None):
        self.file = open(path, "w") if path else None

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record, sort_keys=True) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def summarize(steps: list[StepMetrics], estimate: dict, device: torch.device, ranks: list[dict] | None = None) -> dict:
    """Median measured step (the first step, which warms up, is left out when there are
    more) against the plan's estimate; `ranks`, each rank's group, hardware and device
    (`rank_group`), by rank."""
    timed = steps[1:] if len(steps) > 1 else steps
    step_s = statistics.median(s.step_time_s for s in timed)
    peak = max(s.peak_memory_bytes for s in steps)
    return {
        "steps": len(steps),
        "device": device.type,
        "measured_step_time_s": step_s,
        "estimated_step_time_s": estimate["step_time_s"],
        "step_time_ratio": step_s / estimate["step_time_s"],
        "measured_tokens_per_s": statistics.median(s.tokens_per_s for s in timed),
        "estimated_tokens_per_s": estimate["tokens_per_s"],
        "measured_peak_memory_bytes": peak,
        "estimated_peak_memory_bytes": estimate["peak_memory_bytes"],
        "memory_kind": "allocated" if device.type == "cuda" else "process RSS",
        "first_loss": steps[0].loss,
        "last_loss": steps[-1].loss,
        **({"ranks": ranks} if ranks is not None else {}),
    }


def group_summaries(ranks: list[dict]) -> list[str]:
    """One entry per group of the cluster: its ranks, hardware and device."""
    by_group: dict[str, list[dict]] = {}
    for r in ranks:
        by_group.setdefault(r["group"], []).append(r)
    out = []
    for group, members in by_group.items():
        numbers = ", ".join(str(r["rank"]) for r in members)
        kinds = ", ".join(sorted({f"{r['gpu']} on {r['device']}" for r in members}))
        out.append(f"{group}: rank{'s' if len(members) > 1 else ''} {numbers} ({kinds})")
    return out


def print_summary(summary: dict, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"Run against the plan ({summary['steps']} steps on {summary['device']})")
    for col in ("", "measured", "estimated", "ratio"):
        table.add_column(col, justify="left" if not col else "right")
    table.add_row("step time s", f"{summary['measured_step_time_s']:.4f}", f"{summary['estimated_step_time_s']:.4f}",
                  f"{summary['step_time_ratio']:.2f}")
    table.add_row("tokens/s", f"{summary['measured_tokens_per_s']:,.0f}", f"{summary['estimated_tokens_per_s']:,.0f}",
                  f"{summary['measured_tokens_per_s'] / summary['estimated_tokens_per_s']:.2f}")
    measured, estimated = summary["measured_peak_memory_bytes"], summary["estimated_peak_memory_bytes"]
    table.add_row(f"peak memory GiB ({summary['memory_kind']})", f"{measured / GIB:.3f}", f"{estimated / GIB:.3f}",
                  f"{measured / estimated:.2f}")
    table.add_row("loss first -> last", f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}", "", "")
    console.print(table)


def record(metrics: StepMetrics) -> dict:
    return asdict(metrics)


# -- fault injection (tests only: SHARDWISE_TEST_CRASH_AT, see the module docstring) ----

KILL_POINTS = ("forward", "backward", "optimizer", "save", "resume")


@dataclass(frozen=True)
class Fault:
    point: str          # "start", "hang", "save-all" (the older forms) or one of KILL_POINTS
    rank: int | None    # None: every rank (save-all)
    step: int
    attempt: int = 0


def parse_faults(text: str) -> list[Fault]:
    """SHARDWISE_TEST_CRASH_AT's faults; ValueError naming a malformed one."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        spec, _, attempt = item.partition("@")
        fields = spec.split(":")
        try:
            if len(fields) == 2 and fields[0] == "save":
                fault = Fault("save-all", None, int(fields[1]))
            elif len(fields) == 2:
                fault = Fault("start", int(fields[0]), int(fields[1]))
            elif len(fields) == 3 and fields[0] in ("hang", *KILL_POINTS):
                fault = Fault(fields[0], int(fields[1]), int(fields[2]))
            else:
                raise ValueError
            faults.append(Fault(fault.point, fault.rank, fault.step, int(attempt) if attempt else 0))
        except ValueError:
            raise ValueError(f"SHARDWISE_TEST_CRASH_AT: cannot read {item!r} (RANK:STEP, hang:RANK:STEP, "
                             f"save:STEP or {'|'.join(KILL_POINTS)}:RANK:STEP, each with an optional @ATTEMPT)") \
                from None
    return faults


class FaultInjector:
    """This rank's faults of this attempt, and the hooks that fire them; `step` is the
    step the loop is in. Built only when SHARDWISE_TEST_CRASH_AT is set."""

    def __init__(self, faults: list[Fault], rank: int, attempt: int):
        self.rank, self.attempt = rank, attempt
        self.faults = [f for f in faults if f.attempt == attempt and f.rank in (None, rank)]
        self.step = -1

    def due(self, point: str, step: int) -> bool:
        return any(f.point == point and f.step == step for f in self.faults)

    def fire(self, point: str, step: int | None = None) -> None:
        """Die at once (SIGKILL: nothing flushed, no handler, no atexit) when a fault is due."""
        step = self.step if step is None else step
        if self.due(point, step):
            os.write(2, f"SHARDWISE_TEST_CRASH: rank {self.rank} killed at {point}, step {step}, "
                        f"attempt {self.attempt}\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)

    def install(self, trainer: Trainer) -> None:
        """Hooks for the faults inside a step: the middle layer of this rank's first
        stage (forward, backward) and the optimizer's step (optimizer)."""
        points = {f.point for f in self.faults}
        if points & {"forward", "backward"}:
            layers = list(trainer.model.stages[0].layers.values())
            middle = layers[len(layers) // 2]
            if "forward" in points:
                middle.register_forward_pre_hook(lambda module, args: self.fire("forward"))
            if "backward" in points:
                def arm(module, args, output):
                    if self.due("backward", self.step) and isinstance(output, torch.Tensor) and output.requires_grad:
                        output.register_hook(lambda grad: self.fire("backward"))
                middle.register_forward_hook(arm)
        if "optimizer" in points:
            inner = getattr(trainer.optimizer, "optim", trainer.optimizer)   # ZeRO-1: the local optimizer
            inner.register_step_post_hook(lambda optimizer, args, kwargs: self.fire("optimizer"))


def fault_injector(rank: int) -> FaultInjector | None:
    """This rank's FaultInjector when SHARDWISE_TEST_CRASH_AT is set, else None."""
    text = os.environ.get("SHARDWISE_TEST_CRASH_AT")
    if not text:
        return None
    attempt = int(os.environ.get("SHARDWISE_RESTART", "0")) + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return FaultInjector(parse_faults(text), rank, attempt)


# -- the training loop ----------------------------------------------------------------

def train(job: RunJob, args: argparse.Namespace, source, device: torch.device, rank: int,
          placement: RankGroup, faults: FaultInjector | None = None) -> None:
    training = job.training
    if device.type == "cpu" and training.precision != "fp32" and training.fp8 is None:
        # CPU runs in fp32: few CPUs have fast bf16 matmuls. An FP8 plan keeps its bf16
        # autocast, the precision its FP8 layers run in (torchao's emulation on CPU).
        training = TrainingSpec(**{**job.plan["training"], "precision": "fp32"})
    runtime = runtime_of(job.plan)
    compiled = runtime.torch_compile if args.compile_blocks is None else args.compile_blocks
    config = TrainConfig(lr=args.lr, warmup_steps=args.warmup_steps, total_steps=args.steps,
                         grad_clip=args.grad_clip, seed=args.seed,
                         dtype=torch.float64 if args.fp64 else torch.float32,
                         compile_backend="inductor" if compiled else None, overlap=Overlap.of(runtime))
    # The trainer autocasts to the plan's bf16 / fp16 itself, and not at all in float64
    # (executor.step.autocast_dtype).
    trainer = Trainer(job.model, training, job.strategy, config, device)
    if rank == 0 and config.overlap.async_tp and job.strategy.tp > 1 and not trainer.model.overlap.async_tp:
        print("note: the plan's runtime has async TP, which needs CUDA and compiled blocks (--compile): this "
              "run's TP collectives are synchronous", flush=True)
    if rank == 0 and job.model.is_moe:
        unlike = [what for what, on in (
            ("moe_dispatch deepep: this run exchanges tokens by all-to-all, a copy per routed expert",
             runtime.moe_dispatch != "all-to-all" and job.strategy.ep > 1),
            ("ep_overlap: this run runs each overlapped forward/backward pair in turn", runtime.ep_overlap > 0))
            if on]
        if unlike:
            print("note: the plan's runtime prices " + "; ".join(unlike), flush=True)
    # Each rank says where it runs, as it resolved it from the plan: the summary shows
    # that rank r ran in the group the plan declares.
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"rank": rank, "group": placement.group, "gpu": placement.gpu,
                                   "device": device.type})
    if rank == 0 and len({r["group"] for r in ranks}) > 1:
        print("groups: " + "; ".join(group_summaries(ranks)), flush=True)
    if faults is not None:
        faults.install(trainer)
    start_step = resume(trainer, job, args, rank, faults)
    # --steps is the step to train to, resumed or not (the learning-rate schedule spans it).
    if start_step > args.steps:
        raise SpecError("--steps", f"{args.steps} is the step to train to, and the checkpoint is already at step "
                                   f"{start_step}: give a larger --steps")
    if start_step == args.steps:
        if rank == 0:
            print(f"checkpoint at step {start_step}: all {args.steps} steps are trained, nothing to do", flush=True)
        return
    writer = MetricsWriter(args.metrics_out if rank == 0 else None)
    tokens = training.global_batch * training.seq_len
    steps = []
    for step in range(start_step, args.steps):
        if faults is not None:
            faults.step = step
            if faults.due("start", step):
                os._exit(1)
            if faults.due("hang", step):
                time.sleep(3600)   # a rank that stops answering: its peers' collectives time out
        inputs, targets = source.global_batch(step, training.global_batch, training.seq_len)
        lr = trainer.scheduler.get_last_lr()[0]
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            loss = trainer.step(inputs, targets)   # ends in an all-reduce: every rank is done
        except RuntimeError as err:
            if not is_collective_failure(err):
                raise
            first = str(err).strip().splitlines()[0]
            raise CollectiveFailed(f"step {step + 1}: a collective failed or timed out (--timeout-s "
                                   f"{args.timeout_s:g}): {first}") from err
        if not math.isfinite(loss) or trainer.skipped_update:
            if args.on_nonfinite == "stop":
                raise NonFiniteStep(f"step {step + 1}: the loss ({loss}) or the gradients are not finite; "
                                    f"nothing was updated (--on-nonfinite skip steps over such batches)")
            if rank == 0:
                print(f"step {step + 1}: not finite, skipped (no update)", flush=True)
        elapsed = time.perf_counter() - start
        peak = torch.tensor(peak_memory_bytes(device), dtype=torch.int64, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        metrics = StepMetrics(step, loss, elapsed, tokens / elapsed, int(peak), lr)
        steps.append(metrics)
        writer.write(record(metrics))
        if rank == 0:
            print(f"step {step + 1}/{args.steps}  loss {loss:.4f}  {elapsed:.3f} s  {tokens / elapsed:,.0f} tok/s",
                  flush=True)
        done = step + 1
        if args.checkpoint_dir and ((args.checkpoint_every and done % args.checkpoint_every == 0) or done == args.steps):
            path = checkpoint.save(trainer, done, args.checkpoint_dir, job.plan, keep=args.keep_last,
                                   crash_after_write=faults is not None and faults.due("save-all", done),
                                   crash_mid_write=functools.partial(faults.fire, "save", done)
                                   if faults is not None and faults.due("save", done) else None)
            if rank == 0:
                print(f"checkpoint: step {done} saved to {path}", flush=True)
    summary = {**summarize(steps, job.plan["estimate"], device, ranks), "numerics": trainer.numerics()}
    writer.write({"summary": summary})
    writer.close()
    if rank == 0:
        print_summary(summary)


if __name__ == "__main__":
    code = main()
    # main has closed what it wrote and left the process group. The interpreter's own
    # teardown (torch's and gloo's objects destroyed one by one) took 1-3 s of a one-step
    # run here, and torchrun waits for it: the rank exits at once instead.
    sys.stdout.flush()
    sys.stderr.flush()
    if multiprocessing.parent_process() is not None:
        # Forked by torchrun (executor.launch): its wrapper takes the exit code and ends
        # the process without the teardown.
        sys.exit(code)
    os._exit(code)
