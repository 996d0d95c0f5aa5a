"""The `dflash-ops` command line: the only code that imports typer and rich.

- app.py: the app and global options (--inventory, --version, shell completion)
- guard.py: the one error guard (an expected error -> one red line and its exit code)
- console.py: the consoles, tables and JSON output
- hosts.py, runs.py, evals.py, sync.py, export.py: one module per command group
"""
from .app import app, main

__all__ = ["app", "main"]
