"""One way to touch a host: a small runner object (local subprocess or SSH) behind one interface.

Commands are always argv lists. They are turned into a remote shell line in exactly one place,
:func:`command_line` (``shlex.join``); nothing else in dflash-ops builds shell text from input.
"""
from __future__ import annotations

import errno
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import paramiko

    from .inventory import Host, Inventory

CONNECT_TIMEOUT = 10.0
CONNECT_RETRIES = 2
KILL_GRACE = 5.0
WINDOW_SIZE = 16 << 20  # REFERENCE §5: big windows keep relays fast

logging.getLogger("paramiko").addHandler(logging.NullHandler())


class TransportError(Exception):
    """A host could not be reached or a command could not be run; message is user-facing."""


class HostKeyError(TransportError):
    """The host's key is unknown or does not match known_hosts."""


class CommandTimeout(TransportError):
    """A command ran past its timeout and was killed."""


class CommandFailed(TransportError):
    def __init__(self, message: str, result: "Result"):
        super().__init__(message)
        self.result = result


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def command_line(argv: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                 timeout: float | None = None) -> str:
    """The single place where argv becomes shell text (for the remote login shell)."""
    if isinstance(argv, (str, bytes)) or not argv:
        raise TypeError("argv must be a non-empty list of strings")
    words = [str(a) for a in argv]
    if env:
        for key in env:
            if not key.replace("_", "a").isalnum() or key[0].isdigit():
                raise ValueError(f"bad environment variable name {key!r}")
        words = ["env", *(f"{k}={v}" for k, v in env.items()), *words]
    if timeout is not None:
        # GNU timeout kills the whole process group of the command on the host itself.
        words = ["timeout", "-k", f"{KILL_GRACE:g}", f"{max(timeout, 0.1):g}", *words]
    line = shlex.join(words)
    if cwd:
        line = f"cd -- {shlex.quote(cwd)} && exec {line}"
    return line


def _as_bytes(data: str | bytes | None) -> bytes | None:
    if data is None:
        return None
    return data.encode() if isinstance(data, str) else data


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


class ExecHandle(ABC):
    """A running command with file-like ``stdin`` (writable) and ``stdout``/``stderr`` (readable)."""

    stdin: IO[bytes]
    stdout: IO[bytes]
    stderr: IO[bytes]

    @abstractmethod
    def wait(self, timeout: float | None = None) -> int: ...

    @abstractmethod
    def kill(self) -> None: ...

    def close(self) -> None:
        for f in (self.stdin, self.stdout, self.stderr):
            try:
                f.close()
            except Exception:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Runner(ABC):
    """Run commands and move small files on one host."""

    name: str = "?"

    @abstractmethod
    def run(self, argv: list[str], *, timeout: float | None = 60, check: bool = False,
            input: str | bytes | None = None, env: dict[str, str] | None = None,
            cwd: str | None = None) -> Result: ...

    def run_script(self, script: str, *, timeout: float | None = 60, check: bool = False,
                   env: dict[str, str] | None = None, cwd: str | None = None) -> Result:
        """Run a trusted bash script composed in code (fed on stdin, never interpolated)."""
        return self.run(["bash", "-s"], timeout=timeout, check=check, input=script, env=env, cwd=cwd)

    @abstractmethod
    def open_exec(self, argv: list[str], *, env: dict[str, str] | None = None,
                  cwd: str | None = None) -> ExecHandle: ...

    @abstractmethod
    def put_file(self, local: str | os.PathLike, remote: str) -> None: ...

    @abstractmethod
    def get_file(self, remote: str, local: str | os.PathLike) -> None: ...

    @abstractmethod
    def put_text(self, text: str, remote: str) -> None: ...

    @abstractmethod
    def read_text(self, remote: str) -> str: ...

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _finish(self, argv: list[str], result: Result, check: bool) -> Result:
        if check and not result.ok:
            tail = result.stderr.strip().splitlines()[-1:] or [""]
            raise CommandFailed(
                f"host {self.name}: {shlex.join(argv[:3])}{' …' if len(argv) > 3 else ''} "
                f"exited {result.returncode}: {tail[0]}", result)
        return result


# --- local ---------------------------------------------------------------------------------


class _LocalHandle(ExecHandle):
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.stdin, self.stdout, self.stderr = proc.stdin, proc.stdout, proc.stderr

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class LocalRunner(Runner):
    """Runs argv as a local subprocess (no shell). Used for the built-in ``local`` host."""

    def __init__(self, name: str = "local"):
        self.name = name

    @staticmethod
    def _env(env: dict[str, str] | None) -> dict[str, str] | None:
        return {**os.environ, **env} if env else None

    def run(self, argv, *, timeout=60, check=False, input=None, env=None, cwd=None) -> Result:
        if isinstance(argv, (str, bytes)):
            raise TypeError("argv must be a list of strings")
        try:
            proc = subprocess.Popen(
                [str(a) for a in argv], stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self._env(env), cwd=cwd,
                start_new_session=True)
        except FileNotFoundError as e:
            return self._finish(argv, Result(127, "", f"{e.filename}: command not found\n"), check)
        except OSError as e:
            return self._finish(argv, Result(126, "", f"{e}\n"), check)
        try:
            out, err = proc.communicate(_as_bytes(input), timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            raise CommandTimeout(f"host {self.name}: {argv[0]} timed out after {timeout:g}s") from None
        return self._finish(argv, Result(proc.returncode, _decode(out), _decode(err)), check)

    def open_exec(self, argv, *, env=None, cwd=None) -> ExecHandle:
        proc = subprocess.Popen([str(a) for a in argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=self._env(env), cwd=cwd,
                                start_new_session=True)
        return _LocalHandle(proc)

    @staticmethod
    def _path(p: str | os.PathLike) -> Path:
        return Path(p).expanduser()

    def put_file(self, local, remote) -> None:
        dst = self._path(remote)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, dst)

    def get_file(self, remote, local) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(self._path(remote), local)
        except FileNotFoundError:
            raise TransportError(f"host {self.name}: no such file: {remote}") from None

    def put_text(self, text, remote) -> None:
        dst = self._path(remote)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(text)

    def read_text(self, remote) -> str:
        try:
            return self._path(remote).read_text()
        except FileNotFoundError:
            raise TransportError(f"host {self.name}: no such file: {remote}") from None


# --- ssh -----------------------------------------------------------------------------------


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


def _parse_endpoint(spec: str, default_user: str | None) -> tuple[str | None, str, int]:
    user = default_user
    if "@" in spec:
        user, spec = spec.rsplit("@", 1)
    port = 22
    if spec.startswith("["):
        addr, _, rest = spec[1:].partition("]")
        if rest.startswith(":"):
            port = int(rest[1:])
    elif spec.count(":") == 1:
        addr, p = spec.split(":")
        port = int(p)
    else:
        addr = spec
    return user, addr, port


class _CheckingPolicy:
    """Missing-key policy: refuse (default) or accept without writing (trust_host_key)."""

    def __init__(self, host: "Host", trust: bool, known_hosts: str):
        self.host, self.trust, self.known_hosts = host, trust, known_hosts

    def missing_host_key(self, client, hostname, key) -> None:
        if self.trust:
            client.get_host_keys().add(hostname, key.get_name(), key)
            return
        port = f"-p {self.host.port} " if self.host.port != 22 else ""
        raise HostKeyError(
            f"host {self.host.name} ({self.host.address}:{self.host.port}): unknown host key "
            f"({key.get_name()} {key.fingerprint}) not in {self.known_hosts}; to trust it run "
            f"`ssh-keyscan {port}{self.host.address} >> {self.known_hosts}` (check the fingerprint "
            f"first) or set `trust_host_key: true` for host {self.host.name} in the inventory")


class SSHRunner(Runner):
    """Runs commands over SSH with paramiko, verifying host keys against known_hosts."""

    def __init__(self, host: "Host", *, jump: "SSHRunner | None" = None,
                 connect_timeout: float = CONNECT_TIMEOUT, retries: int = CONNECT_RETRIES):
        self.host = host
        self.name = host.name
        self.jump = jump
        self.connect_timeout = connect_timeout
        self.retries = retries
        self._client: "paramiko.SSHClient | None" = None
        self._sftp = None
        self._lock = threading.Lock()

    # connection ---------------------------------------------------------------------------

    @property
    def known_hosts(self) -> str:
        return str(Path(self.host.known_hosts or "~/.ssh/known_hosts").expanduser())

    def _where(self) -> str:
        return f"host {self.host.name} ({self.host.address}:{self.host.port})"

    def _connect_once(self) -> "paramiko.SSHClient":
        import paramiko

        client = paramiko.SSHClient()
        if os.path.exists(self.known_hosts):
            try:
                client.load_system_host_keys(self.known_hosts)  # read-only: never written back
            except Exception as e:
                raise TransportError(f"{self._where()}: cannot read known_hosts {self.known_hosts}: {e}")
        client.set_missing_host_key_policy(_CheckingPolicy(self.host, self.host.trust_host_key, self.known_hosts))
        sock = None
        if self.jump is not None:
            try:
                transport = self.jump.client().get_transport()
                sock = transport.open_channel("direct-tcpip", (self.host.address, self.host.port),
                                              ("127.0.0.1", 0), timeout=self.connect_timeout)
            except paramiko.ChannelException as e:
                client.close()
                raise TransportError(f"{self._where()}: jump host {self.jump.name} could not open a "
                                     f"connection: {e.args[-1] if e.args else e}") from None
        identity = str(Path(self.host.identity).expanduser()) if self.host.identity else None
        try:
            client.connect(
                self.host.address, port=self.host.port, username=self.host.user,
                key_filename=identity, look_for_keys=identity is None, allow_agent=identity is None,
                timeout=self.connect_timeout, banner_timeout=self.connect_timeout,
                auth_timeout=self.connect_timeout, channel_timeout=self.connect_timeout, sock=sock)
        except BaseException:
            client.close()
            raise
        return client

    def client(self) -> "paramiko.SSHClient":
        with self._lock:
            if self._client is not None and self._client.get_transport() and self._client.get_transport().is_active():
                return self._client
            self._client = self._connect_with_retries()
            return self._client

    def _connect_with_retries(self) -> "paramiko.SSHClient":
        import paramiko

        t = self.connect_timeout
        last: str = ""
        for attempt in range(self.retries + 1):
            started = time.monotonic()
            try:
                return self._connect_once()
            except TransportError:
                raise
            except paramiko.BadHostKeyException as e:
                raise HostKeyError(
                    f"{self._where()}: HOST KEY MISMATCH: the server offered {e.key.get_name()} "
                    f"{e.key.fingerprint} but {self.known_hosts} has a different key; this may be an "
                    f"attack. If the host was reinstalled, remove its old line "
                    f"(`ssh-keygen -R ...` -f {self.known_hosts}) and re-add it") from None
            except paramiko.AuthenticationException:
                raise TransportError(
                    f"{self._where()}: authentication failed as user {self.host.user or '(default)'}"
                    f" with identity {self.host.identity or '(agent/default keys)'}") from None
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
                # a server that never speaks SSH: paramiko reports the banner timeout, or (when the
                # banner wait races the auth step under load) "No existing session"
                if time.monotonic() - started >= 0.9 * t and ("banner" in msg.lower() or "session" in msg.lower()
                                                              or isinstance(e, EOFError)):
                    raise TransportError(f"{self._where()}: timed out waiting for the SSH banner after {t:g}s") from None
                last = msg or type(e).__name__
            if attempt < self.retries:
                time.sleep(0.5 * 2 ** attempt)
        raise TransportError(f"{self._where()}: {last} (after {self.retries + 1} attempts)")

    def connect(self) -> "SSHRunner":
        self.client()
        return self

    def close(self) -> None:
        with self._lock:
            if self._sftp is not None:
                try:
                    self._sftp.close()
                except Exception:
                    pass
                self._sftp = None
            if self._client is not None:
                self._client.close()
                self._client = None
        if self.jump is not None:
            self.jump.close()

    def _open_channel(self) -> "paramiko.Channel":
        transport = self.client().get_transport()
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
            data = _as_bytes(input)
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
        return self._finish(argv, Result(rc, _decode(out), _decode(err)), check)

    def _drain(self, chan: "paramiko.Channel", timeout: float | None, argv) -> tuple[bytes, bytes, float]:
        """Read stdout and stderr until exit (never recv_exit_status() first: it deadlocks)."""
        import select

        start = time.monotonic()
        deadline = None if timeout is None else start + timeout + KILL_GRACE + 5
        out, err = bytearray(), bytearray()
        while True:
            select.select([chan], [], [], 0.2)
            while chan.recv_ready():
                out += chan.recv(1 << 20)
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(1 << 20)
            if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
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

    # files --------------------------------------------------------------------------------

    def sftp(self) -> "paramiko.SFTPClient":
        if self._sftp is None:
            self._sftp = self.client().open_sftp()
        return self._sftp

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
        self._sftp_call("upload", remote, lambda s: s.put(str(local), self._rpath(remote)))

    def get_file(self, remote, local) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        self._sftp_call("download", remote, lambda s: s.get(self._rpath(remote), str(local)))

    def put_text(self, text, remote) -> None:
        self._mkparent(remote)

        def write(s):
            with s.open(self._rpath(remote), "wb") as f:
                f.write(text.encode())
        self._sftp_call("write", remote, write)

    def read_text(self, remote) -> str:
        def read(s):
            with s.open(self._rpath(remote), "rb") as f:
                return _decode(f.read())
        return self._sftp_call("read", remote, read)

    def _sftp_call(self, what: str, remote: str, fn) -> Any:
        try:
            return fn(self.sftp())
        except FileNotFoundError:
            raise TransportError(f"host {self.name}: no such file: {remote}") from None
        except PermissionError:
            raise TransportError(f"host {self.name}: permission denied: {remote}") from None
        except OSError as e:
            raise TransportError(f"host {self.name}: cannot {what} {remote}: {e}") from None


# --- factory -------------------------------------------------------------------------------


def runner_for(host: "Host", inventory: "Inventory | None" = None, *,
               connect_timeout: float = CONNECT_TIMEOUT, retries: int = CONNECT_RETRIES) -> Runner:
    """The runner for a host. ``jump`` may name another inventory host or be ``[user@]addr[:port]``."""
    if host.is_local:
        return LocalRunner(host.name)
    jump = None
    if host.jump:
        if inventory is not None and host.jump in inventory.hosts:
            jhost = inventory.get(host.jump)
        else:
            from dataclasses import replace

            user, addr, port = _parse_endpoint(host.jump, host.user)
            jhost = replace(host, name=f"{host.name}-jump", address=addr, port=port, user=user,
                            jump=None, ssh_config=None)
        if jhost.is_local or jhost.name == host.name:
            raise TransportError(f"host {host.name}: jump host {host.jump!r} is not an SSH host")
        jump = runner_for(jhost, inventory, connect_timeout=connect_timeout, retries=retries)
    return SSHRunner(host, jump=jump, connect_timeout=connect_timeout, retries=retries)
