"""Shared helpers for the executor tests: plans, data, the rank body of a parallel run
(launched with executor.launch.run_local) and the single-process reference training loop, written with plain PyTorch pieces (one unsplit model,
torch.optim, clip_grad_norm_) so the parallel runs are compared with something they do
not share code with beyond the model and its initial weights.
"""

from __future__ import annotations

import torch

from costmodel.loading import load_model
from costmodel.specs import TrainingSpec
from costmodel.strategy import Strategy, even_stages
from executor.data import SyntheticTokens
from executor.launch import run_local as run_ranks
from executor.models import build_model, materialize
from executor.train import TrainConfig, Trainer, cross_entropy, lr_factor

SEQ_LEN = 16
GLOBAL_BATCH = 8
STEPS = 5
CONFIG = TrainConfig(lr=3e-3, warmup_steps=2, total_steps=5)


def training(optimizer: str = "adamw", global_batch: int = GLOBAL_BATCH) -> TrainingSpec:
    return TrainingSpec(global_batch=global_batch, seq_len=SEQ_LEN, precision="fp32", optimizer=optimizer,
                        flash_attention=True)


def strategy(dp=1, tp=1, pp=1, vpp=1, ep=1, m=None, schedule="1f1b", zero=0, recompute="none", sp=False,
             stages=None) -> Strategy:
    if m is None:
        m = max(2, pp * vpp) if pp > 1 else 1
    mbs = GLOBAL_BATCH // (dp * m)
    layers = 4
    return Strategy(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=m, vpp=vpp, ep=ep,
                    schedule=schedule, zero_stage=zero, recompute=recompute, sequence_parallel=sp,
                    stages=stages or even_stages(layers, pp, vpp, recompute))


def batches(spec, steps=STEPS, global_batch=GLOBAL_BATCH):
    source = SyntheticTokens(spec.vocab_size, seed=0)
    return [source.global_batch(step, global_batch, SEQ_LEN) for step in range(steps)]


def reference_run(model_name: str, optimizer: str = "adamw", steps: int = STEPS, global_batch: int = GLOBAL_BATCH):
    """Losses and final parameters of the unsplit model trained in one process."""
    spec = load_model(model_name)
    torch.manual_seed(0)
    model = materialize(build_model(spec, SEQ_LEN), "cpu", CONFIG.seed)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=CONFIG.lr, momentum=CONFIG.momentum)
    else:
        cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
        opt = cls(model.parameters(), lr=CONFIG.lr, betas=CONFIG.betas,
                  weight_decay=CONFIG.weight_decay if optimizer == "adamw" else 0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(CONFIG, s))
    losses = []
    for inputs, targets in batches(spec, steps, global_batch):
        loss = cross_entropy(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CONFIG.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def parallel_run(rank, world, model_name, strat, optimizer="adamw", steps=STEPS, global_batch=GLOBAL_BATCH):
    """Rank body: train `strat` and return (losses, full parameters) on every rank."""
    spec = load_model(model_name)
    trainer = Trainer(spec, training(optimizer, global_batch), strat, CONFIG, "cpu")
    losses = [trainer.step(x, y) for x, y in batches(spec, steps, global_batch)]
    return losses, trainer.full_state_dict()


def assert_matches_reference(results, ref_losses, ref_params) -> None:
    """Every rank's losses equal the single-process ones (rel 1e-5), and the weights the
    ranks hold, gathered, equal the single-process weights (rtol 1e-4, atol 5e-5)."""
    import pytest

    for rank, (losses, _) in enumerate(results):
        assert losses == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
    gathered = {}
    for _, params in results:
        gathered.update(params)
    # A tied head is the embedding; every other weight must come back from some rank.
    expected = set(ref_params) - ({"output.weight"} if "output.weight" not in gathered else set())
    assert set(gathered) == expected
    for name in expected:
        torch.testing.assert_close(gathered[name], ref_params[name], rtol=1e-4, atol=5e-5, msg=name)
