"""remote/sync_host.py against hostile or unlucky checkpoint folders: symlinks, unfinished `.part`
files, file names that look like flags, reserved names in a manifest, a rewrite that keeps size and
mtime. Through the SSH lab where a sync is involved (tests/test_sync.py's Env), else run directly."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from synclab import MiB, Env, identical, sha

from orchestrator.sync import SyncError

TOOL = Path(__file__).resolve().parents[1] / "remote" / "sync_host.py"


@pytest.fixture
def env(ssh_lab, tmp_path):
    return Env(ssh_lab, tmp_path)


def tool(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], input=input, capture_output=True, text=True,
                          timeout=60)


def test_symlinks_in_a_checkpoint_are_refused_and_named(env):
    """`ln -s /etc/hostname step_1/x` would copy the training host's /etc/hostname to the eval
    host. Links are refused (not skipped: a skipped weight file would leave a checkpoint that
    looks complete but is not), and the message names each link and where it points."""
    src = env.ckpt(1, {"model.safetensors": 1, "config.json": b"{}\n"})
    os.symlink("/etc/hostname", src / "x")
    os.symlink("/etc", src / "etcdir")
    (src / "sub").mkdir()
    os.symlink("../config.json", src / "sub" / "cfg")
    with pytest.raises(SyncError) as e:
        env.sync("1")
    msg = str(e.value)
    assert "symbolic links" in msg and "x -> /etc/hostname" in msg and "etcdir -> /etc" in msg
    assert "sub/cfg -> ../config.json" in msg
    assert "Traceback" not in msg
    assert not (env.dst_run / "step_1").exists() and not env.staging(1).exists()
    # `ckpts` still lists the checkpoint (its regular files only)
    res = tool("list", str(env.src_run.parent), "--run", env.run, env.run, "step_{step}")
    row = json.loads(res.stdout)["runs"][env.run]["checkpoints"][0]
    assert row["files"] == 2 and row["size"] == MiB + 3


def test_a_checkpoint_folder_that_is_itself_a_link_is_refused_and_named(env):
    """`ln -s /elsewhere step_6`: the folder a link points to is not the checkpoint folder the
    listing names (it can be anywhere on the host); refused like links inside one, nothing moved."""
    real = env.src_run.parent / f"{env.run}-elsewhere"
    env.ckpt(5, {"model.safetensors": 1, "config.json": b"{}\n"}).rename(real)
    os.symlink(real, env.src_run / "step_6")
    with pytest.raises(SyncError) as e:
        env.sync("6")
    msg = str(e.value)
    assert "is a symbolic link" in msg and f"-> {real}" in msg and "Traceback" not in msg, msg
    assert not (env.dst_run / "step_6").exists() and not env.staging(6).exists()


def test_a_part_file_in_the_source_is_refused_and_named(env):
    """A `.part` file in a training checkpoint is something still being written; the eval side
    treats `.part` as an interrupted transfer. It is never skipped without a word."""
    src = env.ckpt(2, {"model.safetensors": 1, "config.json": b"{}\n", "optim/state.pt.part": b"half"})
    with pytest.raises(SyncError, match=r"unfinished files \(\*\.part\).*optim/state\.pt\.part"):
        env.sync("2")
    assert not (env.dst_run / "step_2").exists()
    (src / "optim" / "state.pt.part").rename(src / "optim" / "state.pt")
    env.sync("2")
    identical(src, env.dst_run / "step_2")


def test_files_named_like_flags_arrive_intact(env):
    """A file named `--sha256` was taken for the flag of `recv` (its argv was scanned whole)."""
    src = env.ckpt(3, {"--sha256": b"not a flag\n", "--idle": b"nor this\n", "--hash": b"x" * 5000,
                       "model.safetensors": 1, "config.json": b"{}\n"})
    res = env.sync("3")
    assert res.verified == 5 and not res.resent
    identical(src, env.dst_run / "step_3")


def test_a_same_size_same_mtime_rewrite_is_hashed_again(env):
    """A manifest cache keyed by (path, size, mtime) alone would keep the old sha256 over a rewrite
    keeping both (a copy with `cp -p`, or two writes within one mtime tick), and the next sync of
    that folder would fail twice over a "checksum mismatch": inode and ctime are keys too."""
    src = env.ckpt(4, {"model.safetensors": 2, "config.json": b"{}\n"})
    env.sync("4")
    cached = json.loads((src / ".dflash-manifest.json").read_text())
    weights = src / "model.safetensors"
    before = os.stat(weights)
    data = bytearray(weights.read_bytes())
    data[123] ^= 0xFF
    with open(weights, "r+b") as f:                 # in place: same inode, same size
        f.write(data)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(weights).st_mtime_ns == before.st_mtime_ns and os.stat(weights).st_size == before.st_size
    listed = json.loads(tool("manifest", str(src)).stdout)
    entry = {e["path"]: e for e in listed["files"]}["model.safetensors"]
    assert entry["sha256"] is None, "the cache vouched for a file that was rewritten"
    old = {e["path"]: e for e in cached["files"]}["model.safetensors"]["sha256"]
    assert old != sha(weights)
    shutil.rmtree(env.dst_run / "step_4")          # sync the rewritten folder again
    res = env.sync("4")
    assert not res.resent
    identical(src, env.dst_run / "step_4")
    # the cache written by that sync vouches for the new bytes, and is used by the next listing
    listed = json.loads(tool("manifest", str(src)).stdout)
    assert {e["path"]: e["sha256"] for e in listed["files"]}["model.safetensors"] == sha(weights)


@pytest.mark.parametrize("rel", [".dflash-owner", ".dflash-verified/model.bin.json", "sub/.dflash-manifest.json",
                                 "model.bin.part"])
def test_reserved_names_from_a_manifest_are_refused(tmp_path, rel):
    """The receiver and the finaliser take relative paths from the manifest the orchestrator sends;
    the staging folder's own bookkeeping names must never be one of them."""
    res = tool("recv", str(tmp_path), "step_1", rel, "10", "0", "0", "token")
    assert res.returncode == 1 and f"reserved name {rel!r}" in res.stderr, res.stderr
    lock = json.dumps({"rundir": str(tmp_path), "ckpt": "step_1", "token": "token", "wait": 1})
    hold = subprocess.run([sys.executable, str(TOOL), "serve"],
                          input=f"LOCK {lock}\nBEGIN\nFINALIZE " + json.dumps(
                              {"files": [{"path": rel, "size": 1, "mtime_ns": 0, "sha256": "0" * 64}]}) + "\n",
                          capture_output=True, text=True, timeout=60)
    lines = hold.stdout.splitlines()
    assert lines[:2] == ["LOCK", "BEGIN"] and lines[2].startswith("ERROR") and "reserved name" in lines[2], lines
    assert not (tmp_path / "step_1").exists()


def test_finalize_replaces_a_copy_only_by_its_digest_and_the_next_lock_removes_a_crashs_leftover(tmp_path):
    """FINALIZE with ``replace`` renames the staging folder over the copy there only when that
    copy's manifest has the digest given (STATE's ``final_digest``); a copy set aside by a crash
    between the two renames (``.old-CKPT``) goes at the next LOCK."""
    import hashlib

    digest = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    final = tmp_path / "step_1"
    final.mkdir()
    (final / "w.bin").write_bytes(b"old")
    (final / ".dflash-manifest.json").write_text(json.dumps(
        {"files": [{"path": "w.bin", "size": 3, "mtime_ns": 1, "sha256": digest(b"old")}]}))
    (tmp_path / ".old-step_1" / "sub").mkdir(parents=True)
    s = subprocess.Popen([sys.executable, str(TOOL), "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(verb: str, payload=None) -> str:
        s.stdin.write(verb + ("" if payload is None else " " + json.dumps(payload)) + "\n")
        s.stdin.flush()
        return s.stdout.readline().strip()
    try:
        where = {"rundir": str(tmp_path), "ckpt": "step_1"}
        assert ask("LOCK", {**where, "token": "tok", "wait": 1}) == "LOCK"
        assert not (tmp_path / ".old-step_1").exists()
        copy = json.loads(ask("STATE", where)[len("STATE "):])["final_digest"]
        assert ask("BEGIN") == "BEGIN"
        r = subprocess.run([sys.executable, str(TOOL), "recv", str(tmp_path), "step_1", "w.bin", "3", "0", "2", "tok"],
                           input=b"new" + b"DFLT" + digest(b"new").encode() + b"\n", capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        files = [{"path": "w.bin", "size": 3, "mtime_ns": 2, "sha256": digest(b"new")}]
        refused = ask("FINALIZE", {"files": files, "replace": digest(b"another copy")})
        assert refused.startswith("ERROR") and "not the copy this sync was to replace" in refused, refused
        assert (final / "w.bin").read_bytes() == b"old"
        done = json.loads(ask("FINALIZE", {"files": files, "replace": copy})[len("FINALIZE "):])
        assert (final / "w.bin").read_bytes() == b"new" and done["digest"] != copy
        assert sorted(p.name for p in tmp_path.iterdir()) == [".lock-step_1", "step_1"]
    finally:
        s.stdin.close()
        s.wait(30)
