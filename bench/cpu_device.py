"""What one CPU rank of this machine does (the figures configs/hardware/cpu.yaml holds):
fp32 GEMM throughput on one thread over the shapes a small model's layers ask for, and
the bandwidth of an elementwise pass. Best of 5 per shape; prints a table and writes
bench/results/cpu_device.json."""

import json
import statistics
import time
from pathlib import Path

import torch

SHAPES = [(m, n, k) for m in (16, 64, 128, 512, 1024, 2048)
          for n, k in ((256, 256), (1024, 256), (256, 1024), (1024, 1024), (512, 512))]


def gemm_flops_per_s(m: int, n: int, k: int, reps: int = 5) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * m * n * k / best


def elementwise_bytes_per_s(num_bytes: int = 64 << 20, reps: int = 5, fresh: bool = False) -> float:
    """One read and one write per element: into an existing buffer (what the optimizer
    and a caching allocator see), or into a freshly allocated one (each pass then pays
    the page faults of a new mapping)."""
    x = torch.randn(num_bytes // 4)
    out = torch.empty_like(x)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        if fresh:
            x.mul(2.0)
        else:
            torch.mul(x, 2.0, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def main() -> None:
    torch.set_num_threads(1)   # one rank per core, as the executor runs here
    rows = [{"m": m, "n": n, "k": k, "flops_per_s": gemm_flops_per_s(m, n, k)} for m, n, k in SHAPES]
    for r in rows:
        print(f"GEMM {r['m']:5d} x {r['n']:5d} x {r['k']:5d}  {r['flops_per_s'] / 1e9:6.1f} GFLOP/s")
    large = statistics.median(r["flops_per_s"] for r in rows if r["m"] >= 512)
    small = statistics.median(r["flops_per_s"] for r in rows if r["m"] == 16)
    bandwidth, fresh = elementwise_bytes_per_s(), elementwise_bytes_per_s(fresh=True)
    print(f"median GEMM with m >= 512: {large / 1e9:.1f} GFLOP/s; m = 16: {small / 1e9:.1f} GFLOP/s "
          f"({small / large:.2f} of it); elementwise {bandwidth / 1e9:.2f} GB/s into a buffer, "
          f"{fresh / 1e9:.2f} GB/s into a fresh allocation")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "cpu_device.json").write_text(json.dumps(
        {"gemm": rows, "median_large_flops_per_s": large, "median_m16_flops_per_s": small,
         "elementwise_bytes_per_s": bandwidth, "elementwise_fresh_bytes_per_s": fresh}, indent=2) + "\n")


if __name__ == "__main__":
    main()
