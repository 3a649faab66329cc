"""The Python door: `plan(...)` does what `shardwise plan` does and returns the plan
document (the same dict the plan file holds); `plan_model(module, example_inputs, ...)`
does it for any torch.nn.Module.

    from planner.api import plan
    doc = plan("gpt3-175b", "dgx-a100-80gb", global_batch=1536, nodes=16, fix={"tp": 8})
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from costmodel.measured import load_measured_times
from costmodel.problem import Problem, TracedProblem, traced_model
from costmodel.specs import MixedClusterSpec, ModelSpec, RuntimeSpec
from costmodel.specs.loading import (
    SpecError,
    as_float,
    load_cluster,
    load_model,
    load_runtime,
    make_training,
    model_from_dict,
    parse_overrides,
    with_runtime_settings,
)
from costmodel.terms.counts import total_parameters
from planner.plan_file import plan_document
from planner.rules import BUDGETS, Rules, load_rules, parse_fix, parse_objective
from planner.search import check_fix, search


def resolve_model(source: str, overrides: dict | None = None) -> ModelSpec:
    """The one model resolver of every command (`--model`): what load_model reads (a
    built-in, a spec, a config.json, a plan file's model block), or `hf:PATH`: that
    config, also built by transformers on the meta device and refused where it differs
    from the spec."""
    text = str(source)
    if not text.startswith("hf:"):
        return load_model(source, overrides)
    from costmodel.specs.hf import check_spec  # torch and transformers: only for hf:

    spec = load_model(text[3:], overrides)
    check_spec(text[3:], spec)
    return spec


def make_problem(model: str, cluster: str, global_batch: Any, *, nodes: Any = None, gpus: Any = None,
                 seq_len: Any = None, precision: str = "bf16", optimizer: str = "adamw",
                 flash_attention: bool = True, overrides: dict | None = None, fix: dict | None = None,
                 profile: str | Path | None = None, runtime: str | Path | RuntimeSpec | None = None,
                 compile: bool | None = None, runtime_settings: str | dict | None = None) -> Problem:
    """Load and validate the specs; raises SpecError naming the bad field. `hf:PATH`
    reads a Hugging Face config.json (or its folder) and checks it against the model
    transformers builds from it on the meta device. `profile` is a `shardwise profile
    --model` JSON whose measured layer times the cost model uses (costmodel.measured); one
    of another model, sequence length, precision or attention kernel is refused. `runtime`:
    the engine's runtime profile, a built-in name (configs/runtimes/) or a file; None:
    pytorch-native. `compile`: torch.compile the blocks (the runtime's torch_compile),
    None: as the runtime profile says. `runtime_settings`: engine settings over the
    profile's ("fsdp_prefetch=2,ddp_bucket_mb=100" or a mapping; SETTING_FIELDS of
    costmodel.specs.runtime)."""
    model_spec = resolve_model(model, overrides)
    cluster_spec = load_cluster(cluster, nodes=nodes, gpus=gpus)
    runtime = runtime if isinstance(runtime, RuntimeSpec) else load_runtime(runtime)
    if compile is not None:
        runtime = replace(runtime, torch_compile=compile)
    if runtime_settings:
        settings = (parse_overrides(runtime_settings, "--runtime-set") if isinstance(runtime_settings, str)
                    else dict(runtime_settings))
        runtime = with_runtime_settings(runtime, settings)
    # The engine decides how a 16-bit run holds its weights, and so what memory counts.
    training = make_training(model_spec, cluster_spec, global_batch, seq_len, precision, optimizer, flash_attention,
                             runtime.mixed_precision)
    measured = load_measured_times(profile, model_spec, training) if profile is not None else None
    problem = Problem(model_spec, cluster_spec, training, measured, runtime)
    check_fix(problem, fix or {})
    return problem


def make_rules(rules: str | Path | None = None, fix: dict | None = None, *, objective: Any = None,
               budgets: dict[str, Any] | None = None, memory_margin: Any = None) -> Rules:
    """The rule set `shardwise plan` searches under: `rules` (a built-in name or a file)
    with the `fix` pins (parsed, as parse_fix returns them) and, over the file's own, the
    `objective`, the `budgets` (rules field -> value: max_cost_per_step_usd,
    power_cap_w, energy_budget_j; None values are not given) and the `memory_margin`
    (None: the file's, else the runtime profile's memory band). A bad value raises
    SpecError naming its command-line option."""
    rule_set = load_rules(rules).with_fix(fix or {})
    given = {key: as_float(value, BUDGETS[key]) for key, value in (budgets or {}).items() if value is not None}
    if objective is not None:
        given["objective"] = parse_objective(objective, "--objective")
    if memory_margin is not None:
        given["memory_margin"] = as_float(memory_margin, "--memory-margin", minimum=0.0, exclusive=False)
    return replace(rule_set, **given)


def plan(model: str, cluster: str, global_batch: Any, *, nodes: Any = None, gpus: Any = None,
         seq_len: Any = None, precision: str = "bf16", optimizer: str = "adamw", flash_attention: bool = True,
         rules: str | None = None, fix: dict | str | None = None, overrides: dict | None = None,
         top: int = 3, profile: str | Path | None = None, runtime: str | Path | None = None,
         compile: bool | None = None, runtime_settings: str | dict | None = None) -> dict:
    """Search and return the plan document; raises SpecError or search.Infeasible.
    `profile`: measured layer times to plan with; `runtime`, `compile`,
    `runtime_settings`: the engine's runtime profile, whether the blocks are compiled and
    its other settings (see make_problem)."""
    pins = parse_fix(fix)
    problem = make_problem(model, cluster, global_batch, nodes=nodes, gpus=gpus, seq_len=seq_len,
                           precision=precision, optimizer=optimizer, flash_attention=flash_attention,
                           overrides=overrides, fix=pins, profile=profile, runtime=runtime, compile=compile,
                           runtime_settings=runtime_settings)
    rule_set = load_rules(rules).with_fix(pins)
    return plan_document(problem, rule_set.name, search(problem, rule_set, top=top))


def plan_model(module, example_inputs: tuple, *, cluster: str, global_batch: Any, nodes: Any = None,
               gpus: Any = None, precision: str = "bf16", optimizer: str = "adamw", flash_attention: bool = True,
               rules: str | None = None, fix: dict | str | None = None, top: int = 3,
               loss_fn=None, example_kwargs: dict | None = None) -> dict:
    """Plan any `torch.nn.Module` from one example micro-batch (`example_inputs`, batch
    first; meta tensors and a module built under `torch.device("meta")` need no
    memory) and return the same plan document as `plan`.

    A Shardwise model (it carries its `spec`) or a Hugging Face causal LM whose config
    the specs read, with the parameter count the spec predicts, is planned by the
    transformer cost model, exactly as `shardwise plan` plans it (tokens per sequence:
    the inputs' second dimension). Any other module is traced (`costmodel.trace`) and
    planned over dp, pp, ZeRO, micro-batching and recompute (`planner.search.traced`),
    stages cut along its execution order so skip connections and encoder-decoder
    links plan as well as chains. `loss_fn(output)` and `example_kwargs` go to the trace.
    """
    pins = parse_fix(fix)
    rule_set = load_rules(rules).with_fix(pins)
    first = example_inputs[0]
    spec = transformer_spec(module)
    if spec is not None:
        return plan_spec(spec, cluster, global_batch, first.shape[1] if first.dim() >= 2 else None, nodes=nodes,
                         gpus=gpus, precision=precision, optimizer=optimizer, flash_attention=flash_attention,
                         rules=rules, fix=pins, top=top)
    problem = traced_problem(module, example_inputs, cluster, global_batch, nodes=nodes, gpus=gpus,
                             precision=precision, optimizer=optimizer, loss_fn=loss_fn, example_kwargs=example_kwargs)
    check_fix(problem, pins)
    return plan_document(problem, rule_set.name, search(problem, rule_set, top=top))


def plan_spec(spec: ModelSpec, cluster: str, global_batch: Any, seq_len: Any = None, *, nodes: Any = None,
              gpus: Any = None, precision: str = "bf16", optimizer: str = "adamw", flash_attention: bool = True,
              rules: str | None = None, fix: dict | str | None = None, top: int = 3,
              runtime: RuntimeSpec | None = None) -> dict:
    """The plan document of a model spec (what `plan` does once the spec is loaded);
    `runtime`: the engine's profile (None: the built-in default)."""
    pins = parse_fix(fix)
    cluster_spec = load_cluster(cluster, nodes=nodes, gpus=gpus)
    runtime = runtime or load_runtime()
    problem = Problem(spec, cluster_spec, make_training(spec, cluster_spec, global_batch, seq_len, precision,
                                                       optimizer, flash_attention, runtime.mixed_precision),
                      runtime=runtime)
    check_fix(problem, pins)
    rule_set = load_rules(rules).with_fix(pins)
    return plan_document(problem, rule_set.name, search(problem, rule_set, top=top))


def transformer_spec(module, exact: bool = True) -> ModelSpec | None:
    """The ModelSpec a module is an instance of, or None: a Shardwise model's own, or
    the one a Hugging Face config reads as, when its parameter count agrees (or, not
    `exact`, whatever it counts: a family the specs approximate, such as Qwen2 with its
    q/k/v biases)."""
    spec = getattr(module, "spec", None)
    if isinstance(spec, ModelSpec):
        return spec
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    try:
        spec = model_from_dict(config.to_dict(), getattr(config, "name_or_path", "") or config.model_type)
    except SpecError:
        return None
    agrees = sum(p.numel() for p in module.parameters()) == total_parameters(spec)
    return spec if agrees or not exact else None


def traced_problem(module, example_inputs: tuple, cluster: str, global_batch: Any, *, nodes: Any = None,
                   gpus: Any = None, precision: str = "bf16", optimizer: str = "adamw", loss_fn=None,
                   example_kwargs: dict | None = None) -> TracedProblem:
    """Trace `module` on its example micro-batch into a TracedProblem. Token inputs
    (integer, batch x sequence) count their sequence as tokens per sample."""
    from costmodel.trace import trace_module  # torch: only for a traced module

    first = example_inputs[0]
    batch = int(first.shape[0]) if first.dim() else 1
    tokens = int(first.shape[1]) if first.dim() >= 2 and not first.is_floating_point() else 1
    graph = trace_module(module, example_inputs, loss_fn=loss_fn, example_kwargs=example_kwargs)
    if not graph.graph["order"]:
        raise SpecError("module", f"{type(module).__name__} has no child modules to place on stages")
    value_bytes = first.element_size() if first.is_floating_point() else next(
        (p.element_size() for p in module.parameters() if p.is_floating_point()), 4)
    model = traced_model(graph, batch, tokens_per_sample=tokens, value_bytes=value_bytes)
    cluster_spec = load_cluster(cluster, nodes=nodes, gpus=gpus)
    if isinstance(cluster_spec, MixedClusterSpec):
        raise SpecError("cluster", f"{cluster_spec.name} is a mixed cluster: a traced module plans on one GPU "
                                   "type (plan a Shardwise or Hugging Face transformer, or one group's cluster)")
    return TracedProblem(model, cluster_spec, make_training(None, cluster_spec, global_batch, tokens, precision,
                                                           optimizer))
