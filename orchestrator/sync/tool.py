"""``remote/sync_host.py`` on a host: it travels as a compressed argument of ``python -c`` (stdin
stays free for data), prints one JSON line per answer, and reports failures as ``ERROR ...``
lines on stderr. A sync talks to each host through one long-lived tool process
(:class:`Session`, ``sync_host.py serve``); the data path starts ``send`` and ``recv`` per file.
"""
from __future__ import annotations

import base64
import hashlib
import json
import queue
import threading
import time
import zlib
from functools import lru_cache
from importlib import resources

from ..errors import OperationFailed
from ..config.inventory import Host

BOOTSTRAP = ("import sys,zlib,base64;exec(compile(zlib.decompress(base64.b64decode(sys.argv.pop(1))),"
             "'sync_host.py','exec'),{'__name__':'__main__'})")
# --tunnel's forced command: the eval host names the tool's blob and a `send`; the blob runs only
# if its sha256 is the one this machine wrote into authorized_keys (argv: HASH DIR)
PINNED_SENDER = ("import os,sys,shlex,zlib,base64,hashlib;"
                 "w=shlex.split(os.environ.get('SSH_ORIGINAL_COMMAND',''));b=w.pop(0) if w else '';"
                 "hashlib.sha256(b.encode()).hexdigest()==sys.argv[1] or sys.exit('ERROR not the dflash-ops sender');"
                 "sys.argv=['sync_host.py','send-from',sys.argv[2],*w];"
                 "exec(compile(zlib.decompress(base64.b64decode(b)),'sync_host.py','exec'),{'__name__':'__main__'})")
# --tunnel's ProxyCommand on the eval host: connect to the tunnel's socket, hand the connection to
# ssh (ProxyUseFdpass) and exit; no byte passes through it
FDPASS = ("import socket,sys,array;s=socket.socket(socket.AF_UNIX);s.connect(sys.argv[1]);"
          "socket.socket(fileno=1).sendmsg([b'x'],[(socket.SOL_SOCKET,socket.SCM_RIGHTS,array.array('i',[s.fileno()]))])")
PING_EVERY = 2.0


class SyncError(OperationFailed):
    """The sync cannot go on; the message is for the user as-is."""


@lru_cache(maxsize=1)
def tool_blob() -> str:
    src = resources.files("remote").joinpath("sync_host.py").read_bytes()
    return base64.b64encode(zlib.compress(src, 9)).decode()


def tool_argv(host: Host, *args: str | int) -> list[str]:
    """``python -S -c BOOTSTRAP BLOB ARGS``: the tool travels as an argument, stdin stays free.
    ``-S``: the tool is stdlib only, and a host's site-packages (``.pth`` hooks, editable
    installs) cost more start-up time than the tool's whole run on a small file."""
    return [host.python, "-S", "-c", BOOTSTRAP, tool_blob(), *(str(a) for a in args)]


def tool_error(stderr: str, fallback: str) -> str:
    """The tool's last ``ERROR`` line, else the last line of stderr, else ``fallback``."""
    lines = [ln[6:] for ln in stderr.splitlines() if ln.startswith("ERROR ")]
    if lines:
        return lines[-1]
    tail = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return tail[-1] if tail else fallback


def run_tool(runner, host: Host, *args, input: str | None = None, timeout: float = 600) -> dict:
    """One tool command over the control connection; its JSON answer."""
    res = runner.run(tool_argv(host, *args), input=input, timeout=timeout)
    if res.returncode in (126, 127):
        raise SyncError(f"host {host.name}: python not found or not executable: {host.python}")
    if not res.ok:
        raise SyncError(f"host {host.name}: sync_host {args[0]}: {tool_error(res.stderr, f'exit {res.returncode}')}")
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SyncError(f"host {host.name}: sync_host {args[0]} printed no JSON") from None


def forced_sender(host: Host, src_dir: str) -> list[str]:
    """The forced command of ``--tunnel``'s one-time key on the training host: ``send-from
    src_dir``, the tool's code pinned by the sha256 of its blob (the blob itself comes with each
    request: an authorized_keys line stays short)."""
    return [host.python, "-S", "-c", PINNED_SENDER, hashlib.sha256(tool_blob().encode()).hexdigest(), src_dir]


def sender_request(*args: str | int, verb: str = "send") -> list[str]:
    """What the eval host asks the forced command for: the blob, then ``send`` (or ``send-batch``)
    and its arguments."""
    return [tool_blob(), verb, *(str(a) for a in args)]


def batch_spec(files) -> str:
    """``send-batch``'s SPEC for ``files`` (FilePlans): what to send of each, compressed."""
    return base64.b64encode(zlib.compress(json.dumps([[f.path, f.size, f.mtime_ns, f.offset] for f in files])
                                          .encode(), 9)).decode()


def fdpass_argv(host: Host, socket_path: str) -> list[str]:
    return [host.python, "-S", "-c", FDPASS, socket_path]


class SessionError(SyncError):
    """A request a host's ``serve`` session refused: ``reason`` is the host's own words."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


class SyncBusy(SessionError):
    """Another sync of the checkpoint holds its lock on the destination (nothing was moved): a
    reason to wait, not a failure of this sync."""


def _pump(stream, sink) -> None:
    """Every line of ``stream`` (decoded, without the newline) into ``sink``, then None."""
    try:
        for raw in iter(stream.readline, b""):
            sink(raw.decode(errors="replace").rstrip("\n"))
    except Exception:
        pass
    sink(None)


class Session:
    """``sync_host.py serve`` on a host over its control connection: the one tool start a sync
    needs per host for everything but moving bytes (listing, manifest, lock, state, finalize, the
    tunnel's key and end). One request, one answer line; pinged every PING_EVERY seconds so it
    knows this side is alive, and it says ``ALIVE`` while it works on a long request, so that a
    session silent for ``idle`` seconds (its process stopped or hung, its connection stalled) fails
    the request then, naming the host, whatever the request's own time limit. Whatever it set up on
    the host is undone when it ends: on :meth:`close`, or by itself when the connection drops or this
    process dies (or by its guardian there when its own process is killed)."""

    def __init__(self, runner, host: Host, idle: float):
        self.host, self.idle = host, idle
        self.h = runner.open_exec(tool_argv(host, "--idle", f"{idle:g}", "serve"))
        self.lines: queue.Queue = queue.Queue()
        self.wlock, self.call_lock = threading.Lock(), threading.Lock()
        self.closed = threading.Event()
        self.err: list[str] = []
        threading.Thread(target=_pump, args=(self.h.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=_pump, args=(self.h.stderr, self.err.append), daemon=True).start()
        threading.Thread(target=self._ping_forever, daemon=True).start()

    def call(self, verb: str, payload=None, timeout: float = 120) -> str:
        """Send ``VERB [json]`` and return the answer after ``VERB``; a refusal is a
        :class:`SessionError`."""
        with self.call_lock:
            self.send(verb if payload is None else f"{verb} {json.dumps(payload)}")
            return self._answer(verb, timeout)

    def call_json(self, verb: str, payload=None, timeout: float = 120):
        return json.loads(self.call(verb, payload, timeout))

    def _answer(self, verb: str, timeout: float) -> str:
        name = self.host.name
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(0.0, min(left, self.idle)))
            except queue.Empty:
                if left <= self.idle:
                    raise SyncError(f"host {name}: no answer from sync_host in {timeout:g}s ({verb})") from None
                raise SyncError(f"host {name}: its sync_host session gave no sign of life for {self.idle:g}s while "
                                f"answering {verb}: its process is stopped or hung, or the connection to {name} "
                                f"stalled; run the same command again once {name} answers") from None
            if line != "ALIVE":
                break
        if line is None:
            self.lines.put(None)  # stays ended for later calls
            raise SyncError(f"host {name}: {self._ended()}")
        if line.startswith("BUSY "):
            raise SyncBusy(f"host {name}: {line[5:]}; it is still running: run this again once it has finished",
                           line[5:])
        if line.startswith("ERROR "):
            raise SessionError(f"host {name}: {line[6:]}", line[6:])
        if line == verb or line.startswith(verb + " "):
            return line[len(verb):].strip()
        raise SyncError(f"host {name}: unexpected answer from sync_host to {verb}: {line[:80]}")

    def _ended(self) -> str:
        try:
            rc = self.h.wait(2)
        except Exception:
            rc = None
        if rc in (126, 127):
            return f"python not found or not executable: {self.host.python}"
        time.sleep(0.05)  # the stderr pump's last lines
        gone = "killed (no exit status), or its connection closed" if rc is not None and rc < 0 else \
            "connection closed"
        return "sync_host ended: " + tool_error("\n".join(e for e in self.err if e), gone)

    def send(self, line: str) -> None:
        """Write one request; the session's end (its process killed, the connection gone) is a
        :class:`SyncError` naming the host."""
        try:
            with self.wlock:
                self.h.stdin.write((line + "\n").encode())
                self.h.stdin.flush()
        except (OSError, ValueError, EOFError):
            if self.closed.is_set():
                raise
            raise SyncError(f"host {self.host.name}: {self._ended()}") from None

    def _ping_forever(self) -> None:
        while not self.closed.wait(PING_EVERY):
            try:
                self.send("PING")
            except Exception:
                return

    def end(self) -> None:
        """Close the session's stdin: it undoes what it set up on the host and exits."""
        if self.closed.is_set():
            return
        self.closed.set()
        try:
            with self.wlock:
                self.h.stdin.close()
        except Exception:
            pass
        self._finished = threading.Thread(target=self._finish, daemon=True)  # never hang on a dead link
        self._finished.start()

    def _finish(self) -> None:
        try:
            self.h.wait(10)
        except Exception:
            pass
        self.h.close()

    def close(self, wait: float = 5.0) -> None:
        """:meth:`end`, then wait (at most ``wait`` s) until it has exited."""
        close_all([self], wait)


def close_all(sessions: list[Session], wait: float = 5.0) -> None:
    """End every session at once, then wait for them (at most ``wait`` s in all)."""
    for s in sessions:
        s.end()
    deadline = time.monotonic() + wait
    for s in sessions:
        s._finished.join(max(deadline - time.monotonic(), 0))
