"""The built-in ``local`` host: argv as local subprocesses (no shell), files by copy."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

from .errors import CommandTimeout, TransportError
from .runner import ExecHandle, Result, Runner, as_bytes, decode


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


def end_process(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM a child still running, SIGKILL it after ``grace`` seconds, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class LocalRunner(Runner):
    """Runs argv as a local subprocess (no shell). Used for the built-in ``local`` host."""

    def __init__(self, name: str = "local"):
        self.name = name

    def absolute(self, path: str) -> str:
        return os.path.abspath(self.expand_home(path))

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
            out, err = proc.communicate(as_bytes(input), timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            raise CommandTimeout(f"host {self.name}: {argv[0]} timed out after {timeout:g}s") from None
        return self._finish(argv, Result(proc.returncode, decode(out), decode(err)), check)

    def open_exec(self, argv, *, env=None, cwd=None) -> ExecHandle:
        proc = subprocess.Popen([str(a) for a in argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=self._env(env), cwd=cwd,
                                start_new_session=True)
        return _LocalHandle(proc)

    @staticmethod
    def _path(p: str | os.PathLike) -> Path:
        return Path(p).expanduser()

    def home(self) -> str:
        return os.path.expanduser("~")

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

    def get_tail(self, remote, local, limit) -> int:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(self._path(remote), "rb") as src, open(local, "wb") as dst:
                size = os.fstat(src.fileno()).st_size
                src.seek(max(0, size - limit))
                shutil.copyfileobj(src, dst)
        except FileNotFoundError:
            raise TransportError(f"host {self.name}: no such file: {remote}") from None
        return size

    def put_text(self, text, remote) -> None:
        dst = self._path(remote)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(text)

    def read_text(self, remote) -> str:
        try:
            return decode(self._path(remote).read_bytes())
        except FileNotFoundError:
            raise TransportError(f"host {self.name}: no such file: {remote}") from None
