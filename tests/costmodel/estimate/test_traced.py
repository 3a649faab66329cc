"""Estimates of traced graphs, term by term against hand-computed values on a small
hand-built model: node compute, pipeline sends across each cut, activation memory with
recomputation and in-flight micro-batches, ZeRO states and gradient sync."""

import pytest
import torch
from torch import nn

from costmodel.estimate.traced import (
    estimate_traced,
    stage_memory,
    stage_work,
    traced_units,
)
from costmodel.problem import NodeCost, TracedModel, TracedProblem
from costmodel.specs import TrainingSpec
from costmodel.specs.loading import load_cluster
from costmodel.strategy import Stage, Strategy
from costmodel.terms import compute
from costmodel.terms.comm import collective_time_s, groups
from costmodel.terms.compute import OPTIMIZER_BYTES_PER_PARAMETER
from costmodel.trace import trace_module

# Three nodes traced on 2 samples in fp32.
NODES = (
    NodeCost("a", forward_flops=4_000_000, backward_flops=8_000_000, parameters=1000, saved_bytes=8000,
             output_bytes=4000, input_bytes=2000, elementwise_bytes=16000),
    NodeCost("b", forward_flops=2_000_000, backward_flops=4_000_000, parameters=3000, saved_bytes=6000,
             output_bytes=4000, input_bytes=4000, elementwise_bytes=8000),
    NodeCost("c", forward_flops=6_000_000, backward_flops=12_000_000, parameters=500, saved_bytes=2000,
             output_bytes=400, input_bytes=8000, elementwise_bytes=4000),
)
MODEL = TracedModel("toy", NODES, cut_bytes=(4000, 8000), glue_parameters=100, traced_batch=2, traced_value_bytes=4)


def problem(precision="fp32"):
    cluster = load_cluster("dgx-a100-80gb", gpus=8)
    return TracedProblem(MODEL, cluster, TrainingSpec(global_batch=32, seq_len=1, precision=precision))


def test_node_compute_is_gemm_flops_plus_memory_bound_bytes():
    p = problem()
    s = Strategy(dp=8, tp=1, pp=1, micro_batch_size=4, num_microbatches=1)
    units = traced_units(p, s)
    gpu = p.cluster.gpu
    peak = gpu.peak_for("fp32") * compute.GEMM_EFFICIENCY_MAX
    # Micro-batch of 4 = twice the traced batch.
    forward_a = 2 * 4e6 / peak + compute.memory_bound_time_s(2 * 16000, p.cluster)
    backward_a = 2 * 8e6 / peak + compute.memory_bound_time_s(2 * 2 * 16000, p.cluster)
    work = stage_work(units, Stage(0, 0, 0, 1))
    assert work.compute_s == pytest.approx(forward_a + backward_a, rel=1e-12)
    assert work.recompute_s == 0 and work.pp_comm_s == 0


def test_pipeline_sends_cross_the_cuts_at_the_stage_ends():
    p = problem("bf16")
    s = Strategy(dp=2, tp=1, pp=4, micro_batch_size=2, num_microbatches=8, zero_stage=0)
    units = traced_units(p, s)
    where = groups(p, s)["pp"]
    # bf16 halves the fp32 trace's bytes; a micro-batch of 2 is the traced batch.
    send = lambda b: collective_time_s("p2p", b, where, p.cluster)  # noqa: E731
    assert stage_work(units, Stage(0, 0, 0, 1)).pp_comm_s == pytest.approx(send(2000))
    assert stage_work(units, Stage(1, 1, 1, 1)).pp_comm_s == pytest.approx(send(2000) + send(4000))
    assert stage_work(units, Stage(2, 2, 2, 1)).pp_comm_s == pytest.approx(send(4000))


def test_stage_memory_by_hand():
    p = problem()
    s = Strategy(dp=2, tp=1, pp=2, micro_batch_size=2, num_microbatches=8, schedule="1f1b", zero_stage=1)
    units = traced_units(p, s)
    # Rank 0 holds a and b (with the root's 100 glue parameters), recomputes a; 1F1B
    # keeps pp - rank = 2 micro-batches in flight.
    stage = Stage(0, 0, 0, 2, full_recompute_layers=1)
    mem = stage_memory(p, units, s, stage)
    params = 100 + 1000 + 3000
    assert mem.weights_bytes == 4 * params and mem.gradients_bytes == 4 * params
    assert mem.optimizer_bytes == 8 * params / 2
    # Kept: a's input and b's saved tensors per micro-batch; a's saved tensors again
    # while it recomputes.
    assert mem.activations_bytes == 2 * (2000 + 6000) + 8000
    # Two DDP buckets and the larger of the sends at its boundary (after b: 8000).
    assert mem.comm_buffer_bytes == 2 * 25 * 2**20 + 2 * 8000


def test_step_time_adds_the_pipeline_the_exposed_sync_and_the_optimizer():
    p = problem()
    s = Strategy(dp=8, tp=1, pp=1, micro_batch_size=2, num_microbatches=2, zero_stage=0)
    s = s.with_stages((Stage(0, 0, 0, 3),))
    e = estimate_traced(p, s)
    units = traced_units(p, s)
    t = stage_work(units, s.stages[0]).total_s
    params = 100 + 1000 + 3000 + 500
    sync = collective_time_s("all_reduce", 4 * params, groups(p, s)["dp"], p.cluster)
    window = p.cluster.comm_overlap * sum(
        compute.memory_bound_time_s(2 * n.elementwise_bytes, p.cluster)
        + n.backward_flops / (p.cluster.gpu.peak_for("fp32") * compute.GEMM_EFFICIENCY_MAX) for n in NODES)
    optimizer = compute.memory_bound_time_s(params * OPTIMIZER_BYTES_PER_PARAMETER["adamw"], p.cluster)
    assert e.step_time_s == pytest.approx(2 * t + max(0.0, sync - window) + optimizer, rel=1e-9)
    assert e.tflops_per_gpu == pytest.approx(32 / 2 * 36e6 / e.step_time_s / 8 / 1e12, rel=1e-9)


def test_elementwise_bytes_are_what_the_flopless_ops_read_and_write():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Linear(8, 16)
            self.act = nn.ReLU()

        def forward(self, x):
            return self.act(self.mlp(x).view(4, 32))

    graph = trace_module(Net(), (torch.randn(8, 8, device="meta"),))
    # addmm has a FLOP formula and moves nothing here; the ReLU reads and writes 8 x 16
    # fp32 values; the view between them moves nothing.
    assert graph.nodes["mlp"]["elementwise_bytes"] == 0
    assert graph.nodes["mlp"]["forward_flops"] == 2 * 8 * 8 * 16
    assert graph.nodes["act"]["elementwise_bytes"] == 2 * 4 * 8 * 16
