"""Exports: a plan's strategy as another engine's configuration. torchtitan's
command-line overrides (its Python-config releases, 0.3) or job TOML (0.2), Megatron-LM's
command-line arguments, or a DeepSpeed config JSON. Each exporter returns the text and
warnings for what the engine cannot express, in the engine's own terms; then the text is
read back with `planner.importers` and any difference from the plan is a warning too,
so nothing is dropped silently.

Option names come from the engines' sources, cited at each constant in
`planner.importers` (which owns what an engine's options mean); the mapping choices are
explained here where they are made.
"""

from __future__ import annotations

import itertools

import json
from dataclasses import dataclass

from costmodel.specs.loading import SpecError
from costmodel.specs import ModelSpec, TrainingSpec
from costmodel.strategy import Strategy
from planner import importers
from planner.evaluate import strategy_changes
from planner.importers import Recompute, megatron_split, torchtitan_num_stages, torchtitan_split
from planner.plan import is_traced, model_of, strategy_of

TARGETS = ("torchtitan", "torchtitan-toml", "megatron", "deepspeed")


@dataclass(frozen=True)
class Exported:
    text: str
    warnings: tuple[str, ...]


def recompute_form(strategy: Strategy) -> Recompute | None:
    """The plan's recomputation as engines state it, or None when it mixes modes or
    counts in a way no single setting says (the partition program chooses per stage)."""
    stages = strategy.stages
    if all(s.selective_recompute_layers == s.num_layers and not s.full_recompute_layers for s in stages):
        return Recompute("selective")
    if any(s.selective_recompute_layers for s in stages):
        return None
    if all(not s.full_recompute_layers for s in stages):
        return Recompute("none")
    if all(s.full_recompute_layers == s.num_layers for s in stages):
        return Recompute("full")
    most = max(s.full_recompute_layers for s in stages)
    if all(s.full_recompute_layers == min(most, s.num_layers) for s in stages):
        return Recompute("full", most)
    return None


def _per_stage(strategy: Strategy) -> str:
    """"1 of 96 layers fully, 0 selectively": the plan's recomputation in a few words."""
    full = sum(s.full_recompute_layers for s in strategy.stages)
    selective = sum(s.selective_recompute_layers for s in strategy.stages)
    return f"{full} of {sum(s.num_layers for s in strategy.stages)} layers fully, {selective} selectively"


def _all_or_nothing(strategy: Strategy, engine: str, where: str, warnings: list[str]) -> str:
    """For engines that recompute every layer or none: the plan's mode, with a warning
    where the plan recomputes only some layers (exported as all of them: it then fits)."""
    form = recompute_form(strategy)
    if form is not None and form.full_layers is None:
        return form.mode
    warnings.append(f"{engine} recomputes every layer or none ({where}); the plan recomputes per stage "
                    f"({_per_stage(strategy)}): exported as full recompute of every layer")
    return "full"


# ---------------------------------------------------------------------------
# torchtitan


def _torchtitan_partition(strategy: Strategy, layers: int, warnings: list[str]) -> dict:
    """The first/last-stage-less-layers and layers-per-stage that make torchtitan's
    split give the plan's stages (importers.torchtitan_split), or its closest split."""
    sizes = [s.num_layers for s in strategy.stages]
    count = len(sizes)
    name = _TT_SCHEDULE[strategy.schedule]
    best = None
    for first in range(0, max(sizes) + 2):
        for last in range(0, max(sizes) + 2):
            split = torchtitan_split(layers, count, first, last)
            per_stage = _layers_per_stage(layers, strategy.pp, name, first, last, count)
            if split is None or per_stage is False:
                continue
            distance = (sum(abs(a - b) for a, b in zip(split, sizes)), (first, last) != (1, 1), first + last)
            if best is None or distance < best[0]:
                best = (distance, first, last, split, per_stage)
    if best is None:
        warnings.append(f"torchtitan cannot build {count} pipeline stages of {layers} layers "
                        "(pipeline_parallel_layers_per_stage)")
        return {}
    _, first, last, split, per_stage = best
    if split != sizes:
        warnings.append(f"torchtitan's split (pipeline_parallel_first/last_stage_less_layers) cannot give the "
                        f"plan's layers per stage {sizes}; exported its closest, {split}: to run the plan's, set "
                        "parallelism.module_fqns_per_model_part (module names depend on the model)")
    out = {"pipeline_parallel_first_stage_less_layers": first, "pipeline_parallel_last_stage_less_layers": last}
    if per_stage is not None:
        out["pipeline_parallel_layers_per_stage"] = per_stage
    return out


def _layers_per_stage(layers: int, pp: int, name: str, first: int, last: int, count: int) -> int | None | bool:
    """The pipeline_parallel_layers_per_stage that makes torchtitan build `count`
    stages: None where its default does, False where no value does."""
    if torchtitan_num_stages(layers, pp, name, None, first, last) == count:
        return None
    effective = layers + first + last
    return next((n for n in range(1, effective + 1) if -(-effective // n) == count), False)


_TT_SCHEDULE = {v: k for k, v in importers.TORCHTITAN_SCHEDULES.items()}


def _torchtitan_fields(strategy: Strategy, model: ModelSpec, training: TrainingSpec,
                       toml: bool) -> tuple[dict, dict, str, list[str]]:
    """(parallelism fields, training fields, AC mode, warnings) for either release."""
    s, warnings = strategy, []
    release = "torchtitan 0.2" if toml else "torchtitan"
    par: dict = {}
    if s.zero_stage == 0:
        par.update(data_parallel_replicate_degree=s.dp, data_parallel_shard_degree=1)
        if toml and s.dp > 1 and (s.tp > 1 or s.pp > 1):
            warnings.append("torchtitan 0.2 refuses DDP beside tp or pp (models/llama3/infra/parallelize.py: "
                            "'DDP has not supported > 1D parallelism'); use --to torchtitan (0.3) or ZeRO-3")
    else:
        # FSDP2 over the data-parallel ranks: resharding after forward is ZeRO-3, keeping
        # the weights gathered until backward is ZeRO-2 (Shardwise's executor runs ZeRO-2 so).
        par.update(data_parallel_replicate_degree=1, data_parallel_shard_degree=s.dp,
                   fsdp_reshard_after_forward="always" if s.zero_stage == 3 else "never")
        if s.zero_stage == 1:
            warnings.append("torchtitan has no ZeRO-1 (optimizer states sharded beside replicated weights and "
                            "gradients): its data parallelism is DDP (data_parallel_replicate_degree) or FSDP2 "
                            "(data_parallel_shard_degree); exported as FSDP2 with fsdp_reshard_after_forward "
                            "never, ZeRO-2")
    par["tensor_parallel_degree"] = s.tp
    if s.tp > 1:
        if toml:
            if not s.sequence_parallel:
                warnings.append("torchtitan 0.2 always runs sequence parallelism with tensor parallelism (no "
                                "enable_sequence_parallel); the plan has it off")
        else:
            par["enable_sequence_parallel"] = s.sequence_parallel
    par["pipeline_parallel_degree"] = s.pp
    if s.pp > 1:
        par["pipeline_parallel_schedule"] = _TT_SCHEDULE[s.schedule]
        par["pipeline_parallel_microbatch_size"] = s.micro_batch_size
        par.update(_torchtitan_partition(s, model.num_hidden_layers, warnings))
    par["context_parallel_degree"] = 1
    par["expert_parallel_degree"] = s.ep
    if s.ep > 1 and (s.zero_stage != 3 or s.tp > 1):
        warnings.append("torchtitan's expert parallelism borrows its ranks from data_parallel_shard_degree x "
                        "tensor_parallel_degree (ParallelismConfig.expert_parallel_degree), so its experts are "
                        f"neither replicated over dp shards nor split over tp as the plan's ep {s.ep} with ZeRO-"
                        f"{s.zero_stage}, tp {s.tp} prices them")
    # Without pp a step accumulates global / (local x dp) gradients; with pp the local
    # batch is cut into micro-batches of pipeline_parallel_microbatch_size.
    local = s.micro_batch_size * (s.num_microbatches if s.pp > 1 else 1)
    train = {"local_batch_size": local, "global_batch_size": training.global_batch, "seq_len": training.seq_len}
    if training.precision == "fp16":
        warnings.append("torchtitan trains in bfloat16 or float32 (TrainingConfig.mixed_precision_param): "
                        "fp16 exported as bfloat16")
    train["mixed_precision_param"] = "float32" if training.precision == "fp32" else "bfloat16"
    ac = _all_or_nothing(s, release, "activation checkpointing applies one policy to every block", warnings)
    if ac == "selective":
        warnings.append(f"{release}'s selective activation checkpointing is per-op (it saves matmul and attention "
                        "outputs but recomputes every second matmul), not the plan's attention-core-only selective "
                        "recompute: its memory and time differ")
    return par, train, ac, warnings


def _flag(section: str, key: str, value) -> str:
    if isinstance(value, bool):
        # tyro's boolean flags: --section.field / --section.no-field
        return f"--{section}.{key}" if value else f"--{section}.no-{key}"
    return f"--{section}.{key} {value}"


def export_torchtitan(strategy: Strategy, model: ModelSpec, training: TrainingSpec) -> Exported:
    """Overrides for `torchtitan/train.py --module M --config C ...` (0.3: tyro flags
    `--parallelism.<field>`, `--training.<field>`, and the activation-checkpoint
    subcommand last, as torchtitan spells it in distributed/minimal_async_ep/api.py)."""
    par, train, ac, warnings = _torchtitan_fields(strategy, model, training, toml=False)
    words = [_flag("parallelism", k, v) for k, v in par.items()] + [_flag("training", k, v) for k, v in train.items()]
    words.append(f"activation-checkpoint:{ac}")
    return Exported(" \\\n".join(words) + "\n", tuple(warnings))


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)   # a TOML basic string is a JSON string for these values
    return str(value)


def export_torchtitan_toml(strategy: Strategy, model: ModelSpec, training: TrainingSpec) -> Exported:
    """The [parallelism], [training] and [activation_checkpoint] sections of a torchtitan
    0.2 job TOML (torchtitan 0.2.2 config/job_config.py)."""
    par, train, ac, warnings = _torchtitan_fields(strategy, model, training, toml=True)
    lines = ["[parallelism]"] + [f"{k} = {_toml_value(v)}" for k, v in par.items()]
    lines += ["", "[training]"] + [f"{k} = {_toml_value(v)}" for k, v in train.items()]
    lines += ["", "[activation_checkpoint]", f"mode = {_toml_value(ac)}"]
    if ac == "selective":
        lines.append('selective_ac_option = "op"')
    return Exported("\n".join(lines) + "\n", tuple(warnings))


# ---------------------------------------------------------------------------
# Megatron-LM


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


def export_megatron(strategy: Strategy, model: ModelSpec, training: TrainingSpec) -> Exported:
    """Megatron-LM arguments for `pretrain_gpt.py` (names: planner.importers.MEGATRON_*)."""
    s, warnings = strategy, []
    args = ["--tensor-model-parallel-size", str(s.tp), "--pipeline-model-parallel-size", str(s.pp)]
    if s.schedule == "gpipe" and s.pp > 1:
        warnings.append("Megatron-LM has no GPipe schedule (megatron/core/pipeline_parallel/schedules.py: "
                        "1F1B without or with interleaving); exported as 1F1B")
    args += _megatron_partition(s, model.num_hidden_layers)
    args += ["--micro-batch-size", str(s.micro_batch_size), "--global-batch-size", str(training.global_batch)]
    if s.sequence_parallel:
        args.append("--sequence-parallel")
    form = recompute_form(s)
    if form is None:
        if any(st.selective_recompute_layers for st in s.stages) and any(st.full_recompute_layers for st in s.stages):
            warnings.append("Megatron-LM has one --recompute-granularity for all layers; the plan mixes selective "
                            f"and full recompute ({_per_stage(s)}): exported as full")
            form = Recompute("full")
        else:
            most = max(st.full_recompute_layers for st in s.stages)
            warnings.append("Megatron-LM recomputes the same number of layers in each virtual stage "
                            "(--recompute-method block --recompute-num-layers); the plan's differ by stage "
                            f"({_per_stage(s)}): exported as the most, {most} per stage")
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
    args += ["--context-parallel-size", "1", "--expert-model-parallel-size", str(s.ep)]
    args += ["--num-layers", str(model.num_hidden_layers), "--hidden-size", str(model.hidden_size),
             "--ffn-hidden-size", str(model.intermediate_size), "--num-attention-heads", str(model.num_attention_heads)]
    if model.num_key_value_heads != model.num_attention_heads:
        args += ["--group-query-attention", "--num-query-groups", str(model.num_key_value_heads)]
    if model.is_moe:
        args += ["--num-experts", str(model.num_local_experts), "--moe-router-topk", str(model.num_experts_per_tok)]
    if not model.is_gpt:
        args += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear"]
    if not model.tie_word_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    args += ["--seq-length", str(training.seq_len), "--max-position-embeddings", str(model.max_position_embeddings)]
    if training.precision in ("bf16", "fp16"):
        args.append(f"--{training.precision}")
    lines, line = [], []
    for word in args:   # one argument (with its value) per line
        if word.startswith("--") and line:
            lines.append(" ".join(line))
            line = []
        line.append(word)
    lines.append(" ".join(line))
    return Exported(" \\\n".join(lines) + "\n", tuple(warnings))


# ---------------------------------------------------------------------------
# DeepSpeed


def export_deepspeed(strategy: Strategy, model: ModelSpec, training: TrainingSpec) -> Exported:
    """A DeepSpeed config JSON (keys: planner.importers.DEEPSPEED_KEYS). The pipeline and
    expert degrees are not config keys in DeepSpeed: they are said in warnings."""
    s, warnings = strategy, []
    config: dict = {"train_batch_size": training.global_batch, "train_micro_batch_size_per_gpu": s.micro_batch_size,
                    "gradient_accumulation_steps": s.num_microbatches, "zero_optimization": {"stage": s.zero_stage}}
    if training.precision in ("bf16", "fp16"):
        config[training.precision] = {"enabled": True}
    if s.tp > 1:
        config["tensor_parallel"] = {"autotp_size": s.tp}
        warnings.append(f"tensor_parallel.autotp_size {s.tp} is DeepSpeed's AutoTP training, which shards "
                        "Hugging Face models by their module names (runtime/tensor_parallel/config.py); other "
                        "models need Megatron-DeepSpeed's tensor-parallel layers")
    if s.sequence_parallel:
        warnings.append("DeepSpeed has no Megatron-style sequence parallelism over the tp ranks (its Ulysses "
                        "sequence parallelism splits attention heads over a group of its own): not exported")
    if s.pp > 1:
        warnings.append(f"DeepSpeed sets the pipeline in code, not in the config: deepspeed.pipe.PipelineModule("
                        f"layers, num_stages={s.pp}, partition_method='uniform') for the plan's pp {s.pp} "
                        "(runtime/pipe/module.py); the degree follows from train_batch_size")
        if s.zero_stage >= 2:
            warnings.append(f"DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3 (runtime/pipe/engine.py); "
                            f"the plan has pp {s.pp} with ZeRO-{s.zero_stage}")
        if s.schedule != "1f1b":
            warnings.append(f"DeepSpeed's pipeline engine runs its own 1F1B TrainSchedule (runtime/pipe/schedule.py); "
                            f"the plan's {s.schedule}" + (f" with vpp {s.vpp}" if s.vpp > 1 else "") + " is not exported")
    if s.ep > 1:
        warnings.append(f"DeepSpeed sets expert parallelism in code: deepspeed.moe.layer.MoE(..., ep_size={s.ep}) "
                        "(deepspeed/moe/layer.py)")
    mode = recompute_form(s)
    if mode is not None and mode.mode == "selective":
        warnings.append("DeepSpeed has no selective (attention-core) recompute: exported without recompute")
        mode = Recompute("none")
    elif mode is None or mode.full_layers is not None:
        mode = Recompute(_all_or_nothing(s, "DeepSpeed", "its pipeline checkpoints every n-th layer; "
                                          "deepspeed.checkpointing wraps what the model wraps", warnings))
    if mode.mode == "full":
        if s.pp > 1:
            config["pipeline"] = {"activation_checkpoint_interval": 1}
        else:
            config["activation_checkpointing"] = {"number_checkpoints": model.num_hidden_layers}
            warnings.append("activation_checkpointing configures deepspeed.checkpointing; the model must call "
                            "deepspeed.checkpointing.checkpoint on each layer (the config does not turn recompute on)")
    return Exported(json.dumps(config, indent=2) + "\n", tuple(warnings))


_EXPORTERS = {"torchtitan": export_torchtitan, "torchtitan-toml": export_torchtitan_toml,
              "megatron": export_megatron, "deepspeed": export_deepspeed}


def export_strategy(target: str, strategy: Strategy, model: ModelSpec, training: TrainingSpec) -> Exported:
    """The target's configuration for `strategy`, with what it cannot express as warnings;
    the text is read back and any strategy it describes other than the plan's is one more."""
    if target not in _EXPORTERS:
        raise SpecError("--to", f"unknown target {target!r} (known: {', '.join(TARGETS)})")
    exported = _EXPORTERS[target](strategy, model, training)
    exported = Exported(exported.text, exported.warnings + _group_warnings(target, strategy))
    try:
        back = importers.read_text(target, exported.text, model, strategy.num_gpus)
    except SpecError as err:
        return Exported(exported.text, exported.warnings + (f"{target} refuses this configuration: {err}",))
    changes = strategy_changes(strategy, back.strategy)
    if changes:
        return Exported(exported.text, exported.warnings + (f"{target} will run this configuration with "
                                                            f"{', '.join(changes)} (plan → exported)",))
    return exported


def _group_warnings(target: str, strategy: Strategy) -> tuple[str, ...]:
    """What a mixed-cluster plan holds that no engine's configuration says."""
    s = strategy
    if s.stage_groups:
        spans, first = [], 0
        for name, run in itertools.groupby(s.stage_groups):
            count = len(list(run))
            spans.append(f"{first if count == 1 else f'{first}-{first + count - 1}'} on {name}")
            first += count
        placed = "pipeline ranks " + ", ".join(spans)
        return (f"{target} has no device groups: the plan puts {placed}; start the nodes so that global ranks "
                f"r x {s.dp * s.tp} onwards are on pipeline rank r's group",)
    if s.replica_groups:
        runs = itertools.groupby(zip(s.replica_groups, s.replica_microbatches))
        shares = ", ".join(f"{len(list(run))} on {name} {m} each" for (name, m), run in runs)
        return (f"{target} gives every data-parallel replica the same share of the batch; the plan's replicas run "
                f"micro-batches by their group's speed ({shares}), which no {target} option says: the export "
                f"takes {s.num_microbatches} for all",)
    return ()


def export_plan(doc: dict, target: str) -> Exported:
    """Export a plan document (read with planner.plan.read_plan)."""
    if is_traced(doc):
        raise SpecError("plan.model", "a traced module's plan has no transformer layers an engine could place")
    return export_strategy(target, strategy_of(doc), model_of(doc), TrainingSpec(**doc["training"]))
