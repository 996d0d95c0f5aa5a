"""The kinds of expected failure. Every domain module raises its own error class, derived from
one of these; the CLI's one error guard (orchestrator/cli/guard.py) prints its message as one red
line and exits with its ``exit_code`` (README, "Exit codes"). Anything else is a bug and keeps
its traceback.
"""
from __future__ import annotations

import errno

DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)    # this machine's disk is full or read-only


def disk_error(e: BaseException) -> OSError | None:
    """``e`` when it is a write refused by a full or read-only disk (:data:`DISK_ERRNOS`), else None."""
    return e if isinstance(e, OSError) and e.errno in DISK_ERRNOS else None


class DflashOpsError(Exception):
    """An expected failure; ``str(error)`` is the user-facing message, ``exit_code`` the
    command's exit status."""

    exit_code = 1


class InputError(DflashOpsError):
    """What the user gave is wrong: a file, a name, an option."""

    exit_code = 2


class OperationFailed(DflashOpsError):
    """The operation ran and failed: a host, a transfer, a worker."""

    exit_code = 1


def nearest(word: str, choices, n: int = 3, cutoff: float = 0.5) -> list[str]:
    """The choices closest to a mistyped ``word`` (the one "did you mean" of every message)."""
    import difflib

    return difflib.get_close_matches(str(word), [str(c) for c in choices], n=n, cutoff=cutoff)


def did_you_mean(word: str, choices) -> str:
    """`` (did you mean 'x'?)`` or ``''``."""
    near = nearest(word, choices, 1)
    return f" (did you mean '{near[0]}'?)" if near else ""
class DflashOpsWarning(UserWarning):
    """Something the user should know that does not stop the command (the CLI shows it as one
    yellow line on stderr)."""
