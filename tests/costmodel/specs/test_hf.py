"""Hugging Face models built from a config.json on the meta device and traced: the same
parameter count as the cost model's spec of that config, layer and head FLOPs within 1%."""

import json

import pytest

pytest.importorskip("transformers")

from costmodel_test_helpers import HF_DIR  # noqa: E402

from costmodel.specs.hf import trace_hf  # noqa: E402
from costmodel.specs.loading import SpecError, load_model  # noqa: E402
from costmodel.terms.counts import build_graph, total_parameters  # noqa: E402

GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 128, "n_head": 4, "n_layer": 3,
        "n_positions": 64, "vocab_size": 500, "transformers_version": "4.44.2"}


def check(source, seq=32):
    spec = load_model(str(source))
    graph, analytic = trace_hf(source, seq), build_graph(spec, seq)
    assert sum(graph.nodes[n]["parameters"] for n in graph) + graph.graph["glue_parameters"] == total_parameters(spec)
    layers = [n for n in graph.graph["order"] if n.rsplit(".", 1)[0].endswith(("layers", ".h"))]
    assert len(layers) == spec.num_hidden_layers
    for i, node in enumerate(layers):
        assert graph.nodes[node]["forward_flops"] == pytest.approx(analytic.nodes[f"layer.{i}"]["forward_flops"], rel=0.01)
        assert graph.nodes[node]["backward_flops"] == pytest.approx(2 * graph.nodes[node]["forward_flops"], rel=0.01)
    head = graph.nodes[graph.graph["order"][-1]]["forward_flops"]
    assert head == pytest.approx(analytic.nodes["head"]["forward_flops"], rel=0.01)
    return graph


def test_llama_config_folder():
    graph = check(HF_DIR / "tinyllama-folder")
    assert graph.nodes["model.layers.0"]["linears"]["self_attn.q_proj"] == "column"
    assert graph.nodes["model.layers.0"]["linears"]["mlp.down_proj"] == "row"


def test_gpt2_config_with_tied_head(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2))
    graph = check(path)
    assert graph.nodes["lm_head"]["parameters"] == 0   # tied to the token embedding


def test_missing_config_names_the_field(tmp_path):
    with pytest.raises(SpecError, match="--model: no Hugging Face config.json"):
        trace_hf(tmp_path, 16)


def test_hf_prefix_refuses_an_architecture_the_spec_cannot_describe(tmp_path):
    from planner.api import make_problem

    neox = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256, "vocab_size": 500,
            "max_position_embeddings": 64, "transformers_version": "4.44.2"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(neox))
    with pytest.raises(SpecError, match=r"--model: transformers builds 164,096 parameters .* has 136,192"):
        make_problem(f"hf:{path}", "cpu", 8, gpus=2, seq_len=64)
    # A family the spec does describe passes the check and plans.
    problem = make_problem(f"hf:{HF_DIR / 'tinyllama-folder'}", "cpu", 8, gpus=2, seq_len=64)
    assert problem.model.num_hidden_layers == 2
