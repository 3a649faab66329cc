"""auto_parallelize on CPU ranks (gloo): tiny Hugging Face Llama and GPT-2 models built
from configs, and a built-in model, planned on the spot for each layout, train five
AdamW steps in float64 with the losses of the unparallelized model and give back the
full weights under the model's own names equal to the reference's, within the float64
tolerances of executor_test_helpers (the model's dtype is the trainer's). The model's
own loss (which computes in float32) is checked on its own, on one step."""

import pytest
import torch
import torch.nn.functional as F

from executor_test_helpers import loss_rtol, run_ranks, weight_atol

transformers = pytest.importorskip("transformers")

SEQ, BATCH, STEPS, LR = 16, 8, 5, 3e-3
DTYPE = torch.float64


def causal_lm_loss(logits, labels):
    """The next-token loss in the logits' dtype (Hugging Face's own upcasts to float32)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def hf_config(family: str):
    if family in ("mistral", "qwen2"):   # Qwen2's q/k/v carry biases
        config = {"mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}[family]
        return config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False)
    if family == "llama":
        return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        tie_word_embeddings=False)
    return transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=4, n_head=4, n_positions=SEQ,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def hf_model(family: str, dtype: torch.dtype = DTYPE):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager").to(dtype)


def token_batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def hf_reference(family: str):
    """One process, plain torch.optim."""
    model = hf_model(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in token_batches():
        loss = causal_lm_loss(model(input_ids=ids).logits, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf_rank(rank, world, family, fix):
    from executor import auto_parallelize

    trainer = auto_parallelize(hf_model(family), cluster="cpu", global_batch=BATCH, seq_len=SEQ, fix=fix,
                               loss_fn=causal_lm_loss, optimizer=lambda params: torch.optim.AdamW(params, lr=LR))
    losses = [trainer.step({"input_ids": ids, "labels": ids}) for ids in token_batches()]
    return {"losses": torch.tensor(losses, dtype=torch.float64), "state": trainer.state_dict()}


LAYOUTS = {
    "dp2": {"dp": 2, "tp": 1, "pp": 1, "zero": 0},
    "tp2": {"dp": 1, "tp": 2, "pp": 1},
    "pp2": {"dp": 1, "tp": 1, "pp": 2, "schedule": "1f1b"},
    "dp2xtp2": {"dp": 2, "tp": 2, "pp": 1, "zero": 0},
    "tp2xpp2": {"dp": 1, "tp": 2, "pp": 2, "schedule": "gpipe"},
    "zero3-dp2": {"dp": 2, "tp": 1, "pp": 1, "zero": 3},
    "tp2-recompute": {"dp": 1, "tp": 2, "pp": 1, "recompute": "full"},
}


def check(results, reference_losses, reference_state):
    for result in results:
        assert result["losses"].tolist() == pytest.approx(reference_losses, rel=loss_rtol(DTYPE))
    state = results[0]["state"]
    assert set(state) == set(reference_state)
    for name, value in reference_state.items():
        assert state[name].dtype == DTYPE, name
        torch.testing.assert_close(state[name], value, atol=weight_atol(DTYPE, LR), rtol=0, msg=name)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hf_models_train_as_the_unparallelized_model(family, layout):
    fix = LAYOUTS[layout]
    world = fix["dp"] * fix["tp"] * fix["pp"]
    check(run_ranks(hf_rank, world, family, fix), *hf_reference(family))


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_other_decoder_families_split_by_the_same_roles(family, layout):
    check(run_ranks(hf_rank, 2, family, LAYOUTS[layout]), *hf_reference(family))


def builtin_model():
    from costmodel.loading import load_model
    from executor.models import build_model, materialize

    return materialize(build_model(load_model("tiny-gpt"), SEQ, dtype=DTYPE), "cpu", seed=3)


def shifted_batches():
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 256, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def builtin_rank(rank, world, fix):
    from executor import auto_parallelize

    trainer = auto_parallelize(builtin_model(), cluster="cpu", global_batch=BATCH, seq_len=SEQ, fix=fix,
                               optimizer=lambda params: torch.optim.AdamW(params, lr=LR))
    losses = [trainer.step(batch) for batch in shifted_batches()]
    return {"losses": torch.tensor(losses, dtype=torch.float64), "state": trainer.state_dict()}


@pytest.mark.parametrize("layout", ["dp2", "tp2xpp2"])
def test_a_builtin_model_trains_with_the_users_weights(layout):
    from executor.train import cross_entropy

    model = builtin_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in shifted_batches():
        loss = cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    fix = LAYOUTS[layout]
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    check(run_ranks(builtin_rank, fix["dp"] * fix["tp"] * fix["pp"], fix), losses, reference)


def load_rank(rank, world, family, fix):
    """Load another model's weights, give them back, and take one step from them with
    the model's own loss, in float32."""
    from executor import auto_parallelize

    trainer = auto_parallelize(hf_model(family, torch.float32), cluster="cpu", global_batch=BATCH, seq_len=SEQ,
                               fix=fix, optimizer=lambda params: torch.optim.AdamW(params, lr=LR))
    torch.manual_seed(7)
    other = transformers.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager")
    trainer.load_state_dict(other.state_dict())
    back = trainer.state_dict()
    loss = trainer.step({"input_ids": token_batches()[0], "labels": token_batches()[0]})
    return {"back": back, "loss": torch.tensor(loss, dtype=torch.float64)}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_load_state_dict_gives_back_the_same_weights_and_trains_from_them(family):
    results = run_ranks(load_rank, 4, family, LAYOUTS["tp2xpp2"])
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
    from executor.parallelize import UnsupportedPlan

    model = hf_model("llama")
    mlp = model.model.layers[0].mlp
    mlp.weird = mlp.down_proj   # a linear layer whose role its name does not tell
    del mlp.down_proj
    try:
        auto_parallelize(model, cluster="cpu", global_batch=BATCH, seq_len=SEQ, fix={"tp": 2})
    except UnsupportedPlan as err:
        return {"message": str(err)}
    return {"message": "no error"}


def test_a_model_it_cannot_split_names_the_module():
    message = run_ranks(unsplittable_rank, 2)[0]["message"]
    assert message == ("model: cannot split LlamaDecoderLayer layers.0.mlp.weird for tp 2: its role "
                       "(column or row) is not known from its name")


def planned_rank(rank, world, plan):
    from executor import auto_parallelize
    from executor.parallelize import UnsupportedPlan

    try:
        trainer = auto_parallelize(hf_model("gpt2"), plan, loss_fn=causal_lm_loss,
                                   optimizer=lambda params: torch.optim.AdamW(params, lr=LR))
    except UnsupportedPlan as err:
        return {"message": str(err)}
    losses = [trainer.step({"input_ids": ids, "labels": ids}) for ids in token_batches()]
    return {"losses": torch.tensor(losses, dtype=torch.float64), "state": trainer.state_dict()}


def test_a_given_plan_file_runs_and_a_plan_for_another_model_is_refused(tmp_path):
    from planner import plan_model
    from planner.plan import write_plan

    meta = (torch.zeros(1, SEQ, dtype=torch.long, device="meta"),)
    doc = plan_model(hf_model("gpt2"), meta, cluster="cpu", gpus=2, global_batch=BATCH, precision="fp32",
                     fix={"tp": 2})
    write_plan(doc, tmp_path / "gpt2.json")
    check(run_ranks(planned_rank, 2, str(tmp_path / "gpt2.json")), *hf_reference("gpt2"))
    other = plan_model(hf_model("llama"), meta, cluster="cpu", gpus=2, global_batch=BATCH, precision="fp32",
                       fix={"tp": 2})
    message = run_ranks(planned_rank, 2, other)[0]["message"]
    assert message.startswith("plan.model.") and "the plan was made for llama" in message
