"""A lab of real OpenSSH servers for tests: hosts `train` and `eval`.

Each host is an sshd in its own network namespace (veth pair to the root namespace, no route
between the two namespaces), so train and eval cannot reach each other while the test process
reaches both. Where namespaces are not permitted the hosts fall back to loopback addresses
(127.0.0.2 / 127.0.0.3), and ``lab.isolated`` is False.

Every lab records what it started in ``REGISTRY/<id>.json``; a later lab removes leftovers of
crashed runs (owner pid dead) by those records. Teardown is by pidfile, then ``ip netns del``.
"""
from __future__ import annotations

import atexit
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from remote.host.proc import alive as live_process   # /proc's view: a zombie is not live

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
REGISTRY = Path(os.environ.get("DFLASH_OPS_LAB_REGISTRY", "/tmp/dflash-ops-sshlab"))
HOST_NAMES = ("train", "eval")


class LabError(RuntimeError):
    pass


def _run(argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


@dataclass
class LabHost:
    name: str
    address: str
    port: int
    user: str
    host_key: Path  # private host key file; host_key_pub is its public line
    host_key_pub: str
    root: Path  # this host's data root on disk (the namespace shares the filesystem)
    netns: str | None
    veth: str | None  # root-namespace side of the veth pair
    config: Path
    pidfile: Path
    log: Path
    authorized_keys: Path | None = None  # this host's own file, read after the lab's shared one

    @property
    def known_hosts_name(self) -> str:
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"

    @property
    def login_home(self) -> str:
        """The home its sshd logs the lab's user into (the password database's, as sshd reads it),
        whatever ``HOME`` this process has."""
        import pwd

        return pwd.getpwnam(self.user).pw_dir

    def sshd_pid(self) -> int | None:
        try:
            return int(self.pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


@dataclass
class SSHLab:
    base: Path
    lab_id: str
    isolated: bool  # True: network namespaces; False: loopback fallback
    fallback_reason: str | None
    client_key: Path
    known_hosts: Path
    hosts: dict[str, LabHost] = field(default_factory=dict)
    _closed: bool = False

    @property
    def train(self) -> LabHost:
        return self.hosts["train"]

    @property
    def eval(self) -> LabHost:
        return self.hosts["eval"]

    def inventory_dict(self, **overrides) -> dict:
        """Inventory data for the two hosts. ``overrides``: ``train={...}``, ``eval={...}``
        (merged into that host; a value None removes the field) or ``extra={name: {...}}``."""
        hosts = {}
        for h in self.hosts.values():
            entry = {
                "address": h.address, "port": h.port, "user": h.user,
                "identity": str(self.client_key), "known_hosts": str(self.known_hosts),
                "roles": [h.name], "python": sys.executable,
                "workdir": str(h.root / "workdir"), "checkpoints": str(h.root / "checkpoints"),
            }
            if h.authorized_keys:
                entry["authorized_keys"] = str(h.authorized_keys)
            for k, v in (overrides.get(h.name) or {}).items():
                if v is None:
                    entry.pop(k, None)
                else:
                    entry[k] = v
            hosts[h.name] = entry
        hosts.update(overrides.get("extra") or {})
        return {"hosts": hosts}

    def write_inventory(self, path: str | os.PathLike, **overrides) -> Path:
        path = Path(path)
        path.write_text(yaml.safe_dump(self.inventory_dict(**overrides), sort_keys=False))
        return path

    def exec_in(self, host: LabHost | str, argv: list[str], timeout: float = 30,
                check: bool = False) -> subprocess.CompletedProcess:
        """Run argv inside the host's network namespace (in the root namespace in fallback mode)."""
        h = self.hosts[host] if isinstance(host, str) else host
        full = ["ip", "netns", "exec", h.netns, *argv] if h.netns else list(argv)
        return _run(full, check=check, timeout=timeout)

    def stop_sshd(self, host: LabHost | str) -> None:
        """Stop the host's sshd; its open sessions keep running (as with a restarted sshd)."""
        h = self.hosts[host] if isinstance(host, str) else host
        _stop_pidfile(h.pidfile)

    def start_sshd(self, host: LabHost | str) -> None:
        h = self.hosts[host] if isinstance(host, str) else host
        self.exec_in(h, [SSHD, "-f", str(h.config), "-E", str(h.log)], check=True)
        _wait_listening(h)

    def link_down(self, host: LabHost | str) -> None:
        self._link(host, "down")

    def link_up(self, host: LabHost | str) -> None:
        self._link(host, "up")

    def _link(self, host: LabHost | str, state: str) -> None:
        h = self.hosts[host] if isinstance(host, str) else host
        if not h.veth:
            raise LabError(f"link_{state} needs network namespaces ({self.fallback_reason})")
        _run(["ip", "link", "set", h.veth, state])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _teardown(self._record())
        try:
            (REGISTRY / f"{self.lab_id}.json").unlink()
        except FileNotFoundError:
            pass

    def _record(self) -> dict:
        return {
            "owner": os.getpid(),
            "netns": [h.netns for h in self.hosts.values() if h.netns],
            "veth": [h.veth for h in self.hosts.values() if h.veth],
            "pidfiles": [str(h.pidfile) for h in self.hosts.values()],
        }

    def _save_record(self) -> None:
        REGISTRY.mkdir(parents=True, exist_ok=True)
        (REGISTRY / f"{self.lab_id}.json").write_text(json.dumps(self._record()))


class ExtraSshd:
    """One more sshd on a lab host (in its network namespace), on ``port``, with host key ``key``
    (a private key file), the lab's authorized keys, ``config`` (more sshd_config lines) and ``env``
    (more variables for its sessions);
    stopping it leaves its open sessions running. On the host's own port (its sshd stopped first)
    it is an impostor of that host."""

    def __init__(self, lab: SSHLab, host: LabHost | str, port: int, key: Path, base: Path, config: str = "",
                 env: dict[str, str] | None = None):
        self.lab, self.host = lab, lab.hosts[host] if isinstance(host, str) else host
        self.port, self.key, self.base, self.config, self.env = port, key, base, config, env
        self.pidfile: Path | None = None

    def start(self) -> "ExtraSshd":
        h, d = self.host, self.base / f"sshd-{self.host.name}-{self.key.name}"
        d.mkdir(exist_ok=True)
        self.pidfile = d / "pid"
        cfg = d / "sshd_config"
        cfg.write_text(sshd_config(port=self.port, address=h.address, host_key=self.key, pidfile=self.pidfile,
                                   authorized_keys=f"{self.lab.base / 'authorized_keys'} {h.authorized_keys}",
                                   env=self.env) + self.config)
        self.lab.exec_in(h, [SSHD, "-f", str(cfg), "-E", str(d / "log")], check=True)
        _wait_listening(replace(h, port=self.port, log=d / "log"))
        return self

    def stop(self) -> None:
        if self.pidfile is not None and self.pidfile.exists():
            _stop_pidfile(self.pidfile)


def _stop_pidfile(pidfile: Path) -> None:
    pid = int(pidfile.read_text().split()[0])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


# --- teardown ------------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie (a daemon's parent is init, which may reap it late)."""
    return not live_process(pid)


def _kill(pids: list[int]) -> None:
    """SIGTERM to each, a second for all of them to end, then SIGKILL to those still running."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 1
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in pids:
        if not _gone(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _teardown(record: dict) -> None:
    sshds = []
    for pf in record.get("pidfiles", []):
        try:
            sshds.append(int(Path(pf).read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            continue
    _kill(sshds)
    for ns in record.get("netns", []):
        # sessions forked by sshd are still in the namespace: end them, then remove it
        pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
        _kill([int(pid) for pid in pids if pid.isdigit() and int(pid) != os.getpid()])
        _run(["ip", "netns", "del", ns], check=False)
    for dev in record.get("veth", []):
        _run(["ip", "link", "del", dev], check=False)  # normally gone with the namespace


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_labs() -> int:
    """Tear down labs whose owning process is gone (crashed runs). Returns how many."""
    n = 0
    if not REGISTRY.is_dir():
        return 0
    for rec_file in REGISTRY.glob("*.json"):
        try:
            record = json.loads(rec_file.read_text())
        except (OSError, ValueError):
            continue
        if _alive(int(record.get("owner", 0) or 0)):
            continue
        _teardown(record)
        rec_file.unlink(missing_ok=True)
        n += 1
    return n


# --- start ---------------------------------------------------------------------------------


def _netns_permitted(probe_name: str) -> tuple[bool, str | None]:
    if os.environ.get("DFLASH_OPS_LAB_NETNS") == "0":
        return False, "DFLASH_OPS_LAB_NETNS=0"
    if os.geteuid() != 0:
        return False, "not root"
    if shutil.which("ip") is None:
        return False, "iproute2 (`ip`) is not installed"
    proc = _run(["ip", "netns", "add", probe_name], check=False)
    if proc.returncode != 0:
        return False, f"`ip netns add` not permitted: {proc.stderr.strip()}"
    _run(["ip", "netns", "del", probe_name], check=False)
    return True, None


def _used_ipv4() -> set[str]:
    out = _run(["ip", "-o", "-4", "addr", "show"], check=False).stdout
    return {w.split("/")[0] for line in out.splitlines() for w in line.split()[3:4]}


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _wait_listening(host: LabHost, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.address, host.port), timeout=1) as s:
                if s.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            time.sleep(0.05)
    log = host.log.read_text() if host.log.exists() else ""
    raise LabError(f"sshd for lab host {host.name} did not come up on {host.address}:{host.port}: {log[-500:]}")


SSHD_CONFIG = """\
Port {port}
ListenAddress {address}
HostKey {host_key}
PidFile {pidfile}
AuthorizedKeysFile {authorized_keys}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
PermitUserEnvironment no
UsePAM no
StrictModes no
AllowTcpForwarding yes
MaxStartups 50:30:100
MaxSessions 50
Subsystem sftp internal-sftp
SetEnv OMP_NUM_THREADS={threads}{env}
"""


def sshd_config(**fields) -> str:
    """A lab host's sshd_config; its sessions get this test process's torch threads (SetEnv;
    tests/conftest.py sets one)."""
    env = "".join(f" {k}={v}" for k, v in (fields.pop("env", None) or {}).items())   # one SetEnv line: sshd uses the first
    return SSHD_CONFIG.format(threads=os.environ.get("OMP_NUM_THREADS", "1"), env=env, **fields)


def start_lab(base: str | os.PathLike) -> SSHLab:
    if not os.path.exists(SSHD):
        raise LabError("OpenSSH server not installed (apt-get install -y openssh-server)")
    clean_stale_labs()
    base = Path(base)
    base.mkdir(parents=True, exist_ok=True)
    lab_id = f"{os.getpid():x}{secrets.token_hex(2)}"[-6:]
    isolated, reason = _netns_permitted(f"dflprobe{lab_id}")

    client_key = base / "client_ed25519"
    for stale in base.glob("**/*ed25519*"):
        stale.unlink()
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dflash-ops-lab", "-f", str(client_key)])
    authorized = base / "authorized_keys"
    authorized.write_text(Path(f"{client_key}.pub").read_text())
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)

    lab = SSHLab(base=base, lab_id=lab_id, isolated=isolated, fallback_reason=reason,
                 client_key=client_key, known_hosts=base / "known_hosts")
    atexit.register(lab.close)

    REGISTRY.mkdir(parents=True, exist_ok=True)
    with open(REGISTRY / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # labs starting at once (pytest-xdist workers) pick distinct subnets
        k = 0
        if isolated:  # pick a free pair of /24s: 10.77.1+2k and 10.77.2+2k (parallel labs)
            used = _used_ipv4()
            while f"10.77.{2 * k + 1}.1" in used or f"10.77.{2 * k + 2}.1" in used:
                k += 1
        for i, name in enumerate(HOST_NAMES):
            hdir = base / name
            (hdir / "root").mkdir(parents=True, exist_ok=True)
            key = hdir / "ssh_host_ed25519_key"
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"lab-{name}", "-f", str(key)])
            if isolated:
                netns, veth, peer = f"dflab-{lab_id}-{name}", f"dv{lab_id}{name[0]}", f"dn{lab_id}{name[0]}"
                subnet = f"10.77.{2 * k + 1 + i}"
                address, port = f"{subnet}.2", (22, 2222)[i]
            else:
                netns = veth = peer = None
                address = f"127.0.0.{2 + i}"
                port = _free_port(address)
            host = LabHost(name=name, address=address, port=port, user="root", host_key=key,
                           host_key_pub=" ".join(Path(f"{key}.pub").read_text().split()[:2]),
                           root=hdir / "root", netns=netns, veth=veth, config=hdir / "sshd_config",
                           pidfile=hdir / "sshd.pid", log=hdir / "sshd.log",
                           authorized_keys=hdir / "authorized_keys")
            lab.hosts[name] = host
            lab._save_record()  # before creating anything, so a crash is still cleaned up
            if isolated:
                _run(["ip", "netns", "add", netns])
                _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer, "netns", netns])
                _run(["ip", "addr", "add", f"{subnet}.1/24", "dev", veth])
                _run(["ip", "link", "set", veth, "up"])
                _run(["ip", "-n", netns, "addr", "add", f"{address}/24", "dev", peer])
                _run(["ip", "-n", netns, "link", "set", peer, "up"])
                _run(["ip", "-n", netns, "link", "set", "lo", "up"])
            host.config.write_text(sshd_config(port=port, address=address, host_key=key, pidfile=host.pidfile,
                                               authorized_keys=f"{authorized} {host.authorized_keys}"))
            _run([SSHD, "-t", "-f", str(host.config)])
            prefix = ["ip", "netns", "exec", netns] if netns else []
            _run([*prefix, SSHD, "-f", str(host.config), "-E", str(host.log)])
    for host in lab.hosts.values():
        _wait_listening(host)
    lab.known_hosts.write_text(
        "".join(f"{h.known_hosts_name} {h.host_key_pub}\n" for h in lab.hosts.values()))
    return lab


if __name__ == "__main__":  # manual use: python tests/sshlab.py /tmp/lab  (Ctrl-C tears down)
    lab = start_lab(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dflash-ops-lab")
    print(json.dumps({n: f"{h.user}@{h.address}:{h.port}" for n, h in lab.hosts.items()},
                     indent=1), "isolated" if lab.isolated else f"loopback ({lab.fallback_reason})")
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
