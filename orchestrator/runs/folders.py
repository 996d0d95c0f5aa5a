"""Eval run folders under the runs directory, and resolving labels (`zlab`, `v5:step20k`, a run id) to them.

A run folder (docs/run-format.md) holds the worker's ``results.jsonl``, ``summary.json``,
``env.json`` and the orchestrator's ``run.json``. Stdlib only: `dflash-ops runs` must start fast.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from remote.contract.formats import MAX_BLOCK_SIZE
from remote.contract.states import State

from ..config.catalog import parse_step, same_checkpoint
from ..errors import InputError, did_you_mean
from .record import RUN_FILE, RunRecord, RunRecordError

RUNS_ENV = "DFLASH_OPS_RUNS"


class RunError(InputError):
    """A run cannot be found, resolved or read (one clear line for the user)."""


def runs_dir(explicit: Optional[str] = None) -> Path:
    """``--runs-dir``, else ``$DFLASH_OPS_RUNS``, else ``./runs``."""
    return Path(explicit or os.environ.get(RUNS_ENV) or "runs")


def _read_json(path: Path) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise RunError(f"{path}: cannot read ({e})") from None


def read_results(path: Path) -> list[dict]:
    """Rows of results.jsonl. A truncated last line (a run still writing) is ignored; a bad line
    elsewhere is an error naming the line."""
    rows: list[dict] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return rows
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines):
                break
            raise RunError(f"{path}:{i}: not JSON ({e.msg})") from None
    return rows


@dataclass
class EvalRun:
    """One eval run's folder as reports read it (a training run is catalog.TrainingRun): its
    ``record`` (run.json, read by :class:`RunRecord` alone), or, for a folder the worker wrote by
    hand, what its env.json says."""

    path: Path
    record: Optional[RunRecord]
    env: dict = field(default_factory=dict)
    _summary: Optional[dict] = field(default=None, repr=False)
    _summary_loaded: bool = field(default=False, repr=False)
    _results: Optional[list] = field(default=None, repr=False)
    _metrics: Optional[dict] = field(default=None, repr=False)

    @property
    def inferred(self) -> bool:
        """No run.json: what is known comes from env.json."""
        return self.record is None

    @property
    def id(self) -> str:
        return self.record.id if self.record else self.path.name

    @property
    def drafter(self) -> Optional[str]:
        if self.record:
            return self.record.drafter
        path = (self.env.get("drafter") or {}).get("path")
        return Path(str(path)).name if path else self.path.name

    @property
    def checkpoint(self) -> Optional[str]:
        return self.record.checkpoint if self.record else None

    @property
    def step(self) -> Optional[int]:
        """The checkpoint's training step (recorded, or read from the folder name)."""
        step = self.record.step if self.record else None
        return parse_step(str(self.checkpoint)) if step is None and self.checkpoint else step

    @property
    def label(self) -> str:
        return self.record.label if self.record else str(self.drafter)

    @property
    def target(self) -> Optional[str]:
        return (self.record.target if self.record else None) or (self.env.get("target") or {}).get("path")

    @property
    def suite(self) -> Optional[str]:
        return self.record.settings.suite if self.record else (self.env.get("suite") or {}).get("name")

    @property
    def hosts(self) -> list[str]:
        if self.record:
            return self.record.hosts
        return [h for h in str(self.env.get("host") or "").split(",") if h]

    @property
    def host(self) -> Optional[str]:
        """The hosts, joined (how lists show them)."""
        return ",".join(self.hosts) or None

    @property
    def settings(self) -> dict:
        return dict(self.env.get("settings") or {})

    @property
    def mode(self) -> Optional[str]:
        return (self.record.settings.mode if self.record else None) or self.settings.get("mode") or \
            (self.summary or {}).get("mode")

    @property
    def prompts_planned(self) -> Optional[int]:
        """The prompts asked for (None: all of the suite, or not known)."""
        return self.record.settings.prompts if self.record else None

    @property
    def block_size(self) -> int:
        b = self.settings.get("block_size") or (self.summary or {}).get("block_size")
        if b:
            return self._bounded(b, "block_size")
        longest = max((n for r in self.results for n in (r.get("acceptance_lengths") or [])), default=16)
        return max(16, int(longest))

    @property
    def max_length(self) -> int:
        """The most tokens one cycle can commit: B, or B + 1 for a sample_from_anchor drafter
        (env.json's ``verify_block``)."""
        return self._bounded(self.settings.get("verify_block") or self.block_size, "verify_block")

    def _bounded(self, value, name: str) -> int:
        """A block size from the run's files, refused (one line) beyond any drafter's: the
        metrics allocate per position of the block."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= MAX_BLOCK_SIZE + 1:
            raise RunError(f"{self.path / 'env.json'}: {name} {str(value)[:24]} is not a block size (1.."
                           f"{MAX_BLOCK_SIZE}); not a run folder dflash-ops wrote")
        return int(value)

    @property
    def status(self) -> State:
        if self.record:
            return self.record.status
        return State.DONE if self.summary is not None else State.UNKNOWN

    @property
    def created_at(self) -> str:
        return str((self.record.created_at if self.record else None) or self.env.get("started_at") or "")

    @property
    def summary(self) -> Optional[dict]:
        if not self._summary_loaded:
            self._summary = _read_json(self.path / "summary.json")
            self._summary_loaded = True
        return self._summary

    @property
    def results(self) -> list[dict]:
        if self._results is None:
            self._results = read_results(self.path / "results.jsonl")
        return self._results

    @property
    def metrics(self) -> dict:
        """Recomputed from results.jsonl (remote.contract.metrics, like the worker's summary.json)."""
        if self._metrics is None:
            from .metrics import compute_metrics

            self._metrics = compute_metrics(self.results, self.block_size, self.mode, self.max_length)
        return self._metrics

    @property
    def invalid(self) -> Optional[str]:
        """Why no τ of this run is a result (a greedy online row that diverged from the target's
        own output other than at a near-tie), from summary.json or the rows; None for a valid run."""
        marked = (self.summary or {}).get("invalid")
        if isinstance(marked, dict):
            return str(marked.get("message") or "marked invalid")
        for row in self.results:
            d = row.get("divergence")
            if isinstance(d, dict) and not d.get("near_tie"):
                return f"prompt {row.get('id')} diverged from the target's greedy output at {d.get('describe')}"
        return None

    def sort_key(self) -> tuple:
        return (self.created_at, self.id)


def load_run(path) -> EvalRun:
    path = Path(path)
    if not path.is_dir():
        raise RunError(f"{path}: no such run folder")
    env = _read_json(path / "env.json") or {}
    if (path / RUN_FILE).exists():
        try:
            record = RunRecord.load(path)
        except RunRecordError as e:
            raise RunError(str(e)) from None
    elif env == {} and not (path / "results.jsonl").exists():
        raise RunError(f"{path}: not a run folder (no run.json, env.json or results.jsonl)")
    else:
        record = None
    return EvalRun(path=path, record=record, env=env)


def load_runs(directory: Optional[Path] = None) -> list[EvalRun]:
    """All runs in the runs dir, oldest first. Folders that are not runs (compare-*) are skipped."""
    d = Path(directory) if directory is not None else runs_dir()
    if not d.is_dir():
        return []
    out = []
    for p in sorted(d.iterdir()):
        if not p.is_dir() or p.name.startswith("compare-"):
            continue
        if not any((p / f).exists() for f in ("run.json", "env.json", "results.jsonl")):
            continue
        try:
            out.append(load_run(p))
        except RunError:
            continue
    return sorted(out, key=EvalRun.sort_key)


LATEST = ("latest", "newest")


def newest(runs: list[EvalRun], prefer: tuple[str, ...] = ("done",)) -> EvalRun:
    """The newest run whose status is in ``prefer``; the newest of all when none is."""
    preferred = [r for r in runs if r.status in prefer]
    return max(preferred or runs, key=EvalRun.sort_key)


def label_matches(run: EvalRun, drafter: str, checkpoint: Optional[str] = None) -> bool:
    """Whether ``run`` is of drafter ``drafter`` (and checkpoint ``checkpoint`` in any spelling:
    ``step20k``, ``20000``, ``step_20000``; ``latest`` = any)."""
    if run.drafter != drafter:
        return False
    return checkpoint is None or checkpoint in LATEST or same_checkpoint(checkpoint, run.checkpoint, run.step)


def find_runs(label: str, runs: list[EvalRun], directory: Path) -> list[EvalRun]:
    """Every run ``label`` may mean, newest last: a run id or a path (that run); ``latest`` (the
    newest run); ``DRAFTER`` or ``DRAFTER:CHECKPOINT`` in any spelling (all its runs);
    ``CHECKPOINT`` alone when only one drafter has it; a unique run-id prefix. Unknown: RunError."""
    by_id = {r.id: r for r in runs}
    if label in by_id:
        return [by_id[label]]
    p = Path(label)
    if (os.sep in label or label.startswith(".")) and p.is_dir():
        return [load_run(p)]
    if label in LATEST and runs:
        return [newest(runs)]
    drafter, sep, ckpt = label.partition(":")
    hits = [r for r in runs if label_matches(r, drafter, ckpt if sep else None)]
    if hits:
        return hits
    if not sep:
        by_ckpt = [r for r in runs if r.checkpoint and same_checkpoint(label, r.checkpoint, r.step)]
        drafters = sorted({str(r.drafter) for r in by_ckpt})
        if len(drafters) == 1:
            return by_ckpt
        if len(drafters) > 1:
            raise RunError(f"run label {label!r} is ambiguous: checkpoint {label} exists for drafters "
                           f"{', '.join(drafters)}; say " + " or ".join(f"{x}:{label}" for x in drafters))
    prefixed = [r for r in runs if r.id.startswith(label)]
    if len(prefixed) == 1:
        return prefixed
    if len(prefixed) > 1:
        raise RunError(f"run label {label!r} is ambiguous: it starts {len(prefixed)} run ids ("
                       + ", ".join(r.id for r in prefixed[:6]) + (" …" if len(prefixed) > 6 else "") + ")")
    raise no_run(label, runs, directory)


def no_run(label: str, runs: list[EvalRun], directory: Path) -> RunError:
    """The one message for a name that matches no run."""
    candidates = sorted({r.id for r in runs} | {str(r.drafter) for r in runs if r.drafter}
                        | {r.label for r in runs if r.checkpoint})
    drafter, sep, _ = label.partition(":")
    have = sorted({str(r.checkpoint) for r in runs if sep and r.drafter == drafter and r.checkpoint})
    extra = f"; {drafter} has runs of {', '.join(have)}" if have else ""
    if not runs:
        return RunError(f"no run matches {label!r}: {directory} has no runs (another folder: --runs-dir or "
                        f"$DFLASH_OPS_RUNS)")
    return RunError(f"no run matches {label!r} in {directory}{did_you_mean(label, candidates)}{extra}; "
                    f"`dflash-ops runs` lists them")


def resolve(label: str, directory: Optional[Path] = None, runs: Optional[list[EvalRun]] = None,
            prefer: tuple[str, ...] = ("done",)) -> EvalRun:
    """The one run ``label`` means (:func:`find_runs`): of several, the newest whose status is in
    ``prefer`` (finished runs for reports, running ones for `attach`/`cancel`)."""
    d = Path(directory) if directory is not None else runs_dir()
    runs = load_runs(d) if runs is None else runs
    return newest(find_runs(label, runs, d), prefer)


def select_runs(runs: list[EvalRun], drafter=None, suite=None, host=None, status=None, checkpoint=None) -> list[EvalRun]:
    def ok(value, want):
        return want is None or (value is not None and str(value) == want)

    return [r for r in runs if ok(r.drafter, drafter) and ok(r.suite, suite) and (host is None or host in r.hosts)
            and ok(r.status, status) and ok(r.checkpoint, checkpoint)]


def settings_text(run: EvalRun) -> str:
    """The decoding settings of a run in a few words: ``greedy, 256 tok, think off`` (what the worker
    recorded in env.json; before it is fetched, what the run asked for)."""
    settings = run.settings
    if not settings and run.record:
        asked = run.record.settings
        settings = {"temperature": asked.temperature, "top_p": asked.top_p, "top_k": asked.top_k,
                    "max_new_tokens": asked.max_new_tokens, "max_blocks": asked.max_blocks,
                    "enable_thinking": {"on": True, "off": False}.get(asked.thinking)}
    if not settings:
        return "-"
    t = settings.get("temperature")
    parts = [f"T={t:g}" if t else "greedy"]
    if t and settings.get("top_p") not in (None, 1, 1.0):
        parts.append(f"top-p {settings['top_p']:g}")
    if t and settings.get("top_k"):
        parts.append(f"top-k {settings['top_k']}")
    if settings.get("max_new_tokens"):
        parts.append(f"{settings['max_new_tokens']} tok")
    if settings.get("max_blocks"):
        parts.append(f"≤{settings['max_blocks']} blocks")
    if "enable_thinking" in settings:
        parts.append({True: "think on", False: "think off"}.get(settings["enable_thinking"], "think default"))
    return ", ".join(parts)


def run_rows(runs: list[EvalRun]) -> list[dict]:
    """One row per run for `dflash-ops runs` (τ recomputed from results.jsonl)."""
    rows = []
    for r in runs:
        try:
            m = r.metrics
            tau, n = m["tau_macro"], m["prompts"]
        except Exception:  # a damaged results.jsonl must not hide the other runs
            tau, n = None, None
        planned = r.prompts_planned
        if r.record and not r.status.is_terminal():     # the workers' own count, as last heard
            done, total = r.record.progress
            n, planned = max(n or 0, done), total or planned
        rows.append({"id": r.id, "drafter": r.drafter, "checkpoint": r.checkpoint, "step": r.step, "label": r.label,
                     "target": r.target, "suite": r.suite, "mode": r.mode, "settings": settings_text(r),
                     "prompts": n, "prompts_planned": planned, "tau_macro": tau, "host": r.host,
                     "created_at": r.created_at, "status": str(r.status)})
    return rows
