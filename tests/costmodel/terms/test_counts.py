"""costmodel.terms.counts: parameter counts (against Hugging Face's exact figures and
Narayanan et al. 2021 eq. 2), forward FLOPs (Korthikanti et al. 2022 eq. 7) and the
layer chain graph."""

from __future__ import annotations

import dataclasses

import networkx as nx
import pytest
from costmodel_test_helpers import HF_DIR

from costmodel.specs.loading import load_model
from costmodel.terms.counts import (
    active_parameters,
    attention_parameters,
    build_graph,
    embedding_parameters,
    expert_parameters,
    head_forward_flops,
    head_parameters,
    layer_forward_flops,
    layer_parameters,
    model_flops_per_step,
    mtp_parameters,
    norm_parameters,
    total_parameters,
)


# ------------------------------------------------------------------ exact HF parameter counts
@pytest.mark.parametrize("source, expected", [
    # model.num_parameters() of the Hugging Face checkpoints
    ("llama2-7b", 6_738_415_616),
    (HF_DIR / "llama-2-7b.json", 6_738_415_616),
    ("llama2-13b", 13_015_864_320),
    ("llama2-70b", 68_976_648_192),
    ("llama3-8b", 8_030_261_248),
    ("llama3-70b", 70_553_706_496),
    ("llama3-405b", 405_853_388_800),
    ("mixtral-8x7b", 46_702_792_704),
    (HF_DIR / "mixtral-8x7b.json", 46_702_792_704),
    (HF_DIR / "mistral-7b.json", 7_241_732_096),
    (HF_DIR / "gpt2.json", 124_439_808),
])
def test_total_parameters_match_hugging_face(source, expected):
    assert total_parameters(load_model(source)) == expected


def test_llama_2_7b_parameter_count_by_hand():
    h, f, L, V = 4096, 11008, 32, 32000
    attention = 4 * h * h                 # q, k, v, o; no biases
    mlp = 3 * h * f                       # gate, up, down
    norms = 2 * h                         # two RMSNorm weights
    total = L * (attention + mlp + norms) + V * h + V * h + h  # embedding, untied head, final norm
    assert total == 6_738_415_616
    assert total_parameters(load_model("llama2-7b")) == total


def test_llama_3_8b_gqa_parameter_count_by_hand():
    h, kv, f, L, V = 4096, 8 * 128, 14336, 32, 128256
    per_layer = (2 * h * h + 2 * h * kv) + 3 * h * f + 2 * h
    assert L * per_layer + 2 * V * h + h == 8_030_261_248 == total_parameters(load_model("llama3-8b"))


def test_mixtral_parameter_count_by_hand():
    h, kv, f, L, V, E = 4096, 1024, 14336, 32, 32000, 8
    dense = 2 * h * h + 2 * h * kv + 2 * h + h * E   # attention, norms, router
    experts = E * 3 * h * f
    m = load_model("mixtral-8x7b")
    assert layer_parameters(m) == (dense, experts)
    assert L * (dense + experts) + 2 * V * h + h == 46_702_792_704


def test_qwen3_235b_a22b_total_and_active_parameters_by_hand():
    """Qwen3 technical report table 1: 235B total, 22B activated (8 of 128 experts)."""
    h, q, kv, f, L, V, E, k = 4096, 64 * 128, 4 * 128, 1536, 94, 151936, 128, 8
    dense = 2 * h * q + 2 * h * kv + 2 * 128 + 2 * h + h * E   # attention, q/k norms, two norms, router
    expert = 3 * h * f
    m = load_model("qwen3-235b-a22b")
    assert total_parameters(m) == L * (dense + E * expert) + 2 * V * h + h == 235_093_634_560
    assert active_parameters(m) == L * (dense + k * expert) + 2 * V * h + h
    assert round(active_parameters(m) / 1e9) == 22


def test_shared_expert_parameters_and_flops_by_hand():
    """tiny-moe-shared: 8 experts 64 wide, top 2, a gated shared expert 128 wide. The
    shared expert and its gate are dense weights every token uses and runs."""
    h, kv, f, E, k, fs, s = 64, 32, 64, 8, 2, 128, 32
    m = load_model("tiny-moe-shared")
    attention = 2 * h * h + 2 * h * kv
    dense = attention + 2 * h + h * E + 3 * h * fs + h   # norms, router, shared expert, its gate
    assert layer_parameters(m) == (dense, E * 3 * h * f)
    assert active_parameters(m) == 4 * (dense + k * 3 * h * f) + 2 * 512 * h + h
    flops = 2 * s * (attention + 3 * h * f * k + h * E + 3 * h * fs + h) + 4 * s * s * h
    assert layer_forward_flops(m, s) == flops


def test_gpt_oss_120b_parameters_and_flops_by_hand():
    """gpt-oss-120b (OpenAI 2025, model card table 1: 116.83B): biased q/k/v/o of 64 query
    and 8 KV heads of 64, a sink per head, a biased router over 128 experts, each a biased
    SwiGLU 2880 wide; half the layers attend 128 keys a query."""
    h, q, kv, f, E, k, L, V = 2880, 64 * 64, 8 * 64, 2880, 128, 4, 36, 201088
    attention = 2 * h * q + 2 * h * kv + (q + 2 * kv + h) + 64
    dense = attention + 2 * h + (h + 1) * E
    expert = 3 * h * f + 2 * f + h
    m = load_model("gpt-oss-120b")
    assert layer_parameters(m) == (dense, E * expert)
    assert total_parameters(m) == L * (dense + E * expert) + 2 * V * h + h == 116_829_156_672
    s = 4096
    keys = (s + 128) / 2   # full layers s keys a query, banded layers 128
    flops = 2 * s * (2 * h * q + 2 * h * kv + 3 * h * f * k + h * E) + 4 * s * keys * q
    assert layer_forward_flops(m, s) == flops


def test_active_parameters_are_the_model_cards():
    assert active_parameters(load_model("mixtral-8x7b")) / 1e9 == pytest.approx(12.9, abs=0.05)   # Jiang et al. 2024
    assert active_parameters(load_model("qwen3-30b-a3b")) == 3_353_032_704   # the card: "3.3B"
    qwen15 = load_model("qwen1.5-moe-a2.7b")   # the card: 14.3B, 2.7B activated
    assert (total_parameters(qwen15), active_parameters(qwen15)) == (14_315_784_192, 2_689_173_504)
    dense = load_model("llama3-8b")
    assert active_parameters(dense) == total_parameters(dense)


def test_tinyllama_folder_parameter_count_by_hand():
    h, kv, f, L, V = 256, 2 * 64, 688, 2, 1000
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    assert total_parameters(load_model(HF_DIR / "tinyllama-folder")) == L * per_layer + 2 * V * h + h == 1_963_264


def test_gpt2_parameter_count_by_hand():
    h, L, V, s = 768, 12, 50257, 1024
    per_layer = 12 * h * h + 13 * h          # 4h^2+4h attention, 8h^2+5h MLP, 4h LayerNorms
    total = L * per_layer + V * h + s * h + 2 * h  # tied head, learned positions, final LayerNorm
    assert total == 124_439_808 == total_parameters(load_model(HF_DIR / "gpt2.json"))


# ------------------------------------------------------------------ Narayanan eq. 2 for GPT
def narayanan_eq2(l, h, V, s):
    """P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)), in integers: 12lh^2 + 13lh + (V+s)h."""
    return 12 * l * h * h + 13 * l * h + (V + s) * h


@pytest.mark.parametrize("name, l, h, billions", [
    ("gpt-22b", 48, 6144, 22.1),
    ("gpt3-175b", 96, 12288, 174.6),
    ("gpt-530b", 105, 20480, 529.6),
    ("gpt-1t", 128, 25600, 1008.0),
])
def test_gpt_parameters_follow_narayanan_eq2(name, l, h, billions):
    V, s = 51200, 2048
    eq2 = narayanan_eq2(l, h, V, s)
    assert eq2 == pytest.approx(12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h)), rel=1e-12)
    # The code also counts the final LayerNorm (weight + bias, 2h) that eq. 2 leaves out.
    assert total_parameters(load_model(name)) == eq2 + 2 * h
    assert round(total_parameters(load_model(name)) / 1e9, 1) == billions  # Korthikanti Table 3 / calibration file


def test_gpt3_175b_is_174_6_billion():
    assert total_parameters(load_model("gpt3-175b")) == 174_615_846_912


# ------------------------------------------------------------------ components
def test_components_gpt():
    m = load_model("tiny-gpt")  # h 64, f 256, V 512, positions 64, tied
    h, f = 64, 256
    assert attention_parameters(m) == 4 * h * h + 4 * h
    assert expert_parameters(m) == 2 * h * f + f + h
    assert norm_parameters(m) == 2 * h
    assert layer_parameters(m) == (4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h, 0)
    assert embedding_parameters(m) == 512 * h + 64 * h
    assert head_parameters(m) == 2 * h  # tied: final LayerNorm only


def test_components_llama_gqa():
    m = load_model("tiny-llama")  # h 64, 4 heads, 2 kv heads (kv 32), f 176, V 512, untied
    h, kv, f = 64, 32, 176
    assert attention_parameters(m) == 2 * h * h + 2 * h * kv
    assert expert_parameters(m) == 3 * h * f
    assert norm_parameters(m) == h
    assert layer_parameters(m) == (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h, 0)
    assert embedding_parameters(m) == 512 * h  # RoPE: no position table
    assert head_parameters(m) == 512 * h + h


def test_components_moe():
    m = load_model("tiny-moe")  # h 64, kv 32, f 128, 4 experts top-2
    h, kv, f, E = 64, 32, 128, 4
    assert layer_parameters(m) == (2 * h * h + 2 * h * kv + 2 * h + h * E, E * 3 * h * f)


# ------------------------------------------------------------------ FLOPs
def test_gpt_layer_flops_are_24sh2_plus_4s2h():
    m = load_model("gpt3-175b")
    s, h = 2048, 12288
    assert layer_forward_flops(m, s) == 24 * s * h * h + 4 * s * s * h


def test_llama_gqa_layer_flops():
    m = load_model("llama3-8b")
    s, h, kv, f = 8192, 4096, 1024, 14336
    projections = 2 * s * (h * h + h * kv + h * kv + h * h)  # q, k, v, o
    scores = 2 * s * s * h + 2 * s * s * h                   # QK^T and AV
    mlp = 2 * s * 3 * h * f
    assert layer_forward_flops(m, s) == projections + scores + mlp


def test_moe_layer_flops_count_the_visited_experts_and_router():
    m = load_model("mixtral-8x7b")
    s, h, kv, f, k, E = 4096, 4096, 1024, 14336, 2, 8
    expected = 2 * s * (2 * h * h + 2 * h * kv) + 4 * s * s * h + k * 2 * s * 3 * h * f + 2 * s * h * E
    assert layer_forward_flops(m, s) == expected


def test_moe_layer_flops_count_the_rows_capacity_keeps():
    m = dataclasses.replace(load_model("mixtral-8x7b"), moe_capacity_factor=0.75)
    s, h, kv, f, k, E = 4096, 4096, 1024, 14336, 2, 8
    expected = 2 * s * (2 * h * h + 2 * h * kv) + 4 * s * s * h + 0.75 * k * 2 * s * 3 * h * f + 2 * s * h * E
    assert layer_forward_flops(m, s) == pytest.approx(expected, rel=1e-15)


def test_head_flops():
    assert head_forward_flops(load_model("gpt3-175b"), 2048) == 2 * 2048 * 12288 * 51200


@pytest.mark.parametrize("name, B", [("gpt-22b", 4), ("gpt3-175b", 1536), ("gpt-1t", 512)])
def test_model_flops_per_step_is_korthikanti_eq7(name, B):
    m = load_model(name)
    s, h, L, V = 2048, m.hidden_size, m.num_hidden_layers, m.vocab_size
    eq7 = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L))
    assert model_flops_per_step(m, B, s) == pytest.approx(eq7, rel=1e-12)


def test_model_flops_per_step_llama_is_3x_forward():
    m = load_model("llama2-7b")
    B, s, h, f, L, V = 8, 4096, 4096, 11008, 32, 32000
    forward = L * (8 * s * h * h + 4 * s * s * h + 6 * s * h * f) + 2 * s * h * V
    assert model_flops_per_step(m, B, s) == pytest.approx(3 * B * forward, rel=1e-12)


def test_matmul_flops_are_6_per_layer_parameter_per_token():
    # Without the s^2 attention term: 3 passes * 2 FLOPs per weight per token (Kaplan et al. 2020, 6ND).
    m = load_model("gpt3-175b")
    s, h, L = 2048, 12288, 96
    dense_matmul_params = 12 * h * h
    assert 3 * L * (layer_forward_flops(m, s) - 4 * s * s * h) == 6 * L * dense_matmul_params * s


# ------------------------------------------------------------------ graph
def test_build_graph_is_a_chain():
    m = load_model("tiny-gpt")
    g = build_graph(m, 64)
    names = ["embedding"] + [f"layer.{i}" for i in range(4)] + ["head"]
    assert g.graph["name"] == "tiny-gpt"
    assert g.number_of_nodes() == 4 + 2 and g.number_of_edges() == 4 + 1
    assert nx.is_directed_acyclic_graph(g)
    assert list(nx.topological_sort(g)) == names
    assert list(g.edges) == list(zip(names, names[1:]))
    assert [g.nodes[n]["kind"] for n in names] == ["embedding"] + ["layer"] * 4 + ["head"]
    assert [g.nodes[f"layer.{i}"]["index"] for i in range(4)] == [0, 1, 2, 3]


def test_graph_attributes_add_up():
    m = load_model("tiny-moe")
    s, B = 64, 3
    g = build_graph(m, s)
    assert sum(d["parameters"] for _, d in g.nodes(data=True)) == total_parameters(m)
    flops = sum(d["forward_flops"] for _, d in g.nodes(data=True))
    assert 3 * B * flops == pytest.approx(model_flops_per_step(m, B, s), rel=1e-12)
    layer = g.nodes["layer.2"]
    assert layer["expert_parameters"] == 4 * 3 * 64 * 128
    assert layer["forward_flops"] == layer_forward_flops(m, s)
    assert g.nodes["embedding"]["forward_flops"] == 0.0
    assert g.nodes["head"]["forward_flops"] == 2 * s * 64 * 512


def test_deepseek_v3_parameters_and_flops_by_hand():
    """DeepSeek-V3 (DeepSeek-AI 2024: 671B, 37B activated): multi-head latent attention
    (q_a 7168 x 1536, q_b 1536 x 128 x 192, kv_a 7168 x 576, kv_b 512 x 128 x 256, o 16384
    x 7168, the two latents' norms), 3 dense layers with a SwiGLU 18432 wide, 58 with 256
    experts 2048 wide (8 per token) beside a shared one and a 256-way router; the MTP
    module (a sparse layer, a 2h x h projection and three norms) priced apart."""
    h, V, L, K, E, k, f, fd = 7168, 129280, 61, 3, 256, 8, 2048, 18432
    attention = h * 1536 + 1536 * 128 * 192 + h * 576 + 512 * 128 * 256 + 128 * 128 * h + 1536 + 512
    assert attention_parameters(load_model("deepseek-v3")) == attention == 187_107_328
    dense_layer = attention + 2 * h + 3 * h * fd
    sparse_dense = attention + 2 * h + E * h + 3 * h * f
    experts = E * 3 * h * f
    m = load_model("deepseek-v3")
    assert layer_parameters(m) == (sparse_dense, experts)
    assert layer_parameters(m.dense_layer()) == (dense_layer, 0)
    assert total_parameters(m) == 2 * V * h + h + K * dense_layer + (L - K) * (sparse_dense + experts) \
        == 671_026_404_352
    assert active_parameters(m) == 2 * V * h + h + K * dense_layer + (L - K) * (sparse_dense + k * 3 * h * f)
    assert mtp_parameters(m) == sparse_dense + experts + 2 * h * h + 3 * h
    s = 4096
    projections = 2 * s * (attention - 1536 - 512)
    scores = 2 * s * s * (128 * 192 + 128 * 128)
    dense_flops = projections + scores + 2 * s * 3 * h * fd
    sparse_flops = projections + scores + 2 * s * (3 * h * f * k + h * E + 3 * h * f)
    assert layer_forward_flops(m.dense_layer(), s) == dense_flops
    assert layer_forward_flops(m, s) == sparse_flops
    head = 2 * s * h * V
    mtp = 2 * s * 2 * h * h + sparse_flops + head
    assert model_flops_per_step(m, 2, s) == 3 * 2 * (K * dense_flops + (L - K) * sparse_flops + head + mtp)
