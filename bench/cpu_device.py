"""What one CPU rank of this machine does (the figures configs/hardware/cpu.yaml holds):
fp32 GEMM throughput on one thread over the shapes a small model's layers ask for, and
the bandwidth of an elementwise pass. Best of 5 per shape; prints a table and writes
bench/results/cpu_device.json."""

import json
import statistics
from pathlib import Path

import torch

from executor.measure import measure_elementwise, measure_gemm

SHAPES = [(m, n, k) for m in (16, 64, 128, 512, 1024, 2048)
          for n, k in ((256, 256), (1024, 256), (256, 1024), (1024, 1024), (512, 512))]


def elementwise_bytes_per_s(fresh: bool = False) -> float:
    point = measure_elementwise(torch.device("cpu"), torch.float32, [64 << 20], fresh=fresh)[0]
    return point["bytes"] / point["seconds"]


def main() -> None:
    torch.set_num_threads(1)   # one rank per core, as the executor runs here
    rows = [p | {"flops_per_s": 2 * p["m"] * p["n"] * p["k"] / p["seconds"]}
            for p in measure_gemm(torch.device("cpu"), torch.float32, SHAPES)]
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
