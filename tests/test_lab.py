"""The SSH lab itself: real sshd hosts, reachable from here, isolated from each other."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sshlab
from orchestrator.config.inventory import load_inventory
from orchestrator.transport import runner_for

pytestmark = pytest.mark.lab      # also the test that needs no lab: it tears down a stale one's namespace

CONNECT = ("import socket, sys\n"
           "s = socket.socket(); s.settimeout(3)\n"
           "try:\n    s.connect((sys.argv[1], int(sys.argv[2])))\nexcept OSError as e:\n"
           "    print(type(e).__name__, e); sys.exit(1)\nprint(s.recv(16).decode(errors='replace'))\n")


def test_hosts_are_real_sshd_reachable_from_here(ssh_lab, lab_inventory):
    inv = load_inventory(lab_inventory)
    for name in ("train", "eval"):
        h = ssh_lab.hosts[name]
        pid = h.sshd_pid()
        assert pid and "sshd" in Path(f"/proc/{pid}/cmdline").read_text()
        with runner_for(inv.get(name)) as r:
            res = r.run(["sh", "-c", "echo $SSH_CONNECTION"], check=True)
        assert res.stdout.split()[2] == h.address  # server side of the connection
        assert h.root.is_dir()


def test_train_and_eval_cannot_reach_each_other(ssh_lab):
    if not ssh_lab.isolated:
        pytest.skip(f"loopback fallback, hosts are not isolated: {ssh_lab.fallback_reason}")
    train, ev = ssh_lab.train, ssh_lab.eval
    # positive control: inside its namespace, train reaches its own sshd
    own = ssh_lab.exec_in(train, [sys.executable, "-c", CONNECT, train.address, str(train.port)])
    assert own.returncode == 0 and own.stdout.startswith("SSH-"), own
    for src, dst in ((train, ev), (ev, train)):
        res = ssh_lab.exec_in(src, [sys.executable, "-c", CONNECT, dst.address, str(dst.port)])
        assert res.returncode == 1, f"{src.name} reached {dst.name}: {res.stdout}"


def test_link_down_cuts_the_host_off(ssh_lab):
    if not ssh_lab.isolated:
        pytest.skip(f"needs network namespaces: {ssh_lab.fallback_reason}")
    h = ssh_lab.eval
    probe = [sys.executable, "-c", CONNECT, h.address, str(h.port)]
    ssh_lab.link_down(h)
    try:
        assert subprocess.run(probe, capture_output=True).returncode == 1
    finally:
        ssh_lab.link_up(h)
    assert subprocess.run(probe, capture_output=True, timeout=10).returncode == 0


def test_stale_lab_of_a_crashed_run_is_cleaned_up(tmp_path, monkeypatch):
    monkeypatch.setattr(sshlab, "REGISTRY", tmp_path / "registry")
    sshlab.REGISTRY.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = subprocess.Popen(["sleep", "60"])  # stands in for a leftover sshd
    (tmp_path / "sshd.pid").write_text(f"{orphan.pid}\n")
    netns = []
    if os.geteuid() == 0 and subprocess.run(["ip", "netns", "add", f"dflab-stale-{os.getpid()}"]).returncode == 0:
        netns = [f"dflab-stale-{os.getpid()}"]
    record = {"owner": dead.pid, "netns": netns, "veth": [], "pidfiles": [str(tmp_path / "sshd.pid")]}
    (sshlab.REGISTRY / "stale.json").write_text(json.dumps(record))
    live = dict(record, owner=os.getpid(), pidfiles=[])
    (sshlab.REGISTRY / "live.json").write_text(json.dumps(live))
    try:
        assert sshlab.clean_stale_labs() == 1
        assert orphan.wait(5) is not None
        assert not (sshlab.REGISTRY / "stale.json").exists()
        assert (sshlab.REGISTRY / "live.json").exists()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for ns in netns:
            assert ns not in listed
    finally:
        orphan.kill()
        for ns in netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
