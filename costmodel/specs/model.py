"""The model: a decoder-only transformer, its fields named as the Hugging Face config
keys so a spec reads the same in YAML, in a `config.json` and in code. Loading and
validation live in `costmodel.specs.loading`; this class only holds values and derives
simple quantities.

The family (`model_type`) sets the defaults of the architecture fields; each can be set
on its own, so one spec describes the dense decoders Hugging Face publishes: an explicit
`head_dim` (Gemma: 256 with hidden 2048), q/k/v and output biases (Qwen2: q/k/v only),
per-head q/k RMSNorm (Qwen3), tied or untied embeddings, GELU / GeGLU / SwiGLU MLPs with
or without biases, LayerNorm or RMSNorm, parallel attention + MLP blocks (GPT-J,
GPT-NeoX, Phi), one or two norms per layer, learned or rotary positions, and an LM-head
bias (Phi).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

FAMILIES = ("gpt", "llama", "mixtral")
MLP_KINDS = ("gelu", "geglu", "swiglu")
ROUTER_SCORINGS = ("softmax", "sigmoid")
# rmsnorm_unit_offset: Gemma's RMSNorm, x * (1 + w) multiplied in fp32 (same parameters).
NORM_KINDS = ("layernorm", "rmsnorm", "rmsnorm_unit_offset")
POSITION_KINDS = ("learned", "rope")

# The architecture fields' values when left unset (None), by family: GPT-2 / GPT-3
# (Radford et al. 2019, Brown et al. 2020) and Llama (Touvron et al. 2023 §2.2).
_GPT = dict(mlp="gelu", norm="layernorm", position_embedding="learned", attention_bias=True,
            attention_out_bias=True, mlp_bias=True)
_LLAMA = dict(mlp="swiglu", norm="rmsnorm", position_embedding="rope", attention_bias=False,
              attention_out_bias=False, mlp_bias=False)
FAMILY_DEFAULTS = {"gpt": _GPT, "llama": _LLAMA, "mixtral": _LLAMA}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    model_type "gpt": LayerNorm, GELU MLP, learned positions, biases, dropout.
    model_type "llama": RMSNorm, SwiGLU MLP, grouped-query attention, RoPE, no biases.
    model_type "mixtral": llama layers whose MLP is a top-k mixture of experts, with
    or without a shared expert beside them.
    Unset (None) architecture fields take the family's value (FAMILY_DEFAULTS);
    `head_dim` unset is hidden_size / num_attention_heads.
    """

    name: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_local_experts: int = 1
    num_experts_per_tok: int = 1
    moe_capacity_factor: float | None = None   # None: dropless; c: an expert takes at most c x its balanced share
    # A dense SwiGLU MLP every token runs beside its routed experts, this wide (0: none):
    # DeepSeek's n_shared_experts x moe_intermediate_size, Qwen2-MoE's
    # shared_expert_intermediate_size, Llama 4's one expert; Megatron-LM's
    # --moe-shared-expert-intermediate-size. `shared_expert_gate`: its output scaled by
    # sigmoid(w x), one weight vector (Qwen2-MoE's shared_expert_gate).
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # Routing weights: the softmax over the k chosen logits, i.e. the softmax over every
    # expert renormalised over the top k (Mixtral, Qwen3-MoE); False: the top k of the
    # softmax over every expert as they are (Qwen2-MoE). Hugging Face's name.
    norm_topk_prob: bool = True
    # How routing is priced, not what is built: the busiest expert-parallel rank's rows
    # over the mean (1: balanced). Not in the fingerprint (canonical_dict).
    moe_load_imbalance: float = 1.0
    head_dim: int | None = None
    mlp: str | None = None                  # "gelu" | "geglu" | "swiglu"
    norm: str | None = None                 # "layernorm" (weight + bias) | "rmsnorm" (weight)
    position_embedding: str | None = None   # "learned" | "rope"
    attention_bias: bool | None = None      # q, k, v biases
    attention_out_bias: bool | None = None  # output projection bias
    mlp_bias: bool | None = None
    qk_norm: bool = False                   # RMSNorm over head_dim on q and k (Qwen3)
    parallel_block: bool = False            # x + attn(norm(x)) + mlp(norm'(x)) (GPT-J, NeoX, Phi)
    # 1: one norm feeds attention and MLP (Phi, GPT-J); 4: each block's output is normed too
    # before the residual add (Gemma 2 and 3's post-attention and post-feedforward norms).
    norms_per_layer: int = 2
    lm_head_bias: bool = False              # Phi
    # gpt-oss (OpenAI 2025, model card §2.1): `windowed_layers` of the layers attend only the
    # last `attention_window` tokens (banded attention; Hugging Face's layer_types
    # "sliding_attention"), each attention softmax has a learned sink logit per head in its
    # denominator, the router has a bias, and the experts' SwiGLU clamps its inputs at
    # `swiglu_limit` (gate * sigmoid(1.702 gate) * (up + 1)).
    attention_window: int | None = None
    windowed_layers: int = 0
    # Llama 4's chunked attention: the windowed layers' queries attend their own chunk of
    # `attention_window` tokens (causal within it) rather than the last that many.
    chunked_attention: bool = False
    # "softmax" over the chosen logits (Mixtral) or "sigmoid" of each (Llama 4, whose
    # score scales the expert's input; DeepSeek-V3).
    router_scoring: str = "softmax"
    attention_sinks: bool = False
    router_bias: bool = False
    swiglu_limit: float | None = None
    # DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437; Hugging Face's names):
    # - Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 §2.1.2), on when
    #   kv_lora_rank > 0: keys and values made per head from a `kv_lora_rank` latent, beside one
    #   shared `qk_rope_head_dim` rotary key; queries from a `q_lora_rank` latent (0: a full
    #   projection); per head, `qk_nope_head_dim` + `qk_rope_head_dim` query/key widths and
    #   `v_head_dim` value widths (head_dim is then unused).
    # - `mlp_only_layers` (Qwen-MoE's name; DeepSeek's first_k_dense_replace, Llama 4's
    #   layers not in moe_layers): the layers of a mixture-of-experts model that hold a dense
    #   SwiGLU MLP `dense_intermediate_size` wide in place of the experts.
    # - Group-limited routing: the experts in `n_group` groups, a token routed within its best
    #   `topk_group` groups (node-limited routing, §2.1.2), the weights scaled by
    #   `routed_scaling_factor`; no parameters or FLOPs beyond the router's.
    # - `num_nextn_predict_layers`: multi-token prediction modules (§2.2), each one more
    #   layer of the model's last kind, a projection of 2h to h and two norms on the last
    #   pipeline stage, sharing the embedding and LM head; trained, so priced, but outside
    #   the published parameter count (671B main model, 14B MTP).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    dense_intermediate_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0
    # How Hugging Face runs it (memory only; no parameter or FLOP changes):
    sliding_window: int | None = None       # Mistral: a mask is built once seq_len reaches it
    hidden_act: str | None = None           # HF's name; "gelu_new" is an elementwise formula
    resid_dropout: float = 0.0              # dropout on the attention and MLP outputs (Phi, GPT-2)
    fused_qkv: bool = False                 # one q/k/v projection whose output V is a view of (GPT-NeoX)

    def __post_init__(self):
        family = FAMILY_DEFAULTS.get(self.model_type, _LLAMA)
        for key, value in family.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        # A plan file's JSON list, sorted: the frozen spec holds a tuple (hashable, one form).
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(self.mlp_only_layers)))

    def canonical_dict(self) -> dict:
        """The fields, less the architecture fields at their family's value: a model
        written before those fields existed keeps its fingerprint."""
        out = asdict(self)
        family = FAMILY_DEFAULTS.get(self.model_type, _LLAMA)
        defaults = {f.name: f.default for f in fields(self) if f.name in _ARCHITECTURE_FIELDS}
        defaults.update(family, head_dim=self.hidden_size // self.num_attention_heads)
        for key, default in defaults.items():
            if out[key] == default:
                del out[key]
        del out["moe_load_imbalance"]   # a pricing assumption: the same model, the same checkpoints
        return out

    @property
    def is_gpt(self) -> bool:
        return self.model_type == "gpt"

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 1

    @property
    def routed_rows_per_token(self) -> float:
        """Rows each token sends to the experts under balanced routing: num_experts_per_tok,
        of which a capacity factor c below 1 keeps c (every expert takes at most
        c x tokens x k / E rows and drops the rest: Lepikhin et al. 2021 §2.2, Fedus et al.
        2022 §2.1). Dropless routing and c >= 1 keep them all."""
        c = self.moe_capacity_factor
        return self.num_experts_per_tok * (1.0 if c is None else min(1.0, c))

    def routed_nodes_per_token(self, nodes: int) -> float:
        """Nodes a token's routed experts lie on, on average, with the experts spread
        evenly over `nodes` nodes: for k of E experts, each equally likely (the balanced
        router) and none twice, nodes x (1 - P), P = prod_{i<k} (E - E/nodes - i)/(E - i)
        the chance that a node holds none of them. Group-limited routing (n_group groups,
        each token within its best topk_group) draws the k from topk_group groups; where
        each node holds whole groups, a token reaches no more nodes than the groups it
        reaches, counted the same way (DeepSeek-AI 2024 §2.1.2 node-limited routing: 8
        groups, 4 a token, 3.6 on average). Groups that straddle nodes are priced as
        ungrouped routing, which spreads tokens over more nodes."""
        if nodes <= 1 or not self.is_moe:
            return 1.0
        k, experts = self.num_experts_per_tok, self.num_local_experts

        def spread(bins: int, per_bin: float, drawn_from: float) -> float:
            none = math.prod(max(0.0, drawn_from - per_bin - i) / (drawn_from - i) for i in range(k))
            return bins * (1.0 - none)

        reached = spread(nodes, experts / nodes, experts)
        if 1 < self.n_group and self.topk_group < self.n_group and self.n_group % nodes == 0:
            per_group = experts / self.n_group
            reached = min(reached, spread(self.topk_group, per_group, self.topk_group * per_group))
        return reached

    def busiest_rank_rows_per_token(self, ep: int) -> float:
        """Expert rows per local token that the busiest rank of an ep group computes and
        receives: k x min(imbalance, c, ep), where `moe_load_imbalance` is the busiest
        rank's share over the mean (routers trained with a balancing loss still run
        uneven: Fedus et al. 2022 §2.2; DeepSeek-AI 2024 §2.1.2), a capacity factor c
        drops what an expert takes beyond c x its share, and a rank cannot receive more
        than every ep rank sends. Balanced routing (1, the default) gives
        `routed_rows_per_token`; with every expert on the rank (ep 1) the rows are the
        routed rows whatever the routing."""
        if ep == 1:
            return self.routed_rows_per_token
        c = self.moe_capacity_factor
        return self.num_experts_per_tok * min(self.moe_load_imbalance, ep, math.inf if c is None else c)

    def attended_keys(self, seq_len: int) -> float:
        """Keys a query attends, averaged over the layers, in the convention of whole
        rows (Korthikanti et al. 2022 eq. 7 counts s keys a query under a causal mask): s
        in a full layer, min(window, s) in a windowed one."""
        if not self.windowed_layers:
            return float(seq_len)
        windowed = self.windowed_layers / self.num_hidden_layers
        return (1 - windowed) * seq_len + windowed * min(self.attention_window, seq_len)

    def windowed_attention_fraction(self, seq_len: int, tile: int = 0) -> float:
        """Share of an unmasked s x s score matrix a windowed layer computes (w the
        window): chunks of w tokens, causal within each, (n w^2 + r^2) / (2 s^2) for
        s = n w + r; a sliding band of w keys a query (w + `tile` where a kernel computes
        whole tiles of keys), less the first queries' triangle, w/s - w^2/(2 s^2); 1/2
        (the causal triangle) once s <= w."""
        if self.chunked_attention:
            n, r = divmod(seq_len, self.attention_window)
            return (n * self.attention_window ** 2 + r * r) / (2 * seq_len * seq_len)
        w = self.attention_window + tile
        if seq_len <= w:
            return 0.5
        return w / seq_len - w * w / (2 * seq_len * seq_len)

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    @property
    def gated_mlp(self) -> bool:
        """GeGLU / SwiGLU: three matrices (Shazeer 2020)."""
        return self.mlp != "gelu"

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2 §2.1.2)."""
        return self.kv_lora_rank > 0

    @property
    def query_head_dim(self) -> int:
        """Width of one head's query and key: nope + rope under MLA, else head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def q_size(self) -> int:
        """Width of the queries (and of the keys made from MLA's latent)."""
        return self.num_attention_heads * self.query_head_dim

    @property
    def out_size(self) -> int:
        """Width of the attention output: the output projection's input."""
        return self.num_attention_heads * self.value_head_dim

    @property
    def kv_size(self) -> int:
        """Width of the K (or V) projection output; under MLA the per-head keys made from
        the latent (values: `out_size`)."""
        if self.is_mla:
            return self.q_size
        return self.num_key_value_heads * self.head_dim

    @property
    def kv_values_per_token(self) -> int:
        """Key and value values a token's attention takes from the projections: K and V
        (2 kv_size); under MLA the latent and the shared rotary key, which DeepSeek
        caches, and which context parallelism gathers, in their place (DeepSeek-V2
        §2.1.2: kv_lora_rank + qk_rope_head_dim a token)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.kv_size

    @property
    def dense_upto(self) -> tuple[int, ...]:
        """Dense-MLP layers among the first i layers, for i = 0 .. num_hidden_layers, of a
        mixture-of-experts model with `mlp_only_layers` (empty otherwise): a stage holding
        layers [a, b) holds dense_upto[b] - dense_upto[a] of them."""
        if not (self.is_moe and self.mlp_only_layers):
            return ()
        dense, out = set(self.mlp_only_layers), [0]
        for i in range(self.num_hidden_layers):
            out.append(out[-1] + (i in dense))
        return tuple(out)

    def layer_kinds(self) -> tuple[tuple[ModelSpec, int], ...]:
        """(the spec of a kind of layer, how many layers are of it): the model itself for
        every layer, or its dense-MLP layers (`dense_layer`) and its mixture-of-experts
        layers."""
        dense = self.dense_layer()
        if dense is None:
            return ((self, self.num_hidden_layers),)
        count = len(self.mlp_only_layers)
        return ((dense, count), (self, self.num_hidden_layers - count))

    def dense_layer(self) -> ModelSpec | None:
        """The spec of this mixture-of-experts model's `mlp_only_layers`: the same
        attention and a dense MLP `dense_intermediate_size` wide. None when every layer is
        alike."""
        if not (self.is_moe and self.mlp_only_layers):
            return None
        return replace(self, name=f"{self.name} dense layers", model_type="llama" if self.model_type == "mixtral"
                       else self.model_type, num_local_experts=1, num_experts_per_tok=1,
                       intermediate_size=self.dense_intermediate_size or self.intermediate_size,
                       moe_capacity_factor=None, shared_expert_intermediate_size=0, shared_expert_gate=False,
                       norm_topk_prob=True, router_scoring="softmax", router_bias=False, swiglu_limit=None,
                       mlp_only_layers=(), dense_intermediate_size=0, n_group=1, topk_group=1,
                       routed_scaling_factor=1.0, num_nextn_predict_layers=0)


_ARCHITECTURE_FIELDS = ("moe_capacity_factor", "shared_expert_intermediate_size", "shared_expert_gate",
                        "norm_topk_prob", "attention_window", "windowed_layers", "chunked_attention", "router_scoring",
                        "attention_sinks", "router_bias", "swiglu_limit", "q_lora_rank", "kv_lora_rank",
                        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mlp_only_layers",
                        "dense_intermediate_size", "n_group", "topk_group", "routed_scaling_factor",
                        "num_nextn_predict_layers", "head_dim", "mlp", "norm",
                        "position_embedding", "attention_bias", "attention_out_bias", "mlp_bias", "qk_norm",
                        "parallel_block", "norms_per_layer", "lm_head_bias", "sliding_window", "hidden_act",
                        "resid_dropout", "fused_qkv")
