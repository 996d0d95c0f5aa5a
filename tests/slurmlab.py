"""A real Slurm cluster for tests: ``munged``, ``slurmctld`` and one ``slurmd`` (Debian's
``slurm-wlm`` and ``munge``), as root, cgroup-free (``proctrack/linuxproc``, ``task/none``), in a
folder of their own: their own munge key and socket, ports, state and logs; nothing under /etc is
used. The node has ``Gres=gpu:2`` whose ``gres.conf`` points at two placeholder character devices,
so each task of a job array gets its own ``CUDA_VISIBLE_DEVICES`` on a CPU machine.

``SLURM_CONF`` names the config for the commands (sbatch, squeue, ...): set in this process for the
``local`` login host, and by an extra sshd's ``SetEnv`` for a login host of the SSH lab. The
controller listens on every address; ``address`` is the one its clients are given (an SSH lab
host's namespace reaches the root namespace at its veth's address).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

NODE = "node1"
PARTITION = "gpu"
URGENT = "urgent"        # a partition of the same node, a higher tier: its jobs preempt (cancel) gpu's


class SlurmLabError(RuntimeError):
    pass


def available() -> str | None:
    """Why the lab cannot start here, or None."""
    missing = [t for t in ("munged", "slurmctld", "slurmd", "sbatch") if not shutil.which(t)
               and not Path(f"/usr/sbin/{t}").exists()]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class SlurmLab:
    base: Path
    address: str
    conf: Path

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env})
        if check and proc.returncode != 0:
            raise SlurmLabError(f"{' '.join(argv)}: {proc.stderr.strip()}")
        return proc

    def node_state(self) -> str:
        return self.run("sinfo", "--noheader", "--Node", "--format=%t").stdout.strip()

    def set_partition(self, state: str) -> None:
        self.run("scontrol", "update", f"PartitionName={PARTITION}", f"State={state}")

    def set_node(self, state: str, reason: str = "test", check: bool = True) -> None:
        self.run("scontrol", "update", f"NodeName={NODE}", f"State={state}",
                 *([f"Reason={reason}"] if state.lower() in ("down", "drain") else []), check=check)

    def wait_idle(self, timeout: float = 60) -> None:
        """Until the node takes jobs again (after a test set it down or drained it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.node_state()
            if state.startswith(("idle", "mix", "alloc")):
                return
            if state.startswith(("down", "drain")):
                self.set_node("RESUME", check=False)     # refused while Slurm is still taking it down
            time.sleep(0.5)
        raise SlurmLabError(f"node {NODE} did not come back ({self.node_state()})")

    @contextlib.contextmanager
    def urgent(self):
        """A second partition of the node, of a higher tier, while the block runs (created and
        deleted then, so that sinfo shows it only meanwhile): with PreemptMode=CANCEL a job of it
        that needs the node preempts, i.e. cancels, the jobs of the default partition there."""
        self.run("scontrol", "create", f"PartitionName={URGENT}", f"Nodes={NODE}", "PriorityTier=2", "State=UP",
                 "MaxTime=INFINITE")
        try:
            yield URGENT
        finally:
            self.run("scancel", f"--partition={URGENT}", check=False)
            self.run("scontrol", "delete", f"PartitionName={URGENT}", check=False)

    def stop_controller(self) -> None:
        """slurmctld stopped (its state saved): the commands then fail as on a cluster whose
        controller is down or unreachable (``Unable to contact slurm controller``)."""
        pid = int((self.base / "run" / "slurmctld.pid").read_text().split()[0])
        os.kill(pid, 15)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        raise SlurmLabError(f"slurmctld (pid {pid}) did not stop")

    def start_controller(self) -> None:
        """slurmctld started again from its saved state (its jobs as they were)."""
        proc = subprocess.run([_bin("slurmctld"), "-f", str(self.conf)], env={**os.environ, **self.env},
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SlurmLabError(f"slurmctld: {proc.stderr.strip()}")
        deadline = time.monotonic() + 60
        while self.run("squeue", "--noheader", check=False, timeout=30).returncode != 0:
            if time.monotonic() > deadline:
                raise SlurmLabError("slurmctld did not answer after its restart")
            time.sleep(0.3)

    def cancel_all(self) -> None:
        self.run("scancel", "--full", "--user=root", check=False)

    def close(self) -> None:
        for pidfile in ("slurmd.pid", "slurmctld.pid", "munged.pid"):
            try:
                pid = int((self.base / "run" / pidfile).read_text().split()[0])
                os.kill(pid, 15)
            except (OSError, ValueError, IndexError):
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(self._alive(p) for p in ("slurmd.pid", "slurmctld.pid")):
            time.sleep(0.1)

    def _alive(self, pidfile: str) -> bool:
        try:
            os.kill(int((self.base / "run" / pidfile).read_text().split()[0]), 0)
            return True
        except (OSError, ValueError, IndexError):
            return False


def start(base: Path, address: str = "127.0.0.1") -> SlurmLab:
    why = available()
    if why:
        raise SlurmLabError(why)
    base = Path(base)
    for d in ("state", "spool", "log", "run", "dev"):
        (base / d).mkdir(parents=True, exist_ok=True)
    for i in range(2):
        dev = base / "dev" / f"gpu{i}"
        if not dev.exists():
            subprocess.run(["mknod", str(dev), "c", "1", "3"], check=True)
    key = base / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    sock = base / "run" / "munge.sock"
    subprocess.run([_bin("munged"), "--force", f"--socket={sock}", f"--key-file={key}",
                    f"--pid-file={base / 'run' / 'munged.pid'}", f"--log-file={base / 'log' / 'munged.log'}",
                    f"--seed-file={base / 'run' / 'munge.seed'}"], check=True, capture_output=True)
    host = socket.gethostname()
    ctld, slurmd = _free_port(), _free_port()
    conf = base / "slurm.conf"
    conf.write_text(f"""ClusterName=lab
SlurmctldHost={host}({address})
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={base / 'state'}
SlurmdSpoolDir={base / 'spool'}
SlurmctldPidFile={base / 'run' / 'slurmctld.pid'}
SlurmdPidFile={base / 'run' / 'slurmd.pid'}
SlurmctldLogFile={base / 'log' / 'slurmctld.log'}
SlurmdLogFile={base / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
MpiDefault=none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
SchedulerParameters=sched_interval=1
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
PlugStackConfig={base / 'plugstack.conf'}
NodeName={NODE} NodeHostname={host} NodeAddr={address} CPUs=2 RealMemory=2000 Gres=gpu:2 State=UNKNOWN
PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE State=UP PriorityTier=1
""")
    (base / "gres.conf").write_text(f"NodeName={NODE} Name=gpu File={base / 'dev'}/gpu[0-1]\n")
    (base / "plugstack.conf").write_text("")
    lab = SlurmLab(base, address, conf)
    env = {**os.environ, **lab.env}
    for argv in ([_bin("slurmctld"), "-i", "-f", str(conf)], [_bin("slurmd"), "-f", str(conf), "-N", NODE]):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            lab.close()
            raise SlurmLabError(f"{argv[0]}: {proc.stderr.strip()}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%t"], env=env, capture_output=True, text=True)
        if got.returncode == 0 and got.stdout.strip().startswith("idle"):
            return lab
        time.sleep(0.3)
    lab.close()
    raise SlurmLabError(f"the node did not come up: {(base / 'log' / 'slurmd.log').read_text()[-500:]}")
