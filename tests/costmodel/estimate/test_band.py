"""costmodel.estimate.band: an estimate's band is its step time and peak memory times
the runtime profile's measured ratios."""

from dataclasses import replace

import pytest
from costmodel_test_helpers import problem, strategy

from costmodel.estimate import estimate
from costmodel.estimate.band import band
from costmodel.specs.loading import load_runtime


def test_band_scales_time_and_memory_by_the_runtime_ratios():
    runtime = replace(load_runtime(), step_time_low_ratio=0.96, step_time_high_ratio=1.4, memory_high_ratio=1.05)
    p = problem("tiny-llama", global_batch=8, runtime=runtime)
    e = estimate(p, strategy(p, dp=2, micro_batch_size=4))
    b = band(e, runtime)
    assert b.step_time_low_s == pytest.approx(0.96 * e.step_time_s, rel=1e-12)
    assert b.step_time_high_s == pytest.approx(1.4 * e.step_time_s, rel=1e-12)
    assert b.peak_memory_high_bytes == pytest.approx(1.05 * e.peak_memory_bytes, rel=1e-12)


def test_a_runtime_without_measurements_has_no_band():
    runtime = replace(load_runtime(), step_time_low_ratio=1.0, step_time_high_ratio=1.0, memory_high_ratio=1.0)
    p = problem("tiny-gpt", global_batch=8, runtime=runtime)
    e = estimate(p, strategy(p, dp=1, micro_batch_size=8))
    b = band(e, runtime)
    assert (b.step_time_low_s, b.step_time_high_s, b.peak_memory_high_bytes) == (
        e.step_time_s, e.step_time_s, e.peak_memory_bytes)
