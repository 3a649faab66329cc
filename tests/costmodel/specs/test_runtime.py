"""Runtime profiles (costmodel/specs/runtime.py, configs/runtimes/): loading, validation,
and each of their terms against a hand computation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.estimate.uniform import unit_costs
from costmodel.problem import Problem
from costmodel.specs import RuntimeSpec
from costmodel.specs.loading import (
    SpecError,
    load_cluster,
    load_model,
    load_runtime,
    make_training,
    runtime_from_dict,
)
from costmodel.strategy import Strategy, even_stages
from costmodel.terms.comm import (
    Placement,
    collective_time_s,
    groups,
    sharded_collective_s,
)
from costmodel.terms.compute import gemm_time_s, layer_compute

NEUTRAL = RuntimeSpec(name="neutral", version=1)
NVLINK_A100 = 3.0e11 * 0.62   # configs/clusters/dgx-a100-80gb.yaml intra_node, achieved


def llama_problem(runtime: RuntimeSpec, gpus=8, batch=8, seq=2048) -> Problem:
    model = load_model("llama2-7b")
    cluster = load_cluster("dgx-a100-80gb", gpus=gpus)
    return Problem(model, cluster, make_training(model, cluster, batch, seq), runtime=runtime)


def test_the_default_runtime_is_pytorch_native_and_every_builtin_names_its_fits():
    assert load_runtime().name == "pytorch-native" and load_runtime() == load_runtime("pytorch-native")
    model = load_model("tiny-llama")
    cluster = load_cluster("dgx-a100-80gb")
    assert Problem(model, cluster, make_training(model, cluster, 8)).runtime.name == "pytorch-native"
    for name in ("pytorch-native", "megatron", "deepspeed-zero"):
        rt = load_runtime(name)
        assert rt.name == name and isinstance(rt.version, int) and rt.version >= 1
        assert rt.fitted_on["gemm_efficiency_scale"]   # every profile says where its kernels came from


@pytest.mark.parametrize("data, field", [
    ({"version": 1, "zero3_overlap": 1.5}, "--runtime.zero3_overlap"),
    ({"version": 1, "dp_overlap": "lots"}, "--runtime.dp_overlap"),
    ({"version": 1, "gemm_efficiency_scale": 0}, "--runtime.gemm_efficiency_scale"),
    ({"version": 1, "async_tp": "maybe"}, "--runtime.async_tp"),
    ({"version": 1, "overlap_everything": 1}, "--runtime.overlap_everything"),
    ({"zero3_overlap": 1}, "--runtime.version"),
    ({"version": 1, "fitted_on": {"warp_factor": "x"}}, "--runtime.fitted_on.warp_factor"),
    ({"version": 1, "step_time_low_ratio": 1.2}, "--runtime.step_time_low_ratio"),
    ({"version": 1, "step_time_high_ratio": 0.9}, "--runtime.step_time_high_ratio"),
    ({"version": 1, "memory_high_ratio": 0.95}, "--runtime.memory_high_ratio"),
    ({"version": 1, "fsdp_kept_gathered": "everything"}, "--runtime.fsdp_kept_gathered"),
    ({"version": 1, "fsdp_prefetch": 0}, "--runtime.fsdp_prefetch"),
    ({"version": 1, "fsdp_prefetch": 1.5}, "--runtime.fsdp_prefetch"),
    ({"version": 1, "ddp_bucket_mb": 0}, "--runtime.ddp_bucket_mb"),
])
def test_a_bad_runtime_field_is_named(data, field):
    with pytest.raises(SpecError) as err:
        runtime_from_dict(data, "mine")
    assert err.value.field == field


def test_an_unknown_runtime_is_bad_input_naming_the_option():
    with pytest.raises(SpecError) as err:
        load_runtime("bogus")
    assert err.value.field == "--runtime" and "pytorch-native" in str(err.value)


def test_a_runtime_file_loads(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nversion: 3\nzero3_overlap: 0.25\nstep_overhead_s: 0.1\n")
    rt = load_runtime(str(path))
    assert (rt.name, rt.version, rt.zero3_overlap, rt.step_overhead_s, rt.dp_overlap) == ("mine", 3, 0.25, 0.1, 1.0)


def test_bandwidth_by_message_size_by_hand():
    # 8 ranks on one DGX A100 node, an all-gather of 8 MB: 1 MB per rank; with a
    # 22 MB half size the ring runs at 1 / (1 + 22) of the link's achieved bandwidth.
    cluster = load_cluster("dgx-a100-80gb")
    rt = replace(NEUTRAL, collective_half_bytes=22e6)
    assert rt.message_efficiency(1e6) == pytest.approx(1 / 23, rel=1e-12)
    group = Placement(8, 8, 1)
    by_hand = 7 / 8 * 8e6 / (NVLINK_A100 / 23) + 7 * 5e-6
    assert collective_time_s("all_gather", 8e6, group, cluster, rt) == pytest.approx(by_hand, rel=1e-12)
    assert collective_time_s("all_gather", 8e6, group, cluster, NEUTRAL) == pytest.approx(
        7 / 8 * 8e6 / NVLINK_A100 + 7 * 5e-6, rel=1e-12)
    # a measured alpha-beta link (the cpu cluster's gloo) takes no curve on top
    cpu = load_cluster("cpu", gpus=2)
    assert collective_time_s("all_gather", 8e6, Placement(2, 2, 1), cpu, rt) == collective_time_s(
        "all_gather", 8e6, Placement(2, 2, 1), cpu, NEUTRAL)


@pytest.mark.parametrize("mixed, gathered, reduced", [("autocast", 4, 4), ("param_dtype", 2, 4), ("megatron", 2, 2)])
def test_zero3_overlap_term_by_hand(mixed, gathered, reduced):
    # llama2-7b, ZeRO-3 over 8 on one node, mbs 1: a layer's gather forward and gather +
    # reduce-scatter backward, less zero3_overlap of the layer's compute, never below 0.
    # Bytes per parameter as PyTorch moves them: the executor gathers its fp32 weights
    # (autocast casts per matmul), FSDP2's param_dtype gathers bf16; both reduce fp32
    # gradients (reduce_dtype); Megatron-LM's recipe moves 16-bit copies.
    rt = replace(NEUTRAL, zero3_overlap=0.1)
    prob = llama_problem(rt)
    prob = replace(prob, training=replace(prob.training, mixed_precision=mixed))
    s = Strategy(dp=8, tp=1, pp=1, micro_batch_size=1, num_microbatches=1, zero_stage=3,
                 stages=even_stages(32, 1))
    where = groups(prob, s)
    layer = layer_compute(prob.model, prob.cluster, prob.training, 1, 1, False, 1, rt)
    params = 4096 * (3 * 4096 + 4096) + 3 * 4096 * 11008 + 2 * 4096   # llama2-7b layer: attention, MLP, two norms
    gather = sharded_collective_s("all_gather", params * gathered, where["dp"], prob.cluster, rt)
    scatter = sharded_collective_s("reduce_scatter", params * reduced, where["dp"], prob.cluster, rt)
    forward, backward = layer.forward_s, 2 * layer.forward_s
    by_hand = max(0.0, gather - 0.1 * forward) + max(0.0, gather + scatter - 0.1 * backward)
    assert unit_costs(prob, s).layer_work["none"].dp_comm_s == pytest.approx(by_hand, rel=1e-12)
    # full overlap hides more
    assert unit_costs(replace(prob, runtime=NEUTRAL), s).layer_work["none"].dp_comm_s < by_hand


def test_async_tp_hides_part_of_the_forward_tp_collectives_by_hand():
    rt_sync = replace(NEUTRAL, async_tp_overlap=0.3)
    rt_async = replace(rt_sync, async_tp=True)
    prob = llama_problem(rt_sync)
    s = Strategy(dp=1, tp=8, pp=1, micro_batch_size=1, num_microbatches=8, sequence_parallel=True,
                 stages=even_stages(32, 1))
    sync = unit_costs(prob, s).layer_work["none"].tp_comm_s
    asyn = unit_costs(replace(prob, runtime=rt_async), s).layer_work["none"].tp_comm_s
    where = groups(prob, s)
    message = 2 * 1 * 2048 * 4096
    stream = 4 * 1 * 2048 * 4096   # autocast's fp32 residual stream: the blocks' gathered inputs
    one_way = 2 * (collective_time_s("all_gather", stream, where["tp"], prob.cluster, rt_sync)
                   + collective_time_s("reduce_scatter", message, where["tp"], prob.cluster, rt_sync))
    regather = 2 * collective_time_s("all_gather", stream, where["tp"], prob.cluster, rt_sync)
    gemm = layer_compute(prob.model, prob.cluster, prob.training, 1, 8, True, 1, rt_sync).gemm_s

    def exposed(c):
        return max(0.7 * c, c - 0.3 * gemm)

    backward = max(0.0, one_way - gemm)
    assert sync == pytest.approx(one_way + backward + regather, rel=1e-12)
    assert asyn == pytest.approx(exposed(one_way) + backward + exposed(regather), rel=1e-12)


def test_dp_overlap_scales_the_backward_window():
    prob = llama_problem(replace(NEUTRAL, dp_overlap=0.25))
    s = Strategy(dp=8, tp=1, pp=1, micro_batch_size=1, num_microbatches=1, stages=even_stages(32, 1))
    assert unit_costs(prob, s).layer_backward_s == pytest.approx(
        0.25 * unit_costs(llama_problem(NEUTRAL), s).layer_backward_s, rel=1e-12)


def test_kernel_factors_by_hand():
    model, cluster = load_model("llama2-7b"), load_cluster("dgx-a100-80gb")
    training = make_training(model, cluster, 8, 2048)
    plain = layer_compute(model, cluster, training, 1, 1, False, 1, NEUTRAL)
    slow = layer_compute(model, cluster, training, 1, 1, False, 1,
                         replace(NEUTRAL, gemm_efficiency_scale=0.5, elementwise_traffic_factor=3.0))
    assert slow.gemm_s == pytest.approx(2 * plain.gemm_s, rel=1e-12)
    assert slow.attention_core_s == pytest.approx(2 * plain.attention_core_s, rel=1e-12)
    assert slow.elementwise_s == pytest.approx(3 * plain.elementwise_s, rel=1e-12)
    compiled = replace(NEUTRAL, elementwise_traffic_factor=3.0, compiled_elementwise_traffic_factor=1.5,
                       torch_compile=True)
    assert layer_compute(model, cluster, training, 1, 1, False, 1, compiled).elementwise_s == pytest.approx(
        1.5 * plain.elementwise_s, rel=1e-12)
    # GPT's LayerNorm and GELU are one eager kernel each: no eager factor, but the compiled one
    gpt = load_model("gpt3-1.3b")
    gpt_training = make_training(gpt, cluster, 8, 2048)
    gpt_plain = layer_compute(gpt, cluster, gpt_training, 1, 1, False, 1, NEUTRAL)
    assert layer_compute(gpt, cluster, gpt_training, 1, 1, False, 1,
                         replace(NEUTRAL, elementwise_traffic_factor=3.0)).elementwise_s == gpt_plain.elementwise_s
    assert layer_compute(gpt, cluster, gpt_training, 1, 1, False, 1, compiled).elementwise_s == pytest.approx(
        1.5 * gpt_plain.elementwise_s, rel=1e-12)


def test_op_level_selective_recompute_repeats_k_o_up_and_the_elementwise_ops():
    # Llama 2 7B's forward matmuls q, k, v, o, gate, up, down: the op-level policy keeps
    # q, v, gate and down and repeats k, o and up, each priced on the GEMM curve.
    rt = replace(NEUTRAL, selective_recompute="op-level")
    prob = llama_problem(rt)   # flash attention: SDPA's output is kept, no attention core to recompute
    s = Strategy(dp=1, tp=1, pp=1, micro_batch_size=1, num_microbatches=8, stages=even_stages(32, 1))
    layer = layer_compute(prob.model, prob.cluster, prob.training, 1, 1, False, 1, rt)
    h, f, tokens = 4096, 11008, 2048
    peak = prob.cluster.gpu.peak_for("bf16")

    def gemm(n, k):
        return gemm_time_s(tokens, n, k, peak, device=prob.cluster.gpu)

    kept = gemm(h, h) + gemm(h, h) + gemm(f, h) + gemm(h, f)
    repeated = gemm(h, h) + gemm(h, h) + gemm(f, h)
    assert unit_costs(prob, s).layer_work["selective"].recompute_s == pytest.approx(
        repeated / (kept + repeated) * layer.gemm_s + layer.elementwise_s, rel=1e-12)
    # Megatron-LM's attention-core policy has nothing to repeat under FlashAttention.
    assert unit_costs(llama_problem(NEUTRAL), s).layer_work["selective"].recompute_s == 0.0


def test_the_fixed_cost_is_added_once_per_step():
    s = Strategy(dp=8, tp=1, pp=1, micro_batch_size=1, num_microbatches=1, stages=even_stages(32, 1))
    base = estimate(llama_problem(NEUTRAL), s)
    more = estimate(llama_problem(replace(NEUTRAL, step_overhead_s=0.125)), s)
    assert more.step_time_s - base.step_time_s == pytest.approx(0.125, rel=1e-9)
    assert more.time.fixed_s == 0.125 and base.time.fixed_s == 0.0


def test_pytorch_native_prices_a_torchtitan_row_near_its_measurement():
    # tt_8b_8gpu_fsdp (torchtitan_h100_runs.json): 5762 tokens/s per GPU, 16 x 8192 tokens
    # on 8 GPUs = 2.843 s; the checked-in profile, whose selective recompute is torchtitan's op-level SAC
    model = load_model("llama3-8b")
    cluster = load_cluster("grand-teton-h100", gpus=8)
    rt = load_runtime()
    assert rt.selective_recompute == "op-level"
    prob = Problem(model, cluster, make_training(model, cluster, 16, 8192), runtime=rt)
    s = Strategy(dp=8, tp=1, pp=1, micro_batch_size=2, num_microbatches=1, zero_stage=3, recompute="selective",
                 stages=even_stages(32, 1, 1, "selective"))
    assert estimate(prob, s).step_time_s == pytest.approx(16 * 8192 / (5762 * 8), rel=0.10)


def test_layer_launch_time_by_hand():
    # Each layer's forward + backward, the embedding and the head each pay layer_launch_s
    # (a third in forward); full recompute repeats the forward's third.
    rt = replace(NEUTRAL, layer_launch_s=0.003)
    s = Strategy(dp=1, tp=1, pp=1, micro_batch_size=1, num_microbatches=8, stages=even_stages(32, 1))
    with_launch, without = unit_costs(llama_problem(rt), s), unit_costs(llama_problem(NEUTRAL), s)
    assert with_launch.layer_work["none"].compute_s - without.layer_work["none"].compute_s == pytest.approx(0.003)
    assert with_launch.layer_work["full"].recompute_s - without.layer_work["full"].recompute_s == pytest.approx(0.001)
    assert with_launch.first_work.compute_s - without.first_work.compute_s == pytest.approx(0.003)
    assert with_launch.last_work.compute_s - without.last_work.compute_s == pytest.approx(0.003)


def test_loss_traffic_factor_by_hand():
    # The loss reads and writes fp32 logits: 2 * 4 bytes per logit, times the factor, at
    # 0.8 of HBM bandwidth (costmodel.terms.compute.head_compute_s).
    from costmodel.terms.compute import head_compute_s
    model, cluster = load_model("llama2-7b"), load_cluster("dgx-a100-80gb")
    training = make_training(model, cluster, 8, 2048)
    base = head_compute_s(model, cluster, training, 1, 1, NEUTRAL)
    more = head_compute_s(model, cluster, training, 1, 1, replace(NEUTRAL, loss_traffic_factor=1.5))
    loss_bytes = 2 * 4 * 2048 * 32000
    assert more - base == pytest.approx(0.5 * loss_bytes / (0.8 * 2.039e12), rel=1e-9)


def test_a_plan_written_before_the_policy_had_a_name_still_loads():
    # Plans record their runtime whole; older ones gave selective recompute as a fraction
    # of GEMMs repeated (0: the attention core, 0.5: torchtitan's op-level SAC).
    old = {"name": "pytorch-native", "version": 1, "selective_recompute_gemm_fraction": 0.0,
           "fitted_on": {"selective_recompute_gemm_fraction": "x", "gemm_efficiency_scale": "y"}}
    assert runtime_from_dict(old, "plan").selective_recompute == "attention-core"
    assert runtime_from_dict({**old, "selective_recompute_gemm_fraction": 0.5}, "plan").selective_recompute == "op-level"
    with pytest.raises(SpecError, match="selective_recompute"):
        runtime_from_dict({"version": 2, "selective_recompute": "some"}, "plan")
