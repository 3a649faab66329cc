"""What an engine's selective recompute keeps and repeats, per layer.

Two policies run under the name "selective" (`RuntimeSpec.selective_recompute`):

- "attention-core": Korthikanti et al. 2022 §4.3 (Megatron-LM): the layer keeps every
  activation except the attention scores, and repeats QK^T, softmax and AV in backward.
  With FlashAttention there is nothing left to drop or repeat (Dao et al. 2022 §3.1).
- "op-level": torchtitan's per-op selective activation checkpointing
  (torchtitan/distributed/activation_checkpoint.py, `_save_list` and
  `_get_custom_policy`; torch.utils.checkpoint.create_selective_checkpoint_contexts), as
  the executor runs it too (executor/parallelize.py). Inside each checkpointed layer the
  policy saves the outputs of SDPA, of sequence-parallel reduce-scatters and of every
  `aten.mm` but every second one (counted in forward order), and recomputes the rest:
  the other matmuls and every elementwise op (norms, RoPE, activation, residuals). A
  linear with a bias runs `addmm`, which the policy neither saves nor counts. The layer's
  input is kept by the checkpoint itself.

This module lists a layer's matmuls in forward order, as the executor's and torchtitan's
modules call them, and splits them by the op-level policy; costmodel.terms.compute
prices the repeated ones and costmodel.terms.memory the kept ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.specs import ModelSpec


@dataclass(frozen=True)
class Matmul:
    """One matmul of a layer's forward on one rank: tokens x in_width @ in_width x out_width."""

    name: str
    out_width: float         # output values per token on this rank
    in_width: float          # the contraction
    tokens_fraction: float = 1.0   # of the micro-batch's tokens (an MoE expert's share)
    bias: bool = False       # F.linear with a bias: addmm, not mm
    grouped: bool = False    # a routed expert's: one torch._grouped_mm (or bmm) for all, not mm

    def output_values(self, tokens: float) -> float:
        return self.out_width * tokens * self.tokens_fraction


def attention_matmuls(model: ModelSpec, tp: int = 1) -> tuple[Matmul, ...]:
    """The attention's projections in forward order, on one rank: q, k, v (or GPT-NeoX's
    fused qkv) and o; under multi-head latent attention (DeepSeek-V2 §2.1.2, as
    transformers' DeepseekV3Attention calls them) the query's down and up projections
    (or one q projection without a query latent), the joint down projection to the kv
    latent and the shared rotary key, the latent's up projection to every head's key and
    value, and o. The down projections are replicated over tp, not split (Megatron-LM's
    MLA builds them "duplicated"): each rank computes them whole."""
    h, q, kv = model.hidden_size, model.q_size, model.kv_size
    bias, out_bias = model.attention_bias, model.attention_out_bias
    if model.is_mla:
        if model.q_lora_rank:
            query = [Matmul("q_a", model.q_lora_rank, h, bias=bias), Matmul("q_b", q / tp, model.q_lora_rank)]
        else:
            query = [Matmul("q", q / tp, h)]
        heads = model.num_attention_heads / tp
        return (*query, Matmul("kv_a", model.kv_lora_rank + model.qk_rope_head_dim, h, bias=bias),
                Matmul("kv_b", heads * (model.qk_nope_head_dim + model.v_head_dim), model.kv_lora_rank),
                Matmul("o", h, model.out_size / tp, bias=out_bias))
    if model.fused_qkv:
        projections = [Matmul("qkv", (q + 2 * kv) / tp, h, bias=bias)]
    else:
        projections = [Matmul(name, width / tp, h, bias=bias) for name, width in (("q", q), ("k", kv), ("v", kv))]
    return (*projections, Matmul("o", h, q / tp, bias=out_bias))


def layer_matmuls(model: ModelSpec, tp: int, ep: int = 1) -> tuple[Matmul, ...]:
    """A layer's matmuls in the order its forward calls them (executor.models.Attention,
    MLP and MoE; torchtitan's llama3 Attention and FeedForward call theirs in the same
    order). Column-parallel outputs are split by tp; a row-parallel matmul (output
    projection, MLP down) writes the whole hidden width per token before its all-reduce
    or reduce-scatter sums the partial results (Shoeybi et al. 2019 §3)."""
    h, f = model.hidden_size, model.intermediate_size
    attention = list(attention_matmuls(model, tp))

    def mlp(share: float, width: float = f, grouped: bool = False) -> list[Matmul]:
        up = [Matmul("gate", width / tp, h, share, model.mlp_bias, grouped)] if model.gated_mlp else []
        return up + [Matmul("up", width / tp, h, share, model.mlp_bias, grouped),
                     Matmul("down", h, width / tp, share, model.mlp_bias, grouped)]

    if not model.is_moe:
        return tuple(attention + mlp(1.0))
    # As costmodel.terms.compute.layer_compute: each of the rank's E/ep experts runs its
    # MLP on tokens * k * ep / E tokens (balanced; the busiest rank's share under
    # moe_load_imbalance), one after another.
    local = model.num_local_experts // ep
    share = model.busiest_rank_rows_per_token(ep) * ep / model.num_local_experts
    experts = [m for _ in range(local) for m in mlp(share, grouped=True)]
    # Then the shared expert over every token, and its gate (executor.models.MoE).
    shared = mlp(1.0, model.shared_expert_intermediate_size) if model.has_shared_expert else []
    if model.shared_expert_gate:
        shared.append(Matmul("shared_gate", 1, h))
    return tuple(attention + [Matmul("router", model.num_local_experts, h, bias=model.router_bias)] + experts + shared)


def op_level_split(model: ModelSpec, tp: int, ep: int = 1) -> tuple[tuple[Matmul, ...], tuple[Matmul, ...]]:
    """(kept, repeated) matmuls under the op-level policy: of the bias-free matmuls (the
    `aten.mm` calls the policy counts), the 1st, 3rd, 5th... are kept; the rest repeat.
    The routed experts' grouped GEMMs are not `aten.mm`: neither counted nor kept."""
    kept, repeated, count = [], [], 0
    for matmul in layer_matmuls(model, tp, ep):
        if matmul.bias or matmul.grouped:
            repeated.append(matmul)
            continue
        count += 1
        (kept if count % 2 == 1 else repeated).append(matmul)
    return tuple(kept), tuple(repeated)
