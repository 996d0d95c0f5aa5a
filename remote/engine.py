"""Serving engines run beside our own decoding, the part every engine shares: a server started as a
subprocess in its own process group on a free loopback port (log to a file, ready when its health
URL answers, stopped by SIGTERM to the group then SIGKILL), a JSON-over-HTTP client (stdlib
``urllib``, no proxies), and the Prometheus text format. Stdlib only: the engine runs in its own
environment (it pins its own torch and transformers) and this side only talks HTTP to it. One
module per engine: :mod:`remote.vllm_engine`.

Every failure is an :class:`EngineError` whose message is one line (a log tail, where there is one,
follows on the next lines)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

LOOPBACK = "127.0.0.1"


class EngineError(Exception):
    """An engine is missing, failed to start, refused its settings, died, or answered badly.

    ``kind``: ``not_installed``, ``start_failed``, ``refused``, ``port_taken``, ``start_timeout``,
    ``died``, ``unreachable``, ``http``, ``bad_answer``, ``mismatch``. ``status``: the HTTP status
    for ``http``. ``log_tail``: the server log's last lines, where the server is ours."""

    def __init__(self, message: str, kind: str, status: int | None = None, log_tail: str = ""):
        super().__init__(message + (f"\n{log_tail}" if log_tail else ""))
        self.headline, self.kind, self.status, self.log_tail = message, kind, status, log_tail


# ----------------------------------------------------------------------------- ports and logs

def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on now (the kernel's pick). Another process may still take it
    before the server binds; the server then fails with 'address already in use' (``port_taken``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(port: int, host: str = LOOPBACK) -> None:
    """EngineError(``port_taken``) when something already listens on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            raise EngineError(f"port {port} on {host} is taken: another process listens there "
                              f"(choose another port, or leave it out for a free one)", "port_taken") from None


def log_tail(path: str | Path, lines: int = 25) -> str:
    """The last ``lines`` non-blank lines of a log, progress bars and long lines trimmed."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    rows = [r.split("\r")[-1].rstrip() for r in text.splitlines()]
    rows = [r[:400] for r in rows if r.strip()]
    return "\n".join("  | " + r for r in rows[-lines:])


_ERROR_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")
_GENERIC_ERRORS = ("EngineDeadError", "EngineCore encountered an issue")  # wrappers of an earlier, real cause


def log_error(path: str | Path) -> str | None:
    """The last ``SomeError: message`` line of a log (the reason a server refused to start), or None.
    A pydantic ``N validation error for X`` comes with the line that says which value and why."""
    try:
        lines = Path(path).read_text("utf-8", "replace").splitlines()
    except OSError:
        return None
    found = None
    for i, line in enumerate(lines):
        m = _ERROR_LINE.search(line)
        if not m or (found and any(g in line for g in _GENERIC_ERRORS)):
            continue
        found = f"{m.group(1)}: {m.group(2).strip()}"
        if "validation error" in m.group(2):
            detail = next((row.strip() for row in lines[i + 1:i + 4] if "error," in row), None)
            if detail:
                found += f": {detail.split(' [type=')[0]}"
    return found


# ----------------------------------------------------------------------------- the server process

class ServerProcess:
    """A server started from ``argv`` (never a shell line) in its own session and process group,
    stdout and stderr to ``log_path``. ``stop()`` ends the whole group: SIGTERM, then SIGKILL after
    ``grace`` seconds."""

    def __init__(self, argv: list[str], log_path: str | Path, env: dict | None = None, name: str = "server"):
        self.argv, self.log_path, self.name = [str(a) for a in argv], Path(log_path), name
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            try:
                self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=env, start_new_session=True)
            except OSError as e:
                raise EngineError(f"cannot run {self.argv[0]}: {e.strerror or e}", "not_installed") from None
        self.pid = self.proc.pid
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def tail(self, lines: int = 25) -> str:
        return log_tail(self.log_path, lines)

    def died_error(self, when: str) -> EngineError:
        """The error for a server found dead: its exit status, its own error line and its log tail."""
        code = self.proc.poll()
        status = f"exit code {code}" if code is not None and code >= 0 else f"killed by signal {-(code or 0)}"
        reason = log_error(self.log_path)
        kind = "died" if when == "mid-run" else "start_failed"
        if when != "mid-run" and reason and "address already in use" in reason.lower():
            kind = "port_taken"
        elif when != "mid-run" and reason:
            kind = "refused"
        msg = f"the {self.name} {'died mid-run' if when == 'mid-run' else 'failed to start'} ({status})"
        if reason:
            msg += f": {reason}"
        return EngineError(f"{msg} (log: {self.log_path})", kind, log_tail=self.tail())

    def wait_ready(self, ready, timeout: float, interval: float = 1.0) -> float:
        """Poll ``ready()`` (True when the server answers) until it is, the process dies (the error
        names why, from its log) or ``timeout`` seconds pass (the server is stopped). Returns the
        seconds it took."""
        deadline = self.started + timeout
        while True:
            if not self.alive():
                raise self.died_error("start")
            if ready():
                return time.monotonic() - self.started
            if time.monotonic() > deadline:
                tail = self.tail()
                self.stop()
                raise EngineError(f"the {self.name} did not become ready within {timeout:g}s "
                                  f"(log: {self.log_path})", "start_timeout", log_tail=tail)
            time.sleep(interval)

    def stop(self, grace: float = 20.0) -> int | None:
        """End the server's process group (SIGTERM, then SIGKILL after ``grace`` s); its exit status."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)          # stragglers of the group (engine workers), if any
        try:
            return self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            return None

    def _signal(self, sig) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# ----------------------------------------------------------------------------- HTTP

class HTTPClient:
    """JSON over HTTP to one server (proxies from the environment are not used: the server is on
    this host or behind a tunnel). ``on_failure(error)`` may return a better error for a failed
    request (e.g. 'the server died mid-run', with its log's reason, when the server is ours)."""

    def __init__(self, base_url: str, timeout: float = 600.0, name: str = "server", on_failure=None):
        self.base, self.timeout, self.name, self.on_failure = base_url.rstrip("/"), timeout, name, on_failure
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        timeout = self.timeout if timeout is None else timeout
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            error = EngineError(f"the {self.name} at {self.base} answered HTTP {e.code} to {method} {path}: "
                                f"{_http_message(e)}", "http", status=e.code)
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                error = EngineError(f"the {self.name} at {self.base} did not answer {method} {path} within "
                                    f"{timeout:g}s", "unreachable")
            else:
                error = EngineError(f"the {self.name} at {self.base} is not reachable ({method} {path}): "
                                    f"{reason or type(e).__name__}", "unreachable")
        raise (self.on_failure(error) if self.on_failure is not None else None) or error

    def json(self, method: str, path: str, body: dict | None = None, timeout: float | None = None):
        raw = self.request(method, path, body, timeout)
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise EngineError(f"the {self.name} at {self.base} answered {method} {path} with something that is "
                              f"not JSON: {raw[:200]!r}", "bad_answer") from None

    def ok(self, path: str, timeout: float = 5.0) -> bool:
        """True when ``GET path`` answers 2xx within ``timeout`` (no error raised)."""
        req = urllib.request.Request(self.base + path, method="GET")
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                return 200 <= resp.status < 300
        except (urllib.error.URLError, OSError, ValueError):
            return False


def _http_message(e: urllib.error.HTTPError) -> str:
    try:
        text = e.read().decode("utf-8", "replace").strip()
    except Exception:
        text = ""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("message", obj.get("detail")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            text = str(err)
    return " ".join(text.split())[:500] or str(e.reason) or "no message"


# ----------------------------------------------------------------------------- Prometheus text format

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """``(name, labels, value)`` for every sample line of a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = {k: bytes(v, "utf-8").decode("unicode_escape") for k, v in _LABEL.findall(m.group(2) or "")}
        try:
            out.append((m.group(1), labels, float(m.group(3))))
        except ValueError:
            continue
    return out
