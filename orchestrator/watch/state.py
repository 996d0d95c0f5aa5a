"""``runs/watch-<RUN>/state.json``: what `watch` has done for one training run, and its lock.

Every change is written atomically (temporary file, fsync, rename) before the work it announces
starts, so `watch` killed at any moment and started again resumes: a checkpoint marked ``syncing``
is synced again (the sync itself resumes), one marked ``evaluating`` with an eval run id is
re-attached to that run (its worker kept running on the host), ``done`` is never redone.

Checkpoint status:  syncing -> evaluating -> done
                    any -> failed (reason; retried on a later pass) -> gave_up after MAX_ATTEMPTS
                    any -> waiting (not complete yet, another sync of it, a host that does not
                           answer: no attempt counted; tried again on a later pass)
                    any but done -> gone (the training host no longer lists it; listed again: new)
                    done -> superseded (its weights changed on the training host since: the point
                           is kept in ``superseded``, and the checkpoint is a new point)

``copies`` records the checkpoint copies this watch synced to each eval host (the sync's digest
of each): only such a copy may be replaced when its checkpoint changes on the training host.
"""
from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import InputError
from ..runs.record import now_iso

STATE_FILE = "state.json"
LOCK_FILE = "lock"
MAX_ATTEMPTS = 3


class WatchBusy(InputError):
    """Another `watch` holds this run's lock."""

    exit_code = 1


class WatchStateError(InputError):
    """The state file is unreadable or was made with other eval settings."""


@dataclass
class Point:
    """One checkpoint of the run, as `watch` sees it."""
    name: str
    step: int
    status: str = "syncing"
    attempts: int = 0
    reason: str | None = None
    eval_run: str | None = None
    host: str | None = None
    limit: int | None = None          # gave_up: the --max-attempts it was given up under
    ident: str | None = None          # the training host's listing of its files (path, size, mtime) when synced
    updated: str = ""
    summary: dict = field(default_factory=dict)   # the eval's headline numbers (tau, ddtree, acceptance)


@dataclass
class WatchState:
    run: str
    settings: dict                                  # the eval settings, the same for every point
    baseline: dict = field(default_factory=dict)    # {label, status, eval_run, summary, reason}
    points: dict[str, Point] = field(default_factory=dict)
    superseded: list[Point] = field(default_factory=list)      # done points whose checkpoint changed since
    copies: dict[str, dict[str, str]] = field(default_factory=dict)  # eval host -> {checkpoint: copy digest}
    path: Path | None = field(default=None, repr=False, compare=False)

    @classmethod
    def open(cls, folder: Path, run: str, settings: dict) -> "WatchState":
        """The state in ``folder`` (a new one when there is none). Settings that differ from the
        ones the trajectory was made with are refused: its points must stay comparable."""
        path = Path(folder) / STATE_FILE
        if not path.exists():
            return cls(run=run, settings=settings, path=path)
        try:
            raw = json.loads(path.read_text())
            state = cls(run=raw["run"], settings=raw["settings"], baseline=raw.get("baseline") or {},
                        points={k: Point(**v) for k, v in raw.get("points", {}).items()},
                        superseded=[Point(**v) for v in raw.get("superseded", [])],
                        copies=raw.get("copies") or {}, path=path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WatchStateError(f"{path}: unreadable watch state ({e}); move it away to start over") from None
        changed = {k: (state.settings.get(k), v) for k, v in settings.items() if state.settings.get(k) != v}
        if changed:
            diff = ", ".join(f"{k}: {a!r} then, {b!r} now" for k, (a, b) in sorted(changed.items()))
            raise WatchStateError(f"the trajectory of run {run} in {folder} was measured with other settings "
                                  f"({diff}); use the same options, or another --runs-dir to start a new one")
        return state

    def save(self) -> None:
        data = {"run": self.run, "settings": self.settings, "baseline": self.baseline,
                "points": {k: asdict(p) for k, p in sorted(self.points.items(), key=lambda kv: kv[1].step)},
                "superseded": [asdict(p) for p in self.superseded], "copies": self.copies}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{STATE_FILE}.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def point(self, name: str, step: int) -> Point:
        return self.points.setdefault(name, Point(name=name, step=step))

    def mark(self, p: Point, status: str, **fields) -> None:
        """Move ``p`` to ``status`` (with ``fields``) and write the state before anything else happens."""
        p.status, p.updated = status, now_iso()
        for k, v in fields.items():
            setattr(p, k, v)
        self.save()

    def failed(self, p: Point, reason: str, max_attempts: int = MAX_ATTEMPTS, final: bool = False) -> None:
        """One more failed attempt; the point is given up after ``max_attempts``, or at once when
        ``final`` (a retry would fail the same way): a larger ``max_attempts`` later tries it again."""
        p.attempts += 1
        if final or p.attempts >= max_attempts:
            self.mark(p, "gave_up", reason=reason, limit=max_attempts)
        else:
            self.mark(p, "failed", reason=reason)

    def supersede(self, p: Point, reason: str) -> None:
        """Done point ``p`` no longer stands for its checkpoint (changed since): kept, marked
        ``superseded``, and the checkpoint is evaluated as a new point."""
        p.status, p.reason, p.updated = "superseded", reason, now_iso()
        self.superseded.append(self.points.pop(p.name))
        self.save()

    def done_points(self) -> list[Point]:
        return sorted((p for p in self.points.values() if p.status == "done"), key=lambda p: p.step)


class RunLock:
    """An exclusive lock (flock) on ``runs/watch-<RUN>/lock``: a second `watch` of the run refuses.
    The kernel drops it when the process dies, however it dies."""

    def __init__(self, folder: Path, run: str):
        self.path, self.run, self.fd = Path(folder) / LOCK_FILE, run, None

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise WatchBusy(f"another `watch` of run {self.run} is running (pid {holder}, lock {self.path}); "
                            f"stop it first, or let it work") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
