"""sync-ckpt throughput, relay and tunnel, vs a raw `ssh cat | ssh cat` pipe and vs rsync through a
reverse tunnel.

    python benchmarks/bench_sync.py [--mib 1024] [--reps 3]     (root: the lab uses namespaces)

Starts its own SSH lab (tests/sshlab.py: real sshd hosts in network namespaces, which cannot reach
each other; needs root), writes a checkpoint with one big file (a repeated 1 MiB random block: real
bytes to hash and encrypt) and a config.json, then runs, interleaved and in rotating order:

- pipe: `ssh train cat FILE | ssh eval 'cat > FILE'`, plain `ssh`, default options (the default
  cipher: chacha20-poly1305), no checksum;
- rsync: the best relay peer measured on these machines: this machine holds `ssh -R` to the eval
  host (aes128-gcm) and the eval host pulls with `rsync -a --whole-file` over ssh (aes128-gcm)
  through that tunnel;
- relay: a full `sync_checkpoint` through this machine (fresh: the destination and the source's
  manifest cache are removed first, so sha256 is computed in flight on both ends; every step
  counted: listing, manifest, lock, transfer, verify, fsync, rename), then the same sync again with
  nothing to move (its time is reported apart);
- tunnel: the same full sync with ``tunnel="tunnel"`` (the eval host pulls through a socket this
  machine forwards: the rsync peer's topology).

Prints MiB/s of each (median), the ratios relay/pipe (goal >= 1.5) and tunnel/rsync (goal >= 1.0),
the nothing-to-move time (goal <= 1.5 s), CPU seconds per GiB of every process of each method and
the load average before and after; every output is checked byte-identical. ``--only pipe,relay``
(etc.) runs a subset; pipe-gcm is the raw pipe with aes128-gcm on both legs (only with --only).

``--small 1000`` measures many small files instead: a full sync (relay, then ``--tunnel``) of a
checkpoint of 1,000 files of 64 B and of one of a single file of the same total size, interleaved;
prints the medians and their ratio (goal <= 3: small files move in batches, one stream for many).
"""
from __future__ import annotations

import argparse
import os
import shlex
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

from orchestrator.config.catalog import parse_catalog  # noqa: E402
from orchestrator.config.inventory import load_inventory  # noqa: E402
from orchestrator.sync import sync_checkpoint  # noqa: E402
from remote.drafters.checkpoint import sha256_file as sha256  # noqa: E402


class CpuMeter:
    """CPU seconds used by every process of the benchmark: this one, its children, and both lab
    sshd trees (sessions and the commands they run), counted by the kernel in a cpuacct cgroup (v1)
    they are moved into. Independent of what else the machine runs, unlike wall time. ``read()``
    is None where no cgroup can be made (not root, no cpuacct hierarchy)."""

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self, pids: list[int]):
        self.dir: Path | None = self.ROOT / f"dflash-bench-sync-{os.getpid()}"
        try:
            self.dir.mkdir()
            for pid in pids:
                (self.dir / "cgroup.procs").write_text(str(pid))
        except OSError:
            self.close()
            self.dir = None

    def read(self) -> float | None:
        return int((self.dir / "cpuacct.usage").read_text()) / 1e9 if self.dir else None

    def close(self) -> None:
        """Back to the root group (call after the lab is gone), then remove the group."""
        if self.dir is None:
            return
        try:
            (self.ROOT / "cgroup.procs").write_text(str(os.getpid()))
            self.dir.rmdir()
        except OSError:
            pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="size of the checkpoint file (MiB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--only", help="comma-separated subset of pipe,rsync,sync (while iterating)")
    ap.add_argument("--small", type=int, default=0, help="measure N files of 64 B against one file of N*64 B instead")
    args = ap.parse_args()

    base = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    lab = sshlab.start_lab(base / "lab")
    meter = CpuMeter([os.getpid(), *(h.sshd_pid() for h in lab.hosts.values())])
    try:
        inv = load_inventory(lab.write_inventory(base / "inventory.yaml"))
        cat = parse_catalog({"runs": {"bench": {"dir": "bench", "pattern": "step_{step}", "settle": 0}}}, base / "c.yaml")
        if args.small:
            return small_files(lab, inv, cat, args.small, args.reps, args.jobs)
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

        def raw(cipher: tuple[str, ...] = ()) -> float:
            raw_dst.unlink(missing_ok=True)
            t = time.monotonic()
            a = subprocess.Popen(ssh(lab.train)[:1] + list(cipher) + ssh(lab.train)[1:] + ["cat", str(big)],
                                 stdout=subprocess.PIPE)
            b = subprocess.Popen(ssh(lab.eval)[:1] + list(cipher) + ssh(lab.eval)[1:] + [f"cat > {raw_dst}"],
                                 stdin=a.stdout)
            a.stdout.close()
            if b.wait() or a.wait():
                raise SystemExit("raw pipe failed")
            return time.monotonic() - t

        rsync_dst = lab.eval.root / "rsync-dst"
        train_alias = "bench-train"
        rsync_known = base / "rsync_known_hosts"
        rsync_known.write_text(f"{train_alias} {lab.train.host_key_pub}\n")
        tunnel_port = 20000 + os.getpid() % 20000

        def rsync_tunnel() -> float:
            """The best relay peer: the eval host pulls with rsync over ssh (aes128-gcm) through a
            reverse tunnel (aes128-gcm) that this machine holds to the training host."""
            shutil.rmtree(rsync_dst, ignore_errors=True)
            rsync_dst.mkdir()
            inner = (f"ssh -p {tunnel_port} -i {lab.client_key} -o BatchMode=yes -o HostKeyAlias={train_alias} "
                     f"-o UserKnownHostsFile={rsync_known} -o StrictHostKeyChecking=yes "
                     f"-c aes128-gcm@openssh.com -o Compression=no")
            remote = ["rsync", "-a", "--whole-file", "-e", inner,
                      f"{lab.train.user}@127.0.0.1:{big}", f"{rsync_dst}/"]
            t = time.monotonic()
            subprocess.run(ssh(lab.eval)[:-1] + ["-c", "aes128-gcm@openssh.com", "-o", "ExitOnForwardFailure=yes",
                                                 "-R", f"127.0.0.1:{tunnel_port}:{lab.train.address}:{lab.train.port}",
                                                 ssh(lab.eval)[-1], shlex.join(remote)], check=True)
            return time.monotonic() - t

        noop: list[float] = []
        noop_cpu: list[float] = [0.0]

        def ours(how: str) -> float:
            shutil.rmtree(dest_root, ignore_errors=True)
            (ck / ".dflash-manifest.json").unlink(missing_ok=True)
            t = time.monotonic()
            res = sync_checkpoint(inv, cat, "step_1000", jobs=args.jobs, tunnel=how)
            dt = time.monotonic() - t
            assert res.bytes_moved == size + (ck / "config.json").stat().st_size, res.bytes_moved
            assert res.path == how, res.path
            if how == "relay":  # and once more, with nothing to move (its CPU is not the relay's)
                c, t = meter.read(), time.monotonic()
                again = sync_checkpoint(inv, cat, "step_1000", jobs=args.jobs, tunnel=how)
                noop.append(time.monotonic() - t)
                noop_cpu.append(meter.read() - c if c is not None else 0.0)
                assert again.bytes_moved == 0 and again.plan.up_to_date
            return dt

        runs = {"pipe": raw, "rsync": rsync_tunnel, "relay": lambda: ours("relay"), "tunnel": lambda: ours("tunnel"),
                "pipe-gcm": lambda: raw(("-c", "aes128-gcm@openssh.com"))}  # only with --only
        runs = {k: v for k, v in runs.items() if k in (args.only or "pipe,rsync,relay,tunnel").split(",")}
        load_before = os.getloadavg()
        times: dict[str, list[float]] = {k: [] for k in runs}
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        for i in range(args.reps):  # interleaved, rotating the order: a busy machine hits all alike
            order = list(runs)[i % len(runs):] + list(runs)[:i % len(runs)]
            for k in order:
                c = meter.read()
                times[k].append(runs[k]())
                if c is not None:
                    cpu[k].append(meter.read() - c - (noop_cpu[-1] if k == "relay" else 0.0))
            print(f"rep {i + 1}: " + "   ".join(f"{k} {args.mib / times[k][-1]:7.1f} MiB/s" for k in runs) +
                  ("   (cpu s: " + " ".join(f"{cpu[k][-1]:.1f}" for k in runs) + ")" if all(cpu.values()) else ""), flush=True)
        load_after = os.getloadavg()
        final = dest_root / "step_1000" / big.name
        outputs = {"pipe": raw_dst, "pipe-gcm": raw_dst, "rsync": rsync_dst / big.name, "relay": final, "tunnel": final}
        ok = all(sha256(outputs[k]) == want for k in runs if k not in ("relay", "tunnel")) and \
            (not {"relay", "tunnel"} & set(runs) or sha256(final) == want)
        gib = args.mib / 1024
        cpu_line = ("CPU seconds per GiB, all processes of each method, both hosts and here (kernel-counted; a busy VM "
                    "inflates it too, compare within a run): " +
                    "   ".join(f"{k} {statistics.median(cpu[k]) / gib:.2f}" for k in runs)) if all(cpu.values()) else \
            "CPU seconds: not measured (no cpuacct cgroup)"
        rate = {k: args.mib / statistics.median(times[k]) for k in runs}
        print(f"file {args.mib} MiB, {args.reps} reps (median), lab isolated={lab.isolated}, cpus={os.cpu_count()}, "
              f"load average before {load_before[0]:.2f} / after {load_after[0]:.2f} (1 min)")
        labels = {"pipe": "raw ssh cat | ssh cat (default cipher)", "pipe-gcm": "raw pipe, aes128-gcm both legs",
                  "rsync": "rsync via reverse tunnel (aes128-gcm)", "relay": "sync-ckpt relay (sha256, fsync, rename)",
                  "tunnel": "sync-ckpt --tunnel (sha256, fsync, rename)"}
        for k in runs:
            print(f"{labels[k]:44s}: {rate[k]:7.1f} MiB/s  ({statistics.median(times[k]):.2f} s)")
        if noop:
            print(f"sync-ckpt with nothing to move                : {statistics.median(noop):.2f} s "
                  f"(median of {len(noop)}; goal <= 1.5 s)")
        print(cpu_line)
        if {"pipe", "relay"} <= set(runs):
            print(f"ratio relay/pipe: {rate['relay'] / rate['pipe']:.2f}x (goal >= 1.5)")
        if {"rsync", "tunnel"} <= set(runs):
            print(f"ratio tunnel/rsync-tunnel: {rate['tunnel'] / rate['rsync']:.2f}x (goal >= 1.0)")
        if {"rsync", "relay"} <= set(runs):
            print(f"ratio relay/rsync-tunnel: {rate['relay'] / rate['rsync']:.2f}x   "
                  f"rsync-tunnel/pipe: {rate['rsync'] / rate.get('pipe', float('nan')):.2f}x")
        print(f"byte-identical: {ok}")
        return 0 if ok else 1
    finally:
        lab.close()
        meter.close()
        shutil.rmtree(base, ignore_errors=True)


def small_files(lab, inv, cat, n: int, reps: int, jobs: int) -> int:
    """A full sync of ``n`` files of 64 B against one of a single file of ``n * 64`` B (relay and
    tunnel, interleaved); the ratio of the medians (goal <= 3)."""
    run = lab.train.root / "checkpoints" / "bench"
    many, one = run / "step_2000", run / "step_3000"
    for i in range(n):
        f = many / f"shard-{i:05d}.bin"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(os.urandom(64))
    one.mkdir(parents=True)
    (one / "model.safetensors").write_bytes(os.urandom(64 * n))
    for d in (many, one):
        (d / "config.json").write_text("{}\n")
    dest = lab.eval.root / "checkpoints" / "bench"
    times: dict[tuple[str, str], list[float]] = {}
    for i in range(reps):
        for how in ("relay", "tunnel"):
            for name, d in (("many", many), ("one", one)) if i % 2 == 0 else (("one", one), ("many", many)):
                shutil.rmtree(dest / d.name, ignore_errors=True)
                (d / ".dflash-manifest.json").unlink(missing_ok=True)
                t = time.monotonic()
                res = sync_checkpoint(inv, cat, d.name, jobs=jobs, tunnel=how)
                times.setdefault((how, name), []).append(time.monotonic() - t)
                assert res.verified == len(list(d.iterdir())) - 1 and res.path == how
                assert all((dest / d.name / f.name).read_bytes() == f.read_bytes()
                           for f in d.iterdir() if not f.name.startswith("."))
    ok = True
    for how in ("relay", "tunnel"):
        m, o = statistics.median(times[(how, "many")]), statistics.median(times[(how, "one")])
        ok &= m <= 3 * o
        print(f"{how:6s}: {n} files of 64 B {m:.2f} s, one file of {64 * n} B {o:.2f} s: {m / o:.2f}x (goal <= 3)")
    print(f"{reps} reps (median), lab isolated={lab.isolated}, cpus={os.cpu_count()}, load {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
