"""What a run measures and how it is reported: one JSON line per step (flushed as it is
written, so a crash loses nothing before it), and a closing summary that puts the
measured step time and memory beside the plan's estimate, as a JSON line and a table;
the JSON also lists each rank's group of the cluster, hardware and device.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

GIB = 1 << 30


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    peak_memory_bytes: int      # largest over ranks; see `peak_memory_bytes()`
    lr: float


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes of this rank: the CUDA caching allocator's counter on a GPU,
    the process's peak resident set on CPU (which includes the Python runtime)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    scale = 1 if sys.platform == "darwin" else 1024   # ru_maxrss is KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)


class MetricsWriter:
    """Appends JSON lines to `path` (or nowhere when None)."""

    def __init__(self, path: str | Path | None):
        self.file = open(path, "w") if path else None

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record, sort_keys=True) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def summarize(steps: list[StepMetrics], estimate: dict, device: torch.device, ranks: list[dict] | None = None) -> dict:
    """Median measured step (the first step, which warms up, is left out when there are
    more) against the plan's estimate; `ranks`, each rank's group, hardware and device
    (executor.run.rank_group), by rank."""
    timed = steps[1:] if len(steps) > 1 else steps
    step_s = statistics.median(s.step_time_s for s in timed)
    peak = max(s.peak_memory_bytes for s in steps)
    return {
        "steps": len(steps),
        "device": device.type,
        "measured_step_time_s": step_s,
        "estimated_step_time_s": estimate["step_time_s"],
        "step_time_ratio": step_s / estimate["step_time_s"],
        "measured_tokens_per_s": statistics.median(s.tokens_per_s for s in timed),
        "estimated_tokens_per_s": estimate["tokens_per_s"],
        "measured_peak_memory_bytes": peak,
        "estimated_peak_memory_bytes": estimate["peak_memory_bytes"],
        "memory_kind": "allocated" if device.type == "cuda" else "process RSS",
        "first_loss": steps[0].loss,
        "last_loss": steps[-1].loss,
        **({"ranks": ranks} if ranks is not None else {}),
    }


def group_summaries(ranks: list[dict]) -> list[str]:
    """One entry per group of the cluster: its ranks, hardware and device."""
    by_group: dict[str, list[dict]] = {}
    for r in ranks:
        by_group.setdefault(r["group"], []).append(r)
    out = []
    for group, members in by_group.items():
        numbers = ", ".join(str(r["rank"]) for r in members)
        kinds = ", ".join(sorted({f"{r['gpu']} on {r['device']}" for r in members}))
        out.append(f"{group}: rank{'s' if len(members) > 1 else ''} {numbers} ({kinds})")
    return out


def print_summary(summary: dict, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"Run against the plan ({summary['steps']} steps on {summary['device']})")
    for col in ("", "measured", "estimated", "ratio"):
        table.add_column(col, justify="left" if not col else "right")
    table.add_row("step time s", f"{summary['measured_step_time_s']:.4f}", f"{summary['estimated_step_time_s']:.4f}",
                  f"{summary['step_time_ratio']:.2f}")
    table.add_row("tokens/s", f"{summary['measured_tokens_per_s']:,.0f}", f"{summary['estimated_tokens_per_s']:,.0f}",
                  f"{summary['measured_tokens_per_s'] / summary['estimated_tokens_per_s']:.2f}")
    measured, estimated = summary["measured_peak_memory_bytes"], summary["estimated_peak_memory_bytes"]
    table.add_row(f"peak memory GiB ({summary['memory_kind']})", f"{measured / GIB:.3f}", f"{estimated / GIB:.3f}",
                  f"{measured / estimated:.2f}")
    table.add_row("loss first -> last", f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}", "", "")
    console.print(table)


def record(metrics: StepMetrics) -> dict:
    return asdict(metrics)
