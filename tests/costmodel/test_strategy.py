"""costmodel.strategy: the Strategy value, stage layout (Megatron's interleaved
assignment), recompute summary and the tp-dp-pp rank order."""

from __future__ import annotations

import dataclasses

import pytest

from costmodel.strategy import (
    RECOMPUTE_MODES,
    SCHEDULES,
    Stage,
    Strategy,
    even_stages,
    expert_layout_error,
    rank_stage_indices,
    schedule_microbatch_error,
    schedule_vpp_error,
    stage_rank,
    summarize_recompute,
)


def test_constants():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb-interleaved", "zbv", "dualpipev")
    assert RECOMPUTE_MODES == ("none", "selective", "full")


def test_stage_properties():
    s = Stage(index=2, pp_rank=1, first_layer=10, num_layers=5, full_recompute_layers=2, selective_recompute_layers=1)
    assert s.last_layer == 10 + 5 - 1 == 14
    assert s.plain_layers == 5 - 2 - 1 == 2


def test_even_stages_divisible():
    stages = even_stages(48, 4)
    assert [(s.index, s.pp_rank, s.first_layer, s.num_layers) for s in stages] == \
        [(0, 0, 0, 12), (1, 1, 12, 12), (2, 2, 24, 12), (3, 3, 36, 12)]
    assert all(s.full_recompute_layers == s.selective_recompute_layers == 0 for s in stages)


def test_even_stages_remainder_goes_to_earlier_stages():
    stages = even_stages(10, 4)  # divmod(10, 4) = (2, 2): stages 0 and 1 get 3
    assert [s.num_layers for s in stages] == [3, 3, 2, 2]
    assert [s.first_layer for s in stages] == [0, 3, 6, 8]
    assert stages[-1].last_layer == 9


def test_even_stages_interleaved_layout():
    stages = even_stages(96, 8, vpp=3)  # 24 virtual stages of 4 layers, stage i on rank i % 8
    assert len(stages) == 24
    assert all(s.num_layers == 4 for s in stages)
    assert [s.pp_rank for s in stages] == [i % 8 for i in range(24)]
    strat = Strategy(dp=1, tp=8, pp=8, vpp=3, micro_batch_size=1, num_microbatches=64).with_stages(stages)
    assert [(s.index, s.first_layer) for s in strat.rank_stages(0)] == [(0, 0), (8, 32), (16, 64)]
    assert [(s.index, s.first_layer) for s in strat.rank_stages(7)] == [(7, 28), (15, 60), (23, 92)]


@pytest.mark.parametrize("mode, full, selective", [("none", 0, 0), ("selective", 0, 6), ("full", 6, 0)])
def test_even_stages_recompute(mode, full, selective):
    stages = even_stages(12, 2, recompute=mode)
    assert [(s.full_recompute_layers, s.selective_recompute_layers) for s in stages] == [(full, selective)] * 2
    assert summarize_recompute(stages) == mode


def test_summarize_mixed():
    stages = (Stage(0, 0, 0, 4, full_recompute_layers=4), Stage(1, 1, 4, 4))
    assert summarize_recompute(stages) == "mixed"
    assert summarize_recompute((Stage(0, 0, 0, 4, 2, 2),)) == "mixed"


def test_with_stages_sets_recompute_and_keeps_the_rest():
    base = Strategy(dp=2, tp=4, pp=2, micro_batch_size=2, num_microbatches=8, zero_stage=1, sequence_parallel=True)
    assert base.recompute == "none" and base.stages == ()
    s = base.with_stages(even_stages(8, 2, recompute="full"))
    assert s.recompute == "full" and len(s.stages) == 2
    assert dataclasses.replace(s, stages=(), recompute="none") == base
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.tp = 8  # type: ignore[misc]


def test_degrees():
    s = Strategy(dp=4, tp=8, pp=16, vpp=2, micro_batch_size=1, num_microbatches=32)
    assert s.num_gpus == 4 * 8 * 16 == 512
    assert s.num_virtual_stages == 16 * 2
    assert (s.ep, s.schedule, s.zero_stage, s.recompute, s.sequence_parallel) == (1, "1f1b", 0, "none", False)


def test_rank_order_is_tp_then_dp_then_pp():
    tp, dp, pp = 2, 3, 4
    s = Strategy(dp=dp, tp=tp, pp=pp, micro_batch_size=1, num_microbatches=4)
    for p in range(pp):
        expected = sorted(t + tp * (d + dp * p) for t in range(tp) for d in range(dp))
        assert s.ranks(p) == tuple(expected)
    assert s.ranks(1) == tuple(range(6, 12))
    assert sorted(r for p in range(pp) for r in s.ranks(p)) == list(range(tp * dp * pp))


def test_zbv_places_the_stages_in_a_v():
    """torch.distributed.pipelining's "v" style: rank r holds stages r and 2pp - 1 - r,
    so the first and the last stage share rank 0."""
    assert [stage_rank(i, 4, "zbv") for i in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_rank(i, 4, "zb-interleaved") for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert rank_stage_indices(1, 4, 2, "zbv") == (1, 6)
    assert rank_stage_indices(1, 4, 2, "interleaved") == (1, 5)
    stages = even_stages(16, 4, vpp=2, schedule="zbv")
    assert [s.pp_rank for s in stages] == [0, 1, 2, 3, 3, 2, 1, 0]
    strat = Strategy(dp=1, tp=1, pp=4, vpp=2, micro_batch_size=1, num_microbatches=8, schedule="zbv").with_stages(stages)
    assert [s.index for s in strat.rank_stages(0)] == [0, 7]
    # DualPipeV runs the same V.
    assert [stage_rank(i, 4, "dualpipev") for i in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_schedule_and_chunk_counts():
    assert schedule_vpp_error("zbv", 2, 4) is None
    assert "vpp 2, not 3" in schedule_vpp_error("zbv", 3, 4)
    assert schedule_vpp_error("zb-interleaved", 1, 4) is None
    assert schedule_vpp_error("zb-interleaved", 3, 4) is None
    assert "vpp of 2 or more" in schedule_vpp_error("interleaved", 1, 4)
    assert "not 1f1b" in schedule_vpp_error("1f1b", 2, 4)
    assert "pp of 2 or more" in schedule_vpp_error("zbv", 2, 1)
    assert schedule_vpp_error("dualpipev", 2, 4) is None
    assert "dualpipev runs two model chunks per rank in a V: vpp 2, not 1" == schedule_vpp_error("dualpipev", 1, 4)


def test_schedule_and_microbatch_counts():
    assert schedule_microbatch_error("gpipe", 4, 1) is None
    assert "at least pp 4" in schedule_microbatch_error("zbv", 4, 3)
    # torch's ScheduleDualPipeV: one micro-batch per virtual stage.
    assert schedule_microbatch_error("dualpipev", 4, 8) is None
    assert "at least 2 x pp = 8 micro-batches, there are 7" in schedule_microbatch_error("dualpipev", 4, 7)
    assert "multiple of pp 4" in schedule_microbatch_error("interleaved", 4, 6)
    # torch's ScheduleInterleavedZeroBubble: rounds of m // pp that must divide m.
    assert schedule_microbatch_error("zb-interleaved", 4, 6) is None       # 1 round of 6
    assert "2 rounds" in schedule_microbatch_error("zb-interleaved", 4, 9)  # 9 // 4 = 2 rounds
    assert schedule_microbatch_error("zb-interleaved", 4, 10) is None      # 2 rounds of 5


def test_a_stage_splits_its_modes_at_the_models_first_layers():
    """Layers 3..8 of a stage, the first 2 fully recomputed and the next 3 selectively:
    (mode, dense-MLP layers, other layers) in layer order, for a model whose first 5 layers
    are dense, one whose every other layer is, and one with none."""
    from costmodel.strategy import Stage

    def upto(dense):
        out = [0]
        for i in range(12):
            out.append(out[-1] + (i in dense))
        return tuple(out)

    stage = Stage(0, 0, 3, 6, full_recompute_layers=2, selective_recompute_layers=3)
    assert stage.layers_by_mode(upto(range(5))) == (("full", 2, 0), ("selective", 0, 3), ("none", 0, 1))
    assert stage.layers_by_mode(upto(range(0, 12, 2))) == (("full", 1, 1), ("selective", 1, 2), ("none", 1, 0))
    assert stage.layers_by_mode(()) == (("full", 0, 2), ("selective", 0, 3), ("none", 0, 1))


@pytest.mark.parametrize("fields, folding, expected", [
    (dict(dp=2, tp=4, ep=8, etp=1, sequence_parallel=True), True, None),   # ep over dp x tp
    (dict(dp=2, tp=4, ep=8, etp=1, sequence_parallel=True), False, "etp"),
    (dict(dp=2, tp=4, ep=8), True, "ep"),          # experts split over tp: ep over dp x cp only
    (dict(dp=2, tp=4, ep=2), False, None),
    (dict(dp=2, tp=4, ep=4, etp=1), True, "etp"),   # whole experts route sequence shards: sp on
    (dict(dp=4, tp=1, ep=4, etp=1), True, "etp"),   # set only where tp > 1
    (dict(dp=8, tp=1, ep=3), True, "ep"),           # 3 does not divide 8 experts
])
def test_expert_layout_error(fields, folding, expected):
    s = Strategy(pp=1, micro_batch_size=1, num_microbatches=1, **fields)
    error = expert_layout_error(s, 8, folding)
    assert (error[0] if error else None) == expected
