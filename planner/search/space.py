"""The search space: every mesh shape (dp x cp x tp x pp, ep inside dp), micro-batch size,
schedule (with virtual stages for interleaving), ZeRO stage and sequence-parallel
setting that the cluster, the batch and the rules admit. Strategies come out without
stages; `planner.search.partition` places the layers and chooses recomputation.

`check_fix_spec` turns a `--fix` that cannot work on this model, cluster or batch into a
`SpecError` (bad input); exclusions by rules are recorded so an empty space can say
which rule emptied it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from costmodel.problem import Problem, TracedProblem
from costmodel.specs.loading import SpecError
from costmodel.strategy import (
    RECOMPUTE_MODES,
    SCHEDULES,
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    Strategy,
    context_parallel_error,
    schedule_microbatch_error,
    schedule_vpp_error,
    schedule_zero_error,
)
from planner.rules import Rules, format_value

# Interleaving beyond 8 model chunks per rank buys little bubble and costs p2p
# (Narayanan et al. 2021 §2.2.2 evaluate up to 4-6 chunks); keeps the space small.
MAX_VPP = 8


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending; pairs up to sqrt(n), so a billion-GPU request
    answers at once."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass
class Exclusions:
    """Why values were left out, knob by knob (the last reason seen wins). A reason
    about a value the rules permit outranks a rule's refusal: under `--fix tp=2` the
    user wants to hear why tp 2 cannot be, not that tp 4 is not 2."""

    reasons: dict[str, str] = field(default_factory=dict)
    rule_reasons: dict[str, str] = field(default_factory=dict)

    def add(self, knob: str, reason: str) -> None:
        self.reasons[knob] = reason

    def add_rule(self, knob: str, reason: str) -> None:
        self.rule_reasons[knob] = reason

    def summary(self) -> str:
        merged = {**self.rule_reasons, **self.reasons}
        return "; ".join(f"{k}: {v}" for k, v in sorted(merged.items())) or "no strategy to consider"


def admits(rules: Rules, why: Exclusions, knob: str, value) -> bool:
    """Whether the rules permit `value` for `knob`; records the rule when not."""
    if rules.permits(knob, value):
        return True
    why.add_rule(knob, rules.why_not(knob, value))
    return False


def micro_batches(rules: Rules, why: Exclusions, batch: int, dp: int, batch_name: str) -> list[tuple[int, int]]:
    """(micro-batch size, number of micro-batches) of each size the rules admit that
    splits the global batch over `dp` replicas; `batch_name` is how the reasons name it."""
    out = []
    for mbs in range(rules.micro_batch_min, rules.micro_batch_max + 1):
        if batch % (dp * mbs):
            why.add("mbs", f"dp {dp} x mbs {mbs} does not divide {batch_name} {batch}")
            continue
        if admits(rules, why, "mbs", mbs):
            out.append((mbs, batch // (dp * mbs)))
    return out


def recompute_modes(problem: Problem, rules: Rules) -> tuple[str, ...]:
    """Recompute modes the partition may use per layer. Under FlashAttention selective
    recompute saves nothing (there are no stored scores), so it is only kept when pinned."""
    modes = tuple(m for m in RECOMPUTE_MODES if rules.permits("recompute", m))
    if problem.training.flash_attention and len(modes) > 1:
        modes = tuple(m for m in modes if m != "selective")
    return modes


def check_fix_spec(problem: Problem, fix: dict) -> None:
    """Reject pins that contradict the model, the cluster or the batch (exit code 2)."""
    model, n, batch = problem.model, problem.cluster.num_gpus, problem.training.global_batch
    layers = model.num_hidden_layers
    for knob in ("dp", "tp", "pp", "cp"):
        if knob in fix and n % fix[knob]:
            raise SpecError(f"--fix {knob}", f"{fix[knob]} does not divide the {n} GPUs of the cluster")
    product = 1
    for knob in ("dp", "tp", "pp", "cp"):
        product *= fix.get(knob, 1)
    if n % product:
        raise SpecError("--fix", f"dp x cp x tp x pp = {product} does not divide the {n} GPUs of the cluster")
    if all(k in fix for k in ("dp", "tp", "pp")) and product != n:
        raise SpecError("--fix", f"dp x cp x tp x pp = {product}, but the cluster has {n} GPUs")
    if why := context_parallel_error(fix.get("cp", 1), problem.training.seq_len):
        raise SpecError("--fix cp", why)
    folding = problem.runtime.moe_folding
    if fix.get("cp", 1) > 1 and fix.get("ep", 1) > 1 and not folding:
        raise SpecError("--fix cp", f"the {problem.runtime.name} runtime runs context parallelism without expert "
                                    f"parallelism; pin one of them to 1 (--runtime megatron folds ep over cp)")
    if "tp" in fix and model.hidden_size % fix["tp"]:
        raise SpecError("--fix tp", f"{fix['tp']} does not divide hidden_size {model.hidden_size}")
    if "pp" in fix and fix["pp"] > layers:
        raise SpecError("--fix pp", f"{fix['pp']} stages for {layers} layers")
    vpp = fix.get("vpp", 1)
    if vpp * fix.get("pp", 1) > layers:
        raise SpecError("--fix vpp", f"pp x vpp = {vpp * fix.get('pp', 1)} virtual stages for {layers} layers")
    if "schedule" in fix and ("vpp" in fix or "pp" in fix):
        schedule = fix["schedule"]
        # Unpinned, vpp is searched (the V schedules' is 2) and pp is taken as a pipeline.
        pinned_vpp = fix.get("vpp", 2 if schedule in ("interleaved", *V_SCHEDULES) else 1)
        why = schedule_vpp_error(schedule, pinned_vpp, fix.get("pp", 2))
        if why:
            raise SpecError("--fix vpp" if pinned_vpp > 1 and schedule in ("gpipe", "1f1b") else "--fix schedule", why)
    if fix.get("schedule") in V_SCHEDULES and 2 * fix.get("pp", 1) > layers:
        raise SpecError("--fix schedule", f"{fix['schedule']} runs 2 x pp = {2 * fix.get('pp', 1)} virtual stages, "
                                          f"more than the {layers} layers")
    if "mbs" in fix and batch % fix["mbs"]:
        raise SpecError("--fix mbs", f"{fix['mbs']} does not divide --global-batch {batch}")
    if "mbs" in fix and "dp" in fix and batch % (fix["mbs"] * fix["dp"]):
        raise SpecError("--fix", f"dp {fix['dp']} x mbs {fix['mbs']} does not divide --global-batch {batch}")
    if "dp" in fix and batch % fix["dp"]:
        raise SpecError("--fix dp", f"{fix['dp']} does not divide --global-batch {batch}")
    if fix.get("sp") and fix.get("tp") == 1:
        raise SpecError("--fix sp", "sequence parallelism needs tp of 2 or more")
    if fix.get("zero", 0) > 0 and fix.get("dp") == 1 and fix.get("cp") == 1:
        raise SpecError("--fix zero", f"ZeRO stage {fix['zero']} shards over dp x cp, but both are 1")
    if "ep" in fix and fix["ep"] > 1:
        if not model.is_moe:
            raise SpecError("--fix ep", f"{model.name} has no experts")
        if model.num_local_experts % fix["ep"]:
            raise SpecError("--fix ep", f"{fix['ep']} does not divide num_local_experts {model.num_local_experts}")
        if "dp" in fix and fix["dp"] % fix["ep"] and not folding:
            raise SpecError("--fix ep", f"{fix['ep']} does not divide dp {fix['dp']}")
        pool = fix.get("dp", 1) * fix.get("cp", 1) * fix.get("tp", 1) // (fix.get("etp", 1) if "tp" in fix else 1)
        if all(k in fix for k in ("dp", "tp")) and folding and pool % fix["ep"]:
            raise SpecError("--fix ep", f"{fix['ep']} does not divide the {pool} ranks of dp x cp x tp / etp")
    if "etp" in fix:
        if not model.is_moe:
            raise SpecError("--fix etp", f"{model.name} has no experts")
        if fix["etp"] != 1 and fix["etp"] != fix.get("tp", fix["etp"]):
            raise SpecError("--fix etp", f"experts split over tp ({fix['tp']}) or kept whole (1), not {fix['etp']}")
        if fix["etp"] == 1 and fix.get("tp", 1) > 1 and not folding:
            raise SpecError("--fix etp", f"the {problem.runtime.name} runtime has no MoE parallel folding: "
                                         f"it splits experts over tp (--runtime pytorch-native or megatron keeps them whole)")


def _tp_options(problem: Problem, rules: Rules, degrees: list[int], why: Exclusions) -> list[int]:
    model, g = problem.model, problem.cluster.fast_domain_gpus
    out = []
    for tp in degrees:
        if not admits(rules, why, "tp", tp):
            continue
        if model.hidden_size % tp:
            why.add("tp", f"{tp} does not divide hidden_size {model.hidden_size}")
        elif rules.tp_within_node and tp > g:
            why.add("tp", f"tp_within_node: {tp} is more than the {g} GPUs of a node"
                                 + (" (its NVLink domain)" if problem.cluster.nvlink_domain_gpus else ""))
        elif rules.tp_divides_heads and (model.num_attention_heads % tp or model.num_key_value_heads % tp):
            why.add("tp", f"tp_divides_heads: {tp} does not divide {model.num_attention_heads} attention "
                          f"and {model.num_key_value_heads} KV heads")
        elif model.is_moe and tp > 1 and not (problem.runtime.expert_tensor_parallel or problem.runtime.moe_folding):
            why.add("tp", f"the {problem.runtime.name} runtime neither splits experts over tp nor keeps them "
                          f"whole under it (--runtime megatron does both)")
        else:
            out.append(tp)
    return out


def _expert_options(problem: Problem, rules: Rules, dp: int, cp: int, tp: int,
                    why: Exclusions) -> list[tuple[int, int | None]]:
    """(ep, etp) pairs for a stage of dp x cp x tp ranks: experts split over tp (etp
    None) where the runtime does that, or whole (etp 1) where it folds (RuntimeSpec
    .moe_folding); ep over the ranks left, every divisor that divides the experts: under
    folding of dp x cp x tp / etp, else of dp (at cp 1)."""
    model, runtime = problem.model, problem.runtime
    if not model.is_moe:
        return [(1, None)]
    etps: list[int | None] = [None] if tp == 1 or runtime.expert_tensor_parallel else []
    if tp > 1 and runtime.moe_folding:
        etps.append(1)
    out = []
    for etp in etps:
        if not admits(rules, why, "etp", tp if etp is None else etp):
            continue
        if runtime.moe_folding:
            pool = dp * cp * tp // (tp if etp is None else etp)
        elif cp > 1:
            why.add("ep", f"cp {cp}: the {runtime.name} runtime runs context parallelism without expert parallelism")
            pool = 1
        else:
            pool = dp
        out += [(ep, etp) for ep in divisors(pool)
                if model.num_local_experts % ep == 0 and admits(rules, why, "ep", ep)]
    return out


def _schedule_options(problem: Problem, rules: Rules, pp: int, m: int, why: Exclusions) -> list[tuple[str, int]]:
    if pp == 1:
        # No pipeline: the schedule is moot; it carries the first permitted name.
        names = [s for s in ("1f1b", "gpipe") if rules.permits("schedule", s)]
        return [(names[0], 1)] if names and rules.permits("vpp", 1) else []
    layers, runtime = problem.model.num_hidden_layers, problem.runtime
    out = []
    for schedule in SCHEDULES:
        if not admits(rules, why, "schedule", schedule):
            continue
        why_not = schedule_microbatch_error(schedule, pp, m)
        if why_not is None and schedule in ZERO_BUBBLE_SCHEDULES:
            why_not = _zero_bubble_refusal(runtime, schedule)
        if why_not:
            why.add("schedule", why_not)
            continue
        if schedule in ("gpipe", "1f1b"):
            if rules.permits("vpp", 1):
                out.append((schedule, 1))
            continue
        if schedule in V_SCHEDULES:
            if 2 * pp > layers:
                why.add("schedule", f"{schedule} runs 2 x pp = {2 * pp} virtual stages, more than the {layers} layers")
            elif rules.permits("vpp", 2):
                out.append((schedule, 2))
            continue
        first = 1 if schedule == "zb-interleaved" else 2
        for vpp in range(first, min(MAX_VPP, layers // pp) + 1):
            if rules.permits("vpp", vpp):
                out.append((schedule, vpp))
    return out


def _zero_bubble_refusal(runtime, schedule: str) -> str | None:
    """Why the runtime cannot run a zero-bubble schedule (None if it can)."""
    if not runtime.zero_bubble_schedules:
        return f"the {runtime.name} runtime does not run zero-bubble schedules ({schedule})"
    if runtime.torch_compile:
        return f"{schedule} does not run compiled blocks (torch.distributed.pipelining splits their backward)"
    return None


def _cp_options(problem: Problem, rules: Rules, degrees: list[int], why: Exclusions) -> list[int]:
    """Context-parallel degrees: 1, and each degree whose 2 cp load-balanced chunks cut
    the sequence evenly."""
    out = []
    for cp in degrees:
        if not admits(rules, why, "cp", cp):
            continue
        if why_not := context_parallel_error(cp, problem.training.seq_len):
            why.add("cp", why_not)
        else:
            out.append(cp)
    return out


def _zero_sp_options(problem: Problem, rules: Rules, why: Exclusions, wanted: Callable[[int], bool],
                     **fields) -> list[Strategy]:
    """The strategy of `fields` at each ZeRO stage (that `wanted` takes) and sequence-
    parallel setting the rules admit. ZeRO shards over every rank holding the same weights
    (dp x cp); sequence parallelism splits a rank's s / cp tokens evenly over the tp ranks."""
    tp, pp, dp_cp, schedule = fields["tp"], fields["pp"], fields["dp"] * fields["cp"], fields["schedule"]
    local_seq = problem.training.seq_len // fields["cp"]
    out = []
    for zero in (range(4) if dp_cp > 1 else (0,)):
        if not wanted(zero) or not admits(rules, why, "zero", zero):
            continue
        if why_not := schedule_zero_error(schedule, pp, dp_cp, zero):
            why.add("schedule", why_not)
            continue
        sp_options = (False, True) if tp > 1 and local_seq % tp == 0 else (False,)
        if fields.get("etp") == 1:
            sp_options = tuple(sp for sp in sp_options if sp)   # whole experts route sequence shards
        if tp > 1 and local_seq % tp:
            why.add("sp", f"tp {tp} does not divide the {local_seq} tokens of a rank's sequence")
        for sp in sp_options:
            if admits(rules, why, "sp", sp):
                out.append(Strategy(**fields, zero_stage=zero, sequence_parallel=sp))
    return out


def enumerate_space(problem: Problem, rules: Rules, context_parallel: bool = True,
                    cp_wanted: Callable[[int, int, int, int], bool] | None = None) -> tuple[list[Strategy], Exclusions]:
    """All stage-less strategies the rules admit, in a fixed order, and the reasons
    for what was left out; cp 1 only unless `context_parallel`. `cp_wanted(tp, pp,
    zero_stage, mbs)`: whether to offer cp > 1 there (planner.search.uniform asks only
    where memory needs it), and then only those strategies: the caller has the cp 1 ones
    already; None offers them all."""
    model, cluster, training = problem.model, problem.cluster, problem.training
    n, batch, layers = cluster.num_gpus, training.global_batch, model.num_hidden_layers
    why = Exclusions()
    modes = recompute_modes(problem, rules)
    if not modes:
        why.add("recompute", "every recompute mode is excluded")
        return [], why
    default_recompute = modes[0] if len(modes) == 1 else "none"
    out: list[Strategy] = []
    for tp in _tp_options(problem, rules, divisors(n), why):
        degrees = divisors(n // tp) if context_parallel else [1]
        for cp in _cp_options(problem, rules, degrees[1:] if cp_wanted else degrees, why):
            for pp in divisors(n // (tp * cp)):
                if pp > layers:
                    why.add("pp", f"{pp} is more than the {layers} layers")
                    continue
                if not admits(rules, why, "pp", pp):
                    continue
                dp = n // (tp * cp * pp)
                if not admits(rules, why, "dp", dp):
                    continue
                for ep, etp in _expert_options(problem, rules, dp, cp, tp, why):
                    for mbs, m in micro_batches(rules, why, batch, dp, "--global-batch"):
                        def wanted(zero: int, mbs=mbs) -> bool:
                            return cp_wanted is None or cp_wanted(tp, pp, zero, mbs)
                        if not any(wanted(zero) for zero in range(4)):
                            continue
                        for schedule, vpp in _schedule_options(problem, rules, pp, m, why):
                            out += _zero_sp_options(problem, rules, why, wanted, dp=dp, tp=tp, pp=pp, cp=cp,
                                                    micro_batch_size=mbs, num_microbatches=m, vpp=vpp, ep=ep,
                                                    etp=etp, schedule=schedule, recompute=default_recompute)
    return out, why


def describe(strategy: Strategy) -> str:
    """Short label: dp8 tp8 pp2 mbs1 1f1b zero1 sp."""
    parts = [f"dp{strategy.dp}", f"tp{strategy.tp}", f"pp{strategy.pp}"]
    if strategy.cp > 1:
        parts.append(f"cp{strategy.cp}")
    if strategy.vpp > 1:
        parts.append(f"vpp{strategy.vpp}")
    if strategy.ep > 1:
        parts.append(f"ep{strategy.ep}")
    if strategy.etp is not None:
        parts.append(f"etp{strategy.etp}")
    parts += [f"mbs{strategy.micro_batch_size}", strategy.schedule, f"zero{strategy.zero_stage}"]
    parts.append(f"sp={format_value(strategy.sequence_parallel)}")
    if strategy.stage_groups:
        parts.append("stages " + "+".join(f"{name}x{len(list(run))}"
                                          for name, run in itertools.groupby(strategy.stage_groups)))
    if strategy.replica_groups:
        runs = itertools.groupby(zip(strategy.replica_groups, strategy.replica_microbatches))
        parts.append("replicas " + "+".join(f"{name}x{len(list(run))}:{m}" for (name, m), run in runs))
    return " ".join(parts)


def enumerate_traced(problem: TracedProblem, rules: Rules) -> tuple[list[Strategy], Exclusions]:
    n, batch, nodes = problem.cluster.num_gpus, problem.training.global_batch, problem.model.num_nodes
    why = Exclusions()
    out = []
    for pp in divisors(n):
        if pp > nodes:
            why.add("pp", f"{pp} is more than the {nodes} blocks of the module")
            continue
        dp = n // pp
        if not (admits(rules, why, "pp", pp) and admits(rules, why, "dp", dp)):
            continue
        for mbs, m in micro_batches(rules, why, batch, dp, "the global batch"):
            # No pipeline: the schedule is moot; it carries the first permitted name.
            schedules = [s for s in ("1f1b", "gpipe") if rules.permits("schedule", s)][:1] if pp == 1 \
                else ["gpipe", "1f1b"]
            for schedule in schedules:
                if not admits(rules, why, "schedule", schedule):
                    continue
                if pp > 1 and schedule == "1f1b" and m < pp:
                    why.add("schedule", f"1f1b needs at least pp {pp} micro-batches, there are {m}")
                    continue
                for zero in (range(4) if dp > 1 else (0,)):
                    if admits(rules, why, "zero", zero):
                        out.append(Strategy(dp=dp, tp=1, pp=pp, micro_batch_size=mbs, num_microbatches=m,
                                            schedule=schedule, zero_stage=zero))
    return out, why
