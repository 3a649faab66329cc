"""Parity of the one training step (executor.step), through both paths that train with
it: every parallel layout trains as one process does.

- The plan runner (executor.train.Trainer, what `shardwise run` builds): five AdamW
  steps of the tiny models on fixed synthetic data in float64, where a layout's other
  summation order cannot move a result past the tolerances executor_test_helpers
  derives (losses 2.8e-13 relative, weights 8.5e-8): per-step losses and the gathered
  weights equal the single-process run's. The production paths keep a loss check each:
  float32 (its summation-order bound) and bf16 autocast (its rounding bound).
- auto_parallelize (executor.auto): tiny Hugging Face Llama and GPT-2 models built from
  configs, and a built-in model, planned on the spot for each layout, train five AdamW
  steps in float64 with the losses of the unparallelized model and give back the full
  weights under the model's own names equal to the reference's, within the same float64
  tolerances (the model's dtype is the trainer's).
"""

import importlib.util
from pathlib import Path

import pytest
import torch
from executor_test_helpers import (
    AUTO_LAYOUTS,
    CONFIG,
    GLOBAL_BATCH,
    PARITY,
    SEQ_LEN,
    STEPS,
    assert_matches_reference,
    assert_trains_as_the_model,
    bf16_loss_rtol,
    cached_reference,
    causal_lm_loss,
    check_parity,
    hf_model,
    hf_reference,
    loss_rtol,
    parallel_run,
    strategy,
    token_batches,
    weight_atol,
)

from costmodel.specs.loading import load_model
from costmodel.specs.loading import SpecError
from costmodel.strategy import Stage, even_stages
from executor.auto import refuse_unsupported
from executor.launch import UnsupportedPlan, check_compile, check_supported, run_local
from executor.models import build_model, cross_entropy, materialize

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")

UNEVEN = (Stage(0, 0, 0, 1), Stage(1, 1, 1, 3))

PLANS = {
    "dp2": strategy(dp=2),
    "tp2": strategy(tp=2),
    "tp2-sp": strategy(tp=2, sp=True),
    "pp2-gpipe": strategy(pp=2, schedule="gpipe"),
    "pp2-1f1b": strategy(pp=2),
    "pp2-interleaved": strategy(pp=2, vpp=2, schedule="interleaved"),
    "dp2-tp2": strategy(dp=2, tp=2),
    "dp2-pp2": strategy(dp=2, pp=2),
    "tp2-pp2": strategy(tp=2, pp=2, sp=True),
    "zero1": strategy(dp=2, zero=1),
    "zero2": strategy(dp=2, zero=2, m=2),
    "zero3": strategy(dp=2, zero=3, m=2),
    "zero3-tp2": strategy(dp=2, tp=2, zero=3),
    "zero3-pp2": strategy(dp=2, pp=2, zero=3),
    "recompute-selective": strategy(dp=2, recompute="selective"),
    # op-level SAC keeps sequence parallelism's reduce-scatter outputs and DTensor matmuls
    "recompute-selective-tp2-sp": strategy(tp=2, sp=True, recompute="selective"),
    "recompute-full": strategy(pp=2, recompute="full"),
    "pp2-uneven": strategy(pp=2, stages=UNEVEN),
    "dp2-accumulate": strategy(dp=2, m=2),
    # The other kinds the search makes on 2 and 4 ranks (tests/executor/test_plans_from_search.py).
    "dp2-pp2-gpipe": strategy(dp=2, pp=2, schedule="gpipe"),
    "dp2-pp2-interleaved": strategy(dp=2, pp=2, vpp=2, schedule="interleaved"),
    "zero3-pp2-gpipe": strategy(dp=2, pp=2, zero=3, schedule="gpipe"),
    "zero2-pp2-interleaved": strategy(dp=2, pp=2, vpp=2, zero=2, schedule="interleaved"),
    "zero3-tp2-sp": strategy(dp=2, tp=2, zero=3, sp=True),
    "dp2-tp2-sp": strategy(dp=2, tp=2, sp=True),
    "tp2-pp2-1f1b": strategy(tp=2, pp=2),
    "tp2-pp2-interleaved": strategy(tp=2, pp=2, vpp=2, schedule="interleaved"),
    "tp2-sp-pp2-interleaved": strategy(tp=2, pp=2, vpp=2, schedule="interleaved", sp=True),
    # Zero-bubble schedules (torch's ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble):
    # backward split into input and weight gradients; zbv's V puts the loss on rank 0.
    # Under dp, ZeRO-0 runs as `replicate` and ZeRO-1 as FSDP2 (data_parallel_kind).
    "pp2-zb": strategy(pp=2, schedule="zb-interleaved"),
    "pp2-zb-interleaved": strategy(pp=2, vpp=2, schedule="zb-interleaved"),
    "pp2-zbv": strategy(pp=2, vpp=2, schedule="zbv"),
    "dp2-pp2-zbv": strategy(dp=2, pp=2, vpp=2, schedule="zbv"),
    "dp2-pp2-zb": strategy(dp=2, pp=2, schedule="zb-interleaved"),
    "zero1-pp2-zbv": strategy(dp=2, pp=2, vpp=2, zero=1, schedule="zbv"),
    "zero2-pp2-zb": strategy(dp=2, pp=2, zero=2, schedule="zb-interleaved"),
    "tp2-sp-pp2-zbv": strategy(tp=2, pp=2, vpp=2, schedule="zbv", sp=True),
    "recompute-full-zbv": strategy(pp=2, vpp=2, schedule="zbv", recompute="full"),
    # DualPipeV: zbv's V, a forward of one chunk paired with a backward of the other.
    "pp2-dualpipev": strategy(pp=2, vpp=2, schedule="dualpipev"),
    "dp2-pp2-dualpipev": strategy(dp=2, pp=2, vpp=2, schedule="dualpipev"),
    "zero2-pp2-dualpipev": strategy(dp=2, pp=2, vpp=2, zero=2, schedule="dualpipev"),
    # Context parallelism (Llama 3's all-gather CP): each rank holds 2 of the 2 cp chunks
    # of every sequence and gathers K and V in each attention; gradients are reduced, and
    # ZeRO shards, over dp x cp. tiny-gpt's learned positions are read at the global
    # positions (under sequence parallelism, the tp rank's slice of them), and its tied
    # embedding is summed over the pipeline's ends of each cp rank.
    "cp2": strategy(cp=2),
    "cp2-tp2-sp": strategy(cp=2, tp=2, sp=True),
    "cp2-pp2": strategy(cp=2, pp=2),
    "cp2-zero3": strategy(cp=2, zero=3, m=2),
    "dp2-cp2": strategy(dp=2, cp=2),
}
# Llama-style: the layouts where GQA, RoPE and SwiGLU meet tensor and pipeline splits.
LLAMA_PLANS = ["tp2", "tp2-sp", "pp2-1f1b", "dp2-tp2", "zero3-tp2", "recompute-full", "recompute-selective",
               "recompute-selective-tp2-sp", "pp2-uneven", "cp2"]
# dp 4 with ep 2: two ranks (edp) hold each expert, so ZeRO shards the experts over them
# and their gradients are summed over edp, divided by dp.
MOE_PLANS = {"ep2": strategy(dp=2, ep=2), "ep2-zero3": strategy(dp=2, ep=2, zero=3), "ep2-pp2": strategy(dp=2, ep=2, pp=2),
             "ep2-zero2": strategy(dp=2, ep=2, zero=2), "ep2-edp2": strategy(dp=4, ep=2),
             "ep2-edp2-zero1": strategy(dp=4, ep=2, zero=1), "ep2-edp2-zero2": strategy(dp=4, ep=2, zero=2),
             "ep2-edp2-zero3": strategy(dp=4, ep=2, zero=3),
             "ep2-pp2-gpipe": strategy(dp=2, ep=2, pp=2, schedule="gpipe"),
             "ep2-pp2-interleaved": strategy(dp=2, ep=2, pp=2, vpp=2, schedule="interleaved"),
             "ep2-pp2-zero3": strategy(dp=2, ep=2, pp=2, zero=3),
             "ep2-pp2-zero2-gpipe": strategy(dp=2, ep=2, pp=2, zero=2, schedule="gpipe"),
             "ep2-pp2-zero3-interleaved": strategy(dp=2, ep=2, pp=2, vpp=2, zero=3, schedule="interleaved"),
             "ep2-pp2-zbv": strategy(dp=2, ep=2, pp=2, vpp=2, schedule="zbv"),
             "ep2-pp2-zb": strategy(dp=2, ep=2, pp=2, schedule="zb-interleaved"),
             "ep2-pp2-zero2-zb": strategy(dp=2, ep=2, pp=2, zero=2, schedule="zb-interleaved"),
             "ep2-pp2-zero2-zbv": strategy(dp=2, ep=2, pp=2, vpp=2, zero=2, schedule="zbv"),
             "ep2-pp2-dualpipev": strategy(dp=2, ep=2, pp=2, vpp=2, schedule="dualpipev"),
             # MoE parallel folding: whole experts under tp (etp 1), the ep group spanning
             # tp ranks (then cp, then dp); each tp rank routes its sequence shard.
             "ep2-tp2": strategy(tp=2, ep=2, etp=1, sp=True),
             "ep1-tp2": strategy(tp=2, etp=1, sp=True),   # experts replicated over tp
             "ep1-dp2-tp2-zero2": strategy(dp=2, tp=2, etp=1, sp=True, zero=2),
             "ep4-dp2-tp2": strategy(dp=2, tp=2, ep=4, etp=1, sp=True),
             "ep2-tp2-edp2-zero2": strategy(dp=2, tp=2, ep=2, etp=1, sp=True, zero=2),
             "ep4-dp2-tp2-zero3": strategy(dp=2, tp=2, ep=4, etp=1, sp=True, zero=3),
             "ep2-tp2-pp2": strategy(tp=2, ep=2, etp=1, sp=True, pp=2),
             "ep2-cp2": strategy(cp=2, ep=2),
             "ep4-dp2-cp2-zero2": strategy(dp=2, cp=2, ep=4, zero=2)}

# The production dtypes' loss checks: one layout of each kind of split, and ZeRO with
# accumulation (where autocast's cache of weight casts once broke the gradients).
PRODUCTION_PLANS = ["dp2-tp2", "tp2-pp2", "pp2-interleaved", "zero3", "zero3-tp2", "pp2-zbv", "cp2"]

@pytest.mark.parametrize("plan", sorted(PLANS))
def test_gpt_parity(plan):
    check_parity("tiny-gpt", PLANS[plan])


@pytest.mark.parametrize("plan", LLAMA_PLANS)
def test_llama_parity(plan):
    check_parity("tiny-llama", PLANS[plan])


# The generic dense decoder (configs/models/tiny-dense.yaml): q/k norm, biases, GeGLU,
# a parallel block and head_dim apart from hidden / heads under tensor, sequence,
# pipeline and ZeRO-3 splits.
DENSE_PLANS = ["tp2", "tp2-sp", "pp2-1f1b", "zero3-tp2"]


@pytest.mark.parametrize("plan", DENSE_PLANS)
def test_dense_parity(plan):
    check_parity("tiny-dense", PLANS[plan])


@pytest.mark.parametrize("plan", sorted(MOE_PLANS))
def test_moe_parity(plan):
    check_parity("tiny-moe", MOE_PLANS[plan])


# Fine-grained experts with a shared expert (configs/models/tiny-moe-shared.yaml: its gate,
# unnormalised top-k routing): the shared expert is a dense weight, replicated over ep,
# reduced and sharded over dp, a unit with the router under ZeRO over experts (edp 2).
SHARED_EXPERT_PLANS = ["ep2", "ep2-zero3", "ep2-edp2", "ep2-edp2-zero3", "ep2-pp2", "ep2-tp2", "ep4-dp2-tp2-zero3"]


@pytest.mark.parametrize("plan", SHARED_EXPERT_PLANS)
def test_moe_with_a_shared_expert_parity(plan):
    check_parity("tiny-moe-shared", MOE_PLANS[plan])


# Dense-MLP layers among the expert ones (configs/models/tiny-qwen3-moe.yaml: layers 0 and
# 2 dense, 1 and 3 sparse): the dense layers' MLPs replicated over ep and sharded over dp,
# pipeline stages holding one kind or both.
DENSE_AND_SPARSE_PLANS = ["ep2", "ep2-zero3", "ep2-edp2-zero2", "ep2-pp2", "ep2-pp2-dualpipev"]


@pytest.mark.parametrize("plan", DENSE_AND_SPARSE_PLANS)
def test_moe_with_dense_layers_parity(plan):
    check_parity("tiny-qwen3-moe", MOE_PLANS[plan])


# DeepSeek-V3's shape without its MTP module (configs/models/tiny-deepseek.yaml, in the 4
# layers these plans split, the first dense): latent attention, a dense first layer,
# grouped sigmoid routing scaled by 2.5 beside a shared expert, under ep, ZeRO over
# experts and pipelines.
DEEPSEEK_PLANS = ["ep2", "ep2-zero3", "ep2-edp2-zero2", "ep2-pp2", "ep2-pp2-dualpipev"]


@pytest.fixture(scope="module")
def deepseek_without_mtp(tmp_path_factory) -> str:
    spec = (Path(__file__).parents[2] / "configs" / "models" / "tiny-deepseek.yaml").read_text()
    path = tmp_path_factory.mktemp("models") / "tiny-deepseek-no-mtp.yaml"
    path.write_text(spec.replace("num_nextn_predict_layers: 1", "num_nextn_predict_layers: 0")
                    .replace("num_hidden_layers: 6", "num_hidden_layers: 4").replace("mlp_only_layers: [0, 1]",
                                                                                    "mlp_only_layers: [0]"))
    return str(path)


@pytest.mark.parametrize("plan", DEEPSEEK_PLANS)
def test_deepseek_v3_without_mtp_parity(plan, deepseek_without_mtp):
    check_parity(deepseek_without_mtp, MOE_PLANS[plan])


def test_expert_capacity_under_ep_drops_as_without_it(tmp_path):
    """Capacity is counted per rank's micro-batch, before the all-to-all: dp2 with ep2
    trains as dp2 with every expert on each rank, capacity factor 1 dropping rows in both,
    and not as the dropless model does."""
    spec = (Path(__file__).parents[2] / "configs" / "models" / "tiny-moe.yaml").read_text()
    model = tmp_path / "tiny-moe-capacity.yaml"
    model.write_text(spec + "moe_capacity_factor: 1.0\n")
    without_ep = run_local(parallel_run, 2, str(model), strategy(dp=2), "adamw", STEPS, GLOBAL_BATCH, PARITY)
    with_ep = run_local(parallel_run, 2, str(model), strategy(dp=2, ep=2), "adamw", STEPS, GLOBAL_BATCH, PARITY)
    assert_matches_reference(with_ep, *without_ep[0])
    dropless_losses, _ = cached_reference("tiny-moe")
    assert without_ep[0][0] != pytest.approx(dropless_losses, rel=1e-6)


def test_zero_bubble_plans_the_executor_cannot_run_are_refused():
    """ZeRO-3 (torch leaves the last stage's weight gradients unreduced), stages off the
    schedule's placement, and compiled blocks (torch cannot split their backward)."""
    spec = load_model("tiny-gpt")
    check_supported(spec, PLANS["zero2-pp2-zb"], 16)
    with pytest.raises(UnsupportedPlan, match="strategy.zero_stage: zbv with ZeRO-3"):
        check_supported(spec, strategy(dp=2, pp=2, vpp=2, zero=3, schedule="zbv"), 16)
    round_robin = strategy(pp=2, vpp=2, schedule="zbv", stages=even_stages(4, 2, 2))
    with pytest.raises(UnsupportedPlan, match="strategy.stages: virtual stage 2 is not on the pipeline rank zbv"):
        check_supported(spec, round_robin, 16)
    with pytest.raises(UnsupportedPlan, match="strategy.vpp: zbv runs two model chunks"):
        check_supported(spec, strategy(pp=2, vpp=1, schedule="zbv"), 16)
    with pytest.raises(SpecError, match="--compile"):
        check_compile(PLANS["pp2-zbv"], True)
    check_compile(PLANS["pp2-zbv"], False)
    check_compile(PLANS["pp2-interleaved"], True)


def test_gpt_oss_llama4_gemma3_and_deepseek_v3_are_refused_by_name_before_any_weights():
    """gpt-oss's banded attention, sinks, biased router and experts and clamped SwiGLU,
    Llama 4's chunked attention and sigmoid routing, Gemma 3's banded layers and
    post-norms, and DeepSeek-V3's pieces, are planned and exported, not built:
    `run` refuses them naming the first."""
    with pytest.raises(UnsupportedPlan, match="^model.attention_window: the executor's built-in model does not build "
                                              "the model's attention_window, attention_sinks, router_bias, "
                                              "swiglu_limit, mlp_bias \\(gpt-oss, Llama 4, Gemma 3, DeepSeek-V3\\) "
                                              "yet"):
        check_supported(load_model("gpt-oss-20b", {"num_hidden_layers": "2"}),
                        strategy(dp=2, ep=2, stages=even_stages(2, 1, 1)), 16)
    with pytest.raises(UnsupportedPlan, match="^model.attention_window: .* attention_window, router_scoring "):
        check_supported(load_model("llama4-scout", {"num_hidden_layers": "4"}), strategy(dp=2, ep=2), 16)
    with pytest.raises(UnsupportedPlan, match="^model.attention_window: .* attention_window, norms_per_layer "):
        check_supported(load_model("gemma3-1b", {"num_hidden_layers": "6"}), strategy(dp=2, stages=even_stages(6, 1, 1)),
                        16)
    # DeepSeek-V3's multi-token prediction module (its latent attention, dense first
    # layers and grouped sigmoid routing are built: test_deepseek_v3_without_mtp_parity).
    with pytest.raises(UnsupportedPlan, match="^model.num_nextn_predict_layers: .* num_nextn_predict_layers "
                                              "\\(gpt-oss"):
        check_supported(load_model("tiny-deepseek"), strategy(dp=2, ep=2, stages=even_stages(6, 1, 1)), 16)
    without_mtp = load_model("tiny-deepseek", {"num_nextn_predict_layers": "0"})
    check_supported(without_mtp, strategy(dp=2, ep=2, stages=even_stages(6, 1, 1)), 16)
    with pytest.raises(UnsupportedPlan, match="^strategy.cp: context parallelism \\(cp 2\\) with multi-head latent"):
        check_supported(without_mtp, strategy(cp=2, stages=even_stages(6, 1, 1)), 16)


def test_context_parallel_plans_the_executor_cannot_run_are_refused():
    """Sequences that do not cut into 2 cp chunks, or whose s / cp tokens the tp ranks
    cannot share under sequence parallelism; cp with expert parallelism; cp for a Hugging
    Face model (its attention is its own, and gathers no keys)."""
    spec = load_model("tiny-gpt")
    check_supported(spec, PLANS["cp2-tp2-sp"], 16)
    with pytest.raises(UnsupportedPlan, match=r"strategy.cp: cp 4 splits each sequence into 2 x cp = 8 equal chunks"):
        check_supported(spec, strategy(cp=4), 12)
    with pytest.raises(UnsupportedPlan, match=r"strategy.sequence_parallel: tp 4 does not divide the sequence of 6 "
                                              r"tokens \(seq 12 / cp 2\)"):
        check_supported(spec, strategy(cp=2, tp=4, sp=True), 12)
    with pytest.raises(UnsupportedPlan, match=r"plan.strategy.cp: auto_parallelize on a Hugging Face model"):
        refuse_unsupported(strategy(cp=2))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("plan", PRODUCTION_PLANS)
def test_production_precisions_keep_the_losses(plan, precision):
    """float32 weights, and bf16 autocast over them (the trainer's own autocast, as
    on a GPU): the losses of one process within the bound for that precision."""
    strat = PLANS[plan]
    ref_losses, _ = cached_reference("tiny-gpt", config=CONFIG, precision=precision)
    results = run_local(parallel_run, strat.num_gpus, "tiny-gpt", strat, "adamw", STEPS, GLOBAL_BATCH, CONFIG,
                        precision)
    rtol = bf16_loss_rtol() if precision == "bf16" else loss_rtol(torch.float32)
    for rank, (losses, params) in enumerate(results):
        assert losses == pytest.approx(ref_losses, rel=rtol), f"rank {rank}"
        assert all(p.dtype == torch.float32 for p in params.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_moe_with_experts_sharded_over_edp_keeps_the_losses_in_production_precisions(precision):
    """ZeRO-2 over experts held by two ranks each (dp 4, ep 2): FSDP2's own reduction
    in float32 (gloo's ops, as NCCL's), the losses of one process within the bound."""
    strat = MOE_PLANS["ep2-edp2-zero2"]
    ref_losses, _ = cached_reference("tiny-moe", config=CONFIG, precision=precision)
    results = run_local(parallel_run, strat.num_gpus, "tiny-moe", strat, "adamw", STEPS, GLOBAL_BATCH, CONFIG,
                        precision)
    rtol = bf16_loss_rtol() if precision == "bf16" else loss_rtol(torch.float32)
    for rank, (losses, _) in enumerate(results):
        assert losses == pytest.approx(ref_losses, rel=rtol), f"rank {rank}"


def test_the_tolerances_are_the_bounds_their_derivations_state():
    """The figures the docstrings and the README quote, from the formulas."""
    assert loss_rtol(torch.float64) == pytest.approx(2.84e-13, rel=1e-2)
    assert weight_atol(torch.float64, PARITY.lr) == pytest.approx(8.53e-8, rel=1e-2)
    assert loss_rtol(torch.float32) == pytest.approx(1.53e-4, rel=1e-2)
    assert weight_atol(torch.float32, CONFIG.lr) == pytest.approx(45.8, rel=1e-2)
    assert bf16_loss_rtol() == pytest.approx(1.73e-3, rel=1e-2)


# -- auto_parallelize ---------------------------------------------------------------------


def hf_rank(rank, world, family, fix):
    from executor import auto_parallelize

    trainer = auto_parallelize(hf_model(family), cluster="cpu", global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, fix=fix,
                               loss_fn=causal_lm_loss,
                               optimizer=lambda params: torch.optim.AdamW(params, lr=PARITY.lr))
    losses = [trainer.step({"input_ids": ids, "labels": ids}) for ids in token_batches()]
    return {"losses": torch.tensor(losses, dtype=torch.float64), "state": trainer.state_dict()}


@needs_transformers
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("layout", list(AUTO_LAYOUTS))
def test_hf_models_train_as_the_unparallelized_model(family, layout):
    fix = AUTO_LAYOUTS[layout]
    world = fix["dp"] * fix["tp"] * fix["pp"]
    assert_trains_as_the_model(run_local(hf_rank, world, family, fix), *hf_reference(family))


@needs_transformers
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_other_decoder_families_split_by_the_same_roles(family, layout):
    assert_trains_as_the_model(run_local(hf_rank, 2, family, AUTO_LAYOUTS[layout]), *hf_reference(family))


def builtin_model():
    return materialize(build_model(load_model("tiny-gpt"), SEQ_LEN, dtype=PARITY.dtype), "cpu", seed=3)


def shifted_batches():
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 256, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def builtin_rank(rank, world, fix):
    from executor import auto_parallelize

    trainer = auto_parallelize(builtin_model(), cluster="cpu", global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, fix=fix,
                               optimizer=lambda params: torch.optim.AdamW(params, lr=PARITY.lr))
    losses = [trainer.step(batch) for batch in shifted_batches()]
    return {"losses": torch.tensor(losses, dtype=torch.float64), "state": trainer.state_dict()}


@needs_transformers
@pytest.mark.parametrize("layout", ["dp2", "tp2xpp2"])
def test_a_builtin_model_trains_with_the_users_weights(layout):
    model = builtin_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=PARITY.lr)
    losses = []
    for x, y in shifted_batches():
        loss = cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    fix = AUTO_LAYOUTS[layout]
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert_trains_as_the_model(run_local(builtin_rank, fix["dp"] * fix["tp"] * fix["pp"], fix), losses, reference)


def test_stages_that_leave_layers_out_are_refused():
    """A plan whose stages hold fewer layers than the model would train a shorter model."""
    six_layers = load_model("tiny-deepseek", {"num_nextn_predict_layers": "0"})
    with pytest.raises(UnsupportedPlan, match="^strategy.stages: they hold 4 layers, tiny-deepseek has 6$"):
        check_supported(six_layers, strategy(pp=2), 16)
    check_supported(six_layers, strategy(pp=2, stages=even_stages(6, 2, 1)), 16)
