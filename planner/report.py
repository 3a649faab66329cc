"""Tables for people: the plan summary (`shardwise plan`) and the breakdowns
(`shardwise explain`), drawn with rich from a plan document."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

GIB = 1 << 30


def _label(strategy: dict) -> str:
    s = strategy
    parts = [f"dp {s['dp']}", f"tp {s['tp']}", f"pp {s['pp']}"]
    if s["vpp"] > 1:
        parts.append(f"vpp {s['vpp']}")
    if s["ep"] > 1:
        parts.append(f"ep {s['ep']}")
    parts += [f"mbs {s['micro_batch_size']} x {s['num_microbatches']}", s["schedule"], f"zero {s['zero_stage']}",
              f"recompute {s['recompute']}", "sp" if s["sequence_parallel"] else "no sp"]
    return ", ".join(parts)


def print_plan(doc: dict, seconds: float, console: Console | None = None) -> None:
    console = console or Console()
    model, cluster = doc["model"], doc["cluster"]
    gpus = cluster["gpus_per_node"] * cluster["num_nodes"]
    console.print(f"[bold]{model['name']}[/] on {gpus} x {cluster['gpu']['name']} "
                  f"({cluster['num_nodes']} nodes), global batch {doc['training']['global_batch']} "
                  f"x {doc['training']['seq_len']} tokens, {doc['training']['precision']}")
    table = Table(title="Plans, best first")
    for col in ("#", "strategy", "step s", "tokens/s", "TFLOP/s/GPU", "MFU", "peak GiB"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for i, cand in enumerate([doc] + doc["alternatives"]):
        e = cand["estimate"]
        table.add_row(str(i + 1), _label(cand["strategy"]), f"{e['step_time_s']:.3f}", f"{e['tokens_per_s']:,.0f}",
                      f"{e['tflops_per_gpu']:.1f}", f"{e['mfu']:.1%}", f"{e['peak_memory_bytes'] / GIB:.1f}")
    console.print(table)
    st = doc["search"]
    console.print(f"search: {st['candidates']} candidates, {st['pruned_memory']} pruned by memory, "
                  f"{st['pruned_bound']} by bound, {st['ilp_solves']} ILP solves, gap {st['gap']:.2%}, "
                  f"{seconds:.2f} s")


def print_explain(doc: dict, console: Console | None = None) -> None:
    console = console or Console()
    e, s = doc["estimate"], doc["strategy"]
    console.print(f"[bold]{doc['model']['name']}[/]: {_label(s)}")
    console.print(f"step {e['step_time_s']:.3f} s, {e['tokens_per_s']:,.0f} tokens/s, "
                  f"{e['tflops_per_gpu']:.1f} TFLOP/s per GPU, MFU {e['mfu']:.1%}, HFU {e['hfu']:.1%}")
    time_table = Table(title="Step time")
    time_table.add_column("term")
    time_table.add_column("seconds", justify="right")
    time_table.add_column("share", justify="right")
    for key, value in e["time"].items():
        time_table.add_row(key.removesuffix("_s"), f"{value:.3f}", f"{value / e['step_time_s']:.1%}")
    console.print(time_table)
    mem_table = Table(title=f"Memory of pipeline rank {e['peak_memory_rank']} (the peak)")
    mem_table.add_column("term")
    mem_table.add_column("GiB", justify="right")
    for key, value in e["memory"].items():
        mem_table.add_row(key.removesuffix("_bytes"), f"{value / GIB:.2f}")
    mem_table.add_row("total", f"{e['peak_memory_bytes'] / GIB:.2f}")
    console.print(mem_table)
    stages = Table(title="Stages")
    for col in ("stage", "pp rank", "layers", "full recompute", "selective", "rank s/micro-batch", "rank GiB"):
        stages.add_column(col, justify="right")
    for st in s["stages"]:
        r = st["pp_rank"]
        stages.add_row(str(st["index"]), str(r), f"{st['first_layer']}-{st['first_layer'] + st['num_layers'] - 1}",
                       str(st["full_recompute_layers"]), str(st["selective_recompute_layers"]),
                       f"{e['rank_time_s'][r]:.4f}", f"{e['rank_memory_bytes'][r] / GIB:.1f}")
    console.print(stages)
