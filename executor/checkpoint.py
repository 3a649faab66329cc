"""Checkpoints of a training run with torch.distributed.checkpoint (DCP): the model's
weights, the optimizer's states, the step (which is also the data position: the data
sources are functions of the step) and each rank's RNG states.

Every tensor is saved under the name it has in the unsplit model (`model.<name>`,
`optim.<name>.<state>`), as DCP's sharded DTensor or plain tensor, so a checkpoint
written under one plan loads under another (other dp, tp, pp, ZeRO stage): DCP reads
each rank's slice of each tensor from whichever files hold it. A tied embedding is
saved once, under the embedding's name, and loaded into the head's copy too.

A save never damages the last good checkpoint: ranks write into
`DIR/.step-00000042.partial`, then rank 0 writes `manifest.json` (the plan, the model
fingerprint, the step, a sha256 of every file) and renames the directory to
`DIR/step-00000042` in one atomic rename, and removes all but the newest `keep`.
Loading verifies the manifest and every checksum first and names the file that does not
match; directories without a manifest (a save killed halfway) are skipped with a
message. Nothing is unpickled: every saved value is a tensor, read with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.tensor import DTensor

from executor.models import canonical_name

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
PREFIX = "step-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file or field."""


@dataclass(frozen=True)
class Found:
    path: Path
    step: int
    manifest: dict


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def _partial_dir(root: Path, step: int) -> Path:
    return root / f".{PREFIX}{step:08d}.partial"


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading any non-tensor item with weights_only=True (the
    default planner unpickles it); Shardwise saves none."""

    def load_bytes(self, read_item, value) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


# -- what a rank holds ------------------------------------------------------------------

def _named_parameters(trainer) -> list[tuple[str, torch.nn.Parameter]]:
    """(name in the unsplit model, parameter) of this rank; the head's copy of a tied
    embedding answers to the embedding's name (saved once, loaded into both)."""
    out, seen = [], set()
    tied = trainer.spec.tie_word_embeddings
    for module in trainer.model.stages:
        for name, p in module.named_parameters():
            name = canonical_name(name)
            if tied and name == "output.weight":
                name = "tok_embeddings.weight"
            if name in seen:
                continue   # both copies here (tp): the embedding's stands for them
            seen.add(name)
            out.append((name, p))
    return out


def _optimizer_states(trainer) -> dict:
    """The optimizer's per-parameter states on this rank (ZeroRedundancyOptimizer:
    only its partition's), keyed by parameter."""
    inner = getattr(trainer.optimizer, "optim", trainer.optimizer)
    return inner.state


def _state_dict(trainer, step: int) -> dict[str, torch.Tensor]:
    states = _optimizer_states(trainer)
    out: dict[str, torch.Tensor] = {"step": torch.tensor(step, dtype=torch.int64)}
    for name, p in _named_parameters(trainer):
        out[f"model.{name}"] = p.detach()
        for key, value in states.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{name}.{key}"] = value
    rank = dist.get_rank()
    out[f"rng.{rank}.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        out[f"rng.{rank}.cuda"] = torch.cuda.get_rng_state()
    return out


# -- saving -----------------------------------------------------------------------------

class _WriterThatCalls(dcp.FileSystemWriter):
    """DCP's file writer that calls `after_write` once this rank's files are written
    (tests: a rank killed mid-save)."""

    def __init__(self, path: str, after_write: Callable[[], None]):
        super().__init__(path)
        self.after_write = after_write

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        self.after_write()
        return written


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save(trainer, step: int, root: str | Path, plan: dict, keep: int = 3, crash_after_write: bool = False,
         crash_mid_write: Callable[[], None] | None = None) -> Path:
    """Write the checkpoint of `step` (steps done) under `root`; every rank calls it.
    Tests only (executor.run's SHARDWISE_TEST_CRASH_AT): `crash_after_write` kills the
    process between the writes and the publish; `crash_mid_write` is called on this rank
    once its own files are written, before DCP gathers the ranks' results (the fault
    injection kills the process there)."""
    root = Path(root)
    partial, final = _partial_dir(root, step), step_dir(root, step)
    if dist.get_rank() == 0:
        if partial.exists():
            shutil.rmtree(partial)   # an earlier attempt at this step that did not finish
        partial.mkdir(parents=True)
    dist.barrier()
    writer = None if crash_mid_write is None else _WriterThatCalls(str(partial), crash_mid_write)
    dcp.save(_state_dict(trainer, step), checkpoint_id=str(partial), storage_writer=writer)
    dist.barrier()
    if crash_after_write:
        os._exit(9)
    if dist.get_rank() == 0:
        files = {f.name: _sha256(f) for f in sorted(partial.iterdir()) if f.is_file()}
        manifest = {"schema_version": MANIFEST_VERSION, "step": step, "model_fingerprint": plan["model_fingerprint"],
                    "plan": plan, "files": files}
        with open(partial / MANIFEST, "w") as f:
            json.dump(manifest, f, sort_keys=True, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)   # the publish: one rename
        for old in sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir())[:-keep]:
            shutil.rmtree(old)
    dist.barrier()
    return final


# -- finding and verifying ------------------------------------------------------------

def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except OSError:
        raise CheckpointError(f"{path / MANIFEST}: missing (a save that did not finish)") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path / MANIFEST}: not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("schema_version") != MANIFEST_VERSION:
        raise CheckpointError(f"{path / MANIFEST}: expected schema_version {MANIFEST_VERSION}")
    for key in ("step", "model_fingerprint", "plan", "files"):
        if key not in manifest:
            raise CheckpointError(f"{path / MANIFEST}: {key} missing")
    return manifest


def verify(path: str | Path) -> dict:
    """The manifest of a checkpoint whose files all match their checksums; otherwise
    CheckpointError naming the first file that does not."""
    path = Path(path)
    manifest = read_manifest(path)
    listed = manifest["files"]
    for name, digest in sorted(listed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing from the checkpoint")
        if _sha256(file) != digest:
            raise CheckpointError(f"{file}: checksum does not match the manifest (altered or damaged)")
    extra = sorted(f.name for f in path.iterdir() if f.is_file() and f.name not in listed and f.name != MANIFEST)
    if extra:
        raise CheckpointError(f"{path / extra[0]}: not in the manifest")
    return manifest


def latest(root: str | Path, log=print) -> Found | None:
    """The newest complete checkpoint under `root` (or `root` itself when it is one);
    incomplete saves are skipped, saying so."""
    root = Path(root)
    if (root / MANIFEST).is_file():
        manifest = read_manifest(root)
        return Found(root, int(manifest["step"]), manifest)
    if not root.is_dir():
        return None
    for partial in sorted(root.glob(f".{PREFIX}*.partial")):
        log(f"checkpoint: ignoring {partial}: a save that did not finish")
    for path in sorted((p for p in root.glob(f"{PREFIX}*") if p.is_dir()), reverse=True):
        if not (path / MANIFEST).is_file():
            log(f"checkpoint: ignoring {path}: no manifest")
            continue
        manifest = read_manifest(path)
        return Found(path, int(manifest["step"]), manifest)
    return None


# -- loading ----------------------------------------------------------------------------

def load(trainer, path: str | Path, plan: dict) -> int:
    """Load a verified checkpoint into this rank's trainer (written under any plan of
    the same model); the step it was taken after."""
    path = Path(path)
    manifest = verify(path)
    if manifest["model_fingerprint"] != plan["model_fingerprint"]:
        raise CheckpointError(f"{path / MANIFEST}: written for another model "
                              f"({manifest['plan']['model'].get('name')}, {manifest['model_fingerprint'][:19]})")
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    params = _named_parameters(trainer)
    wanted: dict[str, torch.Tensor] = {"step": torch.zeros((), dtype=torch.int64)}
    optimizer_targets: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    owned = _owned_by_optimizer(trainer)
    for name, p in params:
        if f"model.{name}" not in saved:
            raise CheckpointError(f"{path}: holds no model.{name}")
        wanted[f"model.{name}"] = p.detach()
        if p not in owned:
            continue
        for key in sorted(k.rsplit(".", 1)[1] for k in saved if k.startswith(f"optim.{name}.")
                          and k.count(".") == name.count(".") + 2):
            target = torch.zeros((), dtype=torch.float32) if key == "step" else torch.zeros_like(p.detach())
            optimizer_targets.setdefault(p, {})[key] = target
            wanted[f"optim.{name}.{key}"] = target
    rank = dist.get_rank()
    same_world = manifest["plan"]["strategy"] == plan["strategy"]
    if same_world and f"rng.{rank}.cpu" in saved:
        wanted[f"rng.{rank}.cpu"] = torch.get_rng_state()
    with torch.no_grad():
        dcp.load(wanted, checkpoint_id=str(path), planner=TensorsOnlyLoadPlanner())
    states = _optimizer_states(trainer)
    for p, values in optimizer_targets.items():
        states[p] = values
    _copy_tied_head(trainer)
    if f"rng.{rank}.cpu" in wanted:
        torch.set_rng_state(wanted[f"rng.{rank}.cpu"])
    step = int(wanted["step"])
    _set_schedule_step(trainer, step)
    return step


def _owned_by_optimizer(trainer) -> set:
    inner = getattr(trainer.optimizer, "optim", trainer.optimizer)
    return {p for group in inner.param_groups for p in group["params"]}


def _copy_tied_head(trainer) -> None:
    """Both copies of a tied embedding on this rank (tp): the head takes the embedding's
    weights and optimizer states (its copy was saved under the embedding's name)."""
    if not trainer.spec.tie_word_embeddings:
        return
    states = _optimizer_states(trainer)
    for module in trainer.model.stages:
        if module.tok_embeddings is None or module.output is None:
            continue
        head, embedding = module.output.weight, module.tok_embeddings.weight
        if head is embedding:
            continue
        with torch.no_grad():
            _local(head).copy_(_local(embedding))
        if embedding in states:
            states[head] = {k: v.clone() for k, v in states[embedding].items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _set_schedule_step(trainer, step: int) -> None:
    """The learning-rate schedule as it stands after `step` steps (LambdaLR's closed form)."""
    scheduler = trainer.scheduler
    scheduler.last_epoch = step
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
