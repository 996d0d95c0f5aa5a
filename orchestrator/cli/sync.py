"""`dflash-ops sync-ckpt` and `ckpts`."""
from __future__ import annotations

from typing import Optional

import typer

from . import console
from .console import safe
from .context import CATALOG_HELP
from .context import names as context_names


def shown(name: str) -> str:
    """A file or folder name as a table shows it: every character a terminal does not print as
    itself (a newline would make a fake row) as its escape (``\\n``)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)


def name_cell(name: str) -> str:
    """:func:`shown`, as data in rich markup."""
    return safe(shown(name))


def _rate_column():
    """Bytes per second in the units of every other size dflash-ops prints (KiB, MiB: human_bytes)."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    from ..reports.render import human_bytes

    class Rate(ProgressColumn):
        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else f"{human_bytes(speed)}/s", style="progress.data.speed")
    return Rate()


class _SyncBars:
    """rich progress bars for a sync: one for the checkpoint, one per file but the small ones that
    move in batches; sizes and rates in KiB/MiB/GiB, as the plan table and the result line."""

    def __init__(self, console):
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                             _rate_column(), TimeRemainingColumn(), console=console, transient=False)
        self.total = None
        self.files: dict[str, int] = {}

    def start(self, plan) -> None:
        self.total = self.bars.add_task(f"[bold]{name_cell(plan.checkpoint)}", total=plan.to_move)
        self.bars.start()

    def file_started(self, f) -> None:
        from ..sync.relay import SMALL

        if f.size > SMALL:
            self.files[f.path] = self.bars.add_task(f"  {name_cell(f.path)}", total=f.size, completed=f.offset)

    def moved(self, f, n: int) -> None:
        if f.path in self.files:
            self.bars.advance(self.files[f.path], n)
        self.bars.advance(self.total, n)

    def file_restarted(self, f, lost: int) -> None:
        if f.path in self.files:
            self.bars.update(self.files[f.path], completed=0)
        self.bars.update(self.total, total=self.bars.tasks[self.total].total + lost)

    def stop(self) -> None:
        self.bars.stop()


def _print_plan(out, plan, typed: str | None = None) -> None:
    from ..reports.render import human_bytes

    if typed:
        out.print(safe(f"{typed} → {plan.run}:{plan.checkpoint} ({plan.src.name} → {plan.dst.name})"))
    out.print(safe(f"from {plan.src.name}:{plan.src_dir}\nto   {plan.dst.name}:{plan.dst_final}"), soft_wrap=True)
    out.print(console.table(None, ["file", "size", "action", "from"],
                            [[shown(f.path), human_bytes(f.size), f.action, human_bytes(f.offset) if f.action == "resume" else "-"]
                             for f in plan.files], right=("size", "from")))
    if plan.incomplete:
        out.print(f"[yellow]not complete yet on {safe(plan.src.name)}: {safe(plan.incomplete)}; a sync now is refused[/]")
    if plan.up_to_date:
        out.print("[green]already on the destination and verified: nothing to move[/]")
    elif plan.final_exists:
        out.print(f"[yellow]{safe(plan.dst_final)} exists (not identical or unverified)[/]")
    else:
        free = "" if plan.free_bytes is None else f", {human_bytes(plan.free_bytes)} free there"
        out.print(f"to move: {human_bytes(plan.to_move)} of {human_bytes(plan.total)}{free}")


def run_sync(names, name: str, *, run: str | None, src: str, dst: str, typed: str | None = None, jobs: int = 4,
             dry_run: bool = False, direct: bool | None = None, tunnel: str | None = None, lock_wait: float = 60.0):
    """One sync with its plan, progress bars (on a terminal) and result line; `sync-ckpt` and
    `eval --sync` both run it."""
    from ..reports.render import human_bytes
    from ..sync import sync_checkpoint

    err, out = console.err(), console.out()
    try:
        result = sync_checkpoint(names.inventory, names.catalog, name, run=run, src_name=src, dst_name=dst,
                                 jobs=jobs, dry_run=dry_run, direct=direct, tunnel=tunnel, lock_wait=lock_wait,
                                 progress=_SyncBars(err) if err.is_terminal else None,
                                 on_plan=lambda p: _print_plan(out, p, typed))
    except KeyboardInterrupt:
        if not dry_run:
            err.print(f"[yellow]sync stopped: what arrived on {safe(dst)} is kept (verified files and partial "
                      f"ones); run the same command again to resume[/]")
        raise
    if dry_run:
        return result
    p = result.plan
    how = {"tunnel": " through the tunnel", "direct": " (pulled by the eval host)"}.get(result.path, "")
    moved = f"moved {human_bytes(result.bytes_moved)}{how} in {result.seconds:.1f}s ({human_bytes(result.rate)}/s)"
    extra = f", re-sent after a checksum mismatch: {', '.join(result.resent)}" if result.resent else ""
    out.print(f"[green]✔[/] {safe(p.run)}:{safe(p.checkpoint)} on {safe(p.dst.name)}: {moved}; "
              f"{result.verified} file(s) verified (sha256), {result.skipped} already there{extra}")
    return result


def sync_ckpt_cmd(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Checkpoint: step20k, 20000, step_20000, 20k, a folder name, or latest; "
                                         "LABEL:CKPT names the training run too (v5:step20k)."),
    run: Optional[str] = typer.Option(None, "--run", help="Training run or drafter label (default: the run with the "
                                                          "newest checkpoint)."),
    src: Optional[str] = typer.Option(None, "--from", metavar="HOST", help="Source host (default: the train host)."),
    dst: Optional[str] = typer.Option(None, "--to", metavar="HOST", help="Destination host (default: the eval host)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the plan (send/resume/skip per file); move nothing."),
    jobs: int = typer.Option(4, "--jobs", "-j", min=1, help="Files moved at once."),
    direct: Optional[bool] = typer.Option(None, "--direct/--relay",
                                          help="The eval host pulls from the train host itself, with its own "
                                               "credentials (default: run's `direct`); --relay: through here."),
    tunnel: bool = typer.Option(False, "--tunnel", help="The eval host pulls from the train host through a tunnel "
                                "forwarded here: encrypted once end to end, this machine only forwards (default: "
                                "the eval host's `tunnel` in the inventory)."),
    tunnel_auto: bool = typer.Option(False, "--tunnel-auto", help="--tunnel where it can be set up, else through here "
                                     "(one line says why)."),
    lock_wait: float = typer.Option(60.0, "--lock-wait", metavar="S", help="Wait this long for another sync's lock."),
    catalog: Optional[str] = typer.Option(None, "--catalog", metavar="PATH", help=CATALOG_HELP),
):
    """Copy a training checkpoint to the eval host: streamed through here, resumable, sha256-verified, atomic."""
    from ..errors import InputError
    from ..sync.tool import SyncBusy

    names = context_names(ctx, catalog=catalog)
    if direct and (tunnel or tunnel_auto):
        raise InputError("--direct and --tunnel exclude each other: the eval host pulls either with its own "
                         "credentials or through the tunnel")
    mode = "tunnel" if tunnel else "auto" if tunnel_auto else "relay" if direct is False else None
    training_run, ckpt = names.checkpoint_name(name, run)
    source, dest = names.role_host("train", src), names.role_host("eval", dst)
    try:
        run_sync(names, ckpt, run=training_run.name if training_run else None, src=source.name, dst=dest.name,
                 typed=name, jobs=jobs, dry_run=dry_run, direct=direct, tunnel=mode, lock_wait=lock_wait)
    except SyncBusy as e:
        raise SyncBusy(f"{e} (or wait longer for it with --lock-wait)") from None


def ckpts_cmd(
    ctx: typer.Context,
    run: Optional[str] = typer.Argument(None, help="Training run or drafter label (default: all runs in the catalog)."),
    src: Optional[str] = typer.Option(None, "--from", metavar="HOST", help="Training host (default: by role)."),
    dst: Optional[str] = typer.Option(None, "--to", metavar="HOST", help="Eval host (default: by role)."),
    catalog: Optional[str] = typer.Option(None, "--catalog", metavar="PATH", help=CATALOG_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the checkpoints as JSON."),
):
    """List a run's checkpoints on the training host: step, size, time, and whether on the eval host."""
    from dataclasses import asdict
    from datetime import datetime

    from ..reports.render import human_bytes
    from ..sync import list_checkpoints

    names = context_names(ctx, catalog=catalog)
    training_run = names.training_run(run) if run else None
    if not names.catalog.runs:
        raise names.catalog.no_runs()
    source = names.role_host("train", src)
    if dst:
        names.host(dst, "eval")
    rows, warnings = list_checkpoints(names.inventory, names.catalog, training_run.name if training_run else None,
                                      src_name=source.name, dst_name=dst)
    if as_json:
        console.print_json({"checkpoints": [asdict(r) for r in rows], "warnings": warnings})
        return
    out = console.out()
    colour = {"yes": "green", "stale": "red", "partial": "yellow", "no": "dim", "?": "red"}
    one_run = len({r.run for r in rows}) == 1
    head = ["checkpoint", "step", "size", "files", "changed", "state", "on eval"]
    cells = [[name_cell(r.name), "-" if r.step is None else str(r.step), human_bytes(r.size), str(r.files),
              datetime.fromtimestamp(r.mtime).strftime("%m-%d %H:%M"),
              "[yellow]being written[/]" if r.incomplete else "complete", f"[{colour[r.on_eval]}]{r.on_eval}[/]"]
             for r in rows]
    if not one_run:
        head, cells = ["run", *head], [[name_cell(r.run), *c] for r, c in zip(rows, cells)]
    title = f"checkpoints of {rows[0].run} on {source.name}" if one_run and rows else f"checkpoints on {source.name}"
    out.print(console.table(title, head, cells, markup=True, right=("step", "size", "files")))
    for r in rows:
        if r.incomplete:
            out.print(f"[yellow]! {name_cell(r.run)}:{name_cell(r.name)} is being written: {safe(r.incomplete)} "
                      f"(sync-ckpt and watch wait for it)[/]")
    for w in warnings:
        out.print(f"[yellow]! {safe(w)}[/]")
    if any(r.on_eval == "stale" for r in rows):
        out.print("[yellow]! stale: the training host saved that checkpoint again after it was synced; the eval "
                  "host's copy is of the old files (eval refuses it: move it away and sync it again)[/]")


def register(app: typer.Typer) -> None:
    app.command("sync-ckpt")(sync_ckpt_cmd)
    app.command("ckpts")(ckpts_cmd)
