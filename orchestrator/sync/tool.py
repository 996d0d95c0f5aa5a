"""``remote/sync_host.py`` on a host: it travels as a compressed argument of ``python -c`` (stdin
stays free for data), prints one JSON line per answer, and reports failures as ``ERROR ...``
lines on stderr.
"""
from __future__ import annotations

import base64
import json
import zlib
from functools import lru_cache
from importlib import resources

from ..errors import OperationFailed
from ..config.inventory import Host

BOOTSTRAP = ("import sys,zlib,base64;exec(compile(zlib.decompress(base64.b64decode(sys.argv.pop(1))),"
             "'sync_host.py','exec'),{'__name__':'__main__'})")


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
