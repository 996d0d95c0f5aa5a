"""The DDTree sweep: online tree decoding at every budget, run by the worker as an eval runs it
(``python -m remote.worker --mode online --ddtree ...``), and one table of what each budget costs:
τ, the time per cycle split as DDTree's ``ddtree_generate`` splits it (draft, tree build, tree
compile, verify, commit), tokens/s, the speedup over plain decoding measured in the same run, and
whether every output equals the target's greedy output (bfloat16: near-ties aside).

The pair is the embedded demo pair (``--recipe demo``: the hybrid Qwen3.5-style target, Gated
DeltaNet + attention; ``qwen3``: its pure-attention twin), built with ``python -m remote.embedded``
(or found) in ``--pair DIR``. On CUDA in bfloat16 this runs the tree path on the hardware it is
for: the target's forward with the tree's 4D mask (sdpa), and the hybrid layers' tree recurrence
through the kernels transformers bound (flash-linear-attention and causal-conv1d where installed;
env.json's ``kernel_path`` says which). Exits with the worker's status when the worker fails (4: an
output left the target's greedy output beyond a near-tie).

    python benchmarks/bench_ddtree.py [--device cuda] [--dtype bfloat16] [--budgets 1,2,4,8,16,32,64]
        [--prompts 4] [--new-tokens 128] [--recipe demo|qwen3] [--pair DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def pair(args) -> dict:
    """The embedded pair in ``args.pair`` (built there if it is not): ``{"target", "drafter"}``."""
    out = subprocess.run([sys.executable, "-m", "remote.embedded", "--out", args.pair, "--recipe", args.recipe],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def sweep(args, folders: dict, out: Path) -> int:
    cmd = [sys.executable, "-m", "remote.worker", "--target", folders["target"], "--drafter", folders["drafter"],
           "--prompts", str(args.prompts), "--max-new-tokens", str(args.new_tokens), "--mode", "online",
           "--ddtree", args.budgets, "--device", args.device, "--out", str(out)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
    return proc.returncode


def table(summary: dict) -> list[str]:
    """The speedup-vs-budget table of one online run's summary.json."""
    from remote.contract.metrics import TREE_STAGES, fastest_budget

    def num(v, digits=2, scale=1.0):
        return "-" if v is None else f"{scale * v:.{digits}f}"

    def row(name, tau, c, speedup):
        stages = c.get("stage_s_per_cycle") or {}
        lossless = {True: "yes", False: "NO", None: "-"}[c.get("lossless")]
        return [name, num(tau, 3), num(c.get("s_per_cycle"), 2, 1e3),
                *[num(stages.get(k), 2, 1e3) for k in TREE_STAGES], num(c.get("tokens_per_s"), 1),
                num(speedup, 2), lossless]

    on, dd = summary["online"], summary.get("ddtree") or {}
    head = ["decoding", "tau", "ms/cycle", *[f"{k} ms" for k in TREE_STAGES], "tokens/s", "speedup", "lossless"]
    rows = [["plain decoding", "1", "-", *["-"] * len(TREE_STAGES), num(on.get("target_tokens_per_s"), 1), "1.00", "-"],
            row("DFlash (no tree)", summary["tau_pooled"], on, on.get("speedup"))]
    rows += [row(f"DDTree-{b}", v["tau_pooled"], v, v.get("speedup")) for b, v in sorted(dd.items(), key=lambda kv: int(kv[0]))]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [head, *rows]]
    best = fastest_budget(dd)
    if best is not None:
        lines.append(f"fastest: DDTree-{best}, {num(dd[best].get('tokens_per_s'), 1)} tokens/s, "
                     f"{num(dd[best].get('speedup'))}x plain decoding")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: the worker's (bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--budgets", default="1,2,4,8,16,32,64")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--recipe", choices=("demo", "qwen3"), default="demo")
    ap.add_argument("--pair", default=None, help="folder of the embedded pair (default: a temporary one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        args.pair = args.pair or str(Path(tmp) / "pair")
        folders = pair(args)
        rc = sweep(args, folders, Path(tmp) / "run")
        if rc:
            return rc
        run = Path(tmp) / "run"
        env, summary = (json.loads((run / f).read_text()) for f in ("env.json", "summary.json"))
    device = " ".join(str(v) for v in (env.get("device"), env.get("gpu"), env.get("dtype")) if v)
    print(f"DDTree sweep: the embedded {args.recipe} pair ({env.get('target', {}).get('model_type')}), {device}, "
          f"Gated DeltaNet kernels: {env.get('kernel_path')}; {summary['prompts']} prompts x {args.new_tokens} "
          f"new tokens, greedy")
    for line in table(summary):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
