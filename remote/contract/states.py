"""The states of a run and of its shards' workers: one vocabulary for the host tool that watches a
worker (:mod:`remote.host.launch`) and for the run record on the user's machine. Stdlib only; the values
are the strings run.json and the host's answers carry."""
from __future__ import annotations

from enum import Enum


class State(str, Enum):
    PREPARING = "preparing"          # a run in pre-flight: no worker started yet
    PENDING = "pending"              # a shard not started yet
    QUEUED = "queued"                # a scheduler's job waiting for its resources (a Slurm task)
    RUNNING = "running"
    DONE = "done"                    # exit code 0 (a run: every shard done and fetched)
    FAILED = "failed"                # a nonzero exit code
    CANCELLED = "cancelled"          # stopped by `cancel`
    LOST = "lost"                    # the worker's processes are gone and it wrote no exit code
    UNKNOWN = "unknown"              # the host cannot say (no pid file yet, an unreadable one, no answer)
    MISSING = "missing"              # its run folder is not on the host
    UNVERIFIABLE = "unverifiable"    # a live process holds the pid but cannot be proven the worker

    def __str__(self) -> str:
        return self.value

    def is_terminal(self) -> bool:
        """Nothing will change it by itself: no worker of it runs any more (or none ever will)."""
        return self in _TERMINAL


_TERMINAL = frozenset({State.DONE, State.FAILED, State.CANCELLED, State.LOST, State.MISSING})
