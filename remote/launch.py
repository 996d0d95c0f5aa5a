"""Run control on a host, stdlib only: start a command detached from the SSH session, follow its
events, report its state, cancel it.  ``python -m remote.launch start|follow|status|cancel RUN_DIR``

A run folder holds: ``cmd.json`` (argv), ``pid`` (the job's process-group leader), ``events.jsonl``
(the job's stdout), ``worker.log`` (its stderr), ``exit_code`` (written when it ends, atomically).
The job runs in its own session (``setsid``) with stdin from /dev/null, so a dropped SSH
connection or a Ctrl-C on the user's machine does not touch it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def start(run_dir: Path, argv: list[str], cwd: str | None = None) -> int:
    """Double-fork a supervisor that runs ``argv`` and records its exit code; returns the job pid."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / "pid").exists() and state(run_dir)["state"] == "running":
        raise SystemExit(f"{run_dir}: a job is already running there")
    for name in ("exit_code", "pid"):
        (run_dir / name).unlink(missing_ok=True)
    _write_atomic(run_dir / "cmd.json", json.dumps({"argv": argv, "cwd": cwd}))
    read_end, write_end = os.pipe()
    if os.fork() > 0:                                  # the caller: wait for the pid, then return
        os.close(write_end)
        pid = int(os.read(read_end, 64).decode() or 0)
        os.close(read_end)
        return pid
    os.close(read_end)
    os.setsid()                                        # new session: no controlling terminal
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):           # let go of the SSH channel, or it would stay open until the job ends
        os.dup2(devnull, fd)
    events = open(run_dir / "events.jsonl", "ab")
    log = open(run_dir / "worker.log", "ab")
    try:
        proc = subprocess.Popen(argv, stdin=devnull, stdout=events, stderr=log, cwd=cwd)
    except OSError as e:
        log.write(f"cannot start {argv[0]}: {e}\n".encode())
        log.flush()
        _write_atomic(run_dir / "exit_code", "127\n")
        os._exit(0)
    _write_atomic(run_dir / "pid", f"{proc.pid} {os.getpid()}\n")   # job, supervisor
    os.write(write_end, str(proc.pid).encode())
    os.close(write_end)
    code = proc.wait()
    _write_atomic(run_dir / "exit_code", f"{code}\n")
    os._exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def state(run_dir: Path) -> dict:
    pid_file, code_file = run_dir / "pid", run_dir / "exit_code"
    if code_file.exists():
        code = int(code_file.read_text().strip() or -1)
        return {"state": "done" if code == 0 else "failed", "exit_code": code}
    if not pid_file.exists():
        return {"state": "unknown" if run_dir.exists() else "missing", "exit_code": None}
    pid, supervisor = (int(x) for x in pid_file.read_text().split())
    if _alive(pid) or _alive(supervisor):   # the supervisor is about to write exit_code
        return {"state": "running", "exit_code": None, "pid": pid}
    if code_file.exists():
        return state(run_dir)
    return {"state": "lost", "exit_code": None, "pid": pid}   # e.g. the host rebooted


def follow(run_dir: Path, offset: int = 0, poll: float = 0.2, heartbeat: float = 10.0) -> int:
    """Copy events.jsonl to stdout from byte ``offset`` until the job has ended, then print a
    final ``{"event": "exit", ...}`` line. A heartbeat line every ``heartbeat`` seconds lets the
    reader tell a quiet job from a dead link."""
    events = run_dir / "events.jsonl"
    last_beat = time.time()
    while True:
        if time.time() - last_beat > heartbeat:
            print(json.dumps({"event": "heartbeat"}), flush=True)
            last_beat = time.time()
        st = state(run_dir)
        if events.exists():
            with open(events, "rb") as f:
                f.seek(offset)
                data = f.read()
            cut = data.rfind(b"\n") + 1                 # only whole lines
            if cut:
                sys.stdout.buffer.write(data[:cut])
                sys.stdout.flush()
                offset += cut
        if st["state"] != "running":
            if events.exists() and events.stat().st_size > offset:
                continue                                # drain what was written before the end
            print(json.dumps({"event": "exit", **st, "offset": offset}), flush=True)
            return 0
        time.sleep(poll)


def cancel(run_dir: Path, grace: float = 10.0) -> dict:
    st = state(run_dir)
    if st["state"] != "running":
        return st
    pid = st["pid"]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.time() + grace
        while time.time() < deadline and _alive(pid):
            time.sleep(0.1)
        if not _alive(pid):
            break
    time.sleep(0.3)
    return state(run_dir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m remote.launch", description=__doc__)
    p.add_argument("action", choices=("start", "follow", "status", "cancel"))
    p.add_argument("run_dir")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--cwd", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    run_dir = Path(args.run_dir).expanduser()
    if args.action == "start":
        if not cmd:
            p.error("start needs -- COMMAND ...")
        pid = start(run_dir, cmd, args.cwd)
        if not pid:
            print(f"could not start {cmd[0]} in {run_dir} (see {run_dir / 'worker.log'})", file=sys.stderr)
            return 1
        print(json.dumps({"pid": pid}), flush=True)
    elif args.action == "follow":
        return follow(run_dir, args.offset)
    elif args.action == "status":
        print(json.dumps(state(run_dir)))
    else:
        print(json.dumps(cancel(run_dir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
