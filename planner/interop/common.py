"""What the engine modules share: `Imported` (a configuration read as a strategy) and
`Exported` (a plan written as a configuration), the recompute form both sides speak
(`Recompute`), building stages from an engine's layer counts, and the checks every reader
makes.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from costmodel.specs import ModelSpec
from costmodel.specs.loading import SpecError
from costmodel.strategy import Stage, Strategy, stage_rank, summarize_recompute
from planner.rules import format_value


@dataclass(frozen=True)
class Imported:
    """A configuration read back: the strategy (with stages), what the config says of
    the training run (None where it says nothing) and what was assumed."""

    strategy: Strategy
    global_batch: int | None
    seq_len: int | None
    precision: str | None
    warnings: tuple[str, ...]
    # What the configuration says of the engine's runtime (costmodel.specs.runtime field,
    # value): torch.compile, async TP, its selective-recompute policy.
    runtime_settings: tuple[tuple[str, object], ...] = ()
    # The FP8 recipe of the layers' linear GEMMs (costmodel.specs.training.FP8_RECIPES),
    # None for none; `states_fp8` False where the configuration cannot say FP8 at all
    # (torchtitan 0.3's overrides: its config_registry function builds the model), so
    # the caller's --precision decides.
    fp8: str | None = None
    states_fp8: bool = True



@dataclass(frozen=True)
class Recompute:
    """Recomputation as engines state it: a mode for every layer, or with
    `full_layers` set, the first `full_layers` of each virtual stage fully recomputed
    (Megatron's `--recompute-method block`)."""

    mode: str = "none"                 # none | selective | full
    full_layers: int | None = None     # None: every layer of the mode
    every_nth: int | None = None       # torchtitan 0.2: every n-th layer of a rank fully recomputed



def build_stages(sizes: list[int], pp: int, recompute: Recompute, schedule: str = "1f1b") -> tuple[Stage, ...]:
    """Stages of the given sizes in virtual-stage order, on the ranks the schedule
    places them (costmodel.strategy.stage_rank: i mod pp, the interleaved layout of
    Megatron and torch.distributed.pipelining, or the V of zbv and dualpipev)."""
    stages, first = [], 0
    for i, n in enumerate(sizes):
        full = selective = 0
        if recompute.mode == "full":
            full = n if recompute.full_layers is None else min(n, recompute.full_layers)
        elif recompute.mode == "selective":
            selective = n
        stages.append(Stage(i, stage_rank(i, pp, schedule), first, n, full, selective))
        first += n
    return tuple(stages)



def engine_strategy(dp: int, tp: int, pp: int, mbs: int, microbatches: int, vpp: int, ep: int, schedule: str, zero: int,
              sp: bool, stages: tuple[Stage, ...], cp: int = 1, etp: int | None = None) -> Strategy:
    """`etp`: the engine's expert tensor-parallel degree (None: tp); Strategy.etp holds
    1 only where it differs from tp."""
    if pp == 1:
        schedule = "1f1b"   # no pipeline: the planner names the schedule 1f1b (planner.search.space)
    etp = 1 if etp == 1 and tp > 1 else None
    return Strategy(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=microbatches, vpp=vpp, ep=ep, cp=cp,
                    etp=etp,
                    schedule=schedule, zero_stage=zero, recompute=summarize_recompute(stages),
                    sequence_parallel=sp, stages=stages)



def divide(total: int, part: int, field_name: str, what: str) -> int:
    if part <= 0 or total % part:
        raise SpecError(field_name, f"{what}: {part} does not divide {total}")
    return total // part



def check_model(pairs: list[tuple[str, object, object]], model: ModelSpec) -> None:
    """(field, config value, model value): a config describing another model is refused."""
    for field_name, given, expected in pairs:
        if given is not None and given != expected:
            raise SpecError(field_name, f"{given}, but {model.name} has {expected}")



def read_file(path: str, kind: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as err:
        raise SpecError("--from", f"cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise SpecError("--from", f"{path} is not {kind} text: {err}") from None



def even_sizes(num_layers: int, parts: int) -> list[int]:
    """Even split, earlier parts taking the remainder (costmodel.strategy.even_stages;
    DeepSpeed's partition_method='uniform' balances the same way)."""
    base, extra = divmod(num_layers, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class Exported:
    text: str
    warnings: tuple[str, ...]
    # What the engine would run other than the plan (read back from the text): the
    # warnings among the above that change the plan, not only say something of it.
    changes: tuple[str, ...] = ()



def recompute_form(strategy: Strategy) -> Recompute | None:
    """The plan's recomputation as engines state it, or None when it mixes modes or
    counts in a way no single setting says (the partition program chooses per stage)."""
    stages = strategy.stages
    if all(s.selective_recompute_layers == s.num_layers and not s.full_recompute_layers for s in stages):
        return Recompute("selective")
    if any(s.selective_recompute_layers for s in stages):
        return None
    if all(not s.full_recompute_layers for s in stages):
        return Recompute("none")
    if all(s.full_recompute_layers == s.num_layers for s in stages):
        return Recompute("full")
    most = max(s.full_recompute_layers for s in stages)
    if all(s.full_recompute_layers == min(most, s.num_layers) for s in stages):
        return Recompute("full", most)
    return None



def per_stage(strategy: Strategy) -> str:
    """"1 of 96 layers fully, 0 selectively": the plan's recomputation in a few words."""
    full = sum(s.full_recompute_layers for s in strategy.stages)
    selective = sum(s.selective_recompute_layers for s in strategy.stages)
    return f"{full} of {sum(s.num_layers for s in strategy.stages)} layers fully, {selective} selectively"



def all_or_nothing(strategy: Strategy, engine: str, where: str, warnings: list[str]) -> str:
    """For engines that recompute every layer or none: the plan's mode, with a warning
    where the plan recomputes only some layers (exported as all of them: it then fits)."""
    form = recompute_form(strategy)
    if form is not None and form.full_layers is None:
        return form.mode
    warnings.append(f"{engine} recomputes every layer or none ({where}); the plan recomputes per stage "
                    f"({per_stage(strategy)}): exported as full recompute of every layer")
    return "full"


# Knobs compared between two strategies: label, attribute.
KNOBS = (("dp", "dp"), ("tp", "tp"), ("pp", "pp"), ("vpp", "vpp"), ("ep", "ep"), ("etp", "expert_tp"), ("cp", "cp"),
          ("mbs", "micro_batch_size"),
          ("micro-batches", "num_microbatches"), ("schedule", "schedule"), ("zero", "zero_stage"),
          ("recompute", "recompute"), ("sp", "sequence_parallel"))



def strategy_changes(old: Strategy, new: Strategy) -> list[str]:
    """What differs, as "tp 8→4": the knobs, then the stage partition and the
    recomputed layers per stage when the knobs agree on them."""
    out = [f"{label} {format_value(getattr(old, name))}→{format_value(getattr(new, name))}"
           for label, name in KNOBS if getattr(old, name) != getattr(new, name)]
    sizes = ([s.num_layers for s in old.stages], [s.num_layers for s in new.stages])
    if sizes[0] != sizes[1] and (old.pp, old.vpp) == (new.pp, new.vpp):   # else implied by pp, vpp
        out.append(f"layers per stage {','.join(map(str, sizes[0]))}→{','.join(map(str, sizes[1]))}")
    elif sizes[0] == sizes[1] and old.stages != new.stages and old.recompute == new.recompute:
        counts = [f"{sum(s.full_recompute_layers for s in x.stages)}/{sum(s.selective_recompute_layers for s in x.stages)}"
                  for x in (old, new)]
        out.append(f"recomputed layers (full/selective) {counts[0]}→{counts[1]}"
                   if counts[0] != counts[1] else "recomputed layers placed differently")
    return out


def override_tokens(text: str) -> list[str]:
    """Shell words of pasted overrides (backslash-newline continuations joined)."""
    try:
        return shlex.split(text.replace("\\\n", " "))
    except ValueError as err:
        raise SpecError("overrides", f"cannot split into words: {err}") from None
