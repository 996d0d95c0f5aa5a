"""Commands and small files over SSH: :class:`SSHRunner`, the control connection to one
endpoint (transport/endpoint.py), on Fabric's ``Connection`` (gateway per jump hop, put/get).

Commands run on session channels this module opens itself: the exact argv from
:func:`command_line`, a 16 MiB window (REFERENCE §5), output drained before the exit status is
read (paramiko deadlocks otherwise), a host-side ``timeout`` plus a local deadline, and every
failure turned into one :class:`TransportError` line naming the host.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import disk_error
from .endpoint import CONNECT_TIMEOUT, SSHEndpoint, endpoint_for
from .errors import CommandTimeout, TransportError
from .runner import KILL_GRACE, ExecHandle, Result, Runner, as_bytes, command_line, decode

if TYPE_CHECKING:  # pragma: no cover
    import paramiko

    from ..config.inventory import Host, Inventory

CONNECT_RETRIES = 2
WINDOW_SIZE = 16 << 20  # REFERENCE §5: big windows keep relays fast
EXIT_QUIET = 2.0        # s without output, after the exit status, that ends a command's output without its EOF

logging.getLogger("paramiko").addHandler(logging.NullHandler())


class _SSHHandle(ExecHandle):
    def __init__(self, chan: "paramiko.Channel"):
        self.chan = chan
        self.stdin = chan.makefile_stdin("wb")
        self.stdout = chan.makefile("rb")
        self.stderr = chan.makefile_stderr("rb")

    def wait(self, timeout: float | None = None) -> int:
        if timeout is not None and not self.chan.status_event.wait(timeout):
            raise CommandTimeout("remote command did not finish in time")
        return self.chan.recv_exit_status()

    def kill(self) -> None:
        self.chan.close()

    def close(self) -> None:
        super().close()
        self.chan.close()


class SSHRunner(Runner):
    """Runs commands over SSH on one endpoint (a Host is resolved with :func:`endpoint_for`)."""

    def __init__(self, endpoint: "SSHEndpoint | Host", inventory: "Inventory | None" = None, *,
                 connect_timeout: float = CONNECT_TIMEOUT, retries: int = CONNECT_RETRIES):
        self.endpoint = endpoint if isinstance(endpoint, SSHEndpoint) else endpoint_for(endpoint, inventory)
        self.name = self.endpoint.name
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.jump = (SSHRunner(self.endpoint.jump, connect_timeout=connect_timeout, retries=retries)
                     if self.endpoint.jump is not None else None)
        self._conn = None   # fabric.Connection, open
        self._lock = threading.Lock()
        self._sftp_lock = threading.Lock()     # one SFTP transfer at a time: the connection has one SFTP client
        self.host_key = None   # the key the open connection accepted (paramiko PKey)
        self._home: str | None = None

    # connection ---------------------------------------------------------------------------

    def _where(self) -> str:
        return self.endpoint.where

    def _connect_once(self):
        import paramiko

        gateway = self.jump.connection() if self.jump is not None else None
        conn = self.endpoint.connection(self.connect_timeout, gateway=gateway)
        try:
            conn.open()
        except paramiko.ChannelException as e:
            conn.close()
            raise TransportError(f"{self._where()}: jump host {self.jump.name if self.jump else '?'} could not "
                                 f"open a connection: {e.args[-1] if e.args else e}") from None
        except BaseException:
            conn.close()
            raise
        self.host_key = conn.transport.get_remote_server_key()
        return conn

    def connection(self):
        """The open Fabric ``Connection`` (connecting, with retries, on first use)."""
        with self._lock:
            if self._conn is None or not self._conn.is_connected:
                self._conn = self._connect_with_retries()
            return self._conn

    def _connect_with_retries(self):
        import paramiko

        t = self.connect_timeout
        last: str = ""
        for attempt in range(self.retries + 1):
            started = time.monotonic()
            try:
                return self._connect_once()
            except TransportError:
                raise
            except paramiko.AuthenticationException as e:
                raise self._auth_failed(isinstance(e, paramiko.PasswordRequiredException)) from None
            except (socket.timeout, TimeoutError):
                raise TransportError(f"{self._where()}: connection timed out after {t:g}s") from None
            except paramiko.ssh_exception.NoValidConnectionsError as e:
                codes = {getattr(x, "errno", None) for x in e.errors.values()}
                if errno.EHOSTUNREACH in codes and errno.ECONNREFUSED not in codes:
                    raise TransportError(f"{self._where()}: no route to host") from None
                last = "connection refused" if errno.ECONNREFUSED in codes else str(e)
            except socket.gaierror as e:
                raise TransportError(f"{self._where()}: cannot resolve address: {e.strerror}") from None
            except OSError as e:
                if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
                    raise TransportError(f"{self._where()}: {e.strerror.lower()}") from None
                last = e.strerror or str(e)
            except (paramiko.SSHException, EOFError) as e:
                msg = str(e)
                if msg == "No authentication methods available":  # no key could be loaded at all
                    raise self._auth_failed(False) from None
                # a server that never speaks SSH: paramiko reports the banner timeout, or (when the
                # banner wait races the auth step under load) "No existing session"
                if time.monotonic() - started >= 0.9 * t and ("banner" in msg.lower() or "session" in msg.lower()
                                                              or isinstance(e, EOFError)):
                    raise TransportError(f"{self._where()}: timed out waiting for the SSH banner after {t:g}s") from None
                last = msg or type(e).__name__
            if attempt < self.retries:
                time.sleep(0.5 * 2 ** attempt)
        raise TransportError(f"{self._where()}: {last} (after {self.retries + 1} attempts)")

    def _auth_failed(self, passphrase: bool) -> TransportError:
        """The login was refused: the cause where it is on this side (a missing or locked key)."""
        keys = ", ".join(self.endpoint.identities) or "(agent/default keys)"
        missing = [k for k in self.endpoint.identities if not os.path.exists(k)]
        why = (f": identity file {', '.join(missing)} does not exist" if missing else
               ": the identity is protected by a passphrase; add it to ssh-agent (ssh-add FILE) first"
               if passphrase else "")
        return TransportError(f"{self._where()}: authentication failed as user {self.endpoint.user or '(default)'}"
                              f" with identity {keys}{why}")

    def connect(self) -> "SSHRunner":
        self.connection()
        return self

    def home(self) -> str:
        if self._home is None:
            res = self.run(["sh", "-c", 'printf %s "$HOME"'], timeout=30)
            if not res.ok or not res.stdout.startswith("/"):
                raise TransportError(f"{self._where()}: cannot tell the login user's home directory (for '~' in "
                                     f"the inventory or catalog): {res.stderr.strip() or res.stdout.strip()}")
            self._home = res.stdout
        return self._home

    def pin_lines(self) -> str:
        """known_hosts lines of the keys this connection and its jump hops accepted (connecting
        first if needed): what the data path is pinned to (:meth:`SSHEndpoint.pinned_to`)."""
        self.connection()
        key = self.host_key
        line = f"{self.endpoint.known_hosts_name} {key.get_name()} {key.get_base64()}\n"
        return (self.jump.pin_lines() if self.jump is not None else "") + line

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.close()
                except Exception:
                    pass
                self._conn = None
        if self.jump is not None:
            self.jump.close()

    def _open_channel(self) -> "paramiko.Channel":
        transport = self.connection().transport
        try:
            return transport.open_session(window_size=WINDOW_SIZE, timeout=self.connect_timeout)
        except Exception as e:
            raise TransportError(f"{self._where()}: cannot open a session: {e}") from None

    # commands -----------------------------------------------------------------------------

    def run(self, argv, *, timeout=60, check=False, input=None, env=None, cwd=None) -> Result:
        line = command_line(argv, env=env, cwd=cwd, timeout=timeout)
        chan = self._open_channel()
        try:
            chan.exec_command(line)
            writer = None
            data = as_bytes(input)
            if data:
                def feed():
                    try:
                        chan.sendall(data)
                    except OSError:
                        pass
                    finally:
                        chan.shutdown_write()
                writer = threading.Thread(target=feed, daemon=True)
                writer.start()
            else:
                chan.shutdown_write()
            out, err, elapsed = self._drain(chan, timeout, argv)
            rc = chan.recv_exit_status()
            if writer is not None:
                writer.join(1)
        finally:
            chan.close()
        if timeout is not None and rc == 124 and elapsed >= timeout * 0.9:
            raise CommandTimeout(f"host {self.name}: {argv[0]} timed out after {timeout:g}s")
        return self._finish(argv, Result(rc, decode(out), decode(err)), check)

    def _drain(self, chan: "paramiko.Channel", timeout: float | None, argv) -> tuple[bytes, bytes, float]:
        """Read stdout and stderr until exit (never recv_exit_status() first: it deadlocks)."""
        import select

        start = time.monotonic()
        deadline = None if timeout is None else start + timeout + KILL_GRACE + 5
        out, err = bytearray(), bytearray()
        last_data, exit_seen = start, None
        while True:
            select.select([chan], [], [], 0.2)
            while chan.recv_ready():
                out += chan.recv(1 << 20)
                last_data = time.monotonic()
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(1 << 20)
                last_data = time.monotonic()
            # sshd sends the exit status when the process exits, and output it has not sent yet comes
            # after it: read on to the end of the output (EOF), or, when something the command left
            # running holds the output open, to EXIT_QUIET s without output after the exit status
            if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                exit_seen = exit_seen or time.monotonic()
                if chan.eof_received or time.monotonic() - max(last_data, exit_seen) > EXIT_QUIET:
                    break
            if chan.closed and not chan.recv_ready() and not chan.recv_stderr_ready():
                break
            if deadline is not None and time.monotonic() > deadline:
                chan.close()
                raise CommandTimeout(f"host {self.name}: {argv[0]} timed out after {timeout:g}s "
                                     f"(the host did not stop it)")
        return bytes(out), bytes(err), time.monotonic() - start

    def open_exec(self, argv, *, env=None, cwd=None) -> ExecHandle:
        chan = self._open_channel()
        chan.exec_command(command_line(argv, env=env, cwd=cwd))
        return _SSHHandle(chan)

    # files (SFTP, through Fabric's put/get) -------------------------------------------------

    @staticmethod
    def _rpath(remote: str) -> str:
        # SFTP starts in the login directory; "~/x" means "x" there.
        if remote == "~":
            return "."
        return remote[2:] if remote.startswith("~/") else remote

    def _mkparent(self, remote: str) -> None:
        parent = os.path.dirname(self._rpath(remote))
        if parent and parent not in (".", "/"):
            self.run(["mkdir", "-p", "--", parent], timeout=30, check=True)

    def put_file(self, local, remote) -> None:
        self._mkparent(remote)
        self._sftp_call("upload", remote, lambda c: c.put(str(local), self._rpath(remote), preserve_mode=False))

    def get_file(self, remote, local) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        self._sftp_call("download", remote, lambda c: c.get(self._rpath(remote), str(local), preserve_mode=False))

    def get_tail(self, remote, local, limit) -> int:
        Path(local).parent.mkdir(parents=True, exist_ok=True)

        def get(c):
            with c.sftp().open(self._rpath(remote), "rb") as f, open(local, "wb") as dst:
                size = f.stat().st_size
                f.seek(max(0, size - limit))
                f.prefetch(size)
                while True:
                    data = f.read(1 << 20)
                    if not data:
                        return size
                    dst.write(data)
        return self._sftp_call("download", remote, get)

    def put_text(self, text, remote) -> None:
        self._mkparent(remote)

        def write(c):
            with c.sftp().open(self._rpath(remote), "wb") as f:
                f.write(text.encode())
        self._sftp_call("write", remote, write)

    def read_text(self, remote) -> str:
        def read(c):
            with c.sftp().open(self._rpath(remote), "rb") as f:
                return decode(f.read())
        return self._sftp_call("read", remote, read)

    def _sftp_call(self, what: str, remote: str, fn) -> Any:
        """``fn(connection)``, one at a time on this runner: paramiko's SFTP client (one per
        connection, Fabric's ``sftp()``) hangs when threads transfer through it at once (the shards
        of a run on one host are fetched side by side)."""
        try:
            with self._sftp_lock:
                return fn(self.connection())
        except FileNotFoundError:
            raise TransportError(f"host {self.name}: no such file: {remote}") from None
        except PermissionError:
            raise TransportError(f"host {self.name}: permission denied: {remote}") from None
        except OSError as e:
            if disk_error(e):       # a download's file here (SFTP reports no such errno of the host)
                raise
            raise TransportError(f"host {self.name}: cannot {what} {remote}: {e}") from None
