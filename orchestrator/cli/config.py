"""`dflash-ops init` (the commented example inventory and catalog, for the user to edit) and
`dflash-ops config` (which files this directory would use, and why)."""
from __future__ import annotations

from typing import Optional

import typer
from rich.markup import escape

from . import console
from .context import CATALOG_HELP, RUNS_DIR_HELP
from .context import names as context_names


def init_cmd(
    directory: str = typer.Option(".", "--dir", metavar="DIR",
                                  help="The project folder: DIR/inventory.yaml, DIR/configs/drafters.yaml and "
                                       "DIR/configs/suites/ (found when dflash-ops runs in DIR)."),
    force: bool = typer.Option(False, "--force", help="Replace files that exist."),
):
    """Write a commented inventory, catalog and prompt suite to edit into the project folder (default: here)."""
    from ..config.paths import write_templates

    out = console.out()
    for path in write_templates(directory, force):
        out.print(f"wrote {escape(str(path))}")
    out.print("The hosts in inventory.yaml are examples (`example: true`: never connected to): set their "
              "addresses and delete that line, set the drafters' paths, then check them with "
              "[bold]dflash-ops config[/] and [bold]dflash-ops hosts check[/]")


def config_cmd(
    ctx: typer.Context,
    catalog: Optional[str] = typer.Option(None, "--catalog", metavar="PATH", help=CATALOG_HELP),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the files as JSON."),
):
    """Which inventory, catalog and runs folder a command run here uses, and by which rule: the
    flag, the environment variable, the current directory, then the user config folder."""
    from ..config.paths import cache_dir

    names = context_names(ctx, catalog=catalog, runs_dir=runs_dir)
    inv, cat = names.inventory, names.catalog       # read them: a broken file fails here, with its line
    files = {"inventory": names.inventory_file, "catalog": names.catalog_file}
    if as_json:
        console.print_json({**{k: {"path": str(f.path) if f.path else None, "source": f.source,
                                   "looked_for": f.kind.places()} for k, f in files.items()},
                            "runs": str(names.runs_root), "cache": str(cache_dir())})
        return
    rows = [[k, str(f.path) if f.path else "none found", f.source or f"looked for {', '.join(f.kind.places()[1:])}"]
            for k, f in files.items()]
    rows += [["runs", str(names.runs_root), "--runs-dir, $DFLASH_OPS_RUNS, else ./runs"],
             ["cache", str(cache_dir()), "$XDG_CACHE_HOME/dflash-ops"]]
    out = console.out()
    out.print(console.table("configuration", ["file", "path", "found by"], rows, wrap=("path", "found by")))
    hosts = [h.name + (" (example)" if h.example else "") for h in inv]
    out.print(escape(f"hosts: {', '.join(hosts)}; training runs: {', '.join(cat.runs) or 'none'}; "
                     f"drafters: {', '.join(cat.drafters) or 'none'}"
                     + (f"; default drafter: {cat.default}" if cat.default else "")))
    if not all(f.path for f in files.values()):
        out.print("[yellow]Without a file only the built-in `local` host (and no catalog) is known: "
                  "`dflash-ops init` writes commented examples to edit.[/]")


def register(app: typer.Typer) -> None:
    app.command("init")(init_cmd)
    app.command("config")(config_cmd)
