"""remote/host/launch.py on this machine with real processes: a pid file is only trusted when the process
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
    return subprocess.run([sys.executable, "-m", "remote.host.launch", *args], cwd=REPO, capture_output=True,
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
    """The review's repro: `sleep 300 & echo "$! 999999" > $d/pid; python -m remote.host.launch cancel $d`."""
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
    proc = subprocess.Popen([sys.executable, "-m", "remote.host.launch", "follow", str(tmp_path)], cwd=REPO,
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


def test_concurrent_starts_in_one_folder_give_one_live_worker(tmp_path):
    """Eight `launch start`s on one run folder at once: exactly one job starts (each job leaves a
    file named by its pid), the others are refused with one line, and cancel stops it: nothing of
    the folder is left running."""
    marks = tmp_path / "marks"
    marks.mkdir()
    job = [sys.executable, "-c", f"import os, time; open(os.path.join({str(marks)!r}, str(os.getpid())), 'w'); "
                                 f"time.sleep(120)"]
    run_dir = tmp_path / "run"
    procs = [subprocess.Popen([sys.executable, "-m", "remote.host.launch", "start", str(run_dir), "--", *job], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(8)]
    results = [p.communicate(timeout=60) + (p.returncode,) for p in procs]
    ok = [json.loads(out)["pid"] for out, _, rc in results if rc == 0]
    try:
        assert len(ok) == 1, results
        assert all("a job is already running there" in err for _, err, rc in results if rc != 0), results
        wait_until(lambda: len(list(marks.iterdir())) >= 1, what="the job to start")
        time.sleep(1.0)
        assert [int(p.name) for p in marks.iterdir()] == ok
    finally:
        st = json.loads(launch("cancel", str(run_dir)).stdout)
    assert st["state"] == "failed" and st["signalled"] is True
    assert not any(alive(int(p.name)) for p in marks.iterdir())


def test_fresh_start_refuses_a_folder_another_run_used(tmp_path):
    """Two runs with the same id on one host: the second fresh start is refused, the first run's
    files untouched."""
    run_dir = tmp_path / "runs" / "20260101-000000-v5-ct129"
    assert launch("start", str(run_dir), "--fresh", "--", "true").returncode == 0
    wait_until(lambda: (run_dir / "exit_code").exists(), what="the first job to end")
    cmd = (run_dir / "cmd.json").read_text()
    res = launch("start", str(run_dir), "--fresh", "--", "false")
    assert res.returncode != 0 and "another run's job was started here before" in res.stderr, res.stderr
    assert (run_dir / "cmd.json").read_text() == cmd and (run_dir / "exit_code").read_text() == "0\n"
    shard = run_dir / "shard-1"          # a shard folder of a run whose id a one-shard run already has
    res = launch("start", str(shard), "--fresh", "--", "true")
    assert res.returncode != 0 and "another run's job was started here before" in res.stderr, res.stderr


def test_follow_reads_a_huge_unterminated_line_once_and_drops_it(tmp_path):
    """A job writes a 24 MiB line without a newline and keeps running: follow must not re-read it
    every poll (its bytes read stay near the file's size, not a multiple of it) nor hold it in
    memory; the line is dropped, and the events after it still come."""
    size = 24 << 20
    job = [sys.executable, "-c", "import sys, time; sys.stdout.write('x' * %d); sys.stdout.flush(); time.sleep(3); "
                                 "sys.stdout.write('\\n{\"event\": \"after\"}\\n'); sys.stdout.flush(); time.sleep(120)"
           % size]
    assert launch("start", str(tmp_path), "--", *job).returncode == 0
    wait_until(lambda: (tmp_path / "events.jsonl").exists() and (tmp_path / "events.jsonl").stat().st_size >= size,
               what="the long line")
    proc = subprocess.Popen([sys.executable, "-m", "remote.host.launch", "follow", str(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(6)
        io = dict(line.split(": ") for line in Path(f"/proc/{proc.pid}/io").read_text().splitlines())
        rss_kib = int(next(line.split()[1] for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                           if line.startswith("VmHWM:")))
    finally:
        launch("cancel", str(tmp_path))
        out, _ = proc.communicate(timeout=30)
    assert int(io["rchar"]) < 2 * size, f"follow read {int(io['rchar']) / size:.1f}x the events file"
    assert rss_kib < 2 * size // 1024, f"follow held {rss_kib} KiB"
    lines = out.splitlines()
    assert json.loads(lines[0]) == {"event": "after"}, lines[:1]
    end = json.loads(lines[-1])
    assert end["event"] == "exit" and end["dropped_lines"] == 1 and end["offset"] == (tmp_path / "events.jsonl").stat().st_size


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (root only: skipped where it cannot be mounted)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


def test_a_job_that_fills_the_disk_is_failed_with_its_exit_code_and_no_space_named(small_disk, tmp_path):
    """The eval workdir fills up while the worker runs: its exit code is still recorded (the room
    for it was taken at start), the state says why, and so does the eval's failure line."""
    from orchestrator.eval.jobs import HostJob
    from orchestrator.eval.pipeline import EvalError, finish
    from orchestrator.runs.record import EvalRequest, RunRecord
    from orchestrator.transport.local import LocalRunner

    run_dir = small_disk / "runs" / "r1"
    fill = ("import sys\nf = open('fill', 'wb')\nprint('{\"event\": \"phase\", \"phase\": \"drafting\"}', flush=True)\n"
            "while True:\n    f.write(b'x' * 65536)\n    f.flush()\n")
    res = launch("start", str(run_dir), "--cwd", str(run_dir), "--", sys.executable, "-c", fill)
    assert res.returncode == 0, res.stderr
    job = HostJob(LocalRunner(), sys.executable, str(REPO), str(run_dir))
    exit_event = [ev for ev in job.follow() if ev.get("event") == "exit"][0]
    assert exit_event["state"] == "failed" and exit_event["exit_code"] == 1, exit_event
    assert "no space left on the disk holding" in exit_event["why"], exit_event
    record = RunRecord.create(tmp_path / "runs", EvalRequest(hosts=["local"]), "v5", None)
    record.shard_exited(0, exit_event)
    record.shards[0].fetched = True
    with pytest.raises(EvalError, match=r"state failed, exit code 1: no space left on the disk holding"):
        finish(record)


def test_a_host_clock_stepped_back_stops_neither_the_heartbeat_nor_cancels_grace(tmp_path, monkeypatch, capsys):
    """The host's wall clock stepped back (NTP, by hand) while a quiet job runs: follow keeps its
    heartbeat (before: none for as long as the step, so the reader said "lost contact" after 60 s)
    and cancel's grace ends on time (before: SIGKILL as much later). The step is made on the clock
    launch.py reads; its timers run on the monotonic clock."""
    import threading
    import types

    from remote.host import launch as host_launch

    back = [0.0]
    real = time.time
    monkeypatch.setattr(host_launch, "time", types.SimpleNamespace(
        time=lambda: real() - back[0], monotonic=time.monotonic, sleep=time.sleep))
    job = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                 "print('{}', flush=True); time.sleep(60)"]
    pid = json.loads(launch("start", str(tmp_path), "--", *job).stdout)["pid"]
    try:
        wait_until(lambda: (tmp_path / "events.jsonl").read_text(), what="the job to ignore SIGTERM")
        follower = threading.Thread(target=host_launch.follow, args=(tmp_path,), kwargs={"heartbeat": 0.2}, daemon=True)
        follower.start()
        time.sleep(0.3)
        back[0] = 3600.0
        time.sleep(1.2)
        beats = capsys.readouterr().out.count('"heartbeat"')
        assert beats >= 4, f"{beats} heartbeat(s) in 1.5 s, the clock stepped back after 0.3 s"
        answer: list[dict] = []
        canceller = threading.Thread(target=lambda: answer.append(host_launch.cancel(tmp_path, grace=0.5)), daemon=True)
        canceller.start()
        time.sleep(0.2)
        back[0] = 7200.0                                # stepped back again during the grace
        canceller.join(10)
        assert answer and answer[0]["state"] == "failed" and answer[0]["exit_code"] == -signal.SIGKILL, answer
        follower.join(10)
        assert not follower.is_alive()
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
