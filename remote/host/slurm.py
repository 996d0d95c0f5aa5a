"""A run's shards as the tasks of one Slurm job array, stdlib only: what runs on the login node
(``submit``, a task's ``state``, ``cancel``) and in each task on its compute node (``run``).

Storage is shared: a shard's run folder (``<workdir>/runs/<run id>[/shard-<k>]``) is the same
folder on the login node and on the node its task runs on. ``submit`` writes the job script into the
run folder and calls ``sbatch --parsable`` with the options as argv items (never a shell line); task
``k`` of the array is shard ``k``. ``slurm.json`` in a shard's folder names its job and task, so the
run control (:mod:`remote.host.launch` ``status``/``follow``/``cancel``) asks Slurm for its state
instead of a pid on this machine. In the task, ``run`` starts the worker as ``start`` would, but in
the foreground (the job is the worker's life), forwards Slurm's signals to it, and records its exit
code and where it ran (``placement.json``). A requeued task (``PREEMPTED``, a node failure,
``scontrol requeue``) runs ``run`` again: the worker's argv carries ``--resume``, so it skips the
prompts it finished.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from remote.host.proc import write_atomic

JOB_FILE = "slurm.json"              # in a task's run folder: {"job": ARRAY JOB ID, "task": K, "submitted": T}
PLACEMENT = "placement.json"         # written by the task on its node when it starts
SCRIPT = "job.sh"                    # in the run's folder: the batch script (fixed text, arguments as argv)
SECRETS = ".secrets.json"            # the worker's secret environment (0600), read by each attempt of a task
POLL = 2.0                           # s between two questions to Slurm while a task is followed
ABSENT_GRACE = 120.0                 # s: a task Slurm no longer knows is judged lost only after its files are this quiet
COMPLETING_WAIT = 60.0               # s a task may stay COMPLETING after its exit code before that code is its end
SIGNAL_AHEAD = 60                    # s before its time limit Slurm sends the task SIGUSR1 (--signal): the worker stops
TIME_LIMIT_NEAR = f"stopped: its time limit was near (Slurm signals {SIGNAL_AHEAD} s ahead)"

# Slurm's job states (squeue %T): those after which nothing more happens to the task
ENDED = {"COMPLETED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "CANCELLED", "BOOT_FAIL", "DEADLINE",
         "REVOKED", "SPECIAL_EXIT"}
QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PREEMPTED", "SUSPENDED", "STOPPED", "RESV_DEL_HOLD",
          "CONFIGURING"}
WHY_ENDED = {
    "TIMEOUT": "it ran into its time limit",
    "OUT_OF_MEMORY": "it ran out of memory",
    "NODE_FAIL": "its node failed",
    "CANCELLED": "it was cancelled in Slurm (scancel)",
    "BOOT_FAIL": "its node failed to boot",
    "DEADLINE": "it reached its deadline",
    "FAILED": "the task failed",
    "REVOKED": "it was revoked (federation)",
    "SPECIAL_EXIT": "it ended in SPECIAL_EXIT (requeue-held by an epilog)",
}

JOB_SCRIPT = """#!/bin/bash
# dflash-ops: one shard of a run, task SLURM_ARRAY_TASK_ID of a Slurm job array (remote/host/slurm.py).
# Arguments: SETUP (a script to source first, or empty), PYTHON, CODE (the worker folder), RUN (the run's
# folder on shared storage), COUNT (shards in the run).
setup=$1 python=$2 code=$3 run=$4 count=$5
if [ -n "$setup" ]; then
    . "$setup" || { echo "dflash-ops: sourcing $setup failed" >&2; exit 97; }
fi
dir=$run
if [ "$count" -gt 1 ]; then dir=$run/shard-$SLURM_ARRAY_TASK_ID; fi
cd "$code" || exit 98
PYTHONPATH=$code exec "$python" -m remote.host.launch run "$dir"
"""


# ----------------------------------------------------------------------------- login node

def submit(run_root: Path, tasks: list[int], count: int, options: list[str], python: str, code_dir: str,
           setup: str | None, job_name: str) -> dict:
    """Submit the tasks ``tasks`` (shard indexes) of a run of ``count`` shards as one job array;
    each task's folder gets its ``slurm.json``. Returns ``{"job": ID, "tasks": [...]}``."""
    for option in options:
        if not option.startswith("--") or "\n" in option:
            raise SystemExit(f"not an sbatch option: {option!r}")
    folders = {k: run_root / f"shard-{k}" if count > 1 else run_root for k in tasks}
    for folder in folders.values():         # an earlier job's, cleared before this one can start and write its own
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("exit_code", PLACEMENT):
            (folder / name).unlink(missing_ok=True)
    script = run_root / SCRIPT
    write_atomic(script, JOB_SCRIPT)
    os.chmod(script, 0o755)
    out = f"{run_root}/slurm-%a.out" if count > 1 else f"{run_root}/slurm.out"
    argv = ["sbatch", "--parsable", f"--job-name={job_name}", f"--array={','.join(map(str, tasks))}",
            f"--output={out}", f"--signal=B:USR1@{SIGNAL_AHEAD}", "--requeue", *options,
            str(script), setup or "", python, code_dir, str(run_root), str(count)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"sbatch refused the job: {_last_line(proc.stderr) or f'exit {proc.returncode}'}")
    job = proc.stdout.strip().split(";")[0]
    if not job.isdigit():
        raise SystemExit(f"sbatch printed no job id ({proc.stdout.strip()[:200]!r})")
    now = time.time()
    for k, folder in folders.items():
        write_atomic(folder / JOB_FILE, json.dumps({"job": job, "task": k, "submitted": now}))
    return {"job": job, "tasks": tasks}


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def job_of(run_dir: Path) -> dict | None:
    """The task's ``slurm.json`` (``job``, ``task``), or None when the folder is not a Slurm task's."""
    try:
        rec = json.loads((run_dir / JOB_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or not str(rec.get("job", "")).isdigit() or not isinstance(rec.get("task"), int):
        return None
    return rec


def task_id(rec: dict) -> str:
    return f"{rec['job']}_{rec['task']}"


def scheduler(rec: dict) -> dict | None:
    """What Slurm says of the task: ``{"state", "reason", "node", "exit", "time_limit", "source"}``
    from ``squeue`` (queued, running and recently ended jobs), else ``sacct`` (accounting), else
    None (Slurm no longer knows it, or has no accounting)."""
    if shutil.which("squeue"):
        proc = _run(["squeue", "--noheader", "--array", "--states=all", f"--jobs={rec['job']}",
                     "--format=%i|%T|%r|%N|%l"])
        found = {}
        for line in proc.stdout.splitlines() if proc and proc.returncode == 0 else []:
            fields = line.strip().split("|")
            if len(fields) == 5 and _covers(fields[0], rec):
                found[fields[0] == task_id(rec)] = {"state": fields[1], "reason": fields[2], "node": fields[3],
                                                    "time_limit": fields[4], "source": "squeue"}
        if found:
            return found.get(True) or found[False]
    if shutil.which("sacct"):
        proc = _run(["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={task_id(rec)}",
                     "--format=JobID,State,Reason,NodeList,ExitCode,Timelimit"])
        for line in proc.stdout.splitlines() if proc and proc.returncode == 0 else []:
            fields = line.strip().split("|")
            if len(fields) >= 6 and fields[0] == task_id(rec):
                return {"state": fields[1].split()[0], "reason": fields[2], "node": fields[3], "exit": fields[4],
                        "time_limit": fields[5], "source": "sacct"}
    return None


def _covers(listed: str, rec: dict) -> bool:
    """Is ``listed`` (an id squeue printed) the task's own line, or a line of its array that stands
    for it: ``J_[0-3,5]`` (tasks not yet split off) or ``J`` (the array's own record: a task never
    started, e.g. cancelled while pending)?"""
    job, task = str(rec["job"]), rec["task"]
    if listed in (f"{job}_{task}", job):
        return True
    if not listed.startswith(f"{job}_[") or not listed.endswith("]"):
        return False
    for part in listed[len(job) + 2:-1].split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (hi or lo).isdigit() and int(lo) <= task <= int(hi or lo):
            return True
    return False


def _run(argv: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _quiet_for(run_dir: Path) -> float:
    """Seconds since anything the task writes last changed (its events, its log), on the clock of
    the storage that holds them (a file touched now: the compute node's and this login node's
    clocks may differ, the file server's is the one both files' times come from)."""
    clock = run_dir / ".now"
    try:
        clock.touch()
        now = clock.stat().st_mtime
    except OSError:
        now = time.time()
    times = []
    for name in ("events.jsonl", "worker.log", PLACEMENT, JOB_FILE):
        try:
            times.append((run_dir / name).stat().st_mtime)
        except OSError:
            pass
    return now - max(times) if times else float("inf")


def state(run_dir: Path, rec: dict, exit_state) -> dict:
    """A task's state in run control's words (:func:`remote.host.launch.state`): ``queued`` (with
    Slurm's reason), ``running`` (with its node), or ended: its exit code's state when it ran to its
    end, else ``failed`` naming Slurm's end state. ``exit_state(path)``: launch's reading of an
    ``exit_code`` file. A task Slurm no longer knows (it left ``squeue`` and there is no
    accounting) is judged by its own files: ended if it wrote an exit code, else running until they
    have been quiet for :data:`ABSENT_GRACE` seconds, then lost."""
    code_file = run_dir / "exit_code"
    sched = scheduler(rec)
    info = {"job": task_id(rec), **({"slurm": sched} if sched else {})}
    if sched is None:
        if code_file.exists():
            return {**exit_state(code_file), **info}
        quiet = _quiet_for(run_dir)
        if quiet < ABSENT_GRACE:
            return {"state": "running", "exit_code": None, **info,
                    "why": f"Slurm no longer lists job {task_id(rec)}; its files changed {quiet:.0f}s ago"}
        return {"state": "lost", "exit_code": None, **info,
                "why": f"Slurm no longer lists job {task_id(rec)} (and has no accounting of it) and it wrote no exit "
                       f"code; its files have been quiet for {quiet:.0f}s"}
    slurm_state = sched["state"]
    if slurm_state in QUEUED:
        held = "held" in sched["reason"].lower() or slurm_state in ("REQUEUE_HOLD", "RESV_DEL_HOLD")
        reason = sched["reason"] if sched["reason"] not in ("", "None", "(null)") else "waiting to start"
        return {"state": "queued", "exit_code": None, **info, "why": f"queued: {reason}"
                + (f" (release it with: scontrol release {task_id(rec)})" if held else "")}
    if slurm_state not in ENDED:                 # RUNNING, COMPLETING, SIGNALING, STAGE_OUT, ...
        if slurm_state == "COMPLETING" and code_file.exists() and time.time() - _mtime(code_file) > COMPLETING_WAIT:
            return {**exit_state(code_file), **info}      # stuck completing: its own exit code tells
        return {"state": "running", "exit_code": None, "node": sched["node"], **info}
    ended = exit_state(code_file) if code_file.exists() else {"state": "failed", "exit_code": None}
    if slurm_state == "COMPLETED":
        return {**ended, **info}
    if ended.get("why") == TIME_LIMIT_NEAR:
        return {**ended, **info, "why": f"Slurm: its time limit ({sched.get('time_limit') or '?'}) was near; the worker "
                                        f"stopped (Slurm signals {SIGNAL_AHEAD} s ahead)"}
    why = f"Slurm: {slurm_state}, {WHY_ENDED.get(slurm_state, 'ended')}"
    if slurm_state == "TIMEOUT" and sched.get("time_limit"):
        why += f" ({sched['time_limit']})"
    if sched.get("exit") and sched["exit"] not in ("0:0", ""):
        why += f", exit code {sched['exit']}"
    return {**ended, "state": "cancelled" if slurm_state == "CANCELLED" else "failed", **info,
            "why": why + (f"; {ended['why']}" if ended.get("why") else "")}


def cancel(run_dir: Path, rec: dict, exit_state, wait: float = 30.0) -> dict:
    """``scancel`` the task (Slurm signals it; its worker stops, its finished rows stay) and wait
    until Slurm says it ended."""
    st = state(run_dir, rec, exit_state)
    if st["state"] not in ("running", "queued"):
        return {**st, "signalled": False}
    proc = _run(["scancel", task_id(rec)])
    if proc is None or proc.returncode != 0:
        return {**st, "why": f"scancel {task_id(rec)} failed: {_last_line(proc.stderr) if proc else 'not run'}",
                "signalled": False}
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        st = state(run_dir, rec, exit_state)
        if st["state"] not in ("running", "queued"):
            break
        time.sleep(0.5)
    return {**st, "signalled": True}


# ----------------------------------------------------------------------------- in the task

def run(run_dir: Path, job_lock_name: str, record_exit, reserve) -> int:
    """The task's body on its node: the worker of ``cmd.json`` in the foreground, its stdout
    appended to events.jsonl and stderr to worker.log, holding the run folder's job lock, with
    Slurm's SIGTERM (``scancel``, the time limit's ``--signal``) passed on to it; its exit code
    recorded as ``start`` records it. Returns that exit code."""
    cmd = json.loads((run_dir / "cmd.json").read_text())
    lock = os.open(run_dir / job_lock_name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"{run_dir}: another job holds {run_dir / job_lock_name}") from None
    (run_dir / "exit_code").unlink(missing_ok=True)
    env = dict(os.environ)
    try:
        env.update(json.loads((run_dir / SECRETS).read_text()))
    except (OSError, ValueError):
        pass
    env.update(cmd.get("env") or {})
    write_atomic(run_dir / PLACEMENT, json.dumps({
        "node": os.environ.get("SLURMD_NODENAME"), "job": os.environ.get("SLURM_ARRAY_JOB_ID"),
        "task": os.environ.get("SLURM_ARRAY_TASK_ID"), "job_id": os.environ.get("SLURM_JOB_ID"),
        "cluster": os.environ.get("SLURM_CLUSTER_NAME"), "partition": os.environ.get("SLURM_JOB_PARTITION"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "job_gpus": os.environ.get("SLURM_JOB_GPUS"), "restarts": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
        "started": time.time()}))
    reserved = reserve(run_dir)
    with open(run_dir / "events.jsonl", "ab") as events, open(run_dir / "worker.log", "ab") as log:
        try:
            proc = subprocess.Popen(cmd["argv"], stdin=subprocess.DEVNULL, stdout=events, stderr=log,
                                    cwd=cmd.get("cwd"), start_new_session=True, env=env, pass_fds=(lock,))
        except OSError as e:
            log.write(f"cannot start {cmd['argv'][0]}: {e}\n".encode())
            record_exit(run_dir, reserved, 127)
            return 127

        near = []

        def pass_on(signum, _frame):
            if signum == signal.SIGUSR1:        # only Slurm's --signal sends it: the time limit comes
                near.append(True)
            try:
                os.killpg(proc.pid, signal.SIGTERM if signum == signal.SIGUSR1 else signum)
                os.killpg(proc.pid, signal.SIGCONT)      # a stopped (suspended) worker ends too
            except ProcessLookupError:
                pass
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, pass_on)
        code = proc.wait()
    record_exit(run_dir, reserved, code, TIME_LIMIT_NEAR if near and code != 0 else None)
    return code
