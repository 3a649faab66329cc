"""Property tests (hypothesis): the estimate moves in the right direction when one knob
moves, and the building blocks keep their algebraic invariants. Examples are few and
deadlines off so the file runs in seconds."""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from costmodel.estimate import estimate
from costmodel.problem import Problem
from costmodel.specs.loading import as_int, load_cluster, load_model, make_training
from costmodel.strategy import Strategy, even_stages
from costmodel.terms.comm import Placement, collective_time_s
from costmodel.terms.memory import in_flight_microbatches, layer_activation_bytes
from costmodel.terms.pipeline import pipeline_coefficients, pipeline_time_s

FEW = settings(max_examples=30, deadline=None)
MODELS = ["tiny-gpt", "tiny-llama", "tiny-moe", "gpt3-1.3b", "llama2-7b"]


@lru_cache(maxsize=None)
def model(name: str, layers: int | None = None):
    return load_model(name, overrides={"num_hidden_layers": str(layers)} if layers else None)


@lru_cache(maxsize=None)
def cluster(gpus: int):
    return load_cluster("dgx-a100-80gb", gpus=gpus)


def estimate_for(name, dp=1, tp=1, pp=1, mbs=1, m=4, vpp=1, schedule=None, zero=0, recompute="none",
                 sp=False, flash=True, layers=None, seq=None):
    mm = model(name, layers)
    cc = cluster(max(8, dp * tp * pp))
    tt = make_training(mm, cc, dp * mbs * m, seq or min(mm.max_position_embeddings, 2048), flash_attention=flash)
    schedule = schedule or ("interleaved" if vpp > 1 else "1f1b")
    s = Strategy(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=m, vpp=vpp, schedule=schedule,
                 zero_stage=zero, sequence_parallel=sp)
    s = s.with_stages(even_stages(mm.num_hidden_layers, pp, vpp, recompute))
    return estimate(Problem(mm, cc, tt), s)


shapes = st.fixed_dictionaries({
    "name": st.sampled_from(MODELS),
    "dp": st.sampled_from([1, 2, 4]),
    "tp": st.sampled_from([1, 2, 4]),
    "mbs": st.sampled_from([1, 2]),
    "zero": st.integers(0, 3),
    "recompute": st.sampled_from(["none", "selective", "full"]),
    "sp": st.booleans(),
    "flash": st.booleans(),
})


# ------------------------------------------------------------------ estimate monotonicity
@FEW
@given(shape=shapes, pp=st.sampled_from([2, 4]), m=st.integers(1, 16), more=st.integers(1, 16),
       schedule=st.sampled_from(["1f1b", "gpipe", "interleaved"]))
def test_more_microbatches_shrink_the_bubble_fraction(shape, pp, m, more, schedule):
    vpp = 2 if schedule == "interleaved" else 1
    a = estimate_for(pp=pp, m=m, vpp=vpp, schedule=schedule, **shape)
    b = estimate_for(pp=pp, m=m + more, vpp=vpp, schedule=schedule, **shape)
    assert a.time.bubble_s > 0
    assert b.time.bubble_s / b.step_time_s < a.time.bubble_s / a.step_time_s
    # the bubble itself does not depend on m: (sum - max) / vpp
    assert b.time.bubble_s == _approx(a.time.bubble_s)


@FEW
@given(shape=shapes, pp=st.sampled_from([1, 2, 4]), m=st.integers(1, 16), more=st.integers(1, 16))
def test_larger_global_batch_never_lowers_throughput(shape, pp, m, more):
    a = estimate_for(pp=pp, m=m, **shape)
    b = estimate_for(pp=pp, m=m + more, **shape)
    assert b.tokens_per_s >= a.tokens_per_s * (1 - 1e-12)
    assert b.step_time_s > a.step_time_s


@FEW
@given(shape=shapes, pp=st.sampled_from([1, 2]), schedule=st.sampled_from(["1f1b", "gpipe"]))
def test_full_recompute_never_holds_more_activations(shape, pp, schedule):
    shape = {**shape, "recompute": "none"}
    name = shape["name"]
    assume(model(name).num_hidden_layers // pp >= 2)  # one layer per rank: the working set dominates
    none = estimate_for(pp=pp, schedule=schedule, **shape)
    full = estimate_for(pp=pp, schedule=schedule, **{**shape, "recompute": "full"})
    sel = estimate_for(pp=pp, schedule=schedule, **{**shape, "recompute": "selective"})
    for r in range(pp):
        assert full.rank_memory_bytes[r] <= none.rank_memory_bytes[r]
        assert sel.rank_memory_bytes[r] <= none.rank_memory_bytes[r]
    assert full.memory.activations_bytes <= none.memory.activations_bytes
    assert full.hfu >= full.mfu and full.step_time_s > none.step_time_s


@FEW
@given(shape=shapes, pp=st.sampled_from([1, 2]))
def test_higher_zero_stage_never_holds_more_memory(shape, pp):
    dp = max(2, shape["dp"])
    shape = {**shape, "dp": dp}
    peaks = [estimate_for(pp=pp, **{**shape, "zero": z}) for z in range(4)]
    for r in range(pp):
        mem = [e.rank_memory_bytes[r] for e in peaks]
        assert mem[0] > mem[1] > mem[2]  # optimizer states, then gradients, sharded over dp > 1
        layers_per_rank = model(shape["name"]).num_hidden_layers // pp
        # ZeRO-3 trades FSDP2's buffers (unsharded weights, all-gather output, reduce-scatter
        # input, unsharded gradients: 8 bytes/param of one unit; a tied root unit held adds
        # 4 of the embedding) for 2(1-1/dp) bytes/param of every local layer: a sure saving
        # once layers_per_rank * (1 - 1/dp) > 6.
        if layers_per_rank * (1 - 1 / dp) > 6:
            assert mem[3] < mem[2]


@FEW
@given(name=st.sampled_from(["tiny-moe", "mixtral-8x7b"]), dp=st.sampled_from([2, 4, 8]), ep=st.sampled_from([1, 2, 4]),
       zero=st.integers(0, 3), low=st.floats(1.0, 3.0), more=st.floats(0.01, 3.0))
def test_a_busier_expert_rank_never_costs_less(name, dp, ep, zero, low, more):
    """moe_load_imbalance: step time and peak memory never fall as the busiest ep rank's
    share grows, and the step slows while the share stays within ep."""
    assume(dp % ep == 0)
    base = model(name, 2)
    cc = cluster(dp)
    s = Strategy(dp=dp, tp=1, pp=1, micro_batch_size=1, num_microbatches=2, ep=ep, zero_stage=zero)
    s = s.with_stages(even_stages(2, 1, 1, "none"))
    a, b = (estimate(Problem(m, cc, make_training(m, cc, 2 * dp, 512)), s)
            for m in (dataclasses.replace(base, moe_load_imbalance=x) for x in (low, low + more)))
    assert b.step_time_s >= a.step_time_s and b.peak_memory_bytes >= a.peak_memory_bytes
    if ep > 1 and low < ep:
        assert b.step_time_s > a.step_time_s


@FEW
@given(shape=shapes, pp=st.sampled_from([1, 2]), layers=st.integers(2, 12), more=st.integers(1, 12))
def test_more_layers_cost_more_time_and_memory(shape, pp, layers, more):
    a = estimate_for(pp=pp, layers=layers, **shape)
    b = estimate_for(pp=pp, layers=layers + more, **shape)
    assert b.step_time_s > a.step_time_s
    assert b.peak_memory_bytes >= a.peak_memory_bytes
    assert all(y >= x for x, y in zip(a.rank_memory_bytes, b.rank_memory_bytes))
    assert sum(b.rank_memory_bytes) > sum(a.rank_memory_bytes)


@FEW
@given(shape=shapes, pp=st.sampled_from([1, 2, 4]), m=st.integers(1, 8), vpp=st.sampled_from([1, 2]))
def test_breakdowns_always_add_up(shape, pp, m, vpp):
    e = estimate_for(pp=pp, m=m, vpp=vpp, **shape)
    assert sum(dataclasses.astuple(e.time)) == _approx(e.step_time_s)
    assert e.memory.total_bytes == _approx(e.peak_memory_bytes)
    assert e.hfu >= e.mfu > 0
    if shape["tp"] == 1:
        assert e.time.tp_comm_s == 0.0
    if pp == 1:
        assert e.time.pp_comm_s == 0.0 and e.time.bubble_s == _approx(0.0)


@FEW
@given(shape=shapes)
def test_sequence_parallel_never_holds_more_activations(shape):
    tp = max(2, shape["tp"])
    off = estimate_for(**{**shape, "tp": tp, "sp": False})
    on = estimate_for(**{**shape, "tp": tp, "sp": True})
    assert on.memory.activations_bytes < off.memory.activations_bytes


# ------------------------------------------------------------------ building blocks
@FEW
@given(name=st.sampled_from(MODELS), b=st.integers(1, 8), tp=st.sampled_from([1, 2, 4]), sp=st.booleans(),
       flash=st.booleans(), seq=st.sampled_from([64, 512, 2048]))
def test_activation_bytes_ordering(name, b, tp, sp, flash, seq):
    mm = model(name)
    # Megatron's recipe: linear in the micro-batch (under autocast each forward's bf16
    # weight copies are a per-micro-batch constant).
    tt = make_training(mm, cluster(8), 8, seq, flash_attention=flash, mixed_precision="megatron")
    full, sel, none = (layer_activation_bytes(mm, tt, b, tp, sp, r) for r in ("full", "selective", "none"))
    assert full < sel <= none
    assert layer_activation_bytes(mm, tt, b, tp, True, "none") <= layer_activation_bytes(mm, tt, b, tp, False, "none")
    assert layer_activation_bytes(mm, tt, 2 * b, tp, sp, "none") == _approx(2 * none)  # linear in micro-batch


@FEW
@given(times=st.lists(st.floats(1e-4, 10.0), min_size=1, max_size=8), m=st.integers(1, 64), vpp=st.integers(1, 4),
       schedule=st.sampled_from(["1f1b", "gpipe", "interleaved"]))
def test_pipeline_coefficients_agree_with_pipeline_time(times, m, vpp, schedule):
    a, c = pipeline_coefficients(schedule, m, vpp)
    total = pipeline_time_s(schedule, times, m, vpp)
    assert a * max(times) + c * sum(times) == _approx(total)
    assert total >= m * max(times) * (1 - 1e-12)               # the slowest rank is busy m times
    assert total <= pipeline_time_s("1f1b", times, m) * (1 + 1e-12)  # interleaving never hurts


@FEW
@given(layers=st.integers(1, 130), pp=st.integers(1, 16), vpp=st.integers(1, 4),
       recompute=st.sampled_from(["none", "selective", "full"]))
def test_even_stages_partition_the_layers(layers, pp, vpp, recompute):
    stages = even_stages(layers, pp, vpp, recompute)
    assert len(stages) == pp * vpp
    assert [s.index for s in stages] == list(range(pp * vpp))
    assert sum(s.num_layers for s in stages) == layers
    assert [s.first_layer for s in stages] == [sum(x.num_layers for x in stages[:i]) for i in range(len(stages))]
    sizes = [s.num_layers for s in stages]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert all(s.pp_rank == s.index % pp for s in stages)
    assert all(s.plain_layers == (s.num_layers if recompute == "none" else 0) for s in stages)


@FEW
@given(pp=st.integers(2, 16), m=st.integers(1, 64), vpp=st.integers(2, 4))
def test_in_flight_bounds(pp, m, vpp):
    for r in range(pp):
        one = in_flight_microbatches("1f1b", pp, r, m)
        gpipe = in_flight_microbatches("gpipe", pp, r, m)
        inter = in_flight_microbatches("interleaved", pp, r, m, vpp)
        assert 1 <= one <= gpipe == m
        assert inter <= m
    assert in_flight_microbatches("1f1b", pp, 0, m) == max(in_flight_microbatches("1f1b", pp, r, m) for r in range(pp))


@FEW
@given(kind=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]),
       nbytes=st.floats(1.0, 1e10), factor=st.floats(1.01, 100.0),
       group=st.sampled_from([Placement(2, 2, 1), Placement(8, 8, 1), Placement(16, 8, 2), Placement(4, 1, 4)]))
def test_collectives_grow_with_bytes_and_shrink_with_bandwidth(kind, nbytes, factor, group):
    c = cluster(64)
    t = collective_time_s(kind, nbytes, group, c)
    assert t > 0
    assert collective_time_s(kind, nbytes * factor, group, c) > t
    faster = dataclasses.replace(
        c, intra_node=dataclasses.replace(c.intra_node, bandwidth_bytes_per_s=c.intra_node.bandwidth_bytes_per_s * factor),
        inter_node=dataclasses.replace(c.inter_node, bandwidth_bytes_per_s=c.inter_node.bandwidth_bytes_per_s * factor))
    assert collective_time_s(kind, nbytes, group, faster) < t


@FEW
@given(n=st.integers(1, 10**12))
def test_as_int_round_trips(n):
    assert as_int(n, "f") == n
    assert as_int(str(n), "f") == n
    assert as_int(float(n), "f") == n  # exact in a double below 2**53


def _approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-12)
