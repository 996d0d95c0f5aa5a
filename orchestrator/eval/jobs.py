"""A worker job on a host: start detached, follow its events, status, cancel, fetch results.

All host-side work goes through ``python -m remote.host.launch`` (stdlib, shipped with the worker),
so no shell command is ever composed here; argv lists are quoted by the transport.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from remote.contract import events
from remote.contract.engines import LOGS as ENGINE_LOGS

from ..errors import disk_error
from ..transport import Runner, TransportError

FETCHED = ("out/results.jsonl", "out/summary.json", "out/env.json", "worker.log", "events.jsonl", "cmd.json",
           "placement.json",                                          # a Slurm task's node and GPUs
           *(f"out/{name}" for name in ENGINE_LOGS.values()))      # the engine's server logs (--engine)
RESULTS = ("results.jsonl", "summary.json", "env.json")     # what a worker that ended `done` leaves
LOGS = ("worker.log", *ENGINE_LOGS.values())                 # fetched up to LOG_CAP: their last part
LOG_CAP = 8 << 20
PARTIAL_LOG = "[dflash-ops: the first "                     # the first line of a log fetched in part


def partial_log(local: Path) -> str | None:
    """Where the whole log is (``host:path``) when ``local`` holds only its last part, else None."""
    try:
        with open(local, "rb") as f:
            first = f.readline(4096).decode(errors="replace")
    except OSError:
        return None
    if not first.startswith(PARTIAL_LOG) or ") is " not in first:
        return None
    return first.rstrip("\n").rsplit(") is ", 1)[1].rstrip("]")


def log_removed(local: Path, when: str) -> None:
    """Say in the first line of a log fetched in part that its whole log on the host is gone."""
    where = partial_log(local)
    if where is None:
        return
    data = Path(local).read_bytes()
    first, rest = data.split(b"\n", 1)
    first = first.decode(errors="replace").replace(f") is {where}]", f") was {where}, removed by "
                                                                     f"`dflash-ops clean` on {when}]")
    Path(local).write_bytes(first.encode() + b"\n" + rest)
CODE_DIR = re.compile(r"[0-9a-f]{16}")       # a shipped worker folder's name under <workdir>/code (ship.py)


class FetchFailed(TransportError):
    """A finished worker's result files did not come back (the shard stays unfetched)."""


class WorkerStalled(Exception):
    """A worker alive on its host (the follower's heartbeats come) that wrote no event for
    ``seconds``: hung, or far slower than it should be."""

    def __init__(self, seconds: float):
        super().__init__(f"no event from the worker for {seconds:.0f} s")
        self.seconds = seconds


def check_shard(record_id: str, shard, host, code: bool = True) -> None:
    """A run.json is input (it may come from another machine): the code and run folders a shard
    names are used on its host only when they are where ``eval`` puts them for that host in this
    inventory (``host``, its paths expanded there): a shipped code folder under its workdir, and
    this run's folder there. (The interpreter is always the inventory's, never run.json's.)"""
    from ..runs.record import RunRecordError

    workdir = (host.workdir or "").rstrip("/")
    run_dir = f"{workdir}/runs/{record_id}" + (f"/shard-{shard.index}" if shard.count > 1 else "")
    code_parent, _, digest = shard.code_dir.rpartition("/")
    problems = [f"code_dir {shard.code_dir!r} is not a worker folder under {workdir}/code"
                if code and (not workdir or code_parent != f"{workdir}/code" or not CODE_DIR.fullmatch(digest))
                else "",
                f"run_dir {shard.run_dir!r} is not {run_dir}" if not workdir or shard.run_dir != run_dir else ""]
    problems = [p for p in problems if p]
    if problems:
        raise RunRecordError(f"run {record_id}, shard {shard.index}: {'; '.join(problems)}: run.json does not match "
                             f"host {host.name} in this inventory; nothing was run there")


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
        return self.runner.run([self.python, "-m", "remote.host.launch", *args], timeout=timeout, input=input,
                               env={"PYTHONPATH": self.code_dir, **(env or {})}, cwd=self.code_dir)

    def start(self, worker_args: list[str], secrets: dict[str, str] | None = None,
              env: dict[str, str] | None = None, fresh: bool = False) -> int:
        """Start the worker detached; ``env`` (e.g. CUDA_VISIBLE_DEVICES) is inherited by it;
        ``secrets`` (environment variables) travel on stdin, never argv. ``fresh``: a new run,
        whose run folder on the host must not hold another run's job."""
        argv = [self.python, "-m", "remote.worker", *worker_args]
        flags = ("--env-stdin",) * bool(secrets) + ("--fresh",) * fresh
        res = self._launch("start", self.run_dir, "--cwd", self.code_dir, *flags, "--", *argv,
                           input=json.dumps(secrets) if secrets else None, env=env)
        if not res.ok:
            raise TransportError(f"could not start the worker: {res.stderr.strip()[-500:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])["pid"]

    def status(self) -> dict:
        res = self._launch("status", self.run_dir)
        if not res.ok:
            raise TransportError(f"status of {self.run_dir}: {res.stderr.strip()[-300:]}")
        return json.loads(res.stdout)

    def folder_gone(self) -> bool:
        """Is the job's run folder gone from the host (removed to free space)? Asked without the
        shipped code, which `dflash-ops clean` removes with it."""
        return not self.runner.run(["test", "-d", self.run_dir], timeout=30).ok

    def digest(self, folder: str, names: list[str]) -> dict[str, str | None]:
        """{name: sha256 of ``folder/name`` on the host, or None where there is no such file}."""
        res = self._launch("digest", folder, "--", *names, timeout=3600)
        if not res.ok:
            raise TransportError(f"sha256 of the files in {folder}: {res.stderr.strip()[-300:]}")
        return json.loads(res.stdout)

    def recorded_env(self) -> dict | None:
        """The env.json the worker wrote at its start (what its finished rows were made with), or
        None when there is none to read."""
        try:
            env = json.loads(self.runner.read_text(f"{self.out_dir}/env.json"))
        except (TransportError, OSError, ValueError):
            return None
        return env if isinstance(env, dict) else None

    def cancel(self) -> dict:
        res = self._launch("cancel", self.run_dir, timeout=60)
        return json.loads(res.stdout) if res.ok else {"state": "unknown", "error": res.stderr.strip()}

    def follow(self, offset: int = 0, read_timeout: float = 60.0, stall_s: float | None = None) -> Iterator[dict]:
        """Events as the worker writes them; the last one is ``{"event": "exit", ...}``.
        Closing the iterator (or Ctrl-C) only closes the connection; the job keeps running.
        ``stall_s``: raise :class:`WorkerStalled` once the worker wrote no event for that long
        (monotonic time, from the start of following or the end of a scheduler's queue; seen at
        the host's next heartbeat)."""
        handle = self.runner.open_exec([self.python, "-m", "remote.host.launch", "follow", self.run_dir,
                                        "--offset", str(offset)], env={"PYTHONPATH": self.code_dir},
                                       cwd=self.code_dir)
        chan = getattr(handle, "chan", None)
        if chan is not None:
            chan.settimeout(read_timeout)     # the host sends a heartbeat every 10 s
        heard, queued = time.monotonic(), False    # the last event (the worker's progress), not a heartbeat
        try:
            for raw in handle.stdout:
                line = raw.decode("utf-8", "replace").strip() if isinstance(raw, bytes) else raw.strip()
                if not line:
                    continue
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if event.get(events.KEY) == events.HEARTBEAT:
                    if stall_s is not None and not queued and time.monotonic() - heard > stall_s:
                        raise WorkerStalled(time.monotonic() - heard)
                    continue
                if event.get(events.KEY) == events.SCHEDULER:     # waiting in a queue, or on Slurm, is no stall
                    queued = event.get("state") in ("queued", "unknown")
                heard = time.monotonic()
                yield event
                if event.get(events.KEY) == events.EXIT:
                    return
            raise TransportError("lost the connection while following the worker")
        except OSError as e:   # socket.timeout included: no heartbeat, the link is dead
            raise TransportError(f"lost the connection while following the worker ({e or 'timed out'})") from None
        finally:
            handle.kill()
            handle.close()

    def fetch(self, local_dir: Path, required: tuple[str, ...] = ()) -> list[str]:
        """Copy the job's files into ``local_dir`` (results, summary, env, logs); returns what came.
        Each file comes into a temporary sibling and is renamed over the local one only once it
        came whole: a file that does not come leaves the local one as it was. A file of
        ``required`` (names in :data:`RESULTS`) that does not come raises :class:`FetchFailed`,
        naming each and why: the shard is then not fetched. A full or read-only disk here raises
        its OSError (the files are still all on the host)."""
        local_dir.mkdir(parents=True, exist_ok=True)
        got, missing = [], []
        for rel in FETCHED:
            name = Path(rel).name
            tmp = local_dir / f".{name}.{os.getpid()}.{secrets.token_hex(6)}.part"
            try:
                if name in LOGS:
                    self.fetch_log(rel, tmp)
                else:
                    self.runner.get_file(f"{self.run_dir}/{rel}", tmp)
                os.replace(tmp, local_dir / name)
                got.append(name)
            except (TransportError, OSError) as e:
                if disk_error(e):
                    raise
                if name in required:
                    missing.append(f"{name} ({getattr(e, 'strerror', None) or e})")
            finally:
                tmp.unlink(missing_ok=True)
        if missing:
            raise FetchFailed(f"could not fetch {', '.join(missing)} from {self.run_dir} on {self.runner.name}")
        return got

    def fetch_log(self, rel: str, local: Path, cap: int = LOG_CAP) -> None:
        """The log ``rel`` of the job into ``local``: whole up to ``cap`` bytes, else its last
        ``cap`` bytes from a line's start, after one line saying so and where the whole log is."""
        remote = f"{self.run_dir}/{rel}"
        size = self.runner.get_tail(remote, local, cap)
        if size <= cap:
            return
        from ..reports.render import human_bytes

        tail = Path(local).read_bytes()
        tail = tail[tail.find(b"\n") + 1:]
        note = (f"{PARTIAL_LOG}{human_bytes(size - len(tail))} of this log were not fetched; the whole log "
                f"({human_bytes(size)}) is {self.runner.name}:{remote}]\n")
        Path(local).write_bytes(note.encode() + tail)

    def log_tail(self, lines: int = 30) -> str:
        tmp = Path(tempfile.gettempdir()) / f"dflash-ops-log.{os.getpid()}.{secrets.token_hex(6)}"
        try:
            self.runner.get_tail(f"{self.run_dir}/worker.log", tmp, 64 << 10)
            text = tmp.read_bytes().decode("utf-8", "replace")
        except (TransportError, OSError):
            return ""
        finally:
            tmp.unlink(missing_ok=True)
        return "\n".join(text.splitlines()[-lines:])
