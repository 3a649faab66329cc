"""Crash recovery of `shardwise run` under torchrun with restarts: kill a rank, see the
run finish and end where an uninterrupted run ends.

Each run trains a tiny plan (tiny-gpt, 2 CPU ranks, gloo, fp32, global batch 8 of 16
tokens) for STEPS steps with `shardwise run PLAN --checkpoint-dir D --checkpoint-every 1
--max-restarts N`, launched as a subprocess, with one rank killed (SIGKILL) by the
worker's tests-only fault injection (SHARDWISE_TEST_CRASH_AT, executor/run.py) at a
seeded random rank, step and point:

- forward: as the middle layer of the rank's first stage starts its forward;
- backward: as the gradient reaches that layer's output (mid-backward);
- optimizer: once its optimizer has updated the weights in place, before the step ends;
- save: mid-save, once the rank's DCP files of that checkpoint are written and before
  DCP gathers the ranks' results (nothing published);
- restart: one of the four above on the first attempt, then a second kill of a random
  rank on the restart itself, while the ranks load the checkpoint to resume from
  (`resume:RANK:STEP@1`), so the run needs a second restart.

N is the number of kills. The plans: dp2 (DDP), dp2 ZeRO-3 (FSDP2, 2 micro-batches)
and pp2 (1F1B, 4 micro-batches), each run once uninterrupted as the reference (twice,
to show the reference itself is repeatable bit for bit). Points and plans are drawn
balanced (each about as often), ranks and steps uniformly.

Per run: the kills that fired (each writes a line on stderr before it dies), the
restarts, whether the run completed (exit 0 and a final checkpoint), the checkpoint it
resumed from, the steps lost (steps rank 0 completed more than once: work redone after
a restart; the step a rank died in is not counted, it never completed), and whether
the final checkpoint's weights and optimizer states (DCP, read back with
dcp_to_torch_save) are bitwise equal to the reference's; also whether the checkpoint
it resumed from and the steps lost are the ones the kill predicts (a kill inside step s
resumes from the checkpoint of s steps and loses none; a save of d steps killed resumes
from d - 1 and trains step d again). Prints a table with totals and writes
bench/results/chaos.json and bench/results/chaos.txt; exits 1 unless every run
completed bitwise equal with its faults fired.

    python bench/chaos.py [--runs 20] [--seed 0] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from planner.api import plan
from planner.plan_file import write_plan

PLANS = {
    "dp2": {"dp": 2, "tp": 1},
    "dp2-zero3": {"dp": 2, "zero": 3, "mbs": 2},
    "pp2-1f1b": {"pp": 2, "mbs": 2, "schedule": "1f1b"},
}
POINTS = ("forward", "backward", "optimizer", "save", "restart")
IN_STEP = ("forward", "backward", "optimizer")
GLOBAL_BATCH, SEQ_LEN, RANKS = 8, 16, 2
RUN_TIMEOUT_S = 600

STEP_LINE = re.compile(r"^step (\d+)/(\d+)  loss", re.MULTILINE)
RESUMED = re.compile(r"checkpoint: resumed from \S+ \(step (\d+)\)")
KILLED = re.compile(r"SHARDWISE_TEST_CRASH: rank (\d+) killed at (\w+), step (\d+), attempt (\d+)")
RESTART = re.compile(r"shardwise: the group exited with code -?\d+; restart")


def draw_runs(count: int, steps: int, rng: random.Random) -> list[dict]:
    """`count` runs: points and plans balanced and shuffled, ranks and steps uniform.
    Steps are the worker's: a step's 0-based index for forward, backward and optimizer,
    the checkpoint's steps done (1..steps) for save."""
    points = [POINTS[i % len(POINTS)] for i in range(count)]
    plans = [list(PLANS)[i % len(PLANS)] for i in range(count)]
    rng.shuffle(points)
    rng.shuffle(plans)
    runs = []
    for point, plan_name in zip(points, plans):
        restart = point == "restart"
        first = rng.choice(("forward", "backward", "optimizer", "save")) if restart else point
        if first == "save":
            # The checkpoint of `step` steps is killed: the run resumes from step - 1.
            step = rng.randint(2 if restart else 1, steps)
            resume_at = step - 1
        else:
            # Killed inside step `step` (0-based): the run resumes from the checkpoint of `step` steps.
            step = rng.randint(1 if restart else 0, steps - 1)
            resume_at = step
        kills = [{"point": first, "rank": rng.randrange(RANKS), "step": step, "attempt": 0}]
        if restart:   # a checkpoint exists (resume_at >= 1): kill a rank while the restart loads it
            kills.append({"point": "resume", "rank": rng.randrange(RANKS), "step": resume_at, "attempt": 1})
        runs.append({"point": point, "plan": plan_name, "kills": kills, "expected_resume": resume_at,
                     "expected_lost": 1 if first == "save" else 0})
    return runs


def crash_spec(kills: list[dict]) -> str:
    return ",".join(f"{k['point']}:{k['rank']}:{k['step']}@{k['attempt']}" for k in kills)


def shardwise_run(plan_file: Path, checkpoints: Path, steps: int,
                  kills: list[dict]) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k != "SHARDWISE_TEST_CRASH_AT"}
    env["OMP_NUM_THREADS"] = "1"   # two ranks on a small machine
    if kills:
        env["SHARDWISE_TEST_CRASH_AT"] = crash_spec(kills)
    cmd = [sys.executable, "-m", "planner.console.cli", "run", str(plan_file), "--steps", str(steps),
           "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1", "--max-restarts", str(len(kills)),
           "--timeout-s", "60"]
    start = time.perf_counter()
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)
    return done, time.perf_counter() - start


def final_tensors(checkpoints: Path, steps: int, scratch: Path) -> dict[str, torch.Tensor] | None:
    """model.* and optim.* of the checkpoint after the last step, or None without one."""
    final = checkpoints / f"step-{steps:08d}"
    if not (final / "manifest.json").is_file():
        return None
    out = scratch / f"{checkpoints.name}.pt"
    dcp_to_torch_save(str(final), str(out))
    state = torch.load(out, weights_only=True)
    out.unlink()
    return {k: v for k, v in state.items() if k.startswith(("model.", "optim."))}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str) -> bool:
    keys_a = {k for k in a if k.startswith(prefix)}
    keys_b = {k for k in b if k.startswith(prefix)}
    return bool(keys_a) and keys_a == keys_b and all(torch.equal(a[k], b[k]) for k in keys_a)


def describe(kill: dict) -> str:
    return f"r{kill['rank']} {kill['point']}@{kill['step']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    runs = draw_runs(args.runs, args.steps, rng)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardwise-chaos-") as tmp:
        tmp = Path(tmp)
        references, repeatable, plan_docs = {}, {}, {}
        for name, fix in PLANS.items():
            doc = plan("tiny-gpt", "cpu", GLOBAL_BATCH, gpus=RANKS, seq_len=SEQ_LEN, precision="fp32", fix=fix)
            write_plan(doc, tmp / f"{name}.json")
            s = doc["strategy"]
            plan_docs[name] = {k: s[k] for k in ("dp", "tp", "pp", "zero_stage", "micro_batch_size",
                                                 "num_microbatches", "schedule")}
            tensors = []
            for repeat in range(2):
                done, seconds = shardwise_run(tmp / f"{name}.json", tmp / f"ref-{name}-{repeat}", args.steps, [])
                if done.returncode != 0:
                    print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
                    raise SystemExit(f"the uninterrupted run of {name} failed (exit {done.returncode})")
                tensors.append(final_tensors(tmp / f"ref-{name}-{repeat}", args.steps, tmp))
                print(f"reference {name} run {repeat + 1}: {seconds:.1f} s", flush=True)
            references[name] = tensors[0]
            repeatable[name] = equal(*tensors, "model.") and equal(*tensors, "optim.")
        rows = []
        for i, run in enumerate(runs):
            checkpoints = tmp / f"run-{i:02d}"
            done, seconds = shardwise_run(tmp / f"{run['plan']}.json", checkpoints, args.steps, run["kills"])
            out = done.stdout + done.stderr
            fired = [{"rank": int(r), "point": p, "step": int(s), "attempt": int(a)}
                     for r, p, s, a in KILLED.findall(out)]
            trained = len(STEP_LINE.findall(done.stdout))
            final = final_tensors(checkpoints, args.steps, tmp)
            completed = done.returncode == 0 and final is not None
            ref = references[run["plan"]]
            row = {
                "run": i + 1, "plan": run["plan"], "point": run["point"], "kills": run["kills"],
                "crash_at": crash_spec(run["kills"]), "fired": fired,
                "all_fired": sorted(map(describe, fired)) == sorted(map(describe, run["kills"])),
                "restarts": len(RESTART.findall(out)), "exit_code": done.returncode, "completed": completed,
                "resumed_from": [int(s) for s in RESUMED.findall(done.stdout)],
                "expected_resume": run["expected_resume"],
                "steps_trained": trained, "steps_lost": trained - args.steps if completed else None,
                "expected_lost": run["expected_lost"],
                "weights_equal": completed and equal(final, ref, "model."),
                "optimizer_equal": completed and equal(final, ref, "optim."),
                "seconds": seconds,
            }
            row["as_predicted"] = ((row["resumed_from"] or [0])[-1] == run["expected_resume"]
                                   and row["steps_lost"] == run["expected_lost"])
            rows.append(row)
            if not completed or not row["all_fired"]:
                row["output_tail"] = out[-4000:]
            print(f"run {i + 1}/{len(runs)}: {run['plan']} {row['crash_at']}: "
                  f"{'completed' if completed else 'FAILED'} in {seconds:.1f} s", flush=True)
    elapsed = time.perf_counter() - started
    lost = [r["steps_lost"] for r in rows if r["steps_lost"] is not None]
    totals = {
        "runs": len(rows),
        "completed": sum(r["completed"] for r in rows),
        "all_faults_fired": sum(r["all_fired"] for r in rows),
        "resumed_and_lost_as_predicted": sum(r["as_predicted"] for r in rows),
        "steps_lost_total": sum(lost),
        "steps_lost_median": statistics.median(lost) if lost else None,
        "weights_bitwise_equal": sum(r["weights_equal"] for r in rows),
        "optimizer_bitwise_equal": sum(r["optimizer_equal"] for r in rows),
        "bitwise_equal": sum(r["weights_equal"] and r["optimizer_equal"] for r in rows),
        "references_repeatable": repeatable,
        "seconds": elapsed,
    }
    text = table(rows, totals, args)
    print(text, end="")
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    (results / "chaos.txt").write_text(text)
    (results / "chaos.json").write_text(json.dumps(
        {"seed": args.seed, "runs": args.runs, "steps": args.steps, "model": "tiny-gpt", "ranks": RANKS,
         "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN, "precision": "fp32", "plans": plan_docs,
         "torch": torch.__version__, "rows": rows, "totals": totals}, indent=2) + "\n")
    ok = totals["completed"] == totals["bitwise_equal"] == totals["all_faults_fired"] == len(rows)
    return 0 if ok else 1


def table(rows: list[dict], totals: dict, args) -> str:
    head = (f"{'run':>3} {'plan':10} {'point':9} {'killed (rank point@step)':28} {'fired':>5} {'restarts':>8} "
            f"{'completed':>9} {'resumed':>8} {'lost':>4} {'weights':>7} {'optim':>5} {'s':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        killed = ", ".join(describe(k) + ("'" if k["attempt"] else "") for k in r["kills"])
        lines.append(f"{r['run']:>3} {r['plan']:10} {r['point']:9} {killed:28} "
                     f"{len(r['fired'])}/{len(r['kills']):<3} {r['restarts']:>8} "
                     f"{'yes' if r['completed'] else 'NO':>9} "
                     f"{','.join(map(str, r['resumed_from'])) or '-':>8} "
                     f"{'-' if r['steps_lost'] is None else r['steps_lost']:>4} "
                     f"{'equal' if r['weights_equal'] else 'DIFF':>7} {'equal' if r['optimizer_equal'] else 'DIFF':>5} "
                     f"{r['seconds']:5.1f}")
    t = totals
    lines += [
        "-" * len(head),
        (f"completed {t['completed']}/{t['runs']}; faults fired as drawn {t['all_faults_fired']}/{t['runs']}; "
         f"resumed from and lost as predicted {t['resumed_and_lost_as_predicted']}/{t['runs']}; "
        f"steps lost total {t['steps_lost_total']}, median {t['steps_lost_median']}; bitwise equal to the "
        f"uninterrupted run: weights {t['weights_bitwise_equal']}/{t['runs']}, optimizer states "
        f"{t['optimizer_bitwise_equal']}/{t['runs']}, both {t['bitwise_equal']}/{t['runs']}"),
        "references repeatable bit for bit: "
        + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in t["references_repeatable"].items()),
        (f"tiny-gpt, {RANKS} CPU ranks (gloo, fp32), {args.steps} steps, checkpoint every step, "
         f"--max-restarts = kills; "
        f"seed {args.seed}; {t['seconds']:.0f} s in all. killed: rank, point, step (forward/backward/optimizer: "
        f"0-based step; save: the checkpoint's steps done; resume: the checkpoint loaded; ' = on the restart). "
        f"lost: steps rank 0 completed more than once."),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
