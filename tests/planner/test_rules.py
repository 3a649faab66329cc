"""planner.rules: rule files and --fix pins are strict and name the field.
"""

from __future__ import annotations

import pytest

from costmodel.specs.loading import SpecError
from planner.rules import parse_fix, rules_from_dict


def test_rules_are_strict_and_name_the_field():
    with pytest.raises(SpecError) as err:
        rules_from_dict({"tp_within_nodes": True}, "x")
    assert err.value.field == "rules.tp_within_nodes"
    with pytest.raises(SpecError) as err:
        parse_fix("zero=4")
    assert err.value.field == "--fix zero"
    assert parse_fix("tp=8,sp=on,recompute=full") == {"tp": 8, "sp": True, "recompute": "full"}


def test_a_rules_file_sets_the_memory_margin():
    assert rules_from_dict({"memory_margin": 0.1}, "mine").memory_margin == 0.1
    assert rules_from_dict({}, "mine").memory_margin is None   # the runtime profile's band
    with pytest.raises(SpecError) as err:
        rules_from_dict({"memory_margin": -0.1}, "mine")
    assert err.value.field == "rules.memory_margin"
