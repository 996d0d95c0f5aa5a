"""`dflash-ops clean`: show what the hosts and this machine's runs folder hold that no run needs, and
remove it once confirmed."""
from __future__ import annotations

import sys
from typing import List, Optional

import typer

from . import console
from .console import safe
from .context import CATALOG_HELP, RUNS_DIR_HELP
from .context import names as context_names


def clean_cmd(
    ctx: typer.Context,
    host: Optional[List[str]] = typer.Option(None, "--host", "-H", help="Clean this host (repeatable; default: every "
                                                                       "host of the inventory that answers)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Delete what is listed without asking (for scripts)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only show what would be deleted (also the default "
                                                          "without --yes when stdin is not a terminal)."),
    as_json: bool = typer.Option(False, "--json", help="Print what would be deleted (and, with --yes, what was) "
                                                       "as JSON; asks nothing."),
    catalog: Optional[str] = typer.Option(None, "--catalog", metavar="PATH", help=CATALOG_HELP),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP),
):
    """Show, per host and here, what can be reclaimed and why (worker code folders no run uses, host
    folders of fetched runs, eval-host checkpoint copies the training host no longer has, run folders
    of evals stopped in pre-flight), then delete it once confirmed. Never what a running or unfetched
    run needs; a link is removed as a link, never followed."""
    from .. import clean
    from ..errors import OperationFailed
    from ..reports.render import human_bytes

    names = context_names(ctx, catalog=catalog, runs_dir=runs_dir)
    hosts = [names.host(n) for n in dict.fromkeys(host)] if host else list(names.inventory)
    places = clean.plan(names.inventory, names.catalog, names.runs_root, hosts, named=bool(host))
    try:
        if as_json:
            _as_json(clean, places, delete=yes and not dry_run)
            return
        out = console.out()
        for p in places:
            if p.skipped:
                console.warning_line(f"{p.name}: skipped: {p.skipped}")
        for p in places:
            if p.items:
                out.print(console.table(f"{p.name}: {p.roots}", ["what", "path", "size", "why"],
                                        [[i.kind, i.shown, human_bytes(i.size), i.why] for i in p.items],
                                        right=("size",), wrap=("why",)))
            for note in p.notes:
                out.print(f"[dim]{safe(p.name)}: {safe(note)}[/]", soft_wrap=True)
        todo = [p for p in places if p.items]
        total = sum(p.size for p in todo)
        failed_hosts = [p.name for p in places if p.skipped and p.named]
        if not todo:
            out.print("nothing to delete")
        else:
            out.print(f"{sum(len(p.items) for p in todo)} item(s), {human_bytes(total)}: "
                      + ", ".join(f"{human_bytes(p.size)} on {p.name}" if p.name != clean.HERE
                                  else f"{human_bytes(p.size)} here" for p in todo))
            if dry_run or not (yes or _confirm(f"delete these {sum(len(p.items) for p in todo)} item(s)?")):
                why = "--dry-run" if dry_run else "not confirmed" if sys.stdin.isatty() else \
                    "not a terminal: add --yes to delete them"
                out.print(f"nothing deleted ({why})")
            else:
                problems = _delete(clean, todo, out, human_bytes)
                if problems:
                    raise OperationFailed(f"{problems} item(s) could not be deleted (named above)")
        if failed_hosts:
            raise OperationFailed(f"{', '.join(failed_hosts)}: skipped (named above); nothing was deleted there")
    finally:
        clean.close(places)


def _as_json(clean, places, delete: bool) -> None:
    from dataclasses import asdict

    from ..errors import OperationFailed

    done = [asdict(clean.delete(p)) for p in places if p.items] if delete else None
    console.print_json({"items": [{"where": p.name, **{k: getattr(i, k) for k in ("kind", "path", "size", "why")}}
                                  for p in places for i in p.items],
                        "skipped": {p.name: p.skipped for p in places if p.skipped},
                        "notes": [f"{p.name}: {n}" for p in places for n in p.notes],
                        "deleted": done})
    failed = [p.name for p in places if p.skipped and p.named] + [f for d in done or [] for f in d["failed"]]
    if failed:
        raise OperationFailed(f"not everything asked for was cleaned: {'; '.join(failed)}")


def _confirm(question: str) -> bool:
    return sys.stdin.isatty() and typer.confirm(question, default=False, err=True)


def _delete(clean, todo, out, human_bytes) -> int:
    problems = 0
    try:
        for p in todo:
            done = clean.delete(p)
            problems += _deleted(clean, p, done, out, human_bytes)
    except KeyboardInterrupt:
        for p in todo:
            done = p.deleted
            if done is None:
                out.print(f"interrupted: nothing deleted {_where(clean, p)} ({len(p.items)} item(s) kept)")
                continue
            _deleted(clean, p, done, out, human_bytes)
            if done.at_hand:
                out.print(f"interrupted while {safe(done.at_hand)} was being removed {_where(clean, p)}: the host "
                          f"finishes that one (or refuses it) and stops there", soft_wrap=True)
            if done.left:
                out.print(f"interrupted: not deleted {_where(clean, p)}: {safe(', '.join(done.left))}", soft_wrap=True)
        raise
    return problems


def _where(clean, p) -> str:
    return "here" if p.name == clean.HERE else f"on {p.name}"


def _deleted(clean, p, done, out, human_bytes) -> int:
    for line in done.failed:
        out.print(f"[red]✘ {safe(p.name)}: not deleted: {safe(line)}[/]", soft_wrap=True)
    out.print(f"deleted {done.removed} of {len(p.items)} item(s) {_where(clean, p)}"
              + (f", {human_bytes(done.freed)} freed" if p.name != clean.HERE else ""))
    return len(done.failed)


def register(app: typer.Typer) -> None:
    app.command("clean")(clean_cmd)
