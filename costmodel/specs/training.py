"""The training run: global batch, sequence length, precision, optimizer, attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("bf16", "fp16", "fp32")
# Peaks a hardware file may record from its data sheet: the training precisions, and fp8 and
# fp4, which no plan uses yet (the cost model prices no FP8 training recipe).
DATA_SHEET_PRECISIONS = PRECISIONS + ("fp8", "fp4")
# How a 16-bit run holds its weights (PyTorch): "autocast" keeps fp32 weights and casts
# each matmul's operands (torch.autocast: the executor, DDP); "param_dtype" gathers the
# weights in the compute dtype (FSDP2 MixedPrecisionPolicy(param_dtype=bf16,
# reduce_dtype=fp32): torchtitan, Hugging Face models under fully_shard); "megatron" is
# Megatron-LM's recipe as Korthikanti et al. 2022 count it (16-bit weights and
# gradients, fp32 master copy in the optimizer, fused kernels).
MIXED_PRECISION = ("autocast", "param_dtype", "megatron")


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
    mixed_precision: str = "autocast"

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len
