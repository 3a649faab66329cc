"""costmodel.terms.pipeline: step time of the pipelined part, (m - 1) * max + sum for
GPipe/1F1B and m * max + (sum - max) / vpp interleaved (Narayanan et al. 2021 §2.2);
zero-bubble schedules fill the bubble with weight gradients (Qi et al. 2024)."""

from __future__ import annotations

import pytest

from costmodel.terms.pipeline import (
    WEIGHT_SHARE_STEPS,
    bubble_factor,
    coefficient_scale,
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
    (p - 1)(T_F + T_B + T_W). Equal passes T_F = T_B = T_W = 1 (w = 1/3, quantised to
    10/32): bubble 3 * (3 - 2 * 30/32) ... the rank time t = 3, so 3 * 3 * (1 - 20/32)."""
    p, m, t = 4, 8, 3.0
    w = 1 / 3
    total = pipeline_time_s("zb-interleaved", [t] * p, m, 1, w)
    assert total == pytest.approx(m * t + (p - 1) * t * (1 - 2 * 10 / 32), rel=1e-12)
    # An exact share: the bubble (p - 1)(T_F + T_B - T_W) with T_W = t/4 exactly.
    exact = pipeline_time_s("zb-interleaved", [t] * p, m, 1, 0.25)
    assert exact - m * t == pytest.approx((p - 1) * (t - 2 * t / 4), rel=1e-12)
    assert exact < pipeline_time_s("1f1b", [t] * p, m)


def test_zb_interleaved_chunks_divide_the_bubble_as_interleaved():
    base = pipeline_time_s("zb-interleaved", UNEVEN, 8, 1, 0.25) - 8 * 4.0
    assert pipeline_time_s("zb-interleaved", UNEVEN, 8, 3, 0.25) - 8 * 4.0 == pytest.approx(base / 3, rel=1e-12)


def test_zbv_has_no_bubble_when_the_passes_are_equal():
    """Qi et al. §6: ZB-V reaches zero bubble at T_F = T_B = T_W (w = 1/3 and above);
    below, the chunk bubble (t/2)(1 - 3w)."""
    assert bubble_factor("zbv", 2, 11 / 32) == 0.0
    assert bubble_factor("zbv", 2, 0.5) == 0.0
    assert bubble_factor("zbv", 2, 0.25) == pytest.approx((1 - 3 * 0.25) / 2, rel=1e-12)
    assert pipeline_time_s("zbv", UNEVEN, 8, 2, 0.25) == pytest.approx(8 * 4.0 + (10.0 - 4.0) * 0.125, rel=1e-12)


def test_no_weight_gradient_share_leaves_the_1f1b_and_interleaved_bubbles():
    assert pipeline_time_s("zb-interleaved", UNEVEN, 8, 1, 0.0) == pipeline_time_s("1f1b", UNEVEN, 8)
    assert pipeline_time_s("zb-interleaved", UNEVEN, 8, 2, 0.0) == pipeline_time_s("interleaved", UNEVEN, 8, 2)
    assert bubble_factor("zbv", 2, 0.0) == 0.5


def test_the_share_is_quantised_down_to_the_larger_bubble():
    w = 0.3   # 9.6 / 32 -> 9 / 32
    assert bubble_factor("zb-interleaved", 1, w) == pytest.approx(1 - 2 * 9 / 32, rel=1e-12)
    assert bubble_factor("zb-interleaved", 1, w) >= 1 - 2 * w


@pytest.mark.parametrize("schedule, vpp", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 5),
                                           ("zb-interleaved", 1), ("zb-interleaved", 3), ("zbv", 2)])
@pytest.mark.parametrize("share", [0.0, 0.1, 1 / 3, 0.29, 0.5])
def test_the_scale_makes_the_coefficients_whole(schedule, vpp, share):
    """The partition solver's integer program multiplies both coefficients by the scale."""
    a, c = pipeline_coefficients(schedule, 12, vpp, share)
    scale = coefficient_scale(schedule, vpp)
    assert a * scale == pytest.approx(round(a * scale), abs=1e-9)
    assert c * scale == pytest.approx(round(c * scale), abs=1e-9)
    assert scale <= WEIGHT_SHARE_STEPS * max(vpp, 2)
    assert a * max(UNEVEN) + c * sum(UNEVEN) == pytest.approx(pipeline_time_s(schedule, UNEVEN, 12, vpp, share),
                                                             rel=1e-12)
