"""costmodel.terms.pipeline: step time of the pipelined part, (m - 1) * max + sum for
GPipe/1F1B and m * max + (sum - max) / vpp interleaved (Narayanan et al. 2021 §2.2);
zero-bubble schedules fill the bubble with weight gradients (Qi et al. 2024)."""

from __future__ import annotations

import itertools
import types

import pytest

from costmodel.terms.memory import loss_microbatches_held
from costmodel.terms.pipeline import (
    BUBBLE_STEPS,
    bubble_factor,
    coefficient_scale,
    paired_share,
    pipeline_coefficients,
    pipeline_time_s,
)

UNEVEN = [1.0, 2.0, 3.0, 4.0]  # sum 10, max 4


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b(schedule):
    assert pipeline_time_s(schedule, UNEVEN, 8) == (8 - 1) * 4.0 + 10.0 == 38.0
    assert pipeline_time_s(schedule, UNEVEN, 1) == 10.0  # one micro-batch passes every rank once


def test_interleaved():
    assert pipeline_time_s("interleaved", UNEVEN, 8, vpp=2) == 8 * 4.0 + (10.0 - 4.0) / 2 == 35.0
    assert pipeline_time_s("interleaved", UNEVEN, 8, vpp=3) == pytest.approx(32.0 + 6.0 / 3)


def test_interleaved_with_one_chunk_is_1f1b():
    assert pipeline_time_s("interleaved", UNEVEN, 8, vpp=1) == pipeline_time_s("1f1b", UNEVEN, 8)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 16), (8, 64)])
def test_equal_stages_bubble_is_p_minus_1_over_m(p, m):
    t = 0.25
    total = pipeline_time_s("1f1b", [t] * p, m)
    assert total == pytest.approx((m + p - 1) * t, rel=1e-12)
    assert (total - m * t) / (m * t) == pytest.approx((p - 1) / m, rel=1e-12)


@pytest.mark.parametrize("p, m, v", [(4, 16, 2), (8, 64, 3)])
def test_equal_stages_interleaved_bubble_shrinks_by_vpp(p, m, v):
    t = 0.25
    total = pipeline_time_s("interleaved", [t] * p, m, v)
    assert (total - m * t) / (m * t) == pytest.approx((p - 1) / (v * m), rel=1e-12)


def test_single_stage_has_no_bubble():
    assert pipeline_time_s("1f1b", [0.5], 10) == pytest.approx(5.0)
    assert pipeline_time_s("gpipe", [0.5], 10) == pytest.approx(5.0)


@pytest.mark.parametrize("schedule, m, vpp, expected", [
    ("1f1b", 8, 1, (7.0, 1.0)),
    ("gpipe", 8, 1, (7.0, 1.0)),
    ("interleaved", 8, 2, (8 - 1 / 2, 1 / 2)),
    ("interleaved", 8, 1, (7.0, 1.0)),
])
def test_coefficients(schedule, m, vpp, expected):
    a, c = pipeline_coefficients(schedule, m, vpp)
    assert (a, c) == pytest.approx(expected)
    assert a * max(UNEVEN) + c * sum(UNEVEN) == pytest.approx(pipeline_time_s(schedule, UNEVEN, m, vpp), rel=1e-12)


# -- zero bubble ------------------------------------------------------------------------

def test_zb_interleaved_bubble_is_zb_h1s():
    """Qi et al. 2024 §3: ZB-H1's bubble (p - 1)(T_F + T_B - T_W) against 1F1B's
    (p - 1)(T_F + T_B + T_W). T_F = 1, T_B = 2, T_W = 1 on a rank time t = 4 (f = w =
    1/4): the bubble 3 * (1 + 2 - 1) = 6, a multiple of t / 64, so not rounded."""
    p, m, t = 4, 8, 4.0
    total = pipeline_time_s("zb-interleaved", [t] * p, m, 1, 0.25, 0.25)
    assert total == m * t + (p - 1) * (1.0 + 2.0 - 1.0)
    assert total < pipeline_time_s("1f1b", [t] * p, m)
    # Past T_W = T_F the longer of the passes is the bubble: T_F = 1, T_B = 0.5, T_W = 1.5.
    assert bubble_factor("zb-interleaved", 1, 0.5, 1 / 3) == pytest.approx(1 / 3, abs=1 / 64)


def test_zb_interleaved_chunks_divide_the_bubble_as_interleaved():
    base = pipeline_time_s("zb-interleaved", UNEVEN, 8, 1, 0.25) - 8 * 4.0
    assert pipeline_time_s("zb-interleaved", UNEVEN, 8, 2, 0.25) - 8 * 4.0 == pytest.approx(base / 2, rel=1e-12)


def test_zbv_and_dualpipev_by_hand():
    """f = w = 1/4, b = 1/2. zbv: max(b - w, b/2, f - b/2) = 1/4. dualpipev:
    max((f + 2b - w)/2, f + (b - w)/2, f) = max(1/2, 3/8, 1/4) = 1/2."""
    assert bubble_factor("zbv", 2, 0.25, 0.25) == 0.25
    assert bubble_factor("dualpipev", 2, 0.25, 0.25) == 0.5
    assert pipeline_time_s("zbv", UNEVEN, 8, 2, 0.25, 0.25) == 8 * 4.0 + (10.0 - 4.0) * 0.25
    # Equal passes (f = w = 1/3): torch's zbv keeps a sixth of 1F1B's bubble, dualpipev a third.
    assert bubble_factor("zbv", 2, 1 / 3, 1 / 3) == pytest.approx(1 / 6, abs=1 / 64)
    assert bubble_factor("dualpipev", 2, 1 / 3, 1 / 3) == pytest.approx(1 / 3, abs=1 / 64)


def test_no_weight_gradient_share_leaves_the_1f1b_and_interleaved_bubbles():
    assert pipeline_time_s("zb-interleaved", UNEVEN, 8, 1, 0.0) == pipeline_time_s("1f1b", UNEVEN, 8)
    assert pipeline_time_s("zb-interleaved", UNEVEN, 8, 2, 0.0) == pipeline_time_s("interleaved", UNEVEN, 8, 2)


def test_the_bubble_is_rounded_up():
    """1 - 2w at w = 0.3 is 0.4 = 25.6 / 64: 26 / 64, the larger bubble."""
    assert bubble_factor("zb-interleaved", 1, 0.3) == 26 / 64


@pytest.mark.parametrize("schedule, vpp", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 5),
                                           ("zb-interleaved", 1), ("zb-interleaved", 3), ("zbv", 2),
                                           ("dualpipev", 2)])
@pytest.mark.parametrize("share", [0.0, 0.1, 1 / 3, 0.29, 0.5])
def test_the_scale_makes_the_coefficients_whole(schedule, vpp, share):
    """The partition solver's integer program multiplies both coefficients by the scale."""
    a, c = pipeline_coefficients(schedule, 12, vpp, share, 0.3)
    scale = coefficient_scale(schedule, vpp)
    assert a * scale == pytest.approx(round(a * scale), abs=1e-9)
    assert c * scale == pytest.approx(round(c * scale), abs=1e-9)
    assert scale <= BUBBLE_STEPS * vpp
    assert a * max(UNEVEN) + c * sum(UNEVEN) == pytest.approx(pipeline_time_s(schedule, UNEVEN, 12, vpp, share, 0.3),
                                                             rel=1e-12)


# -- the formulas against torch's own schedules -----------------------------------------

def torch_order(schedule: str, pp: int, m: int, vpp: int) -> dict[int, list]:
    """Each rank's actions as torch.distributed.pipelining builds them (its
    `_calculate_single_rank_operations`, called on the attributes it reads), bubbles
    dropped."""
    from torch.distributed.pipelining import schedules

    cls = {"zb-interleaved": schedules.ScheduleInterleavedZeroBubble, "zbv": schedules.ScheduleZBVZeroBubble,
           "dualpipev": schedules.ScheduleDualPipeV, "interleaved": schedules.ScheduleInterleaved1F1B}[schedule]
    rounds = max(1, m // pp)
    attrs = types.SimpleNamespace(pp_group_size=pp, _n_microbatches=m, n_local_stages=vpp, num_stages=vpp * pp,
                                  _num_stages=vpp * pp, number_of_rounds=rounds, microbatches_per_round=m // rounds)
    return {r: [a for a in cls._calculate_single_rank_operations(attrs, r) if a is not None] for r in range(pp)}


def simulated_bubble(schedule: str, pp: int, m: int, vpp: int, f: float, w: float) -> float:
    """beta of torch's order list-simulated: every chunk's forward f / vpp, input
    gradient (1 - f - w) / vpp and weight gradient w / vpp of a rank time 1, each action
    starting when its rank is free and its input is there; an overlapped forward and
    backward pair runs one after the other."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    stages = pp * vpp
    seconds = {C.FORWARD: f / vpp, C.BACKWARD_INPUT: (1 - f - w) / vpp, C.BACKWARD_WEIGHT: w / vpp,
               C.FULL_BACKWARD: (1 - f) / vpp}
    kind = {C.FORWARD: "F", C.BACKWARD_INPUT: "I", C.FULL_BACKWARD: "I", C.BACKWARD_WEIGHT: "W"}
    orders = torch_order(schedule, pp, m, vpp)
    done: dict[tuple[str, int, int], float] = {}

    def ready(action) -> float | None:
        s, i, what = action.stage_index, action.microbatch_index, kind[action.computation_type]
        if what == "F":
            return 0.0 if s == 0 else done.get(("F", s - 1, i))
        if what == "I":
            return done.get(("F", s, i)) if s == stages - 1 else done.get(("I", s + 1, i))
        return done.get(("I", s, i))

    position, free = dict.fromkeys(orders, 0), dict.fromkeys(orders, 0.0)
    moved = True
    while moved:
        moved = False
        for r, actions in orders.items():
            while position[r] < len(actions):
                action = actions[position[r]]
                parts = action.sub_actions if action.computation_type == C.OVERLAP_F_B else (action,)
                starts = [ready(part) for part in parts]
                if None in starts:
                    break
                t = max([free[r], *starts])
                for part in parts:
                    t += seconds[part.computation_type]
                    done[(kind[part.computation_type], part.stage_index, part.microbatch_index)] = t
                free[r], position[r], moved = t, position[r] + 1, True
    assert all(position[r] == len(orders[r]) for r in orders)
    return (max(free.values()) - m) / (pp - 1)


@pytest.mark.parametrize("schedule, vpp, above", [("zb-interleaved", 1, 1 / 64), ("zb-interleaved", 2, 1 / 64),
                                                  ("zbv", 2, 0.09), ("dualpipev", 2, 0.18)])
def test_the_bubble_is_never_below_torchs_schedule(schedule, vpp, above):
    """For pp 2 to 8, forward shares 1/4 to 0.4 and weight-gradient shares up to the
    forward's, beta is at least the simulated one (a low time is the misleading side)
    and at most `above` over it (zbv and dualpipev are furthest over at pp 2)."""
    for pp, f in itertools.product((2, 4, 8), (0.25, 1 / 3, 0.4)):
        for w in [k / 24 for k in range(0, 9) if k / 24 <= f]:
            simulated = simulated_bubble(schedule, pp, 2 * pp * vpp if schedule == "zb-interleaved" else 2 * pp,
                                         vpp, f, w)
            beta = bubble_factor(schedule, vpp, w, f)
            assert simulated - 1e-9 <= beta <= simulated + above, (pp, f, w, simulated, beta)


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 13), (8, 40), (16, 120)])
def test_paired_share_counts_torchs_overlapped_pairs(pp, m):
    # dualpipev's OVERLAP_F_B actions over the 2m forward chunks, on the rank with the fewest.
    from torch.distributed.pipelining.schedules import _ComputationType as C

    orders = torch_order("dualpipev", pp, m, 2)
    pairs = min(sum(a.computation_type == C.OVERLAP_F_B for a in actions) for actions in orders.values())
    assert paired_share("dualpipev", pp, m) == pairs / (2 * m)
    assert paired_share("zbv", pp, m) == paired_share("1f1b", pp, m) == 0.0


@pytest.mark.parametrize("schedule, vpp", [("interleaved", 2), ("zb-interleaved", 1), ("zb-interleaved", 2),
                                           ("zbv", 2), ("dualpipev", 2)])
@pytest.mark.parametrize("pp, m", [(2, 8), (4, 8), (4, 16), (8, 32), (16, 120)])
def test_loss_microbatches_held_counts_torchs_last_stage(schedule, vpp, pp, m):
    # Micro-batches between the last stage's forward and its weight gradient (or whole
    # backward), the most at once, on the rank that holds it.
    from torch.distributed.pipelining.schedules import _ComputationType as C

    last, held = pp * vpp - 1, 0
    for actions in torch_order(schedule, pp, m, vpp).values():
        live = set()
        for action in actions:
            for part in action.sub_actions if action.computation_type == C.OVERLAP_F_B else (action,):
                if part.stage_index != last:
                    continue
                if part.computation_type == C.FORWARD:
                    live.add(part.microbatch_index)
                elif part.computation_type in (C.FULL_BACKWARD, C.BACKWARD_WEIGHT):
                    live.discard(part.microbatch_index)
                held = max(held, len(live))
    assert loss_microbatches_held(schedule, pp, m) == held
