"""A worker job on a host: start detached, follow its events, status, cancel, fetch results.

All host-side work goes through ``python -m remote.launch`` (stdlib, shipped with the worker),
so no shell command is ever composed here; argv lists are quoted by the transport.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..transport import Runner, TransportError

FETCHED = ("out/results.jsonl", "out/summary.json", "out/env.json", "worker.log", "events.jsonl", "cmd.json")


@dataclass
class HostJob:
    runner: Runner
    python: str
    code_dir: str
    run_dir: str               # on the host: <workdir>/runs/<run id>[/<shard>]

    @property
    def out_dir(self) -> str:
        return f"{self.run_dir}/out"

    def _launch(self, *args: str, timeout: float | None = 60, input: str | None = None,
                env: dict[str, str] | None = None):
        return self.runner.run([self.python, "-m", "remote.launch", *args], timeout=timeout, input=input,
                               env={"PYTHONPATH": self.code_dir, **(env or {})}, cwd=self.code_dir)

    def start(self, worker_args: list[str], secrets: dict[str, str] | None = None,
              env: dict[str, str] | None = None) -> int:
        """Start the worker detached; ``env`` (e.g. CUDA_VISIBLE_DEVICES) is inherited by it;
        ``secrets`` (environment variables) travel on stdin, never argv."""
        argv = [self.python, "-m", "remote.worker", *worker_args]
        stdin_env = ("--env-stdin",) if secrets else ()
        res = self._launch("start", self.run_dir, "--cwd", self.code_dir, *stdin_env, "--", *argv,
                           input=json.dumps(secrets) if secrets else None, env=env)
        if not res.ok:
            raise TransportError(f"could not start the worker: {res.stderr.strip()[-500:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])["pid"]

    def status(self) -> dict:
        res = self._launch("status", self.run_dir)
        if not res.ok:
            raise TransportError(f"status of {self.run_dir}: {res.stderr.strip()[-300:]}")
        return json.loads(res.stdout)

    def cancel(self) -> dict:
        res = self._launch("cancel", self.run_dir, timeout=60)
        return json.loads(res.stdout) if res.ok else {"state": "unknown", "error": res.stderr.strip()}

    def follow(self, offset: int = 0, read_timeout: float = 60.0) -> Iterator[dict]:
        """Events as the worker writes them; the last one is ``{"event": "exit", ...}``.
        Closing the iterator (or Ctrl-C) only closes the connection; the job keeps running."""
        handle = self.runner.open_exec([self.python, "-m", "remote.launch", "follow", self.run_dir,
                                        "--offset", str(offset)], env={"PYTHONPATH": self.code_dir},
                                       cwd=self.code_dir)
        chan = getattr(handle, "chan", None)
        if chan is not None:
            chan.settimeout(read_timeout)     # the host sends a heartbeat every 10 s
        try:
            for raw in handle.stdout:
                line = raw.decode("utf-8", "replace").strip() if isinstance(raw, bytes) else raw.strip()
                if not line:
                    continue
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if event.get("event") == "heartbeat":
                    continue
                yield event
                if event.get("event") == "exit":
                    return
            raise TransportError("lost the connection while following the worker")
        except OSError as e:   # socket.timeout included: no heartbeat, the link is dead
            raise TransportError(f"lost the connection while following the worker ({e or 'timed out'})") from None
        finally:
            handle.kill()
            handle.close()

    def fetch(self, local_dir: Path) -> list[str]:
        """Copy the job's files into ``local_dir`` (results, summary, env, logs); returns what came."""
        local_dir.mkdir(parents=True, exist_ok=True)
        got = []
        for rel in FETCHED:
            try:
                self.runner.get_file(f"{self.run_dir}/{rel}", local_dir / Path(rel).name)
                got.append(Path(rel).name)
            except (TransportError, OSError):
                pass
        return got

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.runner.read_text(f"{self.run_dir}/worker.log")
        except (TransportError, OSError):
            return ""
        return "\n".join(text.splitlines()[-lines:])
