"""Tables for people: the plan summary (`shardwise plan`) and the breakdowns
(`shardwise explain`), drawn with rich from a plan document."""

from __future__ import annotations

import itertools

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from costmodel.specs.training import precision_name
from costmodel.units import GIB


def _label(strategy: dict) -> str:
    s = strategy
    parts = [f"dp {s['dp']}", f"tp {s['tp']}", f"pp {s['pp']}"]
    if s.get("cp", 1) > 1:
        parts.append(f"cp {s['cp']}")
    if s["vpp"] > 1:
        parts.append(f"vpp {s['vpp']}")
    if s["ep"] > 1:
        parts.append(f"ep {s['ep']}")
    parts += [f"mbs {s['micro_batch_size']} x {s['num_microbatches']}", s["schedule"], f"zero {s['zero_stage']}",
              f"recompute {s['recompute']}", "sp" if s["sequence_parallel"] else "no sp"]
    if s.get("stage_groups"):
        parts.append("stages on " + "+".join(f"{name}x{len(list(run))}"
                                             for name, run in itertools.groupby(s["stage_groups"])))
    if s.get("replica_groups"):
        runs = itertools.groupby(zip(s["replica_groups"], s["replica_microbatches"]))
        parts[parts.index(f"mbs {s['micro_batch_size']} x {s['num_microbatches']}")] = f"mbs {s['micro_batch_size']}"
        parts.append("replicas " + " + ".join(f"{name} x{len(list(run))} of {m} micro-batches"
                                              for (name, m), run in runs))
    return ", ".join(parts)


def cluster_line(cluster: dict) -> str:
    """"16 x H100-SXM (2 nodes)", or each group's for a mixed cluster."""
    if "groups" in cluster:
        return " + ".join(cluster_line(g) for g in cluster["groups"]) + f" ({cluster['name']})"
    gpus = cluster["gpus_per_node"] * cluster["num_nodes"]
    return f"{gpus} x {cluster['gpu']['name']} ({cluster['num_nodes']} nodes)"


def print_plan(doc: dict, seconds: float, console: Console | None = None) -> None:
    console = console or Console()
    model, cluster = doc["model"], doc["cluster"]
    console.print(f"[bold]{model['name']}[/]{parameters_note(doc)} on {cluster_line(cluster)}, global batch "
                  f"{doc['training']['global_batch']} x {doc['training']['seq_len']} tokens, "
                  f"{precision_name(doc['training']['precision'], doc['training'].get('fp8'))}")
    banded = "band" in doc   # plans from before runtime profiles carry none
    docs = [doc] + [{**doc, **alternative} for alternative in doc["alternatives"]]
    _print_side_by_side(docs, [f"#{i + 1}" for i in range(len(docs))], "Plans, best first", console)
    if banded:
        console.print(band_line(doc))
    st = doc["search"]
    console.print(f"search: {st['candidates']} candidates, {st['pruned_memory']} pruned by memory, "
                  f"{st['pruned_bound']} by bound, {st['ilp_solves']} ILP solves, gap {st['gap']:.2%}"
                  f"{_timeouts(st)}, {seconds:.2f} s")


def parameters_note(doc: dict) -> str:
    """" (30.53B parameters, 3.35B active)"; plans written before the counts: ""."""
    if "total_params" not in doc:
        return ""
    def size(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

    total, active = doc["total_params"], doc["active_params"]
    return f" ({size(total)} parameters{f', {size(active)} active' if active != total else ''})"


def _timeouts(stats: dict) -> str:
    # Plans written before solver_timeouts was recorded have none to show.
    count = stats.get("solver_timeouts", 0)
    return f" ({count} solver time-outs)" if count else ""


def band_line(doc: dict) -> str:
    """What the band columns mean, with the runtime profile they come from."""
    runtime = doc.get("runtime", {})
    return (f"band: measured over estimated on runs the {runtime.get('name', 'runtime')} profile was not fitted on "
            f"(bench/calibrate_runtime.py); plans are checked at the memory band's high side unless "
            f"--memory-margin says otherwise")


def explain_tables(doc: dict) -> tuple[list[str], list[tuple[str, list[str], list[list[str]]]]]:
    """`explain`'s summary lines and tables (title, columns, rows of strings), shared by
    the terminal (rich) and the HTML report."""
    e, s = doc["estimate"], doc["strategy"]
    lines = [f"{doc['model']['name']}: {_label(s)}",
             f"step {e['step_time_s']:.3f} s, {e['tokens_per_s']:,.0f} tokens/s, "
             f"{e['tflops_per_gpu']:.1f} TFLOP/s per GPU, MFU {e['mfu']:.1%}, HFU {e['hfu']:.1%}"]
    if "band" in doc:
        b = doc["band"]
        lines.append(f"band: step {b['step_time_low_s']:.3f}-{b['step_time_high_s']:.3f} s, "
                     f"peak memory up to {b['peak_memory_high_bytes'] / GIB:.2f} GiB")
    runtime = doc.get("runtime")
    # Plans written before runtime profiles were priced as pytorch-native (plan_file.runtime_of).
    lines.append(f"runtime: {runtime['name']} v{runtime['version']}" if isinstance(runtime, dict)
                 else "runtime: pytorch-native (not recorded: a plan from before runtime profiles)")
    time_rows = [[key.removesuffix("_s"), f"{value:.3f}", f"{value / e['step_time_s']:.1%}"]
                 for key, value in e["time"].items()]
    mem_rows = [[key.removesuffix("_bytes"), f"{value / GIB:.2f}"] for key, value in e["memory"].items()]
    mem_rows.append(["total", f"{e['peak_memory_bytes'] / GIB:.2f}"])
    stage_rows = []
    groups = s.get("stage_groups") or ["+".join(dict.fromkeys(s.get("replica_groups", [])))] * s["pp"]
    for st in s["stages"]:
        r = st["pp_rank"]
        stage_rows.append([str(st["index"]), str(r), f"{st['first_layer']}-{st['first_layer'] + st['num_layers'] - 1}",
                           str(st["full_recompute_layers"]), str(st["selective_recompute_layers"]),
                           f"{e['rank_time_s'][r]:.4f}", f"{e['rank_memory_bytes'][r] / GIB:.1f}"]
                          + ([groups[r]] if "groups" in doc["cluster"] else []))
    tables = [
        ("Step time", ["term", "seconds", "share"], time_rows),
        (f"Memory of pipeline rank {e['peak_memory_rank']} (the peak)", ["term", "GiB"], mem_rows),
        ("Stages", ["stage", "pp rank", "layers", "full recompute", "selective", "rank s/micro-batch", "rank GiB"]
         + (["group"] if "groups" in doc["cluster"] else []), stage_rows),
    ]
    if s.get("replica_groups"):
        rows, first = [], 0
        times = e.get("replica_time_s") or [None] * len(s["replica_groups"])   # absent in hand-made plans
        for (name, m, t), run in itertools.groupby(zip(s["replica_groups"], s["replica_microbatches"], times)):
            count = len(list(run))
            label = str(first) if count == 1 else f"{first}-{first + count - 1}"
            rows.append([label, name, str(m), "-" if t is None else f"{t:.3f}"])
            first += count
        tables.append(("Replicas", ["replicas", "group", "micro-batches each", "seconds per step"], rows))
    return lines, tables


def print_explain(doc: dict, console: Console | None = None) -> None:
    console = console or Console()
    lines, tables = explain_tables(doc)
    console.print(f"[bold]{escape(lines[0])}[/]")
    for line in lines[1:]:
        console.print(line)
    for title, columns, rows in tables:
        table = Table(title=title)
        for i, col in enumerate(columns):
            # First column left (names) except in the all-numbers stage table.
            table.add_column(col, justify="left" if i == 0 and title != "Stages" else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)


def explain_html(doc: dict, png: bytes | None = None) -> str:
    """One self-contained HTML page: `explain`'s lines and tables, and the figure
    (planner.console.plots) embedded as a base64 PNG; no external assets."""
    import base64
    from html import escape as html_escape

    lines, tables = explain_tables(doc)
    parts = ["<!DOCTYPE html>", '<html><head><meta charset="utf-8">',
             f"<title>Shardwise plan: {html_escape(doc['model']['name'])}</title>",
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #bbb;padding:2px 8px}td{text-align:right}td:first-child{text-align:left}"
             "caption{font-weight:bold;text-align:left}</style></head><body>",
             f"<h1>{html_escape(lines[0])}</h1>"]
    parts += [f"<p>{html_escape(line)}</p>" for line in lines[1:]]
    for title, columns, rows in tables:
        parts.append(f"<table><caption>{html_escape(title)}</caption><tr>"
                     + "".join(f"<th>{html_escape(c)}</th>" for c in columns) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{html_escape(v)}</td>" for v in row) + "</tr>" for row in rows]
        parts.append("</table>")
    if png is not None:
        data = base64.b64encode(png).decode("ascii")
        parts.append(f'<img alt="pipeline timeline, memory per rank and time breakdown" '
                     f'src="data:image/png;base64,{data}">')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def compare_lines(docs: list[dict], names: list[str]) -> tuple[list[str], list[str], list[list[str]]]:
    """`compare`'s table (columns, rows: the strategy, the headline figures, every time
    and memory term, one column per plan) and the lines under it: what differs from the
    first plan and why the fastest wins (the terms that move by more than 0.5% of its step)."""
    from planner.interop.common import strategy_changes
    from planner.plan_file import strategy_of

    est = [d["estimate"] for d in docs]
    rows = [["model"] + [d["model"]["name"] for d in docs],
            ["GPUs"] + [str(strategy_of(d).num_gpus) for d in docs],
            ["strategy"] + [_label(d["strategy"]) for d in docs],
            ["step s"] + [f"{e['step_time_s']:.3f}" for e in est],
            ["tokens/s"] + [f"{e['tokens_per_s']:,.0f}" for e in est],
            ["TFLOP/s/GPU"] + [f"{e['tflops_per_gpu']:.1f}" for e in est],
            ["MFU"] + [f"{e['mfu']:.1%}" for e in est],
            ["peak GiB"] + [f"{e['peak_memory_bytes'] / GIB:.2f}" for e in est]]
    if all("band" in d for d in docs):   # plans from before runtime profiles carry none
        rows.insert(4, ["step s band"] + [f"{d['band']['step_time_low_s']:.3f}-{d['band']['step_time_high_s']:.3f}"
                                          for d in docs])
        rows.append(["up to GiB"] + [f"{d['band']['peak_memory_high_bytes'] / GIB:.2f}" for d in docs])
    for part, unit, scale in (("time", "s", 1.0), ("memory", "GiB", GIB)):
        keys = list(dict.fromkeys(k for e in est for k in e[part]))
        for key in keys:
            label = f"{part}: {key.removesuffix('_s').removesuffix('_bytes')} {unit}"
            rows.append([label] + [f"{e[part].get(key, 0.0) / scale:.3f}" if unit == "s" else
                                   f"{e[part].get(key, 0.0) / scale:.2f}" for e in est])
    lines = []
    first = strategy_of(docs[0])
    for name, doc in zip(names[1:], docs[1:]):
        changes = strategy_changes(first, strategy_of(doc))
        lines.append(f"{names[0]} → {name}: {', '.join(changes) if changes else 'the same strategy'}")
    best = min(range(len(docs)), key=lambda i: (est[i]["step_time_s"], i))
    for i, (name, e) in enumerate(zip(names, est)):
        if i == best:
            continue
        gap = e["step_time_s"] - est[best]["step_time_s"]
        moved = sorted(((e["time"][k] - est[best]["time"].get(k, 0.0), k) for k in e["time"]
                        if abs(e["time"][k] - est[best]["time"].get(k, 0.0)) > 0.005 * est[best]["step_time_s"]),
                       reverse=True)
        why = ", ".join(f"{k.removesuffix('_s')} {-d:+.3f} s" for d, k in moved) or "no single term"
        lines.append(f"{names[best]} is {gap:.3f} s per step faster than {name} "
                     f"({gap / e['step_time_s']:.1%}): {why}")
    return ["", *names], rows, lines


def print_compare(docs: list[dict], names: list[str], console: Console | None = None) -> None:
    _print_side_by_side(docs, names, "Plans side by side", console or Console())


def _print_side_by_side(docs: list[dict], names: list[str], title: str, console: Console) -> None:
    columns, rows, lines = compare_lines(docs, names)
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(escape(col), justify="left" if i == 0 else "right", overflow="fold")
    for row in rows:
        table.add_row(*(escape(c) for c in row))
    console.print(table)
    for line in lines:
        console.print(escape(line))
