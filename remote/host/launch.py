"""Run control on a host, stdlib only: start a command detached from the SSH session, follow its
events, report its state, cancel it.  ``python -m remote.host.launch start|follow|status|cancel RUN_DIR``;
``digest FOLDER -- NAME...`` prints the sha256 of files (what a resume compares with the finished rows').

A run folder holds: ``cmd.json`` (argv), ``pid``, ``events.jsonl`` (the job's stdout),
``worker.log`` (its stderr), ``exit_code`` (written when it ends, atomically). The job runs in its
own session and process group with stdin from /dev/null, so a dropped SSH connection or a Ctrl-C on
the user's machine does not touch it; ``cancel`` signals that whole group.

Secrets (e.g. SGLang credentials) never go in the argv (``ps`` shows it, ``cmd.json`` records it):
``start --env-stdin`` reads a JSON object of environment variables on stdin and gives them to the
job's environment only.

``pid`` is one line ``JOB SUPERVISOR JOB_START SUPERVISOR_START BOOT_ID``: a pid names a process
only together with its start time (``/proc/PID/stat`` field 22) and the boot it belongs to, since
after a reboot or a container restart the same number can be any process. A process counts as the
job only when both match. An older two-number pid file cannot be checked that way: a live process
behind it is reported ``unverifiable`` and is never signalled (unless it started after the file was
written, which proves it is not the job: ``lost``).
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from remote.contract.events import EXIT, HEARTBEAT, KEY, PROGRESS, SCHEDULER
from remote.contract.locks import held
from remote.host import slurm
from remote.host.proc import alive as _alive, start_time as _start_time, write_atomic as _write_atomic

LOCK = ".start.lock"                 # held by `start` from its state check until the pid file is written
JOB_LOCK = ".job.lock"               # held by the job and its supervisor for as long as either lives
EXIT_RESERVED = ".exit_code.reserved"
RESERVED = 4096                      # bytes kept for the exit code (a block)
LOW_SPACE = 1 << 20                  # less free than this on the run folder's disk: "no space left"
READ_CHUNK = 1 << 20                 # follow reads events.jsonl in pieces of this
MAX_LINE = 1 << 20                   # follow drops event lines longer than this


def _held_before(run_dir: Path) -> str | None:
    """A job's ``cmd.json`` already in ``run_dir``, the run folder above it, or a shard folder in it."""
    for f in (run_dir / "cmd.json", run_dir.parent / "cmd.json", *run_dir.glob("shard-*/cmd.json")):
        if f.exists():
            return str(f)
    return None


def start(run_dir: Path, argv: list[str], cwd: str | None = None, env: dict[str, str] | None = None,
          fresh: bool = False) -> int:
    """Double-fork a supervisor that runs ``argv`` (with ``env`` added to its environment) and
    records its exit code; returns the job pid. Starts in one folder are one at a time (a lock
    held until the pid file is written), so a folder never has two live jobs. ``fresh``: a new
    run, refused where another run's job was started before (two runs with the same id)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _start_locked(run_dir, argv, cwd, env, fresh, lock)
    finally:
        os.close(lock)


def _start_locked(run_dir: Path, argv: list[str], cwd: str | None, env: dict[str, str] | None, fresh: bool,
                  lock: int) -> int:
    held = _held_before(run_dir) if fresh else None
    if held:
        raise SystemExit(f"{run_dir}: another run's job was started here before ({held}); two runs with the same "
                         f"id? Start the eval again (it gets a new id)")
    st = state(run_dir)
    if st["state"] == "running":
        raise SystemExit(f"{run_dir}: a job is already running there (" + (f"pid {st['pid']})" if st.get("pid")
                                                                          else f"{st['why']})"))
    if st["state"] == "unverifiable":
        raise SystemExit(f"{run_dir}: {st['why']}; if it is not this run's job, delete {run_dir / 'pid'} "
                         f"and start again")
    if _job_lock_held(run_dir):                        # whatever the pid file says
        raise SystemExit(f"{run_dir}: a job is still running there (it holds {run_dir / JOB_LOCK})")
    for name in ("exit_code", "pid"):
        (run_dir / name).unlink(missing_ok=True)
    _write_atomic(run_dir / "cmd.json", json.dumps({"argv": argv, "cwd": cwd}))
    reserved = _reserve(run_dir / EXIT_RESERVED)       # the exit code's room, taken while there is room
    read_end, write_end = os.pipe()
    if os.fork() > 0:                                  # the caller: wait for the pid, then return
        os.close(write_end)
        os.close(reserved)
        pid = int(os.read(read_end, 64).decode() or 0)
        os.close(read_end)
        return pid
    os.close(read_end)
    os.close(lock)                                     # the caller's to release, once the pid is known
    os.setsid()                                        # new session: no controlling terminal
    if os.fork() > 0:
        os._exit(0)
    job_lock = os.open(run_dir / JOB_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(job_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:                            # taken since the check: the caller reads no pid
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):           # let go of the SSH channel, or it would stay open until the job ends
        os.dup2(devnull, fd)
    events = open(run_dir / "events.jsonl", "ab")
    log = open(run_dir / "worker.log", "ab")
    try:                           # its own process group, so cancel reaches the job's children too
        proc = subprocess.Popen(argv, stdin=devnull, stdout=events, stderr=log, cwd=cwd, start_new_session=True,
                                env={**os.environ, **env} if env else None, pass_fds=(job_lock,))
    except OSError as e:
        log.write(f"cannot start {argv[0]}: {e}\n".encode())
        log.flush()
        _record_exit(run_dir, reserved, 127)
        os._exit(0)
    me = os.getpid()               # (a job that already exited is a zombie until proc.wait: still readable)
    _write_atomic(run_dir / "pid", f"{proc.pid} {me} {_start_time(proc.pid) or 0} {_start_time(me) or 0} {_boot_id()}\n")
    os.write(write_end, str(proc.pid).encode())
    os.close(write_end)
    code = proc.wait()
    _record_exit(run_dir, reserved, code)
    os._exit(0)


def _reserve(path: Path) -> int:
    """A file of RESERVED bytes, written now, that the exit code is later written into in place:
    a job that fills the disk cannot take the room its exit code needs."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b" " * RESERVED)
    os.fsync(fd)
    return fd


def no_space(run_dir: Path) -> str | None:
    """Why a job there may have failed when the disk holding ``run_dir`` is (nearly) full, else None."""
    try:
        st = os.statvfs(run_dir)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free >= LOW_SPACE:
        return None
    return f"no space left on the disk holding {run_dir} ({free:,} bytes free)"


def _record_exit(run_dir: Path, fd: int, code: int, why: str | None = None) -> None:
    """``exit_code``: the code, and on a second line why (``why``, or a full disk) (written into the
    reserved file, then renamed into place: no new block is needed)."""
    why = why or (no_space(run_dir) if code != 0 else None)
    text = (f"{code}\n" + (f"{why}\n" if why else "")).encode()[:RESERVED]
    try:
        os.pwrite(fd, text, 0)
        os.ftruncate(fd, len(text))
        os.fsync(fd)
        os.close(fd)
        os.replace(run_dir / EXIT_RESERVED, run_dir / "exit_code")
    except OSError:
        _write_atomic(run_dir / "exit_code", text.decode())


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "-"


def _started_after(pid: int, when: float) -> bool:
    """Did ``pid`` start after the wall-clock time ``when`` (1 s of slack)?"""
    ticks = _start_time(pid)
    try:
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return False
    return ticks is not None and btime + ticks / os.sysconf("SC_CLK_TCK") > when + 1.0


def _read_pid(pid_file: Path) -> dict | None:
    try:
        fields = pid_file.read_text().split()
        nums = [int(x) for x in fields[:4]]
    except (OSError, ValueError):
        return None
    if len(fields) == 5 and len(nums) == 4:
        return {"pid": nums[0], "supervisor": nums[1], "starts": nums[2:4], "boot_id": fields[4]}
    if len(fields) == 2:           # written by an older version: no start times, no boot id
        return {"pid": nums[0], "supervisor": nums[1], "starts": None, "boot_id": None}
    return None


def _exit_state(code_file: Path) -> dict:
    try:
        first, _, why = code_file.read_text().partition("\n")
        code = int(first.strip())
    except (OSError, ValueError):
        return {"state": "failed", "exit_code": None, "why": f"unreadable {code_file.name}"}
    return {"state": "done" if code == 0 else "failed", "exit_code": code, **({"why": why.strip()} if why.strip() else {})}


def _job_lock_held(run_dir: Path) -> bool:
    """Does a job (or its supervisor) started in ``run_dir`` still live? It holds :data:`JOB_LOCK`."""
    return held(run_dir / JOB_LOCK)


def state(run_dir: Path) -> dict:
    """The job's state. The pid file names it; the job lock says it lives when the pid file cannot
    (lost, unreadable): ``running`` with no pid, never signalled, never started twice."""
    pid_file, code_file = run_dir / "pid", run_dir / "exit_code"
    job = slurm.job_of(run_dir)
    if job is not None:                     # a task of a Slurm job array: Slurm knows, not a pid here
        return slurm.state(run_dir, job, _exit_state)
    if code_file.exists():
        return _exit_state(code_file)
    rec = _read_pid(pid_file) if pid_file.exists() else None
    if rec is None and _job_lock_held(run_dir):
        return {"state": "running", "exit_code": None, "pid": None,
                "why": f"its pid file is {'unreadable' if pid_file.exists() else 'gone'}; it holds {run_dir / JOB_LOCK}"}
    if not pid_file.exists():
        return {"state": "unknown" if run_dir.exists() else "missing", "exit_code": None}
    if rec is None:
        return {"state": "unknown", "exit_code": None, "why": f"unreadable {pid_file}"}
    pid, supervisor = rec["pid"], rec["supervisor"]
    if rec["starts"] is not None:
        if rec["boot_id"] == _boot_id() and (_alive(pid, rec["starts"][0]) or _alive(supervisor, rec["starts"][1])):
            return {"state": "running", "exit_code": None, "pid": pid}   # the supervisor is about to write exit_code
        if code_file.exists():
            return _exit_state(code_file)
        why = ("the host rebooted since the job started" if rec["boot_id"] != _boot_id()
               else no_space(run_dir) or "the job ended without recording an exit code (killed with its supervisor?)")
        return {"state": "lost", "exit_code": None, "pid": pid, "why": why}
    written = pid_file.stat().st_mtime
    suspects = [p for p in (pid, supervisor) if _alive(p) and not _started_after(p, written)]
    if code_file.exists():
        return _exit_state(code_file)
    if not suspects:
        return {"state": "lost", "exit_code": None, "pid": pid, "why": "no process from the pid file is left"}
    return {"state": "unverifiable", "exit_code": None, "pid": suspects[0],
            "why": f"pid {suspects[0]} is alive but {pid_file} has no start time to prove it is this run's job"}


def follow(run_dir: Path, offset: int = 0, poll: float = 0.2, heartbeat: float = 10.0,
           max_line: int = MAX_LINE) -> int:
    """Copy events.jsonl to stdout from byte ``offset`` until the job has ended, then print a
    final ``{"event": "exit", ...}`` line. A heartbeat line every ``heartbeat`` seconds lets the
    reader tell a quiet job from a dead link. Only whole lines are copied; an unterminated last line
    left by a job that ended (killed mid-write) is reported in the exit line as ``torn_tail``.
    Every byte is read once, and a line longer than ``max_line`` is dropped as it grows (counted in
    the exit line's ``dropped_lines``): a huge or endless line costs the host neither memory nor
    CPU again and again."""
    events = run_dir / "events.jsonl"
    last_beat = time.monotonic()           # never the wall clock: a host's may be stepped back (NTP, by hand)
    pos, pending, dropping, dropped = offset, b"", 0, 0     # pending: the unterminated line so far
    told = None                            # what the scheduler said last (a Slurm task)
    scheduled, asked = slurm.job_of(run_dir) is not None, float("-inf")
    unanswered = None                      # since when Slurm has not answered (monotonic)
    while True:
        if time.monotonic() - last_beat > heartbeat:
            print(json.dumps({KEY: HEARTBEAT}), flush=True)
            last_beat = time.monotonic()
        if not scheduled or time.monotonic() - asked >= slurm.POLL:   # Slurm's controller is shared: not 5 times a second
            st, asked = state(run_dir), time.monotonic()
        if "slurm" in st or st.get("unanswered"):
            if st.get("unanswered"):       # unknown, never an answer: the task is waited for, its files never judged
                unanswered = asked if unanswered is None else unanswered
                known = told and told["state"] != "unknown"
                why = (f"{st['why']}; asking again every {slurm.POLL:g} s for up to {slurm.UNANSWERED_WAIT / 60:g} min"
                       + (f" (last known: {told['why'] or told['state']})" if known else ""))
                now = {"state": "unknown", "slurm_state": None, "why": why, "node": None, "job": st["job"]}
            else:
                unanswered = None
                now = {"state": st["state"], "slurm_state": st["slurm"]["state"], "why": st.get("why"),
                       "node": st["slurm"].get("node") or None, "job": st["job"]}
            if now != told and not (told and told["state"] == now["state"] == "unknown"):
                print(json.dumps({KEY: SCHEDULER, **now}), flush=True)
                told = now
            if unanswered is not None and time.monotonic() - unanswered > slurm.UNANSWERED_WAIT:
                print(f"Slurm did not answer for {slurm.UNANSWERED_WAIT / 60:g} min about job {st['job']} "
                      f"({st['unanswered']}); its state is unknown", file=sys.stderr, flush=True)
                return 3                   # no exit line: the follower says the state is not known, attach asks again
        while True:                        # read after the state: once the job has ended this is all of it
            data = _read_from(events, pos, READ_CHUNK)
            if not data:
                break
            pos += len(data)
            *lines, tail = data.split(b"\n")
            out = []
            for line in lines:
                line, pending = pending + line, b""
                if dropping or len(line) > max_line:
                    dropped += 1
                else:
                    out.append(line + b"\n")
                offset += dropping + len(line) + 1
                dropping = 0
            if out:
                sys.stdout.buffer.write(b"".join(out))
                sys.stdout.flush()
            pending += tail
            if dropping or len(pending) > max_line:
                dropping, pending = dropping + len(pending), b""
        if st["state"] not in ("running", "queued") and not st.get("unanswered"):
            end = {KEY: EXIT, **st, "offset": offset}
            if pending or dropping:
                end["torn_tail"] = {"bytes": len(pending) + dropping,
                                    "text": pending[:200].decode("utf-8", "replace")}
            if dropped:
                end["dropped_lines"] = dropped
            print(json.dumps(end), flush=True)
            return 0
        time.sleep(poll)


def _read_from(path: Path, offset: int, limit: int = -1) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(limit)
    except FileNotFoundError:
        return b""


def cancel(run_dir: Path, grace: float = 10.0) -> dict:
    """SIGTERM, then SIGKILL after ``grace`` seconds, to the job's process group; only while the
    process behind the pid file is provably the job (see the module docstring). The answer is the
    job's state, with ``"signalled"``: whether this call signalled it."""
    job = slurm.job_of(run_dir)
    if job is not None:
        return slurm.cancel(run_dir, job, _exit_state)
    st = state(run_dir)
    if st["state"] == "unverifiable":
        return {**st, "why": st["why"] + "; not signalled", "signalled": False}
    if st["state"] != "running":
        return {**st, "signalled": False}              # ended by itself (or never started): left as it is
    rec = _read_pid(run_dir / "pid")
    if rec is None or rec["starts"] is None:
        return {**st, "why": f"{st.get('why') or 'no pid to signal'}; not signalled", "signalled": False}
    pid, start = rec["pid"], rec["starts"][0]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _alive(pid, start):
            break
        try:
            os.killpg(pid, sig)                        # the job leads its own group
        except ProcessLookupError:
            break
        except PermissionError as e:
            return {**st, "why": f"cannot signal process group {pid}: {e}", "signalled": False}
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _alive(pid, start):
            time.sleep(0.1)
    deadline = time.monotonic() + 5                    # the supervisor records the exit code
    while state(run_dir)["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    return {**state(run_dir), "signalled": True}


def digest(folder: Path, names: list[str]) -> dict[str, str | None]:
    """{name: the sha256 of file ``folder/name``, or None when there is no such file}; a name is
    one file in ``folder`` (no separator), else None."""
    out = {}
    for name in names:
        path = folder / name
        if "/" in name or name in ("", ".", "..") or not path.is_file():
            out[name] = None
            continue
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(READ_CHUNK), b""):
                h.update(chunk)
        out[name] = h.hexdigest()
    return out


def prepare(run_dir: Path, argv: list[str], cwd: str | None, env: dict[str, str] | None,
            secrets: dict[str, str] | None, fresh: bool) -> None:
    """A Slurm task's folder made ready for ``run`` (what ``start`` checks, then ``cmd.json``; the
    secrets in a file only its owner reads, never in argv or cmd.json); Slurm starts it later."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        held = _held_before(run_dir) if fresh else None
        if held:
            raise SystemExit(f"{run_dir}: another run's job was started here before ({held}); two runs with the same "
                             f"id? Start the eval again (it gets a new id)")
        st = state(run_dir)
        if st.get("unanswered"):           # a Slurm task of this folder may still be queued or running
            raise SystemExit(f"{run_dir}: {st['why']}: its task may still be queued or running; nothing was submitted "
                             f"(try again once Slurm answers)")
        if st["state"] in ("running", "queued") or _job_lock_held(run_dir):
            raise SystemExit(f"{run_dir}: a job is still {st['state'] if st['state'] == 'queued' else 'running'} "
                             f"there ({st.get('job') or st.get('why') or 'it holds ' + str(run_dir / JOB_LOCK)})")
        (run_dir / slurm.SECRETS).unlink(missing_ok=True)
        if secrets:
            fd = os.open(run_dir / slurm.SECRETS, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(secrets, f)
        _write_atomic(run_dir / "cmd.json", json.dumps({"argv": argv, "cwd": cwd, "env": env or {}}))
    finally:
        os.close(lock)


def run(run_dir: Path) -> int:
    """A Slurm task's body (remote/host/slurm.py's job script execs it on the compute node)."""
    return slurm.run(run_dir, JOB_LOCK, _record_exit, lambda d: _reserve(d / EXIT_RESERVED))


def _env_from_stdin() -> dict[str, str]:
    try:
        env = json.loads(sys.stdin.read() or "{}")
    except json.JSONDecodeError as e:
        raise SystemExit(f"--env-stdin: stdin is not JSON ({e})") from None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise SystemExit("--env-stdin: stdin must be a JSON object of strings")
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m remote.host.launch", description=__doc__)
    p.add_argument("action", choices=("start", "follow", "status", "cancel", "digest", "prepare", "submit", "run"))
    p.add_argument("run_dir", help="the run folder (digest: the folder of the files named after --)")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--cwd", default=None)
    p.add_argument("--env-stdin", action="store_true", help="start: a JSON object of environment variables "
                                                             "for the job on stdin (secrets: never argv)")
    p.add_argument("--fresh", action="store_true", help="start: a new run; refused where another run's job "
                                                         "was started before")
    p.add_argument("--env-json", default=None, help="prepare: a JSON object of environment variables for the job")
    p.add_argument("--slurm-json", default=None, help="submit: {tasks, count, python, code_dir, setup, job_name} "
                                                       "(the sbatch options follow --)")
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    run_dir = Path(args.run_dir).expanduser()
    if args.action == "start":
        if not cmd:
            p.error("start needs -- COMMAND ...")
        env = _env_from_stdin() if args.env_stdin else None
        pid = start(run_dir, cmd, args.cwd, env, fresh=args.fresh)
        if not pid:
            print(f"could not start {cmd[0]} in {run_dir} (see {run_dir / 'worker.log'})", file=sys.stderr)
            return 1
        print(json.dumps({"pid": pid}), flush=True)
    elif args.action == "prepare":
        if not cmd:
            p.error("prepare needs -- COMMAND ...")
        prepare(run_dir, cmd, args.cwd, json.loads(args.env_json) if args.env_json else None,
                _env_from_stdin() if args.env_stdin else None, fresh=args.fresh)
        print(json.dumps({"prepared": str(run_dir)}), flush=True)
    elif args.action == "submit":
        spec = json.loads(args.slurm_json or "{}")
        print(json.dumps(slurm.submit(run_dir, spec["tasks"], spec["count"], cmd, spec["python"], spec["code_dir"],
                                      spec.get("setup"), spec["job_name"])), flush=True)
    elif args.action == "run":
        return run(run_dir)
    elif args.action == "follow":
        return follow(run_dir, args.offset)
    elif args.action == "digest":
        print(json.dumps(digest(run_dir, cmd)))
    elif args.action == "status":
        print(json.dumps({**state(run_dir), **progress(run_dir)}))
    else:
        print(json.dumps({**cancel(run_dir), **progress(run_dir)}))
    return 0


def progress(run_dir: Path, tail: int = 1 << 16) -> dict:
    """``{"done": K, "prompts": N}`` from the job's last progress event (events.jsonl's last 64 KiB),
    or ``{}`` when it has reported none."""
    try:
        with open(run_dir / "events.jsonl", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
            lines = f.read().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and ev.get(KEY) in PROGRESS:
            return {"done": ev.get("done"), "prompts": ev.get("prompts")}
    return {}


if __name__ == "__main__":
    raise SystemExit(main())
