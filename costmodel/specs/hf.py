"""Hugging Face models without weights: a `config.json` (or a folder holding one) built
with `transformers` on the meta device, and traced into a layer graph. transformers is
an optional extra (`pip install 'shardwise[hf]'`); nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import networkx as nx
import torch
from torch import nn

from costmodel.specs.loading import SpecError, hf_text_config, path_kind
from costmodel.trace import trace_module


def config_file(source: str | Path) -> Path:
    path = Path(source)
    if path_kind(path) == "dir":
        path = path / "config.json"
    if path_kind(path) != "file":
        raise SpecError("--model", f"no Hugging Face config.json at {source}")
    return path


def _transformers():
    try:
        import transformers
    except ImportError:
        raise SpecError("--model", "Hugging Face models need transformers: pip install 'shardwise[hf]'") from None
    return transformers


@contextlib.contextmanager
def _meta_masks(transformers):
    """transformers 5 inspects position ids with .item() to find packed sequences, which
    meta tensors cannot answer; our inputs are never packed."""
    masking = getattr(transformers, "masking_utils", None)
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is not None:
        masking.find_packed_sequence_indices = lambda *args, **kwargs: None
    try:
        yield
    finally:
        if original is not None:
            masking.find_packed_sequence_indices = original


def build_hf_model(source: str | Path) -> nn.Module:
    """The causal-LM of a config.json on the meta device, with eager attention (its
    score matrix is counted by FlopCounterMode)."""
    transformers = _transformers()
    data = hf_text_config(json.loads(config_file(source).read_text()))   # Llama 4: its text model
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise SpecError("model.model_type", "missing from the Hugging Face config")
    try:
        config = transformers.AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as err:
        raise SpecError("model.model_type", f"transformers does not know {model_type!r}: {err}") from None
    config.use_cache = False
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def check_spec(source: str | Path, spec) -> None:
    """Refuse a config whose model transformers builds differently from the spec the
    cost model reads out of it (a family the gpt / llama / mixtral specs do not cover)."""
    from costmodel.terms.counts import total_parameters

    built = sum(p.numel() for p in build_hf_model(source).parameters())
    if built != total_parameters(spec):
        raise SpecError("--model", f"transformers builds {built:,} parameters from {source}, the "
                                   f"{spec.model_type} spec read from it has {total_parameters(spec):,}: "
                                   f"an architecture Shardwise does not model yet")


def trace_hf(source: str | Path, seq_len: int, batch: int = 1) -> nx.DiGraph:
    """Layer graph of a Hugging Face model for `batch` sequences of `seq_len` tokens."""
    transformers = _transformers()
    model = build_hf_model(source)
    tokens = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    with _meta_masks(transformers):
        return trace_module(model, (tokens,), loss_fn=lambda out: out.logits.float().sum(),
                            example_kwargs={"use_cache": False})
