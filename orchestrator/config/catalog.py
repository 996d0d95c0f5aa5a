"""The drafter catalog (``configs/drafters.yaml``): training runs, drafter labels, target models.

* ``runs``: training runs on the training host; each has a folder (``dir``, under the host's
  ``checkpoints`` root unless absolute) and a checkpoint folder ``pattern`` with ``{step}``.
* ``drafters``: labels that eval uses: a folder on the eval host (``path``) or a training ``run``
  synced there (found at ``<eval checkpoints>/<run>/<checkpoint folder>``), a ``format`` and a
  ``target``.
* ``targets``: target models (``path`` on the eval host).
* ``default``: the drafter ``eval`` runs when none is named (``LABEL`` or ``LABEL:CKPT``);
  without it, the catalog's training run (see orchestrator/names.py).

File: explicit path, ``$DFLASH_OPS_CATALOG``, ``./configs/drafters.yaml``,
``$XDG_CONFIG_HOME/dflash-ops/drafters.yaml`` (paths.locate), else none: an empty catalog.
Checkpoint names (``step20k``, ``20000``, ``step_20000``, ``20k``, a folder name) are resolved by
:func:`resolve_checkpoint`; names that could escape a folder are refused.
"""
from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from remote.contract.formats import READ_FORMATS

from ..errors import InputError, did_you_mean
from .paths import CATALOG, ConfigFile, check_nesting, locate, read_config_text

ENV_VAR = "DFLASH_OPS_CATALOG"
FORMATS = READ_FORMATS
TOP_KEYS = ("runs", "drafters", "targets", "default")
DEFAULT_PATTERN = "step_{step}"
EMBEDDED = "embedded"   # the demo pair every host can build (remote/embedded.py), a drafter and a target
DEFAULT_SETTLE = 60.0
STEP_FIELD = r"\{step(?::0?\d+d)?\}"   # {step}, or zero-padded: {step:08d}


class CatalogError(InputError):
    """A bad catalog, an unknown label or an unresolvable checkpoint name (message is user-facing)."""


def _nearest(word: str, choices, n: int = 3) -> list[str]:
    return difflib.get_close_matches(word, list(choices), n=n, cutoff=0.4)


def _unknown(kind: str, word: str, choices) -> CatalogError:
    choices = list(choices)
    return CatalogError(f"unknown {kind} '{word}'{did_you_mean(word, choices)}; known: {', '.join(choices) or 'none'}")


# --- names -------------------------------------------------------------------------------------


def check_name(name: str, what: str = "checkpoint name") -> str:
    """A single safe path component: no '/', '..', absolute path, leading dot, NUL or control chars."""
    if not isinstance(name, str) or not name.strip():
        raise CatalogError(f"empty {what}")
    if name.startswith(("/", "~")) or os.path.isabs(name):
        raise CatalogError(f"{what} {name!r} is an absolute path; give a checkpoint name or step")
    if "/" in name or "\\" in name or name in (".", "..") or ".." in name.split("/"):
        raise CatalogError(f"{what} {name!r} would leave the checkpoint folder; refused")
    if name.startswith(".") or any(ord(c) < 32 or c == "\x7f" for c in name):
        raise CatalogError(f"{what} {name!r} is not allowed (hidden or control characters)")
    return name


_STEP_RE = re.compile(r"^(?:step|ckpt|checkpoint)?[_\-]?(\d+(?:\.\d+)?)([km]?)$", re.IGNORECASE)


def parse_step(name: str) -> int | None:
    """``step20k``/``20k`` → 20000, ``step_20000``/``20000`` → 20000, ``1.5k`` → 1500; else None."""
    m = _STEP_RE.match(name.strip())
    if not m:
        return None
    num, unit = m.group(1), m.group(2).lower()
    value = float(num) * {"": 1, "k": 1000, "m": 1_000_000}[unit]
    if value != int(value) or ("." in num and not unit):
        return None
    return int(value)


def step_name(step: int) -> str:
    """The short spelling of a step: 20000 → ``step20k``, 12500 → ``step12500``."""
    return f"step{step // 1000}k" if step and step % 1000 == 0 else f"step{step}"


def same_checkpoint(typed: str, folder: str | None, step: int | None = None) -> bool:
    """Whether ``typed`` (any spelling: ``step20k``, ``20000``, the folder) names the checkpoint
    recorded as ``folder`` (and ``step``)."""
    if folder is not None and typed == folder:
        return True
    want = parse_step(typed)
    have = step if step is not None else (parse_step(folder) if folder else None)
    return want is not None and want == have


# --- model -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingRun:
    """A training run on the training host: its checkpoint folders (not an eval run: runs.EvalRun)."""
    name: str
    dir: str
    pattern: str = DEFAULT_PATTERN
    direct: bool = False  # the eval host can reach the training host itself (see sync-ckpt --direct)
    settle: float = DEFAULT_SETTLE  # a checkpoint counts as complete once quiet this long (sync/complete.py)
    marker: str | None = None  # a file training writes last; when set, it is what "complete" means
    log: str | None = None  # training metrics (JSONL file or TensorBoard folder), relative to `dir`
    metrics: tuple[str, ...] = ()  # tags of `log` plotted beside eval τ (watch's trajectory)
    tau_metric: str | None = None  # the tag eval τ is checked against (watch --alarm-ratio)

    @property
    def regex(self) -> re.Pattern:
        parts = re.split(r"\{step(?::0?(\d+)d)?\}", self.pattern)
        return re.compile("^" + re.escape(parts[0]) + r"(\d+)" + re.escape(parts[2]) + "$")

    def step_of(self, folder: str) -> int | None:
        m = self.regex.match(folder)
        return int(m.group(1)) if m else None

    def folder_for(self, step: int) -> str:
        return self.pattern.format(step=step)

    def source_dir(self, checkpoints_root: str | None) -> str:
        """The run's folder on the training host."""
        if PurePosixPath(self.dir).is_absolute() or self.dir.startswith("~"):
            return self.dir
        if not checkpoints_root:
            raise CatalogError(f"run {self.name}: dir {self.dir!r} is relative but the training host "
                               f"has no `checkpoints` root in the inventory")
        return str(PurePosixPath(checkpoints_root) / self.dir)


@dataclass(frozen=True)
class Target:
    label: str
    path: str


@dataclass(frozen=True)
class Drafter:
    label: str
    format: str
    target: str | None = None
    path: str | None = None  # a folder on the eval host
    run: str | None = None  # or checkpoints of a training run, synced to the eval host

    def eval_path(self, eval_checkpoints_root: str | None, checkpoint: str | None = None) -> str:
        """Where eval finds this drafter (for a run drafter: one checkpoint folder of it)."""
        if self.path:
            return self.path
        if checkpoint is None:
            raise CatalogError(f"drafter {self.label} is training run {self.run}: name a checkpoint, "
                               f"e.g. {self.label}:step20k")
        if not eval_checkpoints_root:
            raise CatalogError("the eval host has no `checkpoints` root in the inventory")
        return str(PurePosixPath(eval_checkpoints_root) / self.run / check_name(checkpoint))


@dataclass
class Catalog:
    runs: dict[str, TrainingRun] = field(default_factory=dict)
    drafters: dict[str, Drafter] = field(default_factory=dict)
    targets: dict[str, Target] = field(default_factory=dict)
    path: Path | None = None
    default: str | None = None       # the drafter eval runs when none is named (LABEL[:CKPT])
    found: ConfigFile | None = None  # where the file was found (None: given directly)

    def run(self, name: str) -> TrainingRun:
        if name not in self.runs:
            raise _unknown("training run", name, self.runs)
        return self.runs[name]

    def no_runs(self) -> CatalogError:
        """The one message for a catalog without training runs: which file it is, or where none was
        found and that `dflash-ops init` writes one."""
        return CatalogError(f"no training runs in the catalog; {self.found if self.found is not None else self.path}")

    def target(self, label: str) -> Target:
        if label not in self.targets:
            raise _unknown("target", label, self.targets)
        return self.targets[label]

    def drafter(self, label: str) -> Drafter:
        """A drafter by label; ``v5:step20k`` gives drafter ``v5`` (split the step with
        :func:`split_label`)."""
        base, _ = split_label(label)
        if base not in self.drafters:
            raise _unknown("drafter", base, self.drafters)
        return self.drafters[base]


def split_label(label: str) -> tuple[str, str | None]:
    """``v5:step20k`` → (``v5``, ``step20k``); ``zlab`` → (``zlab``, None)."""
    base, sep, ckpt = label.partition(":")
    if sep:
        check_name(ckpt)
    return base, (ckpt if sep else None)


def resolve_checkpoint(name: str, run: TrainingRun, folders: list[str]) -> str:
    """The checkpoint folder (one of ``folders``, the run's folders on the training host) that
    ``name`` means: the folder name itself, or a step in any spelling. Unknown: lists the nearest."""
    check_name(name)
    if name in folders:
        return name
    step = parse_step(name)
    if step is None:
        step = run.step_of(name)
    if step is not None:
        hits = [f for f in folders if run.step_of(f) == step]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise CatalogError(f"run {run.name}: step {step} matches several folders: {', '.join(hits)}")
    near = _nearest(name, folders)
    if step is not None:
        stepped = sorted((f for f in folders if run.step_of(f) is not None),
                         key=lambda f: abs(run.step_of(f) - step))
        near = list(dict.fromkeys(stepped[:3] + near))[:4]
    newest = sorted((f for f in folders if run.step_of(f) is not None), key=run.step_of)[-3:]
    hint = f"; nearest: {', '.join(near)}" if near else (
        f"; latest: {', '.join(newest)}" if newest else "; the run has no checkpoints yet")
    return _raise(CatalogError(f"no checkpoint '{name}' in run {run.name}{hint}"))


def _raise(e: Exception):
    raise e


# --- loading -----------------------------------------------------------------------------------


def _mapping(path: Path, where: str, value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CatalogError(f"{path}: {where} must be a mapping, got {type(value).__name__}")
    return value


def _fields(path: Path, where: str, entry: Any, allowed: dict[str, type]) -> dict:
    entry = _mapping(path, where, entry)
    for key, value in entry.items():
        if key not in allowed:
            near = _nearest(str(key), allowed, 1)
            raise CatalogError(f"{path}: {where}: unknown field '{key}'"
                               f"{f' (did you mean {near[0]!r}?)' if near else ''}")
        if value is not None and not isinstance(value, allowed[key]):
            kind = allowed[key]
            name = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
            raise CatalogError(f"{path}: {where}: field '{key}' must be {name}, got {value!r}")
    return entry


def parse_catalog(data: Any, path: Path) -> Catalog:
    cat = Catalog(path=path)
    data = _mapping(path, "top level", data)
    for key in data:
        if key not in ("runs", "drafters", "targets", "default"):
            raise CatalogError(f"{path}: unknown top-level key '{key}'{did_you_mean(key, TOP_KEYS)}; "
                               f"expected {', '.join(TOP_KEYS)}")
    for name, entry in _mapping(path, "runs", data.get("runs")).items():
        name = str(name)
        where = f"run {name!r}"
        try:
            check_name(name, "name")
            if isinstance(entry, dict) and isinstance(entry.get("marker"), str) and entry["marker"]:
                check_name(entry["marker"], "marker")
        except CatalogError as e:
            raise CatalogError(f"{path}: {where}: {e}") from None
        e = _fields(path, where, entry, {"dir": str, "pattern": str, "direct": bool, "settle": (int, float),
                                         "marker": str, "log": str, "metrics": list, "tau_metric": str})
        if e.get("settle") is not None and (isinstance(e["settle"], bool) or e["settle"] < 0):
            raise CatalogError(f"{path}: {where}: settle must be a number of seconds >= 0")
        if e.get("log") and ".." in PurePosixPath(e["log"]).parts:
            raise CatalogError(f"{path}: {where}: log {e['log']!r} must not contain '..'")
        d = e.get("dir") or name
        if not PurePosixPath(d).is_absolute() and ".." in PurePosixPath(d).parts:
            raise CatalogError(f"{path}: {where}: dir {d!r} must not contain '..'")
        pattern = e.get("pattern") or DEFAULT_PATTERN
        if len(re.findall(STEP_FIELD, pattern)) != 1 or "/" in pattern or "{" in re.sub(STEP_FIELD, "", pattern):
            raise CatalogError(f"{path}: {where}: pattern {pattern!r} needs exactly one {{step}} and no '/'")
        metrics = tuple(str(t) for t in e.get("metrics") or ())
        cat.runs[name] = TrainingRun(name=name, dir=d, pattern=pattern, direct=bool(e.get("direct")),
                                     settle=float(DEFAULT_SETTLE if e.get("settle") is None else e["settle"]),
                                     marker=e.get("marker"), log=e.get("log"), metrics=metrics,
                                     tau_metric=e.get("tau_metric") or (metrics[0] if metrics else None))
    for label, entry in _mapping(path, "targets", data.get("targets")).items():
        e = _fields(path, f"target '{label}'", entry, {"path": str})
        if not e.get("path"):
            raise CatalogError(f"{path}: target '{label}': missing field 'path'")
        cat.targets[str(label)] = Target(label=str(label), path=e["path"])
    for label, entry in _mapping(path, "drafters", data.get("drafters")).items():
        label = str(label)
        where = f"drafter '{label}'"
        if ":" in label:
            raise CatalogError(f"{path}: {where}: labels must not contain ':'")
        e = _fields(path, where, entry, {"path": str, "run": str, "format": str, "target": str})
        if bool(e.get("path")) == bool(e.get("run")):
            raise CatalogError(f"{path}: {where}: give exactly one of 'path' or 'run'")
        if e.get("run") and e["run"] not in cat.runs:
            raise CatalogError(f"{path}: {where}: {_unknown('training run', e['run'], cat.runs)}")
        fmt = e.get("format") or ("state_dict" if e.get("run") else "zlab")
        if fmt not in FORMATS:
            raise CatalogError(f"{path}: {where}: format {fmt!r} is not one of {', '.join(FORMATS)}")
        if e.get("target") and e["target"] not in cat.targets:
            raise CatalogError(f"{path}: {where}: {_unknown('target', e['target'], cat.targets)}")
        cat.drafters[label] = Drafter(label=label, format=fmt, target=e.get("target"),
                                      path=e.get("path"), run=e.get("run"))
    default = data.get("default")
    if default is not None:
        if not isinstance(default, str):
            raise CatalogError(f"{path}: default must be a drafter label (LABEL or LABEL:CKPT), got {default!r}")
        base, _ = split_label(default)
        if base not in cat.drafters:
            raise CatalogError(f"{path}: default: {_unknown('drafter', base, cat.drafters)}")
        cat.default = default
    return cat


def load_catalog(path: "str | os.PathLike | ConfigFile | None" = None) -> Catalog:
    """The catalog at ``path`` (a file name, or where :func:`paths.locate` found it), else the
    one discovery finds; none found: an empty catalog that says so (``found``)."""
    import yaml

    found = path if isinstance(path, ConfigFile) else locate(CATALOG, path)
    resolved = found.path
    if resolved is None:
        return Catalog(found=found)
    text = read_config_text(resolved, CatalogError, "the catalog")
    check_nesting(text, resolved, CatalogError, "the catalog")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        raise CatalogError(f"{resolved}: {where}invalid YAML: {getattr(e, 'problem', None) or e}") from None
    cat = parse_catalog(data, resolved)
    cat.found = found
    return cat
