"""The executor's tests under the settings that change floating-point results, to show
that the suite does not depend on the machine it runs on.

Each setting runs the executor tests (tests/executor: parity, checkpoints, mixed
clusters, auto_parallelize, the launcher) in a fresh pytest process:

- OMP_NUM_THREADS 1 and 2: how many threads split a kernel's reductions, in the
  one-process reference runs and in torchrun's workers (the ranks that
  executor.launch.run_local forks run one thread: GNU OpenMP's pool does not survive
  fork);
- ATEN_CPU_CAPABILITY default, avx2 and avx512: forces torch's CPU kernels to another
  instruction set, as other CPUs would pick, and with it the GEMM libraries, which
  ATen's variable does not reach (MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA); a
  capability this CPU lacks is reported and not run: its kernels would stop on an
  illegal instruction;
- torch.use_deterministic_algorithms(True), in every Python process of the run (a
  sitecustomize module on PYTHONPATH), or not.

    python .ci/settings.py                    # every setting: 12 runs, about an hour on 2 cores
    python .ci/settings.py --slice ci         # the one CI runs: parity, default kernels, 2 threads, deterministic
    python .ci/settings.py --setting 2:avx2:on   # one setting (repeatable)
    python .ci/settings.py --suite            # the whole suite twice in a row, then in random order

It prints each setting with its pass, fail and skip counts and exits 1 when any failed.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXECUTOR_TESTS = ["tests/executor"]
# The CI slice leaves out variants whose kernels another plan in it runs already (the
# suite before it runs them all): the zero-bubble schedules but pp2-zbv, dualpipev but
# pp2-dualpipev, the MoE schedule variants but ep2-pp2, the shared expert's plans and
# the context-parallel combinations but cp2; about a minute and a half of CI.
PARITY_TESTS = ["tests/executor/test_step.py", "-k", "(not zb or pp2-zbv) and not ep2-pp2- and not shared_expert "
                                                     "and not cp2- and not dp2-cp2 and not -pp2-dualpipev"]
# torch's AVX512 kernels need these (ATen's CPU capability check, cpuinfo's avx512 set).
CAPABILITY_FLAGS = {"default": set(), "avx2": {"avx2", "fma"},
                    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}
# The same instruction set for MKL's and oneDNN's kernels (their own variables; each
# takes a ceiling, so a CPU without it keeps its best below).
LIBRARY_ISA = {"default": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
               "avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
               "avx512": {"MKL_ENABLE_INSTRUCTIONS": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}}
TIMEOUT_S = 1800   # one setting's pytest run; the executor tests take about 4 minutes
SITECUSTOMIZE = """import torch
torch.use_deterministic_algorithms(True)
"""


@dataclass(frozen=True)
class Setting:
    threads: int
    capability: str      # ATEN_CPU_CAPABILITY, or "native" for torch's own choice
    deterministic: bool

    @property
    def label(self) -> str:
        return (f"OMP_NUM_THREADS={self.threads} ATEN_CPU_CAPABILITY={self.capability} "
                f"deterministic={'on' if self.deterministic else 'off'}")


@dataclass(frozen=True)
class Outcome:
    setting: Setting | None
    tests: str
    passed: int
    failed: int
    skipped: int
    seconds: float
    kernels: str           # the capability torch reported using
    note: str = ""


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def missing_flags(capability: str, flags: set[str]) -> set[str]:
    return CAPABILITY_FLAGS.get(capability, set()) - flags


def environment(setting: Setting, scratch: Path) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(setting.threads))
    for name in ("ATEN_CPU_CAPABILITY", *LIBRARY_ISA["default"]):
        env.pop(name, None)
    if setting.capability != "native":
        env["ATEN_CPU_CAPABILITY"] = setting.capability
        env.update(LIBRARY_ISA.get(setting.capability, {}))
    if setting.deterministic:
        (scratch / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(scratch), env.get("PYTHONPATH")]))
    return env


def kernels_in_use(env: dict[str, str]) -> str:
    probe = [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability(), "
                                   "torch.are_deterministic_algorithms_enabled())"]
    done = subprocess.run(probe, env=env, capture_output=True, text=True, cwd=ROOT)
    words = done.stdout.split()
    return f"{words[0]}{' +det' if words[1:] == ['True'] else ''}" if words else "?"


def counts(output: str) -> tuple[int, int, int]:
    """pytest's closing line: passed, failed (errors included), skipped."""
    found = {}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", output):
        found[word.rstrip("s") if word.startswith("error") else word] = int(number)
    return found.get("passed", 0), found.get("failed", 0) + found.get("error", 0), found.get("skipped", 0)


def run_pytest(args: list[str], env: dict[str, str], log, timeout_s: float) -> tuple[str, int, float]:
    """pytest's output and exit code (124 when it ran past `timeout_s`: a hang counts
    as a failure, it does not stall the script)."""
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout_s)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        partial = err.stdout or ""
        output = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
        code = 124
        log(f"    timed out after {timeout_s:.0f} s")
    seconds = time.perf_counter() - start
    for line in output.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            log(f"    {line}")
    return output, code, seconds


def run_setting(setting: Setting, tests: list[str], flags: set[str], log) -> Outcome:
    lacking = missing_flags(setting.capability, flags)
    if lacking:
        return Outcome(setting, " ".join(tests), 0, 0, 0, 0.0, "-",
                       f"not run: this CPU lacks {', '.join(sorted(lacking))}")
    with tempfile.TemporaryDirectory() as scratch:
        env = environment(setting, Path(scratch))
        kernels = kernels_in_use(env)
        output, code, seconds = run_pytest(tests, env, log, TIMEOUT_S)
    passed, failed, skipped = counts(output)
    note = "" if code == 0 else "timed out" if code == 124 else f"pytest exit {code}"
    if code != 0 and not failed:
        failed = 1   # pytest itself failed (collection, a crash): count the run as failed
    return Outcome(setting, " ".join(tests), passed, failed, skipped, seconds, kernels, note)


def parse_setting(text: str, parser: argparse.ArgumentParser) -> Setting:
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or parts[2] not in ("on", "off"):
        parser.error(f"--setting: expected THREADS:CAPABILITY:on|off, got {text!r}")
    return Setting(int(parts[0]), parts[1], parts[2] == "on")


def matrix() -> list[Setting]:
    return [Setting(t, c, d) for d, c, t in itertools.product((False, True), ("default", "avx2", "avx512"), (1, 2))]


def suite_runs(log) -> list[Outcome]:
    """The whole suite twice in a row in this checkout (no test may depend on another's
    leftovers), then in random order (pytest-random-order, its seed printed)."""
    out = []
    seed = random.SystemRandom().randrange(1_000_000)   # printed, so a failing order can be replayed
    for label, extra in (("whole suite, run 1", []), ("whole suite, run 2 (same checkout)", []),
                         ("whole suite, random order", ["-p", "random_order", f"--random-order-seed={seed}"])):
        log(f"{label} ...")
        output, code, seconds = run_pytest(extra, dict(os.environ), log, 3 * TIMEOUT_S)
        passed, failed, skipped = counts(output)
        failed = failed or int(code != 0)
        out.append(Outcome(None, label, passed, failed, skipped, seconds, "native",
                           f"--random-order-seed={seed}" if "random_order" in extra else ""))
    return out


def table(outcomes: list[Outcome]) -> str:
    lines = [f"{'setting':66s} {'kernels':12s} {'passed':>6s} {'failed':>6s} {'skipped':>7s} {'seconds':>7s}  note"]
    for o in outcomes:
        label = o.setting.label if o.setting else o.tests
        lines.append(f"{label:66s} {o.kernels:12s} {o.passed:6d} {o.failed:6d} {o.skipped:7d} {o.seconds:7.0f}  {o.note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--slice", choices=("all", "ci"), default="all",
                        help="all: every setting on the executor tests; ci: the parity tests under one setting.")
    parser.add_argument("--suite", action="store_true",
                        help="Instead: the whole suite twice in a row, then in random order.")
    parser.add_argument("--setting", action="append", default=[], metavar="THREADS:CAPABILITY:on|off",
                        help="Run only this setting, say 1:default:on (repeatable).")
    parser.add_argument("--out", default=None, help="Also write the table to this file.")
    args = parser.parse_args(argv)
    log = lambda text: print(text, flush=True)   # noqa: E731
    flags = cpu_flags()
    if args.suite:
        outcomes = suite_runs(log)
    else:
        settings = matrix() if args.slice == "all" else [Setting(2, "default", True)]
        if args.setting:
            settings = [parse_setting(text, parser) for text in args.setting]
        tests = EXECUTOR_TESTS if args.slice == "all" else PARITY_TESTS
        outcomes = []
        for setting in settings:
            log(f"{setting.label} ...")
            outcomes.append(run_setting(setting, tests, flags, log))
    text = table(outcomes)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    passed, failed = sum(o.passed for o in outcomes), sum(o.failed for o in outcomes)
    print(f"settings: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
