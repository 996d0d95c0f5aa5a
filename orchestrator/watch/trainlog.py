"""The training run's own logged metrics, fetched read-only from the training host: a JSONL log
(one object per line with ``step`` and metric values; nested ``{"metrics": {...}}`` is flattened)
or a TensorBoard event folder (read with tensorboard's ``EventAccumulator``, the `tensorboard`
extra). The catalog names the file (``log``, relative to the run's folder) and the tags."""
from __future__ import annotations

import base64
import json
import tempfile
from pathlib import Path, PurePosixPath

from ..config.catalog import TrainingRun
from ..errors import OperationFailed
from ..config.inventory import Host

MAX_BYTES = 64 << 20
# on the training host: the log file, or every events file of a folder, as base64 (read only)
_FETCH = r"""
import base64, json, os, sys
p, limit = sys.argv[1], int(sys.argv[2])
files = {}
if os.path.isdir(p):
    for d, _, names in os.walk(p):
        for n in sorted(names):
            if "tfevents" in n:
                files[os.path.relpath(os.path.join(d, n), p)] = os.path.join(d, n)
elif os.path.isfile(p):
    files[os.path.basename(p)] = p
out, total = {}, 0
for rel, full in sorted(files.items()):
    with open(full, "rb") as f:
        data = f.read(max(limit - total, 0))
    total += len(data)
    out[rel] = base64.b64encode(data).decode()
print(json.dumps({"exists": os.path.exists(p), "dir": os.path.isdir(p), "files": out}))
"""


class TrainLogError(OperationFailed):
    pass


def log_path(run: TrainingRun, src: Host) -> str | None:
    if not run.log:
        return None
    return run.log if PurePosixPath(run.log).is_absolute() else str(PurePosixPath(run.source_dir(src.checkpoints)) / run.log)


def fetch_series(runner, src: Host, run: TrainingRun) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...] sorted by step} for the run's ``metrics`` tags; {} when the run
    names no log or it does not exist (yet)."""
    path = log_path(run, src)
    if not path or not run.metrics:
        return {}
    res = runner.run([src.python, "-c", _FETCH, path, str(MAX_BYTES)], timeout=120)
    if not res.ok:
        raise TrainLogError(f"host {src.name}: cannot read the training log {path}: {res.stderr.strip()[-300:]}")
    answer = json.loads(res.stdout)
    if not answer["exists"]:
        return {}
    files = {k: base64.b64decode(v) for k, v in answer["files"].items()}
    series = read_tensorboard(files, run.metrics) if answer["dir"] else read_jsonl(b"".join(files.values()), run.metrics)
    return {t: sorted(v) for t, v in series.items() if v}


def _flat(obj: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, f"{key}/" if prefix or k not in ("metrics",) else ""))
        else:
            out[key] = v
    return out


def read_jsonl(data: bytes, tags: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {t: [] for t in tags}
    for line in data.decode(errors="replace").splitlines():
        try:
            row = _flat(json.loads(line))
        except (ValueError, AttributeError):
            continue  # a torn last line while training writes it
        step = row.get("step", row.get("global_step"))
        if not isinstance(step, (int, float)):
            continue
        for t in tags:
            v = row.get(t)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                series[t].append((int(step), float(v)))
    return series


def read_tensorboard(files: dict[str, bytes], tags: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise TrainLogError("the training log is a TensorBoard folder: install the tensorboard extra "
                            "(pip install 'dflash-ops[tensorboard]')") from None
    series: dict[str, list[tuple[int, float]]] = {t: [] for t in tags}
    with tempfile.TemporaryDirectory() as tmp:
        for rel, data in files.items():
            p = Path(tmp) / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        for folder in sorted({(Path(tmp) / rel).parent for rel in files}):
            acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
            acc.Reload()
            have = set(acc.Tags().get("scalars", []))
            for t in tags:
                if t in have:
                    series[t] += [(int(e.step), float(e.value)) for e in acc.Scalars(t)]
    return series


def value_at(series: list[tuple[int, float]], step: int) -> float | None:
    """The logged value at ``step``, else the last one logged before it (None if none)."""
    best = None
    for s, v in series:
        if s <= step:
            best = v
    return best
