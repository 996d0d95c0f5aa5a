"""remote/launch.py on this machine with real processes: a pid file is only trusted when the process
behind it is provably the job (start time + boot id), cancel signals the job's whole process group,
and follow always ends once the job has ended."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def launch(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remote.launch", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


@pytest.fixture
def bystander():
    """An unrelated process (what a recycled pid points at after a reboot or container restart)."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def wait_until(predicate, timeout: float = 10, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_hand_written_pid_file_does_not_let_cancel_kill_a_bystander(tmp_path, bystander):
    """The review's repro: `sleep 300 & echo "$! 999999" > $d/pid; python -m remote.launch cancel $d`."""
    (tmp_path / "pid").write_text(f"{bystander.pid} 999999\n")
    res = launch("cancel", str(tmp_path))
    assert res.returncode == 0, res.stderr
    time.sleep(0.3)
    assert alive(bystander.pid), "cancel killed a process it could not verify"
    st = json.loads(res.stdout)
    assert st["state"] == "unverifiable" and st["pid"] == bystander.pid
    assert "not signalled" in st["why"]
    # follow ends instead of waiting on it; a new start is refused with advice, not "already running"
    res = launch("follow", str(tmp_path), timeout=15)
    assert json.loads(res.stdout.splitlines()[-1])["state"] == "unverifiable"
    res = launch("start", str(tmp_path), "--", "true")
    assert res.returncode != 0 and f"{tmp_path / 'pid'}" in res.stderr and "already running" not in res.stderr


@pytest.mark.parametrize("layout", ["old-format, written before the process started", "other boot", "other start time"])
def test_stale_pid_file_is_lost_not_running(tmp_path, bystander, layout):
    """After a reboot (or a container restart) the recorded pid belongs to someone else: status says
    lost, cancel leaves it alone, follow ends at once, and a resume starts a new job."""
    pid, start = bystander.pid, start_time(bystander.pid)
    pid_file = tmp_path / "pid"
    if layout.startswith("old-format"):
        pid_file.write_text(f"{pid} {pid}\n")
        old = time.time() - 3600
        os.utime(pid_file, (old, old))
    elif layout == "other boot":
        pid_file.write_text(f"{pid} {pid} {start} {start} 00000000-0000-0000-0000-000000000000\n")
    else:
        pid_file.write_text(f"{pid} {pid} {start + 1} {start + 1} {boot_id()}\n")
    assert json.loads(launch("status", str(tmp_path)).stdout)["state"] == "lost"
    res = launch("cancel", str(tmp_path))
    assert json.loads(res.stdout)["state"] == "lost"
    time.sleep(0.3)
    assert alive(pid)
    t0 = time.monotonic()
    res = launch("follow", str(tmp_path), timeout=15)
    assert time.monotonic() - t0 < 5 and json.loads(res.stdout.splitlines()[-1])["state"] == "lost"
    res = launch("start", str(tmp_path), "--", sys.executable, "-c", "print('{\"event\": \"hi\"}')")
    assert res.returncode == 0, res.stderr
    wait_until(lambda: (tmp_path / "exit_code").exists(), what="the new job to end")
    assert json.loads(launch("status", str(tmp_path)).stdout) == {"state": "done", "exit_code": 0}
    assert alive(pid)


def test_pid_file_records_start_time_and_boot_id_and_cancel_ends_the_whole_group(tmp_path):
    """A job that starts a child of its own: cancel stops both (the process group), and the job's
    supervisor records the signal as the exit."""
    child_file = tmp_path / "child"
    job = ["sh", "-c", f"sleep 300 & echo $! > {child_file}; wait"]
    res = launch("start", str(tmp_path), "--", *job)
    assert res.returncode == 0, res.stderr
    pid = json.loads(res.stdout)["pid"]
    wait_until(lambda: child_file.exists() and child_file.read_text().strip(), what="the child pid")
    child = int(child_file.read_text())
    fields = (tmp_path / "pid").read_text().split()
    assert int(fields[0]) == pid and int(fields[2]) == start_time(pid) and fields[4] == boot_id()
    assert int(fields[3]) == start_time(int(fields[1]))
    assert json.loads(launch("status", str(tmp_path)).stdout)["state"] == "running"
    res = launch("cancel", str(tmp_path))
    st = json.loads(res.stdout)
    assert st["state"] == "failed" and st["exit_code"] == -signal.SIGTERM, st
    wait_until(lambda: not alive(child), timeout=5, what="the job's child to end with it")
    assert not alive(pid)


def test_follow_ends_on_a_torn_last_line_and_reports_it(tmp_path):
    """`printf '{"event":"pro' >> events.jsonl; echo 0 > exit_code`: follow copies the whole lines,
    then ends with an exit event naming the torn tail (it used to spin at 100% CPU forever)."""
    whole = json.dumps({"event": "prompt", "id": "a"}) + "\n"
    (tmp_path / "events.jsonl").write_text(whole + '{"event":"pro')
    (tmp_path / "exit_code").write_text("0\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen([sys.executable, "-m", "remote.launch", "follow", str(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("follow did not end after the job ended with a torn last line")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime < 2.0
    lines = out.splitlines()
    assert lines[0] == whole.strip()
    end = json.loads(lines[-1])
    assert end["event"] == "exit" and end["state"] == "done" and end["offset"] == len(whole)
    assert end["torn_tail"] == {"bytes": len('{"event":"pro'), "text": '{"event":"pro'}
    assert len(lines) == 2
