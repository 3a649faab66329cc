"""A fuzzer of the `shardwise` command line (planner/console/cli.py).

The CLI's contract: bad input never gives a traceback; exit 2 with one line
`error: <field>: ...` naming the field; exit 3 when nothing fits, saying which
constraint binds; 0 on success; nothing left behind on failure (no partial output
files, no `*.tmp`). `run` also documents exit 4 (a non-finite step) and 5 (a
collective timed out), which are accepted for it.

Hypothesis draws cases over every command and option (plan, sweep, explain, replan,
export, evaluate, run, profile): numbers out of range (0, negative, 1e300, nan, inf,
floats where integers go), wrong types, unicode and control characters, empty strings,
empty, huge and garbage files, missing paths, unwritable or missing output folders,
hand-edited plan files (fields of a valid tiny plan set to odd values, deleted,
added), edited model / cluster / rules / runtime / profile files and engine
configurations; mostly invalid, some valid. Each case runs
`python -m planner.console.cli ...` in a fresh temporary folder holding only the
files the case wrote, with a 10 s limit (a hang is a failure; it is interrupted
first, so the report says where it hung), and is checked against the contract.
`run` only gets plans of at most 2 ranks, `--steps 1` and no option that would
start anything bigger; `profile` always gets `--quick` and at most 2 processes.

    python bench/fuzz_cli.py --cases 500 --seed 0 --jobs 2

prints the counts by command and exit code, the time per case and every failing case
grouped by failure signature, and writes bench/results/fuzz_cli.json and .txt.
tests/planner/console/test_fuzz.py runs a slice of the same generators and checks
in-process (CliRunner).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
CLI = [sys.executable, "-m", "planner.console.cli"]
TIMEOUT_S = 10.0
COMMANDS = ("plan", "sweep", "explain", "replan", "export", "evaluate", "run", "profile")
# Relative frequency of each command; run and profile start processes, so fewer of them.
WEIGHTS = {"plan": 18, "sweep": 9, "explain": 12, "replan": 12, "export": 12, "evaluate": 13, "run": 12,
           "profile": 12}
EXIT_OK = {0, 2, 3}
EXIT_OK_BY_COMMAND = {"run": EXIT_OK | {4, 5}}   # README: a non-finite step exits 4, a collective timeout 5
BIG = 2_000_000   # bytes of a "huge" file
ALONE = ("run", "profile")   # commands whose cases start processes: run one at a time (bench)

TINY_PLAN = ["plan", "--model", "tiny-gpt", "--cluster", "cpu", "--gpus", "2", "--global-batch", "8", "--seq", "16",
             "--precision", "fp32"]
# The base plans every plan-file case starts from (all 2 ranks: `run` may train them).
BASE_PLANS = {"dp2": TINY_PLAN, "pp2": TINY_PLAN + ["--fix", "pp=2"], "tp2": TINY_PLAN + ["--fix", "tp=2"]}
BASE_PROFILE = ["profile", "--quick", "--nproc", "1", "--model", "tiny-gpt", "--seq", "16", "--micro-batch-sizes", "1,2",
                "--tp", "1,2"]


# ---------------------------------------------------------------------------
# Cases


@dataclass
class InputFile:
    """A file (or folder, content None) a case writes into its folder before it runs."""

    content: bytes | None
    recipe: str   # how it was made, for the report


@dataclass
class Case:
    command: str
    args: list[str]                                       # after `python -m planner.console.cli`
    files: dict[str, InputFile] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)         # option=kind of each unusual value
    mode: str = "mutated"                                 # valid | mutated | chaos

    def command_line(self) -> str:
        return "python -m planner.console.cli " + " ".join(shlex.quote(a) for a in self.args)

    def as_dict(self) -> dict:
        return {"command": self.command, "args": self.args, "mode": self.mode, "tags": self.tags,
                "files": {name: {"recipe": f.recipe, "bytes": None if f.content is None else len(f.content),
                                 **({"content": f.content.decode("utf-8", "backslashreplace")}
                                    if f.content is not None and len(f.content) <= 2048 else {})}
                          for name, f in self.files.items()}}


@dataclass
class Bases:
    """The valid inputs the mutations start from: plans, a profile, spec documents and
    the base plan exported to each engine."""

    plans: dict[str, dict]
    profile: dict
    models: dict[str, dict]
    cluster: dict
    hardware: dict
    rules: dict
    runtime: dict
    exports: dict[str, str]


def _configs(kind: str, name: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / kind / f"{name}.yaml").read_text())


def make_bases(invoke: Callable[[list[str], Path], tuple[int, str, str]], workdir: Path) -> Bases:
    """Make the base inputs by running the CLI (`invoke(args, cwd) -> (exit, stdout, stderr)`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    plans = {}
    for name, args in BASE_PLANS.items():
        code, out, err = invoke(args + ["-o", f"{name}.json"], workdir)
        if code != 0:
            raise RuntimeError(f"base plan {name} failed ({code}): {err[-2000:]}")
        plans[name] = json.loads((workdir / f"{name}.json").read_text())
    exports = {}
    for target in ("torchtitan", "torchtitan-toml", "megatron", "deepspeed"):
        code, out, err = invoke(["export", "dp2.json", "--to", target], workdir)
        if code != 0:
            raise RuntimeError(f"export {target} failed ({code}): {err[-2000:]}")
        exports[target] = out
    code, out, err = invoke(BASE_PROFILE + ["-o", "profile.json"], workdir)
    if code != 0:
        raise RuntimeError(f"base profile failed ({code}): {err[-2000:]}")
    profile = json.loads((workdir / "profile.json").read_text())
    return Bases(plans=plans, profile=profile,
                 models={n: _configs("models", n) for n in ("tiny-gpt", "tiny-llama", "tiny-moe")},
                 cluster=_configs("clusters", "cpu"), hardware=_configs("hardware", "cpu"),
                 rules=_configs("rules", "default"), runtime=_configs("runtimes", "pytorch-native"),
                 exports=exports)


# ---------------------------------------------------------------------------
# Values: (text, kind)

BAD_INTS = [
    ("0", "zero"), ("-1", "negative"), ("-8", "negative"), ("1e300", "huge"), ("9" * 40, "huge"),
    ("18446744073709551616", "huge"), ("1e3000", "overflow"), ("nan", "nan"), ("NaN", "nan"), ("inf", "inf"),
    ("-inf", "inf"), ("1.5", "float"), ("2.0", "float-integral"), ("2e0", "float-integral"), ("1e-300", "tiny"),
    ("abc", "text"), ("", "empty"), (" ", "blank"), ("0x10", "hex"), ("1_000", "underscore"),
    ("８", "unicode-digit"), ("٣", "unicode-digit"), ("²", "unicode"), ("−1", "unicode-minus"), ("+4", "plus"),
    (" 4 ", "padded"), ("4 GPUs", "text"), ("true", "bool-text"), ("null", "text"), ("\t\r\x1b[31m", "control"),
    ("1\n2", "newline"), ("ünïcødé✓", "unicode"), ("[]", "text"),
]
BAD_FLOATS = [
    ("0", "zero"), ("-1", "negative"), ("-0.5", "negative"), ("1e300", "huge"), ("1e309", "overflow"),
    ("nan", "nan"), ("inf", "inf"), ("-inf", "inf"), ("1e-300", "tiny"), ("abc", "text"), ("", "empty"),
    (" ", "blank"), ("1,5", "comma"), ("1e", "malformed"), ("0x1p3", "hex"), ("∞", "unicode"),
    ("５", "unicode-digit"), ("\x1b[0m", "control"), ("1\n", "newline"), ("true", "bool-text"),
]
BAD_WORDS = [
    ("", "empty"), (" ", "blank"), ("nope", "unknown"), ("TIME", "case"), ("ünïcødé✓", "unicode"),
    ("\x1b[31mred", "control"), ("a\nb", "newline"), ("-", "dash"), ("--", "dashes"), ("x" * 5000, "long"),
    ("0", "zero"), ("../../etc/passwd", "path"),
]
# Text that argv can carry: no NUL, no lone surrogates.
ARG_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=24)


def weighted(*pairs: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    options = [s for w, s in pairs for _ in range(w)]
    return st.sampled_from(options).flatmap(lambda s: s)


def tagged(values: list[tuple[str, str]]) -> st.SearchStrategy:
    return st.sampled_from(values)


def bad_int() -> st.SearchStrategy:
    return weighted((6, tagged(BAD_INTS)),
                    (1, st.integers(-2**70, 2**70).map(lambda i: (str(i), "int"))),
                    (1, st.floats().map(lambda f: (repr(f), "float"))),
                    (1, ARG_TEXT.map(lambda t: (t, "text"))))


def bad_float() -> st.SearchStrategy:
    return weighted((6, tagged(BAD_FLOATS)),
                    (1, st.floats().map(lambda f: (repr(f), "float"))),
                    (1, ARG_TEXT.map(lambda t: (t, "text"))))


def bad_word() -> st.SearchStrategy:
    return weighted((5, tagged(BAD_WORDS)), (1, ARG_TEXT.map(lambda t: (t, "text"))))


# Values a hand edit may put in a JSON / YAML document.
ODD_VALUES: list[Any] = [3, 0, -1, -64, 1.5, 2.0, 1e300, -1e300, 10**40, float("nan"), float("inf"), "", "2",
                         "abc", "ünïcødé✓", None, True, False, [], {}, [1, 2], {"a": 1}]


def value_repr(v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return f"float({str(v)!r})"
    return repr(v)


# ---------------------------------------------------------------------------
# Documents: paths, mutations, garbage


def paths_of(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append(prefix + (k,))
            out += paths_of(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            out.append(prefix + (i,))
            out += paths_of(v, prefix + (i,))
    return out


def path_text(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(path))


def get_at(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def set_at(doc: Any, path: tuple, value: Any) -> None:
    get_at(doc, path[:-1])[path[-1]] = value


def del_at(doc: Any, path: tuple) -> None:
    del get_at(doc, path[:-1])[path[-1]]


@st.composite
def mutated_doc(draw, base: dict, important: list[tuple], values: list[Any] = ODD_VALUES,
                extra: dict[tuple, list[Any]] | None = None) -> tuple[Any, list[str]]:
    """A deep copy of `base` with 1-3 edits: a field set to an odd value, deleted, an
    unknown key added, or the whole document replaced. Returns it and the edits."""
    doc = copy.deepcopy(base)
    notes = []
    everything = paths_of(doc)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["set"] * 7 + ["del"] * 2 + ["add", "whole"]))
        live = [p for p in (important if draw(st.booleans()) else everything) if _exists(doc, p)]
        if op == "whole" or not live:
            doc = draw(st.sampled_from([[], "plan", 42, None, [base]]))
            notes.append(f"whole document := {value_repr(doc)[:40]}")
            break
        path = draw(st.sampled_from(live))
        if op == "set":
            pool = list(values) + list((extra or {}).get(path, []))
            value = draw(st.sampled_from(pool))
            set_at(doc, path, copy.deepcopy(value))
            notes.append(f"{path_text(path)} := {value_repr(value)}")
        elif op == "del":
            del_at(doc, path)
            notes.append(f"del {path_text(path)}")
        else:
            container = get_at(doc, path[:-1]) if len(path) > 1 else doc
            if isinstance(container, dict):
                container["fuzz_unknown"] = 1
                notes.append(f"{path_text(path[:-1]) or '<top>'}.fuzz_unknown := 1")
            elif isinstance(container, list):
                container.append(copy.deepcopy(container[0]) if container else 1)
                notes.append(f"append to {path_text(path[:-1])}")
    return doc, notes


def _exists(doc: Any, path: tuple) -> bool:
    try:
        get_at(doc, path)
        return True
    except (KeyError, IndexError, TypeError):
        return False


def garbage(valid: bytes, kind: str) -> st.SearchStrategy:
    """Bytes that are not a good `kind` (json | yaml | toml | text) document."""
    deep = {"json": b"[" * 100_000, "yaml": b"[" * 100_000, "toml": b"a = " + b"[" * 100_000, "text": b"(" * 100_000}
    items = [
        (b"", "empty file"), (b"{", "truncated: {"), (b"\xff\xfe\x00\x9c garbage", "invalid UTF-8"),
        (b"\xef\xbb\xbf" + valid, "UTF-8 BOM + valid"), (b"null", "null"), (b"[]", "a list"), (b"42", "a number"),
        (b'"text"', "a string"), (b"\x00\x00\x00", "NUL bytes"), (deep[kind], "100000-deep nesting"),
        (valid + b"\n" + b" " * BIG, f"valid + {BIG} bytes of spaces"), (b"a" * BIG, f"{BIG} bytes of 'a'"),
        (valid.replace(b"\n", b"\r\n"), "CRLF line ends"), (valid + b"\x1b[31m\x07", "control characters at the end"),
    ]
    if kind == "yaml":
        items += [(b"a: [unclosed", "unclosed YAML list"), (b"\t- x\n\tb: y", "tabs"),
                  (b"!!python/object/apply:os.system ['true']", "python tag"),
                  (b"a: &a [*a, *a]\nb: *a\n", "recursive alias"),
                  (b"a: 1\na: 2\n" + valid, "duplicate keys"),
                  (b"---\n" + valid + b"\n---\n" + valid, "two YAML documents")]
    if kind == "json":
        items += [(b'{"a": 1, "a": 2}', "duplicate keys"), (b"{'single': 'quotes'}", "single quotes"),
                  (valid + b"\n{}", "trailing data"), (b"NaN", "bare NaN"), (b"1" * 5000, "5000-digit number")]
    if kind == "toml":
        items += [(b"[parallelism\n", "unclosed table"), (b"a = \n", "missing value"), (b"[a]\n[a]\n", "table twice")]
    return st.integers(0, len(items)).flatmap(
        lambda i: st.just(items[i]) if i < len(items) else
        st.integers(0, max(len(valid) - 1, 0)).map(lambda n: (valid[:n], f"truncated at byte {n}")))


def dump_json(doc: Any) -> bytes:
    return json.dumps(doc, indent=1).encode()


def dump_yaml(doc: Any) -> bytes:
    try:
        return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True).encode()
    except yaml.YAMLError:
        return json.dumps(doc).encode()   # JSON is YAML


# ---------------------------------------------------------------------------
# The builder of one case


class Builder:
    def __init__(self, draw, command: str, bases: Bases, names: list[str], choices: tuple[str, ...] = (),
                 valid_percent: int = 15):
        """`names`: what may be made bad (options, or parts like PLAN); `choices`: the click.Choice
        options among them, whose bad values all end in click's one usage error: drawn less often."""
        self.draw, self.command, self.bases = draw, command, bases
        self.args: list[str] = [command]
        self.files: dict[str, InputFile] = {}
        self.tags: list[str] = []
        roll = draw(st.integers(0, 99))
        self.mode = "mutated" if roll < 95 - valid_percent else ("valid" if roll < 95 else "chaos")
        self.bad: set[str] = set()
        if self.mode != "valid":
            pool = [n for n in names if n not in choices] * 4 + list(choices)
            self.bad = set(draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True)))

    # -- plumbing
    def is_bad(self, name: str) -> bool:
        return name in self.bad

    def include(self, name: str, p: float) -> bool:
        """Whether an optional option appears: always when it is to be bad."""
        return self.is_bad(name) or self.draw(st.integers(0, 99)) < p * 100

    def add(self, name: str | None, value: str, kind: str = "valid") -> None:
        self.args += [value] if name is None else [name, value]
        if kind != "valid":
            self.tags.append(f"{name or 'ARG'}={kind}")

    def file(self, name: str, content: bytes | None, recipe: str) -> str:
        self.files[name] = InputFile(content, recipe)
        return name

    def value(self, name: str, valid: list[str], bad: st.SearchStrategy | None = None, p: float = 0.3,
              required: bool = False) -> str | None:
        if not (required or self.include(name, p)):
            return None
        if self.is_bad(name):
            text, kind = self.draw(bad if bad is not None else bad_int())
        else:
            text, kind = self.draw(st.sampled_from(valid)), "valid"
        self.add(name, text, kind)
        return text

    def flag(self, name: str, p: float = 0.2) -> bool:
        if self.draw(st.integers(0, 99)) < p * 100:
            self.args.append(name)
            return True
        return False

    def choice(self, name: str, choices: list[str], p: float = 0.3, required: bool = False) -> None:
        """A click.Choice option: a bad value is click's own usage error."""
        self.value(name, choices, bad_word(), p=p, required=required)

    def finish(self) -> Case:
        if self.mode == "chaos":
            trick = self.draw(st.sampled_from(["unknown option", "extra argument", "drop an argument", "repeat",
                                               "option without value", "dash value", "help"]))
            a = self.args
            if trick == "unknown option":
                a.insert(self.draw(st.integers(1, len(a))), "--fuzz-bogus")
            elif trick == "extra argument":
                a.append("stray")
            elif trick == "drop an argument" and len(a) > 2:
                i = self.draw(st.integers(1, len(a) - 1))
                del a[i:i + (2 if a[i].startswith("-") and i + 1 < len(a) else 1)]
            elif trick == "repeat" and len(a) > 2:
                i = self.draw(st.integers(1, len(a) - 1))
                a += a[i:i + 2]
            elif trick == "option without value" and len(a) > 1:
                opt = next((x for x in reversed(a) if x.startswith("--")), None)
                if opt:
                    a.append(opt)
            elif trick == "dash value":
                a += ["--", "-x"]
            elif trick == "help":
                a.append("--help")
            self.tags.append(f"chaos={trick}")
        return Case(self.command, self.args, self.files, self.tags, self.mode)

    # -- paths

    def output(self, name: str, ext: str, p: float = 0.4) -> str | None:
        """An output path: valid, or a missing / unwritable folder, a folder, a too long name..."""
        if not self.include(name, p):
            return None
        if not self.is_bad(name):
            path = self.draw(st.sampled_from([f"out{ext}", f"sub/out{ext}", f"ünïcødé out{ext}"]))
            if path.startswith("sub/"):
                self.file("sub", None, "an empty folder")
            self.add(name, path)
            return path
        kind = self.draw(st.sampled_from(["missing folder", "parent is a file", "is a folder", "/proc (unwritable)",
                                          "/proc/missing", "name too long", "empty", "read-only folder",
                                          "newline in name", "dot"]))
        path = {"missing folder": f"missing/out{ext}", "parent is a file": f"afile/out{ext}", "is a folder": "adir",
                "/proc (unwritable)": f"/proc/fuzz-out{ext}", "/proc/missing": f"/proc/fuzz-missing/out{ext}",
                "name too long": "n" * 300 + ext, "empty": "", "read-only folder": f"ro/out{ext}",
                "newline in name": f"out\n{ext}", "dot": "."}[kind]
        if kind == "parent is a file":
            self.file("afile", b"x", "a file")
        elif kind == "is a folder":
            self.file("adir", None, "an empty folder")
        elif kind == "read-only folder":
            self.file("ro", None, "an empty folder, chmod 555 (root still writes)")
        self.add(name, path, kind)
        return path

    def missing_path(self) -> tuple[str, str]:
        return self.draw(st.sampled_from([("nope.json", "missing file"), ("", "empty"), (".", "a folder"),
                                          ("/dev/null", "/dev/null"), ("missing/x.yaml", "missing folder"),
                                          ("/proc/self/mem", "unreadable"), ("ünïcødé✓.yaml", "missing unicode")]))

    # -- documents

    def plan_file(self, name: str | None, bad: bool, run_safe: bool = False, fname: str = "p.json") -> str:
        base_name = self.draw(st.sampled_from(sorted(self.bases.plans)))
        base = self.bases.plans[base_name]
        recipe = f"base plan {base_name}: shardwise {' '.join(BASE_PLANS[base_name])} -o {fname}"
        if not bad:
            self.add(name, self.file(fname, dump_json(base), recipe))
            return fname
        how = self.draw(st.sampled_from(["edit"] * 6 + ["semantic"] * 2 + ["garbage"] * 2 + ["path"]))
        if how == "path":
            path, kind = self.missing_path()
            self.add(name, path, f"plan {kind}")
            return path
        if how == "garbage":
            data, what = self.draw(garbage(dump_json(base), "json"))
            self.add(name, self.file(fname, data, f"{recipe}, then {what}"), "plan garbage")
            return fname
        if how == "semantic":
            edits = self.draw(st.sampled_from(SEMANTIC_PLAN_EDITS))
            doc = copy.deepcopy(base)
            notes = []
            for path, value in edits:
                if _exists(doc, path[:-1]):   # stages[0] of a plan without stages: skipped
                    set_at(doc, path, copy.deepcopy(value))
                    notes.append(f"{path_text(path)} := {value_repr(value)}")
        else:
            doc, notes = self.draw(mutated_doc(base, PLAN_PATHS, extra=PLAN_EXTRA_VALUES))
        if isinstance(doc, dict) and isinstance(doc.get("model"), dict) and self.draw(st.booleans()) \
                and refingerprint(doc):
            notes.append("model_fingerprint recomputed")
        if run_safe and not run_safe_plan(doc):
            notes.append("(too big for `run`: replaced by a truncated file)")
            data = dump_json(base)[:100]
        else:
            data = dump_json(doc)
        self.add(name, self.file(fname, data, f"{recipe}, then " + "; ".join(notes)), "plan edited")
        return fname

    def spec_file(self, kind: str, doc: dict, fname: str, edit_paths: list[tuple], tag: str,
                  extra: dict[tuple, list[Any]] | None = None, formats: tuple = ("yaml",)) -> str:
        """A YAML/JSON spec file: `doc` edited, or garbage, or a missing path."""
        how = self.draw(st.sampled_from(["edit"] * 6 + ["garbage"] * 2 + ["path"]))
        fmt = self.draw(st.sampled_from(formats))
        if fmt == "json":
            fname = fname.rsplit(".", 1)[0] + ".json"
        dump = dump_json if fmt == "json" else dump_yaml
        if how == "path":
            path, what = self.missing_path()
            self.tags.append(f"{tag}={what}")
            return path
        if how == "garbage":
            data, what = self.draw(garbage(dump(doc), "json" if fmt == "json" else "yaml"))
            self.file(fname, data, f"{kind} {what}")
            self.tags.append(f"{tag}=garbage")
            return fname
        edited, notes = self.draw(mutated_doc(doc, edit_paths, extra=extra))
        self.file(fname, dump(edited), f"{kind}, then " + "; ".join(notes))
        self.tags.append(f"{tag}=edited")
        return fname

    def model(self, name: str, valid: list[str], p: float = 1.0) -> str | None:
        """--model: a built-in, or a spec file / HF folder; bad: an edited or garbage spec,
        a missing path, an unknown name. The edits' sizes are odd or astronomically large
        (they fail at once), never a model that takes long to measure or train."""
        if not self.include(name, p):
            return None
        if not self.is_bad(name):
            if self.draw(st.integers(0, 9)) < 8:
                self.add(name, self.draw(st.sampled_from(valid)))
                return self.args[-1]
            which = self.draw(st.sampled_from(sorted(self.bases.models)))
            fmt = self.draw(st.sampled_from(["yaml", "json", "hf"]))
            doc = self.bases.models[which]
            if fmt == "hf":
                hf = {**doc, "architectures": ["Fuzz"], "transformers_version": "4.44.0"}
                if hf["model_type"] == "gpt":
                    hf["model_type"] = "gpt2"
                self.file("hf", None, "a folder")
                self.file("hf/config.json", dump_json(hf), f"{which} as a Hugging Face config.json")
                self.add(name, "hf")
            else:
                self.add(name, self.file(f"model.{fmt}", (dump_json if fmt == "json" else dump_yaml)(doc),
                                         f"configs/models/{which}.yaml as {fmt}"))
            return self.args[-1]
        how = self.draw(st.sampled_from(["file"] * 4 + ["word"]))
        if how == "word":
            text, kind = self.draw(bad_word())
            self.add(name, text, f"model {kind}")
            return text
        which = self.draw(st.sampled_from(sorted(self.bases.models)))
        path = self.spec_file(f"configs/models/{which}.yaml", self.bases.models[which], "model.yaml",
                              MODEL_PATHS, name, extra=MODEL_EXTRA_VALUES, formats=("yaml", "json"))
        self.args += [name, path]
        return path

    def cluster(self, name: str, valid: list[str], p: float = 1.0) -> str | None:
        if not self.include(name, p):
            return None
        if not self.is_bad(name):
            self.add(name, self.draw(st.sampled_from(valid)))
            return self.args[-1]
        how = self.draw(st.sampled_from(["file"] * 3 + ["mixed"] + ["word"]))
        if how == "word":
            text, kind = self.draw(bad_word())
            self.add(name, text, f"cluster {kind}")
            return text
        if how == "mixed":
            path = self.spec_file("a mixed cluster of two cpu groups", MIXED_CLUSTER, "cluster.yaml",
                                  MIXED_PATHS, name, extra=MIXED_EXTRA_VALUES)
        else:
            doc = copy.deepcopy(self.bases.cluster)
            if self.draw(st.booleans()):
                doc["gpu"] = copy.deepcopy(self.bases.hardware)
            path = self.spec_file("configs/clusters/cpu.yaml", doc, "cluster.yaml", CLUSTER_PATHS, name,
                                  extra=CLUSTER_EXTRA_VALUES)
        self.args += [name, path]
        return path

    def rules(self, name: str = "--rules", p: float = 0.25) -> None:
        self._named_spec(name, p, "rules", ["default", "megatron", "fsdp"], "configs/rules/default.yaml",
                         self.bases.rules, "rules.yaml", RULES_PATHS, RULES_EXTRA_VALUES)

    def runtime(self, name: str = "--runtime", p: float = 0.2) -> None:
        self._named_spec(name, p, "runtime", ["pytorch-native", "megatron", "deepspeed-zero"],
                         "configs/runtimes/pytorch-native.yaml", self.bases.runtime, "runtime.yaml",
                         [(k,) for k in self.bases.runtime], {("version",): [2, 99]})

    def _named_spec(self, name: str, p: float, kind: str, builtins: list[str], source: str, base: dict,
                    file_name: str, paths: list, extra: dict) -> None:
        """A built-in name when good; when bad, a bad word or an edited copy of `source`."""
        if not self.include(name, p):
            return
        if not self.is_bad(name):
            self.add(name, self.draw(st.sampled_from(builtins)))
            return
        if self.draw(st.integers(0, 3)) == 0:
            text, word_kind = self.draw(bad_word())
            self.add(name, text, f"{kind} {word_kind}")
            return
        self.args += [name, self.spec_file(source, base, file_name, paths, name, extra=extra)]

    def fix(self, name: str = "--fix", p: float = 0.3, valid: list[str] | None = None) -> None:
        self.value(name, valid or FIX_VALID, tagged(FIX_BAD) if self.draw(st.booleans()) else bad_pairs(FIX_KEYS),
                   p=p)

    def overrides(self, name: str = "--set", p: float = 0.2, valid: list[str] | None = None) -> None:
        self.value(name, valid or SET_VALID, tagged(SET_BAD) if self.draw(st.booleans()) else bad_pairs(SET_KEYS),
                   p=p)


def bad_pairs(keys: list[str]) -> st.SearchStrategy:
    """key=value lists with a bad value (or a bad shape)."""
    return st.tuples(st.sampled_from(keys), weighted((3, bad_int()), (1, bad_word()))).map(
        lambda kv: (f"{kv[0]}={kv[1][0]}", f"{kv[0]}={kv[1][1]}"))


# ---------------------------------------------------------------------------
# Pools of the options

FIX_KEYS = ["dp", "tp", "pp", "vpp", "ep", "mbs", "zero", "recompute", "sp", "schedule"]
FIX_VALID = ["tp=1", "pp=2", "dp=2", "zero=1", "zero=3", "recompute=full", "recompute=selective", "sp=on",
             "schedule=gpipe", "mbs=2", "dp=1,tp=2", "tp=2,sp=off", "zero=3,recompute=none", "ep=1"]
FIX_BAD = [("tp=3", "tp=3"), ("dp=0", "dp=zero"), ("pp=-1", "pp=negative"), ("mbs=1e300", "mbs=huge"),
           ("zero=4", "zero=4"), ("recompute=x", "recompute=unknown"), ("sp=maybe", "sp=unknown"),
           ("schedule=x", "schedule=unknown"), ("foo=1", "unknown knob"), ("tp", "no value"), ("tp=", "empty value"),
           ("=2", "no key"), ("tp=2,tp=1", "twice"), ("tp=nan", "tp=nan"), (",,,", "commas"),
           ("vpp=3,pp=1", "vpp without pp"), ("dp=64", "dp above the GPUs"), ("pp=8", "pp above the layers"),
           ("ep=3", "ep=3"), ("tp=2,pp=2", "4 GPUs of 2"), ("mbs=1000000", "mbs huge"), ("TP=2", "upper case"),
           ("tp=２", "unicode digit"), ("schedule=interleaved,vpp=2", "interleaved on 2 GPUs")]
SET_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "intermediate_size", "max_position_embeddings", "num_local_experts", "num_experts_per_tok",
            "moe_capacity_factor", "resid_dropout", "sliding_window", "head_dim", "norms_per_layer",
            "tie_word_embeddings", "model_type", "norm", "mlp"]
SET_VALID = ["num_hidden_layers=2", "hidden_size=128", "num_hidden_layers=8", "vocab_size=1024",
             "tie_word_embeddings=false", "intermediate_size=128"]
SET_BAD = [("hidden_size=0", "hidden_size=zero"), ("hidden_size=-64", "hidden_size=negative"),
           ("hidden_size=1e300", "hidden_size=huge"), ("num_attention_heads=3", "heads=3"), ("foo=1", "unknown"),
           ("hidden_size", "no value"), ("vocab_size=nan", "vocab=nan"), ("model_type=bert", "model_type"),
           ("moe_capacity_factor=1.25", "capacity on dense"), ("max_position_embeddings=0", "max_pos=zero"),
           ("tie_word_embeddings=maybe", "tie=unknown"), ("resid_dropout=1", "dropout=1"),
           ("sliding_window=-1", "window=negative"), ("head_dim=0", "head_dim=zero"),
           ("num_hidden_layers=1e6", "layers=1e6"), ("norms_per_layer=3", "norms=3"), ("norm=x", "norm unknown"),
           ("num_experts_per_tok=5", "top-k above experts"), ("hidden_size=64.5", "hidden=float")]
RUNTIME_SET_VALID = ["fsdp_prefetch=2", "ddp_bucket_mb=100", "fsdp_kept_gathered=head", "chunked_loss=false",
                     "selective_recompute=attention-core", "async_tp=false"]
RUNTIME_SET_BAD = [("fsdp_prefetch=0", "prefetch=zero"), ("ddp_bucket_mb=-1", "bucket=negative"),
                   ("fsdp_kept_gathered=x", "kept=unknown"), ("foo=1", "unknown"), ("fsdp_prefetch", "no value"),
                   ("=", "empty"), (",,", "commas"), ("fsdp_prefetch=nan", "prefetch=nan"),
                   ("ddp_bucket_mb=1e300", "bucket=huge"), ("async_tp=true", "async_tp on cpu"),
                   ("torch_compile=maybe", "compile=unknown"), ("gemm_efficiency_scale=2", "a fitted coefficient"),
                   ("version=3", "version")]
TARGETS = ["torchtitan", "torchtitan-toml", "megatron", "deepspeed"]

PLAN_PATHS = [(k,) for k in ("schema_version", "model", "model_fingerprint", "cluster", "training", "strategy",
                             "estimate", "runtime", "rules", "alternatives")] + \
    [("strategy", k) for k in ("dp", "tp", "pp", "vpp", "ep", "micro_batch_size", "num_microbatches", "zero_stage",
                               "schedule", "recompute", "sequence_parallel", "stages")] + \
    [("strategy", "stages", 0, k) for k in ("num_layers", "first_layer", "full_recompute_layers",
                                            "selective_recompute_layers", "pp_rank", "ranks", "index")] + \
    [("training", k) for k in ("global_batch", "seq_len", "precision", "optimizer", "flash_attention",
                               "mixed_precision")] + \
    [("model", k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                            "vocab_size", "intermediate_size", "max_position_embeddings", "model_type", "name",
                            "head_dim", "num_local_experts", "mlp", "norm")] + \
    [("cluster", k) for k in ("name", "gpus_per_node", "num_nodes", "comm_overlap", "gpu", "intra_node")] + \
    [("cluster", "gpu", k) for k in ("memory_bytes", "peak_flops_per_s", "hbm_bandwidth_bytes_per_s", "name")] + \
    [("cluster", "intra_node", k) for k in ("bandwidth_bytes_per_s", "latency_s", "collectives")] + \
    [("estimate", k) for k in ("step_time_s", "peak_memory_bytes", "rank_memory_bytes", "rank_time_s", "time",
                               "memory", "tokens_per_s", "mfu")] + \
    [("runtime", k) for k in ("name", "version", "torch_compile", "selective_recompute", "fsdp_prefetch",
                              "memory_high_ratio")]
PLAN_EXTRA_VALUES = {
    ("strategy", "schedule"): ["interleaved", "gpipe", "zb"], ("strategy", "recompute"): ["full", "selective", "x"],
    ("training", "precision"): ["bf16", "fp16", "fp8"], ("training", "optimizer"): ["sgd", "lion"],
    ("model", "model_type"): ["llama", "mixtral", "bert"], ("schema_version",): [2, "1"],
    ("cluster", "gpu"): ["cpu", "a100-80gb"], ("training", "mixed_precision"): ["fp32-master", "x"],
}
# Edits a person makes on purpose: more GPUs than the cluster, a pipeline the stages do not describe...
SEMANTIC_PLAN_EDITS = [
    [(("strategy", "tp"), 3)],
    [(("strategy", "tp"), 2), (("strategy", "dp"), 1), (("strategy", "num_microbatches"), 2)],
    [(("strategy", "dp"), 4), (("strategy", "micro_batch_size"), 2)],
    [(("strategy", "dp"), 8), (("strategy", "micro_batch_size"), 1)],
    [(("strategy", "pp"), 2)],
    [(("strategy", "pp"), 4), (("strategy", "dp"), 1), (("strategy", "num_microbatches"), 2)],
    [(("strategy", "vpp"), 2)],
    [(("strategy", "vpp"), 2), (("strategy", "schedule"), "interleaved")],
    [(("cluster", "num_nodes"), 0)],
    [(("cluster", "gpus_per_node"), 1)],
    [(("training", "global_batch"), 16), (("strategy", "num_microbatches"), 2)],
    [(("strategy", "stages"), [])],
    [(("strategy", "zero_stage"), 3), (("strategy", "recompute"), "full")],
    [(("strategy", "sequence_parallel"), True)],
    [(("strategy", "ep"), 2)],
    [(("strategy", "micro_batch_size"), 0), (("strategy", "num_microbatches"), 0)],
    [(("training", "seq_len"), 0)],
    [(("training", "seq_len"), 10**6)],
    [(("model", "num_hidden_layers"), 0), (("strategy", "stages", 0, "num_layers"), 0)],
    [(("strategy", "stages", 0, "num_layers"), 2), (("model", "num_hidden_layers"), 2)],
    [(("cluster", "gpu", "memory_bytes"), 1)],
    [(("cluster", "intra_node", "bandwidth_bytes_per_s"), 0)],
    [(("estimate", "rank_memory_bytes"), [])],
    [(("estimate", "rank_time_s"), [])],
    [(("runtime", "torch_compile"), True)],
    [(("training", "precision"), "bf16")],
    [(("training", "precision"), "fp16")],
    [(("model", "name"), "../../etc/passwd")],
    [(("model", "num_local_experts"), 4), (("strategy", "ep"), 2)],
]

MODEL_PATHS = [(k,) for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                              "num_key_value_heads", "intermediate_size", "vocab_size", "max_position_embeddings",
                              "tie_word_embeddings", "num_local_experts", "num_experts_per_tok")]
MODEL_EXTRA_VALUES = {("model_type",): ["bert", "GPT", "llama", "mixtral", "gpt2"], ("num_attention_heads",): [3, 5],
                      ("num_key_value_heads",): [3, 8]}
CLUSTER_PATHS = [(k,) for k in ("name", "gpu", "gpus_per_node", "num_nodes", "intra_node", "inter_node",
                                "comm_overlap")] + \
    [("intra_node", k) for k in ("bandwidth_bytes_per_s", "latency_s", "collectives")] + \
    [("intra_node", "collectives", "all_gather"), ("intra_node", "collectives", "p2p", "latency_s"),
     ("gpu", "memory_bytes"), ("gpu", "peak_flops_per_s"), ("gpu", "peak_flops_per_s", "fp32"),
     ("gpu", "hbm_bandwidth_bytes_per_s"), ("gpu", "gemm_efficiency_max"), ("gpu", "host_overheads"),
     ("gpu", "host_overheads", "tp_layer_s")]
CLUSTER_EXTRA_VALUES = {("gpu",): ["a100-80gb", "nope", "cpu.yaml"], ("name",): ["x" * 500],
                        ("gpus_per_node",): [3, 2**31], ("num_nodes",): [2, 2**31]}
MIXED_CLUSTER = {"name": "fuzz-mixed",
                 "groups": [{"cluster": "cpu", "num_nodes": 1, "name": "a"}, {"cluster": "cpu", "num_nodes": 1, "name": "b"}],
                 "inter_group": {"bandwidth_bytes_per_s": 1.0e9, "latency_s": 1.0e-4}}
MIXED_PATHS = [("groups",), ("groups", 0), ("groups", 0, "cluster"), ("groups", 0, "num_nodes"), ("groups", 1, "name"),
               ("inter_group",), ("inter_group", "bandwidth_bytes_per_s"), ("inter_group", "latency_s")]
MIXED_EXTRA_VALUES = {("groups", 0, "cluster"): ["cluster.yaml", "mixed-h100-a100", "nope"],
                      ("groups", 1, "name"): ["a"]}
RULES_PATHS = [(k,) for k in ("tp_within_node", "tp_divides_heads", "memory_headroom", "max_stage_imbalance",
                              "micro_batch_size", "allowed", "forbid", "pinned", "objective")] + \
    [("micro_batch_size", "min"), ("micro_batch_size", "max")]
RULES_EXTRA_VALUES = {("allowed",): [{"tp": [3]}, {"tp": []}, {"foo": [1]}, {"schedule": ["x"]}],
                      ("forbid",): [["zero_stage=9"], ["nonsense"], ["tp=1", "tp=2"]],
                      ("pinned",): [{"tp": 3}, {"dp": 0}, {"foo": 1}],
                      ("objective",): ["speed", "cost", "energy"], ("micro_batch_size",): [{"min": 8, "max": 1}],
                      ("micro_batch_size", "min"): [8, 17]}


def refingerprint(doc: dict) -> bool:
    """Set model_fingerprint to the edited model's, so the edit reaches what the check behind it does."""
    try:
        from costmodel.specs import ModelSpec
        from planner.plan_file import fingerprint

        doc["model_fingerprint"] = fingerprint(ModelSpec(**doc["model"]))
        return True
    except Exception:   # noqa: BLE001 - the edit made the model unbuildable: leave the old fingerprint
        return False


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def run_safe_plan(doc: Any) -> bool:
    """Whether `shardwise run` may be given this plan: if it were accepted, it would start
    at most 2 ranks of a model and batch no bigger than the tiny plans'."""
    if not isinstance(doc, dict):
        return True
    s, t, m = doc.get("strategy"), doc.get("training"), doc.get("model")
    if isinstance(s, dict):
        degrees = [s.get(k) for k in ("dp", "tp", "pp")]
        if all(isinstance(d, int) and not isinstance(d, bool) for d in degrees) and \
                not 0 <= degrees[0] * degrees[1] * degrees[2] <= 2:
            return False
        for key, limit in (("micro_batch_size", 8), ("num_microbatches", 8), ("ep", 2), ("vpp", 4)):
            n = _number(s.get(key))
            if n is not None and not -1e9 < n <= limit:
                return False
    if isinstance(t, dict):
        for key, limit in (("global_batch", 16), ("seq_len", 64)):
            n = _number(t.get(key))
            if n is not None and not -1e9 < n <= limit:
                return False
    if isinstance(m, dict):
        for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "num_attention_heads",
                    "num_key_value_heads", "max_position_embeddings", "num_local_experts", "head_dim"):
            n = _number(m.get(key))
            if n is not None and not -1e9 < n <= 512:
                return False
    runtime = doc.get("runtime")
    # `run` would torch.compile on CPU: minutes, not a tiny case
    return not (isinstance(runtime, dict) and runtime.get("torch_compile") not in (False, None, 0, "", "false"))


# ---------------------------------------------------------------------------
# The commands

TINY_MODELS = ["tiny-gpt", "tiny-llama", "tiny-moe"]
BIG_MODELS = ["gpt3-1.3b", "llama2-7b", "llama3-70b", "gpt3-175b", "mixtral-8x7b"]


@st.composite
def plan_case(draw, bases: Bases) -> Case:
    names = ["--model", "--cluster", "size", "--global-batch", "--seq", "--precision", "--optimizer", "--attention",
             "--runtime", "--runtime-set", "--rules", "--fix", "--set", "--profile", "--top", "--objective",
             "budget", "--memory-margin", "--format", "-o"]
    b = Builder(draw, "plan", bases, names, choices=("--attention", "--format"))
    big = draw(st.integers(0, 9)) == 0
    b.model("--model", BIG_MODELS if big else TINY_MODELS + ["llama2-7b"])   # 7B on two CPU ranks: exit 3
    b.cluster("--cluster", ["dgx-a100-80gb", "dgx-h100"] if big else ["cpu"])
    if b.is_bad("size"):
        kind = draw(st.sampled_from(["gpus", "nodes", "both", "none"]))
        if kind in ("gpus", "both"):
            b.add("--gpus", *draw(bad_int()))
        if kind in ("nodes", "both"):
            b.add("--nodes", *draw(bad_int()))
        if kind == "none":
            b.tags.append("size=none")
    elif big:
        b.add("--nodes", draw(st.sampled_from(["1", "2", "16"])))
    else:
        b.add("--gpus", draw(st.sampled_from(["2", "1", "4"])))
    b.value("--global-batch", ["64", "512"] if big else ["8", "16", "4"], required=True)
    b.value("--seq", ["2048", "4096"] if big else ["16", "32", "64"], p=1.0 if not big else 0.7)
    b.value("--precision", ["bf16"] if big else ["fp32", "bf16"], bad_word(), p=1.0)
    b.value("--optimizer", ["adamw", "adam", "sgd"], bad_word(), p=0.15)
    b.choice("--attention", ["flash", "eager"], p=0.15)
    b.runtime()
    b.flag(draw(st.sampled_from(["--compile", "--no-compile"])), p=0.1)
    b.value("--runtime-set", RUNTIME_SET_VALID, tagged(RUNTIME_SET_BAD), p=0.1)
    b.rules()
    b.fix()
    b.overrides()
    if b.include("--profile", 0.1):
        if b.is_bad("--profile"):
            b.args += ["--profile", profile_file(b, "prof.json")]
        else:
            b.file("prof.json", dump_json(bases.profile), f"base profile: shardwise {' '.join(BASE_PROFILE)}")
            b.args += ["--profile", "prof.json"]
    b.value("--top", ["1", "3", "5"], p=0.2)
    b.value("--objective", ["time", "memory", "cost", "energy"], bad_word(), p=0.15)
    if b.include("budget", 0.1):
        budget = draw(st.sampled_from(["--max-cost-per-step", "--power-cap", "--energy-budget"]))
        if b.is_bad("budget"):
            b.add(budget, *draw(bad_float()))
        else:
            b.add(budget, draw(st.sampled_from(["1", "0.01", "1e9", "1e-9"])))   # 1e-9: nothing fits, exit 3
    b.flag("--pareto", p=0.05)
    b.value("--memory-margin", ["0", "0.1", "0.5"], bad_float() | tagged([("-0.5", "negative"), ("-1", "-1"),
                                                                           ("-2", "below -1")]), p=0.1)
    b.choice("--format", ["table", "json"], p=0.3)
    b.output("-o", ".json")
    return b.finish()


def profile_file(b: Builder, fname: str) -> str:
    """A `shardwise profile` JSON (for plan --profile, profile --extend): edited, garbage or missing."""
    how = b.draw(st.sampled_from(["edit"] * 4 + ["garbage"] * 2 + ["path"]))
    if how == "path":
        path, what = b.missing_path()
        b.tags.append(f"profile={what}")
        return path
    base = b.bases.profile
    if how == "garbage":
        data, what = b.draw(garbage(dump_json(base), "json"))
        b.file(fname, data, f"base profile, then {what}")
        b.tags.append("profile=garbage")
        return fname
    important = [(k,) for k in base] + [("layers", 0, k) for k in base["layers"][0]] + \
        [("gemm", 0, k) for k in base["gemm"][0]] + [("layers", 0, "model", "hidden_size")]
    doc, notes = b.draw(mutated_doc(base, important, extra={("schema_version",): [0, 99], ("device",): ["cuda"],
                                                             ("precision",): ["bf16"]}))
    b.file(fname, dump_json(doc), "base profile, then " + "; ".join(notes))
    b.tags.append("profile=edited")
    return fname


@st.composite
def sweep_case(draw, bases: Bases) -> Case:
    names = ["--model", "--cluster", "--gpus", "--global-batch", "--seq", "--precision", "--rules", "--fix", "--set",
             "--objective", "--tokens", "--plot", "-o", "--format", "--runtime-set"]
    b = Builder(draw, "sweep", bases, names, choices=("--format",))
    b.model("--model", TINY_MODELS + ["llama2-7b"])   # 7B on CPU ranks: no size plans, exit 3
    b.cluster("--cluster", ["cpu"])
    b.value("--gpus", ["1,2", "1..4", "2", "2..8", "1..2,4"],
            tagged([("8..1", "reversed"), ("0..4", "zero"), ("1..1e300", "huge range"), ("1..", "open"),
                    ("..4", "open"), ("1...4", "three dots"), (",", "comma"), ("1,,2", "empty item"),
                    ("a..b", "text"), ("-2", "negative"), ("1e300", "huge"), ("1..2..4", "two ranges"),
                    ("1..2**40", "text"), ("3", "odd size"), ("1..1024", "wide"), ("1,2,3,5,6,7", "odd sizes"),
                    ("1..nan", "nan"), ("1.5..4", "float")]) | bad_int(), required=True)
    b.value("--global-batch", ["8", "16"], required=True)
    b.value("--seq", ["16", "32"], p=1.0)
    b.value("--precision", ["fp32"], bad_word(), p=1.0)
    b.value("--runtime-set", RUNTIME_SET_VALID, tagged(RUNTIME_SET_BAD), p=0.05)
    b.rules(p=0.15)
    b.fix(p=0.2)
    b.overrides(p=0.1)
    b.value("--objective", ["time", "memory", "cost", "energy"], bad_word(), p=0.1)
    b.value("--tokens", ["300e9", "1e6", "1000"], bad_float(), p=0.3)
    b.output("--plot", ".png", p=0.15)
    b.output("-o", ".json", p=0.3)
    b.choice("--format", ["table", "json"], p=0.3)
    return b.finish()


@st.composite
def explain_case(draw, bases: Bases) -> Case:
    b = Builder(draw, "explain", bases, ["PLAN"] * 3 + ["--plot", "--html"])
    b.plan_file(None, b.is_bad("PLAN"))
    b.output("--plot", ".png", p=0.12)
    b.output("--html", ".html", p=0.12)
    return b.finish()


@st.composite
def export_case(draw, bases: Bases) -> Case:
    b = Builder(draw, "export", bases, ["PLAN"] * 3 + ["--to", "-o"], choices=("--to",))
    b.plan_file(None, b.is_bad("PLAN"))
    b.choice("--to", TARGETS, required=True)
    b.output("-o", draw(st.sampled_from([".json", ".toml", ".txt"])), p=0.4)
    return b.finish()


@st.composite
def replan_case(draw, bases: Bases) -> Case:
    names = ["PLAN", "PLAN", "size", "--cluster", "--rules", "--fix", "--top", "--format", "-o"]
    b = Builder(draw, "replan", bases, names, choices=("--format",))
    b.plan_file(None, b.is_bad("PLAN"))
    cluster = b.include("--cluster", 0.25)
    if cluster:
        b.cluster("--cluster", ["cpu", "dgx-a100-80gb"], p=1.0)
    if b.is_bad("size"):
        kind = draw(st.sampled_from(["gpus", "nodes", "both", "none"]))
        if kind in ("gpus", "both"):
            b.add("--gpus", *draw(bad_int()))
        if kind in ("nodes", "both"):
            b.add("--nodes", *draw(bad_int()))
        if kind == "none" and not cluster:
            b.tags.append("size=none")
    else:
        which = draw(st.sampled_from(["--gpus", "--nodes"]))
        b.add(which, draw(st.sampled_from(["1", "2", "4"] if which == "--gpus" else ["1", "2"])))
    b.rules(p=0.15)
    b.fix(p=0.2)
    b.value("--top", ["1", "3"], p=0.15)
    b.choice("--format", ["table", "json"], p=0.3)
    b.output("-o", ".json", p=0.3)
    return b.finish()


@st.composite
def evaluate_case(draw, bases: Bases) -> Case:
    names = ["CONFIG"] * 3 + ["ENGINE", "--model", "--cluster", "size", "--global-batch", "--seq", "--precision",
                              "--optimizer", "--runtime", "--rules", "--fix", "--set", "--format"]
    b = Builder(draw, "evaluate", bases, names, choices=("ENGINE", "--format"))
    engine = draw(st.sampled_from(["megatron", "deepspeed", "torchtitan", "torchtitan-toml"]))
    config = engine_config(b, engine, b.is_bad("CONFIG"))
    engine_word = "torchtitan" if engine == "torchtitan-toml" else engine
    if b.is_bad("ENGINE"):
        engine_word, kind = draw(bad_word())
        b.tags.append(f"ENGINE={kind}")
    b.args += ["--from", engine_word, config]
    b.model("--model", ["tiny-gpt"])
    b.cluster("--cluster", ["cpu"])
    if b.is_bad("size"):
        kind = draw(st.sampled_from(["gpus", "nodes", "both", "none"]))
        if kind in ("gpus", "both"):
            b.add("--gpus", *draw(bad_int()))
        if kind in ("nodes", "both"):
            b.add("--nodes", *draw(bad_int()))
        if kind == "none":
            b.tags.append("size=none")
    else:
        b.add("--gpus", draw(st.sampled_from(["2", "2", "1", "4"])))
    b.value("--global-batch", ["8", "16"], p=0.3 if engine != "torchtitan" else 0.6)
    b.value("--seq", ["16"], p=0.8)
    b.value("--precision", ["fp32"], bad_word(), p=0.8)
    b.value("--optimizer", ["adamw", "sgd"], bad_word(), p=0.1)
    b.runtime(p=0.1)
    b.rules(p=0.1)
    b.fix(p=0.15)
    b.overrides(p=0.1, valid=["num_hidden_layers=4"])
    b.choice("--format", ["table", "json"], p=0.3)
    return b.finish()


MEGATRON_FLAGS = ["--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
                  "--global-batch-size", "--seq-length", "--num-layers", "--hidden-size", "--num-attention-heads",
                  "--num-layers-per-virtual-pipeline-stage", "--expert-model-parallel-size", "--context-parallel-size",
                  "--recompute-granularity", "--recompute-num-layers", "--ffn-hidden-size",
                  "--max-position-embeddings"]


def engine_config(b: Builder, engine: str, bad: bool) -> str:
    """CONFIG of `evaluate --from ENGINE CONFIG`: the base plan exported to the engine,
    as text or a file, edited when `bad`."""
    text = b.bases.exports[engine]
    if engine in ("megatron", "torchtitan"):
        tokens = [t for t in text.replace("\\\n", " ").split() if t != "\\"]
        as_file = b.draw(st.integers(0, 3)) == 0 and engine == "megatron"
        if bad:
            how = b.draw(st.sampled_from(["value"] * 4 + ["drop", "unknown", "repeat", "garbage", "extra flag"]))
            flags = [i for i, t in enumerate(tokens) if t.startswith("--") and i + 1 < len(tokens)
                     and not tokens[i + 1].startswith("--")]
            if how == "value" and flags:
                i = b.draw(st.sampled_from(flags))
                v, kind = b.draw(bad_int())
                b.tags.append(f"CONFIG {tokens[i]}={kind}")
                tokens[i + 1] = v
            elif how == "drop" and flags:
                i = b.draw(st.sampled_from(flags))
                b.tags.append(f"CONFIG drop {tokens[i]}")
                del tokens[i:i + 2]
            elif how == "unknown":
                tokens += ["--fuzz-unknown", "1"]
                b.tags.append("CONFIG unknown flag")
            elif how == "repeat" and flags:
                i = b.draw(st.sampled_from(flags))
                tokens += [tokens[i], str(b.draw(st.sampled_from([2, 3, 16, 0])))]
                b.tags.append(f"CONFIG repeat {tokens[i]}")
            elif how == "extra flag" and engine == "megatron":
                flag = b.draw(st.sampled_from(MEGATRON_FLAGS + ["--bf16", "--fp16", "--use-distributed-optimizer",
                                                                "--sequence-parallel", "--recompute-activations"]))
                tokens += [flag] + ([b.draw(bad_int())[0]] if not flag.startswith(("--bf16", "--fp16", "--use",
                                                                                   "--seq", "--recompute-act"))
                                    else [])
                b.tags.append(f"CONFIG extra {flag}")
            else:
                v, kind = b.draw(bad_word())
                b.tags.append(f"CONFIG garbage={kind}")
                return v
        config = " ".join(tokens)
        if as_file:
            b.file("megatron.txt", config.encode(), "megatron arguments: " + config[:200])
            return "megatron.txt"
        return config
    if engine == "deepspeed":
        valid = json.loads(text)
        if not bad:
            return b.file("ds.json", dump_json(valid), "the base plan exported --to deepspeed")
        how = b.draw(st.sampled_from(["edit"] * 4 + ["garbage"] * 2 + ["path"]))
        if how == "path":
            path, what = b.missing_path()
            b.tags.append(f"CONFIG={what}")
            return path
        if how == "garbage":
            data, what = b.draw(garbage(dump_json(valid), "json"))
            b.tags.append("CONFIG=garbage")
            return b.file("ds.json", data, f"deepspeed config, then {what}")
        doc, notes = b.draw(mutated_doc(valid, paths_of(valid), extra={("zero_optimization", "stage"): [4, 3, 1]}))
        b.tags.append("CONFIG=edited")
        return b.file("ds.json", dump_json(doc), "deepspeed config, then " + "; ".join(notes))
    # torchtitan-toml
    if not bad:
        return b.file("job.toml", text.encode(), "the base plan exported --to torchtitan-toml")
    how = b.draw(st.sampled_from(["edit"] * 4 + ["garbage"] * 2 + ["path"]))
    if how == "path":
        path, what = b.missing_path()
        b.tags.append(f"CONFIG={what}")
        return path if path.endswith(".toml") else path + ".toml"
    if how == "garbage":
        data, what = b.draw(garbage(text.encode(), "toml"))
        b.tags.append("CONFIG=garbage")
        return b.file("job.toml", data, f"torchtitan toml, then {what}")
    lines = text.splitlines()
    keyed = [i for i, line in enumerate(lines) if " = " in line]
    i = b.draw(st.sampled_from(keyed))
    value = b.draw(st.sampled_from(["3", "0", "-1", "1e300", "nan", "inf", '"abc"', "[]", "true", "", "1.5",
                                    "99999999999999999999", '"ünïcødé"', "{}"]))
    key = lines[i].split(" = ")[0]
    lines[i] = f"{key} = {value}"
    b.tags.append(f"CONFIG {key}={value}")
    return b.file("job.toml", ("\n".join(lines) + "\n").encode(), f"torchtitan toml, then {key} = {value}")


# Values of `run` that never start more than the tiny plan's job (no huge step counts, restarts or ranks).
RUN_STEPS_BAD = [("0", "zero"), ("-1", "negative"), ("abc", "text"), ("1.5", "float"), ("nan", "nan"), ("inf", "inf"),
                 ("", "empty"), ("1e-300", "tiny"), ("−1", "unicode-minus"), ("1\n", "newline")]
RUN_COUNT_BAD = [("-1", "negative"), ("abc", "text"), ("1.5", "float"), ("nan", "nan"), ("inf", "inf"), ("", "empty"),
                 ("-1e300", "huge negative"), ("ünïcødé", "unicode")]


@st.composite
def run_case(draw, bases: Bases) -> Case:
    names = ["PLAN"] * 3 + ["--steps", "--model", "--data", "--seed", "--lr", "--metrics-out", "--nproc-per-node",
                            "--nnodes", "--node-rank", "--rdzv-endpoint", "--checkpoint-dir", "--checkpoint-every",
                            "--keep-last", "--resume", "--max-restarts", "--on-nonfinite", "--timeout-s"]
    b = Builder(draw, "run", bases, names, choices=("--on-nonfinite",), valid_percent=10)
    b.plan_file(None, b.is_bad("PLAN"), run_safe=True)
    b.value("--steps", ["1"], tagged(RUN_STEPS_BAD), p=1.0)
    if b.include("--model", 0.1):
        if b.is_bad("--model"):
            b.model("--model", [])
        else:
            b.add("--model", "tiny-gpt")
    if b.include("--data", 0.2):
        if b.is_bad("--data"):
            kind = draw(st.sampled_from(["word", "empty file", "binary file", "missing", "folder", "huge file"]))
            if kind == "word":
                b.add("--data", *draw(bad_word()))
            elif kind == "empty file":
                b.add("--data", b.file("data.txt", b"", "empty"), "empty file")
            elif kind == "binary file":
                b.add("--data", b.file("data.txt", bytes(range(256)) * 4, "bytes 0-255 x4"), "binary file")
            elif kind == "huge file":
                b.add("--data", b.file("data.txt", b"lorem ipsum " * (BIG // 12), f"{BIG} bytes of text"),
                      "huge file")
            elif kind == "folder":
                b.add("--data", b.file("adir", None, "an empty folder"), "folder")
            else:
                b.add("--data", "missing.txt", "missing file")
        else:
            which = draw(st.sampled_from(["synthetic", "corpus", "data.txt"]))
            if which == "data.txt":
                b.file("data.txt", ("The quick brown fox jumps over the lazy dog. " * 200).encode(), "9 KB of text")
            b.add("--data", which)
    b.value("--seed", ["0", "7"], tagged(RUN_COUNT_BAD + [("1e300", "huge"), ("18446744073709551616", "2**64")]),
            p=0.15)
    b.value("--lr", ["1e-3", "0.01"], bad_float(), p=0.15)
    b.output("--metrics-out", ".jsonl", p=0.2)
    b.value("--nproc-per-node", ["2"], tagged(RUN_COUNT_BAD + [("0", "zero"), ("1", "too few"), ("3", "too many")]),
            p=0.1)
    nnodes = b.value("--nnodes", ["1"], tagged(RUN_COUNT_BAD + [("0", "zero"), ("2", "two without endpoint")]), p=0.1)
    b.value("--node-rank", ["0"], tagged(RUN_COUNT_BAD + [("1", "out of range"), ("5", "out of range")]), p=0.1)
    if b.is_bad("--rdzv-endpoint") and (nnodes is None or nnodes == "1"):
        # With one node the endpoint is used as is: only malformed ones (a valid one would bind a port).
        b.add("--rdzv-endpoint", *draw(tagged([("nohost", "no port"), (":", "colon"), ("host:abc", "text port"),
                                               ("127.0.0.1:99999", "port out of range"), ("", "empty"),
                                               ("127.0.0.1:-1", "negative port"), ("ü:1", "unicode host")])))
    if b.include("--checkpoint-dir", 0.1):
        if b.is_bad("--checkpoint-dir"):
            kind = draw(st.sampled_from(["a file", "/proc", "empty", "missing parent"]))
            path = {"a file": "afile", "/proc": "/proc/fuzz-ckpt", "empty": "", "missing parent": "a/b/c/ckpt"}[kind]
            if kind == "a file":
                b.file("afile", b"x", "a file")
            b.add("--checkpoint-dir", path, kind)
        else:
            b.add("--checkpoint-dir", "ckpt")
    b.value("--checkpoint-every", ["0", "1"], tagged(RUN_COUNT_BAD), p=0.05)
    b.value("--keep-last", ["1", "3"], tagged(RUN_COUNT_BAD + [("0", "zero")]), p=0.05)
    if b.is_bad("--resume"):
        kind = draw(st.sampled_from(["missing", "empty folder", "a file", "garbage checkpoint"]))
        if kind == "empty folder":
            b.file("ck", None, "an empty folder")
        elif kind == "a file":
            b.file("ck", b"not a checkpoint", "a file")
        elif kind == "garbage checkpoint":
            b.file("ck", None, "a folder")
            b.file("ck/step-1", None, "a folder")
            b.file("ck/step-1/.metadata", b"\x00garbage", "garbage metadata")
        b.add("--resume", "ck", f"resume {kind}")
    b.value("--max-restarts", ["0"], tagged(RUN_COUNT_BAD), p=0.05)
    b.choice("--on-nonfinite", ["stop", "skip"], p=0.1)
    b.value("--timeout-s", ["600", "60"], tagged([(v, k) for v, k in BAD_FLOATS if k != "tiny"]), p=0.1)
    b.flag("--fp64", p=0.1)
    b.flag("--deterministic", p=0.1)
    b.flag("--no-compile", p=0.05)
    return b.finish()


@st.composite
def profile_case(draw, bases: Bases) -> Case:
    names = ["--device", "--nproc", "--precision", "--model", "--set", "--seq", "--micro-batch-sizes", "--tp",
             "--attention", "-o", "--extend", "--spec-out"]
    b = Builder(draw, "profile", bases, names, choices=("--device", "--precision", "--attention"), valid_percent=10)
    b.args.append("--quick")   # always: the whole profile takes a minute
    b.choice("--device", ["cpu"], p=0.2)
    if b.include("--nproc", 1.0):
        if b.is_bad("--nproc"):
            # No large valid counts: each is a process measuring collectives.
            b.add("--nproc", *draw(tagged([(v, k) for v, k in BAD_INTS if k not in ("huge",)] + [("0", "zero")])))
        else:
            b.add("--nproc", draw(st.sampled_from(["1"] * 6 + ["2"])))
    b.choice("--precision", ["fp32", "bf16"], p=0.2)
    model = None
    if b.include("--model", 0.35):
        if b.is_bad("--model"):
            model = b.model("--model", [])
        else:
            model = b.draw(st.sampled_from(["tiny-gpt", "tiny-llama"]))
            b.add("--model", model)
    # Without --model these are refused; with one, only sizes that measure in a second.
    with_model = model is not None or b.draw(st.integers(0, 4)) == 0
    if with_model:
        b.value("--set", ["num_hidden_layers=1"], tagged([(v, k) for v, k in SET_BAD
                                                          if k not in ("layers=1e6",)]), p=0.15)
        b.value("--seq", ["16", "8"], tagged([(v, k) for v, k in BAD_INTS if k != "huge"]), p=0.7)
        b.value("--micro-batch-sizes", ["1", "1,2"], tagged([("0", "zero"), ("-1", "negative"), ("a", "text"),
                                                             (",", "comma"), ("1,,2", "empty item"),
                                                             ("1e300", "huge"), ("1.5", "float"), ("", "empty"),
                                                             ("nan", "nan")]), p=0.7)
        b.value("--tp", ["1", "1,2"], tagged([("3", "3"), ("0", "zero"), ("64", "above heads"), ("1e300", "huge"),
                                              ("a", "text"), ("", "empty"), ("-2", "negative"), ("2,3", "3 listed")]),
                p=0.4)
    b.choice("--attention", ["flash", "eager"], p=0.1)
    extend = b.include("--extend", 0.15)
    if extend:
        b.args.append("--extend")
        if b.is_bad("--extend"):
            out = profile_file(b, "out.json")
        else:
            b.file("out.json", dump_json(bases.profile), f"base profile: shardwise {' '.join(BASE_PROFILE)}")
            out = "out.json"
        b.add("-o", out)
    else:
        b.output("-o", ".json", p=1.0)
    b.output("--spec-out", ".yaml", p=0.2)
    return b.finish()


GENERATORS = {"plan": plan_case, "sweep": sweep_case, "explain": explain_case, "replan": replan_case,
              "export": export_case, "evaluate": evaluate_case, "run": run_case, "profile": profile_case}


def case_strategy(bases: Bases, commands: tuple[str, ...] = COMMANDS) -> st.SearchStrategy:
    pool = [c for c in commands for _ in range(WEIGHTS[c])]
    return st.sampled_from(pool).flatmap(lambda c: GENERATORS[c](bases))


def draw_cases(bases: Bases, n: int, seed: int | None = 0, commands: tuple[str, ...] = COMMANDS,
               derandomize: bool = False) -> list[Case]:
    """n cases drawn by hypothesis (generation only: the cases run afterwards, in parallel)."""
    cases: list[Case] = []

    seen: set = set()

    def collect_with(seed_: int) -> None:
        @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
                  derandomize=derandomize, suppress_health_check=list(HealthCheck))
        @given(case_strategy(bases, commands))
        def collect(case: Case) -> None:
            key = (tuple(case.args), tuple((k, f.content) for k, f in sorted(case.files.items())))
            if key not in seen and len(cases) < n:   # draws that differ only where nothing used them
                seen.add(key)
                cases.append(case)

        (collect if derandomize else hypothesis_seed(seed_)(collect))()

    for attempt in range(1 if derandomize else 10):
        collect_with((seed or 0) * 1000 + attempt)
        if len(cases) >= n:
            break
    return cases


# ---------------------------------------------------------------------------
# Running and checking


@dataclass
class Outcome:
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    new_paths: list[str]
    traceback: str | None = None   # in-process: the exception's traceback
    orphans: int = 0               # processes still running in the case's folder after it ended


@dataclass
class Failure:
    signature: str
    reason: str
    detail: list[str]
    variant: str = ""   # what differs inside one signature (the option of a usage error)


def prepare(case: Case, folder: Path) -> set[str]:
    for name, f in case.files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if f.content is None:
            path.mkdir(exist_ok=True)
        else:
            path.write_bytes(f.content)
    if (folder / "ro").is_dir():
        (folder / "ro").chmod(0o555)
    return snapshot(folder)


def snapshot(folder: Path) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            out.add(os.path.relpath(os.path.join(dirpath, name), folder))
    return out


def cleanup(folder: Path) -> None:
    for dirpath, dirnames, _ in os.walk(folder):
        for d in dirnames:
            try:
                os.chmod(os.path.join(dirpath, d), 0o755)
            except OSError:
                pass
    shutil.rmtree(folder, ignore_errors=True)


def run_subprocess(case: Case, folder: Path, timeout: float = TIMEOUT_S) -> Outcome:
    """Run the case as `python -m planner.console.cli ...` in `folder`; on a time-out, SIGINT
    first (the KeyboardInterrupt traceback says where it hung), then SIGKILL its group."""
    before = prepare(case, folder)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "MPLBACKEND": "Agg", "COLUMNS": "120", "PYTHONIOENCODING": "utf-8"}
    start = time.perf_counter()
    proc = subprocess.Popen(CLI + case.args[0:], cwd=folder, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _signal_group(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=3)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:   # something outside the group holds the pipes
                _kill_running_in(folder)
                out, err = proc.communicate()
    seconds = time.perf_counter() - start
    _signal_group(proc.pid, signal.SIGKILL)
    time.sleep(0.5 if timed_out else 0.0)   # workers that die with torchrun take a moment
    orphans = _kill_running_in(folder)   # torchrun's workers run in sessions of their own
    after = snapshot(folder)
    return Outcome(proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), seconds, timed_out,
                   sorted(after - before), orphans=orphans)


def _kill_running_in(folder: Path) -> int:
    """SIGKILL every process whose working folder is `folder` (what a case started and
    left running); how many there were."""
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if Path(os.readlink(f"/proc/{entry}/cwd")) == folder.resolve():
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
        except OSError:
            pass
    return killed


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class CaseTimeout(BaseException):
    """Raised by the alarm of an in-process case (BaseException: no `except Exception` hides it)."""


def run_in_process(case: Case, folder: Path, timeout: float = TIMEOUT_S) -> Outcome:
    """Run the case with click's CliRunner in this process, in `folder`; an exception other
    than SystemExit is a traceback; an alarm ends a case running past `timeout`."""
    from click.testing import CliRunner

    from planner.console.cli import main

    before = prepare(case, folder)
    old_cwd = os.getcwd()

    def alarm(signum, frame):
        raise CaseTimeout()

    previous = signal.signal(signal.SIGALRM, alarm)
    start = time.perf_counter()
    timed_out, tb, code, out, err = False, None, None, "", ""
    try:
        os.chdir(folder)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        result = CliRunner().invoke(main, case.args, catch_exceptions=True)
        signal.setitimer(signal.ITIMER_REAL, 0)
        code, out, err = result.exit_code, result.stdout, result.stderr
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            tb = "".join(traceback.format_exception(*result.exc_info))
    except CaseTimeout:
        timed_out = True
        tb = traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.chdir(old_cwd)
    seconds = time.perf_counter() - start
    return Outcome(code, out, err, seconds, timed_out, sorted(snapshot(folder) - before), tb)


FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$')


def parse_traceback(text: str) -> tuple[str, str, list[str]] | None:
    """(exception line, where, excerpt) of the traceback in `text` that names this project:
    the first block with a frame of costmodel/planner/executor (the root cause: a rank's
    error before torchrun's ChildFailedError, the original before a chained one), else
    the last block. `where` is that block's innermost project frame."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip().startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    blocks = []
    for n, start in enumerate(starts):
        block = lines[start:starts[n + 1] if n + 1 < len(starts) else len(lines)]
        frames, exc = [], ""
        for line in block[1:]:
            m = FRAME.match(line)
            if m:
                frames.append((m.group(1), m.group(2), m.group(3)))
            elif line.strip() and not line.startswith(" ") and frames:
                exc = line.strip()
                break
        ours = [f for f in frames if f[0].startswith(str(ROOT)) and "/bench/" not in f[0] and "/tests/" not in f[0]]
        blocks.append((block, frames, exc, ours))
    block, frames, exc, ours = next((b for b in blocks if b[3]), blocks[-1])
    where = ours[-1] if ours else (frames[-1] if frames else ("?", "?", "?"))
    rel = os.path.relpath(where[0], ROOT) if where[0].startswith(str(ROOT)) else where[0].split("site-packages/")[-1]
    end = next((i for i, line in enumerate(block) if line.strip() == exc), len(block) - 1) + 1 if exc else len(block)
    block = block[:end]
    excerpt = block[:1] + ["  ..."] + block[-9:] if len(block) > 10 else block
    return exc, f"{rel}:{where[2]} (line {where[1]})", excerpt


def normalize(text: str) -> str:
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"\d+(\.\d+)?(e[+-]?\d+)?", "N", text)
    return text[:140]


def leftover_kind(path: str) -> str:
    if path.endswith(".tmp"):
        return "*.tmp"
    return "a new file or folder"


def check(case: Case, outcome: Outcome) -> list[Failure]:
    """The contract, case by case: allowed exit code, no traceback, a one-line `error: <field>: ...`
    for exit 2 (and 3), within the time limit, nothing left behind on failure."""
    failures = []
    cmd = case.command
    code = outcome.exit_code
    stderr_lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    last = stderr_lines[-1] if stderr_lines else ""
    tb_text = outcome.traceback or ""
    if not tb_text and "Traceback (most recent call last)" in outcome.stdout + outcome.stderr:
        tb_text = outcome.stderr if "Traceback (most recent call last)" in outcome.stderr else outcome.stdout
    parsed = parse_traceback(tb_text) if tb_text else None
    if outcome.timed_out:
        where = parsed[1].split(" (line")[0] if parsed else "?"
        where = "imports" if where.endswith("<module>") else where
        failures.append(Failure(f"timeout: {cmd} (interrupted in {where})", f"no answer within {TIMEOUT_S:g} s",
                                parsed[2] if parsed else stderr_lines[-6:]))
    elif parsed:
        exc, where, excerpt = parsed
        failures.append(Failure(f"traceback: {exc.split(':')[0]} in {where.split(' (line')[0]}",
                                f"exit {code}, traceback: {exc[:300]} at {where}", excerpt))
    else:
        allowed = EXIT_OK_BY_COMMAND.get(cmd, EXIT_OK)
        if code not in allowed:
            failures.append(Failure(f"exit {code}: {cmd}: {normalize(last)}", f"exit code {code} not in {sorted(allowed)}",
                                    stderr_lines[-8:]))
        elif code in (2, 3):
            error_lines = [line for line in stderr_lines if line.startswith("error: ")]
            if code == 2 and last.startswith("Error: "):
                m = re.search(r"(?:option|for) '([^']+)'|No such option: (\S+)|(Got unexpected extra argument)|"
                              r"(Missing argument)|(requires an argument)", outcome.stderr)
                what = next((g for g in (m.groups() if m else ()) if g), last[7:60])
                failures.append(Failure("usage: click's own usage error (`Usage:` / `Error: ...` lines), "
                                        "not `error: <field>: ...`", f"exit 2, click: {last[:200]}",
                                        stderr_lines[-3:], variant=f"{cmd} {normalize(what)}"))
            elif not last.startswith("error: "):
                failures.append(Failure(f"format: {cmd}: exit {code} whose last line is not `error: ...`",
                                        f"last stderr line: {last[:200]!r}", stderr_lines[-6:]))
            elif len(error_lines) > 1:
                failures.append(Failure(f"format: {cmd}: exit {code} with {len(error_lines)} `error:` lines",
                                        "more than one error line", stderr_lines[-6:]))
            elif code == 2 and not re.match(r"^error: [^:\s][^:]*: \S", last):
                failures.append(Failure(f"format: {cmd}: exit 2 names no field: {normalize(last)}",
                                        f"last stderr line: {last[:200]!r}", stderr_lines[-3:]))
    if outcome.orphans:
        failures.append(Failure(f"orphans: {cmd} left processes running", f"{outcome.orphans} processes outlived "
                                f"the case", []))
    tmp = [p for p in outcome.new_paths if p.endswith(".tmp")]
    if outcome.timed_out:
        pass   # interrupted: what it wrote so far is no verdict on its error handling
    elif code != 0:
        if outcome.new_paths:
            failures.append(Failure(f"leftover: {cmd} exit {code} leaves {', '.join(sorted({leftover_kind(p) for p in outcome.new_paths}))}",
                                    f"new paths after a failure: {outcome.new_paths[:5]}", []))
    elif tmp:
        failures.append(Failure(f"leftover: {cmd} exit 0 leaves *.tmp", f"tmp files: {tmp[:5]}", []))
    return failures


# ---------------------------------------------------------------------------
# The report


def report(cases: list[Case], outcomes: list[Outcome], failures: list[list[Failure]], settings_: dict) -> tuple[str, dict]:
    by_command = Counter(c.command for c in cases)
    by_exit = Counter("timeout" if o.timed_out else str(o.exit_code) for o in outcomes)
    by_pair = defaultdict(Counter)
    for c, o in zip(cases, outcomes):
        by_pair[c.command]["timeout" if o.timed_out else str(o.exit_code)] += 1
    times = [o.seconds for o in outcomes]
    per_command_times = defaultdict(list)
    for c, o in zip(cases, outcomes):
        per_command_times[c.command].append(o.seconds)
    groups: dict[str, list[tuple[Case, Outcome, Failure]]] = defaultdict(list)
    for c, o, fs in zip(cases, outcomes, failures):
        for f in fs:
            groups[f.signature].append((c, o, f))
    failing = sum(1 for fs in failures if fs)
    lines = [(f"shardwise CLI fuzz: {len(cases)} cases, seed {settings_['seed']}, {settings_['jobs']} jobs, "
              f"{settings_['runner']}, {settings_['seconds']:.0f} s in all"),
             f"failing cases: {failing}; distinct failure signatures: {len(groups)}", "",
             "cases by command and exit code:"]
    codes = sorted(by_exit, key=lambda k: (k == "timeout", k))
    lines.append(f"  {'command':9s} {'cases':>6s} " + " ".join(f"{'exit ' + k if k != 'timeout' else k:>8s}" for k in codes)
                 + f" {'median s':>9s} {'max s':>7s} {'failing':>8s}")
    failing_by_command = Counter(c.command for c, fs in zip(cases, failures) if fs)
    for cmd in COMMANDS:
        if not by_command[cmd]:
            continue
        ts = per_command_times[cmd]
        lines.append(f"  {cmd:9s} {by_command[cmd]:6d} " + " ".join(f"{by_pair[cmd][k]:8d}" for k in codes)
                     + f" {statistics.median(ts):9.2f} {max(ts):7.2f} {failing_by_command[cmd]:8d}")
    lines.append(f"  {'all':9s} {len(cases):6d} " + " ".join(f"{by_exit[k]:8d}" for k in codes)
                 + f" {statistics.median(times):9.2f} {max(times):7.2f} {failing:8d}")
    modes = Counter(c.mode for c in cases)
    lines += ["", "cases by mode: " + ", ".join(f"{k} {v}" for k, v in sorted(modes.items()))
              + " (valid: every option valid; mutated: 1-3 options or files bad; chaos: also a broken command line)"]
    lines += ["", (f"time per case: median {statistics.median(times):.2f} s, max {max(times):.2f} s "
                   f"(mean {statistics.mean(times):.2f} s)"), ""]
    lines.append(f"failures by signature ({len(groups)}), most cases first:")
    doc_groups = []
    order = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    for n, (sig, items) in enumerate(order, 1):
        commands = sorted({c.command for c, _, _ in items})
        lines += ["", f"[{n}] {sig}", f"    {len(items)} case(s); commands: {', '.join(commands)}"]
        variants = Counter(f.variant for _, _, f in items if f.variant)
        if variants:
            lines.append("    variants: " + ", ".join(f"{v} ({k})" for v, k in variants.most_common()))
        unique, seen_lines = [], set()
        for item in sorted(items, key=lambda x: (len(x[0].files), len(x[0].command_line()))):
            if item[0].command_line() not in seen_lines:
                seen_lines.add(item[0].command_line())
                unique.append(item)
        examples = unique[:3]
        for c, o, f in examples:
            lines.append(f"    $ {c.command_line()}")
            for name, file in c.files.items():
                size = "folder" if file.content is None else f"{len(file.content)} bytes"
                lines.append(f"        file {name} ({size}): {file.recipe[:400]}")
                if file.content is not None and len(file.content) <= 300 and not name.endswith(".json"):
                    lines.append(f"          content: {file.content!r}")
            lines.append(f"      -> exit {o.exit_code}{' (timed out)' if o.timed_out else ''} in {o.seconds:.2f} s: {f.reason[:400]}")
        first = examples[0][2]
        for line in first.detail[:14]:
            lines.append(f"      | {line[:300]}")
        doc_groups.append({"signature": sig, "cases": len(items), "commands": commands,
                           "examples": [{**c.as_dict(), "command_line": c.command_line(), "exit_code": o.exit_code,
                                         "timed_out": o.timed_out, "seconds": round(o.seconds, 3),
                                         "reason": f.reason, "detail": f.detail,
                                         "stderr_tail": o.stderr.splitlines()[-8:]}
                                        for c, o, f in examples]})
    accepted = [(c, o) for c, o in zip(cases, outcomes)
                if o.exit_code == 0 and not o.timed_out and any(t.endswith("edited") for t in c.tags)]
    lines += ["", f"edited input files accepted (exit 0; not a contract failure, but worth a look): {len(accepted)}"]
    for c, o in sorted(accepted, key=lambda x: x[0].command):
        edits = [f"{name}: {f.recipe.split(', then ', 1)[-1][:200]}" for name, f in c.files.items()
                 if ", then " in f.recipe]
        lines.append(f"  {c.command:9s} {'; '.join(edits)}")
    doc = {"settings": settings_, "cases": len(cases), "failing_cases": failing,
           "by_command": dict(by_command), "by_exit": dict(by_exit), "by_command_exit": {k: dict(v) for k, v in by_pair.items()},
           "seconds_per_case": {"median": statistics.median(times), "max": max(times), "mean": statistics.mean(times),
                                "by_command": {k: {"median": statistics.median(v), "max": max(v)}
                                               for k, v in per_command_times.items()}},
           "failures": doc_groups,
           "all_cases": [{**c.as_dict(), "exit_code": o.exit_code, "timed_out": o.timed_out,
                          "seconds": round(o.seconds, 3), "failures": [f.signature for f in fs]}
                         for c, o, fs in zip(cases, outcomes, failures)]}
    return "\n".join(lines) + "\n", doc


def subprocess_invoke(args: list[str], cwd: Path) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    p = subprocess.run(CLI + args, check=False, cwd=cwd, capture_output=True, text=True, env=env, timeout=120)
    return p.returncode, p.stdout, p.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--commands", default=",".join(COMMANDS), help="comma-separated subset of the commands")
    parser.add_argument("--out", default=str(RESULTS / "fuzz_cli"), help="results path without extension")
    args = parser.parse_args()
    commands = tuple(c for c in args.commands.split(",") if c)
    scratch = Path(tempfile.mkdtemp(prefix="fuzz_cli_"))
    started = time.perf_counter()
    try:
        bases = make_bases(subprocess_invoke, scratch / "bases")
        cases = draw_cases(bases, args.cases, args.seed, commands)
        print(f"{len(cases)} cases drawn in {time.perf_counter() - started:.1f} s; running with {args.jobs} jobs",
              file=sys.stderr)
        outcomes: list[Outcome | None] = [None] * len(cases)
        done = [0]
        slots, exclusive = threading.Semaphore(args.jobs), threading.Lock()

        def one(i: int) -> None:
            # `run` and `profile` start processes of their own (torchrun's ranks, the collectives'
            # processes): they run alone, so that the 10 s limit measures them, not the neighbours.
            alone = cases[i].command in ALONE
            if alone:
                with exclusive:
                    for _ in range(args.jobs):
                        slots.acquire()
            else:
                slots.acquire()
            folder = scratch / f"case{i:05d}"
            folder.mkdir()
            try:
                outcomes[i] = run_subprocess(cases[i], folder)
            finally:
                cleanup(folder)
                for _ in range(args.jobs if alone else 1):
                    slots.release()
            done[0] += 1
            if done[0] % 50 == 0:
                print(f"  {done[0]}/{len(cases)} cases, {time.perf_counter() - started:.0f} s", file=sys.stderr)

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(one, range(len(cases))))
        failures = [check(c, o) for c, o in zip(cases, outcomes)]
        settings_ = {"seed": args.seed, "jobs": args.jobs, "cases": args.cases, "commands": list(commands),
                     "runner": "subprocess", "timeout_s": TIMEOUT_S, "seconds": time.perf_counter() - started,
                     "python": sys.version.split()[0], "cpus": os.cpu_count()}
        text, doc = report(cases, outcomes, failures, settings_)
    finally:
        cleanup(scratch)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".txt").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"written {out.with_suffix('.txt')} and {out.with_suffix('.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()
