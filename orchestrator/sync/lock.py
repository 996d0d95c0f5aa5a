"""The destination lock: ``sync_host.py hold`` runs on the eval host over the control connection
for the whole sync. It takes the checkpoint's lock (or waits for another sync, or refuses), answers
STATE (what is already there, under the lock), BEGIN and FINALIZE (the verified staging folder
renamed into place). Every ``recv`` of the data path checks that the holder that started it still
holds the lock (a token), so a killed sync's orphans stop and never interleave with a new one; the
holder gives up when this side stops pinging.
"""
from __future__ import annotations

import queue
import threading
import time

from ..config.inventory import Host
from .tool import SyncError, tool_argv, tool_error

PING_EVERY = 2.0


class SyncBusy(SyncError):
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


class Holder:
    """``sync_host.py hold`` on the destination over the control transport: the lock, the state
    (under the lock), and the final rename."""

    def __init__(self, runner, host: Host, rundir: str, ckpt: str, token: str, wait: float, idle: float):
        self.host = host
        self.h = runner.open_exec(tool_argv(host, "hold", rundir, ckpt, token, "--wait", f"{wait:g}",
                                            "--idle", f"{idle:g}"))
        self.lines: queue.Queue = queue.Queue()
        self.wlock = threading.Lock()
        self.closed = threading.Event()
        self.err: list[str] = []
        threading.Thread(target=_pump, args=(self.h.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=_pump, args=(self.h.stderr, self.err.append), daemon=True).start()
        self.wait_s = wait

    def expect(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise SyncError(f"host {self.host.name}: no answer from the lock holder in {timeout:g}s") from None
            if line is None:
                raise SyncError(f"host {self.host.name}: lock holder ended: "
                                f"{tool_error(chr(10).join(e for e in self.err if e), 'connection closed')}")
            if line.startswith("BUSY"):
                raise SyncBusy(f"host {self.host.name}: {line[5:]}; it is still running: run this again once it "
                               f"has finished")
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
