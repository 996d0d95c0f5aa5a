"""`sync_host recv` writes what arrives straight to disk (O_DIRECT where the file system takes it,
whole blocks, the unaligned tail kept for the next write): whatever the stream's pieces and pauses
and wherever a resume starts, the .part holds exactly the bytes that arrived once the stream
pauses, and the file ends identical. A real `sync_host.py` process on real file systems."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from waiting import wait_for

TOOL = Path(__file__).resolve().parents[1] / "remote" / "sync_host.py"
TOKEN = "t" * 32


def roots(tmp_path: Path) -> list[Path]:
    """This test's folder (a disk file system) and, where there is one, a tmpfs."""
    shm = Path("/dev/shm")
    return [tmp_path] + ([Path(tempfile.mkdtemp(dir=shm))] if shm.is_dir() and os.access(shm, os.W_OK) else [])


@pytest.mark.parametrize("offset", [0, (1 << 20) + 123], ids=["fresh", "resume-unaligned"])
def test_recv_writes_exactly_what_arrived_and_ends_identical(tmp_path, offset):
    rng = random.Random(offset)
    data = rng.randbytes((9 << 20) + 4321)
    digest = hashlib.sha256(data).hexdigest()
    for root in roots(tmp_path):
        rundir = root / "run"
        staging = rundir / ".staging-step_1"
        staging.mkdir(parents=True)
        (staging / ".dflash-owner").write_text(TOKEN)
        lock = os.open(rundir / ".lock-step_1", os.O_RDWR | os.O_CREAT)
        fcntl.flock(lock, fcntl.LOCK_EX)  # as the lock holder does
        part = staging / "w.bin.part"
        part.write_bytes(data[:offset])
        try:
            p = subprocess.Popen([sys.executable, "-S", str(TOOL), "recv", str(rundir), "step_1", "w.bin",
                                  str(len(data)), str(offset), "1", TOKEN], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            pos, paused = offset, False
            while pos < len(data):
                n = rng.choice([1, 4095, 4097, 32768, 1 << 20, 3 << 20])
                p.stdin.write(data[pos:pos + n])
                p.stdin.flush()
                pos += len(data[pos:pos + n])
                if not paused and pos - offset > (5 << 20) + 7:  # a pause: what arrived is on disk
                    paused = True
                    wait_for(lambda: part.stat().st_size == pos, 10, f"{part} to reach {pos} bytes")
            p.stdin.write(b"DFLT" + digest.encode() + b"\n")
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            assert out.decode().splitlines()[-1] == f"OK {digest}", out
            assert (staging / "w.bin").read_bytes() == data
            assert not part.exists()
        finally:
            os.close(lock)


def test_recv_pulls_the_stream_from_a_command_it_runs(tmp_path):
    """`recv --pull ARGV` (how --tunnel and --direct receive): the stream is the stdout of a
    command the receiver starts (here the sender itself), whose stderr comes back as `PULL` lines;
    a failing puller is stopped and named, the .part keeps what arrived."""
    data = random.Random(7).randbytes((3 << 20) + 77)
    src = tmp_path / "src" / "w.bin"
    src.parent.mkdir()
    src.write_bytes(data)
    st = src.stat()
    rundir = tmp_path / "run"
    staging = rundir / ".staging-step_1"
    staging.mkdir(parents=True)
    (staging / ".dflash-owner").write_text(TOKEN)
    lock = os.open(rundir / ".lock-step_1", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        def recv(pull: list[str], name: str = "w.bin") -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-S", str(TOOL), "recv", str(rundir), "step_1", name,
                                   str(len(data)), "0", str(st.st_mtime_ns), TOKEN, "--pull", json.dumps(pull)],
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        ok = recv([sys.executable, "-S", str(TOOL), "send", str(src), str(len(data)), str(st.st_mtime_ns), "0",
                   "--hash"])
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.splitlines()[-1] == f"OK {hashlib.sha256(data).hexdigest()}"
        assert (staging / "w.bin").read_bytes() == data
        half = recv([sys.executable, "-c", "import sys; sys.stdout.buffer.write(open(sys.argv[1], 'rb').read(5000)); "
                     "sys.stderr.write('Connection to training host closed.\\n')", str(src)], name="x.bin")
        assert half.returncode == 4 and half.stdout.splitlines()[-1] == "SHORT 5000", half
        assert "PULL Connection to training host closed." in half.stderr.splitlines(), half.stderr
        assert (staging / "x.bin.part").read_bytes() == data[:5000]
    finally:
        os.close(lock)
