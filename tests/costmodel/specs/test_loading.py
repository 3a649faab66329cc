"""costmodel.specs.loading: built-in names, Hugging Face config.json fixtures, own YAML files,
`--set` overrides, clusters and the SpecError contract (`.field` names what is wrong)."""

from __future__ import annotations

import json

import pytest
from costmodel_test_helpers import HF_DIR

from costmodel.specs import ModelSpec
from costmodel.specs.loading import (
    SpecError,
    as_bool,
    as_float,
    as_int,
    builtin_names,
    load_cluster,
    load_model,
    make_training,
    model_from_dict,
    parse_overrides,
)
from costmodel.units import GIB

TINY_GPT_YAML = """\
model_type: gpt
hidden_size: 64
num_hidden_layers: 4
num_attention_heads: 4
num_key_value_heads: 4
intermediate_size: 256
vocab_size: 512
max_position_embeddings: 64
tie_word_embeddings: true
"""

CLUSTER_YAML = """\
name: test-cluster
gpu: a100-80gb
gpus_per_node: 4
num_nodes: 2
intra_node:
  bandwidth_bytes_per_s: 1.0e+11
  latency_s: 2.0e-06
  efficiency: 0.5
inter_node:
  bandwidth_bytes_per_s: 1.0e+10
  latency_s: 1.0e-05
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def spec_error(fn, *args, **kwargs) -> SpecError:
    with pytest.raises(SpecError) as info:
        fn(*args, **kwargs)
    return info.value


# ------------------------------------------------------------------ built-in names
@pytest.mark.parametrize("name", builtin_names("models"))
def test_every_builtin_model_loads(name):
    model = load_model(name)
    assert isinstance(model, ModelSpec)
    assert model.name == name
    assert model.hidden_size % model.num_attention_heads == 0
    assert model.num_attention_heads % model.num_key_value_heads == 0


def test_builtin_lists_are_the_config_files():
    assert len(builtin_names("models")) == 31
    assert builtin_names("clusters") == ["cpu", "dgx-a100-40gb", "dgx-a100-80gb", "dgx-b200", "dgx-h100", "dgx-h200",
                                          "dgx-h800", "dgx-v100", "gb200-nvl72", "grand-teton-h100", "mi300x", "mixed-a100-v100",
                                          "mixed-h100-a100", "mixed-h200-a100-40gb"]
    assert "a100-80gb" in builtin_names("hardware") and "h100-hbm2e-500w" in builtin_names("hardware")
    assert builtin_names("runtimes") == ["deepspeed-zero", "megatron", "pytorch-native"]


def test_builtin_gpt3_175b_fields():
    m = load_model("gpt3-175b")
    assert (m.model_type, m.hidden_size, m.num_hidden_layers, m.num_attention_heads) == ("gpt", 12288, 96, 96)
    assert (m.intermediate_size, m.vocab_size, m.max_position_embeddings) == (4 * 12288, 51200, 2048)
    assert m.tie_word_embeddings is True and not m.is_moe and m.is_gpt
    assert m.head_dim == 12288 // 96 == 128
    assert m.kv_size == 96 * 128


def test_builtin_llama2_70b_is_gqa():
    m = load_model("llama2-70b")
    assert (m.model_type, m.num_attention_heads, m.num_key_value_heads) == ("llama", 64, 8)
    assert m.head_dim == 8192 // 64 == 128
    assert m.kv_size == 8 * 128 == 1024
    assert m.tie_word_embeddings is False


def test_builtin_mixtral_is_moe():
    m = load_model("mixtral-8x7b")
    assert m.model_type == "mixtral" and m.is_moe
    assert (m.num_local_experts, m.num_experts_per_tok, m.intermediate_size) == (8, 2, 14336)


def test_moe_capacity_factor_reads_and_keeps_dropless_fingerprints():
    m = load_model("mixtral-8x7b", {"moe_capacity_factor": "1.25"})
    assert m.moe_capacity_factor == 1.25
    assert m.canonical_dict()["moe_capacity_factor"] == 1.25
    assert "moe_capacity_factor" not in load_model("mixtral-8x7b").canonical_dict()


@pytest.mark.parametrize("model, value, message", [
    ("mixtral-8x7b", "0", "must be above 0"),
    ("mixtral-8x7b", "inf", "expected a finite number"),
    ("mixtral-8x7b", "lots", "expected a number"),
    ("llama3-8b", "1.0", "without experts"),
])
def test_moe_capacity_factor_rejects(model, value, message):
    with pytest.raises(SpecError, match=message) as err:
        load_model(model, {"moe_capacity_factor": value})
    assert err.value.field == "moe_capacity_factor"


def test_shared_expert_fields_read_and_keep_older_fingerprints():
    m = load_model("tiny-moe-shared")
    assert (m.shared_expert_intermediate_size, m.shared_expert_gate, m.norm_topk_prob) == (128, True, False)
    assert {"shared_expert_intermediate_size": 128, "shared_expert_gate": True,
            "norm_topk_prob": False}.items() <= m.canonical_dict().items()
    plain = load_model("mixtral-8x7b").canonical_dict()
    assert not {"shared_expert_intermediate_size", "shared_expert_gate", "norm_topk_prob"} & set(plain)


@pytest.mark.parametrize("model, overrides, field, message", [
    ("llama3-8b", {"shared_expert_intermediate_size": "1024"}, "shared_expert_intermediate_size", "without experts"),
    ("mixtral-8x7b", {"shared_expert_intermediate_size": "-1"}, "shared_expert_intermediate_size", "at least 0"),
    ("mixtral-8x7b", {"shared_expert_gate": "true"}, "shared_expert_gate", "without a shared expert"),
    ("llama3-8b", {"norm_topk_prob": "false"}, "norm_topk_prob", "without experts"),
    ("mixtral-8x7b", {"norm_topk_prob": "sometimes"}, "norm_topk_prob", ""),
    ("llama3-8b", {"router_scoring": "sigmoid"}, "router_scoring", "without experts"),
    ("mixtral-8x7b", {"router_scoring": "argmax"}, "router_scoring", "unknown 'argmax'"),
    ("llama3-8b", {"attention_window": "4096"}, "windowed_layers", "go together"),
    ("llama3-8b", {"windowed_layers": "16"}, "attention_window", "go together"),
    ("llama3-8b", {"attention_window": "4096", "windowed_layers": "33"}, "windowed_layers", "at most 32"),
    ("llama3-8b", {"router_bias": "true"}, "router_bias", "without experts"),
    ("llama3-8b", {"swiglu_limit": "7"}, "swiglu_limit", "without experts"),
    ("gpt-oss-20b", {"swiglu_limit": "0"}, "swiglu_limit", "above 0"),
])
def test_moe_and_window_fields_reject(model, overrides, field, message):
    with pytest.raises(SpecError, match=message) as err:
        load_model(model, overrides)
    assert err.value.field == field


def test_windowed_layers_are_own_spec_fields():
    m = load_model("llama3-8b", {"attention_window": "4096", "windowed_layers": "16"})
    assert m.attended_keys(8192) == (8192 + 4096) / 2 and m.attended_keys(2048) == 2048
    assert {"attention_window": 4096, "windowed_layers": 16}.items() <= m.canonical_dict().items()


def test_moe_load_imbalance_reads_and_leaves_the_fingerprint():
    """A pricing assumption, not the model: the same fingerprint, so checkpoints resume."""
    m = load_model("mixtral-8x7b", {"moe_load_imbalance": "1.3"})
    assert m.moe_load_imbalance == 1.3
    assert m.canonical_dict() == load_model("mixtral-8x7b").canonical_dict()   # what the fingerprint hashes


@pytest.mark.parametrize("model, value, message", [
    ("mixtral-8x7b", "0.9", "at least 1, got 0.9"),
    ("mixtral-8x7b", "inf", "expected a finite number"),
    ("llama3-8b", "1.2", "without experts"),
])
def test_moe_load_imbalance_rejects(model, value, message):
    with pytest.raises(SpecError, match=message) as err:
        load_model(model, {"moe_load_imbalance": value})
    assert err.value.field == "moe_load_imbalance"


@pytest.mark.parametrize("name", builtin_names("clusters"))
def test_every_builtin_cluster_loads(name):
    c = load_cluster(name)
    for g in getattr(c, "groups", (c,)):
        assert g.num_gpus == g.gpus_per_node * g.num_nodes
        assert 0 < g.intra_node.efficiency <= 1 and 0 < g.inter_node.efficiency <= 1
    assert c.num_gpus == sum(g.num_gpus for g in getattr(c, "groups", (c,)))


def test_an_nvlink_domain_spans_hosts_and_never_the_cluster():
    nvl72 = load_cluster("gb200-nvl72")
    assert (nvl72.gpus_per_node, nvl72.num_nodes, nvl72.nvlink_domain_gpus, nvl72.fast_domain_gpus) == (4, 18, 72, 72)
    assert load_cluster("gb200-nvl72", gpus=8).fast_domain_gpus == 8          # two trays: the domain is the cluster
    assert load_cluster("gb200-nvl72", nodes=36).fast_domain_gpus == 72       # two racks: two domains
    dgx = load_cluster("dgx-h100", nodes=4)
    assert (dgx.nvlink_domain_gpus, dgx.fast_domain_gpus) == (None, 8)        # the node is the domain


@pytest.mark.parametrize("domain, message", [(6, "not a whole number of 4-GPU nodes"), (0, "at least 1"),
                                             ("rack", "expected an integer")])
def test_an_nvlink_domain_is_whole_nodes(tmp_path, domain, message):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"name": "c", "gpu": "h100-sxm", "gpus_per_node": 4, "num_nodes": 4,
                                "nvlink_domain_gpus": domain, "intra_node": {"bandwidth_bytes_per_s": 9e11}}))
    with pytest.raises(SpecError) as err:
        load_cluster(str(path))
    assert err.value.field == "cluster.nvlink_domain_gpus" and message in str(err.value)


def test_data_sheet_fp8_peaks_plan_fp8_training_and_fp4_none():
    b200 = load_cluster("dgx-b200").gpu
    assert (b200.peak_for("bf16"), b200.peak_for("fp8"), b200.peak_for("fp4")) == (2.25e15, 4.5e15, 9.0e15)
    model = load_model("llama2-7b")
    fp8 = make_training(model, load_cluster("dgx-b200"), 64, precision="fp8")
    assert (fp8.precision, fp8.fp8) == ("bf16", "tensorwise")
    rowwise = make_training(model, load_cluster("dgx-h100"), 64, precision="fp8-rowwise")
    assert (rowwise.precision, rowwise.fp8) == ("bf16", "rowwise")
    with pytest.raises(SpecError, match="unknown 'fp4'"):
        make_training(model, load_cluster("dgx-b200"), 64, precision="fp4")
    with pytest.raises(SpecError, match=r"B200 has no fp32 peak \(has: bf16, fp16, fp8, fp8-rowwise, fp8-blockwise, mxfp8;"):
        make_training(model, load_cluster("dgx-b200"), 64, precision="fp32")
    with pytest.raises(SpecError, match=r"A100-80GB has no fp8 peak for fp8-rowwise \(has: bf16, fp16, fp32;"):
        make_training(model, load_cluster("dgx-a100-80gb"), 64, precision="fp8-rowwise")


def test_dgx_a100_80gb_figures():
    c = load_cluster("dgx-a100-80gb")
    assert c.name == "dgx-a100-80gb"
    assert (c.gpus_per_node, c.num_nodes, c.num_gpus) == (8, 1, 8)
    assert c.gpu.peak_for("bf16") == 3.12e14 and c.gpu.peak_for("fp32") == 1.95e13
    assert c.gpu.memory_bytes == 80 * GIB
    assert c.gpu.hbm_bandwidth_bytes_per_s == 2.039e12
    # achieved = peak link bandwidth * efficiency: 300 GB/s * 0.62 and 25 GB/s * 0.8
    assert c.intra_node.achieved_bytes_per_s == pytest.approx(3.0e11 * 0.62)
    assert c.inter_node.achieved_bytes_per_s == pytest.approx(2.5e10 * 0.8)
    assert (c.intra_node.latency_s, c.inter_node.latency_s) == (5e-6, 1e-5)


def test_cpu_cluster_link_efficiency_defaults_to_one():
    c = load_cluster("cpu")
    assert c.intra_node.efficiency == 1.0
    assert c.intra_node.achieved_bytes_per_s == 2.3e9
    assert c.gpu.memory_bytes == 8 * GIB


def test_cluster_resizing_by_gpus_and_nodes():
    assert load_cluster("dgx-a100-80gb", gpus=64).num_nodes == 64 // 8
    assert load_cluster("dgx-a100-80gb", gpus=280).num_nodes == 35
    small = load_cluster("dgx-a100-80gb", gpus=4)  # fewer than a node: one smaller node
    assert (small.gpus_per_node, small.num_nodes) == (4, 1)
    assert load_cluster("dgx-h100", nodes=3).num_gpus == 24


# ------------------------------------------------------------------ Hugging Face configs
def test_hf_llama_2_7b():
    m = load_model(HF_DIR / "llama-2-7b.json")
    assert m.name == "llama-2-7b"
    assert (m.model_type, m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads) == \
        ("llama", 4096, 32, 32, 32)
    assert (m.intermediate_size, m.vocab_size, m.max_position_embeddings, m.tie_word_embeddings) == \
        (11008, 32000, 4096, False)
    # the built-in llama2-7b is the same shape under another name
    assert load_model("llama2-7b") == ModelSpec(**{**m.__dict__, "name": "llama2-7b"})


def test_hf_mistral_7b_maps_to_llama_family():
    m = load_model(str(HF_DIR / "mistral-7b.json"))
    assert (m.model_type, m.num_key_value_heads, m.intermediate_size, m.max_position_embeddings) == \
        ("llama", 8, 14336, 32768)
    assert m.kv_size == 8 * (4096 // 32)


def test_hf_gpt2_aliases_and_defaults():
    m = load_model(HF_DIR / "gpt2.json")
    assert m.model_type == "gpt"
    # n_embd, n_layer, n_head, n_positions aliases; n_inner null -> 4h; kv heads default to heads
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.max_position_embeddings) == (768, 12, 12, 1024)
    assert m.intermediate_size == 4 * 768 == 3072
    assert m.num_key_value_heads == 12
    assert m.vocab_size == 50257
    assert m.tie_word_embeddings is True  # GPT default when the config does not say


def test_hf_mixtral_8x7b():
    m = load_model(HF_DIR / "mixtral-8x7b.json")
    assert (m.model_type, m.num_local_experts, m.num_experts_per_tok, m.num_key_value_heads) == ("mixtral", 8, 2, 8)
    assert load_model("mixtral-8x7b") == ModelSpec(**{**m.__dict__, "name": "mixtral-8x7b"})


def test_hf_folder_reads_its_config_json():
    m = load_model(HF_DIR / "tinyllama-folder")
    assert m.name == "tinyllama-folder"
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads) == (256, 2, 4, 2)
    assert (m.intermediate_size, m.vocab_size, m.max_position_embeddings) == (688, 1000, 128)


def test_hf_config_is_lenient_but_own_json_is_strict(tmp_path):
    data = json.loads((HF_DIR / "llama-2-7b.json").read_text())
    data["some_future_key"] = 1
    assert load_model(write(tmp_path, "hf.json", json.dumps(data))).hidden_size == 4096
    # the same mapping without the HF markers is an own spec: unknown keys are errors
    own = {k: v for k, v in data.items() if k not in ("architectures", "transformers_version")}
    err = spec_error(load_model, write(tmp_path, "own.json", json.dumps(own)))
    assert err.field == "_name_or_path"  # the first unknown key in sorted order


# ------------------------------------------------------------------ own YAML files
def test_own_yaml_file_loads_with_its_stem_as_name(tmp_path):
    m = load_model(write(tmp_path, "my-model.yaml", TINY_GPT_YAML))
    assert m.name == "my-model"
    assert m == ModelSpec(**{**load_model("tiny-gpt").__dict__, "name": "my-model"})


def test_own_yaml_accepts_megatron_aliases(tmp_path):
    text = TINY_GPT_YAML.replace("intermediate_size: 256", "ffn_hidden_size: 128").replace(
        "num_hidden_layers: 4", "num_layers: 6")
    m = load_model(write(tmp_path, "alias.yaml", text))
    assert (m.intermediate_size, m.num_hidden_layers) == (128, 6)


def test_own_yaml_defaults(tmp_path):
    text = "model_type: gpt\nhidden_size: 64\nnum_hidden_layers: 2\nnum_attention_heads: 4\nvocab_size: 100\n"
    m = load_model(write(tmp_path, "minimal.yaml", text))
    assert m.num_key_value_heads == 4 and m.intermediate_size == 4 * 64
    assert m.max_position_embeddings == 2048 and m.tie_word_embeddings is True
    assert (m.num_local_experts, m.num_experts_per_tok) == (1, 1)


def test_llama_needs_intermediate_size(tmp_path):
    text = "model_type: llama\nhidden_size: 64\nnum_hidden_layers: 2\nnum_attention_heads: 4\nvocab_size: 100\n"
    assert spec_error(load_model, write(tmp_path, "m.yaml", text)).field == "intermediate_size"
    m = load_model(write(tmp_path, "m2.yaml", text + "intermediate_size: 176\n"))
    assert m.tie_word_embeddings is False  # llama default


# ------------------------------------------------------------------ overrides
def test_parse_overrides():
    assert parse_overrides("a=1,b=x") == {"a": "1", "b": "x"}
    assert parse_overrides(" a = 1 , , b=2 ") == {"a": "1", "b": "2"}
    assert parse_overrides("a=b=c") == {"a": "b=c"}
    assert parse_overrides("") == {} and parse_overrides(None) == {}


@pytest.mark.parametrize("text", ["a", "=1", "a=", "a=1,b"])
def test_parse_overrides_rejects_malformed_items(text):
    err = spec_error(parse_overrides, text)
    assert err.field == "--set"
    assert spec_error(parse_overrides, text, field="--fix").field == "--fix"


def test_load_model_with_overrides():
    m = load_model("tiny-gpt", overrides=parse_overrides("num_hidden_layers=8,vocab_size=1000"))
    assert (m.num_hidden_layers, m.vocab_size, m.hidden_size) == (8, 1000, 64)
    assert load_model("tiny-gpt", overrides={"n_layer": "6"}).num_hidden_layers == 6  # alias
    assert load_model("tiny-gpt", overrides={"tie_word_embeddings": "false"}).tie_word_embeddings is False
    assert load_model("tiny-gpt", overrides={"hidden_size": "1.28e2"}).hidden_size == 128
    hf = load_model(HF_DIR / "gpt2.json", overrides={"n_layer": "2", "hidden_size": "384"})
    assert (hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size) == (2, 384, 4 * 384)


@pytest.mark.parametrize("overrides, field", [
    ({"foo": "1"}, "--set foo"),
    ({"name": "x"}, "--set name"),
    ({"hidden_size": "abc"}, "hidden_size"),
    ({"hidden_size": "0"}, "hidden_size"),
    ({"num_hidden_layers": "-2"}, "num_hidden_layers"),
    ({"num_attention_heads": "2.5"}, "num_attention_heads"),
    ({"num_attention_heads": "3"}, "num_attention_heads"),       # 3 does not divide 64
    ({"num_key_value_heads": "3"}, "num_key_value_heads"),       # 3 does not divide 4 heads
    ({"tie_word_embeddings": "maybe"}, "tie_word_embeddings"),
    ({"model_type": "bert"}, "model_type"),
])
def test_bad_overrides_name_the_field(overrides, field):
    err = spec_error(load_model, "tiny-gpt", overrides=overrides)
    assert err.field == field
    assert str(err).startswith(f"{field}: ")


def test_hf_override_unknown_key_is_an_error_even_though_hf_is_lenient():
    assert spec_error(load_model, HF_DIR / "llama-2-7b.json", overrides={"rope_theta": "1"}).field == "--set rope_theta"


# ------------------------------------------------------------------ model errors
def test_unknown_model_name():
    err = spec_error(load_model, "gpt-9000")
    assert err.field == "--model"
    assert "gpt-9000" in str(err) and "tiny-gpt" in str(err)  # lists the built-ins
    assert isinstance(err, ValueError)


@pytest.mark.parametrize("name, text", [
    ("bad.yaml", "model_type: gpt\nhidden_size: [64\n"),
    ("bad2.yaml", "a: b: c\n"),
    ("list.yaml", "- 1\n- 2\n"),
    ("scalar.yaml", "just a string\n"),
    ("bad.json", '{"model_type": "gpt", '),
])
def test_malformed_files(tmp_path, name, text):
    assert spec_error(load_model, write(tmp_path, name, text)).field == "--model"


def test_folder_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    err = spec_error(load_model, tmp_path / "empty")
    assert err.field == "--model" and "config.json" in str(err)


@pytest.mark.parametrize("edit, field", [
    (("tie_word_embeddings: true", "tie_word_embeddings: true\nnum_layer_norms: 2"), "num_layer_norms"),
    (("hidden_size: 64", "hidden_size: 0"), "hidden_size"),
    (("vocab_size: 512", "vocab_size: -512"), "vocab_size"),
    (("num_hidden_layers: 4", "num_hidden_layers: many"), "num_hidden_layers"),
    (("num_hidden_layers: 4", "num_hidden_layers: 4.5"), "num_hidden_layers"),
    (("num_hidden_layers: 4", "num_hidden_layers: true"), "num_hidden_layers"),
    (("intermediate_size: 256", "intermediate_size: 0"), "intermediate_size"),
    (("max_position_embeddings: 64", "max_position_embeddings: -1"), "max_position_embeddings"),
    (("num_key_value_heads: 4", "num_key_value_heads: 0"), "num_key_value_heads"),
    (("num_attention_heads: 4", "num_attention_heads: 5"), "num_attention_heads"),  # 5 does not divide 64
    (("num_key_value_heads: 4", "num_key_value_heads: 3"), "num_key_value_heads"),  # 3 does not divide 4
    (("model_type: gpt", "model_type: bert"), "model_type"),
    (("model_type: gpt\n", ""), "model_type"),
    (("hidden_size: 64\n", ""), "hidden_size"),
    (("tie_word_embeddings: true", "tie_word_embeddings: sometimes"), "tie_word_embeddings"),
    (("tie_word_embeddings: true", "tie_word_embeddings: true\nnum_local_experts: 2\nnum_experts_per_tok: 3"),
     "num_experts_per_tok"),
    (("model_type: gpt", "model_type: mixtral"), "num_local_experts"),  # mixtral needs >= 2 experts
])
def test_bad_own_spec_names_the_field(tmp_path, edit, field):
    old, new = edit
    assert old in TINY_GPT_YAML
    err = spec_error(load_model, write(tmp_path, "m.yaml", TINY_GPT_YAML.replace(old, new)))
    assert err.field == field


def test_model_from_dict_directly():
    m = model_from_dict({"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1,
                         "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 10}, "x")
    assert m.name == "x" and m.num_key_value_heads == 2


# ------------------------------------------------------------------ scalar parsers
def test_as_int():
    assert as_int(12, "f") == 12
    assert as_int("12", "f") == 12
    assert as_int("1e3", "f") == 1000          # PyYAML reads 1e3 as a string
    assert as_int(7.0, "f") == 7
    assert as_int(0, "f", minimum=0) == 0
    for bad in (True, "x", 2.5, "2.5", None, [1]):
        assert spec_error(as_int, bad, "f").field == "f"
    assert "at least 1" in str(spec_error(as_int, 0, "f"))


def test_as_float():
    assert as_float("3.0e+11", "f") == 3.0e11
    assert as_float(0, "lat", exclusive=False) == 0.0
    for bad in (0, -1, "nan", "fast", True, None):
        assert spec_error(as_float, bad, "f").field == "f"
    assert spec_error(as_float, -1e-6, "lat", exclusive=False).field == "lat"


def test_as_bool():
    for yes in (True, "true", "On", "YES", "1"):
        assert as_bool(yes, "f") is True
    for no in (False, "false", "off", "No", "0"):
        assert as_bool(no, "f") is False
    for bad in (1, "maybe", None):
        assert spec_error(as_bool, bad, "f").field == "f"


# ------------------------------------------------------------------ cluster files
def test_own_cluster_file(tmp_path):
    c = load_cluster(write(tmp_path, "c.yaml", CLUSTER_YAML))
    assert c.name == "test-cluster" and c.num_gpus == 8
    assert c.gpu.name == "A100-80GB"
    assert c.intra_node.achieved_bytes_per_s == pytest.approx(1.0e11 * 0.5)
    assert c.inter_node.efficiency == 1.0 and c.inter_node.latency_s == 1e-5


def test_cluster_inline_gpu_and_missing_inter_node(tmp_path):
    text = CLUSTER_YAML.split("inter_node:")[0].replace(
        "gpu: a100-80gb",
        "gpu: {name: G, peak_flops_per_s: {fp32: 1.0e+12}, memory_bytes: 1000, hbm_bandwidth_bytes_per_s: 1.0e+11}")
    c = load_cluster(write(tmp_path, "c.yaml", text))
    assert c.gpu.name == "G" and c.gpu.peak_flops_per_s == {"fp32": 1.0e12}
    assert c.inter_node == c.intra_node  # inter_node defaults to intra_node
    m = load_model("tiny-gpt")
    assert spec_error(make_training, m, c, 8).field == "--precision"  # no bf16 peak on this GPU
    assert make_training(m, c, 8, precision="fp32").precision == "fp32"


@pytest.mark.parametrize("old, new, field", [
    ("num_nodes: 2", "num_nodes: 2\nracks: 1", "cluster.racks"),
    ("gpu: a100-80gb", "gpu: tpu-v9", "cluster.gpu"),
    ("gpu: a100-80gb", "gpu: 7", "cluster.gpu"),
    ("gpus_per_node: 4", "gpus_per_node: 0", "cluster.gpus_per_node"),
    ("num_nodes: 2", "num_nodes: two", "cluster.num_nodes"),
    ("  efficiency: 0.5", "  efficiency: 1.5", "cluster.intra_node.efficiency"),
    ("  efficiency: 0.5", "  efficiency: 0", "cluster.intra_node.efficiency"),
    ("  latency_s: 2.0e-06", "  latency_s: -1.0e-06", "cluster.intra_node.latency_s"),
    ("  bandwidth_bytes_per_s: 1.0e+11", "  bandwidth_bytes_per_s: 0", "cluster.intra_node.bandwidth_bytes_per_s"),
    ("  bandwidth_bytes_per_s: 1.0e+10", "  bandwidth_bytes_per_s: fast", "cluster.inter_node.bandwidth_bytes_per_s"),
    ("  latency_s: 1.0e-05", "  latency_s: 1.0e-05\n  jitter_s: 1", "cluster.inter_node.jitter_s"),
    ("inter_node:\n  bandwidth_bytes_per_s: 1.0e+10\n  latency_s: 1.0e-05\n", "inter_node: 10\n", "cluster.inter_node"),
])
def test_bad_cluster_file_names_the_field(tmp_path, old, new, field):
    assert old in CLUSTER_YAML
    err = spec_error(load_cluster, write(tmp_path, "c.yaml", CLUSTER_YAML.replace(old, new)))
    assert err.field == field


@pytest.mark.parametrize("gpu_yaml, field", [
    ("{name: G, peak_flops_per_s: {int8: 1.0e+12}, memory_bytes: 1, hbm_bandwidth_bytes_per_s: 1.0}",
     "cluster.gpu.peak_flops_per_s.int8"),
    ("{name: G, peak_flops_per_s: {}, memory_bytes: 1, hbm_bandwidth_bytes_per_s: 1.0}", "cluster.gpu.peak_flops_per_s"),
    ("{name: G, peak_flops_per_s: {bf16: 0}, memory_bytes: 1, hbm_bandwidth_bytes_per_s: 1.0}",
     "cluster.gpu.peak_flops_per_s.bf16"),
    ("{name: G, peak_flops_per_s: {bf16: 1.0}, memory_bytes: 0, hbm_bandwidth_bytes_per_s: 1.0}", "cluster.gpu.memory_bytes"),
    ("{name: G, peak_flops_per_s: {bf16: 1.0}, memory_bytes: 1}", "cluster.gpu.hbm_bandwidth_bytes_per_s"),
    ("{name: G, peak_flops_per_s: {bf16: 1.0}, memory_bytes: 1, hbm_bandwidth_bytes_per_s: 1.0, tdp: 400}",
     "cluster.gpu.tdp"),
    ("{name: G, peak_flops_per_s: {bf16: 1.0}, memory_bytes: 1, hbm_bandwidth_bytes_per_s: 1.0, "
     "host_overheads: {tp_layer_s: -1}}", "cluster.gpu.host_overheads.tp_layer_s"),
    ("{name: G, peak_flops_per_s: {bf16: 1.0}, memory_bytes: 1, hbm_bandwidth_bytes_per_s: 1.0, "
     "host_overheads: {tp_s: 1}}", "cluster.gpu.host_overheads.tp_s"),
    ("{name: G, peak_flops_per_s: {bf16: 1.0}, memory_bytes: 1, hbm_bandwidth_bytes_per_s: 1.0, host_overheads: 3}",
     "cluster.gpu.host_overheads"),
])
def test_bad_gpu_names_the_field(tmp_path, gpu_yaml, field):
    text = CLUSTER_YAML.replace("gpu: a100-80gb", f"gpu: {gpu_yaml}")
    assert spec_error(load_cluster, write(tmp_path, "c.yaml", text)).field == field


def test_cluster_errors_from_arguments():
    assert spec_error(load_cluster, "dgx-z900").field == "--cluster"
    assert spec_error(load_cluster, "dgx-a100-80gb", gpus=12).field == "--gpus"  # not whole 8-GPU nodes
    assert spec_error(load_cluster, "dgx-a100-80gb", nodes=2, gpus=16).field == "--gpus"
    assert spec_error(load_cluster, "dgx-a100-80gb", gpus=0).field == "--gpus"
    assert spec_error(load_cluster, "dgx-a100-80gb", nodes=0).field == "--nodes"


def test_malformed_cluster_yaml(tmp_path):
    assert spec_error(load_cluster, write(tmp_path, "c.yaml", "name: [x\n")).field == "--cluster"


# ------------------------------------------------------------------ training
def test_make_training():
    m, c = load_model("llama2-7b"), load_cluster("dgx-a100-80gb")
    t = make_training(m, c, 512)
    assert (t.global_batch, t.seq_len, t.precision, t.optimizer, t.flash_attention) == (512, 4096, "bf16", "adamw", True)
    assert t.tokens_per_step == 512 * 4096
    t2 = make_training(m, c, "64", "2048", precision="fp16", optimizer="sgd", flash_attention=False)
    assert (t2.global_batch, t2.seq_len, t2.tokens_per_step) == (64, 2048, 64 * 2048)


@pytest.mark.parametrize("kwargs, field", [
    ({"global_batch": 0}, "--global-batch"),
    ({"global_batch": "lots"}, "--global-batch"),
    ({"global_batch": 8, "seq_len": -1}, "--seq"),
    ({"global_batch": 8, "precision": "int8"}, "--precision"),
    ({"global_batch": 8, "optimizer": "lion"}, "--optimizer"),
])
def test_make_training_errors(kwargs, field):
    m, c = load_model("tiny-gpt"), load_cluster("dgx-a100-80gb")
    assert spec_error(make_training, m, c, **kwargs).field == field


def test_precision_must_exist_on_the_gpu():
    m = load_model("tiny-gpt")
    assert spec_error(make_training, m, load_cluster("dgx-v100"), 8, precision="bf16").field == "--precision"
    assert make_training(m, load_cluster("dgx-v100"), 8, precision="fp16").precision == "fp16"
    assert spec_error(make_training, m, load_cluster("cpu"), 8, precision="fp16").field == "--precision"


def test_architecture_fields_in_own_yaml(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("model_type: llama\nhidden_size: 64\nnum_hidden_layers: 2\nnum_attention_heads: 4\n"
                    "intermediate_size: 128\nvocab_size: 100\nhead_dim: 32\nmlp: geglu\nattention_bias: true\n"
                    "qk_norm: true\n")
    spec = load_model(str(path))
    # In a llama spec attention_bias is Hugging Face's: q, k, v and o alike.
    assert (spec.head_dim, spec.q_size, spec.kv_size, spec.mlp, spec.attention_bias, spec.attention_out_bias) == \
        (32, 128, 128, "geglu", True, True)
    assert spec.canonical_dict()["head_dim"] == 32
    qwen2_like = load_model(str(path), {"attention_out_bias": "false"})
    assert (qwen2_like.attention_bias, qwen2_like.attention_out_bias) == (True, False)


@pytest.mark.parametrize("edit, field", [("mlp: relu", "mlp"), ("norm: batchnorm", "norm"),
                                         ("position_embedding: alibi", "position_embedding"),
                                         ("norms_per_layer: 3", "norms_per_layer"), ("head_dim: 0", "head_dim"),
                                         ("qk_norm: maybe", "qk_norm")])
def test_bad_architecture_field_names_the_field(tmp_path, edit, field):
    path = tmp_path / "m.yaml"
    path.write_text("model_type: llama\nhidden_size: 64\nnum_hidden_layers: 2\nnum_attention_heads: 4\n"
                    f"intermediate_size: 128\nvocab_size: 100\n{edit}\n")
    with pytest.raises(SpecError) as err:
        load_model(str(path))
    assert err.value.field == field


def test_existing_models_keep_their_fingerprint():
    """The architecture fields at their family's values are left out of the canonical
    form, so plans written before they existed still match (planner.plan_file.fingerprint)."""
    from dataclasses import asdict
    spec = load_model("llama2-7b")
    old = {k: v for k, v in asdict(spec).items() if k in (
        "name", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
        "num_local_experts", "num_experts_per_tok")}
    assert spec.canonical_dict() == old
    assert load_model(str(HF_DIR / "gemma-2b.json")).canonical_dict()["mlp"] == "geglu"


@pytest.mark.parametrize("name, recipe", [("fp8", "tensorwise"), ("fp8-rowwise", "rowwise"),
                                          ("fp8-blockwise", "blockwise"), ("mxfp8", "mxfp8"), ("bf16", None)])
def test_precision_names_and_fp8_recipes_round_trip(name, recipe):
    from costmodel.specs.training import PRECISION_CHOICES, precision_name, split_precision

    assert name in PRECISION_CHOICES
    precision, fp8 = split_precision(name)
    assert fp8 == recipe and precision == "bf16" and precision_name(precision, fp8) == name
