"""Measuring the local device: GEMM throughput over the shapes a model's layers ask for,
the bandwidth of elementwise passes, and collectives (all-reduce, all-gather,
reduce-scatter, send/recv) over message sizes across `nproc` local processes. The
result is a versioned JSON profile keyed by device, operation, shape and dtype;
costmodel.calibrate fits it into a cluster spec.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
import torch.distributed as dist

from costmodel.calibrate import PROFILE_SCHEMA_VERSION
from executor.launch import run_local

GEMM_SHAPES = [(m, n, k) for m in (16, 64, 256, 1024, 4096) for n, k in ((256, 256), (1024, 1024), (4096, 1024))]
ELEMENTWISE_BYTES = [1 << 22, 1 << 24, 1 << 26]
COLLECTIVE_BYTES = [1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24]
QUICK_COLLECTIVE_BYTES = [1 << 16, 1 << 20, 1 << 22]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def measure_elementwise(device: torch.device, dtype: torch.dtype, sizes=ELEMENTWISE_BYTES, reps: int = 5,
                        fresh: bool = False) -> list[dict]:
    """One read and one write of `bytes` each pass, into an existing buffer (what the
    optimizer and a caching allocator see) or, `fresh`, into a new allocation (which on
    CPU pays the page faults of a new mapping)."""
    out = []
    for size in sizes:
        x = torch.randn(size // torch.tensor([], dtype=dtype).element_size(), device=device, dtype=dtype)
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
    out = {kind: [] for kind in ("all_reduce", "all_gather", "reduce_scatter", "p2p")}
    for size in sizes:
        full = torch.ones(size // 4, device=device)
        shard = torch.ones(size // 4 // world, device=device)
        ops = {
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: dist.all_gather_into_tensor(full[: shard.numel() * world], shard),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full[: shard.numel() * world]),
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


def profile(device_type: str = "cpu", nproc: int = 2, precision: str = "fp32", quick: bool = False,
            progress=print) -> dict:
    """Measure this machine; `quick` uses fewer shapes and sizes (for tests)."""
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
    progress(f"collectives over {len(sizes)} sizes on {nproc} processes")
    backend = "nccl" if device_type == "cuda" else "gloo"
    collectives = run_local(_collectives, nproc, sizes, reps, device_type, backend=backend)[0] if nproc > 1 else {}
    if device_type == "cuda":
        name, memory = torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory
    else:
        name, memory = "CPU", 8 << 30
    return {"schema_version": PROFILE_SCHEMA_VERSION, "device": device_type, "device_name": name,
            "precision": precision, "ranks": nproc, "memory_bytes": memory,
            "gemm": gemm, "elementwise": elementwise, "collectives": collectives}


def extend(old: dict, new: dict) -> dict:
    """Merge two profiles of the same device: new measurements replace old ones of the
    same operation and shape, the rest are kept."""
    if (old.get("device"), old.get("precision"), old.get("ranks")) != (new["device"], new["precision"], new["ranks"]):
        raise ValueError("profile: can only extend a profile of the same device, precision and process count")
    merged = dict(new)
    gemm = {(p["m"], p["n"], p["k"]): p for p in old["gemm"]} | {(p["m"], p["n"], p["k"]): p for p in new["gemm"]}
    merged["gemm"] = [gemm[k] for k in sorted(gemm)]
    elem = {p["bytes"]: p for p in old["elementwise"]} | {p["bytes"]: p for p in new["elementwise"]}
    merged["elementwise"] = [elem[k] for k in sorted(elem)]
    merged["collectives"] = {}
    for kind in sorted(set(old["collectives"]) | set(new["collectives"])):
        points = {p["bytes"]: p for p in old["collectives"].get(kind, [])} | \
                 {p["bytes"]: p for p in new["collectives"].get(kind, [])}
        merged["collectives"][kind] = [points[k] for k in sorted(points)]
    return merged
