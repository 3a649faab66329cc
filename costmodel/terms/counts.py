"""The layer graph of a model: embedding, transformer layers, final norm, LM head and
loss as a networkx chain, each node carrying its parameter count and forward FLOPs
per sequence. Parameter and FLOP counts of one layer are defined here and nowhere else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from costmodel.specs import ModelSpec
from costmodel.terms.recompute import attention_matmuls

if TYPE_CHECKING:
    import networkx as nx


def attention_parameters(model: ModelSpec) -> int:
    """Q, K, V and output projections with their biases (Korthikanti et al. 2022 eq. 2
    for GPT; Qwen2: q/k/v biases only; MLA's five, `attention_matmuls`) and per-head q/k
    RMSNorm weights (Qwen3). The Q and output widths are heads x head_dim, which need not
    be hidden_size (Gemma)."""
    matmuls = attention_matmuls(model)
    weights = sum(m.out_width * m.in_width for m in matmuls)
    biases = sum(m.out_width for m in matmuls if m.bias)
    qk_norm = 2 * model.head_dim if model.qk_norm else 0
    sinks = model.num_attention_heads if model.attention_sinks else 0   # gpt-oss: a logit per head
    # MLA's RMSNorms on the query and kv latents (DeepSeek-V2 §2.1.2, q_a_layernorm and kv_a_layernorm).
    latent_norms = model.q_lora_rank + model.kv_lora_rank
    return int(weights + biases) + qk_norm + sinks + latent_norms


def expert_parameters(model: ModelSpec, width: int | None = None) -> int:
    """One MLP `width` wide (the spec's intermediate_size unless given): GELU (up and
    down) or GeGLU / SwiGLU (gate, up and down; Shazeer 2020), each with its bias when
    mlp_bias."""
    h, f = model.hidden_size, width or model.intermediate_size
    if model.gated_mlp:
        return 3 * h * f + (2 * f + h if model.mlp_bias else 0)
    return 2 * h * f + (f + h if model.mlp_bias else 0)


def shared_expert_parameters(model: ModelSpec) -> int:
    """The shared expert: an MLP `shared_expert_intermediate_size` wide that every token
    runs (DeepSeek-AI 2024, DeepSeekMoE §2.1; Qwen2-MoE; Llama 4), and its sigmoid gate's
    weight vector where the model has one (Qwen2-MoE)."""
    if not model.has_shared_expert:
        return 0
    gate = model.hidden_size if model.shared_expert_gate else 0
    return expert_parameters(model, model.shared_expert_intermediate_size) + gate


def norm_parameters(model: ModelSpec) -> int:
    """LayerNorm has weight and bias, RMSNorm weight only."""
    return 2 * model.hidden_size if model.norm == "layernorm" else model.hidden_size


def layer_parameters(model: ModelSpec) -> tuple[int, int]:
    """(dense parameters, expert parameters) of one transformer layer; dense includes the
    MoE router and the shared expert (held and reduced as the attention's weights are)."""
    dense = attention_parameters(model) + model.norms_per_layer * norm_parameters(model)
    if model.is_moe:
        router = (model.hidden_size + (1 if model.router_bias else 0)) * model.num_local_experts
        return dense + router + shared_expert_parameters(model), model.num_local_experts * expert_parameters(model)
    return dense + expert_parameters(model), 0


def embedding_parameters(model: ModelSpec) -> int:
    positions = model.max_position_embeddings * model.hidden_size if model.position_embedding == "learned" else 0
    return model.vocab_size * model.hidden_size + positions


def head_parameters(model: ModelSpec) -> int:
    """Final norm plus the LM head (zero extra when tied to the embedding) and its bias
    (Phi)."""
    head = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    return norm_parameters(model) + head + (model.vocab_size if model.lm_head_bias else 0)


def total_parameters(model: ModelSpec) -> int:
    """Every parameter of the model, multi-token prediction modules left out (as DeepSeek
    counts its 671B: `mtp_parameters`)."""
    layers = sum(count * sum(layer_parameters(kind)) for kind, count in model.layer_kinds())
    return embedding_parameters(model) + layers + head_parameters(model)


def active_parameters(model: ModelSpec) -> int:
    """Parameters one token's forward uses: every dense weight (a shared expert's too) and
    the k experts it is routed to in each layer (the "activated parameters" model cards quote, embedding and
    head included: Mixtral 8x7B 12.9B of 46.7B, Jiang et al. 2024 §2; Qwen3-30B-A3B 3.3B
    of 30.5B, Qwen3 technical report table 1; DeepSeek-V3 37B of 671B). Dense models:
    every parameter."""
    layers = 0
    for kind, count in model.layer_kinds():
        dense, experts = layer_parameters(kind)
        routed = experts // kind.num_local_experts * kind.num_experts_per_tok if kind.is_moe else 0
        layers += count * (dense + routed)
    return embedding_parameters(model) + layers + head_parameters(model)


def mtp_projection_parameters(model: ModelSpec) -> int:
    """One multi-token prediction module's own weights beside its layer (DeepSeek-V3
    §2.2): the projection M of the normed hidden state and embedding (2h to h) and three
    RMSNorms (the two inputs', and the shared head's own before the shared LM head;
    Hugging Face's enorm, hnorm and shared_head.norm)."""
    return 2 * model.hidden_size * model.hidden_size + 3 * norm_parameters(model)


def mtp_parameters(model: ModelSpec) -> int:
    """The multi-token prediction modules' parameters, each a layer of the model's last
    kind and `mtp_projection_parameters`; they share the embedding and LM head."""
    return model.num_nextn_predict_layers * (sum(layer_parameters(model)) + mtp_projection_parameters(model))


def layer_forward_flops(model: ModelSpec, seq_len: int) -> float:
    """Model FLOPs of one layer's forward pass for one sequence: 2 per multiply-add of
    every matmul, attention scores over the full s x s matrix (the convention of
    Korthikanti et al. 2022 eq. 7: 24sh^2 + 4s^2h per layer for a 4h GPT MLP). MoE counts
    the rows each token sends to the experts (ModelSpec.routed_rows_per_token: the
    num_experts_per_tok experts it visits, less what a capacity factor below 1 drops) and
    the shared expert's MLP over every token."""
    h, s, f = model.hidden_size, seq_len, model.intermediate_size
    projections = 2 * s * sum(m.out_width * m.in_width for m in attention_matmuls(model))
    # Windowed layers (gpt-oss's banded attention) see min(window, s) keys a query; QK^T
    # over the query width and AV over the value width (MLA: 192 and 128 a head).
    scores = 2 * s * model.attended_keys(s) * (model.q_size + model.out_size)
    mlp_matrices = 3 if model.gated_mlp else 2
    mlp = 2 * s * mlp_matrices * h * f * model.routed_rows_per_token
    router = 2 * s * h * model.num_local_experts if model.is_moe else 0
    # The shared expert runs on every token; its gate is one output per token.
    shared = 2 * s * (mlp_matrices * h * model.shared_expert_intermediate_size + (h if model.shared_expert_gate else 0))
    return float(projections + scores + mlp + router + shared)


def head_forward_flops(model: ModelSpec, seq_len: int) -> float:
    """LM head logits for one sequence: 2shV (Korthikanti et al. 2022 eq. 7's V term)."""
    return 2.0 * seq_len * model.hidden_size * model.vocab_size


def mtp_forward_flops(model: ModelSpec, seq_len: int) -> float:
    """The multi-token prediction modules' forward for one sequence (DeepSeek-V3 §2.2):
    each its projection of 2h to h, a layer of the model's last kind, and the shared LM
    head's logits again."""
    h = model.hidden_size
    each = 2.0 * seq_len * 2 * h * h + layer_forward_flops(model, seq_len) + head_forward_flops(model, seq_len)
    return model.num_nextn_predict_layers * each


def model_flops_per_step(model: ModelSpec, global_batch: int, seq_len: int) -> float:
    """Forward + backward model FLOPs of one step, backward = 2x forward (eq. 7);
    multi-token prediction modules included, as they are trained."""
    layers = sum(count * layer_forward_flops(kind, seq_len) for kind, count in model.layer_kinds())
    per_sequence = layers + head_forward_flops(model, seq_len) + mtp_forward_flops(model, seq_len)
    return 3.0 * global_batch * per_sequence


def build_graph(model: ModelSpec, seq_len: int) -> nx.DiGraph:
    """Chain graph embedding -> layer.0 .. layer.{L-1} -> head; node attributes
    `parameters` and `forward_flops` (per sequence)."""
    import networkx as nx  # only who draws or traces a layer graph pays for it

    graph = nx.DiGraph(name=model.name)
    graph.add_node("embedding", kind="embedding", parameters=embedding_parameters(model), forward_flops=0.0)
    previous, dense_layers, dense_kind = "embedding", set(model.mlp_only_layers), model.dense_layer()
    for i in range(model.num_hidden_layers):
        kind = dense_kind if dense_kind is not None and i in dense_layers else model
        dense, experts = layer_parameters(kind)
        node = f"layer.{i}"
        graph.add_node(node, kind="layer", index=i, parameters=dense + experts,
                       expert_parameters=experts, forward_flops=layer_forward_flops(kind, seq_len))
        graph.add_edge(previous, node)
        previous = node
    graph.add_node("head", kind="head", parameters=head_parameters(model), forward_flops=head_forward_flops(model, seq_len))
    graph.add_edge(previous, "head")
    return graph
