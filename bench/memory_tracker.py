"""Memory against PyTorch's own accounting: the cost model's peak memory per device
(`costmodel.estimate.estimate(...).memory`) beside what `torch.distributed._tools`
records for the same training step (forward, backward, AdamW step) of the same model,
run under FakeTensorMode with the in-process fake process group, so a 7B model on 8
ranks needs neither a GPU nor memory.

fp32 cases: the built-in Llama 2 7B and GPT-3 6.7B (executor.models, sharded by the
executor's own apply_fsdp / apply_tensor_parallel) and Llama 2 7B as transformers builds
it from tests/data/hf/llama-2-7b.json, each ZeRO-3 over 8 ranks (FSDPMemTracker) and
TP 8 (MemTracker), seq 2048.

bf16 cases (BF16_CASES), what users run: published Hugging Face configs
(tests/data/hf: Llama 2 7B, Mistral 7B, Llama 3 8B, Qwen2 7B, Gemma 2B, Qwen3 1.7B,
Llama 3.2 1B, Phi-2, Pythia 1.4B) under FSDP2 over 8 with MixedPrecisionPolicy(
param_dtype=bf16, reduce_dtype=fp32) as torchtitan runs it (SDPA attention, fp32
master weights, AdamW), and the executor's own Llama 3 8B as the executor runs it
(fp32 weights under torch.autocast(bf16, cache_enabled=False), executor/step.py)
under ZeRO-3 over 8 and TP 8; seq 2048-8192, micro-batch 1. The second of two steps
is measured (the first creates the optimizer states), as the trackers' own tests do.
The H200 runs of our executor (shared/reference/h200/executor_runs.json) are printed
beside their estimates too.

Known differences between the tracker and a GPU, left in the figures:
- TP under loss_parallel: DTensor's nll_loss backward handler propagates tensor metadata
  by running the op on fake tensors of the global shape (torch/distributed/tensor/
  parallel/loss.py, _propagate_tensor_meta); under FakeTensorMode the tracker counts
  them as memory: two fp32 tensors of tokens x the whole vocabulary (7.83 GiB for
  Llama-3-8B at seq 8192), which no GPU allocates (LOSS_PARALLEL_META_BYTES).
- Phi-2: SDPA's output is head-major on CPU after the partial rotary's cat, so its
  transpose-reshape is a copy (2 bytes per s*h per layer, not counted: CUDA's flash
  kernels write it token-major); dropout masks are bf16 on CPU (bool on CUDA; counted
  at 2 bytes).

Kinds, tracker -> cost model: parameters (sharded params, buffers) -> weights;
gradients live at the peak -> gradients; optimizer states -> optimizer; activations
(tensors made in forward and kept) -> activations; temporaries (made in backward:
activation gradients, unsharded gradients, the loss's copies) -> temporaries; FSDP2's
unsharded parameters and all-gather / reduce-scatter buffers -> comm buffers. The cost
model's runtime reserve (CUDA context, allocator slack) is not a tensor and is left out.

    python bench/memory_tracker.py            # all cases, prints and writes bench/results/
    python bench/memory_tracker.py bf16       # the bf16 cases and the H200 runs only
    python bench/memory_tracker.py saved      # bytes per s*h one layer saves, by family
"""

from __future__ import annotations

import json
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
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
from costmodel.specs.loading import load_cluster, load_model, load_runtime, make_training  # noqa: E402
from costmodel.strategy import Strategy, even_stages  # noqa: E402
from costmodel.terms import memory  # noqa: E402
from costmodel.units import GIB  # noqa: E402
from executor.models import build_model, cross_entropy, materialize, op_level_context  # noqa: E402
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
    precision: str = "fp32"
    seq_len: int | None = None   # None: the run's (main's) sequence length
    micro_batch_size: int = 1
    recompute: str = "none"      # "selective": op-level (torchtitan's per-op SAC), every layer

    @property
    def hf(self) -> bool:
        return self.model.endswith(".json")

    @property
    def mixed_precision(self) -> str:
        """Hugging Face models under FSDP2's MixedPrecisionPolicy, the executor under autocast."""
        return "param_dtype" if self.hf else "autocast"


CASES = (
    Case("llama2-7b zero3 dp8", "llama2-7b", "zero3"),
    Case("llama2-7b tp8", "llama2-7b", "tp"),
    Case("gpt3-6.7b zero3 dp8", "gpt3-6.7b", "zero3"),
    Case("gpt3-6.7b tp8", "gpt3-6.7b", "tp"),
    Case("hf llama-2-7b zero3 dp8", str(HF_LLAMA), "zero3"),
    Case("hf llama-2-7b tp8", str(HF_LLAMA), "tp"),
)


def _hf(name: str) -> str:
    return str(ROOT / "tests" / "data" / "hf" / f"{name}.json")


BF16_CASES = (
    Case("Llama-2-7B fsdp8 bf16", _hf("llama-2-7b"), "zero3", "bf16", 4096),
    Case("Mistral-7B fsdp8 bf16", _hf("mistral-7b"), "zero3", "bf16", 4096),
    Case("Llama-3-8B fsdp8 bf16", _hf("llama-3-8b"), "zero3", "bf16", 8192),
    Case("Qwen2-7B fsdp8 bf16", _hf("qwen2-7b"), "zero3", "bf16", 4096),
    Case("Gemma-2B fsdp8 bf16", _hf("gemma-2b"), "zero3", "bf16", 8192),
    Case("Qwen3-1.7B fsdp8 bf16", _hf("qwen3-1.7b"), "zero3", "bf16", 4096),
    Case("Llama-3.2-1B fsdp8 bf16", _hf("llama-3.2-1b"), "zero3", "bf16", 2048),
    Case("Phi-2 fsdp8 bf16", _hf("phi-2"), "zero3", "bf16", 2048),
    Case("Pythia-1.4B fsdp8 bf16", _hf("pythia-1.4b"), "zero3", "bf16", 2048),
    Case("executor llama3-8b zero3 dp8 autocast", "llama3-8b", "zero3", "bf16", 4096),
    Case("executor llama3-8b tp8 autocast", "llama3-8b", "tp", "bf16", 8192),
    # torchtitan's Llama 3.1 8B rows (torchtitan_h100_runs.json: FSDP 8, local batch 2,
    # seq 8192, per-op SAC), as transformers builds the model and as the executor runs it.
    Case("Llama-3-8B fsdp8 bf16 mbs2 op-SAC", _hf("llama-3-8b"), "zero3", "bf16", 8192, 2, "selective"),
    Case("executor llama3-8b zero3 dp8 autocast op-SAC", "llama3-8b", "zero3", "bf16", 4096, 2, "selective"),
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
    # bf16 Hugging Face models run SDPA (flash attention); fp32 ones eager.
    training = make_training(spec, cluster, dp * case.micro_batch_size, seq_len, precision=case.precision,
                             optimizer="adamw",
                             flash_attention=not case.hf or case.precision != "fp32",
                             mixed_precision=case.mixed_precision)
    strategy = Strategy(dp=dp, tp=tp, pp=1, micro_batch_size=case.micro_batch_size, num_microbatches=1,
                        zero_stage=3 if case.parallel == "zero3" else 0, recompute=case.recompute,
                        stages=even_stages(spec.num_hidden_layers, 1, recompute=case.recompute))
    # Hugging Face models train on F.cross_entropy over upcast logits (their own loss);
    # the executor's models on its chunked cross-entropy.
    runtime = replace(load_runtime(), chunked_loss=not case.hf)
    return Problem(spec, cluster, training, runtime=runtime), strategy


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
    data.pop("torch_dtype", None)   # fp32 master weights: transformers builds in fp32 without it
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(data))
        model = build_hf_model(path)
    if case.precision != "fp32":
        model.config._attn_implementation = "sdpa"   # what bf16 training runs
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError(f"{case.model}: expected fp32 parameters")
    return model


def _shard_hf(model, case: Case, mesh) -> None:
    """The executor's layouts on transformers' module names: ZeRO-3 units per decoder
    layer, embedding and head; TP with q/k/v/gate/up column-wise, o/down row-wise, the
    embedding and head over the vocabulary."""
    inner = getattr(model, "model", None) or model.gpt_neox
    if case.parallel == "zero3":
        # bf16: FSDP2's MixedPrecisionPolicy as torchtitan sets it.
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if case.precision != "fp32" else MixedPrecisionPolicy())
        layers = getattr(inner, "layers", None)
        embed = getattr(inner, "embed_tokens", None) or getattr(inner, "embed_in", None)
        norm = getattr(inner, "norm", None) or getattr(inner, "final_layernorm", None) or getattr(inner, "final_layer_norm", None)
        head = getattr(model, "lm_head", None) or getattr(model, "embed_out", None)
        for i, layer in enumerate(layers):
            if case.recompute == "selective":
                # torchtitan wraps each block so (distributed/activation_checkpoint.py).
                layer = layers[i] = checkpoint_wrapper(layer, context_fn=op_level_context)
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        if not model.config.tie_word_embeddings:
            fully_shard(embed, mesh=mesh, mp_policy=mp)
            fully_shard([norm, head], mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
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
        return model, lambda x: model(x, use_cache=False).logits.float()   # transformers' loss upcasts

    spec = model_spec(case, layers)
    model = build_model(spec, seq_len)
    for layer in model.layers.values():
        layer.set_recompute(case.recompute)
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
        x = torch.randint(0, vocab, (case.micro_batch_size, seq_len))
        y = torch.randint(0, vocab, (case.micro_batch_size, seq_len))
        if case.parallel == "zero3":
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((x, y))
        else:
            tracker = MemTracker()
            tracker.track_external(model, optimizer, x, y)
        states = {}
        # The executor's mixed precision (executor/step.py TrainStep.autocast).
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
                    if case.precision != "fp32" and not case.hf else nullcontext())
        with tracker:
            for step in range(2):
                with loss_parallel() if case.parallel == "tp" else nullcontext(), autocast:
                    logits = forward(x)
                    # F.cross_entropy as transformers' loss and the executor's own for its models
                    loss = (F.cross_entropy(logits.flatten(0, 1), y.flatten()) if case.hf
                            else cross_entropy(logits, y))
                    del logits
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
    return {"case": case.name, "seq_len": seq_len, "micro_batch_size": case.micro_batch_size,
            "recompute": case.recompute, "layers": problem.model.num_hidden_layers,
            "precision": case.precision if case.precision == "fp32" else f"{case.precision} {case.mixed_precision}",
            "vocab_size": problem.model.vocab_size,
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
        lines.append(f"{row['case']}  (seq {row['seq_len']}, {row['layers']} layers, "
                     f"micro-batch {row.get('micro_batch_size', 1)}, "
                     f"{row.get('precision', 'fp32')}, AdamW)")
        lines.append(f"  {'kind':14s} {'tracker GiB':>12s} {'predicted GiB':>14s}")
        for kind in KINDS:
            lines.append(f"  {kind:14s} {t[kind] / GIB:12.2f} {p[kind] / GIB:14.2f}")
        error = p["total"] / t["total"] - 1
        lines.append(f"  {'peak total':14s} {t['total'] / GIB:12.2f} {p['total'] / GIB:14.2f}   error {100 * error:+.1f}%")
        g = row["states_after_backward"]
        lines.append(f"  {'grads (state)':14s} {g['tracker']['gradients'] / GIB:12.2f} "
                     f"{g['predicted']['gradients'] / GIB:14.2f}   all of them, after backward")
    return "\n".join(lines)


def loss_parallel_meta_bytes(row: dict) -> float:
    """What the tracker counts of loss_parallel's metadata propagation at the global
    shape (two fp32 tensors of tokens x vocabulary), for a TP row; 0 otherwise."""
    if "tp8" not in row["case"] or not row.get("vocab_size"):
        return 0.0
    return 2 * 4.0 * row["seq_len"] * row["vocab_size"]


def summary(rows: list[dict]) -> str:
    lines = [f"{'case':40s} {'seq':>5s} {'tracker GiB':>12s} {'estimate GiB':>13s} {'error':>7s}"]
    for row in rows:
        t, p = row["tracker"]["total"], row["predicted"]["total"]
        line = f"{row['case']:40s} {row['seq_len']:5d} {t / GIB:12.2f} {p / GIB:13.2f} {100 * (p / t - 1):+6.1f}%"
        meta = loss_parallel_meta_bytes(row) if row.get("precision", "fp32") != "fp32" else 0.0
        if meta:
            line += (f"   (tracker less loss_parallel's global-shape meta tensors, {meta / GIB:.2f} GiB: "
                     f"{(t - meta) / GIB:.2f}, {100 * (p / (t - meta) - 1):+.1f}%)")
        lines.append(line)
    return "\n".join(lines)


H200_RUNS = ROOT.parent / "shared" / "reference" / "h200" / "executor_runs.json"


def h200_check(path: Path = H200_RUNS) -> list[dict]:
    """The executor's real H200 runs (bf16 autocast, eager, SDPA) beside the estimate of
    the same plan: peak memory allocated (the estimate without its runtime reserve,
    which torch.cuda.max_memory_allocated does not count), and the run that ran out of
    memory, which the estimate must refuse (above the GPU's memory)."""
    from costmodel.specs.loading import parse_overrides
    if not path.exists():
        return []
    out = []
    for run in json.loads(path.read_text())["runs"]:
        words = run["request"].split(": ", 1)[1].split()
        overrides = parse_overrides(words[words.index("--set") + 1]) if "--set" in words else None
        spec = load_model(words[0], overrides)
        cluster = load_cluster("dgx-h200", gpus=1)
        training = make_training(spec, cluster, int(words[words.index("--global-batch") + 1]),
                                 int(words[words.index("--seq") + 1]), precision="bf16")
        s = run["strategy"]
        strategy = Strategy(dp=1, tp=1, pp=1, micro_batch_size=s["micro_batch_size"],
                            num_microbatches=s["num_microbatches"], zero_stage=0,
                            stages=even_stages(spec.num_hidden_layers, 1, recompute=s["recompute"]))
        # measured before the executor's chunked cross-entropy (main at 613d290)
        runtime = replace(load_runtime(), chunked_loss=False)
        mem = estimate(Problem(spec, cluster, training, runtime=runtime), strategy).memory
        allocated = mem.total_bytes - mem.runtime_reserve_bytes
        measured = run.get("measured_peak_memory_allocated_bytes")
        out.append({"request": run["request"], "estimate_bytes": allocated, "measured_bytes": measured,
                    "gpu_bytes": cluster.gpu.memory_bytes, "outcome": run.get("outcome", "ran")})
    return out


def h200_table(rows: list[dict]) -> str:
    lines = [f"{'H200 run (executor, bf16 autocast)':62s} {'measured GiB':>12s} {'estimate GiB':>13s} {'error':>7s}"]
    for r in rows:
        est = r["estimate_bytes"] / GIB
        if r["measured_bytes"]:
            lines.append(f"{r['request'][:62]:62s} {r['measured_bytes'] / GIB:12.2f} {est:13.2f} "
                         f"{100 * (r['estimate_bytes'] / r['measured_bytes'] - 1):+6.1f}%")
        else:
            verdict = "refused" if r["estimate_bytes"] > r["gpu_bytes"] else "NOT refused"
            lines.append(f"{r['request'][:62]:62s} {'OOM':>12s} {est:13.2f}   {verdict} "
                         f"(GPU {r['gpu_bytes'] / GIB:.1f} GiB)")
    return "\n".join(lines)


SAVED_CASES = (
    ("llama-2-7b", "param_dtype"), ("llama-3-8b", "param_dtype"), ("mistral-7b", "param_dtype"),
    ("qwen3-1.7b", "param_dtype"), ("gemma-2b", "param_dtype"), ("phi-2", "param_dtype"),
    ("pythia-1.4b", "param_dtype"), ("deepseek-v3", "param_dtype"), ("llama2-7b", "autocast"),
    ("llama3-8b", "autocast"),
)


def saved_bytes_per_layer(name: str, mixed_precision: str, seq_len: int = 1024) -> tuple[float, float]:
    """(measured, estimated) bytes per s*h that one layer keeps for backward in bf16:
    every tensor torch.autograd.graph.saved_tensors_hooks sees in a forward of 2 layers
    less 1 layer, one count per storage, parameters and buffers left out; a Hugging
    Face config in bf16 weights (param_dtype) or a built-in model under autocast, the
    bf16 weight copies of autocast left out of both figures."""
    from costmodel.specs.hf import _meta_masks, build_hf_model
    from costmodel.terms.counts import attention_parameters, expert_parameters
    from costmodel.terms.memory import pytorch_layer_activation_bytes

    spec = load_model(_hf(name) if mixed_precision == "param_dtype" else name)

    def saved(layers: int):
        if mixed_precision == "param_dtype":
            import transformers
            data = json.loads(Path(_hf(name)).read_text())
            data["num_hidden_layers"] = layers
            data.pop("torch_dtype", None)
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / "config.json"
                path.write_text(json.dumps(data))
                torch.set_default_dtype(torch.bfloat16)
                try:
                    model = build_hf_model(path)
                finally:
                    torch.set_default_dtype(torch.float32)
            model.config._attn_implementation = "sdpa"
            context, masks = nullcontext(), _meta_masks(transformers)
        else:
            model = build_model(load_model(name, {"num_hidden_layers": str(layers)}), seq_len)
            context, masks = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), nullcontext()
        seen: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            # CPU SDPA runs multi-head latent attention's 192-wide keys and 128-wide values
            # on its math path, keeping fp32 copies and probabilities a CUDA kernel does
            # not: left out here, and the kernel's own tensors out of the estimate below.
            if not (spec.is_mla and t.dtype == torch.float32 and spec.num_attention_heads in t.shape[:2]):
                seen[storage._cdata] = storage.nbytes()
            return t
        with FakeTensorMode(allow_non_fake_inputs=True), masks:
            model.to_empty(device="cpu")
            own = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
            with context, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = model(torch.zeros(1, seq_len, dtype=torch.long))
                del out
        return sum(n for k, n in seen.items() if k not in own)

    one, two = saved(1), saved(2)
    # The second layer measured is of the first kind (DeepSeek-V3: a dense-MLP layer).
    spec = spec.dense_layer() if 1 in spec.mlp_only_layers else spec
    cluster = load_cluster("dgx-h100", gpus=1)
    training = make_training(spec, cluster, 1, seq_len, precision="bf16", mixed_precision=mixed_precision)
    estimated = pytorch_layer_activation_bytes(spec, training, 1, 1, False, "none")
    if spec.is_mla:   # SDPA's q, k, v and log-sum-exp (its output is the output projection's input)
        estimated -= (2.0 * (2 * spec.q_size + spec.out_size) + 4.0 * spec.num_attention_heads) * seq_len
    copies = 2.0 * (attention_parameters(spec) + expert_parameters(spec)) if mixed_precision == "autocast" else 0.0
    sh = seq_len * spec.hidden_size
    return (two - one - copies) / sh, (estimated - copies) / sh


def saved_table(seq_len: int = 1024) -> str:
    lines = [f"bytes per s*h one layer saves (bf16, seq {seq_len}, micro-batch 1)",
             f"{'model':14s} {'precision':12s} {'measured':>9s} {'estimated':>10s}"]
    for name, mixed in SAVED_CASES:
        measured, estimated = saved_bytes_per_layer(name, mixed, seq_len)
        lines.append(f"{name:14s} {mixed:12s} {measured:9.3f} {estimated:10.3f}")
    return "\n".join(lines)


def main(which: str = "all") -> None:
    if which == "saved":
        print(saved_table())
        return
    cases = (CASES if which in ("all", "fp32") else ()) + (BF16_CASES if which in ("all", "bf16") else ())
    if which == "sac":
        cases = tuple(c for c in BF16_CASES if c.recompute == "selective")
    rows = []
    for case in cases:
        rows.append(compare(case, case.seq_len or 2048))
        rows[-1]["error"] = rows[-1]["predicted"]["total"] / rows[-1]["tracker"]["total"] - 1
        print(table(rows[-1:]), flush=True)
    h200 = h200_check()
    text = summary(rows) + "\n\n" + h200_table(h200)
    print("\n" + text)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    suffix = "" if which == "all" else f"_{which}"
    (out / f"memory_tracker{suffix}.json").write_text(json.dumps({"cases": rows, "h200": h200}, indent=2) + "\n")
    (out / f"memory_tracker{suffix}.txt").write_text(table(rows) + "\n\n" + text + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:2])
