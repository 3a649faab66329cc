"""Reading specs from built-in names, YAML and JSON files, and `key=value` overrides.

Own spec files are strict (an unknown key is an error); a real Hugging Face
`config.json` (it carries `architectures` or `transformers_version`) is read leniently,
taking the keys Shardwise needs and ignoring the rest. Every problem raises `SpecError`
naming the field, which the CLI prints as one line with exit code 2.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from costmodel.specs.hardware import (
    ClusterSpec,
    GPUSpec,
    HostOverheads,
    LinkSpec,
    MixedClusterSpec,
)
from costmodel.specs.model import (
    FAMILIES,
    MLP_KINDS,
    NORM_KINDS,
    POSITION_KINDS,
    ROUTER_SCORINGS,
    ModelSpec,
)
from costmodel.specs.runtime import (
    BAND_FIELDS,
    DEFAULT_RUNTIME,
    FLAG_FIELDS,
    FRACTION_FIELDS,
    FSDP_KEPT_GATHERED,
    INT_FIELDS,
    MOE_DISPATCHES,
    NUMBER_FIELDS,
    SELECTIVE_POLICIES,
    SETTING_FIELDS,
    RuntimeSpec,
)
from costmodel.specs.training import (
    DATA_SHEET_PRECISIONS,
    MIXED_PRECISION,
    OPTIMIZERS,
    PRECISION_CHOICES,
    TrainingSpec,
    split_precision,
)

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


class SpecError(ValueError):
    """Bad input: `field` names what is wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


# Hugging Face model_type -> Shardwise family.
_FAMILY_OF = {
    "gpt": "gpt", "gpt2": "gpt", "gpt_neox": "gpt", "gptj": "gpt", "opt": "gpt", "phi": "gpt",
    "starcoder2": "gpt",
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "gemma": "llama",
    "gemma3_text": "llama",
    "mixtral": "mixtral", "qwen2_moe": "mixtral", "qwen3_moe": "mixtral", "gpt_oss": "mixtral",
    "llama4_text": "mixtral", "deepseek_v3": "mixtral",
}
# What each Hugging Face model_type builds beyond its family's defaults, read off the
# modeling_*.py of transformers 5: (fixed fields, tie_word_embeddings when the config
# leaves it out = the config class's default).
_HF_ARCHITECTURE = {
    "gpt2": ({}, True),
    "opt": ({}, True),
    "llama": ({}, False),
    "mistral": ({}, False),
    # Qwen2Attention: q/k/v projections with bias, o_proj without.
    "qwen2": ({"attention_bias": True, "attention_out_bias": False}, False),
    # Qwen3Attention: q_norm / k_norm, RMSNorm over head_dim.
    "qwen3": ({"qk_norm": True}, False),
    # GemmaMLP: gate/up/down with gelu_pytorch_tanh (GeGLU, Shazeer 2020).
    "gemma": ({"mlp": "geglu", "norm": "rmsnorm_unit_offset"}, True),
    # Gemma3DecoderLayer: Gemma's MLP and norms, q/k norm, and four norms a layer (input,
    # post-attention, pre- and post-feedforward).
    "gemma3_text": ({"mlp": "geglu", "norm": "rmsnorm_unit_offset", "qk_norm": True, "norms_per_layer": 4}, True),
    # PhiDecoderLayer: one input_layernorm feeding attention and MLP in parallel;
    # dense / fc1 / fc2 / lm_head with biases; partial rotary (no parameters).
    "phi": ({"position_embedding": "rope", "parallel_block": True, "norms_per_layer": 1,
             "lm_head_bias": True}, False),
    # GPTNeoXLayer: input_layernorm and post_attention_layernorm, parallel when
    # use_parallel_residual; partial rotary.
    "gpt_neox": ({"position_embedding": "rope", "fused_qkv": True}, False),
    # GPTJBlock: one ln_1, attention without biases, MLP with, lm_head with bias.
    "gptj": ({"position_embedding": "rope", "parallel_block": True, "norms_per_layer": 1,
              "attention_bias": False, "attention_out_bias": False, "lm_head_bias": True}, False),
    # Starcoder2: LayerNorm, GELU MLP (c_fc, c_proj), biases everywhere with use_bias.
    "starcoder2": ({"position_embedding": "rope"}, True),
    "mixtral": ({}, False),
    # Qwen3MoeAttention: q_norm / k_norm as Qwen3; the experts' width is moe_intermediate_size.
    "qwen3_moe": ({"qk_norm": True}, False),
}
# GPT-2 style key names -> Hugging Face Llama style key names.
_ALIASES = {
    "n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
    "n_inner": "intermediate_size", "n_positions": "max_position_embeddings",
    "ffn_hidden_size": "intermediate_size", "num_layers": "num_hidden_layers",
}
_MODEL_INT_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "max_position_embeddings",
    "num_local_experts", "num_experts_per_tok",
)
_MODEL_BOOL_FIELDS = ("attention_bias", "attention_out_bias", "mlp_bias", "qk_norm", "parallel_block", "lm_head_bias",
                      "fused_qkv", "norm_topk_prob", "attention_sinks", "router_bias", "chunked_attention")
_MODEL_CHOICE_FIELDS = {"mlp": MLP_KINDS, "norm": NORM_KINDS, "position_embedding": POSITION_KINDS,
                        "router_scoring": ROUTER_SCORINGS}


def _hf_architecture(model_type: str, raw: dict, lenient: bool) -> dict:
    """The architecture fields a Hugging Face config of `model_type` implies (its keys
    read as transformers reads them); own spec files set the fields directly."""
    fixed, tie_default = _HF_ARCHITECTURE.get(model_type, ({}, False))
    out = dict(fixed)
    if model_type in ("llama", "qwen3") and raw.get("attention_bias") is not None:
        # LlamaAttention / Qwen3Attention: attention_bias on q, k, v and o alike.
        out["attention_bias"] = out["attention_out_bias"] = raw["attention_bias"]
    if model_type == "llama" and raw.get("mlp_bias") is not None:
        out["mlp_bias"] = raw["mlp_bias"]
    if model_type == "gpt_neox":
        out["parallel_block"] = raw.get("use_parallel_residual", True)
        if raw.get("attention_bias") is not None:
            out["attention_bias"] = out["attention_out_bias"] = raw["attention_bias"]
    if model_type == "starcoder2" and raw.get("use_bias") is not None:
        out["attention_bias"] = out["attention_out_bias"] = out["mlp_bias"] = raw["use_bias"]
    if model_type in ("qwen2_moe", "qwen3_moe"):
        out.update(_qwen_moe(model_type, raw))
    if model_type == "gpt_oss":
        out.update(_gpt_oss(raw))
    if model_type == "llama4_text":
        out.update(_llama4(raw))
    if model_type == "gemma3_text":
        out.update(_gemma3(raw))
    if model_type == "deepseek_v3":
        out.update(_deepseek_v3(raw))
    if model_type == "phi" and raw.get("qk_layernorm"):
        raise SpecError("qk_layernorm", "Phi's per-head LayerNorm on q and k is not modelled (RMSNorm q/k norm is: qk_norm)")
    if lenient:
        # Memory-only fields, read as transformers reads them.
        out["sliding_window"] = None
        if model_type == "mistral" or (model_type in ("qwen2", "qwen3") and raw.get("use_sliding_window")):
            out["sliding_window"] = raw.get("sliding_window")
        # Kept only where it changes what is saved for backward (transformers'
        # NewGELUActivation is an elementwise formula); other names are the mlp kind.
        act = raw.get("hidden_act", raw.get("activation_function"))
        out["hidden_act"] = "gelu_new" if act == "gelu_new" else None
        drop = raw.get("resid_pdrop", raw.get("hidden_dropout"))
        out["resid_dropout"] = drop if drop is not None else 0.0
    if lenient and raw.get("tie_word_embeddings") is None:
        out["tie_word_embeddings"] = tie_default
    return out


def _qwen_moe(model_type: str, raw: dict) -> dict:
    """Qwen2-MoE / Qwen3-MoE as transformers builds them (modeling_qwen2_moe.py,
    modeling_qwen3_moe.py): every layer is sparse when decoder_sparse_step is 1 and
    mlp_only_layers is empty, each of `num_experts` SwiGLU experts `moe_intermediate_size`
    wide, so that is the MLP width the spec prices; the router's softmax over all
    experts, renormalised over the top k (norm_topk_prob), equals Mixtral's softmax over
    the k chosen logits. Qwen2-MoE adds a shared expert `shared_expert_intermediate_size`
    wide (5632 when the key is left out, the config class's default) behind a sigmoid
    gate; Qwen3-MoE has none. Routing weights follow norm_topk_prob (Qwen2-MoE's
    default is the unnormalised top k). Layers in mlp_only_layers, or off the
    decoder_sparse_step, hold a dense MLP `intermediate_size` wide."""
    out: dict = {}
    if raw.get("num_experts") is not None:
        out["num_local_experts"] = raw["num_experts"]
    if raw.get("moe_intermediate_size") is not None:
        out["intermediate_size"] = raw["moe_intermediate_size"]
    if model_type == "qwen2_moe":
        # Qwen2MoeAttention: q/k/v projections with bias (qkv_bias), o_proj without (as Qwen2).
        out.update(attention_bias=bool(raw.get("qkv_bias", True)), attention_out_bias=False)
        width = raw.get("shared_expert_intermediate_size")
        if width == 0:
            # transformers still builds the gate (h weights) over an empty shared expert.
            raise SpecError("shared_expert_intermediate_size", "0: a gate over an empty shared expert is not "
                                                               "modelled (a width above 0 is)")
        out["shared_expert_intermediate_size"] = 5632 if width is None else width
        out["shared_expert_gate"] = True
    else:
        out["shared_expert_intermediate_size"] = 0   # Qwen3MoeSparseMoeBlock builds none, whatever the key says
    # A layer is sparse when it is not in mlp_only_layers and (i + 1) % decoder_sparse_step
    # is 0; the others hold a dense MLP intermediate_size wide.
    layers = as_int(raw.get("num_hidden_layers", 24), "num_hidden_layers")
    step = raw.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise SpecError("decoder_sparse_step", f"expected an integer of at least 1, got {step!r}")
    listed = raw.get("mlp_only_layers") or []
    if not isinstance(listed, list):
        raise SpecError("mlp_only_layers", f"expected a list of layer indices, got {listed!r}")
    dense = sorted({i for i in listed if isinstance(i, int) and i < layers}   # --set num_hidden_layers keeps its first
                   | {i for i in range(layers) if (i + 1) % step})
    out["mlp_only_layers"] = dense
    if dense:
        out["dense_intermediate_size"] = raw.get("intermediate_size")
    # Qwen2MoeConfig's norm_topk_prob defaults to False, Qwen3MoeConfig's to True.
    out["norm_topk_prob"] = bool(raw.get("norm_topk_prob", model_type == "qwen3_moe"))
    return out


def _windows(types: Any, layers: int, windowed: str, window: Any) -> dict:
    """The windowed layers a config's layer_types lists (one entry a layer, each
    `windowed` or "full_attention"; a model shrunk with --set num_hidden_layers keeps its
    first layers' kinds), attending `window` tokens; a null window: every layer in full."""
    if isinstance(types, list) and len(types) > layers:
        types = types[:layers]
    if not isinstance(types, list) or len(types) != layers:
        raise SpecError("layer_types", f"expected a list of {layers} entries, one a layer (a model given more "
                                       f"layers than its config lists needs a layer_types as long)")
    unknown = sorted({t for t in types if t not in (windowed, "full_attention")}, key=str)
    if unknown:
        raise SpecError("layer_types", f"unknown {unknown[0]!r} ({windowed}, full_attention)")
    count = types.count(windowed) if window else 0
    return {"windowed_layers": count, "attention_window": window if count else None}


def _gpt_oss(raw: dict) -> dict:
    """gpt-oss as transformers builds it (modeling_gpt_oss.py, GptOssConfig's defaults):
    q/k/v/o biases with attention_bias (default true), a sink logit per head, a router
    bias, experts `intermediate_size` wide with biases and SwiGLU clamped at swiglu_limit;
    the layers whose layer_types entry is "sliding_attention" (every other one, the first
    included, by default) attend the last sliding_window tokens; with fewer layers than
    entries (--set num_hidden_layers) the first entries apply."""
    layers = as_int(raw.get("num_hidden_layers", 36), "num_hidden_layers")
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    bias = raw.get("attention_bias", True)
    return {"attention_bias": bias, "attention_out_bias": bias, "attention_sinks": True, "router_bias": True,
            "mlp_bias": True, "swiglu_limit": raw.get("swiglu_limit", 7.0),
            **_windows(raw.get("layer_types") or default, layers, "sliding_attention", raw.get("sliding_window", 128))}


def _llama4(raw: dict) -> dict:
    """Llama 4's text model as transformers builds it (modeling_llama4.py, Llama4TextConfig's
    defaults): every layer a mixture of `num_local_experts` SwiGLU experts
    `intermediate_size` wide beside a shared expert as wide, routed by the sigmoid of the
    top-k logits, but the layers not in moe_layers (Maverick's every other), which hold a
    dense SwiGLU `intermediate_size_mlp` wide; the layers whose layer_types entry is "chunked_attention" (three of every four,
    those with RoPE, by default) attend within chunks of attention_chunk_size tokens. The
    q/k L2 norm, the NoPE layers and the attention temperature carry no parameters."""
    layers = as_int(raw.get("num_hidden_layers", 48), "num_hidden_layers")
    step = raw.get("interleave_moe_layer_step", 1)
    moe_layers = raw.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, layers, step)) if isinstance(step, int) and step > 0 else []
    if isinstance(moe_layers, list) and len(moe_layers) > layers:
        moe_layers = [i for i in moe_layers if isinstance(i, int) and i < layers]   # --set num_hidden_layers
    if not isinstance(moe_layers, list) or not moe_layers or not set(moe_layers) <= set(range(layers)):
        raise SpecError("moe_layers" if raw.get("moe_layers") is not None else "interleave_moe_layer_step",
                        f"expected the indices of the sparse layers among {layers}, got {moe_layers!r}")
    # The other layers hold a dense SwiGLU MLP intermediate_size_mlp wide (Maverick's every other).
    dense = [i for i in range(layers) if i not in set(moe_layers)]
    types = raw.get("layer_types")
    no_rope = raw.get("no_rope_layers")
    if not types and isinstance(no_rope, list) and no_rope:
        # transformers: a layer with RoPE (1) attends in chunks, a NoPE layer (0) in full.
        types = ["chunked_attention" if rope else "full_attention" for rope in no_rope]
    if not types:
        interval = raw.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise SpecError("no_rope_layer_interval", f"expected an integer of at least 1, got {interval!r}")
        types = ["chunked_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    windows = _windows(types, layers, "chunked_attention", raw.get("attention_chunk_size", 8192))
    bias = raw.get("attention_bias", False)
    return {"attention_bias": bias, "attention_out_bias": bias, "router_scoring": "sigmoid",
            "shared_expert_intermediate_size": raw.get("intermediate_size", 8192),
            "chunked_attention": bool(windows["windowed_layers"]), "mlp_only_layers": dense,
            **({"dense_intermediate_size": raw.get("intermediate_size_mlp", 16384)} if dense else {}), **windows}


def _gemma3(raw: dict) -> dict:
    """Gemma 3's text model as transformers builds it (modeling_gemma3.py): the layers
    whose layer_types entry is "sliding_attention" (five of every six by default, or by
    an older config's sliding_window_pattern) attend the last sliding_window tokens.
    Attention and final logit soft-capping are refused by name (Gemma 3 sets neither)."""
    layers = as_int(raw.get("num_hidden_layers", 26), "num_hidden_layers")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) is not None:
            raise SpecError(key, "soft-capped logits are not modelled (null is)")
    if raw.get("use_bidirectional_attention"):
        raise SpecError("use_bidirectional_attention", "bidirectional attention is not modelled (false is)")
    pattern = raw.get("sliding_window_pattern", 6)
    if not raw.get("layer_types") and (isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1):
        raise SpecError("sliding_window_pattern", f"expected an integer of at least 1, got {pattern!r}")
    default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    bias = raw.get("attention_bias", False)
    return {"attention_bias": bias, "attention_out_bias": bias,
            **_windows(raw.get("layer_types") or default, layers, "sliding_attention", raw.get("sliding_window", 4096))}


def _first_k(raw: dict) -> int:
    """DeepSeek's first_k_dense_replace (3 unset, DeepseekV3Config's default), checked."""
    k = raw.get("first_k_dense_replace", 3)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise SpecError("first_k_dense_replace", f"expected an integer of at least 0, got {k!r}")
    return k


def _deepseek_v3(raw: dict) -> dict:
    """DeepSeek-V3 as transformers builds it (modeling_deepseek_v3.py, DeepseekV3Config's
    defaults): multi-head latent attention (q and kv latents, split nope / rope query and
    key widths, head_dim the rotary width); the first `first_k_dense_replace` layers a
    dense SwiGLU MLP `intermediate_size` wide (mlp_only_layers), the rest `n_routed_experts` SwiGLU experts
    `moe_intermediate_size` wide beside `n_shared_experts` of them as one shared MLP,
    routed by the sigmoid of the logits within the best `topk_group` of `n_group` groups
    (the selection bias e_score_correction_bias is a buffer, not a parameter), the top k
    renormalised (norm_topk_prob) and scaled by routed_scaling_factor. transformers builds
    no multi-token prediction module; num_nextn_predict_layers is read for the cost
    (DeepSeek-V3 trains with one). A sparse layer other than every one after the dense
    ones (moe_layer_freq, which transformers ignores) is refused by name."""
    if raw.get("moe_layer_freq", 1) != 1:
        raise SpecError("moe_layer_freq", f"{raw['moe_layer_freq']}: transformers builds every layer after "
                                          f"first_k_dense_replace sparse (1)")
    experts_width = raw.get("moe_intermediate_size", 2048)
    q_lora = raw.get("q_lora_rank", 1536)
    rope = raw.get("qk_rope_head_dim", 64)
    bias = raw.get("attention_bias", False)
    return {"num_local_experts": raw.get("n_routed_experts", 256), "intermediate_size": experts_width,
            "dense_intermediate_size": raw.get("intermediate_size", 18432),
            "mlp_only_layers": list(range(_first_k(raw))),
            "shared_expert_intermediate_size": experts_width * (raw.get("n_shared_experts") or 0),
            "router_scoring": "sigmoid", "norm_topk_prob": raw.get("norm_topk_prob", True),
            "n_group": raw.get("n_group", 8), "topk_group": raw.get("topk_group", 4),
            "routed_scaling_factor": raw.get("routed_scaling_factor", 2.5),
            "num_nextn_predict_layers": raw.get("num_nextn_predict_layers", 0),
            "q_lora_rank": 0 if q_lora is None else q_lora, "kv_lora_rank": raw.get("kv_lora_rank", 512),
            "qk_nope_head_dim": raw.get("qk_nope_head_dim", 128), "qk_rope_head_dim": rope,
            "v_head_dim": raw.get("v_head_dim", 128), "head_dim": rope,
            "num_key_value_heads": raw.get("num_attention_heads"),
            "attention_bias": bias, "attention_out_bias": bias}


_TEXT_MODEL_TYPES = {"llama4": "llama4_text", "gemma3": "gemma3_text"}
# ModelSpec fields that describe experts or their router, and their defaults.
_EXPERT_FIELDS = {"shared_expert_intermediate_size": 0, "router_bias": False, "swiglu_limit": None,
                  "router_scoring": "softmax", "norm_topk_prob": True, "mlp_only_layers": (),
                  "dense_intermediate_size": 0, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0}
# Multi-head latent attention's widths (ModelSpec.is_mla), all above 0 or all 0.
_MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_WINDOWED_MODEL_TYPES = ("gpt_oss", "llama4_text", "gemma3_text")


def hf_text_config(data: dict) -> dict:
    """A multimodal Llama 4 or Gemma 3 config.json's text model (its `text_config`),
    which is what Shardwise plans; any other config as it is."""
    text_type = _TEXT_MODEL_TYPES.get(data.get("model_type"))
    if text_type is not None and isinstance(data.get("text_config"), dict):
        text = dict(data["text_config"])
        text.setdefault("model_type", text_type)
        for key in ("architectures", "transformers_version"):
            if key in data:
                text.setdefault(key, data[key])
        return text
    return data


def configs_dir(kind: str) -> Path:
    return Path(str(resources.files("configs"))) / kind


def builtin_names(kind: str) -> list[str]:
    return sorted(p.stem for p in configs_dir(kind).glob("*.yaml"))


def path_kind(source: str | Path) -> str:
    """"file", "dir", "other" or "missing"; "missing" also for a name the system refuses
    (too long, a NUL byte), where Path.exists and is_file raise on Python 3.11."""
    try:
        path = Path(source)
        if path.is_dir():
            return "dir"
        if path.is_file():
            return "file"
        return "other" if path.exists() else "missing"
    except (OSError, ValueError):
        return "missing"


def read_document(source: str | Path, kind: str, field: str) -> tuple[dict, str]:
    """The mapping in a built-in name or a YAML/JSON path, and a display name."""
    path = Path(source)
    if path_kind(path) == "missing":
        builtin = configs_dir(kind) / f"{source}.yaml"
        if path_kind(builtin) == "missing":
            known = ", ".join(builtin_names(kind))
            what = {"hardware": "GPU", "rules": "rule set"}.get(kind, kind.removesuffix("s"))
            raise SpecError(field, f"unknown {what} {str(source)!r} (built-ins: {known})")
        path = builtin
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            raise SpecError(field, f"{source}: folder has no config.json")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(field, f"cannot read {path}: {err}") from None
    except RecursionError:
        raise SpecError(field, f"{path} is nested too deeply to be a spec") from None
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SpecError(field, f"{path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {first}") from None
    if not isinstance(data, dict):
        raise SpecError(field, f"{path} must hold a mapping of keys to values")
    name = path.parent.name if path.name == "config.json" else path.stem
    return data, name


def read_json_object(path: str | Path, field: str) -> dict:
    """A JSON file holding one object (a plan, a profile), parsed without pickle;
    SpecError naming `field` when it cannot be read or is not an object."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as err:
        raise SpecError(field, f"cannot read {path}: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SpecError(field, f"{path} is not valid JSON: {err}") from None
    except RecursionError:
        raise SpecError(field, f"{path} is nested too deeply to be a Shardwise file") from None
    except ValueError as err:   # a path with a NUL byte
        raise SpecError(field, f"cannot read {path!r}: {err}") from None
    if not isinstance(doc, dict):
        raise SpecError(field, f"{path} must hold a JSON object")
    return doc


def parse_overrides(text: str | None, field: str = "--set") -> dict[str, str]:
    """`a=1,b=x` -> {"a": "1", "b": "x"}."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise SpecError(field, f"expected key=value, got {item.strip()!r}")
        if key.strip() in out:   # which one was meant? saying so beats keeping the last
            raise SpecError(f"{field} {key.strip()}", f"given twice ({out[key.strip()]} and {value.strip()})")
        out[key.strip()] = value.strip()
    return out


# The largest integer any field takes, the largest a float holds exactly: beyond it the
# estimates' float arithmetic overflows (--seq 1e300 squared is inf).
MAX_INT = 2**53


def as_int(value: Any, field: str, minimum: int = 1, maximum: int = MAX_INT) -> int:
    if isinstance(value, bool):
        raise SpecError(field, f"expected an integer, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except (ValueError, OverflowError):
            raise SpecError(field, f"expected an integer, got {value!r}") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise SpecError(field, f"expected an integer, got {value!r}")
    if value < minimum:
        raise SpecError(field, f"must be at least {minimum}, got {value}")
    if value > maximum:
        raise SpecError(field, f"must be at most {maximum}, got {value if value < 10**18 else f'{value:.3g}'}")
    return value


def as_float(value: Any, field: str, minimum: float = 0.0, exclusive: bool = True) -> float:
    if isinstance(value, bool):
        raise SpecError(field, f"expected a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SpecError(field, f"expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise SpecError(field, f"expected a finite number, got {value!r}")
    if number <= minimum if exclusive else number < minimum:
        bound = "above" if exclusive else "at least"
        raise SpecError(field, f"must be {bound} {minimum:g}, got {value!r}")
    return number


def as_bool(value: Any, field: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "on", "yes", "1", "false", "off", "no", "0"):
        return value.lower() in ("true", "on", "yes", "1")
    raise SpecError(field, f"expected true or false, got {value!r}")


def model_from_dict(data: dict, name: str, overrides: dict[str, str] | None = None) -> ModelSpec:
    """Validate a model mapping (own YAML or Hugging Face config) into a ModelSpec."""
    data = hf_text_config(data)
    lenient = "architectures" in data or "transformers_version" in data
    raw = {_ALIASES.get(k, k): v for k, v in data.items()}
    known = {f.name for f in fields(ModelSpec)} - {"name"}
    for key in overrides or {}:
        if _ALIASES.get(key, key) not in known:
            raise SpecError(f"--set {key}", f"unknown model field (fields: {', '.join(sorted(known))})")
    raw.update({_ALIASES.get(k, k): v for k, v in (overrides or {}).items()})
    if not lenient:
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SpecError(unknown[0], "unknown model field")
    model_type = str(raw.get("model_type", "")).lower()
    family = _FAMILY_OF.get(model_type)
    if family is None:
        raise SpecError("model_type", f"unsupported {model_type or 'missing'!r} (families: {', '.join(FAMILIES)}, or a Hugging Face model_type: {', '.join(sorted(_FAMILY_OF))})")
    values: dict[str, Any] = {"model_type": family}
    for key, value in _hf_architecture(model_type, raw, lenient).items():
        # A Hugging Face config is read as transformers builds it; an own file's
        # explicit fields and --set overrides win.
        if key not in (overrides or {}) and (lenient or raw.get(key) is None):
            raw[key] = value
    if model_type in _WINDOWED_MODEL_TYPES:
        # Their sliding_window is the windowed layers' (attention_window), not Mistral's
        # memory-only field, even when --set gives it.
        raw["sliding_window"] = None
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if raw.get(key) is None:
            raise SpecError(key, "missing")
        values[key] = as_int(raw[key], key)
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    defaults = {
        "num_key_value_heads": heads,
        "intermediate_size": 4 * hidden if family == "gpt" else None,
        "max_position_embeddings": 2048,
        "num_local_experts": 1,
        "num_experts_per_tok": 1,
    }
    for key, default in defaults.items():
        value = raw.get(key)
        if value is None:
            if default is None:
                raise SpecError(key, "missing")
            value = default
        values[key] = as_int(value, key)
    tie = raw.get("tie_word_embeddings")
    values["tie_word_embeddings"] = (family == "gpt") if tie is None else as_bool(tie, "tie_word_embeddings")
    for key in _MODEL_BOOL_FIELDS:
        if raw.get(key) is not None:
            values[key] = as_bool(raw[key], key)
    for key, choices in _MODEL_CHOICE_FIELDS.items():
        if raw.get(key) is not None:
            if str(raw[key]) not in choices:
                raise SpecError(key, f"unknown {raw[key]!r} (known: {', '.join(choices)})")
            values[key] = str(raw[key])
    if raw.get("norms_per_layer") is not None:
        values["norms_per_layer"] = as_int(raw["norms_per_layer"], "norms_per_layer")
        if values["norms_per_layer"] not in (1, 2, 4):
            raise SpecError("norms_per_layer", f"1, 2 or 4, got {values['norms_per_layer']}")
    if raw.get("sliding_window") is not None:
        values["sliding_window"] = as_int(raw["sliding_window"], "sliding_window")
    if raw.get("hidden_act") is not None:
        values["hidden_act"] = str(raw["hidden_act"])
    if raw.get("resid_dropout") is not None:
        values["resid_dropout"] = as_float(raw["resid_dropout"], "resid_dropout", exclusive=False)
        if values["resid_dropout"] >= 1:
            raise SpecError("resid_dropout", f"must be below 1, got {values['resid_dropout']}")
    if raw.get("shared_expert_intermediate_size") is not None:
        values["shared_expert_intermediate_size"] = as_int(raw["shared_expert_intermediate_size"],
                                                           "shared_expert_intermediate_size", minimum=0)
    if raw.get("mlp_only_layers"):
        values["mlp_only_layers"] = _layer_list(raw["mlp_only_layers"], values["num_hidden_layers"])
    for key in (*_MLA_FIELDS, "q_lora_rank", "dense_intermediate_size", "n_group",
                "topk_group", "num_nextn_predict_layers"):
        if raw.get(key) is not None:
            values[key] = as_int(raw[key], key, minimum=0)
    if raw.get("routed_scaling_factor") is not None:
        values["routed_scaling_factor"] = as_float(raw["routed_scaling_factor"], "routed_scaling_factor")
    _check_deepseek_fields(values)
    if raw.get("attention_window") is not None:
        values["attention_window"] = as_int(raw["attention_window"], "attention_window")
    if raw.get("windowed_layers") is not None:
        values["windowed_layers"] = as_int(raw["windowed_layers"], "windowed_layers", minimum=0,
                                           maximum=values["num_hidden_layers"])
    if values.get("windowed_layers") == 0:
        values.pop("attention_window", None)   # --set windowed_layers=0: every layer attends in full
    if bool(values.get("windowed_layers")) != (values.get("attention_window") is not None):
        field = "attention_window" if values.get("windowed_layers") else "windowed_layers"
        raise SpecError(field, "attention_window and windowed_layers (how many layers attend only that many "
                               "tokens, at least 1) go together")
    if raw.get("swiglu_limit") is not None:
        values["swiglu_limit"] = as_float(raw["swiglu_limit"], "swiglu_limit")
    if values.get("chunked_attention") and not values.get("windowed_layers"):
        raise SpecError("chunked_attention", "set without windowed layers (attention_window, windowed_layers)")
    if values["num_local_experts"] < 2:
        # Fields of the experts and their router, away from their defaults on a dense model.
        for key, unset in _EXPERT_FIELDS.items():
            if values.get(key, unset) != unset:
                raise SpecError(key, "set on a model without experts (num_local_experts 1)")
    if raw.get("shared_expert_gate") is not None:
        values["shared_expert_gate"] = as_bool(raw["shared_expert_gate"], "shared_expert_gate")
        if values["shared_expert_gate"] and not values.get("shared_expert_intermediate_size"):
            raise SpecError("shared_expert_gate", "set on a model without a shared expert "
                                                  "(shared_expert_intermediate_size 0)")
    if raw.get("moe_capacity_factor") is not None:
        values["moe_capacity_factor"] = as_float(raw["moe_capacity_factor"], "moe_capacity_factor")
        if values["num_local_experts"] < 2:
            raise SpecError("moe_capacity_factor", "set on a model without experts (num_local_experts 1)")
    if raw.get("moe_load_imbalance") is not None:
        values["moe_load_imbalance"] = as_float(raw["moe_load_imbalance"], "moe_load_imbalance")
        if values["moe_load_imbalance"] < 1:
            raise SpecError("moe_load_imbalance", f"the busiest rank's rows over the mean: at least 1, "
                                                  f"got {values['moe_load_imbalance']:g}")
        if values["num_local_experts"] < 2 and values["moe_load_imbalance"] != 1:
            raise SpecError("moe_load_imbalance", "set on a model without experts (num_local_experts 1)")
    if raw.get("head_dim") is not None:
        values["head_dim"] = as_int(raw["head_dim"], "head_dim")
    elif hidden % heads:
        raise SpecError("num_attention_heads", f"{heads} does not divide hidden_size {hidden}")
    if heads % values["num_key_value_heads"]:
        raise SpecError("num_key_value_heads", f"{values['num_key_value_heads']} does not divide num_attention_heads {heads}")
    if values["num_experts_per_tok"] > values["num_local_experts"]:
        raise SpecError("num_experts_per_tok", f"{values['num_experts_per_tok']} exceeds num_local_experts {values['num_local_experts']}")
    if family == "mixtral" and values["num_local_experts"] < 2:
        raise SpecError("num_local_experts", "a mixtral model needs at least 2 experts")
    return ModelSpec(name=name, **{k: values[k] for k in known if k in values})


def _layer_list(value: Any, layers: int) -> tuple[int, ...]:
    """mlp_only_layers: layer indices, given as a list or as "0,1,2" (--set), each once,
    sorted; every one below num_hidden_layers."""
    if isinstance(value, str):
        value = [v for v in value.strip("[]() ").replace(" ", "").split(",") if v]
    if not isinstance(value, (list, tuple)):
        raise SpecError("mlp_only_layers", f"expected a list of layer indices, got {value!r}")
    out = sorted({as_int(v, "mlp_only_layers", minimum=0) for v in value})
    if len(out) != len(value):
        raise SpecError("mlp_only_layers", "a layer is listed twice")
    if out and out[-1] >= layers:
        raise SpecError("mlp_only_layers", f"layer {out[-1]} of a model of {layers} layers")
    return tuple(out)


def _check_deepseek_fields(values: dict) -> None:
    """Multi-head latent attention's widths go together; the dense first layers leave at
    least one sparse layer; routing groups split the experts evenly and hold the top k."""
    mla = [values.get(key, 0) for key in _MLA_FIELDS]
    if any(mla) and not all(mla):
        missing = next(key for key, value in zip(_MLA_FIELDS, mla) if not value)
        raise SpecError(missing, f"multi-head latent attention needs {', '.join(_MLA_FIELDS)} all above 0")
    if values.get("q_lora_rank") and not all(mla):
        raise SpecError("q_lora_rank", "set without multi-head latent attention (kv_lora_rank 0)")
    layers = values["num_hidden_layers"]
    if len(values.get("mlp_only_layers", ())) >= layers:
        raise SpecError("mlp_only_layers", f"every one of the {layers} layers dense leaves none a mixture of experts")
    if values.get("dense_intermediate_size") and not values.get("mlp_only_layers"):
        raise SpecError("dense_intermediate_size", "set without dense-MLP layers (mlp_only_layers empty)")
    experts, groups = values["num_local_experts"], values.get("n_group", 1)
    if groups < 1 or experts % groups:
        raise SpecError("n_group", f"{groups} groups do not split {experts} experts evenly")
    chosen = values.get("topk_group", 1)
    if not 1 <= chosen <= groups:
        raise SpecError("topk_group", f"{chosen}: between 1 and n_group {groups}")
    if groups > 1 and values["num_experts_per_tok"] > chosen * experts // groups:
        raise SpecError("topk_group", f"{chosen} groups of {experts // groups} experts cannot hold the "
                                      f"{values['num_experts_per_tok']} experts a token takes")


def load_model(source: str | Path, overrides: dict[str, str] | None = None) -> ModelSpec:
    """A built-in name, a YAML/JSON spec, a Hugging Face config.json (or its folder), or
    a plan file (its model block). `hf:PATH` is planner.api.resolve_model's."""
    data, name = read_document(source, "models", "--model")
    if "schema_version" in data and isinstance(data.get("model"), dict):   # a plan file: its model
        block = data["model"]
        if "nodes" in block:
            raise SpecError("--model", f"{source} is a plan of a traced module, not a model spec")
        name = str(block.get("name", name))
        data = {k: v for k, v in block.items() if k != "name"}
    return model_from_dict(data, name, overrides)


def gpu_from_dict(data: dict, field: str = "gpu") -> GPUSpec:
    _check_keys(data, {"name", "peak_flops_per_s", "memory_bytes", "hbm_bandwidth_bytes_per_s",
                       "gemm_efficiency_max", "gemm_half_dim", "busy_power_w", "idle_power_w", "host_overheads"},
                field)
    peaks = data.get("peak_flops_per_s")
    if not isinstance(peaks, dict) or not peaks:
        raise SpecError(f"{field}.peak_flops_per_s", "expected a mapping of precision to FLOP/s")
    for p in peaks:
        if p not in DATA_SHEET_PRECISIONS:
            raise SpecError(f"{field}.peak_flops_per_s.{p}",
                            f"unknown precision (known: {', '.join(DATA_SHEET_PRECISIONS)})")
    busy = _optional_number(data, "busy_power_w", field)
    idle = _optional_number(data, "idle_power_w", field, exclusive=False)
    if busy is not None and idle is not None and idle > busy:
        raise SpecError(f"{field}.idle_power_w", f"{idle:g} W is above busy_power_w {busy:g} W")
    return GPUSpec(
        name=str(data.get("name", "gpu")),
        peak_flops_per_s={p: as_float(v, f"{field}.peak_flops_per_s.{p}") for p, v in sorted(peaks.items())},
        memory_bytes=as_int(data.get("memory_bytes"), f"{field}.memory_bytes"),
        hbm_bandwidth_bytes_per_s=as_float(data.get("hbm_bandwidth_bytes_per_s"), f"{field}.hbm_bandwidth_bytes_per_s"),
        gemm_efficiency_max=_optional_fraction(data, "gemm_efficiency_max", field),
        gemm_half_dim=(as_float(data["gemm_half_dim"], f"{field}.gemm_half_dim", exclusive=False)
                       if "gemm_half_dim" in data else None),
        busy_power_w=busy,
        idle_power_w=idle,
        host_overheads=(host_overheads_from_dict(data["host_overheads"], f"{field}.host_overheads")
                        if data.get("host_overheads") is not None else None),
    )


def host_overheads_from_dict(data, field: str) -> HostOverheads:
    """The host seconds of PyTorch's parallel wrappers (HostOverheads): non-negative numbers."""
    if not isinstance(data, dict):
        raise SpecError(field, "expected a mapping of overhead name to seconds")
    names = [f.name for f in fields(HostOverheads)]
    _check_keys(data, set(names), field)
    return HostOverheads(**{k: as_float(data[k], f"{field}.{k}", exclusive=False) for k in names if k in data})


def _optional_number(data: dict, key: str, field: str, exclusive: bool = True) -> float | None:
    """An optional non-negative number (positive when `exclusive`); absent or null: None."""
    if data.get(key) is None:
        return None
    return as_float(data[key], f"{field}.{key}", exclusive=exclusive)


def _optional_fraction(data: dict, key: str, field: str) -> float | None:
    if key not in data:
        return None
    value = as_float(data[key], f"{field}.{key}", exclusive=False)
    if value > 1:
        raise SpecError(f"{field}.{key}", f"must be at most 1, got {value}")
    return value


def link_from_dict(data: Any, field: str) -> LinkSpec:
    if not isinstance(data, dict):
        raise SpecError(field, "expected a mapping with bandwidth_bytes_per_s and latency_s")
    _check_keys(data, {"bandwidth_bytes_per_s", "latency_s", "efficiency", "collectives"}, field)
    efficiency = as_float(data.get("efficiency", 1.0), f"{field}.efficiency")
    if efficiency > 1:
        raise SpecError(f"{field}.efficiency", f"must be at most 1, got {efficiency}")
    per_kind = data.get("collectives", {})
    if not isinstance(per_kind, dict):
        raise SpecError(f"{field}.collectives", "expected a mapping of collective kind to bandwidth and latency")
    collectives = {}
    for kind, figures in sorted(per_kind.items()):
        where = f"{field}.collectives.{kind}"
        if kind not in COLLECTIVE_KINDS:
            raise SpecError(where, f"unknown collective (known: {', '.join(COLLECTIVE_KINDS)})")
        if not isinstance(figures, dict):
            raise SpecError(where, "expected bandwidth_bytes_per_s and latency_s")
        _check_keys(figures, {"bandwidth_bytes_per_s", "latency_s"}, where)
        collectives[kind] = (as_float(figures.get("bandwidth_bytes_per_s"), f"{where}.bandwidth_bytes_per_s"),
                             as_float(figures.get("latency_s"), f"{where}.latency_s", exclusive=False))
    return LinkSpec(
        bandwidth_bytes_per_s=as_float(data.get("bandwidth_bytes_per_s"), f"{field}.bandwidth_bytes_per_s"),
        latency_s=as_float(data.get("latency_s"), f"{field}.latency_s", exclusive=False),
        efficiency=efficiency,
        collectives=collectives,
    )


def load_cluster(source: str | Path, nodes: int | None = None,
                 gpus: int | None = None) -> ClusterSpec | MixedClusterSpec:
    """A cluster by name or path, resized by `nodes` or `gpus` (not both). A file with
    `groups` is a mixed cluster (`mixed_cluster_from_dict`), sized by its groups."""
    data, name = read_document(source, "clusters", "--cluster")
    if "groups" in data:
        if nodes is not None or gpus is not None:
            raise SpecError("--gpus" if gpus is not None else "--nodes",
                            f"{name} is a mixed cluster: its size is its groups' num_nodes (edit the cluster file)")
        return mixed_cluster_from_dict(data, name)
    _check_keys(data, {"name", "gpu", "gpus_per_node", "num_nodes", "intra_node", "inter_node", "comm_overlap",
                       "gpu_hour_price_usd", "nvlink_domain_gpus"}, "cluster")
    gpu_data = data.get("gpu")
    if isinstance(gpu_data, str):
        gpu_data, _ = read_document(gpu_data, "hardware", "cluster.gpu")
    if not isinstance(gpu_data, dict):
        raise SpecError("cluster.gpu", "expected a built-in GPU name or a mapping")
    gpus_per_node = as_int(data.get("gpus_per_node"), "cluster.gpus_per_node")
    num_nodes = as_int(data.get("num_nodes", 1), "cluster.num_nodes")
    domain = None
    if data.get("nvlink_domain_gpus") is not None:
        domain = as_int(data["nvlink_domain_gpus"], "cluster.nvlink_domain_gpus")
        if domain % gpus_per_node:
            raise SpecError("cluster.nvlink_domain_gpus", f"{domain} is not a whole number of "
                                                          f"{gpus_per_node}-GPU nodes")
    if nodes is not None and gpus is not None:
        raise SpecError("--gpus", "give --nodes or --gpus, not both")
    if nodes is not None:
        num_nodes = as_int(nodes, "--nodes")
    if gpus is not None:
        gpus = as_int(gpus, "--gpus")
        if gpus < gpus_per_node:
            gpus_per_node, num_nodes = gpus, 1
        elif gpus % gpus_per_node:
            raise SpecError("--gpus", f"{gpus} is not a whole number of {gpus_per_node}-GPU nodes")
        else:
            num_nodes = gpus // gpus_per_node
    return ClusterSpec(
        name=str(data.get("name", name)),
        gpu=gpu_from_dict(gpu_data, "cluster.gpu"),
        gpus_per_node=gpus_per_node,
        num_nodes=num_nodes,
        intra_node=link_from_dict(data.get("intra_node"), "cluster.intra_node"),
        inter_node=link_from_dict(data.get("inter_node", data.get("intra_node")), "cluster.inter_node"),
        comm_overlap=_optional_fraction(data, "comm_overlap", "cluster") if "comm_overlap" in data else 1.0,
        gpu_hour_price_usd=_optional_number(data, "gpu_hour_price_usd", "cluster"),
        nvlink_domain_gpus=domain,
    )


def mixed_cluster_from_dict(data: dict, name: str) -> MixedClusterSpec:
    """groups: a list of {cluster: built-in name or path, num_nodes: N, name: optional
    group name}; inter_group: the link between nodes of different groups."""
    _check_keys(data, {"name", "groups", "inter_group"}, "cluster")
    entries = data.get("groups")
    if not isinstance(entries, list) or not entries:
        raise SpecError("cluster.groups", "expected a non-empty list of groups")
    groups = []
    for i, entry in enumerate(entries):
        field = f"cluster.groups[{i}]"
        if not isinstance(entry, dict):
            raise SpecError(field, "expected a mapping with cluster and num_nodes")
        _check_keys(entry, {"cluster", "num_nodes", "name"}, field)
        if not isinstance(entry.get("cluster"), str):
            raise SpecError(f"{field}.cluster", "expected a built-in cluster name or a path")
        base = load_cluster(entry["cluster"], nodes=as_int(entry.get("num_nodes", 1), f"{field}.num_nodes"))
        if isinstance(base, MixedClusterSpec):
            raise SpecError(f"{field}.cluster", "a group is a homogeneous cluster, not a mixed one")
        groups.append(replace(base, name=str(entry.get("name", base.name))))
    names = [g.name for g in groups]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise SpecError("cluster.groups", f"two groups are named {duplicate!r}: give each a name")
    if "inter_group" not in data:
        raise SpecError("cluster.inter_group", "missing: the link between nodes of different groups")
    return MixedClusterSpec(name=str(data.get("name", name)), groups=tuple(groups),
                            inter_group=link_from_dict(data["inter_group"], "cluster.inter_group"))


def runtime_from_dict(data: dict, name: str, field: str = "--runtime") -> RuntimeSpec:
    """Validate a runtime profile mapping (configs/runtimes/*.yaml, or a plan's
    `runtime`) into a RuntimeSpec; SpecError names `field`.the_key."""
    allowed = {"name", "version", "description", "fitted_on", "mixed_precision", "selective_recompute",
               "fsdp_kept_gathered", "moe_dispatch", *INT_FIELDS,
               *FRACTION_FIELDS, *NUMBER_FIELDS, *FLAG_FIELDS, *BAND_FIELDS}
    if "selective_recompute_gemm_fraction" in data and "selective_recompute" not in data:
        # Plans written before the policy had a name: 0 was the attention core, 0.5 torchtitan's op-level SAC.
        data = {**data, "selective_recompute": "op-level" if data["selective_recompute_gemm_fraction"] else
                "attention-core"}
    data = {k: v for k, v in data.items() if k != "selective_recompute_gemm_fraction"}
    if isinstance(data.get("fitted_on"), dict):
        data["fitted_on"] = {k: v for k, v in data["fitted_on"].items() if k != "selective_recompute_gemm_fraction"}
    _check_keys(data, allowed, field)
    values: dict[str, Any] = {"name": str(data.get("name", name)),
                              "version": as_int(data.get("version"), f"{field}.version")}
    for key in FRACTION_FIELDS:
        if key in data:
            values[key] = _optional_fraction(data, key, field)
    for key in NUMBER_FIELDS:
        if key in data:
            values[key] = as_float(data[key], f"{field}.{key}",
                                   exclusive=key not in ("collective_half_bytes", "layer_launch_s", "step_overhead_s"))
    for key in INT_FIELDS:
        if key in data:
            values[key] = as_int(data[key], f"{field}.{key}", minimum=1)
    for key, known in (("mixed_precision", MIXED_PRECISION), ("selective_recompute", SELECTIVE_POLICIES),
                       ("fsdp_kept_gathered", FSDP_KEPT_GATHERED), ("moe_dispatch", MOE_DISPATCHES)):
        if key in data:
            if data[key] not in known:
                raise SpecError(f"{field}.{key}", f"unknown {data[key]!r} (known: {', '.join(known)})")
            values[key] = data[key]
    for key in BAND_FIELDS:
        if key in data:
            values[key] = as_float(data[key], f"{field}.{key}", exclusive=True)
            low = key == "step_time_low_ratio"
            if (values[key] > 1.0) if low else (values[key] < 1.0):
                raise SpecError(f"{field}.{key}", f"must be {'at most' if low else 'at least'} 1, got {data[key]}")
    for key in FLAG_FIELDS:
        if key in data:
            values[key] = as_bool(data[key], f"{field}.{key}")
    fitted = data.get("fitted_on", {})
    if not isinstance(fitted, dict) or not all(isinstance(v, str) for v in fitted.values()):
        raise SpecError(f"{field}.fitted_on", "expected a mapping of coefficient to the measurements it was fitted on")
    unknown = sorted(set(fitted) - set(FRACTION_FIELDS) - set(NUMBER_FIELDS) - set(FLAG_FIELDS) - set(BAND_FIELDS)
                     - set(INT_FIELDS)
                     - {"selective_recompute", "fsdp_kept_gathered", "moe_dispatch"})
    if unknown:
        raise SpecError(f"{field}.fitted_on.{unknown[0]}", "not a coefficient of the runtime")
    values["fitted_on"] = {str(k): v for k, v in sorted(fitted.items())}
    return RuntimeSpec(**values)


def with_runtime_settings(runtime: RuntimeSpec, settings: dict[str, Any], field: str = "--runtime-set") -> RuntimeSpec:
    """`runtime` with some of its engine settings (SETTING_FIELDS) changed, validated as
    a runtime file's; SpecError names `field`.the_key."""
    for key in settings:
        if key not in SETTING_FIELDS:
            raise SpecError(f"{field}.{key}", f"not a setting (settings: {', '.join(SETTING_FIELDS)}); fitted "
                                              "coefficients come with a runtime file (--runtime FILE)")
    data = {**asdict(runtime), **settings}
    return runtime_from_dict(data, runtime.name, field)


@lru_cache(maxsize=32)
def _builtin_runtime(name: str) -> RuntimeSpec:
    data, stem = read_document(name, "runtimes", "--runtime")
    return runtime_from_dict(data, stem)


def load_runtime(source: str | Path | None = None) -> RuntimeSpec:
    """A runtime profile by built-in name (configs/runtimes/) or a YAML/JSON path; None:
    the default, pytorch-native. SpecError naming `--runtime` when unknown or bad."""
    source = DEFAULT_RUNTIME if source is None else source
    if path_kind(source) == "missing":
        return _builtin_runtime(str(source))
    data, stem = read_document(source, "runtimes", "--runtime")
    return runtime_from_dict(data, stem)


def make_training(model: ModelSpec, cluster: ClusterSpec | MixedClusterSpec, global_batch: Any, seq_len: Any = None,
                  precision: str = "bf16", optimizer: str = "adamw", flash_attention: bool = True,
                  mixed_precision: str = "autocast") -> TrainingSpec:
    batch = as_int(global_batch, "--global-batch")
    seq = model.max_position_embeddings if seq_len is None else as_int(seq_len, "--seq")
    if precision not in PRECISION_CHOICES:
        raise SpecError("--precision", f"unknown {precision!r} (known: {', '.join(PRECISION_CHOICES)})")
    name, (precision, fp8) = precision, split_precision(precision)
    for group in getattr(cluster, "groups", (cluster,)):
        peaks = group.gpu.peak_flops_per_s
        if precision not in peaks or (fp8 and "fp8" not in peaks):
            have = ", ".join(c for c in PRECISION_CHOICES if _runs_on(c, peaks)) or "none a plan can use"
            needed = f"fp8 peak for {name}" if fp8 else f"{precision} peak"
            raise SpecError("--precision", f"{group.gpu.name} has no {needed} (has: {have}; pass one of those)")
        if not _runs_on(name, peaks):   # an FP8 peak, but not MX's
            raise SpecError("--precision", f"{group.gpu.name} has no MX (block-scaled) FP8 GEMMs, which Blackwell "
                                           "(B200, GB200) has; pass fp8-blockwise or fp8-rowwise")
    if optimizer not in OPTIMIZERS:
        raise SpecError("--optimizer", f"unknown {optimizer!r} (known: {', '.join(OPTIMIZERS)})")
    if mixed_precision not in MIXED_PRECISION:
        raise SpecError("mixed_precision", f"unknown {mixed_precision!r} (known: {', '.join(MIXED_PRECISION)})")
    return TrainingSpec(batch, seq, precision, optimizer, flash_attention, mixed_precision, fp8)


def _runs_on(name: str, peaks: dict) -> bool:
    """Whether a --precision name runs on a GPU of these data-sheet peaks: its precision's
    peak, an fp8 one for FP8 recipes, and for MX formats an FP4 one (MXFP4 / NVFP4: the
    GPUs whose tensor cores take block-scaled formats, Blackwell's)."""
    precision, fp8 = split_precision(name)
    return precision in peaks and (fp8 is None or "fp8" in peaks) and (fp8 != "mxfp8" or "fp4" in peaks)


def _check_keys(data: dict, allowed: set[str], field: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise SpecError(f"{field}.{unknown[0]}", f"unknown field (fields: {', '.join(sorted(allowed))})")
