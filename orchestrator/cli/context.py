"""What the global options give every command: the inventory (loaded on first use)."""
from __future__ import annotations

from dataclasses import dataclass, field

import typer


@dataclass
class Options:
    inventory_path: str | None = None
    _inventory: object = field(default=None, repr=False)

    def inventory(self):
        if self._inventory is None:
            from ..inventory import load_inventory

            self._inventory = load_inventory(self.inventory_path)
        return self._inventory


def options(ctx: typer.Context) -> Options:
    root = ctx.find_root()
    if not isinstance(root.obj, Options):
        root.obj = Options()
    return root.obj


def inventory(ctx: typer.Context):
    return options(ctx).inventory()


RUNS_DIR_HELP = "Runs folder (default: $DFLASH_OPS_RUNS, else ./runs)."
CATALOG_HELP = ("Catalog (default: $DFLASH_OPS_CATALOG, ./configs/drafters.yaml, "
                "$XDG_CONFIG_HOME/dflash-ops/drafters.yaml).")
