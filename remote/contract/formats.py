"""Drafter checkpoint formats and drafter families as both sides name them, and the largest block a
drafter may have (a run folder's acceptance lengths are checked against it). Stdlib only."""
from __future__ import annotations

ZLAB, SPECULATORS, STATE_DICT, SPECFORGE = "zlab", "speculators", "state_dict", "specforge"
READ_FORMATS = (ZLAB, SPECULATORS, STATE_DICT, SPECFORGE)   # what the worker loads (a catalog's `format:`)
EXPORT_FORMATS = (ZLAB, SPECULATORS, SPECFORGE)    # what `export --to` writes
MAX_BLOCK_SIZE = 1024
# the drafter families (remote.contract.families: what each does with a run's settings)
DFLASH, DOMINO, DSPARK = "dflash", "domino", "dspark"
FAMILIES = (DFLASH, DOMINO, DSPARK)
FAMILY_NAMES = {DFLASH: "DFlash", DOMINO: "Domino", DSPARK: "DSpark"}     # as messages write them
