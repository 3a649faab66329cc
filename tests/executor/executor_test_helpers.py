"""Shared helpers for the executor tests: plans, data, the rank body of a parallel run
(launched with executor.launch.run_local), the single-process reference training loop,
written with plain PyTorch pieces (one unsplit model, torch.optim, clip_grad_norm_) so
the parallel runs are compared with something they do not share code with beyond the
model and its initial weights, and the tolerances of the comparison. For
auto_parallelize: tiny Hugging Face models built from configs, and their
single-process reference.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from costmodel.specs import TrainingSpec
from costmodel.specs.loading import load_model
from costmodel.strategy import Strategy, even_stages
from executor.data import SyntheticTokens
from executor.launch import run_local
from executor.models import build_model, cross_entropy, materialize
from executor.train import TrainConfig, Trainer, lr_factor

SEQ_LEN = 16
GLOBAL_BATCH = 8
STEPS = 5
CONFIG = TrainConfig(lr=3e-3, warmup_steps=2, total_steps=5)
# Parity runs in float64: a layout sums in another order than one process, and in
# float64 that moves a result by ~1e-16 relative, so tight tolerances hold on any CPU
# (loss_rtol and weight_atol below).
PARITY = replace(CONFIG, dtype=torch.float64)


def training(optimizer: str = "adamw", global_batch: int = GLOBAL_BATCH, precision: str = "fp32") -> TrainingSpec:
    return TrainingSpec(global_batch=global_batch, seq_len=SEQ_LEN, precision=precision, optimizer=optimizer,
                        flash_attention=True)


def strategy(dp=1, tp=1, pp=1, vpp=1, ep=1, m=None, schedule="1f1b", zero=0, recompute="none", sp=False,
             stages=None, cp=1, etp=None) -> Strategy:
    if m is None:
        m = max(2, pp * vpp) if pp > 1 else 1
    mbs = GLOBAL_BATCH // (dp * m)   # the cp ranks of a replica share its sequences
    layers = 4
    return Strategy(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=m, vpp=vpp, ep=ep, cp=cp, etp=etp,
                    schedule=schedule, zero_stage=zero, recompute=recompute, sequence_parallel=sp,
                    stages=stages or even_stages(layers, pp, vpp, recompute, schedule))


def batches(spec, steps=STEPS, global_batch=GLOBAL_BATCH):
    source = SyntheticTokens(spec.vocab_size, seed=0)
    return [source.global_batch(step, global_batch, SEQ_LEN) for step in range(steps)]


def reference_run(model_name: str, optimizer: str = "adamw", steps: int = STEPS, global_batch: int = GLOBAL_BATCH,
                  config: TrainConfig = CONFIG, precision: str = "fp32"):
    """Losses and final parameters of the unsplit model trained in one process, in
    `config.dtype`, under bf16 autocast for `precision` "bf16"."""
    spec = load_model(model_name)
    torch.manual_seed(0)
    model = materialize(build_model(spec, SEQ_LEN, dtype=config.dtype), "cpu", config.seed)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    else:
        cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
        opt = cls(model.parameters(), lr=config.lr, betas=config.betas,
                  weight_decay=config.weight_decay if optimizer == "adamw" else 0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(config, s))
    losses = []
    for inputs, targets in batches(spec, steps, global_batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = cross_entropy(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def parallel_run(rank, world, model_name, strat, optimizer="adamw", steps=STEPS, global_batch=GLOBAL_BATCH,
                 config=CONFIG, precision="fp32"):
    """Rank body: train `strat` and return (losses, full parameters) on every rank."""
    spec = load_model(model_name)
    trainer = Trainer(spec, training(optimizer, global_batch, precision), strat, config, "cpu")
    losses = [trainer.step(x, y) for x, y in batches(spec, steps, global_batch)]
    return losses, trainer.full_state_dict()


# The longest sum in the tiny models: the softmax over the 512-token vocabulary (hidden
# 64, ffn <= 256 and the 128 tokens of a step are shorter).
LONGEST_SUM = 512
ADAM_EPS = 1e-8   # torch.optim.AdamW's default, which the trainer and the reference use


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon: float64 1.1e-16, float32 6.0e-8, bfloat16 3.9e-3."""
    return torch.finfo(dtype).eps / 2


def loss_rtol(dtype: torch.dtype, steps: int = STEPS) -> float:
    """Relative tolerance of a parallel run's losses against one process's, both in
    `dtype`. A sum of n terms taken in another order moves by at most n·u relative to
    the sum of their magnitudes (Higham 2002, Accuracy and Stability of Numerical
    Algorithms, §4.2, γ_n), and every step's loss inherits the steps before: S·n·u
    (float64: 2.8e-13; float32: 1.5e-4)."""
    return steps * LONGEST_SUM * unit_roundoff(dtype)


def weight_atol(dtype: torch.dtype, lr: float, steps: int = STEPS) -> float:
    """Absolute tolerance of the trained weights. Adam's update lr·m/(sqrt(v)+eps) moves
    by up to lr·δg/eps when a gradient moves by δg (the slope of g/(|g|+eps) is at most
    1/eps): where the exact gradient is ~0 (a key bias, which the softmax ignores) the
    summation order alone decides the update. Gradients are clipped to norm 1, so
    δg <= n·u; over S steps: S·lr·n·u/eps. In float64 that is 8.5e-8, while a bug (a
    missing reduction, a gradient scaled by dp) moves weights by ~lr = 3e-3 a step; in
    float32 it is 46, more than the weights: float32 weights after Adam cannot be
    compared across layouts, which is why the parity suites run in float64."""
    return steps * lr * LONGEST_SUM * unit_roundoff(dtype) / ADAM_EPS


def bf16_loss_rtol(steps: int = STEPS, tokens: int = GLOBAL_BATCH * SEQ_LEN) -> float:
    """Relative tolerance of losses under bf16 autocast, where the error is bf16's
    rounding of every matmul output (u = 2^-8), not the summation order: a different
    order flips roundings near a tie by one bf16 ulp. The loss is a mean over the
    step's tokens, so independent flips average to u/sqrt(tokens) (the probabilistic
    model of Higham & Mary 2019, SIAM J. Sci. Comput. 41(5)), accumulated over S steps:
    S·u/sqrt(tokens) = 1.7e-3 for 5 steps of 128 tokens (measured: at most 1.2e-4)."""
    return steps * unit_roundoff(torch.bfloat16) / tokens ** 0.5


def assert_matches_reference(results, ref_losses, ref_params, config: TrainConfig = PARITY) -> None:
    """Every rank's losses equal the single-process ones, and the weights the ranks
    hold, gathered, equal the single-process weights, within the tolerances above for
    `config.dtype`."""
    import pytest

    for rank, (losses, _) in enumerate(results):
        assert losses == pytest.approx(ref_losses, rel=loss_rtol(config.dtype)), f"rank {rank}"
    gathered = {}
    for _, params in results:
        gathered.update(params)
    # A tied head is the embedding; every other weight must come back from some rank.
    expected = set(ref_params) - ({"output.weight"} if "output.weight" not in gathered else set())
    assert set(gathered) == expected
    for name in expected:
        assert gathered[name].dtype == ref_params[name].dtype == config.dtype, name
        torch.testing.assert_close(gathered[name], ref_params[name], rtol=0, atol=weight_atol(config.dtype, config.lr),
                                   msg=name)


@functools.cache
def cached_reference(model_name: str, steps: int = STEPS, global_batch: int = GLOBAL_BATCH,
                     config: TrainConfig = PARITY, precision: str = "fp32"):
    """reference_run, computed once per test process for each set of arguments."""
    return reference_run(model_name, steps=steps, global_batch=global_batch, config=config, precision=precision)


def check_parity(model_name: str, strat: Strategy, steps: int = STEPS, global_batch: int = GLOBAL_BATCH) -> None:
    """`strat`, run on its ranks in float64, trains `model_name` as one process does."""
    ref_losses, ref_params = cached_reference(model_name, steps, global_batch)
    results = run_local(parallel_run, strat.num_gpus, model_name, strat, "adamw", steps, global_batch, PARITY)
    assert_matches_reference(results, ref_losses, ref_params)


# -- auto_parallelize: tiny Hugging Face models against one process ---------------------

# Layouts auto_parallelize plans for (its `fix`).
AUTO_LAYOUTS = {
    "dp2": {"dp": 2, "tp": 1, "pp": 1, "zero": 0},
    "tp2": {"dp": 1, "tp": 2, "pp": 1},
    "pp2": {"dp": 1, "tp": 1, "pp": 2, "schedule": "1f1b"},
    "dp2xtp2": {"dp": 2, "tp": 2, "pp": 1, "zero": 0},
    "tp2xpp2": {"dp": 1, "tp": 2, "pp": 2, "schedule": "gpipe"},
    "zero3-dp2": {"dp": 2, "tp": 1, "pp": 1, "zero": 3},
    "tp2-recompute": {"dp": 1, "tp": 2, "pp": 1, "recompute": "full"},
    "dp2-selective": {"dp": 2, "tp": 1, "pp": 1, "zero": 0, "recompute": "selective"},
}


def causal_lm_loss(logits, labels):
    """The next-token loss in the logits' dtype (Hugging Face's own upcasts to float32)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def hf_config(family: str):
    import transformers

    if family in ("mistral", "qwen2"):   # Qwen2's q/k/v carry biases
        config = {"mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}[family]
        return config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=SEQ_LEN, tie_word_embeddings=False)
    if family == "llama":
        return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                                        tie_word_embeddings=False)
    return transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=4, n_head=4, n_positions=SEQ_LEN,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def hf_model(family: str, dtype: torch.dtype = PARITY.dtype):
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager").to(dtype)


def token_batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (GLOBAL_BATCH, SEQ_LEN), generator=generator) for _ in range(STEPS)]


def hf_reference(family: str):
    """One process, plain torch.optim: the losses and the final weights."""
    model = hf_model(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PARITY.lr)
    losses = []
    for ids in token_batches():
        loss = causal_lm_loss(model(input_ids=ids).logits, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_trains_as_the_model(results, reference_losses, reference_state) -> None:
    """Every rank's losses, and the weights the trainer gives back under the model's own
    names, equal the single-process run's within the float64 tolerances above."""
    import pytest

    dtype = PARITY.dtype
    for result in results:
        assert result["losses"].tolist() == pytest.approx(reference_losses, rel=loss_rtol(dtype))
    state = results[0]["state"]
    assert set(state) == set(reference_state)
    for name, value in reference_state.items():
        assert state[name].dtype == dtype, name
        torch.testing.assert_close(state[name], value, atol=weight_atol(dtype, PARITY.lr), rtol=0, msg=name)


def saved_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor, autocast: bool) -> int:
    """Bytes autograd saves in one forward of `model` on `tokens` (saved_tensors_hooks,
    each storage once; a DTensor counted by its local part), the model's parameters and
    buffers left out; under bf16 autocast (its weight-cast cache off, as the step runs
    it) when `autocast`."""
    from contextlib import nullcontext

    from torch.distributed.tensor import DTensor

    def storage(t: torch.Tensor):
        return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()

    own = {storage(t)._cdata for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        seen[storage(t)._cdata] = storage(t).nbytes()
        return t
    context = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False) if autocast else nullcontext()
    with context, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return sum(n for k, n in seen.items() if k not in own)
