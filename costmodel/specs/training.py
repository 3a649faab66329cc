"""The training run: global batch, sequence length, precision, optimizer, attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("bf16", "fp16", "fp32")


OPTIMIZERS = ("adam", "adamw", "sgd")


@dataclass(frozen=True)
class TrainingSpec:
    """global_batch in sequences; precision "bf16"/"fp16" means mixed precision with
    fp32 master weights and optimizer states, "fp32" means everything in fp32."""

    global_batch: int
    seq_len: int
    precision: str = "bf16"
    optimizer: str = "adamw"
    flash_attention: bool = True

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len
