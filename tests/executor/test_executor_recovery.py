"""Crash recovery under torchrun: when a rank is killed at a chosen step, `shardwise run
--max-restarts` starts the group again and it resumes from the newest checkpoint, ending with
parameters and optimizer states bitwise equal to an uninterrupted run; a save killed
before its publish leaves the previous checkpoint to resume from; a rank that hangs
makes its peer fail naming the rank, step and operation; a non-finite loss stops the
run, or is skipped when asked."""

import os
import shutil
import subprocess
import sys

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from executor_test_helpers import GLOBAL_BATCH, SEQ_LEN
from planner.api import plan
from planner.plan import write_plan

STEPS = 6


def shardwise_run(plan_file, checkpoints, *extra, crash=None):
    env = dict(os.environ)
    env.pop("SHARDWISE_TEST_CRASH_AT", None)
    if crash:
        env["SHARDWISE_TEST_CRASH_AT"] = crash
    return subprocess.run([sys.executable, "-m", "planner.cli", "run", str(plan_file), "--steps", str(STEPS),
                           "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2", *extra],
                          capture_output=True, text=True, timeout=300, env=env)


def tensors(checkpoint_dir, tmp_path, name):
    out = tmp_path / f"{name}.pt"
    dcp_to_torch_save(str(checkpoint_dir), str(out))
    state = torch.load(out, weights_only=True)
    return {k: v for k, v in state.items() if k.startswith(("model.", "optim."))}


def test_a_killed_rank_is_restarted_and_ends_bitwise_equal(plan_file, tmp_path):
    clean = shardwise_run(plan_file, tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr[-2000:]
    crashed = shardwise_run(plan_file, tmp_path / "crashed", "--max-restarts", "1", crash="1:3")
    assert crashed.returncode == 0, crashed.stderr[-2000:]
    assert "checkpoint: resumed from" in crashed.stdout and "(step 2)" in crashed.stdout
    final = f"step-{STEPS:08d}"
    a = tensors(tmp_path / "clean" / final, tmp_path, "a")
    b = tensors(tmp_path / "crashed" / final, tmp_path, "b")
    assert set(a) == set(b) and any(k.startswith("optim.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_save_killed_halfway_leaves_the_previous_checkpoint(plan_file, tmp_path):
    killed = shardwise_run(plan_file, tmp_path / "ckpt", crash="save:4")
    assert killed.returncode != 0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".step-00000004.partial", "step-00000002"]
    resumed = shardwise_run(plan_file, tmp_path / "ckpt")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"checkpoint: ignoring {tmp_path / 'ckpt' / '.step-00000004.partial'}: a save that did not finish" \
        in resumed.stdout
    assert "(step 2)" in resumed.stdout and (tmp_path / "ckpt" / f"step-{STEPS:08d}" / "manifest.json").is_file()


def test_a_hung_rank_makes_its_peer_time_out_naming_the_rank_the_step_and_the_operation(plan_file, tmp_path):
    result = shardwise_run(plan_file, tmp_path / "ckpt", "--timeout-s", "5", crash="hang:1:2")
    assert result.returncode != 0
    line = next(l for l in result.stderr.splitlines() if l.startswith("error: rank 0: step 3:"))
    assert "a collective failed or timed out (--timeout-s 5)" in line and "Timed out" in line


def test_a_non_finite_loss_stops_the_run_or_is_skipped(plan_file, tmp_path):
    stopped = shardwise_run(plan_file, tmp_path / "a", "--lr", "1e30", "--max-restarts", "2")
    assert stopped.returncode == 4 and "restart" not in stopped.stdout + stopped.stderr   # not worth a restart
    assert any(l.startswith("error: rank 0: step ") and "not finite; nothing was updated" in l
               for l in stopped.stderr.splitlines())
    skipped = shardwise_run(plan_file, tmp_path / "b", "--lr", "1e30", "--on-nonfinite", "skip")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "not finite, skipped (no update)" in skipped.stdout


def test_a_new_plan_resumes_a_checkpoint_of_the_old_one(plan_file, tmp_path):
    import re

    doc = plan("tiny-gpt", "cpu", GLOBAL_BATCH, gpus=2, seq_len=SEQ_LEN, precision="fp32", fix={"dp": 1, "tp": 2})
    write_plan(doc, tmp_path / "tp2.json")
    whole = shardwise_run(plan_file, tmp_path / "dp2")
    # Resume from step 4 of the same run (the schedule spans its 6 steps).
    shutil.rmtree(tmp_path / "dp2" / f"step-{STEPS:08d}")
    second = shardwise_run(tmp_path / "tp2.json", tmp_path / "tp2", "--resume", str(tmp_path / "dp2"))
    assert whole.returncode == second.returncode == 0, second.stderr[-2000:]
    assert f"checkpoint: resumed from {tmp_path / 'dp2' / 'step-00000004'} (step 4)" in second.stdout
    losses = lambda out: re.findall(r"step (\d)/6  loss ([0-9.]+)", out)  # noqa: E731
    assert losses(second.stdout) == losses(whole.stdout)[4:]
