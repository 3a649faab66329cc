"""Pictures of a plan document (`shardwise explain --plot / --html`): the pipeline
schedule as a timeline per pipeline rank, memory per rank against the device capacity
by category, and the step's time breakdown, as one PNG of three panels.

Owns the schedule timeline (`timeline`), the per-rank memory breakdowns the plan file
does not hold (`rank_memory_breakdowns`, recomputed with the cost model) and the
drawing (`render_png`, `figure_png_bytes`). matplotlib runs on its Agg backend through
an explicit Figure: no pyplot, no global state.

The timeline is a dependency simulation of the plan's schedule: each rank runs its
operations in the schedule's order, a forward of micro-batch i on stage s waits for
stage s-1's forward of i, a backward for stage s+1's backward of i (the last stage: its
own forward). A rank's micro-batch time t_r (estimate.rank_time_s; p2p sends included)
splits into forward and backward by costmodel.terms.compute.BACKWARD_FACTOR, recomputation
going to the backward by its share of the plan's time breakdown.
- gpipe: all forwards, then all backwards (torch.distributed.pipelining ScheduleGPipe).
  The makespan is (m - 1) max t + sum t, the estimate's pipelined time, exactly.
- 1f1b: min(p - r - 1, m) warm-up forwards, then one forward one backward, then the
  cool-down backwards (PipeDream-flush). Equal ranks give the estimate's time exactly;
  unequal ranks finish earlier than costmodel.terms.pipeline's (m - 1) max t + sum t, which
  is an upper bound there (the fill and drain through faster ranks overlap).
- interleaved: Megatron-LM's order (Narayanan et al. 2021 §2.2.2): forwards in groups
  of p micro-batches per model chunk, chunk by chunk, 2(p - r - 1) + (vpp - 1)p of
  them warm-up, backwards in the same order with chunks reversed; each of a rank's vpp
  chunks takes t_r / vpp (chunks taken as equal). With m a multiple of p and equal
  ranks this matches the estimate; otherwise it is the approximation the figure shows.
- zb-interleaved, zbv and dualpipev (zero bubble, Qi et al. 2024): each backward splits into the
  input gradient and the weight gradient (half of the backward's non-recompute share
  each, as BACKWARD_FACTOR's two GEMMs per forward GEMM). A list simulation: a rank
  starts, of its operations whose inputs have arrived, the earliest to start, an input
  gradient before a forward before a weight gradient, forwards capped at the schedule's
  in-flight micro-batches (costmodel.terms.memory.in_flight_microbatches) and weight
  gradients free to wait: they fill the idle time. zbv and dualpipev place stage r and
  2p - 1 - r on rank r (costmodel.strategy.stage_rank). This is the idea of the schedule,
  not torch's exact order; the estimate's bubble is costmodel.terms.pipeline's, read off
  torch's order.
Idle time inside the step is drawn as bubble; p2p messages as ticks between rows where
a stage sends its activation (forward) or gradient (backward) to its neighbour.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

from costmodel.estimate import rank_memories
from costmodel.estimate.mixed import rank_capacity_bytes
from costmodel.terms.compute import BACKWARD_FACTOR
from costmodel.strategy import ZERO_BUBBLE_SCHEDULES, rank_stage_indices
from costmodel.terms.memory import in_flight_microbatches
from costmodel.terms.pipeline import pipeline_time_s
from costmodel.units import GIB
from planner.plan_file import cluster_of, problem_of, strategy_of

FIGURE_SIZE_IN = (12.0, 13.0)
FIGURE_DPI = 100          # 1200 x 1300 pixels

# Category -> colour, fixed so a reader (and the tests) can find each in the picture.
# Every colour is distinct from the others, from black text and from white.
COLOURS = {
    # timeline
    "forward": "#1f77b4",
    "backward": "#ff7f0e",
    "weight": "#ffd27f",          # a zero-bubble schedule's weight-gradient pass
    "bubble": "#c8c8c8",
    "p2p": "#9400d3",
    # memory (MemoryBreakdown fields without _bytes; buffers are comm buffers)
    "weights": "#2ca02c",
    "gradients": "#98df8a",
    "optimizer": "#8c564b",
    "activations": "#e377c2",
    "buffers": "#17becf",
    "reserve": "#7f7f00",
    "temporary": "#ffbb78",
    "capacity": "#d62728",
    # time breakdown (TimeBreakdown fields without _s); bubble as above
    "compute": "#4060a0",
    "recompute": "#bcbd22",
    "tp_comm": "#00a080",
    "ep_comm": "#a0a0ff",
    "pp_comm": "#600060",
    "dp_comm": "#ff9896",
    "cp_comm": "#c5b0d5",
    "optimizer_step": "#804000",
    "fixed": "#ffd700",          # the runtime's per-step fixed cost
}

_MEMORY_KEYS = {"weights_bytes": "weights", "gradients_bytes": "gradients", "optimizer_bytes": "optimizer",
                "activations_bytes": "activations", "comm_buffer_bytes": "buffers",
                "runtime_reserve_bytes": "reserve", "temporary_bytes": "temporary"}


def hex_rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


@dataclass(frozen=True)
class Box:
    """One forward, backward or (zero-bubble schedules) weight-gradient pass of one
    micro-batch on one model chunk of a rank."""

    rank: int
    kind: str          # "forward" | "backward" | "weight"
    microbatch: int
    chunk: int
    start_s: float
    end_s: float
    stage: int         # the virtual pipeline stage the chunk is


@dataclass(frozen=True)
class Timeline:
    boxes: tuple[Box, ...]
    makespan_s: float
    estimate_s: float       # costmodel.terms.pipeline.pipeline_time_s of the same rank times
    num_ranks: int


def _rank_order(schedule: str, pp: int, rank: int, m: int, vpp: int) -> list[tuple[str, int, int]]:
    """(kind, chunk, micro-batch) in the order rank `rank` runs them."""
    if schedule == "gpipe":
        return [("forward", 0, i) for i in range(m)] + [("backward", 0, i) for i in range(m)]
    if schedule == "interleaved" and vpp > 1:
        forwards = [(c, i) for g in range(math.ceil(m / pp)) for c in range(vpp)
                    for i in range(g * pp, min(g * pp + pp, m))]
        backwards = [(vpp - 1 - c, i) for c, i in forwards]
        warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp, m * vpp)
    else:
        forwards = backwards = [(0, i) for i in range(m)]
        warmup = min(pp - rank - 1, m)
    ops = [("forward", c, i) for c, i in forwards[:warmup]]
    for k in range(len(forwards) - warmup):
        ops += [("forward", *forwards[warmup + k]), ("backward", *backwards[k])]
    ops += [("backward", c, i) for c, i in backwards[len(forwards) - warmup:]]
    return ops


def timeline(schedule: str, rank_times_s: list[float], num_microbatches: int, vpp: int = 1,
             backward_share: float = BACKWARD_FACTOR / (1 + BACKWARD_FACTOR),
             weight_share: float = 0.5 * BACKWARD_FACTOR / (1 + BACKWARD_FACTOR)) -> Timeline:
    """Simulate the schedule (see the module docstring); `backward_share` of each
    micro-batch time is its backward (`weight_share` of it, for a zero-bubble schedule,
    its weight gradient)."""
    pp, m = len(rank_times_s), num_microbatches
    if schedule in ZERO_BUBBLE_SCHEDULES:
        return _zero_bubble_timeline(schedule, rank_times_s, m, vpp, backward_share, weight_share)
    chunks = vpp if schedule == "interleaved" else 1
    last_stage = pp * chunks - 1
    duration = {"forward": [t * (1 - backward_share) / chunks for t in rank_times_s],
                "backward": [t * backward_share / chunks for t in rank_times_s]}
    orders = [_rank_order(schedule, pp, r, m, chunks) for r in range(pp)]
    done: dict[tuple[str, int, int], float] = {}
    free_s, position, boxes = [0.0] * pp, [0] * pp, []
    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while position[r] < len(orders[r]):
                kind, chunk, i = orders[r][position[r]]
                stage = chunk * pp + r
                if kind == "forward":
                    needs = [("forward", stage - 1, i)] if stage > 0 else []
                else:
                    needs = [("backward", stage + 1, i)] if stage < last_stage else [("forward", stage, i)]
                if any(n not in done for n in needs):
                    break
                start = max([free_s[r]] + [done[n] for n in needs])
                end = start + duration[kind][r]
                done[(kind, stage, i)] = free_s[r] = end
                boxes.append(Box(r, kind, i, chunk, start, end, stage))
                position[r] += 1
                progressed = True
    if any(position[r] < len(orders[r]) for r in range(pp)):
        raise ValueError(f"{schedule} order deadlocks for pp {pp}, m {m}, vpp {vpp}")
    return Timeline(tuple(boxes), max(free_s), pipeline_time_s(schedule, rank_times_s, m, vpp), pp)


def _zero_bubble_timeline(schedule: str, rank_times_s: list[float], m: int, vpp: int, backward_share: float,
                          weight_share: float) -> Timeline:
    """The list simulation of the module docstring."""
    pp = len(rank_times_s)
    stages = pp * vpp
    held_stages = [rank_stage_indices(r, pp, vpp, schedule) for r in range(pp)]
    where = {stage: (r, chunk) for r in range(pp) for chunk, stage in enumerate(held_stages[r])}
    duration = {"forward": [t * (1 - backward_share) / vpp for t in rank_times_s],
                "backward": [t * (backward_share - weight_share) / vpp for t in rank_times_s],
                "weight": [t * weight_share / vpp for t in rank_times_s]}
    # Micro-batches a rank has started (its first chunk's forward) and not finished:
    # later chunks' forwards carry them on and are never held back.
    first_stage = [indices[0] for indices in held_stages]
    limit = [math.ceil(in_flight_microbatches(schedule, pp, r, m, vpp)) for r in range(pp)]
    done: dict[tuple[str, int, int], float] = {}
    next_mb = {(kind, stage): 0 for kind in ("forward", "backward") for stage in range(stages)}
    waiting_weights: list[list[tuple[int, int]]] = [[] for _ in range(pp)]   # (stage, micro-batch)
    free_s, held, boxes = [0.0] * pp, [0] * pp, []
    priority = {"backward": 0, "forward": 1, "weight": 2}
    while len(boxes) < 3 * m * stages:
        best = None
        for stage in range(stages):
            r, _ = where[stage]
            for kind in ("forward", "backward"):
                i = next_mb[(kind, stage)]
                if i >= m or (kind == "forward" and stage == first_stage[r] and held[r] >= limit[r]):
                    continue
                need = (("forward", stage - 1, i) if stage > 0 else None) if kind == "forward" else \
                    (("backward", stage + 1, i) if stage < stages - 1 else ("forward", stage, i))
                if need is not None and need not in done:
                    continue
                start = max(free_s[r], done[need] if need else 0.0)
                key = (start, priority[kind], r, -stage)
                if best is None or key < best[0]:
                    best = (key, kind, stage, i)
        for r in range(pp):
            if waiting_weights[r]:
                stage, i = waiting_weights[r][0]
                key = (free_s[r], priority["weight"], r, stage)
                if best is None or key < best[0]:
                    best = (key, "weight", stage, i)
        if best is None:
            raise ValueError(f"{schedule} simulation deadlocks for pp {pp}, m {m}, vpp {vpp}")
        (start, _, r, _), kind, stage, i = best
        end = start + duration[kind][r]
        done[(kind, stage, i)] = free_s[r] = end
        boxes.append(Box(r, kind, i, where[stage][1], start, end, stage))
        if kind == "weight":
            waiting_weights[r].pop(0)
            continue
        next_mb[(kind, stage)] += 1
        if kind == "backward":
            waiting_weights[r].append((stage, i))
            # The micro-batch counts as started until the input gradient of its first
            # chunk there; its deferred weight gradients are what the cap leaves room for.
            held[r] -= stage == first_stage[r]
        elif stage == first_stage[r]:
            held[r] += 1
    # weight_share and 1 - backward_share are also the weight gradients' and the forward's
    # shares of each rank's micro-batch time.
    return Timeline(tuple(boxes), max(free_s),
                    pipeline_time_s(schedule, rank_times_s, m, vpp, weight_share, 1 - backward_share), pp)


def plan_timeline(doc: dict) -> Timeline:
    """The timeline of a plan document's strategy and estimate."""
    s, e = doc["strategy"], doc["estimate"]
    t = e["time"]
    busy = sum(v for k, v in t.items() if k not in ("bubble_s", "optimizer_s", "fixed_s")) or 1.0
    # Recompute runs inside the backward; the rest splits by BACKWARD_FACTOR.
    recompute_share = t.get("recompute_s", 0.0) / busy
    backward_share = recompute_share + (1 - recompute_share) * BACKWARD_FACTOR / (1 + BACKWARD_FACTOR)
    weight_share = (1 - recompute_share) * 0.5 * BACKWARD_FACTOR / (1 + BACKWARD_FACTOR)
    return timeline(s["schedule"], list(e["rank_time_s"]), s["num_microbatches"], s["vpp"], backward_share,
                    weight_share)


def rank_memory_breakdowns(doc: dict) -> list[dict[str, float]]:
    """Bytes by category (COLOURS' memory keys) of every pipeline rank. The plan holds
    the peak rank's breakdown and every rank's total only, so the breakdowns are
    recomputed with the cost model from the plan's model, cluster, training and
    strategy (the same functions estimate() used)."""
    breakdowns = rank_memories(problem_of(doc), strategy_of(doc))
    return [{_MEMORY_KEYS[k]: getattr(b, k) for k in _MEMORY_KEYS} for b in breakdowns]


def rank_capacities(doc: dict) -> list[float]:
    """Device memory of each pipeline rank (its group's GPU on a mixed cluster)."""
    return [float(c) for c in rank_capacity_bytes(cluster_of(doc), strategy_of(doc))]


# Micro-batches drawn per pipeline rank before the timeline is windowed (x pp).
WINDOW_PIPELINES = 4


def _draw_timeline(ax, tl: Timeline) -> None:
    height = 0.7
    for r in range(tl.num_ranks):
        own = [b for b in tl.boxes if b.rank == r]
        # Bubble first, under the boxes: the rank's idle spans within the step.
        ax.broken_barh([(0.0, tl.makespan_s)], (r - height / 2, height), facecolors=COLOURS["bubble"])
        for kind in ("forward", "backward", "weight"):
            for odd in (False, True):   # interleaved: odd model chunks hatched
                spans = [(b.start_s, b.end_s - b.start_s) for b in own if b.kind == kind and b.chunk % 2 == odd]
                ax.broken_barh(spans, (r - height / 2, height), facecolors=COLOURS[kind],
                               edgecolors="white", linewidth=0.3, hatch="///" if odd else None)
    # p2p: a forward sends its activation to the next stage (drawn below the row), a
    # backward its gradient to the previous one (above); interleaved chunks wrap from
    # the last rank to the first, drawn at the edge.
    stages = 1 + max(b.stage for b in tl.boxes)

    def sends(b: Box) -> bool:
        return b.stage < stages - 1 if b.kind == "forward" else (b.kind == "backward" and b.stage > 0)

    ticks = [(b.end_s, b.rank + (0.5 if b.kind == "forward" else -0.5)) for b in tl.boxes if sends(b)]
    ax.vlines([x for x, _ in ticks], [y - 0.12 for _, y in ticks], [y + 0.12 for _, y in ticks],
              colors=COLOURS["p2p"], linewidth=2.0)
    ax.axvline(tl.estimate_s, color="black", linestyle=":", linewidth=1.0)
    ax.set_yticks(range(tl.num_ranks), [f"pp rank {r}" for r in range(tl.num_ranks)])
    ax.set_ylim(tl.num_ranks + 0.3, -0.7)   # inverted, with a strip below the rows for the legend
    ax.set_xlim(0, max(tl.makespan_s, tl.estimate_s) * 1.01)
    window = ""
    microbatches = 1 + max(b.microbatch for b in tl.boxes)
    shown = WINDOW_PIPELINES * tl.num_ranks
    if microbatches > 2 * shown:
        # Hundreds of micro-batches make a solid bar: show the warm-up and the start of
        # the steady state, which then repeats until the cool-down mirrors the warm-up.
        ax.set_xlim(0, max(b.end_s for b in tl.boxes if b.microbatch < shown) * 1.02)
        window = f"; first {shown} of {microbatches} micro-batches shown"
    ax.set_xlabel("seconds into the step")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    kinds = ("forward", "backward", "weight", "bubble", "p2p") if any(b.kind == "weight" for b in tl.boxes) \
        else ("forward", "backward", "bubble", "p2p")
    handles = [Patch(color=COLOURS[k], label=k) for k in kinds]
    handles.append(Line2D([], [], color="black", linestyle=":", label=f"estimate {tl.estimate_s:.3f} s"))
    ax.legend(handles=handles, loc="lower right", fontsize=8, ncol=len(handles))
    chunks = " (hatched: odd model chunks)" if stages > tl.num_ranks else ""
    ax.set_title(f"Pipeline timeline: makespan {tl.makespan_s:.3f} s{chunks}{window}")


def _draw_memory(ax, breakdowns: list[dict[str, float]], capacity_bytes: float | list[float]) -> None:
    ranks = list(range(len(breakdowns)))
    bottom = [0.0] * len(ranks)
    drawn = []
    for key in _MEMORY_KEYS.values():
        values = [b[key] / GIB for b in breakdowns]
        if not any(values):
            continue
        ax.bar(ranks, values, bottom=bottom, color=COLOURS[key], label=key, width=0.6)
        bottom = [lo + v for lo, v in zip(bottom, values)]
        drawn.append(key)
    capacities = capacity_bytes if isinstance(capacity_bytes, list) else [capacity_bytes] * len(ranks)
    if len(set(capacities)) == 1:
        ax.axhline(capacities[0] / GIB, color=COLOURS["capacity"], linewidth=2.0,
                   label=f"capacity {capacities[0] / GIB:.0f} GiB")
    else:   # a mixed cluster: each rank against its own group's device
        ax.hlines([c / GIB for c in capacities], [r - 0.4 for r in ranks], [r + 0.4 for r in ranks],
                  color=COLOURS["capacity"], linewidth=2.0, label="capacity of each rank's GPU")
    for r, total in zip(ranks, bottom):
        ax.text(r, total, f"{total:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(ranks, [f"pp rank {r}" for r in ranks])
    ax.set_ylabel("GiB per device")
    ax.set_ylim(0, max(max(bottom), max(capacities) / GIB) * 1.12)
    ax.legend(loc="upper right", fontsize=8, ncol=4)
    ax.set_title("Memory per pipeline rank at its peak")


def _draw_time(ax, time_s: dict[str, float], step_s: float) -> None:
    terms = [k.removesuffix("_s") for k in time_s]
    names = ["optimizer_step" if k == "optimizer" else k for k in terms]
    values = list(time_s.values())
    ax.barh(range(len(terms)), values, color=[COLOURS[n] for n in names], height=0.6)
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.3f} s ({v / step_s:.1%})", va="center", fontsize=8)
    ax.set_yticks(range(len(terms)), terms)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values) * 1.25)
    ax.set_xlabel("seconds per step")
    ax.set_title(f"Step time {step_s:.3f} s by term (bottleneck rank, all micro-batches)")


def figure_png_bytes(doc: dict) -> bytes:
    """The three panels as PNG bytes (FIGURE_SIZE_IN at FIGURE_DPI)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    e = doc["estimate"]
    fig = Figure(figsize=FIGURE_SIZE_IN, dpi=FIGURE_DPI)
    FigureCanvasAgg(fig)
    top, middle, bottom = fig.subplots(3, 1, gridspec_kw={"height_ratios": [1.2, 1.0, 0.8]})
    _draw_timeline(top, plan_timeline(doc))
    _draw_memory(middle, rank_memory_breakdowns(doc), rank_capacities(doc))
    _draw_time(bottom, e["time"], e["step_time_s"])
    fig.suptitle(f"{doc['model']['name']} on {doc['cluster']['name']}: "
                 f"dp {doc['strategy']['dp']} tp {doc['strategy']['tp']} pp {doc['strategy']['pp']}, "
                 f"{doc['strategy']['schedule']}, {doc['strategy']['num_microbatches']} micro-batches")
    fig.tight_layout()   # moves the axes inside the canvas; the canvas size stays fixed
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=FIGURE_DPI)
    return out.getvalue()


def render_png(doc: dict, path: str) -> None:
    """Write the figure to `path` (aside, then renamed: never half a file)."""
    from pathlib import Path

    data = figure_png_bytes(doc)
    tmp = Path(path + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


# `shardwise sweep --plot`: throughput, scaling efficiency and time to train against GPUs.
SWEEP_FIGURE_SIZE_IN = (9.0, 10.0)     # 900 x 1000 pixels at FIGURE_DPI; 9 x 7 without a token budget
SWEEP_COLOURS = {"tokens_per_s": "#1f77b4", "ideal": "#7f7f7f", "efficiency": "#2ca02c", "train_time": "#d62728",
                 "no_plan": "#ff7f0e"}
SECONDS_PER_DAY = 86400.0


def sweep_figure(rows, title: str, tokens: float | None = None):
    """The sweep's panels as a matplotlib Figure (Agg canvas), from planner.workflows.sweep's rows:
    tokens/s against GPUs on log2 x log axes with the ideal line, linear scaling from
    the smallest size that plans (its tokens/s x GPUs / its GPUs); scaling efficiency;
    and with the token budget `tokens`, days to train it. Sizes without a plan are
    dotted lines across every panel."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter, FormatStrFormatter, FuncFormatter

    planned = [r for r in rows if r.status == "ok"]
    missing = [r.gpus for r in rows if r.status != "ok"]
    budget = tokens is not None and bool(planned)
    width, height = SWEEP_FIGURE_SIZE_IN
    fig = Figure(figsize=(width, height if budget else height * 0.7), dpi=FIGURE_DPI)
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(3 if budget else 2, 1, sharex=True))
    gpus = [r.gpus for r in planned]
    throughput, efficiency = axes[0], axes[1]
    throughput.plot(gpus, [r.tokens_per_s for r in planned], "o-", color=SWEEP_COLOURS["tokens_per_s"],
                    label="planned")
    if planned:
        first = planned[0]
        throughput.plot(gpus, [first.tokens_per_s * n / first.gpus for n in gpus], "--",
                        color=SWEEP_COLOURS["ideal"], label=f"ideal: linear from {first.gpus} GPUs")
        throughput.legend(loc="upper left", fontsize=8)
        efficiency.set_title(f"Scaling efficiency: tokens/s per GPU against {first.gpus} GPUs")
    throughput.set_yscale("log")
    throughput.set_ylabel("tokens/s")
    throughput.set_title("Throughput")
    efficiency.plot(gpus, [r.scaling_efficiency for r in planned], "o-", color=SWEEP_COLOURS["efficiency"])
    efficiency.axhline(1.0, color=SWEEP_COLOURS["ideal"], linestyle="--", linewidth=1.0)
    # Above 1 when the smallest size is squeezed (recomputation, deep pipelines to fit memory).
    efficiency.set_ylim(0, max([1.0] + [r.scaling_efficiency for r in planned]) * 1.1)
    efficiency.set_ylabel("scaling efficiency")
    if budget:
        axes[2].plot(gpus, [r.train_time_s / SECONDS_PER_DAY for r in planned], "o-",
                     color=SWEEP_COLOURS["train_time"])
        axes[2].set_yscale("log")
        axes[2].set_ylabel("days")
        axes[2].set_title(f"Time to train {tokens:.3g} tokens")
    for ax in (throughput, *axes[2:]):   # log y: 40k, 1M and 3, 10 rather than 4 x 10^4
        plain = EngFormatter(sep="") if ax is throughput else FormatStrFormatter("%g")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, pos, plain=plain: plain(v, pos) if _leading_digit(v)
                                                   in (2, 5) else ""))
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(True, which="major", alpha=0.3)
        for n in missing:
            ax.axvline(n, color=SWEEP_COLOURS["no_plan"], linestyle=":", linewidth=1.5)
    sizes = sorted(r.gpus for r in rows)
    axes[-1].set_xticks(sizes, [str(n) for n in sizes])
    axes[-1].set_xlabel("GPUs" + (" (dotted: no plan)" if missing else ""))
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _leading_digit(value: float) -> int:
    """The first significant digit of a positive number: 2 for 2e4 (minor ticks 2 and 5 get labels)."""
    return round(value / 10 ** math.floor(math.log10(value))) if value > 0 else 0


def sweep_png_bytes(rows, title: str, tokens: float | None = None) -> bytes:
    """sweep_figure as PNG bytes, without the matplotlib version in the file's metadata
    (the same rows give the same bytes)."""
    out = io.BytesIO()
    sweep_figure(rows, title, tokens).savefig(out, format="png", dpi=FIGURE_DPI, metadata={"Software": None})
    return out.getvalue()
