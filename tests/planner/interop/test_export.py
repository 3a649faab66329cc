"""Exports and evaluation: plan -> export -> import gives back the same strategy and
estimate for each target where the target can say it, and a warning where it cannot;
the files parse (tomllib, json); torchtitan's overrides name only its config fields;
Megatron's arguments parse with an argparse mirror of Megatron-LM's names; `shardwise
evaluate` prints the figures estimate() computes; bad input exits 2 with one line."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import replace

import pytest
import tomllib
from click.testing import CliRunner

from costmodel.estimate import estimate
from costmodel.specs.loading import SpecError, load_model, load_runtime
from costmodel.specs.training import precision_name
from costmodel.strategy import Strategy, even_stages, summarize_recompute
from costmodel.units import GIB
from planner.api import make_problem, plan
from planner.console.cli import main
from planner.interop.common import Recompute, build_stages, strategy_changes
from planner.interop.evaluate import evaluate_config
from planner.interop.export import TARGETS, export_plan, export_strategy
from planner.interop.importers import read_text
from planner.interop.torchtitan import torchtitan_split
from planner.plan_file import model_of, strategy_of, training_of, write_plan
from planner.rules import load_rules, parse_fix
from planner.search import search

# Plans made by the search with every knob pinned (each solves in well under a second).
CASES = {
    "zero1-sp-full-pp": dict(model="llama2-7b", gpus=16, batch=64, seq=4096,
                             fix="dp=2,tp=4,pp=2,mbs=1,zero=1,recompute=full,sp=on,schedule=1f1b"),
    "interleaved-uneven": dict(model="gpt3-1.3b", gpus=16, batch=64, seq=2048,
                               fix="dp=2,tp=2,pp=4,vpp=3,mbs=2,zero=0,recompute=none,sp=off,schedule=interleaved"),
    # mbs 1: at mbs 2 PyTorch's 16-bit activations (fp32 residual stream under autocast)
    # need 85 GiB on an A100-80GB (costmodel.terms.memory.pytorch_layer_activation_bytes).
    "zero3-selective": dict(model="llama2-7b", gpus=8, batch=64, seq=4096,
                            fix="dp=8,tp=1,pp=1,mbs=1,zero=3,recompute=selective"),
    "zero2-tp-no-sp": dict(model="llama2-7b", gpus=8, batch=64, seq=4096,
                           fix="dp=4,tp=2,pp=1,mbs=1,zero=2,recompute=none,sp=off"),
    "moe-ep-zero3-pp": dict(model="tiny-moe", gpus=8, batch=32, seq=64,
                            fix="dp=4,tp=1,pp=2,ep=2,mbs=1,zero=3,recompute=none,schedule=1f1b"),
    "zero2-full": dict(model="llama2-7b", gpus=8, batch=64, seq=4096, fix="dp=8,tp=1,pp=1,mbs=1,zero=2,recompute=full"),
    # Qwen3-MoE: head_dim 128 with hidden 2048 / 32 heads (--kv-channels), q/k norm (--qk-layernorm).
    "qwen3-moe-ep": dict(model="qwen3-30b-a3b", gpus=16, batch=64, seq=4096,
                         fix="dp=16,tp=1,pp=1,ep=16,mbs=1,zero=1,recompute=full"),
    # Zero-bubble schedules: torchtitan names them (ZBVZeroBubble, InterleavedZeroBubble);
    # Megatron-LM and DeepSpeed run 1F1B-family pipelines only and warn.
    "zbv-zero2": dict(model="llama2-7b", gpus=16, batch=64, seq=4096,
                      fix="dp=2,tp=2,pp=4,vpp=2,mbs=1,zero=2,recompute=full,sp=on,schedule=zbv"),
    "zb-interleaved": dict(model="llama2-7b", gpus=16, batch=64, seq=4096,
                           fix="dp=2,tp=2,pp=4,vpp=2,mbs=1,zero=2,recompute=full,sp=on,schedule=zb-interleaved"),
    "dualpipev": dict(model="llama2-7b", gpus=16, batch=64, seq=4096,
                      fix="dp=2,tp=2,pp=4,vpp=2,mbs=1,zero=2,recompute=full,sp=on,schedule=dualpipev"),
    # Fine-grained experts with a gated shared expert and unnormalised routing (Qwen2-MoE):
    # Megatron's --moe-shared-expert-intermediate-size, --moe-shared-expert-gate and
    # --moe-router-pre-softmax.
    "moe-shared-ep": dict(model="tiny-moe-shared", gpus=8, batch=32, seq=64,
                          fix="dp=8,tp=1,pp=1,ep=4,mbs=1,zero=2,recompute=none"),
    # DeepSeek-V3's shape: multi-head latent attention, dense first layers, group-limited
    # sigmoid routing scaled by 2.5 and an MTP module (Megatron-LM's --multi-latent-attention
    # and its ranks, --moe-layer-freq, --moe-router-num-groups / -group-topk,
    # --moe-router-topk-scaling-factor, --mtp-num-layers).
    "deepseek-ep-pp": dict(model="tiny-deepseek", gpus=8, batch=32, seq=64,
                           fix="dp=4,tp=1,pp=2,ep=4,mbs=1,zero=1,recompute=none,schedule=1f1b"),
    "moe-capacity-ep": dict(model="tiny-moe", gpus=8, batch=32, seq=64, overrides={"moe_capacity_factor": "1.25"},
                            fix="dp=8,tp=1,pp=1,ep=4,mbs=1,zero=3,recompute=none"),
    # Context parallelism (K/V all-gathered): torchtitan's context_parallel_degree with FSDP2
    # over shard x cp, Megatron's --context-parallel-size with --cp-comm-type all_gather;
    # DeepSpeed refuses it.
    "cp2-zero1-sp": dict(model="llama2-7b", gpus=8, batch=64, seq=4096,
                         fix="dp=2,cp=2,tp=2,pp=1,mbs=1,zero=1,recompute=full,sp=on"),
    "cp2-zero3-pp": dict(model="llama2-7b", gpus=16, batch=64, seq=4096,
                         fix="dp=2,cp=2,tp=2,pp=2,mbs=1,zero=3,recompute=full,sp=on,schedule=1f1b"),
}
# (case, target) pairs the target expresses exactly; every other pair must warn.
EXACT = {
    ("deepseek-ep-pp", "megatron"),
    ("zero1-sp-full-pp", "megatron"),
    ("interleaved-uneven", "megatron"),
    ("zero3-selective", "torchtitan"), ("zero3-selective", "torchtitan-toml"), ("zero3-selective", "megatron"),
    ("zero2-tp-no-sp", "torchtitan"), ("zero2-tp-no-sp", "megatron"), ("zero2-tp-no-sp", "deepspeed"),
    ("moe-ep-zero3-pp", "torchtitan"), ("moe-ep-zero3-pp", "torchtitan-toml"), ("moe-ep-zero3-pp", "megatron"),
    ("zero2-full", "torchtitan"), ("zero2-full", "torchtitan-toml"), ("zero2-full", "megatron"),
    ("zero2-full", "deepspeed"),
    ("moe-capacity-ep", "megatron"),   # torchtitan routes dropless; DeepSpeed sets experts in code
    ("qwen3-moe-ep", "megatron"),
    ("moe-shared-ep", "torchtitan"), ("moe-shared-ep", "torchtitan-toml"), ("moe-shared-ep", "megatron"),
    ("zbv-zero2", "torchtitan"), ("zbv-zero2", "torchtitan-toml"),
    ("zb-interleaved", "torchtitan"), ("zb-interleaved", "torchtitan-toml"),
    ("dualpipev", "torchtitan"), ("dualpipev", "torchtitan-toml"),
    ("cp2-zero1-sp", "megatron"),   # torchtitan has no ZeRO-1
    ("cp2-zero3-pp", "torchtitan"), ("cp2-zero3-pp", "torchtitan-toml"), ("cp2-zero3-pp", "megatron"),
}


def _problem(case):
    c = CASES[case]
    return make_problem(c["model"], "dgx-a100-80gb", c["batch"], gpus=c["gpus"], seq_len=c["seq"],
                        overrides=c.get("overrides"))


_DOCS: dict = {}


def _doc(case):
    if case not in _DOCS:
        c = CASES[case]
        _DOCS[case] = plan(c["model"], "dgx-a100-80gb", c["batch"], gpus=c["gpus"], seq_len=c["seq"], fix=c["fix"],
                           overrides=c.get("overrides"), top=1)
    return _DOCS[case]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("target", TARGETS)
def test_round_trip_gives_the_same_strategy_and_estimate(case, target):
    doc = _doc(case)
    strategy, model = strategy_of(doc), model_of(doc)
    if target == "deepspeed" and strategy.cp > 1:
        with pytest.raises(SpecError, match="DeepSpeed has no context parallelism") as err:
            export_plan(doc, target)
        assert err.value.field == "plan.strategy.cp"
        return
    exported = export_plan(doc, target)
    if (case, target) not in EXACT:
        assert exported.warnings, f"{target} cannot express {case} but said nothing"
        return
    back = read_text(target, exported.text, model, strategy.num_gpus)
    assert back.strategy == strategy
    assert back.global_batch == doc["training"]["global_batch"]
    assert back.seq_len in (None, doc["training"]["seq_len"])
    assert back.precision in (None, doc["training"]["precision"])
    problem = _problem(case)
    assert estimate(problem, back.strategy) == estimate(problem, strategy)
    assert estimate(problem, back.strategy).step_time_s == pytest.approx(doc["estimate"]["step_time_s"], rel=1e-5)


def test_every_inexpressible_pair_names_what_the_engine_will_run():
    """The read-back check: a pair that is not exact says what the engine runs instead."""
    exported = export_plan(_doc("zero1-sp-full-pp"), "torchtitan")
    assert any("will run this configuration with zero 1→2" in w for w in exported.warnings)


def _strategy(pp, vpp, sizes, recompute=Recompute(), dp=2, tp=2, mbs=1, m=8, zero=0, sp=False, schedule=None):
    schedule = schedule or ("interleaved" if vpp > 1 else "1f1b")
    stages = build_stages(sizes, pp, recompute)
    return Strategy(dp, tp, pp, mbs, m, vpp=vpp, schedule=schedule, zero_stage=zero, sequence_parallel=sp,
                    recompute=summarize_recompute(stages), stages=stages)


LLAMA = load_model("llama2-7b")


def _problem_for(strategy):
    """llama2-7b on the strategy's GPUs with the batch its micro-batching makes."""
    batch = strategy.dp * strategy.micro_batch_size * strategy.num_microbatches
    return make_problem("llama2-7b", "dgx-a100-80gb", batch, gpus=strategy.num_gpus, seq_len=4096)


@pytest.mark.parametrize("sizes, pp, vpp, expect", [
    ([8, 8, 8, 8], 4, 1, None),
    ([9, 8, 8, 7], 4, 1, "--decoder-first-pipeline-num-layers 9"),
    ([7, 9, 9, 7], 4, 1, "--decoder-last-pipeline-num-layers 7"),
    ([9, 7, 8, 8], 4, 1, '--pipeline-model-parallel-layout "Et*9|t*7|t*8|t*8L"'),
    ([4, 4, 4, 4, 4, 4, 4, 4], 2, 4, "--num-layers-per-virtual-pipeline-stage 4"),
    ([5, 4, 4, 4, 4, 4, 4, 3], 2, 4, "--pipeline-model-parallel-layout"),
])
def test_megatron_partitions_round_trip(sizes, pp, vpp, expect):
    strategy = _strategy(pp, vpp, sizes, Recompute("full", 2))
    problem = _problem_for(strategy)
    exported = export_strategy("megatron", strategy, LLAMA, problem.training)
    assert exported.warnings == ()
    if expect:
        assert expect in exported.text
    back = read_text("megatron", exported.text, LLAMA, strategy.num_gpus)
    assert back.strategy == strategy
    assert "--recompute-method block" in exported.text and "--recompute-num-layers 2" in exported.text


@pytest.mark.parametrize("sizes, pp, vpp", [
    ([8, 9, 8, 7], 4, 1),               # torchtitan's default split (first/last stage one layer less)
    ([8, 8, 8, 8], 2, 2),               # Interleaved1F1B, two stages per rank (its default)
    ([4, 4, 4, 4, 4, 4, 4, 4], 2, 4),   # four stages per rank: pipeline_parallel_layers_per_stage 4
])
def test_torchtitan_partitions_round_trip(sizes, pp, vpp):
    strategy = _strategy(pp, vpp, sizes, Recompute("full"), zero=3, sp=True)
    problem = _problem_for(strategy)
    for target in ("torchtitan", "torchtitan-toml"):
        exported = export_strategy(target, strategy, LLAMA, problem.training)
        assert exported.warnings == ()
        assert read_text(target, exported.text, LLAMA, strategy.num_gpus).strategy == strategy


def test_torchtitan_default_split_is_torchtitans():
    # torchtitan 0.3.0 _generate_llm_fqn_per_model_part(4, 32, 1, 1): 34 effective layers,
    # stages of 9, 9, 8, 8 less the embedding and the output.
    assert torchtitan_split(32, 4, 1, 1) == [8, 9, 8, 7]
    back = read_text("torchtitan", "--parallelism.pipeline_parallel_degree 4 --training.local_batch_size 4 "
                     "activation-checkpoint:none", LLAMA, 8)
    assert [s.num_layers for s in back.strategy.stages] == [8, 9, 8, 7]
    assert (back.strategy.dp, back.strategy.zero_stage, back.strategy.num_microbatches) == (2, 2, 4)


def test_toml_and_json_parse():
    doc = _doc("zero1-sp-full-pp")
    toml = tomllib.loads(export_plan(doc, "torchtitan-toml").text)
    assert toml["parallelism"]["tensor_parallel_degree"] == 4
    assert toml["parallelism"]["pipeline_parallel_degree"] == 2
    assert toml["training"]["global_batch_size"] == 64 and toml["training"]["seq_len"] == 4096
    assert toml["activation_checkpoint"]["mode"] == "full"
    ds = json.loads(export_plan(_doc("zero2-full"), "deepspeed").text)
    assert ds["zero_optimization"] == {"stage": 2}
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (64, 1, 8)
    assert ds["bf16"] == {"enabled": True}


# torchtitan 0.3.0 (pip download torchtitan==0.3.0), torchtitan/config/configs.py: the
# fields of ParallelismConfig and TrainingConfig, copied from the installed source (the
# exported overrides were also parsed there with tyro against those classes).
PARALLELISM_CONFIG_FIELDS = {
    "data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
    "enable_fsdp_symm_mem", "tensor_parallel_degree", "enable_sequence_parallel", "spmd_backend",
    "pipeline_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
    "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size", "context_parallel_degree",
    "context_parallel_load_balancer", "context_parallel_ptrr_mask_key", "expert_parallel_degree",
}
TRAINING_CONFIG_FIELDS = {
    "local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps", "enable_cpu_offload",
    "disable_cuda_graphs", "dtype", "mixed_precision_param", "mixed_precision_reduce", "gc_freq", "gc_debug",
}
# torchtitan 0.3.0 distributed/activation_checkpoint.py: the tyro subcommands of
# Trainer.Config.activation_checkpoint.
AC_SUBCOMMANDS = {"activation-checkpoint:selective", "activation-checkpoint:full", "activation-checkpoint:none"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_torchtitan_overrides_use_only_config_fields(case):
    words = shlex.split(export_plan(_doc(case), "torchtitan").text.replace("\\\n", " "))
    flags = [w for w in words if w.startswith("--")]
    assert flags
    for flag in flags:
        section, key = flag[2:].split(".", 1)
        key = key.removeprefix("no-")
        assert (section, key in (PARALLELISM_CONFIG_FIELDS if section == "parallelism" else TRAINING_CONFIG_FIELDS)) \
            in (("parallelism", True), ("training", True)), flag
    others = [w for i, w in enumerate(words) if not w.startswith("--") and not (
        i and words[i - 1].startswith("--") and not words[i - 1].startswith(("--parallelism.enable", "--parallelism.no-")))]
    assert others == [others[-1]] and others[-1] in AC_SUBCOMMANDS and words[-1] == others[-1]


def megatron_mirror() -> argparse.ArgumentParser:
    """Megatron-LM's names as megatron/training/arguments.py defines them (types and
    choices); strict: an argument Megatron-LM does not have is an error."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for name in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                 "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--micro-batch-size",
                 "--global-batch-size", "--recompute-num-layers", "--context-parallel-size",
                 "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--num-layers", "--hidden-size", "--ffn-hidden-size",
                 "--num-attention-heads", "--num-query-groups", "--kv-channels", "--seq-length",
                 "--max-position-embeddings", "--num-experts", "--moe-router-topk",
                 "--moe-shared-expert-intermediate-size", "--moe-ffn-hidden-size", "--q-lora-rank", "--kv-lora-rank",
                 "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--moe-router-num-groups",
                 "--moe-router-group-topk", "--mtp-num-layers"):
        parser.add_argument(name, type=int)
    # arguments.py: moe_freq_type, an int or a Python list expression such as "([0]*3+[1]*58)".
    parser.add_argument("--moe-layer-freq", type=str)
    parser.add_argument("--moe-router-topk-scaling-factor", type=float)
    parser.add_argument("--recompute-granularity", choices=["full", "selective"])
    parser.add_argument("--recompute-method", choices=["uniform", "block"])
    parser.add_argument("--data-parallel-sharding-strategy", choices=["no_shard", "optim", "optim_grads",
                                                                      "optim_grads_params"])
    parser.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"])
    parser.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"])
    parser.add_argument("--pipeline-model-parallel-layout", type=str)
    parser.add_argument("--moe-expert-capacity-factor", type=float)
    parser.add_argument("--moe-token-drop-policy", choices=["probs", "position"])
    # arguments.py: nargs="+", a type for all layers or one per layer; the values are
    # megatron-core 0.16.1 TransformerConfig.cp_comm_type's (what Transformer Engine takes).
    parser.add_argument("--cp-comm-type", nargs="+", choices=["p2p", "all_gather", "a2a", "a2a+p2p"])
    # megatron-core 0.16.1 transformer_config.py: TransformerConfig.fp8 (argparse name
    # --fp8-format) and fp8_recipe; Megatron-LM's arguments of those names take these choices.
    parser.add_argument("--fp8-format", choices=["e4m3", "hybrid"])
    parser.add_argument("--fp8-recipe", choices=["tensorwise", "delayed", "mxfp8", "blockwise", "custom"])
    # megatron-core 0.16.1 TransformerConfig.moe_router_score_function
    parser.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"])
    # megatron-core 0.16.1 TransformerConfig.moe_token_dispatcher_type and moe_flex_dispatcher_backend
    parser.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"])
    parser.add_argument("--moe-flex-dispatcher-backend", choices=["deepep", "hybridep"])
    for flag in ("--sequence-parallel", "--use-distributed-optimizer", "--use-megatron-fsdp", "--group-query-attention",
                 "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split", "--bf16", "--fp16",
                 "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                 "--moe-pad-expert-input-to-capacity", "--qk-layernorm", "--add-qkv-bias", "--moe-shared-expert-gate",
                 "--moe-router-pre-softmax", "--multi-latent-attention"):
        parser.add_argument(flag, action="store_true")
    return parser


@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_arguments_parse_with_a_mirror_of_megatron_lm(case):
    doc = _doc(case)
    args = megatron_mirror().parse_args(shlex.split(export_plan(doc, "megatron").text.replace("\\\n", " ")))
    s = strategy_of(doc)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.micro_batch_size) == \
        (s.tp, s.pp, s.micro_batch_size)
    assert args.global_batch_size == doc["training"]["global_batch"] and args.seq_length == doc["training"]["seq_len"]
    assert args.num_layers == doc["model"]["num_hidden_layers"] and args.bf16
    assert args.sequence_parallel == s.sequence_parallel
    assert args.use_distributed_optimizer == (s.zero_stage == 1)
    assert args.context_parallel_size == s.cp
    assert args.cp_comm_type == (["all_gather"] if s.cp > 1 else None)
    assert args.fp8_format is None and args.fp8_recipe is None
    if doc["model"]["num_key_value_heads"] != doc["model"]["num_attention_heads"]:
        assert args.group_query_attention and args.num_query_groups == doc["model"]["num_key_value_heads"]
    model = model_of(doc)
    if model.is_mla:   # the heads' widths are MLA's own arguments
        assert args.multi_latent_attention and args.kv_channels is None and args.v_head_dim == model.v_head_dim
    else:
        assert (args.kv_channels or model.hidden_size // model.num_attention_heads) == model.head_dim
    assert args.qk_layernorm == model.qk_norm


@pytest.mark.parametrize("drop, field", [("--kv-channels 128", "--kv-channels"), ("--qk-layernorm", "--qk-layernorm")])
def test_megatron_arguments_missing_qwen3s_head_dim_or_qk_norm_are_refused(drop, field):
    doc = _doc("qwen3-moe-ep")
    text = export_plan(doc, "megatron").text.replace("\\\n", " ").replace(drop, "")
    with pytest.raises(SpecError, match=f"^{field}: missing"):
        read_text("megatron", text, model_of(doc), 16)


@pytest.mark.parametrize("drop, field, message", [
    ("--moe-shared-expert-intermediate-size 128", "--moe-shared-expert-intermediate-size",
     "absent, but tiny-moe-shared has 128"),
    ("--moe-shared-expert-gate", "--moe-shared-expert-gate", "missing, but tiny-moe-shared has a gate"),
    ("--moe-router-pre-softmax", "--moe-router-pre-softmax", "missing, but tiny-moe-shared has routing weights"),
])
def test_megatron_shared_expert_and_routing_are_the_model_s(drop, field, message):
    """The shared expert's width, its gate and unnormalised routing go out as Megatron's
    arguments and read back; a whole model description without one is another model."""
    doc = _doc("moe-shared-ep")
    text = export_plan(doc, "megatron").text.replace("\\\n", " ")
    args = megatron_mirror().parse_args(shlex.split(text))
    assert (args.moe_shared_expert_intermediate_size, args.moe_shared_expert_gate, args.moe_router_pre_softmax,
            args.num_experts, args.ffn_hidden_size) == (128, True, True, 8, 64)
    assert read_text("megatron", text, model_of(doc), 8).strategy == strategy_of(doc)
    with pytest.raises(SpecError, match=f"^{field}: {message}"):
        read_text("megatron", text.replace(drop, ""), model_of(doc), 8)
    with pytest.raises(SpecError, match="^--moe-shared-expert-intermediate-size: 256, but tiny-moe-shared has 128"):
        read_text("megatron", "--expert-model-parallel-size 4 --global-batch-size 32 "
                              "--moe-shared-expert-intermediate-size 256", model_of(doc), 8)
    with pytest.raises(SpecError, match="^--moe-shared-expert-gate: given, but tiny-moe has no gate on a shared expert"):
        read_text("megatron", export_plan(_doc("moe-ep-zero3-pp"), "megatron").text + " --moe-shared-expert-gate",
                  load_model("tiny-moe"), 8)


def test_megatron_export_of_gpt_oss_keeps_its_biases_and_says_what_it_cannot_write():
    """gpt-oss has biases on every linear layer: no --disable-bias-linear (Megatron's
    linear layers carry biases unless told); its window, sinks, router bias and clamped
    SwiGLU are TransformerConfig fields, named in a warning; the command reads back."""
    doc = plan("gpt-oss-20b", "dgx-h100", 64, gpus=8, seq_len=4096, top=1,
               fix="dp=8,tp=1,pp=1,ep=8,mbs=1,zero=2,recompute=full")
    exported = export_plan(doc, "megatron")
    args = megatron_mirror().parse_args(shlex.split(exported.text.replace("\\\n", " ")))
    assert not args.disable_bias_linear and args.add_qkv_bias and args.num_experts == 32
    assert any("attention window, attention sinks, router bias, clamped SwiGLU (gpt-oss)" in w
               and "window_attn_skip_freq" in w for w in exported.warnings)
    assert read_text("megatron", exported.text, model_of(doc), 8).strategy == strategy_of(doc)


def test_megatron_export_of_llama4_scores_by_sigmoid_and_says_what_it_cannot_write():
    doc = plan("llama4-scout", "dgx-h100", 256, gpus=64, seq_len=8192, top=1,
               fix="dp=16,tp=1,pp=4,ep=16,mbs=1,zero=1,recompute=full,schedule=1f1b")
    exported = export_plan(doc, "megatron")
    args = megatron_mirror().parse_args(shlex.split(exported.text.replace("\\\n", " ")))
    assert (args.moe_router_score_function, args.moe_shared_expert_intermediate_size, args.num_experts,
            args.moe_router_topk, args.disable_bias_linear) == ("sigmoid", 8192, 16, 1, True)
    assert any("no chunked attention" in w and "36 of 48 layers in chunks of 8192" in w for w in exported.warnings)
    assert read_text("megatron", exported.text, model_of(doc), 64).strategy == strategy_of(doc)
    with pytest.raises(SpecError, match="^--moe-router-score-function: absent \\(softmax\\), but llama4-scout"):
        read_text("megatron", exported.text.replace("--moe-router-score-function sigmoid", ""), model_of(doc), 64)


def test_megatron_capacity_factor_is_the_model_s():
    """Megatron's --moe-expert-capacity-factor reads back as the model's capacity; a
    command that drops rows where the model does not (or the reverse) is refused, naming
    the --set that prices it; padding and the probs drop policy are said."""
    doc = _doc("moe-capacity-ep")
    text = export_plan(doc, "megatron").text
    assert "--moe-expert-capacity-factor 1.25" in text and "--moe-token-drop-policy position" in text
    with pytest.raises(SpecError, match="but tiny-moe is dropless: --set moe_capacity_factor=1.25") as err:
        read_text("megatron", text, load_model("tiny-moe"), 8)
    assert err.value.field == "--moe-expert-capacity-factor"
    with pytest.raises(SpecError, match=r"absent \(dropless\), but tiny-moe has moe_capacity_factor 1.25"):
        read_text("megatron", "--expert-model-parallel-size 4 --global-batch-size 32", model_of(doc), 8)
    edited = text.replace("--moe-token-drop-policy position", "--moe-pad-expert-input-to-capacity")
    warnings = read_text("megatron", edited, model_of(doc), 8).warnings
    assert any("priced without the padding" in w for w in warnings)
    assert any("--moe-token-drop-policy probs" in w for w in warnings)
    assert any("routes dropless" in w for w in export_plan(doc, "torchtitan").warnings)
    assert any("capacity_factor=1.25" in w for w in export_plan(doc, "deepspeed").warnings)


def test_warnings_say_what_each_engine_cannot_express():
    def warned(target, strategy, text, problem=None):
        problem = problem or _problem_for(strategy)
        warnings = export_strategy(target, strategy, LLAMA, problem.training).warnings
        assert any(text in w for w in warnings), warnings

    uneven = _strategy(4, 1, [9, 7, 8, 8])
    warned("deepspeed", uneven, "DeepSpeed sets the pipeline in code")
    warned("deepspeed", uneven, "layers per stage 9,7,8,8→8,8,8,8")
    warned("torchtitan", uneven, "cannot give the plan's layers per stage [9, 7, 8, 8]")
    warned("megatron", _strategy(4, 1, [8, 8, 8, 8], schedule="gpipe"), "Megatron-LM has no GPipe schedule")
    warned("torchtitan", replace(_strategy(1, 1, [32]), zero_stage=1), "torchtitan has no ZeRO-1")
    mixed = _strategy(4, 1, [8, 8, 8, 8], Recompute("full", 3))
    warned("torchtitan", mixed, "torchtitan recomputes every layer or none")
    warned("deepspeed", mixed, "DeepSpeed recomputes every layer or none")
    per_stage = mixed.with_stages(tuple(replace(s, full_recompute_layers=i) for i, s in enumerate(mixed.stages)))
    warned("megatron", per_stage, "exported as the most, 3 per stage")
    warned("deepspeed", replace(_strategy(2, 1, [16, 16]), zero_stage=3), "refuses ZeRO-2 and ZeRO-3")
    warned("torchtitan-toml", _strategy(1, 1, [32], sp=False), "always runs sequence parallelism")
    warned("deepspeed", _strategy(1, 1, [32], Recompute("selective")), "no selective (attention-core) recompute")


def test_a_selective_plan_priced_under_the_other_policy_is_warned():
    # torchtitan's selective AC is op-level, Megatron-LM's the attention core: a plan
    # priced under the runtime whose policy the engine runs exports without a word.
    selective = _strategy(1, 1, [32], Recompute("selective"))
    training = _problem_for(selective).training
    native, megatron = load_runtime("pytorch-native"), load_runtime("megatron")

    def policy_warnings(target, runtime):
        return [w for w in export_strategy(target, selective, LLAMA, training, runtime).warnings
                if "selective recompute is" in w]

    assert policy_warnings("torchtitan", native) == [] and policy_warnings("megatron", megatron) == []
    assert policy_warnings("torchtitan", megatron) == [
        "torchtitan's selective recompute is op-level, the plan priced it as attention-core (runtime megatron): "
        "its memory and time differ; plan with --runtime pytorch-native to price what torchtitan runs"]
    assert "plan with --runtime megatron" in policy_warnings("megatron", native)[0]


MEGATRON_ARGS = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 1 "
                 "--global-batch-size 64 --seq-length 4096 --bf16 --recompute-granularity full "
                 "--recompute-method uniform --recompute-num-layers 1 --lr 3e-4 --train-iters 10")
EVAL = ["--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--gpus", "8"]


def test_evaluate_prints_the_estimates_figures():
    out = CliRunner().invoke(main, ["evaluate", "--from", "megatron", MEGATRON_ARGS] + EVAL)
    assert out.exit_code == 0, out.output
    # A Megatron-LM configuration is priced under the megatron runtime profile
    problem = make_problem("llama2-7b", "dgx-a100-80gb", 64, gpus=8, seq_len=4096, runtime="megatron")
    mine = estimate(problem, Strategy(2, 2, 2, 1, 32, stages=even_stages(32, 2, 1, "full")).with_stages(
        even_stages(32, 2, 1, "full")))
    best = search(problem, load_rules(None), top=1).best.estimate
    gain = mine.step_time_s / best.step_time_s - 1
    assert (f"yours: {mine.tflops_per_gpu:.1f} TFLOP/s per GPU, {mine.peak_memory_bytes / GIB:.1f} GiB peak; "
            f"best: {best.tflops_per_gpu:.1f} ({gain:+.0%})") in out.output
    assert "ignored (not an argument Shardwise reads): --lr --train-iters" in out.output
    assert "why (yours → best):" in out.output
    assert f"recompute: {mine.time.recompute_s:.3f} s → {best.time.recompute_s:.3f} s" in out.output

    data = json.loads(CliRunner().invoke(main, ["evaluate", "--from", "megatron", MEGATRON_ARGS, "--format", "json"]
                                         + EVAL).stdout)
    assert data["yours"]["estimate"]["step_time_s"] == pytest.approx(mine.step_time_s, rel=1e-5)
    assert data["best"]["estimate"]["step_time_s"] == pytest.approx(best.step_time_s, rel=1e-5)
    assert data["gain"] == pytest.approx(gain, rel=1e-4)


def test_evaluate_round_trips_an_exported_plan(tmp_path):
    """plan -> export -> evaluate prices the plan's own strategy: its figures, best found = it,
    under the runtime the plan was made for (--runtime pytorch-native); by default a
    DeepSpeed configuration is priced under deepspeed-zero."""
    doc = _doc("zero2-full")
    path = tmp_path / "plan.json"
    write_plan(doc, path)
    config = tmp_path / "ds.json"
    out = CliRunner().invoke(main, ["export", str(path), "--to", "deepspeed", "-o", str(config)])
    assert out.exit_code == 0 and config.exists()
    args = ["evaluate", "--from", "deepspeed", str(config), "--format", "json", "--seq", "4096",
            "--fix", CASES["zero2-full"]["fix"]] + EVAL
    data = json.loads(CliRunner().invoke(main, args + ["--runtime", "pytorch-native"]).stdout)
    assert data["yours"]["strategy"] == doc["strategy"]
    assert data["yours"]["estimate"]["step_time_s"] == doc["estimate"]["step_time_s"]
    assert data["changes"] == [] and data["gain"] == pytest.approx(0.0, abs=1e-9)
    as_deepspeed = json.loads(CliRunner().invoke(main, args).stdout)
    problem = make_problem("llama2-7b", "dgx-a100-80gb", 64, gpus=8, seq_len=4096, runtime="deepspeed-zero")
    assert as_deepspeed["yours"]["estimate"]["step_time_s"] == pytest.approx(
        estimate(problem, strategy_of(doc)).step_time_s, rel=1e-5)


def test_evaluate_says_when_yours_does_not_fit():
    out = CliRunner().invoke(main, ["evaluate", "--from", "megatron", "--micro-batch-size 4 --global-batch-size 64 "
                                    "--seq-length 4096 --bf16"] + EVAL)
    assert out.exit_code == 0, out.output
    assert re.search(r"yours does not fit: pipeline rank 0 needs [\d.]+ GiB, A100-80GB has 80 GiB", out.output)


def test_export_warnings_go_to_stderr_one_per_line(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(_doc("zero1-sp-full-pp"), path)
    out = CliRunner().invoke(main, ["export", str(path), "--to", "torchtitan", "--allow-changes"])
    assert out.exit_code == 0
    assert out.stderr.splitlines() and all(line.startswith("warning: ") for line in out.stderr.splitlines())
    assert out.stdout.rstrip().endswith("activation-checkpoint:full")


def test_an_export_that_changes_the_plan_is_refused_unless_allowed(tmp_path):
    """torchtitan has no ZeRO-1: the read-back says it would run ZeRO-2; without
    --allow-changes nothing is written and the export exits 3 naming the change."""
    path = tmp_path / "plan.json"
    write_plan(_doc("zero1-sp-full-pp"), path)
    out = CliRunner().invoke(main, ["export", str(path), "--to", "torchtitan", "-o", str(tmp_path / "tt.txt")])
    assert out.exit_code == 3 and not (tmp_path / "tt.txt").exists()
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --to torchtitan: the engine would not run this plan as planned")
    assert "zero 1→2" in last and "--allow-changes" in last
    exact = tmp_path / "exact.json"
    write_plan(_doc("zero1-sp-full-pp"), exact)
    assert CliRunner().invoke(main, ["export", str(exact), "--to", "megatron"]).exit_code == 0


@pytest.mark.parametrize("source, config, extra, field", [
    ("torchtitan", "--parallelism.data_parallel_replicate_degree 3 --parallelism.data_parallel_shard_degree 1",
     [], "parallelism"),
    ("torchtitan", "--parallelism.tensor_parallel_degre 2", [], "--parallelism.tensor_parallel_degre"),
    # cp 2 cuts each sequence into 4 load-balanced chunks: 2050 tokens do not split so.
    ("torchtitan", "--parallelism.context_parallel_degree 2 --training.seq_len 2050 activation-checkpoint:none", [],
     "parallelism.context_parallel_degree"),
    ("megatron", "--context-parallel-size 4 --global-batch-size 64 --seq-length 2052", [], "--context-parallel-size"),
    ("megatron", "--context-parallel-size 2 --cp-comm-type ring --global-batch-size 64", [], "--cp-comm-type"),
    ("megatron", "--num-layers 40 --global-batch-size 64", [], "--num-layers"),
    ("megatron", "--global-batch-size 64", ["--global-batch", "32"], "--global-batch-size"),
    ("megatron", "--tensor-model-parallel-size 16 --global-batch-size 64", [], "--tensor-model-parallel-size"),
    ("megatron", "--recompute-granularity full --global-batch-size 64", [], "--recompute-method"),
    ("megatron", "--micro-batch-size x", [], "--micro-batch-size"),
    ("deepspeed", "BAD_JSON", [], "--from"),
    ("deepspeed", {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 1}, [], "train_batch_size"),
    ("deepspeed", {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1},
     [], "train_batch_size"),
])
def test_evaluate_bad_input_exits_2_with_one_line(tmp_path, source, config, extra, field):
    if source == "deepspeed":
        path = tmp_path / "ds.json"
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        config = str(path)
    out = CliRunner().invoke(main, ["evaluate", "--from", source, config] + EVAL + extra)
    assert out.exit_code == 2, out.output
    lines = out.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {field}:"), out.stderr
    assert "Traceback" not in out.output


def test_export_bad_plan_exits_2(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{")
    out = CliRunner().invoke(main, ["export", str(path), "--to", "megatron"])
    assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1 and "plan" in out.output


def test_exports_are_deterministic_and_unpriced_schedules_are_refused():
    assert export_plan(_doc("interleaved-uneven"), "megatron") == export_plan(_doc("interleaved-uneven"), "megatron")
    with pytest.raises(SpecError, match="parallelism.pipeline_parallel_schedule"):
        read_text("torchtitan", "--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule "
                  "LoopedBFS", LLAMA, 8)


def test_torchtitan_overrides_take_the_global_batch_they_leave_out():
    """Overrides change a config_registry config Shardwise does not see: --global-batch fills in."""
    out = CliRunner().invoke(main, ["evaluate", "--from", "torchtitan", "--training.local_batch_size 2 "
                                    "activation-checkpoint:full", "--global-batch", "64", "--seq", "4096",
                                    "--format", "json"] + EVAL)
    assert out.exit_code == 0, out.output
    mine = json.loads(out.stdout)["yours"]["strategy"]
    assert (mine["dp"], mine["zero_stage"], mine["micro_batch_size"], mine["num_microbatches"]) == (8, 3, 2, 4)


def test_a_torchtitan_export_states_the_memory_of_torchtitan_s_loss():
    # The plan is priced with the executor's chunked loss; torchtitan computes
    # F.cross_entropy over the upcast logits: the export re-prices the peak so.
    doc = plan("llama3-8b", "dgx-h100", 16, gpus=8, seq_len=8192, fix="dp=8,tp=1,pp=1,mbs=2,zero=3,recompute=selective",
               top=1)
    problem, strategy = make_problem("llama3-8b", "dgx-h100", 16, gpus=8, seq_len=8192), strategy_of(doc)
    theirs = estimate(replace(problem, runtime=replace(problem.runtime, chunked_loss=False)), strategy)
    planned = estimate(problem, strategy)
    assert theirs.peak_memory_bytes > planned.peak_memory_bytes
    warning = (f"torchtitan runs this plan with chunked_loss false (the plan's runtime pytorch-native does not): "
               f"peak memory {theirs.peak_memory_bytes / GIB:.1f} GiB per rank against the plan's "
               f"{planned.peak_memory_bytes / GIB:.1f} GiB; the device has 80.0 GiB")
    assert warning in export_plan(doc, "torchtitan").warnings
    # DeepSpeed's configuration says nothing of the loss: no such line.
    assert not any("peak memory" in w for w in export_plan(doc, "deepspeed").warnings)


def test_zero_bubble_schedules_export_by_torch_s_names_and_megatron_refuses_them():
    exported = export_plan(_doc("zbv-zero2"), "torchtitan")
    assert "--parallelism.pipeline_parallel_schedule ZBVZeroBubble" in exported.text
    assert "InterleavedZeroBubble" in export_plan(_doc("zb-interleaved"), "torchtitan").text
    assert "--parallelism.pipeline_parallel_schedule DualPipeV" in export_plan(_doc("dualpipev"), "torchtitan").text
    megatron = export_plan(_doc("zbv-zero2"), "megatron")
    assert any("Megatron-LM has no zero-bubble schedule" in w for w in megatron.warnings)
    assert any("schedule zbv→interleaved" in w for w in megatron.warnings)


# torchtitan 0.2.2 torchtitan/config/job_config.py: the fields of Parallelism (copied from
# the released source, pip download torchtitan==0.2.2).
PARALLELISM_022_FIELDS = {
    "data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
    "tensor_parallel_degree", "disable_loss_parallel", "enable_async_tensor_parallel", "pipeline_parallel_degree",
    "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
    "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size", "pipeline_parallel_expert_parallel_overlap",
    "context_parallel_degree", "context_parallel_load_balancer", "context_parallel_rotate_method",
    "expert_parallel_degree", "expert_tensor_parallel_degree", "expert_parallel_comm_backend",
}


def test_context_parallel_exports_say_the_degree_and_the_all_gather():
    doc = _doc("cp2-zero3-pp")
    overrides = export_plan(doc, "torchtitan").text
    assert "--parallelism.context_parallel_degree 2 \\\n" in overrides
    # FSDP2 shards over data_parallel_shard_degree x context_parallel_degree: the plan's dp x cp.
    assert "--parallelism.data_parallel_shard_degree 2 \\\n" in overrides
    toml = tomllib.loads(export_plan(doc, "torchtitan-toml").text)["parallelism"]
    assert set(toml) <= PARALLELISM_022_FIELDS
    assert (toml["context_parallel_degree"], toml["context_parallel_rotate_method"]) == (2, "allgather")
    assert (toml["data_parallel_replicate_degree"], toml["data_parallel_shard_degree"]) == (1, 2)
    megatron = export_plan(doc, "megatron").text
    assert "--context-parallel-size 2 \\\n--cp-comm-type all_gather \\\n" in megatron
    # Without context parallelism nothing of it is said beyond the degree 1.
    plain = export_plan(_doc("zero2-full"), "torchtitan-toml").text
    assert "context_parallel_degree = 1\n" in plain and "rotate" not in plain
    assert "--cp-comm-type" not in export_plan(_doc("zero2-full"), "megatron").text


def test_torchtitan_cannot_replicate_over_cp_ranks():
    """torchtitan runs FSDP2 over its cp ranks whenever cp > 1: a plan with replicated
    weights (ZeRO-0) over dp x cp is exported as ZeRO-2 and says so."""
    s = replace(strategy_of(_doc("cp2-zero3-pp")), zero_stage=0)
    exported = export_strategy("torchtitan", s, LLAMA, _problem("cp2-zero3-pp").training)
    assert any("shards the weights over its cp ranks" in w for w in exported.warnings)
    assert exported.changes == ("torchtitan will run this configuration with zero 0→2 (plan → exported)",)
    # Megatron replicates over dp x cp without the distributed optimizer: exact.
    assert export_strategy("megatron", s, LLAMA, _problem("cp2-zero3-pp").training).warnings == ()


def test_torchtitan_reads_cp_with_its_fsdp_over_shard_x_cp():
    base = "--parallelism.tensor_parallel_degree 2 --parallelism.context_parallel_degree 2 " \
           "--training.local_batch_size 1 --training.global_batch_size 8 activation-checkpoint:none"
    # replicate 1, shard 2: FSDP2 over shard x cp, ZeRO-3 over dp x cp with nothing to say.
    back = read_text("torchtitan", base, LLAMA, 8)
    s = back.strategy
    assert (s.dp, s.cp, s.tp, s.zero_stage, s.num_microbatches) == (2, 2, 2, 3, 4)
    assert not any("context_parallel" in w or "HSDP" in w for w in back.warnings)
    # replicate 2, shard 1: torchtitan still shards over its cp ranks (HSDP), priced over dp x cp.
    hsdp = read_text("torchtitan", base + " --parallelism.data_parallel_replicate_degree 2 "
                     "--parallelism.data_parallel_shard_degree 1", LLAMA, 8)
    assert (hsdp.strategy.dp, hsdp.strategy.cp, hsdp.strategy.zero_stage) == (2, 2, 3)
    assert any("HSDP (replicate 2 x shard 1 x cp 2) is priced as ZeRO-3 over all dp 2 x cp 2 ranks" in w
               for w in hsdp.warnings)
    balancer = read_text("torchtitan", base + " --parallelism.context_parallel_load_balancer ptrr", LLAMA, 8)
    assert any("context_parallel_load_balancer ptrr: priced as the head-tail split" in w for w in balancer.warnings)
    with pytest.raises(SpecError, match="^--parallelism.context_parallel_rotate_method: not a field"):
        read_text("torchtitan", base + " --parallelism.context_parallel_rotate_method alltoall", LLAMA, 8)


def test_an_alltoall_or_p2p_cp_config_is_priced_as_all_gather_and_says_so():
    doc = _doc("cp2-zero3-pp")
    toml = export_plan(doc, "torchtitan-toml").text
    assert not read_text("torchtitan-toml", toml, LLAMA, 16).warnings
    alltoall = read_text("torchtitan-toml", toml.replace('"allgather"', '"alltoall"'), LLAMA, 16)
    assert alltoall.strategy == strategy_of(doc)
    assert any(w.startswith("parallelism.context_parallel_rotate_method alltoall") and "priced as all-gather" in w
               for w in alltoall.warnings)
    with pytest.raises(SpecError, match="^parallelism.context_parallel_rotate_method: expected allgather or alltoall"):
        read_text("torchtitan-toml", toml.replace('"allgather"', '"ring"'), LLAMA, 16)

    megatron = export_plan(doc, "megatron").text
    assert not read_text("megatron", megatron, LLAMA, 16).warnings
    for given, said in (("--cp-comm-type p2p", "--cp-comm-type p2p"), ("--cp-comm-type a2a", "--cp-comm-type a2a"),
                        ("", "--cp-comm-type not given: Megatron-LM's default p2p")):
        back = read_text("megatron", megatron.replace("--cp-comm-type all_gather", given), LLAMA, 16)
        assert back.strategy == strategy_of(doc)
        assert any(w.startswith(said) and w.endswith("priced as all-gather") for w in back.warnings), back.warnings
    per_layer = megatron.replace("--cp-comm-type all_gather", "--cp-comm-type " + " ".join(["all_gather"] * 32))
    assert not read_text("megatron", per_layer, LLAMA, 16).warnings
    with pytest.raises(SpecError, match="^--cp-comm-type: 3 types, one for all layers or one per layer"):
        read_text("megatron", megatron.replace("all_gather", "all_gather p2p p2p"), LLAMA, 16)


def test_megatron_shards_the_distributed_optimizer_over_dp_x_cp():
    # dp 1 x cp 2: the distributed optimizer still shards over the two cp ranks (ZeRO-1).
    back = read_text("megatron", "--context-parallel-size 2 --tensor-model-parallel-size 4 --cp-comm-type all_gather "
                     "--use-distributed-optimizer --global-batch-size 8 --seq-length 4096 --bf16", LLAMA, 8)
    s = back.strategy
    assert (s.dp, s.cp, s.tp, s.zero_stage, s.num_microbatches) == (1, 2, 4, 1, 8)
    assert strategy_changes(s, replace(s, dp=2, cp=1)) == ["dp 1→2", "cp 2→1"]


def test_deepspeed_export_of_a_cp_plan_exits_2_naming_cp(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(_doc("cp2-zero1-sp"), path)
    out = CliRunner().invoke(main, ["export", str(path), "--to", "deepspeed", "-o", str(tmp_path / "ds.json")])
    assert out.exit_code == 2 and not (tmp_path / "ds.json").exists()
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: plan.strategy.cp: 2: DeepSpeed has no context parallelism")
    assert "Traceback" not in out.output


def test_evaluate_prices_a_cp_config_and_finds_an_exported_plan_best(tmp_path):
    """plan (cp 2) -> export -> evaluate under the same pins: the plan's own strategy,
    figures and no change, for Megatron's arguments and torchtitan's TOML."""
    case = CASES["cp2-zero1-sp"]
    doc = _doc("cp2-zero1-sp")
    args = ["--format", "json", "--runtime", "pytorch-native", "--fix", case["fix"]] + EVAL
    data = json.loads(CliRunner().invoke(main, ["evaluate", "--from", "megatron", export_plan(doc, "megatron").text]
                                         + args).stdout)
    assert data["yours"]["strategy"] == doc["strategy"] and data["yours"]["strategy"]["cp"] == 2
    assert data["yours"]["estimate"]["step_time_s"] == doc["estimate"]["step_time_s"]
    assert data["changes"] == [] and data["gain"] == pytest.approx(0.0, abs=1e-9)

    zero3 = dict(case, fix=case["fix"].replace("zero=1", "zero=3"))
    doc3 = plan(zero3["model"], "dgx-a100-80gb", zero3["batch"], gpus=zero3["gpus"], seq_len=zero3["seq"],
                fix=zero3["fix"], top=1)
    toml = tmp_path / "job.toml"
    toml.write_text(export_plan(doc3, "torchtitan-toml").text)
    out = CliRunner().invoke(main, ["evaluate", "--from", "torchtitan", str(toml), "--format", "json",
                                    "--fix", zero3["fix"]] + EVAL)
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["yours"]["strategy"] == doc3["strategy"]
    problem = make_problem("llama2-7b", "dgx-a100-80gb", 64, gpus=8, seq_len=4096,
                           runtime=replace(load_runtime("pytorch-native"), chunked_loss=False))
    assert data["yours"]["estimate"]["step_time_s"] == pytest.approx(
        estimate(problem, strategy_of(doc3)).step_time_s, rel=1e-5)


# ---------------------------------------------------------------------------
# FP8 training (TrainingSpec.fp8): torchtitan 0.2's [model] converters and
# [quantize.linear.float8], Megatron-LM's --fp8-format / --fp8-recipe; torchtitan 0.3 sets
# it in Python (a warning), DeepSpeed has no such setting (exit 2).

# Plans on H100s (an fp8 peak): FSDP2 with tp, and tp x pp without data parallelism.
FP8_CASES = {
    "fp8-zero3-tp": dict(model="llama3-8b", gpus=8, batch=16, seq=2048,
                         fix="dp=4,tp=2,pp=1,mbs=1,zero=3,recompute=full,sp=on"),
    "fp8-tp-pp": dict(model="llama3-8b", gpus=8, batch=16, seq=2048,
                      fix="dp=1,tp=4,pp=2,mbs=1,zero=0,recompute=full,sp=on,schedule=1f1b"),
}
FP8_PRECISIONS = {"fp8": "tensorwise", "fp8-rowwise": "rowwise"}
# torchtitan 0.2.2 torchtitan/config/job_config.py class Float8Linear (lines 731-752), the
# [quantize.linear.float8] table of a job TOML (JobConfig.quantize -> Quantize.linear ->
# QuantizedLinear.float8); the converter's registered name, components/quantization/float8.py
# line 238.
FLOAT8_022_FIELDS = {"enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp", "recipe_name",
                     "filter_fqns", "emulate"}
FLOAT8_022_CONVERTER = "quantize.linear.float8"


def _fp8_problem(case, precision):
    c = FP8_CASES[case]
    return make_problem(c["model"], "dgx-h100", c["batch"], gpus=c["gpus"], seq_len=c["seq"], precision=precision)


def _fp8_doc(case, precision):
    key = (case, precision)
    if key not in _DOCS:
        c = FP8_CASES[case]
        _DOCS[key] = plan(c["model"], "dgx-h100", c["batch"], gpus=c["gpus"], seq_len=c["seq"], fix=c["fix"],
                          precision=precision, top=1)
    return _DOCS[key]


@pytest.mark.parametrize("case", sorted(FP8_CASES))
@pytest.mark.parametrize("precision", sorted(FP8_PRECISIONS))
@pytest.mark.parametrize("target", ["torchtitan-toml", "megatron", "torchtitan"])
def test_fp8_plans_round_trip_with_the_same_estimate(case, precision, target):
    doc = _fp8_doc(case, precision)
    strategy, model = strategy_of(doc), model_of(doc)
    recipe = FP8_PRECISIONS[precision]
    assert doc["training"]["fp8"] == recipe
    exported = export_plan(doc, target)
    back = read_text(target, exported.text, model, strategy.num_gpus)
    assert back.strategy == strategy
    if target == "torchtitan":
        # 0.3's overrides cannot say FP8: the config_registry function builds the model.
        assert (back.states_fp8, back.fp8) == (False, None)
        assert any("Float8LinearConverter.Config(recipe_name=\"rowwise\", filter_fqns=[\"lm_head\"])" in w
                   for w in exported.warnings)
        # 0.3.0's Float8LinearConverter has no tensorwise recipe: the engine runs rowwise.
        assert exported.changes == (() if recipe == "rowwise" else (
            "torchtitan will run this configuration with fp8 tensorwise→rowwise (plan → exported)",))
        precision_back = precision
    elif target == "megatron" and recipe == "rowwise":
        # Megatron has no per-row scaling: its nearest, blockwise, writes its tiles' scales too.
        assert (back.precision, back.fp8) == ("bf16", "blockwise")
        assert exported.changes == ("megatron will run this configuration with fp8 rowwise→blockwise (plan → "
                                    "exported)",)
        back_step_s = estimate(_fp8_problem(case, "fp8-blockwise"), back.strategy).step_time_s
        assert back_step_s == pytest.approx(doc["estimate"]["step_time_s"], rel=0.01)
        return
    else:
        assert (back.precision, back.fp8) == ("bf16", recipe)
        assert exported.changes == ()
        precision_back = precision_name(back.precision, back.fp8)
    problem = _fp8_problem(case, precision_back)
    assert problem.training == _fp8_problem(case, precision).training
    assert estimate(problem, back.strategy).step_time_s == pytest.approx(doc["estimate"]["step_time_s"], rel=1e-5)


@pytest.mark.parametrize("case", sorted(FP8_CASES))
@pytest.mark.parametrize("precision", sorted(FP8_PRECISIONS))
def test_fp8_toml_uses_torchtitan_022_s_converter_and_fields(case, precision):
    doc = _fp8_doc(case, precision)
    toml = tomllib.loads(export_plan(doc, "torchtitan-toml").text)
    assert set(toml["parallelism"]) <= PARALLELISM_022_FIELDS
    assert toml["model"] == {"converters": [FLOAT8_022_CONVERTER]}
    float8 = toml["quantize"]["linear"]["float8"]
    assert set(float8) <= FLOAT8_022_FIELDS and float8["filter_fqns"] == ["output"]
    if precision == "fp8" and toml["parallelism"]["data_parallel_shard_degree"] > 1:
        # torchtitan's advice for tensorwise under FSDP2; its converter refuses them beside a
        # recipe_name, whose absence is tensorwise.
        assert float8 == {"enable_fsdp_float8_all_gather": True, "precompute_float8_dynamic_scale_for_fsdp": True,
                          "filter_fqns": ["output"]}
    else:
        assert float8 == {"recipe_name": FP8_PRECISIONS[precision], "filter_fqns": ["output"]}


@pytest.mark.parametrize("case", sorted(FP8_CASES))
@pytest.mark.parametrize("precision", sorted(FP8_PRECISIONS))
def test_fp8_exports_parse_as_the_engines_do(case, precision):
    doc = _fp8_doc(case, precision)
    args = megatron_mirror().parse_args(shlex.split(export_plan(doc, "megatron").text.replace("\\\n", " ")))
    assert args.bf16 and args.fp8_format == "hybrid"
    assert args.fp8_recipe == {"fp8": "tensorwise", "fp8-rowwise": "blockwise"}[precision]
    words = shlex.split(export_plan(doc, "torchtitan").text.replace("\\\n", " "))
    for flag in (w for w in words if w.startswith("--")):
        section, key = flag[2:].split(".", 1)
        fields = PARALLELISM_CONFIG_FIELDS if section == "parallelism" else TRAINING_CONFIG_FIELDS
        assert section in ("parallelism", "training") and key.removeprefix("no-") in fields, flag


@pytest.mark.parametrize("precision, cluster, recipe", [("fp8-blockwise", "dgx-h100", "blockwise"),
                                                       ("mxfp8", "dgx-b200", "mxfp8")])
def test_blockwise_and_mx_fp8_go_to_megatron_by_name_and_torchtitan_refuses_them(precision, cluster, recipe):
    """DeepSeek-V3's 1x128 / 128x128 tiles and OCP MX's 32-value blocks: Megatron-LM's
    --fp8-recipe of those names, read back as the same recipe; torchtitan's Float8Linear
    has tensorwise and rowwise only (exit 2 naming plan.training.fp8); the executor
    refuses them by name; MX needs Blackwell."""
    doc = plan("llama3-8b", cluster, 16, gpus=8, seq_len=2048, precision=precision, top=1,
               fix="dp=1,tp=4,pp=2,mbs=1,zero=0,recompute=full,sp=on,schedule=1f1b")
    exported = export_plan(doc, "megatron")
    assert exported.warnings == ()
    args = megatron_mirror().parse_args(shlex.split(exported.text.replace("\\\n", " ")))
    assert (args.fp8_format, args.fp8_recipe) == ("hybrid", recipe)
    assert read_text("megatron", exported.text, model_of(doc), 8).fp8 == recipe
    for target in ("torchtitan", "torchtitan-toml"):
        with pytest.raises(SpecError, match=f"^plan.training.fp8: {recipe}: torchtitan's Float8Linear recipes"):
            export_plan(doc, target)
    from executor.launch import UnsupportedPlan, check_supported

    with pytest.raises(UnsupportedPlan, match=f"^training.fp8: {recipe} scaling is priced and exported"):
        check_supported(model_of(doc), strategy_of(doc), 2048, "bf16", recipe)
    if recipe == "mxfp8":
        with pytest.raises(SpecError, match="^--precision: H100-SXM has no MX"):
            make_problem("llama3-8b", "dgx-h100", 16, gpus=8, precision="mxfp8")


def test_megatron_has_no_rowwise_scaling_and_says_so():
    exported = export_plan(_fp8_doc("fp8-zero3-tp", "fp8-rowwise"), "megatron")
    said = ("Megatron-LM has no rowwise FP8 scaling (--fp8-recipe: tensorwise, delayed, mxfp8, blockwise, custom; "
            "megatron-core enums.py Fp8Recipe): exported as its nearest, blockwise (1x128 tiles, 128x128 weight "
            "blocks), which the plan prices as rowwise")
    changed = "megatron will run this configuration with fp8 rowwise→blockwise (plan → exported)"
    assert exported.warnings == (said, changed) and exported.changes == (changed,)
    assert export_plan(_fp8_doc("fp8-tp-pp", "fp8"), "megatron").warnings == ()
    # ZeRO-3 tensorwise is priced with FSDP2's float8 all-gather, which the export does not set in Megatron.
    assert any("Megatron FSDP gathers them so only with fp8 parameters" in w
               for w in export_plan(_fp8_doc("fp8-zero3-tp", "fp8"), "megatron").warnings)


def test_torchtitan_toml_tensorwise_under_fsdp_gathers_in_fp8_as_priced():
    """The estimate prices tensorwise FP8 under FSDP2 with its float8 all-gather: the
    export turns it on and says nothing of it; a TOML without it is priced so and says so.
    With tp and sp, torchtitan 0.2's float8 TP is unreachable (its converter's name): said."""
    exported = export_plan(_fp8_doc("fp8-zero3-tp", "fp8"), "torchtitan-toml")
    assert not any("enable_fsdp_float8_all_gather" in w for w in exported.warnings)
    assert any("applies its float8 tensor parallelism only when model.converters holds" in w
               for w in exported.warnings)
    assert not export_plan(_fp8_doc("fp8-zero3-tp", "fp8-rowwise"), "torchtitan-toml").warnings
    off = exported.text.replace("enable_fsdp_float8_all_gather = true\n", "")
    back = read_text("torchtitan-toml", off, LLAMA3, 8)
    assert back.fp8 == "tensorwise" and any("enable_fsdp_float8_all_gather is off" in w for w in back.warnings)


def test_non_fp8_exports_say_nothing_of_fp8():
    for case in ("zero2-full", "cp2-zero3-pp", "zero1-sp-full-pp"):
        for target in TARGETS:
            if target == "deepspeed" and "cp2" in case:
                continue
            exported = export_plan(_doc(case), target)
            assert not re.search("fp8|float8|converters|quantize", exported.text), (case, target)
            assert not any("FP8" in w or "fp8" in w for w in exported.warnings), (case, target)


def test_deepspeed_export_of_an_fp8_plan_exits_2_naming_fp8(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(_fp8_doc("fp8-zero3-tp", "fp8"), path)
    out = CliRunner().invoke(main, ["export", str(path), "--to", "deepspeed", "-o", str(tmp_path / "ds.json")])
    assert out.exit_code == 2 and not (tmp_path / "ds.json").exists()
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: plan.training.fp8: tensorwise: a DeepSpeed config has no FP8 training setting"), out.stderr
    assert "Traceback" not in out.output


def test_torchtitan_0_3_tensorwise_export_exits_3_unless_allowed(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(_fp8_doc("fp8-zero3-tp", "fp8"), path)
    out = CliRunner().invoke(main, ["export", str(path), "--to", "torchtitan"])
    assert out.exit_code == 3 and "fp8 tensorwise→rowwise" in out.stderr.strip().splitlines()[-1]
    assert CliRunner().invoke(main, ["export", str(path), "--to", "torchtitan-toml"]).exit_code == 0


FP8_TOML = export_plan(plan("llama3-8b", "dgx-h100", 16, gpus=8, seq_len=2048, precision="fp8-rowwise",
                            fix="dp=8,tp=1,pp=1,mbs=1,zero=3,recompute=full", top=1), "torchtitan-toml").text
LLAMA3 = load_model("llama3-8b")


@pytest.mark.parametrize("edit, field, message", [
    ('recipe_name = "rowwise"', "quantize.linear.float8.recipe_name", "'mxfp8' (known: tensorwise, rowwise"),
    ('converters = ["quantize.linear.float8"]', "model.converters", "'float8' is not a converter torchtitan 0.2.2"),
    ('converters = ["quantize.linear.float8"]', "model.converters", "'quantize.linear.mx': Shardwise prices FP8"),
    ('filter_fqns = ["output"]', "quantize.linear.float8.amax_history_len", "not a field"),
    ('recipe_name = "rowwise"', "quantize.linear.float8.enable_fsdp_float8_all_gather", "refuses it beside"),
])
def test_torchtitan_toml_fp8_settings_it_cannot_read_are_refused(edit, field, message):
    replacement = {"quantize.linear.float8.recipe_name": 'recipe_name = "mxfp8"',
                   "quantize.linear.float8.amax_history_len": 'amax_history_len = 16',
                   "quantize.linear.float8.enable_fsdp_float8_all_gather":
                       'recipe_name = "rowwise"\nenable_fsdp_float8_all_gather = true'}.get(field)
    if field == "model.converters":
        replacement = 'converters = ["float8"]' if "'float8'" in message else 'converters = ["quantize.linear.mx"]'
    assert edit in FP8_TOML
    with pytest.raises(SpecError) as err:
        read_text("torchtitan-toml", FP8_TOML.replace(edit, replacement), LLAMA3, 8)
    assert err.value.field == field and message in str(err.value)


def test_torchtitan_toml_fp8_variants_are_priced_and_said():
    assert read_text("torchtitan-toml", FP8_TOML, LLAMA3, 8).warnings == ()
    hp = read_text("torchtitan-toml", FP8_TOML.replace('"rowwise"', '"rowwise_with_gw_hp"'), LLAMA3, 8)
    assert hp.fp8 == "rowwise" and any("rowwise_with_gw_hp runs the weight-gradient GEMMs in bf16" in w
                                       for w in hp.warnings)
    head = read_text("torchtitan-toml", FP8_TOML.replace('["output"]', '[]'), LLAMA3, 8)
    assert head.fp8 == "rowwise" and any("converts the LM head to FP8 too" in w for w in head.warnings)
    default = read_text("torchtitan-toml", FP8_TOML.replace('recipe_name = "rowwise"\n', ""), LLAMA3, 8)
    assert default.fp8 == "tensorwise" and default.precision == "bf16"   # torchao's default recipe
    assert any("enable_fsdp_float8_all_gather is off" in w for w in default.warnings)
    gather = read_text("torchtitan-toml", FP8_TOML.replace('recipe_name = "rowwise"',
                                                           "enable_fsdp_float8_all_gather = true"), LLAMA3, 8)
    assert gather.fp8 == "tensorwise" and gather.warnings == ()
    # The table without the converter is not FP8; float32 beside the converter is refused.
    off = read_text("torchtitan-toml", FP8_TOML.replace('converters = ["quantize.linear.float8"]', "converters = []"),
                    LLAMA3, 8)
    assert (off.fp8, off.states_fp8) == (None, True)
    with pytest.raises(SpecError, match="^training.mixed_precision_param: float32 beside FP8"):
        read_text("torchtitan-toml", FP8_TOML.replace('"bfloat16"', '"float32"'), LLAMA3, 8)


@pytest.mark.parametrize("flags, fp8, warned", [
    ("--bf16 --fp8-format hybrid --fp8-recipe tensorwise", "tensorwise", None),
    ("--bf16 --fp8-format e4m3 --fp8-recipe tensorwise", "tensorwise", None),
    ("--bf16 --fp8-format hybrid", "tensorwise", "--fp8-recipe not given: Megatron's default delayed"),
    ("--bf16 --fp8-format hybrid --fp8-recipe delayed", "tensorwise", "--fp8-recipe delayed scales each tensor"),
    ("--bf16 --fp8-format hybrid --fp8-recipe blockwise", "blockwise", None),
    ("--bf16 --fp8-format hybrid --fp8-recipe mxfp8", "mxfp8", None),
    ("--bf16 --fp8-recipe tensorwise", None, "--fp8-recipe tensorwise without --fp8-format"),
    ("--bf16", None, None),
])
def test_megatron_reads_fp8_format_and_recipe(flags, fp8, warned):
    back = read_text("megatron", "--tensor-model-parallel-size 8 --global-batch-size 8 " + flags, LLAMA3, 8)
    assert (back.precision, back.fp8) == ("bf16", fp8)
    assert any(warned in w for w in back.warnings) if warned else back.warnings == ()


@pytest.mark.parametrize("flags, field", [
    ("--fp16 --fp8-format hybrid", "--fp8-format"),
    ("--fp8-format hybrid", "--fp8-format"),
    ("--bf16 --fp8-format hybrid --fp8-recipe custom", "--fp8-recipe"),
    ("--bf16 --fp8-format hybrid --fp8-recipe rowwise", "--fp8-recipe"),
    ("--bf16 --fp8-format e5m2", "--fp8-format"),
])
def test_megatron_fp8_it_cannot_price_is_refused(flags, field):
    with pytest.raises(SpecError) as err:
        read_text("megatron", "--tensor-model-parallel-size 8 --global-batch-size 8 " + flags, LLAMA3, 8)
    assert err.value.field == field


H100_EVAL = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8"]


@pytest.mark.parametrize("precision", sorted(FP8_PRECISIONS))
def test_evaluate_prices_an_exported_fp8_config_as_the_plan(tmp_path, precision):
    """plan (fp8) -> export -> evaluate under the same pins and runtime: the plan's own
    strategy and figures, FP8 and all, for Megatron's arguments and torchtitan's TOML."""
    doc = _fp8_doc("fp8-zero3-tp", precision)
    args = ["--format", "json", "--runtime", "pytorch-native", "--fix", FP8_CASES["fp8-zero3-tp"]["fix"]] + H100_EVAL
    out = CliRunner().invoke(main, ["evaluate", "--from", "megatron", export_plan(doc, "megatron").text] + args)
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["yours"]["strategy"] == doc["strategy"]
    if precision == "fp8-rowwise":
        # Megatron runs blockwise scaling where the plan has rowwise: its tiles' scales, 0.1% more.
        assert data["yours"]["estimate"]["step_time_s"] == pytest.approx(doc["estimate"]["step_time_s"], rel=0.01)
        assert data["yours"]["estimate"]["step_time_s"] > doc["estimate"]["step_time_s"]
    else:
        assert data["yours"]["estimate"]["step_time_s"] == doc["estimate"]["step_time_s"]
        assert data["changes"] == [] and data["gain"] == pytest.approx(0.0, abs=1e-9)
    toml = tmp_path / "job.toml"
    toml.write_text(export_plan(doc, "torchtitan-toml").text)
    ev = evaluate_config("torchtitan", str(toml), "llama3-8b", "dgx-h100", gpus=8, rules=load_rules(None).with_fix(
        parse_fix(FP8_CASES["fp8-zero3-tp"]["fix"])), pins=parse_fix(FP8_CASES["fp8-zero3-tp"]["fix"]))
    assert ev.problem.training == _fp8_problem("fp8-zero3-tp", precision).training
    assert ev.strategy == strategy_of(doc)
    problem = replace(_fp8_problem("fp8-zero3-tp", precision), runtime=ev.problem.runtime)
    assert ev.yours.step_time_s == pytest.approx(estimate(problem, ev.strategy).step_time_s, rel=1e-12)


def test_torchtitan_overrides_take_fp8_from_the_precision_flag():
    """0.3's overrides say bfloat16 but cannot say FP8: --precision fp8-rowwise is taken."""
    doc = _fp8_doc("fp8-zero3-tp", "fp8-rowwise")
    ev = evaluate_config("torchtitan", export_plan(doc, "torchtitan").text, "llama3-8b", "dgx-h100", gpus=8,
                         precision="fp8-rowwise", rules=load_rules(None).with_fix(parse_fix(FP8_CASES["fp8-zero3-tp"]["fix"])))
    assert ev.problem.training.fp8 == "rowwise" and ev.strategy == strategy_of(doc)


MEGATRON_FP8 = ("--tensor-model-parallel-size 8 --global-batch-size 8 --seq-length 2048 --bf16 --fp8-format hybrid "
                "--fp8-recipe tensorwise")


@pytest.mark.parametrize("config, extra, field", [
    # FP8 on an A100 (no fp8 peak): the engine's own field.
    (MEGATRON_FP8, ["--cluster", "dgx-a100-80gb"], "--fp8-format"),
    # The configuration says FP8, --precision says bf16 (and the reverse).
    (MEGATRON_FP8, ["--cluster", "dgx-h100", "--precision", "bf16"], "--fp8-format"),
    ("--tensor-model-parallel-size 8 --global-batch-size 8 --seq-length 2048 --bf16",
     ["--cluster", "dgx-h100", "--precision", "fp8"], "--fp8-format"),
])
def test_evaluate_fp8_bad_input_exits_2_naming_the_engine_s_field(config, extra, field):
    out = CliRunner().invoke(main, ["evaluate", "--from", "megatron", config, "--model", "llama3-8b", "--gpus", "8"]
                             + extra)
    assert out.exit_code == 2, out.output
    errors = [line for line in out.stderr.strip().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {field}:"), out.stderr
    assert "Traceback" not in out.output


def test_evaluate_a_torchtitan_toml_with_fp8_on_an_a100_names_its_converters(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text(FP8_TOML)
    out = CliRunner().invoke(main, ["evaluate", "--from", "torchtitan", str(toml), "--model", "llama3-8b",
                                    "--cluster", "dgx-a100-80gb", "--gpus", "8"])
    assert out.exit_code == 2 and out.stderr.strip().splitlines()[-1].startswith(
        "error: model.converters: FP8 (rowwise) on A100-80GB, which has no fp8 peak"), out.stderr


@pytest.mark.parametrize("drop, field, message", [
    ("--multi-latent-attention", "--multi-latent-attention", "absent, but tiny-deepseek has it"),
    ("--q-lora-rank 32", "--q-lora-rank", "absent, but tiny-deepseek has 32"),
    ('--moe-layer-freq "([0]*2+[1]*4)"', "--moe-layer-freq", "absent, but tiny-deepseek has 2 dense first layers"),
    ("--moe-router-num-groups 4", "--moe-router-num-groups", "absent, but tiny-deepseek has 4"),
    ("--moe-router-topk-scaling-factor 2.5", "--moe-router-topk-scaling-factor", "absent, but tiny-deepseek has 2.5"),
    ("--mtp-num-layers 1", "--mtp-num-layers", "absent, but tiny-deepseek has 1"),
])
def test_megatron_deepseek_v3_layout_is_the_model_s(drop, field, message):
    """Multi-head latent attention and its ranks, the dense first layers (their width as
    --ffn-hidden-size, the experts' as --moe-ffn-hidden-size), group-limited routing, its
    scaling and the MTP modules go out as Megatron-LM's arguments and read back; a whole
    model description without one is another model."""
    doc = _doc("deepseek-ep-pp")
    text = export_plan(doc, "megatron").text.replace("\\\n", " ")
    args = megatron_mirror().parse_args(shlex.split(text))
    assert (args.multi_latent_attention, args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim,
            args.qk_pos_emb_head_dim, args.v_head_dim, args.kv_channels) == (True, 32, 16, 16, 8, 16, None)
    assert (args.ffn_hidden_size, args.moe_ffn_hidden_size, args.moe_layer_freq) == (256, 32, "([0]*2+[1]*4)")
    assert (args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_topk_scaling_factor,
            args.mtp_num_layers, args.moe_router_score_function) == (4, 2, 2.5, 1, "sigmoid")
    assert read_text("megatron", text, model_of(doc), 8).strategy == strategy_of(doc)
    assert drop in text
    with pytest.raises(SpecError, match=f"^{re.escape(field)}: {re.escape(message)}"):
        read_text("megatron", text.replace(drop, ""), model_of(doc), 8)
    with pytest.raises(SpecError, match=r"^--moe-layer-freq: dense-MLP layers 0, 2, but tiny-deepseek has 2 dense "
                                        r"first layers"):
        read_text("megatron", text.replace('"([0]*2+[1]*4)"', "[0,1,0,1,1,1]"), model_of(doc), 8)
    # Megatron's int form: layer i sparse when i % N is 0 (every other, from layer 0).
    every_other = replace(model_of(doc), mlp_only_layers=(1, 3, 5))
    assert read_text("megatron", text.replace('"([0]*2+[1]*4)"', "2").replace("--ffn-hidden-size 256", ""),
                     every_other, 8).strategy.dp == 4
    with pytest.raises(SpecError, match="^--multi-latent-attention: given, but tiny-moe has none"):
        read_text("megatron", "--expert-model-parallel-size 2 --global-batch-size 32 --multi-latent-attention",
                  load_model("tiny-moe"), 8)


def test_the_expert_dispatch_priced_is_the_one_exported_and_read_back():
    """The plan's all-to-all goes out as Megatron's alltoall dispatcher (its default,
    allgather, moves tokens otherwise); DeepEP's node-deduplicated dispatch
    (runtime moe_dispatch deepep) as flex with the deepep backend, and both read back as
    the runtime setting; torchtitan's job TOML reads expert_parallel_comm_backend."""
    doc = _doc("deepseek-ep-pp")
    model, strategy, training = model_of(doc), strategy_of(doc), training_of(doc)
    plain = export_strategy("megatron", strategy, model, training, load_runtime())
    assert "--moe-token-dispatcher-type alltoall" in plain.text and not plain.warnings
    back = read_text("megatron", plain.text, model, 8)
    assert dict(back.runtime_settings)["moe_dispatch"] == "all-to-all"
    deepep = replace(load_runtime(), moe_dispatch="deepep")
    exported = export_strategy("megatron", strategy, model, training, deepep)
    args = megatron_mirror().parse_args(shlex.split(exported.text.replace("\\\n", " ")))
    assert (args.moe_token_dispatcher_type, args.moe_flex_dispatcher_backend) == ("flex", "deepep")
    assert dict(read_text("megatron", exported.text, model, 8).runtime_settings)["moe_dispatch"] == "deepep"
    absent = read_text("megatron", plain.text.replace("--moe-token-dispatcher-type alltoall", ""), model, 8)
    assert any("absent (Megatron's default allgather)" in w for w in absent.warnings)
    toml = export_strategy("torchtitan-toml", strategy, model, training, deepep)
    assert 'expert_parallel_comm_backend = "deepep"' in toml.text
    assert not any("DeepEP" in w for w in toml.warnings)
    assert dict(read_text("torchtitan-toml", toml.text, model, 8).runtime_settings)["moe_dispatch"] == "deepep"
    standard = export_strategy("torchtitan-toml", strategy, model, training, load_runtime()).text
    assert 'expert_parallel_comm_backend = "standard"' in standard
    assert dict(read_text("torchtitan-toml", standard, model, 8).runtime_settings).get("moe_dispatch") is None
    with pytest.raises(SpecError, match="^parallelism.expert_parallel_comm_backend: expected standard or deepep"):
        read_text("torchtitan-toml", toml.text.replace('"deepep"', '"nvshmem"'), model, 8)
    assert any("DeepEPTokenDispatcher" in w
               for w in export_strategy("torchtitan", strategy, model, training, deepep).warnings)


def test_torchtitan_0_2_overlaps_dualpipev_expert_exchange_and_refuses_checkpointing():
    """torchtitan 0.2.2 runs DualPipeV's overlapped pairs on two threads meeting at dispatch
    and combine (pipeline_parallel_expert_parallel_overlap, on by default): read as the
    runtime's ep_overlap 1; with activation checkpointing it refuses to start. The export
    writes the plan's: off under the executor's runtime, on where the plan priced it."""
    doc = plan("tiny-deepseek", "dgx-a100-80gb", 32, gpus=8, seq_len=64, top=1,
               fix="dp=4,tp=1,pp=2,vpp=2,ep=4,mbs=1,zero=1,recompute=none,schedule=dualpipev")
    model, strategy, training = model_of(doc), strategy_of(doc), training_of(doc)
    text = export_plan(doc, "torchtitan-toml").text
    assert "pipeline_parallel_expert_parallel_overlap = false" in text
    assert "ep_overlap" not in dict(read_text("torchtitan-toml", text, model, 8).runtime_settings)
    default = text.replace("pipeline_parallel_expert_parallel_overlap = false\n", "")
    assert dict(read_text("torchtitan-toml", default, model, 8).runtime_settings)["ep_overlap"] == 1.0
    overlapped = replace(load_runtime(), ep_overlap=1.0)
    on = export_strategy("torchtitan-toml", strategy, model, training, overlapped)
    assert "pipeline_parallel_expert_parallel_overlap = true" in on.text
    assert not any("overlap" in w for w in on.warnings)
    # torchtitan 0.3 dropped the overlap: its overrides read as pairs run one after the other.
    assert "ep_overlap" not in dict(read_text("torchtitan", export_plan(doc, "torchtitan").text, model, 8)
                                    .runtime_settings)
    recomputed = strategy.with_stages(even_stages(6, 2, 2, "full", "dualpipev"))
    full = export_strategy("torchtitan-toml", recomputed, model, training, overlapped)
    assert "pipeline_parallel_expert_parallel_overlap = false" in full.text
    assert any("exported with the overlap off, which the plan priced on" in w for w in full.warnings)
    with pytest.raises(SpecError, match="^activation_checkpoint.mode: full with DualPipeV's expert-parallel overlap"):
        read_text("torchtitan-toml", full.text.replace("pipeline_parallel_expert_parallel_overlap = false\n", ""),
                  model, 8)


def test_fp8_experts_are_what_megatron_runs_and_the_plan_says_when_it_priced_otherwise():
    """Megatron-LM runs the experts' GEMMs in FP8 under --fp8-format: its configuration
    reads back as the runtime's fp8_experts, and a plan priced with bf16 experts (the
    executor's runtime) says so when exported there; under --runtime megatron it does not."""
    fix = "dp=8,tp=1,pp=1,ep=4,mbs=1,zero=1,recompute=none"
    native = plan("tiny-moe", "dgx-h100", 32, gpus=8, seq_len=64, precision="fp8-rowwise", fix=fix, top=1)
    exported = export_plan(native, "megatron")
    assert any("experts' GEMMs (routed and shared) in FP8" in w for w in exported.warnings)
    back = read_text("megatron", exported.text, model_of(native), 8)
    assert dict(back.runtime_settings)["fp8_experts"] is True
    megatron = plan("tiny-moe", "dgx-h100", 32, gpus=8, seq_len=64, precision="fp8-rowwise", fix=fix, top=1,
                    runtime="megatron")
    assert not any("experts" in w for w in export_plan(megatron, "megatron").warnings)
    toml = export_plan(megatron, "torchtitan-toml")
    assert any("quantize.grouped_mm.float8" in w for w in toml.warnings)


def test_torchtitan_toml_grouped_fp8_converter_reads_as_fp8_experts():
    """torchtitan 0.2.2's quantize.grouped_mm.float8 (torchao's scaled grouped GEMMs on
    the modules its fqns name) reads back as the runtime's fp8_experts; it needs the
    linear converter beside it, and torchtitan asserts pipeline and context parallelism
    off under it."""
    doc = plan("tiny-moe", "dgx-h100", 32, gpus=8, seq_len=64, precision="fp8-rowwise", top=1,
               fix="dp=8,tp=1,pp=1,ep=4,mbs=1,zero=3,recompute=none")
    text = export_plan(doc, "torchtitan-toml").text
    linear = 'converters = ["quantize.linear.float8"]'
    assert linear in text
    both = (text.replace(linear, 'converters = ["quantize.linear.float8", "quantize.grouped_mm.float8"]')
            + '\n[quantize.grouped_mm.float8]\nfqns = ["experts"]\n')
    back = read_text("torchtitan-toml", both, model_of(doc), 8)
    assert dict(back.runtime_settings)["fp8_experts"] is True and back.fp8 == "rowwise"
    assert "fp8_experts" not in dict(read_text("torchtitan-toml", text, model_of(doc), 8).runtime_settings)
    with pytest.raises(SpecError, match="^model.converters: 'quantize.grouped_mm.float8' without"):
        read_text("torchtitan-toml", both.replace('"quantize.linear.float8", ', ""), model_of(doc), 8)
    piped = plan("tiny-moe", "dgx-h100", 32, gpus=8, seq_len=64, precision="fp8-rowwise", top=1,
                 fix="dp=4,tp=1,pp=2,ep=4,mbs=1,zero=2,recompute=none,schedule=1f1b")
    piped_text = export_plan(piped, "torchtitan-toml").text
    with pytest.raises(SpecError, match="^model.converters: 'quantize.grouped_mm.float8' with pipeline parallelism"):
        read_text("torchtitan-toml", piped_text.replace(linear, 'converters = ["quantize.linear.float8", '
                                                                '"quantize.grouped_mm.float8"]')
                  + '\n[quantize.grouped_mm.float8]\nfqns = ["experts"]\n', model_of(piped), 8)


def test_whole_experts_under_tp_go_out_as_the_engines_expert_tensor_parallel_degree():
    """MoE parallel folding (Strategy.etp 1) goes out as Megatron's
    --expert-tensor-parallel-size 1 and torchtitan 0.2's expert_tensor_parallel_degree,
    experts split over tp as tp; both read back. torchtitan 0.3 keeps experts whole
    whatever the plan says (its sparse mesh has no etp): a plan splitting them is told."""
    megatron = load_runtime("megatron")
    doc = plan("tiny-moe", "dgx-h100", 32, gpus=4, seq_len=64, runtime="megatron", top=1,
               fix="dp=2,tp=2,pp=1,ep=4,etp=1,mbs=1,zero=1,recompute=none,sp=on")
    model, strategy, training = model_of(doc), strategy_of(doc), training_of(doc)
    assert (strategy.etp, strategy.ep, strategy.edp, doc["strategy"]["etp"]) == (1, 4, 1, 1)
    text = export_strategy("megatron", strategy, model, training, megatron).text
    args = megatron_mirror().parse_args(shlex.split(text.replace("\\\n", " ")))
    assert (args.tensor_model_parallel_size, args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (2, 4, 1)
    assert read_text("megatron", text, model, 4).strategy.etp == 1
    split = replace(strategy, ep=2, etp=None)
    split_text = export_strategy("megatron", split, model, training, megatron).text
    assert "--expert-tensor-parallel-size 2" in split_text
    assert read_text("megatron", split_text, model, 4).strategy.etp is None
    toml = export_strategy("torchtitan-toml", strategy, model, training, megatron).text
    assert tomllib.loads(toml)["parallelism"]["expert_tensor_parallel_degree"] == 1
    assert read_text("torchtitan-toml", toml, model, 4).strategy.etp == 1
    split_toml = export_strategy("torchtitan-toml", split, model, training, megatron).text
    assert read_text("torchtitan-toml", split_toml, model, 4).strategy.etp is None
    assert any("torchtitan 0.3 keeps the routed experts whole" in w
               for w in export_strategy("torchtitan", split, model, training, megatron).warnings)
