"""A Slurm cluster as an eval host (inventory ``kind: slurm``): the control side.

Everything goes through the cluster's login host (``login:``, an SSH host of the inventory or
``local``): the worker ships to ``workdir`` there (storage the compute nodes see too), pre-flight
runs there, and a run's shards on the cluster are the tasks of one **job array** (task ``k`` is
shard ``k``), submitted by ``python -m remote.host.launch submit`` with the inventory's job
settings as sbatch options. Each task runs the worker on its compute node in the foreground
(:mod:`remote.host.slurm`); its events land in the shard's run folder on shared storage, where
``follow`` on the login node reads them, and its state is what Slurm says (queued with Slurm's
reason, running on a node, ended with Slurm's end state), so ``attach``, ``cancel`` (``scancel``)
and ``eval --resume`` (a new job for the shards left) work as on an SSH host.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from remote.contract.slurm import ENDED, NO_REASON

from ..errors import OperationFailed
from ..transport import Runner, TransportError, runner_for
from .jobs import HostJob

if TYPE_CHECKING:  # pragma: no cover
    from ..config.inventory import Host, Inventory
    from ..runs.record import RunRecord, Shard


class SlurmError(OperationFailed):
    """The cluster could not be asked, or refused a job."""


def login_runner(host: "Host", inventory: "Inventory | None") -> Runner:
    """The runner of the cluster's login host, where its commands run."""
    if inventory is None:
        raise SlurmError(f"host {host.name}: a Slurm cluster needs the inventory (its login host)")
    host.refuse_example()
    return runner_for(inventory.get(host.slurm.login), inventory)


def login_python(host: "Host", inventory: "Inventory") -> str:
    """The login host's python (the run control there is stdlib only)."""
    return inventory.get(host.slurm.login).python


@dataclass
class Partition:
    name: str
    up: bool
    nodes: list[dict]            # {"name", "state", "cpus", "gpus"}

    @property
    def gpus(self) -> int:
        return sum(n["gpus"] for n in self.nodes)


@dataclass
class Cluster:
    version: str                 # "22.05.8"
    name: str | None             # ClusterName
    partitions: list[Partition]
    default: str | None          # the default partition

    def partition(self, name: str | None) -> Partition | None:
        return next((p for p in self.partitions if p.name == (name or self.default)), None)


def _gres_gpus(gres: str) -> int:
    """GPUs in a node's GRES (``gpu:2``, ``gpu:a100:4(S:0-1)``, ``gpu:2,shard:8``)."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def cluster_info(host: "Host", runner: Runner) -> Cluster:
    """The cluster as its login host sees it: Slurm's version, its name, each partition's nodes
    with their state, CPUs and GPUs (``sinfo``)."""
    version = runner.run(["sinfo", "--version"], timeout=60)
    if version.returncode in (126, 127) or not version.ok and "not found" in version.stderr:
        raise SlurmError(f"host {host.name}: no Slurm commands on its login host {host.slurm.login} (sinfo not found)")
    if not version.ok:
        raise SlurmError(f"host {host.name}: sinfo failed on {host.slurm.login}: {_tail(version.stderr)}")
    nodes = runner.run(["sinfo", "--noheader", "--Node", "--format=%P|%a|%N|%t|%c|%G"], timeout=60)
    if not nodes.ok:
        raise SlurmError(f"host {host.name}: sinfo failed on {host.slurm.login}: {_tail(nodes.stderr)}")
    partitions: dict[str, Partition] = {}
    default = None
    for line in nodes.stdout.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 6:
            continue
        pname, avail, node, st, cpus, gres = fields
        if pname.endswith("*"):
            pname = default = pname[:-1]
        part = partitions.setdefault(pname, Partition(pname, avail == "up", []))
        part.nodes.append({"name": node, "state": st, "cpus": int(cpus) if cpus.isdigit() else 0,
                           "gpus": _gres_gpus(gres)})
    name = None
    config = runner.run(["scontrol", "show", "config"], timeout=60)
    for line in config.stdout.splitlines() if config.ok else []:
        key, _, value = line.partition("=")
        if key.strip() == "ClusterName":
            name = value.strip()
    return Cluster(version=version.stdout.split()[-1] if version.stdout.split() else "?", name=name,
                   partitions=list(partitions.values()), default=default)


def _tail(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


@dataclass
class SlurmJob(HostJob):
    """A shard that is a task of a job array: run control through the login host (``python``:
    the login host's), the worker run by ``job_python`` on a compute node once Slurm starts it."""
    job_python: str = "python3"

    def start(self, worker_args: list[str], secrets: dict[str, str] | None = None,
              env: dict[str, str] | None = None, fresh: bool = False) -> int:
        """Make the task's folder ready (``cmd.json``); :func:`submit` then starts the tasks. The
        worker always resumes: a task Slurm requeues starts again and skips what it finished."""
        argv = [self.job_python, "-m", "remote.worker", *worker_args]
        if "--resume" not in argv:
            argv.append("--resume")
        flags = ("--env-stdin",) * bool(secrets) + ("--fresh",) * fresh
        res = self._launch("prepare", self.run_dir, "--cwd", self.code_dir, "--env-json", json.dumps(env or {}),
                           *flags, "--", *argv, input=json.dumps(secrets) if secrets else None)
        if not res.ok:
            raise TransportError(f"could not prepare the worker's folder: {res.stderr.strip()[-500:]}")
        return 0


def submit(record: "RunRecord", host: "Host", shards: list["Shard"], runner: Runner, python: str, code_dir: str,
           gpus_per_task: int, cluster: Cluster | None = None) -> str:
    """One job array for ``shards`` (task k = shard k) of ``record`` on cluster ``host``; each
    shard records its job. Returns the job id."""
    run_root = f"{host.workdir.rstrip('/')}/runs/{record.id}"
    spec = {"tasks": [s.index for s in shards], "count": shards[0].count, "python": host.python,
            "code_dir": code_dir, "setup": host.slurm.setup, "job_name": record.id}
    res = runner.run([python, "-m", "remote.host.launch", "submit", run_root, "--slurm-json", json.dumps(spec),
                      "--", *host.slurm.sbatch_options(gpus_per_task)],
                     timeout=180, env={"PYTHONPATH": code_dir}, cwd=code_dir)
    if not res.ok:
        raise SlurmError(f"host {host.name}: {_tail(res.stderr)}")
    job = json.loads(res.stdout.strip().splitlines()[-1])["job"]
    for s in shards:
        s.slurm = {"job": job, "task": s.index, "login": host.slurm.login,
                   "partition": host.slurm.partition or (cluster.default if cluster else None),
                   **({"cluster": cluster.name, "version": cluster.version} if cluster else {})}
    return job


PROBE_SCRIPT = """#!/bin/bash
# dflash-ops hosts check: the compute nodes' python and whether they see the workdir (a file there).
setup=$1 python=$2 out=$3
if [ -n "$setup" ]; then . "$setup" || exit 97; fi
exec "$python" -c '
import importlib, json, os, sys
found = {"node": os.environ.get("SLURMD_NODENAME")}
for name in ("torch", "transformers"):
    try:
        found[name] = importlib.import_module(name).__version__
    except Exception:
        found[name] = None
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(found, f)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
' "$out"
"""


CHECK_JOB = "dflash-ops-check"        # the job name of `hosts check`'s job


def probe_job(host: "Host", runner: Runner, timeout: float, poll: float = 2.0) -> dict:
    """Run a tiny CPU job that imports the worker's packages with the inventory's python on a
    compute node and writes what it found into ``workdir``; read back here, that file also proves
    the login host and the nodes share ``workdir``. The job is submitted with a known id
    (``sbatch --parsable``), waited on by asking Slurm for its state, and cancelled
    (``scancel --name``) when it has not ended within ``timeout`` seconds (at least 30): on a busy
    cluster no check job stays queued to start after its folder is gone. ``{"error": ...}`` when it
    could not."""
    import secrets
    import time

    folder = f"{host.workdir.rstrip('/')}/.slurm-probe/{secrets.token_hex(6)}"
    script, marker = f"{folder}/probe.sh", f"{folder}/found.json"
    opts = [o for o in host.slurm.sbatch_options(0) if not o.startswith("--time=")]
    wait = max(timeout, 30)
    try:
        runner.run(["mkdir", "-p", folder], timeout=30, check=True)
        runner.put_text(PROBE_SCRIPT, script)
        runner.run(["chmod", "755", script], timeout=30, check=True)
        res = runner.run(["sbatch", "--parsable", f"--job-name={CHECK_JOB}", "--time=5", f"--output={folder}/slurm.out",
                          *opts, script, host.slurm.setup or "", host.python, marker], timeout=60)
        job = res.stdout.strip().split(";")[0] if res.ok else ""
        if not job.isdigit():
            return {"error": f"the check job was not submitted: {_tail(res.stderr or res.stdout)}"}
        deadline, state, reason = time.monotonic() + wait, "PENDING", ""
        while state not in ENDED:
            if time.monotonic() > deadline:
                stop = runner.run(["scancel", f"--name={CHECK_JOB}", job], timeout=60)
                return {"error": f"the check job {job} did not end within {wait:.0f} s ({state}"
                                 + (f": {reason}" if reason not in NO_REASON else "") + "); "
                                 + ("cancelled" if stop.ok else f"scancel {job} failed ({_tail(stop.stderr)}): it may "
                                                                f"still start")
                                 + " (`hosts check --timeout S` waits longer)"}
            time.sleep(poll)
            q = runner.run(["squeue", "--noheader", "--states=all", f"--jobs={job}", "--format=%T|%r"], timeout=60)
            if q.ok and q.stdout.strip():
                state, _, reason = q.stdout.strip().splitlines()[0].partition("|")
            elif q.ok or "Invalid job id" in q.stderr:
                break                   # it left squeue: ended (its file says how)
        if state not in ("COMPLETED", "PENDING", "RUNNING"):
            return {"error": f"the check job {job} ended {state}"
                             + (f" ({reason})" if reason not in NO_REASON else "")
                             + f": {_tail(_read(runner, f'{folder}/slurm.out'))}"}
        try:
            return json.loads(runner.read_text(marker))
        except (TransportError, ValueError):
            return {"error": f"the check job ran, but its file is not in {host.workdir} on the login host: workdir "
                             f"must be storage the login host and the compute nodes both see"}
    except TransportError as e:
        return {"error": f"the check job: {e}"}
    finally:
        try:
            runner.run(["rm", "-rf", "--", folder], timeout=30)
        except TransportError:
            pass


def _read(runner: Runner, path: str) -> str:
    try:
        return runner.read_text(path)
    except (TransportError, ValueError):
        return ""
