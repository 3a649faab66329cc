"""The uncertainty band of an estimate: how much slower or faster a plan may run, and
how much more memory it may need, than estimated, as the runtime profile's measured
errors say (`costmodel.specs.runtime.RuntimeSpec`: step_time_low_ratio,
step_time_high_ratio, memory_high_ratio, each measured over predicted on rows the
profile was not fitted on; bench/calibrate_runtime.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.estimate.breakdown import Estimate
from costmodel.specs.runtime import RuntimeSpec


@dataclass(frozen=True)
class Band:
    step_time_low_s: float
    step_time_high_s: float
    peak_memory_high_bytes: float


def band(estimate: Estimate, runtime: RuntimeSpec) -> Band:
    """The estimate's step time and peak memory scaled by the runtime's measured ratios."""
    return Band(step_time_low_s=estimate.step_time_s * runtime.step_time_low_ratio,
                step_time_high_s=estimate.step_time_s * runtime.step_time_high_ratio,
                peak_memory_high_bytes=estimate.peak_memory_bytes * runtime.memory_high_ratio)
