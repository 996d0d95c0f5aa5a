"""Eval run folders under the runs directory, and resolving labels (`zlab`, `v5:step20k`, a run id) to them.

A run folder (docs/run-format.md) holds the worker's ``results.jsonl``, ``summary.json``,
``env.json`` and the orchestrator's ``run.json``. Stdlib only: `dflash-ops runs` must start fast.

A folder is untrusted input (run folders travel between machines): every file is read here and
checked as it is read (run.json by :class:`RunRecord`, the worker's files by
:mod:`remote.contract.runfiles`, the block size against ``MAX_BLOCK_SIZE``), and a fault is one
:class:`RunError` naming the file. Listings leave a damaged folder out and say which (``skipped``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from remote.contract import runfiles
from remote.contract.formats import MAX_BLOCK_SIZE
from remote.contract.states import State

from ..config.catalog import parse_step, same_checkpoint
from ..errors import InputError, did_you_mean
from .record import RUN_FILE, RunRecord, RunRecordError, plain_name

RUNS_ENV = "DFLASH_OPS_RUNS"


class RunError(InputError):
    """A run cannot be found, resolved or read (one clear line for the user)."""


def runs_dir(explicit: Optional[str] = None) -> Path:
    """``--runs-dir``, else ``$DFLASH_OPS_RUNS``, else ``./runs``."""
    return Path(explicit or os.environ.get(RUNS_ENV) or "runs")


RUN_FILES = (RUN_FILE, "env.json", "results.jsonl")     # a folder with none of them is no run


def _read(path: Path) -> Optional[bytes]:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise RunError(f"{path}: cannot read ({e.strerror or e})") from None


def read_json(path: Path, check: Callable[[object], None]) -> Optional[object]:
    """``path``'s JSON document, checked by ``check`` (remote.contract.runfiles); None when the
    file is not there."""
    data = _read(path)
    if data is None:
        return None
    try:
        value = runfiles.parse(data)
        check(value)
    except runfiles.RunFileError as e:
        raise RunError(f"{path}: {e}") from None
    return value


def read_results(path: Path, longest: int = MAX_BLOCK_SIZE + 1) -> list[dict]:
    """Rows of results.jsonl, each checked (``longest``: the most tokens one cycle of the run
    commits). A last line without its newline that does not parse (a run still writing) is
    ignored; any other fault is an error naming the line."""
    data = _read(path)
    if data is None:
        return []
    lines = data.split(b"\n")
    rows: list[dict] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = runfiles.parse(line)
        except runfiles.RunFileError as e:
            if i == len(lines):
                break
            raise RunError(f"{path}:{i}: {e}") from None
        try:
            runfiles.check_row(row, longest)
        except runfiles.RunFileError as e:
            raise RunError(f"{path}:{i}: {e}") from None
        rows.append(row)
    return rows


class RunList(list):
    """Runs, and the run folders left out of them: ``skipped``, one line each saying why."""

    def __init__(self, runs=(), skipped=()):
        super().__init__(runs)
        self.skipped: list[str] = list(skipped)


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
        declared = self._declared_block()
        if declared:
            return declared
        longest = max((n for r in self.results for n in (r.get("acceptance_lengths") or [])), default=16)
        return max(16, int(longest))

    def _declared_block(self) -> Optional[int]:
        b = self.settings.get("block_size") or (self.summary or {}).get("block_size")
        return self._bounded(b, "block_size") if b else None

    @property
    def max_length(self) -> int:
        """The most tokens one cycle can commit: B, or B + 1 for a sample_from_anchor drafter
        (env.json's ``verify_block``)."""
        return self._bounded(self.settings.get("verify_block") or self.block_size, "verify_block")

    def _declared_max_length(self) -> int:
        """What a row's acceptance lengths are checked against: the run's declared B (or B + 1),
        else the largest block a drafter may have."""
        declared = self.settings.get("verify_block") or self._declared_block()
        return self._bounded(declared, "verify_block") if declared else MAX_BLOCK_SIZE + 1

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
            self._summary = read_json(self.path / "summary.json", runfiles.check_summary)
            self._summary_loaded = True
        return self._summary

    @property
    def results(self) -> list[dict]:
        if self._results is None:
            self._results = read_results(self.path / "results.jsonl", self._declared_max_length())
        return self._results

    def check(self) -> "EvalRun":
        """Every file of the folder read and checked (a :class:`RunError` names the first fault),
        as listings and `compare` do before they use a run."""
        _ = self.summary, self.results, self.max_length
        return self

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
        own output other than at a near-tie, a drafter whose outputs were NaN or infinite), from
        summary.json or the rows; None for a valid run."""
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
    """The run in folder ``path``: run.json and env.json read and checked (the rest on use)."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        path = Path(os.path.abspath(path))
    if not path.is_dir():
        raise RunError(f"{path}: no such run folder")
    env = read_json(path / "env.json", runfiles.check_env) or {}
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


def _is_run_folder(p: Path) -> bool:
    return p.is_dir() and not p.name.startswith("compare-") and any((p / f).exists() for f in RUN_FILES)


def load_runs(directory: Optional[Path] = None) -> RunList:
    """All runs in the runs dir, oldest first. Folders that are not runs (compare-*) are passed
    over; a run folder that cannot be read is left out, and named in ``skipped``."""
    d = Path(directory) if directory is not None else runs_dir()
    out = RunList()
    if not d.is_dir():
        return out
    for p in sorted(d.iterdir()):
        if not _is_run_folder(p):
            continue
        try:
            out.append(load_run(p))
        except RunError as e:
            out.skipped.append(str(e))
    out.sort(key=EvalRun.sort_key)
    return out


def readable(runs: list[EvalRun]) -> RunList:
    """The runs whose every file reads and checks (:meth:`EvalRun.check`); the others in ``skipped``."""
    out = RunList()
    for r in runs:
        try:
            out.append(r.check())
        except RunError as e:
            out.skipped.append(str(e))
    return out


def run_folder(directory: Path, run_id: str) -> Path:
    """The folder of run ``run_id`` under ``directory``; an id that is not a plain name (one that
    would lead out of it) is refused."""
    if not plain_name(run_id):
        raise RunError(f"{str(run_id)[:80]!r} is not a run id (a run id is a folder name under {directory})")
    return Path(directory) / run_id


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
    if plain_name(label) and _is_run_folder(Path(directory) / label):   # a folder left out: why
        return [load_run(Path(directory) / label).check()]
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
    skipped = getattr(runs, "skipped", [])
    if skipped:
        extra += f"; {len(skipped)} run folder(s) cannot be read and were left out (the first: {skipped[0]})"
    if not runs:
        return RunError(f"no run matches {label!r}: {directory} has no runs{extra} (another folder: --runs-dir or "
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
    """One row per run for `dflash-ops runs` (τ recomputed from results.jsonl; runs that passed
    :func:`readable`); an offline run at T > 0 has no τ but an ``expected_tau_macro`` (an estimate)."""
    rows = []
    for r in runs:
        m = r.metrics
        tau, n = m["tau_macro"], m["prompts"]
        expected = (m.get("expected") or {}).get("tau_macro")
        planned = r.prompts_planned
        if r.record and not r.status.is_terminal():     # the workers' own count, as last heard
            done, total = r.record.progress
            n, planned = max(n or 0, done), total or planned
        rows.append({"id": r.id, "drafter": r.drafter, "checkpoint": r.checkpoint, "step": r.step, "label": r.label,
                     "target": r.target, "suite": r.suite, "mode": r.mode, "settings": settings_text(r),
                     "prompts": n, "prompts_planned": planned, "tau_macro": tau, "expected_tau_macro": expected,
                     "host": r.host, "created_at": r.created_at, "status": str(r.status)})
    return rows
