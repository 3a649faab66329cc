"""FP8 training (TrainingSpec.fp8: torchao.float8's Float8Linear on the layers' linear
layers, emulated on CPU): which layers it converts, how far its losses sit from bf16's,
and that each layout trains as one process does.

What a layout must equal: tensorwise scaling takes one scale per tensor from the amax of
the tokens one GEMM sees, so a layout equals one process that runs the same
micro-batches (dp2 with one micro-batch of 4 sequences a rank is one process with two of
4; context parallelism, whose GEMMs see half of each sequence's tokens, equals no
one-process run and is not compared). The parity runs keep their weights in float64, but
torchao's emulated FP8 GEMM dequantizes and multiplies in float32
(torchao/float8/float8_ops.py: `a._data.float() / a._scale`): where a layout does not
split a GEMM's inner dimension (DDP, FSDP, pipeline stages) it runs the same float32
products in the same order and the losses agree to float64's summation bound; tensor
parallelism splits the row-wise layers' inner dimension, so its float32 sums differ at
~1e-7 and can flip an FP8 rounding in a later step (tolerances below).
"""

import functools

import pytest
import torch
from executor_test_helpers import (
    CONFIG,
    GLOBAL_BATCH,
    PARITY,
    SEQ_LEN,
    STEPS,
    batches,
    cached_reference,
    loss_rtol,
    strategy,
)

from costmodel.specs import TrainingSpec
from costmodel.specs.loading import load_model
from executor.launch import UnsupportedPlan, check_supported, run_local

torchao = pytest.importorskip("torchao.float8", reason="FP8 training needs torchao")

# tiny-llama's MLP is 176 wide: 88 on each of two tp ranks, which FP8 GEMMs cannot take
# (multiples of 16); 192 splits into 96.
TP_SHAPES = {"intermediate_size": "192"}
# The first-step loss of tensor parallelism against one process: its float32 sums in
# another order (measured: 1.5e-9 relative; an amax taken over one tp shard instead of
# the whole weight moved it by 3e-5).
TP_FIRST_LOSS_RTOL = 1e-6
# Every step's: from the second step on, a float32 difference can flip an FP8 rounding,
# one element by one e4m3 step (2^-3 relative), and Adam carries it (measured: at most
# 6.2e-5 relative over 5 steps with tp2, tp2 with sequence parallelism, and zero3-tp2).
TP_LOSS_RTOL = 5e-4


def fp8_training(recipe: str) -> TrainingSpec:
    return TrainingSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, precision="bf16", optimizer="adamw",
                        flash_attention=True, fp8=recipe)


def fp8_run(rank, world, model_name, strat, recipe, config, overrides=None, steps=STEPS):
    """Rank body: train with FP8 linear layers; (losses, the names of this rank's
    Float8Linear layers, the FP8 weight scales checked against the whole weight's)."""
    from torchao.float8.config import e4m3_dtype
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_utils import amax_to_scale
    from torch.distributed.tensor import DTensor

    from executor.train import Trainer

    spec = load_model(model_name, overrides)
    trainer = Trainer(spec, fp8_training(recipe), strat, config, "cpu")
    model = trainer.model.stages[0]
    names = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    plain = sorted(n for n, m in model.named_modules() if type(m) is torch.nn.Linear)
    losses = [trainer.step(x, y) for x, y in batches(spec, steps)]
    # A sharded weight's tensorwise scale, as torchao computes it for the DTensor, against
    # the scale of the whole weight: (scale, whole weight's scale, this shard's own scale).
    scales = []
    for m in model.modules():
        if isinstance(m, Float8Linear) and isinstance(m.weight, DTensor):
            weight = m.weight
            cast = hp_tensor_to_float8_dynamic(weight, e4m3_dtype, m.linear_mm_config)
            whole = weight.full_tensor()
            local = weight.to_local()
            whole, local = (getattr(t, "_tensor", t) for t in (whole, local))
            scales.append((float(cast.to_local()._scale), float(amax_to_scale(whole.abs().max(), e4m3_dtype)),
                           float(amax_to_scale(local.abs().max(), e4m3_dtype))))
            precomputed = getattr(weight._local_tensor, "_precomputed_scale", None)
            if precomputed is not None:   # FSDP2's float8 all-gather: the scale kept for the next gather
                scales.append((float(precomputed), float(amax_to_scale(whole.abs().max(), e4m3_dtype)),
                               float(amax_to_scale(local.abs().max(), e4m3_dtype))))
    return {"losses": losses, "fp8": names, "plain": plain, "scales": scales}


@functools.cache
def one_process(model_name: str, recipe: str, microbatches: int = 1, config=PARITY, overrides: tuple = (),
                steps: int = STEPS):
    """One process's FP8 run over `microbatches` micro-batches of the global batch."""
    return run_local(fp8_run, 1, model_name, strategy(m=microbatches), recipe, config, dict(overrides) or None,
                     steps)[0]


def test_fp8_converts_the_layers_projections_and_mlp_only():
    """Float8Linear exactly where TrainingSpec.fp8 says: every layer's q/k/v/o projections
    and MLP matrices; the LM head (and the embedding, not a linear layer) stay as they
    were. Under tensor parallelism a layer whose shard FP8 GEMMs cannot take stays bf16."""
    from executor.models import build_model
    from executor.parallelize import apply_fp8, fp8_config, fp8_gemm_fits

    run = one_process("tiny-llama", "tensorwise")
    layers = [f"layers.{i}.{part}" for i in range(4)
              for part in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]
    assert run["fp8"] == sorted(layers)
    assert run["plain"] == ["output"]
    # tp 2 splits the 176-wide MLP into 88s: its three matrices stay nn.Linear.
    spec = load_model("tiny-llama")
    model = build_model(spec, SEQ_LEN)
    apply_fp8(model, fp8_config("tensorwise", torch.device("cpu"), False), tp=2)
    kinds = {n: type(m).__name__ for n, m in model.layers["0"].named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {"attention.wq": "Float8Linear", "attention.wk": "Float8Linear", "attention.wv": "Float8Linear",
                     "attention.wo": "Float8Linear", "feed_forward.w1": "Linear", "feed_forward.w2": "Linear",
                     "feed_forward.w3": "Linear"}
    assert not fp8_gemm_fits(torch.nn.Linear(64, 176, device="meta"), "w1", 2)
    assert fp8_gemm_fits(torch.nn.Linear(64, 176, device="meta"), "w1", 1)
    assert not fp8_gemm_fits(torch.nn.Linear(88, 64, device="meta"), "w2", 1)


def test_fp8_refuses_what_it_cannot_run(monkeypatch):
    """fp8 with fp32 or fp16, with an MoE's experts (torchao's grouped GEMM is not built
    here), with micro-batches FP8 GEMMs cannot take, and without torchao."""
    spec = load_model("tiny-llama")
    check_supported(spec, strategy(), SEQ_LEN, "bf16", "tensorwise")
    for precision in ("fp32", "fp16"):
        with pytest.raises(UnsupportedPlan, match="training.fp8: FP8 linear layers run inside bf16"):
            check_supported(spec, strategy(), SEQ_LEN, precision, "tensorwise")
    with pytest.raises(UnsupportedPlan, match="training.fp8: the experts of an MoE model"):
        check_supported(load_model("tiny-moe"), strategy(dp=2, ep=2), SEQ_LEN, "bf16", "rowwise")
    with pytest.raises(UnsupportedPlan, match="training.fp8: a micro-batch holds 12 tokens"):
        check_supported(spec, strategy(dp=2, m=4), 12, "bf16", "tensorwise")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(UnsupportedPlan, match="pip install torchao"):
        check_supported(spec, strategy(), SEQ_LEN, "bf16", "tensorwise")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_losses_stay_near_bf16(recipe):
    """One process, fp32 weights under bf16 autocast as a plan runs: FP8 linear layers move
    the losses off bf16's by FP8's rounding, e4m3's unit roundoff u = 2^-4 on each GEMM
    operand, averaged over the step's tokens and carried over the steps:
    S·u/sqrt(tokens) = 2.8e-2 for 5 steps of 128 tokens (measured: at most 3.4e-4). They do
    move: FP8 rounds 16 times coarser than bf16 (measured: the farthest step 2.5e-4
    (rowwise) and 3.4e-4 (tensorwise) apart)."""
    bf16_losses, _ = cached_reference("tiny-llama", config=CONFIG, precision="bf16")
    losses = one_process("tiny-llama", recipe, config=CONFIG)["losses"]
    u = torch.finfo(torch.float8_e4m3fn).eps / 2
    assert losses == pytest.approx(bf16_losses, rel=STEPS * u / (GLOBAL_BATCH * SEQ_LEN) ** 0.5)
    assert max(abs(a - b) / b for a, b in zip(losses, bf16_losses)) > 1e-5


# (layout, its ranks' strategy, the micro-batches of the one-process run it equals)
DATA_PARALLEL = {"dp2": (strategy(dp=2), 2), "zero3": (strategy(dp=2, zero=3, m=2), 4),
                 "pp2": (strategy(pp=2), 2)}


@pytest.mark.parametrize("layout", sorted(DATA_PARALLEL))
def test_fp8_tensorwise_data_and_pipeline_parallel_train_as_one_process(layout):
    """DDP, FSDP2 (ZeRO-3, weights gathered in FP8 with their scales precomputed after
    each update) and pipeline stages run one process's float32 GEMMs in its order: the
    losses agree to float64's summation bound (2.8e-13; measured: equal, or one ulp)."""
    strat, microbatches = DATA_PARALLEL[layout]
    results = run_local(fp8_run, 2, "tiny-llama", strat, "tensorwise", PARITY)
    reference = one_process("tiny-llama", "tensorwise", microbatches)["losses"]
    for result in results:
        assert result["losses"] == pytest.approx(reference, rel=loss_rtol(PARITY.dtype))
    if layout == "zero3":
        # FSDP2 gathers the weights in FP8: each scale kept is the whole weight's.
        scales = [s for r in results for s in r["scales"]]
        assert len(scales) == 2 * 2 * 4 * 7   # ranks x (cast, kept) x layers x linear layers
        assert all(s == whole for s, whole, _ in scales)
        assert any(own != whole for _, whole, own in scales)   # a shard's own amax would not do


def test_fp8_rowwise_dp2_trains_as_one_process():
    """Rowwise scales are powers of two, so the emulated float32 GEMMs are exact and
    DDP's losses agree with one process's to float64's summation bound."""
    results = run_local(fp8_run, 2, "tiny-llama", strategy(dp=2), "rowwise", PARITY)
    reference = one_process("tiny-llama", "rowwise", 2)["losses"]
    for result in results:
        assert result["losses"] == pytest.approx(reference, rel=loss_rtol(PARITY.dtype))


TENSOR_PARALLEL = {"tp2": (strategy(tp=2), 2, 1), "tp2-sp": (strategy(tp=2, sp=True), 2, 1),
                   "zero3-tp2": (strategy(dp=2, tp=2, zero=3), 4, 2)}


@pytest.mark.parametrize("layout", sorted(TENSOR_PARALLEL))
def test_fp8_tensorwise_tensor_parallel_trains_as_one_process(layout):
    """Tensor parallelism with torchao's float8 styles (on CPU under sequence parallelism
    the plain ones: gloo cannot gather FP8): each weight's tensorwise scale comes from
    the amax of the whole weight, not of this rank's shard (torchao reduces a DTensor's
    amax over its mesh; under FSDP x TP the kept scale too), and the losses equal one
    process's within the tolerances above."""
    strat, world, microbatches = TENSOR_PARALLEL[layout]
    results = run_local(fp8_run, world, "tiny-llama", strat, "tensorwise", PARITY, TP_SHAPES)
    reference = one_process("tiny-llama", "tensorwise", microbatches, overrides=tuple(TP_SHAPES.items()))["losses"]
    for result in results:
        assert result["losses"][0] == pytest.approx(reference[0], rel=TP_FIRST_LOSS_RTOL)
        assert result["losses"] == pytest.approx(reference, rel=TP_LOSS_RTOL)
        assert len(result["fp8"]) == 4 * 7
    scales = [s for r in results for s in r["scales"]]
    assert scales and all(s == whole for s, whole, _ in scales)
    assert any(own != whole for _, whole, own in scales)
