"""Evaluate what a user runs today: read an engine's configuration
(`planner.interop.importers`), check it runs on the model and cluster, price it with
`costmodel.estimate`, search the best plan under the same rules, and say what differs
(knob by knob) and why it is faster (which time and memory terms shrink).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from costmodel.estimate import Estimate, estimate
from costmodel.estimate.band import Band, band
from costmodel.problem import Problem
from costmodel.specs import MixedClusterSpec
from costmodel.specs.loading import (
    SpecError,
    as_int,
    load_cluster,
    load_runtime,
)
from costmodel.specs.training import precision_name, split_precision
from costmodel.strategy import Strategy, context_parallel_error
from costmodel.units import GIB
from planner.api import make_problem, resolve_model
from planner.interop.common import Imported, strategy_changes
from planner.interop.importers import read_config
from planner.plan_file import _round, strategy_dict
from planner.rules import Rules
from planner.search import Candidate, Infeasible, search
from planner.search.partition import usable_memory_bytes

# The runtime profile (configs/runtimes/) each engine's configuration is priced under.
ENGINE_RUNTIMES = {"megatron": "megatron", "deepspeed": "deepspeed-zero", "torchtitan": "pytorch-native"}

# The engine's own name for what the evaluation checks (for error messages).
ENGINE_FIELDS = {
    "megatron": {"global_batch": "--global-batch-size", "seq": "--seq-length", "precision": "--bf16/--fp16",
                 "tp": "--tensor-model-parallel-size", "sp": "--sequence-parallel", "ep": "--expert-model-parallel-size",
                 "cp": "--context-parallel-size", "fp8": "--fp8-format"},
    "torchtitan": {"global_batch": "training.global_batch_size", "seq": "training.seq_len",
                   "precision": "training.mixed_precision_param", "tp": "parallelism.tensor_parallel_degree",
                   "sp": "parallelism.enable_sequence_parallel", "ep": "parallelism.expert_parallel_degree",
                   "cp": "parallelism.context_parallel_degree", "fp8": "model.converters"},
    "deepspeed": {"global_batch": "train_batch_size", "seq": "--seq", "precision": "bf16.enabled/fp16.enabled",
                  "tp": "tensor_parallel.autotp_size", "sp": "--sp", "ep": "--ep", "cp": "--cp", "fp8": "bf16.enabled"},
}


@dataclass(frozen=True)
class TermChange:
    """One term of the step time (seconds) or of the peak rank's memory (bytes)."""

    kind: str       # time | memory
    term: str
    yours: float
    best: float


@dataclass(frozen=True)
class Evaluation:
    problem: Problem
    strategy: Strategy
    yours: Estimate
    usable_memory_bytes: float
    best: Candidate | None
    best_missing: str | None        # why no best plan exists under the rules
    changes: tuple[str, ...]
    terms: tuple[TermChange, ...]   # terms that differ, largest saving first
    warnings: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return self.yours.peak_memory_bytes <= self.usable_memory_bytes

    @property
    def yours_band(self) -> Band:
        return band(self.yours, self.problem.runtime)

    @property
    def gain(self) -> float | None:
        """Throughput of the best plan over yours, minus one."""
        return None if self.best is None else self.yours.step_time_s / self.best.estimate.step_time_s - 1


def _stated_precision(imported: Imported, given) -> str | None:
    """The --precision name of what the config says (FP8 included: "fp8", "fp8-rowwise").
    Where the config cannot say FP8 (torchtitan 0.3's overrides), a --precision of FP8 over
    the config's bf16 is taken: its config_registry function sets the converters."""
    if imported.precision is None:
        return None
    stated = precision_name(imported.precision, imported.fp8)
    if not imported.states_fp8 and given is not None and split_precision(str(given))[0] == stated:
        return str(given)
    return stated


def _reconcile(source: str, imported: Imported, global_batch, seq, precision) -> tuple:
    """The config's batch, sequence and precision, or the command line's where the
    config says nothing; the two disagreeing is bad input naming the config's field."""
    names = ENGINE_FIELDS[source]
    out = []
    for key, given, stated in (("global_batch", global_batch, imported.global_batch),
                               ("seq", seq, imported.seq_len), ("precision", precision, _stated_precision(imported, precision))):
        flag = {"global_batch": "--global-batch", "seq": "--seq", "precision": "--precision"}[key]
        if stated is not None and given is not None and str(given) != str(stated):
            fp8_only = key == "precision" and split_precision(str(given))[0] == split_precision(str(stated))[0]
            raise SpecError(names["fp8" if fp8_only else key], f"the configuration says {stated}, {flag} says {given}")
        out.append(stated if stated is not None else given)
    if out[0] is None:
        raise SpecError("--global-batch", f"the configuration does not state the global batch ({names['global_batch']})")
    return out[0], out[1], out[2] or "bf16"


def check_runnable(problem: Problem, strategy: Strategy, source: str) -> None:
    """Refuse what the engine itself would refuse on this model (exit code 2)."""
    model, names = problem.model, ENGINE_FIELDS[source]
    tp = strategy.tp
    for what, size in (("hidden_size", model.hidden_size), ("num_attention_heads", model.num_attention_heads),
                       ("num_key_value_heads", model.num_key_value_heads)):
        if size % tp:
            raise SpecError(names["tp"], f"{tp} does not divide {what} {size} of {model.name}")
    if why := context_parallel_error(strategy.cp, problem.training.seq_len):
        raise SpecError(names["cp"], why)
    # Under context parallelism a rank holds seq / cp tokens, which sequence parallelism splits over tp.
    tokens = problem.training.seq_len // strategy.cp
    if strategy.sequence_parallel and tokens % tp:
        raise SpecError(names["sp"], f"tp {tp} does not divide the sequence of {tokens} tokens"
                        + (f" a cp rank holds (seq {problem.training.seq_len} / cp {strategy.cp})"
                           if strategy.cp > 1 else ""))
    if strategy.ep > 1:
        if not model.is_moe:
            raise SpecError(names["ep"], f"{strategy.ep}, but {model.name} has no experts")
        if model.num_local_experts % strategy.ep or strategy.dp % strategy.ep:
            raise SpecError(names["ep"], f"{strategy.ep} must divide the {model.num_local_experts} experts and dp "
                                         f"{strategy.dp}")


def _terms(yours: Estimate, best: Estimate) -> tuple[TermChange, ...]:
    """Terms that differ by more than 0.5% of the step (or of the peak), the largest
    saving first."""
    out = []
    for kind, a, b, scale in (("time", yours.time, best.time, yours.step_time_s),
                              ("memory", yours.memory, best.memory, yours.peak_memory_bytes)):
        for f in fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if abs(x - y) > 0.005 * scale:
                out.append(TermChange(kind, f.name.removesuffix("_s").removesuffix("_bytes"), x, y))
    return tuple(sorted(out, key=lambda t: (t.kind != "time", t.best - t.yours, t.term)))


def evaluate_config(source: str, config: str, model_name: str, cluster_name: str, *, nodes=None, gpus=None,
                    global_batch=None, seq=None, precision=None, optimizer: str = "adamw",
                    flash_attention: bool = True, overrides: dict | None = None, rules: Rules,
                    pins: dict | None = None, runtime: str | None = None) -> Evaluation:
    """Price the configuration and the best plan under `rules` (already holding `pins`),
    both under `runtime` (by default the engine's own, ENGINE_RUNTIMES)."""
    spec = resolve_model(model_name, overrides)
    cluster = load_cluster(cluster_name, nodes=nodes, gpus=gpus)
    if isinstance(cluster, MixedClusterSpec):
        raise SpecError("--cluster", f"{cluster.name} is a mixed cluster: an engine's configuration does not say "
                                     "which ranks run on which group; evaluate on one of its groups' clusters")
    hint = None if global_batch is None else as_int(global_batch, "--global-batch")
    imported = read_config(source, config, spec, cluster.num_gpus, hint)
    batch, seq_len, precision = _reconcile(source, imported, global_batch, seq, precision)
    if imported.fp8 is not None and "fp8" not in cluster.gpu.peak_flops_per_s:
        have = ", ".join(sorted(cluster.gpu.peak_flops_per_s))
        raise SpecError(ENGINE_FIELDS[source]["fp8"], f"FP8 ({imported.fp8}) on {cluster.gpu.name}, which has no fp8 "
                                                      f"peak (has: {have}): the engine would not run FP8 GEMMs there")
    problem = make_problem(model_name, cluster_name, batch, nodes=nodes, gpus=gpus, seq_len=seq_len,
                           precision=precision, optimizer=optimizer, flash_attention=flash_attention,
                           overrides=overrides, fix=pins,
                           runtime=replace(load_runtime(runtime or ENGINE_RUNTIMES[source]),
                                           **dict(imported.runtime_settings)))
    strategy = imported.strategy
    check_runnable(problem, strategy, source)
    yours = estimate(problem, strategy)
    best = missing = None
    try:
        best = search(problem, rules, top=1).best
    except Infeasible as err:
        missing = err.reason
    changes = tuple(strategy_changes(strategy, best.strategy)) if best else ()
    terms = _terms(yours, best.estimate) if best else ()
    return Evaluation(problem, strategy, yours, usable_memory_bytes(problem, rules), best, missing,
                      changes, terms, imported.warnings)


def summary_line(ev: Evaluation) -> str:
    """yours: 132.0 TFLOP/s per GPU, 71.2 GiB peak; best: 151.0 (+14%): tp 8→4, pp 4→8"""
    y = ev.yours
    line = f"yours: {y.tflops_per_gpu:.1f} TFLOP/s per GPU, {y.peak_memory_bytes / GIB:.1f} GiB peak"
    if ev.best is None:
        return line + f"; best: no plan under these rules ({ev.best_missing})"
    b = ev.best.estimate
    what = ", ".join(ev.changes) if ev.changes else "your configuration is the best found"
    return line + (f"; best: {b.tflops_per_gpu:.1f} ({ev.gain:+.0%}), {b.peak_memory_bytes / GIB:.1f} GiB peak: {what}")


def band_line(ev: Evaluation) -> str:
    """yours: step 2.310-3.353 s, up to 28.1 GiB (the pytorch-native profile's band)"""
    b = ev.yours_band
    return (f"yours: step {b.step_time_low_s:.3f}-{b.step_time_high_s:.3f} s, up to "
            f"{b.peak_memory_high_bytes / GIB:.1f} GiB (the {ev.problem.runtime.name} profile's band)")


def memory_line(ev: Evaluation) -> str | None:
    """A line when your configuration does not fit (it is priced all the same)."""
    if ev.fits:
        return None
    gpu = ev.problem.cluster.gpu
    return (f"yours does not fit: pipeline rank {ev.yours.peak_memory_rank} needs "
            f"{ev.yours.peak_memory_bytes / GIB:.1f} GiB, {gpu.name} has {gpu.memory_bytes / GIB:.0f} GiB "
            f"({ev.usable_memory_bytes / GIB:.1f} GiB usable after the rules' memory headroom and margin)")


def reason_lines(ev: Evaluation) -> list[str]:
    """Which terms shrink (and grow), in seconds per step and GiB of the peak rank."""
    out = []
    for t in ev.terms:
        if t.kind == "time":
            out.append(f"{t.term}: {t.yours:.3f} s → {t.best:.3f} s ({t.best - t.yours:+.3f} s)")
        else:
            out.append(f"{t.term} memory: {t.yours / GIB:.2f} GiB → {t.best / GIB:.2f} GiB "
                       f"({(t.best - t.yours) / GIB:+.2f} GiB)")
    return out


def evaluation_document(ev: Evaluation) -> dict:
    """The evaluation as JSON-ready data, rounded like plan files."""
    best = None
    if ev.best is not None:
        best = {"strategy": strategy_dict(ev.best.strategy), "estimate": asdict(ev.best.estimate),
                "band": asdict(band(ev.best.estimate, ev.problem.runtime))}
    return _round({
        "yours": {"strategy": strategy_dict(ev.strategy), "estimate": asdict(ev.yours),
                  "band": asdict(ev.yours_band), "fits_memory": ev.fits},
        "best": best, "best_missing": ev.best_missing, "gain": ev.gain, "changes": list(ev.changes),
        "terms": [asdict(t) for t in ev.terms], "usable_memory_bytes": ev.usable_memory_bytes,
        "summary": summary_line(ev), "warnings": list(ev.warnings),
    })
