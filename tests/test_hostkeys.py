"""Host keys on both paths, against real sshd hosts of the lab:

- a known_hosts file with ``@cert-authority`` and ``@revoked`` lines keeps working (the plain
  entries are used, the CA lines skipped with a warning) and a revoked key is refused on both paths;
- with ``trust_host_key`` the data path is pinned to the key the control connection accepted: an
  sshd that shows the data path another key is refused;
- the first sync of a checkpoint verifies the bytes against a sha256 the training host computed over
  the control connection, never only against the sender's own trailer.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

import sshlab
from orchestrator.config.catalog import parse_catalog
from orchestrator.config.inventory import load_inventory
from orchestrator.sync import SyncError, sync_checkpoint
from orchestrator.transport import HostKeyError, endpoint_for, runner_for
from synclab import MiB, identical, write_file

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[1]
FAST = dict(alive=(2, 3), idle=6.0, stall=20.0, progress=None)


def keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)], check=True)
    return " ".join(Path(f"{path}.pub").read_text().split()[:2])


def data_path_ok(endpoint) -> subprocess.CompletedProcess:
    return subprocess.run(endpoint.argv(["echo", "data-ok"], ("ConnectTimeout=10",)), capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def lab_inv(ssh_lab, tmp_path_factory):
    return load_inventory(ssh_lab.write_inventory(tmp_path_factory.mktemp("inv") / "inventory.yaml"))


def test_known_hosts_with_cert_authority_and_revoked_lines(ssh_lab, lab_inv, tmp_path):
    ev = ssh_lab.eval
    ca = keygen(tmp_path / "host_ca")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"# a CA for the fleet, and a key that was compromised\n@cert-authority *.fleet.example {ca}\n"
                  f"@revoked 203.0.113.7 {ssh_lab.train.host_key_pub}\n{ev.known_hosts_name} {ev.host_key_pub}\n")
    host = replace(lab_inv.get("eval"), known_hosts=str(kh))
    with pytest.warns(UserWarning, match=r"skipping 1 line.*known_hosts:2 \(@cert-authority"):
        with runner_for(host) as r:
            assert r.run(["echo", "ok"]).stdout == "ok\n"
    res = data_path_ok(endpoint_for(host))
    assert res.returncode == 0 and res.stdout.strip() == "data-ok", res.stderr

    # the CLI shows the warning as one yellow line and goes on
    inv = ssh_lab.write_inventory(tmp_path / "inventory.yaml", eval={"known_hosts": str(kh), "python": "/nonexistent"})
    kh.write_text(kh.read_text() + "\n")            # a new version of the file: read (and warned about) again
    res = CliRunner().invoke(__import__("orchestrator.cli", fromlist=["app"]).app,
                             ["--inventory", str(inv), "hosts", "check", "eval"])
    assert "Traceback" not in res.output
    warned = [ln for ln in res.stderr.splitlines() if ln.startswith("warning: known_hosts: skipping 1 line")]
    assert len(warned) == 1 and "python not found" in res.stdout, res.output

    # a revoked key is refused, even when a plain line lists it and even with trust_host_key
    kh.write_text(f"{ev.known_hosts_name} {ev.host_key_pub}\n@revoked * {ev.host_key_pub}\n")
    for trust in (False, True):
        with pytest.raises(HostKeyError, match="@revoked"):
            runner_for(replace(host, trust_host_key=trust)).connect()
    res = data_path_ok(endpoint_for(host))
    assert res.returncode == 255 and "REVOKED" in res.stderr, res.stderr


def _port(lab) -> int:
    return sshlab._free_port(lab.eval.address) if not lab.isolated else random.randrange(20000, 30000)


def _run_with_checkpoint(lab, tmp_path, files: dict) -> tuple[str, object, Path]:
    run = f"r{uuid.uuid4().hex[:8]}"
    src = lab.train.root / "checkpoints" / run / "step_1"
    for name, spec in files.items():
        if isinstance(spec, bytes):
            src.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes(spec)
        else:
            write_file(src / name, spec, salt=name.encode())
    cat = parse_catalog({"runs": {run: {"dir": run, "settle": 0}}}, tmp_path / "drafters.yaml")  # written just now
    return run, cat, src


def test_data_path_is_pinned_to_the_key_the_control_connection_accepted(ssh_lab, tmp_path, monkeypatch):
    """trust_host_key and an empty known_hosts: the control connection accepts sshd A's key; then
    A is replaced by B (another key, same address and port) before the data path's master
    connection to that host is opened. The data path must refuse B (before: StrictHostKeyChecking=
    accept-new with /dev/null took any key)."""
    import orchestrator.sync.transfer as transfer
    port = _port(ssh_lab)
    a, b = tmp_path / "key_a", tmp_path / "key_b"
    keygen(a), keygen(b)
    sshd = sshlab.ExtraSshd(ssh_lab, "eval", port, a, tmp_path).start()
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    inv = load_inventory(ssh_lab.write_inventory(tmp_path / "inventory.yaml", eval={
        "port": port, "trust_host_key": True, "known_hosts": str(empty)}))
    run, cat, src = _run_with_checkpoint(ssh_lab, tmp_path, {"model.safetensors": 2, "config.json": b"{}\n"})
    impostor = sshlab.ExtraSshd(ssh_lab, "eval", port, b, tmp_path)
    real_start, swapped = transfer.Masters.start, []

    def swap_then_start(self, runner):
        if runner.endpoint.name == "eval" and not swapped:
            swapped.append(1)
            sshd.stop()
            impostor.start()
        real_start(self, runner)
    monkeypatch.setattr(transfer.Masters, "start", swap_then_start)
    try:
        with pytest.raises(SyncError, match="host key verification failed"):
            sync_checkpoint(inv, cat, "step_1", run=run, **FAST)
        assert swapped
        monkeypatch.setattr(transfer.Masters, "start", real_start)
        final = ssh_lab.eval.root / "checkpoints" / run / "step_1"
        assert not final.exists()
        impostor.stop()
        sshd.start()                                  # the same (unknown, trusted) key throughout: it syncs
        sync_checkpoint(inv, cat, "step_1", run=run, **FAST)
        identical(src, final)
        assert empty.read_text() == ""
    finally:
        for s in (sshd, impostor):
            try:
                s.stop()
            except (OSError, ValueError):
                pass


def test_first_sync_does_not_trust_the_senders_own_trailer(ssh_lab, tmp_path):
    """Whoever answers the data path in the training host's place sends other bytes of the same size
    and mtime, with a trailer that matches them. The sync must not finalize them (before: the
    receiver checked them against that trailer only, and the checkpoint appeared, wrong)."""
    run, cat, src = _run_with_checkpoint(ssh_lab, tmp_path, {"model.safetensors": 3, "config.json": b"{}\n"})
    evil = src.parent / ".evil.bin"
    write_file(evil, 3, salt=b"evil")
    st = (src / "model.safetensors").stat()
    os.utime(evil, ns=(st.st_atime_ns, st.st_mtime_ns))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"impostor": {"file": "model.safetensors", "with": str(evil)}}))
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {REPO / "tests" / "faultpy.py"} {spec} "$@"\n')
    wrapper.chmod(0o755)
    lying = load_inventory(ssh_lab.write_inventory(tmp_path / "lying.yaml", train={"python": str(wrapper)}))
    final = ssh_lab.eval.root / "checkpoints" / run / "step_1"
    with pytest.raises(SyncError, match="model.safetensors: the bytes that arrived on eval .* are not the file on "
                                        "train .*computed there over the control connection"):
        sync_checkpoint(lying, cat, "step_1", run=run, **FAST)
    assert not final.exists()
    honest = load_inventory(ssh_lab.write_inventory(tmp_path / "honest.yaml"))
    res = sync_checkpoint(honest, cat, "step_1", run=run, **FAST)
    assert res.bytes_moved == 3 * MiB                # the impostor's copy was sent again, nothing else
    identical(src, final)
