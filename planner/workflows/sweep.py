"""Capacity planning (`shardwise sweep`): one training job planned at a range of cluster
sizes, and what each size buys. This module owns reading the size range (`parse_sizes`),
the figures that compare sizes (scaling efficiency against the smallest size that
plans) and the time, cost and energy of training a token budget (`sweep`, one
`SweepRow` per size).

Each size is planned exactly as `shardwise plan --gpus N` plans it (planner.api's
make_problem and make_rules, then planner.search.search), so a row's figures are that
plan's and `SweepRow.plan` is the plan document `plan` would write. A size that cannot
be built (not a whole number of nodes, a pin it does not divide) or where nothing fits
becomes a row that says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from costmodel.estimate.energy import cost_energy
from costmodel.specs.loading import SpecError, as_float, as_int
from planner.api import make_problem, make_rules
from planner.plan_file import _round, plan_document
from planner.rules import parse_fix
from planner.search import Infeasible, search
from planner.search.space import describe

OK, INFEASIBLE, IMPOSSIBLE = "ok", "infeasible", "impossible"


@dataclass(frozen=True)
class SweepRow:
    """One size of a sweep. `status`: ok (planned), infeasible (searched, nothing fits)
    or impossible (the size cannot be built); `reason` says why when not ok. The
    figures are None without a plan, and the train_* ones without a token budget (the
    cost without a price, the energy without power figures in the cluster spec)."""

    gpus: int
    status: str
    reason: str | None = None
    strategy: str | None = None             # the best plan: planner.search.space.describe and its recompute
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    scaling_efficiency: float | None = None  # per-GPU throughput / the smallest planned size's
    mfu: float | None = None
    peak_memory_bytes: float | None = None
    train_steps: float | None = None
    train_time_s: float | None = None
    train_cost_usd: float | None = None
    train_energy_j: float | None = None
    plan: dict | None = field(default=None, repr=False, compare=False)   # the plan document

    def as_dict(self) -> dict:
        """The row without its plan document, floats rounded as plan files round them."""
        return _round({f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"})


def _doubling(first: int, last: int, text: str) -> list[int]:
    if last < first:
        raise SpecError("--gpus", f"{text}: the range ends below its start")
    sizes = [first]
    while sizes[-1] < last:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != last:
        raise SpecError("--gpus", f"{text}: {last} is not {first} times a power of two "
                                  f"(try {first}..{sizes[-2]} or {first}..{sizes[-1]})")
    return sizes


def parse_sizes(text: str) -> tuple[int, ...]:
    """`8..1024` -> 8, 16, 32, ..., 1024 (A..B doubles from A to B: the powers of two
    when A is one); `8,16,48` -> those sizes; items mix (`8..64,96`). Sorted, without
    repeats. Raises SpecError naming --gpus."""
    sizes: set[int] = set()
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            raise SpecError("--gpus", f"{text!r}: expected sizes like 8..1024 or 8,16,48")
        if ".." in item:
            first, _, last = item.partition("..")
            sizes.update(_doubling(as_int(first.strip(), "--gpus"), as_int(last.strip(), "--gpus"), item))
        else:
            sizes.add(as_int(item, "--gpus"))
    return tuple(sorted(sizes))


def _size_bound(err: SpecError) -> bool:
    """Whether a SpecError is the size's own (the GPU count, a pin it does not divide)
    rather than bad input at every size, which must stop the sweep with exit 2."""
    return err.field == "--gpus" or err.field.startswith("--fix")


def sweep(model: str, cluster: str, sizes: tuple[int, ...] | str, global_batch: Any, *, seq_len: Any = None,
          precision: str = "bf16", optimizer: str = "adamw", flash_attention: bool = True,
          overrides: dict | None = None, rules: str | None = None, fix: dict | str | None = None,
          objective: str | None = None, tokens: Any = None, top: int = 3,
          progress: Callable[[int, int], None] | None = None, runtime: str | None = None,
          compile: bool | None = None, runtime_settings: str | dict | None = None) -> tuple[SweepRow, ...]:
    """Plan the job at every size (a tuple, or text for parse_sizes) as `plan --gpus N`
    would, and return a row per size, smallest first. `tokens`: the training budget
    in tokens, for the train_* figures. `progress(done, total)` is told after each size.
    Raises SpecError for input that is bad at every size."""
    sizes = parse_sizes(sizes) if isinstance(sizes, str) else tuple(sorted(set(sizes)))
    budget_tokens = as_float(tokens, "--tokens") if tokens is not None else None
    pins = parse_fix(fix)
    rule_set = make_rules(rules, pins, objective=objective)
    planned: list[tuple[int, Any, Any] | SweepRow] = []
    for done, gpus in enumerate(sizes):
        try:
            problem = make_problem(model, cluster, global_batch, gpus=gpus, seq_len=seq_len, precision=precision,
                                   optimizer=optimizer, flash_attention=flash_attention, overrides=overrides,
                                   fix=pins, runtime=runtime, compile=compile, runtime_settings=runtime_settings)
            planned.append((gpus, problem, search(problem, rule_set, top=top)))
        except SpecError as err:
            if not _size_bound(err):
                raise
            planned.append(SweepRow(gpus, IMPOSSIBLE, reason=str(err)))
        except Infeasible as err:
            hint = f"; would fit if you {err.relaxation}" if err.relaxation else ""
            planned.append(SweepRow(gpus, INFEASIBLE, reason=f"{err.reason}{hint}"))
        if progress:
            progress(done + 1, len(sizes))

    base_per_gpu = None   # tokens/s per GPU of the smallest size that plans
    rows = []
    for entry in planned:
        if isinstance(entry, SweepRow):
            rows.append(entry)
            continue
        gpus, problem, result = entry
        best = result.best
        e = best.estimate
        per_gpu = e.tokens_per_s / gpus
        if base_per_gpu is None:
            base_per_gpu = per_gpu
        train = {}
        if budget_tokens is not None:
            figures = cost_energy(problem.cluster, best.strategy, e)   # per step (costmodel.estimate.energy)
            # The budget takes tokens / tokens_per_step steps (fractional: a budget is a
            # size, not a schedule), each priced as this plan's step; its time is
            # tokens / tokens_per_s, tokens_per_s being tokens_per_step / step_time_s.
            steps = budget_tokens / problem.training.tokens_per_step
            train = {"train_steps": steps, "train_time_s": budget_tokens / e.tokens_per_s,
                     "train_cost_usd": (steps * figures.cost_per_step_usd
                                        if figures.cost_per_step_usd is not None else None),
                     "train_energy_j": (steps * figures.energy_per_step_j
                                        if figures.energy_per_step_j is not None else None)}
        rows.append(SweepRow(
            gpus, OK, strategy=f"{describe(best.strategy)} recompute={best.strategy.recompute}", step_time_s=e.step_time_s, tokens_per_s=e.tokens_per_s,
            tokens_per_s_per_gpu=per_gpu,
            # Strong scaling of one job (same global batch): 1.0 when tokens/s grows as the GPUs do.
            scaling_efficiency=per_gpu / base_per_gpu,
            mfu=e.mfu, peak_memory_bytes=e.peak_memory_bytes, **train,
            plan=plan_document(problem, rule_set.name, result)))
    return tuple(rows)
