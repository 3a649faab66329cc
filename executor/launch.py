"""Starting a run: the torchrun command line for a plan, on one machine (standalone
rendezvous) or across nodes (c10d rendezvous at an endpoint every node can reach).
Each node runs the same command with its own --node-rank."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from costmodel.loading import SpecError


@dataclass(frozen=True)
class Launch:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str = "shardwise"
    max_restarts: int = 0


def plan_launch(num_gpus: int, nproc_per_node: int | None, nnodes: int, node_rank: int,
                rdzv_endpoint: str | None, rdzv_id: str = "shardwise", max_restarts: int = 0) -> Launch:
    """Check the process layout against the plan's world size; raises SpecError."""
    if nnodes < 1:
        raise SpecError("--nnodes", "must be at least 1")
    if nproc_per_node is None:
        if num_gpus % nnodes:
            raise SpecError("--nnodes", f"{nnodes} nodes cannot share the plan's {num_gpus} processes evenly")
        nproc_per_node = num_gpus // nnodes
    if nproc_per_node * nnodes != num_gpus:
        raise SpecError("--nproc-per-node", f"the plan needs {num_gpus} processes, "
                                            f"{nproc_per_node} x {nnodes} nodes would start {nproc_per_node * nnodes}")
    if nnodes > 1 and not rdzv_endpoint:
        raise SpecError("--rdzv-endpoint", "required with --nnodes > 1 (host:port of node 0)")
    if not 0 <= node_rank < nnodes:
        raise SpecError("--node-rank", f"must be in 0..{nnodes - 1}")
    return Launch(nproc_per_node, nnodes, node_rank, rdzv_endpoint, rdzv_id, max_restarts)


def torchrun_command(launch: Launch, worker_args: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(launch.nproc_per_node)]
    if launch.rdzv_endpoint:
        cmd += ["--nnodes", str(launch.nnodes), "--node-rank", str(launch.node_rank),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", launch.rdzv_endpoint, "--rdzv-id", launch.rdzv_id]
    else:
        cmd += ["--standalone"]
    if launch.max_restarts:
        cmd += ["--max-restarts", str(launch.max_restarts)]
    return cmd + ["-m", "executor.run"] + worker_args


def run_torchrun(launch: Launch, worker_args: list[str]) -> int:
    """Start torchrun and wait; its exit code (the first failing worker's)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")   # one intra-op thread per rank: ranks share the cores
    return subprocess.call(torchrun_command(launch, worker_args), env=env)
