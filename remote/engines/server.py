"""Serving engines run beside our own decoding, the part every engine shares: a server started as a
subprocess in its own process group on a free loopback port (log to a file, ready when its health
URL answers, stopped by SIGTERM to the group then SIGKILL), a JSON-over-HTTP client (stdlib
``urllib``, no proxies), and the Prometheus text format. Stdlib only: the engine runs in its own
environment (it pins its own torch and transformers) and this side only talks HTTP to it. One
module per engine: :mod:`remote.engines.vllm`, :mod:`remote.engines.sglang`; the worker's engine phase is
:mod:`remote.engines.phase`.

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

from remote.engines.http import http_error_message, opener
from remote.host.proc import start_time

LOOPBACK = "127.0.0.1"


class EngineError(Exception):
    """An engine is missing, failed to start, refused its settings, died, or answered badly.

    ``kind``: ``not_installed``, ``start_failed``, ``refused``, ``port_taken``, ``start_timeout``,
    ``died``, ``unreachable``, ``http``, ``bad_answer``, ``mismatch``. ``status``: the HTTP status
    for ``http``. ``log_tail``: the server log's last lines, where the server is ours."""

    def __init__(self, message: str, kind: str, status: int | None = None, log_tail: str = ""):
        super().__init__(message + (f"\n{log_tail}" if log_tail else ""))
        self.headline, self.kind, self.status, self.log_tail = message, kind, status, log_tail


# ----------------------------------------------------------------------------- the engine's environment

def environment_python(python: str | None, env_var: str, name: str, install: str) -> str:
    """The engine environment's python: ``python``, else ``$env_var``. EngineError
    (``not_installed``, saying how to install) when neither names an executable."""
    path = python or os.environ.get(env_var)
    if not path:
        raise EngineError(f"no {name} environment given (an engine python, or ${env_var}); install one: {install}",
                          "not_installed")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise EngineError(f"{name} is not installed: {path} is not an executable python; install it: {install}",
                          "not_installed")
    return path


def environment_versions(python: str, kind: str, name: str, install: str, timeout: float = 120.0) -> dict:
    """``{kind: VERSION, "distribution": ..., "torch": ..., "transformers": ...}`` of the engine
    environment, from package metadata (:func:`remote.host.probe.engine_packages`: importing an engine
    takes far longer). EngineError (``not_installed``) when the engine is not in it."""
    import subprocess

    from remote.host.probe import ENGINE_DISTRIBUTIONS, engine_packages

    try:
        found = engine_packages(python, timeout)
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        raise EngineError(f"cannot read the versions in {python}'s environment: {e}", "not_installed") from None
    dist = next((d for d in ENGINE_DISTRIBUTIONS[kind] if found.get(d)), None)
    if dist is None:
        raise EngineError(f"{name} is not installed in {python}'s environment; install it: {install}", "not_installed")
    return {kind: found[dist], "distribution": dist, "torch": found.get("torch"),
            "transformers": found.get("transformers")}


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
_NOT_AN_ERROR = re.compile(r"\b(?:INFO|WARNING|DEBUG)\b")   # a log record below error level that quotes one


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
        if not m or _NOT_AN_ERROR.search(line[:m.start()]) or (found and any(g in line for g in _GENERIC_ERRORS)):
            continue
        found = f"{m.group(1)}: {m.group(2).strip()}"
        if "validation error" in m.group(2):
            detail = next((row.strip() for row in lines[i + 1:i + 4] if "error," in row), None)
            if detail:
                found += f": {detail.split(' [type=')[0]}"
    return found


# ----------------------------------------------------------------------------- processes of an earlier worker

def kill_recorded(path: str | Path) -> list[int]:
    """SIGKILL the process groups of the servers recorded in ``path`` (:meth:`ServerProcess.record`)
    that still run: servers an earlier worker started and could not stop (it was killed with
    SIGKILL). A pid whose start time differs is another process and is left alone. Returns the pids
    killed; the file is removed."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    killed = []
    for line in lines:
        try:
            pid, start = (int(x) for x in line.split()[:2])
        except ValueError:
            continue
        if start_time(pid) == start:
            try:
                os.killpg(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
    path.unlink(missing_ok=True)
    return killed


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

    def record(self, path: str | Path) -> None:
        """Append ``PID START`` to ``path``, so a later worker can end this server should this one
        be killed before it could (:func:`kill_recorded`)."""
        with open(path, "a") as f:
            f.write(f"{self.pid} {start_time(self.pid) or 0}\n")

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def tail(self, lines: int = 25) -> str:
        return log_tail(self.log_path, lines)

    def failure(self, error: EngineError) -> EngineError | None:
        """For a request to this server that failed: 'died mid-run' with the log's reason when the
        server died (it exits shortly after an engine-core failure, which answers HTTP 500 first);
        None while it lives or for a refusal (HTTP 4xx)."""
        if error.kind == "http" and (error.status or 0) < 500:
            return None
        deadline = time.monotonic() + 10.0
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.died_error("mid-run") if not self.alive() else None

    def died_error(self, when: str) -> EngineError:
        """The error for a server found dead: its exit status, its own error line and its log tail."""
        code = self.proc.poll()
        status = f"exit code {code}" if code is not None and code >= 0 else f"killed by signal {-(code or 0)}"
        # killed by a signal (SIGKILL, the OOM killer): the log cannot hold the reason
        reason = log_error(self.log_path) if code is None or code >= 0 else None
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
        """End the server's process group (SIGTERM, then SIGKILL after ``grace`` s); its exit status.
        Safe to call from a signal handler and more than once."""
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


def check_served(name: str, url: str, got: dict, problems: list[str], speculative: bool,
                 num_speculative_tokens: int | None) -> dict:
    """``got`` (a client's ``served()``) when it serves what a run needs, else EngineError
    (``mismatch``) naming every difference: the engine's own ``problems`` (model, drafter, algorithm)
    and, the same for every engine, speculation on/off and the draft tokens per step."""
    if speculative and not got["speculative"]:
        problems.append("it runs without speculative decoding")
    if not speculative and got["speculative"]:
        problems.append("it runs with speculative decoding")
    if speculative and num_speculative_tokens is not None and got["num_speculative_tokens"] is not None \
            and got["num_speculative_tokens"] != int(num_speculative_tokens):
        problems.append(f"it drafts {got['num_speculative_tokens']} tokens per step, not {num_speculative_tokens}")
    if problems:
        raise EngineError(f"the {name} at {url} does not serve what this run needs: " + "; ".join(problems),
                          "mismatch")
    return got


class OwnServer:
    """An engine server this process started and owns (one subclass per engine): ``url``,
    ``client``, ``process``, ``argv``, ``settings``, ``startup_s``; ``stop()`` (also on leaving a
    ``with`` block)."""

    name = "server"
    health_path = "/health"
    client_class: type = None       # the engine's client: client_class(url, process=process)

    def __init__(self, process: ServerProcess, url: str, argv: list[str], startup_s: float | None, settings: dict):
        self.process, self.url, self.argv, self.startup_s, self.settings = process, url, argv, startup_s, settings
        self.client = self.client_class(url, process=process)

    def wait_ready(self, timeout: float):
        """Wait until the health URL answers; EngineError (the server stopped) when it refuses its
        settings (its own message), fails otherwise (log tail) or is not up within ``timeout``."""
        probe = HTTPClient(self.url, name=self.name)
        try:
            self.startup_s = self.process.wait_ready(lambda: probe.ok(self.health_path, 5.0), timeout)
        except BaseException:
            self.process.stop()
            raise
        return self

    def stop(self, grace: float = 20.0) -> int | None:
        return self.process.stop(grace)

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
        self._opener = opener()

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
                                f"{http_error_message(e, one_line=True)}", "http", status=e.code)
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
