"""The one error guard: every command runs inside it. An expected failure (any
orchestrator.errors.DflashOpsError) becomes one red line on stderr and its ``exit_code``;
Ctrl-C becomes exit 130; a write this machine's full or read-only disk refused, one line (exit 1);
anything else is a bug and keeps its traceback. A DflashOpsWarning becomes one yellow line."""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import typer
from typer.core import TyperGroup

from ..errors import DflashOpsError, DflashOpsWarning, OperationFailed, disk_error
from .console import error_line, warning_line

INTERRUPTED = 130


@contextmanager
def guard():
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message, category, *args, **kwargs):
            if issubclass(category, DflashOpsWarning):
                warning_line(str(message))
            else:
                shown(message, category, *args, **kwargs)
        warnings.showwarning = show
        with _errors():
            yield


@contextmanager
def _errors():
    try:
        yield
    except DflashOpsError as e:
        error_line(str(e))
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        error_line("interrupted")
        raise typer.Exit(INTERRUPTED) from None
    except OSError as e:
        if not disk_error(e):
            raise
        where = f" to {os.path.dirname(e.filename)}" if e.filename else ""
        error_line(f"cannot write{where} on this machine: {e.strerror}; free space (or give --runs-dir a writable "
                   f"folder) and run the command again")
        raise typer.Exit(OperationFailed.exit_code) from None


class GuardedGroup(TyperGroup):
    """The root command group: its subcommands (and their callbacks) run inside :func:`guard`;
    their help is tidied for the terminal (cli/helptext.py)."""

    def main(self, *args, **kwargs):
        from .helptext import tidy

        tidy(self)
        return super().main(*args, **kwargs)

    def invoke(self, ctx):
        with guard():
            return super().invoke(ctx)
