"""The `dflash-ops` app: global options, and one module per command group registered on it.
Commands import the domain modules they need inside their bodies, so `dflash-ops --help` and
shell completion start fast (no paramiko, numpy, matplotlib or torch at start-up)."""
from __future__ import annotations

from typing import Optional

import typer

from . import clean, config, evals, export, hosts, runs, sync, watch
from .context import options
from .guard import GuardedGroup

app = typer.Typer(
    name="dflash-ops",
    cls=GuardedGroup,
    help="Evaluate DFlash drafter checkpoints on remote GPU hosts, sync checkpoints, write reports.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"dflash-ops {version('dflash-ops')}")
        except PackageNotFoundError:
            typer.echo("dflash-ops (not installed)")
        raise typer.Exit()


@app.callback()
def main_options(
    ctx: typer.Context,
    inventory: Optional[str] = typer.Option(
        None, "--inventory", "-i", metavar="PATH",
        help="Inventory file (default: $DFLASH_OPS_INVENTORY, ./inventory.yaml, then inventory.yaml in the "
             "user config folder; else only `local`; `dflash-ops config` shows which)."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
):
    options(ctx).inventory_path = inventory


for group in (hosts, runs, evals, sync, export, config, watch, clean):
    group.register(app)


def _quiet_channel_files_at_exit() -> None:
    """paramiko's channel files (stdin/stdout/stderr of a remote command) whose channel is gone
    raise ValueError from their ``__del__`` when Python collects them at exit: a traceback on the
    user's terminal after a command that succeeded, with nothing lost. Those, and only those, are
    not printed."""
    import sys

    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, ValueError) and \
                getattr(unraisable.object, "__qualname__", "") == "BufferedFile.__del__":
            return
        previous(unraisable)
    sys.unraisablehook = hook


def _terminate_like_ctrl_c() -> None:
    """SIGTERM and SIGHUP (a closed terminal, a killed session) end a command the way Ctrl-C does:
    through its cleanup (a followed eval detaches, a sync stops its transfers) and the exit
    handlers (the Ray tunnel is closed, its files removed), never by dying on the spot."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)


def main() -> None:
    _quiet_channel_files_at_exit()
    _terminate_like_ctrl_c()
    app()
