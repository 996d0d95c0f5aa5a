"""`dflash-ops export`: a drafter checkpoint written in another format on the host where it is.

The worker package is shipped to the host as for an eval (ship.py) and ``python -m
remote.export`` runs there, next to the checkpoint: the weights never travel. Its one JSON line
is the answer; its refusals, a destination it will not use and its failures become this module's
errors, each one line. What it writes is atomic on the host (remote/export.py): a failed or
killed export leaves no destination folder.
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from typing import Callable

from ..config.catalog import EMBEDDED
from ..config.inventory import Host, Inventory
from ..errors import InputError, OperationFailed
from ..transport import runner_for
from .ship import ship

MODULE = "remote.export"
TIMEOUT = 6 * 3600       # reading, writing, fsyncing and reading back a large checkpoint


class ExportError(OperationFailed):
    """The export ran and failed: the host, the worker, a checkpoint it cannot read or write."""


class ExportRefused(ExportError):
    """The target format cannot hold the checkpoint; the message names the fields."""


class ExportDestination(InputError):
    """The destination cannot be used: it exists (without ``--force``), is the source, or has no parent."""


@dataclass
class ExportRequest:
    """One export on one host. ``source``: the checkpoint folder there (``~`` expanded there), or
    ``embedded`` (the demo drafter in the host's workdir, built on first use); a relative path is
    taken from here on ``local``, from the login home on an SSH host. ``out``: absolute, ``~/...``,
    or relative to the source's parent folder; None: ``SOURCE.<format>`` beside it.
    ``verifier``: passed as given; ``default_verifier``: a folder passed only where it has a
    config.json on the host (the catalog's target)."""
    source: str
    fmt: str
    out: str | None = None
    force: bool = False
    verifier: str | None = None
    default_verifier: str | None = None
    num_target_layers: int | None = None


def export_on_host(host: Host, inventory: Inventory, req: ExportRequest,
                   on_phase: Callable[[str], None] | None = None) -> dict:
    """Run the export on ``host``; returns remote/export.py's result, with ``host``, ``verifier``
    (what was passed, or None) and ``source_path`` added."""
    phase = on_phase or (lambda _: None)
    if not host.workdir:
        raise ExportError(f"host {host.name}: no `workdir` in the inventory (the worker is shipped there)")
    host.refuse_example()
    phase("connecting")
    with runner_for(host, inventory) as runner:
        host = host.on_host(runner.expand_home)
        phase("shipping the worker")
        code_dir = ship(runner, host.python, host.workdir)
        if req.source == EMBEDDED:
            from .pipeline import embedded_models

            phase("finding the embedded demo pair (built on first use: about a minute on CPU)")
            source, target = embedded_models(host, runner, code_dir)
            default_verifier = req.default_verifier or target
        else:
            source, default_verifier = runner.absolute(req.source), req.default_verifier
        verifier = req.verifier
        if verifier is not None and not posixpath.isabs(runner.expand_home(verifier)):
            folder = runner.absolute(verifier)      # a folder there, else a model id as given
            verifier = folder if runner.run(["test", "-d", folder], timeout=30).ok else verifier
        verifier = runner.expand_home(verifier)
        default_verifier = runner.absolute(default_verifier) if default_verifier else None
        if verifier is None and default_verifier is not None and \
                runner.run(["test", "-f", posixpath.join(default_verifier, "config.json")], timeout=30).ok:
            verifier = default_verifier
        argv = [host.python, "-m", MODULE, source, "--to", req.fmt]
        if req.out is not None:
            out = runner.expand_home(req.out)
            if not posixpath.isabs(out):
                out = posixpath.join(posixpath.dirname(source.rstrip("/")), out)
            argv += ["--out", out]
        if req.force:
            argv.append("--force")
        if verifier is not None:
            argv += ["--verifier", verifier]
        if req.num_target_layers is not None:
            argv += ["--num-target-layers", str(req.num_target_layers)]
        phase(f"exporting {source} to {req.fmt}")
        res = runner.run(argv, timeout=TIMEOUT, env={"PYTHONPATH": code_dir}, cwd=code_dir)
    answer = _answer(res.stdout)
    if answer is None:
        tail = [ln for ln in (res.stderr or res.stdout).strip().splitlines() if ln.strip()]
        last = tail[-1] if tail else "no output"
        hint = (f" (the python environment {host.python} lacks it: set `python:` in the inventory to the ML "
                f"environment's interpreter)" if last.startswith("ModuleNotFoundError") else "")
        raise ExportError(f"host {host.name}: the export of {source} failed (exit {res.returncode}): {last}{hint}")
    if not answer.get("ok"):
        kind = answer.get("kind")
        where = f"host {host.name}: {source}: " if kind == "refused" else f"host {host.name}: "
        message = where + _one_line(answer.get("error", "the export failed"))
        raise (ExportRefused if kind == "refused" else ExportDestination if kind == "destination"
               else ExportError)(message)
    return {**answer, "host": host.name, "verifier": verifier, "source_path": source}


def _answer(stdout: str) -> dict | None:
    """remote/export.py's JSON line (its last line of stdout), or None."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        return data if isinstance(data, dict) else None
    return None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())
