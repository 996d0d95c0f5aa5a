"""`ckpts`: a training run's checkpoints on the training host (step, size, time), whether each
is complete there yet (sync/complete.py's rule) and whether it is already complete on the eval host."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config.catalog import Catalog, TrainingRun
from ..config.inventory import Host, Inventory, InventoryError
from ..transport import TransportError, runner_for
from .complete import judge_listed
from .fresh import changed_files, differs
from .plan import dest_rundir
from .tool import Session, SyncError, run_tool


def host_checkpoints(runner, host: Host, runs: list[TrainingRun], root_for: Callable[[TrainingRun], str],
                     session: Session | None = None) -> dict:
    """The tool's listing of each run's checkpoint folders under ``root_for(run)`` on ``host``
    (``host``'s paths already expanded there: :meth:`Host.on_host`), asked through ``session``
    where the caller has one open, else by a tool run of its own."""
    args: list[str] = [host.checkpoints or "/"]
    for r in runs:
        args += ["--run", r.name, runner.absolute(root_for(r)), r.pattern]  # a relative root: from the login home
    answer = (session.call_json("LIST", args, timeout=120) if session is not None
              else run_tool(runner, host, "list", *args, timeout=120))
    for info in answer["runs"].values():
        info["now"] = answer["now"]  # the host's clock, for the completeness rule
    return answer["runs"]


def stale_copies(listing: dict, there: dict, srun, src: Host, drun, dst: Host,
                 runs: list[TrainingRun]) -> set[tuple[str, str]]:
    """(run, checkpoint) of the complete copies on the eval host that are not the training host's
    checkpoint any more (sync/fresh.py: listings first, hashes only where those differ)."""
    out = set()
    for r in runs:
        copies = {c["name"]: c for c in there.get(r.name, {}).get("checkpoints", []) if c["complete"]}
        for c in listing[r.name]["checkpoints"]:
            if c["name"] in copies and differs(c, copies[c["name"]]) and changed_files(
                    srun, src, f"{listing[r.name]['dir']}/{c['name']}", drun, dst, dest_rundir(dst, r), c["name"]):
                out.add((r.name, c["name"]))
    return out


@dataclass
class CkptRow:
    run: str
    name: str
    step: int | None
    size: int
    files: int
    mtime: float
    on_eval: str  # yes | stale (the training host's files changed since) | partial | no | ?
    incomplete: str = ""   # why it is not complete yet on the training host (sync/complete.py); "" = complete


def list_checkpoints(inv: Inventory, catalog: Catalog, run: str | None = None, *,
                     src_name: str | None = None, dst_name: str | None = None) -> tuple[list[CkptRow], list[str]]:
    """Checkpoints of one run (or all runs) on the training host, and whether each is on the eval
    host. Returns (rows, warnings)."""
    src = inv.pick("train", src_name)
    runs = [catalog.run(run)] if run else list(catalog.runs.values())
    if not runs:
        raise catalog.no_runs()
    warnings: list[str] = []
    stale: set[tuple[str, str]] = set()
    with runner_for(src, inv) as srun:
        src = src.on_host(srun.expand_home)
        listing = host_checkpoints(srun, src, runs, lambda r: r.source_dir(src.checkpoints))
        there: dict | None = None
        try:
            dst = inv.pick("eval", dst_name)
            if dst.checkpoints:
                with runner_for(dst, inv, connect_timeout=10) as drun:
                    dst = dst.on_host(drun.expand_home)
                    there = host_checkpoints(drun, dst, runs, lambda r: dest_rundir(dst, r))
                    stale = stale_copies(listing, there, srun, src, drun, dst, runs)
        except (InventoryError, TransportError, SyncError) as e:
            warnings.append(f"eval host: {e}")
    rows = []
    for r in runs:
        info = listing[r.name]
        if not info.get("exists", True):
            warnings.append(f"run {r.name}: {info['dir']} does not exist on {src.name}")
        d = {c["name"]: c for c in (there or {}).get(r.name, {}).get("checkpoints", [])}
        staging = set((there or {}).get(r.name, {}).get("staging", []))
        for c in info["checkpoints"]:
            if there is None:
                on = "?"
            elif (r.name, c["name"]) in stale:
                on = "stale"
            elif c["name"] in d and d[c["name"]]["complete"]:
                on = "yes"
            elif c["name"] in staging or c["name"] in d:
                on = "partial"
            else:
                on = "no"
            verdict = judge_listed(c, info["now"], r)
            rows.append(CkptRow(r.name, c["name"], c["step"], c["size"], c["files"], c["mtime"], on,
                                "" if verdict.complete else verdict.reason))
    rows.sort(key=lambda x: (x.run, x.step if x.step is not None else -1, x.name))
    return rows, warnings
