"""Fault injection for `sync-ckpt` on the SSH lab: a real fault at an exact point of a real sync,
then a plain rerun; after it every byte is identical and the rerun sent exactly what had not yet
arrived (nothing verified is sent again, a partial file resumes from its end).

Faults: kill the local process (SIGKILL), kill the remote side (SIGKILL every sync_host process of
the sync on both hosts), drop the link (`ip link set down` on the eval host's veth), fill the
destination disk (a tmpfs). Points: before the first byte (lock held, staging made), mid-transfer
(the first file verified, the second 1 MiB in), between verification and the final rename (the lock
holder about to rename the staging folder). The points are pauses planted by tests/faultpy.py, the
hosts' `python` in the faulty run's inventory. The table of outcomes is printed at the end of the
run and kept in docs/reliability.md.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from faulttable import Table
from waiting import wait_for
from synclab import MiB, Env, sha

REPO = Path(__file__).resolve().parents[1]
FAULTS = ("kill-local", "kill-remote", "link-down", "disk-full")
POINTS = ("before", "mid", "rename")
FILES = {"a.bin": 6, "b.bin": 3, "config.json": b'{"block_size": 16}\n'}  # sent in this order (jobs=1)
FAST = dict(jobs=1, alive=(1, 3), idle=5.0, stall=20.0)
LINK_DOWN_S = 8.0

DRIVER = """
import json, sys
from orchestrator.config.catalog import parse_catalog
from orchestrator.config.inventory import load_inventory
from orchestrator.sync import SyncError, sync_checkpoint
inv, cat, run, name, opts = sys.argv[1:6]
try:
    res = sync_checkpoint(load_inventory(inv), parse_catalog(json.load(open(cat)), cat), name, run=run,
                          progress=False, **json.loads(opts))
    print(json.dumps({"ok": True, "moved": res.bytes_moved}))
except SyncError as e:
    print(json.dumps({"ok": False, "error": str(e)}))
"""

PROBE = """
import hashlib, json, os, sys
rundir, ckpt = sys.argv[1:3]
final, staging = os.path.join(rundir, ckpt), os.path.join(rundir, ".staging-" + ckpt)
def digest(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
out = {"final": None, "verified": {}, "parts": {}, "staging": os.path.isdir(staging)}
if os.path.isdir(final):
    out["final"] = {os.path.relpath(os.path.join(d, n), final): digest(os.path.join(d, n))
                    for d, dirs, names in os.walk(final) for n in names if not n.startswith(".")}
    out["final_dot"] = sorted(n for n in os.listdir(final) if n.startswith("."))
    with open(os.path.join(final, ".dflash-manifest.json")) as f:
        out["manifest"] = {e["path"]: e["sha256"] for e in json.load(f)["files"]}
records = os.path.join(staging, ".dflash-verified")
for d, dirs, names in os.walk(records):
    for n in names:
        rec = json.load(open(os.path.join(d, n)))
        p = os.path.join(staging, rec["path"])
        if os.path.isfile(p) and os.path.getsize(p) == rec["size"]:
            out["verified"][rec["path"]] = rec["size"]
for d, dirs, names in os.walk(staging):
    for n in names:
        if n.endswith(".part"):
            out["parts"][os.path.relpath(os.path.join(d, n), staging)[:-5]] = os.path.getsize(os.path.join(d, n))
print(json.dumps(out))
"""

FILL = """
import errno, sys
with open(sys.argv[1], "wb", buffering=0) as f:
    for size in (1 << 20, 4096):
        try:
            while True:
                f.write(b"\\0" * size)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
"""


def in_eval_ns(lab, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run on the eval host's side of the file system (its mount namespace holds the tmpfs)."""
    return subprocess.run(["nsenter", "-t", str(lab.eval.sshd_pid()), "-m", "--", *argv], capture_output=True,
                          text=True, timeout=60, check=check)


def tool_pids(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


@pytest.fixture(scope="module")
def small_disk(ssh_lab, tmp_path_factory):
    """A 96 MiB tmpfs as the eval host's checkpoints root for the disk-full cases (mounted in the
    eval sshd's mount namespace; the sync's free-space check wants its 64 MiB reserve)."""
    mnt = tmp_path_factory.mktemp("small-disk")
    if in_eval_ns(ssh_lab, ["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(mnt)], check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    in_eval_ns(ssh_lab, ["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def table(request):
    return Table(request, "sync fault injection",
                 ("fault", "point", "faulty run", "rerun sent", "of not yet verified", "identical"))


class Case:
    def __init__(self, lab, tmp: Path, fault: str, point: str, small_disk: Path | None):
        self.lab, self.fault, self.point, self.dir = lab, fault, point, tmp / "fault"
        self.dir.mkdir()
        self.env = Env(lab, tmp, eval_ckpts=small_disk)
        self.src = self.env.ckpt(1, dict(FILES))
        self.total = sum(p.stat().st_size for p in self.src.iterdir())
        pause = {"before": {"at": "send", "file": "a.bin", "bytes": 0},
                 "mid": {"at": "send", "file": "b.bin", "bytes": MiB},
                 "rename": {"at": "rename", "ckpt": "step_1"}}[point]
        self.spec = self.dir / "spec.json"
        self.spec.write_text(json.dumps({"dir": str(self.dir), "pause": pause}))
        wrapper = self.dir / "python"
        wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {REPO / "tests" / "faultpy.py"} {self.spec} "$@"\n')
        wrapper.chmod(0o755)
        eval_over = {"python": str(wrapper), **({"checkpoints": str(small_disk)} if small_disk else {})}
        self.faulty_inv = lab.write_inventory(tmp / "faulty.yaml", train={"python": str(wrapper)}, eval=eval_over)

    def part_size(self, name: str) -> int | None:
        """Seen through the eval sshd's root: its mount namespace holds the tmpfs of the disk-full cases."""
        part = Path(f"/proc/{self.lab.eval.sshd_pid()}/root") / str(self.env.staging(1)).lstrip("/") / f"{name}.part"
        try:
            return part.stat().st_size
        except OSError:
            return None

    def probe(self) -> dict:
        res = in_eval_ns(self.lab, [sys.executable, "-c", PROBE, str(self.env.dst_run), "step_1"])
        return json.loads(res.stdout)

    def faulty_run(self) -> str:
        opts = json.dumps({**FAST, "lock_wait": 30})
        driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(self.faulty_inv), str(self.env.cat_path),
                                   self.env.run, "step_1", opts], cwd=REPO, stdout=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: (self.dir / "paused").exists() or driver.poll() is not None, 60, "the pause point")
            assert driver.poll() is None, f"the sync ended before the pause point: {driver.stdout.read()}"
            if self.point in ("before", "mid"):          # the receiver has exactly what the sender sent
                name, size = ("a.bin", 0) if self.point == "before" else ("b.bin", MiB)
                wait_for(lambda: self.part_size(name) == size, 30, f"{name}.part to reach {size} bytes")
            filler = self.env.dst_run.parent / f"filler-{self.env.run}"
            if self.fault == "kill-local":
                driver.send_signal(signal.SIGKILL)
            elif self.fault == "kill-remote":
                for pid in tool_pids(str(self.spec)):
                    os.kill(pid, signal.SIGKILL)
            elif self.fault == "link-down":
                self.lab.link_down("eval")
            elif self.fault == "disk-full":
                in_eval_ns(self.lab, [sys.executable, "-c", FILL, str(filler)])
            (self.dir / "release").touch()
            try:
                if self.fault == "link-down":
                    try:
                        driver.wait(LINK_DOWN_S)
                    except subprocess.TimeoutExpired:
                        pass
                    self.lab.link_up("eval")
                out = driver.communicate(timeout=120)[0]
            finally:
                if self.fault == "link-down":
                    self.lab.link_up("eval")
                in_eval_ns(self.lab, ["rm", "-f", str(filler)], check=False)
        finally:
            (self.dir / "release").touch()            # whatever happened, no pause outlives the case
            if driver.poll() is None:
                driver.kill()
                driver.wait()
        wait_for(lambda: not tool_pids(str(self.spec)), 30, "the faulty sync's host processes to end")
        if self.fault == "kill-local":
            return "killed"
        res = json.loads(out.strip().splitlines()[-1])
        return "completed" if res["ok"] else "failed: " + res["error"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("fault", FAULTS)
def test_fault_then_rerun_moves_only_what_is_missing_and_ends_identical(ssh_lab, tmp_path, request, table,
                                                                         fault, point):
    if fault == "link-down" and not ssh_lab.isolated:
        pytest.skip(f"needs network namespaces: {ssh_lab.fallback_reason}")
    disk = request.getfixturevalue("small_disk") if fault == "disk-full" else None
    case = Case(ssh_lab, tmp_path, fault, point, disk)
    outcome = case.faulty_run()
    before = case.probe()
    sizes = {p.name: p.stat().st_size for p in case.src.iterdir() if not p.name.startswith(".")}
    missing = 0 if before["final"] else sum(size - before["parts"].get(rel, 0)
                                             for rel, size in sizes.items() if rel not in before["verified"])
    res = case.env.sync("step_1", lock_wait=60, **FAST)
    after = case.probe()
    want = {rel: sha(case.src / rel) for rel in sizes}
    same = (after["final"] == want and after["manifest"] == want
            and after["final_dot"] == [".dflash-manifest.json", ".dflash-synced.json"])
    table.append((fault, point, outcome[:70], f"{res.bytes_moved / MiB:.2f} MiB", f"{missing / MiB:.2f} MiB",
                  "yes" if same else "NO"))
    assert same, (after, want)
    assert res.bytes_moved == missing, (outcome, before)
    if fault == "disk-full" and point != "rename":  # the receiver's word, with the bytes really on disk
        m = re.match(r"failed: no space left on eval:\S+ while moving (\S+): ([\d,]+) of ([\d,]+) bytes arrived", outcome)
        assert m and "it resumes" in outcome, outcome
        rel, arrived, size = m.group(1), int(m.group(2).replace(",", "")), int(m.group(3).replace(",", ""))
        assert (arrived, size) == (before["parts"].get(rel, 0), sizes[rel]), (outcome, before)
    if point == "rename":                          # everything was verified before the fault
        assert missing == 0
    if point == "mid":                             # the first file had been verified: never sent again
        assert before["final"] or "a.bin" in before["verified"], before
    assert not after["staging"]
