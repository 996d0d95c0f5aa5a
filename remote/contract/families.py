"""What each drafter family (z-lab's DFlash and SpecForge's Domino and DSpark:
:data:`remote.contract.formats.FAMILIES`) does with a run's settings: whose rules count it by
default, which DDTree budgets it walks, and what it refuses. Stdlib only: the worker applies these
rules to the drafter it loaded, the pre-flight to the one it inspected, before any run exists (the
control plane never reads a checkpoint itself).

A family is *sequential* where a draft depends on the token drafted before it (DFlash2's selector,
Domino, DSpark with a Markov head): ``remote.drafters.config.DrafterConfig.sequential``."""
from __future__ import annotations

from remote.contract.engines import ENGINES
from remote.contract.formats import DFLASH, FAMILY_NAMES
from remote.contract.settings import SPECFORGE, ZLAB_RULES, EvalSettings


def default_semantics(family: str) -> str:
    """Whose rules count a run when neither ``--semantics`` nor the catalog names them: by the
    family, whatever the folder's format (docs/drafters.md)."""
    return ZLAB_RULES if family == DFLASH else SPECFORGE


def tree_refusal(family: str, sequential: bool) -> str | None:
    """Why DDTree is not defined for a drafter of ``family``, else None: a SpecForge head's drafts
    depend on the token drafted before (DFlash2's selector scores a node's children from it)."""
    if family == DFLASH or not sequential:
        return None
    return (f"DDTree on a {family} drafter: its drafts depend on the token drafted before, so a tree's children "
            f"would be drafted from their own parents, which this worker does not do")


def engine_refusal(engine: str, family: str) -> str | None:
    """Why the serving engine of kind ``engine`` (remote.contract.engines) cannot serve a drafter of
    ``family``, else None."""
    kind = ENGINES[engine]
    if family in kind.serves:
        return None
    others = " or ".join(k.name for k in ENGINES.values() if family in k.serves)
    return (f"{kind.name} serves {' and '.join(FAMILY_NAMES[f] for f in kind.serves)} drafters only; this is SpecForge's "
            f"{family} drafter, which {others} serves")


def budgets(settings: EvalSettings, family: str, sequential: bool) -> tuple[list[int], str]:
    """``(the DDTree budgets a run walks, why none where the settings' default ones are left out)``."""
    asked = settings.budgets()
    if asked and tree_refusal(family, sequential):
        return [], f"no DDTree: a {family} drafter's drafts depend on the token drafted before"
    return asked, ""


def problems(settings: EvalSettings, family: str, sequential: bool, engine: str | None = None) -> list[str]:
    """What a run of ``settings`` may not ask of a drafter of ``family`` (one line each): DDTree
    budgets given by ``--ddtree`` on a sequential head, a serving ``engine`` that does not serve it."""
    out = []
    refusal = tree_refusal(family, sequential)
    if refusal and settings.ddtree is not None and settings.budgets():
        out.append(f"--ddtree {settings.ddtree}: {refusal}; leave out --ddtree")
    if engine and settings.engine and engine_refusal(engine, family):
        out.append(f"--engine: {engine_refusal(engine, family)}")
    return out
