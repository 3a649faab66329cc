"""Fixtures the executor's torchrun tests share, and the compiled tests' inductor cache."""

import os
import tempfile

import pytest
from executor_test_helpers import GLOBAL_BATCH, SEQ_LEN

from planner.api import plan
from planner.plan_file import write_plan

# Inductor's on-disk cache does not key its CPU kernels on ATEN_CPU_CAPABILITY: kernels
# compiled under one kernel set and loaded under another gave NaN losses (measured:
# test_compiled_blocks_train_as_eager under avx2 after a default run). One cache per
# kernel set, inherited by the ranks and the `shardwise run` processes the tests start.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_shardwise_{os.environ.get('ATEN_CPU_CAPABILITY') or 'default'}"))


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    """A dp2 plan of tiny-gpt for two CPU ranks, written as a plan file."""
    doc = plan("tiny-gpt", "cpu", GLOBAL_BATCH, gpus=2, seq_len=SEQ_LEN, precision="fp32", fix={"dp": 2, "tp": 1})
    path = tmp_path_factory.mktemp("plans") / "tiny-gpt-dp2.json"
    write_plan(doc, path)
    return path
