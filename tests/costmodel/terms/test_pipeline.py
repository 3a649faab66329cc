"""costmodel.terms.pipeline: step time of the pipelined part, (m - 1) * max + sum for
GPipe/1F1B and m * max + (sum - max) / vpp interleaved (Narayanan et al. 2021 §2.2)."""

from __future__ import annotations

import pytest

from costmodel.terms.pipeline import pipeline_coefficients, pipeline_time_s

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
