"""The layering of the three packages (docs/architecture.md), checked on every import
statement of every module, at any depth (function bodies and TYPE_CHECKING blocks
included):

- costmodel imports nothing of planner or executor;
- planner reaches the executor only from the command line (planner/console/cli.py), and
  only inside the commands that run or measure (never at module level);
- executor reads plans only through planner.plan_file (and plans, for auto_parallelize,
  only through planner.api);
- no import cycle between modules.

A failure names the offending import: file, line and module.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("costmodel", "planner", "executor")
PLANNER_TO_EXECUTOR = "planner.console.cli"
EXECUTOR_TO_PLANNER = ("planner.plan_file", "planner.api")


@dataclass(frozen=True)
class Import:
    importer: str      # the module holding the statement
    imported: str      # the module it loads (a submodule when `from pkg import submodule`)
    where: str         # file:line
    top_level: bool    # at module level (not inside a function)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports() -> list[Import]:
    known = modules()
    found = []
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                     for n in ast.walk(f)}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import sub` loads the submodule; `from mod import name` loads mod.
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                           for a in node.names]
            for target in dict.fromkeys(targets):
                if target.split(".")[0] in PACKAGES:
                    found.append(Import(name, target, f"{path.relative_to(ROOT)}:{node.lineno}",
                                        id(node) not in functions))
    return found


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_every_import_names_a_module_that_exists():
    known = modules()
    missing = [f"{i.where} imports {i.imported}" for i in imports() if i.imported not in known]
    assert not missing, missing


def test_costmodel_imports_nothing_of_planner_or_executor():
    bad = [f"{i.where} imports {i.imported}" for i in imports()
           if in_package(i.importer, "costmodel") and not in_package(i.imported, "costmodel")]
    assert not bad, bad


def test_planner_reaches_the_executor_only_from_the_commands_that_run():
    bad = [f"{i.where} imports {i.imported}" for i in imports()
           if in_package(i.importer, "planner") and in_package(i.imported, "executor")
           and (i.importer != PLANNER_TO_EXECUTOR or i.top_level)]
    assert not bad, bad


def test_executor_reads_plans_only_through_the_plan_file_module():
    bad = [f"{i.where} imports {i.imported}" for i in imports()
           if in_package(i.importer, "executor") and in_package(i.imported, "planner")
           and i.imported not in EXECUTOR_TO_PLANNER]
    assert not bad, bad


def test_no_import_cycle():
    graph = nx.DiGraph()
    where = {}
    for i in imports():
        if i.importer != i.imported:
            graph.add_edge(i.importer, i.imported)
            where.setdefault((i.importer, i.imported), i.where)
    cycles = [c for c in nx.simple_cycles(graph)]
    described = [" -> ".join(f"{a} ({where[a, b]})" for a, b in zip(c, c[1:] + c[:1])) for c in cycles]
    assert not described, described


def test_no_package_holds_more_than_a_dozen_modules():
    """A reader finds where a change goes: no folder of the three packages holds more
    than twelve modules and subpackages besides its __init__."""
    crowded = {}
    for pkg in PACKAGES:
        for folder in [ROOT / pkg, *[p for p in (ROOT / pkg).rglob("*") if p.is_dir() and (p / "__init__.py").exists()]]:
            entries = [p for p in folder.iterdir() if (p.suffix == ".py" and p.name != "__init__.py")
                       or (p.is_dir() and (p / "__init__.py").exists())]
            if len(entries) > 12:
                crowded[str(folder.relative_to(ROOT))] = len(entries)
    assert not crowded, crowded
