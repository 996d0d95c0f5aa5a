"""`sync-ckpt --tunnel` on the SSH lab: the eval host pulls from the training host through a socket
this machine forwards, the only way between the two hosts (network namespaces).

What is asserted: the bytes arrive identical through the tunnel (the training host saw the eval
host's login come from this machine, with a key that is not the lab's); resume, the checksum
re-send and the progress events behave as in the relay; the eval host's client is pinned to the
training host key the control connection accepted (an impostor sshd behind the tunnel is
refused, never trusted on first use); the one-time key is restricted (a forced command that only
sends files of the checkpoint folder, from this machine's address, with an expiry) and gone once
the eval host is logged in; where the tunnel cannot be set up (no ssh client on the eval host,
the training host refusing the key) one line says why and ``auto`` falls back to the relay; and
after success, failure, Ctrl-C and SIGKILL (of this process, or of a host's session while the tunnel
is set up) nothing is left on either host or here: no authorized_keys line, tunnel folder (key,
known_hosts, sockets), forwarded socket or connection. A stopped or killed sender on the training
host is named as such.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from glob import glob
from pathlib import Path

import pytest
import sshlab
from synclab import FAST, MiB, Env, Paused, identical, serve_pids

from orchestrator.config.inventory import load_inventory
from orchestrator.sync import SyncError, SyncProgress, TunnelFallback, TunnelUnavailable
from orchestrator.sync import tool as tool_mod
from orchestrator.sync.tool import tool_blob
from orchestrator.transport import master as master_mod

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("tunnel")]  # /tmp/dflash-t-*: one at a time
KEY_TAG = "dflash-ops-sync-"
ALIAS = "dflash-ops-training-host"


@pytest.fixture
def env(ssh_lab, tmp_path):
    e = Env(ssh_lab, tmp_path)
    e.keys_before = authorized_keys(ssh_lab)
    return e


def authorized_keys(lab) -> str | None:
    f = lab.train.authorized_keys
    return f.read_text() if f.exists() else None


def _ours(master_dir: str) -> bool:
    """A master folder of this test process (or of a command it ran that is gone): not one of a sync
    the other pytest-xdist worker is running now."""
    try:
        pid = int(Path(master_dir, "pid").read_text())
    except (OSError, ValueError):
        return False
    return pid == os.getpid() or not Path(f"/proc/{pid}").exists()


def leftovers(lab, here: bool = True) -> list[str]:
    """Whatever a tunnel sync may leave behind: one-time key lines on the training host, the eval
    host's tunnel folders (key, known_hosts, sockets), processes (masters here, the eval host's
    connection to the training host), sockets listening in the eval host's network namespace, and
    with ``here`` this machine's master folders (after a SIGKILL here, the next sync removes them)."""
    found = []
    text = authorized_keys(lab) or ""
    found += [f"authorized_keys: {ln[:60]}..." for ln in text.splitlines() if KEY_TAG in ln]
    masters = [d for d in glob(f"{master_mod._socket_base()}/dflash-m-*") if _ours(d)] if here else []
    found += glob("/tmp/dflash-t-*") + masters
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        line = b" ".join(argv).decode(errors="replace")
        if "dflash-t-" in line or any(m in line for m in masters) or ALIAS in line:
            found.append(f"process {entry}: {line[:100]}")
    unix = lab.exec_in(lab.eval, ["cat", "/proc/net/unix"]).stdout
    found += [f"socket {ln.split()[-1]}" for ln in unix.splitlines() if "dflash-t-" in ln]
    return found


def nothing_left(lab, env: Env, timeout: float = 20, here: bool = True) -> None:
    deadline = time.monotonic() + timeout
    while (left := leftovers(lab, here)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left
    assert authorized_keys(lab) == env.keys_before  # byte for byte as it was


def tunnel_dir() -> Path:
    dirs = glob("/tmp/dflash-t-*")
    assert len(dirs) == 1, dirs
    return Path(dirs[0])


def fingerprint(pub: str) -> str:
    return subprocess.run(["ssh-keygen", "-lf", "-"], input=pub, capture_output=True, text=True,
                          check=True).stdout.split()[1]


class Recorder(SyncProgress):
    """The progress events of a sync (what the CLI's bars are drawn from); ``on_start`` runs
    when bytes are about to move (the data path is up)."""

    def __init__(self, on_start=None):
        self.bytes, self.events, self.on_start = 0, [], on_start

    def start(self, plan):
        self.events.append("start")
        if self.on_start:
            self.on_start(plan)

    def moved(self, f, n):
        self.bytes += n

    def stop(self):
        self.events.append("stop")


def test_the_tunnel_is_the_only_way_between_the_hosts_and_the_bytes_take_it(env, ssh_lab):
    if not ssh_lab.isolated:
        pytest.skip(f"needs network namespaces: {ssh_lab.fallback_reason}")
    tr = ssh_lab.train
    probe = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)\n"
             "except OSError as e:\n    print('unreachable', e)\nelse:\n    print('reachable')")
    res = ssh_lab.exec_in(ssh_lab.eval, [sys.executable, "-c", probe, tr.address, str(tr.port)])
    assert res.stdout.startswith("unreachable"), res.stdout + res.stderr
    src = env.ckpt(1, {"model.safetensors": 24, "config.json": b"{}\n", "sub/extra.pt": 3})
    log_before = tr.log.read_text()
    seen = Recorder()
    res = env.sync("1", tunnel="tunnel", progress=seen)
    assert res.path == "tunnel" and res.bytes_moved == 27 * MiB + 3 and res.verified == 3
    identical(src, env.dst_run / "step_1")
    assert seen.events == ["start", "stop"] and seen.bytes == res.bytes_moved
    # the training host saw one login with a key that is not the lab's, from this machine's address
    lab_key = fingerprint(Path(f"{ssh_lab.client_key}.pub").read_text())
    here = tr.address.rsplit(".", 1)[0] + ".1"  # the root namespace's end of the training host's link
    logins = re.findall(r"Accepted publickey for \S+ from (\S+) port \d+ ssh2: ED25519 (\S+)",
                        tr.log.read_text()[len(log_before):])
    tunnelled = [(addr, fp) for addr, fp in logins if fp != lab_key]
    assert len(tunnelled) == 1 and tunnelled[0][0] == here, logins
    nothing_left(ssh_lab, env)
    # nothing to move: no tunnel at all
    again = env.sync("1", tunnel="tunnel")
    assert again.bytes_moved == 0 and again.plan.up_to_date and again.path == ""


def test_resume_and_checksum_resend_through_the_tunnel(env, ssh_lab):
    src = env.ckpt(2, {"model.safetensors": 200, "config.json": b"{}\n"})
    proc = env.cli("sync-ckpt", "2", "--run", env.run, "--tunnel")
    try:
        env.wait_part(2, "model.safetensors", 20 * MiB)
    finally:
        proc.send_signal(signal.SIGKILL)  # only the orchestrator: the hosts notice and clean up
        proc.wait()
    nothing_left(ssh_lab, env, timeout=30, here=False)  # the hosts' sessions end as their connections drop
    stopped_at = env.part_size(2, "model.safetensors")
    plans = []
    res = env.sync("2", tunnel="tunnel", on_plan=plans.append)
    f = {x.path: x for x in plans[0].files}["model.safetensors"]
    assert f.action == "resume" and f.offset == stopped_at > 0
    assert res.path == "tunnel" and res.bytes_moved == plans[0].to_move <= 200 * MiB - stopped_at + 3
    identical(src, env.dst_run / "step_2")
    # a corrupt .part: found by the receiver's sha256, sent again from zero, through the tunnel
    src3 = env.ckpt(3, {"model.bin": 24, "config.json": b"{}\n"})
    env.staging(3).mkdir(parents=True)
    prefix = bytearray((src3 / "model.bin").read_bytes()[: 5 * MiB])
    prefix[4321] ^= 0xFF
    (env.staging(3) / "model.bin.part").write_bytes(prefix)
    res = env.sync("3", tunnel="tunnel")
    assert res.resent == ["model.bin"] and res.path == "tunnel"
    identical(src3, env.dst_run / "step_3")
    nothing_left(ssh_lab, env)


def test_the_one_time_key_is_restricted_and_gone_once_the_eval_host_is_in(env, ssh_lab, monkeypatch):
    """While the key is in the training host's authorized_keys (between GRANT and the eval host's
    login), it is tried from this machine (its `from` address) for what it must not do. Its folder
    on the eval host is 0700, and its private key is found nowhere else: not in a log, a work or
    checkpoints folder of either host, nor in what the sync said."""
    src = env.ckpt(4, {"model.safetensors": 2, "config.json": b"{}\n"})
    tr, seen = ssh_lab.train, {}
    real_forward = master_mod.Master.forward

    def misuse(self, spec):
        line = next(ln for ln in authorized_keys(ssh_lab).splitlines() if KEY_TAG in ln)
        seen["line"] = line
        key = tunnel_dir() / "id"
        seen["mode"] = tunnel_dir().stat().st_mode & 0o777
        seen["secret"] = [ln for ln in key.read_text().splitlines() if ln and not ln.startswith("-----")]

        def ssh(*args, remote=None):
            argv = ["ssh", "-F", "/dev/null", "-i", str(key), "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none",
                    "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={ssh_lab.known_hosts}", "-p", str(tr.port),
                    "-o", "ConnectTimeout=10", *args, f"{tr.user}@{tr.address}"]
            return subprocess.run(argv + ([remote] if remote else []), capture_output=True, text=True, timeout=60,
                                  stdin=subprocess.DEVNULL)
        seen["shell"] = ssh(remote="cat /etc/hostname")
        blob = tool_blob()
        seen["outside"] = ssh(remote=shlex.join([blob, "send", "../../../../etc/hostname", "1", "1", "0"]))
        seen["dotfile"] = ssh(remote=shlex.join([blob, "send", ".dflash-manifest.json", "1", "1", "0"]))
        seen["forward"] = ssh("-N", "-o", "ExitOnForwardFailure=yes", "-L", "127.0.0.1:0:127.0.0.1:22")
        return real_forward(self, spec)
    monkeypatch.setattr(master_mod.Master, "forward", misuse)

    def inside(plan):  # the tunnel is up: the key has done its work
        d = tunnel_dir()
        seen["known_hosts"] = (d / "known_hosts").read_text()
        seen["files"] = sorted(p.name for p in d.iterdir())
        seen["keys_now"] = authorized_keys(ssh_lab)
    res = env.sync("4", tunnel="tunnel", progress=Recorder(on_start=inside))
    assert res.path == "tunnel"
    identical(src, env.dst_run / "step_4")
    line = seen["line"]
    opts = line.split(" ssh-ed25519 ")[0]
    assert opts.startswith("restrict,") and f'from="{tr.address.rsplit(".", 1)[0]}.1"' in opts \
        if ssh_lab.isolated else opts.startswith("restrict,")
    assert re.search(r'expiry-time="\d{14}"', opts) and 'command="' in opts and line.split()[-1].startswith(KEY_TAG)
    assert str(env.src_run / "step_4") in opts
    for what in ("shell", "outside", "dotfile"):
        r = seen[what]
        assert r.returncode != 0 and "hostname" not in r.stdout, (what, r.stdout, r.stderr)
    assert "not the dflash-ops sender" in seen["shell"].stderr
    assert "refusing path" in seen["outside"].stderr and "refusing path" in seen["dotfile"].stderr
    assert seen["forward"].returncode != 0
    # in the tunnel: the training host's key as its control connection accepted it, under an alias,
    # and nothing else; no key file left on the eval host; no line left on the training host
    assert seen["known_hosts"] == f"{ALIAS} {tr.host_key_pub}\n"
    assert "id" not in seen["files"] and "id.pub" not in seen["files"]
    assert seen["keys_now"] == env.keys_before
    nothing_left(ssh_lab, env)
    assert seen["mode"] == 0o700 and len(seen["secret"]) > 2
    where = [tr.log, ssh_lab.eval.log, *(p for h in (tr, ssh_lab.eval) for p in h.root.rglob("*") if p.is_file())]
    for path in where:
        if path.stat().st_size < (1 << 20):
            text = path.read_bytes()
            assert not any(part.encode() in text for part in seen["secret"][1:-1]), path
    assert not any(part in repr(res) for part in seen["secret"])


def test_an_impostor_behind_the_tunnel_is_refused(env, ssh_lab, monkeypatch, tmp_path):
    """The training host's sshd is replaced (another host key, same address and port) after its
    control connection accepted the real key and before the eval host logs in through the tunnel:
    the eval host's client refuses it, and that is never a reason to fall back."""
    env.ckpt(5, {"model.safetensors": 2, "config.json": b"{}\n"})
    fake = tmp_path / "impostor_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(fake)], check=True)
    impostor = sshlab.ExtraSshd(ssh_lab, "train", ssh_lab.train.port, fake, tmp_path)
    real_forward = master_mod.Master.forward

    def swap_then_forward(self, spec):
        ssh_lab.stop_sshd("train")
        impostor.start()
        return real_forward(self, spec)
    monkeypatch.setattr(master_mod.Master, "forward", swap_then_forward)
    try:
        with pytest.raises(SyncError, match="host key verification failed") as e:
            env.sync("5", tunnel="auto")
        assert not isinstance(e.value, TunnelUnavailable)
    finally:
        impostor.stop()
        ssh_lab.start_sshd("train")
    assert not (env.dst_run / "step_5").exists()
    nothing_left(ssh_lab, env)


@pytest.mark.parametrize("how", ["failure", "interrupt"])
def test_nothing_is_left_behind_after_a_failure_or_ctrl_c(env, ssh_lab, how):
    src = env.ckpt(6, {"model.safetensors": 8, "config.json": b"{}\n"})

    def changed(plan):  # the source changes after the plan: the sender refuses it mid-sync
        st = (src / "model.safetensors").stat()
        os.utime(src / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    def interrupt(plan):
        raise KeyboardInterrupt
    if how == "failure":
        with pytest.raises(SyncError, match="changed on train while it was sent"):
            env.sync("6", tunnel="tunnel", on_plan=changed)
    else:
        with pytest.raises(KeyboardInterrupt):
            env.sync("6", tunnel="tunnel", progress=Recorder(on_start=interrupt))
    assert not (env.dst_run / "step_6").exists()
    nothing_left(ssh_lab, env)


def test_ctrl_c_of_the_command_leaves_nothing_behind(env, ssh_lab):
    env.ckpt(7, {"model.safetensors": 200, "config.json": b"{}\n"})
    proc = env.cli("sync-ckpt", "7", "--run", env.run, "--tunnel")
    try:
        env.wait_part(7, "model.safetensors", 10 * MiB)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in err, err
    nothing_left(ssh_lab, env)


def test_where_the_tunnel_cannot_be_set_up_one_line_and_auto_falls_back(env, ssh_lab, tmp_path):
    src = env.ckpt(8, {"model.safetensors": 2, "config.json": b"{}\n"})
    final = env.dst_run / "step_8"
    # 1. the eval host has no OpenSSH client
    bare = tmp_path / "python-without-ssh"
    bare.write_text(f'#!/bin/sh\nPATH=/nonexistent exec {sys.executable} "$@"\n')
    bare.chmod(0o755)
    inv = ssh_lab.write_inventory(tmp_path / "no-ssh.yaml", eval={"python": str(bare)})
    env.inv, env.inv_path = load_inventory(inv), inv
    with pytest.raises(TunnelUnavailable, match="host eval cannot pull: this host has no OpenSSH client"):
        env.sync("8", tunnel="tunnel")
    assert not final.exists()
    nothing_left(ssh_lab, env)
    p = env.cli("sync-ckpt", "8", "--run", env.run, "--tunnel")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1 and err.count("\n") == 1 and "no OpenSSH client" in err and "Traceback" not in err, err
    with pytest.warns(TunnelFallback, match="no OpenSSH client.*through this machine instead"):
        res = env.sync("8", tunnel="auto")
    assert res.path == "relay"
    identical(src, final)
    nothing_left(ssh_lab, env)
    # 2. the training host does not take the key (sshd reads another authorized_keys file)
    other = tmp_path / "not-read-by-sshd"
    inv = ssh_lab.write_inventory(tmp_path / "refusing.yaml", train={"authorized_keys": str(other)})
    env.inv, env.inv_path = load_inventory(inv), inv
    src9 = env.ckpt(9, {"model.safetensors": 2, "config.json": b"{}\n"})
    with pytest.raises(TunnelUnavailable, match="host train refused the eval host's login through the tunnel: .*"
                                                "Permission denied"):
        env.sync("9", tunnel="tunnel")
    assert not other.exists()  # made for the key, removed with it
    nothing_left(ssh_lab, env)
    p = env.cli("sync-ckpt", "9", "--run", env.run, "--tunnel-auto")
    out, err = p.communicate(timeout=120)
    warned = " ".join(err.split())  # one warning (wrapped to the terminal's width)
    assert p.returncode == 0 and err.count("warning:") == 1 and "Permission denied" in warned, err
    assert "through this machine instead" in warned and "✔" in out
    identical(src9, env.dst_run / "step_9")
    nothing_left(ssh_lab, env)


def test_an_eval_host_that_refuses_the_forward(env, ssh_lab, tmp_path):
    """The eval host's sshd does not forward sockets (AllowStreamLocalForwarding no): one line,
    and with auto the relay."""
    port = sshlab._free_port(ssh_lab.eval.address) if not ssh_lab.isolated else 2299
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
    sshd = sshlab.ExtraSshd(ssh_lab, "eval", port, tmp_path / "k", tmp_path,
                            config="AllowStreamLocalForwarding no\n").start()
    try:
        known = tmp_path / "known_hosts"
        pub = " ".join((tmp_path / "k.pub").read_text().split()[:2])
        known.write_text(f"[{ssh_lab.eval.address}]:{port} {pub}\n{ssh_lab.known_hosts.read_text()}")
        inv = ssh_lab.write_inventory(tmp_path / "no-forward.yaml", eval={"port": port, "known_hosts": str(known)},
                                      train={"known_hosts": str(known)})
        env.inv, env.inv_path = load_inventory(inv), inv
        src = env.ckpt(10, {"model.safetensors": 2, "config.json": b"{}\n"})
        with pytest.raises(TunnelUnavailable, match="refused to forward a socket"):
            env.sync("10", tunnel="tunnel")
        nothing_left(ssh_lab, env)
        with pytest.warns(TunnelFallback, match="refused to forward a socket"):
            assert env.sync("10", tunnel="auto").path == "relay"
        identical(src, env.dst_run / "step_10")
        nothing_left(ssh_lab, env)
    finally:
        sshd.stop()


def test_the_eval_hosts_inventory_default_and_an_awkward_folder_name(ssh_lab, tmp_path):
    """`tunnel: true` on the eval host makes it the default; a run folder whose name needs quoting
    in the forced command (quotes, a dollar, a backslash, a space) goes through it unharmed."""
    env = Env(ssh_lab, tmp_path)
    inv = ssh_lab.write_inventory(tmp_path / "tunnel-default.yaml", eval={"tunnel": True})
    env.keys_before = authorized_keys(ssh_lab)
    env.inv, env.inv_path = load_inventory(inv), inv
    name = f"""{env.run} a"b'c$d\\e"""
    env.cat_path.write_text(json.dumps({"runs": {env.run: {"dir": name, "settle": 0}}}))
    from orchestrator.config.catalog import parse_catalog
    env.catalog = parse_catalog(json.loads(env.cat_path.read_text()), env.cat_path)
    env.src_run = ssh_lab.train.root / "checkpoints" / name
    src = env.ckpt(1, {"model.safetensors": 2, "config.json": b"{}\n"})
    res = env.sync("1")
    assert res.path == "tunnel"
    identical(src, env.dst_run / "step_1")
    res = env.sync("1", tunnel="relay")          # the command line wins over the inventory
    assert res.bytes_moved == 0
    nothing_left(ssh_lab, env)


@pytest.mark.parametrize("host, point", [("train", "granted"), ("eval", "pull")])
def test_a_hosts_session_killed_while_the_tunnel_is_set_up_is_one_line_and_leaves_nothing(env, ssh_lab, monkeypatch,
                                                                                        host, point):
    """`sync_host.py serve` SIGKILLed right after the training host granted the one-time key, or on
    the eval host while it logs in through the tunnel: the key line stayed in authorized_keys until
    its expiry, the tunnel folder (the one-time private key in it) until the next sync, and the
    message blamed the training host's refusal of the login. Now the session's guardian undoes
    them at once, and the line names the host whose session ended."""
    src = env.ckpt(11, {"model.safetensors": 2, "config.json": b"{}\n"})
    victim = ssh_lab.train if host == "train" else ssh_lab.eval

    def kill():
        pids = serve_pids(victim)
        assert pids
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    if point == "granted":
        real_forward = master_mod.Master.forward

        def forward(self, spec):
            kill()
            return real_forward(self, spec)
        monkeypatch.setattr(master_mod.Master, "forward", forward)
    else:
        real_answer = tool_mod.Session._answer

        def answer(self, verb, timeout):
            if verb == "PULL":
                time.sleep(0.1)                  # the eval host is starting its connection through the tunnel
                kill()
            return real_answer(self, verb, timeout)
        monkeypatch.setattr(tool_mod.Session, "_answer", answer)
    started = time.monotonic()
    with pytest.raises(SyncError) as e:
        env.sync("11", tunnel="tunnel")
    msg = str(e.value)
    assert time.monotonic() - started < 30
    assert not isinstance(e.value, TunnelUnavailable), msg   # not a reason to fall back to the relay
    assert msg.startswith(f"host {host}: sync_host ended: killed") and "\n" not in msg, msg
    nothing_left(ssh_lab, env)
    monkeypatch.undo()
    assert env.sync("11", tunnel="tunnel").path == "tunnel"
    identical(src, env.dst_run / "step_11")
    nothing_left(ssh_lab, env)


@pytest.mark.parametrize("how", ["SIGSTOP", "SIGKILL"])
def test_a_stopped_or_killed_sender_on_the_training_host_is_named(env, ssh_lab, tmp_path, how):
    """The training host's sender stopped or killed mid-file: "host eval: no data arrived" and "the
    stream ... ended early" named the wrong host or no cause; now the training host and what
    happened to its sender, in the idle time at most."""
    src = env.ckpt(12, {"model.safetensors": 3, "config.json": b"{}\n"})
    p = Paused(env, tmp_path, 12, "model.safetensors", MiB, tunnel="tunnel")
    pid = int((p.dir / "paused").read_text().split()[1])
    os.kill(pid, getattr(signal, how))
    started = time.monotonic()
    try:
        p.t.join(60)
        took = time.monotonic() - started
    finally:
        if how == "SIGSTOP":
            os.kill(pid, signal.SIGCONT)
    err = p.release().get("err")
    msg = str(err)
    assert isinstance(err, SyncError) and "\n" not in msg and "exit 0" not in msg, repr(err)
    assert took < FAST["idle"] + 15, took
    if how == "SIGSTOP":
        assert msg.startswith("no data came from host train through the tunnel from eval for 6s") and \
            "is its sender stopped" in msg, msg
    else:
        assert msg.startswith("the sender on host train (through the tunnel from the eval host) was killed"), msg
    nothing_left(ssh_lab, env)
    assert env.sync("12", tunnel="tunnel").path == "tunnel"
    identical(src, env.dst_run / "step_12")
