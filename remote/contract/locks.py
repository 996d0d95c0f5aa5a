"""Whether a lock file is held: the run control's locks (a job's, a resume's) are ``flock`` locks on
files in a run folder, and the host side and the control plane ask the same question of them."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path


def held(path: Path, follow: bool = True) -> bool:
    """Is ``path`` ``flock``-ed by some process now? False when there is no such file (``follow=False``:
    or a link in its place)."""
    try:
        fd = os.open(path, os.O_RDONLY | (0 if follow else os.O_NOFOLLOW))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
