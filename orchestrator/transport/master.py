"""OpenSSH master connections: one per host per sync, which every data-path OpenSSH client rides
(ControlMaster), so a file costs a session on an open connection, not a connection of its own
(TCP, key exchange, authentication, sshd's fork and re-exec). A client riding the master hands it
its stdin/stdout, and the master moves the bytes itself.

The socket lives in a private folder (0700) with a short path (Unix sockets allow ~100 bytes).
The master lives exactly as long as this process feeds it: its own session runs ``cat`` on the
host with our pipe as stdin, so when this process ends, however it ends (SIGKILL included), that
session ends and the master exits once its last channel closes; nothing like a ControlPersist
daemon outlives a sync. :meth:`Master.close` ends it at once.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

from .endpoint import SSHEndpoint
from .errors import HostKeyError, TransportError
from .local import end_process

SOCKET_ROOM = 90  # longest folder path for the socket (sun_path holds 104-108 bytes)


PREFIX = "dflash-m-"


def _socket_base() -> str:
    base = tempfile.gettempdir()
    return "/tmp" if len(base) > SOCKET_ROOM - 20 and os.path.isdir("/tmp") else base


def _sweep(base: str) -> None:
    """Remove master folders of this user whose process is gone (killed with SIGKILL: the master
    itself exited once its session ended, its folder stayed)."""
    try:
        names = [n for n in os.listdir(base) if n.startswith(PREFIX)]
    except OSError:
        return
    for n in names:
        d = os.path.join(base, n)
        try:
            if os.lstat(d).st_uid != os.getuid():
                continue
            with open(os.path.join(d, "pid")) as f:
                os.kill(int(f.read()), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (OSError, ValueError):
            continue


class Master:
    """An OpenSSH master connection to ``endpoint``, started at once in the background and pinned
    to ``pins`` (known_hosts lines of the keys the control connection accepted:
    :meth:`SSHRunner.pin_lines`), as is every client that rides it; :meth:`ready` waits until it
    is authenticated."""

    def __init__(self, endpoint: SSHEndpoint, pins: str, extra: tuple[str, ...] = ()):
        base = _socket_base()
        _sweep(base)
        self.dir = tempfile.mkdtemp(prefix=PREFIX, dir=base)  # 0700
        with open(os.path.join(self.dir, "pid"), "w") as f:
            f.write(str(os.getpid()))
        known = os.path.join(self.dir, "known_hosts")
        with open(known, "w") as f:
            f.write(pins)
        self.endpoint, self.extra = endpoint.pinned_to(known), extra
        self.control = os.path.join(self.dir, "c")
        self.log = os.path.join(self.dir, "log")
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(self.endpoint.master_argv(self.control, extra), stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        self._ready = False

    def argv(self, remote: list[str], extra: tuple[str, ...] | None = None) -> list[str]:
        """An OpenSSH client running ``remote`` on the host over this master."""
        return self.endpoint.argv(remote, self.extra if extra is None else extra, control=self.control)

    def ready(self, timeout: float) -> "Master":
        """Wait until the master is authenticated (its socket appears: OpenSSH opens it only then);
        one line naming the host if it fails."""
        deadline = time.monotonic() + timeout
        while not self._ready:
            if os.path.exists(self.control):
                self._ready = True
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise self.failure()
            time.sleep(0.01)
        return self

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def ended(self, within: float) -> bool:
        """Has the master exited, waiting up to ``within`` seconds for it? A master that gives up on a
        dead link closes its clients' sessions first: a client can end (ssh's 255, nothing said) a
        moment before the master's own process does."""
        try:
            self.proc.wait(timeout=max(0.0, within))
        except subprocess.TimeoutExpired:
            return False
        return True

    def error_tail(self) -> str:
        try:
            with open(self.log, "rb") as f:
                lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return lines[-1] if lines else ""

    def failure(self) -> TransportError:
        ep, tail = self.endpoint, self.error_tail()
        if "host key verification failed" in tail.lower() or "REMOTE HOST IDENTIFICATION HAS CHANGED" in tail:
            return HostKeyError(f"{ep.where}: host key verification failed (known_hosts {ep.known_hosts_file})")
        why = tail or ("no connection in time" if self.alive else f"ssh exited {self.proc.returncode}")
        return TransportError(f"{ep.where}: the OpenSSH connection for the data path failed: {why}")

    def forward(self, spec: str, timeout: float = 30) -> None:
        """Add the remote forward ``-R spec`` to this connection (the host listens, this machine
        connects); one line if the host refuses it."""
        res = subprocess.run(["ssh", *self.endpoint.options(self.extra, control=self.control), "-O", "forward",
                              "-R", spec, "--", self.endpoint.address], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            tail = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
            raise TransportError(f"{self.endpoint.where} refused to forward a socket to this machine: {tail}")

    def close(self) -> None:
        """End the master now (its sessions end with it) and remove its folder."""
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass
        end_process(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)
