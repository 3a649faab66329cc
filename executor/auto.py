"""`auto_parallelize`: inside a torchrun job, turn a user's model into a parallel
trainer for a plan, given or planned on the spot for the job's world size.

    trainer = auto_parallelize(model, cluster="dgx-h100", global_batch=64, fix={"tp": 2},
                               optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4))
    loss = trainer.step({"input_ids": ids, "labels": ids})   # the global batch, every rank

Every rank passes the same model with the same weights (seeded, or loaded) and the same
global batch; each keeps its share. The trainer is the executor's one `Trainer`
(executor.train), training through the one step (executor.step) as `shardwise run`
does; this module gives it the model and the user's optimizer. Two kinds of model:

- Shardwise's own (`executor.models.Transformer`): built for this rank as `shardwise
  run` builds it (executor.parallelize.BuiltinModel), then given the user's weights
  (torch.distributed.checkpoint's `set_model_state_dict` shards full tensors into
  DTensor and FSDP parameters).
- Hugging Face causal LMs of the usual decoder layout (an input embedding, a ModuleList
  of decoder layers, a final norm, an LM head): `DecoderModel` splits the model's own
  modules as the plan asks, trained on the model's own loss or `loss_fn`:
  * tensor parallelism by layer role (Shoeybi et al. 2019 §3; the roles of
    `costmodel.trace.split_role`): q/k/v, gate/up and fc column-wise, o/down/c_proj
    row-wise, the input embedding and the LM head over the vocabulary (the logits are
    gathered, so the model's own loss runs unchanged). GPT-2's Conv1D become the
    equivalent nn.Linear first, and its fused q/k/v is regrouped so that each rank's
    column shard holds its own heads' q, k and v;
  * pipeline stages cut at decoder layers: each stage runs the model's own forward on
    its layers, later stages feeding it `inputs_embeds` with the position table and
    embedding dropout muted, the final norm and the head only on the last stage;
  * data parallelism: DDP for ZeRO 0 (PyTorch's `replicate` over TP weights), FSDP2 for
    ZeRO 2 and 3; ZeRO 1 runs as ZeRO 2 (the same traffic; the optimizer is the user's,
    so it cannot be wrapped in ZeroRedundancyOptimizer);
  * recompute: `checkpoint_wrapper` on the first layers of each stage, whole (full) or
    under the op-level policy (selective; executor.models.op_level_context).
  A model it cannot split as the plan asks gets UnsupportedPlan naming the module; its
  weights go in and out under the model's own names and layouts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from costmodel.specs import ModelSpec, TrainingSpec
from costmodel.specs.loading import load_runtime
from costmodel.strategy import Strategy
from costmodel.trace import split_role
from executor.launch import UnsupportedPlan
from executor.mesh import RankMesh, tied_ends_group
from executor.models import op_level_context
from executor.parallelize import BuiltinModel, wrap_ddp
from executor.step import Accumulation, ModelParts, StageShapes, TiedEmbedding
from executor.train import TrainConfig, Trainer

Optimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-4)


def auto_parallelize(model: nn.Module, plan: dict | str | None = None, *, cluster: str | None = None,
                     global_batch: int | None = None, seq_len: int | None = None, fix: dict | None = None,
                     rules: str | None = None, loss_fn: Callable | None = None,
                     optimizer: Optimizer = default_optimizer, device: str | torch.device | None = None):
    """A trainer of `model` for `plan` (a plan document or file), or for the plan
    `planner.plan_model` finds for this job's world size on `cluster` (with `rules` and
    `fix`, a dict such as {"tp": 2, "pp": 2}); `seq_len` defaults to the model's
    maximum positions. The process group must be initialised (torchrun, or
    `dist.init_process_group`)."""
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:   # torchrun started us; the script has not joined the group yet
            raise RuntimeError("auto_parallelize: no process group is initialised: call "
                               "torch.distributed.init_process_group() before it")
        raise RuntimeError("auto_parallelize runs inside a process group: start the script with torchrun "
                           "(torchrun --nproc-per-node N script.py), or initialise one first")
    from planner.api import plan_model, plan_spec
    from planner.plan_file import read_plan, strategy_of

    builtin = isinstance(getattr(model, "spec", None), ModelSpec) and hasattr(model, "tok_embeddings")
    if builtin and loss_fn is not None:
        raise UnsupportedPlan("loss_fn: Shardwise's own models train on next-token cross-entropy; loss_fn is "
                              "for Hugging Face models")
    if plan is None:
        if cluster is None or global_batch is None:
            raise ValueError("auto_parallelize: give a plan, or a cluster and a global_batch to plan for")
        seq = seq_len or _max_positions(model)
        example = (torch.zeros(1, seq, dtype=torch.long, device="meta"),)
        # What DecoderModel does not run is kept out of the search (the user's pins win).
        pins = dict(fix or {}) if builtin else {"sp": False, "vpp": 1, "cp": 1, **(fix or {})}
        # A float64 model (debugging numerics) is priced as fp32, the nearest the cost model knows.
        precision = "fp32" if next(model.parameters()).dtype in (torch.float32, torch.float64) else "bf16"
        if builtin:
            plan = plan_model(model, example, cluster=cluster, gpus=dist.get_world_size(), global_batch=global_batch,
                              precision=precision, rules=rules, fix=pins, top=1)
        else:
            # A Hugging Face model trains on its own loss (or the user's): F.cross_entropy over
            # upcast logits, not the built-in models' chunked one.
            # Its stages run gpipe or 1f1b (refuse_unsupported): no zero-bubble schedules.
            runtime = replace(load_runtime(), chunked_loss=False, zero_bubble_schedules=False)
            plan = plan_spec(_decoder_spec(model), cluster, global_batch, seq, gpus=dist.get_world_size(),
                             precision=precision, rules=rules, fix=pins, top=1, runtime=runtime)
    elif not isinstance(plan, dict):
        plan = read_plan(plan)
    strategy = strategy_of(plan)
    _check_model(model, plan)
    if strategy.num_gpus != dist.get_world_size():
        raise UnsupportedPlan(f"plan.strategy: the plan needs {strategy.num_gpus} processes, "
                              f"{dist.get_world_size()} were started")
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))   # torchrun's GPU for this rank
        torch.cuda.set_device(device)
    device = torch.device(device or "cpu")
    training = TrainingSpec(**plan["training"])
    dtype = next(model.parameters()).dtype
    if builtin:
        # The user's optimizer runs the update as it is: no clipping (the norm is still
        # taken, and an update whose gradients are not finite skipped), no schedule; the
        # weights keep the model's dtype (float64 included).
        config = TrainConfig(grad_clip=float("inf"), dtype=dtype)

        def build_model(mesh, rank_device):
            built = BuiltinModel(model.spec, training, strategy, mesh, config.dtype, config.seed, rank_device)
            built.load_state_dict(model.state_dict())
            return built

        return Trainer(model.spec, training, strategy, config, device, build_model=build_model, optimizer=optimizer)
    if training.fp8 is not None:
        raise UnsupportedPlan("training.fp8: FP8 linear layers are built for Shardwise's own models; a Hugging "
                              "Face model trains in its own dtype (plan with --precision bf16)")
    # A Hugging Face model trains in its own dtype, without autocast, and its gradients
    # go to the user's optimizer unclipped, without a global norm.
    config = TrainConfig(grad_clip=None, dtype=dtype, autocast=False)

    def build_decoder(mesh, rank_device):
        return DecoderModel(model, strategy, mesh, training.seq_len, loss_fn, rank_device)

    return Trainer(ModelSpec(**plan["model"]), training, strategy, config, device, build_model=build_decoder,
                   optimizer=optimizer)


def _check_model(model: nn.Module, plan: dict) -> None:
    """Refuse a plan made for another architecture (the spec's fields but its name)."""
    if "nodes" in plan["model"]:
        raise UnsupportedPlan("plan.model: a plan of a traced module; auto_parallelize trains transformer "
                              "models (Shardwise's own, Hugging Face decoder LMs)")
    spec = _decoder_spec(model)
    mine = {k: v for k, v in asdict(spec).items() if k != "name"}
    planned = {k: v for k, v in asdict(ModelSpec(**plan["model"])).items() if k != "name"}
    if mine != planned:
        field = next(k for k in sorted(mine) if mine[k] != planned.get(k))
        raise UnsupportedPlan(f"plan.model.{field}: the plan was made for {plan['model']['name']} "
                              f"({field} {planned.get(field)}), this model has {mine[field]}")


def _decoder_spec(model: nn.Module) -> ModelSpec:
    """The spec the planner prices a model by: its own, or its Hugging Face config's
    (a family the specs approximate, such as Qwen2's q/k/v biases, is priced as the
    nearest; DecoderModel splits the model's real modules either way)."""
    from planner.api import transformer_spec

    spec = transformer_spec(model, exact=False)
    if spec is None:
        raise UnsupportedPlan(f"model: {type(model).__name__} is neither a Shardwise model nor a Hugging Face "
                              f"decoder LM whose config the specs read")
    return spec


def _max_positions(model: nn.Module) -> int:
    config = getattr(model, "config", None) or getattr(model, "spec", None)
    for key in ("max_position_embeddings", "n_positions"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    raise ValueError("auto_parallelize: give seq_len (the model does not say its maximum positions)")


# -- a Hugging Face decoder LM split by a strategy ------------------------------------

FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")
EMBEDDING_DROPOUTS = ("drop", "embed_dropout", "emb_drop")
FUSED_QKV = ("c_attn", "qkv", "qkv_proj", "query_key_value", "Wqkv")
WRAPPED = "_checkpoint_wrapped_module."


def refuse_unsupported(strategy: Strategy) -> None:
    """Refuse what a Hugging Face model cannot be split into, naming the plan's field."""
    # Context parallelism gathers K and V inside the attention, which is the model's own.
    for knob, ok in (("sequence_parallel", not strategy.sequence_parallel), ("vpp", strategy.vpp == 1),
                     ("ep", strategy.ep == 1), ("cp", strategy.cp == 1),
                     ("schedule", strategy.schedule in ("gpipe", "1f1b"))):
        if not ok:
            raise UnsupportedPlan(f"plan.strategy.{knob}: auto_parallelize on a Hugging Face model runs tp, "
                                  f"pp (gpipe, 1f1b), dp, ZeRO and recompute; plan with --fix "
                                  f"sp=off,vpp=1,ep=1,cp=1,schedule=1f1b")
    if len(set(strategy.replica_microbatches)) > 1:
        raise UnsupportedPlan(f"plan.strategy.replica_groups: auto_parallelize on a Hugging Face model gives "
                              f"every replica an equal share, the plan's are "
                              f"{list(strategy.replica_microbatches)} micro-batches; run uneven shares with "
                              f"Shardwise's own models, or plan with stage groups")


class DecoderStage(nn.Module):
    """One pipeline stage of a causal LM (all of it when first and last): token ids or
    hidden states in, hidden states or logits out."""

    def __init__(self, lm: nn.Module, first: bool, last: bool):
        super().__init__()
        self.lm, self.first, self.last = lm, first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.lm.base_model
        out = base(input_ids=x, use_cache=False) if self.first else base(inputs_embeds=x, use_cache=False)
        hidden = out[0]
        return self.lm.get_output_embeddings()(hidden) if self.last else hidden


class _MutedPositions(nn.Module):
    """A later stage's stand-in for the position table: its input already holds them."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*positions.shape, self.hidden_size, device=positions.device)


def _child_name(parent: nn.Module, child: nn.Module) -> str | None:
    return next((n for n, m in parent.named_children() if m is child), None)


def decoder_layers(base: nn.Module) -> tuple[str, nn.ModuleList]:
    """The base model's stack of decoder layers: its longest ModuleList."""
    stacks = [(n, m) for n, m in base.named_children() if isinstance(m, nn.ModuleList)]
    if not stacks:
        raise UnsupportedPlan(f"model: {type(base).__name__} holds no ModuleList of decoder layers to split")
    return max(stacks, key=lambda item: len(item[1]))


def _as_linear(conv: nn.Module) -> nn.Linear:
    """GPT-2's Conv1D (weight in x out) as the nn.Linear it computes."""
    n_in, n_out = conv.weight.shape
    linear = nn.Linear(n_in, n_out, bias=conv.bias is not None, device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        if conv.bias is not None:
            linear.bias.copy_(conv.bias)
    linear.from_conv1d = True
    return linear


def _qkv_order(out_features: int, tp: int) -> torch.Tensor:
    """Row order of a fused [q | k | v] projection that puts each tp rank's heads of q,
    k and v in its contiguous column shard."""
    third = out_features // 3
    per = third // tp
    return torch.cat([torch.arange(part * third + r * per, part * third + (r + 1) * per)
                      for r in range(tp) for part in range(3)])


class DecoderModel:
    """This rank's stage of the Hugging Face causal LM `lm` for `strategy` (the module
    docstring says how it is split), trained on `loss_fn` (default: the model's own loss)."""

    def __init__(self, lm: nn.Module, strategy: Strategy, mesh: RankMesh, seq_len: int,
                 loss_fn: Callable | None, device: torch.device):
        refuse_unsupported(strategy)
        self.strategy, self.mesh, self.device = strategy, mesh, device
        self.is_first, self.is_last = mesh.pp_rank == 0, mesh.pp_rank == strategy.pp - 1
        embedding = lm.get_input_embeddings()
        vocab, self.hidden_size = embedding.weight.shape
        loss_fn = loss_fn or (lambda logits, labels: lm.loss_function(logits=logits, labels=labels, vocab_size=vocab))
        dtype = embedding.weight.dtype   # of the hidden states stages exchange
        self.tied = lm.get_output_embeddings().weight is embedding.weight
        ends_group = tied_ends_group(mesh) if self.tied and strategy.pp > 1 else None
        self.renamed: dict[str, str] = {}       # stage parameter name -> the model's
        self.regrouped: dict[str, torch.Tensor] = {}   # fused q/k/v rows, by the model's name
        self.transposed: set[str] = set()      # Conv1D weights, by the model's name
        self.stage = self._split(lm.to(device))
        self.module = self._data_parallel(self.stage)
        self.parts = ModelParts(
            modules=(self.module,),
            stage_indices=(mesh.pp_rank,),
            loss_fn=loss_fn,
            vocab_parallel_loss=False,   # the head gathers the logits
            # FSDP2 and `replicate` reduce once, on the last micro-batch, ZeRO-3 included
            # (its gradients accumulate unsharded until then).
            accumulation=Accumulation(defer_sync=strategy.dp > 1 and not isinstance(self.module, DDP)),
            shapes=StageShapes(seq_len=seq_len, hidden_seq_len=seq_len, hidden_size=self.hidden_size,
                               logits_width=vocab, dtype=dtype),
            tied=self._tied_embedding(ends_group))
        self.tied_names = (self.embedding_name, self.head_name) if self.tied else None

    # -- splitting ------------------------------------------------------------------

    def _split(self, lm: nn.Module) -> DecoderStage:
        s = self.strategy
        base = lm.base_model
        prefix = _child_name(lm, base)
        stack_name, layers = decoder_layers(base)
        stage = next(st for st in s.stages if st.pp_rank == self.mesh.pp_rank)
        owned = list(range(stage.first_layer, stage.first_layer + stage.num_layers))
        if len(layers) != sum(st.num_layers for st in s.stages):
            raise UnsupportedPlan(f"plan.strategy.stages: the plan places {sum(st.num_layers for st in s.stages)} "
                                  f"layers, {type(base).__name__}.{stack_name} holds {len(layers)}")
        embedding, head = lm.get_input_embeddings(), lm.get_output_embeddings()
        self.embedding_name = f"{prefix}.{_child_name(base, embedding)}.weight"
        self.head_name = f"{_child_name(lm, head)}.weight"
        if self.tied and (s.tp > 1 or s.pp > 1):
            # The ends are split (or sit on other ranks): the head gets its own copy, and
            # the two gradients are summed each step.
            head.weight = nn.Parameter(embedding.weight.detach().clone())
        setattr(base, stack_name, nn.ModuleList([layers[i] for i in owned]))
        for local, original in enumerate(owned):
            self.renamed[f"{prefix}.{stack_name}.{local}."] = f"{prefix}.{stack_name}.{original}."
        if not self.is_first:
            setattr(base, _child_name(base, embedding), None)
            for name, child in list(base.named_children()):
                if isinstance(child, nn.Embedding):
                    setattr(base, name, _MutedPositions(self.hidden_size))   # GPT-2's wpe
                elif name in EMBEDDING_DROPOUTS:
                    setattr(base, name, nn.Identity())
        if not self.is_last:
            for name in FINAL_NORMS:
                if getattr(base, name, None) is not None:
                    setattr(base, name, nn.Identity())
            setattr(lm, _child_name(lm, head), None)
        if s.tp > 1:
            self._tensor_parallel(lm, base, stack_name, prefix)
        full, selective = stage.full_recompute_layers, stage.selective_recompute_layers
        for i, layer in enumerate(getattr(base, stack_name)):
            if i < full:
                getattr(base, stack_name)[i] = checkpoint_wrapper(layer)
            elif i < full + selective:
                getattr(base, stack_name)[i] = checkpoint_wrapper(layer, context_fn=op_level_context)
        return DecoderStage(lm, self.is_first, self.is_last)

    def _tensor_parallel(self, lm: nn.Module, base: nn.Module, stack_name: str, prefix: str) -> None:
        tp, tp_mesh = self.strategy.tp, self.mesh["tp"]
        for index, layer in enumerate(getattr(base, stack_name)):
            plan = {}
            for name, module in list(layer.named_modules()):
                if type(module).__name__ == "Conv1D":
                    parent, _, leaf = name.rpartition(".")
                    module = _as_linear(module)
                    setattr(layer.get_submodule(parent), leaf, module)
                    self.transposed.add(self._model_name(f"{prefix}.{stack_name}.{index}.{name}.weight"))
                if not isinstance(module, nn.Linear):
                    continue
                role = split_role(name)
                where = f"{type(layer).__name__} {stack_name}.{index}.{name}"
                if role is None:
                    raise UnsupportedPlan(f"model: cannot split {where} for tp {tp}: its role (column or row) "
                                          f"is not known from its name")
                if module.out_features % tp if role == "column" else module.in_features % tp:
                    raise UnsupportedPlan(f"model: tp {tp} does not divide {where}")
                if role == "column" and name.rpartition(".")[2] in FUSED_QKV:
                    order = _qkv_order(module.out_features, tp)
                    with torch.no_grad():
                        module.weight.copy_(module.weight[order])
                        if module.bias is not None:
                            module.bias.copy_(module.bias[order])
                    self.regrouped[self._model_name(f"{prefix}.{stack_name}.{index}.{name}")] = order
                plan[name] = ColwiseParallel() if role == "column" else RowwiseParallel()
            if not plan:
                raise UnsupportedPlan(f"model: {type(layer).__name__} {stack_name}.{index} has no linear layers to split")
            parallelize_module(layer, tp_mesh, plan)
            # Attention modules that size their split by attribute (GPT-2's split_size)
            # now hold 1/tp of the heads.
            for module in layer.modules():
                for attr in ("split_size", "num_heads", "num_key_value_heads"):
                    if isinstance(getattr(module, attr, None), int):
                        setattr(module, attr, getattr(module, attr) // tp)
        ends = {}
        embedding, head = lm.get_input_embeddings(), lm.get_output_embeddings()
        if self.is_first:
            ends[f"{_child_name(lm, base)}.{_child_name(base, embedding)}"] = RowwiseParallel(input_layouts=Replicate())
        if self.is_last:
            ends[_child_name(lm, head)] = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(lm, tp_mesh, ends)

    def _data_parallel(self, stage: DecoderStage) -> nn.Module:
        s, dp_mesh = self.strategy, self.mesh.dp_cp_mesh
        if s.dp == 1:
            return stage
        _, layers = decoder_layers(stage.lm.base_model)
        if s.zero_stage >= 1:
            for layer in layers:
                fully_shard(layer, mesh=dp_mesh, reshard_after_forward=s.zero_stage == 3)
            fully_shard(stage, mesh=dp_mesh, reshard_after_forward=s.zero_stage == 3)
            return stage
        if s.tp > 1:
            for layer in layers:
                replicate(layer, mesh=dp_mesh)
            replicate(stage, mesh=dp_mesh)
            return stage
        return wrap_ddp(stage, dp_mesh, [])

    def _tied_embedding(self, ends_group) -> TiedEmbedding | None:
        """The embedding and the head's copy of it here, when they are two parameters."""
        if not self.tied or (self.strategy.tp == 1 and self.strategy.pp == 1):
            return None
        embedding, head = self.stage.lm.get_input_embeddings(), self.stage.lm.get_output_embeddings()
        return TiedEmbedding(embedding.weight if embedding is not None else None,
                             head.weight if head is not None else None, ends_group)

    def parameters(self) -> list[nn.Parameter]:
        return self.parts.parameters()

    # -- weights --------------------------------------------------------------------

    def _model_name(self, name: str) -> str:
        name = name.replace(WRAPPED, "").removeprefix("lm.")
        for local, original in self.renamed.items():
            if name.startswith(local):
                return original + name[len(local):]
        return name

    def _stage_parameters(self) -> list[tuple[str, str, torch.Tensor]]:
        """(name in the stage's state_dict, name in the model's, parameter); the head's
        own copy of a tied embedding answers to the embedding's name."""
        out = []
        for name, p in self.stage.named_parameters():
            model_name = self._model_name(name)
            if self.tied and model_name == self.head_name:
                model_name = self.embedding_name
            out.append((name.replace(WRAPPED, ""), model_name, p))
        return out

    def _regroup_rows(self, model_name: str) -> torch.Tensor | None:
        return self.regrouped.get(model_name.rsplit(".", 1)[0])

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full, unsharded weights under the model's own names and layouts (what
        `full_state_dict` gives); each rank keeps its shards."""
        mapped = {}
        for stage_name, model_name, _ in self._stage_parameters():
            if model_name not in state:
                raise KeyError(f"state_dict: {model_name} is missing")
            value = state[model_name].to(self.device)
            if model_name in self.transposed:
                value = value.t()
            order = self._regroup_rows(model_name)
            if order is not None:
                value = value[order.to(value.device)]
            mapped[stage_name] = value.contiguous()
        set_model_state_dict(self.stage, mapped, options=StateDictOptions(full_state_dict=True, strict=False))

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stage's full, unsharded weights under the model's own names and
        layouts (a tied head under the embedding's name)."""
        local = {}
        for _, model_name, p in self._stage_parameters():
            value = (p.full_tensor() if isinstance(p, DTensor) else p.detach()).cpu().clone()
            order = self._regroup_rows(model_name)
            if order is not None:
                restored = torch.empty_like(value)
                restored[order] = value
                value = restored
            if model_name in self.transposed:
                value = value.t().contiguous()
            local[model_name] = value
        return local
