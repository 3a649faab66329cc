"""Elastic re-planning (`shardwise replan`): the job a plan file describes (its model
spec, training spec and global batch) planned again on another cluster size or another
cluster. This module owns rebuilding the plan's problem from the document, the choice of
the nearest global batch when the plan's own cannot be kept, and the notes that say what
was kept and what changed. The search and the document are `plan`'s own, so a replan is
byte for byte the plan `shardwise plan` makes for the same model, cluster, size and batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from costmodel.problem import Problem
from costmodel.specs import ClusterSpec, MixedClusterSpec
from costmodel.specs.loading import (
    SpecError,
    as_int,
    builtin_names,
    configs_dir,
    load_cluster,
    make_training,
)
from costmodel.specs.training import precision_name
from costmodel.strategy import Strategy
from costmodel.units import GIB
from planner.plan_file import (
    cluster_of,
    is_traced,
    model_of,
    plan_document,
    profile_of,
    runtime_of,
    strategy_of,
)
from planner.rules import Rules, load_rules, parse_fix
from planner.search import Infeasible, SearchResult, check_fix, search
from planner.search.space import divisors, enumerate_space

# Other global batches tried, nearest first, before giving up: each costs one search.
MAX_BATCH_TRIES = 16

# make_training names CLI flags; a replan's training spec comes from the plan file.
_TRAINING_FIELDS = {"--global-batch": "plan.training.global_batch", "--seq": "plan.training.seq_len",
                    "--precision": "plan.training.precision", "--optimizer": "plan.training.optimizer"}


class NoPlan(Infeasible):
    """Nothing plans on the new size, at the plan's batch or the nearest ones tried.
    `problem` and `rules` are those of the plan's own batch, for suggest_relaxation."""

    def __init__(self, reason: str, problem: Problem, rules: Rules):
        super().__init__(reason)
        self.problem = problem
        self.rules = rules


def resized(cluster: ClusterSpec, nodes: Any = None, gpus: Any = None) -> ClusterSpec:
    """The cluster at another size, read as load_cluster reads --nodes and --gpus (fewer
    GPUs than a node makes one partial node)."""
    if isinstance(cluster, MixedClusterSpec) and (nodes is not None or gpus is not None):
        raise SpecError("--gpus" if gpus is not None else "--nodes",
                        f"{cluster.name} is a mixed cluster: its size is its groups' num_nodes "
                        "(give --cluster with a resized cluster file)")
    if nodes is not None and gpus is not None:
        raise SpecError("--gpus", "give --nodes or --gpus, not both")
    if nodes is not None:
        return replace(cluster, num_nodes=as_int(nodes, "--nodes"))
    if gpus is None:
        return cluster
    count = as_int(gpus, "--gpus")
    per_node = cluster.gpus_per_node
    if count < per_node:
        return replace(cluster, gpus_per_node=count, num_nodes=1)
    if count % per_node:
        raise SpecError("--gpus", f"{count} is not a whole number of {per_node}-GPU nodes")
    return replace(cluster, num_nodes=count // per_node)


def _rules_of(doc: dict, rules: str | None, notes: list[str]) -> Rules:
    if rules is not None:
        return load_rules(rules)
    name = doc.get("rules")
    if name in builtin_names("rules"):
        # The built-in's own file: a same-named file in the working directory must not shadow it.
        return load_rules(configs_dir("rules") / f"{name}.yaml")
    notes.append(f"the plan's rules {name!r} are not a built-in set: planned under the default rules (give --rules)")
    return load_rules(None)


def _problem_at(problem: Problem, global_batch: int) -> Problem:
    return replace(problem, training=replace(problem.training, global_batch=global_batch))


def allowed_dps(problem: Problem, rules: Rules) -> list[int]:
    """The dp degrees the size, the model and the rules allow whatever the batch: the
    space at a batch every dp and micro-batch size divides."""
    every = math.lcm(*divisors(problem.cluster.num_gpus), *range(1, rules.micro_batch_max + 1))
    space, _ = enumerate_space(_problem_at(problem, every), rules)
    return sorted({s.dp for s in space})


def nearest_batches(global_batch: int, dps: list[int], rules: Rules) -> list[int]:
    """Other global batches to try, nearest first (ties: the larger first): the multiples
    of each allowed dp (times a pinned micro-batch size) just below and above."""
    steps = sorted({dp * rules.pinned.get("mbs", 1) for dp in dps})
    batches = set()
    for step in steps:
        below, above = (global_batch - 1) // step * step, (global_batch // step + 1) * step
        batches.update(b for b in (below, above) if b >= 1)
    return sorted(batches, key=lambda b: (abs(b - global_batch), -b))[:MAX_BATCH_TRIES]


def _search_at(problem: Problem, rules: Rules, top: int, progress=None) -> SearchResult | None:
    try:
        check_fix(problem, rules.pinned)
        return search(problem, rules, top=top, progress=progress)
    except (Infeasible, SpecError):   # a pin that this batch does not divide plans nothing either
        return None


def _nearest_plan(problem: Problem, rules: Rules, top: int, reason: str,
                  progress=None) -> tuple[SearchResult, Problem, str]:
    """The plan at the nearest other batch that has one, its problem, and why the
    plan's own batch has none; raises NoPlan when none of those tried plans."""
    batch, mbs = problem.training.global_batch, rules.pinned.get("mbs", 1)
    dps = allowed_dps(problem, rules)
    if dps and not any(batch % (dp * mbs) == 0 for dp in dps):
        times = f" times the pinned mbs {mbs}" if "mbs" in rules.pinned else ""
        reason = f"no dp the size and rules allow ({', '.join(map(str, dps))}){times} divides it"
    for other in nearest_batches(batch, dps, rules):
        candidate = _problem_at(problem, other)
        result = _search_at(candidate, rules, top, progress)
        if result is not None:
            return result, candidate, reason
    raise NoPlan(f"global batch {batch} on {problem.cluster.num_gpus} GPUs: {reason}; none of the nearest "
                 f"batches tried plans either", problem, rules)


def _sized(cluster: ClusterSpec | MixedClusterSpec) -> str:
    if isinstance(cluster, MixedClusterSpec):
        return f"{cluster.num_gpus} GPUs ({' + '.join(_sized(g) for g in cluster.groups)})"
    nodes = f"{cluster.num_nodes} node{'s' if cluster.num_nodes != 1 else ''}"
    return f"{cluster.num_gpus} GPUs ({nodes} of {cluster.gpus_per_node} {cluster.gpu.name})"


def strategy_changes(old: Strategy, new: Strategy) -> str:
    """`dp 8→4, pp 2→4; tp 8, mbs 1, ... unchanged` for the notes."""
    knobs = [("dp", old.dp, new.dp), ("tp", old.tp, new.tp), ("pp", old.pp, new.pp), ("vpp", old.vpp, new.vpp),
             ("ep", old.ep, new.ep), ("mbs", old.micro_batch_size, new.micro_batch_size),
             ("micro-batches", old.num_microbatches, new.num_microbatches),
             ("schedule", old.schedule, new.schedule), ("zero", old.zero_stage, new.zero_stage),
             ("recompute", old.recompute, new.recompute),
             ("sp", "on" if old.sequence_parallel else "off", "on" if new.sequence_parallel else "off")]
    if old.etp is not None or new.etp is not None:
        knobs.insert(5, ("etp", old.expert_tp, new.expert_tp))
    if old.cp > 1 or new.cp > 1:
        knobs.insert(3, ("cp", old.cp, new.cp))
    changed = [f"{k} {a}→{b}" for k, a, b in knobs if a != b]
    kept = [f"{k} {a}" for k, a, b in knobs if a == b]
    return "strategy: " + (", ".join(changed) or "unchanged") + (f"; {', '.join(kept)} unchanged" if changed and kept else "")


def replan(doc: dict, *, gpus: Any = None, nodes: Any = None, cluster: str | None = None, rules: str | None = None,
           fix: dict | str | None = None, top: int = 3,
           progress: Callable[[int, int], None] | None = None) -> tuple[dict, list[str]]:
    """The plan document of `doc`'s job on the new size, and the notes saying what was
    kept and what changed. `cluster` (a name or file) replaces the plan's cluster, sized
    by `nodes` or `gpus` or else its own file; without it the plan's cluster is resized.
    `progress(done, total)` is told each search's progress (search's own callback).
    Raises SpecError naming the bad field, NoPlan when no batch tried plans."""
    if is_traced(doc):
        raise SpecError("plan.model", "a traced module's plan cannot be replanned from the file: "
                                      "call planner.api.plan_model with the module on the new size")
    if gpus is None and nodes is None and cluster is None:
        raise SpecError("--gpus", "give the new size (--gpus or --nodes) or a new --cluster")
    model, old = model_of(doc), strategy_of(doc)
    old_cluster = cluster_of(doc)
    notes: list[str] = []
    measured = profile_of(doc)
    if cluster is not None:
        new_cluster = load_cluster(cluster, nodes=nodes, gpus=gpus)
        if measured is not None:
            notes.append("the plan's measured layer times are of its own cluster: the new one is priced analytically")
            measured = None
    else:
        new_cluster = resized(old_cluster, nodes=nodes, gpus=gpus)
    t = doc["training"]
    try:
        training = make_training(model, new_cluster, t["global_batch"], t["seq_len"],
                                 precision_name(t["precision"], t.get("fp8")), t["optimizer"], t["flash_attention"])
    except SpecError as err:
        raise SpecError(_TRAINING_FIELDS.get(err.field, err.field), str(err).split(": ", 1)[1]) from None
    except (KeyError, TypeError) as err:
        raise SpecError("plan.training", f"malformed: {err!r}") from None
    rule_set = _rules_of(doc, rules, notes)
    pins = parse_fix(fix)
    rule_set = rule_set.with_fix(pins)
    problem = Problem(model, new_cluster, training, measured, runtime_of(doc))
    check_fix(problem, pins)   # a pin the new size cannot take is bad input, as for `plan`

    batch = training.global_batch
    notes.insert(0, f"{_sized(old_cluster)} → {_sized(new_cluster)}")
    try:
        result, planned = search(problem, rule_set, top=top, progress=progress), problem
        notes.append(f"global batch {batch} kept")
    except Infeasible as err:
        result, planned, reason = _nearest_plan(problem, rule_set, top, err.reason, progress)
        notes.append(f"global batch {batch} cannot be kept on {new_cluster.num_gpus} GPUs: {reason}; "
                     f"{planned.training.global_batch} is the closest that plans")
    new_doc = plan_document(planned, rule_set.name, result)
    notes.append(strategy_changes(old, result.best.strategy))
    was, now = doc["estimate"], new_doc["estimate"]
    notes.append(f"step {was['step_time_s']:.3f} s → {now['step_time_s']:.3f} s, "
                 f"{was['tokens_per_s']:,.0f} → {now['tokens_per_s']:,.0f} tokens/s, "
                 f"peak {was['peak_memory_bytes'] / GIB:.1f} → {now['peak_memory_bytes'] / GIB:.1f} GiB")
    return new_doc, notes
