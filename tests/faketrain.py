"""A fake training process for `watch` tests: writes checkpoints of a drafter (copies of its
files) into RUN_DIR one after another, the way a training loop saves them (straight into the
final folder, file by file), and appends its own metrics to RUN_DIR/train.jsonl.

    python faketrain.py RUN_DIR DRAFTER_DIR --steps 100,200,300 --slow 300 --gap 1.0 --metric 10.0

``--slow STEP``: that checkpoint is written slowly (config.json first, then the weights in small
pieces with pauses shorter than the run's settle time). ``--metric X``: the logged
``eval/acc_len`` (what a training loop would claim τ is). Prints ``WROTE step_N`` when each is whole.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path


def write_slowly(src: Path, dst: Path, pieces: int, pause: float) -> None:
    data = src.read_bytes()
    size = -(-len(data) // pieces)
    with open(dst, "wb") as f:
        for i in range(0, len(data), size):
            f.write(data[i:i + size])
            f.flush()
            time.sleep(pause)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("drafter", type=Path)
    ap.add_argument("--steps", required=True)
    ap.add_argument("--slow", type=int, default=None)
    ap.add_argument("--gap", type=float, default=1.0)
    ap.add_argument("--pause", type=float, default=0.4)
    ap.add_argument("--metric", type=float, default=3.0)
    a = ap.parse_args()
    a.run_dir.mkdir(parents=True, exist_ok=True)
    files = sorted((p for p in a.drafter.iterdir() if p.is_file() and not p.name.startswith(".")),
                   key=lambda p: (p.name != "config.json", p.name))  # config first, weights last
    for step in map(int, a.steps.split(",")):
        d = a.run_dir / f"step_{step}"
        d.mkdir()
        for f in files:
            if step == a.slow:
                write_slowly(f, d / f.name, pieces=8, pause=a.pause)
            else:
                shutil.copyfile(f, d / f.name)
        with open(a.run_dir / "train.jsonl", "a") as log:
            log.write(json.dumps({"step": step, "metrics": {"eval/acc_len": a.metric, "loss": 1.0 / step}}) + "\n")
        print(f"WROTE step_{step}", flush=True)
        time.sleep(a.gap)


if __name__ == "__main__":
    main()
