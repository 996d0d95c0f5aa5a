"""The one error guard: every command runs inside it. An expected failure (any
orchestrator.errors.DflashOpsError) becomes one red line on stderr and its ``exit_code``;
Ctrl-C becomes exit 130; anything else is a bug and keeps its traceback."""
from __future__ import annotations

from contextlib import contextmanager

import typer
from typer.core import TyperGroup

from ..errors import DflashOpsError
from .console import error_line

INTERRUPTED = 130


@contextmanager
def guard():
    try:
        yield
    except DflashOpsError as e:
        error_line(str(e))
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        error_line("interrupted")
        raise typer.Exit(INTERRUPTED) from None


class GuardedGroup(TyperGroup):
    """The root command group: its subcommands (and their callbacks) run inside :func:`guard`."""

    def invoke(self, ctx):
        with guard():
            return super().invoke(ctx)
