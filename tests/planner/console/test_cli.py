"""planner.console.cli: exit codes and one-line messages.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from planner.console.cli import main


@pytest.mark.parametrize("args, code, text", [
    (["--model", "nope"], 2, "--model"),
    (["--fix", "tp=3"], 2, "--fix tp"),
    (["--global-batch", "-4"], 2, "--global-batch"),
    (["--fix", "mbs=3"], 2, "--fix mbs"),
])
def test_cli_bad_input_exits_2_with_one_line(args, code, text):
    base = {"--model": "llama2-7b", "--cluster": "dgx-h100", "--nodes": "1", "--global-batch": "64"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = ["plan"] + [x for kv in base.items() for x in kv]
    out = CliRunner().invoke(main, argv)
    assert out.exit_code == code
    assert text in out.output and "Traceback" not in out.output
    assert len(out.output.strip().splitlines()) == 1



def test_cli_infeasible_exits_3_naming_memory():
    out = CliRunner().invoke(main, ["plan", "--model", "gpt3-175b", "--cluster", "dgx-a100-80gb",
                                    "--nodes", "2", "--global-batch", "64", "--seq", "2048"])
    assert out.exit_code == 3
    assert "needs" in out.output and "GiB" in out.output and "would fit if you use" in out.output
