"""Pipeline schedules: step time of the pipelined part from per-rank micro-batch times.

With t_r the forward+backward time of one micro-batch on pipeline rank r (all of its
model chunks), every schedule here takes m * max_r t_r + beta * (sum_r t_r - max_r t_r):
each micro-batch passes the slowest rank once, and filling and draining the pipeline
costs the other ranks' passes times the bubble factor beta.

- gpipe and 1f1b: beta = 1, i.e. (m - 1) max + sum. For equal stages (m + p - 1) t, the
  bubble fraction (p - 1)/m of Narayanan et al. 2021 §2.2.
- interleaved (vpp model chunks per rank): beta = 1/vpp, the bubble (p - 1)/(vpp m)
  for equal stages (Narayanan et al. 2021 §2.2.2).
- zb-interleaved (torch's ScheduleInterleavedZeroBubble, ZB1P): backward is split into
  the input gradient B and the weight gradient W, and the W passes fill the bubble. Qi
  et al. 2024 ("Zero Bubble Pipeline Parallelism", §3, ZB-H1) give the bubble
  (p - 1)(T_F + T_B - T_W) against 1F1B's (p - 1)(T_F + T_B + T_W); with w = T_W / t the
  weight-gradient share of a rank's time, beta = (1 - 2w), over vpp with chunks as for
  interleaved. DeepSeek-V3's report (2024, §3.2.1, Table 2) lists the same ZB1P bubble.
- zbv (ScheduleZBVZeroBubble): two chunks per rank in a V; Qi et al. §6 reach zero
  bubble when T_F = T_B = T_W per chunk, the warm-up's chunk bubble
  T_F + T_B - 2 T_W = (t/2)(1 - 3w): beta = max(0, 1 - 3w) / 2.

w is quantised down to a multiple of 1/WEIGHT_SHARE_STEPS (a smaller share is the larger
bubble): every user of beta agrees, and the partition solver's integer program scales
the coefficients to whole numbers (`coefficient_scale`).
"""

from __future__ import annotations

import math

WEIGHT_SHARE_STEPS = 32


def bubble_factor(schedule: str, vpp: int = 1, weight_grad_share: float = 0.0) -> float:
    """beta of the module docstring."""
    k = math.floor(min(max(weight_grad_share, 0.0), 1.0) * WEIGHT_SHARE_STEPS)
    if schedule == "zb-interleaved":
        return max(0, WEIGHT_SHARE_STEPS - 2 * k) / (WEIGHT_SHARE_STEPS * vpp)
    if schedule == "zbv":
        return max(0, WEIGHT_SHARE_STEPS - 3 * k) / (WEIGHT_SHARE_STEPS * 2)
    if schedule == "interleaved" and vpp > 1:
        return 1.0 / vpp
    return 1.0


def pipeline_time_s(schedule: str, rank_times_s: list[float], num_microbatches: int, vpp: int = 1,
                    weight_grad_share: float = 0.0) -> float:
    slowest, total = max(rank_times_s), sum(rank_times_s)
    return num_microbatches * slowest + bubble_factor(schedule, vpp, weight_grad_share) * (total - slowest)


def pipeline_coefficients(schedule: str, num_microbatches: int, vpp: int = 1,
                          weight_grad_share: float = 0.0) -> tuple[float, float]:
    """(a, c) with pipeline time = a * max_r t_r + c * sum_r t_r: the linear form the
    partition solver minimises."""
    beta = bubble_factor(schedule, vpp, weight_grad_share)
    return num_microbatches - beta, beta


def coefficient_scale(schedule: str, vpp: int = 1) -> int:
    """The least integer that makes both coefficients whole numbers."""
    if schedule == "zb-interleaved":
        return WEIGHT_SHARE_STEPS * vpp
    if schedule == "zbv":
        return WEIGHT_SHARE_STEPS * 2
    return vpp if schedule == "interleaved" else 1
