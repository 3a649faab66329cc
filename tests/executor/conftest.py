"""Fixtures the executor's torchrun tests share."""

import pytest
from executor_test_helpers import GLOBAL_BATCH, SEQ_LEN

from planner.api import plan
from planner.plan_file import write_plan


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    """A dp2 plan of tiny-gpt for two CPU ranks, written as a plan file."""
    doc = plan("tiny-gpt", "cpu", GLOBAL_BATCH, gpus=2, seq_len=SEQ_LEN, precision="fp32", fix={"dp": 2, "tp": 1})
    path = tmp_path_factory.mktemp("plans") / "tiny-gpt-dp2.json"
    write_plan(doc, path)
    return path
