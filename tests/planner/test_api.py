"""planner.plan_model: modules the specs describe plan exactly as the CLI plans them;
any other module is traced and planned into pipeline stages cut along its execution
order, DAGs (a U-Net's skip connections, an encoder-decoder) included."""

import itertools
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from costmodel.estimate import estimate
from costmodel.estimate.traced import stage_memory, stage_work, traced_units
from costmodel.problem import traced_model
from costmodel.specs.loading import SpecError, load_model
from costmodel.strategy import Stage, Strategy
from costmodel.trace import trace_module
from executor.models import build_model
from planner import plan_model
from planner.api import plan, traced_problem
from planner.plan_file import dumps, read_plan, strategy_of, write_plan
from planner.rules import Rules
from planner.search import Infeasible
from planner.search.traced import partition

sys.path.insert(0, str(Path(__file__).parents[1] / "costmodel"))
from test_trace import EncoderDecoder, UNet  # noqa: E402


def test_a_builtin_model_plans_exactly_as_the_cli():
    model = build_model(load_model("tiny-gpt"), 64)
    tokens = torch.zeros(1, 64, dtype=torch.long, device="meta")
    from_module = plan_model(model, (tokens,), cluster="cpu", gpus=2, global_batch=8, precision="fp32")
    from_name = plan("tiny-gpt", "cpu", 8, gpus=2, seq_len=64, precision="fp32")
    assert dumps(from_module) == dumps(from_name)


def test_a_hugging_face_model_plans_as_its_config():
    pytest.importorskip("transformers")
    from costmodel_test_helpers import HF_DIR

    from costmodel.specs.hf import build_hf_model

    folder = HF_DIR / "tinyllama-folder"
    tokens = torch.zeros(1, 128, dtype=torch.long, device="meta")
    from_module = plan_model(build_hf_model(folder), (tokens,), cluster="dgx-a100-80gb", gpus=8, global_batch=64)
    from_config = plan(f"hf:{folder}", "dgx-a100-80gb", 64, gpus=8, seq_len=128)
    assert from_module["strategy"] == from_config["strategy"]
    assert from_module["estimate"] == from_config["estimate"]


def unet_problem(gpus=2, batch=8, cluster="cpu"):
    return traced_problem(UNet(), (torch.randn(2, 3, 32, 32, device="meta"),), cluster, batch, gpus=gpus,
                          precision="fp32")


def test_unet_cut_bytes_count_each_tensor_crossing_once():
    model = unet_problem().model
    assert [n.name for n in model.nodes] == ["enc.0", "enc.1", "bottleneck.0", "bottleneck.1", "dec.0", "dec.1", "head"]
    c, hw = 8, 32 * 32
    full, half, quarter = 4 * c * hw, 4 * 2 * c * hw // 4, 4 * 2 * c * hw // 16
    # After enc.0: its pooled output and its skip; after enc.1: the enc.0 skip, the
    # enc.1 skip and the pooled enc.1 output; in the bottleneck the same with its own
    # output in place of the pooled one; after dec.0 the enc.0 skip and dec.0's output.
    assert tuple(c // 2 for c in model.cut_bytes) == (full + full // 4, full + half + quarter, full + half + quarter,
                               full + half + quarter, full + 4 * c * hw // 4, 4 * c * hw)


def test_the_partition_is_the_best_of_every_contiguous_split():
    problem = unet_problem(gpus=4, batch=16, cluster="dgx-a100-80gb")
    rules = Rules()
    for pp, schedule in ((2, "gpipe"), (4, "1f1b")):
        strategy = Strategy(dp=4 // pp, tp=1, pp=pp, micro_batch_size=1, num_microbatches=16 * pp // 4,
                            schedule=schedule)
        units = traced_units(problem, strategy)
        stages = partition(problem, units, strategy, rules, usable=1e30)
        n = problem.model.num_nodes
        best = min(
            max(stage_work(units, Stage(r, r, a, b - a)).total_s for r, (a, b) in enumerate(zip((0, *cuts), (*cuts, n))))
            for cuts in itertools.combinations(range(1, n), pp - 1))
        assert max(stage_work(units, s).total_s for s in stages) == pytest.approx(best, rel=1e-12)
        assert [s.pp_rank for s in stages] == list(range(pp))
        assert sum(s.num_layers for s in stages) == n


def test_a_tight_memory_recomputes_the_fewest_nodes_that_fit():
    problem = unet_problem(gpus=2, batch=8)
    strategy = Strategy(dp=1, tp=1, pp=2, micro_batch_size=4, num_microbatches=2, schedule="gpipe")
    units = traced_units(problem, strategy)
    free = partition(problem, units, strategy, Rules(), usable=1e30)
    assert all(s.full_recompute_layers == 0 for s in free)
    # Leave the first stage 1 byte short of its plain memory: it must recompute some
    # of its nodes, and the fewest that fit.
    first = free[0]
    tight = stage_memory(problem, units, strategy, first).total_bytes - 1
    stages = partition(problem, units, strategy, Rules(), usable=tight)
    for s in stages:
        assert stage_memory(problem, units, strategy, s).total_bytes <= tight
        if s.full_recompute_layers:
            fewer = Stage(s.index, s.pp_rank, s.first_layer, s.num_layers, s.full_recompute_layers - 1)
            assert stage_memory(problem, units, strategy, fewer).total_bytes > tight
    assert any(s.full_recompute_layers for s in stages)


def test_dag_models_plan_into_stages_every_edge_runs_forward_through():
    for module, inputs in ((UNet(), (torch.randn(2, 3, 32, 32, device="meta"),)),
                           (EncoderDecoder(), (torch.randn(2, 5, 16, device="meta"), torch.randn(2, 7, 16, device="meta")))):
        doc = plan_model(module, inputs, cluster="cpu", gpus=2, global_batch=8, precision="fp32", fix={"pp": 2})
        strategy = strategy_of(doc)
        rank_of = {}
        for s in strategy.stages:
            for i in range(s.first_layer, s.first_layer + s.num_layers):
                rank_of[doc["model"]["nodes"][i]["name"]] = s.pp_rank
        graph = trace_module(module, inputs)
        assert set(rank_of) == set(graph.nodes)
        assert all(rank_of[u] <= rank_of[v] for u, v in graph.edges)
        problem = traced_problem(module, inputs, "cpu", 8, gpus=2, precision="fp32")
        assert doc["estimate"]["step_time_s"] == pytest.approx(estimate(problem, strategy).step_time_s, rel=1e-5)


def test_the_encoder_decoder_boundary_sends_the_memory_and_the_target():
    inputs = (torch.randn(2, 5, 16, device="meta"), torch.randn(2, 7, 16, device="meta"))
    model = traced_model(trace_module(EncoderDecoder(), inputs), batch=2)
    # Two samples, fp32: the encoder's output (5 x 16) and the decoder's target (7 x 16)
    # cross every cut between the encoders and the decoders' first reader.
    assert model.cut_bytes[1] == 2 * 4 * (5 * 16 + 7 * 16)


def test_a_traced_plan_file_reads_back_and_is_deterministic(tmp_path):
    args = (UNet(), (torch.randn(2, 3, 32, 32, device="meta"),))
    first = plan_model(*args, cluster="dgx-a100-80gb", gpus=8, global_batch=64)
    second = plan_model(*args, cluster="dgx-a100-80gb", gpus=8, global_batch=64)
    assert dumps(first) == dumps(second)
    write_plan(first, tmp_path / "unet.json")
    assert read_plan(tmp_path / "unet.json") == first


def test_pins_a_traced_module_cannot_take_and_memory_that_binds():
    args = (UNet(), (torch.randn(2, 3, 32, 32, device="meta"),))
    with pytest.raises(SpecError, match="fix tp"):
        plan_model(*args, cluster="cpu", gpus=2, global_batch=8, fix={"tp": 2})
    with pytest.raises(Infeasible, match="memory binds"):
        plan_model(*args, cluster="cpu", gpus=2, global_batch=8, fix={"recompute": "none"},
                   rules=str(Path(__file__).parent / "data" / "tiny_memory.yaml"))


MAX_PARTITIONS = 8


class Residual(nn.Module):
    """A stack of MLP blocks added into a residual stream in the root's own forward."""

    def __init__(self, layers=100, width=256):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                     for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_a_residual_stream_is_one_tensor_per_cut_and_100_blocks_plan_with_few_partitions():
    with torch.device("meta"):
        model = Residual()
    inputs = (torch.randn(4, 128, 256, device="meta"),)
    traced = traced_model(trace_module(model, inputs), batch=4)
    # Each Sequential inside the stack is one node; the stream crosses each cut once.
    assert traced.num_nodes == 100
    assert set(traced.cut_bytes) == {4 * 4 * 128 * 256}
    doc = plan_model(model, inputs, cluster="dgx-a100-80gb", nodes=4, global_batch=256, fix={"pp": 4, "zero": 0})
    assert [s["num_layers"] for s in doc["strategy"]["stages"]] and sum(
        s["num_layers"] for s in doc["strategy"]["stages"]) == 100
    # The bound prunes: the stage partition (the costly part) runs for a handful of the
    # candidates, not all of them (its time is bench/trace_time.py's).
    search = doc["search"]
    assert search["ilp_solves"] + search["pruned_bound"] == search["candidates"]
    assert search["ilp_solves"] <= MAX_PARTITIONS < search["candidates"]


def test_a_module_with_real_weights_traces_on_meta_without_touching_them():
    model = UNet()
    meta = trace_module(model, (torch.randn(2, 3, 32, 32, device="meta"),))
    real = trace_module(model, (torch.randn(2, 3, 32, 32),))
    for name in real:
        for key in ("forward_flops", "backward_flops", "parameters", "saved_bytes", "output_bytes"):
            assert meta.nodes[name][key] == real.nodes[name][key], (name, key)
    assert all(not p.is_meta for p in model.parameters())
