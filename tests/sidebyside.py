"""Independent `dflash-ops` commands of one test run side by side: on a 2-core machine most of an
eval's time is one core starting Python processes (CLI, probe, inspection, memory plan, worker),
so two at once take little more than one. Each still runs and is checked exactly as before."""
from __future__ import annotations

import subprocess
import time
from datetime import datetime
from pathlib import Path


def finished(proc: subprocess.Popen, timeout: float = 900) -> subprocess.CompletedProcess:
    """``proc`` waited for, as ``subprocess.run(..., capture_output=True)`` would return it."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def started(runs: Path, proc: subprocess.Popen, code: Path, known: set[str] = frozenset(),
            timeout: float = 300) -> str:
    """Wait until ``proc``'s eval has its run (a new folder in ``runs`` beside ``known``), the worker
    code is shipped to the host's ``code`` folder, and the clock is past the run id's second; then
    another eval of the same host may start: it finds the code there (no two shipping it at once)
    and gets another id (run ids have one-second resolution). Returns the run id."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None and proc.returncode != 0:
            done = finished(proc)
            raise AssertionError(f"exit {done.returncode} before its run started: {done.stdout}{done.stderr}")
        ids = [d.name for d in runs.iterdir() if (d / "run.json").exists() and d.name not in known] \
            if runs.exists() else []
        if ids and datetime.now().strftime("%Y%m%d-%H%M%S") not in ids[0] and any(code.glob("*/.complete")):
            return ids[0]
        assert time.monotonic() < deadline, f"timed out waiting for the run in {runs} to start"
        time.sleep(0.1)
