"""Pipeline schedules: step time of the pipelined part from per-rank micro-batch times.

With t_r the forward+backward time of one micro-batch on pipeline rank r:
- gpipe and 1f1b: (m - 1) * max_r t_r + sum_r t_r. Every micro-batch passes the slowest
  rank once; filling and draining costs one pass through all ranks. For equal stages
  this is (m + p - 1) t, the bubble fraction (p - 1)/m of Narayanan et al. 2021 §2.2.
- interleaved (vpp model chunks per rank): m * max_r t_r + (sum_r t_r - max_r t_r) / vpp,
  i.e. the bubble shrinks by vpp: (p - 1)/(vpp * m) for equal stages (Narayanan et al.
  2021 §2.2.2).
"""

from __future__ import annotations


def pipeline_time_s(schedule: str, rank_times_s: list[float], num_microbatches: int, vpp: int = 1) -> float:
    slowest, total = max(rank_times_s), sum(rank_times_s)
    m = num_microbatches
    if schedule == "interleaved" and vpp > 1:
        return m * slowest + (total - slowest) / vpp
    return (m - 1) * slowest + total


def pipeline_coefficients(schedule: str, num_microbatches: int, vpp: int = 1) -> tuple[float, float]:
    """(a, c) with pipeline time = a * max_r t_r + c * sum_r t_r: the linear form the
    partition solver minimises."""
    m = num_microbatches
    if schedule == "interleaved" and vpp > 1:
        return m - 1.0 / vpp, 1.0 / vpp
    return m - 1.0, 1.0
