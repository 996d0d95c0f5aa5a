"""The data path: each file streams from ``sync_host.py send`` on the source into one running
``sync_host.py recv`` on the destination, the sender's stdout joined to the receiver's stdin by a
kernel pipe (REFERENCE §5; benchmarks/bench_sync.py). The OpenSSH clients of both ends ride one
master connection per host (transport/master.py), so a file costs a session, not a connection.
Small files (at most ``SMALL``) go many to a stream (``send-batch``/``recv-batch``: a header,
the bytes and a trailer per file), so a checkpoint of thousands of them costs a few streams.
The bytes never enter this process nor touch this machine's disk, and no paramiko is in the way
(its 512 MiB rekey deadlock, paramiko#822). ``ServerAliveInterval``/``CountMax`` make a dead
link fail in bounded time; the remote ends give up when stdin is silent for ``idle`` seconds; a
watchdog stops a transfer that moved nothing for ``stall`` seconds.

With ``--tunnel`` (sync/tunnel.py) or ``--direct`` there is no pipe here: the receiver starts the
sender itself (``recv --pull``) through an OpenSSH client on the eval host, and this machine only
runs the receiver's session (and, for the tunnel, forwards the training host's encrypted stream).

Integrity: bytes go to ``.staging-CKPT/NAME.part``, appended from its size on resume; sha256 is
computed in flight on both ends (the sender over the whole file, continuing over the prefix on
resume; the receiver over the ``.part`` prefix, read once, plus the new bytes) and compared
before fsync + rename; a mismatch deletes the ``.part`` and the file is sent again from zero.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Callable

from ..reports.render import human_bytes
from ..transport import CONNECT_TIMEOUT
from ..transport.master import Master
from .plan import FilePlan, SyncPlan, SyncResult
from .tool import SyncError, batch_spec, tool_argv, tool_error

ALIVE_INTERVAL = 5  # ssh ServerAliveInterval: a dead link is noticed after INTERVAL*COUNT seconds
ALIVE_COUNT = 3
IDLE_TIMEOUT = 20.0  # remote ends give up after this long without input
STALL_TIMEOUT = 45.0  # backstop: no byte moved for this long -> abort
MASTER_EXIT_GRACE = 3.0  # s a failed transfer's explanation waits for a master ending with its clients
PIPE_SIZE = 1 << 20
AES_FIRST = "aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,aes128-ctr,aes256-ctr"
CHACHA_FIRST = "chacha20-poly1305@openssh.com,aes128-gcm@openssh.com,aes256-gcm@openssh.com,aes128-ctr,aes256-ctr"
# only for a host that offers none of the AEAD ciphers above: encrypt-then-MAC, UMAC first
MACS = ("umac-128-etm@openssh.com,hmac-sha2-256-etm@openssh.com,hmac-sha2-512-etm@openssh.com,"
        "umac-128@openssh.com,hmac-sha2-256,hmac-sha2-512,hmac-sha1")


@lru_cache(maxsize=1)
def ciphers(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The data path's cipher preference. This machine en- and decrypts every byte twice (both
    legs), so its CPU decides: AES-GCM first where it has AES instructions (on this project's
    machines ~1.4x the default ChaCha20 pipe, benchmarks/bench_sync.py), ChaCha20-Poly1305 first
    where it has none. OpenSSH takes the first cipher of the list that the host also offers."""
    try:
        with open(cpuinfo) as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return AES_FIRST  # not Linux: assume a CPU of the last decade
    return AES_FIRST if {"aes", "aes256"} & set(flags.split(":")[-1].split()) else CHACHA_FIRST


def data_options(alive: tuple[int, int] = (ALIVE_INTERVAL, ALIVE_COUNT)) -> tuple[str, ...]:
    """OpenSSH options of the data path: a dead link fails in ALIVE[0]*ALIVE[1] s, fast ciphers."""
    return (f"ConnectTimeout={int(CONNECT_TIMEOUT)}", f"ServerAliveInterval={alive[0]}",
            f"ServerAliveCountMax={alive[1]}", "TCPKeepAlive=yes", "Compression=no", f"Ciphers={ciphers()}",
            f"MACs={MACS}")


MAX_SESSIONS = 8  # files at once on one master connection (sshd's MaxSessions is 10 by default)
SMALL = 1 << 20  # files of at most this size move in batches: one stream for many (send-batch/recv-batch)
BATCH_FILES = 500  # at most this many files per batch
BATCH_SPEC = 64 << 10  # and a SPEC (an argument of the sender's command line) of at most this many bytes


def batches(files: list[FilePlan], jobs: int) -> tuple[list[list[FilePlan]], list[FilePlan]]:
    """The small files in batches (at least ``jobs`` of them where there are that many files), and
    the files that move one by one."""
    small = [f for f in files if f.size <= SMALL]
    if len(small) < 2:
        return [], files
    per = max(1, min(BATCH_FILES, -(-len(small) // max(jobs, 1))))
    groups: list[list[FilePlan]] = []
    for i in range(0, len(small), per):
        group = small[i:i + per]
        while len(group) > 1 and len(batch_spec(group)) > BATCH_SPEC:  # long names: fewer per batch
            half = len(group) // 2
            groups.append(group[:half])
            group = group[half:]
        groups.append(group)
    return groups, [f for f in files if f.size > SMALL]


@dataclass(frozen=True)
class DataPath:
    """How the data path reaches the hosts of a sync: the OpenSSH master connection of each
    (transport/master.py, pinned to the host key its control connection accepted), or None for
    the built-in ``local`` host (run here). ``pull``: with ``--tunnel`` and ``--direct``, the
    command the eval host runs to start the sender of a file on the training host (file, offset
    -> argv; ``pull_batch``: SPEC -> argv for ``send-batch``); there is no sender here then."""
    src: Master | None
    dst: Master | None
    pull: Callable[[FilePlan, int], list[str]] | None = None
    mode: str = "relay"
    pull_batch: Callable[[str], list[str]] | None = None

    @staticmethod
    def argv(master: Master | None, remote: list[str], alive: tuple[int, int]) -> list[str]:
        """``remote`` run over ``master``'s connection, or here."""
        return list(remote) if master is None else master.argv(remote, data_options(alive))


class SyncProgress:
    """What a sync reports while it moves bytes; this one shows nothing (the CLI draws bars)."""

    def start(self, plan: SyncPlan) -> None:
        """Bytes are about to move: ``plan.to_move`` in all."""

    def file_started(self, f: FilePlan) -> None:
        """``f`` starts moving at ``f.offset``."""

    def moved(self, f: FilePlan, n: int) -> None:
        """``n`` more bytes of ``f`` arrived."""

    def file_restarted(self, f: FilePlan, lost: int) -> None:
        """``f`` is sent again from zero (a checksum mismatch): ``lost`` bytes must move again."""

    def stop(self) -> None:
        """No more bytes will move (done, failed or interrupted)."""


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
        self._stop_all()

    def _stop_all(self) -> None:
        for p in list(self.procs):
            try:
                os.killpg(p.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass

    def _started(self, proc: subprocess.Popen) -> None:
        """``proc`` is one of the transfer's now; one killed meanwhile does not outlive the kill."""
        self.procs.append(proc)
        if self.killed_for:
            self.kill(self.killed_for)

    def run(self, on_bytes: Callable[[int], None],
            on_line: Callable[[str], None] | None = None) -> tuple[str, str, str, str]:
        """Returns (status line, dst stderr, src stderr, src rc). ``on_line`` sees every line but
        progress (a batch: ``F REL`` starts the next file, its progress counted from zero)."""
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
            self._started(src)
            os.close(w)
        else:
            src = None
        dst = subprocess.Popen(self.dst_argv, stdin=r if r is not None else subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self._started(dst)
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
                if line.startswith("F "):
                    self.got = 0
                if on_line is not None:
                    on_line(line)
        dst.wait()
        if src is not None:
            try:
                src.wait(timeout=10 if dst.returncode == 0 else 3)
            except subprocess.TimeoutExpired:
                if status:  # the receiver said why it ended: stopping the sender is only tidying up
                    self._stop_all()
                else:
                    self.kill("sender did not stop")
                src.wait()
        for t in threads:
            t.join(5)
        self.rcs = (src.returncode if src is not None else 0, dst.returncode)
        return (status, errs["dst"].decode(errors="replace"), errs["src"].decode(errors="replace"),
                str(self.rcs[0]))


def move(plan: SyncPlan, path: DataPath, token: str, result: SyncResult, *, jobs: int = 4,
         alive: tuple[int, int] = (ALIVE_INTERVAL, ALIVE_COUNT), idle: float = IDLE_TIMEOUT,
         stall: float = STALL_TIMEOUT, progress: SyncProgress | None = None) -> None:
    """Move every file of ``plan`` that is not skipped, ``jobs`` at once (one sender/receiver pair
    each; the small ones in batches, a pair for many: :func:`batches`); a receiver that reports a
    bad checksum gets its file once more from zero. The first failure stops the others; what
    arrived stays in the staging folder for the rerun."""
    todo = [f for f in plan.files if f.action != "skip"]
    if not todo:
        return
    src, dst = plan.src, plan.dst
    progress = progress or SyncProgress()
    lock = threading.Lock()
    active: dict[str, Transfer] = {}
    abort = threading.Event()
    failures: list[str] = []

    def argv_pair(f: FilePlan, offset: int) -> tuple[list[str] | None, list[str]]:
        recv = tool_argv(dst, "--idle", f"{idle:g}", "recv", plan.dst_rundir, plan.checkpoint, f.path,
                         f.size, offset, f.mtime_ns, token, *(["--sha256", f.sha256] if f.sha256 else []))
        if path.pull is not None:  # the eval host starts the sender itself
            return None, path.argv(path.dst, [*recv, "--pull", json.dumps(path.pull(f, offset))], alive)
        send = tool_argv(src, "send", str(PurePosixPath(plan.src_dir) / f.path), f.size, f.mtime_ns,
                         offset, *(["--hash", "--cache", plan.src_dir] if f.sha256 is None else []))
        return path.argv(path.src, send, alive), path.argv(path.dst, recv, alive)

    def on_bytes_of(f: FilePlan) -> Callable[[int], None]:
        def on_bytes(n: int) -> None:
            with lock:
                result.bytes_moved += n
            progress.moved(f, n)
        return on_bytes

    def one_batch(fs: list[FilePlan]) -> None:
        spec = batch_spec(fs)
        recv = tool_argv(dst, "--idle", f"{idle:g}", "recv-batch", plan.dst_rundir, plan.checkpoint, token)
        if path.pull_batch is not None:
            t = Transfer(fs[0], None, path.argv(path.dst, [*recv, "--pull", json.dumps(path.pull_batch(spec))],
                                                alive))
        else:
            t = Transfer(fs[0], path.argv(path.src, tool_argv(src, "send-batch", plan.src_dir, spec), alive),
                         path.argv(path.dst, recv, alive))
        named = {f.path: f for f in fs}
        done: dict[str, str] = {}
        moved = {"f": fs[0]}

        def on_line(line: str) -> None:
            if line.startswith("F "):
                t.f = moved["f"] = named.get(line[2:], fs[0])
                progress.file_started(t.f)
            elif line != "END":
                done[moved["f"].path] = line
        with lock:
            if abort.is_set():
                return
            active[f"batch:{fs[0].path}"] = t
        status, derr, serr, src_rc = t.run(lambda n: on_bytes_of(moved["f"])(n), on_line)
        with lock:
            active.pop(f"batch:{fs[0].path}", None)
        for f in fs:
            st = done.get(f.path, "")
            if st.startswith("CHANGED"):
                raise SyncError(f.changed(src.name))
            if st.startswith("OK "):
                ok(f, st)
            elif st.startswith("BAD") and not abort.is_set():
                one(f, 0)  # once more from zero, on its own
            elif not st or status != "END":
                raise SyncError(explain(moved["f"], t, status, derr, serr, src_rc, plan, path, alive, idle))

    def ok(f: FilePlan, status: str) -> None:
        digest = status[3:].strip()
        if f.sha256 and digest != f.sha256:
            raise SyncError(f"{f.path}: receiver reported {digest}, manifest {f.sha256}")
        f.sha256 = digest

    def one(f: FilePlan, offset: int | None = None) -> None:
        progress.file_started(f)
        offset = f.offset if offset is None else offset
        for attempt in range(2):
            t = Transfer(f, *argv_pair(f, offset))
            with lock:
                if abort.is_set():
                    return
                active[f.path] = t
            status, derr, serr, src_rc = t.run(on_bytes_of(f))
            with lock:
                active.pop(f.path, None)
            if status.startswith("OK "):
                ok(f, status)
                return
            if status.startswith("BAD") and attempt == 0 and not abort.is_set():
                result.resent.append(f.path)  # corrupt .part / bad stream: again from zero
                progress.file_restarted(f, offset)
                offset = 0
                continue
            raise SyncError(explain(f, t, status, derr, serr, src_rc, plan, path, alive, idle))

    def watchdog() -> None:
        while not abort.wait(1.0):
            now = time.monotonic()
            with lock:
                for t in list(active.values()):
                    if now - t.last > stall:
                        t.kill(f"no byte moved for {stall:g}s")

    def guarded(work: FilePlan | list[FilePlan]) -> None:
        try:
            one_batch(work) if isinstance(work, list) else one(work)
        except BaseException as e:
            with lock:
                failures.append(str(e))
                abort.set()
                for t in active.values():
                    t.kill("another file failed")
            raise

    wd = threading.Thread(target=watchdog, daemon=True)
    wd.start()
    grouped, single = batches(todo, jobs)
    work: list = [*sorted(single, key=lambda f: -f.to_move), *grouped]
    pool = ThreadPoolExecutor(max_workers=max(1, min(jobs, len(work), MAX_SESSIONS)))
    try:
        progress.start(plan)
        futures = [pool.submit(guarded, w) for w in work]
        for fut in futures:
            try:
                fut.result()
            except Exception:  # noqa: BLE001 — recorded in `failures` by guarded(); the first is raised below
                pass
    except BaseException:              # Ctrl-C (or SIGTERM): stop every transfer now, not at its end
        with lock:
            abort.set()
            for t in active.values():
                t.kill("interrupted")
        raise
    finally:
        abort.set()
        pool.shutdown(wait=True, cancel_futures=True)   # quick once the transfers are killed
        progress.stop()
    if failures:
        raise SyncError(failures[0])


def explain(f: FilePlan, t: Transfer, status: str, derr: str, serr: str, src_rc: str, plan: SyncPlan,
            path: DataPath, alive, idle: float) -> str:
    src, dst, dst_dir = plan.src, plan.dst, plan.dst_rundir
    where = f"{f.path} ({human_bytes(t.got)} of {human_bytes(f.size - f.offset)} this run)"
    keep = "what arrived is kept in the staging folder; run the same command again to resume"
    if status.startswith("NOSPACE"):   # the receiver's own word, before the sender's broken pipe
        arrived = int(status.split()[1])
        return (f"no space left on {dst.name}:{dst_dir or '?'} while moving {f.path}: {arrived:,} of "
                f"{f.size:,} bytes arrived (kept in the staging folder); free space there and run the same "
                f"command again: it resumes")
    sender_rc = t.rcs[0]
    if path.pull is not None:  # the sender's leg as the eval host's client saw it
        lines = derr.splitlines()
        serr = "\n".join(ln[5:] for ln in lines if ln.startswith("PULL "))
        sender_rc = next((int(ln.split()[1]) for ln in lines if re.fullmatch(r"PULLRC -?\d+", ln)), None)
        derr = "\n".join(ln for ln in lines if not ln.startswith(("PULL ", "PULLRC ")))
    if status.startswith("CHANGED") or tool_error(serr, "").startswith("CHANGED "):
        return f.changed(src.name)
    if 255 in (t.rcs[1], sender_rc) and not t.killed_for:     # ssh's own exit: was it its master going?
        settle = time.monotonic() + MASTER_EXIT_GRACE
        for m in (path.dst, path.src):
            if m is not None:
                m.ended(settle - time.monotonic())
    dead = alive[0] * alive[1]
    for host, err, m in ((dst, derr, path.dst), (src, serr, path.src)):
        text = (err + "\n" + (m.error_tail() if m is not None and not m.alive else "")).strip()
        low = text.lower()
        via = " (through the tunnel from the eval host)" if host is src and path.mode == "tunnel" else ""
        if "host key verification failed" in low:
            if m is not None:
                ep = m.endpoint
                return f"{ep.where}: host key verification failed (known_hosts {ep.known_hosts_file})"
            return f"host {host.name}: host key verification failed{via}"
        if "not responding" in low or "timed out" in low or "connection reset" in low:
            return (f"lost the connection to host {host.name} ({host.address}:{host.port}){via} while "
                    f"moving {where}: no answer for ~{dead}s; {keep}")
        if any(w in low for w in ("connection refused", "no route", "could not resolve",
                                  "network is unreachable", "permission denied")):
            return f"cannot reach host {host.name} ({host.address}:{host.port}){via}: {text.splitlines()[-1]}"
    for host, m in ((dst, path.dst), (src, path.src)):
        if m is not None and not m.alive and not t.killed_for:
            tail = m.error_tail() or "connection closed"
            return (f"lost the connection to host {host.name} ({host.address}:{host.port}) while moving {where} "
                    f"(ssh: {tail}); {keep}")
    for host, rc, err, ssh_used in ((dst, t.rcs[1], derr, not dst.is_local),
                                    (src, sender_rc, serr, path.pull is not None or
                                     (t.src_argv is not None and not src.is_local))):
        if ssh_used and rc == 255 and not t.killed_for:  # ssh itself failed, or says nothing: the command was killed
            via = " (through the tunnel from the eval host)" if host is src and path.mode == "tunnel" else ""
            if not err.strip():
                return (f"the {'sender' if host is src else 'receiver'} on host {host.name}{via} was killed "
                        f"(ended by a signal) while moving {where}; {keep}")
            return (f"lost the connection to host {host.name} ({host.address}:{host.port}){via} while "
                    f"moving {where} (ssh: {err.strip().splitlines()[-1]}); {keep}")
    if t.killed_for:
        return f"stopped moving {where}: {t.killed_for}; {keep}"
    if status.startswith("IDLE"):  # the receiver waited: the sender's end of the stream went silent
        via = f" through the tunnel from {dst.name}" if path.mode == "tunnel" else \
            f" to {dst.name}" if path.pull is not None else ""
        return (f"no data came from host {src.name}{via} for {idle:g}s while moving {where}: is its sender "
                f"stopped, or the link stalled? {keep}")
    if status.startswith("LOST"):
        return f"host {dst.name}: this sync lost the checkpoint lock while moving {where}"
    if status.startswith("BAD"):
        return f"{f.path}: sha256 mismatch again after re-sending from zero ({status}); the source may be changing"
    if status.startswith("SHORT") or not status:
        ended = (f"the stream from {src.name} ended early: {dst.name}'s connection to it closed (is {src.name} "
                 f"stopped or unreachable from {dst.name}?)" if path.pull is not None
                 else f"the stream from {src.name} ended early (its sender's exit status {src_rc})")
        why = tool_error(serr, "") or tool_error(derr, "") or ended
        return f"moving {where} failed: {why}; {keep}"
    return f"moving {where} failed: {status} {tool_error(derr, '')}"
