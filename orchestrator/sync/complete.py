"""When a checkpoint folder on the training host counts as complete: the one rule that
`sync-ckpt` and `watch` share (a checkpoint still being written is never synced or evaluated).

Complete = both
* **quiet**: no file in it changed for the run's ``settle`` seconds (catalog), measured on the
  training host's own clock: from a file's newest mtime or ctime, whichever is later. An mtime can
  be set to anything (a writer whose clock runs behind, times kept by ``cp -p``/``rsync -a``/``tar``
  as a copy arrives), a ctime is the host's time of the last change; clock skew between hosts does
  not matter. On shared storage both come from the file server's clock: a file dated well in the
  future is named as skew, and ``settle: 0`` with a ``marker`` is the rule that needs no clock), and
* **the expected files exist**: the file the run names as ``marker`` in the catalog (training
  writes it last), or else a ``config.json`` plus weights (``*.safetensors``/``.pt``/``.pth``/
  ``.bin``; every shard of a ``-0000k-of-0000n`` set).

Inputs are what the host's ``sync_host list``/``manifest`` already report: relative paths, the
newest mtime and ctime, and the host's clock at the time of the answer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..config.catalog import TrainingRun
from .tool import SyncError

CONFIG = "config.json"
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
_SHARD = re.compile(r"^(.*)-(\d+)-of-(\d+)(\.[a-z]+)$")
CLOCK_SKEW = 60.0         # a file dated further than this in the host's future: the clocks disagree


class IncompleteCheckpoint(SyncError):
    """The checkpoint is still being written (or lacks its expected files): nothing is finalised."""

    exit_code = 5


@dataclass(frozen=True)
class Verdict:
    complete: bool
    reason: str = ""          # why not, for the user
    wait: float | None = None  # seconds until it may be quiet (when only the settle time is missing)


def missing_files(paths: list[str], marker: str | None) -> list[str]:
    """The expected files that are not among ``paths`` (relative paths in the folder)."""
    names = set(paths)
    if marker:
        return [] if marker in names else [marker]
    top = [p for p in paths if "/" not in p]
    missing = [] if CONFIG in names else [CONFIG]
    weights = [p for p in top if p.endswith(WEIGHT_SUFFIXES) and not p.endswith(".index.json")]
    if not weights:
        missing.append("weights (*.safetensors, *.pt, *.pth or *.bin)")
    for stem, suffix, total in {(m[1], m[4], int(m[3])) for m in map(_SHARD.match, weights) if m}:
        width = len(next(m[2] for m in map(_SHARD.match, weights) if m and m[1] == stem))
        for k in range(1, total + 1):
            name = f"{stem}-{k:0{width}d}-of-{total:0{width}d}{suffix}"
            if name not in names:
                missing.append(name)
    return missing


def judge(paths: list[str], newest_mtime: float, host_now: float, run: TrainingRun,
          newest_ctime: float | None = None) -> Verdict:
    """Whether a checkpoint with files ``paths`` (newest mtime ``newest_mtime``, newest ctime
    ``newest_ctime``, both on the training host's clock ``host_now``) is complete under ``run``'s rule."""
    missing = missing_files(paths, run.marker)
    if missing:
        return Verdict(False, f"expected files missing: {', '.join(missing[:5])}"
                              f"{' …' if len(missing) > 5 else ''}")
    changed = max(newest_mtime, newest_ctime if newest_ctime is not None else newest_mtime)
    age = host_now - changed
    if run.settle <= 0:         # the expected files alone (a marker) say it is complete
        return Verdict(True)
    if age < -CLOCK_SKEW:
        return Verdict(False, f"a file is dated {-age:.0f}s in the future of the training host's clock (shared "
                              f"storage whose file server's clock runs ahead?), so quiet time cannot be measured; "
                              f"set `marker` (a file training writes last) and `settle: 0` for run {run.name} in "
                              f"the catalog")
    if age < run.settle:
        behind = changed - newest_mtime
        dated = (f" though its mtime says {host_now - newest_mtime:.0f}s ago (a writer whose clock runs behind the "
                 f"training host's, or times kept from a copy)" if behind > CLOCK_SKEW else "")
        return Verdict(False, f"a file changed {max(age, 0):.0f}s ago{dated} (settle time {run.settle:g}s)",
                       wait=run.settle - max(age, 0.0))
    return Verdict(True)


def judge_listed(entry: dict, host_now: float, run: TrainingRun) -> Verdict:
    """:func:`judge` on one checkpoint of a ``sync_host list`` answer."""
    return judge(entry.get("paths") or [], entry["mtime"], host_now, run, entry.get("ctime"))


def judge_manifest(files: list[dict], host_now: float, run: TrainingRun) -> Verdict:
    """:func:`judge` on a ``sync_host manifest`` answer's files (mtimes and ctimes in ns)."""
    newest = max((f["mtime_ns"] for f in files), default=0) / 1e9
    ctimes = [f["ctime_ns"] for f in files if f.get("ctime_ns") is not None]
    return judge([f["path"] for f in files], newest, host_now, run, max(ctimes) / 1e9 if ctimes else None)


def newest_complete(info: dict, run: TrainingRun) -> str | None:
    """The newest complete checkpoint folder of a run's ``list`` answer (``info["now"]`` set)."""
    done = [c for c in info["checkpoints"] if c["step"] is not None and judge_listed(c, info["now"], run).complete]
    return max(done, key=lambda c: c["step"])["name"] if done else None


def require_complete(files: list[dict], host_now: float, run: TrainingRun, host: str, folder: str,
                     instead: str | None = None) -> None:
    """Raise :class:`IncompleteCheckpoint` (one clear line) unless the checkpoint is complete;
    ``instead`` names a complete one to suggest."""
    v = judge_manifest(files, host_now, run)
    if not v.complete:
        hint = (f"try again in {v.wait:.0f}s" if v.wait is not None else
                f"is training still writing it? (the rule: {rule_text(run)})")
        other = f"; the newest complete checkpoint is {instead}" if instead else ""
        raise IncompleteCheckpoint(f"{host}:{folder} is not complete yet: {v.reason}; not synced — {hint}{other}")


def rule_text(run: TrainingRun) -> str:
    files = f"the marker file {run.marker}" if run.marker else "config.json and weights"
    return f"{files} present, no change for {run.settle:g}s; set `marker`/`settle` for run {run.name} in the catalog"
