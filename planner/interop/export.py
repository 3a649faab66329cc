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
from dataclasses import replace

from costmodel.estimate import estimate
from costmodel.problem import Problem
from costmodel.specs import (
    ClusterSpec,
    MixedClusterSpec,
    ModelSpec,
    RuntimeSpec,
    TrainingSpec,
)
from costmodel.specs.loading import SpecError
from costmodel.strategy import Strategy
from costmodel.units import GIB
from planner.interop import importers
from planner.interop.common import Exported, strategy_changes
from planner.interop.deepspeed import export_deepspeed
from planner.interop.megatron import export_megatron
from planner.interop.torchtitan import export_torchtitan, export_torchtitan_toml
from planner.plan_file import (
    cluster_of,
    is_traced,
    model_of,
    runtime_of,
    strategy_of,
    training_of,
)

TARGETS = ("torchtitan", "torchtitan-toml", "megatron", "deepspeed")
# The selective recompute each engine runs (costmodel.terms.recompute); DeepSpeed has none.
ENGINE_SELECTIVE = {"torchtitan": "op-level", "torchtitan-toml": "op-level", "megatron": "attention-core"}


_EXPORTERS = {"torchtitan": export_torchtitan, "torchtitan-toml": export_torchtitan_toml,
              "megatron": export_megatron, "deepspeed": export_deepspeed}


def export_strategy(target: str, strategy: Strategy, model: ModelSpec, training: TrainingSpec,
                    runtime: RuntimeSpec | None = None, cluster: ClusterSpec | None = None) -> Exported:
    """The target's configuration for `strategy`, with what it cannot express as warnings;
    the text is read back and any strategy it describes other than the plan's is one more.
    `runtime`: the profile the plan was priced under (its selective recompute policy);
    with `cluster` too, the peak memory the engine's own settings give is checked. A plan
    that no setting of the target runs (DeepSpeed with cp > 1 or FP8) raises SpecError."""
    if target not in _EXPORTERS:
        raise SpecError("--to", f"unknown target {target!r} (known: {', '.join(TARGETS)})")
    exported = _EXPORTERS[target](strategy, model, training, runtime)
    dispatch = runtime.moe_dispatch if runtime is not None and model.is_moe and strategy.ep > 1 else "all-to-all"
    exported = Exported(exported.text, exported.warnings + _group_warnings(target, strategy)
                        + _selective_warnings(target, strategy, runtime) + _dispatch_warnings(target, dispatch)
                        + _fp8_expert_warnings(target, model, training, runtime), exported.changes)
    try:
        back = importers.read_text(target, exported.text, model, strategy.num_gpus)
    except SpecError as err:
        refused = f"{target} refuses this configuration: {err}"
        return Exported(exported.text, exported.warnings + (refused,), exported.changes + (refused,))
    if runtime is not None and cluster is not None:
        exported = Exported(exported.text, exported.warnings + _memory_warnings(
            target, Problem(model, cluster, training, runtime=runtime), strategy, back.runtime_settings),
            exported.changes)
    changes = strategy_changes(strategy, back.strategy)
    if back.states_fp8 and back.fp8 != training.fp8:
        changes.append(f"fp8 {training.fp8 or 'none'}→{back.fp8 or 'none'}")
    if changes:
        changed = f"{target} will run this configuration with {', '.join(changes)} (plan → exported)"
        return Exported(exported.text, exported.warnings + (changed,), exported.changes + (changed,))
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


# Where an engine the export does not tell chooses DeepEP (RuntimeSpec.moe_dispatch).
DEEPEP_SETTING = {
    "torchtitan": ("the model config's token dispatcher, DeepEPTokenDispatcher (torchtitan 0.3.0 "
                   "models/common/token_dispatcher.py)"),
}


def _dispatch_warnings(target: str, dispatch: str) -> tuple[str, ...]:
    """A plan priced with DeepEP's node-deduplicated dispatch, exported where the text does not say it."""
    if dispatch != "deepep" or target in ("megatron", "torchtitan-toml"):
        return ()
    where = DEEPEP_SETTING.get(target)
    if where is None:
        return (f"{target} has no DeepEP dispatch: its all-to-all sends a copy of each token per routed expert, "
                "more network traffic than the plan priced (runtime moe_dispatch deepep)",)
    return (f"the plan prices DeepEP's dispatch (runtime moe_dispatch deepep), which the export does not write: "
            f"set {where}",)


def _fp8_expert_warnings(target: str, model: ModelSpec, training: TrainingSpec,
                         runtime: RuntimeSpec | None) -> tuple[str, ...]:
    """An FP8 MoE plan whose experts' precision differs from what the engine runs:
    Megatron-LM converts them under --fp8-format (Transformer Engine's grouped linear
    layers); torchtitan's exports name its linear FP8 converter only."""
    if not (model.is_moe and training.fp8):
        return ()
    priced = runtime is not None and runtime.fp8_experts
    if target == "megatron" and not priced:
        return ("Megatron runs the experts' GEMMs (routed and shared) in FP8 too (Transformer Engine's grouped linear "
                "layers); the plan priced them in bf16: plan with --runtime megatron (or --runtime-set "
                "fp8_experts=true) to price what it runs",)
    if target.startswith("torchtitan") and priced:
        return ("the plan prices the experts' GEMMs in FP8, which the export does not convert: add torchtitan's "
                "grouped-GEMM converter (quantize.grouped_mm.float8, fqns experts)",)
    return ()


def _memory_warnings(target: str, problem: Problem, strategy: Strategy, settings) -> tuple[str, ...]:
    """The plan's peak memory re-priced under the settings the engine runs it with (its
    importer's runtime settings for the exported text: torchtitan's F.cross_entropy over
    the upcast logits, its FSDP2 wrapping), where that is higher than the plan's."""
    engine = replace(problem.runtime, **dict(settings))
    if engine == problem.runtime:
        return ()
    planned = estimate(problem, strategy).peak_memory_bytes
    theirs = estimate(replace(problem, runtime=engine), strategy).peak_memory_bytes
    if theirs <= planned * 1.01:
        return ()
    differs = ", ".join(f"{k} {_setting(getattr(engine, k))}" for k, _ in settings
                        if getattr(engine, k) != getattr(problem.runtime, k))
    device = problem.cluster.gpu.memory_bytes
    verdict = (f"more than the device's {device / GIB:.1f} GiB: it runs out of memory there; plan with a runtime "
               f"profile that says {differs} (--runtime FILE)") if theirs > device else \
        f"the device has {device / GIB:.1f} GiB"
    return (f"{target} runs this plan with {differs} (the plan's runtime {problem.runtime.name} does not): peak "
            f"memory {theirs / GIB:.1f} GiB per rank against the plan's {planned / GIB:.1f} GiB; {verdict}",)


def _setting(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


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
                f"r x {s.dp_cp * s.tp} onwards are on pipeline rank r's group",)
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
    cluster = cluster_of(doc)
    return export_strategy(target, strategy_of(doc), model_of(doc), training_of(doc), runtime_of(doc),
                           None if isinstance(cluster, MixedClusterSpec) else cluster)
