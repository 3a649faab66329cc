"""One rank's trainer: builds its part of the model from a strategy (through
executor.parallelize), the optimizer with its learning-rate schedule, the pipeline
schedule, and runs training steps: micro-batches, gradient synchronisation, the tied
embedding's gradient, clipping by the global norm, the update. Every rank of the job
calls `Trainer.step` with the same global batch; each takes its own share (on a mixed
cluster's replica groups, its replica's number of micro-batches).
"""

from __future__ import annotations

import inspect
import math
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel as DDP

from costmodel.specs import ModelSpec, TrainingSpec
from costmodel.strategy import Strategy
from executor.data import replica_shard
from executor.models import canonical_name, materialize
from executor.parallelize import (
    UnsupportedPlan,
    apply_expert_parallel,
    apply_fsdp,
    apply_recompute,
    apply_replicate,
    apply_tensor_parallel,
    build_mesh,
    check_supported,
    expert_parameters,
    stage_module,
)


@dataclass(frozen=True)
class TrainConfig:
    """Optimizer and schedule settings (GPT-3's recipe, Brown et al. 2020 §B: Adam
    beta2 0.95, weight decay 0.1, clipping at 1.0, warm-up then cosine to 10%), and the
    dtype of weights, gradients and optimizer states: float32, or float64 to tell a
    numerical difference from a bug (a layout's summation order then moves results by
    ~1e-16 relative, not ~1e-7). Autocast (the plan's bf16 / fp16) lowers the matmuls
    of either."""

    lr: float = 1e-3
    warmup_steps: int = 2
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = 0.9
    grad_clip: float = 1.0
    seed: int = 0
    dtype: torch.dtype = torch.float32


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
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=zero_group, **kwargs)
    return cls(params, **kwargs)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss; vocabulary-sharded logits need the loss_parallel context."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# DDP's switch for not broadcasting buffers each forward: `forward_sync_buffers` in
# recent PyTorch, `broadcast_buffers` (deprecated there) before.
NO_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                  else {"broadcast_buffers": False})


def data_parallel_kind(strategy: Strategy) -> str:
    """How the dp replicas are kept in step: "none", "ddp" (ZeRO-0, and ZeRO-1 with
    ZeroRedundancyOptimizer, Rajbhandari et al. 2020 §5.1), "replicate" (ZeRO-0 over
    tensor-parallel weights) or "fsdp" (ZeRO-2 and 3; ZeRO-1 over tensor-parallel weights
    runs as ZeRO-2: the same traffic per step, less memory than planned)."""
    if strategy.dp == 1:
        return "none"
    if strategy.zero_stage >= 2 or (strategy.zero_stage == 1 and strategy.tp > 1):
        return "fsdp"
    return "replicate" if strategy.tp > 1 else "ddp"


class Trainer:
    """The model parts, optimizer and schedule of this rank for `strategy`."""

    def __init__(self, spec: ModelSpec, training: TrainingSpec, strategy: Strategy,
                 config: TrainConfig = TrainConfig(), device: torch.device | str = "cpu"):
        check_supported(spec, strategy, training.seq_len)
        if dist.get_world_size() != strategy.num_gpus:
            raise UnsupportedPlan(f"plan.strategy: the plan needs {strategy.num_gpus} processes "
                                  f"(dp {strategy.dp} x tp {strategy.tp} x pp {strategy.pp}), "
                                  f"{dist.get_world_size()} were started")
        self.spec, self.training, self.strategy, self.config = spec, training, strategy, config
        self.device = torch.device(device)
        self.mesh, self.dp_mesh = build_mesh(strategy, self.device.type)
        coords = dict(zip(self.mesh.mesh_dim_names, self.mesh.get_coordinate()))
        self.pp_rank = coords["pp"]
        self.dp_rank = self.dp_mesh.get_local_rank()
        self.is_last = self.pp_rank == strategy.pp - 1
        self.tied_ends = self._tied_ends_group()
        self.data_parallel = data_parallel_kind(strategy)
        self.modules = [self._build(stage) for stage in self._stages()]
        self.optimizer = make_optimizer(training.optimizer, self._parameters(), config,
                                        self.dp_mesh.get_group() if self.data_parallel == "ddp" and strategy.zero_stage == 1 else None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(config, s))
        self.schedule = self._pipeline_schedule() if strategy.pp > 1 else None
        self.skipped_update = False   # whether the last step's gradients were not finite

    # -- building -------------------------------------------------------------------

    def _stages(self):
        if self.strategy.pp == 1:
            return [None]
        return list(self.strategy.rank_stages(self.pp_rank))

    def _build(self, stage) -> nn.Module:
        s = self.strategy
        model = stage_module(self.spec, self.training.seq_len, stage, s.num_virtual_stages, self.config.dtype)
        if s.tp > 1:
            model.untie()
        apply_recompute(model, stage, s)
        for layer in model.layers.values():
            layer.attention.flash = self.training.flash_attention
        if s.ep > 1:
            apply_expert_parallel(model, self.mesh["ep"])
        if s.tp > 1:
            apply_tensor_parallel(model, self.mesh["tp"], s.sequence_parallel)
        experts = {p for _, p in expert_parameters(model)}
        if self.data_parallel == "fsdp":
            apply_fsdp(model, self.dp_mesh, max(2, s.zero_stage), experts)
        elif self.data_parallel == "replicate":
            apply_replicate(model, self.dp_mesh, experts)
        materialize(model, self.device, self.config.seed)
        model.stage = stage
        if self.data_parallel == "ddp":
            DDP._set_params_and_buffers_to_ignore_for_model(model, [n for n, _ in expert_parameters(model)])
            # Buffers (the RoPE tables) are computed identically on every rank: no
            # per-step broadcast.
            model = DDP(model, process_group=self.dp_mesh.get_group(), **NO_BUFFER_SYNC)
        return model

    def _parameters(self):
        return [p for m in self.modules for p in m.parameters()]

    def _autocast_dtype(self) -> torch.dtype | None:
        """The plan's bf16 / fp16 for the matmuls; None in fp32, and in float64 (a
        debugging run computes everything in float64)."""
        if self.config.dtype == torch.float64:
            return None
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.training.precision)

    def numerics(self) -> dict:
        """What the run computed in, for its summary: the weights' dtype, the autocast
        dtype ("none" without), and whether algorithms were forced deterministic."""
        return {"dtype": str(self.config.dtype).removeprefix("torch."),
                "autocast": self.training.precision if self._autocast_dtype() else "none",
                "deterministic": torch.are_deterministic_algorithms_enabled()}

    def autocast(self):
        """The plan's mixed precision: matmuls in bf16 / fp16 under torch.autocast,
        weights, gradients and optimizer states in `config.dtype`."""
        lower = self._autocast_dtype()
        if lower is None:
            return nullcontext()
        # No cache of weight casts: one autocast region spans every micro-batch of a
        # step, and under FSDP2's accumulation a cast cached in the first micro-batch
        # gave the later ones wrong gradients (tiny-gpt, ZeRO-2/3 with 2 micro-batches,
        # bf16: losses 3e-3 off one process's from the second step; tests/executor/
        # test_executor_parity.py). Each weight is cast once per forward either way.
        return torch.autocast(self.device.type, dtype=lower, cache_enabled=False)

    def _models(self) -> list[nn.Module]:
        """This rank's model parts, without their DDP wrappers."""
        return [m.module if isinstance(m, DDP) else m for m in self.modules]

    def _tied_ends_group(self):
        if not self.spec.tie_word_embeddings or self.strategy.pp == 1:
            return None
        return tied_ends_group(self.mesh)

    def _pipeline_schedule(self):
        # Imported here: torch.distributed.pipelining pulls in torch.export (seconds of
        # start-up that runs without a pipeline need not pay).
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        s, b, t = self.strategy, self.strategy.micro_batch_size, self.training.seq_len
        h, v = self.spec.hidden_size, self.spec.vocab_size
        local_t = t // s.tp if s.sequence_parallel else t
        # Stages exchange the residual stream, in the weights' dtype (under autocast the
        # matmuls run lower, but each residual add is in this dtype).
        dtype = self.config.dtype
        stages = []
        for module, inner in zip(self.modules, self._models()):
            index = inner.stage.index
            first, last = index == 0, index == s.num_virtual_stages - 1
            # Shapes given up front (pipelining's static metadata): no shape-inference
            # pass. Hidden states carry gradients between stages; token ids do not.
            hidden = torch.empty(b, local_t, h, dtype=dtype, device="meta", requires_grad=True)
            example_in = torch.zeros(b, t, dtype=torch.long, device="meta") if first else hidden
            example_out = torch.empty(b, t, v // s.tp, dtype=dtype, device="meta", requires_grad=True) if last else hidden
            stages.append(PipelineStage(module, index, s.num_virtual_stages, self.device,
                                        input_args=example_in, output_args=example_out,
                                        group=self.mesh["pp"].get_group()))
        if s.schedule == "interleaved":
            return ScheduleInterleaved1F1B(stages, n_microbatches=s.num_microbatches, loss_fn=cross_entropy)
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[s.schedule]
        return cls(stages[0], n_microbatches=s.num_microbatches, loss_fn=cross_entropy)

    # -- one step -------------------------------------------------------------------

    def local_batch(self, inputs: torch.Tensor, targets: torch.Tensor):
        """This rank's dp share of the global batch (its replica's micro-batches)."""
        x, y = replica_shard(inputs, targets, self.strategy, self.dp_rank)
        return x.to(self.device), y.to(self.device)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of this rank's share; the mean loss on the last stage."""
        s = self.strategy
        with loss_parallel() if s.tp > 1 else nullcontext(), self.autocast():
            if self.schedule is not None:
                losses = []
                first = any(m.stage.index == 0 for m in self._models())
                self.schedule.step(*((inputs,) if first else ()),
                                   **(dict(target=targets, losses=losses) if self.is_last else {}))
                return torch.stack([self._plain(l.detach()) for l in losses]).mean() if self.is_last else None
            model = self.modules[0]
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            count = s.replica_share(self.dp_rank)[1]
            # DDP and FSDP average gradients over dp. Dividing each micro-batch's loss
            # by an average replica's micro-batch count (all micro-batches / dp) makes
            # that average the gradient of the mean loss over the whole global batch,
            # also when replicas run different counts (a mixed cluster's shares).
            per_replica = sum(s.replica_share(d)[1] for d in range(s.dp)) / s.dp
            for i, (x, y) in enumerate(zip(inputs.chunk(count), targets.chunk(count))):
                last = i == count - 1
                with ExitStack() as stack:
                    self._accumulate(stack, model, last)
                    loss = cross_entropy(model(x), y)
                    (loss / per_replica).backward()
                total += self._plain(loss.detach()).double()
            return total / count

    def _accumulate(self, stack: ExitStack, model: nn.Module, last: bool) -> None:
        """Gradient accumulation over micro-batches: DDP reduces on the last one only;
        ZeRO-2 keeps weights gathered and gradients unreduced until then."""
        if isinstance(model, DDP) and not last:
            stack.enter_context(model.no_sync())
        if self.data_parallel == "replicate":
            model.set_requires_gradient_sync(last)
        if self.data_parallel == "fsdp" and self.strategy.zero_stage < 3:
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)

    def synchronize_gradients(self) -> None:
        """What DDP and FSDP do not: the tied embedding's two copies, and expert weights."""
        s = self.strategy
        for p in self._parameters():
            # DTensor's embedding backward returns a replicated gradient of a
            # vocabulary-sharded weight: keep this rank's rows (a local slice, no traffic).
            if isinstance(p, DTensor) and p.grad is not None and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        if s.sequence_parallel and s.tp > 1:
            # Each tp rank adds only its slice of the learned positions, so the
            # replicated table's gradient is the sum over the tp ranks.
            for inner in self._models():
                if inner.pos_embeddings is not None:
                    dist.all_reduce(self._local(inner.pos_embeddings.weight.grad), group=self.mesh["tp"].get_group())
        if self.spec.tie_word_embeddings and (s.pp > 1 or s.tp > 1):
            grads = [self._local(p.grad) for p in self._tied_parameters()]
            if s.pp == 1:
                total = grads[0] + grads[1]
                for g in grads:
                    g.copy_(total)
            elif grads:
                dist.all_reduce(grads[0], group=self.tied_ends)
        # Expert weights see tokens from every dp rank through the all-to-all: the
        # gradient of the dp-mean loss is their sum over edp divided by dp.
        for inner in self._models():
            for _, p in expert_parameters(inner):
                if p.grad is not None:
                    if s.dp // s.ep > 1:
                        dist.all_reduce(p.grad, group=self.mesh["edp"].get_group())
                    p.grad.div_(s.dp)

    def _tied_parameters(self) -> list[nn.Parameter]:
        out = []
        for inner in self._models():
            if inner.tok_embeddings is not None:
                out.append(inner.tok_embeddings.weight)
            if inner.output is not None:
                out.append(inner.output.weight)
        return out

    @staticmethod
    def _plain(t: torch.Tensor) -> torch.Tensor:
        """A replicated DTensor (the loss under loss_parallel) as a plain tensor."""
        return t.full_tensor() if isinstance(t, DTensor) else t

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def clip_gradients(self) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most grad_clip (Pascanu et al.
        2013), the norm taken over every distinct parameter once: each rank's local
        squares are divided by the number of ranks holding the same values."""
        s = self.strategy
        skip = set()
        if self.spec.tie_word_embeddings and (s.pp > 1 or s.tp > 1):
            skip = {id(inner.output.weight) for inner in self._models() if inner.output is not None}
        experts = {id(p) for inner in self._models() for _, p in expert_parameters(inner)}
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for p in self._parameters():
            if p.grad is None:
                continue
            grads.append(self._local(p.grad))
            if id(p) in skip:
                continue
            total += torch.linalg.vector_norm(grads[-1], dtype=torch.float64).square() / self._replicas(p, id(p) in experts)
        dist.all_reduce(total)
        norm = total.sqrt()
        scale = torch.clamp(self.config.grad_clip / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        return norm

    def _replicas(self, param: torch.Tensor, expert: bool) -> int:
        s = self.strategy
        sizes = {"dp": s.dp // s.ep if expert else s.dp, "tp": s.tp}
        if isinstance(param, DTensor):
            for name, placement in zip(param.device_mesh.mesh_dim_names, param.placements):
                # FSDP over TP shards as _StridedShard, which is not a Shard subclass.
                if (placement.is_shard() or isinstance(placement, _StridedShard)) and name in sizes:
                    sizes[name] = 1
        return sizes["dp"] * sizes["tp"]

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One optimizer step on the global batch; this rank's loss (last stage only)."""
        x, y = self.local_batch(inputs, targets)
        loss = self.forward_backward(x, y)
        self.synchronize_gradients()
        norm = self.clip_gradients()
        # A non-finite loss makes the global gradient norm non-finite on every rank
        # alike: no rank updates (the caller decides whether to stop).
        self.skipped_update = not bool(torch.isfinite(norm))
        if not self.skipped_update:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """`train_step`, and the global batch's mean loss on every rank."""
        return self.global_loss(self.train_step(inputs, targets))

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights of this rank's pipeline stages, by their names in the unsplit
        model (gathered over tp, dp and ep; every rank of the stage gets them)."""
        out = {}
        for inner in self._models():
            experts = {id(p) for _, p in expert_parameters(inner)}
            for name, p in inner.named_parameters():
                value = p.full_tensor() if isinstance(p, DTensor) else p.detach()
                if id(p) in experts:
                    parts = [torch.empty_like(value) for _ in range(self.strategy.ep)]
                    dist.all_gather(parts, value.contiguous(), group=self.mesh["ep"].get_group())
                    value = torch.cat(parts)
                out[canonical_name(name)] = value.cpu().clone()
        return out

    def global_loss(self, loss: torch.Tensor | None) -> float:
        return global_loss(loss, self.strategy, self.device, self.dp_rank)


def tied_ends_group(mesh) -> dist.ProcessGroup | None:
    """This rank's group of the ranks holding the embedding and the head's copy of it
    (first and last pipeline stage, same dp and tp coordinate), whose gradients are
    summed (Megatron-LM); None on the ranks between. Every rank must call it."""
    ranks = mesh.mesh   # [pp, edp, ep, tp] global ranks
    mine = None
    for index in torch.cartesian_prod(*(torch.arange(n) for n in ranks.shape[1:])).view(-1, 3).tolist():
        pair = [int(ranks[0][tuple(index)]), int(ranks[-1][tuple(index)])]
        group = dist.new_group(pair)   # every rank creates every group, in the same order
        if dist.get_rank() in pair:
            mine = group
    return mine


def global_loss(loss: torch.Tensor | None, strategy: Strategy, device: torch.device, dp_rank: int) -> float:
    """The global batch's mean loss, on every rank: the last stage's replica means
    (`loss`, this rank's) weighted by their replicas' sequences; its tp ranks hold the
    same value."""
    counts = [strategy.replica_share(d)[1] for d in range(strategy.dp)]
    value = torch.zeros((), dtype=torch.float64, device=device)
    if loss is not None:
        value += loss.double() * counts[dp_rank]
    dist.all_reduce(value)
    return float(value) / (sum(counts) * strategy.tp)
