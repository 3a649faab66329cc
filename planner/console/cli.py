"""The `shardwise` command line: `plan` searches for the best parallel strategy and
writes a plan file, `explain` prints a plan file's breakdowns, `replan` plans a plan
file's job on another size or cluster, `sweep` plans a job at a range of sizes and
compares them (capacity planning), `export` writes a plan as
torchtitan / Megatron-LM / DeepSpeed configuration, `evaluate` prices such a
configuration beside the best plan, `run` trains with a plan, `profile` measures this
machine and fits a cluster spec (the executor is imported only by those two).

Exit codes: 0 ok, 2 bad input (one line naming the field), 3 nothing feasible (the
binding constraint with its numbers and a relaxation that would make a plan exist).
"""

from __future__ import annotations

import os
import sys

import click

# Only what every command needs: the search, torch, the solver, rich and matplotlib are
# imported by the command that uses them, so that `--help` and bad input answer at once.
from costmodel.specs.loading import SpecError, as_float, as_int, parse_overrides
from costmodel.units import GIB

EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3


def _fail(code: int, message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def training_options(command):
    """The training run's options, as `plan` and `sweep` take them: --seq, --precision,
    --optimizer, --attention, --runtime."""
    for option in reversed([
        click.option("--seq", metavar="INT>=1", type=str, default=None,
                     help="Sequence length [default: the model's max_position_embeddings]."),
        click.option("--precision", default="bf16", show_default=True,
                     help="bf16 | fp16 (mixed, fp32 master weights) | fp32 | fp8 | fp8-rowwise | fp8-blockwise | "
                          "mxfp8 (bf16 with the layers' linear GEMMs in FP8: one scale a tensor, a row, a 1x128 "
                          "tile, or MX's 32 values on Blackwell)."),
        click.option("--optimizer", default="adamw", show_default=True, help="adam | adamw | sgd."),
        click.option("--attention", type=click.Choice(["flash", "eager"]), default="flash", show_default=True,
                     help="Attention kernel: flash keeps no score matrix."),
        click.option("--runtime", "runtime_name", default="pytorch-native", show_default=True,
                     help="The engine that runs the plan: a runtime profile (configs/runtimes/: pytorch-native, "
                          "megatron, deepspeed-zero) or a YAML path. It sets collective overlap, bandwidth by "
                          "message size, kernel efficiency and fixed costs."),
        click.option("--compile/--no-compile", "compile_blocks", default=None,
                     help="Price (and have `shardwise run` use) torch.compile on each transformer block "
                          "[default: the runtime profile's torch_compile; pytorch-native: eager]."),
        click.option("--runtime-set", "runtime_settings", default=None, metavar="KEY=VALUE,...",
                     help="Engine settings over the runtime profile's, priced and recorded in the plan for "
                          "`shardwise run`: fsdp_prefetch (FSDP2 units gathered ahead, >= 1), "
                          "fsdp_kept_gathered (none | head | root), ddp_bucket_mb, async_tp (CUDA with "
                          "--compile), chunked_loss, selective_recompute (op-level | attention-core), "
                          "torch_compile. E.g. fsdp_prefetch=2,ddp_bucket_mb=100."),
    ]):
        command = option(command)
    return command


class _Shardwise(click.Group):
    """click's group, with click's own usage errors (a bad choice, a missing or unknown
    option) said as every other bad input is: one line naming the field, exit 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.exceptions.NoArgsIsHelpError as err:   # bare `shardwise`: the help, as click says it
            click.echo(err.ctx.get_help())
            sys.exit(0)
        except click.UsageError as err:
            _fail(EXIT_BAD_INPUT, _usage_line(err))
        except click.ClickException as err:
            _fail(err.exit_code, err.format_message())
        except click.Abort:
            _fail(1, "aborted")
        sys.exit(code if isinstance(code, int) else 0)


def _usage_line(err: click.UsageError) -> str:
    param = getattr(err, "param", None)
    if param is not None:
        field = param.opts[0] if getattr(param, "opts", None) else param.name.upper()
    else:
        field = getattr(err, "option_name", None) or (err.ctx.command.name if err.ctx else "shardwise")
    message = err.message if isinstance(err, click.BadParameter) and not isinstance(err, click.MissingParameter) \
        else err.format_message()
    command = err.ctx.command_path if err.ctx else "shardwise"
    return f"{field}: {' '.join(message.split())} (see {command} --help)"


@click.group(cls=_Shardwise, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shardwise", prog_name="shardwise", message="%(prog)s %(version)s")
def main() -> None:
    """Shardwise plans how to split a model's training over GPUs: data, tensor and
    pipeline parallel degrees, micro-batching, schedule, ZeRO stage and recomputation.

    \b
    Example:
      shardwise plan --model gpt3-175b --cluster dgx-a100-80gb --nodes 16 --global-batch 1536
    """


@main.command()
@click.option("--model", "model_name", required=True, help="Built-in model (gpt3-175b, llama3-70b, ...) or a YAML/JSON spec or Hugging Face config.json path.")
@click.option("--cluster", "cluster_name", required=True,
              help="Built-in cluster (dgx-a100-80gb, dgx-h100, ...; mixed: mixed-h100-a100, ...) or a YAML path. "
                   "A mixed cluster (groups of node types) is sized by its file: no --nodes/--gpus.")
@click.option("--nodes", metavar="INT>=1", type=str, default=None, help="Number of nodes.")
@click.option("--gpus", type=str, metavar="INT>=1", default=None, help="Number of GPUs (instead of --nodes).")
@click.option("--global-batch", metavar="INT>=1", required=True, type=str, help="Global batch in sequences.")
@training_options
@click.option("--rules", "rules_name", default=None, help="Rule set: built-in (default, megatron, fsdp) or a YAML path.")
@click.option("--fix", default=None, help="Pin knobs: dp=,tp=,pp=,vpp=,ep=,cp=,mbs=,zero=,recompute=none|selective|full,sp=on|off,schedule=gpipe|1f1b|interleaved|zb-interleaved|zbv|dualpipev (cp: context-parallel ranks splitting each sequence).")
@click.option("--set", "overrides", default=None, help="Override model fields: key=value,...")
@click.option("--profile", "profile_file", default=None,
              help="A `shardwise profile --model` JSON of this model, --seq, --precision and --attention: its "
                   "measured layer, embedding and head times replace the analytic ones, interpolated between "
                   "measured micro-batch sizes and tp widths; shapes it does not cover stay analytic.")
@click.option("--top", metavar="INT>=1", default="3", show_default=True, help="Plans to report: the best and the next alternatives.")
@click.option("--objective", default=None,
              help="time | memory | cost (USD per step, from the cluster's gpu_hour_price_usd) | energy (J per "
                   "step, from the GPU's busy_power_w and idle_power_w) [default: the rules', else time].")
@click.option("--max-cost-per-step", "max_cost", metavar="USD>0", default=None, help="Drop plans costing more than this many USD per step.")
@click.option("--power-cap", "power_cap", metavar="WATTS>0", default=None,
              help="Drop plans whose busiest GPU averages more than this many watts over a step.")
@click.option("--energy-budget", "energy_budget", metavar="JOULES>0", default=None,
              help="Drop plans using more than this many joules per step (all GPUs).")
@click.option("--pareto", is_flag=True, default=False,
              help="Solve every candidate that fits and list those no other beats on all of step time, cost and energy.")
@click.option("--memory-margin", "memory_margin", metavar="FLOAT>=0", default=None,
              help="A plan fits when its estimated peak memory x (1 + this) is within the device's usable memory "
                   "[default: the rules' memory_margin, else the runtime profile's measured memory band, "
                   "memory_high_ratio - 1]. 0 checks the estimate itself.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("-o", "--output", default=None, help="Write the plan file here.")
def plan(model_name, cluster_name, nodes, gpus, global_batch, seq, precision, optimizer, attention, runtime_name,
         compile_blocks, runtime_settings, rules_name, fix, overrides, profile_file, top, objective, max_cost, power_cap, energy_budget, pareto,
         memory_margin, fmt, output) -> None:
    """Find the best strategy that fits (fastest, or by --objective), and write it as a plan file."""
    from planner.api import make_problem, make_rules
    from planner.console.progress import progress_bar
    from planner.console.report import print_plan
    from planner.plan_file import dumps, plan_document, write_plan
    from planner.rules import parse_fix
    from planner.search import Infeasible, search, suggest_relaxation

    try:
        _check_outputs(("-o", output))
        problem = make_problem(model_name, cluster_name, global_batch, nodes=nodes, gpus=gpus, seq_len=seq,
                               precision=precision, optimizer=optimizer, flash_attention=attention == "flash",
                               overrides=parse_overrides(overrides), fix=parse_fix(fix), profile=profile_file,
                               runtime=runtime_name, compile=compile_blocks, runtime_settings=runtime_settings)
        rules = make_rules(rules_name, parse_fix(fix), objective=objective,
                           budgets={"max_cost_per_step_usd": max_cost, "power_cap_w": power_cap,
                                    "energy_budget_j": energy_budget}, memory_margin=memory_margin)
        top_k = as_int(top, "--top")
        with progress_bar("searching") as progress:
            result = search(problem, rules, top=top_k, progress=progress, pareto=pareto)
    except SpecError as err:
        _fail(EXIT_BAD_INPUT, str(err))
    except Infeasible as err:
        if err.solver_limited:   # the reason says what helps (--fix)
            _fail(EXIT_INFEASIBLE, f"no feasible plan: {err.reason}")
        relax = err.relaxation or suggest_relaxation(problem, rules)
        hint = f"; would fit if you {relax}" if relax else "; no relaxation up to 16x the GPUs helps"
        _fail(EXIT_INFEASIBLE, f"no feasible plan: {err.reason}{hint}")
    doc = plan_document(problem, rules.name, result)
    if result.stats.solver_timeouts:
        click.echo(f"warning: the solver's time limit ended {result.stats.solver_timeouts} partition "
                   f"program(s) before they were proven optimal; the best plan is within "
                   f"{result.stats.gap:.2%} of the best of the space (the reported gap)", err=True)
    if problem.measured_times is not None:
        best = result.best.strategy
        click.echo(f"profile {profile_file}: {problem.measured_times.describe()}", err=True)
        analytic = problem.measured_times.uncovered(best.micro_batch_size, best.tp)
        if analytic:
            click.echo(f"profile {profile_file}: no measured {', '.join(analytic)} at micro-batch "
                       f"{best.micro_batch_size}, tp {best.tp} (the best plan's shape): priced by the analytic model",
                       err=True)
    if output:
        _or_fail(write_plan, doc, output)
    if fmt == "json":
        click.echo(dumps(doc), nl=False)
    else:
        print_plan(doc, result.stats.seconds)
        _print_cost_energy(doc)
        if output:
            click.echo(f"plan written to {output}")


def _print_cost_energy(doc: dict) -> None:
    """The best plan's cost and energy, and the Pareto table when there is one."""
    from rich.console import Console
    from rich.table import Table

    from planner.console.report import _label

    figures = doc.get("cost_energy", {})
    if figures:
        parts = []
        if "cost_per_step_usd" in figures:
            parts.append(f"${figures['cost_per_step_usd']:.4g} per step")
        if "energy_per_step_j" in figures:
            parts.append(f"{figures['energy_per_step_j'] / 1e3:.4g} kJ per step, "
                         f"{figures['average_power_w']:.0f} W average per GPU, "
                         f"{figures['max_device_power_w']:.0f} W on the busiest")
        click.echo("best plan: " + ", ".join(parts))
    if doc.get("pareto"):
        table = Table(title="Pareto front: no other plan beats these on all of step time, cost and energy")
        for col in ("#", "strategy", "step s", "USD/step", "kJ/step", "W/GPU avg"):
            table.add_column(col, justify="left" if col == "strategy" else "right")
        for i, cand in enumerate(doc["pareto"]):
            f = cand["cost_energy"]
            table.add_row(str(i + 1), _label(cand["strategy"]), f"{cand['estimate']['step_time_s']:.4g}",
                          f"{f['cost_per_step_usd']:.4g}", f"{f['energy_per_step_j'] / 1e3:.4g}",
                          f"{f['average_power_w']:.0f}")
        Console().print(table)


@main.command()
@click.option("--model", "model_name", required=True, help="Built-in model or a spec / config.json path, as for `plan`.")
@click.option("--cluster", "cluster_name", required=True, help="Built-in cluster or a YAML path, as for `plan`.")
@click.option("--gpus", "sizes", required=True,
              help="Sizes to plan: A..B doubles from A to B (8..1024: 8, 16, ..., 1024), or a list 8,16,48 "
                   "(items mix: 8..64,96).")
@click.option("--global-batch", metavar="INT>=1", required=True, type=str, help="Global batch in sequences, the same at every size.")
@training_options
@click.option("--set", "overrides", default=None, help="Override model fields: key=value,...")
@click.option("--rules", "rules_name", default=None, help="Rule set, as for `plan`.")
@click.option("--fix", default=None, help="Pin knobs at every size, as for `plan`.")
@click.option("--objective", default=None, help="time | memory | cost | energy, as for `plan`.")
@click.option("--tokens", metavar="FLOAT>0", default=None,
              help="Token budget of the training run (300e9): adds the time, cost (USD) and energy to train it "
                   "at each size.")
@click.option("--plot", "plot_file", default=None,
              help="Also draw tokens/s against GPUs with ideal linear scaling, the scaling efficiency and, with "
                   "--tokens, the days to train, as one PNG here.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("-o", "--output", default=None, help="Write the rows as JSON here.")
def sweep(model_name, cluster_name, sizes, global_batch, seq, precision, optimizer, attention, runtime_name,
          compile_blocks, runtime_settings, overrides, rules_name, fix, objective, tokens, plot_file, fmt, output) -> None:
    """Capacity planning: plan the same job at each cluster size, as `plan --gpus N`
    would, and compare the sizes: throughput, scaling efficiency (tokens/s per GPU
    against the smallest size that plans) and, with --tokens, the time, cost and
    energy to train that many tokens. A size that cannot be built or where nothing
    fits is a row saying why; exit 3 when no size plans.

    \b
    shardwise sweep --model llama3-70b --cluster dgx-h100 --gpus 8..1024 --global-batch 1024 --seq 8192 \\
        --rules megatron --tokens 300e9 --plot sweep.png
    shardwise sweep --model llama2-7b --cluster dgx-a100-80gb --gpus 8,16,32 --global-batch 64 --format json
    """
    import json

    from planner.console.progress import progress_bar
    from planner.workflows.sweep import IMPOSSIBLE, OK, parse_sizes
    from planner.workflows.sweep import sweep as sweep_rows

    try:
        gpus = parse_sizes(sizes)
        _check_outputs(("--plot", plot_file), ("-o", output))
        with progress_bar("sweep") as update:
            def tick(done: int, total: int) -> None:   # label the bar with the size planned next
                update(done, total, f"planning {gpus[done]} GPUs" if done < total else "sweep")

            tick(0, len(gpus))
            rows = sweep_rows(model_name, cluster_name, gpus, global_batch, seq_len=seq, precision=precision,
                              optimizer=optimizer, flash_attention=attention == "flash",
                              overrides=parse_overrides(overrides), rules=rules_name, fix=fix, objective=objective,
                              tokens=tokens, progress=tick, runtime=runtime_name, compile=compile_blocks,
                              runtime_settings=runtime_settings)
    except SpecError as err:
        _fail(EXIT_BAD_INPUT, str(err))
    planned = [r for r in rows if r.status == OK]
    if not planned and all(r.status == IMPOSSIBLE for r in rows):
        _fail(EXIT_BAD_INPUT, rows[0].reason)   # bad at every size: bad input, not a capacity answer
    budget = float(tokens) if tokens is not None else None   # checked by sweep_rows
    document = {"model": planned[0].plan["model"]["name"] if planned else model_name,
                "cluster": planned[0].plan["cluster"]["name"] if planned else cluster_name,
                "tokens": budget, "rows": [r.as_dict() for r in rows]}
    text = json.dumps(document, sort_keys=True, indent=2) + "\n"
    written = []
    if plot_file and planned:
        from planner.console.plots import sweep_png_bytes

        t = planned[0].plan["training"]
        title = f"{document['model']} on {document['cluster']}, global batch {t['global_batch']} x {t['seq_len']} tokens"
        _write_aside("--plot", plot_file, sweep_png_bytes(rows, title, budget))
        written.append(f"plot written to {plot_file}")
    if output:
        _write_aside("-o", output, text.encode())
        written.append(f"sweep written to {output}")
    if fmt == "json":
        click.echo(text, nl=False)
    else:
        _print_sweep(rows, budget)
    for line in written:
        click.echo(line, err=fmt == "json")   # stdout holds only the JSON document
    if not planned:
        _fail(EXIT_INFEASIBLE, f"no size plans: {'; '.join(f'{r.gpus} GPUs: {r.reason}' for r in rows)}")


def _check_outputs(*pairs: tuple[str, str | None]) -> None:
    """Every (option, path) given can be written (planner.outputs.check_writable) and a
    --plot is a PNG: checked before the work, so a bad path costs nothing."""
    from planner.outputs import check_writable

    for option, path in pairs:
        if path is None:
            continue
        check_writable(path, option)
        if option == "--plot" and not str(path).lower().endswith(".png"):
            raise SpecError("--plot", f"{path}: the figure is drawn as PNG; give a .png path")


def _or_fail(write, *args) -> None:
    """Run a writer; a SpecError it raises (a disk that filled since the check) exits 2."""
    try:
        write(*args)
    except SpecError as err:
        _fail(EXIT_BAD_INPUT, str(err))


def _write_aside(option: str, path: str, data: bytes | str) -> None:
    """Write aside, then rename: never half a file; exit 2 naming `option` if it cannot."""
    from planner.outputs import write_atomic

    _or_fail(write_atomic, path, data, option)


def _print_sweep(rows, tokens: float | None) -> None:
    """The sweep as rich tables (the sizes; with a token budget, what training it takes
    at each), then why each size without a plan has none."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from costmodel.specs.training import precision_name


    def table(title: str, columns: list[str]) -> Table:
        out = Table(title=title, box=box.SIMPLE_HEAD)
        for col in columns:   # the strategy wraps on a narrow terminal, the figures do not
            out.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=col != "strategy",
                           overflow="fold" if col == "strategy" else "ellipsis")
        return out

    planned = [r for r in rows if r.plan is not None]
    if planned:
        doc = planned[0].plan
        t = doc["training"]
        click.echo(f"{doc['model']['name']} on {doc['cluster']['gpu']['name']} ({doc['cluster']['name']}), "
                   f"global batch {t['global_batch']} x {t['seq_len']} tokens, "
                   f"{precision_name(t['precision'], t.get('fp8'))}, rules {doc['rules']}")
    sizes = table("Plans by size", ["GPUs", "strategy", "step s", "tokens/s", "per GPU", "scaling", "MFU", "peak GiB"])
    for r in rows:
        if r.plan is None:
            sizes.add_row(str(r.gpus), f"no plan: {r.status}", *[""] * 6)
        else:
            sizes.add_row(str(r.gpus), r.strategy, f"{r.step_time_s:.3f}", f"{r.tokens_per_s:,.0f}",
                          f"{r.tokens_per_s_per_gpu:,.0f}", f"{r.scaling_efficiency:.1%}", f"{r.mfu:.1%}",
                          f"{r.peak_memory_bytes / GIB:.1f}")
    console = Console()
    console.print(sizes)
    if tokens is not None and planned:
        train = table(f"Training {tokens:.3g} tokens", ["GPUs", "steps", "days", "USD", "MWh"])
        for r in planned:
            train.add_row(str(r.gpus), f"{r.train_steps:,.0f}", f"{r.train_time_s / 86400:.3g}",   # 86400 s a day
                          f"{r.train_cost_usd:,.0f}" if r.train_cost_usd is not None else "-",
                          f"{r.train_energy_j / 3.6e9:.3g}" if r.train_energy_j is not None else "-")   # 3.6e9 J a MWh
        console.print(train)
    for r in rows:
        if r.plan is None:
            click.echo(f"{r.gpus} GPUs: {r.reason}")


@main.command()
@click.argument("plan_file")
@click.option("--plot", "plot_file", default=None,
              help="Also draw the pipeline timeline per rank, memory per rank against capacity and the time "
                   "breakdown, as one PNG here.")
@click.option("--html", "html_file", default=None,
              help="Also write one self-contained HTML page here: the tables and the figure, embedded.")
def explain(plan_file, plot_file, html_file) -> None:
    """Print a plan file's strategy, stages and time and memory breakdowns.

    \b
    shardwise explain plan.json --plot plan.png --html plan.html
    """
    import os

    from planner.console.report import print_explain
    from planner.plan_file import read_plan

    try:
        doc = read_plan(plan_file)
        _check_outputs(("--plot", plot_file), ("--html", html_file))
        if plot_file and html_file and os.path.abspath(plot_file) == os.path.abspath(html_file):
            raise SpecError("--html", "the same path as --plot")
    except SpecError as err:
        _fail(EXIT_BAD_INPUT, str(err))
    print_explain(doc)
    if not (plot_file or html_file):
        return

    from rich.console import Console

    from planner.console.plots import figure_png_bytes
    from planner.console.report import explain_html

    with Console(stderr=True).status("drawing the timeline, memory and time breakdown"):
        png = figure_png_bytes(doc)
    for option, path, data in (("--plot", plot_file, png),
                               ("--html", html_file, explain_html(doc, png).encode() if html_file else None)):
        if not path:
            continue
        _write_aside(option, path, data)
        click.echo(f"{option.removeprefix('--')} written to {path}")


@main.command()
@click.argument("plan_file")
@click.option("--gpus", type=str, metavar="INT>=1", default=None, help="The new number of GPUs.")
@click.option("--nodes", metavar="INT>=1", type=str, default=None, help="The new number of nodes (instead of --gpus).")
@click.option("--cluster", "cluster_name", default=None,
              help="A new cluster (built-in or YAML), sized by --nodes/--gpus or else by its file "
                   "[default: the plan's own cluster, resized].")
@click.option("--rules", "rules_name", default=None, help="Rule set [default: the plan's, when it is a built-in].")
@click.option("--fix", default=None, help="Pin knobs, as for `plan` (the plan file does not record its pins).")
@click.option("--top", metavar="INT>=1", default="3", show_default=True, help="Plans to report: the best and the next alternatives.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("-o", "--output", default=None, help="Write the new plan file here.")
def replan(plan_file, gpus, nodes, cluster_name, rules_name, fix, top, fmt, output) -> None:
    """Plan the same job (model, sequence length, precision, optimizer, attention and
    global batch) on another size or cluster. The global batch is kept when a plan
    exists for it; otherwise the nearest batch that plans is taken (ties: the larger)
    and the notes say so, with what changed in the strategy and the estimate.

    \b
    shardwise replan plan.json --gpus 64 -o plan-64.json
    shardwise replan plan.json --nodes 12
    shardwise replan plan.json --cluster dgx-h100 --nodes 4 --rules megatron
    """
    import time

    from planner.console.progress import progress_bar
    from planner.console.report import print_plan
    from planner.plan_file import dumps, read_plan, write_plan
    from planner.search import suggest_relaxation
    from planner.workflows.replan import NoPlan
    from planner.workflows.replan import replan as replan_doc

    started = time.perf_counter()
    try:
        _check_outputs(("-o", output))
        with progress_bar("searching") as progress:
            doc, notes = replan_doc(read_plan(plan_file), gpus=gpus, nodes=nodes, cluster=cluster_name,
                                    rules=rules_name, fix=fix, top=as_int(top, "--top"), progress=progress)
    except SpecError as err:
        _fail(EXIT_BAD_INPUT, str(err))
    except NoPlan as err:
        relax = suggest_relaxation(err.problem, err.rules)
        hint = f"; would fit if you {relax}" if relax else "; no relaxation up to 16x the GPUs helps"
        _fail(EXIT_INFEASIBLE, f"no feasible plan: {err.reason}{hint}")
    if output:
        _or_fail(write_plan, doc, output)
    if fmt == "json":
        for note in notes:   # stdout holds only the plan document
            click.echo(f"note: {note}", err=True)
        click.echo(dumps(doc), nl=False)
        return
    for note in notes:
        click.echo(note)
    print_plan(doc, time.perf_counter() - started)
    if output:
        click.echo(f"plan written to {output}")


@main.command()
@click.argument("plan_file")
@click.option("--to", "target", required=True, type=click.Choice(["torchtitan", "torchtitan-toml", "megatron", "deepspeed"]),
              help="torchtitan: command-line overrides for its Python-config releases (0.3); torchtitan-toml: the "
                   "sections of an older (0.2) job TOML; megatron: Megatron-LM arguments; deepspeed: a config JSON.")
@click.option("-o", "--output", default=None, help="Write the configuration here [default: stdout].")
@click.option("--allow-changes", is_flag=True,
              help="Write the configuration even where the engine would run something other than the plan "
                   "(each change is said on stderr); without it such an export exits 3.")
def export(plan_file, target, output, allow_changes) -> None:
    """Write a plan as another engine's configuration. What the engine cannot express
    (an uneven partition, per-stage recompute, a ZeRO stage it lacks, a degree it sets
    in code) is said on stderr, one `warning:` line each; nothing is dropped silently.
    Where the configuration read back is another strategy than the plan's, the export
    exits 3 unless --allow-changes is given.

    \b
    shardwise export plan.json --to torchtitan        # paste after torchtitan/train.py --module M --config C
    shardwise export plan.json --to torchtitan-toml -o job.toml
    shardwise export plan.json --to megatron          # arguments for pretrain_gpt.py
    shardwise export plan.json --to deepspeed -o ds_config.json
    """
    from planner.interop.export import export_plan
    from planner.plan_file import read_plan

    try:
        _check_outputs(("-o", output))
        exported = export_plan(read_plan(plan_file), target)
    except SpecError as err:
        _fail(EXIT_BAD_INPUT, str(err))
    for warning in exported.warnings:
        click.echo(f"warning: {warning}", err=True)
    if exported.changes and not allow_changes:
        _fail(EXIT_INFEASIBLE, f"--to {target}: the engine would not run this plan as planned ({exported.changes[0]}); "
                               f"--allow-changes writes it anyway, or plan again under rules the engine can run "
                               f"(--rules megatron, --rules fsdp)")
    if output:
        _write_aside("-o", output, exported.text)
        click.echo(f"{target} configuration written to {output}", err=True)
    else:
        click.echo(exported.text, nl=False)


@main.command()
@click.option("--from", "source", required=True, nargs=2,
              type=(click.Choice(["torchtitan", "megatron", "deepspeed"]), str), metavar="ENGINE CONFIG",
              help="The engine (torchtitan, megatron, deepspeed) and its configuration: quoted arguments or a file.")
@click.option("--model", "model_name", required=True, help="The model, as for `plan`.")
@click.option("--cluster", "cluster_name", required=True, help="The cluster, as for `plan`.")
@click.option("--nodes", metavar="INT>=1", type=str, default=None, help="Number of nodes.")
@click.option("--gpus", type=str, metavar="INT>=1", default=None, help="Number of GPUs (instead of --nodes).")
@click.option("--global-batch", metavar="INT>=1", default=None, help="Global batch in sequences, where the configuration does not say it.")
@click.option("--seq", metavar="INT>=1", default=None, help="Sequence length, where the configuration does not say it "
                                          "[default: the model's max_position_embeddings].")
@click.option("--precision", default=None, help="bf16 | fp16 | fp32 | fp8 | fp8-rowwise | fp8-blockwise | mxfp8, where "
                                                "the configuration does "
                                                "not say it (torchtitan 0.3 overrides cannot say FP8) [default: bf16].")
@click.option("--optimizer", default="adamw", show_default=True, help="adam | adamw | sgd.")
@click.option("--attention", type=click.Choice(["flash", "eager"]), default="flash", show_default=True,
              help="Attention kernel: flash keeps no score matrix.")
@click.option("--runtime", "runtime_name", default=None,
              help="Runtime profile to price with [default: the engine's: megatron for megatron, deepspeed-zero "
                   "for deepspeed, pytorch-native for torchtitan].")
@click.option("--rules", "rules_name", default=None, help="Rule set the best plan must obey, as for `plan`.")
@click.option("--fix", default=None, help="Pin knobs of the best plan, as for `plan`.")
@click.option("--set", "overrides", default=None, help="Override model fields: key=value,...")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def evaluate(source, model_name, cluster_name, nodes, gpus, global_batch, seq, precision, optimizer,
             attention, runtime_name, rules_name, fix, overrides, fmt) -> None:
    """Predict what the configuration you run today does, beside the best plan found
    under the same rules: what to change and which time and memory terms shrink.
    CONFIG is torchtitan overrides (quoted) or a job TOML, Megatron-LM arguments
    (quoted; a whole command line is fine) or a file of them, or a DeepSpeed JSON.
    The configuration's batch, sequence length and precision win; --global-batch,
    --seq and --precision fill in what it does not say and must agree with what it does.

    \b
    shardwise evaluate --from megatron "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 \\
        --micro-batch-size 1 --global-batch-size 1536 --seq-length 2048 --bf16" \\
        --model gpt3-175b --cluster dgx-a100-80gb --nodes 16
    shardwise evaluate --from torchtitan "--parallelism.tensor_parallel_degree 8 --training.local_batch_size 2" \\
        --model llama3-70b --cluster dgx-h100 --nodes 8 --global-batch 1024 --seq 8192
    shardwise evaluate --from deepspeed ds_config.json --model llama2-7b --cluster dgx-a100-80gb --gpus 8 --seq 4096
    """
    from planner.interop.evaluate import (
        band_line,
        evaluate_config,
        evaluation_document,
        memory_line,
        reason_lines,
        summary_line,
    )
    from planner.plan_file import dumps
    from planner.rules import load_rules, parse_fix

    source, config = source
    try:
        pins = parse_fix(fix)
        ev = evaluate_config(source, config, model_name, cluster_name, nodes=nodes, gpus=gpus,
                             global_batch=global_batch, seq=seq, precision=precision, optimizer=optimizer,
                             flash_attention=attention == "flash", overrides=parse_overrides(overrides),
                             rules=load_rules(rules_name).with_fix(pins), pins=pins, runtime=runtime_name)
    except SpecError as err:
        _fail(EXIT_BAD_INPUT, str(err))
    for warning in ev.warnings:
        click.echo(f"warning: {warning}", err=True)
    if fmt == "json":
        click.echo(dumps(evaluation_document(ev)), nl=False)
        return
    click.echo(summary_line(ev))
    click.echo(band_line(ev))
    if memory_line(ev):
        click.echo(memory_line(ev))
    reasons = reason_lines(ev)
    if reasons:
        click.echo("why (yours → best):")
        for line in reasons:
            click.echo(f"  {line}")


@main.command()
@click.argument("plan_file")
@click.option("--steps", metavar="INT>=1", default="10", show_default=True, help="The step to train to, counted from the start of training: a run resumed from a checkpoint at "
                   "step 40 with --steps 100 trains 60 more (the learning-rate schedule spans all 100).")
@click.option("--model", "model_name", default=None, help="Refuse the plan unless it was made for this model.")
@click.option("--data", default="synthetic", show_default=True,
              help="synthetic (seeded random tokens) | corpus (the built-in text, byte tokens) | a .txt path.")
@click.option("--seed", metavar="INT>=0", default="0", show_default=True, help="Seed of the weights and the data.")
@click.option("--lr", metavar="FLOAT>0", default=None, help="Peak learning rate [default: 1e-3, warm-up then cosine].")
@click.option("--metrics-out", default=None, help="Write one JSON line per step and a closing summary here.")
@click.option("--nproc-per-node", metavar="INT>=1", default=None, help="Processes on this node [default: the plan's GPUs / --nnodes].")
@click.option("--nnodes", metavar="INT>=1", default="1", show_default=True, help="Nodes taking part; each runs this same command.")
@click.option("--node-rank", metavar="INT>=0", default="0", show_default=True, help="This node's index (0 .. nnodes-1).")
@click.option("--rdzv-endpoint", default=None, help="host:port of node 0, for --nnodes > 1.")
@click.option("--rdzv-id", default="shardwise", show_default=True, help="Job id shared by the nodes.")
@click.option("--checkpoint-dir", default=None,
              help="Save checkpoints here (DCP, one directory per step, published atomically); a run started "
                   "again with the same directory resumes from its newest good checkpoint.")
@click.option("--checkpoint-every", metavar="INT>=0", default="0", show_default=True,
              help="Steps between checkpoints (0: only after the last step).")
@click.option("--keep-last", metavar="INT>=1", default="3", show_default=True, help="Checkpoints kept; older ones are removed.")
@click.option("--resume", default=None,
              help="Start from this checkpoint (or the newest under this directory), written under any plan "
                   "of the same model: it is resharded on load.")
@click.option("--max-restarts", metavar="INT>=0", default="0", show_default=True,
              help="Times the group is started again (a fresh torchrun) when it fails, say a rank died; with "
                   "--checkpoint-dir it resumes from the newest checkpoint. Bad input and non-finite steps are "
                   "not retried.")
@click.option("--on-nonfinite", type=click.Choice(["stop", "skip"]), default="stop", show_default=True,
              help="A step with a non-finite loss or gradient: stop the run (exit 4) or skip its update.")
@click.option("--timeout-s", metavar="SECONDS>0", default="600", show_default=True,
              help="Seconds a collective may wait for a peer before the run fails naming the rank (exit 5).")
@click.option("--fp64", is_flag=True,
              help="Train in float64 (weights, activations, gradients, optimizer states; no autocast) from the "
                   "same initial weights: a layout's other summation order then moves the losses by ~1e-16, "
                   "so a larger difference from a one-process run is a bug, not rounding.")
@click.option("--deterministic", is_flag=True,
              help="torch.use_deterministic_algorithms(True): kernels without a deterministic form fail "
                   "instead of varying from run to run.")
@click.option("--compile/--no-compile", "compile_blocks", default=None,
              help="torch.compile each transformer block with inductor [default: as the plan was priced, its "
                   "runtime's torch_compile (`plan --compile`)].")
def run(plan_file, steps, model_name, data, seed, lr, metrics_out, nproc_per_node, nnodes, node_rank,
        rdzv_endpoint, rdzv_id, checkpoint_dir, checkpoint_every, keep_last, resume, max_restarts, on_nonfinite,
        timeout_s, fp64, deterministic, compile_blocks) -> None:
    """Train with a plan: torchrun starts one process per GPU (or CPU rank, gloo),
    each builds its share of the model (DTensor TP, pipeline stages, DDP/FSDP) and
    trains; rank 0 prints progress and the measured figures beside the estimate.

    \b
    One machine:   shardwise run plan.json --steps 20 --metrics-out m.jsonl
    Two nodes:     shardwise run plan.json --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500
                   shardwise run plan.json --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29500
    Surviving:     shardwise run plan.json --steps 1000 --checkpoint-dir ckpt --checkpoint-every 50 --max-restarts 3
    Another plan:  shardwise run newplan.json --steps 1000 --resume ckpt --checkpoint-dir ckpt2
    """
    from executor.launch import (
        check_compile,
        check_endpoint,
        check_machine,
        job_device_type,
        load_job,
        plan_launch,
        run_torchrun,
    )
    from planner.outputs import check_folder, check_writable
    from planner.plan_file import runtime_of

    try:
        job = load_job(plan_file, model_name)
        check_compile(job.strategy, runtime_of(job.plan).torch_compile if compile_blocks is None else compile_blocks)
        check_endpoint(rdzv_endpoint)
        launch = plan_launch(job.strategy.num_gpus, as_int(nproc_per_node, "--nproc-per-node") if nproc_per_node else None,
                             as_int(nnodes, "--nnodes"), as_int(node_rank, "--node-rank", minimum=0),
                             rdzv_endpoint, rdzv_id, as_int(max_restarts, "--max-restarts", minimum=0))
        worker = [plan_file, "--steps", str(as_int(steps, "--steps")), "--data", data,
                  "--seed", str(as_int(seed, "--seed", minimum=0)),
                  "--checkpoint-every", str(as_int(checkpoint_every, "--checkpoint-every", minimum=0)),
                  "--keep-last", str(as_int(keep_last, "--keep-last")), "--on-nonfinite", on_nonfinite,
                  "--timeout-s", str(as_float(timeout_s, "--timeout-s"))]
        check_machine(launch, job_device_type(job.plan), job.plan["estimate"]["peak_memory_bytes"])
        if data != "synthetic":   # reading a corpus needs torch; synthetic tokens need no check
            from executor.data import check_source

            try:
                check_source(data, job.model.vocab_size, job.training.global_batch, job.training.seq_len)
            except ValueError as err:
                raise SpecError("--data", str(err).removeprefix("data: ")) from None
        if metrics_out:
            check_writable(metrics_out, "--metrics-out")
        if checkpoint_dir:
            check_folder(checkpoint_dir, "--checkpoint-dir")
            worker += ["--checkpoint-dir", checkpoint_dir]
        if resume:
            from executor.checkpoint import CheckpointError, latest, verify

            try:   # the checkpoint the ranks would load, checked here: checksums and its model
                found = latest(resume, log=lambda *a: None)
                if found is None:
                    raise SpecError("--resume", f"no complete checkpoint at {resume}")
                verify(found.path)
            except CheckpointError as err:
                raise SpecError("--resume", str(err)) from None
            if found.manifest["model_fingerprint"] != job.plan["model_fingerprint"]:
                raise SpecError("--resume", f"{found.path} was written for another model "
                                            f"({found.manifest['plan']['model'].get('name')}) than the plan's "
                                            f"({job.model.name})")
            worker += ["--resume", resume]
        if lr is not None:
            worker += ["--lr", str(as_float(lr, "--lr"))]
        if model_name:
            worker += ["--model", model_name]
        if metrics_out:
            worker += ["--metrics-out", metrics_out]
        worker += ["--fp64"] * fp64 + ["--deterministic"] * deterministic
        if compile_blocks is not None:
            worker += ["--compile" if compile_blocks else "--no-compile"]
    except SpecError as err:
        _fail(EXIT_BAD_INPUT, str(err))
    sys.exit(run_torchrun(launch, worker))


def _check_profile_ranks(device: str, ranks: int) -> None:
    """One rank per GPU, or per CPU core: a CPU rank runs one thread, and more ranks than
    cores would measure their contention for the cores, not the machine."""
    if device == "cuda":
        have, what = __import__("torch").cuda.device_count(), "GPUs"
    else:
        have = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        what = "CPU cores"
    if ranks > have:
        raise SpecError("--nproc", f"{ranks} processes, one per {what[:-1]}, and this machine has {have} {what}; "
                                   f"use --nproc {have} or fewer")


@main.command()
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where to measure: this machine's CPU (one thread per process, gloo) or its GPUs (NCCL).")
@click.option("--nproc", metavar="INT>=1", default="2", show_default=True,
              help="Local processes (GPUs) for the collectives; 1 skips them. Also the widest default --tp.")
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True,
              help="dtype of the GEMMs and elementwise passes; bf16/fp16 layer kinds run under autocast.")
@click.option("--model", "model_name", default=None,
              help="Also measure this model's layer kinds (transformer layer, embedding, LM head + loss) as the "
                   "TP shard one rank runs, forward and backward, compute only: a built-in, a YAML/JSON spec or a "
                   "config.json, as for `plan`.")
@click.option("--set", "overrides", default=None, help="Override model fields: key=value,...")
@click.option("--seq", metavar="INT>=1", default=None, help="Sequence length of the layer kinds [default: the model's max_position_embeddings].")
@click.option("--micro-batch-sizes", "micro_batch_sizes", default=None,
              help="Comma-separated micro-batch sizes of the layer kinds [default: 1,2,4,8; with --quick 1,2].")
@click.option("--tp", "tp_widths", default=None,
              help="Comma-separated TP widths of the layer kinds: heads, kv heads, intermediate size and vocabulary "
                   "divided by tp [default: the powers of two up to --nproc that divide them].")
@click.option("--attention", type=click.Choice(["flash", "eager"]), default="flash", show_default=True,
              help="Attention kernel of the layer kinds, as `plan --attention`.")
@click.option("-o", "--output", required=True, help="Profile JSON to write (versioned; keyed by device, operation, shape and dtype).")
@click.option("--extend", is_flag=True,
              help="Merge into the profile already at --output: new measurements replace those of the same key, the rest are kept.")
@click.option("--spec-out", default=None,
              help="Also write the fitted cluster spec (YAML: GEMM curve, bandwidth, alpha-beta per collective) here.")
@click.option("--quick", is_flag=True, help="Fewer shapes, sizes and repetitions (seconds instead of a minute).")
def profile(device, nproc, precision, model_name, overrides, seq, micro_batch_sizes, tp_widths, attention, output,
            extend, spec_out, quick) -> None:
    """Measure this machine (GEMMs over shapes, elementwise bandwidth, collectives over
    message sizes and, with --model, the layer kinds over micro-batch sizes and TP
    widths) and fit the cost model's parameters to it.

    \b
    shardwise profile --device cpu --nproc 2 -o cpu.json --spec-out my-cpu.yaml
    shardwise plan --model tiny-gpt --cluster my-cpu.yaml --gpus 2 --global-batch 8 --precision fp32
    shardwise profile --device cpu --model tiny-gpt --seq 64 --micro-batch-sizes 1,2,4 -o cpu.json --extend
    shardwise plan --model tiny-gpt --cluster cpu --gpus 2 --global-batch 8 --seq 64 --precision fp32 --profile cpu.json
    """
    import json
    from pathlib import Path

    import yaml

    from costmodel.calibrate import cluster_spec, roofline_notes
    from costmodel.measured import READABLE_SCHEMA_VERSIONS, check_mergeable
    from executor.launch import unbuilt_features
    from executor.measure import check_tp
    from executor.measure import extend as extend_profile
    from executor.measure import profile as measure
    from planner.api import resolve_model

    try:
        _check_outputs(("-o", output), ("--spec-out", spec_out))
        ranks = as_int(nproc, "--nproc")
        spec = seq_len = mbs = widths = None
        if model_name is not None:
            spec = resolve_model(model_name, parse_overrides(overrides))
            seq_len = as_int(seq, "--seq") if seq is not None else spec.max_position_embeddings
            mbs = _int_list(micro_batch_sizes, "--micro-batch-sizes")
            widths = _int_list(tp_widths, "--tp")
            # The profile measures one transformer layer kind (a model with dense-MLP layers
            # among its expert layers has two), of the usual attention.
            if built := unbuilt_features(spec) + [name for name, on in (("kv_lora_rank", spec.is_mla),
                                                                         ("mlp_only_layers", spec.mlp_only_layers))
                                                  if on]:
                raise SpecError("--model", f"{spec.name}: the executor's built-in model does not build its "
                                           f"{', '.join(built)}, so its layers cannot be measured")
            for tp in widths or []:
                why = check_tp(spec, tp)
                if why:
                    raise SpecError("--tp", why)
        elif any(v is not None for v in (overrides, seq, micro_batch_sizes, tp_widths)):
            raise SpecError("--model", "--set, --seq, --micro-batch-sizes and --tp describe the layer kinds of a --model")
        old = None
        if extend:
            try:
                old = json.loads(Path(output).read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise SpecError("--extend", f"cannot read the profile at {output}: {err}") from None
            if not isinstance(old, dict) or old.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
                raise SpecError("--extend", f"{output} is not a version {' or '.join(map(str, READABLE_SCHEMA_VERSIONS))} profile")
            if (old.get("device"), old.get("precision"), old.get("ranks")) != (device, precision, ranks):
                raise SpecError("--extend", "can only extend a profile of the same device, precision and process count")
            check_mergeable(old, f"--extend {output}")
        if device == "cuda" and not __import__("torch").cuda.is_available():
            raise SpecError("--device", "cuda is not available on this machine")
        _check_profile_ranks(device, ranks)
    except SpecError as err:
        _fail(EXIT_BAD_INPUT, str(err))
    result = measure(device, ranks, precision, quick, progress=lambda line: click.echo(f"measuring {line}", err=True),
                     model=spec, seq_len=seq_len, micro_batch_sizes=mbs, tp_widths=widths,
                     flash=attention == "flash")
    if old is not None:
        try:
            result = extend_profile(old, result)
        except (ValueError, KeyError, TypeError) as err:
            _fail(EXIT_BAD_INPUT, f"--extend: {err}")
    _write_aside("-o", output, json.dumps(result, indent=2, sort_keys=True) + "\n")
    click.echo(f"profile written to {output}")
    if spec_out:
        spec_doc = json.loads(json.dumps(cluster_spec(result, Path(spec_out).stem)))   # no shared objects: no YAML anchors
        notes = roofline_notes(result)
        _write_aside("--spec-out", spec_out, "# Fitted by shardwise profile from " + output + "\n"
                     + "".join(f"# note: {note}\n" for note in notes) + yaml.safe_dump(spec_doc, sort_keys=False))
        click.echo(f"cluster spec written to {spec_out}")
        for note in notes:
            click.echo(f"note: {note}", err=True)


@main.command()
@click.argument("plan_files", nargs=-1, required=True, metavar="PLAN.json PLAN.json [...]")
def compare(plan_files) -> None:
    """Plans side by side: strategy, step time, throughput, MFU and peak memory, every
    time and memory term, what differs from the first plan and why the fastest wins.

    \b
    shardwise plan ... --fix tp=8 -o a.json; shardwise plan ... --fix tp=4 -o b.json
    shardwise compare a.json b.json
    """
    from pathlib import Path

    from planner.console.report import print_compare
    from planner.plan_file import read_plan

    try:
        if len(plan_files) < 2:
            raise SpecError("PLAN_FILES", "give two plan files or more")
        docs = [read_plan(path) for path in plan_files]
    except SpecError as err:
        _fail(EXIT_BAD_INPUT, str(err))
    names = [Path(p).stem for p in plan_files]
    if len(set(names)) < len(names):
        names = list(plan_files)
    print_compare(docs, names)


@main.command()
def models() -> None:
    """List the built-in models (configs/models/), one line each: family, parameters,
    layers, hidden size, heads, experts and context. Any of them is a `--model`."""
    from costmodel.specs.loading import builtin_names, load_model
    from costmodel.terms.counts import active_parameters, total_parameters

    def size(n: int) -> str:
        return f"{n / 1e9:7.2f}B" if n >= 1e9 else f"{n / 1e6:7.2f}M"

    for name in builtin_names("models"):
        m = load_model(name)
        experts = (f", {m.num_local_experts} experts top-{m.num_experts_per_tok} "
                   f"({size(active_parameters(m)).strip()} active)" if m.is_moe else "")
        click.echo(f"{name:16s} {m.model_type:8s} {size(total_parameters(m))}  {m.num_hidden_layers:3d} layers, "
                   f"hidden {m.hidden_size}, {m.num_attention_heads} heads ({m.num_key_value_heads} kv){experts}, "
                   f"context {m.max_position_embeddings}")


@main.command()
def clusters() -> None:
    """List the built-in clusters (configs/clusters/), one line each: the GPU, GPUs per
    node, memory, bf16 peak and the links within and across nodes. Any of them is a
    `--cluster` (sized with --nodes or --gpus; a mixed one by its file)."""
    from costmodel.specs.loading import builtin_names, load_cluster

    def node(c) -> str:
        g = c.gpu
        precision = "bf16" if "bf16" in g.peak_flops_per_s else max(g.peak_flops_per_s, key=g.peak_flops_per_s.get)
        peak = g.peak_flops_per_s[precision]
        domain = f" ({c.nvlink_domain_gpus}-GPU NVLink domain)" if c.nvlink_domain_gpus else ""
        return (f"{g.name} x {c.gpus_per_node}/node{domain}, {g.memory_bytes / GIB:.0f} GiB, "
                f"{peak / 1e12:.4g} TFLOP/s {precision}, links "
                f"{c.intra_node.bandwidth_bytes_per_s / 1e9:.0f} GB/s in {'domain' if domain else 'node'}, "
                f"{c.inter_node.bandwidth_bytes_per_s / 1e9:.1f} GB/s across")

    for name in builtin_names("clusters"):
        if name.startswith("mixed"):
            c = load_cluster(name)
            groups = "; ".join(f"{g.num_nodes} node(s) of {node(g)}" for g in c.groups)
            click.echo(f"{name:22s} mixed: {groups}")
        else:
            click.echo(f"{name:22s} {node(load_cluster(name, nodes=1))}")


def _int_list(text: str | None, field: str) -> list[int] | None:
    """`1,2,4` -> [1, 2, 4] (sorted, without repeats); None stays None."""
    if text is None:
        return None
    values = sorted({as_int(item.strip(), field) for item in text.split(",") if item.strip()})
    if not values:
        raise SpecError(field, "expected comma-separated integers")
    return values


def run_main() -> None:
    """The `shardwise` program: main, then an exit that skips torch's teardown (its
    thread pools and gloo's objects destroyed one by one: a second or more after a
    profile here) once a command has imported it. Everything a command writes is
    closed before it returns."""
    try:
        main()
    except SystemExit as done:
        code = done.code
    else:
        code = 0
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    if "torch" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run_main()
