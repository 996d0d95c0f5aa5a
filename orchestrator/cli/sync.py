"""`dflash-ops sync-ckpt` and `ckpts`."""
from __future__ import annotations

from typing import Optional

import typer
from rich.markup import escape

from . import console
from .context import CATALOG_HELP, inventory


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


def _print_plan(out, plan) -> None:
    from ..render import human_bytes

    out.print(console.table(f"{plan.src.name}:{plan.src_dir} → {plan.dst.name}:{plan.dst_final}",
                            ["file", "size", "action", "from"],
                            [[f.path, human_bytes(f.size), f.action, human_bytes(f.offset) if f.action == "resume" else "-"]
                             for f in plan.files], right=("size", "from")))
    if plan.incomplete:
        out.print(f"[yellow]not complete yet on {escape(plan.src.name)}: {escape(plan.incomplete)}; a sync now is refused[/]")
    if plan.up_to_date:
        out.print("[green]already on the destination and verified: nothing to move[/]")
    elif plan.final_exists:
        out.print(f"[yellow]{escape(plan.dst_final)} exists (not identical or unverified)[/]")
    else:
        free = "" if plan.free_bytes is None else f", {human_bytes(plan.free_bytes)} free there"
        out.print(f"to move: {human_bytes(plan.to_move)} of {human_bytes(plan.total)}{free}")


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
    catalog: Optional[str] = typer.Option(None, "--catalog", metavar="PATH", help=CATALOG_HELP),
):
    """Copy a training checkpoint to the eval host: streamed through here, resumable, sha256-verified, atomic."""
    from ..catalog import load_catalog
    from ..render import human_bytes
    from ..sync import sync_checkpoint

    inv = inventory(ctx)
    err, out = console.err(), console.out()
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


def ckpts_cmd(
    ctx: typer.Context,
    run: Optional[str] = typer.Argument(None, help="Training run (default: all runs in the catalog)."),
    src: Optional[str] = typer.Option(None, "--from", metavar="HOST", help="Training host (default: by role)."),
    dst: Optional[str] = typer.Option(None, "--to", metavar="HOST", help="Eval host (default: by role)."),
    catalog: Optional[str] = typer.Option(None, "--catalog", metavar="PATH", help=CATALOG_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the checkpoints as JSON."),
):
    """List a run's checkpoints on the training host: step, size, time, and whether on the eval host."""
    from dataclasses import asdict
    from datetime import datetime

    from ..catalog import load_catalog
    from ..render import human_bytes
    from ..sync import list_checkpoints

    rows, warnings = list_checkpoints(inventory(ctx), load_catalog(catalog), run, src_name=src, dst_name=dst)
    if as_json:
        console.print_json({"checkpoints": [asdict(r) for r in rows], "warnings": warnings})
        return
    out = console.out()
    colour = {"yes": "green", "partial": "yellow", "no": "dim", "?": "red"}
    out.print(console.table("checkpoints on the training host", ["run", "checkpoint", "step", "size", "files", "time",
                                                                 "on eval"], [
        [escape(r.run), escape(r.name), "-" if r.step is None else str(r.step), human_bytes(r.size), str(r.files),
         datetime.fromtimestamp(r.mtime).strftime("%Y-%m-%d %H:%M"), f"[{colour[r.on_eval]}]{r.on_eval}[/]"]
        for r in rows], markup=True))
    for w in warnings:
        out.print(f"[yellow]! {escape(w)}[/]")


def register(app: typer.Typer) -> None:
    app.command("sync-ckpt")(sync_ckpt_cmd)
    app.command("ckpts")(ckpts_cmd)
