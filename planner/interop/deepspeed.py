"""DeepSpeed: a config JSON, read as a strategy (`read_deepspeed`) and written from one
(`export_deepspeed`). Keys cite DeepSpeed 0.19.8 `deepspeed/runtime/config.py`,
`runtime/zero/config.py`, `runtime/tensor_parallel/config.py`, `runtime/pipe/engine.py`,
`runtime/activation_checkpointing/config.py`.
"""

from __future__ import annotations

import json

from costmodel.specs import ModelSpec, RuntimeSpec, TrainingSpec
from costmodel.specs.loading import SpecError
from costmodel.strategy import Strategy
from planner.interop.common import (
    Exported,
    Imported,
    Recompute,
    all_or_nothing,
    build_stages,
    divide,
    engine_strategy,
    even_sizes,
    recompute_form,
)

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
        dp = divide(num_gpus, tp, "tensor_parallel.autotp_size", f"of the cluster's {num_gpus} GPUs")
        accumulation = divide(total, micro * dp, "train_batch_size", f"micro-batch {micro} x dp {dp}")
    else:
        dp = divide(total, micro * accumulation, "train_batch_size",
                     f"train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps {accumulation}")
    pp = divide(num_gpus, dp * tp, "train_batch_size",
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
    sizes = even_sizes(model.num_hidden_layers, pp)
    strategy = engine_strategy(dp, tp, pp, micro, accumulation, 1, 1, "1f1b", stage if dp > 1 else 0, False,
                         build_stages(sizes, pp, recompute))
    return Imported(strategy, total, None, precision, tuple(warnings))


def export_deepspeed(strategy: Strategy, model: ModelSpec, training: TrainingSpec,
                     runtime: RuntimeSpec | None = None) -> Exported:
    """A DeepSpeed config JSON (keys: DEEPSPEED_KEYS). The pipeline and
    expert degrees are not config keys in DeepSpeed: they are said in warnings. A plan
    with context parallelism or FP8 is refused (SpecError): no DeepSpeed setting runs it."""
    s, warnings = strategy, []
    if s.cp > 1:
        # DeepSpeed's sequence parallelism is Ulysses (deepspeed/sequence/layer.py
        # DistributedAttention): all-to-all from sequence to head shards and back, another
        # scheme with other costs than the plan's K/V all-gather over a sequence split.
        raise SpecError("plan.strategy.cp", f"{s.cp}: DeepSpeed has no context parallelism that all-gathers K and V "
                        "(its Ulysses sequence parallelism scatters attention heads all-to-all); export to "
                        "torchtitan or megatron, or plan with --fix cp=1")
    if training.fp8 is not None:
        # DeepSpeed 0.19.8 runtime/config.py and runtime/constants.py have no FP8 key: the
        # precision keys are bf16 and fp16.
        raise SpecError("plan.training.fp8", f"{training.fp8}: a DeepSpeed config has no FP8 training setting (its "
                        "precision keys are bf16 and fp16); export to torchtitan or megatron, or plan with "
                        "--precision bf16")
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
    if s.ep > 1 or model.moe_capacity_factor is not None:
        said = ", ".join(([f"ep_size={s.ep}"] if s.ep > 1 else [])
                         + ([f"capacity_factor={model.moe_capacity_factor:g}"] if model.moe_capacity_factor else []))
        warnings.append(f"DeepSpeed sets its experts in code: deepspeed.moe.layer.MoE(..., {said}) "
                        "(deepspeed/moe/layer.py)")
    mode = recompute_form(s)
    if mode is not None and mode.mode == "selective":
        warnings.append("DeepSpeed has no selective (attention-core) recompute: exported without recompute")
        mode = Recompute("none")
    elif mode is None or mode.full_layers is not None:
        mode = Recompute(all_or_nothing(s, "DeepSpeed", "its pipeline checkpoints every n-th layer; "
                                          "deepspeed.checkpointing wraps what the model wraps", warnings))
    if mode.mode == "full":
        if s.pp > 1:
            config["pipeline"] = {"activation_checkpoint_interval": 1}
        else:
            config["activation_checkpointing"] = {"number_checkpoints": model.num_hidden_layers}
            warnings.append("activation_checkpointing configures deepspeed.checkpointing; the model must call "
                            "deepspeed.checkpointing.checkpoint on each layer (the config does not turn recompute on)")
    return Exported(json.dumps(config, indent=2) + "\n", tuple(warnings))
