"""sync-ckpt throughput vs a raw `ssh train cat FILE | ssh eval 'cat > FILE'` pipe, same file, same run.

    python benchmarks/bench_sync.py [--mib 1024] [--reps 2]

Starts its own SSH lab (tests/sshlab.py: real sshd hosts in network namespaces; needs root), writes
a checkpoint with one big file (a repeated 1 MiB random block: real bytes to hash and encrypt), then
alternates: the raw pipe (plain `ssh`, default options) and a full `sync_checkpoint` (fresh: the
destination and the source's manifest cache are removed first, so sha256 is computed in flight on
both ends; every step counted: listing, manifest, lock, transfer, verify, fsync, rename).
Prints MiB/s of both and the ratio sync/pipe (goal >= 1.0).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import sshlab  # noqa: E402

from orchestrator.catalog import parse_catalog  # noqa: E402
from orchestrator.inventory import load_inventory  # noqa: E402
from orchestrator.sync import sync_checkpoint  # noqa: E402
from remote.checkpoint import sha256_file as sha256  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="size of the checkpoint file (MiB)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=4)
    args = ap.parse_args()

    base = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    lab = sshlab.start_lab(base / "lab")
    try:
        inv = load_inventory(lab.write_inventory(base / "inventory.yaml"))
        cat = parse_catalog({"runs": {"bench": {"dir": "bench", "pattern": "step_{step}"}}}, base / "c.yaml")
        ck = lab.train.root / "checkpoints" / "bench" / "step_1000"
        ck.mkdir(parents=True)
        big = ck / "model.safetensors"
        block = os.urandom(1 << 20)
        with open(big, "wb") as f:
            for _ in range(args.mib):
                f.write(block)
        (ck / "config.json").write_text('{"block_size": 16}\n')
        want = sha256(big)
        size = big.stat().st_size
        dest_root = lab.eval.root / "checkpoints" / "bench"
        raw_dst = lab.eval.root / "raw.bin"

        def ssh(h) -> list[str]:
            return ["ssh", "-i", str(lab.client_key), "-o", f"UserKnownHostsFile={lab.known_hosts}",
                    "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-p", str(h.port),
                    f"{h.user}@{h.address}"]

        def raw() -> float:
            raw_dst.unlink(missing_ok=True)
            t = time.monotonic()
            a = subprocess.Popen(ssh(lab.train) + ["cat", str(big)], stdout=subprocess.PIPE)
            b = subprocess.Popen(ssh(lab.eval) + [f"cat > {raw_dst}"], stdin=a.stdout)
            a.stdout.close()
            if b.wait() or a.wait():
                raise SystemExit("raw pipe failed")
            return time.monotonic() - t

        def ours() -> float:
            shutil.rmtree(dest_root, ignore_errors=True)
            (ck / ".dflash-manifest.json").unlink(missing_ok=True)
            t = time.monotonic()
            res = sync_checkpoint(inv, cat, "step_1000", jobs=args.jobs)
            dt = time.monotonic() - t
            assert res.bytes_moved == size + (ck / "config.json").stat().st_size, res.bytes_moved
            return dt

        pipe_t, sync_t = [], []
        for i in range(args.reps):
            pipe_t.append(raw())
            sync_t.append(ours())
            print(f"rep {i + 1}: pipe {args.mib / pipe_t[-1]:7.1f} MiB/s   sync {args.mib / sync_t[-1]:7.1f} MiB/s",
                  flush=True)
        ok = sha256(dest_root / "step_1000" / "model.safetensors") == want == sha256(raw_dst)
        p, s = statistics.median(pipe_t), statistics.median(sync_t)
        print(f"file {args.mib} MiB, {args.reps} reps (median), lab isolated={lab.isolated}, "
              f"cpus={os.cpu_count()}")
        print(f"raw ssh cat | ssh cat  : {args.mib / p:7.1f} MiB/s  ({p:.2f} s)")
        print(f"sync-ckpt (sha256 in flight, verify, fsync, atomic rename): "
              f"{args.mib / s:7.1f} MiB/s  ({s:.2f} s)")
        print(f"ratio sync/pipe: {p / s:.2f}x   byte-identical: {ok}")
        return 0 if ok else 1
    finally:
        lab.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
