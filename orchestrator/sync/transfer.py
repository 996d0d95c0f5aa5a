"""One checkpoint's sync, start to end: resolve the name on the training host, take the lock on
the eval host, plan (send / resume / skip), check free space, relay the files (pinned to the host
keys the control connections accepted), verify them against the sha256 the training host's manifest
gives over its control connection (on a first sync, the ones its senders recorded there: see
``check_against``), and let the lock holder rename the staging folder into place.
"""
from __future__ import annotations

import json
import os
import secrets
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import PurePosixPath
from typing import Callable, Iterator

from ..config.catalog import Catalog
from ..config.inventory import Inventory
from ..reports.render import human_bytes
from ..transport import SSHRunner, runner_for
from .complete import judge_manifest, newest_complete, require_complete
from .fresh import describe
from .listing import host_checkpoints
from .lock import Holder
from .plan import SyncPlan, SyncResult, dest_rundir, make_plan, pick_run, resolve_name, same_manifest
from .relay import ALIVE_COUNT, ALIVE_INTERVAL, IDLE_TIMEOUT, STALL_TIMEOUT, DataPath, SyncProgress, move
from .tool import SyncError, run_tool

LOCK_WAIT = 60.0
FREE_RESERVE = 64 << 20  # keep this much free on the destination


def sync_checkpoint(inv: Inventory, catalog: Catalog, name: str, *, run: str | None = None,
                    src_name: str | None = None, dst_name: str | None = None, jobs: int = 4,
                    dry_run: bool = False, direct: bool | None = None, lock_wait: float = LOCK_WAIT,
                    alive: tuple[int, int] = (ALIVE_INTERVAL, ALIVE_COUNT), idle: float = IDLE_TIMEOUT,
                    stall: float = STALL_TIMEOUT, progress: SyncProgress | None = None,
                    on_plan: Callable[[SyncPlan], None] | None = None) -> SyncResult:
    """Copy checkpoint ``name`` of a training run (default: the run with the newest checkpoint)
    from the training host to the eval host; ``dry_run`` only plans. ``on_plan`` sees the plan
    before any byte moves."""
    src, dst = inv.pick("train", src_name), inv.pick("eval", dst_name)
    with runner_for(src, inv) as srun, runner_for(dst, inv) as drun, ThreadPoolExecutor(2) as bg:
        started = time.monotonic()
        dconn = bg.submit(lambda: drun.connect() and dst.on_host(drun.expand_home))  # both come up at once
        src = src.on_host(srun.expand_home)
        r, info = pick_run(catalog, run, lambda runs: host_checkpoints(
            srun, src, runs, lambda x: x.source_dir(src.checkpoints)))
        ckpt = resolve_name(name, r, info, src)
        dst = dconn.result()
        direct = r.direct if direct is None else direct
        plan = SyncPlan(run=r.name, checkpoint=ckpt, src=src, dst=dst,
                        src_dir=str(PurePosixPath(info["dir"]) / ckpt), dst_rundir=dest_rundir(dst, r))
        if src.name == dst.name and plan.src_dir == plan.dst_final:
            raise SyncError(f"source and destination are the same folder: {plan.src_dir}")
        manifest_f = bg.submit(run_tool, srun, src, "manifest", plan.src_dir, timeout=600)
        source = manifest_f.result()  # the completeness rule, before the destination is touched
        if not dry_run:
            instead = newest_complete(info, r) if name in ("latest", "newest") else None
            require_complete(source["files"], source["now"], r, src.name, plan.src_dir, instead)
        else:
            plan.incomplete = judge_manifest(source["files"], source["now"], r).reason or None
            st = run_tool(drun, dst, "state", plan.dst_rundir, ckpt, timeout=120)
            src_files = source["files"]
            plan.final_exists = st["final_exists"]
            plan.up_to_date = st["final_exists"] and same_manifest(st["final_manifest"], src_files)
            make_plan(plan, src_files, st)
            if on_plan:
                on_plan(plan)
            return SyncResult(plan=plan, dry_run=True)
        token = secrets.token_hex(16)
        holder = Holder(drun, dst, plan.dst_rundir, ckpt, token, lock_wait, idle)
        try:
            holder.expect("LOCKED", lock_wait + 30)
            pinger = threading.Thread(target=holder.ping_forever, daemon=True)
            pinger.start()
            holder.send("STATE")
            st = json.loads(holder.expect("STATE ", 120))
            src_files = source["files"]
            plan.final_exists = st["final_exists"]
            if st["final_exists"]:
                if any(e.get("sha256") is None for e in src_files):
                    src_files = run_tool(srun, src, "manifest", plan.src_dir, "--hash", timeout=3600)["files"]
                if same_manifest(st["final_manifest"], src_files):
                    plan.up_to_date = True
                    make_plan(plan, src_files, {"free_bytes": st["free_bytes"]})
                    for f in plan.files:
                        f.action, f.offset = "skip", f.size
                    if on_plan:
                        on_plan(plan)
                    return SyncResult(plan=plan, seconds=time.monotonic() - started,
                                      verified=len(plan.files), skipped=len(plan.files))
                copy = {e["path"]: e.get("sha256") for e in st["final_manifest"] or []}
                now = {e["path"]: e.get("sha256") for e in src_files}
                changed = sorted(p for p in copy.keys() | now.keys() if copy.get(p) != now.get(p))
                why = (f"a copy of other files (changed on {src.name} since it was synced: {describe(changed)})"
                       if copy else "without a dflash manifest")
                raise SyncError(f"{dst.name}:{plan.dst_final} already exists, {why}; move it away to sync again")
            make_plan(plan, src_files, st)
            if on_plan:
                on_plan(plan)
            need = plan.to_move
            if st["free_bytes"] is not None and st["free_bytes"] < need + FREE_RESERVE:
                raise SyncError(
                    f"not enough space on {dst.name} for {plan.dst_rundir}: {human_bytes(need)} to write "
                    f"(+{human_bytes(FREE_RESERVE)} reserve), {human_bytes(st['free_bytes'])} free; nothing was moved")
            holder.send("BEGIN")
            holder.expect("BEGUN", 60)
            result = SyncResult(plan=plan)
            with data_path(srun, drun, plan, token, direct) as path:
                move(plan, path, token, result, jobs=jobs, alive=alive, idle=idle, stall=stall, progress=progress)
            if any(e.get("sha256") is None for e in src_files):  # first sync: see source_hashes
                check_against(plan, run_tool(srun, src, "manifest", plan.src_dir, "--hash", timeout=3600)["files"])
            manifest = {"files": [{"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns,
                                   "sha256": f.sha256} for f in plan.files]}
            holder.send("FINALIZE " + json.dumps(manifest))
            holder.expect("DONE", 300)
            result.seconds = time.monotonic() - started
            result.verified = len(plan.files)
            result.skipped = sum(f.action == "skip" for f in plan.files)
        finally:
            holder.close()
        return result


def check_against(plan: SyncPlan, source_files: list[dict]) -> None:
    """Every file that arrived has the sha256 the training host's manifest gives over the control
    connection (and the file there is still the one listed).

    On a first sync that manifest is read after the transfer, and its hashes are the ones each
    sender recorded in the folder's manifest cache (``send --cache``) as it read the file, keyed by
    size, mtime, inode and ctime: no second read of the checkpoint. They are still the training
    host's word: the data path is pinned to the host key the control connection accepted
    (``data_path``), so the sender ran on that host, and whoever might answer the data path in its
    place could not write that host's cache. A file the cache does not cover (a read-only source,
    a file rewritten meanwhile, a sender that hashed some other file) is hashed there now, over
    the control connection."""
    there = {e["path"]: e for e in source_files}
    for f in plan.files:
        e = there.get(f.path)
        if e is None or e["size"] != f.size or e["mtime_ns"] != f.mtime_ns:
            raise SyncError(f"{plan.src.name}:{plan.src_dir}/{f.path} changed during the sync (is training still "
                            f"writing it?); run the same command again")
        if e["sha256"] != f.sha256:
            raise SyncError(f"{f.path}: the bytes that arrived on {plan.dst.name} (sha256 {f.sha256[:16]}...) are not "
                            f"the file on {plan.src.name} (sha256 {e['sha256'][:16]}..., computed there over the "
                            f"control connection): the data path delivered other content; nothing was finalized. "
                            f"A rerun sends the file again")


@contextmanager
def data_path(srun, drun, plan: SyncPlan, token: str, direct: bool) -> Iterator[DataPath]:
    """The sync's data path, each SSH host pinned to the key its control connection accepted:
    a temporary known_hosts file here (removed at the end), and for ``direct`` one on the eval
    host for its own pull from the training host."""
    ssh = {r: r.endpoint for r in (srun, drun) if isinstance(r, SSHRunner)}
    with tempfile.TemporaryDirectory(prefix="dflash-ops-keys-") as tmp:
        pins = os.path.join(tmp, "known_hosts")
        with open(pins, "w") as f:
            f.write("".join(r.pin_lines() for r in ssh))
        pinned = {r: ep.pinned_to(pins) for r, ep in ssh.items()}
        if not direct:
            yield DataPath(pinned.get(srun), pinned.get(drun))
            return
        if srun not in ssh:
            raise SyncError(f"--direct needs the training host to be an SSH host, not {plan.src.name}")
        remote_pins = f"{plan.dst_rundir}/.dflash-known-hosts-{token}"
        drun.put_text(srun.pin_lines(), remote_pins)
        try:
            yield DataPath(None, pinned.get(drun), pulled=ssh[srun].pinned_to(remote_pins))
        finally:
            drun.run(["rm", "-f", "--", remote_pins], timeout=30)
