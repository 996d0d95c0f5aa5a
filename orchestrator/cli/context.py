"""What the global options give every command: the names resolver (orchestrator/names.py) over
the inventory, the catalog and the runs folder, built on first use."""
from __future__ import annotations

from dataclasses import dataclass, field

import typer


@dataclass
class Options:
    inventory_path: str | None = None
    _names: dict = field(default_factory=dict, repr=False)

    def names(self, catalog: str | None = None, runs_dir: str | None = None):
        if (catalog, runs_dir) not in self._names:
            from ..names import Resolver

            self._names[catalog, runs_dir] = Resolver(inventory=self.inventory_path, catalog=catalog,
                                                      runs_root=runs_dir)
        return self._names[catalog, runs_dir]


def options(ctx: typer.Context) -> Options:
    root = ctx.find_root()
    if not isinstance(root.obj, Options):
        root.obj = Options()
    return root.obj


def names(ctx: typer.Context, *, catalog: str | None = None, runs_dir: str | None = None):
    """The command's resolver: every name the user typed goes through it."""
    return options(ctx).names(catalog, runs_dir)


def inventory(ctx: typer.Context):
    return names(ctx).inventory


RUNS_DIR_HELP = "Runs folder (default: $DFLASH_OPS_RUNS, else ./runs)."
CATALOG_HELP = ("Catalog (default: $DFLASH_OPS_CATALOG, ./configs/drafters.yaml, then drafters.yaml in the user "
                "config folder; `dflash-ops config` shows which).")
