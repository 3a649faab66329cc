"""Constraint rules: what the user allows, pins and forbids, and how much memory to keep
free. Read from `configs/rules/*.yaml` or a user file, strictly (an unknown key is an
error), and merged with `--fix`. The search space (`planner.search.space`) and the partition
solver (`planner.search.partition`) enforce them; nothing here is advisory.

The knobs a rule can name are the keys of `--fix`:
dp, tp, pp, vpp, ep, etp, cp, mbs, zero, recompute, sp, schedule. `etp` is the ranks each
expert's matrices split over: tp, or 1 (whole experts under MoE parallel folding).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from costmodel.specs.loading import (
    SpecError,
    as_bool,
    as_float,
    as_int,
    parse_overrides,
    read_document,
)
from costmodel.strategy import RECOMPUTE_MODES, SCHEDULES, schedule_vpp_error

INT_KNOBS = ("dp", "tp", "pp", "vpp", "ep", "etp", "cp", "mbs", "zero")
KNOBS = INT_KNOBS + ("recompute", "sp", "schedule")
# Longer spellings accepted in rule files and --fix.
ALIASES = {"expert_tensor_parallel": "etp", "micro_batch_size": "mbs", "zero_stage": "zero", "sequence_parallel": "sp", "context_parallel": "cp"}
OBJECTIVES = ("time", "memory", "cost", "energy")
# Budgets a plan must meet (costmodel.estimate.energy): rule-file key -> CLI option.
BUDGETS = {"max_cost_per_step_usd": "--max-cost-per-step", "power_cap_w": "--power-cap",
           "energy_budget_j": "--energy-budget"}


@dataclass(frozen=True)
class Rules:
    """A rule set. `allowed[k]` lists the values knob k may take (absent: any);
    `forbidden` holds (knob, value) pairs; `pinned[k]` fixes knob k."""

    name: str = "default"
    tp_within_node: bool = True
    tp_divides_heads: bool = True
    ep_divides_experts: bool = True
    memory_headroom: float = 0.05
    # A plan fits when its estimated peak memory x (1 + memory_margin) is within the
    # device's memory x (1 - memory_headroom). None: the high side of the runtime
    # profile's memory band (RuntimeSpec.memory_high_ratio - 1).
    memory_margin: float | None = None
    max_stage_imbalance: float = 0.25
    micro_batch_min: int = 1
    micro_batch_max: int = 16
    allowed: dict[str, tuple] = field(default_factory=dict)
    forbidden: tuple[tuple[str, Any], ...] = ()
    pinned: dict[str, Any] = field(default_factory=dict)
    objective: str = "time"
    # Per step: USD for all GPUs; W averaged over the step on the busiest device; J for
    # all GPUs (per step rather than per run: the planner does not know the run's length).
    max_cost_per_step_usd: float | None = None
    power_cap_w: float | None = None
    energy_budget_j: float | None = None

    def permits(self, knob: str, value: Any) -> bool:
        """Whether `value` for `knob` passes allowed, forbidden and pinned."""
        if knob in self.pinned and self.pinned[knob] != value:
            return False
        if knob in self.allowed and value not in self.allowed[knob]:
            return False
        return (knob, value) not in self.forbidden

    def why_not(self, knob: str, value: Any) -> str:
        """The rule that excludes `value` for `knob` (for error messages)."""
        if knob in self.pinned and self.pinned[knob] != value:
            return f"pinned {knob}={format_value(self.pinned[knob])}"
        if knob in self.allowed and value not in self.allowed[knob]:
            return f"allowed.{knob} is {list(map(format_value, self.allowed[knob]))}"
        return f"forbid {knob}={format_value(value)}"

    def with_fix(self, fix: dict[str, Any]) -> Rules:
        """These rules with more knobs pinned (`--fix` wins over the file's pins)."""
        return replace(self, pinned={**self.pinned, **fix})


def parse_objective(value: Any, field_name: str) -> str:
    objective = str(value)
    if objective not in OBJECTIVES:
        raise SpecError(field_name, f"unknown {objective!r} (known: {', '.join(OBJECTIVES)})")
    return objective


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def knob_value(knob: str, value: Any, field_name: str) -> Any:
    """Validate one value for one knob."""
    if knob in INT_KNOBS:
        number = as_int(value, field_name, minimum=0 if knob == "zero" else 1)
        if knob == "zero" and number > 3:
            raise SpecError(field_name, f"ZeRO stage must be 0, 1, 2 or 3, got {number}")
        return number
    if knob == "sp":
        return as_bool(value, field_name)
    text = str(value).lower()
    known = RECOMPUTE_MODES if knob == "recompute" else SCHEDULES
    if text not in known:
        raise SpecError(field_name, f"unknown {knob} {value!r} (known: {', '.join(known)})")
    return text


def knob_name(key: Any, field_name: str) -> str:
    name = ALIASES.get(str(key), str(key))
    if name not in KNOBS:
        raise SpecError(field_name, f"unknown knob {key!r} (knobs: {', '.join(KNOBS)})")
    return name


def parse_fix(text: str | dict | None, field_name: str = "--fix") -> dict[str, Any]:
    """`tp=8,pp=4,recompute=full` (or a dict) -> validated pins."""
    items = parse_overrides(text, field_name) if isinstance(text, str) or text is None else dict(text)
    out: dict[str, Any] = {}
    for key, value in items.items():
        knob = knob_name(key, f"{field_name} {key}")
        if knob in out:   # an alias and its knob (mbs=2,micro_batch_size=4)
            raise SpecError(f"{field_name} {key}", f"pins {knob} a second time")
        out[knob] = knob_value(knob, value, f"{field_name} {key}")
    if out.get("vpp", 1) > 1 and out.get("pp") == 1:
        raise SpecError(f"{field_name} vpp", f"vpp {out['vpp']} needs pp > 1: interleaving splits each pipeline "
                                             "rank's layers into chunks")
    if "schedule" in out and "vpp" in out and (why := schedule_vpp_error(out["schedule"], out["vpp"], 2)):
        raise SpecError(f"{field_name} vpp", why)
    return out


def rules_from_dict(data: dict, name: str) -> Rules:
    known = {"tp_within_node", "tp_divides_heads", "ep_divides_experts", "memory_headroom", "memory_margin",
             "max_stage_imbalance", "micro_batch_size", "allowed", "forbid", "pinned", "objective", *BUDGETS}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SpecError(f"rules.{unknown[0]}", f"unknown field (fields: {', '.join(sorted(known))})")
    defaults = Rules()
    headroom = as_float(data.get("memory_headroom", defaults.memory_headroom), "rules.memory_headroom",
                        minimum=0.0, exclusive=False)
    if headroom >= 1:
        raise SpecError("rules.memory_headroom", f"must be below 1, got {headroom}")
    margin = data.get("memory_margin")
    margin = None if margin is None else as_float(margin, "rules.memory_margin", minimum=0.0, exclusive=False)
    imbalance = as_float(data.get("max_stage_imbalance", defaults.max_stage_imbalance),
                         "rules.max_stage_imbalance", minimum=0.0, exclusive=False)
    bounds = data.get("micro_batch_size", {}) or {}
    if not isinstance(bounds, dict) or set(bounds) - {"min", "max"}:
        raise SpecError("rules.micro_batch_size", "expected {min: N, max: N}")
    mbs_min = as_int(bounds.get("min", defaults.micro_batch_min), "rules.micro_batch_size.min")
    mbs_max = as_int(bounds.get("max", defaults.micro_batch_max), "rules.micro_batch_size.max")
    if mbs_min > mbs_max:
        raise SpecError("rules.micro_batch_size", f"min {mbs_min} is above max {mbs_max}")

    allowed_data = data.get("allowed", {}) or {}
    if not isinstance(allowed_data, dict):
        raise SpecError("rules.allowed", "expected a mapping of knob to a list of values")
    allowed = {}
    for key, values in allowed_data.items():
        knob = knob_name(key, f"rules.allowed.{key}")
        values = values if isinstance(values, list) else [values]
        if not values:
            raise SpecError(f"rules.allowed.{key}", "empty list allows nothing")
        allowed[knob] = tuple(knob_value(knob, v, f"rules.allowed.{key}") for v in values)

    forbid_data = data.get("forbid", []) or []
    if not isinstance(forbid_data, list):
        raise SpecError("rules.forbid", "expected a list such as [zero_stage=3, schedule=gpipe]")
    forbidden = []
    for item in forbid_data:
        for key, value in parse_overrides(str(item), "rules.forbid").items():
            knob = knob_name(key, f"rules.forbid {key}")
            forbidden.append((knob, knob_value(knob, value, f"rules.forbid {key}")))

    pinned_data = data.get("pinned", {}) or {}
    if not isinstance(pinned_data, dict):
        raise SpecError("rules.pinned", "expected a mapping of knob to value")
    pinned = parse_fix(pinned_data, "rules.pinned")

    objective = parse_objective(data.get("objective", "time"), "rules.objective")
    return Rules(
        name=name,
        tp_within_node=as_bool(data.get("tp_within_node", True), "rules.tp_within_node"),
        tp_divides_heads=as_bool(data.get("tp_divides_heads", True), "rules.tp_divides_heads"),
        ep_divides_experts=as_bool(data.get("ep_divides_experts", True), "rules.ep_divides_experts"),
        memory_headroom=headroom,
        memory_margin=margin,
        max_stage_imbalance=imbalance,
        micro_batch_min=mbs_min,
        micro_batch_max=mbs_max,
        allowed=allowed,
        forbidden=tuple(forbidden),
        pinned=pinned,
        objective=objective,
        **{key: as_float(data[key], f"rules.{key}") for key in BUDGETS if data.get(key) is not None},
    )


def load_rules(source: str | Path | None = None) -> Rules:
    """Rules by built-in name (`default`, `megatron`, `fsdp`) or path; default if None."""
    data, name = read_document(source or "default", "rules", "--rules")
    return rules_from_dict(data, name)
