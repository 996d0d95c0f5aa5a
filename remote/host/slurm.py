"""A run's shards as the tasks of one Slurm job array, stdlib only: what runs on the login node
(``submit``, a task's ``state``, ``cancel``) and in each task on its compute node (``run``).

Storage is shared: a shard's run folder (``<workdir>/runs/<run id>[/shard-<k>]``) is the same
folder on the login node and on the node its task runs on. ``submit`` writes the job script into the
run folder and calls ``sbatch --parsable`` with the options as argv items (never a shell line); task
``k`` of the array is shard ``k``. ``slurm.json`` in a shard's folder names its job and task, so the
run control (:mod:`remote.host.launch` ``status``/``follow``/``cancel``) asks Slurm for its state
instead of a pid on this machine. In the task, ``run`` starts the worker as ``start`` would, but in
the foreground (the job is the worker's life), forwards Slurm's signals to it, and records its exit
code and where it ran (``placement.json``). A requeued task (a node failure, ``scontrol requeue``,
a preemption where PreemptMode=REQUEUE) runs ``run`` again: the worker's argv carries ``--resume``, so it skips the
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

from remote.contract.slurm import ENDED, HELD, NO_REASON, QUEUED, REASONS, SAID_BY_STATE, WAITING, WHY_ENDED
from remote.host.proc import write_atomic

JOB_FILE = "slurm.json"              # a task's run folder: {"job": ARRAY JOB, "task": K, "submitted": T, "name": RUN ID}
PLACEMENT = "placement.json"         # written by the task on its node when it starts
SCRIPT = "job.sh"                    # in the run's folder: the batch script (fixed text, arguments as argv)
SECRETS = ".secrets.json"            # the worker's secret environment (0600), read by each attempt of a task
POLL = 2.0                           # s between two questions to Slurm while a task is followed
ABSENT_GRACE = 120.0                 # s: a task Slurm no longer knows is judged lost only after its files are this quiet
COMPLETING_WAIT = 60.0               # s a task may stay COMPLETING after its exit code before that code is its end
SIGNAL_AHEAD = 60                    # s before its time limit Slurm sends the task SIGUSR1 (--signal): the worker stops
TIME_LIMIT_NEAR = f"stopped: its time limit was near (Slurm signals {SIGNAL_AHEAD} s ahead)"

UNANSWERED_WAIT = 600.0              # s follow waits for Slurm to answer again before it gives up (attach asks again)
SUBMIT_SLACK = 600.0                 # s a job's submit time may precede slurm.json's (sbatch's time, clocks apart)
ASK_TIMEOUT = 45                     # s one squeue/sacct/scancel may take (its retries to a down controller: ~20 s)

UNANSWERED = ("Unable to contact slurm controller", "Socket timed out", "Zero Bytes were transmitted",
              "Connection refused", "Connection timed out", "Communication connection failure", "timed out",
              "Transport endpoint", "Network is unreachable", "No route to host")


class Unanswered(Exception):
    """Slurm did not answer a question (its controller is down or unreachable, a timeout, any
    failure that is not an answer): the task's state is unknown, never taken for an answer."""


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
    each task's folder gets its ``slurm.json``. Returns ``{"job": ID, "tasks": [...]}``.

    An sbatch whose answer was lost (a timeout, the connection dropped: slurmctld may well have
    taken the job) is not taken as a refusal: the job is looked up by its name (the run id, unique
    to the run) with ``squeue --name``, and recorded when found; only where Slurm answers that no
    such job is there is it a refusal (nothing was submitted: the caller may retry)."""
    for option in options:
        if not option.startswith("--") or "\n" in option:
            raise SystemExit(f"not an sbatch option: {option!r}")
    folders = {k: run_root / f"shard-{k}" if count > 1 else run_root for k in tasks}
    known = {str(rec["job"]) for rec in map(job_of, [run_root, *run_root.glob("shard-*")]) if rec}  # the run's jobs
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
    asked = time.time()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        said = _last_line(proc.stderr) or f"exit {proc.returncode}"
        job = proc.stdout.strip().split(";")[0] if proc.returncode == 0 else None
    except subprocess.TimeoutExpired:
        said, job = "sbatch did not answer in 120 s", None
    if job is None and (said.startswith("sbatch did not answer") or _unanswered(said)):
        job = _submitted_as(job_name, asked, known, said)
    elif job is None:
        raise SystemExit(f"sbatch refused the job: {said}")
    if not job.isdigit():
        raise SystemExit(f"sbatch printed no job id ({proc.stdout.strip()[:200]!r})")
    for k, folder in folders.items():
        write_atomic(folder / JOB_FILE, json.dumps({"job": job, "task": k, "submitted": asked, "name": job_name}))
    return {"job": job, "tasks": tasks}


def _unanswered(said: str) -> bool:
    return any(word.lower() in said.lower() for word in UNANSWERED)


def _submitted_as(job_name: str, asked: float, known: set[str], said: str) -> str:
    """The job an sbatch whose answer was lost submitted: the one job named ``job_name``, submitted
    since ``asked`` (less :data:`SUBMIT_SLACK`), not one of this run's earlier jobs (``known``):
    one ``squeue`` lists, not ended, else one in accounting (``sacct``: it ended already). Raises
    SystemExit: a refusal when Slurm lists none, else why it cannot be told."""
    try:
        proc = _ask(["squeue", "--noheader", "--states=all", f"--name={job_name}", "--format=%F|%j|%V|%T"])
    except Unanswered as e:
        raise SystemExit(f"sbatch did not answer ({said}), and Slurm cannot be asked whether it took the job ({e}): a "
                         f"job named {job_name} may be queued; see `squeue --name={job_name}` (scancel it, or wait "
                         f"and attach)") from None
    found = set()
    for line in proc.stdout.splitlines():
        fields = line.strip().split("|")
        if (len(fields) == 4 and fields[1] == job_name and fields[0].isdigit() and fields[0] not in known
                and fields[3] not in ENDED and _epoch(fields[2]) >= asked - SUBMIT_SLACK):
            found.add(fields[0])
    if not found and shutil.which("sacct"):      # gone from squeue already: accounting, where there is one
        since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(asked - SUBMIT_SLACK))
        try:
            proc = _ask(["sacct", "--noheader", "--parsable2", "--allocations", f"--name={job_name}",
                         f"--starttime={since}", "--format=JobID,JobName,Submit"], absent="accounting storage is disabled")
        except Unanswered as e:
            raise SystemExit(f"sbatch did not answer ({said}), squeue lists no job named {job_name} and sacct did not "
                             f"answer ({e}): see `sacct --name={job_name}`") from None
        for line in proc.stdout.splitlines():
            fields = line.strip().split("|")
            job = fields[0].split("_")[0] if fields else ""
            if len(fields) == 3 and fields[1] == job_name and job.isdigit() and job not in known \
                    and _epoch(fields[2]) >= asked - SUBMIT_SLACK:
                found.add(job)
    if len(found) == 1:
        return found.pop()
    if not found:
        raise SystemExit(f"sbatch refused the job: {said} (and Slurm lists no job named {job_name})")
    raise SystemExit(f"sbatch did not answer ({said}), and Slurm lists {len(found)} jobs named {job_name} "
                     f"({', '.join(sorted(found))}): scancel those not wanted")


def _epoch(when: str) -> float:
    """Seconds since the epoch of a time Slurm printed (``2026-12-07T21:32:34``, this host's zone)."""
    try:
        return time.mktime(time.strptime(when.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return float("nan")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def job_of(run_dir: Path) -> dict | None:
    """The task's ``slurm.json`` (``job``, ``task``, ``submitted``, ``name``: the job's name, the
    run id), or None when the folder is not a Slurm task's."""
    try:
        rec = json.loads((run_dir / JOB_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or not str(rec.get("job", "")).isdigit() or not isinstance(rec.get("task"), int):
        return None
    if not isinstance(rec.get("name"), str):      # the run id: the run folder's name
        rec["name"] = (run_dir.parent if run_dir.name.startswith("shard-") else run_dir).name
    return rec


def task_id(rec: dict) -> str:
    return f"{rec['job']}_{rec['task']}"


def scheduler(rec: dict) -> dict | None:
    """What Slurm says of the task: ``{"state", "reason", "node", "exit", "time_limit", "source",
    "name", "submitted"}`` from ``squeue`` (queued, running and recently ended jobs), else ``sacct``
    (accounting), else None (Slurm answered that it no longer knows it, and has no accounting).
    The job Slurm lists under the task's id may be another's (ids wrap at MaxJobId, a controller's
    state reset starts them again): ``foreign`` then says whose, and it is never the task's.
    Raises :class:`Unanswered` when Slurm did not answer."""
    found = {}
    if shutil.which("squeue"):
        proc = _ask(["squeue", "--noheader", "--array", "--states=all", f"--jobs={rec['job']}",
                     "--format=%i|%T|%r|%N|%l|%j|%V"], absent="Invalid job id")
        for line in proc.stdout.splitlines():
            fields = line.strip().split("|")
            if len(fields) == 7 and _covers(fields[0], rec):
                found[fields[0] == task_id(rec)] = {
                    "state": fields[1], "reason": fields[2], "node": fields[3], "time_limit": fields[4],
                    "name": fields[5], "submitted": fields[6], "source": "squeue"}
    if not found and shutil.which("sacct"):
        proc = _ask(["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={task_id(rec)}",
                     "--format=JobID,State,Reason,NodeList,ExitCode,Timelimit,JobName,Submit"],
                    absent="accounting storage is disabled")
        for line in proc.stdout.splitlines():
            fields = line.strip().split("|")
            if len(fields) >= 8 and fields[0] == task_id(rec):
                found[True] = {"state": fields[1].split()[0], "reason": fields[2], "node": fields[3], "exit": fields[4],
                               "time_limit": fields[5], "name": fields[6], "submitted": fields[7], "source": "sacct"}
                break
    if not found:
        return None
    got = found.get(True) or found[False]
    whose = _foreign(got, rec)
    return {**got, "foreign": whose} if whose else got


def _foreign(got: dict, rec: dict) -> str | None:
    """Why the job Slurm listed under the task's id is not the task (another name, or submitted
    before the task was), else None."""
    if got["name"] != rec["name"]:
        return f"it is named {got['name']!r}, this run's is {rec['name']!r}"
    submitted = _epoch(got["submitted"])
    if isinstance(rec.get("submitted"), (int, float)) and submitted < rec["submitted"] - SUBMIT_SLACK:
        return (f"it was submitted at {got['submitted']}, before this run's task was "
                f"({time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(rec['submitted']))})")
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


def _ask(argv: list[str], absent: str | None = None) -> subprocess.CompletedProcess:
    """Run a Slurm command; its answer, or :class:`Unanswered` (a timeout, any failure but the one
    whose message holds ``absent``: Slurm's answer that there is nothing, given as empty output)."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=ASK_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise Unanswered(f"{argv[0]}: no answer in {ASK_TIMEOUT} s") from None
    except OSError as e:
        raise Unanswered(f"{argv[0]}: {e}") from None
    if proc.returncode != 0:
        if absent and absent.lower() in proc.stderr.lower():
            return subprocess.CompletedProcess(argv, 0, "", proc.stderr)
        raise Unanswered(f"{argv[0]}: {_last_line(proc.stderr) or f'exit {proc.returncode}'}")
    return proc


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


def _reason(reason: str) -> str | None:
    """Slurm's reason as said (None where it gives none: ``None``, ``(null)``), explained where
    :data:`REASONS` has words for it."""
    if reason.strip() in NO_REASON:
        return None
    extra = REASONS.get(reason.strip())
    return f"{reason.strip()}: {extra}" if extra else reason.strip()


def state(run_dir: Path, rec: dict, exit_state) -> dict:
    """A task's state in run control's words (:func:`remote.host.launch.state`): ``queued`` (waiting
    on the scheduler, each of :data:`WAITING` told as itself, with Slurm's reason), ``running``
    (with its node), or ended: its exit code's state when it ran to its end, else ``failed`` (or
    ``cancelled``) naming Slurm's end state and reason. ``exit_state(path)``: launch's reading of
    an ``exit_code`` file.

    ``unknown`` (with ``unanswered``) when Slurm did not answer: never judged by the task's files.
    ``lost`` (with ``foreign``) when the job Slurm lists under the task's id is another's: the task
    is gone. A task Slurm answers it no longer knows (it left ``squeue`` and there is no
    accounting) is judged by its own files: ended if it wrote an exit code, else running until
    they have been quiet for :data:`ABSENT_GRACE` seconds, then lost."""
    code_file = run_dir / "exit_code"
    try:
        sched = scheduler(rec)
    except Unanswered as e:
        return {"state": "unknown", "exit_code": None, "job": task_id(rec), "unanswered": str(e),
                "why": f"Slurm did not answer about job {task_id(rec)} ({e})"}
    info = {"job": task_id(rec), **({"slurm": sched} if sched else {})}
    if sched is not None and sched.get("foreign"):
        ended = exit_state(code_file) if code_file.exists() else {"state": "lost", "exit_code": None}
        return {**ended, **info, "foreign": sched["foreign"],
                "why": f"job {task_id(rec)} in Slurm is not this run's task ({sched['foreign']}; job ids are reused "
                       f"after MaxJobId or a controller's state reset): the task is gone; that job is left alone"}
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
    slurm_state, reason = sched["state"], _reason(sched["reason"])
    if slurm_state in QUEUED:
        held = slurm_state in HELD or "held" in (reason or "").lower()
        if slurm_state in ("SUSPENDED", "STOPPED"):
            why = WAITING[slurm_state] + (f" (on {sched['node']})" if sched.get("node") else "")
        else:
            why = f"{WAITING[slurm_state]}: {reason or 'Slurm gave no reason yet'}"
        return {"state": "queued", "exit_code": None, **info, "why": why
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
    why = f"Slurm: {slurm_state}, {WHY_ENDED[slurm_state]}"
    if slurm_state == "TIMEOUT" and sched.get("time_limit"):
        why += f" ({sched['time_limit']})"
    if reason and sched["reason"].strip() not in SAID_BY_STATE:
        why += f"; reason {reason}"
    if sched.get("exit") and sched["exit"] not in ("0:0", ""):
        why += f", exit code {sched['exit']}"
    return {**ended, "state": "cancelled" if slurm_state == "CANCELLED" else "failed", **info,
            "why": why + (f"; {ended['why']}" if ended.get("why") else "")}


def cancel(run_dir: Path, rec: dict, exit_state, wait: float = 30.0) -> dict:
    """``scancel`` the task (Slurm signals it; its worker stops, its finished rows stay) and wait
    until Slurm says it ended. Only the task itself: ``scancel --name`` with the run id, and never
    a job :func:`state` found another's (``foreign``). ``unconfirmed`` says why the cancel is not
    known done (Slurm did not answer, or has not said the task ended)."""
    st = state(run_dir, rec, exit_state)
    if st["state"] not in ("running", "queued"):
        return {**st, "signalled": False, **({"unconfirmed": st["why"]} if st["state"] == "unknown" else {})}
    try:
        _ask(["scancel", f"--name={rec['name']}", task_id(rec)])
    except Unanswered as e:
        return {**st, "why": f"scancel {task_id(rec)}: Slurm did not answer ({e})", "signalled": False,
                "unconfirmed": f"scancel {task_id(rec)}: Slurm did not answer ({e})"}
    deadline = time.monotonic() + wait
    while True:
        st = state(run_dir, rec, exit_state)
        if st["state"] not in ("running", "queued", "unknown") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if st["state"] in ("running", "queued", "unknown"):
        return {**st, "signalled": True, "unconfirmed": f"scancel {task_id(rec)} was sent, but Slurm has not said that "
                                                        f"it ended ({st.get('why') or st['state']})"}
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
