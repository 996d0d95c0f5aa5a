"""Fault injection for `dflash-ops eval` on the SSH lab: a real fault at an exact point
of a real eval, then `eval --resume RUN`; after it every prompt of the suite is in the run's
results exactly once, in suite order, and the resumed worker redid no finished prompt.

Faults: kill the local process (SIGKILL of the `eval` CLI; the detached worker keeps running),
kill the remote worker (SIGKILL of its process group), drop the link (`ip link set down` on the
eval host's veth for LINK_DOWN_S). Points: `loading` (the worker started, no prompt finished) and
`mid` (the first prompt's row written). The worker is frozen with SIGSTOP the moment the point is
seen (the row count at the fault is exact), the fault is applied, then it is let go with SIGCONT.
The table of outcomes is printed at the end of the run and kept in docs/reliability.md.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from faulttable import Table
from clirun import lab_cli
from runfolders import remote_run_dir, results
from waiting import wait_for

FAULTS = ("kill-local", "kill-remote", "link-down")
POINTS = ("loading", "mid")
N_PROMPTS = 3
LINK_DOWN_S = 8.0


def rows_on_host(rdir: Path) -> int:
    path = rdir / "out" / "results.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def worker_pid(rdir: Path) -> int | None:
    try:
        return int((rdir / "pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@pytest.fixture
def table(request):
    return Table(request, "eval fault injection",
                 ("fault", "point", "rows at fault", "faulty run", "rerun", "prompts once"))


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:60] if lines else ""


@pytest.mark.timeout(420)
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("fault", FAULTS)
def test_eval_fault_then_resume_has_every_prompt_once(eval_lab, tmp_path, table, fault, point):
    lab = eval_lab["lab"]
    if fault == "link-down" and not lab.isolated:
        pytest.skip(f"needs network namespaces: {lab.fallback_reason}")
    runs = tmp_path / "runs"
    args = ("--host", "eval", "--drafter", "demo", "--prompts", N_PROMPTS, "--max-new-tokens", 32,
            "--device", "cpu", "--ddtree", "")
    proc = lab_cli(eval_lab, "eval", *args, runs=runs, popen=True)
    pid = None
    try:
        wait_for(lambda: runs.exists() and any((d / "run.json").exists() for d in runs.iterdir()), 120, "the run")
        run_id = next(d.name for d in runs.iterdir() if (d / "run.json").exists())
        rdir = remote_run_dir(eval_lab, "eval", run_id)
        wait_for(lambda: worker_pid(rdir) is not None, 180, "the worker to start")
        pid = worker_pid(rdir)
        if point == "mid":
            wait_for(lambda: rows_on_host(rdir) >= 1, 240, "the first prompt")
        os.kill(pid, signal.SIGSTOP)
        at_fault = rows_on_host(rdir)
        assert at_fault == 0 if point == "loading" else 0 < at_fault < N_PROMPTS, at_fault
        if fault == "kill-local":
            proc.kill()
        elif fault == "kill-remote":
            os.killpg(pid, signal.SIGKILL)
        else:
            lab.link_down("eval")
        os.kill(pid, signal.SIGCONT) if fault != "kill-remote" else None
        if fault == "link-down":
            time.sleep(LINK_DOWN_S)
            lab.link_up("eval")
        out = proc.communicate(timeout=300)[0]
    finally:
        if fault == "link-down":
            lab.link_up("eval")
        if pid:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    faulty = ("killed" if fault == "kill-local" else "completed" if proc.returncode == 0
              else f"exit {proc.returncode}: {last_line(out)}")
    done = json.loads((runs / run_id / "run.json").read_text())["status"] == "done"
    rerun = "-"
    if not done:
        resumed = lab_cli(eval_lab, "eval", "--resume", run_id, runs=runs)
        rerun = f"exit {resumed.returncode}"
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    rows = results(runs / run_id)
    suite_ids = json.loads((runs / run_id / "env.json").read_text())["suite"]["ids"]
    once = [r["id"] for r in rows] == suite_ids and len(set(suite_ids)) == N_PROMPTS
    table.append((fault, point, at_fault, faulty, rerun, "yes" if once else "NO"))
    assert once, ([r["id"] for r in rows], suite_ids)
    starts = [json.loads(line) for line in (rdir / "events.jsonl").read_text().splitlines()
              if '"event": "start"' in line]
    if fault == "kill-remote":                   # a new worker, which skipped what was finished
        assert worker_pid(rdir) != pid and starts[-1]["done"] == at_fault, starts
    else:                                        # the worker was never started twice
        assert worker_pid(rdir) == pid and len(starts) == 1, starts
