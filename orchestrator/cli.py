"""The `dflash-ops` command line. Keep imports here light: `dflash-ops --help` must start fast."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import List, Optional

import typer

from .inventory import InventoryError, load_inventory

app = typer.Typer(
    name="dflash-ops",
    help="Evaluate DFlash drafter checkpoints on remote GPU hosts, sync checkpoints, write reports.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
hosts_app = typer.Typer(help="List the inventory's hosts; `hosts check` probes them.",
                        invoke_without_command=True)
app.add_typer(hosts_app, name="hosts")


def _console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=None if stream.isatty() else 200, highlight=False,
                   soft_wrap=stderr)


def fail(message: str, code: int = 2) -> "typer.Exit":
    from rich.markup import escape

    _console(stderr=True).print(f"[bold red]error:[/] [red]{escape(message)}[/]")
    return typer.Exit(code)


@contextmanager
def user_errors():
    """Turn expected errors into one clean red line and exit code 2 (never a traceback)."""
    from .transport import TransportError

    try:
        yield
    except (InventoryError, TransportError) as e:
        raise fail(str(e)) from None


@app.callback()
def main_options(
    ctx: typer.Context,
    inventory: Optional[str] = typer.Option(
        None, "--inventory", "-i", metavar="PATH",
        help="Inventory file (default: $DFLASH_OPS_INVENTORY, ./inventory.yaml, else only `local`)."),
):
    ctx.obj = {"inventory": inventory}


def _inventory(ctx: typer.Context):
    path = (ctx.find_root().obj or {}).get("inventory")
    with user_errors():
        return load_inventory(path)


@hosts_app.callback()
def hosts(ctx: typer.Context):
    """List hosts and their roles (with no subcommand)."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.table import Table

    inv = _inventory(ctx)
    table = Table(title=f"hosts ({inv.path or 'built-in only'})")
    for col in ("name", "roles", "address", "python", "workdir", "checkpoints", "sglang", "gpus"):
        table.add_column(col)
    for h in inv:
        address = "(local subprocess)" if h.is_local else (
            f"{h.user + '@' if h.user else ''}{h.address}:{h.port}" + (f" via {h.jump}" if h.jump else ""))
        table.add_row(h.name, ",".join(h.roles), address, h.python, h.workdir or "-",
                      h.checkpoints or "-", h.sglang or "-", "-" if h.gpus is None else str(h.gpus))
    _console().print(table)


@hosts_app.command("check")
def hosts_check(
    ctx: typer.Context,
    names: Optional[List[str]] = typer.Argument(None, help="Hosts to check (default: all)."),
    timeout: float = typer.Option(60.0, help="Seconds allowed per host."),
):
    """Connect to hosts in parallel and report python, torch/CUDA, GPUs, disk and SGLang."""
    from rich.markup import escape
    from rich.table import Table

    from .hostcheck import check_hosts

    inv = _inventory(ctx)
    with user_errors():
        selected = [inv.get(n) for n in names] if names else list(inv)
    reports = check_hosts(selected, timeout=timeout, inventory=inv)

    table = Table(title="hosts check")
    for col in ("host", "ok", "python", "torch", "cuda", "transformers", "fla", "gpus",
                "free (workdir / ckpts)", "sglang", "model"):
        table.add_column(col)
    for r in reports:
        disk = " / ".join(r.disk.get(k) or "-" for k in ("workdir", "checkpoints"))
        table.add_row(
            r.name, "[green]ok[/]" if r.ok else "[red]FAIL[/]", r.python or "-", r.torch or "-",
            r.cuda or "-", r.transformers or "-", r.fla or "-", escape(", ".join(r.gpus) or "none"),
            disk, r.sglang or "-", escape(r.model or "-"))
    out = _console()
    out.print(table)
    for r in reports:
        for e in r.errors:
            out.print(f"[red]✘ {escape(r.name)}: {escape(e)}[/]")
        for w in r.warnings:
            out.print(f"[yellow]! {escape(r.name)}: {escape(w)}[/]")
    failed = [r.name for r in reports if not r.ok]
    if failed:
        out.print(f"[bold red]{len(failed)} of {len(reports)} host(s) failed: {', '.join(failed)}[/]")
        raise typer.Exit(1)


# --- runs, show, compare (bodies in runs.py, report.py, compare.py; imported lazily) ---------------
_RUNS_DIR_HELP = "Runs folder (default: $DFLASH_OPS_RUNS, else ./runs)."


@app.command("runs")
def runs_cmd(
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Only runs of this drafter label."),
    suite: Optional[str] = typer.Option(None, "--suite", help="Only runs of this suite."),
    host: Optional[str] = typer.Option(None, "--host", help="Only runs on this host."),
    status: Optional[str] = typer.Option(None, "--status", help="Only runs with this status (done, failed, running)."),
    as_json: bool = typer.Option(False, "--json", help="Print the list as JSON."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=_RUNS_DIR_HELP),
):
    """List runs: id, drafter, checkpoint, target, suite, prompts, τ, host, date, status."""
    from .runs import cli_runs

    cli_runs(runs_dir, drafter=drafter, suite=suite, host=host, status=status, as_json=as_json)


@app.command("show")
def show_cmd(
    run: str = typer.Argument(..., help="A run id, a drafter label (newest run) or DRAFTER:CHECKPOINT."),
    rewrite: bool = typer.Option(False, "--rewrite", help="Rewrite report.md/report.html even if current."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=_RUNS_DIR_HELP),
):
    """Print a run's summary and the paths of its report (written if missing or stale)."""
    from .report import cli_show

    cli_show(run, runs_dir, rewrite=rewrite)


@app.command("compare")
def compare_cmd(
    runs: List[str] = typer.Argument(..., help="Runs to compare (labels or ids); the first is the baseline."),
    force: bool = typer.Option(False, "--force", help="Compare even when the runs do not pair (common prompts)."),
    resamples: int = typer.Option(10000, "--resamples", help="Bootstrap / permutation resamples."),
    seed: int = typer.Option(0, "--seed", help="Seed of the bootstrap and permutation test."),
    published: Optional[str] = typer.Option(None, "--published", metavar="BENCH",
                                            help="Show published numbers for BENCH (default: from the suite name)."),
    no_published: bool = typer.Option(False, "--no-published", help="Never show published numbers."),
    out: Optional[str] = typer.Option(None, "--out", metavar="DIR", help="Folder for compare.md/.html."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=_RUNS_DIR_HELP),
):
    """Pair runs prompt by prompt and compare them with the first: τ, per-position acceptance,
    DDTree, win/tie/loss, paired-bootstrap CIs and p-values. Exit code 3 when the runs do not pair."""
    from .compare import cli_compare

    cli_compare(runs, runs_dir_opt=runs_dir, force=force, resamples=resamples, seed=seed,
                published=published, no_published=no_published, out=out, as_json=as_json)


from .cli_eval import register as _register_eval  # noqa: E402  (eval, attach, cancel)

_register_eval(app)


# --- sync-ckpt, ckpts -----------------------------------------------------------------------------


class _SyncBars:
    """rich progress bars for a sync: one for the checkpoint, one per file."""

    def __init__(self, console):
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                             TimeRemainingColumn(), console=console, transient=False)
        self.total = None
        self.files: dict[str, int] = {}

    def start(self, plan) -> None:
        self.total = self.bars.add_task(f"[bold]{plan.checkpoint}", total=plan.to_move)
        self.bars.start()

    def file_started(self, f) -> None:
        self.files[f.path] = self.bars.add_task(f"  {f.path}", total=f.size, completed=f.offset)

    def moved(self, f, n: int) -> None:
        self.bars.advance(self.files[f.path], n)
        self.bars.advance(self.total, n)

    def file_restarted(self, f, lost: int) -> None:
        self.bars.update(self.files[f.path], completed=0)
        self.bars.update(self.total, total=self.bars.tasks[self.total].total + lost)

    def stop(self) -> None:
        self.bars.stop()


def _print_plan(console, plan) -> None:
    from rich.markup import escape
    from rich.table import Table

    from .render import human_bytes

    t = Table(title=f"{plan.src.name}:{plan.src_dir} → {plan.dst.name}:{plan.dst_final}")
    for c in ("file", "size", "action", "from"):
        t.add_column(c, justify="right" if c in ("size", "from") else "left")
    for f in plan.files:
        t.add_row(escape(f.path), human_bytes(f.size), f.action, human_bytes(f.offset) if f.action == "resume" else "-")
    console.print(t)
    if plan.up_to_date:
        console.print("[green]already on the destination and verified: nothing to move[/]")
    elif plan.final_exists:
        console.print(f"[yellow]{escape(plan.dst_final)} exists (not identical or unverified)[/]")
    else:
        free = "" if plan.free_bytes is None else f", {human_bytes(plan.free_bytes)} free there"
        console.print(f"to move: {human_bytes(plan.to_move)} of {human_bytes(plan.total)}{free}")


@contextmanager
def _sync_errors():
    from .catalog import CatalogError
    from .sync import SyncError

    try:
        yield
    except (SyncError, CatalogError) as e:
        raise fail(str(e)) from None


@app.command("sync-ckpt")
def sync_ckpt_cmd(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Checkpoint: step20k, 20000, step_20000, 20k, a folder name, or latest."),
    run: Optional[str] = typer.Option(None, "--run", help="Training run (configs/drafters.yaml; default: newest)."),
    src: Optional[str] = typer.Option(None, "--from", metavar="HOST", help="Source host (default: the train host)."),
    dst: Optional[str] = typer.Option(None, "--to", metavar="HOST", help="Destination host (default: the eval host)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the plan (send/resume/skip per file); move nothing."),
    jobs: int = typer.Option(4, "--jobs", "-j", min=1, help="Files moved at once."),
    direct: Optional[bool] = typer.Option(None, "--direct/--relay",
                                          help="The eval host pulls from the train host itself (default: run's `direct`)."),
    lock_wait: float = typer.Option(60.0, "--lock-wait", metavar="S", help="Wait this long for another sync's lock."),
    catalog: Optional[str] = typer.Option(None, "--catalog", metavar="PATH", help="Catalog (default: configs/drafters.yaml)."),
):
    """Copy a training checkpoint to the eval host: streamed through here, resumable, sha256-verified, atomic."""
    from .catalog import load_catalog
    from .render import human_bytes
    from .sync import sync_checkpoint

    inv = _inventory(ctx)
    err, out = _console(stderr=True), _console()
    with user_errors(), _sync_errors():
        result = sync_checkpoint(inv, load_catalog(catalog), name, run=run, src_name=src, dst_name=dst, jobs=jobs,
                                 dry_run=dry_run, direct=direct, lock_wait=lock_wait,
                                 progress=_SyncBars(err) if err.is_terminal else None,
                                 on_plan=lambda p: _print_plan(out, p))
    if dry_run:
        return
    p = result.plan
    moved = f"moved {human_bytes(result.bytes_moved)} in {result.seconds:.1f}s ({human_bytes(result.rate)}/s)"
    extra = f", re-sent after a checksum mismatch: {', '.join(result.resent)}" if result.resent else ""
    out.print(f"[green]✔[/] {p.run}/{p.checkpoint} on {p.dst.name}:{p.dst_final}: {moved}; "
              f"{result.verified} file(s) verified (sha256), {result.skipped} already there{extra}")


@app.command("ckpts")
def ckpts_cmd(
    ctx: typer.Context,
    run: Optional[str] = typer.Argument(None, help="Training run (default: all runs in the catalog)."),
    src: Optional[str] = typer.Option(None, "--from", metavar="HOST", help="Training host (default: by role)."),
    dst: Optional[str] = typer.Option(None, "--to", metavar="HOST", help="Eval host (default: by role)."),
    catalog: Optional[str] = typer.Option(None, "--catalog", metavar="PATH", help="Catalog (default: configs/drafters.yaml)."),
):
    """List a run's checkpoints on the training host: step, size, time, and whether on the eval host."""
    from datetime import datetime

    from rich.table import Table

    from .catalog import load_catalog
    from .render import human_bytes
    from .sync import list_checkpoints

    inv = _inventory(ctx)
    out = _console()
    with user_errors(), _sync_errors():
        rows, warnings = list_checkpoints(inv, load_catalog(catalog), run, src_name=src, dst_name=dst)
    t = Table(title="checkpoints on the training host")
    for c in ("run", "checkpoint", "step", "size", "files", "time", "on eval"):
        t.add_column(c)
    colour = {"yes": "green", "partial": "yellow", "no": "dim", "?": "red"}
    for r in rows:
        t.add_row(r.run, r.name, "-" if r.step is None else str(r.step), human_bytes(r.size), str(r.files),
                  datetime.fromtimestamp(r.mtime).strftime("%Y-%m-%d %H:%M"), f"[{colour[r.on_eval]}]{r.on_eval}[/]")
    out.print(t)
    for w in warnings:
        out.print(f"[yellow]! {w}[/]")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
