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

    # OPT's learned positions have two rows more than max_position_embeddings.
    opt = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 256, "vocab_size": 500,
           "max_position_embeddings": 64, "word_embed_proj_dim": 64, "transformers_version": "4.44.2"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(opt))
    with pytest.raises(SpecError, match=r"--model: transformers builds 136,320 parameters .* has 136,192"):
        make_problem(f"hf:{path}", "cpu", 8, gpus=2, seq_len=64)
    # A family the spec does describe passes the check and plans.
    problem = make_problem(f"hf:{HF_DIR / 'tinyllama-folder'}", "cpu", 8, gpus=2, seq_len=64)
    assert problem.model.num_hidden_layers == 2


# Published config.json files of dense decoder families and the parameter counts that
# transformers builds from them (= the model cards' figures: Llama 3 8B 8.03B, Qwen2 7B
# 7.62B, Gemma 2B 2.51B, Phi-2 2.78B, Pythia 1.4B 1.41B).
PUBLISHED = {
    "llama-2-7b.json": 6_738_415_616,
    "llama-3-8b.json": 8_030_261_248,
    "llama-3.2-1b.json": 1_235_814_400,     # head_dim 64, tied
    "mistral-7b.json": 7_241_732_096,
    "qwen2-7b.json": 7_615_616_512,         # q/k/v biases
    "qwen2.5-1.5b.json": 1_543_714_304,     # q/k/v biases, tied
    "qwen3-1.7b.json": 1_720_574_976,       # q/k norm, head_dim 128 with hidden 2048
    "gemma-2b.json": 2_506_172_416,         # GeGLU, head_dim 256, multi-query, tied
    "phi-2.json": 2_779_683_840,            # parallel block, one norm, biases, LM-head bias
    "pythia-1.4b.json": 1_414_647_808,      # GPT-NeoX: parallel block, two norms, rotary
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_load_as_transformers_builds_them(name):
    from costmodel.specs.hf import check_spec
    spec = load_model(str(HF_DIR / name))
    assert total_parameters(spec) == PUBLISHED[name]
    check_spec(HF_DIR / name, spec)   # raises unless transformers builds the same count


@pytest.mark.parametrize("name", ["qwen2.5-1.5b.json", "qwen3-1.7b.json", "gemma-2b.json", "phi-2.json",
                                  "pythia-1.4b.json"])
def test_published_families_trace_to_the_spec_flops(tmp_path, name):
    data = json.loads((HF_DIR / name).read_text())
    data["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(data))
    check(tmp_path / "config.json", seq=64)


def test_family_fields_read_from_published_configs():
    gemma, qwen2, phi = (load_model(str(HF_DIR / n)) for n in ("gemma-2b.json", "qwen2-7b.json", "phi-2.json"))
    assert (gemma.head_dim, gemma.q_size, gemma.mlp, gemma.tie_word_embeddings) == (256, 2048, "geglu", True)
    assert (qwen2.attention_bias, qwen2.attention_out_bias, qwen2.mlp_bias) == (True, False, False)
    assert (phi.parallel_block, phi.norms_per_layer, phi.lm_head_bias, phi.position_embedding) == (True, 1, True, "rope")


def _builtin_as_config_json(name: str, tmp_path, **changes):
    """A built-in whose YAML is a released config.json, written back as one."""
    from pathlib import Path

    import yaml

    import configs

    data = yaml.safe_load((Path(configs.__file__).parent / "models" / f"{name}.yaml").read_text())
    data.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def test_qwen3_moe_loads_as_transformers_builds_it(tmp_path):
    """Qwen3-30B-A3B's released config: 30,532,122,624 parameters (transformers' count on
    the meta device; the model card's 30.5B), experts moe_intermediate_size wide."""
    from costmodel.specs.hf import check_spec

    path = _builtin_as_config_json("qwen3-30b-a3b", tmp_path)
    spec = load_model(str(path))
    assert (spec.intermediate_size, spec.num_local_experts, spec.num_experts_per_tok, spec.qk_norm,
            spec.head_dim) == (768, 128, 8, True, 128)
    assert total_parameters(spec) == 30_532_122_624 == total_parameters(load_model("qwen3-30b-a3b"))
    check_spec(path, spec)


def test_qwen3_moe_traces_to_the_spec_flops(tmp_path):
    check(_builtin_as_config_json("qwen3-30b-a3b", tmp_path, num_hidden_layers=2, hidden_size=256, head_dim=32,
                                  num_attention_heads=8, num_key_value_heads=2, moe_intermediate_size=64,
                                  num_experts=8, num_experts_per_tok=2, vocab_size=1000), seq=64)


@pytest.mark.parametrize("changes, dense", [
    ({"decoder_sparse_step": 2}, tuple(range(0, 48, 2))),
    ({"mlp_only_layers": [0, 5]}, (0, 5)),
    ({"decoder_sparse_step": 3, "mlp_only_layers": [2]}, tuple(i for i in range(48) if (i + 1) % 3 or i == 2)),
])
def test_qwen3_moe_dense_layers_load_as_transformers_builds_them(tmp_path, changes, dense):
    """A layer off decoder_sparse_step, or in mlp_only_layers, holds a dense MLP
    intermediate_size wide (Qwen3MoeDecoderLayer)."""
    from costmodel.specs.hf import check_spec

    path = _builtin_as_config_json("qwen3-30b-a3b", tmp_path, **changes)
    spec = load_model(str(path))
    assert (spec.mlp_only_layers, spec.dense_intermediate_size) == (dense, 6144)
    check_spec(path, spec)


def test_qwen3_moe_dense_layers_trace_to_the_spec_flops(tmp_path):
    check(_builtin_as_config_json("qwen3-30b-a3b", tmp_path, num_hidden_layers=4, hidden_size=256, head_dim=32,
                                  num_attention_heads=8, num_key_value_heads=2, moe_intermediate_size=64,
                                  intermediate_size=512, num_experts=8, num_experts_per_tok=2, vocab_size=1000,
                                  decoder_sparse_step=2), seq=64)


def test_qwen2_moe_loads_as_transformers_builds_it(tmp_path):
    """Qwen1.5-MoE-A2.7B's config: 14,315,784,192 parameters as transformers builds them
    (the model card's 14.3B), 2,689,173,504 activated (2.7B): 60 experts 1408 wide, a
    gated shared expert 5632 wide, q/k/v biases, routing weights not renormalised."""
    from costmodel.specs.hf import check_spec
    from costmodel.terms.counts import active_parameters

    path = _builtin_as_config_json("qwen1.5-moe-a2.7b", tmp_path)
    spec = load_model(str(path))
    assert (spec.intermediate_size, spec.num_local_experts, spec.shared_expert_intermediate_size,
            spec.shared_expert_gate, spec.norm_topk_prob, spec.attention_bias, spec.attention_out_bias) == (
        1408, 60, 5632, True, False, True, False)
    assert total_parameters(spec) == 14_315_784_192 == total_parameters(load_model("qwen1.5-moe-a2.7b"))
    assert active_parameters(spec) == 2_689_173_504
    check_spec(path, spec)


def test_qwen2_moe_traces_to_the_spec_flops(tmp_path):
    """The shared expert and its gate run on every token: the traced layer's FLOPs are
    the spec's."""
    check(_builtin_as_config_json("qwen1.5-moe-a2.7b", tmp_path, num_hidden_layers=2, hidden_size=256,
                                  num_attention_heads=8, num_key_value_heads=8, moe_intermediate_size=64,
                                  shared_expert_intermediate_size=192, num_experts=8, num_experts_per_tok=2,
                                  vocab_size=1000), seq=64)


@pytest.mark.parametrize("model_type, norm_topk_prob, shared", [("qwen2_moe", False, 5632), ("qwen3_moe", True, 0)])
def test_qwen_moe_defaults_are_the_config_classes(tmp_path, model_type, norm_topk_prob, shared):
    """Keys left out read as transformers' config classes default them: Qwen2-MoE's shared
    expert 5632 wide and unnormalised routing; Qwen3-MoE none and renormalised. Qwen3-MoE
    builds no shared expert whatever its config says."""
    path = _builtin_as_config_json("qwen3-30b-a3b", tmp_path, model_type=model_type)
    data = json.loads(path.read_text())
    del data["norm_topk_prob"]
    data["shared_expert_intermediate_size" if model_type == "qwen3_moe" else "_unused"] = 4096
    path.write_text(json.dumps(data))
    spec = load_model(str(path))
    assert (spec.norm_topk_prob, spec.shared_expert_intermediate_size) == (norm_topk_prob, shared)


def test_qwen2_moe_gate_over_an_empty_shared_expert_is_refused(tmp_path):
    path = _builtin_as_config_json("qwen1.5-moe-a2.7b", tmp_path, shared_expert_intermediate_size=0)
    with pytest.raises(SpecError, match="^shared_expert_intermediate_size: 0: a gate over an empty shared expert"):
        load_model(str(path))


@pytest.mark.parametrize("name, total, card_active", [("gpt-oss-120b", 116_829_156_672, 5_132_849_472),
                                                      ("gpt-oss-20b", 20_914_757_184, 3_608_307_264)])
def test_gpt_oss_loads_as_transformers_builds_it(tmp_path, name, total, card_active):
    """gpt-oss's config (OpenAI's model card: 116.83B and 20.91B parameters, 5.13B and 3.61B
    active without the unembedding): biases on q/k/v/o, the router and the experts, a
    sink per head, SwiGLU clamped at 7, every other layer banded over 128 tokens."""
    from costmodel.specs.hf import check_spec
    from costmodel.terms.counts import active_parameters

    path = _builtin_as_config_json(name, tmp_path)
    spec = load_model(str(path))
    assert (spec.attention_bias, spec.attention_out_bias, spec.mlp_bias, spec.router_bias, spec.attention_sinks,
            spec.swiglu_limit, spec.attention_window, spec.windowed_layers) == (
        True, True, True, True, True, 7.0, 128, spec.num_hidden_layers // 2)
    assert total_parameters(spec) == total == total_parameters(load_model(name))
    assert active_parameters(spec) - spec.vocab_size * spec.hidden_size == card_active
    check_spec(path, spec)


@pytest.mark.parametrize("layer_types, text", [(["sliding_attention"], "expected a list of 2 entries"),
                                               ("sliding_attention", "expected a list of 2 entries"),
                                               (["sliding_attention", "chunked_attention"], "unknown 'chunked_attention'")])
def test_gpt_oss_layer_types_the_spec_cannot_describe_are_refused(tmp_path, layer_types, text):
    path = _builtin_as_config_json("gpt-oss-20b", tmp_path, num_hidden_layers=2, layer_types=layer_types)
    with pytest.raises(SpecError, match=f"^layer_types: {text}"):
        load_model(str(path))


def test_gpt_oss_shrunk_keeps_its_first_layers_kinds():
    spec = load_model("gpt-oss-20b", {"num_hidden_layers": "3"})
    assert (spec.num_hidden_layers, spec.windowed_layers) == (3, 2)


def _as_multimodal(path, model_type, architecture):
    """Rewrite a text model's config.json as its multimodal release holds it: under
    text_config, beside a vision_config."""
    text = json.loads(path.read_text())
    path.write_text(json.dumps({"architectures": [architecture], "model_type": model_type,
                                "transformers_version": text["transformers_version"], "text_config": text,
                                "vision_config": {}}))


@pytest.mark.parametrize("nested", [False, True])
def test_llama4_scout_loads_as_transformers_builds_it(tmp_path, nested):
    """Llama 4 Scout's text model: 107,769,861,120 parameters as transformers builds them
    (the card's 109B counts the vision encoder too), 17.17B active (the card's 17B): 16
    experts and a shared expert 8192 wide, top 1 by sigmoid, 36 of 48 layers chunked at
    8192. A multimodal config.json (model_type llama4) is read by its text_config."""
    from costmodel.specs.hf import check_spec
    from costmodel.terms.counts import active_parameters

    path = _builtin_as_config_json("llama4-scout", tmp_path)
    if nested:
        _as_multimodal(path, "llama4", "Llama4ForConditionalGeneration")
    spec = load_model(str(path))
    assert (spec.shared_expert_intermediate_size, spec.router_scoring, spec.windowed_layers, spec.attention_window,
            spec.chunked_attention, spec.num_experts_per_tok) == (8192, "sigmoid", 36, 8192, True, 1)
    assert total_parameters(spec) == 107_769_861_120 == total_parameters(load_model("llama4-scout"))
    assert active_parameters(spec) == 17_172_894_720
    check_spec(path, spec)


def test_llama4_maverick_loads_as_transformers_builds_it(tmp_path):
    """Llama 4 Maverick's text model: 400,711,848,960 parameters as transformers builds
    them (the card's 400B), 17.18B active (17B): the odd layers 128 experts and a shared
    expert 8192 wide, the even ones a dense SwiGLU 16384 wide (intermediate_size_mlp)."""
    from costmodel.specs.hf import check_spec
    from costmodel.terms.counts import active_parameters

    path = _builtin_as_config_json("llama4-maverick", tmp_path)
    spec = load_model(str(path))
    assert (spec.mlp_only_layers, spec.dense_intermediate_size, spec.num_local_experts) == (
        tuple(range(0, 48, 2)), 16384, 128)
    assert total_parameters(spec) == 400_711_848_960 == total_parameters(load_model("llama4-maverick"))
    assert active_parameters(spec) == 17_184_691_200
    check_spec(path, spec)


@pytest.mark.parametrize("nested", [False, True])
def test_gemma3_loads_as_transformers_builds_it(tmp_path, nested):
    """Gemma 3 1B's config: 999,885,952 parameters as transformers builds them (the
    report's 302M embedding and 698M other): q/k norm, four norms a layer, 22 of 26 layers
    banded over 512 tokens. A multimodal config.json (model_type gemma3, the 4B and up) is
    read by its text_config."""
    from costmodel.specs.hf import check_spec

    path = _builtin_as_config_json("gemma3-1b", tmp_path)
    if nested:
        _as_multimodal(path, "gemma3", "Gemma3ForConditionalGeneration")
    spec = load_model(str(path))
    assert (spec.qk_norm, spec.norms_per_layer, spec.mlp, spec.norm, spec.windowed_layers, spec.attention_window,
            spec.chunked_attention, spec.tie_word_embeddings) == (True, 4, "geglu", "rmsnorm_unit_offset", 22, 512,
                                                                  False, True)
    assert total_parameters(spec) == 999_885_952 == total_parameters(load_model("gemma3-1b"))
    if not nested:   # transformers' multimodal class would build the vision tower too
        check_spec(path, spec)


@pytest.mark.parametrize("field", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_gemma3_soft_capping_is_refused_by_name(tmp_path, field):
    path = _builtin_as_config_json("gemma3-1b", tmp_path, **{field: 30.0})
    with pytest.raises(SpecError, match=f"^{field}: soft-capped logits are not modelled"):
        load_model(str(path))


def test_gemma3_traces_to_the_spec_flops(tmp_path):
    """Within the window (seq 64, window 512) the banded layers are full ones: the traced
    layers' FLOPs (its four norms and q/k norm carry none) are the spec's."""
    check(_builtin_as_config_json("gemma3-1b", tmp_path, num_hidden_layers=2, hidden_size=256, head_dim=64,
                                  intermediate_size=512, vocab_size=1000), seq=64)


def test_windowed_families_read_their_window_overrides(tmp_path):
    """gpt-oss's sliding_window is its windowed layers' (not Mistral's memory-only field),
    given or overridden; null or --set windowed_layers=0 leaves every layer in full."""
    spec = load_model("gpt-oss-20b", {"sliding_window": "64"})
    assert (spec.attention_window, spec.windowed_layers, spec.sliding_window) == (64, 12, None)
    spec = load_model("gpt-oss-20b", {"windowed_layers": "0"})
    assert (spec.attention_window, spec.windowed_layers) == (None, 0)
    spec = load_model(str(_builtin_as_config_json("gpt-oss-20b", tmp_path, sliding_window=None)))
    assert (spec.attention_window, spec.windowed_layers) == (None, 0)


def test_llama4_layer_kinds_follow_no_rope_layers(tmp_path):
    """transformers derives Llama 4's layer kinds from no_rope_layers when layer_types is
    absent: a RoPE layer (1) attends in chunks, a NoPE layer (0) in full."""
    data = json.loads(_builtin_as_config_json("llama4-scout", tmp_path).read_text())
    del data["layer_types"]
    data["no_rope_layers"] = [1, 0] * 24
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert load_model(str(tmp_path / "config.json")).windowed_layers == 24
    del data["no_rope_layers"]
    data["no_rope_layer_interval"] = 0
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(SpecError, match="^no_rope_layer_interval: expected an integer of at least 1, got 0"):
        load_model(str(tmp_path / "config.json"))


def test_deepseek_v3_loads_as_transformers_builds_it(tmp_path):
    """DeepSeek-V3's released config: 671,026,404,352 parameters as transformers builds
    them (DeepSeek-AI 2024: 671B, 37B activated), its multi-token prediction module
    (which transformers does not build) priced apart; multi-head latent attention's
    ranks, the 3 dense first layers 18432 wide and 256 experts 2048 wide in 8 groups."""
    from costmodel.specs.hf import check_spec
    from costmodel.terms.counts import active_parameters

    path = _builtin_as_config_json("deepseek-v3", tmp_path)
    spec = load_model(str(path))
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim,
            spec.head_dim) == (1536, 512, 128, 64, 128, 64)
    assert (spec.mlp_only_layers, spec.dense_intermediate_size, spec.intermediate_size,
            spec.shared_expert_intermediate_size, spec.num_local_experts, spec.num_experts_per_tok) == (
        (0, 1, 2), 18432, 2048, 2048, 256, 8)
    assert (spec.router_scoring, spec.n_group, spec.topk_group, spec.routed_scaling_factor,
            spec.num_nextn_predict_layers) == ("sigmoid", 8, 4, 2.5, 1)
    assert total_parameters(spec) == 671_026_404_352 == total_parameters(load_model("deepseek-v3"))
    assert active_parameters(spec) == 37_552_282_624
    check_spec(path, spec)


def test_deepseek_v3_without_a_query_latent_loads_as_transformers_builds_it(tmp_path):
    """q_lora_rank null (DeepSeek-V2-Lite's form): one q projection, no query latent."""
    from costmodel.specs.hf import check_spec

    path = _builtin_as_config_json("deepseek-v3", tmp_path, q_lora_rank=None, num_hidden_layers=4,
                                   n_routed_experts=16, first_k_dense_replace=1)
    spec = load_model(str(path))
    assert spec.q_lora_rank == 0
    check_spec(path, spec)


def test_deepseek_v3_traces_to_the_spec_flops(tmp_path):
    """Per layer, dense and mixture-of-experts alike: MLA's five projections, scores over
    the 48-wide query/key heads and 32-wide value heads, routed and shared experts."""
    check(_builtin_as_config_json("deepseek-v3", tmp_path, num_hidden_layers=3, first_k_dense_replace=1,
                                  hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
                                  qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
                                  num_experts_per_tok=2, n_group=4, topk_group=2, vocab_size=1000,
                                  max_position_embeddings=128, rope_scaling=None), seq=64)


@pytest.mark.parametrize("changes, field, text", [
    ({"moe_layer_freq": 2}, "moe_layer_freq", "transformers builds every layer after first_k_dense_replace"),
    ({"v_head_dim": 0}, "v_head_dim", "multi-head latent attention needs"),
    ({"first_k_dense_replace": 61}, "mlp_only_layers", "every one of the 61 layers dense"),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace", "expected an integer of at least 0"),
    ({"n_group": 7}, "n_group", "7 groups do not split 256 experts evenly"),
    ({"topk_group": 9}, "topk_group", "between 1 and n_group 8"),
    ({"topk_group": 1, "n_group": 64}, "topk_group", "1 groups of 4 experts cannot hold the 8 experts"),
])
def test_deepseek_v3_layouts_the_spec_cannot_describe_are_refused_by_name(tmp_path, changes, field, text):
    with pytest.raises(SpecError, match=f"^{field}: .*{text}"):
        load_model(str(_builtin_as_config_json("deepseek-v3", tmp_path, **changes)))
