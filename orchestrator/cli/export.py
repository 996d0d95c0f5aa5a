"""`dflash-ops export`."""
from __future__ import annotations

from typing import Optional

import typer

from . import console
from .console import safe
from .context import CATALOG_HELP
from .context import names as context_names


def _default_host(names):
    """The inventory's eval host (an SSH host before the built-in ``local``)."""
    from ..errors import InputError

    inv = names.inventory
    hosts = [h for h in inv.with_role("eval") if not h.is_local] or inv.with_role("eval")
    if len(hosts) != 1:
        raise InputError(f"{len(hosts)} hosts have role eval ({', '.join(h.name for h in hosts) or 'none'}): pick the "
                         f"host where the checkpoint is with --host HOST; {names.inventory_file}")
    return hosts[0]


def _source(names, choice, host, explicit: bool, err):
    """(host, the checkpoint folder there, how a user names the export afterwards) for the drafter
    ``choice``: a training run's checkpoint where it is synced on ``host``; one only on the training
    host is exported there when no --host was given."""
    from ..config.catalog import EMBEDDED
    from ..names import NotSynced
    from ..sync.plan import dest_rundir

    if choice.label == EMBEDDED and choice.run is None:
        return host, EMBEDDED, None
    if choice.run is None:
        return host, choice.path, None
    with err.status(f"{host.name}: connecting, looking for the checkpoints of training run {choice.run.name} ..."):
        choice = names.locate_checkpoint(choice, host)
    what = f"{choice.label}:{choice.checkpoint}"
    if choice.synced:
        return host, f"{dest_rundir(host, choice.run)}/{choice.checkpoint}", what
    if explicit:
        raise NotSynced(f"{what} is on {choice.source.name} but not on {host.name}: export it there with --host "
                        f"{choice.source.name}, or copy it first with `dflash-ops sync-ckpt {what} --to {host.name}`")
    source = choice.source
    return source, f"{choice.run.source_dir(source.checkpoints).rstrip('/')}/{choice.checkpoint}", what


def export_cmd(
    ctx: typer.Context,
    drafter: str = typer.Argument(..., help="LABEL[:CKPT] from the catalog (a training run's checkpoint: the named one, "
                                       "else the newest), a folder on the host, or 'embedded'."),
    fmt: str = typer.Option(..., "--to", metavar="FORMAT", help="The format to write: zlab, speculators or specforge."),
    host: Optional[str] = typer.Option(None, "--host", "-H",
                                       help="The host where the checkpoint is (default: the eval host; a training "
                                            "run's checkpoint that is only on the training host is exported there)."),
    out: Optional[str] = typer.Option(None, "--out", metavar="DIR",
                                      help="The new checkpoint folder on the host (default: SOURCE.zlab or "
                                           "SOURCE.speculators beside the source; a relative path is taken beside "
                                           "the source)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing destination folder (whole)."),
    verifier: Optional[str] = typer.Option(None, "--verifier", metavar="DIR|ID",
                                           help="The target model as the host sees it: recorded in a speculators "
                                                "config; a folder also gives num_target_layers (default: the "
                                                "catalog's target of the drafter, where its folder is on the host)."),
    num_target_layers: Optional[int] = typer.Option(None, "--num-target-layers", metavar="N", min=1,
                                                    help="Decoder layers of the target, where the source does not "
                                                         "record them and z-lab output needs them."),
    catalog: Optional[str] = typer.Option(None, "--catalog", metavar="PATH", help=CATALOG_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
):
    """Write a drafter checkpoint in the z-lab or the speculators format, on the host where it is: a new
    folder beside it (atomic; dflash-export.json records the source's hashes and what was mapped);
    what the format cannot hold is refused, naming the field."""
    import posixpath

    from remote.contract.formats import EXPORT_FORMATS as FORMATS

    from ..errors import InputError, did_you_mean
    from ..eval.export import ExportRequest, export_on_host
    from ..reports.render import human_bytes

    if fmt not in FORMATS:
        raise InputError(f"--to {fmt}: not a format dflash-ops writes{did_you_mean(fmt, FORMATS)}; formats: "
                         f"{', '.join(FORMATS)}")
    names = context_names(ctx, catalog=catalog)
    where = names.host(host) if host else _default_host(names)
    choice = names.drafter(drafter, where, need_target=False)
    err = console.err()
    where, source, named = _source(names, choice, where, host is not None, err)
    req = ExportRequest(source=source, fmt=fmt, out=out, force=force, verifier=verifier,
                        default_verifier=choice.target_path, num_target_layers=num_target_layers)
    status = err.status(f"{where.name}: connecting ...") if not as_json else None
    if status:
        status.start()
    try:
        result = export_on_host(where, names.inventory, req,
                                on_phase=lambda p: status.update(f"{where.name}: {safe(p)} ...") if status else None)
    finally:
        if status:
            status.stop()
    if as_json:
        console.print_json(result)
        return
    size = sum(f["size"] for f in result["files"])
    files = ", ".join(f["path"] for f in result["files"])
    out_name = result["out"].rstrip("/").rsplit("/", 1)[-1]
    o = console.out()
    o.print(safe(f"✔ {named or drafter} ({result['source_format']}) → {result['format']} on {result['host']}: "
                   f"{result['out']} ({files}: {human_bytes(size)}; {result['note']}: the source's sha256 and what "
                   f"was mapped)"), soft_wrap=True)
    if result.get("verifier"):
        o.print(safe(f"  verifier: {result['verifier']}"), soft_wrap=True)
    for line in result.get("not_carried") or []:
        o.print(f"[yellow]! not carried: {safe(line)}[/]", soft_wrap=True)
    in_run = named and posixpath.dirname(result["out"].rstrip("/")) in {
        posixpath.dirname(result[k].rstrip("/")) for k in ("source", "source_path")}
    then = f"{named.split(':', 1)[0]}:{out_name}" if in_run else \
        f"{result['out']} --target {choice.target or 'TARGET'}"
    if "eval" in where.roles:
        o.print(safe(f"  evaluate it with: dflash-ops eval --host {result['host']} --drafter {then}"), soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("export")(export_cmd)
