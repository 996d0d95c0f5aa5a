"""`dflash-ops hosts` and `hosts check`."""
from __future__ import annotations

from typing import List, Optional

import typer

from . import console
from .context import inventory
from .context import names as context_names

hosts_app = typer.Typer(help="List the inventory's hosts; `hosts check` probes them.", invoke_without_command=True)


@hosts_app.callback()
def hosts(ctx: typer.Context,
          as_json: bool = typer.Option(False, "--json", help="Print the hosts as JSON.")):
    """List hosts and their roles (with no subcommand)."""
    if ctx.invoked_subcommand is not None:
        return
    inv = inventory(ctx)
    if as_json:
        console.print_json({"inventory": str(inv.path) if inv.path else None, "hosts": [h.to_dict() for h in inv]})
        return
    rows = []
    engines = any(h.engine for h in inv)
    for h in inv:
        address = "(local subprocess)" if h.is_local else h.endpoint if h.is_ray else \
            f"Slurm through {h.slurm.login}" if h.is_slurm else (
            f"{h.user + '@' if h.user else ''}{h.address}:{h.port}" + (f" via {h.jump}" if h.jump else ""))
        rows.append([h.name + (" (example)" if h.example else ""), ",".join(h.roles), address, h.python,
                     h.workdir or "-", h.checkpoints or "-", h.sglang or "-", "-" if h.gpus is None else str(h.gpus)]
                    + ([h.engine.describe() if h.engine else "-"] if engines else []))
    out = console.out()
    out.print(console.table(f"hosts ({context_names(ctx).inventory_file})", [
        "name", "roles", "address", "python", "workdir", "checkpoints", "sglang", "gpus"]
        + (["engine"] if engines else []), rows))
    examples = [h.name for h in inv if h.example]
    if examples:
        out.print(f"[yellow]{', '.join(examples)}: example host{'s' * (len(examples) > 1)} (`example: true` in "
                  f"{inv.get(examples[0]).defined_in}), never connected to: set the address and delete that line[/]")


@hosts_app.command("check")
def hosts_check(
    ctx: typer.Context,
    names: Optional[List[str]] = typer.Argument(None, help="Hosts to check (default: all)."),
    timeout: float = typer.Option(60.0, help="Seconds allowed per host."),
    as_json: bool = typer.Option(False, "--json", help="Print the reports as JSON."),
):
    """Connect to hosts in parallel and report python, torch/CUDA, GPUs, disk, SGLang and the serving
    engine (its version, or what a running engine server serves). Example hosts (`example: true`)
    are checked only when named: left out, they are listed as not checked."""
    from dataclasses import asdict


    from ..eval.hostcheck import HostCheckFailed, check_hosts

    resolver = context_names(ctx)
    inv = resolver.inventory
    selected = [resolver.host(n) for n in names] if names else [h for h in inv if not h.example]
    examples = [] if names else [h for h in inv if h.example]
    reports = check_hosts(selected, timeout=timeout, inventory=inv)
    failed = [r.name for r in reports if not r.ok]
    if as_json:
        console.print_json([asdict(r) | {"ok": r.ok} for r in reports])
    else:
        engines = any(r.engine for r in reports)      # the engine column only where some host has one
        rows = [[console.safe(r.name), "[green]passed[/]" if r.ok else "[red]FAILED[/]", *(console.safe(v or "-") for v in (
                 r.python, r.torch, r.cuda, r.transformers, r.fla)),
                 console.safe(", ".join(r.gpus) or ("none" if r.python else "-")),
                 console.safe(" / ".join(r.disk.get(k) or "-" for k in ("workdir", "checkpoints"))),
                 console.safe(r.sglang or "-"), console.safe(r.model or "-")] + ([console.safe(r.engine or "-")] if engines else [])
                for r in reports]
        out = console.out()
        out.print(console.table("hosts check", ["host", "check", "python", "torch", "cuda", "transformers", "fla",
                                                "gpus", "free (workdir / ckpts)", "sglang", "model"]
                                + (["engine"] if engines else []), rows, markup=True))
        for r in reports:
            for e in r.errors:
                out.print(f"[red]✘ {console.safe(r.name)}: {console.safe(e)}[/]")
            for w in r.warnings:
                out.print(f"[yellow]! {console.safe(r.name)}: {console.safe(w)}[/]")
    if examples:
        console.warning_line(f"not checked: {', '.join(h.name for h in examples)}, example host"
                             f"{'s' * (len(examples) > 1)} (`example: true` in {examples[0].defined_in}): set the "
                             f"address and delete that line to check {'them' if len(examples) > 1 else 'it'}")
    if failed:
        raise HostCheckFailed(f"{len(failed)} of {len(reports)} host(s) failed: {', '.join(failed)}")


def register(app: typer.Typer) -> None:
    app.add_typer(hosts_app, name="hosts")
