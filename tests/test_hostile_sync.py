"""sync-ckpt against an eval host whose folders are untrusted, and a source that changes while it
is sent, on the SSH lab: a planted link where the sync expects its own staging folder, `.part` or
record is never followed (nothing outside the run's folder is touched), a planted file with a forged
verification record is not finalized, every file is sent (dotfiles, 255-byte names; many small files
in a few streams), a source touched, rewritten, truncated or replaced mid-send is named and the rerun
completes; one line on each fault (a killed host session, a host-key mismatch with a runnable
`ssh-keygen -R`, a missing or locked identity), a sync given up is not finalized later, `--tunnel`
grants leave authorized_keys byte for byte, a relative checkpoints root is joined once, a name with
a newline is one row. Each test failed before its fix (docs/reliability.md#sync-destination)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from synclab import FAST, REPO, MiB, Env, Paused, identical, serve_pids, sha
from waiting import wait_for

from orchestrator.config.inventory import load_inventory
from orchestrator.sync import SyncError, sync_checkpoint


@pytest.fixture
def env(ssh_lab, tmp_path):
    return Env(ssh_lab, tmp_path)


def victim(tmp_path: Path) -> Path:
    """A folder outside the checkpoints tree that a planted link points to."""
    d = tmp_path / "victim"
    d.mkdir()
    (d / "precious.txt").write_text("keep me\n")
    return d


def unchanged(d: Path) -> None:
    assert sorted(p.name for p in d.iterdir()) == ["precious.txt"], list(d.iterdir())
    assert (d / "precious.txt").read_text() == "keep me\n"


def test_a_planted_staging_link_is_refused_named_and_nothing_outside_is_touched(env, tmp_path):
    env.ckpt(1, {"model.safetensors": 1, "config.json": b"{}\n"})
    v = victim(tmp_path)
    env.dst_run.mkdir(parents=True)
    os.symlink(v, env.staging(1))
    with pytest.raises(SyncError) as e:
        env.sync("1")
    msg = str(e.value)
    assert str(env.staging(1)) in msg and "symbolic link" in msg and "Traceback" not in msg, msg
    unchanged(v)
    assert not (env.dst_run / "step_1").exists()
    assert os.path.islink(env.staging(1))


def test_planted_links_inside_the_staging_folder_are_never_followed(env, tmp_path):
    """`NAME.part -> FILE` (the model's bytes would be appended to FILE), a subfolder and the
    records folder as links: removed without following, the checkpoint arrives identical."""
    src = env.ckpt(2, {"model.safetensors": 2, "sub/extra.pt": 1, "config.json": b"{}\n"})
    v = victim(tmp_path)
    stage = env.staging(2)
    stage.mkdir(parents=True)
    os.symlink(v / "precious.txt", stage / "model.safetensors.part")
    os.symlink(v, stage / "sub")
    os.symlink(v, stage / ".dflash-verified")
    os.symlink(v / "precious.txt", stage / ".dflash-owner")
    (stage / "planted" / "deeper").mkdir(parents=True)
    (stage / "planted" / "deeper" / "x.bin").write_bytes(b"x")
    os.mkfifo(stage / "fifo")
    env.sync("2")
    unchanged(v)
    identical(src, env.dst_run / "step_2")
    assert not (env.dst_run / "step_2" / "planted").exists() and not (env.dst_run / "step_2" / "fifo").exists()
    assert not any(p.is_symlink() for p in (env.dst_run / "step_2").rglob("*"))


def test_a_planted_final_link_is_refused_and_named(env, tmp_path):
    env.ckpt(3, {"model.safetensors": 1, "config.json": b"{}\n"})
    v = victim(tmp_path)
    env.dst_run.mkdir(parents=True)
    os.symlink(v, env.dst_run / "step_3")
    with pytest.raises(SyncError) as e:
        env.sync("3")
    assert str(env.dst_run / "step_3") in str(e.value) and "symbolic link" in str(e.value), str(e.value)
    unchanged(v)


def test_a_planted_file_with_a_forged_record_is_not_finalized(env):
    """Right size, other bytes, a record claiming the source's sha256: finalize hashes what it did
    not verify itself in this session, discards it, and the rerun sends the file."""
    src = env.ckpt(4, {"model.safetensors": 2, "config.json": b"{}\n"})
    stage = env.staging(4)
    stage.mkdir(parents=True)
    real = src / "model.safetensors"
    (stage / "model.safetensors").write_bytes(b"\0" * real.stat().st_size)
    rec = {"path": "model.safetensors", "size": real.stat().st_size, "mtime_ns": real.stat().st_mtime_ns,
           "sha256": sha(real)}
    (stage / ".dflash-verified").mkdir()
    for name in ("model.safetensors.json", hashlib.sha256(b"model.safetensors").hexdigest()[:32] + ".json"):
        (stage / ".dflash-verified" / name).write_text(json.dumps(rec))
    try:
        env.sync("4")
    except SyncError as e:
        assert "model.safetensors" in str(e) and "again" in str(e), str(e)
        env.sync("4")
    identical(src, env.dst_run / "step_4")


def test_every_file_is_sent_dotfiles_and_the_longest_names_included(env):
    long = "w" * 250 + ".bin"                      # 254 bytes: NAME.part and NAME.json exceed NAME_MAX
    src = env.ckpt(5, {".metadata": b"torch dcp\n", ".hidden/x.distcp": b"x" * 5000, long: 1,
                       "config.json": b"{}\n"})
    res = env.sync("5")
    dst = env.dst_run / "step_5"
    for rel in (".metadata", ".hidden/x.distcp", long):
        assert (dst / rel).read_bytes() == (src / rel).read_bytes(), rel
    manifest = json.loads((dst / ".dflash-manifest.json").read_text())
    assert {e["path"] for e in manifest["files"]} == {".metadata", ".hidden/x.distcp", long, "config.json"}
    assert res.verified == 4


def test_a_long_name_resumes(env):
    long = "r" * 251 + ".pt"
    src = env.ckpt(6, {long: 160, "config.json": b"{}\n"})
    proc = env.cli("sync-ckpt", "step_6", "--run", env.run)
    try:
        wait_for(lambda: any(p.stat().st_size >= 8 * MiB for p in env.staging(6).glob(".dflash-part-*")), 60,
                 "the long name's partial file", proc=proc)
    finally:
        proc.kill()
        proc.wait()
    plans = []
    env.sync("6", on_plan=plans.append, lock_wait=30)
    assert {f.path: f.action for f in plans[0].files}[long] == "resume"
    identical(src, env.dst_run / "step_6")


def touch(p: Path) -> None:
    os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))


def rewrite(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[5] ^= 0xFF
    with open(p, "r+b") as f:                      # in place: same inode and size
        f.write(data)


def truncate(p: Path) -> None:
    os.truncate(p, MiB // 2)


def replace(p: Path) -> None:
    tmp = p.with_name("new.tmp")
    shutil.copyfile(p, tmp)
    with open(tmp, "r+b") as f:
        f.write(b"new")
    os.utime(tmp, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns))  # same size and mtime, other bytes
    os.replace(tmp, p)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("change", [touch, rewrite, truncate, replace], ids=lambda f: f.__name__)
def test_a_source_that_changes_while_it_is_sent_is_named_and_the_rerun_completes(env, tmp_path, change):
    src = env.ckpt(7, {"model.safetensors": 2, "config.json": b"{}\n"})
    p = Paused(env, tmp_path, 7, "model.safetensors", MiB)
    change(src / "model.safetensors")
    box = p.release()
    err = box.get("err")
    assert err is not None, "a checkpoint that changed while it was sent was reported synced"
    assert not (env.dst_run / "step_7").exists()
    env.sync("7")                                   # no wedge: the rerun completes
    identical(src, env.dst_run / "step_7")
    msg = str(err)
    assert isinstance(err, SyncError) and "Traceback" not in msg, repr(err)
    assert "model.safetensors changed on train while it was sent; it will be sent again" in msg, msg


def test_a_killed_host_session_is_one_line_naming_the_host_and_the_rerun_completes(env, tmp_path):
    """The training host's session killed mid-transfer: the next request to it found a closed
    socket (an 80-line `OSError: Socket is closed` traceback)."""
    src = env.ckpt(8, {"model.safetensors": 2, "config.json": b"{}\n"})
    p = Paused(env, tmp_path, 8, "model.safetensors", MiB)
    pids = serve_pids(env.lab.train)
    assert pids
    for pid in pids:
        os.kill(pid, 9)
    err = p.release().get("err")
    assert isinstance(err, SyncError) and "host train" in str(err) and "\n" not in str(err), repr(err)
    assert not (env.dst_run / "step_8").exists()
    env.sync("8", lock_wait=30)
    identical(src, env.dst_run / "step_8")


def test_a_checkpoint_name_with_a_newline_is_one_row_escaped(env):
    env.ckpt(9, {"model.safetensors": b"w", "config.json": b"{}\n"}).rename(env.src_run / "step_9\nstep_10")
    proc = env.cli("ckpts", env.run, env={**os.environ, "COLUMNS": "120"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "step_9\\nstep_10" in out, out
    assert not any(line.lstrip("│ ").startswith("step_10") for line in out.splitlines()), out


TOOL = REPO / "remote" / "sync_host.py"


class Serve:
    def __init__(self):
        import subprocess
        self.p = subprocess.Popen([sys.executable, str(TOOL), "serve"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)

    def ask(self, line: str) -> str:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def end(self) -> None:
        if not self.p.stdin.closed:
            self.p.stdin.close()
        self.p.wait(30)


def test_overlapping_grants_leave_authorized_keys_and_its_folders_as_they_were(tmp_path):
    """Two `--tunnel` syncs at once on a file without a final newline, and two at once that both
    find neither the file nor its folders (whichever ends first): every byte and folder as before,
    no granted line left unterminated (the second grant of a file the first made left it empty)."""
    keys = tmp_path / "authorized_keys"
    before = b"ssh-ed25519 AAAAuser user@laptop"               # no final newline
    keys.write_bytes(before)
    grant = {"file": str(keys), "command": 'command="true"'}
    a, b = Serve(), Serve()
    try:
        assert a.ask("GRANT " + json.dumps({**grant, "key": "ssh-ed25519 AAAAone", "token": "one"})).startswith("GRANT")
        assert b.ask("GRANT " + json.dumps({**grant, "key": "ssh-ed25519 AAAAtwo", "token": "two"})).startswith("GRANT")
        assert a.ask("REVOKE") == "REVOKE"
        held = keys.read_bytes()
        assert b"AAAAtwo dflash-ops-sync-two\n" in held and held.endswith(before), held
        assert b.ask("REVOKE") == "REVOKE"
    finally:
        a.end()
        b.end()
    assert keys.read_bytes() == before
    deep = tmp_path / "no" / "such" / "authorized_keys"
    for maker_first in (True, False):
        c, d = Serve(), Serve()
        try:
            for s, t in ((c, "c"), (d, "d")):
                assert s.ask("GRANT " + json.dumps({**grant, "file": str(deep), "key": f"ssh-ed25519 AAAA{t}",
                                                    "token": t})).startswith("GRANT")
            first, last = (c, d) if maker_first else (d, c)
            assert first.ask("REVOKE") == "REVOKE"
            assert deep.exists()                            # the other grant's line is still there
        finally:
            c.end()                                         # the session's end revokes
            d.end()
        assert not (tmp_path / "no").exists(), list((tmp_path / "no").rglob("*"))


def test_a_host_key_mismatch_names_a_runnable_ssh_keygen_and_identity_faults_are_named(ssh_lab, tmp_path):
    import re
    import shlex
    import subprocess
    from dataclasses import replace as with_

    from orchestrator.transport import SSHRunner, TransportError
    from orchestrator.transport.errors import HostKeyError

    inv = load_inventory(ssh_lab.write_inventory(tmp_path / "inventory.yaml"))
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"{ssh_lab.eval.known_hosts_name} {ssh_lab.train.host_key_pub}\n")
    host = with_(inv.get("eval"), known_hosts=str(wrong))
    with pytest.raises(HostKeyError) as e:
        SSHRunner(host).connect()
    cmd = re.search(r"`(ssh-keygen -R [^`]+)`", str(e.value)).group(1)
    subprocess.run(shlex.split(cmd), check=True, capture_output=True, timeout=30)
    assert ssh_lab.train.host_key_pub.split()[1] not in wrong.read_text()

    for what, make in (("does not exist", None), ("passphrase", "secret")):
        key = tmp_path / f"id_{what[:4]}"
        if make:
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", make, "-f", str(key)], check=True, timeout=30)
        host = with_(inv.get("eval"), identity=str(key))
        with pytest.raises(TransportError) as e:
            SSHRunner(host, retries=0).connect()
        assert what in str(e.value) and str(key) in str(e.value), str(e.value)


def test_a_relative_checkpoints_root_is_taken_from_the_login_home_once(env, tmp_path):
    """`checkpoints: ckpts` (as `hosts check` reads it: from the login home) was joined twice
    (`ckpts/ckpts/RUN`) by the listing."""
    src = env.ckpt(10, {"model.safetensors": 1, "config.json": b"{}\n"})
    rel = os.path.relpath(env.src_run.parent, env.lab.train.login_home)
    inv = load_inventory(env.lab.write_inventory(tmp_path / "relative.yaml", train={"checkpoints": rel}))
    assert not os.path.isabs(inv.get("train").checkpoints)
    sync_checkpoint(inv, env.catalog, "10", run=env.run, **FAST)
    identical(src, env.dst_run / "step_10")


def reachable_training_host(lab, env: Env, tmp: Path):
    """The lab with a training host the eval host can reach (for `--direct`; the lab's own two
    cannot reach each other): an sshd of its own in the eval host's network namespace, on the same
    files as the lab's `train`, and an `ssh` first on the eval host's PATH that logs in with the
    lab's key (as a key of the eval host's own would). Sets ``env``'s inventory; returns the sshd."""
    import subprocess

    import sshlab

    key = tmp / "direct_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
    port = 2298 if lab.isolated else sshlab._free_port(lab.eval.address)
    sshd = sshlab.ExtraSshd(lab, "eval", port, key, tmp).start()
    known = tmp / "direct_known_hosts"
    known.write_text(f"[{lab.eval.address}]:{port} {' '.join(key.with_suffix('.pub').read_text().split()[:2])}\n")
    bindir = tmp / "eval-bin"
    bindir.mkdir()
    for name, text in ((bindir / "ssh", f'exec {shutil.which("ssh")} -i {lab.client_key} "$@"'),
                       (tmp / "eval-python", f'PATH={bindir}:$PATH exec {sys.executable} "$@"')):
        name.write_text(f"#!/bin/sh\n{text}\n")
        name.chmod(0o755)
    env.inv = load_inventory(lab.write_inventory(tmp / "direct.yaml", eval={"python": str(tmp / "eval-python")},
                                                 train={"address": lab.eval.address, "port": port,
                                                        "known_hosts": str(known)}))
    return sshd


@pytest.mark.parametrize("mode", ["relay", "tunnel", "direct"])
def test_many_small_files_move_in_a_few_streams(env, monkeypatch, tmp_path, mode):
    """One sender/receiver pair per file made 1,000 files of 64 B take minutes: they go in batches
    (`send-batch`/`recv-batch`), at most `jobs` streams, and arrive identical with their records;
    with `--direct` too (a training host the eval host reaches: :func:`reachable_training_host`)."""
    import subprocess

    import orchestrator.sync.relay as relay

    files = {f"s/{i:04d}.bin": os.urandom(64) for i in range(300)}
    src = env.ckpt(11, {**files, ".metadata": b"dcp\n", "config.json": b"{}\n", "big.bin": 2})
    started = []
    real = subprocess.Popen

    class Counting(real):
        def __init__(self, argv, **kw):
            started.append(argv)
            super().__init__(argv, **kw)
    monkeypatch.setattr(relay.subprocess, "Popen", Counting)
    if mode == "direct":
        sshd = reachable_training_host(env.lab, env, tmp_path)
        try:
            res = env.sync("11", jobs=4, direct=True)
        finally:
            sshd.stop()
    else:
        res = env.sync("11", jobs=4, tunnel=mode)
    assert res.path == mode and res.verified == 303
    identical(src, env.dst_run / "step_11")
    receivers = [a for a in started if {"recv", "recv-batch"} & set(a)]
    assert len(receivers) <= 5, len(receivers)             # 4 batches and big.bin


@pytest.mark.timeout(120)
def test_a_stopped_eval_host_session_fails_finalize_in_bounded_time_and_never_finalizes_later(env, monkeypatch):
    """The eval host's `serve` stopped (SIGSTOP) as FINALIZE is asked: the sync waited 300 s for
    the answer. Now it fails once the session has been silent for `idle` s (a working session says
    ALIVE), naming the host; run again (SIGCONT), the session does not rename the checkpoint into
    place, and the rerun completes."""
    import signal
    import time

    from orchestrator.sync.lock import Destination

    src = env.ckpt(13, {"model.safetensors": 1, "config.json": b"{}\n"})
    real, stopped = Destination.finalize, []

    def stop_then_finalize(self, manifest, rehash=0):
        stopped.extend(serve_pids(env.lab.eval))
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        box["asked"] = time.monotonic()
        return real(self, manifest, rehash)
    box: dict = {}
    monkeypatch.setattr(Destination, "finalize", stop_then_finalize)
    try:
        with pytest.raises(SyncError) as e:
            env.sync("13")
        took = time.monotonic() - box["asked"]
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    msg = str(e.value)
    assert stopped and took < FAST["idle"] + 15, took
    assert msg.startswith("host eval: ") and "stopped" in msg and "FINALIZE" in msg and "\n" not in msg, msg
    wait_for(lambda: not serve_pids(env.lab.eval), 30, "the stopped session to end")
    assert not (env.dst_run / "step_13").exists() and env.staging(13).exists()
    monkeypatch.undo()
    env.sync("13")
    identical(src, env.dst_run / "step_13")


def test_a_run_folder_that_is_a_link_out_of_the_checkpoints_root_is_refused_and_named(env, tmp_path):
    """`<checkpoints>/RUN` itself a link to a folder elsewhere: the lock file, the staging folder and
    the checkpoint were written there. Refused before anything is made there (a dry run too); a
    link that stays inside the checkpoints root is followed."""
    src = env.ckpt(14, {"model.safetensors": 1, "config.json": b"{}\n"})
    v = victim(tmp_path)
    env.dst_run.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(v, env.dst_run)
    for dry in (True, False):
        with pytest.raises(SyncError) as e:
            env.sync("14", dry_run=dry)
        msg = str(e.value)
        assert f"{env.dst_run} is a symbolic link to {v}, outside the checkpoints root" in msg, msg
        unchanged(v)
    os.unlink(env.dst_run)
    inside = env.dst_run.with_name(env.run + "-real")
    inside.mkdir()
    os.symlink(inside.name, env.dst_run)
    env.sync("14")
    identical(src, inside / "step_14")


def test_no_inventory_field_becomes_an_option_or_a_shell_command(ssh_lab, tmp_path):
    """A host's address, user, identity, known_hosts and python reach OpenSSH's and the shell's
    command lines only as the values they are: an address like `-oProxyCommand=…` is never an
    option, a python with `;` never a second command (the one quoting place, transport/runner.py)."""
    import subprocess

    from orchestrator.sync.tool import run_tool
    from orchestrator.transport import SSHRunner, TransportError, endpoint_for

    mark = tmp_path / "PWNED"
    evil = f"-oProxyCommand=touch {mark}"
    for field, value in (("address", evil), ("user", evil), ("identity", f"{tmp_path}/k; touch {mark}"),
                         ("known_hosts", f"{tmp_path}/kh -oProxyCommand=touch {mark}")):
        host = load_inventory(ssh_lab.write_inventory(tmp_path / f"{field}.yaml", eval={field: value})).get("eval")
        with pytest.raises(TransportError) as e:
            SSHRunner(host, retries=0, connect_timeout=5).connect()
        assert "\n" not in str(e.value), str(e.value)
        try:
            argv = endpoint_for(host).argv(["true"], ("ConnectTimeout=5",))   # the data path's OpenSSH
        except TransportError:
            continue                                        # refused as it is (an address that is an option)
        data = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert data.returncode != 0, (field, data.stderr)
    host = load_inventory(ssh_lab.write_inventory(tmp_path / "python.yaml",
                                                  eval={"python": f"{sys.executable}; touch {mark}"})).get("eval")
    with SSHRunner(host) as r, pytest.raises(SyncError, match="python not found or not executable"):
        run_tool(r, host, "manifest", str(tmp_path))
    assert not mark.exists()
