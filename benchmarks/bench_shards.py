"""Wall time of one eval run as 1 shard vs 2 shards (``--gpus 2``), same prompts, same host.

Runs the real command twice, ``dflash-ops eval --host local`` and ``... --gpus 2``, on the embedded
demo pair (built once in --home when missing), each end to end: pre-flight, detached workers,
following, fetching, merging, report. On CPU the two workers share the machine's cores (each
with --threads torch threads), so the ratio shows what the sharding and merging cost or gain
here; on a host with two GPUs pass ``--host H --device cuda`` for the GPU figure. The merged
results of the two runs must be identical (checked).

    python benchmarks/bench_shards.py [--prompts 8] [--max-new-tokens 96] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_eval(home: Path, runs: Path, args, *extra: str) -> tuple[float, Path]:
    env = {**os.environ, "DFLASH_OPS_HOME": str(home), "DFLASH_OPS_RUNS": str(runs),
           "OMP_NUM_THREADS": str(args.threads), "COLUMNS": "120"}
    argv = [sys.executable, "-m", "orchestrator.cli", "eval", "--host", args.host, "--prompts", str(args.prompts),
            "--max-new-tokens", str(args.max_new_tokens), "--ddtree", "", *extra]
    if args.device:
        argv += ["--device", args.device]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"eval failed:\n{proc.stdout}\n{proc.stderr}")
    (run,) = [d for d in runs.iterdir() if (d / "run.json").exists()]
    return wall, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="local")
    p.add_argument("--device", default=None)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (OMP_NUM_THREADS)")
    p.add_argument("--home", default=None, help="DFLASH_OPS_HOME holding embedded/ (default: a temp folder)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(args.home or Path(tmp) / "home")
        from remote.embedded import ensure
        ensure(home / "embedded")
        one_wall, one = run_eval(home, Path(tmp) / "one", args)
        two_wall, two = run_eval(home, Path(tmp) / "two", args, "--gpus", "2")
        rows = [[json.loads(line)["acceptance_lengths"] for line in (r / "results.jsonl").read_text().splitlines()]
                for r in (one, two)]
        assert rows[0] == rows[1], "the 2-shard run differs from the 1-shard run"
    print(f"prompts {args.prompts}, max new tokens {args.max_new_tokens}, {args.threads} thread(s) per worker, "
          f"{os.cpu_count()} CPU(s)")
    print(f"1 shard : {one_wall:7.1f} s")
    print(f"2 shards: {two_wall:7.1f} s")
    print(f"ratio (1 shard / 2 shards wall time): {one_wall / two_wall:.2f}x")


if __name__ == "__main__":
    main()
