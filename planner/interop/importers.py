"""Reading a training engine's configuration as a Shardwise Strategy, by engine:
torchtitan's command-line overrides or job TOML (`interop.torchtitan`), Megatron-LM's
command-line arguments (`interop.megatron`), a DeepSpeed config JSON (`interop.deepspeed`),
quoted on the command line or in a file. Each reader returns the strategy
with its stages, the batch, sequence and precision the config states, and warnings for
what it had to assume; a config that is malformed or contradicts itself, the model or the
cluster raises SpecError naming the engine's own field (exit code 2).

The engine modules own what each option means and cite the engine source it comes
from; files are read with tomllib and json only.
"""

from __future__ import annotations

from costmodel.specs import ModelSpec
from costmodel.specs.loading import SpecError, path_kind
from planner.interop.common import Imported, read_file
from planner.interop.deepspeed import read_deepspeed
from planner.interop.megatron import read_megatron
from planner.interop.torchtitan import read_torchtitan

SOURCES = ("torchtitan", "megatron", "deepspeed")


# ---------------------------------------------------------------------------
# The engines' stage partitions


# ---------------------------------------------------------------------------
# torchtitan


# ---------------------------------------------------------------------------
# Megatron-LM


# ---------------------------------------------------------------------------
# DeepSpeed


def read_text(target: str, text: str, model: ModelSpec, num_gpus: int) -> Imported:
    """Read a configuration's text; `target` is one of planner.interop.export.TARGETS."""
    if target in ("torchtitan", "torchtitan-toml"):
        return read_torchtitan(text, model, num_gpus, toml=target == "torchtitan-toml")
    if target == "megatron":
        return read_megatron(text, model, num_gpus)
    if target == "deepspeed":
        return read_deepspeed(text, model, num_gpus)
    raise SpecError("--from", f"unknown engine {target!r} (known: {', '.join(SOURCES)})")


def read_config(source_kind: str, source: str, model: ModelSpec, num_gpus: int,
                global_batch: int | None = None) -> Imported:
    """Read what a user runs: `source` is torchtitan overrides or a job TOML path,
    Megatron-LM arguments (or a file holding them), or a DeepSpeed JSON path.
    `global_batch` fills in what torchtitan overrides leave out."""
    if source_kind == "torchtitan":
        if source.endswith(".toml"):
            return read_torchtitan(read_file(source, "TOML"), model, num_gpus, toml=True)
        return read_torchtitan(source, model, num_gpus, global_batch=global_batch)
    if source_kind == "megatron":
        is_file = not source.lstrip().startswith("-") and path_kind(source) == "file"
        return read_megatron(read_file(source, "text") if is_file else source, model, num_gpus)
    if source_kind == "deepspeed":
        return read_deepspeed(read_file(source, "JSON"), model, num_gpus)
    raise SpecError("--from", f"unknown engine {source_kind!r} (known: {', '.join(SOURCES)})")
