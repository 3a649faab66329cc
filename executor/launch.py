"""Starting a run: a plan read and checked for running (`load_job`; `check_supported`,
what this executor can build; `rank_group`, where a plan puts a rank), the checks of the
process layout, the endpoint and this machine, and the torchrun command line, on one
machine (standalone rendezvous) or across nodes (static rendezvous at an endpoint every
node can reach, nodes numbered by --node-rank; each node runs the same command with its
own --node-rank), and torchrun's entry point. Also `run_local`, the in-process launcher
that tests and benchmarks use.

No torch at module level: `shardwise run` checks a plan, and torchrun's launcher process
starts the ranks, without torch's start-up (1.6 s of the 6 s a one-step run of a tiny
plan takes here); the functions that need torch import it."""

from __future__ import annotations

import datetime
import importlib.util
import io
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

from costmodel.specs import ModelSpec, TrainingSpec
from costmodel.specs.loading import SpecError, load_model
from costmodel.strategy import (
    ZERO_BUBBLE_SCHEDULES,
    Strategy,
    context_parallel_error,
    expert_layout_error,
    layout_error,
    schedule_microbatch_error,
    schedule_zero_error,
)
from planner.plan_file import (
    fingerprint,
    is_traced,
    model_of,
    read_plan,
    strategy_of,
    training_of,
)

# Worker exit codes a restart cannot cure: bad input (2), a non-finite step (4).
FINAL_EXIT_CODES = (2, 4)


# -- the plan: read, checked against what this executor can build --------------------

class UnsupportedPlan(ValueError):
    """The plan asks for something this executor cannot build; the message says what."""


def unbuilt_features(spec: ModelSpec) -> list[str]:
    """The spec fields the built-in model (executor.models) does not build: priced and
    exported, refused by `run` and `profile --model`."""
    return [name for name, on in (("attention_window", spec.windowed_layers),
                                  ("attention_sinks", spec.attention_sinks), ("router_bias", spec.router_bias),
                                  ("swiglu_limit", spec.swiglu_limit is not None),
                                  ("mlp_bias", spec.is_moe and spec.mlp_bias),
                                  # The built model routes by sigmoid as DeepSeek-V3 does (its groups,
                                  # scaling or MLA say so); Llama 4's scales the experts' inputs.
                                  ("router_scoring", spec.router_scoring == "sigmoid" and spec.n_group == 1
                                   and spec.routed_scaling_factor == 1.0 and not spec.is_mla),
                                  ("norms_per_layer", spec.norms_per_layer == 4),
                                  ("num_nextn_predict_layers", spec.num_nextn_predict_layers)) if on]


def check_supported(spec: ModelSpec, strategy: Strategy, seq_len: int, precision: str = "bf16",
                    fp8: str | None = None) -> None:
    """Refuse, before any weights exist, what cannot be built (`precision` and `fp8`:
    the training spec's, checked when fp8 is set)."""
    if fp8 is not None:
        check_fp8(spec, strategy, seq_len, precision, fp8)
    if why := context_parallel_error(strategy.cp, seq_len):
        raise UnsupportedPlan(f"strategy.cp: {why}")
    if strategy.cp > 1 and spec.is_mla:
        raise UnsupportedPlan(f"strategy.cp: context parallelism (cp {strategy.cp}) with multi-head latent attention "
                              "is not built (the plan gathers the latent, the executor's attention would gather "
                              "every head's K and V); plan with --fix cp=1")
    # Under context parallelism a rank holds seq_len / cp tokens of each sequence.
    local_len = seq_len // strategy.cp
    if strategy.sequence_parallel and local_len % strategy.tp:
        split = f" (seq {seq_len} / cp {strategy.cp})" if strategy.cp > 1 else ""
        raise UnsupportedPlan(f"strategy.sequence_parallel: tp {strategy.tp} does not divide the sequence "
                              f"of {local_len} tokens{split}")
    if why := schedule_microbatch_error(strategy.schedule, strategy.pp, strategy.num_microbatches):
        raise UnsupportedPlan(f"strategy.num_microbatches: {why}")
    if layout := layout_error(strategy):
        field, why = layout
        raise UnsupportedPlan(f"strategy.{field.split('[')[0]}: {why}")
    held = sum(stage.num_layers for stage in strategy.stages)
    if strategy.stages and held != spec.num_hidden_layers:
        # Stages that leave layers out would train a shorter model without a word.
        raise UnsupportedPlan(f"strategy.stages: they hold {held} layers, {spec.name} has {spec.num_hidden_layers}")
    if why := schedule_zero_error(strategy.schedule, strategy.pp, strategy.dp_cp, strategy.zero_stage):
        raise UnsupportedPlan(f"strategy.zero_stage: {why}")
    built = unbuilt_features(spec)
    if built:
        raise UnsupportedPlan(f"model.{built[0]}: the executor's built-in model does not build the model's "
                              f"{', '.join(built)} (gpt-oss, Llama 4, Gemma 3, DeepSeek-V3) yet; export the plan (shardwise export) "
                              "to an engine that does")
    if spec.is_moe and strategy.tp > 1 and strategy.etp != 1:
        raise UnsupportedPlan(f"strategy.etp: experts split over tp {strategy.tp} are not built (the executor keeps "
                              f"them whole under tp, MoE parallel folding); plan with --fix etp=1")
    if spec.is_moe and (layout := expert_layout_error(strategy, spec.num_local_experts, folding=True)):
        raise UnsupportedPlan(f"strategy.{layout[0]}: {layout[1]}")
    if spec.num_attention_heads % strategy.tp or spec.num_key_value_heads % strategy.tp:
        raise UnsupportedPlan(f"strategy.tp: {strategy.tp} does not divide the {spec.num_attention_heads} heads "
                              f"and {spec.num_key_value_heads} kv heads")
    if strategy.stage_groups and len(strategy.stage_groups) != strategy.pp:
        raise UnsupportedPlan(f"plan.strategy.stage_groups: expected one group per pipeline rank ({strategy.pp}), "
                              f"got {len(strategy.stage_groups)}")
    if strategy.replica_groups or strategy.replica_microbatches:
        check_replica_shares(strategy)


# torch._scaled_mm, the FP8 GEMM torchao calls on a GPU, takes operands whose dimensions
# are multiples of 16 (the weights' in executor.parallelize.fp8_gemm_fits; a micro-batch's
# tokens are the inner dimension of the weight-gradient GEMM).
FP8_GEMM_MULTIPLE = 16


# The FP8 recipes the executor builds (torchao.float8's Float8LinearConfig recipes).
EXECUTOR_FP8_RECIPES = ("tensorwise", "rowwise")


def check_fp8(spec: ModelSpec, strategy: Strategy, seq_len: int, precision: str, fp8: str) -> None:
    """FP8 training (torchao.float8 on the layers' linear layers) runs on bf16 mixed
    precision, with torchao installed, on dense models, with micro-batches of a multiple
    of 16 tokens per rank."""
    from costmodel.specs.training import FP8_RECIPES

    if fp8 not in FP8_RECIPES:
        raise UnsupportedPlan(f"training.fp8: expected one of {', '.join(FP8_RECIPES)}, got {fp8!r}")
    if fp8 not in EXECUTOR_FP8_RECIPES:
        raise UnsupportedPlan(f"training.fp8: {fp8} scaling is priced and exported (Megatron-LM runs it), not built: "
                              f"the executor's torchao.float8 runs {' and '.join(EXECUTOR_FP8_RECIPES)}; plan with "
                              "--precision fp8 or fp8-rowwise to run here")
    if precision != "bf16":
        raise UnsupportedPlan(f"training.fp8: FP8 linear layers run inside bf16 mixed precision, the plan has "
                              f"precision {precision}; plan with --precision fp8 or fp8-rowwise")
    if spec.is_moe:
        # torchao converts nn.Linear; the experts are grouped weights run by one grouped
        # GEMM, whose FP8 path (torchao's MoE training) this executor does not build.
        raise UnsupportedPlan("training.fp8: the experts of an MoE model would stay bf16 (torchao's FP8 grouped "
                              "GEMM is not supported here), which is not what an fp8 plan prices; plan with "
                              "--precision bf16")
    tokens = strategy.micro_batch_size * seq_len // strategy.cp
    if tokens % FP8_GEMM_MULTIPLE:
        raise UnsupportedPlan(f"training.fp8: a micro-batch holds {tokens} tokens per rank, and FP8 GEMMs take "
                              f"multiples of {FP8_GEMM_MULTIPLE}; plan another micro-batch size or sequence length")
    # Looked up, not imported: the launcher checks a plan without torch (torchao imports it).
    if importlib.util.find_spec("torchao") is None:
        raise UnsupportedPlan("training.fp8: FP8 training needs torchao, which is not installed; "
                              "pip install torchao (or shardwise[fp8])")


def check_compile(strategy: Strategy, compiled: bool) -> None:
    """torch.distributed.pipelining's zero-bubble schedules split each backward into
    input and weight gradients, which they cannot do through torch.compile (they raise)."""
    if compiled and strategy.pp > 1 and strategy.schedule in ZERO_BUBBLE_SCHEDULES:
        raise SpecError("--compile", f"the {strategy.schedule} schedule does not run compiled blocks "
                                     f"(torch.distributed.pipelining splits their backward); run with --no-compile "
                                     f"or plan another schedule")


def check_replica_shares(strategy: Strategy) -> None:
    """Replica groups (a mixed cluster's data-parallel replicas, each running its own
    number of micro-batches): every replica must issue the same collectives whatever
    its count. DDP, `replicate` and ZeRO-2's FSDP do (gradients are reduced once, on
    the last micro-batch; ZeRO-2 gathers each weight once, on the first); what gathers
    or exchanges per micro-batch does not."""
    s, field = strategy, "plan.strategy.replica_groups"
    counts = s.replica_microbatches
    if len(counts) != s.dp or any(not isinstance(m, int) or m < 1 for m in counts):
        raise UnsupportedPlan(f"plan.strategy.replica_microbatches: expected {s.dp} positive micro-batch counts "
                              f"(one per dp replica), got {list(counts)}")
    if len(s.replica_groups) != s.dp:
        raise UnsupportedPlan(f"{field}: expected {s.dp} group names (one per dp replica), got {len(s.replica_groups)}")
    if s.pp > 1:
        raise UnsupportedPlan(f"{field}: replica shares need pp 1 (a pipeline schedule runs one micro-batch count "
                              f"on every stage), the plan has pp {s.pp}; plan with stage groups")
    if s.zero_stage >= 3:
        raise UnsupportedPlan(f"{field}: ZeRO-3 gathers every layer's weights in each micro-batch's forward and "
                              f"backward, so replicas running {list(counts)} micro-batches would issue different "
                              f"collectives; plan with zero_stage <= 2")
    if s.ep > 1:
        raise UnsupportedPlan(f"{field}: expert parallelism exchanges tokens across replicas in each micro-batch, "
                              f"so replicas running {list(counts)} micro-batches cannot meet; plan with ep 1")


def degrees(strategy: Strategy) -> str:
    """The degrees whose product is the plan's process count, as messages name them."""
    cp = f" x cp {strategy.cp}" if strategy.cp > 1 else ""
    return f"dp {strategy.dp}{cp} x tp {strategy.tp} x pp {strategy.pp}"


@dataclass(frozen=True)
class RunJob:
    """A plan file read, checked and turned into what a trainer needs."""

    plan: dict
    model: ModelSpec
    training: TrainingSpec
    strategy: Strategy


def load_job(plan_path: str, model_name: str | None = None, world_size: int | None = None) -> RunJob:
    """Read and check a plan for running; raises SpecError naming the field."""
    doc = read_plan(plan_path)
    if is_traced(doc):
        raise SpecError("plan.model", f"a plan of the traced module {doc['model']['name']}: shardwise run trains "
                                      f"models given by a spec (built-in, YAML or a config.json)")
    model = model_of(doc)   # read as a model file is: a field left out takes its default
    if model_name is not None:
        given = load_model(model_name)
        if fingerprint(given) != doc["model_fingerprint"]:
            raise SpecError("--model", f"{model_name} is not the model this plan was made for ({model.name}; "
                                       f"fingerprints {fingerprint(given)[:19]} vs {doc['model_fingerprint'][:19]})")
    training = training_of(doc)
    strategy = strategy_of(doc)
    if world_size is not None and world_size != strategy.num_gpus:
        raise SpecError("--nproc-per-node", f"the plan needs {strategy.num_gpus} processes "
                                            f"({degrees(strategy)}), {world_size} would be started")
    try:
        check_supported(model, strategy, training.seq_len, training.precision, training.fp8)
    except UnsupportedPlan as err:
        raise SpecError(*str(err).split(": ", 1)) from None
    job_device_type(doc)
    return RunJob(doc, model, training, strategy)


@dataclass(frozen=True)
class RankGroup:
    """Where a plan puts one global rank: its group of the cluster (the cluster itself
    when it is not mixed), the group's hardware and the device type that runs it."""

    group: str
    gpu: str
    device_type: str   # "cpu" or "cuda"


def is_cpu_hardware(name: str) -> bool:
    """Hardware the executor runs on CPU: configs/hardware/cpu.yaml is named "CPU", and
    its copies keep the word first ("cpu-slow", "CPU 2x")."""
    return re.split(r"[^a-z0-9]", name.strip().lower(), maxsplit=1)[0] == "cpu"


def rank_group(doc: dict, rank: int) -> RankGroup:
    """The group of global `rank` in plan `doc`. Ranks run tp innermost, then cp, then
    dp, then pp (costmodel.strategy): with stage groups a rank's group is its pipeline
    rank's, rank // (dp x cp x tp); with replica groups its dp replica's,
    (rank // (cp x tp)) % dp; any other plan on a mixed cluster fills the groups in the
    cluster file's order."""
    s, cluster = strategy_of(doc), doc["cluster"]
    if not 0 <= rank < s.num_gpus:
        raise SpecError("RANK", f"rank {rank} is not one of the plan's {s.num_gpus} ranks")
    if "groups" not in cluster:
        gpu = cluster["gpu"]["name"]
        return RankGroup(cluster["name"], gpu, "cpu" if is_cpu_hardware(gpu) else "cuda")
    groups = cluster["groups"]
    if s.stage_groups:
        name = s.stage_groups[rank // (s.dp * s.cp * s.tp)]
    elif s.replica_groups:
        name = s.replica_groups[(rank // (s.cp * s.tp)) % s.dp]
    else:
        first = 0
        for g in groups:
            first += g["gpus_per_node"] * g["num_nodes"]
            if rank < first:
                name = g["name"]
                break
        else:
            raise SpecError("plan.cluster.groups", f"the groups hold fewer than the plan's {s.num_gpus} ranks")
    group = next(g for g in groups if g["name"] == name)   # strategy_of checked the names
    gpu = group["gpu"]["name"]
    return RankGroup(name, gpu, "cpu" if is_cpu_hardware(gpu) else "cuda")


def job_device_type(doc: dict) -> str:
    """The device type of every rank of the plan; SpecError when its groups need both
    CPU and CUDA (one job joins one process group: gloo or NCCL)."""
    placed = [rank_group(doc, r) for r in range(strategy_of(doc).num_gpus)]
    kinds = {p.device_type: p for p in placed}
    if len(kinds) > 1:
        cpu, cuda = kinds["cpu"], kinds["cuda"]
        raise SpecError("plan.cluster.groups", f"group {cpu.group} ({cpu.gpu}) runs on CPU and group {cuda.group} "
                                               f"({cuda.gpu}) on CUDA: one job runs one backend (gloo or NCCL); "
                                               f"plan the GPU groups alone")
    return placed[0].device_type


# -- the launch ---------------------------------------------------------------------

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


# What one rank costs beyond its share of the model: the interpreter, torch and its
# libraries, gloo's buffers (measured: ~0.25 GiB resident per CPU rank of the tiny models).
PROCESS_OVERHEAD_BYTES = 2**28


def check_machine(launch: Launch, device_type: str, rank_memory_bytes: float) -> None:
    """Refuse, before torchrun starts, a launch this machine cannot hold: more CUDA ranks
    than GPUs, or CPU ranks whose estimated memory (the plan's peak per rank plus each
    process's own) exceeds the memory available. SpecError names what the plan needs
    against what the machine has."""
    n = launch.nproc_per_node
    if device_type == "cuda":
        import torch

        have = torch.cuda.device_count()
        if n > have:
            raise SpecError("--nproc-per-node", f"the plan starts {n} ranks on this node, one per GPU; "
                                                f"this machine has {have} GPUs (use --nnodes to spread it)")
        return
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):   # not POSIX: nothing to check against
        return
    need = n * (rank_memory_bytes + PROCESS_OVERHEAD_BYTES)
    if need > available:
        gib = 2**30
        raise SpecError("--nproc-per-node", f"the plan starts {n} CPU ranks on this node, about "
                                            f"{need / gib:.1f} GiB ({rank_memory_bytes / gib:.2f} GiB estimated per "
                                            f"rank + {PROCESS_OVERHEAD_BYTES / gib:.2f} GiB per process); this "
                                            f"machine has {available / gib:.1f} GiB available")


def check_endpoint(endpoint: str | None) -> None:
    """host:port with a port in 1..65535 and a host this machine can resolve (torchrun's
    own message comes after a traceback, and for a host it cannot resolve it retries
    until its rendezvous timeout, silently)."""
    if endpoint is None:
        return
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SpecError("--rdzv-endpoint", f"expected HOST:PORT (port 1..65535), got {endpoint!r}")
    try:
        socket.getaddrinfo(host.removeprefix("[").removesuffix("]"), int(port))
    except (OSError, UnicodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise SpecError("--rdzv-endpoint", f"cannot resolve host {host!r} ({reason}); "
                                           "give node 0's name or address as this node sees it") from None


WORKER_SCRIPT = str(Path(__file__).with_name("run.py"))


def torchrun_command(launch: Launch, worker_args: list[str]) -> list[str]:
    # Static rendezvous: node K takes ranks K * nproc_per_node onwards, as its
    # --node-rank says (c10d numbers nodes by host name), so the ranks of a mixed
    # cluster's plan land on the groups the plan put them on.
    cmd = [sys.executable, "-m", "executor.launch", "--nproc-per-node", str(launch.nproc_per_node)]
    if launch.rdzv_endpoint:
        cmd += ["--nnodes", str(launch.nnodes), "--node-rank", str(launch.node_rank),
                "--rdzv-backend", "static", "--rdzv-endpoint", launch.rdzv_endpoint, "--rdzv-id", launch.rdzv_id]
    else:
        cmd += ["--standalone"]
    # The ranks are forked from the launcher once it has imported the worker's modules
    # (torchrun_main): each rank importing torch, DTensor and DCP itself took 4.4 s of a
    # one-step run on 2 cores. torchrun forks only for a script it runs in-process.
    return cmd + ["--start-method", "fork", "--run-path", WORKER_SCRIPT] + worker_args


def run_torchrun(launch: Launch, worker_args: list[str], log=print) -> int:
    """Start torchrun and wait; its exit code (the first failing worker's). A failed
    group is started again, up to `launch.max_restarts` times, by a fresh torchrun: a
    new rendezvous store, so no address of a dead rank lingers (torchrun's own restarts
    reuse its store, and gloo ranks of the new attempt were seen to dial addresses of
    the old one); the workers resume from their --checkpoint-dir."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")   # one intra-op thread per rank: ranks share the cores
    once = Launch(**{**launch.__dict__, "max_restarts": 0})
    with tempfile.TemporaryDirectory() as scratch:
        # torchrun exits 1 whatever its workers' codes; rank 0 leaves its own here, so a
        # failure no restart can cure (bad input, a non-finite step) is not retried.
        exit_file = Path(scratch) / "exit-code"
        env["SHARDWISE_EXIT_FILE"] = str(exit_file)
        for attempt in range(launch.max_restarts + 1):
            env["SHARDWISE_RESTART"] = str(attempt)
            code, stopped_by = _call_forwarding_signals(torchrun_command(once, worker_args), env)
            if stopped_by is not None:   # the job was stopped (scancel, kubectl delete, Ctrl-C): no restart
                log(f"shardwise: stopped by {signal.Signals(stopped_by).name}; torchrun and its workers were told")
                return 128 + stopped_by
            if exit_file.is_file():
                code = int(exit_file.read_text())
                if code in FINAL_EXIT_CODES:
                    return code
            if code == 0 or attempt == launch.max_restarts:
                return code
            log(f"shardwise: the group exited with code {code}; restart {attempt + 1} of {launch.max_restarts}")
    return code


def _call_forwarding_signals(cmd: list[str], env: dict) -> tuple[int, int | None]:
    """Run torchrun and wait; SIGTERM / SIGINT sent to this process (what Slurm's scancel
    and Kubernetes send) go on to torchrun, which stops its workers, so stopping the
    command stops the job and no worker is left holding its device. (exit code, the
    signal that stopped it or None)."""
    proc = subprocess.Popen(cmd, env=env)
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        proc.send_signal(signum)

    import threading

    on_main = threading.current_thread() is threading.main_thread()   # only there can handlers be set
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)} if on_main else {}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code, (received[0] if received else None)


def die_with_launcher() -> None:
    """Have the kernel end this worker when torchrun, its parent, ends. `torchrun -m
    executor.run` starts each worker in a session of its own, so a launcher killed
    outright (SIGKILL, the OOM killer, a scheduler's hard stop) cannot stop it, and an
    orphan waits in a collective for ever, holding its device; the ranks `shardwise run`
    forks (torchrun_command) share the launcher's process group, but not a SIGKILL of
    the launcher alone. Linux only (prctl PR_SET_PDEATHSIG); elsewhere a no-op.
    Called by executor.run under torchrun."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    # The launcher may have gone between reading its pid and the call: the kernel would
    # not tell. (Not `parent == 1`: in a container torchrun itself may be pid 1.)
    if os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)


# -- the in-process launcher of tests and benchmarks (fork, gloo over loopback TCP: 0.06 s
# for two ranks against ~3 s for torchrun) -----------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, queue, fn, args, backend):
    import torch
    import torch.distributed as dist

    # One intra-op thread per forked rank, whatever OMP_NUM_THREADS says: GNU OpenMP's
    # thread pool does not survive fork, and a forked rank running two threads after
    # its parent had used two hung in its first parallel kernel.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world, *args)
        buffer = io.BytesIO()   # by value: a shared-memory tensor would die with this process
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:   # report every failure to the parent, then exit
        queue.put((rank, "error", traceback.format_exc()))


def run_local(fn, world: int, *args, backend: str = "gloo") -> list:
    """Run fn(rank, world, *args) on `world` forked ranks of this machine (gloo, or
    nccl with one GPU per rank); their return values by rank."""
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn" if backend == "nccl" else "fork")   # CUDA cannot be forked
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue, fn, args, backend)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(world):
        rank, status, value = queue.get()
        if status == "error":
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        results[rank] = torch.load(io.BytesIO(value), weights_only=True)
    for p in procs:
        p.join(timeout=30)
    return [results[r] for r in range(world)]


def _drop_traceback(record: logging.LogRecord) -> bool:
    record.exc_info, record.exc_text = None, None
    return True


def torchrun_main(argv: list[str]) -> int:
    """torchrun (torch.distributed.run) in this process, its ChildFailedError said in one
    line: the first failed rank, how it ended and where its error was written. The rank's
    own error line comes before it, from the rank; torchrun's traceback of its agent says
    nothing more and is left out."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    if WORKER_SCRIPT in argv:
        # What every rank imports, once, before torchrun forks them (the executor's own
        # modules are quick; torch's distributed packages are 4 s). Importing initialises
        # no CUDA context and starts no OpenMP pool, neither of which survives a fork.
        import rich.table  # noqa: F401
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.pipelining  # noqa: F401
        import torch.distributed.tensor.parallel  # noqa: F401

        # A forked rank that fails is logged with torch's own traceback of the join,
        # which says nothing the one line below does not: keep the log line only.
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_drop_traceback)

    try:
        torchrun(argv)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        how = (f"killed by {signal.Signals(-failure.exitcode).name}" if failure.exitcode < 0
               else f"exit code {failure.exitcode}")
        where = f"; its error: {failure.error_file}" if os.path.isfile(str(failure.error_file)) else ""
        print(f"shardwise: rank {rank} (pid {failure.pid}) failed, {how}{where}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":   # what torchrun_command starts
    code = torchrun_main(sys.argv[1:])
    sys.stdout.flush()   # torchrun has reaped its workers; skip the interpreter's slow teardown
    sys.stderr.flush()
    os._exit(code)
