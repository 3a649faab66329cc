"""One rank's trainer, the only one: this rank's parts of the model, built by a model
adapter (executor.parallelize.BuiltinModel for Shardwise's own Transformer,
executor.auto.DecoderModel for a Hugging Face decoder LM), the optimizer with its
learning-rate schedule, and the training step (executor.step). `shardwise run`
(executor.run) and `auto_parallelize` (executor.auto) both train through it. Also the
plan runner's optimizer and schedule settings, and the model's full weights gathered
across the pipeline's stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from costmodel.specs import ModelSpec, TrainingSpec
from costmodel.strategy import Strategy
from executor.launch import UnsupportedPlan, degrees
from executor.mesh import RankMesh, build_mesh
from executor.parallelize import (
    BuiltinModel,
    Overlap,
    data_parallel_kind,
)
from executor.step import ModelParts, TrainStep, autocast_dtype


@dataclass(frozen=True)
class TrainConfig:
    """Optimizer and schedule settings (GPT-3's recipe, Brown et al. 2020 §B: Adam
    beta2 0.95, weight decay 0.1, clipping at 1.0, warm-up then cosine to 10%), and the
    dtype of weights, gradients and optimizer states: float32, or float64 to tell a
    numerical difference from a bug (a layout's summation order then moves results by
    ~1e-16 relative, not ~1e-7). Autocast (the plan's bf16 / fp16) lowers the matmuls
    of either, unless `autocast` is off. `grad_clip` None takes no global norm at all
    (and so does not skip an update whose gradients are not finite)."""

    lr: float = 1e-3
    warmup_steps: int = 2
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = 0.9
    grad_clip: float | None = 1.0
    seed: int = 0
    dtype: torch.dtype = torch.float32
    autocast: bool = True
    # torch.compile each transformer block with this backend (regional compilation, as
    # torchtitan does: "inductor" for speed, "aot_eager" to check the graphs quickly);
    # None runs eager.
    compile_backend: str | None = None
    # The plan's overlap settings (FSDP2 prefetch and kept units, DDP buckets, async TP).
    overlap: Overlap = Overlap()


def lr_factor(config: TrainConfig, step: int) -> float:
    """Multiplier of the base learning rate at `step` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(name: str, params, config: TrainConfig, zero_group=None) -> torch.optim.Optimizer:
    """The training spec's optimizer; `zero_group` shards its states (ZeRO-1) over that group."""
    params = list(params)
    foreach = False if any(isinstance(p, DTensor) for p in params) else None
    if name == "sgd":
        cls, kwargs = torch.optim.SGD, dict(lr=config.lr, momentum=config.momentum, foreach=foreach)
    else:
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        kwargs = dict(lr=config.lr, betas=config.betas, foreach=foreach,
                      weight_decay=config.weight_decay if name == "adamw" else 0.0)
    if zero_group is not None:
        # Imported here: torch.distributed.optim takes 0.3 s of every rank's start-up.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=zero_group, **kwargs)
    return cls(params, **kwargs)


class RankModel(Protocol):
    """What the trainer needs of a model adapter (executor.parallelize.BuiltinModel,
    executor.auto.DecoderModel)."""

    parts: ModelParts                      # this rank's share, as the step runs it
    tied_names: tuple[str, str] | None     # (embedding, head) of a tied embedding

    def parameters(self) -> list[nn.Parameter]: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages' full, unsharded weights under the model's own names."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full, unsharded weights under the model's own names; each rank keeps its shards."""


class Trainer:
    """This rank's trainer of a plan (`spec`, `training`, `strategy`). By default it
    trains `spec`'s Transformer from `config.seed`'s weights with the training spec's
    optimizer under `config`'s schedule (`shardwise run`); `build_model` builds this
    rank's parts otherwise, from the job's mesh and this rank's device (a user's model,
    for auto_parallelize), and `optimizer` makes the user's optimizer from the
    parameters, run as it is: no schedule."""

    def __init__(self, spec: ModelSpec, training: TrainingSpec, strategy: Strategy,
                 config: TrainConfig = TrainConfig(), device: torch.device | str = "cpu", *,
                 build_model: Callable[[RankMesh, torch.device], RankModel] | None = None,
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None):
        if dist.get_world_size() != strategy.num_gpus:
            raise UnsupportedPlan(f"plan.strategy: the plan needs {strategy.num_gpus} processes "
                                  f"({degrees(strategy)}), {dist.get_world_size()} were started")
        self.spec, self.training, self.strategy, self.config = spec, training, strategy, config
        self.device = torch.device(device)
        self.mesh = build_mesh(strategy, self.device.type)
        if build_model is None:
            self.model = BuiltinModel(spec, training, strategy, self.mesh, config.dtype, config.seed, self.device,
                                      config.compile_backend, config.overlap)
        else:
            self.model = build_model(self.mesh, self.device)
        if optimizer is None:
            # ZeRO-1 over DDP: ZeroRedundancyOptimizer shards the states over dp (x cp).
            zero_1 = data_parallel_kind(strategy) == "ddp" and strategy.zero_stage == 1
            self.optimizer = make_optimizer(training.optimizer, self.model.parameters(), config,
                                            self.mesh.dp_cp_mesh.get_group() if zero_1 else None)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(config, s))
        else:
            self.optimizer, self.scheduler = optimizer(self.model.parameters()), None
        self.autocast_dtype = autocast_dtype(training.precision, config.dtype) if config.autocast else None
        # One optimizer step on the global batch; this rank's loss (last stage only).
        self.train_step = TrainStep(self.model.parts, strategy, self.mesh, self.optimizer, self.scheduler,
                                    config.grad_clip, self.autocast_dtype, self.device)

    @property
    def skipped_update(self) -> bool:
        """Whether the last step's gradients were not finite (no update was made)."""
        return self.train_step.skipped_update

    def step(self, inputs, targets: torch.Tensor | None = None) -> float:
        """One optimizer step on the global batch, the same on every rank; the global
        batch's mean loss, on every rank. The batch is `inputs` and `targets` as the loss
        takes them (next-token targets for Shardwise's models, the model's labels for a
        Hugging Face one), or one argument: a dict with `input_ids` and `labels`
        (default: the inputs), or an (inputs, targets) pair."""
        if targets is None:
            if isinstance(inputs, dict):
                inputs, targets = inputs["input_ids"], inputs.get("labels", inputs["input_ids"])
            else:
                inputs, targets = inputs
        self._check_batch(inputs)
        return self.train_step.global_loss(self.train_step(inputs, targets))

    def _check_batch(self, inputs) -> None:
        """The batch is the plan's: a global batch of sequences of its length (token ids:
        [global_batch, seq_len]). Said here, at the call, rather than as a shape error deep
        in a pipeline stage or the loss."""
        if not isinstance(inputs, torch.Tensor) or inputs.dim() == 0:
            return
        b, s = self.training.global_batch, self.training.seq_len
        tokens = inputs.dim() >= 2 and not inputs.is_floating_point()
        if inputs.shape[0] != b or (tokens and inputs.shape[1] != s):
            want = f"[{b}, {s}] (global batch x seq_len)" if tokens else f"{b} samples (the global batch)"
            raise ValueError(f"batch: inputs of shape {list(inputs.shape)}, but the plan is for {want}; "
                             f"plan for this shape (plan --global-batch / --seq, auto_parallelize "
                             f"global_batch= / seq_len=) or cut the batch to it")

    def numerics(self) -> dict:
        """What the run computed in, for its summary: the weights' dtype, the autocast
        dtype ("none" without), whether algorithms were forced deterministic, the
        blocks' torch.compile backend ("none": eager), and, for a built-in model, the
        overlap settings it ran with (async TP off where it cannot run)."""
        built_in = isinstance(self.model, BuiltinModel)
        return {"dtype": str(self.config.dtype).removeprefix("torch."),
                "autocast": self.training.precision if self.autocast_dtype else "none",
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "compile": self.config.compile_backend or "none",
                **({"overlap": asdict(self.model.overlap)} if built_in else {})}

    # -- weights --------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights of this rank's pipeline stages under the model's own names
        (gathered over tp, dp and ep; every rank of the stage gets them)."""
        return self.model.full_state_dict()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded weights of every stage, on every rank, under the model's
        own names (a tied head under both, as the model's own state_dict has it)."""
        merged = self.model.full_state_dict()
        if self.strategy.pp > 1:
            stages = [None] * self.strategy.pp
            dist.all_gather_object(stages, merged, group=self.mesh["pp"].get_group())
            merged = {}
            for stage in stages:
                merged.update(stage)
        if self.model.tied_names is not None:
            embedding, head = self.model.tied_names
            merged[head] = merged[embedding]
        return dict(sorted(merged.items()))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full, unsharded weights under the model's own names (what `state_dict`
        gives); each rank keeps its shards."""
        self.model.load_state_dict(state)
