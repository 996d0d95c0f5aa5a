"""One checkpoint's sync, start to end: one session per host (``sync_host.py serve``, tool.py)
and, for the data path, one OpenSSH master connection per host (transport/master.py), all opened
while the sync lists and locks; resolve the name on the training host, take the lock on the eval
host, plan (send / resume / skip), check free space, move the files (relay, ``--tunnel`` or
``--direct``; every OpenSSH client pinned to the host key its host's control connection accepted),
verify them against the sha256 the training host's manifest gives over its control connection
(on a first sync, the ones its senders recorded there: see ``check_against``), and let the lock
holder rename the staging folder into place.
"""
from __future__ import annotations

import secrets
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import PurePosixPath
from typing import Callable, Iterator

from ..config.catalog import Catalog, TrainingRun
from ..config.inventory import Host, Inventory
from ..errors import DflashOpsWarning
from ..reports.render import human_bytes
from ..transport import SSHRunner, TransportError, runner_for
from ..transport.master import Master
from .complete import judge_manifest, newest_complete, require_complete
from .fresh import describe
from .listing import host_checkpoints
from .lock import Destination
from .plan import FilePlan, SyncPlan, SyncResult, dest_rundir, make_plan, pick_run, resolve_name, same_manifest
from .relay import ALIVE_COUNT, ALIVE_INTERVAL, IDLE_TIMEOUT, STALL_TIMEOUT, DataPath, SyncProgress, data_options, move
from .tool import Session, SyncError, close_all, tool_argv
from .tunnel import TunnelUnavailable, pull_through_tunnel

LOCK_WAIT = 60.0
FREE_RESERVE = 64 << 20  # keep this much free on the destination
MODES = ("relay", "tunnel", "auto", "direct")


class TunnelFallback(DflashOpsWarning):
    """``--tunnel-auto`` could not set up the tunnel: the sync moves the bytes through this machine."""


def data_mode(run: TrainingRun, dst: Host, direct: bool | None, tunnel: str | None) -> str:
    """How the bytes move: ``relay`` (through this machine), ``tunnel`` (the eval host pulls through
    a tunnel this machine forwards; ``auto``: the relay where the tunnel cannot be set up) or
    ``direct`` (the eval host pulls with its own credentials). What the command says wins, then
    the training run's ``direct`` (catalog), then the eval host's ``tunnel`` (inventory)."""
    if tunnel is not None and tunnel not in MODES:
        raise SyncError(f"unknown data path {tunnel!r}; one of {', '.join(MODES)}")
    if direct and tunnel not in (None, "relay", "direct"):
        raise SyncError("--direct and --tunnel exclude each other: the eval host pulls either with its own "
                        "credentials or through the tunnel")
    if direct or tunnel == "direct":
        return "direct"
    if tunnel is not None:
        return tunnel
    if direct is False:
        return "relay"
    if run.direct:
        return "direct"
    return {True: "tunnel", "auto": "auto"}.get(dst.tunnel, "relay")


class Masters:
    """The data path's OpenSSH master connections of a sync, one per SSH host, started in the
    background as soon as the host's control connection is up; closed at the end of the sync."""

    def __init__(self, alive: tuple[int, int]):
        self.alive, self.open = alive, {}

    def start(self, runner) -> None:
        if isinstance(runner, SSHRunner) and runner not in self.open:
            self.open[runner] = Master(runner.endpoint, runner.pin_lines(), data_options(self.alive))

    def get(self, runner, timeout: float = 60) -> Master | None:
        """``runner``'s master, authenticated (None for the local host)."""
        if not isinstance(runner, SSHRunner):
            return None
        self.start(runner)
        try:
            return self.open[runner].ready(timeout)
        except TransportError as e:
            raise SyncError(str(e)) from None

    def close(self) -> None:
        for m in self.open.values():
            m.close()
        self.open.clear()


def _session(runner, host: Host, idle: float, sessions: list[Session], masters: Masters | None) -> tuple[Host, Session]:
    """Connect, expand ``~`` in the host's paths there, start its session (into ``sessions``, closed
    at the end of the sync) and, unless ``masters`` is None, its data path's master connection."""
    runner.connect()
    host = host.on_host(runner.expand_home)
    session = Session(runner, host, idle)
    sessions.append(session)
    if masters is not None:
        masters.start(runner)
    return host, session


def sync_checkpoint(inv: Inventory, catalog: Catalog, name: str, *, run: str | None = None,
                    src_name: str | None = None, dst_name: str | None = None, jobs: int = 4,
                    dry_run: bool = False, direct: bool | None = None, tunnel: str | None = None,
                    lock_wait: float = LOCK_WAIT, alive: tuple[int, int] = (ALIVE_INTERVAL, ALIVE_COUNT),
                    idle: float = IDLE_TIMEOUT, stall: float = STALL_TIMEOUT, progress: SyncProgress | None = None,
                    on_plan: Callable[[SyncPlan], None] | None = None,
                    replace_own_copy: str | None = None) -> SyncResult:
    """Copy checkpoint ``name`` of a training run (default: the run with the newest checkpoint)
    from the training host to the eval host; ``dry_run`` only plans. ``on_plan`` sees the plan
    before any byte moves. ``tunnel``: relay, tunnel, auto or direct (default: ``data_mode``).
    A copy of other files already on the eval host is refused, unless its digest is
    ``replace_own_copy`` (the ``copy_digest`` of an earlier result: a copy the caller made itself),
    which the new copy then replaces at the final rename."""
    src, dst = inv.pick("train", src_name), inv.pick("eval", dst_name)
    with ExitStack() as stack:
        srun = stack.enter_context(runner_for(src, inv))
        drun = stack.enter_context(runner_for(dst, inv))
        masters = None if dry_run else Masters(alive)
        if masters is not None:
            stack.callback(masters.close)
        sessions: list[Session] = []
        stack.callback(close_all, sessions)
        bg = stack.enter_context(ThreadPoolExecutor(1))
        started = time.monotonic()
        eval_side: Future = bg.submit(_session, drun, dst, idle, sessions, masters)  # both hosts come up at once
        src, ssess = _session(srun, src, idle, sessions, None)
        r, info = pick_run(catalog, run, lambda runs: host_checkpoints(
            srun, src, runs, lambda x: x.source_dir(src.checkpoints), session=ssess))
        ckpt = resolve_name(name, r, info, src)
        dst, dsess = eval_side.result()
        mode = data_mode(r, dst, direct, tunnel)
        if masters is not None and mode == "relay":
            masters.start(srun)
        plan = SyncPlan(run=r.name, checkpoint=ckpt, src=src, dst=dst,
                        src_dir=str(PurePosixPath(info["dir"]) / ckpt), dst_rundir=dest_rundir(dst, r))
        if src.name == dst.name and plan.src_dir == plan.dst_final:
            raise SyncError(f"source and destination are the same folder: {plan.src_dir}")
        source = ssess.call_json("MANIFEST", {"dir": plan.src_dir}, timeout=600)
        src_files = source["files"]
        plan.excluded = source.get("excluded") or []
        if dry_run:
            plan.incomplete = judge_manifest(src_files, source["now"], r).reason or None
            st = dsess.call_json("STATE", {"rundir": plan.dst_rundir, "ckpt": ckpt,
                                           "paths": [e["path"] for e in src_files]}, timeout=120)
            plan.final_exists = st["final_exists"]
            plan.up_to_date = st["final_exists"] and same_manifest(st["final_manifest"], src_files)
            make_plan(plan, src_files, st)
            if on_plan:
                on_plan(plan)
            return SyncResult(plan=plan, dry_run=True)
        # the completeness rule, before the destination is touched
        instead = newest_complete(info, r) if name in ("latest", "newest") else None
        require_complete(src_files, source["now"], r, src.name, plan.src_dir, instead)
        token = secrets.token_hex(16)
        dest = Destination(dsess, plan.dst_rundir, ckpt, token)
        dest.lock(lock_wait)
        st = dest.state([e["path"] for e in src_files])
        plan.final_exists = st["final_exists"]
        if st["final_exists"]:
            if any(e.get("sha256") is None for e in src_files):
                src_files = ssess.call_json("MANIFEST", {"dir": plan.src_dir, "hash": True}, timeout=3600)["files"]
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
            if replace_own_copy is None or st.get("final_digest") != replace_own_copy:
                why = (f"a copy of other files (changed on {src.name} since it was synced: {describe(changed)})"
                       if copy else "without a dflash manifest")
                raise SyncError(f"{dst.name}:{plan.dst_final} already exists, {why}; move it away to sync again")
            plan.final_exists = False       # the caller's own copy: replaced at the final rename
        make_plan(plan, src_files, st)
        if on_plan:
            on_plan(plan)
        need = plan.to_move
        if st["free_bytes"] is not None and st["free_bytes"] < need + FREE_RESERVE:
            raise SyncError(
                f"not enough space on {dst.name} for {plan.dst_rundir}: {human_bytes(need)} to write "
                f"(+{human_bytes(FREE_RESERVE)} reserve), {human_bytes(st['free_bytes'])} free; nothing was moved")
        dest.begin()
        result = SyncResult(plan=plan)
        if any(f.action != "skip" for f in plan.files):  # a full-size .part still has to be verified
            with data_path(srun, drun, ssess, dsess, masters, plan, token, mode, alive) as path:
                result.path = path.mode
                move(plan, path, token, result, jobs=jobs, alive=alive, idle=idle, stall=stall, progress=progress)
        if any(e.get("sha256") is None for e in src_files):  # first sync: see check_against
            changed = check_against(plan, ssess.call_json("MANIFEST", {"dir": plan.src_dir, "hash": True},
                                                          timeout=3600)["files"])
            if changed:
                dest.discard([f.path for f in changed])
                raise SyncError("; ".join(f.changed(src.name) for f in changed[:3]) +
                                (f" (and {len(changed) - 3} more files)" if len(changed) > 3 else ""))
        manifest = {"files": [{"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns,
                               "sha256": f.sha256} for f in plan.files], "excluded": plan.excluded,
                    **({"replace": st["final_digest"]} if st["final_exists"] else {})}
        result.copy_digest = dest.finalize(manifest, rehash=sum(f.size for f in plan.files if f.action == "skip"))
        result.seconds = time.monotonic() - started
        result.verified = len(plan.files)
        result.skipped = sum(f.action == "skip" for f in plan.files)
        return result


def check_against(plan: SyncPlan, source_files: list[dict]) -> list[FilePlan]:
    """Every file that arrived has the sha256 the training host's manifest gives over the control
    connection (and the file there is still the one listed).

    On a first sync that manifest is read after the transfer (a request to the training host's
    session: no tool start), and its hashes are the ones each sender recorded in the folder's
    manifest cache (``send --cache``) as it read the file, keyed by size, mtime, inode and ctime:
    the checkpoint is read and hashed once there, by its senders. They are still the training
    host's word: every client of the data path is pinned to the host key that host's control
    connection accepted (``data_path``: the relay's master connection here; with ``--tunnel`` the
    eval host's client, whose only known host key is that one, and whose key can only run the
    sender of this checkpoint's files, the tool's code pinned by its sha256), so the sender ran on
    that host as our code, and whoever might answer the data path in its place could not write that
    host's cache. A file the cache does not cover (a read-only source, a file rewritten meanwhile, a
    sender that hashed some other file) is hashed there now, over the control connection.

    Returns the files that are not the ones listed any more (changed while they were sent)."""
    there = {e["path"]: e for e in source_files}
    changed = []
    for f in plan.files:
        e = there.get(f.path)
        if e is None or (e["size"], e["mtime_ns"]) != (f.size, f.mtime_ns) or \
                (all(f.ident) and (e.get("ino"), e.get("ctime_ns")) != f.ident):
            changed.append(f)
        elif f.sha256 is None:
            raise SyncError(f"{f.path} was not received and verified on {plan.dst.name}; run the same command again")
        elif e["sha256"] != f.sha256:
            raise SyncError(f"{f.path}: the bytes that arrived on {plan.dst.name} (sha256 {f.sha256[:16]}...) are not "
                            f"the file on {plan.src.name} (sha256 {e['sha256'][:16]}..., computed there over the "
                            f"control connection): the data path delivered other content; nothing was finalized. "
                            f"A rerun sends the file again")
    return changed


@contextmanager
def data_path(srun, drun, ssess: Session, dsess: Session, masters: Masters, plan: SyncPlan, token: str,
              mode: str, alive: tuple[int, int]) -> Iterator[DataPath]:
    """The sync's data path (``mode``: :func:`data_mode`), every OpenSSH client pinned to the host
    key its host's control connection accepted: the master connections here, and for ``direct``
    a known_hosts file on the eval host for its own pull from the training host."""
    dm = masters.get(drun)
    with ExitStack() as stack:
        if mode in ("tunnel", "auto"):
            try:
                pull, batch = stack.enter_context(pull_through_tunnel(srun, ssess, dsess, dm, plan, token, alive))
            except TunnelUnavailable as e:
                if mode == "tunnel":
                    raise
                warnings.warn(TunnelFallback(f"{e}; moving the bytes through this machine instead"), stacklevel=2)
            else:
                yield DataPath(None, dm, pull, "tunnel", batch)
                return
        if mode == "direct":
            if not isinstance(srun, SSHRunner):
                raise SyncError(f"--direct needs the training host to be an SSH host, not {plan.src.name}")
            remote_pins = f"{plan.dst_rundir}/.dflash-known-hosts-{token}"
            drun.put_text(srun.pin_lines(), remote_pins)
            stack.callback(drun.run, ["rm", "-f", "--", remote_pins], timeout=30)
            pulled = srun.endpoint.pinned_to(remote_pins)

            def pull(f, offset: int) -> list[str]:
                send = tool_argv(plan.src, "send", str(PurePosixPath(plan.src_dir) / f.path), f.size, f.mtime_ns,
                                 offset, *(["--hash", "--cache", plan.src_dir] if f.sha256 is None else []))
                return pulled.argv(send, data_options(alive), on_host=True)

            def batch(spec: str) -> list[str]:
                return pulled.argv(tool_argv(plan.src, "send-batch", plan.src_dir, spec), data_options(alive), on_host=True)
            yield DataPath(None, dm, pull, "direct", batch)
            return
        yield DataPath(masters.get(srun), dm)
