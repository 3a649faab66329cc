"""planner.plan_file: the plan artifact round-trips and the one validation refuses a tampered
plan for every reader.
"""

from __future__ import annotations

import json
import pytest
from costmodel.specs.loading import SpecError
from planner.api import plan
from planner.plan_file import read_plan, strategy_of, write_plan


def test_returned_plan_fits_memory_and_round_trips(tmp_path):
    doc = plan("gpt3-13b", "dgx-a100-40gb", 256, nodes=2, seq_len=2048)
    assert doc["estimate"]["peak_memory_bytes"] <= 40 * 2**30 * 0.95 * 1.0001
    path = tmp_path / "plan.json"
    write_plan(doc, path)
    back = read_plan(path)
    assert back == doc
    s = strategy_of(back)
    assert s.dp * s.tp * s.pp == 16 and sum(st.num_layers for st in s.stages) == 40



def test_tampered_plan_is_rejected(tmp_path):
    doc = plan("tiny-llama", "cpu", 8, gpus=2)
    doc["model"]["hidden_size"] += 1
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SpecError) as err:
        read_plan(path)
    assert err.value.field == "plan.model_fingerprint"
