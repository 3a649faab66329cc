"""What a training engine's configuration means, as a Shardwise Strategy: torchtitan's
command-line overrides (its Python-config releases, 0.3) or job TOML (0.2), Megatron-LM's
command-line arguments, and a DeepSpeed config JSON. Each reader returns the strategy
with its stages, the batch, sequence and precision the config states, and warnings for
what it had to assume; a config that is malformed or contradicts itself, the model or the
cluster raises SpecError naming the engine's own field (exit code 2).

This module also owns the engines' own stage partitions (`torchtitan_split`,
`megatron_split`, `megatron_layout_sizes`), which `planner.export` inverts. Files are read
with tomllib and json only. Every option name below cites the engine source file it comes
from: torchtitan 0.3.0 `torchtitan/config/configs.py` (ParallelismConfig, TrainingConfig)
and `torchtitan/trainer.py`, torchtitan 0.2.2 `torchtitan/config/job_config.py`,
DeepSpeed 0.19.8 `deepspeed/runtime/config.py`, `runtime/zero/config.py`,
`runtime/tensor_parallel/config.py`, `runtime/pipe/engine.py`,
`runtime/activation_checkpointing/config.py`; Megatron-LM's `megatron/training/arguments.py`
is not on PyPI, so its names are those of megatron-core 0.16.1's config fields
(`ModelParallelConfig`, `TransformerConfig`, `DistributedDataParallelConfig`, which
Megatron-LM fills from its arguments of the same names with dashes) and, where an
argument is spelled differently from its field, Megatron-LM's arguments.py as we know it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

from costmodel.specs.loading import SpecError
from costmodel.specs import ModelSpec
from costmodel.strategy import Stage, Strategy, summarize_recompute

SOURCES = ("torchtitan", "megatron", "deepspeed")


@dataclass(frozen=True)
class Imported:
    """A configuration read back: the strategy (with stages), what the config says of
    the training run (None where it says nothing) and what was assumed."""

    strategy: Strategy
    global_batch: int | None
    seq_len: int | None
    precision: str | None
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class Recompute:
    """Recomputation as engines state it: a mode for every layer, or with
    `full_layers` set, the first `full_layers` of each virtual stage fully recomputed
    (Megatron's `--recompute-method block`)."""

    mode: str = "none"                 # none | selective | full
    full_layers: int | None = None     # None: every layer of the mode
    every_nth: int | None = None       # torchtitan 0.2: every n-th layer of a rank fully recomputed


# ---------------------------------------------------------------------------
# The engines' stage partitions


def torchtitan_split(num_layers: int, num_stages: int, first_less: int, last_less: int) -> list[int] | None:
    """Layers per virtual stage as torchtitan places them: the embedding counts as
    `first_less` layers and the output as `last_less`, the effective layers are spread
    evenly with earlier stages taking the remainder (torchtitan 0.3.0
    `distributed/pipeline_parallel.py`, _generate_llm_fqn_per_model_part). None where
    torchtitan refuses the split."""
    if num_stages == 1:
        return [num_layers]
    effective = num_layers + first_less + last_less
    base, extra = divmod(effective, num_stages)
    if base == 0 or first_less > base or last_less > base:
        return None
    sizes, placed = [], 0
    for i in range(num_stages):
        want = base + (1 if i < extra else 0) - (first_less if i == 0 else last_less if i == num_stages - 1 else 0)
        take = max(0, min(want, num_layers - placed))
        sizes.append(take)
        placed += take
    return sizes if placed == num_layers else None


def torchtitan_num_stages(num_layers: int, pp: int, schedule_name: str, layers_per_stage: int | None,
                          first_less: int, last_less: int) -> int:
    """Virtual stages torchtitan makes (torchtitan 0.3.0 `distributed/pipeline_parallel.py`,
    _get_pipeline_metadata): ceil((layers + first_less + last_less) / layers_per_stage),
    or without it one per rank for single-stage schedules and two for looped ones."""
    if layers_per_stage is None:
        return pp * (1 if schedule_name in SINGLE_STAGE_SCHEDULES else 2)
    return math.ceil((num_layers + first_less + last_less) / layers_per_stage)


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


def build_stages(sizes: list[int], pp: int, recompute: Recompute) -> tuple[Stage, ...]:
    """Stages of the given sizes in virtual-stage order (stage i on pipeline rank i mod
    pp, the interleaved layout of Megatron and torch.distributed.pipelining)."""
    stages, first = [], 0
    for i, n in enumerate(sizes):
        full = selective = 0
        if recompute.mode == "full":
            full = n if recompute.full_layers is None else min(n, recompute.full_layers)
        elif recompute.mode == "selective":
            selective = n
        stages.append(Stage(i, i % pp, first, n, full, selective))
        first += n
    return tuple(stages)


def _strategy(dp: int, tp: int, pp: int, mbs: int, microbatches: int, vpp: int, ep: int, schedule: str, zero: int,
              sp: bool, stages: tuple[Stage, ...]) -> Strategy:
    if pp == 1:
        schedule = "1f1b"   # no pipeline: the planner names the schedule 1f1b (planner.space)
    return Strategy(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=microbatches, vpp=vpp, ep=ep,
                    schedule=schedule, zero_stage=zero, recompute=summarize_recompute(stages),
                    sequence_parallel=sp, stages=stages)


def _divide(total: int, part: int, field_name: str, what: str) -> int:
    if part <= 0 or total % part:
        raise SpecError(field_name, f"{what}: {part} does not divide {total}")
    return total // part


def _check_model(pairs: list[tuple[str, object, object]], model: ModelSpec) -> None:
    """(field, config value, model value): a config describing another model is refused."""
    for field_name, given, expected in pairs:
        if given is not None and given != expected:
            raise SpecError(field_name, f"{given}, but {model.name} has {expected}")


# ---------------------------------------------------------------------------
# torchtitan

# torchtitan 0.3.0 torchtitan/config/configs.py: the fields of ParallelismConfig and
# TrainingConfig (its CLI surface `--parallelism.<field>` / `--training.<field>`, parsed by
# tyro, which accepts the field names with underscores or dashes).
TORCHTITAN_PARALLELISM_FIELDS = (
    "data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
    "enable_fsdp_symm_mem", "tensor_parallel_degree", "enable_sequence_parallel", "spmd_backend",
    "pipeline_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
    "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size", "context_parallel_degree",
    "context_parallel_load_balancer", "context_parallel_ptrr_mask_key", "expert_parallel_degree",
)
TORCHTITAN_TRAINING_FIELDS = (
    "local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps", "enable_cpu_offload",
    "disable_cuda_graphs", "dtype", "mixed_precision_param", "mixed_precision_reduce", "gc_freq", "gc_debug",
)
# torchtitan 0.2.2 torchtitan/config/job_config.py: fields of Parallelism and Training the
# older job TOML may hold beyond those (0.3.0 dropped them).
TORCHTITAN_TOML_EXTRA_FIELDS = {
    "parallelism": ("disable_loss_parallel", "enable_async_tensor_parallel", "pipeline_parallel_expert_parallel_overlap",
                    "context_parallel_rotate_method", "expert_tensor_parallel_degree", "expert_parallel_comm_backend"),
    "training": ("dataset", "dataset_path", "dataloader"),
}
# Schedule names of torch.distributed.pipelining.schedules.get_schedule_class (the
# names torchtitan's pipeline_parallel_schedule takes), Shardwise's name for each.
TORCHTITAN_SCHEDULES = {"GPipe": "gpipe", "1F1B": "1f1b", "Interleaved1F1B": "interleaved"}
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
# torchtitan 0.3.0 distributed/activation_checkpoint.py ActivationCheckpointingConfig: a
# tyro subcommand per policy; the Trainer.Config default is SelectiveAC (trainer.py).
TORCHTITAN_AC_SUBCOMMANDS = {"selective": "selective", "full": "full", "none": "none", "memory-budget": None}
TORCHTITAN_DEFAULTS = {
    "data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1, "fsdp_reshard_after_forward": "default",
    "tensor_parallel_degree": 1, "enable_sequence_parallel": True, "pipeline_parallel_degree": 1,
    "pipeline_parallel_first_stage_less_layers": 1, "pipeline_parallel_last_stage_less_layers": 1,
    "pipeline_parallel_layers_per_stage": None, "pipeline_parallel_schedule": "1F1B",
    "pipeline_parallel_microbatch_size": 1, "context_parallel_degree": 1, "expert_parallel_degree": 1,
    "module_fqns_per_model_part": None,
    "local_batch_size": 8, "global_batch_size": -1, "seq_len": 2048, "dtype": "float32",
    "mixed_precision_param": "bfloat16",
}


def _override_tokens(text: str) -> list[str]:
    """Shell words of pasted overrides (backslash-newline continuations joined)."""
    try:
        return shlex.split(text.replace("\\\n", " "))
    except ValueError as err:
        raise SpecError("overrides", f"cannot split into words: {err}") from None


def parse_torchtitan_overrides(text: str) -> tuple[dict[str, dict], str | None, list[str]]:
    """`--parallelism.tensor_parallel_degree 4 ... activation-checkpoint:full` ->
    ({"parallelism": {...}, "training": {...}}, AC subcommand or None, warnings)."""
    sections: dict[str, dict] = {"parallelism": {}, "training": {}}
    known = {"parallelism": TORCHTITAN_PARALLELISM_FIELDS, "training": TORCHTITAN_TRAINING_FIELDS}
    subcommand, ignored = None, []
    words = _override_tokens(text)
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if re.fullmatch(r"activation[-_]checkpoint:[a-z-]+", word):
            subcommand = word.split(":", 1)[1]
            if subcommand not in TORCHTITAN_AC_SUBCOMMANDS:
                raise SpecError("activation_checkpoint", f"unknown policy {subcommand!r} "
                                f"(known: {', '.join(TORCHTITAN_AC_SUBCOMMANDS)})")
            continue
        if not word.startswith("--"):
            ignored.append(word)
            continue
        name, eq, value = word[2:].partition("=")
        section, dot, key = name.partition(".")
        takes_value = not (eq or i >= len(words) or words[i].startswith("--") or ":" in words[i])
        if section not in sections or not dot:
            i += takes_value   # the value of an option Shardwise does not read
            if name not in ("module", "config"):   # torchtitan's model and config_registry choice
                ignored.append("--" + name)
            continue
        key = key.replace("-", "_")
        negated = key.startswith("no_") and key[3:] in known[section]
        field_name = key[3:] if negated else key
        if field_name not in known[section]:
            cls = "ParallelismConfig" if section == "parallelism" else "TrainingConfig"
            raise SpecError(f"--{section}.{key}", f"not a field of torchtitan's {cls}")
        if negated:
            sections[section][field_name] = False
        elif eq:
            sections[section][field_name] = value
        elif takes_value:
            sections[section][field_name] = words[i]
            i += 1
        else:
            sections[section][field_name] = True
    warnings = [f"ignored (not a parallelism or training field Shardwise reads): {' '.join(ignored)}"] if ignored else []
    return sections, subcommand, warnings


def _tt_int(sections: dict, section: str, key: str, minimum: int = 1, allow: tuple = ()) -> int:
    value = sections[section].get(key, TORCHTITAN_DEFAULTS[key])
    field_name = f"{section}.{key}"
    try:
        number = int(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or (number < minimum and number not in allow):
        raise SpecError(field_name, f"expected an integer >= {minimum}, got {value!r}")
    return number


def _tt_value(sections: dict, section: str, key: str):
    return sections[section].get(key, TORCHTITAN_DEFAULTS[key])


def _tt_bool(value, field_name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise SpecError(field_name, f"expected true or false, got {value!r}")


def read_torchtitan(text: str, model: ModelSpec, num_gpus: int, toml: bool = False,
                    global_batch: int | None = None) -> Imported:
    """torchtitan overrides, or with `toml` the text of a 0.2 job TOML. Overrides change
    a config_registry function's config Shardwise does not see, so a global batch they
    leave out is `global_batch` where given (a TOML leaving it out means torchtitan's -1)."""
    if toml:
        sections, ac, warnings = _torchtitan_toml(text)
    else:
        sections, subcommand, warnings = parse_torchtitan_overrides(text)
        if subcommand is None:
            warnings.append("no activation-checkpoint policy given: torchtitan's Trainer.Config default "
                            "(SelectiveAC, torchtitan/trainer.py) is assumed")
            subcommand = "selective"
        ac = Recompute(TORCHTITAN_AC_SUBCOMMANDS[subcommand] or "none")
        if TORCHTITAN_AC_SUBCOMMANDS[subcommand] is None:
            raise SpecError("activation_checkpoint", "memory-budget AC is the compiler's choice; Shardwise cannot price it")
    return _torchtitan_strategy(sections, ac, warnings, model, num_gpus, None if toml else global_batch)


def _read_file(path: str, kind: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as err:
        raise SpecError("--from", f"cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise SpecError("--from", f"{path} is not {kind} text: {err}") from None


def _torchtitan_toml(text: str) -> tuple[dict, Recompute, list[str]]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise SpecError("--from", f"not valid TOML: {err}") from None
    sections = {}
    for section, names in (("parallelism", TORCHTITAN_PARALLELISM_FIELDS), ("training", TORCHTITAN_TRAINING_FIELDS)):
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise SpecError(section, "expected a table")
        unknown = sorted(set(table) - set(names) - set(TORCHTITAN_TOML_EXTRA_FIELDS[section]))
        if unknown:
            raise SpecError(f"{section}.{unknown[0]}", "not a field of torchtitan's job config")
        sections[section] = dict(table)
    ac_table = data.get("activation_checkpoint", {})
    mode = str(ac_table.get("mode", "selective")) if isinstance(ac_table, dict) else None
    # torchtitan 0.2.2 job_config.py ActivationCheckpoint: mode selective|full|memory_budget|none;
    # selective_ac_option "op" (per-op SAC) or an integer n (every n-th layer fully recomputed).
    warnings = []
    if mode == "full" or mode == "none":
        ac = Recompute(mode)
    elif mode == "selective":
        option = str(ac_table.get("selective_ac_option", "2"))
        if option == "op":
            ac = Recompute("selective")
        elif option.isdigit() and int(option) >= 1:
            ac = Recompute("full", every_nth=None if int(option) == 1 else int(option))
        else:
            raise SpecError("activation_checkpoint.selective_ac_option", f"expected 'op' or an integer, got {option!r}")
    else:
        raise SpecError("activation_checkpoint.mode", f"expected selective, full or none, got {mode!r}")
    if "activation_checkpoint" not in data:
        warnings.append("no [activation_checkpoint] section: torchtitan's default (mode selective, "
                        "selective_ac_option 2: every 2nd layer) is assumed")
    return sections, ac, warnings


def _torchtitan_strategy(sections: dict, ac: Recompute, warnings: list[str], model: ModelSpec,
                         num_gpus: int, global_hint: int | None) -> Imported:
    p = "parallelism"
    replicate = _tt_int(sections, p, "data_parallel_replicate_degree")
    shard = _tt_int(sections, p, "data_parallel_shard_degree", allow=(-1,))
    tp = _tt_int(sections, p, "tensor_parallel_degree")
    pp = _tt_int(sections, p, "pipeline_parallel_degree")
    cp = _tt_int(sections, p, "context_parallel_degree")
    ep = _tt_int(sections, p, "expert_parallel_degree")
    if cp > 1:
        raise SpecError("parallelism.context_parallel_degree", f"{cp}: Shardwise does not model context parallelism")
    if shard == -1:
        # torchtitan 0.3.0 ParallelismConfig: -1 takes the ranks left after the other degrees.
        shard = _divide(num_gpus, replicate * tp * pp * cp, "parallelism.data_parallel_shard_degree",
                        f"replicate x tp x pp x cp of the cluster's {num_gpus} GPUs")
    if replicate * shard * tp * pp * cp != num_gpus:
        raise SpecError("parallelism", f"replicate {replicate} x shard {shard} x tp {tp} x pp {pp} = "
                        f"{replicate * shard * tp * pp}, but the cluster has {num_gpus} GPUs")
    dp = replicate * shard
    reshard = str(_tt_value(sections, p, "fsdp_reshard_after_forward"))
    if reshard not in ("default", "always", "never"):
        raise SpecError("parallelism.fsdp_reshard_after_forward", f"expected default, always or never, got {reshard!r}")
    if shard == 1:
        zero = 0
    else:
        # torchtitan 0.3.0 distributed/fsdp.py get_fsdp_reshard_after_forward_policy:
        # "default" keeps the weights gathered after forward under pp (ZeRO-2-like).
        keeps = reshard == "never" or (reshard == "default" and pp > 1)
        zero = 2 if keeps else 3
        if replicate > 1:
            warnings.append(f"HSDP (replicate {replicate} x shard {shard}) is priced as ZeRO-{zero} over all {dp} "
                            "data-parallel ranks: Shardwise shards over the whole data-parallel group")
    sp = tp > 1 and _tt_bool(_tt_value(sections, p, "enable_sequence_parallel"), "parallelism.enable_sequence_parallel")
    name = str(_tt_value(sections, p, "pipeline_parallel_schedule"))
    if pp > 1 and name not in TORCHTITAN_SCHEDULES:
        raise SpecError("parallelism.pipeline_parallel_schedule",
                        f"{name!r}: Shardwise prices {', '.join(TORCHTITAN_SCHEDULES)}")
    schedule = TORCHTITAN_SCHEDULES.get(name, "1f1b")

    layers = model.num_hidden_layers
    first_less = _tt_int(sections, p, "pipeline_parallel_first_stage_less_layers", minimum=0)
    last_less = _tt_int(sections, p, "pipeline_parallel_last_stage_less_layers", minimum=0)
    per_stage = sections[p].get("pipeline_parallel_layers_per_stage")
    per_stage = None if per_stage in (None, "None") else _tt_int(sections, p, "pipeline_parallel_layers_per_stage")
    fqns = sections[p].get("module_fqns_per_model_part")
    if pp == 1:
        sizes = [layers]
    elif fqns not in (None, "None"):
        sizes = _fqn_sizes(fqns, layers)
    else:
        count = torchtitan_num_stages(layers, pp, name, per_stage, first_less, last_less)
        sizes = torchtitan_split(layers, count, first_less, last_less)
        if sizes is None:
            raise SpecError("parallelism.pipeline_parallel_layers_per_stage",
                            f"torchtitan cannot split {layers} layers into {count} stages with first/last "
                            f"stage less layers {first_less}/{last_less}")
    if len(sizes) % pp:
        raise SpecError("parallelism.pipeline_parallel_layers_per_stage",
                        f"{len(sizes)} virtual stages do not divide over pp {pp}")
    vpp = len(sizes) // pp
    if vpp > 1 and schedule != "interleaved":
        raise SpecError("parallelism.pipeline_parallel_schedule", f"{name} runs one stage per rank, not {vpp}")
    if vpp == 1 and schedule == "interleaved":
        raise SpecError("parallelism.pipeline_parallel_schedule", "Interleaved1F1B needs 2 or more stages per rank")

    t = "training"
    local = _tt_int(sections, t, "local_batch_size")
    if "local_batch_size" not in sections[t]:
        warnings.append("training.local_batch_size not given: torchtitan's default 8 is assumed")
    given_global = _tt_int(sections, t, "global_batch_size", allow=(-1,))
    global_batch = given_global if given_global != -1 else global_hint or local * dp
    accumulation = _divide(global_batch, local * dp, "training.global_batch_size",
                           f"local_batch_size {local} x dp {dp}")
    if pp > 1:
        mbs = _tt_int(sections, p, "pipeline_parallel_microbatch_size")
        microbatches = _divide(local, mbs, "parallelism.pipeline_parallel_microbatch_size",
                               "the micro-batch size must divide training.local_batch_size") * accumulation
        if accumulation > 1:
            warnings.append(f"torchtitan runs {accumulation} pipeline schedules per step (gradient accumulation); "
                            f"priced as one schedule of {microbatches} micro-batches, one bubble instead of {accumulation}")
    else:
        mbs, microbatches = local, accumulation
    if ac.every_nth is not None:
        stages = _every_nth(sizes, pp, ac.every_nth)
    else:
        stages = build_stages(sizes, pp, ac)
    precision = {"bfloat16": "bf16", "float32": "fp32"}.get(str(_tt_value(sections, t, "mixed_precision_param")))
    if precision is None:
        raise SpecError("training.mixed_precision_param", "expected bfloat16 or float32")
    if str(_tt_value(sections, t, "dtype")) == "bfloat16":
        warnings.append("training.dtype bfloat16 keeps weights, gradients and optimizer states in bf16; "
                        "priced as mixed precision with fp32 master weights")
        precision = "bf16"
    if "mixed_precision_param" not in sections[t] and "dtype" not in sections[t]:
        precision = None   # the config does not say; the caller's --precision decides
    seq = _tt_int(sections, t, "seq_len") if "seq_len" in sections[t] else None
    strategy = _strategy(dp, tp, pp, mbs, microbatches, vpp, ep, schedule, zero, sp, stages)
    return Imported(strategy, global_batch, seq, precision, tuple(warnings))


def _fqn_sizes(fqns, layers: int) -> list[int]:
    """Layers per model part of module_fqns_per_model_part (a list of FQN lists)."""
    if not isinstance(fqns, list) or not all(isinstance(part, list) for part in fqns):
        raise SpecError("parallelism.module_fqns_per_model_part", "expected a list of lists of module names "
                        "(give it in a TOML; Shardwise does not read it from overrides)")
    sizes = [sum(1 for name in part if re.fullmatch(r"layers\.\d+", str(name))) for part in fqns]
    if sum(sizes) != layers:
        raise SpecError("parallelism.module_fqns_per_model_part", f"names {sum(sizes)} layers, the model has {layers}")
    return sizes


def _every_nth(sizes: list[int], pp: int, every: int) -> tuple[Stage, ...]:
    """torchtitan 0.2's selective_ac_option n: every n-th layer a rank builds is fully
    recomputed (a counter over the rank's layers, torchtitan 0.2.2
    models/llama3/infra/parallelize.py _apply_ac_to_transformer_block); the cost model
    counts recomputed layers per stage, not which ones."""
    counters = [0] * pp
    stages, first = [], 0
    for i, n in enumerate(sizes):
        rank = i % pp
        full = (counters[rank] + n) // every - counters[rank] // every
        counters[rank] += n
        stages.append(Stage(i, rank, first, n, full, 0))
        first += n
    return tuple(stages)


# ---------------------------------------------------------------------------
# Megatron-LM

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
    "--seq-length", "--max-position-embeddings",   # arguments.py
    "--num-experts", "--moe-router-topk",     # TransformerConfig.num_moe_experts, moe_router_topk
)
MEGATRON_CHOICE_ARGS = {
    "--recompute-granularity": ("full", "selective"),     # TransformerConfig.recompute_granularity
    "--recompute-method": ("uniform", "block"),           # TransformerConfig.recompute_method
    # DistributedDataParallelConfig.data_parallel_sharding_strategy (Megatron FSDP)
    "--data-parallel-sharding-strategy": ("no_shard", "optim", "optim_grads", "optim_grads_params"),
}
MEGATRON_STR_ARGS = ("--pipeline-model-parallel-layout",)   # TransformerConfig.pipeline_model_parallel_layout
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
)
MEGATRON_NARGS_ARGS = ("--recompute-modules",)   # TransformerConfig.recompute_modules
MEGATRON_STR_MODEL_ARGS = ("--normalization", "--position-embedding-type")   # arguments.py


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
    for name in MEGATRON_FLAGS:
        parser.add_argument(name, action="store_true")
    for name in MEGATRON_NARGS_ARGS:
        parser.add_argument(name, nargs="*")
    return parser


def read_megatron(text: str, model: ModelSpec, num_gpus: int) -> Imported:
    """Megatron-LM command-line arguments (a whole pasted command line is fine: words
    that are not arguments Shardwise reads are ignored with a warning)."""
    words = _override_tokens(text)
    try:
        args, rest = megatron_parser().parse_known_args(words)
    except _ArgError as err:
        match = re.search(r"argument (--[a-z0-9-]+)", str(err))
        raise SpecError(match.group(1) if match else "megatron", str(err)) from None
    warnings = []
    unknown = [w for w in rest if w.startswith("--")]
    if unknown:
        warnings.append(f"ignored (not an argument Shardwise reads): {' '.join(unknown)}")
    kv = model.num_key_value_heads if model.num_key_value_heads != model.num_attention_heads else None
    _check_model([("--num-layers", args.num_layers, model.num_hidden_layers),
                  ("--hidden-size", args.hidden_size, model.hidden_size),
                  ("--ffn-hidden-size", args.ffn_hidden_size, model.intermediate_size),
                  ("--num-attention-heads", args.num_attention_heads, model.num_attention_heads),
                  ("--num-query-groups", args.num_query_groups if args.group_query_attention else None,
                   model.num_key_value_heads),
                  ("--num-experts", args.num_experts, model.num_local_experts if model.is_moe else None),
                  ("--moe-router-topk", args.moe_router_topk, model.num_experts_per_tok if model.is_moe else None)],
                 model)
    if kv is not None and not args.group_query_attention and args.num_attention_heads is not None:
        raise SpecError("--group-query-attention", f"missing: {model.name} has {kv} KV heads")
    tp = args.tensor_model_parallel_size or 1
    pp = args.pipeline_model_parallel_size or 1
    cp = args.context_parallel_size or 1
    ep = args.expert_model_parallel_size or 1
    if cp > 1:
        raise SpecError("--context-parallel-size", f"{cp}: Shardwise does not model context parallelism")
    if args.expert_tensor_parallel_size not in (None, tp):
        warnings.append(f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size}: priced with the "
                        f"experts split over tp {tp} as Megatron's default")
    dp = _divide(num_gpus, tp * pp * cp, "--tensor-model-parallel-size",
                 f"tp {tp} x pp {pp} must divide the cluster's {num_gpus} GPUs")
    mbs = args.micro_batch_size or 1
    global_batch = args.global_batch_size or mbs * dp   # arguments.py: defaults to micro x dp
    microbatches = _divide(global_batch, mbs * dp, "--global-batch-size", f"micro-batch {mbs} x dp {dp}")

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
    if dp == 1:
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
    strategy = _strategy(dp, tp, pp, mbs, microbatches, vpp, ep, schedule, zero, tp > 1 and args.sequence_parallel,
                         build_stages(sizes, pp, recompute))
    return Imported(strategy, global_batch, args.seq_length, precision, tuple(warnings))


# ---------------------------------------------------------------------------
# DeepSpeed

DEEPSPEED_KEYS = {
    # deepspeed/runtime/constants.py
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    # deepspeed/runtime/config.py: zero_optimization, bf16, fp16, pipeline, activation_checkpointing;
    # deepspeed/runtime/tensor_parallel/config.py: tensor_parallel
    "zero_optimization", "bf16", "fp16", "tensor_parallel", "pipeline", "activation_checkpointing",
}


def _ds_int(data: dict, key: str, field_name: str | None = None, minimum: int = 1) -> int | None:
    value = data.get(key)
    name = field_name or key
    if value is None:
        return None
    if value == "auto":
        raise SpecError(name, "'auto' is filled in by the Hugging Face Trainer; give the number")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SpecError(name, f"expected an integer >= {minimum}, got {value!r}")
    return value


def _ds_section(data: dict, key: str) -> dict:
    section = data.get(key, {})
    if not isinstance(section, dict):
        raise SpecError(key, "expected an object")
    return section


def read_deepspeed(text: str, model: ModelSpec, num_gpus: int) -> Imported:
    """A DeepSpeed config JSON. The pipeline degree is not in the file (DeepSpeed sets it
    in code, `deepspeed.pipe.PipelineModule(num_stages=...)`): it is what the batch
    identity train_batch_size = micro x accumulation x dp (runtime/config.py
    _batch_assertion) leaves of the cluster's GPUs."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise SpecError("--from", f"not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise SpecError("--from", "expected a JSON object")
    warnings = []
    ignored = sorted(set(data) - DEEPSPEED_KEYS)
    if ignored:
        warnings.append(f"ignored (not a key Shardwise reads): {', '.join(ignored)}")
    tp = _ds_int(_ds_section(data, "tensor_parallel"), "autotp_size", "tensor_parallel.autotp_size", minimum=0) or 1
    micro = _ds_int(data, "train_micro_batch_size_per_gpu")
    accumulation = _ds_int(data, "gradient_accumulation_steps")
    total = _ds_int(data, "train_batch_size")
    if total is None or micro is None:
        raise SpecError("train_batch_size" if total is None else "train_micro_batch_size_per_gpu",
                        "missing: Shardwise needs train_batch_size and train_micro_batch_size_per_gpu")
    if accumulation is None:
        dp = _divide(num_gpus, tp, "tensor_parallel.autotp_size", f"of the cluster's {num_gpus} GPUs")
        accumulation = _divide(total, micro * dp, "train_batch_size", f"micro-batch {micro} x dp {dp}")
    else:
        dp = _divide(total, micro * accumulation, "train_batch_size",
                     f"train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps {accumulation}")
    pp = _divide(num_gpus, dp * tp, "train_batch_size",
                 f"its dp {dp} x tp {tp} must divide the cluster's {num_gpus} GPUs")
    stage = _ds_int(_ds_section(data, "zero_optimization"), "stage", "zero_optimization.stage", minimum=0) or 0
    if stage > 3:
        raise SpecError("zero_optimization.stage", f"expected 0 to 3, got {stage}")
    if pp > 1 and stage >= 2:
        # deepspeed/runtime/pipe/engine.py: "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"
        raise SpecError("zero_optimization.stage", f"{stage}: DeepSpeed's pipeline engine (pp {pp}, left by "
                        "train_batch_size) refuses ZeRO-2 and ZeRO-3")
    if pp > 1:
        warnings.append(f"pp {pp} (the GPUs train_batch_size leaves): DeepSpeed's PipelineModule partition is set "
                        "in code; priced as an even split of the layers, DeepSpeed's 1F1B TrainSchedule")
    recompute = Recompute()
    interval = _ds_int(_ds_section(data, "pipeline"), "activation_checkpoint_interval",
                       "pipeline.activation_checkpoint_interval", minimum=0) or 0
    if pp > 1 and interval:
        recompute = Recompute("full")
        if interval > 1:
            warnings.append(f"pipeline.activation_checkpoint_interval {interval} checkpoints groups of layers; "
                            "priced as every layer recomputed on its own")
    elif "activation_checkpointing" in data:
        recompute = Recompute("full")
        warnings.append("activation_checkpointing configures deepspeed.checkpointing, which the model calls: "
                        "priced as every layer recomputed")
    if model.is_moe:
        warnings.append("expert parallelism is set in code (deepspeed.moe.layer.MoE(ep_size=...)); priced as ep 1")
    bf16 = _ds_section(data, "bf16").get("enabled") is True
    fp16 = _ds_section(data, "fp16").get("enabled") is True
    if bf16 and fp16:
        raise SpecError("bf16.enabled", "both bf16 and fp16 are enabled")
    precision = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    sizes = _even_sizes(model.num_hidden_layers, pp)
    strategy = _strategy(dp, tp, pp, micro, accumulation, 1, 1, "1f1b", stage if dp > 1 else 0, False,
                         build_stages(sizes, pp, recompute))
    return Imported(strategy, total, None, precision, tuple(warnings))


def _even_sizes(num_layers: int, parts: int) -> list[int]:
    """Even split, earlier parts taking the remainder (costmodel.strategy.even_stages;
    DeepSpeed's partition_method='uniform' balances the same way)."""
    base, extra = divmod(num_layers, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def read_text(target: str, text: str, model: ModelSpec, num_gpus: int) -> Imported:
    """Read a configuration's text; `target` is one of planner.export.TARGETS."""
    if target in ("torchtitan", "torchtitan-toml"):
        return read_torchtitan(text, model, num_gpus, toml=target == "torchtitan-toml")
    if target == "megatron":
        return read_megatron(text, model, num_gpus)
    if target == "deepspeed":
        return read_deepspeed(text, model, num_gpus)
    raise SpecError("--from", f"unknown engine {target!r} (known: {', '.join(SOURCES)})")


def read_config(source_kind: str, source: str, model: ModelSpec, num_gpus: int,
                global_batch: int | None = None) -> Imported:
    """Read what a user runs: `source` is torchtitan overrides or a job TOML path,
    Megatron-LM arguments (or a file holding them), or a DeepSpeed JSON path.
    `global_batch` fills in what torchtitan overrides leave out."""
    if source_kind == "torchtitan":
        if source.endswith(".toml"):
            return read_torchtitan(_read_file(source, "TOML"), model, num_gpus, toml=True)
        return read_torchtitan(source, model, num_gpus, global_batch=global_batch)
    if source_kind == "megatron":
        is_file = not source.lstrip().startswith("-") and Path(source).is_file()
        return read_megatron(_read_file(source, "text") if is_file else source, model, num_gpus)
    if source_kind == "deepspeed":
        return read_deepspeed(_read_file(source, "JSON"), model, num_gpus)
    raise SpecError("--from", f"unknown engine {source_kind!r} (known: {', '.join(SOURCES)})")
