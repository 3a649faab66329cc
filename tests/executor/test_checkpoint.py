"""Checkpoints (executor.checkpoint, DCP): a checkpoint written under one plan resumes
under others (fewer and more processes, other dp / cp / tp / pp / ZeRO) with the losses of
an uninterrupted run (float64, the tolerances of executor_test_helpers); an
interrupted save leaves the previous checkpoint loadable; an altered file is refused by
name."""

import json

import pytest
import torch
from executor_test_helpers import (
    PARITY,
    STEPS,
    batches,
    loss_rtol,
    reference_run,
    strategy,
    training,
    weight_atol,
)

from costmodel.specs.loading import load_model
from executor import checkpoint
from executor.launch import run_local
from executor.train import Trainer

SAVED_AT = 2
PLAN_STUB = {"model_fingerprint": "sha256:test"}


def plan_of(strat) -> dict:
    from planner.plan_file import strategy_dict

    return {**PLAN_STUB, "model": {"name": "tiny-gpt"}, "strategy": strategy_dict(strat)}


def save_rank(rank, world, strat, root, model="tiny-gpt"):
    spec = load_model(model)
    trainer = Trainer(spec, training(), strat, PARITY, "cpu")
    losses = [trainer.step(x, y) for x, y in batches(spec, SAVED_AT)]
    checkpoint.save(trainer, SAVED_AT, root, plan_of(strat))
    return torch.tensor(losses, dtype=torch.float64)


def resume_rank(rank, world, strat, root, model="tiny-gpt"):
    spec = load_model(model)
    trainer = Trainer(spec, training(), strat, PARITY, "cpu")
    found = checkpoint.latest(root, log=lambda *a: None)
    step = checkpoint.load(trainer, found.path, plan_of(strat))
    losses = [trainer.step(x, y) for x, y in batches(spec, STEPS)[step:]]
    return {"step": torch.tensor(step), "losses": torch.tensor(losses, dtype=torch.float64),
            "state": trainer.full_state_dict()}


LAYOUTS = {
    "dp2xtp2": dict(dp=2, tp=2),
    "tp2xpp2": dict(tp=2, pp=2),
    "zero3-dp4": dict(dp=4, zero=3),
    "dp2": dict(dp=2),
    "pp2-zero1": dict(dp=2, pp=2, zero=1),
    "tp2": dict(tp=2),
    "single": dict(),
    # ZeRO-3 over the dp x cp ranks holding the same weights.
    "cp2-zero3": dict(cp=2, zero=3, m=2),
}
RESUMES = {"dp2xtp2": ["dp2", "tp2xpp2"], "tp2xpp2": ["zero3-dp4", "single"], "zero3-dp4": ["tp2", "pp2-zero1"],
           "cp2-zero3": ["dp2"]}


def world(layout):
    return strategy(**LAYOUTS[layout]).num_gpus


@pytest.mark.parametrize("saved", list(RESUMES))
def test_a_checkpoint_resumes_under_other_plans_with_the_uninterrupted_losses(saved, tmp_path):
    reference, final = reference_run("tiny-gpt", config=PARITY)
    rtol, atol = loss_rtol(PARITY.dtype), weight_atol(PARITY.dtype, PARITY.lr)
    first = run_local(save_rank, world(saved), strategy(**LAYOUTS[saved]), str(tmp_path))
    assert first[0].tolist() == pytest.approx(reference[:SAVED_AT], rel=rtol)
    for resumed in RESUMES[saved]:
        out = run_local(resume_rank, world(resumed), strategy(**LAYOUTS[resumed]), str(tmp_path))
        assert int(out[0]["step"]) == SAVED_AT
        assert out[-1]["losses"].tolist() == pytest.approx(reference[SAVED_AT:], rel=rtol), resumed
        state = out[0]["state"]
        for name, value in state.items():
            torch.testing.assert_close(value, final[name], atol=atol, rtol=0, msg=f"{resumed}: {name}")


def test_every_ranks_experts_are_saved_and_resume_under_another_ep(tmp_path):
    """Experts sharded over ep (and over edp by ZeRO-2): the checkpoint holds every
    rank's experts, and resumes with one process or ep 2 without ZeRO with the losses
    and weights of an uninterrupted run."""
    reference, final = reference_run("tiny-moe", config=PARITY)
    rtol, atol = loss_rtol(PARITY.dtype), weight_atol(PARITY.dtype, PARITY.lr)
    first = run_local(save_rank, 4, strategy(dp=4, ep=2, zero=2), str(tmp_path), "tiny-moe")
    assert first[0].tolist() == pytest.approx(reference[:SAVED_AT], rel=rtol)
    for resumed in (strategy(), strategy(dp=2, ep=2)):
        out = run_local(resume_rank, resumed.num_gpus, resumed, str(tmp_path), "tiny-moe")
        assert out[-1]["losses"].tolist() == pytest.approx(reference[SAVED_AT:], rel=rtol), resumed
        for name, value in out[0]["state"].items():
            torch.testing.assert_close(value, final[name], atol=atol, rtol=0, msg=f"{resumed}: {name}")


def test_an_altered_file_is_refused_by_name(tmp_path):
    run_local(save_rank, 2, strategy(dp=2), str(tmp_path))
    found = checkpoint.latest(tmp_path, log=lambda *a: None)
    data = sorted(p for p in found.path.iterdir() if p.suffix == ".distcp")[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(checkpoint.CheckpointError, match=f"{data}: checksum does not match"):
        checkpoint.verify(found.path)


def test_a_save_that_did_not_finish_is_skipped_with_a_message(tmp_path):
    run_local(save_rank, 2, strategy(dp=2), str(tmp_path))
    # What a save killed before its publish leaves: a partial directory of DCP files
    # and no manifest (the worker's crash hook produces the same under torchrun).
    partial = tmp_path / ".step-00000004.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    messages = []
    found = checkpoint.latest(tmp_path, log=messages.append)
    assert found.step == SAVED_AT and found.path.name == "step-00000002"
    assert messages == [f"checkpoint: ignoring {partial}: a save that did not finish"]
    checkpoint.verify(found.path)


def test_the_manifest_carries_the_plan_and_checksums(tmp_path):
    run_local(save_rank, 2, strategy(dp=2), str(tmp_path))
    manifest = json.loads((tmp_path / "step-00000002" / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["model_fingerprint"] == "sha256:test"
    assert manifest["plan"]["strategy"]["dp"] == 2
    assert set(manifest["files"]) == {p.name for p in (tmp_path / "step-00000002").iterdir()} - {"manifest.json"}
