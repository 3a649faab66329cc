"""auto_parallelize's own concerns (its parity with one process is in test_step.py):
weights given to a Hugging Face model come back unchanged under the model's own names
and train with the model's own loss; a model it cannot split, and a plan made for
another model, are refused by name; a given plan file runs."""

import pytest
import torch
from executor_test_helpers import (
    AUTO_LAYOUTS,
    GLOBAL_BATCH,
    PARITY,
    SEQ_LEN,
    assert_trains_as_the_model,
    causal_lm_loss,
    hf_config,
    hf_model,
    hf_reference,
    loss_rtol,
    token_batches,
)

from executor.launch import run_local

transformers = pytest.importorskip("transformers")


def load_rank(rank, world, family, fix):
    """Load another model's weights, give them back, and take one step from them with
    the model's own loss, in float32."""
    from executor import auto_parallelize

    trainer = auto_parallelize(hf_model(family, torch.float32), cluster="cpu", global_batch=GLOBAL_BATCH,
                               seq_len=SEQ_LEN, fix=fix,
                               optimizer=lambda params: torch.optim.AdamW(params, lr=PARITY.lr))
    torch.manual_seed(7)
    other = transformers.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager")
    trainer.load_state_dict(other.state_dict())
    back = trainer.state_dict()
    loss = trainer.step({"input_ids": token_batches()[0], "labels": token_batches()[0]})
    return {"back": back, "loss": torch.tensor(loss, dtype=torch.float64)}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_load_state_dict_gives_back_the_same_weights_and_trains_from_them(family):
    results = run_local(load_rank, 4, family, AUTO_LAYOUTS["tp2xpp2"])
    torch.manual_seed(7)
    other = transformers.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager")
    ids = token_batches()[0]
    expected = other(input_ids=ids, labels=ids).loss.item()
    for result in results:
        assert set(result["back"]) == set(other.state_dict())
        for name, value in other.state_dict().items():
            assert torch.equal(result["back"][name], value), name
        assert result["loss"].item() == pytest.approx(expected, rel=loss_rtol(torch.float32, steps=1))


def unsplittable_rank(rank, world):
    from executor import auto_parallelize
    from executor.launch import UnsupportedPlan

    model = hf_model("llama")
    mlp = model.model.layers[0].mlp
    mlp.weird = mlp.down_proj   # a linear layer whose role its name does not tell
    del mlp.down_proj
    try:
        auto_parallelize(model, cluster="cpu", global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, fix={"tp": 2})
    except UnsupportedPlan as err:
        return {"message": str(err)}
    return {"message": "no error"}


def test_a_model_it_cannot_split_names_the_module():
    message = run_local(unsplittable_rank, 2)[0]["message"]
    assert message == ("model: cannot split LlamaDecoderLayer layers.0.mlp.weird for tp 2: its role "
                       "(column or row) is not known from its name")


def planned_rank(rank, world, plan):
    from executor import auto_parallelize
    from executor.launch import UnsupportedPlan

    try:
        trainer = auto_parallelize(hf_model("gpt2"), plan, loss_fn=causal_lm_loss,
                                   optimizer=lambda params: torch.optim.AdamW(params, lr=PARITY.lr))
    except UnsupportedPlan as err:
        return {"message": str(err)}
    losses = [trainer.step({"input_ids": ids, "labels": ids}) for ids in token_batches()]
    return {"losses": torch.tensor(losses, dtype=torch.float64), "state": trainer.state_dict()}


def test_a_given_plan_file_runs_and_a_plan_for_another_model_is_refused(tmp_path):
    from planner import plan_model
    from planner.plan_file import write_plan

    meta = (torch.zeros(1, SEQ_LEN, dtype=torch.long, device="meta"),)
    doc = plan_model(hf_model("gpt2"), meta, cluster="cpu", gpus=2, global_batch=GLOBAL_BATCH, precision="fp32",
                     fix={"tp": 2})
    write_plan(doc, tmp_path / "gpt2.json")
    assert_trains_as_the_model(run_local(planned_rank, 2, str(tmp_path / "gpt2.json")), *hf_reference("gpt2"))
    other = plan_model(hf_model("llama"), meta, cluster="cpu", gpus=2, global_batch=GLOBAL_BATCH, precision="fp32",
                       fix={"tp": 2})
    message = run_local(planned_rank, 2, other)[0]["message"]
    assert message.startswith("plan.model.") and "the plan was made for llama" in message
