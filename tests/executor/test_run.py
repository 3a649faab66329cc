"""`shardwise run` (executor.run): a plan file trained under torchrun gives the
single-process losses, writes its metrics, and every bad input is refused before any
process trains.

Crash recovery under torchrun: when a rank is killed at a chosen step, `shardwise run
--max-restarts` starts the group again and it resumes from the newest checkpoint, ending
with parameters and optimizer states bitwise equal to an uninterrupted run; a save
killed before its publish leaves the previous checkpoint to resume from; a rank that
hangs makes its peer fail naming the rank, step and operation; a non-finite loss stops
the run, or is skipped when asked."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from executor_test_helpers import (
    CONFIG,
    GLOBAL_BATCH,
    SEQ_LEN,
    STEPS,
    loss_rtol,
    reference_run,
)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from executor.launch import WORKER_SCRIPT, plan_launch, torchrun_command
from executor.run import main as worker_main
from planner.api import plan
from planner.console.cli import main as cli
from planner.plan_file import write_plan


def run_cli(*args):
    result = CliRunner().invoke(cli, ["run", *map(str, args)])
    return result.exit_code, result.output


def test_corrupt_plan_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "model": ')
    code, out = run_cli(bad)
    assert code == 2 and "plan: " in out and "not valid JSON" in out
    assert len(out.strip().splitlines()) == 1


def test_tampered_plan_is_refused(plan_file, tmp_path):
    doc = json.loads(plan_file.read_text())
    doc["model"]["hidden_size"] = 128    # the fingerprint no longer matches
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(doc))
    code, out = run_cli(tampered)
    assert code == 2 and "plan.model_fingerprint" in out


def test_plan_for_another_model_is_refused(plan_file):
    code, out = run_cli(plan_file, "--model", "tiny-llama")
    assert code == 2 and out.startswith("error: --model: tiny-llama is not the model this plan was made for")


def test_world_size_mismatch_is_refused(plan_file, monkeypatch):
    code, out = run_cli(plan_file, "--nproc-per-node", "3")
    assert code == 2 and "--nproc-per-node: the plan needs 2 processes" in out
    # The worker checks again, before it joins a process group.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert worker_main([str(plan_file), "--steps", "1"]) == 2


def test_the_checks_before_launch_and_the_launcher_import_no_torch(plan_file):
    """`shardwise run` checks a plan, and torchrun's launcher process starts the ranks,
    without torch's start-up (1.6 s of the 6 s a one-step tiny run takes here): the
    checks live in executor.launch."""
    script = ("import sys\n"
              "from click.testing import CliRunner\n"
              "from planner.console.cli import main\n"
              f"out = CliRunner().invoke(main, ['run', {str(plan_file)!r}, '--nproc-per-node', '3'])\n"
              "import executor.launch\n"
              "print(out.exit_code, sorted(m for m in ('torch', 'numpy') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[0] == "2 []", done.stdout + done.stderr


def test_torchrun_command_for_nodes():
    one = torchrun_command(plan_launch(8, None, 1, 0, None), ["p.json"])
    assert one[one.index("--nproc-per-node") + 1] == "8" and "--standalone" in one
    two = torchrun_command(plan_launch(16, None, 2, 1, "node0:29500"), ["p.json"])
    assert two[two.index("--nproc-per-node") + 1] == "8"
    assert two[two.index("--node-rank") + 1] == "1" and two[two.index("--rdzv-endpoint") + 1] == "node0:29500"
    assert two[1:3] == ["-m", "executor.launch"]
    assert two[-5:] == ["--start-method", "fork", "--run-path", WORKER_SCRIPT, "p.json"]
    assert WORKER_SCRIPT.endswith("executor/run.py")


def test_run_trains_like_one_process(plan_file, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    cmd = [sys.executable, "-m", "planner.console.cli", "run", str(plan_file), "--steps", str(STEPS), "--lr", str(CONFIG.lr),
           "--metrics-out", str(metrics)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps, summary = lines[:-1], lines[-1]["summary"]
    assert [s["step"] for s in steps] == list(range(STEPS))
    ref_losses, _ = reference_run("tiny-gpt")
    assert [s["loss"] for s in steps] == pytest.approx(ref_losses, rel=loss_rtol(CONFIG.dtype))
    assert all(s["step_time_s"] > 0 and s["peak_memory_bytes"] > 0 for s in steps)
    assert summary["steps"] == STEPS and summary["estimated_step_time_s"] > 0
    # The workers inherit this process's setting (.ci/settings.py turns it on in every process).
    assert summary["numerics"] == {"dtype": "float32", "autocast": "none",
                                   "deterministic": torch.are_deterministic_algorithms_enabled(), "compile": "none",
                                   "overlap": {"fsdp_prefetch": 1, "fsdp_kept_gathered": "none", "ddp_bucket_mb": 25.0,
                                               "async_tp": False}}
    assert "Run against the plan" in done.stdout


def test_a_compiled_plan_runs_compiled_and_trains_as_eager(tmp_path):
    """`plan --compile` prices compiled blocks and records it in the plan's runtime;
    `shardwise run` then compiles each block with inductor, and the losses are eager's
    within float32's bound for another summation order."""
    doc = plan("tiny-gpt", "cpu", GLOBAL_BATCH, gpus=2, seq_len=SEQ_LEN, precision="fp32", fix={"dp": 2, "tp": 1},
               compile=True)
    assert doc["runtime"]["torch_compile"] is True
    write_plan(doc, tmp_path / "compiled.json")
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "planner.console.cli", "run", str(tmp_path / "compiled.json"), "--steps", "3",
           "--lr", str(CONFIG.lr), "--metrics-out", str(metrics)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", **os.environ},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert lines[-1]["summary"]["numerics"]["compile"] == "inductor"
    ref_losses, _ = reference_run("tiny-gpt", steps=3)
    assert [s["loss"] for s in lines[:-1]] == pytest.approx(ref_losses, rel=loss_rtol(CONFIG.dtype, steps=3))


def test_plans_the_executor_cannot_build_are_refused(plan_file, tmp_path):
    doc = json.loads(plan_file.read_text())
    for change, field in (({"vpp": 2, "schedule": "1f1b"}, "strategy.vpp"),
                          ({"tp": 2, "dp": 1, "micro_batch_size": 8, "sequence_parallel": True}, None)):
        bad = json.loads(json.dumps(doc))
        bad["strategy"].update(change)
        if field is None:   # SP over a sequence tp does not divide
            bad["training"]["seq_len"] = 15
            field = "strategy.sequence_parallel"
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        code, out = run_cli(path)
        assert code == 2 and field in out, out


# -- crash recovery ------------------------------------------------------------------

RESTART_STEPS = 6   # each run of the recovery tests, checkpointed every 2 steps


def shardwise_run(plan_file, checkpoints, *extra, crash=None):
    env = dict(os.environ)
    env.pop("SHARDWISE_TEST_CRASH_AT", None)
    if crash:
        env["SHARDWISE_TEST_CRASH_AT"] = crash
    return subprocess.run([sys.executable, "-m", "planner.console.cli", "run", str(plan_file),
                           "--steps", str(RESTART_STEPS), "--checkpoint-dir", str(checkpoints),
                           "--checkpoint-every", "2", *extra],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def clean_run(plan_file, tmp_path_factory):
    """The uninterrupted run the recovery tests compare with: its checkpoint folder and
    its process (one run for the module; tests copy the folder before they write to it)."""
    folder = tmp_path_factory.mktemp("clean") / "ckpt"
    done = shardwise_run(plan_file, folder)
    assert done.returncode == 0, done.stderr[-2000:]
    return folder, done


def assert_final_checkpoints_bitwise_equal(clean_dir, tmp_path):
    """The clean run's and the crashed run's (tmp_path / "crashed") last checkpoints: the
    same weights and optimizer states, bit for bit."""
    final = f"step-{RESTART_STEPS:08d}"
    a = tensors(clean_dir / final, tmp_path, "a")
    b = tensors(tmp_path / "crashed" / final, tmp_path, "b")
    assert set(a) == set(b) and any(k.startswith("optim.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def tensors(checkpoint_dir, tmp_path, name):
    out = tmp_path / f"{name}.pt"
    dcp_to_torch_save(str(checkpoint_dir), str(out))
    state = torch.load(out, weights_only=True)
    return {k: v for k, v in state.items() if k.startswith(("model.", "optim."))}


def test_a_killed_rank_is_restarted_and_ends_bitwise_equal(plan_file, clean_run, tmp_path):
    crashed = shardwise_run(plan_file, tmp_path / "crashed", "--max-restarts", "1", crash="1:3")
    assert crashed.returncode == 0, crashed.stderr[-2000:]
    assert "checkpoint: resumed from" in crashed.stdout and "(step 2)" in crashed.stdout
    assert_final_checkpoints_bitwise_equal(clean_run[0], tmp_path)


def test_a_save_killed_halfway_leaves_the_previous_checkpoint(plan_file, tmp_path):
    killed = shardwise_run(plan_file, tmp_path / "ckpt", crash="save:4")
    assert killed.returncode != 0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".step-00000004.partial", "step-00000002"]
    resumed = shardwise_run(plan_file, tmp_path / "ckpt")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"checkpoint: ignoring {tmp_path / 'ckpt' / '.step-00000004.partial'}: a save that did not finish" \
        in resumed.stdout
    final = tmp_path / "ckpt" / f"step-{RESTART_STEPS:08d}"
    assert "(step 2)" in resumed.stdout and (final / "manifest.json").is_file()


def test_a_hung_rank_makes_its_peer_time_out_naming_the_rank_the_step_and_the_operation(plan_file, tmp_path):
    result = shardwise_run(plan_file, tmp_path / "ckpt", "--timeout-s", "5", crash="hang:1:2")
    assert result.returncode != 0
    line = next(l for l in result.stderr.splitlines() if l.startswith("error: rank 0: step 3:"))
    assert "a collective failed or timed out (--timeout-s 5)" in line and "Timed out" in line


def test_a_non_finite_loss_stops_the_run_or_is_skipped(plan_file, tmp_path):
    stopped = shardwise_run(plan_file, tmp_path / "a", "--lr", "1e30", "--max-restarts", "2")
    assert stopped.returncode == 4 and "restart" not in stopped.stdout + stopped.stderr   # not worth a restart
    # Every rank finds it; torchrun may stop the others before they print, so any rank's line.
    assert any(re.match(r"error: rank \d+: step \d+: ", l) and "not finite; nothing was updated" in l
               for l in stopped.stderr.splitlines())
    skipped = shardwise_run(plan_file, tmp_path / "b", "--lr", "1e30", "--on-nonfinite", "skip")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "not finite, skipped (no update)" in skipped.stdout


def test_a_new_plan_resumes_a_checkpoint_of_the_old_one(clean_run, tmp_path):
    doc = plan("tiny-gpt", "cpu", GLOBAL_BATCH, gpus=2, seq_len=SEQ_LEN, precision="fp32", fix={"dp": 1, "tp": 2})
    write_plan(doc, tmp_path / "tp2.json")
    clean_dir, whole = clean_run
    # Resume from step 4 of the same run (the schedule spans its 6 steps).
    shutil.copytree(clean_dir, tmp_path / "dp2", ignore=shutil.ignore_patterns(f"step-{RESTART_STEPS:08d}"))
    second = shardwise_run(tmp_path / "tp2.json", tmp_path / "tp2", "--resume", str(tmp_path / "dp2"))
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"checkpoint: resumed from {tmp_path / 'dp2' / 'step-00000004'} (step 4)" in second.stdout
    losses = lambda out: re.findall(r"step (\d)/6  loss ([0-9.]+)", out)  # noqa: E731
    assert losses(second.stdout) == losses(whole.stdout)[4:]


def test_a_rank_killed_mid_backward_is_restarted_and_ends_bitwise_equal(plan_file, clean_run, tmp_path):
    """SHARDWISE_TEST_CRASH_AT's in-step points: rank 1 SIGKILLed as the gradient
    reaches its middle layer in step 3 (0-based); the restart resumes from step 2."""
    crashed = shardwise_run(plan_file, tmp_path / "crashed", "--max-restarts", "1", crash="backward:1:3")
    assert crashed.returncode == 0, crashed.stderr[-2000:]
    assert "SHARDWISE_TEST_CRASH: rank 1 killed at backward, step 3, attempt 0" in crashed.stderr
    assert "restart 1 of 1" in crashed.stdout and "(step 2)" in crashed.stdout
    assert_final_checkpoints_bitwise_equal(clean_run[0], tmp_path)


# -- refused before launch: the data, the outputs, the endpoint, the machine ----------------

@pytest.mark.parametrize("make, text", [
    (lambda d: d / "missing.txt", "--data: unknown data source"),
    (lambda d: (d / "empty.txt").write_text("") and None or d / "empty.txt", "too small for one sample"),
    (lambda d: (d / "short.txt").write_text("a few bytes " * 5) and None or d / "short.txt", "fewer than one batch"),
    (lambda d: (d / "bin.txt").write_bytes(b"\xff\xfe" * 4000) and None or d / "bin.txt", "is not UTF-8 text"),
])
def test_bad_data_is_refused_before_any_rank_starts(plan_file, tmp_path, make, text):
    code, out = run_cli(plan_file, "--data", make(tmp_path))
    assert code == 2 and text in out and len(out.strip().splitlines()) == 1, out


@pytest.mark.parametrize("option, value, text", [
    ("--metrics-out", "missing/m.jsonl", "--metrics-out: cannot write"),
    ("--checkpoint-dir", "afile", "--checkpoint-dir: afile is a file"),
    ("--checkpoint-dir", "/proc/shardwise-ckpt", "--checkpoint-dir: cannot write under /proc/shardwise-ckpt"),
    ("--rdzv-endpoint", "nohost", "--rdzv-endpoint: expected HOST:PORT"),
    # Found by bench/fuzz_cli.py: torchrun retried an unresolvable host until its timeout.
    ("--rdzv-endpoint", "ü:29500", "--rdzv-endpoint: cannot resolve host 'ü'"),
    ("--rdzv-endpoint", "no-such-host.invalid:29500", "--rdzv-endpoint: cannot resolve host 'no-such-host.invalid'"),
])
def test_unusable_outputs_and_endpoints_are_refused_before_launch(plan_file, tmp_path, monkeypatch, option, value,
                                                                   text):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    code, out = run_cli(plan_file, option, value)
    assert code == 2 and text in out and len(out.strip().splitlines()) == 1, out


def test_a_plan_bigger_than_this_machine_is_refused(tmp_path, monkeypatch):
    """128 CPU ranks of ~1 GiB each: the memory they need against what the machine has,
    before a process is forked."""
    import executor.launch as launch

    doc = plan("tiny-gpt", "cpu", 128, gpus=128, seq_len=SEQ_LEN, precision="fp32", fix={"dp": 128, "tp": 1})
    write_plan(doc, tmp_path / "big.json")
    monkeypatch.setattr(launch.os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 2**20, "SC_PAGE_SIZE": 4096}[name])
    code, out = run_cli(tmp_path / "big.json")
    assert code == 2 and "the plan starts 128 CPU ranks on this node" in out and "4.0 GiB available" in out, out


def _parent(pid: int) -> int | None:
    """`pid`'s parent, or None once it has gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _alive(marker: str) -> list[int]:
    """Processes whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def test_sigterm_stops_torchrun_and_every_worker(plan_file, tmp_path):
    """What scancel and Kubernetes send: the command forwards it, torchrun stops its
    workers, and none outlives the command."""
    import signal
    import time

    marker = tmp_path / "sigterm-plan.json"
    marker.write_text(plan_file.read_text())
    cmd = [sys.executable, "-m", "planner.console.cli", "run", str(marker), "--steps", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={"OMP_NUM_THREADS": "1", **os.environ})
    for line in proc.stdout:   # wait until the ranks train
        if line.startswith("step "):
            break
    assert len(_alive(str(marker))) >= 3   # this command, torchrun and its two workers
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.time() + 30
    while _alive(str(marker)) and time.time() < deadline:
        time.sleep(0.2)
    assert _alive(str(marker)) == []


def test_workers_end_when_torchrun_is_killed_outright(plan_file, tmp_path):
    """SIGKILL (the OOM killer, a hard stop) of the command and torchrun: no forwarding
    is possible, and the workers end anyway (the kernel's parent-death signal,
    executor.launch.die_with_launcher)."""
    import signal
    import time

    marker = tmp_path / "sigkill-plan.json"
    marker.write_text(plan_file.read_text())
    cmd = [sys.executable, "-m", "planner.console.cli", "run", str(marker), "--steps", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={"OMP_NUM_THREADS": "1", **os.environ}, start_new_session=True)
    for line in proc.stdout:   # wait until the ranks train
        if line.startswith("step "):
            break
    try:
        # The command, torchrun (its child) and the workers (torchrun's children).
        launchers = [pid for pid in _alive(str(marker)) if _parent(pid) == proc.pid]
        workers = [pid for pid in _alive(str(marker)) if _parent(pid) in launchers]
        assert len(launchers) == 1 and len(workers) == 2, (launchers, workers)
        os.kill(proc.pid, signal.SIGKILL)
        os.kill(launchers[0], signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.time() + 30
        while _alive(str(marker)) and time.time() < deadline:
            time.sleep(0.2)
        assert _alive(str(marker)) == []
    finally:   # a failure leaves no orphan behind
        for pid in _alive(str(marker)):
            os.kill(pid, signal.SIGKILL)


def test_steps_is_the_step_to_train_to_after_a_resume_too(plan_file, clean_run, tmp_path):
    """A run trained to step 6 and started again with --steps 6 has nothing to do; with
    --steps 5 it is bad input naming --steps (the checkpoint is past it)."""
    shutil.copytree(clean_run[0], tmp_path / "ckpt")
    again = shardwise_run(plan_file, tmp_path / "ckpt", "--steps", str(RESTART_STEPS))
    assert again.returncode == 0 and "all 6 steps are trained, nothing to do" in again.stdout, again.stderr[-2000:]
    back = shardwise_run(plan_file, tmp_path / "ckpt", "--steps", str(RESTART_STEPS - 1))
    assert back.returncode == 2
    assert "--steps: 5 is the step to train to, and the checkpoint is already at step 6" in back.stdout + back.stderr


def test_resume_from_another_model_or_a_tampered_checkpoint_is_refused_before_launch(plan_file, tmp_path):
    from executor.checkpoint import MANIFEST, MANIFEST_VERSION

    ckpt = tmp_path / "other"
    ckpt.mkdir()
    (ckpt / "data.distcp").write_bytes(b"weights")
    manifest = {"schema_version": MANIFEST_VERSION, "step": 3, "model_fingerprint": "sha256:another",
                "plan": {"model": {"name": "tiny-llama"}}, "files": {"data.distcp": "0" * 64}}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    code, out = run_cli(plan_file, "--resume", ckpt)
    assert code == 2 and "checksum does not match the manifest" in out and len(out.strip().splitlines()) == 1
    import hashlib

    manifest["files"]["data.distcp"] = hashlib.sha256(b"weights").hexdigest()
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    code, out = run_cli(plan_file, "--resume", ckpt)
    assert code == 2 and "was written for another model (tiny-llama) than the plan's (tiny-gpt)" in out, out
