"""The model: a decoder-only transformer, its fields named as the Hugging Face config
keys so a spec reads the same in YAML, in a `config.json` and in code. Loading and
validation live in `costmodel.specs.loading`; this class only holds values and derives
simple quantities.
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("gpt", "llama", "mixtral")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    model_type "gpt": LayerNorm, GELU MLP, learned positions, biases, dropout.
    model_type "llama": RMSNorm, SwiGLU MLP, grouped-query attention, RoPE, no biases.
    model_type "mixtral": llama layers whose MLP is a top-k mixture of experts.
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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def is_gpt(self) -> bool:
        return self.model_type == "gpt"

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 1

    @property
    def kv_size(self) -> int:
        """Width of the K (or V) projection output."""
        return self.num_key_value_heads * self.head_dim


