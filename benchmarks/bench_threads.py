"""torch threads for the test suite's tiny models: one per process vs torch's default (every core).

The suite runs two test processes on a 2-core machine (pyproject's addopts), each decoding tiny
models in-process and starting workers that do the same. This starts ``--procs`` processes at once,
each decoding ``--calls`` short speculative generations (tiny hybrid target, random drafter, greedy)
with ``--threads`` torch threads, and times the group; it alternates the two settings for
``--reps`` rounds and prints the ratio of the medians. tests/conftest.py's OMP_NUM_THREADS=1 rests
on this ratio (> 1: one thread is faster).

    python benchmarks/bench_threads.py [--procs 2] [--calls 40] [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
from remote.decode.online import speculative_generate
from remote.drafters.tiny import tiny_drafter, tiny_drafter_config, tiny_target
target = tiny_target("qwen3_5").eval()
drafter = tiny_drafter(tiny_drafter_config(target)).eval()
prompt = torch.tensor([[1, 2, 3, 4, 5, 6]])
sys.stdout.write("ready\\n"); sys.stdout.flush(); sys.stdin.readline()
with torch.no_grad():
    for _ in range(int(sys.argv[2])):
        speculative_generate(target, drafter, prompt, 24)
"""
REPO = Path(__file__).resolve().parents[1]


def group(procs: int, threads: int, calls: int) -> float:
    """Seconds for ``procs`` processes to decode ``calls`` times each, timed from the moment all
    have loaded (imports and model building are not counted)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(threads), str(calls)], env=env, cwd=REPO,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    for c in children:
        assert c.stdout.readline().strip() == "ready", "a child failed to start"
    t0 = time.perf_counter()
    for c in children:
        c.stdin.write("go\n")
        c.stdin.flush()
    for c in children:
        if c.wait() != 0:
            raise SystemExit("a child failed")
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    cores = os.cpu_count() or 1
    default, one = [], []
    for _ in range(a.reps):
        default.append(group(a.procs, cores, a.calls))
        one.append(group(a.procs, 1, a.calls))
    d, o = statistics.median(default), statistics.median(one)
    print(f"{a.procs} processes x {a.calls} generations: {cores} threads each {d:.2f} s, 1 thread each {o:.2f} s "
          f"(medians of {a.reps})")
    print(f"ratio ({cores} threads / 1 thread): {d / o:.2f}x")


if __name__ == "__main__":
    main()
