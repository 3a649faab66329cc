"""What `shardwise profile` measures on this machine: GEMM throughput over the shapes a
model's layers ask for, the bandwidth of elementwise passes, collectives (all-reduce,
all-gather, reduce-scatter, all-to-all, send/recv) over message sizes across `nproc`
local processes, and, given a model, the forward and backward seconds of its layer
kinds (transformer layer, embedding, LM head with the loss) as the TP shard one rank
runs, over micro-batch sizes and TP widths, and on CPU ranks the host time DTensor TP and
FSDP2 add to a layer (measure_host_overheads). The result is a versioned JSON profile
keyed by device, operation, shape and dtype; costmodel.calibrate fits it into a cluster
spec and costmodel.measured reads the layer times for `shardwise plan --profile`.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from costmodel.measured import (
    LAYER_KINDS,
    PROFILE_SCHEMA_VERSION,
    layer_key,
    model_dims,
)
from costmodel.specs import ModelSpec
from executor.launch import run_local
from executor.models import INIT_STD, MLP, Block, RMSNorm, rope_tables

GEMM_SHAPES = [(m, n, k) for m in (16, 64, 256, 1024, 4096) for n, k in ((256, 256), (1024, 1024), (4096, 1024))]
ELEMENTWISE_BYTES = [1 << 22, 1 << 24, 1 << 26]
COLLECTIVE_BYTES = [1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24]
QUICK_COLLECTIVE_BYTES = [1 << 16, 1 << 20, 1 << 22]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The roofline sweep: a rate that changes by less than this between two sizes has settled.
ROOFLINE_SETTLED = 0.03
MAX_ROOFLINE_DIM = 16384          # 16384^3 in bf16: 8.8 TFLOP, ~11 ms on an H200
MAX_ROOFLINE_BYTES = 1 << 30
# Longest single call the sweep grows to (quick: for tests).
ROOFLINE_SECONDS, QUICK_ROOFLINE_SECONDS = 0.5, 0.05


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_s(fn, device: torch.device, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_gemm(device: torch.device, dtype: torch.dtype, shapes=GEMM_SHAPES, reps: int = 5) -> list[dict]:
    out = []
    for m, n, k in shapes:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        out.append({"m": m, "n": n, "k": k, "seconds": _best_s(lambda: a @ b, device, reps)})
    return out


def measure_roofline(device: torch.device, dtype: torch.dtype, reps: int, max_seconds: float) -> tuple[list, list, dict]:
    """Square GEMMs (side doubled) and elementwise passes (size x4), each grown until its
    rate settles (changes by less than ROOFLINE_SETTLED between two sizes) or the next
    call would take longer than `max_seconds`: the small shapes a layer asks for never
    reach a chip's peak (on an H200 a 4096 x 256 x 256 GEMM runs at a third of it, a
    4 MiB copy at an eighth of its bandwidth), and a fitted spec must rest on
    measurements that did. Returns the GEMM points, the elementwise points and whether
    each settled."""
    gemm, settled_gemm = _grow_until_settled(
        lambda dim: measure_gemm(device, dtype, [(dim, dim, dim)], reps)[0], 256, MAX_ROOFLINE_DIM, 2, 8,
        lambda p: 2 * p["m"] * p["n"] * p["k"] / p["seconds"], max_seconds)
    elementwise, settled_bandwidth = _grow_until_settled(
        lambda size: measure_elementwise(device, dtype, [size], reps)[0], ELEMENTWISE_BYTES[0], MAX_ROOFLINE_BYTES, 4,
        4, lambda p: p["bytes"] / p["seconds"], max_seconds)
    return gemm, elementwise, {"gemm_settled": settled_gemm, "bandwidth_settled": settled_bandwidth}


def _grow_until_settled(measure, first: int, last: int, growth: int, work_growth: int, rate,
                        max_seconds: float) -> tuple[list, bool]:
    """Points measure(size) for size = first, first x growth, ... up to `last`, until
    two in a row differ in rate by less than ROOFLINE_SETTLED (True) or the next size,
    `work_growth` times the work (8 for a square GEMM's doubled side), would take longer
    than `max_seconds` (False)."""
    points, size = [], first
    while size <= last:
        points.append(measure(size))
        if len(points) > 1 and abs(rate(points[-1]) / rate(points[-2]) - 1) < ROOFLINE_SETTLED:
            return points, True
        if points[-1]["seconds"] * work_growth > max_seconds:
            break
        size *= growth
    return points, False


def measure_elementwise(device: torch.device, dtype: torch.dtype, sizes=ELEMENTWISE_BYTES, reps: int = 5,
                        fresh: bool = False) -> list[dict]:
    """One read and one write of `bytes` each pass, into an existing buffer (what the
    optimizer and a caching allocator see) or, `fresh`, into a new allocation (which on
    CPU pays the page faults of a new mapping)."""
    out = []
    for size in sizes:
        # Values do not change a pass's time; drawing 256 MiB of random ones would take a second.
        x = torch.ones(size // torch.tensor([], dtype=dtype).element_size(), device=device, dtype=dtype)
        y = torch.empty_like(x)
        seconds = _best_s((lambda: x.mul(2.0)) if fresh else (lambda: torch.mul(x, 2.0, out=y)), device, reps)
        out.append({"bytes": 2 * size, "seconds": seconds})
    return out


def _collectives(rank: int, world: int, sizes: list[int], reps: int, device_type: str) -> dict:
    """Median seconds per collective and size, identical iteration counts on every rank
    (a time-based loop desynchronises gloo ranks)."""
    # all_gather_into_tensor / reduce_scatter_tensor warn of a rename in recent torch.
    warnings.filterwarnings("ignore", category=FutureWarning)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    out = {kind: [] for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}
    for size in sizes:
        full = torch.ones(size // 4, device=device)
        shard = torch.ones(size // 4 // world, device=device)
        received = torch.empty_like(full)
        ops = {
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: dist.all_gather_into_tensor(full[: shard.numel() * world], shard),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full[: shard.numel() * world]),
            # Each rank sends 1/world of the buffer to every rank (costmodel.terms.comm: the
            # bytes of an all-to-all are what one rank sends in all).
            "all_to_all": lambda: dist.all_to_all_single(received[: shard.numel() * world],
                                                         full[: shard.numel() * world]),
        }
        for kind, op in ops.items():
            times = []
            for _ in range(reps + 1):
                dist.barrier()
                _sync(device)
                start = time.perf_counter()
                op()
                _sync(device)
                times.append(time.perf_counter() - start)
            out[kind].append({"bytes": shard.numel() * world * 4, "seconds": statistics.median(times[1:])})
        # p2p between ranks 0 and 1: half a ping-pong is one way.
        times = []
        for _ in range(reps + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(full, 1)
                dist.recv(full, 1)
            elif rank == 1:
                dist.recv(full, 0)
                dist.send(full, 0)
            times.append((time.perf_counter() - start) / 2)
        out["p2p"].append({"bytes": size, "seconds": statistics.median(times[1:])})
    return out


# --- host overheads of the parallel wrappers (CPU ranks) ----------------------------

# The reference block the wrappers are timed on: a 512-wide GPT layer at seq 128, three
# micro-batch sizes (for TP's growth with activation bytes). Host costs are per op and
# per byte, so they carry to other widths (costmodel.specs.hardware.HostOverheads).
HOST_BLOCK = {"model_type": "gpt", "hidden_size": 512, "num_hidden_layers": 1, "num_attention_heads": 8,
              "num_key_value_heads": 8, "intermediate_size": 2048, "vocab_size": 512,
              "max_position_embeddings": 128, "tie_word_embeddings": False}
HOST_MICRO_BATCH_SIZES = (1, 2, 4)
HOST_REPS = 9


def _thread_s(fn, reps: int) -> float:
    """Median CPU seconds of the calling thread over `reps` calls after one warm-up, the
    ranks in step: gloo's collectives run on threads of their own, so waiting for them
    is not counted, and their calling-thread work is measured bare and subtracted."""
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times[1:])


def _forward_backward(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    def run() -> None:
        out = layer(x, cos, sin)
        out.backward(torch.ones_like(out))
    return run


def _host_overheads(rank: int, world: int, reps: int, micro_batch_sizes: tuple[int, ...], block: dict) -> dict:
    """One rank's thread seconds of the reference block's forward + backward: its plain
    layer, its TP shard, under DTensor TP over all ranks (with and without sequence
    parallelism), under FSDP2 with and without resharding after forward, and of the bare
    collectives each issues."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from costmodel.specs.loading import model_from_dict
    from executor.models import build_model, materialize
    from executor.parallelize import apply_tensor_parallel

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    spec = model_from_dict(block, "host-overhead-block")
    seq, h = spec.max_position_embeddings, spec.hidden_size
    cos, sin = rope_tables(seq, spec.head_dim)
    mesh = init_device_mesh("cpu", (world,))
    generator = torch.Generator().manual_seed(0)
    shard_layer = shard_block(spec, world)
    tp_layers = {}
    for sp in (False, True):
        model = materialize(build_model(spec, seq), "cpu")
        apply_tensor_parallel(model, mesh, sp)
        tp_layers[sp] = model.layers["0"]
    rows = []
    for b in micro_batch_sizes:
        x = torch.randn(b, seq, h, generator=generator).requires_grad_()
        row = {"micro_batch_size": b, "activation_bytes": x.numel() * 4,
               "tp_shard_s": _thread_s(_forward_backward(shard_layer, x, cos, sin), reps)}
        for sp in (False, True):
            local = x.detach().chunk(world, dim=1)[rank].requires_grad_() if sp else x
            row["tp_sp_s" if sp else "tp_s"] = _thread_s(_forward_backward(tp_layers[sp], local, cos, sin), reps)
        message, shard = torch.ones(x.numel()), torch.ones(x.numel() // world)
        row["all_reduce_s"] = _thread_s(lambda: dist.all_reduce(message), reps)
        row["all_gather_s"] = _thread_s(lambda: dist.all_gather_into_tensor(message, shard), reps)
        row["reduce_scatter_s"] = _thread_s(lambda: dist.reduce_scatter_tensor(shard, message), reps)
        rows.append(row)
    x = torch.randn(micro_batch_sizes[0], seq, h, generator=generator).requires_grad_()
    plain = shard_block(spec, 1)
    parameters = sum(p.numel() for p in plain.parameters())
    out = {"block": block, "ranks": world, "tp": rows, "layer_bytes": parameters * 4,
           "plain_s": _thread_s(_forward_backward(plain, x, cos, sin), reps)}
    for reshard in (False, True):
        model = materialize(build_model(spec, seq), "cpu")
        fully_shard(model.layers["0"], mesh=mesh, reshard_after_forward=reshard)
        key = "fsdp_reshard_s" if reshard else "fsdp_keep_s"
        out[key] = _thread_s(_forward_backward(model.layers["0"], x, cos, sin), reps)
    full, shard = torch.ones(parameters - parameters % world), torch.ones(parameters // world)
    out["unit_all_gather_s"] = _thread_s(lambda: dist.all_gather_into_tensor(full, shard), reps)
    out["unit_reduce_scatter_s"] = _thread_s(lambda: dist.reduce_scatter_tensor(shard, full), reps)
    return out


def measure_host_overheads(nproc: int, reps: int = HOST_REPS,
                           micro_batch_sizes: tuple[int, ...] = HOST_MICRO_BATCH_SIZES,
                           seq_len: int = HOST_BLOCK["max_position_embeddings"]) -> dict:
    """What DTensor TP and FSDP2 add on the host, measured on `nproc` CPU ranks (rank 0's
    figures; costmodel.calibrate turns them into HostOverheads, a line in the activation
    bytes: two micro-batch sizes fix it, three check it). A shorter `seq_len` measures
    the same line over smaller activations (profile --quick)."""
    # Imported before the fork, so the ranks do not each import them (1 s per rank here).
    # torch._dynamo too: the first module built on the meta device imports it (0.7 s).
    import torch._dynamo  # noqa: F401

    import executor.models  # noqa: F401
    import executor.parallelize  # noqa: F401

    block = dict(HOST_BLOCK, max_position_embeddings=seq_len)
    return run_local(_host_overheads, nproc, reps, micro_batch_sizes, block)[0]


# --- layer kinds --------------------------------------------------------------------

DEFAULT_MICRO_BATCH_SIZES = (1, 2, 4, 8)
QUICK_MICRO_BATCH_SIZES = (1, 2)
LAYER_REPS = 10        # best of; a layer at these sizes takes milliseconds, so 10 cost little
MIN_REP_S = 2e-3       # one repetition's length, for kinds far shorter than the timer's noise
MAX_PASSES = 20


def check_tp(spec: ModelSpec, tp: int) -> str | None:
    """Why `tp` cannot shard this model's layers (None if it can): the heads, the kv
    heads, the intermediate size and the vocabulary are split over the tp ranks."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
                 "shared_expert_intermediate_size"):
        if getattr(spec, name) % tp:
            return f"{tp} does not divide {name} {getattr(spec, name)}"
    return None


def default_tp_widths(spec: ModelSpec, nproc: int) -> list[int]:
    """Powers of two up to the local process count that shard the model."""
    widths, tp = [], 1
    while tp <= max(1, nproc):
        if check_tp(spec, tp) is None:
            widths.append(tp)
        tp *= 2
    return widths


class _Embedding(nn.Module):
    """This rank's vocabulary shard of the embedding (rows [0, V/tp)), masking the ids
    other ranks hold as a vocabulary-parallel embedding does (Shoeybi et al. 2019 §3), and
    GPT's learned positions."""

    def __init__(self, spec: ModelSpec, tp: int, seq_len: int):
        super().__init__()
        self.rows, self.tp = spec.vocab_size // tp, tp
        self.tok = nn.Embedding(self.rows, spec.hidden_size)
        self.pos = nn.Parameter(torch.empty(seq_len, spec.hidden_size)) if spec.is_gpt else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            outside = ids >= self.rows
            x = self.tok(ids.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            x = self.tok(ids)
        return x + self.pos if self.pos is not None else x


class _Head(nn.Module):
    """Final norm, this rank's vocabulary shard of the logits, and the cross-entropy over
    them (compute only: vocabulary-parallel cross-entropy adds three all-reduces of one
    value per token, which the cost model prices as communication)."""

    def __init__(self, spec: ModelSpec, tp: int):
        super().__init__()
        self.norm = nn.LayerNorm(spec.hidden_size) if spec.is_gpt else RMSNorm(spec.hidden_size)
        self.output = nn.Linear(spec.hidden_size, spec.vocab_size // tp, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def shard_block(spec: ModelSpec, tp: int) -> Block:
    """The transformer layer as one of tp ranks holds it: Q, K, V and the first MLP
    matrices split column-wise, the output projections row-wise (Megatron-LM's layout,
    as executor.parallelize applies it), norms whole."""
    block = Block(spec)
    h, kv, f, bias = spec.hidden_size, spec.kv_size, spec.intermediate_size, spec.is_gpt
    attention = block.attention
    attention.wq = nn.Linear(h, h // tp, bias=bias)
    attention.wk = nn.Linear(h, kv // tp, bias=bias)
    attention.wv = nn.Linear(h, kv // tp, bias=bias)
    attention.wo = nn.Linear(h // tp, h, bias=bias)
    ffn = block.feed_forward
    if spec.is_moe:
        e = spec.num_local_experts
        ffn.w1 = nn.Parameter(torch.empty(e, f // tp, h))
        ffn.w3 = nn.Parameter(torch.empty(e, f // tp, h))
        ffn.w2 = nn.Parameter(torch.empty(e, h, f // tp))
        if ffn.shared_expert is not None:
            # Split as a dense MLP (costmodel.terms.compute); the gate's one output stays whole.
            ffn.shared_expert = MLP(spec, spec.shared_expert_intermediate_size // tp)
    else:
        ffn.w1 = nn.Linear(h, f // tp, bias=bias)
        ffn.w2 = nn.Linear(f // tp, h, bias=bias)
        if ffn.w3 is not None:
            ffn.w3 = nn.Linear(h, f // tp, bias=False)
    return block


def _layer_case(spec: ModelSpec, kind: str, seq_len: int, micro_batch_size: int, tp: int,
                device: torch.device, flash: bool):
    """The module and its inputs for one layer kind at one shape (seeded: the same case
    every time)."""
    generator = torch.Generator().manual_seed(0)
    b, h = micro_batch_size, spec.hidden_size
    if kind == "embedding":
        module = _Embedding(spec, tp, seq_len)
        inputs = (torch.randint(0, spec.vocab_size, (b, seq_len), generator=generator),)
    elif kind == "head":
        module = _Head(spec, tp)
        inputs = (torch.randn(b, seq_len, h, generator=generator).requires_grad_(),
                  torch.randint(0, spec.vocab_size // tp, (b, seq_len), generator=generator))
    else:
        module = shard_block(spec, tp)
        module.attention.flash = flash
        cos, sin = rope_tables(seq_len, spec.head_dim)
        inputs = (torch.randn(b, seq_len, h, generator=generator).requires_grad_(), cos, sin)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)
    module = module.to(device)
    inputs = tuple(x.detach().to(device).requires_grad_(x.requires_grad) for x in inputs)
    return module, inputs


def measure_layer(spec: ModelSpec, kind: str, seq_len: int, micro_batch_size: int, tp: int,
                  device: torch.device, dtype: torch.dtype, flash: bool = True,
                  reps: int = LAYER_REPS) -> tuple[float, float]:
    """Best-of-`reps` forward and backward seconds of one layer kind's TP shard (after a
    warm-up pass), with real tensors on `device`; bf16/fp16 run under autocast over fp32
    weights, as the executor trains them. Best-of, because on a shared machine noise only
    ever adds time; a repetition averages as many passes as make MIN_REP_S, so a
    sub-millisecond kind (the embedding) is not one timer reading. On CPU the clock is
    the thread's CPU time: with one thread per rank the layer runs on the calling thread
    (autograd's CPU work included), so it equals the wall time on a core of its own, and
    other processes sharing the cores do not inflate it (a 2-core machine running
    anything else would otherwise add up to half again)."""
    module, inputs = _layer_case(spec, kind, seq_len, micro_batch_size, tp, device, flash)
    clock = time.thread_time if device.type == "cpu" else time.perf_counter
    mixed = dtype != torch.float32

    def one_pass() -> tuple[float, float]:
        module.zero_grad(set_to_none=True)   # as an optimizer step leaves them
        for x in inputs:
            x.grad = None
        _sync(device)
        start = clock()
        with torch.autocast(device.type, dtype=dtype, enabled=mixed):
            out = module(*inputs)
        _sync(device)
        middle = clock()
        if out.dim() == 0:
            out.backward()
        else:
            out.backward(torch.ones_like(out))
        _sync(device)
        return middle - start, clock() - middle

    warm_fwd, warm_bwd = one_pass()   # also warms up the allocator and kernels
    passes = max(1, min(MAX_PASSES, math.ceil(MIN_REP_S / max(warm_fwd + warm_bwd, 1e-9))))
    best_fwd = best_bwd = float("inf")
    for _ in range(reps):
        times = [one_pass() for _ in range(passes)]
        best_fwd = min(best_fwd, sum(t[0] for t in times) / passes)
        best_bwd = min(best_bwd, sum(t[1] for t in times) / passes)
    return best_fwd, best_bwd


def measure_layers(spec: ModelSpec, seq_len: int, micro_batch_sizes, tp_widths, device: torch.device,
                   precision: str, flash: bool = True, reps: int = LAYER_REPS, progress=print) -> list[dict]:
    """Every layer kind at every (micro-batch size, tp width): the profile's "layers"."""
    shapes = [(tp, b) for tp in tp_widths for b in micro_batch_sizes]
    out = []
    for i, (tp, b) in enumerate(shapes, 1):
        progress(f"layer kinds of {spec.name} at micro-batch {b}, tp {tp} ({i}/{len(shapes)})")
        for kind in LAYER_KINDS:
            forward_s, backward_s = measure_layer(spec, kind, seq_len, b, tp, device, DTYPES[precision], flash, reps)
            out.append({"kind": kind, "model": model_dims(spec), "model_name": spec.name, "seq_len": seq_len,
                        "precision": precision, "attention": "flash" if flash else "eager",
                        "micro_batch_size": b, "tp": tp, "forward_s": forward_s, "backward_s": backward_s})
    return sorted(out, key=layer_key)


def profile(device_type: str = "cpu", nproc: int = 2, precision: str = "fp32", quick: bool = False,
            progress=print, model: ModelSpec | None = None, seq_len: int | None = None,
            micro_batch_sizes=None, tp_widths=None, flash: bool = True) -> dict:
    """Measure this machine; `quick` uses fewer shapes and sizes (for tests). With a
    `model`, also its layer kinds at `seq_len` (default its max_position_embeddings) over
    `micro_batch_sizes` and `tp_widths` (defaults: 1, 2, 4, 8 or with `quick` 1, 2; the
    powers of two up to `nproc` that shard the model)."""
    device = torch.device(device_type)
    dtype = DTYPES[precision]
    shapes = GEMM_SHAPES[::3] if quick else GEMM_SHAPES
    sizes = QUICK_COLLECTIVE_BYTES if quick else COLLECTIVE_BYTES
    reps = 2 if quick else 5
    if device_type == "cpu":
        torch.set_num_threads(1)   # one core per rank, as the executor runs on CPU
    progress(f"GEMM over {len(shapes)} shapes ({precision})")
    gemm = measure_gemm(device, dtype, shapes, reps)
    progress("elementwise bandwidth")
    elementwise = measure_elementwise(device, dtype, ELEMENTWISE_BYTES[:1] if quick else ELEMENTWISE_BYTES, reps)
    progress("roofline: GEMM and elementwise sizes grown until their rates settle")
    square, passes, roofline = measure_roofline(device, dtype, reps,
                                                QUICK_ROOFLINE_SECONDS if quick else ROOFLINE_SECONDS)
    gemm = _merge(gemm, square, lambda p: (p["m"], p["n"], p["k"]))
    elementwise = _merge(elementwise, passes, lambda p: p["bytes"])
    progress(f"collectives over {len(sizes)} sizes on {nproc} processes")
    backend = "nccl" if device_type == "cuda" else "gloo"
    collectives = run_local(_collectives, nproc, sizes, reps, device_type, backend=backend)[0] if nproc > 1 else {}
    host_overheads = None
    if device_type == "cpu" and nproc > 1:
        # On a GPU the host runs ahead of the kernels: nothing to add (HostOverheads).
        progress(f"host overheads of DTensor TP and FSDP2 on {nproc} processes")
        host_overheads = (measure_host_overheads(nproc, 1, HOST_MICRO_BATCH_SIZES[:2], seq_len=64) if quick
                          else measure_host_overheads(nproc))
    layers = []
    if model is not None:
        mbs = list(micro_batch_sizes or (QUICK_MICRO_BATCH_SIZES if quick else DEFAULT_MICRO_BATCH_SIZES))
        widths = list(tp_widths or default_tp_widths(model, nproc))
        layers = measure_layers(model, seq_len or model.max_position_embeddings, mbs, widths, device, precision,
                                flash, 2 if quick else LAYER_REPS, progress)
    if device_type == "cuda":
        name, memory = torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory
    else:
        name, memory = "CPU", 8 << 30
    return {"schema_version": PROFILE_SCHEMA_VERSION, "device": device_type, "device_name": name,
            "precision": precision, "ranks": nproc, "memory_bytes": memory,
            "gemm": gemm, "elementwise": elementwise, "collectives": collectives, "layers": layers,
            "roofline": roofline, **({"host_overheads": host_overheads} if host_overheads else {})}


def _merge(points: list[dict], more: list[dict], key) -> list[dict]:
    """Points of both lists, one per key (the later measurement wins), sorted by key."""
    merged = {key(p): p for p in points} | {key(p): p for p in more}
    return [merged[k] for k in sorted(merged)]


def extend(old: dict, new: dict) -> dict:
    """Merge two profiles of the same device: new measurements replace old ones of the
    same operation and shape (layer kinds: of the same model dimensions, sequence
    length, precision, attention, micro-batch size and tp), the rest are kept. An old
    version 1 profile (no layer kinds) is carried over into the new version."""
    if (old.get("device"), old.get("precision"), old.get("ranks")) != (new["device"], new["precision"], new["ranks"]):
        raise ValueError("profile: can only extend a profile of the same device, precision and process count")
    merged = dict(new)
    merged["gemm"] = _merge(old["gemm"], new["gemm"], lambda p: (p["m"], p["n"], p["k"]))
    merged["elementwise"] = _merge(old["elementwise"], new["elementwise"], lambda p: p["bytes"])
    merged["collectives"] = {}
    for kind in sorted(set(old["collectives"]) | set(new["collectives"])):
        points = {p["bytes"]: p for p in old["collectives"].get(kind, [])} | \
                 {p["bytes"]: p for p in new["collectives"].get(kind, [])}
        merged["collectives"][kind] = [points[k] for k in sorted(points)]
    layers = {layer_key(p): p for p in old.get("layers", [])} | {layer_key(p): p for p in new.get("layers", [])}
    merged["layers"] = [layers[k] for k in sorted(layers)]
    if "host_overheads" in old and "host_overheads" not in new:
        merged["host_overheads"] = old["host_overheads"]
    return merged
