"""The destination lock: the eval host's ``sync_host.py serve`` session (tool.py) takes the
checkpoint's lock for the whole sync (or waits for another sync, or refuses), answers STATE
(what is already there, under the lock), BEGIN and FINALIZE (the verified staging folder renamed
into place). Every ``recv`` of the data path checks that the session that started it still holds
the lock (a token), so a killed sync's orphans stop and never interleave with a new one; the
session gives up the lock when this side stops pinging or its connection drops.
"""
from __future__ import annotations

import json

from .tool import Session

REHASH_RATE = 50 << 20  # bytes/s a host hashes at the least (FINALIZE's time limit)


class Destination:
    """One checkpoint's folder on the eval host, through that host's session."""

    def __init__(self, session: Session, rundir: str, ckpt: str, token: str):
        self.session, self.where = session, {"rundir": rundir, "ckpt": ckpt}
        self.token = token

    def lock(self, wait: float) -> None:
        self.session.call("LOCK", {**self.where, "token": self.token, "wait": wait}, timeout=wait + 30)

    def state(self, paths: list[str]) -> dict:
        """``paths``: the checkpoint's files (the staging folder keys long names by a digest)."""
        return self.session.call_json("STATE", {**self.where, "paths": paths}, timeout=120)

    def begin(self) -> None:
        self.session.call("BEGIN", timeout=60)

    def discard(self, paths: list[str]) -> None:
        """Drop what the staging folder holds of ``paths`` (they changed while they were sent)."""
        self.session.call("DISCARD", {"paths": paths}, timeout=120)

    def finalize(self, manifest: dict, rehash: int = 0) -> str:
        """Rename the verified staging folder into place (over the copy there when ``manifest``'s
        ``replace`` is that copy's digest); returns the new copy's digest (STATE's ``final_digest``).
        ``rehash``: bytes of files verified by an earlier sync, which the host hashes again (the
        staging folder is untrusted storage)."""
        answer = self.session.call("FINALIZE", manifest, timeout=300 + rehash / REHASH_RATE)
        return json.loads(answer)["digest"]
