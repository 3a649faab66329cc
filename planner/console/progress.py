"""Progress bars for the command line's long work (the search, a sweep of sizes).

`progress_bar` draws a rich bar on stderr and hands out a `(done, total)` callback, the
protocol planner.search.search takes. Nothing goes to stdout, which holds `--format
json` documents, and nothing at all is drawn when stderr is not a terminal (pipes, log
files, click's CliRunner), so captured output stays what it was. The bar is transient:
it disappears when the work ends and leaves the terminal to the tables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

# (done, total, description=None): the bar's new position, and a new label if given.
Update = Callable[..., None]


def _quiet(done: int, total: int, description: str | None = None) -> None:
    """The callback when no bar is drawn."""


@contextmanager
def progress_bar(description: str, console: Console | None = None) -> Iterator[Update]:
    """A bar labelled `description` for the `with` block; the callback it yields moves it
    to `done` of `total` (a search's candidates, a sweep's sizes) and may relabel it."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield _quiet
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int, description: str | None = None) -> None:
            bar.update(task, completed=done, total=total,
                       **({"description": description} if description is not None else {}))

        yield update
