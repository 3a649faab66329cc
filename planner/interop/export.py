"""Exports: a plan's strategy as another engine's configuration, by target: torchtitan's
command-line overrides (its Python-config releases, 0.3) or job TOML (0.2)
(`interop.torchtitan`), Megatron-LM's command-line arguments (`interop.megatron`), or a
DeepSpeed config JSON (`interop.deepspeed`). Each exporter returns the text and warnings
for what the engine cannot express, in the engine's own terms; then the text is read
back with `planner.interop.importers` and any difference from the plan is a warning too,
so nothing is dropped silently.
"""

from __future__ import annotations

import itertools

from costmodel.specs import ModelSpec, RuntimeSpec, TrainingSpec
from costmodel.specs.loading import SpecError
from costmodel.strategy import Strategy
from planner.interop import importers
from planner.interop.common import Exported, strategy_changes
from planner.interop.deepspeed import export_deepspeed
from planner.interop.megatron import export_megatron
from planner.interop.torchtitan import export_torchtitan, export_torchtitan_toml
from planner.plan_file import is_traced, model_of, runtime_of, strategy_of, training_of

TARGETS = ("torchtitan", "torchtitan-toml", "megatron", "deepspeed")
# The selective recompute each engine runs (costmodel.terms.recompute); DeepSpeed has none.
ENGINE_SELECTIVE = {"torchtitan": "op-level", "torchtitan-toml": "op-level", "megatron": "attention-core"}


# ---------------------------------------------------------------------------
# torchtitan


# ---------------------------------------------------------------------------
# Megatron-LM


# ---------------------------------------------------------------------------
# DeepSpeed


_EXPORTERS = {"torchtitan": export_torchtitan, "torchtitan-toml": export_torchtitan_toml,
              "megatron": export_megatron, "deepspeed": export_deepspeed}


def export_strategy(target: str, strategy: Strategy, model: ModelSpec, training: TrainingSpec,
                    runtime: RuntimeSpec | None = None) -> Exported:
    """The target's configuration for `strategy`, with what it cannot express as warnings;
    the text is read back and any strategy it describes other than the plan's is one more.
    `runtime`: the profile the plan was priced under (its selective recompute policy)."""
    if target not in _EXPORTERS:
        raise SpecError("--to", f"unknown target {target!r} (known: {', '.join(TARGETS)})")
    exported = _EXPORTERS[target](strategy, model, training)
    exported = Exported(exported.text, exported.warnings + _group_warnings(target, strategy)
                        + _selective_warnings(target, strategy, runtime))
    try:
        back = importers.read_text(target, exported.text, model, strategy.num_gpus)
    except SpecError as err:
        return Exported(exported.text, exported.warnings + (f"{target} refuses this configuration: {err}",))
    changes = strategy_changes(strategy, back.strategy)
    if changes:
        return Exported(exported.text, exported.warnings + (f"{target} will run this configuration with "
                                                            f"{', '.join(changes)} (plan → exported)",))
    return exported


def _selective_warnings(target: str, strategy: Strategy, runtime: RuntimeSpec | None) -> tuple[str, ...]:
    """A plan priced under one selective recompute policy, exported to an engine that runs the other."""
    engine = ENGINE_SELECTIVE.get(target)
    if runtime is None or engine is None or not any(st.selective_recompute_layers for st in strategy.stages):
        return ()
    if runtime.selective_recompute == engine:
        return ()
    return (f"{target}'s selective recompute is {engine}, the plan priced it as {runtime.selective_recompute} "
            f"(runtime {runtime.name}): its memory and time differ; plan with --runtime "
            f"{'pytorch-native' if engine == 'op-level' else 'megatron'} to price what {target} runs",)


def _group_warnings(target: str, strategy: Strategy) -> tuple[str, ...]:
    """What a mixed-cluster plan holds that no engine's configuration says."""
    s = strategy
    if s.stage_groups:
        spans, first = [], 0
        for name, run in itertools.groupby(s.stage_groups):
            count = len(list(run))
            spans.append(f"{first if count == 1 else f'{first}-{first + count - 1}'} on {name}")
            first += count
        placed = "pipeline ranks " + ", ".join(spans)
        return (f"{target} has no device groups: the plan puts {placed}; start the nodes so that global ranks "
                f"r x {s.dp * s.tp} onwards are on pipeline rank r's group",)
    if s.replica_groups:
        runs = itertools.groupby(zip(s.replica_groups, s.replica_microbatches))
        shares = ", ".join(f"{len(list(run))} on {name} {m} each" for (name, m), run in runs)
        return (f"{target} gives every data-parallel replica the same share of the batch; the plan's replicas run "
                f"micro-batches by their group's speed ({shares}), which no {target} option says: the export "
                f"takes {s.num_microbatches} for all",)
    return ()


def export_plan(doc: dict, target: str) -> Exported:
    """Export a plan document (read with planner.plan_file.read_plan)."""
    if is_traced(doc):
        raise SpecError("plan.model", "a traced module's plan has no transformer layers an engine could place")
    return export_strategy(target, strategy_of(doc), model_of(doc), training_of(doc), runtime_of(doc))
