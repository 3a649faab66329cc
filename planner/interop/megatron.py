"""Megatron-LM: its command-line arguments, read as a strategy (`read_megatron`) and written
from one (`export_megatron`), with Megatron's own stage partition (`megatron_split`,
`megatron_layout_sizes`). Megatron-LM's `megatron/training/arguments.py` is not on PyPI, so
its names are those of megatron-core 0.16.1's config fields (`ModelParallelConfig`,
`TransformerConfig`, `DistributedDataParallelConfig`, which Megatron-LM fills from its
arguments of the same names with dashes) and, where an argument is spelled differently
from its field, Megatron-LM's arguments.py as we know it.
"""

from __future__ import annotations

import argparse
import re

from costmodel.specs import ModelSpec, RuntimeSpec, TrainingSpec
from costmodel.specs.loading import SpecError
from costmodel.strategy import ZERO_BUBBLE_SCHEDULES, Strategy
from planner.interop.common import (
    Exported,
    Imported,
    Recompute,
    build_stages,
    check_model,
    divide,
    engine_strategy,
    override_tokens,
    per_stage,
    recompute_form,
)


def megatron_split(num_layers: int, pp: int, vpp: int, first: int | None = None, last: int | None = None,
                   account_embedding: bool = False, account_loss: bool = False) -> list[int] | None:
    """Layers per virtual stage (index = chunk * pp + pp rank) as Megatron places them:
    evenly, or with `first`/`last` layers on the first/last pipeline rank and the rest
    even (`TransformerConfig.num_layers_in_first/last_pipeline_stage`,
    megatron/core/transformer/transformer_layer.py get_transformer_layer_offset), or with
    the embedding and loss counted as layers (`account_for_embedding/loss_in_pipeline_split`).
    None where Megatron refuses it (the layers do not divide)."""
    if first is not None or last is not None:
        middle_ranks = pp - (first is not None) - (last is not None)
        middle = num_layers - (first or 0) - (last or 0)
        if middle < 0 or (middle_ranks and middle % (middle_ranks * vpp)) or (not middle_ranks and middle):
            return None
        per_rank = {r: middle // (middle_ranks * vpp) if middle_ranks else 0 for r in range(pp)}
        for rank, count in ((0, first), (pp - 1, last)):
            if count is not None:
                if count % vpp:
                    return None
                per_rank[rank] = count // vpp
        return [per_rank[i % pp] for i in range(pp * vpp)]
    total = num_layers + account_embedding + account_loss
    if total % (pp * vpp):
        return None
    sizes = [total // (pp * vpp)] * (pp * vpp)
    sizes[0] -= account_embedding
    sizes[-1] -= account_loss
    return sizes if min(sizes) >= 0 else None



def megatron_layout_sizes(layout: str) -> list[int]:
    """Decoder layers per virtual stage of a `--pipeline-model-parallel-layout` string,
    unrolled as megatron/core/transformer/pipeline_parallel_layer_layout.py
    parse_str_to_list does ("Et*3|(tt|)*2,t|tL")."""
    text = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    if set(text) - set("EtmL|"):
        raise SpecError("--pipeline-model-parallel-layout", f"unknown layer character in {layout!r} (known: E, t, m, L)")
    if "m" in text:
        raise SpecError("--pipeline-model-parallel-layout", "multi-token prediction layers (m) are not modelled")
    return [stage.count("t") for stage in text.split("|")]



# Megatron-LM argument names (megatron/training/arguments.py); each maps to the
# megatron-core 0.16.1 config field named in the comment.
MEGATRON_INT_ARGS = (
    "--tensor-model-parallel-size",           # ModelParallelConfig.tensor_model_parallel_size
    "--pipeline-model-parallel-size",         # ModelParallelConfig.pipeline_model_parallel_size
    "--num-layers-per-virtual-pipeline-stage",  # arguments.py; sets virtual_pipeline_model_parallel_size
    "--num-virtual-stages-per-pipeline-rank",  # arguments.py; the same, stated per rank
    "--decoder-first-pipeline-num-layers",    # TransformerConfig.num_layers_in_first_pipeline_stage
    "--decoder-last-pipeline-num-layers",     # TransformerConfig.num_layers_in_last_pipeline_stage
    "--micro-batch-size", "--global-batch-size",   # arguments.py (training batch)
    "--recompute-num-layers",                 # TransformerConfig.recompute_num_layers
    "--context-parallel-size",                # ModelParallelConfig.context_parallel_size
    "--expert-model-parallel-size",           # ModelParallelConfig.expert_model_parallel_size
    "--expert-tensor-parallel-size",          # ModelParallelConfig.expert_tensor_parallel_size
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",   # TransformerConfig
    "--num-query-groups",                     # TransformerConfig.num_query_groups
    "--kv-channels",                          # TransformerConfig.kv_channels (head_dim)
    "--seq-length", "--max-position-embeddings",   # arguments.py
    "--num-experts", "--moe-router-topk",     # TransformerConfig.num_moe_experts, moe_router_topk
    "--moe-shared-expert-intermediate-size",  # TransformerConfig.moe_shared_expert_intermediate_size
    # DeepSeek-V3 (megatron-core 0.16.1 TransformerConfig and MLATransformerConfig):
    "--moe-ffn-hidden-size",                  # TransformerConfig.moe_ffn_hidden_size (the experts' width)
    "--q-lora-rank", "--kv-lora-rank",        # MLATransformerConfig.q_lora_rank, kv_lora_rank
    "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim",   # MLATransformerConfig (nope, rope, value)
    "--moe-router-num-groups", "--moe-router-group-topk",   # TransformerConfig (group-limited routing)
    "--mtp-num-layers",                       # TransformerConfig.mtp_num_layers
)



MEGATRON_CHOICE_ARGS = {
    "--recompute-granularity": ("full", "selective"),     # TransformerConfig.recompute_granularity
    "--recompute-method": ("uniform", "block"),           # TransformerConfig.recompute_method
    # DistributedDataParallelConfig.data_parallel_sharding_strategy (Megatron FSDP)
    "--data-parallel-sharding-strategy": ("no_shard", "optim", "optim_grads", "optim_grads_params"),
    # FP8 through Transformer Engine (megatron-core 0.16.1 transformer_config.py): the field
    # `fp8` is the argument --fp8-format ("hybrid": e4m3 forward, e5m2 gradients), `fp8_recipe`
    # --fp8-recipe (default "delayed"; enums.py Fp8Recipe).
    "--fp8-format": ("e4m3", "hybrid"),
    "--fp8-recipe": ("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
    "--moe-router-score-function": ("softmax", "sigmoid"),   # TransformerConfig.moe_router_score_function
    # TransformerConfig.moe_token_dispatcher_type (default "allgather") and, for "flex",
    # moe_flex_dispatcher_backend: how tokens reach their experts (RuntimeSpec.moe_dispatch).
    "--moe-token-dispatcher-type": ("allgather", "alltoall", "flex"),
    "--moe-flex-dispatcher-backend": ("deepep", "hybridep"),
}



MEGATRON_STR_ARGS = ("--pipeline-model-parallel-layout",)   # TransformerConfig.pipeline_model_parallel_layout

# TransformerConfig.cp_comm_type: how the cp ranks exchange K and V, one for all layers or
# one per layer. "all_gather" gathers the whole sequence's K and V before attention (what
# Shardwise prices), "p2p" passes chunks around a ring (Megatron-LM's default), "a2a"
# scatters heads as DeepSpeed Ulysses does, "a2a+p2p" nests the two.
MEGATRON_CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
# Without --cp-comm-type: Megatron-LM's default ["p2p"] (arguments.py), and megatron-core
# hands an unset type to Transformer Engine as "p2p" (extensions/transformer_engine.py).
MEGATRON_CP_COMM_DEFAULT = "p2p"

# TransformerConfig.moe_expert_capacity_factor (None: dropless), moe_token_drop_policy
# ("probs" drops the lowest router probabilities, "position" the latest tokens: the
# executor's) and moe_pad_expert_input_to_capacity.
MEGATRON_FLOAT_MODEL_ARGS = ("--moe-expert-capacity-factor",
                             "--moe-router-topk-scaling-factor")   # TransformerConfig.moe_router_topk_scaling_factor
MEGATRON_DROP_POLICIES = ("probs", "position")



MEGATRON_FLAGS = (
    "--sequence-parallel",                    # ModelParallelConfig.sequence_parallel
    "--use-distributed-optimizer",            # DistributedDataParallelConfig.use_distributed_optimizer
    "--use-megatron-fsdp",                    # DistributedDataParallelConfig.use_megatron_fsdp
    "--use-torch-fsdp2",                      # arguments.py: PyTorch FSDP2 in place of DDP
    "--group-query-attention",                # arguments.py; enables num_query_groups
    "--account-for-embedding-in-pipeline-split",   # TransformerConfig.account_for_embedding_in_pipeline_split
    "--account-for-loss-in-pipeline-split",   # TransformerConfig.account_for_loss_in_pipeline_split
    "--bf16", "--fp16",                       # ModelParallelConfig.bf16 / fp16
    "--untie-embeddings-and-output-weights", "--swiglu", "--disable-bias-linear",   # model shape, arguments.py
    "--moe-pad-expert-input-to-capacity",     # TransformerConfig.moe_pad_expert_input_to_capacity
    "--qk-layernorm",                         # TransformerConfig.qk_layernorm (Qwen3's q/k norm)
    "--add-qkv-bias",                         # TransformerConfig.add_qkv_bias (Qwen2's q/k/v biases)
    "--moe-shared-expert-gate",               # TransformerConfig.moe_shared_expert_gate (Qwen2-MoE)
    # TransformerConfig.moe_router_pre_softmax: the top k of the softmax over every expert,
    # not renormalised (the spec's norm_topk_prob False); Megatron's default is the softmax
    # over the k chosen logits.
    "--moe-router-pre-softmax",
    "--multi-latent-attention",               # TransformerConfig.multi_latent_attention
    "--moe-enable-deepep",                    # TransformerConfig.moe_enable_deepep (deprecated: flex + deepep)
)



MEGATRON_NARGS_ARGS = ("--recompute-modules",    # TransformerConfig.recompute_modules
                       "--cp-comm-type")          # TransformerConfig.cp_comm_type (MEGATRON_CP_COMM_TYPES)



MEGATRON_STR_MODEL_ARGS = ("--normalization", "--position-embedding-type",   # arguments.py
                           # TransformerConfig.moe_layer_freq: an int (every N-th layer sparse) or a
                           # Python list expression of 0 (dense) and 1 (sparse) a layer, "([0]*3+[1]*58)".
                           "--moe-layer-freq")


def moe_layer_pattern(model: ModelSpec) -> str:
    """--moe-layer-freq for a model with dense-MLP layers (mlp_only_layers): dense first
    layers as Megatron-LM's DeepSeek-V3 recipe writes them, "([0]*3+[1]*58)", any other
    layout as its list of 0 (dense) and 1 (sparse) a layer."""
    dense, layers = set(model.mlp_only_layers), model.num_hidden_layers
    if dense == set(range(len(dense))):
        return f"([0]*{len(dense)}+[1]*{layers - len(dense)})"
    return "[" + ",".join("0" if i in dense else "1" for i in range(layers)) + "]"


def read_moe_layer_freq(text: str | None, layers: int) -> tuple[int, ...]:
    """The dense-MLP layers --moe-layer-freq gives: an int N makes layer i sparse when
    i % N is 0 (megatron-core gpt_layer_specs.py; 1 or absent: every layer), a list of 0
    (dense) and 1 (sparse) a layer, or the ([0]*K+[1]*N) form."""
    flat = (text or "1").replace(" ", "").strip("\"'")
    if flat.isdigit() and int(flat) > 0:
        return tuple(i for i in range(layers) if i % int(flat))
    match = re.fullmatch(r"\(?\[0\]\*(\d+)\+\[1\]\*(\d+)\)?", flat)
    if match:
        pattern = [0] * int(match.group(1)) + [1] * int(match.group(2))
    elif re.fullmatch(r"\[[01](,[01])*\]", flat):
        pattern = [int(c) for c in flat[1:-1].split(",")]
    else:
        raise SpecError("--moe-layer-freq", f"{text!r}: Shardwise reads an int, a list of 0 and 1 a layer, or "
                                            "([0]*K+[1]*N)")
    if len(pattern) != layers:
        raise SpecError("--moe-layer-freq", f"{len(pattern)} entries for {layers} layers")
    return tuple(i for i, sparse in enumerate(pattern) if not sparse)


class _ArgError(Exception):
    pass



class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting."""

    def error(self, message: str):
        raise _ArgError(message)



def megatron_parser() -> argparse.ArgumentParser:
    """An argparse definition with Megatron-LM's names for what Shardwise reads."""
    parser = _Parser(prog="megatron", add_help=False, allow_abbrev=False)
    for name in MEGATRON_INT_ARGS:
        parser.add_argument(name, type=int)
    for name, choices in MEGATRON_CHOICE_ARGS.items():
        parser.add_argument(name, choices=choices)
    for name in MEGATRON_STR_ARGS + MEGATRON_STR_MODEL_ARGS:
        parser.add_argument(name)
    for name in MEGATRON_FLOAT_MODEL_ARGS:
        parser.add_argument(name, type=float)
    parser.add_argument("--moe-token-drop-policy", choices=MEGATRON_DROP_POLICIES)
    for name in MEGATRON_FLAGS:
        parser.add_argument(name, action="store_true")
    for name in MEGATRON_NARGS_ARGS:
        parser.add_argument(name, nargs="*")
    return parser



def _check_capacity(args: argparse.Namespace, model: ModelSpec, warnings: list[str]) -> None:
    """Megatron's expert capacity against the model's: dropping rows changes what the
    experts compute, so a command that drops where the model does not (or the reverse)
    describes another model."""
    given, expected = args.moe_expert_capacity_factor, model.moe_capacity_factor
    if given != expected:
        said = "absent (dropless)" if given is None else f"{given:g}"
        has = "is dropless" if expected is None else f"has moe_capacity_factor {expected:g}"
        fix = (f"--set moe_capacity_factor={given:g}" if given is not None
               else "leave moe_capacity_factor unset")
        raise SpecError("--moe-expert-capacity-factor", f"{said}, but {model.name} {has}: {fix} to price it")
    if given is None:
        return
    if args.moe_pad_expert_input_to_capacity:
        warnings.append("--moe-pad-expert-input-to-capacity: priced without the padding (each expert runs the "
                        "rows it keeps, balanced routing)")
    if args.moe_token_drop_policy != "position":
        warnings.append("--moe-token-drop-policy probs (Megatron's default) drops the lowest router probabilities; "
                        "priced the same (as many rows kept), while the executor drops the latest tokens (position)")


# Megatron's recipe for each of Shardwise's (costmodel.specs.training.FP8_RECIPES):
# "tensorwise" is Transformer Engine's Float8CurrentScaling, one scale per tensor from its
# current amax (megatron/core/fp8_utils.py), torchao's tensorwise. Megatron has no per-row
# scaling: "blockwise" (Float8BlockScaling: 1x128 tiles of activations and gradients,
# 128x128 blocks of weights) is the nearest to torchao's rowwise. "blockwise" and "mxfp8"
# (MXFP8BlockScaling) are Shardwise's recipes of those names.
MEGATRON_FP8_RECIPES = {"tensorwise": "tensorwise", "rowwise": "blockwise", "blockwise": "blockwise", "mxfp8": "mxfp8"}
# Without --fp8-recipe: TransformerConfig.fp8_recipe's default.
MEGATRON_FP8_RECIPE_DEFAULT = "delayed"


def _read_fp8(args: argparse.Namespace, precision: str, model: ModelSpec, warnings: list[str]) -> str | None:
    """The FP8_RECIPES name --fp8-format / --fp8-recipe are priced as (None: no FP8)."""
    if args.fp8_format is None:
        if args.fp8_recipe is not None:
            warnings.append(f"--fp8-recipe {args.fp8_recipe} without --fp8-format: Megatron trains without FP8, "
                            "priced so")
        return None
    if precision != "bf16":
        raise SpecError("--fp8-format", f"{args.fp8_format} with {'--fp16' if precision == 'fp16' else 'fp32'}: "
                        "Shardwise prices FP8 training beside --bf16 (bf16 mixed precision)")
    recipe = args.fp8_recipe or MEGATRON_FP8_RECIPE_DEFAULT
    if recipe == "custom":
        raise SpecError("--fp8-recipe", "custom (--fp8-quantizer-factory) quantizes as its factory says; Shardwise "
                        "prices tensorwise, delayed, blockwise and mxfp8")
    said = "not given: Megatron's default delayed" if args.fp8_recipe is None else recipe
    if recipe == "delayed":
        warnings.append(f"--fp8-recipe {said} scales each tensor by its amax history; priced as tensorwise, "
                        "whose current scaling reads each tensor once more (its amax) before the cast")
    return "tensorwise" if recipe in ("tensorwise", "delayed") else recipe


def _read_dispatcher(args: argparse.Namespace, model: ModelSpec, ep: int,
                     warnings: list[str]) -> tuple[tuple[str, object], ...]:
    """The runtime's moe_dispatch that --moe-token-dispatcher-type says (megatron-core
    0.16.1 transformer_config.py: "flex" with the DeepEP backend, or --moe-enable-deepep,
    deduplicates tokens by node; "alltoall" sends a copy per routed expert)."""
    if not model.is_moe or ep == 1:
        return ()
    kind = args.moe_token_dispatcher_type
    if kind == "flex" or args.moe_enable_deepep:
        if args.moe_flex_dispatcher_backend == "hybridep":
            warnings.append("--moe-flex-dispatcher-backend hybridep: priced as DeepEP's node-deduplicated dispatch")
        return (("moe_dispatch", "deepep"),)
    if kind != "alltoall":
        said = "absent (Megatron's default allgather)" if kind is None else kind
        warnings.append(f"--moe-token-dispatcher-type {said} gathers every ep rank's tokens to each; priced as "
                        "alltoall, which the export writes")
    return (("moe_dispatch", "all-to-all"),)




def _check_moe_layout(args: argparse.Namespace, model: ModelSpec, whole: bool) -> None:
    """The model's q/k/v biases, shared expert, its gate and its routing weights: each
    changes what Megatron builds or computes, so a command that gives one the model does
    not have, or (a `whole` model description: --hidden-size given) leaves out one it
    has, describes another model."""
    scoring = args.moe_router_score_function
    if (scoring or "softmax") != model.router_scoring and (whole or scoring is not None):
        raise SpecError("--moe-router-score-function", f"{scoring or 'absent (softmax)'}, but {model.name} scores "
                                                       f"its routing by {model.router_scoring}")
    shared = model.shared_expert_intermediate_size or None
    given = args.moe_shared_expert_intermediate_size
    if given != shared and (whole or given is not None):
        raise SpecError("--moe-shared-expert-intermediate-size",
                        f"{given or 'absent'}, but {model.name} has {shared or 'no shared expert'}")
    for flag, given, expected, has, has_not in (
            ("--moe-shared-expert-gate", args.moe_shared_expert_gate, model.shared_expert_gate,
             "a gate on its shared expert", "no gate on a shared expert"),
            ("--moe-router-pre-softmax", args.moe_router_pre_softmax, model.is_moe and not model.norm_topk_prob,
             "routing weights left unnormalised over the top k (norm_topk_prob false)",
             "routing weights renormalised over the top k"),
            ("--add-qkv-bias", args.add_qkv_bias, model.attention_bias and not model.is_gpt,
             "q/k/v biases", "no q/k/v biases")):
        if given != expected and (whole or given):
            raise SpecError(flag, f"{'missing' if expected else 'given'}, but {model.name} has "
                                  f"{has if expected else has_not}")


def _dense_said(dense: tuple[int, ...]) -> str | None:
    """Dense-MLP layers in words (None: none)."""
    if not dense:
        return None
    if dense == tuple(range(len(dense))):
        return f"{len(dense)} dense first layers"
    return f"dense-MLP layers {', '.join(map(str, dense))}"


def _check_deepseek(args: argparse.Namespace, model: ModelSpec, whole: bool) -> None:
    """Multi-head latent attention and its ranks, the dense-MLP layers, group-limited
    routing, its scaling and the multi-token prediction modules (DeepSeek-V3, Llama 4
    Maverick's dense layers): a command
    that gives one the model does not have, or (a `whole` model description) leaves out
    one it has, describes another model. Megatron's q_lora_rank unset is no query latent."""
    pairs = [("--multi-latent-attention", args.multi_latent_attention or None, model.is_mla or None)]
    if model.is_mla or args.multi_latent_attention:
        pairs += [("--q-lora-rank", args.q_lora_rank, model.q_lora_rank or None),
                  ("--kv-lora-rank", args.kv_lora_rank, model.kv_lora_rank),
                  ("--qk-head-dim", args.qk_head_dim, model.qk_nope_head_dim),
                  ("--qk-pos-emb-head-dim", args.qk_pos_emb_head_dim, model.qk_rope_head_dim),
                  ("--v-head-dim", args.v_head_dim, model.v_head_dim)]
    dense = read_moe_layer_freq(args.moe_layer_freq, model.num_hidden_layers)
    expected = model.mlp_only_layers if model.is_moe else ()
    pairs += [("--moe-layer-freq", _dense_said(dense), _dense_said(expected)),
              ("--moe-router-num-groups", args.moe_router_num_groups, model.n_group if model.n_group > 1 else None),
              ("--moe-router-group-topk", args.moe_router_group_topk, model.topk_group if model.n_group > 1 else None),
              ("--moe-router-topk-scaling-factor", args.moe_router_topk_scaling_factor,
               model.routed_scaling_factor if model.routed_scaling_factor != 1.0 else None),
              ("--mtp-num-layers", args.mtp_num_layers, model.num_nextn_predict_layers or None)]
    for flag, given, expected in pairs:
        if given != expected and (whole or given is not None):
            said = "absent" if given is None else "given" if given is True else given
            has = "none" if expected is None else "it" if expected is True else expected
            raise SpecError(flag, f"{said}, but {model.name} has {has}")


def read_megatron(text: str, model: ModelSpec, num_gpus: int) -> Imported:
    """Megatron-LM command-line arguments (a whole pasted command line is fine: words
    that are not arguments Shardwise reads are ignored with a warning)."""
    words = override_tokens(text)
    try:
        args, rest = megatron_parser().parse_known_args(words)
    except _ArgError as err:
        match = re.search(r"argument (--[a-z0-9-]+)", str(err))
        raise SpecError(match.group(1) if match else "megatron", str(err)) from None
    for name in MEGATRON_INT_ARGS:   # Megatron-LM asserts these positive; 0 is not a default here
        value = getattr(args, name.lstrip("-").replace("-", "_"))
        if value is not None and value < (0 if name == "--recompute-num-layers" else 1):
            raise SpecError(name, f"must be at least {0 if name == '--recompute-num-layers' else 1}, got {value}")
    warnings = []
    unknown = [w for w in rest if w.startswith("--")]
    if unknown:
        warnings.append(f"ignored (not an argument Shardwise reads): {' '.join(unknown)}")
    kv = model.num_key_value_heads if model.num_key_value_heads != model.num_attention_heads else None
    check_model([("--num-layers", args.num_layers, model.num_hidden_layers),
                  ("--hidden-size", args.hidden_size, model.hidden_size),
                  ("--ffn-hidden-size", args.ffn_hidden_size, (model.dense_intermediate_size or model.intermediate_size)
                   if model.dense_upto else model.intermediate_size),
                  ("--moe-ffn-hidden-size", args.moe_ffn_hidden_size,
                   model.intermediate_size if model.is_moe else None),
                  ("--num-attention-heads", args.num_attention_heads, model.num_attention_heads),
                  ("--num-query-groups", args.num_query_groups if args.group_query_attention else None,
                   model.num_key_value_heads),
                  ("--kv-channels", args.kv_channels, None if model.is_mla else model.head_dim),
                  ("--num-experts", args.num_experts, model.num_local_experts if model.is_moe else None),
                  ("--moe-router-topk", args.moe_router_topk, model.num_experts_per_tok if model.is_moe else None)],
                 model)
    if model.is_moe:
        _check_capacity(args, model, warnings)
    if kv is not None and not args.group_query_attention and args.num_attention_heads is not None:
        raise SpecError("--group-query-attention", f"missing: {model.name} has {kv} KV heads")
    # Megatron-LM's kv_channels defaults to hidden / heads, and q/k are not normalised unless asked.
    if args.kv_channels is None and args.hidden_size is not None and not model.is_mla and \
            model.head_dim != model.hidden_size // model.num_attention_heads:
        raise SpecError("--kv-channels", f"missing: {model.name} has head_dim {model.head_dim}, not "
                                         f"hidden / heads = {model.hidden_size // model.num_attention_heads}")
    if model.qk_norm and not args.qk_layernorm and args.hidden_size is not None:
        raise SpecError("--qk-layernorm", f"missing: {model.name} normalises q and k per head")
    _check_moe_layout(args, model, whole=args.hidden_size is not None)
    _check_deepseek(args, model, whole=args.hidden_size is not None)
    tp = args.tensor_model_parallel_size or 1
    pp = args.pipeline_model_parallel_size or 1
    cp = args.context_parallel_size or 1
    ep = args.expert_model_parallel_size or 1
    if cp > 1:
        _check_cp_comm_type(args.cp_comm_type, model.num_hidden_layers, warnings)
    etp = args.expert_tensor_parallel_size
    if etp not in (None, 1, tp):
        warnings.append(f"--expert-tensor-parallel-size {etp}: priced with the experts split over tp {tp} as "
                        f"Megatron's default (Shardwise prices experts split over tp or kept whole)")
        etp = None
    # Megatron's data-parallel size is what tp x pp x cp leave (parallel_state.py); the
    # distributed optimizer and Megatron FSDP shard over dp x cp (the data-parallel group
    # with context parallelism), Shardwise's ZeRO group.
    dp = divide(num_gpus, tp * pp * cp, "--tensor-model-parallel-size",
                 f"tp {tp} x pp {pp}" + (f" x cp {cp}" if cp > 1 else "") + f" must divide the cluster's {num_gpus} GPUs")
    mbs = args.micro_batch_size or 1
    global_batch = args.global_batch_size or mbs * dp   # arguments.py: defaults to micro x dp
    microbatches = divide(global_batch, mbs * dp, "--global-batch-size", f"micro-batch {mbs} x dp {dp}")

    layers = model.num_hidden_layers
    vpp = 1
    if args.num_layers_per_virtual_pipeline_stage:
        per_chunk = args.num_layers_per_virtual_pipeline_stage
        if layers % (pp * per_chunk):
            raise SpecError("--num-layers-per-virtual-pipeline-stage",
                            f"{per_chunk} layers per virtual stage do not divide {layers} layers over pp {pp}")
        vpp = layers // (pp * per_chunk)
    elif args.num_virtual_stages_per_pipeline_rank:
        vpp = args.num_virtual_stages_per_pipeline_rank
    if args.pipeline_model_parallel_layout:
        sizes = megatron_layout_sizes(args.pipeline_model_parallel_layout)
        if len(sizes) % pp or sum(sizes) != layers:
            raise SpecError("--pipeline-model-parallel-layout", f"{len(sizes)} stages of {sum(sizes)} layers for "
                            f"pp {pp} and {layers} layers")
        vpp = len(sizes) // pp
    else:
        sizes = megatron_split(layers, pp, vpp, args.decoder_first_pipeline_num_layers,
                               args.decoder_last_pipeline_num_layers, args.account_for_embedding_in_pipeline_split,
                               args.account_for_loss_in_pipeline_split)
        if sizes is None:
            field_name = ("--decoder-first-pipeline-num-layers" if args.decoder_first_pipeline_num_layers is not None
                          or args.decoder_last_pipeline_num_layers is not None else "--pipeline-model-parallel-size")
            raise SpecError(field_name, f"Megatron cannot split {layers} layers evenly over pp {pp} x vpp {vpp}")
    # Megatron-core pipeline_parallel/schedules.py: forward_backward_pipelining_without_interleaving
    # (1F1B) or _with_interleaving (virtual stages); no GPipe.
    schedule = "interleaved" if vpp > 1 else "1f1b"

    if args.use_torch_fsdp2:
        zero = 3
    elif args.use_megatron_fsdp:
        strategy_name = args.data_parallel_sharding_strategy or "no_shard"
        zero = ("no_shard", "optim", "optim_grads", "optim_grads_params").index(strategy_name)
    else:
        zero = 1 if args.use_distributed_optimizer else 0
    if dp * cp == 1:
        zero = 0

    recompute = Recompute()
    if args.recompute_granularity == "selective":
        recompute = Recompute("selective")
        if args.recompute_modules not in (None, ["core_attn"]):
            warnings.append(f"--recompute-modules {' '.join(args.recompute_modules)}: priced as the attention core only")
    elif args.recompute_granularity == "full":
        if args.recompute_method is None or args.recompute_num_layers is None:
            # TransformerConfig.__post_init__ refuses full recompute without both.
            raise SpecError("--recompute-method", "full recompute needs --recompute-method and --recompute-num-layers")
        if args.recompute_method == "uniform":
            recompute = Recompute("full")
            if args.recompute_num_layers > 1:
                warnings.append(f"--recompute-method uniform --recompute-num-layers {args.recompute_num_layers} "
                                "checkpoints groups of layers; priced as every layer recomputed on its own")
        else:
            recompute = Recompute("full", args.recompute_num_layers)
    if args.bf16 and args.fp16:
        raise SpecError("--bf16", "both --bf16 and --fp16 given")
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    if precision == "fp32":
        # Megatron-LM's default (megatron/training/arguments.py: --bf16 and --fp16 are
        # store_true); a pasted excerpt often leaves them out.
        warnings.append("neither --bf16 nor --fp16: Megatron-LM trains in fp32, priced as fp32")
    fp8 = _read_fp8(args, precision, model, warnings)
    settings = _read_dispatcher(args, model, ep, warnings)
    if fp8 is not None and model.is_moe:
        # Megatron-LM runs the experts' GEMMs (routed and shared) in FP8 too, through
        # Transformer Engine's grouped linear layers (megatron-core TEGroupedMLP).
        settings += (("fp8_experts", True),)
    strategy = engine_strategy(dp, tp, pp, mbs, microbatches, vpp, ep, schedule, zero, tp > 1 and args.sequence_parallel,
                         build_stages(sizes, pp, recompute), cp, etp if model.is_moe else None)
    return Imported(strategy, global_batch, args.seq_length, precision, tuple(warnings), settings, fp8=fp8)


def _check_cp_comm_type(given: list[str] | None, layers: int, warnings: list[str]) -> None:
    """--cp-comm-type against what Shardwise prices, K and V all-gathered: one type for
    every layer or one per layer (TransformerConfig.__post_init__ asserts the count)."""
    types = given or [MEGATRON_CP_COMM_DEFAULT]
    unknown = [t for t in types if t not in MEGATRON_CP_COMM_TYPES]
    if unknown:
        raise SpecError("--cp-comm-type", f"{unknown[0]!r} (known: {', '.join(MEGATRON_CP_COMM_TYPES)})")
    if len(types) > 1 and len(types) != layers:
        raise SpecError("--cp-comm-type", f"{len(types)} types, one for all layers or one per layer ({layers})")
    others = sorted(set(types) - {"all_gather"})
    if others:
        said = "not given: Megatron-LM's default p2p" if not given else " ".join(others)
        warnings.append(f"--cp-comm-type {said} exchanges K and V otherwise than all_gather (p2p: chunks around a "
                        "ring, a2a: heads scattered as in Ulysses); priced as all-gather")


def _megatron_partition(strategy: Strategy, layers: int) -> list[str]:
    """The shortest arguments that make Megatron place the plan's stages: even, first/last
    pipeline rank uneven, embedding/loss counted as layers, else the explicit layout."""
    s = strategy
    sizes = [st.num_layers for st in s.stages]
    if s.pp == 1:
        return []
    vpp_args = ["--num-virtual-stages-per-pipeline-rank", str(s.vpp)] if s.vpp > 1 else []
    if megatron_split(layers, s.pp, s.vpp) == sizes:
        return ["--num-layers-per-virtual-pipeline-stage", str(sizes[0])] if s.vpp > 1 else []
    first = sum(n for i, n in enumerate(sizes) if i % s.pp == 0)
    last = sum(n for i, n in enumerate(sizes) if i % s.pp == s.pp - 1)
    for f, l in ((first, None), (None, last), (first, last)):
        if megatron_split(layers, s.pp, s.vpp, f, l) == sizes:
            out = [] if f is None else ["--decoder-first-pipeline-num-layers", str(f)]
            return out + ([] if l is None else ["--decoder-last-pipeline-num-layers", str(l)]) + vpp_args
    for embedding, loss in ((True, False), (False, True), (True, True)):
        if megatron_split(layers, s.pp, s.vpp, None, None, embedding, loss) == sizes:
            return (["--account-for-embedding-in-pipeline-split"] * embedding
                    + ["--account-for-loss-in-pipeline-split"] * loss + vpp_args)
    # TransformerConfig.pipeline_model_parallel_layout: stages split by '|', virtual stage
    # i = chunk * pp + pp rank, E the embedding, t a decoder layer, L the loss.
    stages = []
    for i, n in enumerate(sizes):
        body = "t" if n == 1 else f"t*{n}" if n else ""
        stages.append(("E" if i == 0 else "") + body + ("L" if i == len(sizes) - 1 else ""))
    return ["--pipeline-model-parallel-layout", '"' + "|".join(stages) + '"']



def export_megatron(strategy: Strategy, model: ModelSpec, training: TrainingSpec,
                    runtime: RuntimeSpec | None = None) -> Exported:
    """Megatron-LM arguments for `pretrain_gpt.py` (names: the MEGATRON_* constants above);
    `runtime`: the plan's, whose moe_dispatch names the token dispatcher."""
    s, warnings = strategy, []
    args = ["--tensor-model-parallel-size", str(s.tp), "--pipeline-model-parallel-size", str(s.pp)]
    if s.schedule == "gpipe" and s.pp > 1:
        warnings.append("Megatron-LM has no GPipe schedule (megatron/core/pipeline_parallel/schedules.py: "
                        "1F1B without or with interleaving); exported as 1F1B")
    if s.schedule in ZERO_BUBBLE_SCHEDULES and s.pp > 1:
        warnings.append(f"Megatron-LM has no zero-bubble schedule (megatron/core/pipeline_parallel/schedules.py: "
                        f"1F1B without or with interleaving); the plan's {s.schedule} exported as "
                        + ("interleaved 1F1B with its stages placed round-robin" if s.vpp > 1 else "1F1B"))
    args += _megatron_partition(s, model.num_hidden_layers)
    args += ["--micro-batch-size", str(s.micro_batch_size), "--global-batch-size", str(training.global_batch)]
    if s.sequence_parallel:
        args.append("--sequence-parallel")
    form = recompute_form(s)
    if form is None:
        if any(st.selective_recompute_layers for st in s.stages) and any(st.full_recompute_layers for st in s.stages):
            warnings.append("Megatron-LM has one --recompute-granularity for all layers; the plan mixes selective "
                            f"and full recompute ({per_stage(s)}): exported as full")
            form = Recompute("full")
        else:
            most = max(st.full_recompute_layers for st in s.stages)
            warnings.append("Megatron-LM recomputes the same number of layers in each virtual stage "
                            "(--recompute-method block --recompute-num-layers); the plan's differ by stage "
                            f"({per_stage(s)}): exported as the most, {most} per stage")
            form = Recompute("full", most)
    if form.mode == "selective":
        args += ["--recompute-granularity", "selective"]
    elif form.mode == "full":
        args += ["--recompute-granularity", "full"]
        args += (["--recompute-method", "uniform", "--recompute-num-layers", "1"] if form.full_layers is None
                 else ["--recompute-method", "block", "--recompute-num-layers", str(form.full_layers)])
    # ZeRO-1 is the distributed optimizer; ZeRO-2/3 shard gradients and weights only under
    # Megatron FSDP (DistributedDataParallelConfig.data_parallel_sharding_strategy).
    if s.zero_stage == 1:
        args.append("--use-distributed-optimizer")
    elif s.zero_stage >= 2:
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                 "optim_grads" if s.zero_stage == 2 else "optim_grads_params"]
    args += ["--context-parallel-size", str(s.cp)]
    if s.cp > 1:
        # Megatron-LM's default is p2p (a ring); all_gather is the exchange the plan priced.
        args += ["--cp-comm-type", "all_gather"]
    args += ["--expert-model-parallel-size", str(s.ep)]
    if model.is_moe and s.tp > 1:
        # Megatron's default is tp; 1 keeps the experts whole (MoE parallel folding).
        args += ["--expert-tensor-parallel-size", str(s.expert_tp)]
    ffn = (model.dense_intermediate_size or model.intermediate_size) if model.dense_upto else model.intermediate_size
    args += ["--num-layers", str(model.num_hidden_layers), "--hidden-size", str(model.hidden_size),
             "--ffn-hidden-size", str(ffn), "--num-attention-heads", str(model.num_attention_heads)]
    if model.num_key_value_heads != model.num_attention_heads:
        args += ["--group-query-attention", "--num-query-groups", str(model.num_key_value_heads)]
    if model.is_mla:
        args.append("--multi-latent-attention")
        if model.q_lora_rank:
            args += ["--q-lora-rank", str(model.q_lora_rank)]
        args += ["--kv-lora-rank", str(model.kv_lora_rank), "--qk-head-dim", str(model.qk_nope_head_dim),
                 "--qk-pos-emb-head-dim", str(model.qk_rope_head_dim), "--v-head-dim", str(model.v_head_dim)]
    elif model.head_dim != model.hidden_size // model.num_attention_heads:
        args += ["--kv-channels", str(model.head_dim)]
    if model.qk_norm:
        args.append("--qk-layernorm")
    if model.is_moe:
        args += ["--num-experts", str(model.num_local_experts), "--moe-router-topk", str(model.num_experts_per_tok)]
        if s.ep > 1:
            args += (["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"]
                     if runtime is not None and runtime.moe_dispatch == "deepep"
                     else ["--moe-token-dispatcher-type", "alltoall"])
        if model.moe_capacity_factor is not None:
            args += ["--moe-expert-capacity-factor", f"{model.moe_capacity_factor:g}",
                     "--moe-token-drop-policy", "position"]
        if model.has_shared_expert:
            args += ["--moe-shared-expert-intermediate-size", str(model.shared_expert_intermediate_size)]
        if model.shared_expert_gate:
            args.append("--moe-shared-expert-gate")
        if not model.norm_topk_prob:
            args.append("--moe-router-pre-softmax")
        if model.router_scoring != "softmax":
            args += ["--moe-router-score-function", model.router_scoring]
        if model.dense_upto:
            args += ["--moe-ffn-hidden-size", str(model.intermediate_size), "--moe-layer-freq", f'"{moe_layer_pattern(model)}"']
        if model.n_group > 1:
            args += ["--moe-router-num-groups", str(model.n_group), "--moe-router-group-topk", str(model.topk_group)]
        if model.routed_scaling_factor != 1.0:
            args += ["--moe-router-topk-scaling-factor", f"{model.routed_scaling_factor:g}"]
    if model.num_nextn_predict_layers:
        args += ["--mtp-num-layers", str(model.num_nextn_predict_layers)]
    if model.attention_bias and not model.is_gpt:
        args.append("--add-qkv-bias")
    if not model.is_gpt:
        args += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope"]
        if not (model.attention_out_bias and model.mlp_bias):
            args.append("--disable-bias-linear")   # Megatron's linear layers carry biases unless told
        if model.attention_out_bias != model.mlp_bias:
            warnings.append(f"Megatron-LM's --disable-bias-linear covers every linear layer: the model has biases on "
                            f"its {'attention output' if model.attention_out_bias else 'MLP'} only, exported without")
    if model.chunked_attention:
        warnings.append(f"Megatron-LM has no chunked attention (Llama 4's, {model.windowed_layers} of "
                        f"{model.num_hidden_layers} layers in chunks of {model.attention_window})")
    if model.router_scoring == "sigmoid" and model.n_group == 1:
        # Llama 4's; DeepSeek-V3's group-limited sigmoid routing scales the outputs, as Megatron does.
        warnings.append("Megatron-LM scales the experts' outputs by the router's sigmoid, where Llama 4 scales their "
                        "inputs (the same FLOPs and traffic)")
    gpt_oss = [name for name, on in (("attention window", model.windowed_layers and not model.chunked_attention),
                                     ("attention sinks", model.attention_sinks),
                                     ("router bias", model.router_bias),
                                     ("clamped SwiGLU", model.swiglu_limit is not None)) if on]
    if gpt_oss:
        warnings.append(f"the model's {', '.join(gpt_oss)} (gpt-oss) are not Megatron-LM arguments here: set them in "
                        "its TransformerConfig (window_size and window_attn_skip_freq, softmax_type 'learnable', "
                        "activation_func_clamp_value and glu_linear_offset; megatron-core 0.16.1), as its gpt-oss "
                        "recipe does")
    if not model.tie_word_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    args += ["--seq-length", str(training.seq_len), "--max-position-embeddings", str(model.max_position_embeddings)]
    if training.precision in ("bf16", "fp16"):
        args.append(f"--{training.precision}")
    if training.fp8 is not None:
        recipe = MEGATRON_FP8_RECIPES[training.fp8]
        args += ["--fp8-format", "hybrid", "--fp8-recipe", recipe]
        if recipe != training.fp8:
            warnings.append(f"Megatron-LM has no {training.fp8} FP8 scaling (--fp8-recipe: tensorwise, delayed, mxfp8, "
                            f"blockwise, custom; megatron-core enums.py Fp8Recipe): exported as its nearest, {recipe} "
                            "(1x128 tiles, 128x128 weight blocks), which the plan prices as rowwise")
        if training.fp8 == "tensorwise" and s.zero_stage == 3:
            warnings.append("the plan prices ZeRO-3's weight all-gathers of the FP8 layers in fp8 (1 byte a weight, "
                            "as FSDP2's float8 all-gather); Megatron FSDP gathers them so only with fp8 parameters "
                            "(TransformerConfig.fp8_param), which the export does not set: it gathers bf16")
    lines, line = [], []
    for word in args:   # one argument (with its value) per line
        if word.startswith("--") and line:
            lines.append(" ".join(line))
            line = []
        line.append(word)
    lines.append(" ".join(line))
    return Exported(" \\\n".join(lines) + "\n", tuple(warnings))
