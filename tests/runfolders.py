"""What a real eval leaves, read back: the one run in a runs folder (``only_run``), its
results.jsonl rows (``results``), its folder on a lab host (``remote_run_dir``) and how many
prompts its progress log has reported (``prompt_events``). Synthetic runs: tests/fakeruns.py."""
from __future__ import annotations

import json
from pathlib import Path


def results(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]



def only_run(runs: Path) -> Path:
    dirs = [d for d in runs.iterdir() if (d / "run.json").exists()]
    assert len(dirs) == 1, dirs
    return dirs[0]



def remote_run_dir(eval_lab: dict, host: str, run_id: str) -> Path:
    return eval_lab["lab"].hosts[host].root / "workdir" / "runs" / run_id



def prompt_events(path: Path) -> int:
    if not path.exists():
        return 0
    return sum('"event": "prompt"' in line for line in path.read_text().splitlines())

