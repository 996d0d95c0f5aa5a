"""Processes and files on a host, stdlib only: a process named by its pid *and* start time (a pid
alone may have been reused), liveness as /proc sees it (a zombie is not live), and files written
whole or not at all (a temporary sibling, then a rename)."""
from __future__ import annotations

import os
from pathlib import Path


def stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/PID/stat`` (after the command name, which may hold spaces and parens),
    or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks after boot (field 22); None if there is no such process."""
    fields = stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def alive(pid: int, start: int | None = None) -> bool:
    """Is ``pid`` a live (not zombie) process, and, with ``start``, the one that started then?"""
    fields = stat_fields(pid)
    if pid <= 0 or fields is None or fields[0] == "Z":
        return False
    return start is None or start_time(pid) == start


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` whole: into ``.NAME.PID.tmp`` beside it, then renamed over it (a
    reader sees the old file or the new one, never a part)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
