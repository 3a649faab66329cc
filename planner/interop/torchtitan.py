"""torchtitan: its command-line overrides (the Python-config releases, 0.3) and job TOML
(0.2), read as a strategy (`read_torchtitan`) and written from one (`export_torchtitan`,
`export_torchtitan_toml`), with torchtitan's own stage partition (`torchtitan_split`).
Option names cite torchtitan 0.3.0 `torchtitan/config/configs.py` (ParallelismConfig,
TrainingConfig) and `torchtitan/trainer.py`, and 0.2.2 `torchtitan/config/job_config.py`.
"""

from __future__ import annotations

import json
import math
import re

import tomllib

from costmodel.specs import ModelSpec, RuntimeSpec, TrainingSpec
from costmodel.specs.loading import SpecError
from costmodel.strategy import Stage, Strategy, schedule_vpp_error, stage_rank
from planner.interop.common import (
    Exported,
    Imported,
    Recompute,
    all_or_nothing,
    build_stages,
    divide,
    engine_strategy,
    override_tokens,
)


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
TORCHTITAN_SCHEDULES = {"GPipe": "gpipe", "1F1B": "1f1b", "Interleaved1F1B": "interleaved",
                        "InterleavedZeroBubble": "zb-interleaved", "ZBVZeroBubble": "zbv", "DualPipeV": "dualpipev"}


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
    "expert_tensor_parallel_degree": 1,
    "module_fqns_per_model_part": None, "context_parallel_load_balancer": "headtail",
    "context_parallel_rotate_method": "allgather",
    "local_batch_size": 8, "global_batch_size": -1, "seq_len": 2048, "dtype": "float32",
    "mixed_precision_param": "bfloat16",
}


# FP8 training (costmodel.specs.training.FP8_RECIPES). torchtitan 0.2.2: `[model] converters`
# names "quantize.linear.float8" (the name components/quantization/float8.py registers;
# ModelConvertersContainer looks each name up in that registry), configured by
# `[quantize.linear.float8]`, config/job_config.py class Float8Linear: recipe_name
# Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None (None: torchao's
# Float8LinearConfig default, tensorwise dynamic scaling), enable_fsdp_float8_all_gather
# and precompute_float8_dynamic_scale_for_fsdp (the converter refuses them beside a
# recipe_name), filter_fqns (default [], matched as substrings of module names) and
# emulate. The LM head is `output` (models/llama3/model/model.py), the MoE router's
# linear `router.gate` (models/moe/moe.py).
TORCHTITAN_FLOAT8_CONVERTER = "quantize.linear.float8"
TORCHTITAN_FLOAT8_FIELDS = ("enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp",
                            "recipe_name", "filter_fqns", "emulate")
TORCHTITAN_FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# torchtitan 0.2.2's MoE FP8: "quantize.grouped_mm.float8" (Float8GroupedMMConverter,
# components/quantization/float8.py: torchao's dynamic rowwise scaled grouped GEMMs for
# the MoE modules its `[quantize.grouped_mm.float8] fqns` name, e.g. "experts"; it asserts
# pipeline and context parallelism off): the runtime's fp8_experts.
TORCHTITAN_GROUPED_FLOAT8_CONVERTER = "quantize.grouped_mm.float8"
# torchtitan 0.3.0 sets FP8 in Python only: Trainer.Config.model_spec is
# Annotated[..., tyro.conf.Suppress] (trainer.py), built by a config_registry function
# with model_registry(flavor, converters=[Float8LinearConverter.Config(...)])
# (components/quantization/float8.py: recipe_name Literal["rowwise",
# "rowwise_with_gw_hp"] = "rowwise", no tensorwise; filter_fqns; emulate). Its LM head is
# `lm_head` (models/common/decoder.py; models/llama3/config_registry.py llama3_405b
# filters it so).
TORCHTITAN_03_FLOAT8_RECIPES = ("rowwise", "rowwise_with_gw_hp")


def parse_torchtitan_overrides(text: str) -> tuple[dict[str, dict], str | None, list[str]]:
    """`--parallelism.tensor_parallel_degree 4 ... activation-checkpoint:full` ->
    ({"parallelism": {...}, "training": {...}}, AC subcommand or None, warnings)."""
    sections: dict[str, dict] = {"parallelism": {}, "training": {}}
    known = {"parallelism": TORCHTITAN_PARALLELISM_FIELDS, "training": TORCHTITAN_TRAINING_FIELDS}
    subcommand, ignored = None, []
    words = override_tokens(text)
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
    return _torchtitan_strategy(sections, ac, warnings, model, num_gpus, None if toml else global_batch, toml)


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
    sections["fp8"] = _toml_float8(data)
    # torchtitan 0.2 job_config.py Compile: `[compile] enable` (torch.compile per block).
    compile_table = data.get("compile", {})
    sections["compile"] = dict(compile_table) if isinstance(compile_table, dict) else {}
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


def _toml_float8(data: dict) -> dict | None:
    """The FP8 settings of a 0.2 job TOML: None where model.converters does not name
    torchtitan's FP8 converter, else the [quantize.linear.float8] table (checked)."""
    model_table = data.get("model", {})
    converters = model_table.get("converters", []) if isinstance(model_table, dict) else []
    if not isinstance(converters, list) or not all(isinstance(c, str) for c in converters):
        raise SpecError("model.converters", f"expected a list of converter names, got {converters!r}")
    for name in converters:
        if name == "float8":
            raise SpecError("model.converters", "'float8' is not a converter torchtitan 0.2.2 registers: its FP8 "
                            f"converter is {TORCHTITAN_FLOAT8_CONVERTER!r} (components/quantization/float8.py), "
                            "configured by [quantize.linear.float8]")
        if name not in (TORCHTITAN_FLOAT8_CONVERTER, TORCHTITAN_GROUPED_FLOAT8_CONVERTER):
            raise SpecError("model.converters", f"{name!r}: Shardwise prices FP8 linear layers and experts "
                            f"({TORCHTITAN_FLOAT8_CONVERTER!r}, {TORCHTITAN_GROUPED_FLOAT8_CONVERTER!r}), "
                            "not MX formats")
    experts = _toml_grouped_float8(data) if TORCHTITAN_GROUPED_FLOAT8_CONVERTER in converters else False
    if TORCHTITAN_FLOAT8_CONVERTER not in converters:
        if experts:
            raise SpecError("model.converters", f"{TORCHTITAN_GROUPED_FLOAT8_CONVERTER!r} without "
                            f"{TORCHTITAN_FLOAT8_CONVERTER!r}: Shardwise prices FP8 experts beside FP8 linear layers")
        return None
    table = _quantize_table(data, "linear")
    unknown = sorted(set(table) - set(TORCHTITAN_FLOAT8_FIELDS))
    if unknown:
        raise SpecError(f"quantize.linear.float8.{unknown[0]}", "not a field of torchtitan's Float8Linear config")
    recipe = table.get("recipe_name")
    if recipe is not None and recipe not in TORCHTITAN_FLOAT8_RECIPES:
        raise SpecError("quantize.linear.float8.recipe_name",
                        f"{recipe!r} (known: {', '.join(TORCHTITAN_FLOAT8_RECIPES)})")
    gather = _tt_bool(table.get("enable_fsdp_float8_all_gather", False), "quantize.linear.float8.enable_fsdp_float8_all_gather")
    if recipe is not None and gather:
        # components/quantization/float8.py asserts the two apart.
        raise SpecError("quantize.linear.float8.enable_fsdp_float8_all_gather",
                        f"torchtitan refuses it beside recipe_name {recipe!r}; leave recipe_name unset "
                        "(tensorwise) to gather in fp8")
    filters = _module_names(table.get("filter_fqns", []), "quantize.linear.float8.filter_fqns")
    return {"recipe": recipe or "tensorwise", "all_gather": gather, "filters": filters,
            "emulate": _tt_bool(table.get("emulate", False), "quantize.linear.float8.emulate"), "experts": experts}


def _toml_grouped_float8(data: dict) -> bool:
    """Whether a 0.2 job TOML's [quantize.grouped_mm.float8] converts the experts (its
    `fqns` name them: torchtitan's MoE module holds them as `experts`)."""
    table = _quantize_table(data, "grouped_mm")
    unknown = sorted(set(table) - {"fqns"})
    if unknown:
        raise SpecError(f"quantize.grouped_mm.float8.{unknown[0]}", "not a field of torchtitan's Float8GroupedMM config")
    fqns = _module_names(table.get("fqns", []), "quantize.grouped_mm.float8.fqns")
    return any(f.strip() and f.strip() in "layers.0.moe.experts" for f in fqns)


def _quantize_table(data: dict, kind: str) -> dict:
    """A 0.2 job TOML's [quantize.<kind>.float8] table (empty where absent)."""
    table = data.get("quantize", {})
    for key in (kind, "float8"):
        table = table.get(key, {}) if isinstance(table, dict) else None
    if not isinstance(table, dict):
        raise SpecError(f"quantize.{kind}.float8", "expected a table")
    return table


def _module_names(value, field: str) -> list[str]:
    """A list of module names, given as a TOML array or one comma-separated string."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, list):
        raise SpecError(field, f"expected a list of module names, got {value!r}")
    return [str(name) for name in names]


def _float8_read(fp8: dict, model: ModelSpec, fsdp: bool, warnings: list[str]) -> str:
    """The FP8_RECIPES name a 0.2 job TOML's FP8 settings are priced as, with what differs said."""
    recipe = fp8["recipe"]
    if recipe == "rowwise_with_gw_hp":
        warnings.append("quantize.linear.float8.recipe_name rowwise_with_gw_hp runs the weight-gradient GEMMs in "
                        "bf16 (a third of the linear layers' FLOPs); priced as rowwise, every linear GEMM in FP8: "
                        "the estimate is optimistic")
        recipe = "rowwise"
    if not any(f in "output" for f in fp8["filters"]):
        warnings.append("quantize.linear.float8.filter_fqns does not name output: torchtitan converts the LM head "
                        "to FP8 too; priced with the LM head in bf16")
    if model.is_moe and not any(f in "layers.0.moe.router.gate" for f in fp8["filters"]):
        warnings.append("quantize.linear.float8.filter_fqns does not name router.gate: torchtitan converts the MoE "
                        "router to FP8 where its width divides by 16; priced with the router in bf16")
    if model.has_shared_expert and not any(f in "layers.0.moe.shared_experts.w1" for f in fp8["filters"]):
        warnings.append("quantize.linear.float8.filter_fqns does not name shared_experts: torchtitan converts the "
                        "shared expert to FP8 too; priced with it in bf16")
    if fp8["recipe"] == "tensorwise" and fsdp and not fp8["all_gather"]:
        warnings.append(_FP8_GATHER_WARNING)
    if fp8["emulate"]:
        warnings.append("quantize.linear.float8.emulate runs FP8 emulated in high precision (a test setting); "
                        "priced at the GPU's FP8 peak")
    return recipe


# Shardwise prices tensorwise FP8 under FSDP2 with its float8 all-gather (costmodel.estimate.uniform).
_FP8_GATHER_WARNING = ("quantize.linear.float8.enable_fsdp_float8_all_gather is off: FSDP2 all-gathers the FP8 "
                       "layers' weights in bf16; priced as tensorwise FP8 gathers them, 1 byte a weight (set it, "
                       "with precompute_float8_dynamic_scale_for_fsdp and no recipe_name, as torchtitan advises)")
# torchtitan 0.2.2 models/llama3/infra/parallelize.py line 77: float8 tensorwise TP only when
# model.converters holds "float8", which its converter registry does not know.
_FP8_TP_WARNING = ("torchtitan 0.2 applies its float8 tensor parallelism only when model.converters holds \"float8\" "
                   "(models/llama3/infra/parallelize.py), a name its converter registry lacks: under torch.compile "
                   "the plan prices each block's input cast once on the sequence shard before the tp all-gather, "
                   "torchtitan casts the gathered bf16 input")


def _torchtitan_strategy(sections: dict, ac: Recompute, warnings: list[str], model: ModelSpec,
                         num_gpus: int, global_hint: int | None, toml: bool = False) -> Imported:
    p = "parallelism"
    replicate = _tt_int(sections, p, "data_parallel_replicate_degree")
    shard = _tt_int(sections, p, "data_parallel_shard_degree", allow=(-1,))
    tp = _tt_int(sections, p, "tensor_parallel_degree")
    pp = _tt_int(sections, p, "pipeline_parallel_degree")
    cp = _tt_int(sections, p, "context_parallel_degree")
    ep = _tt_int(sections, p, "expert_parallel_degree")
    if cp > 1:
        _context_parallel_warnings(sections, warnings)
    if shard == -1:
        # torchtitan 0.3.0 ParallelismConfig: -1 takes the ranks left after the other degrees.
        shard = divide(num_gpus, replicate * tp * pp * cp, "parallelism.data_parallel_shard_degree",
                        f"replicate x tp x pp x cp of the cluster's {num_gpus} GPUs")
    if replicate * shard * tp * pp * cp != num_gpus:
        with_cp = f" x cp {cp}" if cp > 1 else ""
        raise SpecError("parallelism", f"replicate {replicate} x shard {shard}{with_cp} x tp {tp} x pp {pp} = "
                        f"{replicate * shard * cp * tp * pp}, but the cluster has {num_gpus} GPUs")
    # torchtitan's world is replicate x shard x cp x tp x pp; its batch is split over
    # replicate x shard only (the cp ranks share each sequence), which is Shardwise's dp.
    dp = replicate * shard
    reshard = str(_tt_value(sections, p, "fsdp_reshard_after_forward"))
    if reshard not in ("default", "always", "never"):
        raise SpecError("parallelism.fsdp_reshard_after_forward", f"expected default, always or never, got {reshard!r}")
    # FSDP2 shards over torchtitan's "fsdp" mesh, data_parallel_shard_degree x
    # context_parallel_degree (0.3.0 distributed/parallel_dims.py; 0.2.2 "dp_shard_cp"): with
    # cp > 1 it shards even where data_parallel_shard_degree is 1 (models/llama3/parallelize.py).
    if shard * cp == 1:
        zero = 0
    else:
        # torchtitan 0.3.0 distributed/fsdp.py get_fsdp_reshard_after_forward_policy:
        # "default" keeps the weights gathered after forward under pp (ZeRO-2-like).
        keeps = reshard == "never" or (reshard == "default" and pp > 1)
        zero = 2 if keeps else 3
        if replicate > 1 and cp == 1:
            warnings.append(f"HSDP (replicate {replicate} x shard {shard}) is priced as ZeRO-{zero} over all {dp} "
                            "data-parallel ranks: Shardwise shards over the whole data-parallel group")
        elif replicate > 1:
            warnings.append(f"HSDP (replicate {replicate} x shard {shard} x cp {cp}) is priced as ZeRO-{zero} over "
                            f"all dp {dp} x cp {cp} ranks: Shardwise shards over every rank holding the same weights")
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
    if pp > 1 and (why := schedule_vpp_error(schedule, vpp, pp)):
        raise SpecError("parallelism.pipeline_parallel_schedule", f"{name}: {why} (stages per rank)")

    t = "training"
    local = _tt_int(sections, t, "local_batch_size")
    if "local_batch_size" not in sections[t]:
        warnings.append("training.local_batch_size not given: torchtitan's default 8 is assumed")
    given_global = _tt_int(sections, t, "global_batch_size", allow=(-1,))
    global_batch = given_global if given_global != -1 else global_hint or local * dp
    accumulation = divide(global_batch, local * dp, "training.global_batch_size",
                           f"local_batch_size {local} x dp {dp}")
    if pp > 1:
        mbs = _tt_int(sections, p, "pipeline_parallel_microbatch_size")
        microbatches = divide(local, mbs, "parallelism.pipeline_parallel_microbatch_size",
                               "the micro-batch size must divide training.local_batch_size") * accumulation
        if accumulation > 1:
            warnings.append(f"torchtitan runs {accumulation} pipeline schedules per step (gradient accumulation); "
                            f"priced as one schedule of {microbatches} micro-batches, one bubble instead of {accumulation}")
    else:
        mbs, microbatches = local, accumulation
    if ac.every_nth is not None:
        stages = _every_nth(sizes, pp, ac.every_nth, schedule)
    else:
        stages = build_stages(sizes, pp, ac, schedule)
    precision = {"bfloat16": "bf16", "float32": "fp32"}.get(str(_tt_value(sections, t, "mixed_precision_param")))
    if precision is None:
        raise SpecError("training.mixed_precision_param", "expected bfloat16 or float32")
    if str(_tt_value(sections, t, "dtype")) == "bfloat16":
        warnings.append("training.dtype bfloat16 keeps weights, gradients and optimizer states in bf16; "
                        "priced as mixed precision with fp32 master weights")
        precision = "bf16"
    if "mixed_precision_param" not in sections[t] and "dtype" not in sections[t]:
        precision = None   # the config does not say; the caller's --precision decides
    fp8 = None
    if sections.get("fp8") is not None:
        fp8 = _float8_read(sections["fp8"], model, shard > 1, warnings)
        if precision == "fp32":
            raise SpecError("training.mixed_precision_param", "float32 beside FP8 linear layers (model.converters): "
                            "Shardwise prices FP8 training as bf16 mixed precision (bfloat16)")
        precision = "bf16"
    seq = _tt_int(sections, t, "seq_len") if "seq_len" in sections[t] else None
    # torchtitan 0.2.2 splits the routed experts over expert_tensor_parallel_degree ranks,
    # 1 (its default) or tp; 0.3.0 keeps them whole (its sparse mesh has no etp).
    etp = _tt_int(sections, p, "expert_tensor_parallel_degree") if toml else 1
    if etp not in (1, tp):
        raise SpecError("parallelism.expert_tensor_parallel_degree", f"{etp}: torchtitan runs 1 or tp ({tp})")
    strategy = engine_strategy(dp, tp, pp, mbs, microbatches, vpp, ep, schedule, zero, sp, stages, cp,
                               etp if model.is_moe and ep > 1 else None)
    # torchtitan's loss is F.cross_entropy over the upcast logits; under "default" it keeps
    # its [norm, output] unit gathered from forward to backward (0.3.0 distributed/fsdp.py:
    # resharded only under "always").
    settings = [("chunked_loss", False),
                ("fsdp_kept_gathered", "head" if zero == 3 and reshard == "default" else "none")]
    if "enable" in sections.get("compile", {}):
        settings.append(("torch_compile", _tt_bool(sections["compile"]["enable"], "compile.enable")))
    if "enable_async_tensor_parallel" in sections[p]:
        settings.append(("async_tp", _tt_bool(sections[p]["enable_async_tensor_parallel"],
                                              "parallelism.enable_async_tensor_parallel")))
    backend = sections[p].get("expert_parallel_comm_backend", "standard")
    if backend not in ("standard", "deepep"):
        raise SpecError("parallelism.expert_parallel_comm_backend", f"expected standard or deepep, got {backend!r}")
    if backend == "deepep" and ep > 1:
        # torchtitan 0.2.2 job_config.py: DeepEP's kernels in place of the all-to-all.
        settings.append(("moe_dispatch", "deepep"))
    # torchtitan 0.2.2 distributed/dual_pipe_v.py: under DualPipeV with ep and pp, the
    # forward and backward of each OVERLAP_F_B pair run on two threads that meet at the
    # dispatch and combine, so each one's exchange runs behind the other's computation
    # (pipeline_parallel_expert_parallel_overlap, on by default); it refuses checkpointing.
    # torchtitan 0.3.0 dropped it: its DualPipeV runs torch's pairs one after the other.
    if (schedule == "dualpipev" and ep > 1 and pp > 1
            and _tt_bool(sections[p].get("pipeline_parallel_expert_parallel_overlap", toml),
                         "parallelism.pipeline_parallel_expert_parallel_overlap")):
        if ac.mode != "none":
            raise SpecError("activation_checkpoint.mode", f"{ac.mode} with DualPipeV's expert-parallel overlap: "
                            "torchtitan refuses the two together (dual_pipe_v.py); set mode none or "
                            "parallelism.pipeline_parallel_expert_parallel_overlap false")
        settings.append(("ep_overlap", 1.0))
    if sections.get("fp8") is not None and sections["fp8"].get("experts") and model.is_moe:
        if pp > 1 or cp > 1:
            raise SpecError("model.converters", f"{TORCHTITAN_GROUPED_FLOAT8_CONVERTER!r} with "
                            f"{'pipeline' if pp > 1 else 'context'} parallelism: torchtitan's Float8GroupedMMConverter "
                            "asserts pipeline and context parallelism off (components/quantization/float8.py)")
        settings.append(("fp8_experts", True))
    if ac.mode == "selective" and ac.every_nth is None:
        # torchtitan's per-op SAC (distributed/activation_checkpoint.py, _save_list policy):
        # costmodel.terms.recompute's op-level policy.
        settings.append(("selective_recompute", "op-level"))
    return Imported(strategy, global_batch, seq, precision, tuple(warnings), tuple(settings), fp8,
                    states_fp8="fp8" in sections)


def _context_parallel_warnings(sections: dict, warnings: list[str]) -> None:
    """How torchtitan's cp ranks exchange K and V and split the sequence, against what
    Shardwise prices: K and V all-gathered over the cp group, each sequence cut into 2 cp
    chunks with rank i holding chunks i and 2cp - 1 - i (torch's _HeadTailLoadBalancer)."""
    p = "parallelism"
    # torchtitan 0.2.2 job_config.py: Literal["allgather", "alltoall"], handed to torch's
    # set_rotate_method. 0.3.0 dropped the field: its SDPA path runs torch's default
    # (_ContextParallelOptions.rotate_method ALL_GATHER), its FlexAttention path flex_cp_allgather.
    rotate = str(_tt_value(sections, p, "context_parallel_rotate_method"))
    if rotate not in ("allgather", "alltoall"):
        raise SpecError("parallelism.context_parallel_rotate_method", f"expected allgather or alltoall, got {rotate!r}")
    if rotate == "alltoall":
        warnings.append("parallelism.context_parallel_rotate_method alltoall passes K/V shards around the cp ranks "
                        "(torch's ring attention); priced as all-gather (K and V gathered once per attention)")
    balancer = str(_tt_value(sections, p, "context_parallel_load_balancer"))
    if balancer != "headtail":
        warnings.append(f"parallelism.context_parallel_load_balancer {balancer}: priced as the head-tail split "
                        "(2 x cp chunks, rank i holding chunks i and 2cp - 1 - i), each cp rank the same causal work")


def _fqn_sizes(fqns, layers: int) -> list[int]:
    """Layers per model part of module_fqns_per_model_part (a list of FQN lists)."""
    if not isinstance(fqns, list) or not all(isinstance(part, list) for part in fqns):
        raise SpecError("parallelism.module_fqns_per_model_part", "expected a list of lists of module names "
                        "(give it in a TOML; Shardwise does not read it from overrides)")
    sizes = [sum(1 for name in part if re.fullmatch(r"layers\.\d+", str(name))) for part in fqns]
    if sum(sizes) != layers:
        raise SpecError("parallelism.module_fqns_per_model_part", f"names {sum(sizes)} layers, the model has {layers}")
    return sizes


def _every_nth(sizes: list[int], pp: int, every: int, schedule: str) -> tuple[Stage, ...]:
    """torchtitan 0.2's selective_ac_option n: every n-th layer a rank builds is fully
    recomputed (a counter over the rank's layers, torchtitan 0.2.2
    models/llama3/infra/parallelize.py _apply_ac_to_transformer_block); the cost model
    counts recomputed layers per stage, not which ones."""
    counters = [0] * pp
    stages, first = [], 0
    for i, n in enumerate(sizes):
        rank = stage_rank(i, pp, schedule)
        full = (counters[rank] + n) // every - counters[rank] // every
        counters[rank] += n
        stages.append(Stage(i, rank, first, n, full, 0))
        first += n
    return tuple(stages)


def _torchtitan_partition(strategy: Strategy, layers: int, warnings: list[str]) -> dict:
    """The first/last-stage-less-layers and layers-per-stage that make torchtitan's
    split give the plan's stages (torchtitan_split), or its closest split."""
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


_TT_SCHEDULE = {v: k for k, v in TORCHTITAN_SCHEDULES.items()}


def _torchtitan_fields(strategy: Strategy, model: ModelSpec, training: TrainingSpec,
                       toml: bool) -> tuple[dict, dict, str, list[str]]:
    """(parallelism fields, training fields, AC mode, warnings) for either release."""
    s, warnings = strategy, []
    release = "torchtitan 0.2" if toml else "torchtitan"
    par: dict = {}
    if s.zero_stage == 0 and s.cp == 1:
        par.update(data_parallel_replicate_degree=s.dp, data_parallel_shard_degree=1)
        if toml and s.dp > 1 and (s.tp > 1 or s.pp > 1):
            warnings.append("torchtitan 0.2 refuses DDP beside tp or pp (models/llama3/infra/parallelize.py: "
                            "'DDP has not supported > 1D parallelism'); use --to torchtitan (0.3) or ZeRO-3")
    else:
        # FSDP2 over the data-parallel ranks: resharding after forward is ZeRO-3, keeping
        # the weights gathered until backward is ZeRO-2 (Shardwise's executor runs ZeRO-2 so).
        # torchtitan shards over data_parallel_shard_degree x context_parallel_degree (its
        # "fsdp" mesh), the plan's dp x cp.
        par.update(data_parallel_replicate_degree=1, data_parallel_shard_degree=s.dp,
                   fsdp_reshard_after_forward="always" if s.zero_stage == 3 else "never")
        if s.zero_stage == 0:
            warnings.append(f"torchtitan shards the weights over its cp ranks whenever context_parallel_degree > 1 "
                            "(FSDP2 on data_parallel_shard_degree x context_parallel_degree, "
                            f"models/llama3/parallelize.py); the plan's replicated weights over dp {s.dp} x cp {s.cp} "
                            "exported as FSDP2 with fsdp_reshard_after_forward never, ZeRO-2")
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
    par["context_parallel_degree"] = s.cp
    if s.cp > 1 and toml:
        # 0.2's choice of K/V exchange (its default, said so the file states what was
        # priced); 0.3.0 has no such field and always all-gathers (_context_parallel_warnings).
        par["context_parallel_rotate_method"] = "allgather"
    par["expert_parallel_degree"] = s.ep
    if model.is_moe and s.ep > 1 and s.tp > 1:
        if toml:
            par["expert_tensor_parallel_degree"] = s.expert_tp
        elif s.etp is None:
            warnings.append(f"torchtitan 0.3 keeps the routed experts whole under tp (its sparse mesh has no expert "
                            f"tensor parallelism): the plan's experts split over tp {s.tp} are not what it runs; "
                            f"plan with --fix etp=1")
    if model.moe_capacity_factor is not None:
        warnings.append(f"torchtitan's MoE routes dropless (torchtitan/models/moe): the model's capacity factor "
                        f"{model.moe_capacity_factor:g} is not exported, and torchtitan's experts take every row")
    if s.ep > 1 and s.zero_stage != 3:
        warnings.append("torchtitan shards the experts with FSDP over the ranks left from expert parallelism "
                        "(its efsdp mesh), so they are not replicated over dp shards as the plan's ep "
                        f"{s.ep} with ZeRO-{s.zero_stage} prices them")
    # Without pp a step accumulates global / (local x dp) gradients; with pp the local
    # batch is cut into micro-batches of pipeline_parallel_microbatch_size.
    local = s.micro_batch_size * (s.num_microbatches if s.pp > 1 else 1)
    train = {"local_batch_size": local, "global_batch_size": training.global_batch, "seq_len": training.seq_len}
    if training.precision == "fp16":
        warnings.append("torchtitan trains in bfloat16 or float32 (TrainingConfig.mixed_precision_param): "
                        "fp16 exported as bfloat16")
    train["mixed_precision_param"] = "float32" if training.precision == "fp32" else "bfloat16"
    ac = all_or_nothing(s, release, "activation checkpointing applies one policy to every block", warnings)
    return par, train, ac, warnings


def _float8_fields(strategy: Strategy, model: ModelSpec, training: TrainingSpec, par: dict,
                   toml: bool) -> tuple[dict | None, list[str], tuple[str, ...]]:
    """FP8 for either release: the 0.2 TOML's [quantize.linear.float8] table (None
    without FP8), warnings, and what torchtitan would run other than the plan."""
    if training.fp8 is None:
        return None, [], ()
    if training.fp8 not in TORCHTITAN_FLOAT8_RECIPES:
        raise SpecError("plan.training.fp8", f"{training.fp8}: torchtitan's Float8Linear recipes are "
                        f"{', '.join(TORCHTITAN_FLOAT8_RECIPES)} (0.2.2 config/job_config.py; its MX converter, "
                        "quantize.linear.mx, is not exported here); plan with --precision fp8-rowwise, or export "
                        "--to megatron")
    filters = (["output" if toml else "lm_head"] + (["router.gate"] if model.is_moe else [])
               + (["shared_experts"] if model.has_shared_expert else []))
    if not toml:
        # 0.3.0: no override turns FP8 on (Trainer.Config.model_spec is tyro.conf.Suppress).
        recipe = training.fp8 if training.fp8 in TORCHTITAN_03_FLOAT8_RECIPES else "rowwise"
        quoted = ", ".join(f'"{f}"' for f in filters)
        said = (f"torchtitan 0.3 sets FP8 in the config_registry function, not in overrides (Trainer.Config."
                f"model_spec is tyro.conf.Suppress): build the model with model_registry(flavor, converters=["
                f'Float8LinearConverter.Config(recipe_name="{recipe}", filter_fqns=[{quoted}])]) '
                "(components/quantization/float8.py; models/llama3/config_registry.py llama3_405b does so)")
        warnings = [said]
        if recipe == training.fp8:
            return None, warnings, ()
        change = f"torchtitan will run this configuration with fp8 {training.fp8}→{recipe} (plan → exported)"
        warnings.append(f"torchtitan 0.3's Float8LinearConverter has the recipes {', '.join(TORCHTITAN_03_FLOAT8_RECIPES)} "
                        f"(components/quantization/float8.py), no {training.fp8}: plan with --precision fp8-rowwise, or "
                        "export --to torchtitan-toml (0.2 runs tensorwise)")
        return None, warnings + [change], (change,)
    table: dict = {}
    warnings = []
    if training.fp8 == "tensorwise" and par.get("data_parallel_shard_degree", 1) > 1:
        # torchtitan's recommendation for tensorwise under FSDP2 (job_config.py Float8Linear);
        # the converter refuses both beside a recipe_name, and without one runs tensorwise.
        table.update(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
    else:
        table["recipe_name"] = training.fp8
    table["filter_fqns"] = filters
    if training.fp8 == "tensorwise" and strategy.tp > 1 and strategy.sequence_parallel:
        warnings.append(_FP8_TP_WARNING)
    return table, warnings, ()


def _flag(section: str, key: str, value) -> str:
    if isinstance(value, bool):
        # tyro's boolean flags: --section.field / --section.no-field
        return f"--{section}.{key}" if value else f"--{section}.no-{key}"
    return f"--{section}.{key} {value}"


def export_torchtitan(strategy: Strategy, model: ModelSpec, training: TrainingSpec,
                      runtime: RuntimeSpec | None = None) -> Exported:
    """Overrides for `torchtitan/train.py --module M --config C ...` (0.3: tyro flags
    `--parallelism.<field>`, `--training.<field>`, and the activation-checkpoint
    subcommand last, as torchtitan spells it in distributed/minimal_async_ep/api.py)."""
    par, train, ac, warnings = _torchtitan_fields(strategy, model, training, toml=False)
    _, fp8_warnings, changes = _float8_fields(strategy, model, training, par, toml=False)
    words = [_flag("parallelism", k, v) for k, v in par.items()] + [_flag("training", k, v) for k, v in train.items()]
    words.append(f"activation-checkpoint:{ac}")
    return Exported(" \\\n".join(words) + "\n", tuple(warnings + fp8_warnings), changes)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, list)):
        return json.dumps(value)   # a TOML basic string (or array of them) is JSON for these values
    return str(value)


def export_torchtitan_toml(strategy: Strategy, model: ModelSpec, training: TrainingSpec,
                           runtime: RuntimeSpec | None = None) -> Exported:
    """The [parallelism], [training] and [activation_checkpoint] sections of a torchtitan
    0.2 job TOML (torchtitan 0.2.2 config/job_config.py). `runtime`: the plan's, whose
    moe_dispatch and ep_overlap are written as expert_parallel_comm_backend and DualPipeV's
    pipeline_parallel_expert_parallel_overlap where the plan has ep > 1."""
    moe_dispatch = runtime.moe_dispatch if runtime is not None else "all-to-all"
    ep_overlap = runtime.ep_overlap if runtime is not None else 0.0
    par, train, ac, warnings = _torchtitan_fields(strategy, model, training, toml=True)
    s = strategy
    if model.is_moe and s.ep > 1:
        par["expert_parallel_comm_backend"] = "deepep" if moe_dispatch == "deepep" else "standard"
        if s.schedule == "dualpipev" and s.pp > 1:
            # On by default in torchtitan 0.2.2, which then refuses activation checkpointing.
            overlap = ep_overlap > 0 and ac == "none"
            par["pipeline_parallel_expert_parallel_overlap"] = overlap
            if ep_overlap > 0 and not overlap:
                warnings.append("torchtitan overlaps DualPipeV's expert exchange only without activation checkpointing "
                                "(distributed/dual_pipe_v.py): exported with the overlap off, which the plan priced on")
    lines = ["[parallelism]"] + [f"{k} = {_toml_value(v)}" for k, v in par.items()]
    lines += ["", "[training]"] + [f"{k} = {_toml_value(v)}" for k, v in train.items()]
    lines += ["", "[activation_checkpoint]", f"mode = {_toml_value(ac)}"]
    if ac == "selective":
        lines.append('selective_ac_option = "op"')
    table, fp8_warnings, _ = _float8_fields(strategy, model, training, par, toml=True)
    if table is not None:
        lines += ["", "[model]", f"converters = {_toml_value([TORCHTITAN_FLOAT8_CONVERTER])}",
                  "", "[quantize.linear.float8]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return Exported("\n".join(lines) + "\n", tuple(warnings + fp8_warnings))
