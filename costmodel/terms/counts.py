"""The layer graph of a model: embedding, transformer layers, final norm, LM head and
loss as a networkx chain, each node carrying its parameter count and forward FLOPs
per sequence. Parameter and FLOP counts of one layer are defined here and nowhere else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from costmodel.specs import ModelSpec

if TYPE_CHECKING:
    import networkx as nx


def attention_parameters(model: ModelSpec) -> int:
    """Q, K, V and output projections with their biases (Korthikanti et al. 2022 eq. 2
    for GPT; Qwen2: q/k/v biases only) and per-head q/k RMSNorm weights (Qwen3). The Q
    and output widths are heads x head_dim, which need not be hidden_size (Gemma)."""
    h, q, kv = model.hidden_size, model.q_size, model.kv_size
    weights = h * q + 2 * h * kv + q * h
    biases = (q + 2 * kv if model.attention_bias else 0) + (h if model.attention_out_bias else 0)
    qk_norm = 2 * model.head_dim if model.qk_norm else 0
    sinks = model.num_attention_heads if model.attention_sinks else 0   # gpt-oss: a logit per head
    return weights + biases + qk_norm + sinks


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
    dense, experts = layer_parameters(model)
    return embedding_parameters(model) + model.num_hidden_layers * (dense + experts) + head_parameters(model)


def active_parameters(model: ModelSpec) -> int:
    """Parameters one token's forward uses: every dense weight (a shared expert's too) and
    the k experts it is routed to in each layer (the "activated parameters" model cards quote, embedding and
    head included: Mixtral 8x7B 12.9B of 46.7B, Jiang et al. 2024 §2; Qwen3-30B-A3B 3.3B
    of 30.5B, Qwen3 technical report table 1). Dense models: every parameter."""
    dense, experts = layer_parameters(model)
    routed = experts // model.num_local_experts * model.num_experts_per_tok if model.is_moe else 0
    return embedding_parameters(model) + model.num_hidden_layers * (dense + routed) + head_parameters(model)


def layer_forward_flops(model: ModelSpec, seq_len: int) -> float:
    """Model FLOPs of one layer's forward pass for one sequence: 2 per multiply-add of
    every matmul, attention scores over the full s x s matrix (the convention of
    Korthikanti et al. 2022 eq. 7: 24sh^2 + 4s^2h per layer for a 4h GPT MLP). MoE counts
    the rows each token sends to the experts (ModelSpec.routed_rows_per_token: the
    num_experts_per_tok experts it visits, less what a capacity factor below 1 drops) and
    the shared expert's MLP over every token."""
    h, s, q, kv, f = model.hidden_size, seq_len, model.q_size, model.kv_size, model.intermediate_size
    projections = 2 * s * (2 * h * q + 2 * h * kv)
    # Windowed layers (gpt-oss's banded attention) see min(window, s) keys a query.
    scores = 4 * s * model.attended_keys(s) * q
    mlp_matrices = 3 if model.gated_mlp else 2
    mlp = 2 * s * mlp_matrices * h * f * model.routed_rows_per_token
    router = 2 * s * h * model.num_local_experts if model.is_moe else 0
    # The shared expert runs on every token; its gate is one output per token.
    shared = 2 * s * (mlp_matrices * h * model.shared_expert_intermediate_size + (h if model.shared_expert_gate else 0))
    return float(projections + scores + mlp + router + shared)


def head_forward_flops(model: ModelSpec, seq_len: int) -> float:
    """LM head logits for one sequence: 2shV (Korthikanti et al. 2022 eq. 7's V term)."""
    return 2.0 * seq_len * model.hidden_size * model.vocab_size


def model_flops_per_step(model: ModelSpec, global_batch: int, seq_len: int) -> float:
    """Forward + backward model FLOPs of one step, backward = 2x forward (eq. 7)."""
    per_sequence = model.num_hidden_layers * layer_forward_flops(model, seq_len) + head_forward_flops(model, seq_len)
    return 3.0 * global_batch * per_sequence


def build_graph(model: ModelSpec, seq_len: int) -> nx.DiGraph:
    """Chain graph embedding -> layer.0 .. layer.{L-1} -> head; node attributes
    `parameters` and `forward_flops` (per sequence)."""
    import networkx as nx  # only who draws or traces a layer graph pays for it

    graph = nx.DiGraph(name=model.name)
    dense, experts = layer_parameters(model)
    graph.add_node("embedding", kind="embedding", parameters=embedding_parameters(model), forward_flops=0.0)
    previous = "embedding"
    for i in range(model.num_hidden_layers):
        node = f"layer.{i}"
        graph.add_node(node, kind="layer", index=i, parameters=dense + experts,
                       expert_parameters=experts, forward_flops=layer_forward_flops(model, seq_len))
        graph.add_edge(previous, node)
        previous = node
    graph.add_node("head", kind="head", parameters=head_parameters(model), forward_flops=head_forward_flops(model, seq_len))
    graph.add_edge(previous, "head")
    return graph
