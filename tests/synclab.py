"""What the sync tests share: a training run of its own per test on the SSH lab (``Env``), big
files made of a 1 MiB random block (real bytes for sha256 and the ciphers), the check that a
synced checkpoint is byte-identical with its manifest, a sync paused in its sender (``Paused``) and
the hosts' ``serve`` sessions (``serve_pids``)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from orchestrator.config.catalog import parse_catalog
from orchestrator.config.inventory import load_inventory
from orchestrator.sync import sync_checkpoint
from waiting import wait_for

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
FAST = dict(alive=(2, 3), idle=6.0, stall=20.0, progress=None)  # quick dead-link detection for tests
_BLOCK = os.urandom(MiB)


def write_file(path: Path, mib: int, salt: bytes = b"") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    block = bytearray(_BLOCK)
    with open(path, "wb") as f:
        for i in range(mib):
            block[:16] = hashlib.md5(salt + i.to_bytes(4, "little")).digest()  # not one repeated block
            f.write(block)


def sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


class Env:
    def __init__(self, lab, tmp: Path, eval_ckpts: Path | None = None):
        self.lab = lab
        self.run = f"r{uuid.uuid4().hex[:8]}"
        eval_over = {"checkpoints": str(eval_ckpts)} if eval_ckpts else {}
        self.inv_path = lab.write_inventory(tmp / "inventory.yaml", eval=eval_over)
        self.inv = load_inventory(self.inv_path)
        self.cat_path = tmp / "drafters.yaml"
        self.cat_path.write_text(json.dumps({"runs": {self.run: {"dir": self.run, "pattern": "step_{step}",
                                                                  "settle": 0}}}))  # files written just now
        self.catalog = parse_catalog(json.loads(self.cat_path.read_text()), self.cat_path)
        self.src_run = lab.train.root / "checkpoints" / self.run
        self.dst_run = (eval_ckpts or lab.eval.root / "checkpoints") / self.run

    def ckpt(self, step: int, files: dict[str, int | bytes]) -> Path:
        d = self.src_run / f"step_{step}"
        for rel, spec in files.items():
            if isinstance(spec, bytes):
                (d / rel).parent.mkdir(parents=True, exist_ok=True)
                (d / rel).write_bytes(spec)
            else:
                write_file(d / rel, spec, salt=rel.encode())
        return d

    def sync(self, name: str, **kw):
        return sync_checkpoint(self.inv, self.catalog, name, run=self.run, **{**FAST, **kw})

    def cli(self, *args: str, **kw) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "-i", str(self.inv_path), *args,
                                 "--catalog", str(self.cat_path)], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **kw)

    def staging(self, step: int) -> Path:
        return self.dst_run / f".staging-step_{step}"

    def part_size(self, step: int, rel: str) -> int:
        try:
            return (self.staging(step) / f"{rel}.part").stat().st_size
        except OSError:
            return 0

    def wait_part(self, step: int, rel: str, at_least: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.part_size(step, rel) < at_least:
            assert time.monotonic() < deadline, "transfer did not start"
            time.sleep(0.05)


def _files(d: Path) -> list[str]:
    """Every file under ``d``, dotfiles included, but the sync's own bookkeeping (.dflash-* at the top)."""
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*")
                  if p.is_file() and not p.relative_to(d).parts[0].startswith(".dflash-"))


def identical(src: Path, dst: Path) -> None:
    names, got = _files(src), _files(dst)
    assert names == got
    for n in names:
        assert sha(src / n) == sha(dst / n), n
    manifest = json.loads((dst / ".dflash-manifest.json").read_text())
    assert {e["path"]: e["sha256"] for e in manifest["files"]} == {n: sha(src / n) for n in names}


class Paused:
    """A sync whose training host's sender of FILE pauses once BYTES are out (tests/faultpy.py)."""

    def __init__(self, env: Env, tmp: Path, step: int, file: str, at: int, tunnel: str | None = None):
        self.dir = tmp / "fault"
        self.dir.mkdir()
        spec = self.dir / "spec.json"
        spec.write_text(json.dumps({"dir": str(self.dir), "pause": {"at": "send", "file": file, "bytes": at}}))
        wrapper = self.dir / "python"
        wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {REPO / "tests" / "faultpy.py"} {spec} "$@"\n')
        wrapper.chmod(0o755)
        inv = load_inventory(env.lab.write_inventory(tmp / "faulty.yaml", train={"python": str(wrapper)}))
        self.box: dict = {}

        def go():
            try:
                self.box["res"] = sync_checkpoint(inv, env.catalog, str(step), run=env.run, tunnel=tunnel, **FAST)
            except Exception as e:  # noqa: BLE001
                self.box["err"] = e
        self.t = threading.Thread(target=go)
        self.t.start()
        wait_for(lambda: (self.dir / "paused").exists() or not self.t.is_alive(), 60, "the pause point")
        assert self.t.is_alive(), self.box

    def release(self) -> dict:
        (self.dir / "release").touch()
        self.t.join(120)
        assert not self.t.is_alive()
        return self.box


def serve_pids(host) -> list[int]:
    """The `sync_host.py serve` sessions of the lab host ``host`` (by the address their sshd took them in on),
    without their guardians."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        conn = next((e.split(b"=", 1)[1].split() for e in env if e.startswith(b"SSH_CONNECTION=")), [])
        if b"serve" in cmd and conn[2:4] == [host.address.encode(), str(host.port).encode()] and \
                _stdin(entry) != "/dev/null":  # not its guardian (remote/sync_host.py Guardian)
            pids.append(int(entry))
    return pids


def _stdin(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/fd/0")
    except OSError:
        return None
