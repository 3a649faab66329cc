"""planner.console.cli against its contract, fuzzed: the CI slice of bench/fuzz_cli.py.

The same hypothesis generators and checks as the bench (bad numbers, wrong types,
unicode and control characters, empty / huge / garbage files, missing and unwritable
paths, hand-edited plan, spec and engine files), drawn with a fixed seed so CI is
deterministic, and run in-process with click's CliRunner in a fresh folder per case.
Each case must exit 0, 2 or 3 (`run`: also 4, 5) without a traceback; exit 2 ends in
one line `error: <field>: ...`; it answers within 10 s; a failure leaves no new file
and no `*.tmp` behind.

Nothing here starts a process: `run`'s torchrun launch and `profile`'s measurement are
replaced by stubs (the launch reports success, the measurement returns the base
profile), so what is checked is everything the CLI does before and after them. The
bench runs real subprocesses, launches included:

    python bench/fuzz_cli.py --cases 2000
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import fuzz_cli

SEED = 20261206
# Cases per command (280 in all; about 15-30 s in-process on a 2-core machine).
SLICE = {"plan": 50, "sweep": 25, "explain": 35, "replan": 30, "export": 35, "evaluate": 40, "run": 35, "profile": 30}


def _invoke_in_process(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """make_bases' runner: CliRunner for the plans and exports, a subprocess for the base
    profile (it measures, which this process should not)."""
    if args[0] == "profile":
        return fuzz_cli.subprocess_invoke(args, cwd)
    from planner.console.cli import main

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        result = CliRunner().invoke(main, args, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> fuzz_cli.Bases:
    return fuzz_cli.make_bases(_invoke_in_process, tmp_path_factory.mktemp("fuzz_bases"))


@pytest.fixture
def no_processes(monkeypatch, bases):
    """`run` launches nothing (the launch reports success), `profile` measures nothing
    (it gets the base profile)."""
    import executor.launch
    import executor.measure

    monkeypatch.setattr(executor.launch, "run_torchrun", lambda launch, worker, log=print: 0)
    monkeypatch.setattr(executor.measure, "profile", lambda *args, **kwargs: copy.deepcopy(bases.profile))


def test_the_slice_is_at_least_200_cases():
    assert sum(SLICE.values()) >= 200


@pytest.mark.parametrize("command", list(SLICE))
def test_fuzzed_command_lines_keep_the_contract(command, bases, no_processes, tmp_path):
    cases = fuzz_cli.draw_cases(bases, SLICE[command], seed=SEED, commands=(command,))
    assert len(cases) == SLICE[command]
    failures: dict[str, list] = {}
    for i, case in enumerate(cases):
        folder = tmp_path / f"case{i:03d}"
        folder.mkdir()
        try:
            outcome = fuzz_cli.run_in_process(case, folder)
        finally:
            fuzz_cli.cleanup(folder)
        for failure in fuzz_cli.check(case, outcome):
            failures.setdefault(failure.signature, []).append((case, outcome, failure))
    lines = []
    for signature, items in sorted(failures.items(), key=lambda kv: -len(kv[1])):
        case, outcome, failure = items[0]
        lines += [f"{signature}  [{len(items)} case(s)]", f"  $ {case.command_line()}"]
        lines += [f"    file {name}: {f.recipe[:300]}" for name, f in case.files.items()]
        lines += [f"  -> exit {outcome.exit_code}: {failure.reason[:300]}"]
        lines += [f"  | {line[:200]}" for line in failure.detail[-4:]]
    assert not failures, f"{len(failures)} contract failure(s) of `{command}`:\n" + "\n".join(lines)
