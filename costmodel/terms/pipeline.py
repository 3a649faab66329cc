"""Pipeline schedules: step time of the pipelined part from per-rank micro-batch times.

With t_r the forward+backward time of one micro-batch on pipeline rank r (all of its
model chunks), every schedule here takes m * max_r t_r + beta * (sum_r t_r - max_r t_r):
each micro-batch passes the slowest rank once, and filling and draining the pipeline
costs the other ranks' passes times the bubble factor beta.

- gpipe and 1f1b: beta = 1, i.e. (m - 1) max + sum. For equal stages (m + p - 1) t, the
  bubble fraction (p - 1)/m of Narayanan et al. 2021 §2.2.
- interleaved (vpp model chunks per rank): beta = 1/vpp, the bubble (p - 1)/(vpp m)
  for equal stages (Narayanan et al. 2021 §2.2.2).
- Zero-bubble schedules split each backward into the input gradient B and the weight
  gradient W, which can wait and fill the bubble (Qi et al. 2024, "Zero Bubble Pipeline
  Parallelism"). With f, b and w the forward, input-gradient and weight-gradient shares
  of a rank's time (f + b + w = 1):
  - zb-interleaved (torch's ScheduleInterleavedZeroBubble, ZB1P): beta =
    max(f + b - w, b, f) / vpp. The first term is ZB-H1's bubble (p - 1)(T_F + T_B - T_W)
    (Qi et al. §3; DeepSeek-V3 report 2024 §3.2.1, Table 2); it holds while T_W is at most
    T_F and T_B, past which the longer pass is the bubble.
  - zbv (ScheduleZBVZeroBubble, two chunks per rank in a V): beta = max(b - w, b/2, f - b/2).
    Qi et al. §6 reach zero bubble at T_F = T_B = T_W with their own V schedule; torch's
    leaves a sixth of 1F1B's there.
  - dualpipev (ScheduleDualPipeV, DeepSeek's DualPipe cut in half): beta =
    max((f + 2(b + w) - 3w)/2, f + (b - w)/2, f), the first term DeepSeek-V3's Table 2
    (PP/2 - 1)(F&B + B - 3W) with the forward and backward of its overlapped pair run one
    after the other (F&B = F + B), as torch's runtime does without a custom overlap.
  The zbv and dualpipev terms, and the limits of the zb-interleaved one, are read off
  torch's own action lists (`_calculate_single_rank_operations`) list-simulated with
  equal chunks: tests/costmodel/terms/test_pipeline.py checks every formula against that
  simulation for pp 2 to 16, f from 1/4 to 0.4 and w up to f: never below it, and equal
  for zb-interleaved (zbv is up to 0.09 above it, dualpipev up to 0.18, both at pp 2).

beta is rounded up to a multiple of 1/(BUBBLE_STEPS vpp) (the larger bubble): every user
of beta agrees, and the partition solver's integer program scales the coefficients to
whole numbers (`coefficient_scale`).
"""

from __future__ import annotations

import math

BUBBLE_STEPS = 64
# A layer's backward is twice its forward (Narayanan et al. 2021 §3.5): the forward share
# where the caller knows no better.
FORWARD_SHARE = 1.0 / 3.0


def bubble_factor(schedule: str, vpp: int = 1, weight_grad_share: float = 0.0,
                  forward_share: float = FORWARD_SHARE) -> float:
    """beta of the module docstring."""
    w = min(max(weight_grad_share, 0.0), 1.0)
    f = min(max(forward_share, 0.0), 1.0 - w)
    b = 1.0 - f - w
    if schedule == "zb-interleaved":
        beta = max(f + b - w, b, f)
    elif schedule == "zbv":
        beta = max(b - w, b / 2, f - b / 2)
    elif schedule == "dualpipev":
        beta = max((f + 2 * (b + w) - 3 * w) / 2, f + (b - w) / 2, f)
    elif schedule == "interleaved" and vpp > 1:
        return 1.0 / vpp
    else:
        return 1.0
    steps = coefficient_scale(schedule, vpp)
    chunks = vpp if schedule == "zb-interleaved" else 1
    # Rounded up, less a hair so that an exact multiple stays put.
    return math.ceil(beta / chunks * steps - 1e-9) / steps


def pipeline_time_s(schedule: str, rank_times_s: list[float], num_microbatches: int, vpp: int = 1,
                    weight_grad_share: float = 0.0, forward_share: float = FORWARD_SHARE) -> float:
    slowest, total = max(rank_times_s), sum(rank_times_s)
    beta = bubble_factor(schedule, vpp, weight_grad_share, forward_share)
    return num_microbatches * slowest + beta * (total - slowest)


def paired_share(schedule: str, pp: int, num_microbatches: int) -> float:
    """Share of a rank's forward and backward chunks that the schedule runs as
    overlapped pairs, one micro-batch's forward beside another's backward, whose
    communication can hide behind each other's computation (DeepSeek-V3 report §3.2.1):
    dualpipev's OVERLAP_F_B actions, 2m - 3pp + r + 1 on rank r of pp (one fewer on the
    last) out of 2m forward chunks, the least on rank 0 (torch's
    ScheduleDualPipeV._calculate_single_rank_operations, steps 4 and 5; counted in
    tests/costmodel/terms/test_pipeline.py). Other schedules pair none."""
    if schedule != "dualpipev" or num_microbatches <= 0:
        return 0.0
    pairs = 2 * num_microbatches - 3 * pp + 1 - (1 if pp == 1 else 0)
    return min(1.0, max(0, pairs) / (2 * num_microbatches))


def pipeline_coefficients(schedule: str, num_microbatches: int, vpp: int = 1,
                          weight_grad_share: float = 0.0, forward_share: float = FORWARD_SHARE) -> tuple[float, float]:
    """(a, c) with pipeline time = a * max_r t_r + c * sum_r t_r: the linear form the
    partition solver minimises."""
    beta = bubble_factor(schedule, vpp, weight_grad_share, forward_share)
    return num_microbatches - beta, beta


def coefficient_scale(schedule: str, vpp: int = 1) -> int:
    """The least integer that makes both coefficients whole numbers."""
    if schedule == "zb-interleaved":
        return BUBBLE_STEPS * vpp
    if schedule in ("zbv", "dualpipev"):
        return BUBBLE_STEPS
    return vpp if schedule == "interleaved" else 1
