"""The training run: global batch, sequence length, precision, optimizer, attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("bf16", "fp16", "fp32")
# Peaks a hardware file may record from its data sheet: the training precisions, fp8 (the
# GEMMs of FP8 training) and fp4, which no plan uses yet.
DATA_SHEET_PRECISIONS = PRECISIONS + ("fp8", "fp4")
# FP8 training recipes: bf16 mixed precision whose transformer-layer linear layers run
# their GEMMs in FP8 with dynamic scaling (torchao.float8's Float8Linear; Micikevicius et
# al. 2022, "FP8 Formats for Deep Learning": e4m3 weights and activations, e5m2 gradients).
# "tensorwise": one scale per tensor; "rowwise": one per row (torchao's recipes of those
# names); "blockwise": one per 1x128 tile of activations and gradients and per 128x128
# block of weights (DeepSeek-AI 2024 §3.3.1-3.3.2; Transformer Engine's Float8BlockScaling,
# Megatron-LM's --fp8-recipe blockwise); "mxfp8": OCP Microscaling (MX v1.0) FP8, one
# power-of-two (E8M0) scale per 32 values, which Blackwell's tensor cores take natively.
# Embedding, LM head, router, attention core and norms stay in bf16.
FP8_RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")
# What --precision takes: the training precisions, and "fp8" (tensorwise), "fp8-rowwise",
# "fp8-blockwise" and "mxfp8", bf16 with FP8 linear layers.
PRECISION_CHOICES = PRECISIONS + ("fp8", "fp8-rowwise", "fp8-blockwise", "mxfp8")
# Scale bytes a cast writes per value beside its 1-byte values: a float32 per 1x128 tile
# (blockwise), an E8M0 byte per 32 values (mxfp8); one per row or tensor is negligible.
FP8_SCALE_BYTES_PER_VALUE = {"blockwise": 4 / 128, "mxfp8": 1 / 32}
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
    fp32 master weights and optimizer states, "fp32" means everything in fp32. `fp8`: an
    FP8_RECIPES name when the layers' linear GEMMs run in FP8 (with precision bf16)."""

    global_batch: int
    seq_len: int
    precision: str = "bf16"
    optimizer: str = "adamw"
    flash_attention: bool = True
    mixed_precision: str = "autocast"
    fp8: str | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def split_precision(name: str) -> tuple[str, str | None]:
    """(precision, FP8 recipe) of a --precision name: "fp8" is bf16 with tensorwise FP8
    linear layers, "fp8-rowwise" with rowwise ones (and so on), "mxfp8" with MX ones; the
    others have no FP8 recipe."""
    if name == "fp8":
        return "bf16", "tensorwise"
    if name == "mxfp8":
        return "bf16", "mxfp8"
    if name.startswith("fp8-"):
        return "bf16", name.removeprefix("fp8-")
    return name, None


def precision_name(precision: str, fp8: str | None = None) -> str:
    """The --precision name of a precision and FP8 recipe (split_precision's inverse)."""
    if fp8 is None:
        return precision
    if fp8 == "mxfp8":
        return "mxfp8"
    return "fp8" if fp8 == "tensorwise" else f"fp8-{fp8}"
