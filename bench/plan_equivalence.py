"""Plan a fixed set of varied requests and record every output, so that a change meant
to keep behaviour (a refactor) can be checked byte for byte against the run before it.

    python bench/plan_equivalence.py --out /tmp/before     # on the old code
    python bench/plan_equivalence.py --out /tmp/after      # on the new code
    python bench/plan_equivalence.py --compare /tmp/before /tmp/after

Each request is a `shardwise` command line (run in-process through click, in one
working folder so written files and the paths in messages agree between runs) or a
`plan_model` call on a traced torch module. What is recorded per request: the exit
code, stdout, stderr and every file it wrote; the comparison masks the search's wall
time and the checkout's folder, what differs between two runs of the same code. The requests cover the built-in models
x clusters x rule sets x `--fix` knobs, precisions, objectives and budgets, Hugging
Face configs, mixed clusters, infeasible and bad input, replan, sweep, every export
target, evaluate, explain and traced modules.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HF = ROOT / "tests" / "data" / "hf"
WORK = Path("/tmp/shardwise-plan-equivalence")  # fixed: paths echoed in messages must agree between runs


def _plan(name: str, *args: str) -> tuple[str, list[str]]:
    return name, ["plan", *args]


def requests() -> list[tuple[str, list[str]]]:
    """(name, argv) of every CLI request, in the order they run (replan, export and
    explain read plan files written by earlier requests)."""
    plans = [
        _plan("gpt3-175b-a100", "--model", "gpt3-175b", "--cluster", "dgx-a100-80gb", "--nodes", "16",
              "--global-batch", "1536", "--seq", "2048", "-o", "gpt3-175b.json"),
        _plan("gpt3-175b-megatron-tp8", "--model", "gpt3-175b", "--cluster", "dgx-a100-80gb", "--nodes", "16",
              "--global-batch", "1536", "--seq", "2048", "--rules", "megatron", "--fix", "tp=8", "--format", "json"),
        _plan("llama3-70b-h100", "--model", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "8",
              "--global-batch", "1024", "--seq", "8192", "-o", "llama3-70b.json"),
        _plan("llama3-70b-fsdp", "--model", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "8",
              "--global-batch", "1024", "--seq", "8192", "--rules", "fsdp", "--format", "json"),
        _plan("llama3-70b-pp4-interleaved", "--model", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "8",
              "--global-batch", "1024", "--seq", "8192", "--fix", "pp=4,vpp=2,schedule=interleaved"),
        _plan("llama3-70b-gpipe", "--model", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "8",
              "--global-batch", "1024", "--seq", "8192", "--fix", "pp=4,schedule=gpipe", "--format", "json"),
        _plan("llama2-7b-a100", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--gpus", "8",
              "--global-batch", "64", "--seq", "4096", "-o", "llama2-7b.json"),
        _plan("llama2-7b-zero3", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--gpus", "8",
              "--global-batch", "64", "--seq", "4096", "--fix", "zero=3,tp=1", "--format", "json"),
        _plan("llama2-7b-recompute-full", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--gpus", "8",
              "--global-batch", "64", "--seq", "4096", "--fix", "recompute=full,mbs=2"),
        _plan("llama2-7b-sp-off", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--gpus", "16",
              "--global-batch", "64", "--seq", "4096", "--fix", "tp=4,sp=off", "--format", "json"),
        _plan("llama2-7b-eager-fp16", "--model", "llama2-7b", "--cluster", "dgx-v100", "--gpus", "16",
              "--global-batch", "64", "--seq", "2048", "--precision", "fp16", "--attention", "eager"),
        _plan("llama2-13b-fp32-sgd", "--model", "llama2-13b", "--cluster", "dgx-a100-80gb", "--gpus", "32",
              "--global-batch", "128", "--seq", "2048", "--precision", "fp32", "--optimizer", "sgd", "--format", "json"),
        _plan("llama2-70b-memory", "--model", "llama2-70b", "--cluster", "dgx-a100-80gb", "--nodes", "8",
              "--global-batch", "512", "--seq", "4096", "--objective", "memory"),
        _plan("llama2-70b-cost", "--model", "llama2-70b", "--cluster", "dgx-a100-80gb", "--nodes", "8",
              "--global-batch", "512", "--seq", "4096", "--objective", "cost", "--format", "json"),
        _plan("llama2-70b-energy-cap", "--model", "llama2-70b", "--cluster", "dgx-a100-80gb", "--nodes", "8",
              "--global-batch", "512", "--seq", "4096", "--objective", "energy", "--power-cap", "350"),
        _plan("llama2-70b-pareto", "--model", "llama2-70b", "--cluster", "dgx-a100-80gb", "--nodes", "8",
              "--global-batch", "512", "--seq", "4096", "--pareto", "--format", "json"),
        _plan("llama3-8b-h200-top5", "--model", "llama3-8b", "--cluster", "dgx-h200", "--gpus", "8",
              "--global-batch", "256", "--seq", "8192", "--top", "5"),
        _plan("llama3-405b-h100", "--model", "llama3-405b", "--cluster", "dgx-h100", "--nodes", "64",
              "--global-batch", "2048", "--seq", "8192", "--rules", "megatron", "--format", "json"),
        _plan("mixtral-h100", "--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--nodes", "4",
              "--global-batch", "512", "--seq", "4096", "-o", "mixtral.json"),
        _plan("mixtral-ep8", "--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--nodes", "4",
              "--global-batch", "512", "--seq", "4096", "--fix", "ep=8", "--format", "json"),
        _plan("gpt3-13b-v100", "--model", "gpt3-13b", "--cluster", "dgx-v100", "--nodes", "8",
              "--global-batch", "512", "--seq", "2048", "--precision", "fp16"),
        _plan("gpt3-1.3b-a100-40", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-40gb", "--gpus", "8",
              "--global-batch", "256", "--seq", "2048", "--format", "json"),
        _plan("gpt3-6.7b-set", "--model", "gpt3-6.7b", "--cluster", "dgx-a100-80gb", "--gpus", "16",
              "--global-batch", "256", "--seq", "2048", "--set", "num_layers=24"),
        _plan("gpt-22b-budget", "--model", "gpt-22b", "--cluster", "dgx-a100-80gb", "--nodes", "8",
              "--global-batch", "512", "--seq", "2048", "--max-cost-per-step", "5", "--energy-budget", "5e7"),
        _plan("gpt-530b", "--model", "gpt-530b", "--cluster", "dgx-a100-80gb", "--nodes", "35",
              "--global-batch", "2240", "--seq", "2048", "--rules", "megatron", "--format", "json"),
        _plan("gpt-1t", "--model", "gpt-1t", "--cluster", "dgx-a100-80gb", "--nodes", "64",
              "--global-batch", "3072", "--seq", "2048", "--rules", "megatron"),
        _plan("tiny-gpt-cpu", "--model", "tiny-gpt", "--cluster", "cpu", "--gpus", "4", "--global-batch", "8",
              "--precision", "fp32", "-o", "tiny-gpt.json"),
        _plan("tiny-llama-cpu", "--model", "tiny-llama", "--cluster", "cpu", "--gpus", "2", "--global-batch", "8",
              "--precision", "fp32", "--fix", "pp=2", "--format", "json"),
        _plan("tiny-moe-cpu", "--model", "tiny-moe", "--cluster", "cpu", "--gpus", "4", "--global-batch", "8",
              "--precision", "fp32", "--format", "json"),
        _plan("rules-file", "--model", "tiny-gpt", "--cluster", "cpu", "--gpus", "2", "--global-batch", "8",
              "--precision", "fp32", "--rules", str(ROOT / "tests" / "planner" / "data" / "tiny_memory.yaml")),
        _plan("hf-llama-2-7b", "--model", f"hf:{HF / 'llama-2-7b.json'}", "--cluster", "dgx-a100-80gb", "--gpus", "8",
              "--global-batch", "64", "--seq", "4096", "--format", "json"),
        _plan("hf-mistral", "--model", str(HF / "mistral-7b.json"), "--cluster", "dgx-h100", "--gpus", "16",
              "--global-batch", "128", "--seq", "4096"),
        _plan("hf-mixtral", "--model", str(HF / "mixtral-8x7b.json"), "--cluster", "dgx-h100", "--nodes", "4",
              "--global-batch", "256", "--seq", "4096", "--format", "json"),
        _plan("hf-gpt2", "--model", str(HF / "gpt2.json"), "--cluster", "dgx-a100-40gb", "--gpus", "4",
              "--global-batch", "32"),
        _plan("mixed-a100-v100", "--model", "llama2-13b", "--cluster", "mixed-a100-v100", "--global-batch", "512",
              "--seq", "4096", "--precision", "fp16", "-o", "mixed.json"),
        _plan("mixed-h100-a100-pp", "--model", "llama2-13b", "--cluster", "mixed-h100-a100", "--global-batch", "256",
              "--seq", "4096", "--fix", "pp=2", "--format", "json"),
        _plan("infeasible-memory", "--model", "gpt3-175b", "--cluster", "dgx-a100-80gb", "--gpus", "8",
              "--global-batch", "64", "--seq", "2048"),
        _plan("infeasible-fix", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--gpus", "8",
              "--global-batch", "64", "--fix", "tp=16"),
        _plan("bad-model", "--model", "no-such-model", "--cluster", "dgx-a100-80gb", "--gpus", "8",
              "--global-batch", "64"),
        _plan("bad-batch", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--gpus", "8",
              "--global-batch", "-3"),
        _plan("bad-fix", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--gpus", "8",
              "--global-batch", "64", "--fix", "zero=7"),
    ]
    followers = [
        ("replan-gpus", ["replan", "llama2-7b.json", "--gpus", "64", "-o", "llama2-7b-64.json"]),
        ("replan-nodes", ["replan", "gpt3-175b.json", "--nodes", "12", "--format", "json"]),
        ("replan-cluster", ["replan", "llama3-70b.json", "--cluster", "dgx-a100-80gb", "--nodes", "4",
                            "--rules", "megatron"]),
        ("replan-mixed", ["replan", "mixed.json", "--cluster", "dgx-a100-80gb", "--nodes", "4", "--format", "json"]),
        ("sweep-table", ["sweep", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--gpus", "8,16,32",
                         "--global-batch", "64", "--seq", "4096"]),
        ("sweep-tokens", ["sweep", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "8..128",
                          "--global-batch", "1024", "--seq", "8192", "--rules", "megatron", "--tokens", "300e9",
                          "--format", "json", "-o", "sweep.json"]),
        ("explain-gpt3", ["explain", "gpt3-175b.json"]),
        ("explain-mixed", ["explain", "mixed.json"]),
        ("explain-tiny", ["explain", "tiny-gpt.json"]),
        ("evaluate-megatron", ["evaluate", "--from", "megatron",
                               "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --micro-batch-size 1 "
                               "--global-batch-size 1536 --seq-length 2048 --bf16",
                               "--model", "gpt3-175b", "--cluster", "dgx-a100-80gb", "--nodes", "16"]),
        ("evaluate-torchtitan", ["evaluate", "--from", "torchtitan",
                                 "--parallelism.tensor_parallel_degree 8 --training.local_batch_size 2",
                                 "--model", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "8",
                                 "--global-batch", "1024", "--seq", "8192", "--format", "json"]),
    ]
    for plan_file in ("gpt3-175b.json", "llama3-70b.json", "mixtral.json", "tiny-gpt.json", "mixed.json"):
        for target in ("torchtitan", "torchtitan-toml", "megatron", "deepspeed"):
            followers.append((f"export-{target}-{plan_file[:-5]}", ["export", plan_file, "--to", target]))
    followers.append(("export-deepspeed-file", ["export", "llama2-7b.json", "--to", "deepspeed", "-o", "ds.json"]))
    followers.append(("evaluate-deepspeed", ["evaluate", "--from", "deepspeed", "ds.json", "--model", "llama2-7b",
                                             "--cluster", "dgx-a100-80gb", "--gpus", "8", "--seq", "4096"]))
    return plans + followers


def traced_requests() -> list[tuple[str, dict]]:
    """Traced modules (no transformer spec): a chain and a skip-connected net."""
    import torch
    from torch import nn

    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 64)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.c(torch.relu(self.b(h)) + h)

    torch.manual_seed(0)
    chain = nn.Sequential(*[nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)) for _ in range(8)])
    return [
        ("traced-chain", dict(module=chain, example_inputs=(torch.randn(16, 128),), cluster="dgx-a100-80gb", gpus=8,
                              global_batch=256)),
        ("traced-chain-pp2", dict(module=chain, example_inputs=(torch.randn(16, 128),), cluster="cpu", gpus=4,
                                  global_batch=32, precision="fp32", fix={"pp": 2})),
        ("traced-skip", dict(module=Skip(), example_inputs=(torch.randn(8, 64),), cluster="cpu", gpus=2,
                             global_batch=8, precision="fp32")),
    ]


def _cli():
    for name in ("planner.console.cli", "planner.cli"):
        try:
            return importlib.import_module(name).main
        except ModuleNotFoundError:
            continue
    raise SystemExit("no shardwise CLI module found")


def run_all(out: Path) -> int:
    # Wide enough that no table wraps: a wrapped line moves with the search's wall time.
    os.environ["COLUMNS"] = "250"
    from click.testing import CliRunner

    from planner.api import plan_model

    main = _cli()
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    os.chdir(WORK)
    digests = {}
    for name, argv in requests():
        before = {p.name for p in WORK.iterdir()}
        result = CliRunner().invoke(main, argv, catch_exceptions=True)
        record = {"argv": argv, "exit_code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr}
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            record["exception"] = repr(result.exception)
        record["files"] = {p.name: p.read_text() for p in sorted(WORK.iterdir()) if p.name not in before}
        (out / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True))
        digests[name] = hashlib.sha256((out / f"{name}.json").read_bytes()).hexdigest()[:16]
        print(f"{name:40s} exit {result.exit_code}  {digests[name]}", flush=True)
    for name, kwargs in traced_requests():
        doc = plan_model(**kwargs)
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1, sort_keys=True))
        digests[name] = hashlib.sha256((out / f"{name}.json").read_bytes()).hexdigest()[:16]
        print(f"{name:40s} plan_model  {digests[name]}", flush=True)
    (out / "digests.json").write_text(json.dumps(digests, indent=1, sort_keys=True))
    print(f"{len(digests)} requests recorded in {out}")
    return 0


# What differs between two runs of the same code: the search's wall time, and the
# checkout's folder in the paths of the repository's test files (before and after are
# often two checkouts).
_SECONDS = re.compile(r"(gap [0-9.]+%, )[0-9.]+ s")
_CHECKOUT = re.compile(r"(?:/[\w.-]+)+?/(tests|configs)/")


def _digests(folder: Path) -> dict[str, str]:
    """Each request's digest, its search wall time and checkout folder masked."""
    out = {}
    for path in sorted(folder.glob("*.json")):
        if path.name != "digests.json":
            text = _SECONDS.sub(r"\1<seconds> s", path.read_text())
            text = _CHECKOUT.sub(r"<checkout>/\1/", text)
            out[path.stem] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


def compare(before: Path, after: Path) -> int:
    a, b = _digests(before), _digests(after)
    differ = sorted(name for name in a if a[name] != b.get(name))
    missing = sorted(set(a) ^ set(b))
    for name in differ:
        print(f"differs: {name}")
    for name in missing:
        print(f"only in one run: {name}")
    print(f"{len(a) - len(differ)} of {len(a)} requests byte-identical")
    return 1 if differ or missing else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="record every request's outputs in this folder")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if not args.out:
        parser.error("give --out or --compare")
    sys.exit(run_all(args.out.resolve()))
