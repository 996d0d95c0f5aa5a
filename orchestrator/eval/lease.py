"""A run's lease on an eval host: what the run may load there (its drafter and target folders)
and the worker code it runs, written before its pre-flight so that `dflash-ops clean`, from any
machine, keeps them while the run may still load them (remote/host/clean.py ``lease``: when a lease
is live, and the lock its writer and each removal take)."""
from __future__ import annotations

import json
import socket
from importlib import resources

from ..config.catalog import EMBEDDED
from ..config.inventory import Host, Inventory
from ..errors import DflashOpsError, OperationFailed
from ..runs.record import EvalRequest, RunRecord
from ..transport import runner_for


def host_tool() -> str:
    """remote/host/clean.py's source: it runs on a host as ``python -c SOURCE COMMAND ...``."""
    return resources.files("remote.host").joinpath("clean.py").read_text()


def model_paths(host: Host, runner, req: EvalRequest) -> tuple[str | None, str | None]:
    """(drafter folder, target folder) on ``host`` as the request names them (None: the embedded
    demo's, found in pre-flight, or a hub id); ``host``'s paths expanded there."""
    drafter = target = None
    if req.drafter_ref != EMBEDDED:
        if req.drafter_run and host.checkpoints:
            drafter = f"{host.checkpoints.rstrip('/')}/{req.drafter_run}/{req.checkpoint}"
        elif req.drafter_path:
            drafter = runner.absolute(req.drafter_path)
    if req.target != EMBEDDED and is_folder(req.target_path):
        target = runner.absolute(req.target_path)
    return drafter, target


def is_folder(target: str | None) -> bool:
    """A target named by a folder (``/x``, ``~/x``, ``./x``, ``a/b/c``), not a hub model id (``org/name``)."""
    return bool(target) and (target.startswith(("/", "~", ".")) or target.count("/") >= 2)


def take(record: RunRecord, host: Host, runner, code: str) -> None:
    """Write run ``record``'s lease on ``host`` (its paths expanded there), naming what it will load
    and the worker code ``code`` (a digest) it will run."""
    paths = [p for p in model_paths(host, runner, record.request) if p]
    lease = {"paths": paths, "code": code, "origin": f"{socket.gethostname()}:{record.folder}"}
    res = runner.run([host.python, "-c", host_tool(), "lease", host.workdir.rstrip("/"), record.id,
                      json.dumps(lease)], timeout=180)
    if not res.ok:
        tail = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
        raise OperationFailed(f"host {host.name}: cannot write this run's lease in {host.workdir}/leases (what keeps "
                        f"`dflash-ops clean` off its drafter): {tail}")


def release(record: RunRecord, inventory: Inventory) -> None:
    """Drop run ``record``'s leases on its hosts (it ended or was cancelled); a host that does not
    answer keeps it, where it stops counting once the run's jobs there have ended."""
    for name in record.hosts:
        try:
            host = inventory.get(name)
            if host.is_ray or not host.workdir:
                continue
            with runner_for(host, inventory) as runner:
                host = host.on_host(runner.expand_home)
                runner.run([host.python, "-c", host_tool(), "release", host.workdir.rstrip("/"), record.id],
                           timeout=60)
        except (DflashOpsError, OSError):
            continue
