"""Memory against PyTorch's own accounting: the cost model's peak memory per device
(`costmodel.estimate.estimate(...).memory`) beside what `torch.distributed._tools`
records for the same training step (forward, backward, AdamW step; fp32) of the same
model, run under FakeTensorMode with the in-process fake process group, so a 7B model
on 8 ranks needs neither a GPU nor memory.

Cases: the built-in Llama 2 7B and GPT-3 6.7B (executor.models, sharded by the
executor's own apply_fsdp / apply_tensor_parallel) and Llama 2 7B as transformers builds
it from tests/data/hf/llama-2-7b.json, each ZeRO-3 over 8 ranks (FSDPMemTracker) and
TP 8 (MemTracker). The second of two steps is measured (the first creates the optimizer
states), as the trackers' own tests do.

Kinds, tracker -> cost model: parameters (sharded params, buffers) -> weights;
gradients live at the peak -> gradients; optimizer states -> optimizer; activations
(tensors made in forward and kept) -> activations; temporaries (made in backward:
activation gradients, unsharded gradients, the loss's copies) -> temporaries; FSDP2's
unsharded parameters and all-gather / reduce-scatter buffers -> comm buffers. The cost
model's runtime reserve (CUDA context, allocator slack) is not a tensor and is left out.

    python bench/memory_tracker.py            # full models, seq 2048, prints and writes bench/results/
"""

from __future__ import annotations

import json
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from costmodel.estimate import estimate  # noqa: E402
from costmodel.problem import Problem  # noqa: E402
from costmodel.specs.loading import load_cluster, load_model, make_training  # noqa: E402
from costmodel.strategy import Strategy, even_stages  # noqa: E402
from costmodel.terms import memory  # noqa: E402
from costmodel.units import GIB  # noqa: E402
from executor.models import build_model, cross_entropy, materialize  # noqa: E402
from executor.parallelize import apply_fsdp, apply_tensor_parallel  # noqa: E402
from executor.train import TrainConfig, make_optimizer  # noqa: E402

WORLD = 8
HF_LLAMA = ROOT / "tests" / "data" / "hf" / "llama-2-7b.json"
KINDS = ("parameters", "gradients", "optimizer", "activations", "temporaries", "comm_buffers")


@dataclass(frozen=True)
class Case:
    name: str
    model: str        # a built-in name, or a Hugging Face config.json
    parallel: str     # "zero3" (dp 8) or "tp" (tp 8)

    @property
    def hf(self) -> bool:
        return self.model.endswith(".json")


CASES = (
    Case("llama2-7b zero3 dp8", "llama2-7b", "zero3"),
    Case("llama2-7b tp8", "llama2-7b", "tp"),
    Case("gpt3-6.7b zero3 dp8", "gpt3-6.7b", "zero3"),
    Case("gpt3-6.7b tp8", "gpt3-6.7b", "tp"),
    Case("hf llama-2-7b zero3 dp8", str(HF_LLAMA), "zero3"),
    Case("hf llama-2-7b tp8", str(HF_LLAMA), "tp"),
)

# Tracker reference types by the cost model's kinds (FSDPMemTracker's _FSDPRefType and
# MemTracker's _MemRefType values).
TRACKER_KINDS = {
    "parameters": ("Sharded Param", "Parameter", "Buffer"),
    "gradients": ("Sharded Grad", "Gradient"),
    "optimizer": ("OptState", "Optstate"),
    "activations": ("Activation", "Inputs"),
    "temporaries": ("Temp", "Unsharded Grad", "Other"),
    "comm_buffers": ("Unsharded Param", "All Gather", "Reduce Scatter"),
}


def ensure_fake_process_group() -> None:
    """The in-process fake backend: collectives return at once, with the right shapes."""
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)


def model_spec(case: Case, layers: int | None):
    overrides = {"num_hidden_layers": str(layers)} if layers else None
    return load_model(case.model, overrides=overrides)


def problem_and_strategy(case: Case, seq_len: int, layers: int | None) -> tuple[Problem, Strategy]:
    spec = model_spec(case, layers)
    cluster = load_cluster("dgx-h100", gpus=WORLD)
    dp, tp = (WORLD, 1) if case.parallel == "zero3" else (1, WORLD)
    # Flash attention as the model runs it: the executor calls SDPA (fused on CPU, the
    # s x s scores never stored); transformers is built with eager attention.
    training = make_training(spec, cluster, dp, seq_len, precision="fp32", optimizer="adamw",
                             flash_attention=not case.hf)
    strategy = Strategy(dp=dp, tp=tp, pp=1, micro_batch_size=1, num_microbatches=1,
                        zero_stage=3 if case.parallel == "zero3" else 0,
                        stages=even_stages(spec.num_hidden_layers, 1))
    return Problem(spec, cluster, training), strategy


def predicted(case: Case, seq_len: int, layers: int | None = None) -> dict[str, float]:
    """The cost model's breakdown of the peak, bytes by kind, and the model states whole."""
    problem, strategy = problem_and_strategy(case, seq_len, layers)
    mem = estimate(problem, strategy).memory
    out = {"parameters": mem.weights_bytes, "gradients": mem.gradients_bytes, "optimizer": mem.optimizer_bytes,
           "activations": mem.activations_bytes, "temporaries": mem.temporary_bytes,
           "comm_buffers": mem.comm_buffer_bytes}
    out["total"] = sum(out[k] for k in KINDS)
    return out


# ------------------------------------------------------------------ the tracked step
def _hf_module(case: Case, layers: int | None):
    from costmodel.specs.hf import build_hf_model
    data = json.loads(Path(case.model).read_text())
    if layers:
        data["num_hidden_layers"] = layers
    data.pop("torch_dtype", None)   # fp32 training: transformers builds in fp32 without it
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(data))
        model = build_hf_model(path)
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError(f"{case.model}: expected fp32 parameters")
    return model


def _shard_hf(model, case: Case, mesh) -> None:
    """The executor's layouts on transformers' module names: ZeRO-3 units per decoder
    layer, embedding and head; TP with q/k/v/gate/up column-wise, o/down row-wise, the
    embedding and head over the vocabulary."""
    inner = model.model
    if case.parallel == "zero3":
        for layer in inner.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(inner.embed_tokens, mesh=mesh)
        fully_shard([inner.norm, model.lm_head], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    for layer in inner.layers:
        parallelize_module(layer, mesh, plan)
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})


def _build(case: Case, seq_len: int, layers: int | None, mesh):
    """The model on the meta device, sharded as the executor shards it."""
    if case.hf:
        model = _hf_module(case, layers)
        _shard_hf(model, case, mesh)
        return model, lambda x: model(x, use_cache=False).logits
    spec = model_spec(case, layers)
    model = build_model(spec, seq_len)
    if case.parallel == "zero3":
        apply_fsdp(model, mesh, 3, set())
    else:
        model.untie()   # as the executor's trainer does under tp
        apply_tensor_parallel(model, mesh, sequence_parallel=False)
    return model, model


def _materialize(model, case: Case) -> None:
    """Fake CPU tensors in place of the meta ones (the executor's materialize)."""
    if case.hf:
        model.to_empty(device="cpu")
    else:
        materialize(model, "cpu")


def _kinds(snapshot: dict) -> dict[str, float]:
    """A tracker snapshot of the CPU device as bytes by the cost model's kinds."""
    (device_snapshot,) = snapshot.values()   # one device: cpu
    by_name = {getattr(k, "value", k): v for k, v in device_snapshot.items()}
    out = {kind: float(sum(by_name.get(name, 0) for name in names)) for kind, names in TRACKER_KINDS.items()}
    out["total"] = float(by_name["Total"])
    return out


def tracked(case: Case, seq_len: int, layers: int | None = None) -> dict:
    """Two training steps under the tracker; the peak (of the second, whose optimizer
    states exist from the start) by kind, and the model states after backward."""
    ensure_fake_process_group()
    mesh = init_device_mesh("cpu", (WORLD,))   # outside fake mode: the mesh holds real ranks
    hf_masks = nullcontext()
    if case.hf:
        import transformers

        from costmodel.specs.hf import _meta_masks
        hf_masks = _meta_masks(transformers)
    # Built and sharded on meta outside fake mode; allocated as fake CPU tensors inside.
    model, forward = _build(case, seq_len, layers, mesh)
    with FakeTensorMode(allow_non_fake_inputs=True), hf_masks:
        _materialize(model, case)
        optimizer = make_optimizer("adamw", model.parameters(), TrainConfig())
        vocab = model_spec(case, layers).vocab_size
        x = torch.randint(0, vocab, (1, seq_len))
        y = torch.randint(0, vocab, (1, seq_len))
        if case.parallel == "zero3":
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((x, y))
        else:
            tracker = MemTracker()
            tracker.track_external(model, optimizer, x, y)
        states = {}
        with tracker:
            for step in range(2):
                with loss_parallel() if case.parallel == "tp" else nullcontext():
                    loss = cross_entropy(forward(x), y)
                    loss.backward()
                shard_gradients_as_parameters(model)
                tracker.track_external(model)   # MemTracker: the new gradient tensors are gradients
                if step == 1:
                    states = _kinds(tracker.get_tracker_snapshot("current"))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if step == 0:
                    tracker.reset_mod_stats()
        peak = _kinds(tracker.get_tracker_snapshot("peak"))
    return {"peak": peak, "after_backward": states}


def shard_gradients_as_parameters(model) -> None:
    """What the executor's TrainStep.synchronize_gradients (executor/step.py) does before the optimizer: DTensor's
    embedding backward returns a replicated gradient of a vocabulary-sharded weight; keep
    this rank's rows (a local slice)."""
    for p in model.parameters():
        if isinstance(p, DTensor) and p.grad is not None and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def compare(case: Case, seq_len: int, layers: int | None = None) -> dict:
    """Tracker and cost model side by side for one case (bytes)."""
    measured = tracked(case, seq_len, layers)
    problem, strategy = problem_and_strategy(case, seq_len, layers)
    states = memory.sharded_state_bytes(sum_parameters(problem, strategy), problem.training,
                                        strategy.zero_stage, strategy.dp)
    return {"case": case.name, "seq_len": seq_len, "layers": problem.model.num_hidden_layers,
            "tracker": measured["peak"], "predicted": predicted(case, seq_len, layers),
            "states_after_backward": {
                "tracker": {k: measured["after_backward"][k] for k in ("parameters", "gradients", "optimizer")},
                "predicted": {"parameters": states[0], "gradients": states[1], "optimizer": states[2]}}}


def sum_parameters(problem: Problem, strategy: Strategy) -> float:
    """Parameters one rank holds before ZeRO sharding (after tp)."""
    from costmodel.terms.counts import (
        embedding_parameters,
        head_parameters,
        layer_parameters,
    )
    model = problem.model
    dense, experts = layer_parameters(model)
    head = head_parameters(model) + (model.vocab_size * model.hidden_size if model.tie_word_embeddings and strategy.tp > 1 else 0)
    return (model.num_hidden_layers * (dense + experts) + embedding_parameters(model) + head) / strategy.tp


def table(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        t, p = row["tracker"], row["predicted"]
        lines.append(f"{row['case']}  (seq {row['seq_len']}, {row['layers']} layers, micro-batch 1, fp32, AdamW)")
        lines.append(f"  {'kind':14s} {'tracker GiB':>12s} {'predicted GiB':>14s}")
        for kind in KINDS:
            lines.append(f"  {kind:14s} {t[kind] / GIB:12.2f} {p[kind] / GIB:14.2f}")
        error = p["total"] / t["total"] - 1
        lines.append(f"  {'peak total':14s} {t['total'] / GIB:12.2f} {p['total'] / GIB:14.2f}   error {100 * error:+.1f}%")
        g = row["states_after_backward"]
        lines.append(f"  {'grads (state)':14s} {g['tracker']['gradients'] / GIB:12.2f} "
                     f"{g['predicted']['gradients'] / GIB:14.2f}   all of them, after backward")
    return "\n".join(lines)


def main(seq_len: int = 2048) -> None:
    rows = []
    for case in CASES:
        rows.append(compare(case, seq_len))
        rows[-1]["error"] = rows[-1]["predicted"]["total"] / rows[-1]["tracker"]["total"] - 1
        print(table(rows[-1:]), flush=True)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "memory_tracker.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "memory_tracker.txt").write_text(table(rows) + "\n")


if __name__ == "__main__":
    main()
