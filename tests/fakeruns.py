"""Synthetic run folders in the format of docs/run-format.md (plus the orchestrator's run.json).

`make_run(runs_dir, run_id, drafter, checkpoint, ...)` writes a consistent run: results.jsonl
(acceptance lengths, reference completions, DDTree walks, all-anchors hits, online timings),
summary.json (computed by the worker's own `remote.contract.metrics.summarize`), env.json and run.json.

Reference completions depend only on the prompt id and `ref_seed`, so two runs over the same
suite pair prompt by prompt like real offline runs against the same reference; per-prompt
difficulty also depends only on the prompt id, so paired runs are correlated like real drafters.
`read_rows(run_dir)` reads a run's results.jsonl back. The report tests' checks: tests/reportchecks.py.
"""
from __future__ import annotations

import copy
import hashlib
import json
import zlib
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np

DEFAULT_BUDGETS = (8, 16, 32, 64)
CATEGORIES = ("math", "code", "writing")


def _rng(*parts) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32("/".join(map(str, parts)).encode()))


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def completion_length(prompt_id: str, ref_seed: int = 0) -> int:
    return int(_rng("len", prompt_id, ref_seed).integers(40, 121))


def reference_tokens(prompt_id: str, length: int, ref_seed: int = 0) -> list[int]:
    """The reference completion's token ids (a deterministic stream per prompt)."""
    return [int(x) for x in _rng("ref", prompt_id, ref_seed).integers(0, 151000, size=max(length, 0))]


def prompt_tokens(prompt_id: str) -> list[int]:
    r = _rng("prompt", prompt_id)
    return [int(x) for x in r.integers(0, 151000, size=int(r.integers(8, 24)))]


def difficulty(prompt_id: str) -> float:
    """A per-prompt multiplier of the drafter's mean acceptance (shared by all runs)."""
    return float(_rng("difficulty", prompt_id).uniform(0.6, 1.4))


def segment(total: int, mean: float, block_size: int, rng: np.random.Generator) -> list[int]:
    """Acceptance lengths (1..B, bonus token included) covering `total` tokens, capped at the end."""
    p = 1.0 / max(1.0, float(mean))
    out, left = [], total
    while left > 0:
        n = int(min(block_size, rng.geometric(p), left))
        out.append(max(1, n))
        left -= out[-1]
    return out


def make_run(runs_dir: Union[str, Path], run_id: str, drafter: str = "zlab", checkpoint: Optional[str] = None,
             acceptance: Optional[Sequence[Sequence[int]]] = None,
             categories: Union[None, bool, Sequence[str], Callable[[int, str], str]] = None,
             env: Optional[dict] = None, *, prompts: int = 12, mean: float = 4.0, seed: int = 0,
             block_size: int = 16, suite: str = "gsm8k", target: str = "Qwen/Qwen3-8B",
             mode: str = "offline", host: str = "ct129", status: str = "done",
             created_at: Optional[str] = None, prompt_ids: Optional[Sequence[str]] = None,
             ref_seed: int = 0, output_ids: Optional[dict] = None,
             ddtree: Union[bool, Sequence[int]] = True, all_anchors: bool = True,
             summary: Union[bool, dict] = True, meta: Optional[dict] = None,
             row_overrides: Optional[dict] = None) -> Path:
    """Write `runs_dir/run_id/` and return its path.

    acceptance: acceptance lengths per prompt (default: generated with `mean` × the prompt's
      difficulty, covering the reference completion). Given explicitly, each prompt's
      completion length is the sum of its lengths.
    categories: per-prompt list, a function (index, id) -> category, False for none, or None
      (default: cycle through math/code/writing).
    env: overrides deep-merged into env.json (e.g. {"kernel_path": "torch"}).
    output_ids: {prompt id: token list} replacing reference completions (to break pairing).
    summary: True (write the worker's summary), False (no summary.json), or a dict of overrides
      deep-merged into it (to make it disagree with results.jsonl).
    row_overrides: {prompt id: {field: value}} applied to results rows last.
    """
    B = int(block_size)
    run_dir = Path(runs_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    ids = list(prompt_ids) if prompt_ids is not None else [
        f"{suite}-{i}" for i in range(len(acceptance) if acceptance is not None else prompts)]
    rng = np.random.default_rng(zlib.crc32(f"{run_id}/{seed}".encode()))
    budgets = [] if ddtree is False else list(DEFAULT_BUDGETS if ddtree is True else ddtree)

    rows = []
    for i, pid in enumerate(ids):
        if acceptance is not None:
            lengths = [int(x) for x in acceptance[i]]
            total = sum(lengths)
        else:
            total = completion_length(pid, ref_seed)
            lengths = segment(total, mean * difficulty(pid), B, rng)
        out_ids = list(output_ids[pid]) if output_ids and pid in output_ids else reference_tokens(pid, total, ref_seed)
        if categories is False:
            cat = None
        elif categories is None:
            cat = CATEGORIES[i % len(CATEGORIES)]
        elif callable(categories):
            cat = categories(i, pid)
        else:
            cat = categories[i]
        cycles, tokens = len(lengths), sum(lengths)
        row = {"id": pid, "category": cat, "reference": "local", "prompt_ids": prompt_tokens(pid),
               "output_ids": out_ids, "acceptance_lengths": lengths, "cycles": cycles, "tokens": tokens,
               "tau": tokens / cycles if cycles else None}
        if cat is None:
            del row["category"]
        if mode == "offline":
            if budgets:
                row["ddtree"] = {}
                for n in budgets:
                    boost = 1.0 + 0.18 * np.log2(n / 4.0)
                    dl = segment(tokens, mean * difficulty(pid) * boost, B, rng)
                    row["ddtree"][str(n)] = {"acceptance_lengths": dl, "tau": sum(dl) / len(dl)}
            if all_anchors:
                acc = min(0.97, 1.0 - 1.0 / max(1.05, mean * difficulty(pid)))
                count = [max(0, tokens - 1 - k) for k in range(B - 1)]
                correct = [int(rng.binomial(c, max(0.0, acc - 0.02 * k))) for k, c in enumerate(count)]
                row["all_anchors"] = {"correct": correct, "count": count}
        else:
            wall = 0.02 * cycles + 0.001 * tokens
            row["wall_s"] = round(wall, 6)
            row["target_wall_s"] = round(0.018 * tokens, 6)
            row["lossless"] = True
        row.update((row_overrides or {}).get(pid, {}))
        rows.append(row)

    with open(run_dir / "results.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")

    created = created_at or _created_from_id(run_id)
    suite_sha = hashlib.sha256(("\n".join(ids) + f"/{ref_seed}").encode()).hexdigest()
    env_doc = {
        "host": host, "device": "cuda:0", "gpu": "NVIDIA H200", "dtype": "bfloat16", "kernel_path": "fla",
        "versions": {"python": "3.11.7", "torch": "2.13.0", "transformers": "5.3.0",
                     "safetensors": "0.6.2", "fla": "0.4.1"},
        "drafter": {"path": f"/ckpt/{drafter}/{checkpoint or 'final'}", "format": "zlab",
                    "config": {"block_size": B, "num_hidden_layers": 5},
                    "sha256": {"model.safetensors": hashlib.sha256(f"{drafter}:{checkpoint}".encode()).hexdigest()}},
        "target": {"path": target, "model_type": "qwen3", "num_hidden_layers": 36},
        "suite": {"name": suite, "sha256": suite_sha, "prompts": len(ids)},
        "settings": {"mode": mode, "max_new_tokens": 256, "max_blocks": None, "block_size": B,
                     "enable_thinking": False, "ddtree_budgets": budgets, "reference": "local",
                     "sglang_url": None},
        "seed": 0, "command": ["python", "-m", "remote.eval", "--out", str(run_dir)],
        "started_at": created, "finished_at": created,
    }
    env_doc = deep_merge(env_doc, env or {})
    (run_dir / "env.json").write_text(json.dumps(env_doc, indent=2), encoding="utf-8")

    if summary is not False:
        from remote.contract.metrics import summarize

        s = summarize(rows, B, mode)
        if isinstance(summary, dict):
            s = deep_merge(s, summary)
        (run_dir / "summary.json").write_text(json.dumps(s, indent=2), encoding="utf-8")

    from orchestrator.runs.record import EvalRequest, RunRecord, Shard
    from remote.contract.settings import EvalSettings
    from remote.contract.states import State

    hosts = host.split(",")
    request = EvalRequest(hosts=hosts, settings=EvalSettings(suite=suite, mode=mode, prompts=len(ids)),
                          drafter_ref=f"{drafter}:{checkpoint}" if checkpoint else drafter, target=target)
    shards = [Shard(host=h, index=i, count=len(hosts), state=State(status) if status in State._value2member_map_
                    else State.UNKNOWN, fetched=status == "done") for i, h in enumerate(hosts)]
    record = RunRecord(id=run_id, drafter=drafter, checkpoint=checkpoint, target=target, created_at=created,
                       status=State(status), request=request, shards=shards)
    run_meta = record.to_dict()
    run_meta.update(meta or {})
    (run_dir / "run.json").write_text(json.dumps(run_meta, indent=2), encoding="utf-8")
    return run_dir


def _created_from_id(run_id: str) -> str:
    parts = run_id.split("-")
    if len(parts) >= 2 and len(parts[0]) == 8 and parts[0].isdigit() and len(parts[1]) == 4 and parts[1].isdigit():
        d, t = parts[0], parts[1]
        return f"{d[:4]}-{d[4:6]}-{d[6:]}T{t[:2]}:{t[2:]}:00"
    return "2026-01-01T00:00:00"


def read_rows(run_dir: Union[str, Path]) -> list[dict]:
    with open(Path(run_dir) / "results.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def add_confidences(run_dir: Union[str, Path], skill: float = 2.0, seed: int = 0) -> list[dict]:
    """Give a run a DSpark confidence head: per cycle, one confidence per drafted position (B − 1),
    sigmoid(±skill + noise), + for the positions the cycle accepted; results.jsonl and summary.json
    (the worker's own `summarize`) rewritten. Returns the rows."""
    run_dir = Path(run_dir)
    env = json.loads((run_dir / "env.json").read_text(encoding="utf-8"))
    B, mode = int(env["settings"]["block_size"]), env["settings"]["mode"]
    rows = read_rows(run_dir)
    for row in rows:
        rng = _rng("confidences", run_dir.name, row["id"], seed)
        row["confidences"] = [
            [round(float(1 / (1 + np.exp(-(skill if k < length else -skill) - rng.normal()))), 6) for k in range(1, B)]
            for length in row["acceptance_lengths"]]
    with open(run_dir / "results.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    from remote.contract.metrics import summarize

    (run_dir / "summary.json").write_text(json.dumps(summarize(rows, B, mode), indent=2), encoding="utf-8")
    return rows


# how add_online_ddtree splits a cycle's time over its stages
TREE_SHARES = {"draft": 0.25, "tree_build": 0.05, "tree_compile": 0.05, "verify": 0.55, "commit": 0.10}
LINEAR_SHARES = {"draft": 0.3, "verify": 0.6, "commit": 0.1}


def add_online_ddtree(run_dir: Union[str, Path], budgets: Sequence[int] = (4, 8, 16, 32), seed: int = 0,
                      cycle_s: float = 0.02, node_s: float = 0.0005) -> list[dict]:
    """Give an online run DDTree budgets as the worker records them (``ddtree[N]``: acceptance
    lengths, τ, the target's output, ``wall_s``, ``cycles_s`` and ``stage_s``, ``lossless``): τ
    grows with N, a cycle costs ``cycle_s + node_s × N`` (split over the stages in the shares of
    ``TREE_SHARES``), so the speed peaks at a middle budget; the linear decoding's cycles get
    ``LINEAR_SHARES`` of 90% of its ``wall_s``. results.jsonl and summary.json (the worker's own
    `summarize`) rewritten, env.json's ``ddtree_budgets`` set. Returns the rows."""
    run_dir = Path(run_dir)
    env = json.loads((run_dir / "env.json").read_text(encoding="utf-8"))
    B, mode = int(env["settings"]["block_size"]), env["settings"]["mode"]
    assert mode == "online", mode
    env["settings"]["ddtree_budgets"] = list(budgets)
    (run_dir / "env.json").write_text(json.dumps(env, indent=2), encoding="utf-8")
    rows = read_rows(run_dir)
    for row in rows:
        rng = _rng("online-ddtree", run_dir.name, row["id"], seed)
        tokens = sum(row["acceptance_lengths"])
        row["cycles_s"] = round(0.9 * row["wall_s"], 6)
        row["stage_s"] = {k: share * row["cycles_s"] for k, share in LINEAR_SHARES.items()}
        row["ddtree"] = {}
        for n in budgets:
            dl = segment(tokens, row["tau"] * (1.0 + 0.25 * np.log2(n / 2.0)), B, rng)
            cycles = round(len(dl) * (cycle_s + node_s * n), 6)
            row["ddtree"][str(n)] = {"acceptance_lengths": dl, "tau": sum(dl) / len(dl),
                                     "output_ids": list(row["output_ids"]),
                                     "wall_s": round(cycles + 0.001 * tokens, 6), "cycles_s": cycles,
                                     "stage_s": {k: share * cycles for k, share in TREE_SHARES.items()},
                                     "lossless": True}
    with open(run_dir / "results.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    from remote.contract.metrics import summarize

    (run_dir / "summary.json").write_text(json.dumps(summarize(rows, B, mode), indent=2), encoding="utf-8")
    return rows


def shipped(home: Path) -> str:
    """The worker code shipped into workdir ``home`` of the built-in `local` host (its code folder)."""
    import sys

    from orchestrator.config.inventory import builtin_local
    from orchestrator.eval.ship import ship
    from orchestrator.transport.local import LocalRunner

    return ship(LocalRunner(builtin_local()), sys.executable, str(home))


def local_run(home: Path, runs: Path, rid: str, status: str = "done", **kw) -> Path:
    """A fake run of the `local` host (workdir ``home``: $DFLASH_OPS_HOME) whose shard names the
    folders eval would use there."""
    import sys

    folder = make_run(runs, rid, host="local", status=status, prompts=3, **kw)
    record = json.loads((folder / "run.json").read_text())
    record["shards"][0].update(run_dir=f"{home}/runs/{rid}", code_dir=shipped(home), python=sys.executable)
    (folder / "run.json").write_text(json.dumps(record))
    return folder


def hung_job(run_dir: Path, done: int = 1, prompts: int = 3) -> int:
    """A job the run control (remote/host/launch.py) starts in ``run_dir`` that reports ``done`` of
    ``prompts`` prompts and then hangs: alive, its follower's heartbeats coming, no progress.
    Returns its pid (its process group)."""
    import os
    import subprocess
    import sys

    events = [{"event": "start", "prompts": prompts, "done": 0, "mode": "offline"},
              *({"event": "prompt", "id": f"p{i}", "index": i, "done": i + 1, "prompts": prompts, "cycles": 4,
                 "tau": 2.0} for i in range(done))]
    body = f"import time\nfor e in {[json.dumps(e) for e in events]!r}: print(e, flush=True)\ntime.sleep(600)\n"
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "remote.host.launch", "start", str(run_dir), "--", sys.executable,
                           "-c", body], capture_output=True, text=True, timeout=60, cwd=repo,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["pid"]
