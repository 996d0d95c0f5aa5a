"""sync-ckpt / ckpts on the SSH lab: train and eval are real sshd hosts that cannot reach each other.

Every test uses its own training run (folder) so tests share the session lab without interfering.
Big files are a repeated 1 MiB random block: real bytes for sha256 and the ciphers.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from orchestrator.config.catalog import CatalogError, parse_catalog
from orchestrator.sync import SyncError, list_checkpoints, sync_checkpoint
from synclab import REPO, MiB, Env, identical
from waiting import wait_for


class _Counting:
    """Wraps a child's stdout/stderr and counts the bytes this process reads from it."""

    def __init__(self, f, box: list):
        self.f, self.box = f, box

    def readline(self, *a):
        line = self.f.readline(*a)
        self.box[0] += len(line)
        return line

    def read(self, *a):
        data = self.f.read(*a)
        self.box[0] += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self.f, name)


def record_popen(monkeypatch) -> tuple[list, list]:
    import orchestrator.sync.relay as sync_mod

    procs, read = [], [0]
    real = subprocess.Popen

    class Recorder(real):
        def __init__(self, argv, **kw):
            procs.append((list(argv), kw.get("stdin"), kw.get("stdout")))
            super().__init__(argv, **kw)
            for name in ("stdout", "stderr"):
                if getattr(self, name) is not None:
                    setattr(self, name, _Counting(getattr(self, name), read))
    monkeypatch.setattr(sync_mod.subprocess, "Popen", Recorder)
    return procs, read


@pytest.fixture
def env(ssh_lab, tmp_path):
    return Env(ssh_lab, tmp_path)


def test_multifile_checkpoint_with_big_file_arrives_identical_never_touching_local_disk(env, tmp_path, monkeypatch):
    """> 600 MiB file (past paramiko's 512 MiB rekey point if paramiko carried data), several files
    incl. a subfolder; never a partial checkpoint under the final name; this process never reads
    or writes the data and nothing lands in the local tmp/home."""
    src = env.ckpt(20000, {"model.safetensors": 640, "config.json": b'{"block_size": 16}\n',
                           "optim/extra.pt": 24})
    final = env.dst_run / "step_20000"
    local_tmp, local_home = tmp_path / "localtmp", tmp_path / "home"
    local_tmp.mkdir(), local_home.mkdir()
    monkeypatch.setenv("TMPDIR", str(local_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("HOME", str(local_home))

    seen_partial: list[str] = []
    stop = threading.Event()

    def poll():  # the final name must only ever show the complete checkpoint
        while not stop.is_set():
            if final.exists():
                files = {p.name: p.stat().st_size for p in final.rglob("*") if p.is_file()}
                if files.get("model.safetensors") != 640 * MiB or ".dflash-manifest.json" not in files \
                        or files.get("extra.pt") != 24 * MiB or any(n.endswith(".part") for n in files):
                    seen_partial.append(repr(files))
            time.sleep(0.01)
    poller = threading.Thread(target=poll)
    poller.start()
    procs, read = record_popen(monkeypatch)
    try:
        res = env.sync("step20k", jobs=3)
    finally:
        stop.set()
        poller.join()
    total = sum(p.stat().st_size for p in src.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert res.bytes_moved == total and res.verified == 3 and res.skipped == 0
    identical(src, final)
    assert not env.staging(20000).exists()
    assert not seen_partial, seen_partial[:3]
    # the bytes went ssh (send) -> kernel pipe -> ssh (recv): every sender's stdout is a pipe fd
    # handed to its receiver, and all this process read from its children is progress/status lines
    senders = [p for p in procs if "send" in p[0][-1]]
    receivers = [p for p in procs if "recv" in p[0][-1]]
    assert len(senders) == len(receivers) == 3 and all(p[0][0] == "ssh" for p in procs)
    assert all(isinstance(out, int) for _, _, out in senders)
    assert sorted(o for _, _, o in senders) != [] and all(isinstance(i, int) for _, i, _ in receivers)
    assert read[0] < 64 << 10, read[0]
    big = [p for d in (local_tmp, local_home, tmp_path) for p in d.rglob("*") if p.is_file() and p.stat().st_size > 64 << 10]
    assert not big, big
    # the source manifest is cached; a second sync moves nothing
    assert (src / ".dflash-manifest.json").exists()
    again = env.sync("20000")
    assert again.bytes_moved == 0 and again.plan.up_to_date
    plans = []
    env.sync("step_20000", dry_run=True, on_plan=plans.append)
    assert plans[0].up_to_date and plans[0].to_move == 0


def test_kill_mid_file_then_rerun_resumes_and_verifies(env):
    src = env.ckpt(3000, {"model.safetensors": 320, "config.json": b"{}\n"})
    proc = env.cli("sync-ckpt", "step_3000", "--run", env.run)
    try:
        env.wait_part(3000, "model.safetensors", 40 * MiB)
    finally:
        proc.send_signal(signal.SIGKILL)  # only the orchestrator: its ssh children are orphaned
        proc.wait()
    killed_at = env.part_size(3000, "model.safetensors")
    time.sleep(1.5)  # orphans notice their lock holder is gone and stop
    stopped_at = env.part_size(3000, "model.safetensors")
    assert stopped_at < 320 * MiB, "the killed sync's orphans kept writing"
    time.sleep(1.0)
    assert env.part_size(3000, "model.safetensors") == stopped_at
    assert not (env.dst_run / "step_3000").exists()

    plans = []
    res = env.sync("step3k", on_plan=plans.append)
    f = {x.path: x for x in plans[0].files}["model.safetensors"]
    assert f.action == "resume" and f.offset == stopped_at >= killed_at
    assert 0 < res.bytes_moved < 320 * MiB + 3
    assert res.bytes_moved <= 320 * MiB - stopped_at + 3
    identical(src, env.dst_run / "step_3000")


def test_corrupt_part_is_detected_and_resent(env):
    src = env.ckpt(40, {"model.bin": 48, "config.json": b"{}\n"})
    stage = env.staging(40)
    stage.mkdir(parents=True)
    prefix = bytearray((src / "model.bin").read_bytes()[: 20 * MiB])
    prefix[12345] ^= 0xFF  # one flipped byte inside the already-received part
    (stage / "model.bin.part").write_bytes(prefix)
    plans = []
    res = env.sync("step_40", on_plan=plans.append)
    assert {x.path: x.action for x in plans[0].files}["model.bin"] == "resume"
    assert res.resent == ["model.bin"]
    identical(src, env.dst_run / "step_40")


@pytest.mark.timeout(200)
def test_cut_link_fails_in_bounded_time_and_rerun_completes(env, ssh_lab):
    if not ssh_lab.isolated:
        pytest.skip(f"needs network namespaces: {ssh_lab.fallback_reason}")
    src = env.ckpt(7, {"model.safetensors": 400, "config.json": b"{}\n"})
    box: dict = {}

    def go():
        try:
            box["res"] = env.sync("7")
        except Exception as e:  # noqa: BLE001
            box["err"] = e
        box["t"] = time.monotonic()
    t = threading.Thread(target=go)
    t.start()
    try:
        env.wait_part(7, "model.safetensors", 30 * MiB)
        ssh_lab.link_down("eval")
        cut = time.monotonic()
        t.join(90)
    finally:
        ssh_lab.link_up("eval")
    assert not t.is_alive(), "sync did not give up on a dead link"
    took = box["t"] - cut
    assert "err" in box and isinstance(box["err"], SyncError), box
    msg = str(box["err"])
    assert "eval" in msg and ("lost the connection" in msg or "no byte moved" in msg), msg
    assert "resume" in msg
    assert took < 60, took
    assert not (env.dst_run / "step_7").exists()
    res = env.sync("step_7", lock_wait=60)  # the old lock holder has given up by then
    assert res.bytes_moved < 400 * MiB
    identical(src, env.dst_run / "step_7")


def test_not_enough_space_is_refused_before_a_byte_moves(ssh_lab, tmp_path):
    """A real small tmpfs as the eval host's checkpoints root (mounted in the mount namespace the
    eval sshd lives in: `ip netns exec` gave it its own)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    ns = ["nsenter", "-t", str(ssh_lab.eval.sshd_pid()), "-m", "--"]
    if subprocess.run([*ns, "mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    probe = ("import os, sys; s = os.statvfs(sys.argv[1]); "
             "print(s.f_blocks - s.f_bfree, sum(len(f) for _, _, f in os.walk(sys.argv[1])))")
    try:
        env = Env(ssh_lab, tmp_path, eval_ckpts=mnt)
        env.ckpt(5, {"model.safetensors": 64, "config.json": b"{}\n"})
        with pytest.raises(SyncError, match="not enough space on eval.*96.0 MiB free; nothing was moved"):
            env.sync("5")
        used, nfiles = subprocess.run([*ns, sys.executable, "-c", probe, str(mnt)], capture_output=True,
                                      text=True, check=True).stdout.split()
        assert int(used) == 0  # not one data block written (only the empty lock file exists)
        assert int(nfiles) <= 1
    finally:
        subprocess.run([*ns, "umount", "-l", str(mnt)])


def held_senders(src: Path) -> list:
    """SIGSTOP the training host's ``sync_host send`` processes of checkpoint ``src`` (the lab's
    hosts share this machine's process table): the transfer stalls, its lock stays held."""
    import psutil

    held = []
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info["cmdline"] or []
        if argv and os.path.basename(argv[0]).startswith("python") and "send" in argv and any(str(src) in a for a in argv):
            p.send_signal(signal.SIGSTOP)
            held.append(p)
    assert held, "no sender found"
    return held


def test_concurrent_second_sync_refuses_or_waits_never_interleaves(env):
    src = env.ckpt(9, {"model.safetensors": 500, "config.json": b"{}\n"})
    box: dict = {}
    first = threading.Thread(target=lambda: box.setdefault("a", env.sync("9")))
    first.start()
    env.wait_part(9, "model.safetensors", 10 * MiB)
    senders = held_senders(src)   # the first sync is held mid-file (it holds the lock) while the second asks
    try:
        with pytest.raises(SyncError, match="another sync of step_9 holds"):
            env.sync("9", lock_wait=1)
        assert first.is_alive()
    finally:
        for p in senders:
            p.send_signal(signal.SIGCONT)
    waiter = threading.Thread(target=lambda: box.setdefault("b", env.sync("9", lock_wait=120)))
    waiter.start()
    first.join(120)
    waiter.join(120)
    assert box["a"].bytes_moved == 500 * MiB + 3  # + config.json
    assert box["b"].bytes_moved == 0 and box["b"].plan.up_to_date  # waited, then found it done
    identical(src, env.dst_run / "step_9")


def test_names_dry_run_and_ckpts_listing(env):
    env.ckpt(1000, {"model.pt": b"a" * 1000, "config.json": b"{}\n"})
    env.ckpt(2000, {"model.pt": b"b" * 2000, "config.json": b"{}\n"})
    with pytest.raises(CatalogError, match="nearest: step_2000"):
        env.sync("step2500")
    with pytest.raises(CatalogError, match="would leave"):
        env.sync("../other")
    with pytest.raises(CatalogError, match="absolute"):
        env.sync("/etc")
    plans = []
    res = env.sync("latest", dry_run=True, on_plan=plans.append)
    assert res.dry_run and res.bytes_moved == 0 and plans[0].checkpoint == "step_2000"
    assert {f.action for f in plans[0].files} == {"send"}
    assert not env.dst_run.exists() or not any(env.dst_run.iterdir())
    env.sync("1k")
    rows, warnings = list_checkpoints(env.inv, env.catalog, env.run)
    assert [(r.name, r.step, r.on_eval) for r in rows] == [("step_1000", 1000, "yes"), ("step_2000", 2000, "no")]
    assert not warnings
    # the command line: ckpts table, dry-run plan, a clean error line for an unknown name
    out = env.cli("ckpts", env.run).communicate(timeout=60)[0]
    assert "step_1000" in out and "yes" in out and "step_2000" in out
    p = env.cli("sync-ckpt", "2k", "--run", env.run, "--dry-run")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "send" in out and "model.pt" in out, err
    p = env.cli("sync-ckpt", "step_999", "--run", env.run)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "no checkpoint 'step_999'" in err and "Traceback" not in err


def test_default_run_is_the_one_with_the_newest_checkpoint(ssh_lab, tmp_path):
    old = Env(ssh_lab, tmp_path)
    old.ckpt(1, {"config.json": b"{}\n"})
    new_run = f"r{uuid.uuid4().hex[:8]}"
    d = ssh_lab.train.root / "checkpoints" / new_run / "step_5"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    os.utime(old.src_run / "step_1" / "config.json", (time.time() - 3600,) * 2)
    cat = parse_catalog({"runs": {old.run: {}, new_run: {}}}, tmp_path / "c.yaml")
    plans = []
    sync_checkpoint(old.inv, cat, "5", dry_run=True, on_plan=plans.append, progress=None)
    assert plans[0].run == new_run and plans[0].checkpoint == "step_5"


def test_ckpts_json(env):
    env.ckpt(300, {"config.json": b"{}\n"})
    p = env.cli("ckpts", env.run, "--json")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    data = json.loads(out)
    assert [(c["run"], c["name"], c["step"], c["on_eval"]) for c in data["checkpoints"]] == [
        (env.run, "step_300", 300, "no")]
    assert data["warnings"] == []


@pytest.mark.timing
def test_ctrl_c_stops_the_transfer_at_once_and_the_rerun_resumes(env, tmp_path):
    """Ctrl-C during a sync stopped nothing: the transfer ran to its end and exited 0. The sender
    is slow (tests/faultpy.py: 1 s per 256 KiB, 32 s for the 8 MiB file, never silent long enough
    for the stall rule); once 2 MiB arrived, SIGINT to the CLI ends it within seconds with exit
    130, saying that a rerun resumes, and nothing more arrives; the rerun sends only the rest."""
    src = env.ckpt(1, {"model.safetensors": 8, "config.json": b"{}\n"})
    fault = tmp_path / "fault"
    fault.mkdir()
    spec = fault / "spec.json"
    spec.write_text(json.dumps({"dir": str(fault), "throttle": {"at": "send", "file": "model.safetensors",
                                                                "seconds": 1.0}}))
    wrapper = fault / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {REPO / "tests" / "faultpy.py"} {spec} "$@"\n')
    wrapper.chmod(0o755)
    inv = env.lab.write_inventory(tmp_path / "faulty.yaml", train={"python": str(wrapper)})
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "-i", str(inv), "sync-ckpt", "1", "--run",
                             env.run, "--catalog", str(env.cat_path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: env.part_size(1, "model.safetensors") >= 2 * MiB, 600, "2 MiB to arrive", proc)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("Ctrl-C did not stop the sync within 30 s")
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and took < 15, (proc.returncode, took, err)
    assert "run the same command again to resume" in err and "Traceback" not in err, err
    assert not (env.dst_run / "step_1").exists()
    time.sleep(3.0)                            # the receiver keeps what arrived: the rerun resumes from it
    arrived = env.part_size(1, "model.safetensors")
    assert 2 * MiB <= arrived < 8 * MiB
    time.sleep(3.0)
    assert env.part_size(1, "model.safetensors") == arrived      # stopped: nothing more comes
    res = env.sync("1")
    assert 8 * MiB - arrived <= res.bytes_moved <= 8 * MiB - arrived + 3       # (+ config.json if not yet there)
    identical(src, env.dst_run / "step_1")
