"""The Python door: `plan(...)` does what `shardwise plan` does and returns the plan
document (the same dict the plan file holds).

    from planner.api import plan
    doc = plan("gpt3-175b", "dgx-a100-80gb", global_batch=1536, nodes=16, fix={"tp": 8})
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from costmodel.hf import check_spec
from costmodel.loading import load_cluster, load_model, make_training
from costmodel.profile import load_measured_times
from costmodel.specs import Problem
from planner.plan import plan_document
from planner.rules import load_rules, parse_fix
from planner.search import search
from planner.space import check_fix


def make_problem(model: str, cluster: str, global_batch: Any, *, nodes: Any = None, gpus: Any = None,
                 seq_len: Any = None, precision: str = "bf16", optimizer: str = "adamw",
                 flash_attention: bool = True, overrides: dict | None = None, fix: dict | None = None,
                 profile: str | Path | None = None) -> Problem:
    """Load and validate the specs; raises SpecError naming the bad field. `hf:PATH`
    reads a Hugging Face config.json (or its folder) and checks it against the model
    transformers builds from it on the meta device. `profile` is a `shardwise profile
    --model` JSON whose measured layer times the cost model uses (costmodel.profile); one
    of another model, sequence length, precision or attention kernel is refused."""
    if str(model).startswith("hf:"):
        source = str(model)[3:]
        model_spec = load_model(source, overrides)
        check_spec(source, model_spec)
    else:
        model_spec = load_model(model, overrides)
    cluster_spec = load_cluster(cluster, nodes=nodes, gpus=gpus)
    training = make_training(model_spec, cluster_spec, global_batch, seq_len, precision, optimizer, flash_attention)
    measured = load_measured_times(profile, model_spec, training) if profile is not None else None
    problem = Problem(model_spec, cluster_spec, training, measured)
    check_fix(problem, fix or {})
    return problem


def plan(model: str, cluster: str, global_batch: Any, *, nodes: Any = None, gpus: Any = None,
         seq_len: Any = None, precision: str = "bf16", optimizer: str = "adamw", flash_attention: bool = True,
         rules: str | None = None, fix: dict | str | None = None, overrides: dict | None = None,
         top: int = 3, profile: str | Path | None = None) -> dict:
    """Search and return the plan document; raises SpecError or search.Infeasible.
    `profile`: measured layer times to plan with (see make_problem)."""
    pins = parse_fix(fix)
    problem = make_problem(model, cluster, global_batch, nodes=nodes, gpus=gpus, seq_len=seq_len,
                           precision=precision, optimizer=optimizer, flash_attention=flash_attention,
                           overrides=overrides, fix=pins, profile=profile)
    rule_set = load_rules(rules).with_fix(pins)
    return plan_document(problem, rule_set.name, search(problem, rule_set, top=top))
