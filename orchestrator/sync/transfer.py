"""One checkpoint's sync, start to end: resolve the name on the training host, take the lock on
the eval host, plan (send / resume / skip), check free space, relay the files, verify, and let
the lock holder rename the staging folder into place; cache the manifest on the source.
"""
from __future__ import annotations

import json
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePosixPath
from typing import Callable

from ..catalog import Catalog
from ..inventory import Inventory
from ..render import human_bytes
from ..transport import TransportError, runner_for
from .complete import judge_manifest, newest_complete, require_complete
from .listing import list_runs
from .lock import Holder
from .plan import SyncPlan, SyncResult, dest_rundir, make_plan, pick_run, resolve_name, same_manifest
from .relay import ALIVE_COUNT, ALIVE_INTERVAL, IDLE_TIMEOUT, STALL_TIMEOUT, SyncProgress, move
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
        dconn = bg.submit(drun.connect)  # both control connections come up at once
        r, info = pick_run(catalog, run, lambda runs: list_runs(
            srun, src, runs, lambda x: x.source_dir(src.checkpoints)))
        ckpt = resolve_name(name, r, info, src)
        direct = r.direct if direct is None else direct
        plan = SyncPlan(run=r.name, checkpoint=ckpt, src=src, dst=dst,
                        src_dir=str(PurePosixPath(info["dir"]) / ckpt), dst_rundir=dest_rundir(dst, r))
        if src.name == dst.name and plan.src_dir == plan.dst_final:
            raise SyncError(f"source and destination are the same folder: {plan.src_dir}")
        manifest_f = bg.submit(run_tool, srun, src, "manifest", plan.src_dir, timeout=600)
        dconn.result()
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
                raise SyncError(f"{dst.name}:{plan.dst_final} already exists with different content "
                                f"(or without a dflash manifest); move it away to sync again")
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
            move(plan, inv, token, result, jobs=jobs, alive=alive, idle=idle, stall=stall, direct=direct,
                 progress=progress)
            manifest = {"files": [{"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns,
                                   "sha256": f.sha256} for f in plan.files]}
            # each sender that hashed its file cached the sha256 on the source itself; only a file
            # skipped on a hash the destination verified (none on the source yet) is cached here,
            # while the destination finalizes, keyed by the inode and ctime listed at the start
            listed = {e["path"]: e for e in src_files}
            saved = None
            if any(f.action == "skip" and not listed[f.path].get("sha256") for f in plan.files):
                cache = {"files": [{**listed[e["path"]], **e} for e in manifest["files"]]}
                saved = bg.submit(run_tool, srun, src, "save-manifest", plan.src_dir,
                                  input=json.dumps(cache), timeout=60)
            holder.send("FINALIZE " + json.dumps(manifest))
            holder.expect("DONE", 300)
            result.seconds = time.monotonic() - started
            result.verified = len(plan.files)
            result.skipped = sum(f.action == "skip" for f in plan.files)
        finally:
            holder.close()
        try:
            if saved is not None:
                saved.result()
        except (SyncError, TransportError):
            pass
        return result
