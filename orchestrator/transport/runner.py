"""The one interface to a host: run argv (never shell text), stream a command, move small files.

Commands are argv lists. They become a remote shell line in exactly one place,
:func:`command_line` (``shlex.join``); nothing else in dflash-ops builds shell text from input.
"""
from __future__ import annotations

import os
import posixpath
import shlex
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import IO

from .errors import CommandFailed

KILL_GRACE = 5.0


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


def authorized_keys_command(argv: list[str]) -> str:
    """The ``command="..."`` option of an authorized_keys line forcing ``argv``: its shell text
    (:func:`command_line`) with every ``"`` escaped as sshd reads the option (``\\"``; any other
    backslash stays as it is). A line break cannot be part of an authorized_keys line."""
    line = command_line(argv)
    if any(c in line for c in "\r\n\0"):
        raise ValueError("a forced command cannot hold a line break")
    return 'command="' + line.replace('"', '\\"') + '"'


def as_bytes(data: str | bytes | None) -> bytes | None:
    if data is None:
        return None
    return data.encode() if isinstance(data, str) else data


def decode(data: bytes) -> str:
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

    def get_tail(self, remote: str, local: str | os.PathLike, limit: int) -> int:
        """The last ``limit`` bytes of ``remote`` (all of it when shorter) into ``local``; returns
        the remote file's whole size. (Here: the whole file comes and is cut; SSH and local read
        only the tail.)"""
        self.get_file(remote, local)
        size = os.path.getsize(local)
        if size > limit:
            with open(local, "r+b") as f:
                f.seek(size - limit)
                tail = f.read()
                f.seek(0)
                f.write(tail)
                f.truncate()
        return size

    @abstractmethod
    def put_text(self, text: str, remote: str) -> None: ...

    @abstractmethod
    def read_text(self, remote: str) -> str: ...

    def connect(self) -> "Runner":
        """Open the connection now (a no-op where there is none)."""
        return self

    @abstractmethod
    def home(self) -> str:
        """The login user's home directory on the host."""

    def expand_home(self, path: str | None) -> str | None:
        """``~`` and ``~/...`` as a shell on the host expands them (other paths unchanged), so a
        path from the inventory or catalog can be quoted literally afterwards."""
        if path is None or (path != "~" and not path.startswith("~/")):
            return path
        return self.home().rstrip("/") + path[1:]

    def absolute(self, path: str) -> str:
        """``path`` as the host reads it from any folder (a worker runs in its code folder): ``~``
        expanded there; a relative path is taken from the login home (:class:`LocalRunner`: from
        this process's folder, where the user typed it)."""
        path = self.expand_home(path)
        return path if posixpath.isabs(path) else posixpath.join(self.home(), path)

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
