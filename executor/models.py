"""The built-in model families as plain PyTorch modules: GPT (LayerNorm, GELU MLP,
learned positions, biases), Llama (RMSNorm, SwiGLU, grouped-query attention, RoPE) and
Mixtral (Llama layers whose MLP is a top-k mixture of experts), and the next-token loss
they train on. The spec's architecture fields shape each module: head_dim, biases,
q/k norm, GELU / GeGLU / SwiGLU, LayerNorm / RMSNorm, parallel blocks with one or two
norms, learned or rotary positions, an LM-head bias. Rotary embeddings rotate the whole
head (a partial rotary factor changes no parameter or FLOP count and is not modelled).

Parameter counts equal `costmodel.terms.counts`'s for the same spec and the forward FLOPs that
`FlopCounterMode` counts equal `costmodel.terms.counts.layer_forward_flops` /
`head_forward_flops` (eager attention; SDPA kernels on CPU count none).

Layers live in a `ModuleDict` keyed by their index, and a pipeline stage is the same
module with the layers and ends it does not own set to None (torchtitan's layout), so
parameter names are the same on every stage and in every layout. Weights are drawn per
parameter from a generator seeded by (seed, name): the same model whatever the split.

Under context parallelism (`ContextShard`, set by executor.parallelize) a model holds its
rank's tokens of each sequence: it reads the RoPE rows and learned positions at their
global positions, and each attention gathers the keys and values of the whole sequence
and runs each of its two chunks against the keys up to that chunk's end, causal at the
bottom-right (no mask is made: CUDA's fused kernels take the lower-right causal bias as
it is).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from costmodel.specs import ModelSpec
from costmodel.strategy import RECOMPUTE_MODES
from costmodel.terms import memory
from executor.data import context_positions

INIT_STD = 0.02   # GPT-2 / Megatron-LM default initialisation
ROPE_THETA = 10000.0


class RMSNorm(nn.Module):
    """x / rms(x) * w; with `unit_offset` Gemma's x / rms(x) * (1 + w), w starting at 0."""

    def __init__(self, dim: int, eps: float = 1e-5, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1 + self.weight if self.unit_offset else self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * scale


def rope_tables(seq_len: int, head_dim: int, device=None,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE (Su et al. 2021, RoFormer eq. 34), [seq_len, head_dim / 2].
    Computed in float32 at least (bf16 angles would be off by whole radians at long
    positions), in float64 for a float64 model."""
    dtype = torch.promote_types(dtype, torch.float32)
    inv = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=dtype), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; rotates (even, odd) pairs."""
    t = x.shape[2]
    cos, sin = cos[:t].to(x.dtype), sin[:t].to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flash: bool,
                   shard: ContextShard | None = None) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(d)) v over [B, heads, T, head_dim]; k and v may have
    fewer heads (grouped-query attention). `flash` uses PyTorch's fused SDPA kernel;
    otherwise the score matrix is materialised (and counted by FlopCounterMode). Under
    context parallelism (`shard`) q holds this rank's two chunks and k, v the whole
    sequence in position order."""
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if shard is not None:
        return shard.attend(q, k, v, flash)
    return causal_attention(q, k, v, flash)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flash: bool,
                     bias: CausalBias | None = None) -> torch.Tensor:
    """q's T_q queries are the last T_q of k's T_k positions: each sees the keys up to its
    own (causal at the bottom-right; the usual square causal mask when T_q = T_k).
    `bias`: torch's lower-right CausalBias for these shapes, made beforehand (a tensor
    subclass, which cannot be made under a dispatch mode such as FlopCounterMode)."""
    t_q, t_k = q.shape[2], k.shape[2]
    if flash:
        if t_q == t_k:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(t_q, t_k) if bias is None else bias)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    seen = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(diagonal=t_k - t_q)
    return scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v


@dataclass(frozen=True, eq=False)   # eq=False: a process group has no meaningful ==
class ContextShard:
    """This rank's part of every sequence under context parallelism (Llama 3's
    all-gather CP, Dubey et al. 2024 §3.3.2): rank `rank` of `size` holds the tokens at
    executor.data.context_positions, and each attention gathers the keys and values of
    the whole sequence over `group`."""

    rank: int
    size: int
    group: dist.ProcessGroup
    # torch's lower-right causal biases by (queries, keys), made when the shard is set up
    # (`prepare`): CausalBias is a tensor subclass that cannot be made under a dispatch
    # mode (FlopCounterMode, the memory trackers, executor.collective_log), as a step may run.
    biases: dict = field(default_factory=dict)

    def prepare(self, seq_len: int) -> None:
        """Make the causal biases this rank's two chunks take for sequences of `seq_len`."""
        chunk = seq_len // (2 * self.size)
        for g in (self.rank, 2 * self.size - 1 - self.rank):
            if g > 0:
                self.biases[(chunk, (g + 1) * chunk)] = causal_lower_right(chunk, (g + 1) * chunk)

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's `local_len` tokens of each sequence."""
        return context_positions(local_len * self.size, self.rank, self.size, device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flash: bool) -> torch.Tensor:
        """Attention of this rank's two chunks of queries (global chunks `rank` and
        2 size - 1 - rank of 2 size) over the gathered keys in position order: chunk g
        sees the keys of chunks 0 to g, causal within its own, so each call is causal at
        the bottom-right and no mask is made (an s/cp x s one would be 4 GiB in bf16 at
        128K tokens and cp 8). The key slices are views of the gathered K and V, which
        every chunk's backward shares."""
        chunk = q.shape[2] // 2
        outs = []
        for j, g in enumerate((self.rank, 2 * self.size - 1 - self.rank)):
            end = (g + 1) * chunk
            outs.append(causal_attention(q[:, :, j * chunk:(j + 1) * chunk], k[:, :, :end], v[:, :, :end], flash,
                                         self.biases.get((chunk, end))))
        return torch.cat(outs, dim=2)

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ([B, heads, local tokens, head_dim]) of every cp rank, gathered along the
        sequence in one all-gather (one collective's latency and message overhead, not
        two) and put in position order; the backward reduce-scatters their gradients to
        the ranks' own tokens, again in one."""
        local_len = k.shape[2]
        both = torch.stack((k, v))   # [2, B, heads, T, head_dim]
        gathered = all_gather_autograd(both, 3, self.group)   # rank r's tokens at [r T, (r + 1) T)
        source = torch.cat([context_positions(local_len * self.size, r, self.size, k.device)
                            for r in range(self.size)])
        return gathered.index_select(3, source.argsort()).unbind(0)


# The differentiable all-gather: all_gather_single_autograd in recent torch, which warns
# that the older all_gather_tensor_autograd is deprecated; both reduce-scatter the
# gradient in backward.
all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def _op_level_save_list() -> frozenset:
    """The ops whose outputs op-level selective recompute keeps: matmuls (every second one
    is dropped by the policy), every SDPA kernel PyTorch may pick on this device, and
    sequence parallelism's reduce-scatters (torchtitan's `_save_list`)."""
    ops = {torch.ops.aten.mm.default}
    for namespace, name in (("aten", "_scaled_dot_product_flash_attention"),
                            ("aten", "_scaled_dot_product_efficient_attention"),
                            ("aten", "_scaled_dot_product_cudnn_attention"),
                            ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
                            ("_c10d_functional", "reduce_scatter_tensor")):
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            ops.add(packet.default)
    return frozenset(ops)


OP_LEVEL_SAVE = _op_level_save_list()


def op_level_context():
    """Contexts for one checkpointed layer under op-level selective recompute, the policy
    of torchtitan's per-op SAC (torchtitan/distributed/activation_checkpoint.py): keep
    the outputs of OP_LEVEL_SAVE but every second matmul, counted in forward order (the
    recompute counts its own, so the two agree), and recompute the rest. The cost model
    counts the same (costmodel.terms.recompute)."""
    mm = torch.ops.aten.mm.default
    counts = {False: 0, True: 0}   # matmuls seen, by ctx.is_recompute

    def policy(ctx, func, *args, **kwargs):
        if func == mm:
            counts[ctx.is_recompute] += 1
        keep = func in OP_LEVEL_SAVE and not (func == mm and counts[ctx.is_recompute] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def make_norm(spec: ModelSpec, dim: int | None = None) -> nn.Module:
    dim = dim or spec.hidden_size
    return nn.LayerNorm(dim) if spec.norm == "layernorm" else RMSNorm(dim, unit_offset=spec.norm == "rmsnorm_unit_offset")


class Attention(nn.Module):
    """Q, K, V and output projections (Q and output heads x head_dim wide), with the
    spec's biases and per-head q/k RMSNorm (Qwen3). Heads are read off the local
    projection width (`view(B, T, -1, head_dim)`), so a column-wise split over tp ranks
    runs as it is."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, q, kv, bias = spec.hidden_size, spec.q_size, spec.kv_size, spec.attention_bias
        self.head_dim = spec.head_dim
        self.rope = spec.position_embedding == "rope"
        self.wq = nn.Linear(h, q, bias=bias)
        self.wk = nn.Linear(h, kv, bias=bias)
        self.wv = nn.Linear(h, kv, bias=bias)
        self.wo = nn.Linear(q, h, bias=spec.attention_out_bias)
        self.q_norm = RMSNorm(spec.head_dim) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim) if spec.qk_norm else None
        self.flash = True
        self.context_shard: ContextShard | None = None   # set by executor.parallelize under cp > 1

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.context_shard is not None:
            # After RoPE (each rank rotates its own positions) and before the grouped-query
            # repeat, so the all-gather carries kv heads only.
            k, v = self.context_shard.gather(k, v)
        out = attention_core(q, k, v, self.flash, self.context_shard)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 §2.1.2, as transformers'
    DeepseekV3Attention lays it out): the query from a latent of q_lora_rank (normed)
    or straight from x; keys and values from one shared latent of kv_lora_rank (normed),
    each head's key qk_nope_head_dim wide from it beside a qk_rope_head_dim rotary part
    shared by every head, its value v_head_dim wide. RoPE as the executor rotates
    (even, odd) pairs: transformers' rope_interleave layout; the scores scaled by the
    query width (no YaRN mscale)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, heads, bias = spec.hidden_size, spec.num_attention_heads, spec.attention_bias
        self.nope, self.rope_dim, self.value_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.kv_lora_rank = spec.kv_lora_rank
        query = heads * (self.nope + self.rope_dim)
        if spec.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(h, spec.q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(spec.q_lora_rank)
            self.wq_b = nn.Linear(spec.q_lora_rank, query, bias=False)
        else:
            self.wq = nn.Linear(h, query, bias=False)
        self.wkv_a = nn.Linear(h, spec.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_norm = RMSNorm(spec.kv_lora_rank)
        self.wkv_b = nn.Linear(spec.kv_lora_rank, heads * (self.nope + self.value_dim), bias=False)
        self.wo = nn.Linear(heads * self.value_dim, h, bias=spec.attention_out_bias)
        self.flash = True
        self.context_shard: ContextShard | None = None   # check_supported refuses cp > 1 here

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q_pass, q_rot = q.view(b, t, -1, self.nope + self.rope_dim).transpose(1, 2).split(
            [self.nope, self.rope_dim], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, t, -1, self.nope + self.value_dim).transpose(1, 2)
        k_pass, v = kv.split([self.nope, self.value_dim], dim=-1)
        q_rot = apply_rope(q_rot, cos, sin)
        k_rot = apply_rope(k_rot.view(b, 1, t, self.rope_dim), cos, sin).expand(-1, k_pass.shape[1], -1, -1)
        q, k = torch.cat((q_pass, q_rot), dim=-1), torch.cat((k_pass, k_rot), dim=-1)
        out = attention_core(q, k, v, self.flash)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """GELU: w2(gelu(w1 x)); SwiGLU: w2(silu(w1 x) * w3 x); GeGLU: w2(gelu(w1 x) * w3 x)
    (Shazeer 2020); every matrix with a bias when the spec's mlp_bias."""

    def __init__(self, spec: ModelSpec, width: int | None = None):
        super().__init__()
        h, f, bias = spec.hidden_size, width or spec.intermediate_size, spec.mlp_bias
        self.gated = spec.gated_mlp
        self.silu = spec.mlp == "swiglu"
        self.w1 = nn.Linear(h, f, bias=bias)
        self.w2 = nn.Linear(f, h, bias=bias)
        self.w3 = nn.Linear(h, f, bias=bias) if self.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.silu(self.w1(x)) if self.silu else F.gelu(self.w1(x), approximate="tanh")
        if self.gated:
            gate = gate * self.w3(x)
        return self.w2(gate)


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of x runs in: autocast's where it is on (torch._grouped_mm is not
    on autocast's lists, so the experts cast themselves, as their per-expert matmuls were
    cast), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _grouped_mm_fits(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch._grouped_mm takes fp32/bf16 rows whose widths are 16-byte multiples, on CPU and
    on Hopper or later GPUs (bf16 there)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if any(d * x.element_size() % 16 for d in (w1.shape[-1], w1.shape[-2], w2.shape[-2])):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu"


class MoE(nn.Module):
    """Top-k mixture of SwiGLU experts (Mixtral: softmax over the k chosen router logits,
    Jiang et al. 2024 §2.1; the spec's norm_topk_prob False: the top k of the softmax over
    every expert, Qwen2-MoE), dropless unless the spec sets a capacity factor c: then each
    expert takes at most ceil(c x tokens x k / E) of a micro-batch's rows, the earliest
    tokens first, and a dropped row adds nothing (the residual carries the token; GShard,
    Lepikhin et al. 2021 §2.2; Switch, Fedus et al. 2022 §2.1). The experts' weights are stacked on dim 0 so expert
    parallelism shards that dim; `dispatch` (set by executor.parallelize) moves tokens to
    the rank holding their expert and back. A shared expert (the spec's
    shared_expert_intermediate_size: DeepSeekMoE, DeepSeek-AI 2024 §2.1; Qwen2-MoE;
    Llama 4) is a dense MLP every token runs, added to the routed experts' output, scaled
    by sigmoid(shared_gate x) where the spec has a gate (Qwen2-MoE); it is held and
    reduced as the dense weights are, on every expert-parallel rank."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, f, e = spec.hidden_size, spec.intermediate_size, spec.num_local_experts
        self.num_experts, self.top_k = e, spec.num_experts_per_tok
        self.capacity_factor = spec.moe_capacity_factor
        self.norm_topk_prob = spec.norm_topk_prob
        self.sigmoid = spec.router_scoring == "sigmoid"
        self.n_group, self.topk_group = spec.n_group, spec.topk_group
        self.routed_scaling_factor = spec.routed_scaling_factor
        self.router = nn.Linear(h, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, f, h))
        self.w3 = nn.Parameter(torch.empty(e, f, h))
        self.w2 = nn.Parameter(torch.empty(e, h, f))
        self.dispatch = None           # executor.parallelize's all-to-all exchange under ep > 1
        f_shared = spec.shared_expert_intermediate_size
        self.shared_expert = MLP(spec, f_shared) if f_shared else None
        self.shared_gate = nn.Linear(h, 1, bias=False) if f_shared and spec.shared_expert_gate else None

    def experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Run the local experts on rows of x grouped by expert, `counts[e]` rows each, all
        experts in one call per matrix: torch._grouped_mm where the build and the shapes
        allow it, else one batched matmul over rows padded to the busiest expert."""
        dtype = _matmul_dtype(x)
        x = x.to(dtype)
        # Under expert parallelism the weights are DTensors sharded over ep: this rank's experts.
        w1, w3, w2 = ((w.to_local() if isinstance(w, DTensor) else w).to(dtype) for w in (self.w1, self.w3, self.w2))
        if _grouped_mm_fits(x, w1, w2):
            offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)

            def grouped(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return torch._grouped_mm(rows, w.transpose(-2, -1), offs=offsets)

            return grouped(F.silu(grouped(x, w1)) * grouped(x, w3), w2)
        # Padded: expert e's rows at [e, 0:counts[e]] of an [E, busiest, h] batch.
        sizes = torch.tensor(counts, device=x.device)
        expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), sizes)
        slot = torch.arange(x.shape[0], device=x.device) - (sizes.cumsum(0) - sizes)[expert]
        padded = x.new_zeros(len(counts), max(counts, default=0), x.shape[-1]).index_put((expert, slot), x)
        hidden = F.silu(padded @ w1.transpose(-2, -1)) * (padded @ w3.transpose(-2, -1))
        return (hidden @ w2.transpose(-2, -1))[expert, slot]

    def _within_capacity(self, flat: torch.Tensor, order: torch.Tensor,
                         counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sorted rows each expert keeps under the capacity, and the kept counts.
        The sort is stable, so an expert's rows stand in token order."""
        capacity = math.ceil(self.capacity_factor * flat.numel() / self.num_experts)
        first_row = counts.cumsum(0) - counts
        slot = torch.arange(order.numel(), device=order.device) - first_row[flat[order]]
        return order[slot < capacity], counts.clamp(max=capacity)

    def _sigmoid_route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's routing (DeepSeek-AI 2024 §2.1.2; transformers' DeepseekV3TopkRouter):
        fp32 sigmoid scores; with n_group groups, a token's experts come from its
        topk_group groups of the highest top-2 score sums; the chosen scores normalised
        where norm_topk_prob, times routed_scaling_factor. The load-balancing bias that
        DeepSeek adds to the scores for the choice is not kept (it is zero at the start
        of training and updated outside the gradient)."""
        scores = torch.sigmoid(logits.float())
        choice = scores
        if self.n_group > 1:
            grouped = scores.view(-1, self.n_group, self.num_experts // self.n_group)
            best = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1).topk(self.topk_group, dim=-1)[1]
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter(1, best, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        chosen = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return (weights * self.routed_scaling_factor).to(logits.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.router(tokens)
        if self.sigmoid:
            weights, chosen = self._sigmoid_route(logits)
        elif self.norm_topk_prob:
            weights, chosen = logits.topk(self.top_k, dim=-1)
            weights = weights.softmax(-1)
        else:
            # Qwen2-MoE: the top k of an fp32 softmax over every expert, not renormalised.
            weights, chosen = logits.softmax(-1, dtype=torch.float32).topk(self.top_k, dim=-1)
            weights = weights.to(logits.dtype)
        # One row per (token, choice), sorted by expert: each expert sees its rows together.
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.capacity_factor is not None:
            order, counts = self._within_capacity(flat, order, counts)
        rows = tokens[order // self.top_k]
        counts = counts.tolist()
        if self.dispatch is None:
            out_rows = self.experts(rows, counts)
        else:
            out_rows = self.dispatch(self, rows, counts)
        weighted = out_rows * weights.flatten()[order].unsqueeze(-1)
        # In the experts' dtype: under autocast they run in bf16 while the stream is fp32.
        combined = tokens.new_zeros(tokens.shape, dtype=weighted.dtype).index_add(0, order // self.top_k, weighted)
        if self.shared_expert is not None:
            shared = self.shared_expert(tokens)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(tokens)) * shared
            combined = combined + shared
        return combined.view(shape)


class Block(nn.Module):
    """Pre-norm transformer layer, sequential (x + attn, then + mlp) or parallel (GPT-J
    / GPT-NeoX / Phi: x + attn(norm x) + mlp(norm' x), norm' = norm with one norm per
    layer). `recompute` is "none", "selective" (op-level: `op_level_context`) or "full" (the whole
    layer; Chen et al. 2016 checkpointing). `dense`: one of a mixture-of-experts model's
    dense-MLP layers (the spec's mlp_only_layers), its MLP dense_intermediate_size wide."""

    def __init__(self, spec: ModelSpec, dense: bool = False):
        super().__init__()
        self.attention_norm = make_norm(spec)
        self.attention = LatentAttention(spec) if spec.is_mla else Attention(spec)
        self.ffn_norm = make_norm(spec) if spec.norms_per_layer == 2 else None
        if spec.is_moe and not dense:
            self.feed_forward = MoE(spec)
        else:
            self.feed_forward = MLP(spec, spec.dense_intermediate_size if spec.is_moe else None)
        self.parallel = spec.parallel_block
        self.recompute = "none"

    def set_recompute(self, mode: str) -> None:
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute: expected one of {RECOMPUTE_MODES}, got {mode!r}")
        self.recompute = mode

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        normed = self.attention_norm(x)
        if self.parallel:
            mlp_in = normed if self.ffn_norm is None else self.ffn_norm(x)
            return x + self.attention(normed, cos, sin) + self.feed_forward(mlp_in)
        x = x + self.attention(normed, cos, sin)
        return x + self.feed_forward(self.ffn_norm(x) if self.ffn_norm is not None else self.attention_norm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`cos` and `sin`: RoPE rows of this rank's positions."""
        if self.recompute == "full":
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        if self.recompute == "selective":
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False, context_fn=op_level_context)
        return self._forward(x, cos, sin)


class Transformer(nn.Module):
    """Embedding -> layers -> final norm -> LM head. Any of the ends and any layer may
    be None (a pipeline stage); the forward takes token ids when the embedding is
    present and hidden states otherwise, and returns logits when the head is present."""

    def __init__(self, spec: ModelSpec, seq_len: int | None = None):
        super().__init__()
        self.spec = spec
        self.seq_len = seq_len or spec.max_position_embeddings
        h = spec.hidden_size
        self.tok_embeddings = nn.Embedding(spec.vocab_size, h)
        learned = spec.position_embedding == "learned"
        self.pos_embeddings = nn.Embedding(spec.max_position_embeddings, h) if learned else None
        self.layers = nn.ModuleDict({str(i): Block(spec, dense=i in spec.mlp_only_layers)
                                     for i in range(spec.num_hidden_layers)})
        self.norm = make_norm(spec)
        self.output = nn.Linear(h, spec.vocab_size, bias=spec.lm_head_bias)
        cos, sin = rope_tables(self.seq_len, spec.qk_rope_head_dim if spec.is_mla else spec.head_dim)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.tied = False
        self.sequence_shard = None   # (tp rank, tp size) under sequence parallelism
        self.context_shard: ContextShard | None = None   # this rank's tokens under context parallelism
        if spec.tie_word_embeddings:
            self.tie()

    def tie(self) -> None:
        self.output.weight = self.tok_embeddings.weight
        self.tied = True

    def untie(self) -> None:
        """Give the head its own copy of the tied embedding (pipeline ends on different
        ranks, or tensor parallelism): the trainer keeps the two copies' gradients summed."""
        if self.tied:
            self.output.weight = nn.Parameter(self.tok_embeddings.weight.detach().clone())
            self.tied = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = self._context_positions(x)   # None without context parallelism
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
            if self.pos_embeddings is not None:
                # Under sequence parallelism x holds this rank's slice of the positions.
                t = x.shape[1]
                first = self.sequence_shard[0] * t if self.sequence_shard else 0
                rows = slice(first, first + t) if positions is None else positions[first:first + t]
                x = x + self.pos_embeddings.weight[rows]
        cos, sin = self.rope_cos, self.rope_sin
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = self.output(x)
        return x

    def _context_positions(self, x: torch.Tensor) -> torch.Tensor | None:
        """Global positions of this rank's tokens under context parallelism. `x` is its
        tokens (ids), or hidden states, which under sequence parallelism hold the tp
        rank's slice of them."""
        if self.context_shard is None:
            return None
        local_len = x.shape[1]
        if self.tok_embeddings is None and self.sequence_shard:
            local_len *= self.sequence_shard[1]
        return self.context_shard.positions(local_len, x.device)


# fp32 bytes of one chunk of the chunked cross-entropy's rows, defined beside the memory
# term that counts it.
LOSS_CHUNK_BYTES = memory.LOSS_CHUNK_BYTES


def loss_chunk_rows(vocab: int) -> int:
    """Tokens per chunk of ChunkedCrossEntropy for a vocabulary of `vocab` (what
    costmodel.terms.memory.loss_peak_bytes counts too)."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab))


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy whose fp32 work never spans the whole micro-batch: the rows are
    upcast, log-sum-exp'd and differentiated a chunk of tokens at a time, the gradient
    (softmax - one-hot) / N written into a buffer in the logits' dtype as it goes, which
    backward scales in place. Plain F.cross_entropy holds three fp32 copies of the
    logits at its peak (the upcast, log_softmax's output and their gradients: 12 bytes
    per logit); this holds the logits and the gradient buffer in their own dtype and
    one chunk in fp32 (costmodel.terms.memory.loss_peak_bytes). Same value and gradient
    as F.cross_entropy (tests/executor/test_models.py)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        n, rows = flat.shape[0], loss_chunk_rows(logits.shape[-1])
        work_dtype = torch.promote_types(logits.dtype, torch.float32)   # fp32, or fp64 to debug
        gradient = torch.empty_like(flat)
        total = torch.zeros((), dtype=work_dtype, device=logits.device)
        for start in range(0, n, rows):
            chunk = flat[start:start + rows].to(work_dtype, copy=True)
            picked = flat_targets[start:start + rows].unsqueeze(1)
            lse = torch.logsumexp(chunk, dim=-1, keepdim=True)
            total += (lse - chunk.gather(1, picked)).sum()
            probabilities = chunk.sub_(lse).exp_()
            probabilities.scatter_add_(1, picked, torch.full_like(picked, -1, dtype=probabilities.dtype))
            gradient[start:start + rows] = probabilities.div_(n)
        ctx.save_for_backward(gradient)
        ctx.logits_shape = logits.shape
        return total / n

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (gradient,) = ctx.saved_tensors
        return gradient.mul_(grad_output.to(gradient.dtype)).view(ctx.logits_shape), None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss the built-in models train on. Whole-vocabulary logits take
    ChunkedCrossEntropy (no fp32 copy of the whole micro-batch's logits); vocabulary-
    sharded logits (DTensor, tensor parallelism) take F.cross_entropy under the
    loss_parallel context, which reduces over the shards."""
    if isinstance(logits, DTensor):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return ChunkedCrossEntropy.apply(logits, targets)


def build_model(spec: ModelSpec, seq_len: int | None = None, device: str | torch.device = "meta",
                dtype: torch.dtype = torch.float32) -> Transformer:
    """The whole model, by default on the meta device (no memory): parallelize, then
    `materialize`. `dtype` is the weights' (float64 to debug a numerical difference)."""
    with torch.device(device):
        return Transformer(spec, seq_len).to(dtype)


def canonical_name(name: str) -> str:
    """A parameter's name without wrapper prefixes, as in the unsplit model."""
    for wrapper in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module."):
        name = name.replace(wrapper, "")
    return name


def initial_value(name: str, shape: torch.Size, seed: int, tied: bool) -> torch.Tensor:
    """The full initial value of parameter `name`: N(0, 0.02) for matrices and
    embeddings, zero biases, unit norm weights. Seeded by name, so every rank and every
    layout draws the same numbers. A head tied to the embedding starts as the embedding."""
    if tied and name == "output.weight":
        name = "tok_embeddings.weight"
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * INIT_STD


@torch.no_grad()
def materialize(model: Transformer, device: str | torch.device, seed: int = 0) -> Transformer:
    """Allocate a (possibly sharded, meta-device) model on `device` and fill in each
    rank's part of the initial weights. A rank holds its own shards plus, for one
    parameter at a time, that parameter's full initial value."""
    model.to_empty(device=device)
    if model.tied:
        model.tie()   # to_empty gave the head a parameter of its own
    tied = model.spec.tie_word_embeddings
    for name, param in model.named_parameters():
        name = canonical_name(name)
        if isinstance(param, DTensor):
            full = initial_value(name, param.shape, seed, tied)
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(initial_value(name, param.shape, seed, tied))
    cos, sin = rope_tables(model.seq_len, model.spec.head_dim, device=device, dtype=model.rope_cos.dtype)
    model.rope_cos.copy_(cos)
    model.rope_sin.copy_(sin)
    return model


def num_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied head counts once), full sizes even when sharded."""
    return sum(p.numel() for p in model.parameters())
