"""The plan file: a versioned JSON document holding the model spec and its fingerprint,
the cluster, the training spec, the chosen strategy with its stages, the estimate, the
alternatives and the search statistics. Written with sorted keys and rounded floats so
the same inputs give the same bytes; read back with `json` only (never pickle) and
validated field by field.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from costmodel.estimate import Estimate
from costmodel.estimate.band import band
from costmodel.estimate.energy import cost_energy
from costmodel.measured import LayerPoint, MeasuredTimes
from costmodel.problem import NodeCost, Problem, TracedModel, TracedProblem
from costmodel.specs import (
    ClusterSpec,
    LinkSpec,
    MixedClusterSpec,
    ModelSpec,
    RuntimeSpec,
    TrainingSpec,
)
from costmodel.specs.loading import (
    SpecError,
    as_float,
    as_int,
    gpu_from_dict,
    link_from_dict,
    load_runtime,
    model_from_dict,
    read_json_object,
    runtime_from_dict,
)
from costmodel.specs.training import (
    FP8_RECIPES,
    MIXED_PRECISION,
    OPTIMIZERS,
    PRECISIONS,
)
from costmodel.strategy import (
    RECOMPUTE_MODES,
    SCHEDULES,
    Stage,
    Strategy,
    context_parallel_error,
    expert_layout_error,
    layout_error,
)
from costmodel.terms.counts import active_parameters, total_parameters
from planner.outputs import write_atomic
from planner.search import Candidate, SearchResult

SCHEMA_VERSION = 1
FLOAT_DIGITS = 6   # significant digits kept: far below the cost model's accuracy


def fingerprint(model: ModelSpec | TracedModel) -> str:
    """sha256 of the model's canonical JSON (a spec, or a traced module's graph): the
    executor refuses other models."""
    # A spec leaves out the architecture fields at its family's values, so plans
    # written before those fields existed keep their fingerprint.
    data = model.canonical_dict() if isinstance(model, ModelSpec) else asdict(model)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.{FLOAT_DIGITS}g}")
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_round(v) for v in value]
    return value


# Strategy fields a plan carries only when set (mixed clusters), so other plans keep their bytes.
_MIXED_STRATEGY_FIELDS = ("stage_groups", "replica_groups", "replica_microbatches")


def strategy_dict(strategy: Strategy) -> dict:
    # cp is written only above 1 and etp only when set, so plans without context
    # parallelism or whole experts under tp keep their bytes.
    out = {f.name: getattr(strategy, f.name) for f in fields(strategy)
           if f.name != "stages" and not (f.name in _MIXED_STRATEGY_FIELDS and not getattr(strategy, f.name))
           and not (f.name == "cp" and strategy.cp == 1) and not (f.name == "etp" and strategy.etp is None)}
    out["stages"] = [asdict(s) | {"ranks": list(strategy.ranks(s.pp_rank))} for s in strategy.stages]
    return out


def candidate_dict(candidate: Candidate, cluster: ClusterSpec | None = None, runtime: RuntimeSpec | None = None) -> dict:
    """A candidate's strategy and estimate; given a runtime, the estimate's uncertainty
    "band" (costmodel.estimate.band); given a cluster with a price or power figures,
    also its "cost_energy" (costmodel.estimate.energy), which plans of unpriced
    clusters never carry."""
    estimate = asdict(candidate.estimate)
    if not estimate["replica_time_s"]:
        del estimate["replica_time_s"]   # set for replica groups only; other plans keep their bytes
    if not estimate["time"]["cp_comm_s"]:
        del estimate["time"]["cp_comm_s"]   # set under context parallelism only, likewise
    out = {"strategy": strategy_dict(candidate.strategy), "estimate": estimate,
           "partition_gap": candidate.gap}
    if runtime is not None:
        out["band"] = asdict(band(candidate.estimate, runtime))
    figures = cost_energy(cluster, candidate.strategy, candidate.estimate).as_dict() if cluster else {}
    if figures:
        out["cost_energy"] = figures
    return out


# Optional cluster fields a plan carries only when set, so plans of clusters without
# them keep their bytes.
_OPTIONAL_GPU_FIELDS = ("busy_power_w", "idle_power_w", "host_overheads")
_OPTIONAL_CLUSTER_FIELDS = ("gpu_hour_price_usd", "nvlink_domain_gpus")


def cluster_dict(cluster: ClusterSpec | MixedClusterSpec) -> dict:
    if isinstance(cluster, MixedClusterSpec):
        return {"name": cluster.name, "groups": [cluster_dict(g) for g in cluster.groups],
                "inter_group": asdict(cluster.inter_group)}
    out = asdict(cluster)
    for key in _OPTIONAL_CLUSTER_FIELDS:
        if out[key] is None:
            del out[key]
    for key in _OPTIONAL_GPU_FIELDS:
        if out["gpu"][key] is None:
            del out["gpu"][key]
    return out


def training_dict(training: TrainingSpec) -> dict:
    """The training block; `fp8` only when set, so plans without FP8 keep their bytes."""
    out = asdict(training)
    if out["fp8"] is None:
        del out["fp8"]
    return out


def parameter_counts(problem) -> dict:
    """The model's total parameters and those one token uses (costmodel.terms.counts;
    a traced module: the parameters of its layers and root, all of them active)."""
    if isinstance(problem, Problem):
        return {"total_params": total_parameters(problem.model), "active_params": active_parameters(problem.model)}
    total = problem.model.parameters
    return {"total_params": total, "active_params": total}


def plan_document(problem, rules_name: str, result: SearchResult) -> dict:
    """The plan as a JSON-ready dict (no wall-clock seconds: they would break determinism)."""
    stats = asdict(result.stats)
    stats.pop("seconds")
    runtime = problem.runtime if isinstance(problem, Problem) else None
    doc = {
        "schema_version": SCHEMA_VERSION,
        "model": asdict(problem.model),
        "model_fingerprint": fingerprint(problem.model),
        **parameter_counts(problem),
        "cluster": cluster_dict(problem.cluster),
        "training": training_dict(problem.training),
        **({"runtime": runtime_dict(problem.runtime)} if isinstance(problem, Problem) else {}),
        "rules": rules_name,
        **candidate_dict(result.best, problem.cluster, runtime),
        "alternatives": [candidate_dict(c, problem.cluster, runtime) for c in result.alternatives],
        "search": stats,
    }
    if result.pareto:
        doc["pareto"] = [candidate_dict(c, problem.cluster, runtime) for c in result.pareto]
    if getattr(problem, "measured_times", None) is not None:
        # The measured times the estimate used, so the plan says what priced it (the
        # file's path is left out: the same measurements give the same plan).
        doc["profile"] = {k: v for k, v in asdict(problem.measured_times).items() if k != "source"}
    return _round(doc)


def runtime_dict(runtime: RuntimeSpec) -> dict:
    """The runtime profile a plan was priced under, whole (a reader needs no configs/
    to price it again), with the measurements each coefficient was fitted on."""
    return asdict(runtime)


def runtime_of(doc: dict) -> RuntimeSpec:
    """The runtime profile a plan document holds; plans written before runtime profiles
    (no `runtime`) were priced as PyTorch-native and load as the built-in pytorch-native."""
    if "runtime" not in doc:
        return load_runtime()
    data = doc["runtime"]
    if not isinstance(data, dict):
        raise SpecError("plan.runtime", "expected a mapping")
    return runtime_from_dict(data, str(data.get("name", "runtime")), "plan.runtime")


def dumps(doc: dict) -> str:
    return json.dumps(doc, sort_keys=True, indent=2) + "\n"


def write_plan(doc: dict, path: str | Path, field: str = "-o") -> None:
    """Write aside, then rename: a crash never leaves half a plan file; SpecError naming
    `field` when it cannot be written."""
    write_atomic(path, dumps(doc), field)


_STRATEGY_INTS = ("dp", "tp", "pp", "micro_batch_size", "num_microbatches", "vpp", "ep", "zero_stage")


def read_plan(path: str | Path) -> dict:
    """Load a plan file and check it (`check_plan`); raises SpecError naming the bad field."""
    return check_plan(read_json_object(path, "plan"))


def check_plan(doc: dict) -> dict:
    """The one validation of a plan document, made by every reader (run, explain, replan,
    export, evaluate, auto_parallelize): what one refuses, all refuse, with the same
    message. Raises SpecError naming the bad field; returns the document."""
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise SpecError("plan.schema_version", f"expected {SCHEMA_VERSION}, got {doc.get('schema_version')!r}")
    for key in ("model", "model_fingerprint", "cluster", "training", "strategy", "estimate"):
        if key not in doc:
            raise SpecError(f"plan.{key}", "missing")
        if key != "model_fingerprint" and not isinstance(doc[key], dict):
            raise SpecError(f"plan.{key}", f"expected a mapping, got {type(doc[key]).__name__}")
    _check_training(doc["training"])
    model = model_of(doc)
    if fingerprint(model) != doc["model_fingerprint"]:
        raise SpecError("plan.model_fingerprint", "does not match the model spec in the file")
    training = training_of(doc)
    cluster_of(doc)
    profile_of(doc)
    runtime_of(doc)
    strategy = strategy_of(doc)
    if strategy.replica_microbatches:
        batch, why = (strategy.micro_batch_size * sum(strategy.replica_microbatches),
                      "micro_batch_size x sum(replica_microbatches)")
    else:
        batch, why = (strategy.dp * strategy.micro_batch_size * strategy.num_microbatches,
                      "dp x micro_batch_size x num_microbatches")
    if batch != training.global_batch:
        raise SpecError("plan.strategy", f"{why} does not equal the global batch")
    cluster = cluster_of(doc)
    gpus = cluster.num_gpus
    if not isinstance(cluster, MixedClusterSpec) and strategy.num_gpus != gpus:   # a mixed plan places its groups
        cp = f" x cp {strategy.cp}" if strategy.cp > 1 else ""
        raise SpecError("plan.strategy", f"dp {strategy.dp}{cp} x tp {strategy.tp} x pp {strategy.pp} = "
                                         f"{strategy.num_gpus} ranks, but the plan's cluster has {gpus} GPUs")
    if why := context_parallel_error(strategy.cp, training.seq_len):
        raise SpecError("plan.strategy.cp", why)
    if isinstance(model, ModelSpec) and (model.is_moe or strategy.etp is not None or strategy.ep > 1):
        if not model.is_moe:
            raise SpecError("plan.strategy.ep" if strategy.ep > 1 else "plan.strategy.etp", f"{model.name} has no experts")
        if layout := expert_layout_error(strategy, model.num_local_experts, runtime_of(doc).moe_folding):
            raise SpecError(f"plan.strategy.{layout[0]}", layout[1])
    _check_estimate(doc["estimate"], strategy)
    return doc


def _check_training(data: dict) -> None:
    """The training block's types and choices (TrainingSpec itself does not check them)."""
    for key in ("global_batch", "seq_len"):
        as_int(data.get(key), f"plan.training.{key}")
    for key, choices in (("precision", PRECISIONS), ("optimizer", OPTIMIZERS), ("mixed_precision", MIXED_PRECISION)):
        if key in data and data[key] not in choices:
            raise SpecError(f"plan.training.{key}", f"expected one of {', '.join(choices)}, got {data[key]!r}")
    for key in ("flash_attention",):
        if key in data and not isinstance(data[key], bool):
            raise SpecError(f"plan.training.{key}", f"expected true or false, got {data[key]!r}")
    if data.get("fp8") is not None and (data["fp8"] not in FP8_RECIPES or data.get("precision") != "bf16"):
        raise SpecError("plan.training.fp8", f"expected one of {', '.join(FP8_RECIPES)} with precision bf16, got "
                                             f"{data['fp8']!r} with {data.get('precision')!r}")


def _check_estimate(data: dict, strategy: Strategy) -> None:
    """Every figure the estimate needs is there and is a finite number; the per-rank
    figures have one entry per pipeline rank (and per replica), the ranks they name exist."""
    for f in fields(Estimate):
        if f.name == "replica_time_s" and f.name not in data:
            continue
        if f.name not in data:
            raise SpecError(f"plan.estimate.{f.name}", "missing")
        value = data[f.name]
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            items = [(None, value)]
        for key, item in items:
            if isinstance(item, (dict, list)) or item is None:
                continue   # nested breakdowns and absent figures are read where they are used
            name = f"plan.estimate.{f.name}" + (f".{key}" if key is not None else "")
            if isinstance(item, bool) or not isinstance(item, (int, float)) or item != item or abs(item) == float("inf"):
                raise SpecError(name, f"expected a finite number, got {item!r}")
    lengths = {"rank_time_s": strategy.pp, "rank_memory_bytes": strategy.pp}
    if "replica_time_s" in data:
        lengths["replica_time_s"] = len(strategy.replica_groups)
    for key, length in lengths.items():
        if not isinstance(data[key], list) or len(data[key]) != length:
            what = "replica" if key == "replica_time_s" else "pipeline rank"
            got = f"{len(data[key])}" if isinstance(data[key], list) else repr(data[key])
            raise SpecError(f"plan.estimate.{key}", f"expected one number per {what} ({length}), got {got}")
    for key in ("peak_memory_rank", "bottleneck_rank"):
        if not isinstance(data[key], int) or isinstance(data[key], bool) or data[key] not in range(strategy.pp):
            raise SpecError(f"plan.estimate.{key}", f"expected a pipeline rank, 0 to {strategy.pp - 1}, got {data[key]!r}")


def training_of(doc: dict) -> TrainingSpec:
    """The training run a plan document holds."""
    try:
        return TrainingSpec(**doc["training"])
    except TypeError as err:
        raise SpecError("plan.training", str(err)) from None


def problem_of(doc: dict) -> Problem | TracedProblem:
    """The problem a plan document was made for: its model, cluster, training run,
    measured layer times and runtime profile."""
    if is_traced(doc):
        return TracedProblem(model_of(doc), cluster_of(doc), training_of(doc))
    return Problem(model_of(doc), cluster_of(doc), training_of(doc), profile_of(doc), runtime_of(doc))


def is_traced(doc: dict) -> bool:
    """Whether the plan is of a traced module (`planner.api.plan_model`) rather than a spec."""
    return isinstance(doc.get("model"), dict) and "nodes" in doc["model"]


def model_of(doc: dict) -> ModelSpec | TracedModel:
    """The model a plan document holds."""
    data = doc["model"]
    try:
        if is_traced(doc):
            nodes = tuple(NodeCost(**n) for n in data["nodes"])
            return TracedModel(**{**data, "nodes": nodes, "cut_bytes": tuple(data["cut_bytes"])})
    except (TypeError, KeyError) as err:
        raise SpecError("plan.model", f"malformed: {err}") from None
    try:   # read as a model file is: every field's type and range checked
        return model_from_dict({k: v for k, v in data.items() if k != "name"}, str(data.get("name")))
    except SpecError as err:
        raise SpecError(f"plan.model.{err.field}", str(err).removeprefix(f"{err.field}: ")) from None


def _check_mixed(strategy: Strategy, doc: dict) -> None:
    """The group fields of a mixed plan: one group per pipeline rank or per replica, each
    named in the plan's cluster, and replica shares that add up to the global batch."""
    s = strategy
    if not s.is_mixed:
        return
    if s.cp > 1:
        raise SpecError("plan.strategy.cp", "a plan for a mixed cluster runs cp 1")
    names = {g.get("name") for g in doc["cluster"].get("groups", [])} if isinstance(doc["cluster"], dict) else set()
    if s.stage_groups and s.replica_groups:
        raise SpecError("plan.strategy.replica_groups", "a plan sets stage_groups or replica_groups, not both")
    groups, field, count = ((s.stage_groups, "stage_groups", s.pp) if s.stage_groups
                            else (s.replica_groups, "replica_groups", s.dp))
    if len(groups) != count:
        raise SpecError(f"plan.strategy.{field}", f"expected {count} group names, got {len(groups)}")
    unknown = [g for g in groups if g not in names]
    if unknown:
        raise SpecError(f"plan.strategy.{field}", f"group {unknown[0]!r} is not a group of the plan's cluster")
    if s.replica_groups:
        shares = s.replica_microbatches
        if len(shares) != s.dp or any(not isinstance(m, int) or isinstance(m, bool) or m < 1 for m in shares):
            raise SpecError("plan.strategy.replica_microbatches", f"expected {s.dp} positive integers, got {list(shares)}")
        if s.pp != 1:
            raise SpecError("plan.strategy.replica_groups", "replica groups need pp 1")
        if s.micro_batch_size * sum(shares) != doc["training"].get("global_batch"):
            raise SpecError("plan.strategy.replica_microbatches",
                            f"mbs x sum = {s.micro_batch_size * sum(shares)} is not the global batch")


def strategy_of(doc: dict) -> Strategy:
    """The Strategy a plan document holds."""
    data = doc["strategy"]
    if not isinstance(data, dict):
        raise SpecError("plan.strategy", f"expected a mapping, got {type(data).__name__}")
    for key, choices in (("schedule", SCHEDULES), ("recompute", (*RECOMPUTE_MODES, "mixed"))):
        if data.get(key) not in choices:
            raise SpecError(f"plan.strategy.{key}", f"expected one of {', '.join(choices)}, got {data.get(key)!r}")
    if not isinstance(data.get("sequence_parallel"), bool):
        raise SpecError("plan.strategy.sequence_parallel", f"expected true or false, got {data.get('sequence_parallel')!r}")
    if not isinstance(data.get("stages", []), list) or not all(isinstance(s, dict) for s in data.get("stages", [])):
        raise SpecError("plan.strategy.stages", "expected a list of stage mappings")
    for i, stage in enumerate(data.get("stages", [])):
        for key, value in stage.items():
            if key != "ranks" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise SpecError(f"plan.strategy.stages[{i}].{key}", f"expected a non-negative integer, got {value!r}")
    for key in _STRATEGY_INTS:
        if not isinstance(data.get(key), int) or isinstance(data.get(key), bool) or data[key] < 0:
            raise SpecError(f"plan.strategy.{key}", f"expected a non-negative integer, got {data.get(key)!r}")
    cp = data.get("cp", 1)
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise SpecError("plan.strategy.cp", f"expected a positive integer, got {cp!r}")
    etp = data.get("etp")
    if etp is not None and (etp != 1 or isinstance(etp, bool)):
        raise SpecError("plan.strategy.etp", f"expected 1 (whole experts under tp) or absent (experts split over tp), "
                                             f"got {etp!r}")
    try:
        stages = tuple(Stage(**{k: v for k, v in s.items() if k != "ranks"}) for s in data.get("stages", []))
        strategy = Strategy(**{k: data[k] for k in _STRATEGY_INTS}, cp=cp, etp=etp,
                            schedule=str(data["schedule"]), recompute=str(data["recompute"]),
                            sequence_parallel=bool(data["sequence_parallel"]), stages=stages,
                            **{k: tuple(data[k]) for k in _MIXED_STRATEGY_FIELDS if k in data})
    except (TypeError, KeyError) as err:
        raise SpecError("plan.strategy", f"malformed: {err}") from None
    _check_mixed(strategy, doc)
    if layout := layout_error(strategy):
        raise SpecError(f"plan.strategy.{layout[0]}", layout[1])
    if is_traced(doc):
        if strategy.cp > 1:
            raise SpecError("plan.strategy.cp", "a traced module's plan runs cp 1: its attention is the module's own")
        if sum(s.num_layers for s in stages) != len(doc["model"]["nodes"]):
            raise SpecError("plan.strategy.stages", "nodes of the stages do not add up to the module's nodes")
    elif sum(s.num_layers for s in stages) != doc["model"]["num_hidden_layers"]:
        raise SpecError("plan.strategy.stages", "layers of the stages do not add up to num_hidden_layers")
    return strategy


def _plan_link(data: dict, field: str) -> LinkSpec:
    link = dict(data)
    # asdict writes a collective's figures as a pair; cluster files name them.
    link["collectives"] = {kind: {"bandwidth_bytes_per_s": bw, "latency_s": lat}
                           for kind, (bw, lat) in link.get("collectives", {}).items()}
    return link_from_dict(link, field)



def cluster_of(doc: dict) -> ClusterSpec | MixedClusterSpec:
    """The cluster a plan document holds, validated as a cluster file is."""
    data = doc["cluster"]
    if not isinstance(data, dict):
        raise SpecError("plan.cluster", "expected a mapping")
    if "groups" in data:
        try:
            return MixedClusterSpec(name=str(data["name"]),
                                    groups=tuple(cluster_of({"cluster": g}) for g in data["groups"]),
                                    inter_group=_plan_link(data["inter_group"], "plan.cluster.inter_group"))
        except (KeyError, TypeError) as err:
            raise SpecError("plan.cluster", f"malformed: {err!r}") from None
    try:
        gpu = {k: v for k, v in data["gpu"].items() if v is not None}   # None: the fitted A100 constants
        links = {side: _plan_link(data[side], f"plan.cluster.{side}") for side in ("intra_node", "inter_node")}
        return ClusterSpec(name=str(data["name"]), gpu=gpu_from_dict(gpu, "plan.cluster.gpu"),
                           gpus_per_node=as_int(data["gpus_per_node"], "plan.cluster.gpus_per_node"),
                           num_nodes=as_int(data["num_nodes"], "plan.cluster.num_nodes"),
                           comm_overlap=as_float(data.get("comm_overlap", 1.0), "plan.cluster.comm_overlap",
                                                 exclusive=False),
                           gpu_hour_price_usd=(as_float(data["gpu_hour_price_usd"], "plan.cluster.gpu_hour_price_usd")
                                               if data.get("gpu_hour_price_usd") is not None else None),
                           nvlink_domain_gpus=(as_int(data["nvlink_domain_gpus"], "plan.cluster.nvlink_domain_gpus")
                                               if data.get("nvlink_domain_gpus") is not None else None),
                           **links)
    except SpecError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise SpecError("plan.cluster", f"malformed: {err!r}") from None



def profile_of(doc: dict) -> MeasuredTimes | None:
    """The measured layer times a plan was priced with, or None."""
    data = doc.get("profile")
    if data is None:
        return None
    try:
        points = {kind: tuple(LayerPoint(**p) for p in pts) for kind, pts in data["points"].items()}
        return MeasuredTimes(**{**data, "source": "plan.profile", "points": points})
    except (KeyError, TypeError, AttributeError) as err:
        raise SpecError("plan.profile", f"malformed: {err!r}") from None
