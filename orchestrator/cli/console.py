"""The one place output is made for a terminal: rich consoles on stdout/stderr, the red error
line, tables, and plain JSON for ``--json``.

Widths: a terminal's own width (or ``$COLUMNS``); a pipe without ``$COLUMNS`` gets 200 columns so
table rows stay on one line. A table never cuts a cell: where its rows fit, it is a table; where
only its free-text columns (``wrap``) are too wide, those wrap inside it; where neither, a list
(one record per row, ``column value`` pairs).
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Sequence

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

PIPE_WIDTH = 200
# C0 controls but tab and newline, DEL and C1: what makes escape sequences (a window title, the
# clipboard, a cleared screen, a rewritten line) out of text
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean(value) -> str:
    """``value`` as text without control characters: whatever a host, a worker or a file sent
    reaches the terminal as data, never as terminal commands."""
    return _CONTROL.sub("", str(value))


def safe(value) -> str:
    """``value`` as data in rich markup: control characters stripped (:func:`clean`) and markup
    escaped, so ``[/x]`` in a prompt id is text, not a tag. Everything printed that did not come
    from this code goes through it."""
    return escape(clean(value))


def _console(stream) -> Console:
    width = None if stream.isatty() or os.environ.get("COLUMNS", "").isdigit() else PIPE_WIDTH
    return Console(file=stream, width=width, highlight=False)


def out() -> Console:
    """The console on stdout (results)."""
    return _console(sys.stdout)


def err() -> Console:
    """The console on stderr (progress, warnings, errors)."""
    return _console(sys.stderr)


def error_line(message: str) -> None:
    """The one red line of an expected failure (never wrapped: one line, whatever the width)."""
    err().print(f"[bold red]error:[/] [red]{safe(message)}[/]", soft_wrap=True)


def warning_line(message: str) -> None:
    """One yellow line, never wrapped (it may name a path a user copies)."""
    err().print(f"[bold yellow]warning:[/] [yellow]{safe(message)}[/]", soft_wrap=True)


def print_json(data) -> None:
    print(json.dumps(data, indent=2, default=str))


MIN_WRAP = 24   # a free-text column narrower than this is hard to read: the table becomes a list


class Tabular:
    """A table that fits the console it is printed on: a rich table when every cell fits on one
    line, or when only the ``wrap`` columns (free text: a versions list, a path) do not and they
    keep at least MIN_WRAP columns; else a list with one record per row (nothing is ever cut:
    ids stay whole)."""

    def __init__(self, title, header, cells, right, caption, show_header, transpose, wrap=()):
        self.title, self.header, self.cells = title, list(header), cells
        self.right, self.caption, self.show_header, self.transpose = set(right), caption, show_header, transpose
        self.wrap = set(wrap)

    def widths(self, max_width: int) -> list[int] | None:
        """Each column's width within ``max_width``: every cell on one line, else the ``wrap``
        columns narrowed (sharing what is left, none below MIN_WRAP); None when even that does
        not fit (a table whose ids or numbers wrap is hard to read: it becomes a list)."""
        columns = [[Text(clean(h))] * self.show_header + [r[i] for r in self.cells] for i, h in enumerate(self.header)]
        full = [max(max(cell_len(line) for line in t.plain.splitlines() or [""]) for t in col) for col in columns]
        room = max_width - 3 * len(full) - 1     # padding and borders
        if sum(full) <= room:
            return full
        wrapping = [i for i, h in enumerate(self.header) if h in self.wrap]
        left = room - sum(w for i, w in enumerate(full) if i not in wrapping)
        if not wrapping or left < MIN_WRAP * len(wrapping):
            return None
        widths = list(full)
        for n, i in enumerate(sorted(wrapping, key=lambda i: full[i])):   # narrow ones keep their width
            widths[i] = min(full[i], left // (len(wrapping) - n))
            left -= widths[i]
        return widths

    def table(self, widths: list[int]) -> Table:
        t = Table(title=safe(self.title) if self.title else None, caption=safe(self.caption) if self.caption else None,
                  show_header=self.show_header)
        for h, w in zip(self.header, widths):
            t.add_column(safe(h), justify="right" if h in self.right else "left", width=w, overflow="fold")
        for r in self.cells:
            t.add_row(*r)
        return t

    def records(self) -> Group:
        """One record per row (or, ``transpose``d, per column): its first cell, then the other
        cells as ``column value`` pairs."""
        parts = [Text(clean(self.title), style="italic")] if self.title else []
        header, cells = self.header, self.cells
        if self.transpose:
            header = [self.header[0]] + [r[0].plain for r in self.cells]
            cells = [[Text(clean(h))] + [r[i] for r in self.cells] for i, h in enumerate(self.header) if i]
        for r in cells:
            parts.append(Text.assemble(r[0], style="bold"))
            pairs = Text(" · ").join(Text.assemble((f"{h} ", "dim"), c)
                                     for h, c in zip(header[1:], r[1:]) if c.plain not in ("", "-", "—"))
            parts.append(Padding(pairs, (0, 0, 0, 2), expand=False))
        if self.caption:
            parts.append(Text(clean(self.caption), style="dim"))
        return Group(*parts)

    def __rich_console__(self, console: Console, options: ConsoleOptions):
        widths = self.widths(options.max_width)
        yield self.table(widths) if widths else self.records()


def table(title: str | None, header: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[str] = (),
          caption: str | None = None, show_header: bool = True, markup: bool = False,
          transpose: bool = False, wrap: Sequence[str] = ()) -> Tabular:
    """A table that fits the terminal (see :class:`Tabular`); cells are data (:func:`clean`) unless ``markup``
    (then they may carry [colour] tags, their data made :func:`safe` by the caller). Columns named in ``right`` are right-aligned; columns
    named in ``wrap`` hold free text that may wrap inside the table rather than turn it into a
    list. ``transpose``: as a list, one record per column (a table of runs side by side)."""
    cells = [[Text.from_markup(str(c)) if markup else Text(clean(c)) for c in r] for r in rows]
    return Tabular(title, header, cells, right, caption, show_header, transpose, wrap)
