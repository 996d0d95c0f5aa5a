"""The sync data path's performance choices keep their guarantees: senders that hash a file cache
its sha256 on the source themselves (in parallel, none losing another's entry), so a first sync
reads and hashes the checkpoint once on the training host (relay and tunnel alike), the tool runs
without site-packages, and the cipher order follows this machine's CPU. Real `sync_host.py`
processes (and the SSH lab for whole syncs); the throughput itself is measured by
benchmarks/bench_sync.py."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from synclab import Env, identical

from orchestrator.config.inventory import Host
from orchestrator.sync import relay
from orchestrator.sync.tool import Session, tool_argv

TOOL = Path(__file__).resolve().parents[1] / "remote" / "sync_host.py"


def send(path: Path, cache: Path) -> subprocess.Popen:
    st = path.stat()
    return subprocess.Popen([sys.executable, str(TOOL), "send", str(path), str(st.st_size), str(st.st_mtime_ns),
                             "0", "--hash", "--cache", str(cache)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_parallel_senders_each_cache_their_hash_and_keep_the_others(tmp_path):
    ck = tmp_path / "step_1"
    (ck / "sub").mkdir(parents=True)
    files = {"a.bin": os.urandom(3 << 20), "b.bin": os.urandom(5 << 20), "sub/c.json": b"{}\n",
             "d.bin": os.urandom(1 << 20)}
    for rel, data in files.items():
        (ck / rel).write_bytes(data)
    procs = {rel: send(ck / rel, ck) for rel in files}
    for rel, p in procs.items():
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        want = hashlib.sha256(files[rel]).hexdigest()
        assert out == files[rel] + b"DFLT" + want.encode() + b"\n"
    cache = {e["path"]: e for e in json.loads((ck / ".dflash-manifest.json").read_text())["files"]}
    assert {rel: e["sha256"] for rel, e in cache.items()} == \
        {rel: hashlib.sha256(d).hexdigest() for rel, d in files.items()}
    # and the listing trusts those entries: no file is hashed again
    listed = json.loads(subprocess.run([sys.executable, str(TOOL), "manifest", str(ck)], capture_output=True,
                                       text=True, timeout=60, check=True).stdout)
    assert listed["hashed"] == 0 and all(e["sha256"] == cache[e["path"]]["sha256"] for e in listed["files"])


def test_a_read_only_source_still_sends(tmp_path):
    ck = tmp_path / "ro"
    ck.mkdir()
    (ck / "w.bin").write_bytes(b"x" * 70000)
    ck.chmod(0o555)
    try:
        if os.access(ck, os.W_OK):  # root writes anyway: make the cache file a folder instead
            (ck / ".dflash-manifest.json").mkdir()
        p = send(ck / "w.bin", ck)
        out, err = p.communicate(timeout=60)
    finally:
        ck.chmod(0o755)
    assert p.returncode == 0, err
    assert out.endswith(b"DFLT" + hashlib.sha256(b"x" * 70000).hexdigest().encode() + b"\n")
    assert sorted(p.name for p in ck.iterdir()) in (["w.bin"], [".dflash-manifest.json", "w.bin"])


def test_the_tool_runs_without_site_packages(tmp_path):
    """`python -S`: the host's site-packages hooks are not loaded (start-up time), and the tool,
    stdlib only, still works."""
    host = Host(name="h", address="local", python=sys.executable)
    argv = tool_argv(host, "state", str(tmp_path / "run"), "step_1")
    assert argv[:3] == [sys.executable, "-S", "-c"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["final_exists"] is False


def test_cipher_order_follows_this_machines_cpu(tmp_path):
    def order(flags: str) -> str:
        relay.ciphers.cache_clear()
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\n{flags}\n")
        try:
            return relay.ciphers(str(info))
        finally:
            relay.ciphers.cache_clear()
    assert order("flags\t\t: fpu sse2 aes avx2").startswith("aes128-gcm@openssh.com,")
    assert order("Features\t: fp asimd aes pmull sha2").startswith("aes128-gcm@openssh.com,")
    assert order("flags\t\t: fpu sse2 avx2").startswith("chacha20-poly1305@openssh.com,")
    assert order("flags\t\t: fpu vaes_like").startswith("chacha20-poly1305@openssh.com,")
    assert relay.ciphers(str(tmp_path / "absent")).startswith("aes128-gcm@openssh.com,")
    relay.ciphers.cache_clear()
    opts = relay.data_options()
    assert any(o.startswith("Ciphers=") for o in opts) and any(o.startswith("MACs=umac-128-etm") for o in opts)


@pytest.mark.xdist_group("tunnel")     # /tmp/dflash-t-*: one tunnel at a time (test_sync_tunnel.py)
@pytest.mark.parametrize("how", ["relay", "tunnel"])
def test_a_first_sync_hashes_the_checkpoint_once_on_the_training_host(ssh_lab, tmp_path, monkeypatch, how):
    """The check after the transfer (the training host's own sha256 of every file) takes the
    senders' cache entries: it hashes nothing again."""
    env = Env(ssh_lab, tmp_path)
    src = env.ckpt(1, {"model.safetensors": 6, "config.json": b"{}\n", "sub/opt.pt": 2})
    answers, real = [], Session.call_json

    def record(self, verb, payload=None, timeout=120):
        answer = real(self, verb, payload, timeout)
        if verb == "MANIFEST":
            answers.append((bool((payload or {}).get("hash")), answer["hashed"], [e["sha256"] for e in answer["files"]]))
        return answer
    monkeypatch.setattr(Session, "call_json", record)
    res = env.sync("1", tunnel=how)
    assert res.path == how and res.verified == 3
    identical(src, env.dst_run / "step_1")
    assert [(h, n) for h, n, _ in answers] == [(False, 0), (True, 0)], answers  # listed unhashed, checked from the cache
    assert None in answers[0][2] and None not in answers[1][2]
