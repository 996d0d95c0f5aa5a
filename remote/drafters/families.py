"""The drafter class of each family (:data:`remote.contract.formats.FAMILIES`): z-lab's DFlash and
DFlash2 and the speculators variants (:mod:`remote.drafters.dflash`), SpecForge's Domino
(:mod:`remote.drafters.domino`) and DSpark (:mod:`remote.drafters.dspark`)."""
from __future__ import annotations

from remote.drafters.config import DOMINO, DSPARK, DrafterConfig


def drafter_class(cfg: DrafterConfig) -> type:
    if cfg.family == DOMINO:
        from remote.drafters.domino import DominoDrafter
        return DominoDrafter
    if cfg.family == DSPARK:
        from remote.drafters.dspark import DSparkDrafter
        return DSparkDrafter
    from remote.drafters.dflash import DFlashDrafter
    return DFlashDrafter


def build_drafter(cfg: DrafterConfig):
    """The (untrained) drafter of ``cfg``'s family."""
    return drafter_class(cfg)(cfg)
