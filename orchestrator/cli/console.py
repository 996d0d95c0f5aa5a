"""The one place output is made for a terminal: rich consoles on stdout/stderr, the red error
line, tables, and plain JSON for ``--json``."""
from __future__ import annotations

import json
import sys
from typing import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def _console(stream, stderr: bool) -> Console:
    # not a terminal (a pipe, a test): wide enough that table rows stay on one line
    return Console(file=stream, width=None if stream.isatty() else 200, highlight=False, soft_wrap=stderr)


def out() -> Console:
    """The console on stdout (results)."""
    return _console(sys.stdout, stderr=False)


def err() -> Console:
    """The console on stderr (progress, warnings, errors)."""
    return _console(sys.stderr, stderr=True)


def error_line(message: str) -> None:
    err().print(f"[bold red]error:[/] [red]{escape(message)}[/]")


def warning_line(message: str) -> None:
    err().print(f"[bold yellow]warning:[/] [yellow]{escape(message)}[/]")


def print_json(data) -> None:
    print(json.dumps(data, indent=2, default=str))


def table(title: str | None, header: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[str] = (),
          caption: str | None = None, show_header: bool = True, markup: bool = False) -> Table:
    """A rich table; cells are escaped unless ``markup`` (then they may carry [colour] tags).
    Columns named in ``right`` are right-aligned."""
    t = Table(title=title, caption=caption, show_header=show_header)
    for h in header:
        t.add_column(escape(h), justify="right" if h in right else "left")
    for r in rows:
        t.add_row(*[str(c) if markup else escape(str(c)) for c in r])
    return t
