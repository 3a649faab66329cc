"""The one training step, whatever the model and however it was split. Every rank of
the job calls it with the same global batch and takes its own share (on a mixed
cluster's replica groups, its replica's number of micro-batches; under context
parallelism, its tokens of each of its replica's sequences).

A step is: forward and backward of the share under the plan's autocast, by the
pipeline schedule (torch.distributed.pipelining) when pp > 1, by gradient accumulation
over micro-batches otherwise; the gradient synchronisation that DDP and FSDP do not do
(DTensor gradient layouts, the learned positions under sequence parallelism, the tied
embedding's two copies, expert weights); clipping by the global norm; the optimizer's
update; the learning-rate schedule. The global batch's mean loss ends it.

What differs between models arrives as data, `ModelParts`, which a model adapter
builds: executor.parallelize.BuiltinModel for Shardwise's own Transformer,
executor.auto.DecoderModel for a Hugging Face decoder LM.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.parallel import DistributedDataParallel as DDP

from costmodel.strategy import Strategy
from executor.data import context_shard, replica_shard
from executor.launch import UnsupportedPlan
from executor.mesh import RankMesh

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str, dtype: torch.dtype) -> torch.dtype | None:
    """The plan's bf16 / fp16 for the matmuls of weights in `dtype`; None in fp32, and
    in float64 (a debugging run computes everything in float64)."""
    if dtype == torch.float64:
        return None
    return AUTOCAST_DTYPES.get(precision)


@dataclass(frozen=True)
class Accumulation:
    """What a model part's data-parallel wrapper is told on each micro-batch, besides
    DDP's no_sync before the last one: `defer_sync` (FSDP2, `replicate`) reduces the
    gradients on the last micro-batch only; `keep_gathered` (FSDP2 under ZeRO-2) keeps
    the weights gathered from the first forward to the last backward."""

    defer_sync: bool = False
    keep_gathered: bool = False


@dataclass(frozen=True, eq=False)   # eq=False: comparing parameters with == is elementwise, not a bool
class TiedEmbedding:
    """This rank's copies of an input embedding tied to the LM head, when the two are
    separate parameters (tensor parallelism splits them, or the pipeline's ends are
    separate stages): their gradients are summed each step, here when both are here,
    over `ends_group` (the first and last stage's ranks) otherwise (Megatron-LM)."""

    embedding: nn.Parameter | None
    head: nn.Parameter | None
    ends_group: dist.ProcessGroup | None = None


@dataclass(frozen=True)
class StageShapes:
    """What pipeline stages exchange per micro-batch (pipelining's static metadata: no
    shape-inference pass): token ids [b, seq_len] into the first stage, hidden states
    [b, hidden_seq_len, hidden_size] between stages, logits [b, seq_len, logits_width]
    out of the last; hidden states and logits in `dtype`."""

    seq_len: int
    hidden_seq_len: int
    hidden_size: int
    logits_width: int
    dtype: torch.dtype


@dataclass(frozen=True, eq=False)
class ModelParts:
    """This rank's share of the model as the step runs it, built by a model adapter."""

    modules: tuple[nn.Module, ...]     # as the step calls them: wrapped for data parallelism
    stage_indices: tuple[int, ...]     # each module's pipeline stage (0 when pp is 1)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    vocab_parallel_loss: bool          # logits sharded over the vocabulary: the loss runs under loss_parallel
    accumulation: Accumulation
    shapes: StageShapes
    tied: TiedEmbedding | None = None
    expert_parameters: tuple[nn.Parameter, ...] = ()   # sharded over ep (DTensors), replicated over edp
    experts_reduced_by_fsdp: bool = False   # FSDP shards them over edp and reduces their gradients
    summed_over_tp: tuple[nn.Parameter, ...] = ()      # each tp rank's gradient is one part of the whole
    # Run after each optimizer update: FP8 weights' scales for FSDP2's float8 all-gather,
    # computed for all of them at once (executor.parallelize).
    after_update: tuple[Callable[[], None], ...] = ()

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under loss_parallel) as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class TrainStep:
    """One optimizer step of this rank's parts. `grad_clip` None leaves the gradients
    as they are (no norm, so no check that they are finite); a scheduler of None keeps
    the learning rate."""

    def __init__(self, parts: ModelParts, strategy: Strategy, mesh: RankMesh, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None, grad_clip: float | None,
                 autocast_dtype: torch.dtype | None, device: torch.device):
        self.parts, self.strategy, self.mesh, self.device = parts, strategy, mesh, device
        self.optimizer, self.scheduler, self.grad_clip = optimizer, scheduler, grad_clip
        self.autocast_dtype = autocast_dtype
        # The last virtual stage's rank computes the loss: the last pipeline rank, or
        # rank 0 under zbv's and dualpipev's V (costmodel.strategy.stage_rank).
        self.is_last_stage = strategy.num_virtual_stages - 1 in parts.stage_indices if strategy.pp > 1 else True
        self.schedule = self._pipeline_schedule() if strategy.pp > 1 else None
        self._can_drop_outputs = (self.schedule is not None
                                  and "return_outputs" in inspect.signature(self.schedule.step).parameters)
        self.skipped_update = False   # whether the last step's gradients were not finite

    def _pipeline_schedule(self):
        # Imported here: torch.distributed.pipelining pulls in torch.export (seconds of
        # start-up that runs without a pipeline need not pay).
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble,
            schedules,
        )

        s, shapes, b = self.strategy, self.parts.shapes, self.strategy.micro_batch_size
        stages = []
        for module, index in zip(self.parts.modules, self.parts.stage_indices):
            first, last = index == 0, index == s.num_virtual_stages - 1
            # Hidden states carry gradients between stages; token ids do not.
            hidden = torch.empty(b, shapes.hidden_seq_len, shapes.hidden_size, dtype=shapes.dtype, device="meta",
                                 requires_grad=True)
            example_in = torch.zeros(b, shapes.seq_len, dtype=torch.long, device="meta") if first else hidden
            example_out = (torch.empty(b, shapes.seq_len, shapes.logits_width, dtype=shapes.dtype, device="meta",
                                       requires_grad=True) if last else hidden)
            stages.append(PipelineStage(module, index, s.num_virtual_stages, self.device,
                                        input_args=example_in, output_args=example_out,
                                        group=self.mesh["pp"].get_group()))
        multi = {"interleaved": ScheduleInterleaved1F1B, "zb-interleaved": ScheduleInterleavedZeroBubble,
                 "zbv": ScheduleZBVZeroBubble, "dualpipev": getattr(schedules, "ScheduleDualPipeV", None)}
        if s.schedule in multi:
            if multi[s.schedule] is None:
                raise UnsupportedPlan("strategy.schedule: dualpipev needs torch.distributed.pipelining's "
                                      f"ScheduleDualPipeV, which torch {torch.__version__} lacks")
            return multi[s.schedule](stages, n_microbatches=s.num_microbatches, loss_fn=self.parts.loss_fn)
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[s.schedule]
        return cls(stages[0], n_microbatches=s.num_microbatches, loss_fn=self.parts.loss_fn)

    def autocast(self):
        """The plan's mixed precision: matmuls in bf16 / fp16 under torch.autocast,
        weights, gradients and optimizer states in their own dtype."""
        if self.autocast_dtype is None:
            return nullcontext()
        # No cache of weight casts: one autocast region spans every micro-batch of a
        # step, and under FSDP2's accumulation a cast cached in the first micro-batch
        # gave the later ones wrong gradients (tiny-gpt, ZeRO-2/3 with 2 micro-batches,
        # bf16: losses 3e-3 off one process's from the second step; tests/executor/
        # test_step.py). Each weight is cast once per forward either way.
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=False)

    # -- one step -------------------------------------------------------------------

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One optimizer step on the global batch; this rank's loss (last stage only)."""
        x, y = self.local_batch(inputs, targets)
        loss = self.forward_backward(x, y)
        self.synchronize_gradients()
        if self.grad_clip is not None:
            norm = self.clip_gradients()
            # A non-finite loss makes the global gradient norm non-finite on every rank
            # alike: no rank updates (the caller decides whether to stop).
            self.skipped_update = not bool(torch.isfinite(norm))
        if not self.skipped_update:
            self.optimizer.step()
            for update in self.parts.after_update:
                update()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def local_batch(self, inputs: torch.Tensor, targets: torch.Tensor):
        """This rank's share of the global batch: its replica's micro-batches, and of
        their sequences this cp rank's tokens."""
        x, y = replica_shard(inputs, targets, self.strategy, self.mesh.dp_rank)
        if self.strategy.cp > 1:
            x, y = context_shard(x, y, self.mesh.cp_rank, self.strategy.cp)
        return x.to(self.device), y.to(self.device)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of this rank's share; the mean loss on the last stage."""
        s, parts = self.strategy, self.parts
        with loss_parallel() if parts.vocab_parallel_loss else nullcontext(), self.autocast():
            if self.schedule is not None:
                losses = []
                first = 0 in parts.stage_indices
                # return_outputs=False: by default the last stage keeps every micro-batch's
                # output, the logits, to merge them at the end of the step (m x mbs x seq x
                # vocab values; 32 GiB for Llama 3 8B at seq 8192 and 16 micro-batches).
                # (torch before 2.8 has no such argument and keeps them.)
                keep = {"return_outputs": False} if self._can_drop_outputs else {}
                self.schedule.step(*((inputs,) if first else ()), **keep,
                                   **(dict(target=targets, losses=losses) if self.is_last_stage else {}))
                return torch.stack([_plain(l.detach()) for l in losses]).mean() if self.is_last_stage else None
            model = parts.modules[0]
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            count = s.replica_share(self.mesh.dp_rank)[1]
            # DDP and FSDP average gradients over dp (x cp). Dividing each micro-batch's
            # loss by an average replica's micro-batch count (all micro-batches / dp)
            # makes that average the gradient of the mean loss over the whole global
            # batch, also when replicas run different counts (a mixed cluster's shares);
            # each cp rank's loss is the mean over its equal share of the tokens.
            per_replica = sum(s.replica_share(d)[1] for d in range(s.dp)) / s.dp
            for i, (x, y) in enumerate(zip(inputs.chunk(count), targets.chunk(count))):
                last = i == count - 1
                with ExitStack() as stack:
                    self._accumulate(stack, model, last)
                    loss = parts.loss_fn(model(x), y)
                    (loss / per_replica).backward()
                total += _plain(loss.detach()).double()
            return total / count

    def _accumulate(self, stack: ExitStack, model: nn.Module, last: bool) -> None:
        """Gradient accumulation over micro-batches: data parallelism reduces the
        gradients on the last one only."""
        if isinstance(model, DDP) and not last:
            stack.enter_context(model.no_sync())
        if self.parts.accumulation.defer_sync:
            model.set_requires_gradient_sync(last)
        if self.parts.accumulation.keep_gathered:
            model.set_reshard_after_backward(last)

    def synchronize_gradients(self) -> None:
        """What DDP and FSDP do not: gradient layouts, the learned positions under
        sequence parallelism, the tied embedding's two copies, and expert weights."""
        s, parts = self.strategy, self.parts
        for p in parts.parameters():
            # DTensor's embedding backward returns a replicated gradient of a
            # vocabulary-sharded weight: keep this rank's rows (a local slice, no traffic).
            if isinstance(p, DTensor) and p.grad is not None and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        for p in parts.summed_over_tp:
            dist.all_reduce(_local(p.grad), group=self.mesh["tp"].get_group())
        if parts.tied is not None:
            grads = [_local(p.grad) for p in (parts.tied.embedding, parts.tied.head)
                     if p is not None and p.grad is not None]
            if len(grads) == 2:   # both copies here: pp 1, or a V (both ends on rank 0)
                total = grads[0] + grads[1]
                for g in grads:
                    g.copy_(total)
            elif grads:
                dist.all_reduce(grads[0], group=parts.tied.ends_group)
        # Expert weights see tokens from every rank of their ep group through the
        # all-to-all (each token once: the tp ranks of a replica route their own sequence
        # shards): the gradient of the mean over the dp x cp losses is their sum over
        # edp divided by dp x cp. FSDP has taken the mean over edp already.
        for p in parts.expert_parameters:
            if p.grad is None:
                continue
            grad = _local(p.grad)
            if parts.experts_reduced_by_fsdp:
                grad.mul_(s.edp / s.dp_cp)
                continue
            if s.edp > 1:
                dist.all_reduce(grad, group=self.mesh["edp"].get_group())
            grad.div_(s.dp_cp)

    def clip_gradients(self) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most grad_clip (Pascanu et al.
        2013), the norm taken over every distinct parameter once: each rank's local
        squares are divided by the number of ranks holding the same values, and the
        head's copy of a tied embedding is left to the embedding."""
        tied = self.parts.tied
        skip = {id(tied.head)} if tied is not None and tied.head is not None else set()
        experts = {id(p) for p in self.parts.expert_parameters}
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for p in self.parts.parameters():
            if p.grad is None:
                continue
            grads.append(_local(p.grad))
            if id(p) in skip:
                continue
            total += torch.linalg.vector_norm(grads[-1], dtype=torch.float64).square() / self._replicas(p, id(p) in experts)
        dist.all_reduce(total)
        norm = total.sqrt()
        scale = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        return norm

    def _replicas(self, param: torch.Tensor, expert: bool) -> int:
        s = self.strategy
        # The cp ranks of a replica hold the same weights; an expert is held by its edp
        # ranks only (its ep group spans the tp ranks).
        sizes = {"dp": s.edp, "tp": 1} if expert else {"dp": s.dp_cp, "tp": s.tp}
        if isinstance(param, DTensor):
            for name, placement in zip(param.device_mesh.mesh_dim_names, param.placements):
                # FSDP over TP shards as _StridedShard, which is not a Shard subclass.
                # Experts under FSDP: sharded over edp; the rest over dp, or dp x cp.
                key = "dp" if name in ("edp", "dp_cp") else name
                if (placement.is_shard() or isinstance(placement, _StridedShard)) and key in sizes:
                    sizes[key] = 1
        return sizes["dp"] * sizes["tp"]

    def global_loss(self, loss: torch.Tensor | None) -> float:
        """The global batch's mean loss, on every rank: the last stage's replica means
        (`loss`, this rank's) weighted by their replicas' sequences; its tp ranks hold
        the same value, its cp ranks the means over equal shares of the tokens."""
        s = self.strategy
        counts = [s.replica_share(d)[1] for d in range(s.dp)]
        value = torch.zeros((), dtype=torch.float64, device=self.device)
        if loss is not None:
            value += loss.double() * counts[self.mesh.dp_rank]
        dist.all_reduce(value)
        return float(value) / (sum(counts) * s.tp * s.cp)
