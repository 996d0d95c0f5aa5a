"""Waiting in tests: for a condition (``wait_for``), for a ``dflash-ops`` subprocess to end
(``finished``), and for an eval's run to have started (``started``), so that independent commands
of one test can run side by side: on a 2-core machine most of an eval's time is one core starting
Python processes (CLI, probe, inspection, memory plan, worker), so two at once take little more
than one. Each still runs and is checked exactly as it would alone."""
from __future__ import annotations

import subprocess
import time
from datetime import datetime
from pathlib import Path

# How much longer than on a quiet 2-core machine a step may take here: the suite's durations on a
# quiet machine (`.ci/run` prints the slowest 30) against the same suite with both cores loaded by
# another process, or beside another suite, were up to ~3x (e.g. the watch test: 60 s quiet, 137 s
# beside another suite); a bound is this many times the quiet time, plus a minute for a process start.
LOAD = 5.0


def patience(quiet_s: float) -> float:
    """A bound for a step that takes ``quiet_s`` seconds on a quiet 2-core machine: waiting returns
    as soon as what it waits for happens, so a generous bound costs nothing when the step is healthy."""
    return LOAD * quiet_s + 60


def wait_for(predicate, timeout: float = 240, what: str = "condition", proc: subprocess.Popen | None = None,
             interval: float = 0.05):
    """``predicate()``'s first truthy value; AssertionError after ``timeout`` s, or as soon as ``proc``
    (if given) has ended, with its last output."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            tail = proc.stdout.read()[-3000:] if proc.stdout else ""
            raise AssertionError(f"exit {proc.returncode} before {what}: {tail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)



def finished(proc: subprocess.Popen, timeout: float = 900) -> subprocess.CompletedProcess:
    """``proc`` waited for, as ``subprocess.run(..., capture_output=True)`` would return it; past
    ``timeout`` it is killed and the AssertionError shows the end of what it printed."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, proc.args))[:300]} did not end in {timeout:g}s; it printed: "
                             f"{(out or '')[-3000:]}{(err or '')[-2000:]}") from None
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

