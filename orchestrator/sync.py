"""`sync-ckpt` / `ckpts`: move a training checkpoint to the eval host, streamed, resumable, verified.

Data path (REFERENCE §5, measured in benchmarks/bench_sync.py): for every file one OpenSSH client
runs ``ckpt_tool.py send`` on the source and one runs ``ckpt_tool.py recv`` on the destination;
the first one's stdout is connected to the second one's stdin by a kernel pipe (1 MiB), so the
bytes never enter this process nor touch this machine's disk, and there is no paramiko in the
data path (no 512 MiB rekey deadlock, paramiko#822). ``ServerAliveInterval``/``CountMax`` make a
dead link fail in bounded time; the remote ends give up when stdin is silent for ``idle`` seconds
(so a cut link never leaves a lock held). Several files move at once (one pair each).

Control (listing, manifests, the destination lock) goes through :func:`transport.runner_for`
(paramiko). The destination lock is held by ``ckpt_tool.py hold`` for the whole sync; every
``recv`` checks that the holder that started it still holds it (a token), so a killed sync's
orphans stop and can never interleave with a new one.

Integrity: bytes go to ``.staging-CKPT/NAME.part``, appended from its size on resume; sha256 is
computed in flight on both ends (the sender over the whole file, continuing over the prefix on
resume; the receiver over the ``.part`` prefix, read once, plus the new bytes) and compared
before fsync + rename; a mismatch deletes the ``.part`` and re-sends the file from zero. The
staging folder, with a manifest copy, is renamed to ``CKPT`` only when every file verified.
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import secrets
import subprocess
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import PurePosixPath
from typing import Callable

from .catalog import Catalog, CatalogError, TrainingRun, check_name, resolve_checkpoint
from .inventory import Host, Inventory, InventoryError
from .transport import CONNECT_TIMEOUT, TransportError, command_line, endpoint_for, runner_for

ALIVE_INTERVAL = 5  # ssh ServerAliveInterval: a dead link is noticed after INTERVAL*COUNT seconds
ALIVE_COUNT = 3
IDLE_TIMEOUT = 20.0  # remote ends give up after this long without input
STALL_TIMEOUT = 45.0  # backstop: no byte moved for this long -> abort
LOCK_WAIT = 60.0
PING_EVERY = 2.0
FREE_RESERVE = 64 << 20  # keep this much free on the destination
PIPE_SIZE = 1 << 20
CIPHERS = ("aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,"
           "aes128-ctr,aes256-ctr")
BOOTSTRAP = ("import sys,zlib,base64;exec(compile(zlib.decompress(base64.b64decode(sys.argv.pop(1))),"
             "'ckpt_tool.py','exec'),{'__name__':'__main__'})")


class SyncError(Exception):
    """The sync cannot go on; the message is for the user as-is."""


# --- shipping the tool, building commands ---------------------------------------------------------

_BLOB: str | None = None


def tool_blob() -> str:
    global _BLOB
    if _BLOB is None:
        src = resources.files("remote").joinpath("ckpt_tool.py").read_bytes()
        _BLOB = base64.b64encode(zlib.compress(src, 9)).decode()
    return _BLOB


def tool_argv(host: Host, *args: str | int) -> list[str]:
    """``python -c BOOTSTRAP BLOB ARGS``: the tool travels as an argument, stdin stays free."""
    return [host.python, "-c", BOOTSTRAP, tool_blob(), *(str(a) for a in args)]


def data_options(alive: tuple[int, int] = (ALIVE_INTERVAL, ALIVE_COUNT)) -> tuple[str, ...]:
    """OpenSSH options of the data path: a dead link fails in ALIVE[0]*ALIVE[1] s, fast ciphers."""
    return (f"ConnectTimeout={int(CONNECT_TIMEOUT)}", f"ServerAliveInterval={alive[0]}",
            f"ServerAliveCountMax={alive[1]}", "TCPKeepAlive=yes", "Compression=no", f"Ciphers={CIPHERS}")


def data_argv(host: Host, remote: list[str], inventory: Inventory | None = None,
              alive: tuple[int, int] = (ALIVE_INTERVAL, ALIVE_COUNT)) -> list[str]:
    """``remote`` run on ``host`` by an OpenSSH client (the host's endpoint), or locally."""
    return list(remote) if host.is_local else endpoint_for(host, inventory).argv(remote, data_options(alive))


def _tool_error(stderr: str, fallback: str) -> str:
    lines = [ln[6:] for ln in stderr.splitlines() if ln.startswith("ERROR ")]
    if lines:
        return lines[-1]
    tail = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return tail[-1] if tail else fallback


def run_tool(runner, host: Host, *args, input: str | None = None, timeout: float = 600) -> dict:
    res = runner.run(tool_argv(host, *args), input=input, timeout=timeout)
    if res.returncode in (126, 127):
        raise SyncError(f"host {host.name}: python not found or not executable: {host.python}")
    if not res.ok:
        raise SyncError(f"host {host.name}: ckpt_tool {args[0]}: {_tool_error(res.stderr, f'exit {res.returncode}')}")
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SyncError(f"host {host.name}: ckpt_tool {args[0]} printed no JSON") from None


# --- hosts, runs, names -------------------------------------------------------------------------


def pick_host(inv: Inventory, role: str, name: str | None) -> Host:
    if name:
        return inv.get(name)
    hosts = [h for h in inv.with_role(role) if not h.is_local] or inv.with_role(role)
    if len(hosts) != 1:
        flag = "--from" if role == "train" else "--to"
        raise InventoryError(f"{len(hosts)} hosts have role {role} ({', '.join(h.name for h in hosts) or 'none'});"
                             f" pick one with {flag} HOST")
    return hosts[0]


def list_runs(runner, host: Host, runs: list[TrainingRun], root_for: Callable[[TrainingRun], str]) -> dict:
    args: list[str] = ["list", host.checkpoints or "/"]
    for r in runs:
        args += ["--run", r.name, root_for(r), r.pattern]
    return run_tool(runner, host, *args, timeout=120)["runs"]


def newest_run(listing: dict) -> str | None:
    best, when = None, -1.0
    for name, info in listing.items():
        for c in info["checkpoints"]:
            if c["mtime"] > when:
                best, when = name, c["mtime"]
    return best


def dest_rundir(dst: Host, run: TrainingRun) -> str:
    if not dst.checkpoints:
        raise SyncError(f"host {dst.name} has no `checkpoints` root in the inventory")
    return str(PurePosixPath(dst.checkpoints) / run.name)


# --- plan ---------------------------------------------------------------------------------------


@dataclass
class FilePlan:
    path: str
    size: int
    mtime_ns: int
    sha256: str | None  # known on the source (cached manifest) or None: hashed in flight
    offset: int = 0
    action: str = "send"  # send | resume | skip

    @property
    def to_move(self) -> int:
        return 0 if self.action == "skip" else self.size - self.offset


@dataclass
class SyncPlan:
    run: str
    checkpoint: str
    src: Host
    dst: Host
    src_dir: str
    dst_rundir: str
    files: list[FilePlan] = field(default_factory=list)
    up_to_date: bool = False
    final_exists: bool = False
    free_bytes: int | None = None

    @property
    def dst_final(self) -> str:
        return str(PurePosixPath(self.dst_rundir) / self.checkpoint)

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def to_move(self) -> int:
        return 0 if self.up_to_date else sum(f.to_move for f in self.files)


@dataclass
class SyncResult:
    plan: SyncPlan
    bytes_moved: int = 0
    seconds: float = 0.0
    verified: int = 0
    skipped: int = 0
    resent: list[str] = field(default_factory=list)
    dry_run: bool = False

    @property
    def rate(self) -> float:
        return self.bytes_moved / self.seconds if self.seconds > 0 else 0.0


def _make_plan(plan: SyncPlan, src_files: list[dict], st: dict) -> None:
    plan.free_bytes = st.get("free_bytes")
    verified, parts = st.get("verified") or {}, st.get("parts") or {}
    for e in src_files:
        f = FilePlan(e["path"], e["size"], e["mtime_ns"], e.get("sha256"))
        v = verified.get(f.path)
        if v and v.get("size") == f.size and v.get("mtime_ns") == f.mtime_ns and \
                (f.sha256 is None or v.get("sha256") == f.sha256):
            f.action, f.offset, f.sha256 = "skip", f.size, v["sha256"]
        elif 0 < parts.get(f.path, 0) <= f.size:
            f.action, f.offset = "resume", parts[f.path]
        plan.files.append(f)


def _same_manifest(a: list[dict] | None, b: list[dict]) -> bool:
    if not a:
        return False
    key = lambda e: (e["path"], e["size"], e.get("sha256"))  # noqa: E731
    return sorted(map(key, a)) == sorted(map(key, b))


# --- the lock holder on the destination ---------------------------------------------------------


class Holder:
    """``ckpt_tool.py hold`` on the destination over the control transport: the lock, the state
    (under the lock), and the final rename."""

    def __init__(self, runner, host: Host, rundir: str, ckpt: str, token: str, wait: float, idle: float):
        self.host = host
        self.h = runner.open_exec(tool_argv(host, "hold", rundir, ckpt, token, "--wait", f"{wait:g}",
                                            "--idle", f"{idle:g}"))
        self.lines: queue.Queue = queue.Queue()
        self.wlock = threading.Lock()
        self.closed = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain_err, daemon=True).start()
        self.err: list[str] = []
        self.wait_s = wait

    def _read(self) -> None:
        try:
            for raw in iter(self.h.stdout.readline, b""):
                self.lines.put(raw.decode(errors="replace").rstrip("\n"))
        except Exception:
            pass
        self.lines.put(None)

    def _drain_err(self) -> None:
        try:
            for raw in iter(self.h.stderr.readline, b""):
                self.err.append(raw.decode(errors="replace").rstrip("\n"))
        except Exception:
            pass

    def expect(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise SyncError(f"host {self.host.name}: no answer from the lock holder in {timeout:g}s") from None
            if line is None:
                raise SyncError(f"host {self.host.name}: lock holder ended: "
                                f"{_tool_error(chr(10).join(self.err), 'connection closed')}")
            if line.startswith("BUSY"):
                raise SyncError(f"host {self.host.name}: {line[5:]}; it is still running — wait for it "
                                f"or raise --lock-wait")
            if line.startswith("ERROR"):
                raise SyncError(f"host {self.host.name}: {line[6:]}")
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def send(self, line: str) -> None:
        with self.wlock:
            self.h.stdin.write((line + "\n").encode())
            self.h.stdin.flush()

    def ping_forever(self) -> None:
        while not self.closed.wait(PING_EVERY):
            try:
                self.send("PING")
            except Exception:
                return

    def close(self) -> None:
        self.closed.set()
        try:
            with self.wlock:
                self.h.stdin.close()
        except Exception:
            pass
        t = threading.Thread(target=self.h.close, daemon=True)  # never hang on a dead link
        t.start()
        t.join(5)


# --- one file's transfer ------------------------------------------------------------------------


class Transfer:
    def __init__(self, f: FilePlan, src_argv: list[str] | None, dst_argv: list[str]):
        self.f = f
        self.src_argv, self.dst_argv = src_argv, dst_argv
        self.got = 0
        self.last = time.monotonic()
        self.procs: list[subprocess.Popen] = []
        self.killed_for: str | None = None
        self.rcs = (0, 0)

    def kill(self, why: str) -> None:
        self.killed_for = self.killed_for or why
        for p in self.procs:
            try:
                os.killpg(p.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass

    def run(self, on_bytes: Callable[[int], None]) -> tuple[str, str, str, str]:
        """Returns (status line, dst stderr, src stderr, src rc)."""
        self.got = 0
        self.last = time.monotonic()
        r = w = None
        if self.src_argv is not None:
            r, w = os.pipe()
            try:
                fcntl.fcntl(w, 1031, PIPE_SIZE)  # F_SETPIPE_SZ: fewer wake-ups per MiB
            except OSError:
                pass
            src = subprocess.Popen(self.src_argv, stdin=subprocess.DEVNULL, stdout=w,
                                   stderr=subprocess.PIPE, start_new_session=True)
            self.procs.append(src)
            os.close(w)
        else:
            src = None
        dst = subprocess.Popen(self.dst_argv, stdin=r if r is not None else subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.procs.append(dst)
        if r is not None:
            os.close(r)  # only the two ssh clients hold the pipe now
        errs = {"src": b"", "dst": b""}

        def drain(name, stream):
            errs[name] = stream.read()
        threads = [threading.Thread(target=drain, args=("dst", dst.stderr), daemon=True)]
        if src is not None:
            threads.append(threading.Thread(target=drain, args=("src", src.stderr), daemon=True))
        for t in threads:
            t.start()
        status = ""
        for raw in iter(dst.stdout.readline, b""):
            line = raw.decode(errors="replace").strip()
            if line.startswith("P "):
                n = int(line[2:])
                if n > self.got:
                    on_bytes(n - self.got)
                    self.got = n
                self.last = time.monotonic()
            elif line:
                status = line
        dst.wait()
        if src is not None:
            try:
                src.wait(timeout=10 if dst.returncode == 0 else 3)
            except subprocess.TimeoutExpired:
                self.kill("sender did not stop")
                src.wait()
        for t in threads:
            t.join(5)
        self.rcs = (src.returncode if src is not None else 0, dst.returncode)
        return (status, errs["dst"].decode(errors="replace"), errs["src"].decode(errors="replace"),
                str(self.rcs[0]))


# --- the sync -----------------------------------------------------------------------------------


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _pick_run(catalog: Catalog, run: str | None, listing_fn) -> tuple[TrainingRun, dict]:
    if run:
        r = catalog.run(run)
        return r, listing_fn([r])[r.name]
    if not catalog.runs:
        raise CatalogError(f"no training runs in the catalog ({catalog.path or 'none found'})")
    listing = listing_fn(list(catalog.runs.values()))
    name = newest_run(listing) or next(iter(catalog.runs))
    return catalog.runs[name], listing[name]


def _resolve(name: str, r: TrainingRun, info: dict, src: Host) -> str:
    folders = [c["name"] for c in info["checkpoints"]]
    if name in ("latest", "newest"):
        stepped = [c for c in info["checkpoints"] if c["step"] is not None]
        if not stepped:
            raise CatalogError(f"run {r.name} has no checkpoints on {src.name} ({info['dir']})")
        return max(stepped, key=lambda c: c["step"])["name"]
    if not info.get("exists", True):
        check_name(name)
        raise CatalogError(f"run {r.name}: folder {info['dir']} does not exist on host {src.name}")
    return resolve_checkpoint(name, r, folders)


def sync_checkpoint(inv: Inventory, catalog: Catalog, name: str, *, run: str | None = None,
                    src_name: str | None = None, dst_name: str | None = None, jobs: int = 4,
                    dry_run: bool = False, direct: bool | None = None, lock_wait: float = LOCK_WAIT,
                    alive: tuple[int, int] = (ALIVE_INTERVAL, ALIVE_COUNT), idle: float = IDLE_TIMEOUT,
                    stall: float = STALL_TIMEOUT, console=None, progress: bool = True,
                    on_plan: Callable[[SyncPlan], None] | None = None) -> SyncResult:
    src, dst = pick_host(inv, "train", src_name), pick_host(inv, "eval", dst_name)
    with runner_for(src, inv) as srun, runner_for(dst, inv) as drun, ThreadPoolExecutor(2) as bg:
        started = time.monotonic()
        dconn = bg.submit(_connect, drun)  # both control connections come up at once
        r, info = _pick_run(catalog, run, lambda runs: list_runs(
            srun, src, runs, lambda x: x.source_dir(src.checkpoints)))
        ckpt = _resolve(name, r, info, src)
        direct = r.direct if direct is None else direct
        plan = SyncPlan(run=r.name, checkpoint=ckpt, src=src, dst=dst,
                        src_dir=str(PurePosixPath(info["dir"]) / ckpt), dst_rundir=dest_rundir(dst, r))
        if src.name == dst.name and plan.src_dir == plan.dst_final:
            raise SyncError(f"source and destination are the same folder: {plan.src_dir}")
        manifest_f = bg.submit(run_tool, srun, src, "manifest", plan.src_dir, timeout=600)
        dconn.result()
        if dry_run:
            st = run_tool(drun, dst, "state", plan.dst_rundir, ckpt, timeout=120)
            src_files = manifest_f.result()["files"]
            plan.final_exists = st["final_exists"]
            plan.up_to_date = st["final_exists"] and _same_manifest(st["final_manifest"], src_files)
            _make_plan(plan, src_files, st)
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
            src_files = manifest_f.result()["files"]
            plan.final_exists = st["final_exists"]
            if st["final_exists"]:
                if any(e.get("sha256") is None for e in src_files):
                    src_files = run_tool(srun, src, "manifest", plan.src_dir, "--hash", timeout=3600)["files"]
                if _same_manifest(st["final_manifest"], src_files):
                    plan.up_to_date = True
                    _make_plan(plan, src_files, {"free_bytes": st["free_bytes"]})
                    for f in plan.files:
                        f.action, f.offset = "skip", f.size
                    if on_plan:
                        on_plan(plan)
                    return SyncResult(plan=plan, seconds=time.monotonic() - started,
                                      verified=len(plan.files), skipped=len(plan.files))
                raise SyncError(f"{dst.name}:{plan.dst_final} already exists with different content "
                                f"(or without a dflash manifest); move it away to sync again")
            _make_plan(plan, src_files, st)
            if on_plan:
                on_plan(plan)
            need = plan.to_move
            if st["free_bytes"] is not None and st["free_bytes"] < need + FREE_RESERVE:
                raise SyncError(
                    f"not enough space on {dst.name} for {plan.dst_rundir}: {_human(need)} to write "
                    f"(+{_human(FREE_RESERVE)} reserve), {_human(st['free_bytes'])} free; nothing was moved")
            holder.send("BEGIN")
            holder.expect("BEGUN", 60)
            result = SyncResult(plan=plan)
            _move(plan, inv, token, jobs, alive, idle, stall, direct, result, console, progress)
            manifest = {"files": [{"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns,
                                   "sha256": f.sha256} for f in plan.files]}
            # cache the manifest on the source (for the next sync) while the destination finalizes
            saved = bg.submit(run_tool, srun, src, "save-manifest", plan.src_dir,
                              input=json.dumps(manifest), timeout=60)
            holder.send("FINALIZE " + json.dumps(manifest))
            holder.expect("DONE", 300)
            result.seconds = time.monotonic() - started
            result.verified = len(plan.files)
            result.skipped = sum(f.action == "skip" for f in plan.files)
        finally:
            holder.close()
        try:
            saved.result()
        except (SyncError, TransportError):
            pass
        return result


def _connect(runner) -> None:
    if hasattr(runner, "connect"):
        runner.connect()


def _move(plan: SyncPlan, inv: Inventory, token: str, jobs: int, alive, idle: float, stall: float,
          direct: bool, result: SyncResult, console, show: bool) -> None:
    todo = [f for f in plan.files if f.action != "skip"]
    if not todo:
        return
    src, dst = plan.src, plan.dst
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                        TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                        disable=not show, transient=False)
    total_task = progress.add_task(f"[bold]{plan.checkpoint}", total=plan.to_move)
    lock = threading.Lock()
    active: dict[str, Transfer] = {}
    abort = threading.Event()
    failures: list[str] = []

    def argv_pair(f: FilePlan, offset: int) -> tuple[list[str] | None, list[str]]:
        send = tool_argv(src, "send", str(PurePosixPath(plan.src_dir) / f.path), f.size, f.mtime_ns,
                         offset, *(["--hash"] if f.sha256 is None else []))
        recv = tool_argv(dst, "--idle", f"{idle:g}", "recv", plan.dst_rundir, plan.checkpoint, f.path,
                         f.size, offset, f.mtime_ns, token, *(["--sha256", f.sha256] if f.sha256 else []))
        if direct:  # the eval host pulls from the training host itself, with its own key and known_hosts
            pull = endpoint_for(src, inv).argv(send, data_options(alive), on_host=True)
            line = f"set -o pipefail 2>/dev/null; {command_line(pull)} | {command_line(recv)}"
            return None, data_argv(dst, ["bash", "-c", line], inv, alive)
        return data_argv(src, send, inv, alive), data_argv(dst, recv, inv, alive)

    def one(f: FilePlan) -> None:
        task = progress.add_task(f"  {f.path}", total=f.size, completed=f.offset)
        offset = f.offset
        for attempt in range(2):
            if abort.is_set():
                return
            t = Transfer(f, *argv_pair(f, offset))
            with lock:
                active[f.path] = t

            def on_bytes(n: int) -> None:
                with lock:
                    result.bytes_moved += n
                progress.advance(task, n)
                progress.advance(total_task, n)
            status, derr, serr, src_rc = t.run(on_bytes)
            with lock:
                active.pop(f.path, None)
            if status.startswith("OK "):
                digest = status[3:].strip()
                if f.sha256 and digest != f.sha256:
                    raise SyncError(f"{f.path}: receiver reported {digest}, manifest {f.sha256}")
                f.sha256 = digest
                return
            if status.startswith("BAD") and attempt == 0 and not abort.is_set():
                result.resent.append(f.path)  # corrupt .part / bad stream: again from zero
                progress.update(task, completed=0)
                progress.update(total_task, total=progress.tasks[total_task].total + offset)
                offset = 0
                continue
            raise SyncError(_explain(f, t, status, derr, serr, src_rc, src, dst, alive, idle))

    def watchdog() -> None:
        while not abort.wait(1.0):
            now = time.monotonic()
            with lock:
                for t in list(active.values()):
                    if now - t.last > stall:
                        t.kill(f"no byte moved for {stall:g}s")

    def guarded(f: FilePlan) -> None:
        try:
            one(f)
        except BaseException as e:
            with lock:
                failures.append(str(e))
                abort.set()
                for t in active.values():
                    t.kill("another file failed")
            raise

    wd = threading.Thread(target=watchdog, daemon=True)
    wd.start()
    try:
        with progress, ThreadPoolExecutor(max_workers=max(1, min(jobs, len(todo)))) as pool:
            futures = [pool.submit(guarded, f) for f in sorted(todo, key=lambda f: -f.to_move)]
            for fut in futures:
                try:
                    fut.result()
                except BaseException:
                    pass
    except BaseException:
        abort.set()
        with lock:
            for t in active.values():
                t.kill("interrupted")
        raise
    finally:
        abort.set()
    if failures:
        raise SyncError(failures[0])


def _explain(f: FilePlan, t: Transfer, status: str, derr: str, serr: str, src_rc: str,
             src: Host, dst: Host, alive, idle: float) -> str:
    where = f"{f.path} ({_human(t.got)} of {_human(f.size - f.offset)} this run)"
    keep = "what arrived is kept in the staging folder; run the same command again to resume"
    dead = alive[0] * alive[1]
    for host, err in ((dst, derr), (src, serr)):
        low = err.lower()
        if "host key verification failed" in low:
            ep = endpoint_for(host)
            return f"{ep.where}: host key verification failed (known_hosts {ep.known_hosts_file})"
        if "not responding" in low or "timed out" in low or "connection reset" in low:
            return (f"lost the connection to host {host.name} ({host.address}:{host.port}) while "
                    f"moving {where}: no answer for ~{dead}s; {keep}")
        if any(w in low for w in ("connection refused", "no route", "could not resolve",
                                  "network is unreachable", "permission denied")):
            return f"cannot reach host {host.name} ({host.address}:{host.port}): {err.strip().splitlines()[-1]}"
    for host, rc, err, ssh_used in ((dst, t.rcs[1], derr, not dst.is_local),
                                    (src, t.rcs[0], serr, t.src_argv is not None and not src.is_local)):
        if ssh_used and rc == 255 and not t.killed_for:  # ssh itself failed: the connection
            tail = (err.strip().splitlines() or ["connection closed"])[-1]
            return (f"lost the connection to host {host.name} ({host.address}:{host.port}) while "
                    f"moving {where} (ssh: {tail}); {keep}")
    if t.killed_for:
        return f"stopped moving {where}: {t.killed_for}; {keep}"
    if status.startswith("IDLE"):
        return f"host {dst.name}: no data arrived for {idle:g}s while moving {where}; {keep}"
    if status.startswith("LOST"):
        return f"host {dst.name}: this sync lost the checkpoint lock while moving {where}"
    if status.startswith("BAD"):
        return f"{f.path}: sha256 mismatch again after re-sending from zero ({status}); the source may be changing"
    if status.startswith("SHORT") or not status:
        why = _tool_error(serr, "") or _tool_error(derr, "") or f"the stream ended early (sender exit {src_rc})"
        return f"moving {where} failed: {why}; {keep}"
    return f"moving {where} failed: {status} {_tool_error(derr, '')}"


# --- ckpts ----------------------------------------------------------------------------------------


@dataclass
class CkptRow:
    run: str
    name: str
    step: int | None
    size: int
    files: int
    mtime: float
    on_eval: str  # yes | partial | no | ?


def list_checkpoints(inv: Inventory, catalog: Catalog, run: str | None = None, *,
                     src_name: str | None = None, dst_name: str | None = None) -> tuple[list[CkptRow], list[str]]:
    """Checkpoints of one run (or all runs) on the training host, and whether each is on the eval
    host. Returns (rows, warnings)."""
    src = pick_host(inv, "train", src_name)
    runs = [catalog.run(run)] if run else list(catalog.runs.values())
    if not runs:
        raise CatalogError(f"no training runs in the catalog ({catalog.path or 'none found'})")
    warnings: list[str] = []
    with runner_for(src, inv) as srun:
        listing = list_runs(srun, src, runs, lambda r: r.source_dir(src.checkpoints))
    there: dict | None = None
    try:
        dst = pick_host(inv, "eval", dst_name)
        if dst.checkpoints:
            with runner_for(dst, inv, connect_timeout=10) as drun:
                there = list_runs(drun, dst, runs, lambda r: dest_rundir(dst, r))
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
            elif c["name"] in d and d[c["name"]]["complete"]:
                on = "yes"
            elif c["name"] in staging or c["name"] in d:
                on = "partial"
            else:
                on = "no"
            rows.append(CkptRow(r.name, c["name"], c["step"], c["size"], c["files"], c["mtime"], on))
    rows.sort(key=lambda x: (x.run, x.step if x.step is not None else -1, x.name))
    return rows, warnings


# --- command line bodies (called from cli.py) -----------------------------------------------------


def _errors():
    from contextlib import contextmanager

    from .cli import fail

    @contextmanager
    def guard():
        try:
            yield
        except (SyncError, CatalogError, InventoryError, TransportError) as e:
            raise fail(str(e)) from None
    return guard()


def _print_plan(console, plan: SyncPlan) -> None:
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"{plan.src.name}:{plan.src_dir} → {plan.dst.name}:{plan.dst_final}")
    for c in ("file", "size", "action", "from"):
        t.add_column(c, justify="right" if c in ("size", "from") else "left")
    for f in plan.files:
        t.add_row(escape(f.path), _human(f.size), f.action, _human(f.offset) if f.action == "resume" else "-")
    console.print(t)
    if plan.up_to_date:
        console.print("[green]already on the destination and verified: nothing to move[/]")
    elif plan.final_exists:
        console.print(f"[yellow]{escape(plan.dst_final)} exists (not identical or unverified)[/]")
    else:
        free = "" if plan.free_bytes is None else f", {_human(plan.free_bytes)} free there"
        console.print(f"to move: {_human(plan.to_move)} of {_human(plan.total)}{free}")


def cli_sync(inv: Inventory, name: str, *, run=None, src=None, dst=None, dry_run=False, jobs=4,
             direct=None, lock_wait=LOCK_WAIT, catalog=None) -> None:
    from rich.console import Console

    from .catalog import load_catalog

    err = Console(stderr=True, highlight=False)
    out = Console(highlight=False)
    with _errors():
        cat = load_catalog(catalog)
        result = sync_checkpoint(inv, cat, name, run=run, src_name=src, dst_name=dst, jobs=jobs,
                                 dry_run=dry_run, direct=direct, lock_wait=lock_wait, console=err,
                                 progress=err.is_terminal, on_plan=lambda p: _print_plan(out, p))
    if dry_run:
        return
    p = result.plan
    moved = f"moved {_human(result.bytes_moved)} in {result.seconds:.1f}s ({_human(result.rate)}/s)"
    extra = f", re-sent after a checksum mismatch: {', '.join(result.resent)}" if result.resent else ""
    out.print(f"[green]✔[/] {p.run}/{p.checkpoint} on {p.dst.name}:{p.dst_final}: {moved}; "
              f"{result.verified} file(s) verified (sha256), {result.skipped} already there{extra}")


def cli_ckpts(inv: Inventory, run=None, *, src=None, dst=None, catalog=None) -> None:
    from datetime import datetime

    from rich.console import Console
    from rich.table import Table

    from .catalog import load_catalog

    out = Console(highlight=False)
    with _errors():
        rows, warnings = list_checkpoints(inv, load_catalog(catalog), run, src_name=src, dst_name=dst)
    t = Table(title="checkpoints on the training host")
    for c in ("run", "checkpoint", "step", "size", "files", "time", "on eval"):
        t.add_column(c)
    colour = {"yes": "green", "partial": "yellow", "no": "dim", "?": "red"}
    for r in rows:
        t.add_row(r.run, r.name, "-" if r.step is None else str(r.step), _human(r.size), str(r.files),
                  datetime.fromtimestamp(r.mtime).strftime("%Y-%m-%d %H:%M"),
                  f"[{colour[r.on_eval]}]{r.on_eval}[/]")
    out.print(t)
    for w in warnings:
        out.print(f"[yellow]! {w}[/]")
